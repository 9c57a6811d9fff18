"""Logical -> physical plan: chaining rules, union dissolution, partitioner defaults."""

import pickle

import numpy as np
import pyarrow as pa
import pytest

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.keygroups import key_group_of, subtask_of_key_group
from rayflow.plan.partitioners import KeySelector, Partitioner, PartitionerSpec, PartitionKind
from rayflow.plan.physical import PlanError
from sinks.basic import CollectSink


def env(p=2):
    return StreamExecutionEnvironment.get_execution_environment().set_parallelism(p)


def test_forward_edges_of_equal_parallelism_chain_into_one_vertex():
    e = env()
    e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r).filter(bool).sink_to(CollectSink())
    graph = e.get_job_graph()
    assert len(graph.vertices) == 1
    assert [op.name for op in graph.vertices[0].operators] == ["Map", "Filter", "CollectSink"]


def test_key_by_and_parallelism_change_break_chains():
    e = env()
    s = e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r)
    s.key_by("value").sum("value").set_parallelism(3).map(lambda r: r).sink_to(CollectSink())
    graph = e.get_job_graph()
    assert len(graph.vertices) == 3
    kinds = [graph.edges[i].partitioner.kind for i in sorted(graph.edges)]
    assert kinds == [PartitionKind.HASH, PartitionKind.REBALANCE]


def test_disable_chaining_gives_one_vertex_per_operator():
    e = env().disable_operator_chaining()
    e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r).sink_to(CollectSink())
    assert len(e.get_job_graph().vertices) == 3


def test_union_is_dissolved_into_edges():
    e = env()
    a = e.from_source(NumberSequenceSource(0, 9), "a")
    b = e.from_source(NumberSequenceSource(10, 19), "b").set_parallelism(1)
    a.union(b).map(lambda r: r).sink_to(CollectSink())
    graph = e.get_job_graph()
    target = [v for v in graph.vertices.values() if v.name.startswith("Map")][0]
    assert len(target.in_edges) == 2
    # a (p=2) -> Map (p=2) is forward: 1 channel; b (p=1) -> rebalance: 1 channel
    assert len(graph.input_channels(target.vertex_id, 0)) == 2


def test_explicit_forward_between_different_parallelism_is_an_error():
    e = env()
    e.from_source(NumberSequenceSource(0, 9)).forward().map(lambda r: r).set_parallelism(3).sink_to(
        CollectSink()
    )
    with pytest.raises(PlanError, match="forward edge"):
        e.get_job_graph()


def test_dangling_operator_is_an_error():
    e = env()
    e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r, name="lonely")
    with pytest.raises(PlanError, match="lonely"):
        e.get_job_graph()


def test_hash_partitioner_routes_each_key_to_its_key_group_owner():
    batch = pa.RecordBatch.from_pydict({"k": list(range(100)) * 3, "v": list(range(300))})
    p = Partitioner(PartitionerSpec(PartitionKind.HASH, KeySelector("k")), 0, 3, 128)
    routed = p.route(batch)
    assert sum(b.num_rows for _, b in routed) == 300
    owner = {}
    for target, part in routed:
        for key in part.column("k").to_pylist():
            assert owner.setdefault(key, target) == target
    assert len({t for t, _ in routed}) == 3


@pytest.mark.parametrize("targets", [2, 3, 4, 5, 16, 128])
@pytest.mark.parametrize("max_parallelism", [128, 100])
def test_hash_partitioner_keeps_each_targets_rows_in_order(targets, max_parallelism):
    keys = [(i * 7919) % 1013 - 300 for i in range(3000)]
    batch = pa.RecordBatch.from_pydict({"k": keys, "i": list(range(3000))})
    p = Partitioner(
        PartitionerSpec(PartitionKind.HASH, KeySelector("k")), 0, targets, max_parallelism
    )
    expected: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        target = subtask_of_key_group(key_group_of(k, max_parallelism), targets, max_parallelism)
        expected.setdefault(target, []).append(i)
    routed = p.route(batch)
    assert [t for t, _ in routed] == sorted(expected)
    assert {t: part.column("i").to_pylist() for t, part in routed} == expected


def test_rebalance_round_robins_and_broadcast_copies():
    batch = pa.RecordBatch.from_pydict({"v": [1, 2]})
    rebalance = Partitioner(PartitionerSpec(PartitionKind.REBALANCE), 1, 3, 128)
    assert [rebalance.route(batch)[0][0] for _ in range(4)] == [1, 2, 0, 1]
    broadcast = Partitioner(PartitionerSpec(PartitionKind.BROADCAST), 0, 3, 128)
    assert [t for t, _ in broadcast.route(batch)] == [0, 1, 2]


def test_hash_routed_parts_serialize_only_their_own_rows():
    # A slice pickles (and goes through Ray and into channel state) with its parent's
    # whole buffers: each part must carry only its rows.
    batch = pa.record_batch({"k": np.arange(40_000) % 97, "v": np.arange(40_000)})
    p = Partitioner(PartitionerSpec(PartitionKind.HASH, KeySelector("k")), 0, 4, 128)
    parts = p.route(batch)
    whole = len(pickle.dumps(batch))
    assert sum(part.num_rows for _, part in parts) == batch.num_rows
    assert sum(len(pickle.dumps(part)) for _, part in parts) < 1.2 * whole


