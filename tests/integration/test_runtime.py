"""The data plane on a real Ray: partitioners, chaining, map_batches, union, end of
input, keyed state, user errors and backpressure."""

from __future__ import annotations

import collections
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray

from rayflow import (
    JobFailedError,
    KeyedProcessFunction,
    ListStateDescriptor,
    MapStateDescriptor,
    NumberSequenceSource,
    ReducingStateDescriptor,
    RuntimeContext,
    StreamExecutionEnvironment,
    ValueStateDescriptor,
)
from rayflow.runtime.placement import job_placement_groups
from rayflow.sink import Sink, SinkContext, SinkWriter
from sinks.basic import CollectSink


def env(parallelism: int = 2) -> StreamExecutionEnvironment:
    return StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)


def tag_subtask(name: str):
    class Tag:
        def open(self, ctx: RuntimeContext) -> None:
            self.index = ctx.get_index_of_this_subtask()

        def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
            return batch.append_column(name, pa.array([self.index] * batch.num_rows))

    from rayflow.functions import Function

    return type("TagFn", (Tag, Function), {})()


def test_forward_keeps_each_subtasks_records_on_the_same_subtask():
    e = env(2).disable_operator_chaining()
    sink = CollectSink()
    (
        e.from_source(NumberSequenceSource(0, 999, batch_size=100))
        .map_batches(tag_subtask("src"))
        .forward()
        .map_batches(tag_subtask("dst"))
        .sink_to(sink)
    )
    table = e.execute().sink_result(sink)
    assert table.num_rows == 1000
    assert table.column("src").to_pylist() == table.column("dst").to_pylist()
    assert sorted(table.column("value").to_pylist()) == list(range(1000))


def test_rebalance_spreads_batches_over_all_targets():
    e = env(1)
    sink = CollectSink()
    (
        e.from_source(NumberSequenceSource(0, 999, batch_size=100))
        .rebalance()
        .map_batches(tag_subtask("dst"))
        .set_parallelism(3)
        .sink_to(sink)
        .set_parallelism(3)
    )
    table = e.execute().sink_result(sink)
    counts = collections.Counter(table.column("dst").to_pylist())
    assert counts == {0: 400, 1: 300, 2: 300}


def test_broadcast_delivers_every_record_to_every_subtask():
    e = env(1)
    sink = CollectSink()
    (
        e.from_source(NumberSequenceSource(0, 99, batch_size=10))
        .broadcast()
        .map_batches(tag_subtask("dst"))
        .set_parallelism(3)
        .sink_to(sink)
        .set_parallelism(3)
    )
    table = e.execute().sink_result(sink)
    per_subtask = collections.defaultdict(list)
    for dst, value in zip(table.column("dst").to_pylist(), table.column("value").to_pylist()):
        per_subtask[dst].append(value)
    assert {k: sorted(v) for k, v in per_subtask.items()} == {i: list(range(100)) for i in range(3)}


def test_hash_partitioning_puts_every_key_on_exactly_one_subtask():
    e = env(2)
    sink = CollectSink()
    (
        e.from_collection([{"word": w, "n": 1} for w in ["a", "b", "c", "d", "e"] * 200])
        .key_by("word")
        .map_batches(tag_subtask("dst"))
        .set_parallelism(3)
        .sink_to(sink)
        .set_parallelism(3)
    )
    table = e.execute().sink_result(sink)
    owners = collections.defaultdict(set)
    for word, dst in zip(table.column("word").to_pylist(), table.column("dst").to_pylist()):
        owners[word].add(dst)
    assert all(len(o) == 1 for o in owners.values())
    assert collections.Counter(table.column("word").to_pylist()) == {w: 200 for w in "abcde"}


def test_chained_per_record_and_batch_functions():
    e = env(2)
    sink = CollectSink()
    (
        e.from_source(NumberSequenceSource(1, 1000, batch_size=64))
        .filter(lambda r: r["value"] % 2 == 0)
        .map(lambda r: {"value": r["value"], "square": r["value"] ** 2})
        .flat_map(lambda r: [r, {"value": -r["value"], "square": 0}] if r["value"] <= 10 else [r])
        .map_batches(lambda b: b.append_column("double", pc.multiply(b.column("value"), 2)))
        .sink_to(sink)
    )
    result = e.execute()
    assert "Filter -> Map -> FlatMap -> MapBatches -> CollectSink" in e.explain()
    table = result.sink_result(sink)
    values = sorted(table.column("value").to_pylist())
    assert values == sorted([v for v in range(2, 1001, 2)] + [-2, -4, -6, -8, -10])
    rows = {r["value"]: r for r in table.to_pylist()}
    assert rows[500]["square"] == 250000 and rows[500]["double"] == 1000


