"""The chaos harness: the keyed running-sum job, its exact expected output, and checks
of what a sink committed against it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import CheckpointAlignment, CheckpointingMode, RestartStrategies
from rayflow.testing import FaultPlan, inject_faults
from sinks.basic import CollectSink

KEYS = 1000


def with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pa.array(batch.column("value").to_numpy() % KEYS))


class HotKeyDelay:
    """Sleeps ``seconds`` per batch that holds key 0: the subtask owning it is slow."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self.seconds and (batch.column("key").to_numpy() == 0).any():
            time.sleep(self.seconds)
        return batch


def expected_sums(n: int) -> dict[int, int]:
    values = np.arange(n, dtype=np.int64)
    sums = np.bincount(values % KEYS, weights=values, minlength=KEYS).astype(np.int64)
    return {k: int(sums[k]) for k in range(min(KEYS, n))}


@dataclass
class Outcome:
    result: object
    table: pa.Table
    sums: dict[int, int]
    rows: int


def build_keyed_sum(
    n: int,
    parallelism: int = 2,
    batch_size: int = 5000,
    rate: float | None = 500_000,
    checkpoint_ms: int | None = 300,
    mode: CheckpointingMode = CheckpointingMode.EXACTLY_ONCE,
    sink: CollectSink | None = None,
    storage: str | None = None,
    restart_delay_ms: int = 50,
    plan: FaultPlan | None = None,
    alignment: CheckpointAlignment = CheckpointAlignment.ALIGNED,
    alignment_timeout_ms: int = 50,
    hot_delay_s: float = 0.0,
    buffer_timeout_ms: int | None = None,
) -> tuple[StreamExecutionEnvironment, CollectSink]:
    """The keyed running sum. ``alignment`` picks aligned, unaligned or aligned-with-
    timeout checkpoints; ``hot_delay_s`` makes the sum subtask that owns key 0 sleep that
    long per batch, so its input channels back up (skew, real backpressure);
    ``buffer_timeout_ms`` sets the output buffer timeout (None: the default)."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    if buffer_timeout_ms is not None:
        env.set_buffer_timeout(buffer_timeout_ms)
    if checkpoint_ms is not None:
        env.enable_checkpointing(checkpoint_ms, mode)
        config = env.get_checkpoint_config()
        if storage is not None:
            config.set_checkpoint_storage(storage)
        if alignment is CheckpointAlignment.UNALIGNED:
            config.enable_unaligned_checkpoints()
        elif alignment is CheckpointAlignment.ALIGNED_WITH_TIMEOUT:
            config.set_aligned_checkpoint_timeout(alignment_timeout_ms)
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(10, restart_delay_ms))
    if plan is not None:
        inject_faults(env, plan)
    sink = sink or CollectSink()
    (
        env.from_source(
            NumberSequenceSource(0, n - 1, batch_size=batch_size, records_per_second=rate),
            "numbers",
        )
        .uid("numbers")
        .map_batches(with_key, name="with-key")
        .key_by("key")
        .sum("value")
        .uid("running-sum")
        .map_batches(HotKeyDelay(hot_delay_s), name="hot-key")
        .sink_to(sink, name="committed")
        .uid("committed")
    )
    return env, sink


def outcome(result, sink: CollectSink) -> Outcome:
    table = result.sink_result(sink)
    sums: dict[int, int] = {}
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist()):
        sums[key] = value
    return Outcome(result, table, sums, table.num_rows)


def expected_rows(n: int, parallelism: int, batch_size: int) -> int:
    """Rows the mini-batch sum emits: one per key per (source batch, target) sub-batch."""
    splits = [(n * i // parallelism, n * (i + 1) // parallelism) for i in range(parallelism)]
    rows = 0
    for lo, hi in splits:
        for start in range(lo, hi, batch_size):
            stop = min(hi, start + batch_size)
            rows += len({v % KEYS for v in range(start, min(stop, start + KEYS))})
    return rows


def unique_job(name: str) -> str:
    return f"{name}-{time.time_ns()}"
