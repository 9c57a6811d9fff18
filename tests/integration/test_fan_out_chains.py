"""A stream with several consumers on a real Ray: the first chainable consumer stays in
the producer's chain (as in Flink) and the other edges leave the chain at the producer,
midway. Every consumer gets every record once, through a kill, with exactly-once sinks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode, RestartStrategies
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink

KEYS = 7


def _with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pc.remainder(batch.column("value"), KEYS))


def test_edges_leaving_a_chain_midway_are_exactly_once_through_a_kill():
    n = 300_000
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(200, CheckpointingMode.EXACTLY_ONCE)
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 50))
    env.set_latency_tracking_interval(10)
    inject_faults(
        env,
        FaultPlan([Fault(FaultPoint.AFTER_RECORDS, vertex="Sum", subtask=1, records=40_000)]),
    )
    raw, sums, plain = CollectSink(), CollectSink(), CollectSink()
    numbers = env.from_source(NumberSequenceSource(0, n - 1, batch_size=5_000), "numbers")
    keyed = numbers.map_batches(_with_key, "with-key")
    keyed.sink_to(raw, "raw")  # chained: with-key -> raw
    summed = keyed.key_by("key").sum("value")  # leaves after with-key
    summed.sink_to(sums, "sums")  # chained: Sum -> sums
    copies = CollectSink()
    summed.sink_to(copies, "copies")  # leaves after Sum
    numbers.sink_to(plain, "plain")  # leaves after the source
    graph = env.get_job_graph()
    assert [v.name for v in graph.vertices.values()] == [
        "numbers -> with-key -> raw",
        "Sum -> sums",
        "copies",
        "plain",
    ]
    result = env.execute("fan-out-chains")
    assert result.restarts >= 1
    values = np.arange(n, dtype=np.int64)
    for sink, columns in ((raw, ["value", "key"]), (plain, ["value"])):
        committed = result.sink_result(sink)
        assert committed.column_names == columns  # what its operator emitted, not another's
        assert np.array_equal(np.sort(committed.column("value").to_numpy()), values)
    table = result.sink_result(sums)  # running sums per key, each batch's last
    expected = np.bincount(values % KEYS, weights=values, minlength=KEYS).astype(np.int64)
    per_key = table.group_by("key").aggregate([("value", "max")]).to_pylist()
    assert {r["key"]: r["value_max"] for r in per_key} == {k: int(expected[k]) for k in range(KEYS)}
    order = [("key", "ascending"), ("value", "ascending")]
    assert result.sink_result(copies).sort_by(order).equals(table.sort_by(order))
    # a chain that holds a sink records the age of the latency markers it also sends on,
    # except where markers start (its source's: every age would be about 0)
    recorded = {
        (m["vertex"], m["subtask"]): m["latency"]["count"]
        for m in result.metrics
        if m["attempt"] == max(x["attempt"] for x in result.metrics)
    }
    for i in range(2):
        assert recorded[("Sum -> sums", i)] > 0, recorded
        assert recorded[("copies", i)] > 0, recorded
        assert recorded[("numbers -> with-key -> raw", i)] == 0, recorded
