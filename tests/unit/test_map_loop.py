"""A map emits into columns once its output's schema is settled and the C loop is loaded
(``rayflow.runtime.map_loop``): every record out, and every error, is what the record path
gives, including where a value is not a record of the schema, changes after it left, or
fails. Every test runs with the loop in C and with the record path alone."""

from __future__ import annotations

import datetime

import pyarrow as pa
import pytest

from rayflow import (
    CollectionSource,
    KeyedProcessFunction,
    MapFunction,
    StreamExecutionEnvironment,
)
from rayflow.errors import RecordError, SchemaChangeError
from rayflow.eventtime import WatermarkStrategy
from rayflow.runtime import speedups as speedups_switch
from rayflow.runtime.map_loop import map_loop
from rayflow.runtime.operators import MapOperator, OperatorContext
from rayflow.runtime.records import Columns
from rayflow.testing import run_in_process

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True, params=["records", "c"])
def loop_in(request, monkeypatch):
    """Runs the test with the record path alone, then with the loop in C."""
    c = request.getfixturevalue("speedups") if request.param == "c" else None
    monkeypatch.setattr(speedups_switch, "module", c)
    return request.param


def _run(rows, fn, batch_size: int = 2, output_type=None, name: str = "M") -> list[dict]:
    """The records a parallelism-1 map of ``rows`` emits, in order: the first batch
    settles the schema, every later one goes through the loop (where it is loaded)."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.from_source(CollectionSource(rows, batch_size=batch_size)).map(
        fn, output_type=output_type, name=name
    )
    return run_in_process(env).records


def _op(fn, output_type=None, reuse: bool = False) -> MapOperator:
    op = MapOperator(fn, output_type)
    op.open(
        OperatorContext(
            job_name="j",
            operator_name="M",
            operator_uid="m",
            subtask_index=0,
            parallelism=1,
            max_parallelism=128,
            attempt=0,
            checkpointing=True,
            object_reuse=reuse,
        )
    )
    return op


ROWS = [{"k": i % 3, "v": i} for i in range(20)]


def _double(r: dict) -> dict:
    return {"k": r["k"], "v": r["v"] * 2}


@pytest.mark.parametrize("batch_size", [1, 2, 7, 20])
def test_the_values_are_those_of_a_plain_loop(batch_size):
    assert _run(ROWS, _double, batch_size) == [_double(dict(r)) for r in ROWS]


def test_a_settled_schema_leaves_as_columns_where_the_loop_is_loaded(loop_in):
    op = _op(_double)
    op.process(pa.RecordBatch.from_pylist(ROWS[:2]))
    records, _ = op._records(pa.RecordBatch.from_pylist(ROWS[2:5]))
    if loop_in == "c":
        assert isinstance(records, Columns)
        assert records.rows() == [_double(r) for r in ROWS[2:5]]
    else:
        assert records == [_double(r) for r in ROWS[2:5]]


class _OneDict(MapFunction):
    """Returns the one dict it keeps, changed for each record."""

    def __init__(self) -> None:
        self.out: dict = {}

    def map(self, value):
        self.out["k"] = value["k"]
        self.out["v"] = value["v"] + 100
        return self.out


def _one_dict_out(reuse: bool) -> list[dict]:
    op = _op(_OneDict(), reuse=reuse)
    op.process(pa.RecordBatch.from_pylist(ROWS[:2]))
    out = op.process(pa.RecordBatch.from_pylist(ROWS[2:6]))
    return pa.Table.from_batches(out).to_pylist()


def test_a_dict_the_function_keeps_and_changes_leaves_as_it_was():
    assert _one_dict_out(reuse=False) == [{"k": r["k"], "v": r["v"] + 100} for r in ROWS[2:6]]


def test_with_object_reuse_a_map_emits_what_it_emits_without_the_c_module(monkeypatch):
    """Review schedule: object reuse on, a function returning one dict it keeps changing.
    The columns took each value as returned, the record path (all a map has without the C
    module) the dict as it is when the batch is built: a job restored on a node without
    the module emitted other records. With object reuse a map takes the record path."""
    got = _one_dict_out(reuse=True)
    monkeypatch.setattr(speedups_switch, "module", None)
    assert got == _one_dict_out(reuse=True) == [{"k": 2, "v": 105}] * 4


def test_the_function_is_called_once_per_record_where_the_loop_stops():
    """The loop stops at a value that is not a record of the schema: it and the records
    after it go as records, the function never called again on a record."""
    calls: list[int] = []

    def fn(r):
        calls.append(r["v"])
        return {"k": r["k"]} if r["v"] == 5 else {"k": r["k"], "v": r["v"]}

    op = _op(fn)
    out = op.process(pa.RecordBatch.from_pylist(ROWS[:2]))
    out += op.process(pa.RecordBatch.from_pylist(ROWS[2:10]))
    assert calls == list(range(10))
    assert pa.Table.from_batches(out).column("v").to_pylist() == [0, 1, 2, 3, 4, None, 6, 7, 8, 9]


def test_a_record_with_a_new_key_is_named():
    def fn(r):
        return {"k": r["k"], "v": r["v"], "extra": 1} if r["v"] > 4 else dict(r)

    with pytest.raises(SchemaChangeError, match="map 'M'.*'extra'"):
        _run(ROWS[:8], fn, batch_size=3)


@pytest.mark.parametrize(
    ("late", "error", "match"),
    [
        pytest.param(lambda v: "many", SchemaChangeError, "map 'M'.*'v'", id="str"),
        pytest.param(lambda v: v + 0.5, SchemaChangeError, "map 'M'.*'v'", id="float"),
        pytest.param(None, RecordError, "map 'M' must return a dict", id="not-a-record"),
    ],
)
def test_a_late_value_the_schema_does_not_take_is_named(late, error, match):
    """Once the schema is settled, a value is a str or a float in the int column (named,
    never truncated), or no record at all (a list)."""

    def fn(r):
        if r["v"] <= 4:
            return dict(r)
        return [r["v"]] if late is None else {"k": r["k"], "v": late(r["v"])}

    with pytest.raises(error, match=match):
        _run(ROWS[:8], fn, batch_size=3)


def test_a_stop_iteration_is_named():
    def fn(r):
        if r["v"] > 4:
            raise StopIteration
        return dict(r)

    with pytest.raises(RuntimeError, match="map 'M'.*StopIteration"):
        _run(ROWS[:8], fn, batch_size=3)


def test_an_error_of_the_function_is_raised_as_it_is():
    def fn(r):
        if r["v"] > 4:
            raise ZeroDivisionError("boom")
        return dict(r)

    with pytest.raises(ZeroDivisionError, match="boom"):
        _run(ROWS[:8], fn, batch_size=3)


def test_a_bytearray_in_a_text_column_leaves_as_it_was():
    """A text column takes a bytearray: the loop hands it to the record path, which copies
    it, so changing it afterwards changes no record that left."""
    kept = bytearray(b"x")

    def fn(r):
        if r["v"] < 2:
            return {"k": r["k"], "s": "s"}
        kept.extend(b"y")
        return {"k": r["k"], "s": kept}

    out = _run([{"k": 0, "v": v} for v in range(5)], fn, batch_size=2)
    assert [r["s"] for r in out] == ["s", "s", "xy", "xyy", "xyyy"]


def _outcome(rows, fn, batch_size: int) -> object:
    """The records a map emits, or the type and message of its error."""
    try:
        return _run(rows, fn, batch_size)
    except Exception as exc:  # noqa: BLE001 - compared as an outcome
        return type(exc), str(exc)


@pytest.mark.parametrize("bool_in_int", [False, True])
def test_text_floats_bools_times_and_nulls_convert_as_records_do(monkeypatch, bool_in_int):
    start = datetime.datetime(2026, 1, 1)
    rows = [{"k": i % 2, "v": i} for i in range(12)]

    def fn(r):
        i = r["v"]
        return {
            "s": str(i),
            "f": i / 2,
            "b": i % 3 == 0,
            "t": start + datetime.timedelta(seconds=i),
            "n": None if i == 9 else str(i),  # a null in a text column
            "i": True if bool_in_int and i == 7 else i,
        }

    got = _outcome(rows, fn, 3)
    monkeypatch.setattr(speedups_switch, "module", None)
    assert got == _outcome(rows, fn, 3)  # what the record path gives
    if bool_in_int:
        assert got[0] is SchemaChangeError and "map 'M': key 'i'" in got[1]
    else:
        assert got == [fn(r) for r in rows]


def test_a_big_batch_built_in_slices_falls_back_as_a_whole():
    """A batch over one slice (8192 rows of two columns) whose later slice stops the loop
    is built whole from the slices' columns and records."""
    rows = [{"k": 0, "v": 1}] + [{"k": i % 5, "v": i} for i in range(20_000)]

    def fn(r):
        return {"k": r["k"]} if r["v"] == 15_000 else {"k": r["k"], "v": r["v"]}

    out = _run(rows, fn, batch_size=20_000)
    assert [r.get("v") for r in out] == [None if r["v"] == 15_000 else r["v"] for r in rows]


