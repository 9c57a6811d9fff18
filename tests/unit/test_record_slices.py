"""Per-record operators take a big batch in slices once their output schema is settled:
the records out, their order, their timestamps, the keyed state and the batches
downstream are what the whole batch gives; a batch whose types a slice could not infer
(a key None in its first rows) is still taken whole, and one whose slice's records do not
build alone (Arrow types a value by the values it is with) is built whole, batch or error
as the whole batch gives it."""

from __future__ import annotations

import datetime
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rayflow.errors import RecordError, SchemaChangeError
from rayflow.eventtime.strategy import TIMESTAMP_COLUMN, split_timestamps, with_timestamps
from rayflow.functions import KeyedProcessFunction
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime import operators
from rayflow.runtime.operators import (
    FilterOperator,
    FlatMapOperator,
    KeyedProcessOperator,
    KeyedReduceOperator,
    MapOperator,
    OperatorContext,
    slice_rows,
)

ROWS = 40_000  # five slices of two columns


def opened(op: Any) -> Any:
    op.open(OperatorContext("job", "op", "uid", 0, 1, 128, 0))
    return op


def numbers(rows: int = ROWS, start: int = 0) -> pa.RecordBatch:
    values = np.arange(start, start + rows)
    return pa.record_batch({"key": values % 7, "value": values})


class _Running(KeyedProcessFunction):
    def process_element(self, value: dict[str, Any], ctx: Any) -> Any:
        yield {"key": value["key"], "twice": value["value"] * 2}


def _ops() -> dict[str, Any]:
    return {
        "map": MapOperator(lambda r: {"key": r["key"], "value": r["value"] + 1}),
        "flat_map": FlatMapOperator(
            lambda r: [r, {"key": r["key"], "value": -r["value"]}] if r["value"] % 3 else []
        ),
        "filter": FilterOperator(lambda r: r["value"] % 5 != 0),
        "reduce": KeyedReduceOperator(
            KeySelector("key"), lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]}
        ),
        "process": KeyedProcessOperator(KeySelector("key"), _Running()),
    }


def _expected(kind: str, rows: list[dict[str, Any]], sums: dict[int, int]) -> list[Any]:
    if kind == "map":
        return [{"key": r["key"], "value": r["value"] + 1} for r in rows]
    if kind == "flat_map":
        out = []
        for r in rows:
            if r["value"] % 3:
                out += [r, {"key": r["key"], "value": -r["value"]}]
        return out
    if kind == "filter":
        return [r for r in rows if r["value"] % 5 != 0]
    if kind == "reduce":
        out = []
        for r in rows:
            sums[r["key"]] = sums.get(r["key"], 0) + r["value"]
            out.append({"key": r["key"], "value": sums[r["key"]]})
        return out
    return [{"key": r["key"], "twice": r["value"] * 2} for r in rows]


def test_a_slice_is_sixteen_thousand_values_and_never_under_a_thousand_rows() -> None:
    assert slice_rows(numbers(10)) == 8192
    assert slice_rows(pa.record_batch({"v": [1]})) == 16_384
    wide = pa.record_batch({f"c{i}": [1] for i in range(64)})
    assert slice_rows(wide) == 1024


@pytest.mark.parametrize("kind", ["map", "flat_map", "filter", "reduce", "process"])
def test_a_big_batch_gives_one_batch_with_the_records_the_whole_batch_gives(kind: str) -> None:
    op = opened(_ops()[kind])
    sums: dict[int, int] = {}
    for start in (0, ROWS):  # the first batch settles the schema, the second is sliced
        batch = numbers(start=start)
        out = op.process(batch)
        assert len(out) == 1, "downstream sees one batch, as before"
        assert out[0].to_pylist() == _expected(kind, batch.to_pylist(), sums)
    if kind != "filter":
        assert op._out.settled


@pytest.mark.parametrize("kind", ["map", "reduce", "process"])
def test_records_are_built_a_slice_at_a_time_once_the_schema_is_settled(kind: str) -> None:
    op = opened(_ops()[kind])
    calls: list[int] = []
    build = op._out.build

    def counting(rows: list[Any]) -> Any:
        calls.append(len(rows))
        return build(rows)

    op._out.build = counting
    op.process(numbers())
    assert calls == [ROWS], "the first batch infers the schema whole"
    calls.clear()
    op.process(numbers(start=ROWS))
    assert calls == [8192, 8192, 8192, 8192, ROWS - 4 * 8192]


