"""The acceptance job: a keyed running sum over 1,000,000 numbers at parallelism 2."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
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