def test_two_operators_with_one_uid_are_an_error():
    """Two sinks given the same uid (two PostgresSinks into one table, say) would share
    their transaction names (job, uid, subtask): one sink's recovery or end-of-input
    sweep rolls back what the other prepared for a completed checkpoint, and those rows
    are lost. Their state would share a name in checkpoints too. The plan refuses."""
    e = env()
    numbers = e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r)
    numbers.sink_to(CollectSink(), name="first").uid("orders-table")
    numbers.sink_to(CollectSink(), name="second").uid("orders-table")
    with pytest.raises(PlanError, match="'orders-table'.*'first'.*'second'"):
        e.get_job_graph()


def test_a_uid_that_names_another_operator_by_default_is_an_error():
    """An operator's default uid is ``<kind>-<id>``: a uid given by hand may be the same."""
    e = env()
    stream = e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r, name="m")
    stream.sink_to(CollectSink(), name="s1")
    first = e.get_job_graph()
    [taken] = [op.uid for v in first.vertices.values() for op in v.operators if op.name == "m"]
    stream.sink_to(CollectSink(), name="s2").uid(taken)
    with pytest.raises(PlanError, match="uid"):
        e.get_job_graph()


def _with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pa.array(np.asarray(batch.column("value")) % 3))


def test_a_stream_with_several_consumers_keeps_its_first_chainable_one_in_its_chain():
    """As in Flink, an operator whose output is also keyed elsewhere still chains its
    forward consumer; the keyed edge leaves the chain at that operator, not at its end."""
    e = env()
    keyed = e.from_source(NumberSequenceSource(0, 9), "numbers").map_batches(_with_key, "with-key")
    keyed.sink_to(CollectSink(), "raw")
    keyed.key_by("key").sum("value").sink_to(CollectSink(), "sums")
    graph = e.get_job_graph()
    assert [[op.name for op in v.operators] for v in graph.vertices.values()] == [
        ["with-key", "raw"],
        ["Sum", "sums"],
    ]
    (edge,) = graph.edges.values()
    assert edge.partitioner.kind is PartitionKind.HASH
    assert graph.output_position(edge.edge_id) == 0  # with-key's output, not raw's
    assert "--HASH('key')--> [1] Sum -> sums (from with-key)" in graph.explain()


def test_a_source_with_several_consumers_sends_from_the_source_itself():
    e = env()
    numbers = e.from_source(NumberSequenceSource(0, 9), "numbers")
    numbers.sink_to(CollectSink(), "raw")
    numbers.map(lambda r: r, name="copy").sink_to(CollectSink(), "copies")
    graph = e.get_job_graph()
    assert [v.name for v in graph.vertices.values()] == ["numbers -> raw", "copy -> copies"]
    (edge,) = graph.edges.values()
    assert edge.partitioner.kind is PartitionKind.FORWARD
    assert graph.output_position(edge.edge_id) == -1
    assert "(from numbers)" in graph.explain()


def test_only_one_consumer_continues_a_chain_and_edges_of_the_end_say_nothing_more():
    e = env()
    mapped = e.from_source(NumberSequenceSource(0, 9), "numbers").map(lambda r: r, name="m")
    mapped.sink_to(CollectSink(), "first")
    mapped.sink_to(CollectSink(), "second")
    graph = e.get_job_graph()
    assert [v.name for v in graph.vertices.values()] == ["numbers -> m -> first", "second"]
    (edge,) = graph.edges.values()
    assert graph.output_position(edge.edge_id) == 0
    # an edge from the chain's last operator reads as before
    e2 = env()
    e2.from_source(NumberSequenceSource(0, 9)).key_by("value").sum("value").sink_to(CollectSink())
    assert "(from" not in e2.get_job_graph().explain()


def test_a_field_missing_from_a_stream_that_also_feeds_a_chained_sink_is_named_at_build():
    """The keyed edge carries the source's own records even though a sink is chained after
    the source: the sum's field is still checked against the source's columns."""
    e = env()
    numbers = e.from_source(NumberSequenceSource(0, 9), "numbers")
    numbers.sink_to(CollectSink(), "raw")
    numbers.key_by("value").sum("vlaue").sink_to(CollectSink(), "sums")
    with pytest.raises(KeyError, match=r"sum\('vlaue'\): no such column"):
        e.get_job_graph()


def test_a_sink_that_disables_chaining_runs_in_subtasks_of_its_own():
    e = env()
    keyed = e.from_source(NumberSequenceSource(0, 9), "numbers").map_batches(_with_key, "with-key")
    keyed.sink_to(CollectSink(), "raw").disable_chaining()
    keyed.key_by("key").sum("value").sink_to(CollectSink(), "sums")
    graph = e.get_job_graph()
    assert [v.name for v in graph.vertices.values()] == [
        "numbers -> with-key",
        "raw",
        "Sum -> sums",
    ]
    assert "(from" not in graph.explain()


def test_start_new_chain_rebuilds_the_chains_a_stream_with_several_consumers_had():
    """Before a stream with several consumers chained one of them, ``M`` ended its vertex:
    ``start_new_chain()`` on the consumer builds those vertices again (what an unaligned
    checkpoint of the earlier graph needs), with the operators after it still chained."""

    def build(new_chain: bool):
        e = env()
        m = e.from_source(NumberSequenceSource(0, 9), "numbers").map(lambda r: r, name="M")
        n = m.map(lambda r: r, name="N")
        if new_chain:
            n = n.start_new_chain()
        n.map(lambda r: r, name="N2").sink_to(CollectSink(), "out")
        m.key_by("value").sum("value").sink_to(CollectSink(), "sums")
        return [[op.name for op in v.operators] for v in e.get_job_graph().vertices.values()]

    assert build(False) == [["M", "N", "N2", "out"], ["Sum", "sums"]]
    assert build(True) == [["M"], ["N", "N2", "out"], ["Sum", "sums"]]
