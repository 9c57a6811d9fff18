"""Running a job in process, without Ray: the real operators, partitioners and key groups,
every subtask with its own copy of the functions, sinks run as on Ray."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest
import ray

from rayflow import (
    KeyedProcessFunction,
    MapFunction,
    NumberSequenceSource,
    RuntimeContext,
    SinkContext,
    StreamExecutionEnvironment,
    TwoPhaseCommittingSink,
    ValueStateDescriptor,
)
from rayflow.errors import RecordError
from rayflow.keygroups import key_group_of
from rayflow.sink import CommitOutcome, CommittableSerializer, Committer, TransactionWriter
from rayflow.testing import run_in_process
from sinks.basic import CollectSink


def env(parallelism: int = 2) -> StreamExecutionEnvironment:
    return StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)


def test_a_keyed_job_runs_without_ray():
    started = ray.is_initialized()
    e = env()
    e.from_source(NumberSequenceSource(0, 99, batch_size=7)).filter(lambda r: r["value"] % 3).map(
        lambda r: {"k": r["value"] % 5, "v": r["value"]}
    ).key_by("k").reduce(lambda a, b: {"k": a["k"], "v": a["v"] + b["v"]})
    records = run_in_process(e).records
    assert ray.is_initialized() == started  # no Ray started
    kept = [v for v in range(100) if v % 3]
    assert len(records) == len(kept)
    finals: dict[int, int] = {}
    for r in records:
        finals[r["k"]] = max(finals.get(r["k"], 0), r["v"])
    assert finals == {k: sum(v for v in kept if v % 5 == k) for k in range(5)}


class Where(MapFunction):
    """Tags records with the subtask that saw them; counts its own records."""

    def open(self, runtime_context: RuntimeContext) -> None:
        self.index = runtime_context.get_index_of_this_subtask()
        self.parallelism = runtime_context.get_number_of_parallel_subtasks()
        self.seen = 0

    def map(self, value: dict) -> dict:
        self.seen += 1
        return {**value, "subtask": self.index, "seen": self.seen}


def test_each_subtask_has_its_own_function_and_gets_its_key_groups():
    e = env(3)
    e.from_source(NumberSequenceSource(0, 59)).key_by("value").map(Where())
    records = run_in_process(e).records
    assert sorted(r["value"] for r in records) == list(range(60))
    for r in records:
        group = key_group_of(r["value"], 128)
        assert r["subtask"] == group * 3 // 128  # the key group's subtask, as on Ray
    per_subtask: dict[int, list[int]] = {}
    for r in records:
        per_subtask.setdefault(r["subtask"], []).append(r["seen"])
    for seen in per_subtask.values():  # counted per subtask, not shared
        assert sorted(seen) == list(range(1, len(seen) + 1))


class RunningCount(KeyedProcessFunction):
    def open(self, runtime_context: RuntimeContext) -> None:
        self.count = runtime_context.get_state(ValueStateDescriptor("count", 0))

    def process_element(self, value, ctx):
        self.count.update(self.count.value() + 1)
        yield {"k": ctx.get_current_key(), "n": self.count.value()}


def test_keyed_state_and_a_collect_sink():
    e = env()
    sink = CollectSink()
    e.from_collection([{"k": i % 3} for i in range(9)]).key_by("k").process(RunningCount()).sink_to(
        sink
    )
    result = run_in_process(e)
    table = result.sink_result(sink)
    assert isinstance(table, pa.Table)
    finals: dict[int, int] = {}
    for r in table.to_pylist():
        finals[r["k"]] = max(finals.get(r["k"], 0), r["n"])
    assert finals == {0: 3, 1: 3, 2: 3}
    assert sink._collector is None  # stood in for: no Ray actor


def test_sum_metrics_and_unions():
    e = env()
    a = e.from_collection([{"k": 1, "v": 1}, {"k": 1, "v": None}])
    b = e.from_collection([{"k": 2, "v": 5}])
    a.union(b).key_by("k").sum("v", name="Total")
    result = run_in_process(e)
    last = {r["k"]: r["v"] for r in result.records}
    assert last == {1: 1, 2: 5}
    assert sum(m["nulls_skipped"] for m in result.metrics["Total"]) == 1


def test_a_user_error_keeps_its_type_and_names_operator_and_subtask():
    def explode(record):
        if record["value"] == 7:
            raise ZeroDivisionError("boom")
        return record

    e = env()
    e.from_source(NumberSequenceSource(0, 9)).map(explode, name="Exploder")
    with pytest.raises(ZeroDivisionError) as info:
        run_in_process(e)
    if hasattr(info.value, "__notes__"):
        assert "'Exploder', subtask 2/2" in info.value.__notes__[0]


def test_record_errors_are_the_same_as_on_ray():
    e = env(1)
    e.from_source(NumberSequenceSource(0, 3)).map(lambda r: r["value"] * 2, name="Double")
    with pytest.raises(RecordError, match="^map 'Double' must return a dict"):
        run_in_process(e)


class _Committed:
    rows: list[int] = []


class _ListWriter(TransactionWriter):
    def begin_transaction(self, sequence: int) -> list:
        return []

    def write(self, transaction: list, batch: pa.RecordBatch) -> None:
        transaction.extend(batch.column("value").to_pylist())

    def pre_commit(self, transaction: list, checkpoint_id: int | None = None) -> list:
        return transaction

    def abort_transaction(self, transaction: list) -> None:
        transaction.clear()


class _ListCommitter(Committer):
    def commit(self, committable: list) -> CommitOutcome:
        _Committed.rows.extend(committable)
        return CommitOutcome.committed()

    def abort(self, committable: Any) -> None:
        pass

    def abort_lingering(self, context: SinkContext, keep) -> int:
        return 0


class _ListSerializer(CommittableSerializer):
    @property
    def version(self) -> int:
        return 1

    def serialize(self, committable: list) -> bytes:
        return json.dumps(committable).encode()

    def deserialize(self, version: int, data: bytes) -> list:
        return json.loads(data)


class ListTwoPhaseSink(TwoPhaseCommittingSink):
    """Commits into a class-level list (one process)."""

    def create_transaction_writer(self, context: SinkContext) -> _ListWriter:
        return _ListWriter()

    def create_committer(self, context: SinkContext | None) -> _ListCommitter:
        return _ListCommitter()

    def committable_serializer(self) -> _ListSerializer:
        return _ListSerializer()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_phase_sinks_commit_everything_at_the_end(checkpointing, tmp_path):
    _Committed.rows = []
    e = env()
    if checkpointing:
        e.enable_checkpointing(1000)
        e.get_checkpoint_config().set_checkpoint_storage(f"file://{tmp_path}")
    e.from_source(NumberSequenceSource(0, 49)).sink_to(ListTwoPhaseSink())
    run_in_process(e)
    assert sorted(_Committed.rows) == list(range(50))


def test_the_plan_is_left_as_it_was():
    e = env()
    stream = e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r)
    before = dict(e._plan.transformations)
    run_in_process(e)
    assert e._plan.transformations == before
    assert [t.name for t in e._plan.open_ends()] == [stream.get_name()]


def test_several_open_streams_are_collected_by_name():
    e = env(1)
    source = e.from_source(NumberSequenceSource(0, 2))
    source.map(lambda r: {"a": r["value"]}, name="A")
    source.map(lambda r: {"b": r["value"]}, name="B")
    result = run_in_process(e)
    assert result.collected == {
        "A": [{"a": 0}, {"a": 1}, {"a": 2}],
        "B": [{"b": 0}, {"b": 1}, {"b": 2}],
    }
    with pytest.raises(ValueError, match="2 streams"):
        _ = result.records


def test_an_edge_that_leaves_a_chain_midway_carries_that_operator_s_output():
    """``with-key`` chains its sink ``raw`` and also feeds a keyed sum: the sum gets
    with-key's records, every one once; the source's own output goes to a third consumer."""
    e = env(2)
    numbers = e.from_source(NumberSequenceSource(0, 99), "numbers")
    keyed = numbers.map(lambda r: {"key": r["value"] % 3, "value": r["value"]}, name="with-key")
    raw, sums, plain = CollectSink(), CollectSink(), CollectSink()
    keyed.sink_to(raw, "raw")
    keyed.key_by("key").reduce(
        lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]}
    ).sink_to(sums, "sums")
    numbers.sink_to(plain, "plain")
    graph = e.get_job_graph()
    assert [v.name for v in graph.vertices.values()] == [
        "numbers -> with-key -> raw",
        "Reduce -> sums",
        "plain",
    ]
    result = run_in_process(e)
    assert result.sink_result(raw).column_names == ["key", "value"]
    assert result.sink_result(plain).column_names == ["value"]  # the source's, not with-key's
    assert sorted(result.sink_result(raw).column("value").to_pylist()) == list(range(100))
    assert sorted(result.sink_result(plain).column("value").to_pylist()) == list(range(100))
    table = result.sink_result(sums)
    assert table.num_rows == 100
    last = {}
    for row in table.to_pylist():
        last[row["key"]] = max(last.get(row["key"], 0), row["value"])
    assert last == {k: sum(v for v in range(100) if v % 3 == k) for k in range(3)}
