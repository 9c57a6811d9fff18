"""The event-time window chaos job: a tumbling 1 s event-time window sum per key over
out-of-order input with some very late records, its exact expected output computed
directly, and checks of what the sinks committed.

Records are ``{k, t, v}``; ``t`` runs ahead by 2 ms a record with up to ``DISORDER`` ms
of disorder, which the watermark strategy allows for, so no such record is late. Every
``LATE_EVERY``-th record (from the ``LATE_FROM``-th on) is instead ``LATE_BY`` ms old:
its window closed long before it arrives whatever the batching (the source reads 100
records a batch and generates a watermark after each), so it goes to the late side
output. The source runs at parallelism 1 (one split), so the watermark a window subtask
has at each record is the same in every run, before and after a restore.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from rayflow import StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.eventtime import Duration, WatermarkStrategy
from rayflow.outputs import OutputTag
from rayflow.sources import CollectionSource
from rayflow.testing import FaultPlan, inject_faults
from rayflow.windowing import TumblingEventTimeWindows
from sinks.basic import CollectSink

KEYS = 50
WINDOW_MS = 1000
DISORDER = 200
LATE_EVERY = 97
LATE_FROM = 3000
LATE_BY = 5000
BATCH = 100
LATE = OutputTag("late")


def make_records(n: int, seed: int = 0) -> pa.Table:
    rng = random.Random(seed)
    ks, ts, vs = [], [], []
    for i in range(n):
        t = 2 * i + rng.randrange(DISORDER)
        if i >= LATE_FROM and i % LATE_EVERY == 0:
            t = 2 * i - LATE_BY
        ks.append(i % KEYS)
        ts.append(t)
        vs.append(rng.randrange(1000))
    return pa.table({"k": ks, "t": ts, "v": vs})


def is_late(i: int) -> bool:
    return i >= LATE_FROM and i % LATE_EVERY == 0


def expected(table: pa.Table) -> tuple[dict[tuple[int, int], int], Counter]:
    """Window sums ``(key, window start) -> sum`` of the on-time records, and the late
    records (as ``(k, t, v)``) counted."""
    sums: dict[tuple[int, int], int] = {}
    late: Counter = Counter()
    rows = zip(*(table.column(c).to_pylist() for c in ("k", "t", "v")))
    for i, (k, t, v) in enumerate(rows):
        if is_late(i):
            late[(k, t, v)] += 1
            continue
        start = t - t % WINDOW_MS
        sums[(k, start)] = sums.get((k, start), 0) + v
    return sums, late


def build(
    table: pa.Table,
    parallelism: int,
    storage: str,
    plan: FaultPlan | None = None,
    rate: float | None = None,
    sinks: tuple[CollectSink, CollectSink] | None = None,
    checkpoint_ms: int = 100,
    unaligned: bool = False,
) -> tuple[StreamExecutionEnvironment, CollectSink, CollectSink]:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    env.enable_checkpointing(checkpoint_ms)
    env.get_checkpoint_config().set_checkpoint_storage(storage)
    if unaligned:
        env.get_checkpoint_config().enable_unaligned_checkpoints()
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(10, 50))
    if plan is not None:
        inject_faults(env, plan)
    sums_sink, late_sink = sinks or (CollectSink(), CollectSink())
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_millis(DISORDER)
    ).with_timestamp_assigner("t")
    source = CollectionSource(table, batch_size=BATCH)
    if rate is not None:
        source = _RateLimited(source, rate)
    windowed = (
        env.from_source(source, strategy, "events")
        .set_parallelism(1)
        .uid("events")
        .key_by("k")
        .window(TumblingEventTimeWindows.of(Duration.of_millis(WINDOW_MS)))
        .side_output_late_data(LATE)
        .sum("v", name="window-sum")
        .uid("window-sum")
    )
    windowed.sink_to(sums_sink, "sums").uid("sums")
    windowed.get_side_output(LATE).sink_to(late_sink, "late").uid("late")
    return env, sums_sink, late_sink


class _RateLimited(CollectionSource):
    """A collection source read at ``rate`` records per second (per subtask)."""

    def __init__(self, source: CollectionSource, rate: float) -> None:
        self.__dict__.update(source.__dict__)
        self.records_per_second = rate


@dataclass
class WindowOutcome:
    sums: dict[tuple[int, int], int]
    windows_emitted: Counter
    late: Counter


def outcome(result, sums_sink: CollectSink, late_sink: CollectSink) -> WindowOutcome:
    table = result.sink_result(sums_sink)
    sums: dict[tuple[int, int], int] = {}
    emitted: Counter = Counter()
    columns = ("k", "window_start", "window_end", "v")
    # a run that fired no window (stopped before its first) collected no batch, so no schema
    rows = zip(*(table.column(c).to_pylist() for c in columns)) if table.num_rows else ()
    for k, start, end, v in rows:
        assert end - start == WINDOW_MS
        sums[(k, start)] = v
        emitted[(k, start)] += 1
    late_table = result.sink_result(late_sink)
    late: Counter = Counter()
    if late_table.num_rows:
        late = Counter(zip(*(late_table.column(c).to_pylist() for c in ("k", "t", "v"))))
    return WindowOutcome(sums, emitted, late)


def unique_job(name: str) -> str:
    return f"{name}-{time.time_ns()}"
