"""A keyed reduce emits into columns once its output's schema is settled
(``rayflow.runtime.reduce_loop``): every record out is what the record path gave,
including where a value is not a record of the schema, changes after it left, or fails.

Every test runs twice: with the loop in Python and with it in C
(:mod:`rayflow.runtime._speedups`), which must give the same results."""

from __future__ import annotations

import datetime

import pyarrow as pa
import pytest

from rayflow import (
    CollectionSource,
    KeyedProcessFunction,
    ReduceFunction,
    StreamExecutionEnvironment,
)
from rayflow.errors import RecordError, SchemaChangeError
from rayflow.eventtime import WatermarkStrategy
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime import speedups as speedups_switch
from rayflow.runtime.operators import KeyedReduceOperator, OperatorContext
from rayflow.runtime.records import Columns
from rayflow.runtime.reduce_loop import reduce_loop
from rayflow.state import ValueStateDescriptor
from rayflow.testing import run_in_process

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True, params=["python", "c"])
def loop_in(request, monkeypatch):
    """Runs the test with the loop in Python, then in C."""
    c = request.getfixturevalue("speedups") if request.param == "c" else None
    monkeypatch.setattr(speedups_switch, "module", c)
    return request.param


def _run(rows, reduce, batch_size: int = 2, output_type=None, name: str = "R") -> list[dict]:
    """The records a parallelism-1 reduce of ``rows`` (by ``k``) emits, in order: the
    first batch settles the schema, every later one goes through the compiled loop."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.from_source(CollectionSource(rows, batch_size=batch_size)).key_by("k").reduce(
        reduce, output_type=output_type, name=name
    )
    return run_in_process(env).records


def _reference(rows, reduce) -> list[dict]:
    """What a reduce emits, computed record by record with copies."""
    state: dict = {}
    out = []
    for row in rows:
        previous = state.get(row["k"])
        value = dict(row) if previous is None else reduce(dict(previous), dict(row))
        state[row["k"]] = value
        out.append(dict(value))
    return out


def _add(a: dict, b: dict) -> dict:
    return {"k": a["k"], "v": a["v"] + b["v"]}


def _add_into(a: dict, b: dict) -> dict:
    a["v"] += b["v"]
    return a


ROWS = [{"k": i % 3, "v": i} for i in range(20)]


@pytest.mark.parametrize("reduce", [_add, _add_into])
@pytest.mark.parametrize("batch_size", [1, 2, 7, 20])
def test_the_running_values_are_those_of_the_record_path(reduce, batch_size):
    assert _run(ROWS, reduce, batch_size) == _reference(ROWS, reduce)


def _columns_after(schema_rows, batch_rows, reduce, output_type=None, reuse=False):
    """What the operator's loop makes of ``batch_rows`` after ``schema_rows`` settled
    its output (a reduce of ``reduce`` by ``k``)."""
    op = KeyedReduceOperator(KeySelector("k"), reduce, output_type)
    op.open(
        OperatorContext(
            job_name="j",
            operator_name="R",
            operator_uid="r",
            subtask_index=0,
            parallelism=1,
            max_parallelism=128,
            attempt=0,
            checkpointing=True,
            object_reuse=reuse,
        )
    )
    op.process(pa.RecordBatch.from_pylist(schema_rows))
    records, _ = op._records(pa.RecordBatch.from_pylist(batch_rows))
    return op, records


def test_a_settled_int_schema_leaves_as_columns():
    op, records = _columns_after([{"k": 0, "v": 1}], [{"k": 0, "v": 2}, {"k": 1, "v": 3}], _add)
    assert isinstance(records, Columns)
    assert records.rows() == [{"k": 0, "v": 3}, {"k": 1, "v": 3}]
    assert op.backend.current_key == 1  # the last record's, as per record


def test_a_value_changed_after_it_left_leaves_as_it_was():
    """``_add_into`` adds into the dict the state keeps: each value leaves as it was."""
    _, records = _columns_after(
        [{"k": 0, "v": 1}], [{"k": 0, "v": 2}, {"k": 0, "v": 3}, {"k": 0, "v": 4}], _add_into
    )
    assert isinstance(records, Columns)
    assert records.lists == [[0, 0, 0], [3, 6, 10]]


def _drop_v_at(limit: int):
    def reduce(a: dict, b: dict) -> dict:
        total = (a.get("v") or 0) + b["v"]
        return {"k": a["k"]} if total > limit else {"k": a["k"], "v": total}

    return reduce


def test_a_record_lacking_a_key_and_those_after_it_go_as_records_with_nulls():
    rows = [{"k": 0, "v": v} for v in range(1, 9)]
    out = _run(rows, _drop_v_at(12), batch_size=4)
    assert [r.get("v") for r in out] == [1, 3, 6, 10, None, 6, None, 8]
    assert [r.get("v") for r in out] == [r.get("v") for r in _reference(rows, _drop_v_at(12))]
    assert all(set(r) == {"k", "v"} for r in out)


def test_a_record_with_a_new_key_is_named():
    rows = [{"k": 0, "v": v} for v in range(1, 7)]

    def reduce(a, b):
        total = a["v"] + b["v"]
        return {"k": a["k"], "v": total, "extra": 1} if total > 10 else {"k": a["k"], "v": total}

    with pytest.raises(SchemaChangeError, match="reduce 'R'.*'extra'"):
        _run(rows, reduce, batch_size=3)


@pytest.mark.parametrize(
    ("late", "error", "match"),
    [
        pytest.param(lambda total: "many", SchemaChangeError, "reduce 'R'.*'v'", id="str"),
        pytest.param(lambda total: total + 0.5, SchemaChangeError, "reduce 'R'.*'v'", id="float"),
        pytest.param(None, RecordError, "reduce 'R' must return a dict", id="not-a-record"),
    ],
)
def test_a_late_value_the_schema_does_not_take_is_named(late, error, match):
    """Once the schema is settled, the last record's value is a str or a float in the
    int column (named, never truncated), or no record at all (a list)."""
    rows = [{"k": 0, "v": v} for v in range(1, 7)]

    def reduce(a, b):
        total = a["v"] + b["v"]
        if total <= 15:
            return {"k": a["k"], "v": total}
        return [total] if late is None else {"k": a["k"], "v": late(total)}

    with pytest.raises(error, match=match):
        _run(rows, reduce, batch_size=3)


def test_a_call_failing_on_what_an_earlier_call_returned_names_that():
    """The earlier call's list goes out as the value the state keeps; the batch fails
    on the next call, which is given that list."""
    rows = [{"k": 0, "v": v} for v in range(1, 9)]

    def reduce(a, b):
        total = a["v"] + b["v"]
        return [total] if total == 10 else {"k": a["k"], "v": total}

    with pytest.raises(RecordError, match=r"reduce 'R' must return a dict \(a record\), got list"):
        _run(rows, reduce, batch_size=3)


def test_a_stop_iteration_in_the_compiled_loop_is_named():
    rows = [{"k": 0, "v": v} for v in range(1, 7)]

    def reduce(a, b):
        if a["v"] + b["v"] > 10:
            raise StopIteration
        return {"k": a["k"], "v": a["v"] + b["v"]}

    with pytest.raises(RuntimeError, match="reduce 'R'.*StopIteration"):
        _run(rows, reduce, batch_size=3)


def test_an_error_of_the_function_is_raised_as_it_is():
    rows = [{"k": 0, "v": v} for v in range(1, 7)]

    def reduce(a, b):
        if a["v"] + b["v"] > 10:
            raise ZeroDivisionError("boom")
        return {"k": a["k"], "v": a["v"] + b["v"]}

    with pytest.raises(ZeroDivisionError, match="boom"):
        _run(rows, reduce, batch_size=3)


def test_a_bytearray_in_a_text_column_leaves_as_it_was():
    """A text column takes a bytearray: the compiled loop hands it to the record path,
    which copies it, so adding to it afterwards changes no record that left."""
    rows = [{"k": 0, "s": "a"}] + [{"k": 0, "s": "b"}] * 5

    def reduce(a, b):
        if isinstance(a["s"], str) and len(a["s"]) < 3:
            return {"k": 0, "s": a["s"] + b["s"]}
        buffer = a["s"] if isinstance(a["s"], bytearray) else bytearray(a["s"], "ascii")
        buffer.extend(b"b")
        return {"k": 0, "s": buffer}

    out = _run(rows, reduce, batch_size=2)
    assert [r["s"] for r in out] == ["a", "ab", "abb", "abbb", "abbbb", "abbbbb"]


def test_text_floats_bools_times_and_nulls_convert_as_records_do():
    start = datetime.datetime(2026, 1, 1)
    rows = [
        {"k": i % 2, "s": str(i), "f": i / 2, "b": i % 3 == 0, "t": start, "n": str(i)}
        for i in range(12)
    ]

    def reduce(a, b):
        return {
            "k": a["k"],
            "s": a["s"] + b["s"],
            "f": a["f"] + b["f"],
            "b": a["b"] or b["b"],
            "t": a["t"] + datetime.timedelta(seconds=b["f"]),
            "n": None if b["s"] == "9" else b["s"],  # a null in a text column
        }

    assert _run(rows, reduce, batch_size=3) == _reference(rows, reduce)


class _CountingReduce(ReduceFunction):
    """Keeps a count per key in keyed state: the current key must be set per record."""

    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count"))

    def reduce(self, a, b):
        seen = (self.count.value() or 1) + 1
        self.count.update(seen)
        return {"k": a["k"], "v": a["v"] + b["v"], "seen": seen}


def test_a_reduce_function_sees_the_state_of_each_record_s_key():
    rows = [{"k": i % 3, "v": i, "seen": 1} for i in range(15)]
    out = _run(rows, _CountingReduce(), batch_size=4)
    for k in range(3):
        assert [r["seen"] for r in out if r["k"] == k] == [1, 2, 3, 4, 5]


def test_a_big_batch_built_in_slices_falls_back_as_a_whole():
    """A batch over one slice (8192 rows of two columns) whose later slice stops the
    compiled loop is built whole from the slices' columns and records."""
    rows = [{"k": 0, "v": 1}] + [{"k": i % 5, "v": 1} for i in range(20_000)]

    def reduce(a, b):
        total = a.get("v", 0) + b["v"]
        return {"k": a["k"]} if total == 3000 else {"k": a["k"], "v": total}

    out = _run(rows, reduce, batch_size=20_000)
    assert sum("v" not in r for r in _reference(rows, reduce)) == 5  # once per key
    assert [r.get("v") for r in out] == [r.get("v") for r in _reference(rows, reduce)]


