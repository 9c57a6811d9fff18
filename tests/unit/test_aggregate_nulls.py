"""Built-in aggregations over nulls and over fields of the wrong type: Flink SQL's null
semantics (nulls skipped, the aggregate of only nulls is null), a count of skipped nulls
in the operator's metrics, and the field's type checked on the first batch."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rayflow.plan.partitioners import KeySelector
from rayflow.runtime.operators import KeyedAggregateOperator, OperatorContext


def aggregate(kind: str, field: str | None = "v", key: object = "k") -> KeyedAggregateOperator:
    op = KeyedAggregateOperator(KeySelector(key), kind, field)
    op.open(OperatorContext("job", "Agg", "uid", 0, 1, 128, 0))
    return op


def rows(op: KeyedAggregateOperator, batch: pa.RecordBatch) -> dict:
    (out,) = op.process(batch)
    return dict(zip(out.column(0).to_pylist(), out.column(1).to_pylist()))


@pytest.mark.parametrize("key", ["k", lambda r: r["k"]], ids=["column", "function"])
def test_sum_skips_nulls_and_counts_them(key):
    op = aggregate("sum", key=key)
    assert rows(op, pa.record_batch({"k": [1, 1, 2], "v": [1, 2, 5]})) == {1: 3, 2: 5}
    assert rows(op, pa.record_batch({"k": [1, 2, 3], "v": [None, 4, None]})) == {
        1: 3,
        2: 9,
        3: None,  # only nulls so far: null, as SUM in Flink SQL
    }
    assert op.metrics() == {"nulls_skipped": 2}
    assert rows(op, pa.record_batch({"k": [3], "v": [7]})) == {3: 7}


def test_a_batch_without_the_field_after_batches_with_it_counts_as_nulls():
    op = aggregate("sum")
    rows(op, pa.record_batch({"k": [1], "v": [1]}))
    assert rows(op, pa.record_batch({"k": [1, 2]})) == {1: 1, 2: None}
    assert op.metrics() == {"nulls_skipped": 2}


@pytest.mark.parametrize("kind,expected", [("min", {1: 2, 2: None}), ("max", {1: 5, 2: None})])
def test_min_and_max_skip_nulls(kind, expected):
    op = aggregate(kind)
    rows(op, pa.record_batch({"k": [1, 1, 2], "v": [5, None, None]}))
    assert rows(op, pa.record_batch({"k": [1, 2], "v": [2, None]})) == expected
    assert op.metrics() == {"nulls_skipped": 3}


def test_the_output_keeps_one_schema_when_the_first_totals_are_null():
    op = aggregate("sum")
    (first,) = op.process(pa.record_batch({"k": [1], "v": pa.array([None], pa.int64())}))
    (second,) = op.process(pa.record_batch({"k": [1], "v": [3]}))
    assert first.schema == second.schema
    assert second.column("v").to_pylist() == [3]


def test_count_has_no_null_metric():
    op = aggregate("count", None)
    assert rows(op, pa.record_batch({"k": [1, 1]})) == {1: 2}
    assert op.metrics() == {}


@pytest.mark.parametrize(
    "kind,column,message",
    [
        ("sum", ["a", "b"], r"^sum\('v'\): field 'v' is string; sum needs a numeric field"),
        ("sum", [True, False], r"^sum\('v'\): field 'v' is bool; sum needs a numeric field"),
        ("min", [[1], [2]], r"^min\('v'\): field 'v' is list<item: int64>; min needs a field"),
    ],
)
def test_a_field_of_the_wrong_type_fails_on_the_first_batch(kind, column, message):
    op = aggregate(kind)
    with pytest.raises(TypeError, match=message):
        op.process(pa.record_batch({"k": [1, 2], "v": column}))


def test_min_and_max_of_strings_are_ordered():
    op = aggregate("max")
    assert rows(op, pa.record_batch({"k": [1, 1], "v": ["a", "c"]})) == {1: "c"}
    assert rows(op, pa.record_batch({"k": [1], "v": ["b"]})) == {1: "c"}


def test_a_field_never_seen_is_an_error():
    with pytest.raises(KeyError, match=r"sum\('v'\): no such column"):
        aggregate("sum").process(pa.record_batch({"k": [1]}))


def test_a_float_total_after_int_totals_is_not_truncated():
    op = aggregate("sum")
    rows(op, pa.record_batch({"k": [1], "v": [1]}))
    assert rows(op, pa.record_batch({"k": [1], "v": [1.5]})) == {1: 2.5}


@pytest.mark.parametrize("kind", ["sum", "count", "min", "max"])
@pytest.mark.parametrize("field_type", [pa.int64(), pa.int32(), pa.float64()])
def test_small_batches_aggregate_as_large_ones(kind, field_type):
    """A batch of up to ``small_batch_rows`` rows is aggregated in Python where that is
    exact: the same rows, types and running totals as Arrow's group-by gives them."""
    import random

    rng = random.Random(7)
    field = None if kind == "count" else "v"
    small, large = aggregate(kind, field), aggregate(kind, field)
    large.small_batch_rows = 0  # Arrow's group-by for every batch
    big = 2**30 if field_type == pa.int32() else 2**40
    for rows in [1, 2, 5, 40, 300, 512, 513, 3, 1]:
        keys = [rng.choice([None, *range(-3, 40)]) for _ in range(rows)]
        values = [rng.choice([None, -big, 7, 0, big, rng.randint(-9, 9)]) for _ in keys]
        batch = pa.record_batch(
            {"k": pa.array(keys, pa.int64()), "v": pa.array(values, field_type)}
        )
        (a,) = small.process(batch)
        (b,) = large.process(batch)
        assert a.schema == b.schema
        assert dict(zip(a.column(0).to_pylist(), a.column(1).to_pylist())) == dict(
            zip(b.column(0).to_pylist(), b.column(1).to_pylist())
        )
        assert sorted(a.column(0).to_pylist(), key=repr) == sorted(
            b.column(0).to_pylist(), key=repr
        )
    assert small.metrics() == large.metrics()


