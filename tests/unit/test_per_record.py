"""The per-record path without Ray: batch <-> dict conversions, the per-record operators
against the plain ``to_pylist`` / ``from_pylist`` loops they replace, and the keyed state
caches across snapshot, restore and rescaling."""

from __future__ import annotations

import pickle
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rayflow.functions import KeyedProcessFunction, ReduceFunction, RuntimeContext
from rayflow.keygroups import key_group_of, key_groups_of_subtask
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime.operators import (
    FilterOperator,
    FlatMapOperator,
    KeyedProcessOperator,
    KeyedReduceOperator,
    MapOperator,
    OperatorContext,
)
from rayflow.runtime.records import (
    batch_to_columns,
    batch_to_rows,
    iter_columns,
    rows_to_batch,
    rows_to_batches,
)
from rayflow.state import KeyedStateBackend, ValueStateDescriptor

MAXP = 128


def context(index: int = 0, parallelism: int = 1) -> OperatorContext:
    return OperatorContext("job", "op", "uid", index, parallelism, MAXP, 0)


def opened(op: Any, index: int = 0, parallelism: int = 1) -> Any:
    op.open(context(index, parallelism))
    return op


# --- batch -> rows ------------------------------------------------------------------------

BATCHES = {
    "ints": pa.record_batch({"value": np.arange(10)}),
    "two columns": pa.record_batch({"key": np.arange(10) % 3, "value": np.arange(10)}),
    "floats, strings, nulls": pa.record_batch(
        {"f": [1.5, None, float("nan")], "s": ["a", None, "ü"], "b": [True, None, False]}
    ),
    "nested": pa.RecordBatch.from_pylist(
        [
            {"d": {"x": 1, "y": [1, 2]}, "l": [[1], []]},
            {"d": None, "l": None},
            {"d": {"x": None, "y": []}, "l": [None]},
        ]
    ),
    "map type": pa.record_batch(
        {"m": pa.array([[("a", 1)], None], type=pa.map_(pa.string(), pa.int64()))}
    ),
    "binary, decimal, timestamp": pa.record_batch(
        {
            "bin": pa.array([b"\x00", None], pa.binary()),
            "dec": pa.array([Decimal("1.25"), None], pa.decimal128(5, 2)),
            "ts": pa.array([0, 1_000_000], pa.timestamp("us")),
        }
    ),
    "awkward names": pa.RecordBatch.from_arrays(
        [pa.array([1, 2]), pa.array([3, 4]), pa.array([5, 6]), pa.array([7, 8])],
        names=["a'b\"c", "def", "1 x\n", "ß€"],
    ),
    "duplicate names": pa.RecordBatch.from_arrays(
        [pa.array([1, 2]), pa.array(["x", "y"]), pa.array([3, 4])], names=["a", "b", "a"]
    ),
    "no rows": pa.record_batch({"a": pa.array([], pa.int64()), "b": pa.array([], pa.string())}),
    "no columns": pa.RecordBatch.from_pydict({}).slice(0, 0),
    "many columns": pa.RecordBatch.from_pydict({f"c{i}": [i, i + 1] for i in range(300)}),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_batch_to_rows_equals_to_pylist(name):
    batch = BATCHES[name]
    rows = batch_to_rows(batch)
    expected = batch.to_pylist()
    # repr: NaN equals itself, key order and value types count
    assert repr(rows) == repr(expected)
    assert [[type(v) for v in r.values()] for r in rows] == [
        [type(v) for v in r.values()] for r in expected
    ]
    rows2, columns = batch_to_columns(batch)
    assert repr(rows2) == repr(expected)
    assert repr(columns) == repr([c.to_pylist() for c in batch.columns])
    lazy, columns3 = iter_columns(batch)
    assert not isinstance(lazy, list)
    rows3 = list(lazy)
    assert repr(rows3) == repr(expected)
    assert [[type(v) for v in r.values()] for r in rows3] == [
        [type(v) for v in r.values()] for r in expected
    ]
    assert repr(columns3) == repr([c.to_pylist() for c in batch.columns])


def test_rows_are_fresh_dicts():
    rows = batch_to_rows(BATCHES["two columns"])
    rows[0]["key"] = "changed"
    assert batch_to_rows(BATCHES["two columns"])[0]["key"] == 0
    assert len({id(r) for r in rows}) == len(rows)


def test_lazy_rows_are_fresh_dicts_built_as_they_are_read():
    batch = BATCHES["two columns"]
    lazy, _ = iter_columns(batch)
    first = next(lazy)
    first["key"] = "changed"
    rest = list(lazy)
    assert [first, *rest][1:] == batch.to_pylist()[1:]
    assert next(iter_columns(batch)[0])["key"] == 0
    assert len({id(r) for r in [first, *rest]}) == batch.num_rows


# --- rows -> batch ------------------------------------------------------------------------

ROWS = {
    "ints": [{"k": i, "v": i * 2} for i in range(5)],
    "ints and floats": [{"v": 1}, {"v": 2.5}, {"v": None}],
    "strings and None": [{"s": "a"}, {"s": None}, {"s": "é"}],
    "missing key later": [{"a": 1, "b": 2}, {"a": 3}],
    "other key order later": [{"a": 1, "b": "x"}, {"b": "y", "a": 2}],
    "nested": [{"d": {"x": 1, "y": [1, 2]}}, {"d": {"x": 2}}, {"d": None}],
    "lists": [{"l": [1, 2]}, {"l": []}, {"l": None}],
    "all None": [{"n": None}, {"n": None}],
    "numpy scalars": [{"v": np.int64(3)}, {"v": np.int64(4)}],
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_rows_to_batch_equals_from_pylist(name):
    rows = ROWS[name]
    batch = rows_to_batch(rows)
    expected = pa.RecordBatch.from_pylist(rows)
    assert batch.schema == expected.schema
    assert batch.equals(expected)
    assert [b.to_pylist() for b in rows_to_batches(rows)] == [expected.to_pylist()]


def test_no_rows_give_no_batch():
    assert rows_to_batches([]) == []


def test_a_key_only_a_later_row_has_is_a_column_where_from_pylist_drops_it():
    rows = [{"a": 1}, {"a": 2, "b": 3}]
    assert pa.RecordBatch.from_pylist(rows).schema.names == ["a"]
    assert rows_to_batch(rows).to_pylist() == [{"a": 1, "b": None}, {"a": 2, "b": 3}]


# --- per-record operators against the loops they replace ----------------------------------


def reference_rows(rows: list[dict]) -> list[pa.RecordBatch]:
    return [pa.RecordBatch.from_pylist(rows)] if rows else []


def same(got: list[pa.RecordBatch], expected: list[pa.RecordBatch]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.schema == b.schema
        assert repr(a.to_pylist()) == repr(b.to_pylist())  # NaN equals itself


def input_batches() -> list[pa.RecordBatch]:
    rng = np.random.default_rng(7)
    return [
        pa.record_batch({"key": rng.integers(0, 50, 200), "value": rng.integers(0, 1000, 200)})
        for _ in range(5)
    ]


def test_map_flat_map_filter_match_the_plain_loops():
    batches = input_batches() + [BATCHES["nested"], BATCHES["floats, strings, nulls"]]
    for batch in batches:
        # fresh operators for each input schema: an operator's output keeps one schema
        fmap = opened(MapOperator(lambda r: {**r, "n": len(r)}))
        flat = opened(FlatMapOperator(lambda r: [r, r] if len(str(r)) % 2 else None))
        keep = opened(FilterOperator(lambda r: len(str(r)) % 3))
        rows = batch.to_pylist()
        same(fmap.process(batch), reference_rows([{**r, "n": len(r)} for r in rows]))
        same(
            flat.process(batch),
            reference_rows([x for r in rows if len(str(r)) % 2 for x in (r, r)]),
        )
        mask = pa.array([bool(len(str(r)) % 3) for r in rows], type=pa.bool_())
        kept = batch.filter(mask)
        same(keep.process(batch), [kept] if kept.num_rows else [])


def add(a: dict, b: dict) -> dict:
    return {"key": a["key"], "value": a["value"] + b["value"]}


def reference_reduce(batches: list[pa.RecordBatch], key_of: Any) -> tuple[list, dict]:
    """The reduce loop over ``to_pylist`` with a naive store: outputs, and the snapshot
    ``key group -> pickled {state name: {key: value}}`` it implies."""
    groups: dict[int, dict[str, dict]] = {}
    outputs = []
    for batch in batches:
        out = []
        for record in batch.to_pylist():
            key = key_of(record)
            table = groups.setdefault(key_group_of(key, MAXP), {}).setdefault("reduce", {})
            previous = table.get(key)
            value = record if previous is None else add(previous, record)
            table[key] = value
            out.append(value)
        outputs.append(reference_rows(out))
    return outputs, {g: repr(t) for g, t in groups.items()}


def loaded(snapshot: dict[int, bytes]) -> dict[int, str]:
    """A backend snapshot as ``key group -> repr of its tables`` (insertion order counts;
    pickle's memo may differ with the identity of equal strings)."""
    return {group: repr(pickle.loads(blob)) for group, blob in snapshot.items()}


@pytest.mark.parametrize(
    "key,key_of",
    [
        ("key", lambda r: r["key"]),
        (["key", "value"], lambda r: (r["key"], r["value"])),
        (lambda r: r["key"] % 7, lambda r: r["key"] % 7),
    ],
    ids=["column", "columns", "function"],
)
def test_keyed_reduce_matches_the_plain_loop_and_its_snapshot(key, key_of):
    batches = input_batches()
    op = opened(KeyedReduceOperator(KeySelector(key), add))
    outputs = [op.process(b) for b in batches]
    expected_outputs, expected_snapshot = reference_reduce(batches, key_of)
    for got, expected in zip(outputs, expected_outputs):
        same(got, expected)
    assert loaded(op.snapshot_state(1)) == expected_snapshot
    assert op.backend.current_key == key_of(batches[-1].to_pylist()[-1])


def test_keyed_reduce_of_mixed_and_missing_keys():
    # A key function can mix types: 1 and 1.0 are one key (as in a dict), None is a key.
    def key_of(r: dict) -> Any:
        return {"one": 1, "one.0": 1.0, "none": None}.get(r["key"], r["key"])

    batch = pa.record_batch(
        {"key": ["a", "one", "none", "one.0", "a", "none"], "value": [1, 2, 3, 4, 5, 6]}
    )
    op = opened(KeyedReduceOperator(KeySelector(key_of), add))
    out = op.process(batch)
    expected_outputs, expected_snapshot = reference_reduce([batch], key_of)
    same(out, expected_outputs[0])
    assert [r["value"] for r in out[0].to_pylist()] == [1, 2, 3, 6, 6, 9]
    assert loaded(op.snapshot_state(1)) == expected_snapshot
    with pytest.raises(KeyError):
        opened(KeyedReduceOperator(KeySelector("key"), add)).process(
            pa.record_batch({"other": [1]})
        )


class CountingReduce(ReduceFunction):
    """Uses keyed state in reduce(): needs the current key set for every record."""

    def open(self, runtime_context: RuntimeContext) -> None:
        self.calls = runtime_context.get_state(ValueStateDescriptor("calls", 0))

    def reduce(self, a: dict, b: dict) -> dict:
        self.calls.update(self.calls.value() + 1)
        return {"key": a["key"], "value": self.calls.value()}


def test_reduce_function_with_keyed_state_sees_the_record_key():
    op = opened(KeyedReduceOperator(KeySelector("key"), CountingReduce()))
    batch = pa.record_batch({"key": [1, 2, 1, 1, 2], "value": [0, 0, 0, 0, 0]})
    out = op.process(batch)[0].to_pylist()
    assert [r["value"] for r in out] == [0, 0, 1, 2, 1]  # calls so far for the record's key
    assert dict(op.backend.items("calls")) == {1: 2, 2: 1}


class Running(KeyedProcessFunction):
    def open(self, runtime_context: RuntimeContext) -> None:
        self.total = runtime_context.get_state(ValueStateDescriptor("total", 0))

    def process_element(self, value: dict, ctx: KeyedProcessFunction.Context):
        self.total.update(self.total.value() + value["value"])
        yield {"key": ctx.get_current_key(), "total": self.total.value()}


@pytest.mark.parametrize("key", ["key", lambda r: r["key"]], ids=["column", "function"])
def test_keyed_process_matches_the_plain_loop(key):
    batches = input_batches()
    op = opened(KeyedProcessOperator(KeySelector(key), Running()))
    totals: dict = {}
    for batch in batches:
        expected = []
        for r in batch.to_pylist():
            totals[r["key"]] = totals.get(r["key"], 0) + r["value"]
            expected.append({"key": r["key"], "total": totals[r["key"]]})
        same(op.process(batch), reference_rows(expected))
    assert dict(op.backend.items("total")) == totals


# --- keyed state caches: snapshot, restore, rescale -----------------------------------------


def routed(batch: pa.RecordBatch, index: int, parallelism: int) -> pa.RecordBatch:
    owned = set(key_groups_of_subtask(index, parallelism, MAXP))
    keep = [key_group_of(k, MAXP) in owned for k in batch.column("key").to_pylist()]
    return batch.filter(pa.array(keep))


def final_values(ops: list[KeyedReduceOperator]) -> dict:
    out: dict = {}
    for op in ops:
        out.update(op.backend.items("reduce"))
    return out


def test_keyed_reduce_restores_and_rescales_like_an_uninterrupted_run():
    batches = input_batches()
    whole = opened(KeyedReduceOperator(KeySelector("key"), add))
    for b in batches:
        whole.process(b)

    first = opened(KeyedReduceOperator(KeySelector("key"), add))
    for b in batches[:3]:
        first.process(b)
    snapshot = first.snapshot_state(1)
    for parallelism in (1, 2, 3):
        ops = []
        for index in range(parallelism):
            op = opened(KeyedReduceOperator(KeySelector("key"), add), index, parallelism)
            op.restore_state([snapshot])
            for b in batches[3:]:
                part = routed(b, index, parallelism)
                expected_keys = part.column("key").to_pylist()
                out = op.process(part)
                assert [r["key"] for o in out for r in o.to_pylist()] == expected_keys
            ops.append(op)
        assert final_values(ops) == dict(whole.backend.items("reduce"))


def test_restore_after_use_drops_the_cached_tables():
    batches = input_batches()
    op = opened(KeyedReduceOperator(KeySelector("key"), add))
    op.process(batches[0])
    snapshot = op.snapshot_state(1)
    op.process(batches[1])  # the caches now point at tables the restore replaces
    op.restore_state([snapshot])
    after = op.process(batches[1])

    fresh = opened(KeyedReduceOperator(KeySelector("key"), add))
    fresh.restore_state([snapshot])
    same(after, fresh.process(batches[1]))
    assert loaded(op.snapshot_state(2)) == loaded(fresh.snapshot_state(2))


def test_bounded_key_caches_keep_state_exact(monkeypatch):
    monkeypatch.setattr(KeyedStateBackend, "_KEY_CACHE_SIZE", 4)
    batches = input_batches()
    small = opened(KeyedReduceOperator(KeySelector("key"), add))
    outputs = [small.process(b) for b in batches]
    expected_outputs, expected_snapshot = reference_reduce(batches, lambda r: r["key"])
    for got, expected in zip(outputs, expected_outputs):
        same(got, expected)
    assert loaded(small.snapshot_state(1)) == expected_snapshot
    assert len(small.backend.key_tables("reduce")) <= 4


def test_backend_key_tables_point_into_the_key_groups():
    backend = KeyedStateBackend(MAXP, range(MAXP))
    table = backend.table_of_key("k", "s")
    table["k"] = 1
    assert backend.key_tables("s")["k"] is table
    backend.set_current_key("k")
    assert backend.table("s") is table
    assert backend.snapshot() == {
        key_group_of("k", MAXP): pickle.dumps({"s": {"k": 1}}, protocol=pickle.HIGHEST_PROTOCOL)
    }


# --- a user function raising StopIteration is an error, never the end of the batch ---------


def _stops_at(n: int):
    def fn(*args: Any) -> Any:
        record = args[-1]
        if record["value"] == n:
            raise StopIteration("user code")
        return args[0] if len(args) == 1 else record

    return fn


def _stopping_operators():
    yield "map", MapOperator(_stops_at(5))
    yield "filter", FilterOperator(lambda r: _stops_at(5)(r) is not None)
    yield "flat_map", FlatMapOperator(lambda r: [_stops_at(5)(r)])
    yield "reduce (function)", KeyedReduceOperator(KeySelector("key"), _stops_at(5))
    yield (
        "key function (reduce)",
        KeyedReduceOperator(KeySelector(lambda r: _stops_at(5)(r)["key"]), lambda a, b: b),
    )
    yield (
        "key function (tuple-free, process)",
        KeyedProcessOperator(KeySelector(lambda r: _stops_at(5)(r)["key"]), _EchoProcess()),
    )


class _EchoProcess(KeyedProcessFunction):
    def process_element(self, value, ctx):
        yield value


@pytest.mark.parametrize("name", [n for n, _ in _stopping_operators()])
def test_stop_iteration_from_user_code_fails_the_batch_instead_of_dropping_records(name):
    op = dict(_stopping_operators())[name]
    opened(op)
    batch = pa.record_batch({"key": np.arange(10) % 3, "value": np.arange(10)})
    # Not pytest.raises: a StopIteration leaving its block is not reported as raised.
    try:
        out = op.process(batch)
    except StopIteration:
        pytest.fail(f"{name}: StopIteration escaped the operator (a caller's loop ends there)")
    except Exception as exc:  # noqa: BLE001 - any error naming it will do
        assert "StopIteration" in str(exc) and "'op'" in str(exc), str(exc)
    else:
        rows = sum(b.num_rows for b in out)
        pytest.fail(f"{name}: the batch of 10 records ended after {rows} without an error")