def test_a_key_none_in_the_first_slice_and_set_later_is_typed_by_the_whole_batch() -> None:
    op = opened(MapOperator(lambda r: {"x": None if r["value"] < 10_000 else r["value"]}))
    out = op.process(numbers())
    assert out[0].schema.field("x").type == pa.int64()
    assert out[0].column("x").null_count == 10_000
    assert op._out.settled
    # and later batches go on in slices with the type the whole batch gave
    out = op.process(numbers(start=ROWS))
    assert out[0].column("x").to_pylist() == list(range(ROWS, 2 * ROWS))


def test_an_output_that_held_only_none_is_not_settled_and_stays_whole() -> None:
    op = opened(MapOperator(lambda r: {"x": None, "value": r["value"]}))
    op.process(numbers(100))
    assert not op._out.settled
    calls: list[int] = []
    build = op._out.build
    op._out.build = lambda rows: calls.append(len(rows)) or build(rows)
    op.process(numbers())
    assert calls == [ROWS]


def test_timestamps_stay_with_their_records_across_slices() -> None:
    op = opened(MapOperator(lambda r: {"value": r["value"] * 10}))
    op.process(numbers(10))
    batch = with_timestamps(numbers(), pa.array(np.arange(ROWS) + 1_000, type=pa.int64()))
    (out,) = op.process(batch)
    records, stamps = split_timestamps(out)
    assert records.column("value").to_pylist() == [v * 10 for v in range(ROWS)]
    assert stamps is not None and stamps.to_pylist() == list(range(1_000, 1_000 + ROWS))


def test_keyed_state_after_a_sliced_batch_is_what_record_by_record_gives() -> None:
    op = opened(_ops()["reduce"])
    op.process(numbers(10))
    op.process(numbers(start=10))
    restored = opened(_ops()["reduce"])
    restored.restore_state([op.snapshot_state(1)])
    (out,) = restored.process(numbers(7, start=ROWS + 10))
    total = ROWS + 17
    expect = {k: sum(v for v in range(total) if v % 7 == k) for k in range(7)}
    assert {r["key"]: r["value"] for r in out.to_pylist()} == expect


# --- a slice's records typed as the whole batch's ------------------------------------------


def _whole_and_sliced(
    make: Any, batches: list[pa.RecordBatch], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], list[Any]]:
    """What each batch gives (its batches, or its error) taken whole and in slices."""

    def outcomes() -> list[Any]:
        op = opened(make())
        got: list[Any] = []
        for batch in batches:
            try:
                got.append([(b.schema, b.to_pylist()) for b in op.process(batch)])
            except Exception as exc:  # noqa: BLE001 - compared below
                got.append((type(exc), str(exc)))
        got.append(op.snapshot_state(1) if hasattr(op, "backend") else None)
        return got

    sliced = outcomes()
    with monkeypatch.context() as m:
        m.setattr(operators, "MIN_SLICE_ROWS", 10**9)  # every batch whole
        whole = outcomes()
    return whole, sliced


UTC = datetime.timezone.utc


def _later(value: int, early: Any, late: Any) -> Any:
    """``early`` in the first records of a batch, ``late`` from its second slice on."""
    return early if value % ROWS < 100 else late


#: outputs whose values Arrow types by the batch they are in: a slice of only the later
#: values is typed apart from the first ones (and fails), the whole batch is not
MIXED = {
    "decimal with int defaults": (
        lambda r: {"d": _later(r["value"], Decimal(r["value"]) / 4, 0)},
        pa.schema([("d", pa.decimal128(20, 2))]),
    ),
    "binary with str": (lambda r: {"b": _later(r["value"], b"x", "s")}, None),
    "aware with naive datetimes": (
        lambda r: {
            "t": _later(
                r["value"], datetime.datetime(2020, 1, 1, tzinfo=UTC), datetime.datetime(2020, 1, 2)
            )
        },
        None,
    ),
    "dates with datetimes": (
        lambda r: {
            "d": _later(r["value"], datetime.date(2020, 1, 1), datetime.datetime(2020, 1, 2, 5))
        },
        None,
    ),
    "a struct's floats with bools": (
        lambda r: {"s": {"f": _later(r["value"], 1.5, True)}},
        None,
    ),
    "decimals of a wider scale": (
        lambda r: {"d": _later(r["value"], Decimal("1.5"), Decimal("2.50"))},
        None,
    ),
    "a struct field None only later": (
        lambda r: {"s": _later(r["value"], {"a": 1}, {"a": 2, "b": None})},
        None,
    ),
    "bytes after str": (lambda r: {"t": _later(r["value"], "x", b"y")}, None),
}