@pytest.mark.parametrize("small_batch_rows", [512, 0], ids=["python", "arrow"])
@pytest.mark.parametrize(
    ("field_type", "batches"),
    [
        (pa.int64(), [[2**62, 2**62]]),  # within one batch (Arrow's group-by wraps it)
        (pa.int64(), [[2**62], [2**62]]),  # across batches
        (pa.int64(), [[-(2**62)], [-(2**62)], [-1]]),
        (pa.uint64(), [[2**63, 2**63]]),
    ],
    ids=["int64-in-a-batch", "int64-across", "int64-below", "uint64"],
)
def test_an_integer_sum_out_of_range_is_an_error_naming_the_key(
    small_batch_rows, field_type, batches
):
    """Neither wrapped around (Arrow's sum does that silently) nor emitted, whatever the
    batch sizes: an error naming the operator, the key and the total."""
    op = aggregate("sum")
    op.small_batch_rows = small_batch_rows
    *fine, last = batches
    for values in fine:
        rows(op, pa.record_batch({"k": [4] * len(values), "v": pa.array(values, field_type)}))
    batch = pa.record_batch({"k": [4] * len(last), "v": pa.array(last, field_type)})
    with pytest.raises(OverflowError, match=r"sum\('v'\) of 'Agg': the total of key 4 is"):
        op.process(batch)


@pytest.mark.parametrize("small_batch_rows", [512, 0], ids=["python", "arrow"])
def test_sums_near_the_ends_of_their_range_are_exact(small_batch_rows):
    op = aggregate("sum")
    op.small_batch_rows = small_batch_rows
    big = pa.record_batch({"k": [1, 1, 2], "v": pa.array([2**62, 2**62 - 1, -(2**63)])})
    assert rows(op, big) == {1: 2**63 - 1, 2: -(2**63)}
    unsigned = aggregate("sum")
    unsigned.small_batch_rows = small_batch_rows
    batch = pa.record_batch({"k": [1, 1], "v": pa.array([2**63, 2**63 - 1], pa.uint64())})
    (out,) = unsigned.process(batch)
    assert out.column(1).type == pa.uint64() and out.column(1).to_pylist() == [2**64 - 1]


@pytest.mark.parametrize("small_batch_rows", [512, 0], ids=["python", "arrow"])
def test_nan_is_one_key_across_batches_and_a_restore(small_batch_rows):
    """As Java's ``Double.equals`` has it (and Arrow's group-by within a batch): every
    NaN key counts towards one key, also after its state was snapshotted and restored."""
    nan = float("nan")
    op = aggregate("count", None)
    op.small_batch_rows = small_batch_rows
    (out,) = op.process(pa.record_batch({"k": pa.array([nan, nan, 1.0, nan])}))
    assert dict(zip(map(repr, out.column(0).to_pylist()), out.column(1).to_pylist())) == {
        "nan": 3,
        "1.0": 1,
    }
    assert out.num_rows == 2
    (out,) = op.process(pa.record_batch({"k": pa.array([nan])}))
    assert out.column(1).to_pylist() == [4]
    snapshot = op.snapshot_state(1)
    restored = aggregate("count", None)
    restored.small_batch_rows = small_batch_rows
    restored.restore_state([snapshot])
    (out,) = restored.process(pa.record_batch({"k": pa.array([nan, 2.0])}))
    assert dict(zip(map(repr, out.column(0).to_pylist()), out.column(1).to_pylist())) == {
        "nan": 5,
        "2.0": 1,
    }
    assert len(list(restored.backend.items(restored.state_name))) == 3