def test_union_and_end_of_input_with_several_sources():
    e = env(2)
    sink = CollectSink()
    a = e.from_source(NumberSequenceSource(0, 4999, batch_size=500), "a")
    b = e.from_source(NumberSequenceSource(10_000, 10_099, batch_size=7), "b").set_parallelism(1)
    c = e.from_collection([{"value": -1}, {"value": -2}], "c")
    a.union(b, c).key_by("value").map_batches(lambda x: x).sink_to(sink)
    table = e.execute("union").sink_result(sink)
    expected = list(range(5000)) + list(range(10_000, 10_100)) + [-1, -2]
    assert sorted(table.column("value").to_pylist()) == sorted(expected)


class EveryStateType(KeyedProcessFunction):
    def open(self, ctx: RuntimeContext) -> None:
        self.count = ctx.get_state(ValueStateDescriptor("count", default=0))
        self.history = ctx.get_list_state(ListStateDescriptor("history"))
        self.seen = ctx.get_map_state(MapStateDescriptor("seen"))
        self.total = ctx.get_reducing_state(ReducingStateDescriptor("total", lambda a, b: a + b))

    def process_element(self, value, ctx):
        self.count.update(self.count.value() + 1)
        self.history.add(value["v"])
        self.seen.put(value["v"] % 3, self.seen.get(value["v"] % 3, 0) + 1)
        self.total.add(value["v"])
        if self.count.value() == 4:
            yield {
                "key": ctx.get_current_key(),
                "count": self.count.value(),
                "history": sorted(self.history.get()),
                "seen": sorted(self.seen.items()),
                "total": self.total.get(),
            }


def test_every_keyed_state_type_is_scoped_per_key():
    records = [{"k": f"key-{i % 5}", "v": i} for i in range(20)]
    e = env(2)
    sink = CollectSink()
    e.from_collection(records).key_by("k").process(EveryStateType()).sink_to(sink)
    rows = {r["key"]: r for r in e.execute().sink_result(sink).to_pylist()}
    assert sorted(rows) == [f"key-{i}" for i in range(5)]
    for i in range(5):
        values = [i, i + 5, i + 10, i + 15]
        row = rows[f"key-{i}"]
        assert row["count"] == 4
        assert row["history"] == values
        assert row["total"] == sum(values)
        expected_seen = collections.Counter(v % 3 for v in values)
        assert row["seen"] == [
            {"key": k, "value": v} for k, v in sorted(expected_seen.items())
        ] or row["seen"] == [[k, v] for k, v in sorted(expected_seen.items())]


def test_builtin_count_min_max():
    records = [{"k": i % 3, "v": (i * 37) % 101} for i in range(300)]
    results = {}
    for agg in ("count", "min", "max"):
        e = env(2)
        sink = CollectSink()
        keyed = e.from_collection(records).key_by("k")
        (keyed.count() if agg == "count" else getattr(keyed, agg)("v")).sink_to(sink)
        table = e.execute().sink_result(sink)
        column = "count" if agg == "count" else "v"
        results[agg] = dict(zip(table.column("k").to_pylist(), table.column(column).to_pylist()))
    for k in range(3):
        vs = [r["v"] for r in records if r["k"] == k]
        assert results["count"][k] == len(vs)
        assert results["min"][k] == min(vs)
        assert results["max"][k] == max(vs)


def test_user_exception_names_operator_and_subtask_and_leaves_no_actor():
    def explode(record):
        if record["value"] == 777:
            raise ZeroDivisionError("boom at 777")
        return record

    e = env(2)
    e.from_source(NumberSequenceSource(0, 999, batch_size=50)).map(
        explode, name="exploder"
    ).sink_to(CollectSink())
    client = e.execute_async("failing")
    with pytest.raises(JobFailedError) as info:
        client.wait()
    message = str(info.value)
    assert "'exploder'" in message and "subtask 2/2" in message
    assert "ZeroDivisionError: boom at 777" in message
    assert "in explode" in message  # the original traceback
    deadline = time.time() + 20
    while (
        _live_actors_of(client.job_id) or job_placement_groups(client.job_id)
    ) and time.time() < deadline:
        time.sleep(0.2)
    assert _live_actors_of(client.job_id) == []
    assert job_placement_groups(client.job_id) == {}