@pytest.mark.parametrize(
    ("schema", "compiled"),
    [
        (pa.schema([("k", pa.int64()), ("v", pa.float64())]), True),
        (pa.schema([("k", pa.string()), ("v", pa.binary())]), True),
        (pa.schema([("k", pa.int64()), ("v", pa.list_(pa.int64()))]), False),
        (pa.schema([("k", pa.int64()), ("v", pa.struct([("a", pa.int64())]))]), False),
        (pa.schema([("k", pa.int64()), ("v", pa.dictionary(pa.int8(), pa.string()))]), False),
        (pa.schema([("k", pa.int64()), ("k", pa.int64())]), False),
        (pa.schema([]), False),
    ],
)
def test_which_schemas_have_a_compiled_loop(schema, compiled):
    assert (reduce_loop(("k", "v"), 0, schema, sets_key=False) is not None) is compiled


def test_a_column_name_is_only_ever_a_literal():
    names = ("k", "v'] ; import os #", 'q"\\n', "}) or 1 #")
    schema = pa.schema([(n, pa.int64()) for n in names])
    loop = reduce_loop(names, 0, schema, sets_key=False)
    assert loop is not None
    lists: list[list] = [[] for _ in names]
    tables: dict = {}
    seen = []

    def call(a, b):
        seen.append(b)
        return b

    key, end = loop(
        tables,
        lambda key, name: tables.setdefault(key, {}),
        "reduce",
        call,
        None,
        lists,
        [None, None],
        *([1, 1], [10, 11], [20, 21], [30, 31]),
    )
    assert lists == [[1, 1], [10, 11], [20, 21], [30, 31]]
    assert seen == [dict(zip(names, (1, 11, 21, 31)))]


