"""The acceptance job: a keyed running sum over 1,000,000 numbers at parallelism 2."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode, RestartStrategies
from rayflow.runtime.operators import slice_rows
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink

N = 1_000_000
KEYS = 1000


def expected_sums() -> dict[int, int]:
    values = np.arange(N, dtype=np.int64)
    sums = np.bincount(values % KEYS, weights=values, minlength=KEYS).astype(np.int64)
    return {k: int(sums[k]) for k in range(KEYS)}


def with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pa.array(batch.column("value").to_numpy() % KEYS))


def last_value_per_key(table: pa.Table, key: str, value: str) -> dict:
    out: dict = {}
    for k, v in zip(table.column(key).to_pylist(), table.column(value).to_pylist()):
        out[k] = v
    return out


def test_vectorized_sum_gives_exact_per_key_sums():
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    sink = CollectSink()
    (
        env.from_source(NumberSequenceSource(0, N - 1, batch_size=10_000), "numbers")
        .map_batches(with_key, name="with-key")
        .key_by("key")
        .sum("value")
        .sink_to(sink)
    )
    result = env.execute("keyed-sum")
    assert last_value_per_key(result.sink_result(sink), "key", "value") == expected_sums()
    assert result.records_in("numbers") == N


def test_per_record_reduce_gives_exact_per_key_sums():
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    sink = CollectSink()
    (
        env.from_source(NumberSequenceSource(0, N - 1, batch_size=10_000), "numbers")
        .map(lambda r: {"key": r["value"] % KEYS, "value": r["value"]}, name="with-key")
        .key_by(lambda r: r["key"])
        .reduce(lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]})
        .sink_to(sink)
    )
    result = env.execute("keyed-reduce")
    table = result.sink_result(sink)
    assert table.num_rows == N  # reduce emits one running value per input record
    assert last_value_per_key(table, "key", "value") == expected_sums()


def test_per_record_job_in_slices_is_exact_through_a_kill():
    """Sources' 1 MiB batches (131,072 rows) reach the map and the reduce whole, which
    take them a slice at a time; a reduce subtask killed mid-run restores and the committed
    output still holds every running value once."""
    n = 600_000
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(200, CheckpointingMode.EXACTLY_ONCE)
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 50))
    inject_faults(
        env,
        FaultPlan([Fault(FaultPoint.AFTER_RECORDS, vertex="Reduce", subtask=1, records=150_000)]),
    )
    sink = CollectSink()
    source = NumberSequenceSource(0, n - 1)
    assert source.batch_size > 2 * slice_rows(pa.record_batch({"key": [0], "value": [0]}))
    (
        env.from_source(source, "numbers")
        .map(lambda r: {"key": r["value"] % KEYS, "value": r["value"]}, name="with-key")
        .key_by("key")
        .reduce(lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]})
        .sink_to(sink)
    )
    result = env.execute("keyed-reduce-sliced")
    assert result.restarts >= 1
    table = result.sink_result(sink)
    assert table.num_rows == n
    values = np.arange(n, dtype=np.int64)
    sums = np.bincount(values % KEYS, weights=values, minlength=KEYS).astype(np.int64)
    assert last_value_per_key(table, "key", "value") == {k: int(sums[k]) for k in range(KEYS)}