def _live_actors_of(job_id: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"rayflow:{job_id}:")
    ]


class _SlowWriter(SinkWriter):
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        time.sleep(self.delay)
        self.rows += batch.num_rows

    def finish(self):
        return self.rows


class SlowSink(Sink):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _SlowWriter(self.delay)

    def merge_results(self, results):
        return sum(results)


def test_slow_sink_keeps_batches_in_flight_bounded():
    capacity, window, batch_rows, batches = 2, 2, 100, 300
    e = env(1).disable_operator_chaining().set_buffer_limits(capacity, window)
    sink = SlowSink(0.01)
    e.from_source(
        NumberSequenceSource(0, batches * batch_rows - 1, batch_size=batch_rows)
    ).map_batches(lambda b: b, name="relay").sink_to(sink, name="slow")
    client = e.execute_async("backpressure")
    # Batches between the source's count of records out and the sink's count of records
    # in, at most: in each output buffer fewer than `window` (it sends at `window`); per
    # channel `window` pushed and not yet admitted plus `capacity` admitted and not yet
    # taken; in the relay's hands one message (a bundle of at most `window`); in the
    # sink's hands the rest of a bundle it is counting item by item (`window` - 1).
    bound_rows = (6 * window + 2 * capacity - 3) * batch_rows
    gaps = []
    named: set[str] = set()

    def vertices() -> dict:
        return {m["vertex"]: m for m in client.metrics()}

    while client.get_job_status() in ("CREATED", "RUNNING"):
        named |= {n for n in _live_actors_of(client.job_id) if ":v" in n}
        # The source's count first, the sink's in a later call: the two reads are not one
        # instant, and this order can only make a gap look smaller, never bigger.
        first, second = vertices(), vertices()
        if len(first) == 3 and len(second) == 3:
            source_out = first["Source"]["records_out"]
            sink_in = second["slow"]["records_in"]
            gaps.append(source_out - sink_in)
            assert second["relay"]["max_buffered"] <= capacity
            assert second["Source"]["max_in_flight"] <= window
        time.sleep(0.05)
    result = client.wait()
    assert len(named) == 3, "every subtask actor is named after its job"
    assert _live_actors_of(client.job_id) == []
    assert result.sink_result("slow") == batches * batch_rows
    assert len(gaps) > 10, "the job should run long enough to be observed"
    assert max(gaps) <= bound_rows
    assert max(gaps) >= batch_rows, "the slow sink should hold the source back"


def test_collect_sinks_of_one_process_share_a_collector_and_keep_their_rows_apart():
    """One collector actor stands for the outside world of every CollectSink this
    process sets up: each sink reads back only its own rows (at-least-once appends and
    exactly-once transactions alike), and a sink's rows go once the sink is collected."""
    import gc

    from rayflow import DeliveryGuarantee

    def run(values, guarantee):
        e = env(1).enable_checkpointing(60_000)
        sink = CollectSink(guarantee)
        e.from_collection([{"v": v} for v in values]).sink_to(sink)
        return sink, e.execute().sink_result(sink)

    a, rows_a = run([1, 2], DeliveryGuarantee.EXACTLY_ONCE)
    b, rows_b = run([3], DeliveryGuarantee.AT_LEAST_ONCE)
    assert a._collector._actor_id == b._collector._actor_id
    assert rows_a.column("v").to_pylist() == [1, 2]
    assert rows_b.column("v").to_pylist() == [3]
    collector, sink_id = a._collector, a._sink_id
    assert ray.get(collector.contents.remote(sink_id))["transactions"]
    del a, rows_a
    gc.collect()
    deadline = time.time() + 30
    while ray.get(collector.contents.remote(sink_id))["transactions"]:
        assert time.time() < deadline, "a collected sink's rows stayed in the collector"
        time.sleep(0.1)
    assert ray.get(collector.contents.remote(b._sink_id))["transactions"], "b's rows went too"