class _EqualToV:
    """A dict key that is not a str but looks up as ``"v"``."""

    def __hash__(self) -> int:
        return hash("v")

    def __eq__(self, other: object) -> bool:
        return other == "v"


def test_a_key_that_looks_up_as_a_column_name_is_that_column():
    """Review schedule: a key object equal to ``"v"`` (with its hash). The record path
    named it as no str; the compiled loop takes the dict as the record it equals."""
    rows = [{"k": 0, "v": v} for v in range(1, 5)]
    out = _run(rows, lambda a, b: {"k": a["k"], _EqualToV(): a["v"] + b["v"]}, batch_size=2)
    assert [r["v"] for r in out] == [1, 3, 6, 10]


def test_with_object_reuse_on_the_compiled_loop_emits_values_as_they_were():
    """Review schedule: object reuse on, a function adding into its accumulator. Nothing
    is copied, but the columns take each value as it is emitted."""
    op, records = _columns_after(
        [{"k": 0, "v": 1}],
        [{"k": 0, "v": 2}, {"k": 0, "v": 3}, {"k": 0, "v": 4}],
        _add_into,
        reuse=True,
    )
    assert isinstance(records, Columns)
    assert records.lists == [[0, 0, 0], [3, 6, 10]]


def test_a_list_in_an_int_column_beside_a_text_column_is_named():
    """Review schedule: a schema with text and int columns; a list in the int column
    that a later call changes. The batch fails naming the operator and the key."""
    calls = {"n": 0}

    def reduce(a, b):
        calls["n"] += 1
        if calls["n"] == 2:
            return {"k": 0, "s": "x", "v": [1]}
        if isinstance(a["v"], list):
            a["v"].append(99)
            return {"k": 0, "s": "x", "v": 5}
        return {"k": 0, "s": "x", "v": a["v"] + 1}

    rows = [{"k": 0, "s": "a", "v": 0}, {"k": 0, "s": "b", "v": 0}] + [
        {"k": 0, "s": "b", "v": 0}
    ] * 3
    with pytest.raises(SchemaChangeError, match="reduce 'R'.*'v'"):
        _run(rows, reduce, batch_size=2)