class _Stamps(KeyedProcessFunction):
    def process_element(self, value, ctx):
        yield {**value, "stamp": ctx.timestamp()}


def test_event_time_stamps_go_with_what_is_emitted():
    rows = [{"k": i % 2, "v": i, "t": 1000 + i} for i in range(12)]
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")
    stream = env.from_source(CollectionSource(rows, batch_size=3), strategy)
    stream.map(lambda r: {"k": r["k"], "v": r["v"], "names": ",".join(sorted(r))}).key_by(
        "k"
    ).process(_Stamps())
    out = run_in_process(env).records
    assert [r["stamp"] for r in out] == [1000 + i for i in range(12)]
    assert {r["names"] for r in out} == {"k,t,v"}


@pytest.mark.parametrize(
    ("schema", "has_loop"),
    [
        (pa.schema([("k", pa.int64()), ("v", pa.float64())]), True),
        (pa.schema([("k", pa.string()), ("v", pa.binary())]), True),
        (pa.schema([("k", pa.int64()), ("v", pa.list_(pa.int64()))]), False),
        (pa.schema([("k", pa.int64()), ("k", pa.int64())]), False),
        (pa.schema([]), False),
    ],
)
def test_which_schemas_have_a_loop(schema, has_loop, loop_in):
    assert (map_loop(("k", "v"), schema) is not None) is (has_loop and loop_in == "c")
    assert map_loop((), pa.schema([("k", pa.int64())])) is None