def _collect_run(sink: CollectSink, values: list[int]) -> list[int]:
    from rayflow import RestartStrategies

    e = env(1).enable_checkpointing(60_000).set_restart_strategy(RestartStrategies.no_restart())
    e.from_collection([{"v": v} for v in values]).sink_to(sink)
    return e.execute().sink_result(sink).column("v").to_pylist()


def test_copies_of_a_collect_sink_made_before_their_jobs_keep_their_rows_apart():
    """A sink built once and copied for each job (copy, deepcopy or a pickle round trip,
    before any job set it up) gives each copy its own rows, as separate sinks do."""
    import copy
    import pickle

    template = CollectSink()
    a, b, c = copy.copy(template), copy.deepcopy(template), pickle.loads(pickle.dumps(template))
    assert _collect_run(a, [1, 2]) == [1, 2]
    assert _collect_run(b, [3]) == [3]
    assert _collect_run(c, [4]) == [4]


def test_a_lost_collector_does_not_take_the_later_collect_sinks_with_it():
    """The collector stands for the outside world of one sink's run; once it is gone
    (killed, or its process died), a sink set up afterwards gets a collector that lives."""
    first = CollectSink()
    assert _collect_run(first, [1]) == [1]
    ray.kill(first._collector, no_restart=True)
    second = CollectSink()
    assert _collect_run(second, [2]) == [2]


def test_a_collected_sink_leaves_the_rows_of_a_copy_made_after_its_setup():
    """A copy of a sink that was set up writes to the same rows (as the subtasks' copies
    do); collecting the original in this process leaves them to the copy still in use."""
    import copy
    import gc

    from sinks.basic import _to_ipc

    original = CollectSink()
    original.setup("job")
    twin = copy.copy(original)
    twin.commit(("t0", 0, 0, _to_ipc([pa.record_batch({"v": [7]})])))
    del original
    gc.collect()
    assert twin.merge_results([]).column("v").to_pylist() == [7]


def test_a_late_commit_for_a_collected_sink_is_not_kept():
    """Once a sink is collected, a commit still on its way for it (a subtask of an
    earlier attempt, say) does not leave rows in the long-lived shared collector."""
    import gc

    from sinks.basic import _to_ipc

    sink = CollectSink()
    sink.setup("job")
    collector, sink_id = sink._collector, sink._sink_id
    late = ("t0", 0, 0, _to_ipc([pa.record_batch({"v": [7]})]))
    del sink
    gc.collect()
    ray.get(collector.commit.remote(sink_id, *late))  # after the release: calls keep order
    assert ray.get(collector.contents.remote(sink_id))["transactions"] == []


def test_a_collect_sink_run_again_under_the_same_job_name_keeps_the_rerun_rows():
    """One sink object used for two fresh runs of the same job name (a rerun, not a
    restore) is one outside world holding both runs' rows: the rerun's transactions are
    not taken for the first run's, so none of its rows is dropped as committed before."""
    from rayflow import DeliveryGuarantee

    sink = CollectSink(DeliveryGuarantee.EXACTLY_ONCE)
    assert _collect_run(sink, [1, 2]) == [1, 2]
    assert sorted(_collect_run(sink, [3])) == [1, 2, 3]


_RERUN_AFTER_RAY_REINIT = """
import ray
from rayflow import RestartStrategies, StreamExecutionEnvironment
from sinks.basic import CollectSink


def run(sink, values):
    e = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    e.enable_checkpointing(60_000).set_restart_strategy(RestartStrategies.no_restart())
    e.from_collection([{"v": v} for v in values]).sink_to(sink)
    return e.execute().sink_result(sink).column("v").to_pylist()


sink = CollectSink()
ray.init(address="local", include_dashboard=False, logging_level="WARNING", num_cpus=2)
assert run(sink, [1]) == [1]
ray.shutdown()
ray.init(address="local", include_dashboard=False, logging_level="WARNING", num_cpus=2)
print("rerun:", run(sink, [2]))
ray.shutdown()
"""


def test_a_collect_sink_runs_again_after_ray_is_started_anew_in_the_process(tmp_path):
    """A driver that shuts Ray down and starts it again (a new cluster) and runs a job
    with a sink of an earlier job: the sink gets a collector of the new cluster, not the
    handle of one that went with the old (whose use takes the process down)."""
    from tests.integration.drivers import run_driver

    done = run_driver(tmp_path, "rerun.py", _RERUN_AFTER_RAY_REINIT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rerun: [2]" in done.stdout