def test_two_bad_columns_in_another_key_order_name_one_of_them():
    """Review schedule: the records come back in the schema's key order, so of two
    columns holding a str the error may name the other one; it names the operator, one
    of them and a record."""

    def reduce(a, b):
        bad = b["v"] > 2
        return {"b": "x" if bad else 1, "a": "y" if bad else 1, "k": 0, "v": b["v"]}

    rows = [{"k": 0, "a": 1, "b": 1, "v": v} for v in range(1, 6)]
    with pytest.raises(SchemaChangeError, match="reduce 'R'.*'[ab]'"):
        _run(rows, reduce, batch_size=2)


class _Stamps(KeyedProcessFunction):
    def process_element(self, value, ctx):
        yield {**value, "stamp": ctx.timestamp()}


def _names_seen(a: dict, b: dict) -> dict:
    return {"k": a["k"], "v": a["v"] + b["v"], "names": ",".join(sorted(b))}


def test_event_time_stamps_stay_out_of_the_records_and_go_with_what_is_emitted():
    """Review finding: the reduce gave its function, and emitted, records holding the
    timestamp column of event time as a key, where map, flat_map, filter and process
    take it off; records its function built had no timestamp. Each record out carries
    the timestamp of the record it came from."""
    rows = [{"k": i % 2, "v": i, "names": "", "t": 1000 + i} for i in range(12)]
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")
    stream = env.from_source(CollectionSource(rows, batch_size=3), strategy)
    keyed = stream.map(lambda r: {"k": r["k"], "v": r["v"], "names": ""}).key_by("k")
    keyed.reduce(_names_seen).key_by("k").process(_Stamps())
    out = run_in_process(env).records
    assert [sorted(r) for r in out] == [["k", "names", "stamp", "v"]] * 12
    assert {r["names"] for r in out[2:]} == {"k,names,v"}
    assert [r["stamp"] for r in out] == [1000 + i for i in range(12)]
    assert [r["v"] for r in out] == [r["v"] for r in _reference(rows, _add)]


def test_state_checkpointed_with_the_timestamp_key_is_restored_without_it():
    """State of an earlier version: its reduce kept the event-time timestamp column in
    the values it reduced (and checkpointed). Restored, a function that builds on the
    value (``{**a, ...}``) emitted that key as a column of its own, beside the stamps
    the records out carry: the batch out held the timestamp column twice."""
    from rayflow.eventtime.strategy import TIMESTAMP_COLUMN

    def merge(a: dict, b: dict) -> dict:
        return {**a, "v": a["v"] + b["v"]}

    old, _ = _columns_after([{"k": 0, "v": 1}], [{"k": 1, "v": 2}], merge)
    for key in (0, 1):  # as the earlier version kept them
        old.backend.table_of_key(key, old.STATE)[key][TIMESTAMP_COLUMN] = 5
    snapshot = old.snapshot_state(1)
    op, _ = _columns_after([{"k": 9, "v": 0}], [{"k": 9, "v": 0}], merge)
    op.restore_state([snapshot])
    stamped = pa.RecordBatch.from_pylist(
        [{"k": 0, "v": 10, TIMESTAMP_COLUMN: 7}, {"k": 1, "v": 20, TIMESTAMP_COLUMN: 8}]
    )
    (out,) = op.process(stamped)
    assert out.schema.names.count(TIMESTAMP_COLUMN) == 1
    assert out.to_pylist() == [
        {"k": 0, "v": 11, TIMESTAMP_COLUMN: 7},
        {"k": 1, "v": 22, TIMESTAMP_COLUMN: 8},
    ]