@pytest.mark.parametrize("settled_first", [True, False])
@pytest.mark.parametrize("case", sorted(MIXED))
def test_a_slice_s_values_are_typed_as_the_whole_batch_types_them(
    case: str, settled_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settled schema's batch in slices gives what it gives whole; and a first batch
    is taken whole (its first slice's schema would type the slices after it apart from
    what the whole batch infers: a decimal's scale, a struct field that is None only
    later, bytes after str)."""
    fn, output_type = MIXED[case]
    batches = [numbers(10), numbers(), numbers()] if settled_first else [numbers(), numbers()]
    whole, sliced = _whole_and_sliced(lambda: MapOperator(fn, output_type), batches, monkeypatch)
    assert all(isinstance(out, list) for out in whole[:-1]), whole  # the whole batch took them
    assert sliced == whole


#: values of a kind, for a record's number ``v``; the random outputs below draw a kind per
#: key and part of the first batch
_KINDS: dict[str, Any] = {
    "int": lambda v: v,
    "big int": lambda v: 2**63 + v,
    "negative": lambda v: -v,
    "float": lambda v: v / 2,
    "integral float": lambda v: float(v),
    "none": lambda v: None,
    "str": lambda v: str(v),
    "bytes": lambda v: b"%d" % v,
    "bool": lambda v: v % 2 == 0,
    "decimal": lambda v: Decimal(v) / 4,
    "date": lambda v: datetime.date(2020, 1, 1 + v % 28),
    "naive": lambda v: datetime.datetime(2020, 1, 1, v % 24),
    "aware": lambda v: datetime.datetime(2020, 1, 1, v % 24, tzinfo=UTC),
    "int list": lambda v: [v, 1],
    "float list": lambda v: [v / 2],
    "empty list": lambda v: [],
    "struct int": lambda v: {"f": v},
    "struct float": lambda v: {"f": v / 2},
    "struct more": lambda v: {"f": v, "g": "x"},
    "missing": lambda v: _MISSING,
}
_MISSING = object()


def _random_output(seed: int) -> Any:
    """A map function whose output's keys take values of kinds drawn per key, for the
    first slice of the first batch, the rest of it, and a few rows anywhere."""
    import random

    rng = random.Random(seed)
    kinds = sorted(_KINDS)
    keys = [f"k{i}" for i in range(rng.randrange(1, 4))]
    plan = {
        key: (rng.choice(kinds), rng.choice(kinds), rng.choice(kinds), rng.randrange(ROWS))
        for key in keys
    }
    if rng.random() < 0.5:  # most keys keep one kind
        for key in keys[1:]:
            kind = rng.choice(kinds[:6])
            plan[key] = (kind, kind, kind, 0)

    def fn(r: dict[str, Any]) -> Any:
        v = r["value"]
        out = {}
        for key, (early, late, odd, at) in plan.items():
            kind = odd if v % ROWS == at else early if v % ROWS < 8192 else late
            value = _KINDS[kind](v)
            if value is not _MISSING:
                out[key] = value
        return out

    return fn


@pytest.mark.parametrize("seed", range(60))
def test_random_outputs_in_slices_give_what_they_give_whole(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random outputs whose values change kind after the first slice, or in one row: the
    first batch, and the one after it (in slices, in the schema the first settled), give
    the batches, or the error, and the state that each gives taken whole."""
    fn = _random_output(seed)
    for make in (
        lambda: MapOperator(fn),
        lambda: KeyedReduceOperator(KeySelector("key"), lambda a, b: {**fn(b), "key": a["key"]}),
    ):
        whole, sliced = _whole_and_sliced(make, [numbers(), numbers(start=ROWS)], monkeypatch)
        assert sliced == whole


@pytest.mark.parametrize("kind", ["flat_map", "process"])
def test_a_batch_taken_whole_after_a_slice_failed_keeps_its_timestamps(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def records(r: dict[str, Any]) -> list[dict[str, Any]]:
        out = {"v": r["value"], "b": _later(r["value"], b"x", "s")}
        return [out, out] if r["value"] % 3 else []

    class Process(KeyedProcessFunction):
        def process_element(self, value: dict[str, Any], ctx: Any) -> Any:
            return records(value)

    make = {
        "flat_map": lambda: FlatMapOperator(records),
        "process": lambda: KeyedProcessOperator(KeySelector("key"), Process()),
    }[kind]
    stamps = pa.array(np.arange(ROWS) * 10, type=pa.int64())
    batches = [with_timestamps(numbers(), stamps), with_timestamps(numbers(), stamps)]
    whole, sliced = _whole_and_sliced(make, batches, monkeypatch)
    assert isinstance(whole[1], list) and whole[1][0][0].names[-1] == TIMESTAMP_COLUMN
    assert sliced == whole


def test_a_function_s_error_in_a_later_slice_is_raised_as_the_whole_batch_raises_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole batch calls the function on every record before it builds any: a record
    that does not convert in the first slice does not hide a failing call after it."""

    def fn(r: dict[str, Any]) -> Any:
        if r["value"] % ROWS == 30_000:
            raise ValueError("bad record")
        return {"x": "text" if r["value"] % ROWS == 5 else r["value"]}

    whole, sliced = _whole_and_sliced(
        lambda: MapOperator(fn), [numbers(10, start=10), numbers()], monkeypatch
    )
    assert whole[1] == (ValueError, "bad record")
    assert sliced == whole


def test_a_record_that_is_no_dict_is_named_as_the_whole_batch_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fn(r: dict[str, Any]) -> Any:
        if r["value"] % ROWS == 39_000:
            return 5
        return {"x": "text" if r["value"] % ROWS == 5 else r["value"]}

    whole, sliced = _whole_and_sliced(
        lambda: MapOperator(fn), [numbers(10, start=10), numbers()], monkeypatch
    )
    assert whole[1][0] is RecordError
    assert sliced == whole


def test_more_values_than_a_dictionary_s_index_counts_are_named_across_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each slice holds under 128 distinct values, the batch 500: an int8-indexed output
    fails as the whole batch fails, naming the operator and the key (not Arrow's error from
    joining the slices)."""
    output_type = pa.schema([("c", pa.dictionary(pa.int8(), pa.string()))])

    def fn(r: dict[str, Any]) -> dict[str, Any]:
        v = r["value"]
        return {"c": str((v // 8192) * 100 + v % 100)}

    whole, sliced = _whole_and_sliced(
        lambda: MapOperator(fn, output_type), [numbers(10), numbers()], monkeypatch
    )
    assert whole[1][0] is SchemaChangeError and "more than int8 indices" in whole[1][1]
    assert sliced == whole


def test_dictionaries_of_slices_join_as_the_whole_batch_encodes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    output_type = pa.schema([("c", pa.dictionary(pa.int32(), pa.string()))])
    fn = lambda r: {"c": str(r["value"] // 9000)}  # noqa: E731
    whole, sliced = _whole_and_sliced(
        lambda: MapOperator(fn, output_type), [numbers(10), numbers()], monkeypatch
    )
    assert sliced == whole


def test_slices_join_without_pyarrow_s_concat_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pa.concat_batches`` is in pyarrow 19 and later; rayflow takes pyarrow 14."""
    monkeypatch.delattr(pa, "concat_batches", raising=False)
    for kind in ["map", "flat_map", "filter", "reduce", "process"]:
        op = opened(_ops()[kind])
        sums: dict[int, int] = {}
        for start in (0, ROWS):
            batch = numbers(start=start)
            (out,) = op.process(batch)
            assert out.to_pylist() == _expected(kind, batch.to_pylist(), sums)


def test_a_declared_schema_s_metadata_is_on_every_batch_however_it_was_built() -> None:
    """The first slice held only None (its batch is conformed to the declared schema), the
    others values: the batch out has the declared schema, metadata and all, as one built
    whole has."""
    output_type = pa.schema(
        [pa.field("x", pa.int64(), metadata={"unit": "ms"})], metadata={"source": "test"}
    )
    op = opened(MapOperator(lambda r: {"x": None if r["value"] % ROWS < 9000 else 1}, output_type))
    small = op.process(numbers(10, start=9000))
    big = op.process(numbers())
    for (out,) in (small, big):
        assert out.schema.equals(output_type, check_metadata=True)
