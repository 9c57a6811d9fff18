"""What per-record operators make of the records user functions return: keys that differ
from record to record are unified (never dropped), an operator's output keeps one schema
from batch to batch (missing keys filled, a new key or type refused at the operator), and
anything that is not a record is named as such."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from rayflow.errors import RecordError, SchemaChangeError
from rayflow.functions import KeyedProcessFunction
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime.operators import (
    FlatMapOperator,
    KeyedProcessOperator,
    KeyedReduceOperator,
    MapOperator,
    OperatorContext,
)
from rayflow.runtime.records import OutputRecords, rows_to_batch


def opened(op: Any, name: str = "Op") -> Any:
    op.open(OperatorContext("job", name, "uid", 0, 1, 128, 0))
    return op


def values(batch: pa.RecordBatch) -> list[int]:
    return batch.column("value").to_pylist()


def numbers(n: int, start: int = 0) -> pa.RecordBatch:
    return pa.record_batch({"value": list(range(start, start + n))})


# --- keys that differ within one batch ----------------------------------------------------


def test_a_key_only_later_records_have_is_kept():
    op = opened(MapOperator(lambda r: {**r, "odd": 1} if r["value"] % 2 else dict(r)))
    (batch,) = op.process(numbers(4))
    assert batch.schema.names == ["value", "odd"]
    assert batch.to_pylist() == [
        {"value": 0, "odd": None},
        {"value": 1, "odd": 1},
        {"value": 2, "odd": None},
        {"value": 3, "odd": 1},
    ]


def test_keys_are_unified_in_order_of_first_appearance():
    rows = [{"a": 1, "b": "x"}, {"b": "y", "c": 2.5}, {"a": 3}, {"c": None, "d": [1]}]
    batch = rows_to_batch(rows)
    assert batch.schema.names == ["a", "b", "c", "d"]
    assert batch.to_pylist() == [
        {"a": 1, "b": "x", "c": None, "d": None},
        {"a": None, "b": "y", "c": 2.5, "d": None},
        {"a": 3, "b": None, "c": None, "d": None},
        {"a": None, "b": None, "c": None, "d": [1]},
    ]


def test_same_keys_in_another_order_and_same_count_but_other_keys():
    assert rows_to_batch([{"a": 1, "b": 2}, {"b": 3, "a": 4}]).to_pylist() == [
        {"a": 1, "b": 2},
        {"a": 4, "b": 3},
    ]
    # as many keys as the first record, but not the same ones
    assert rows_to_batch([{"a": 1, "b": 2}, {"a": 3, "c": 4}]).to_pylist() == [
        {"a": 1, "b": 2, "c": None},
        {"a": 3, "b": None, "c": 4},
    ]


@pytest.mark.parametrize("kind", ["flat_map", "reduce", "process"])
def test_flat_map_reduce_and_process_unify_keys_too(kind):
    batch = pa.record_batch({"k": [1, 1, 2], "value": [1, 2, 3]})
    if kind == "flat_map":
        op = opened(FlatMapOperator(lambda r: [r, {**r, "twice": r["value"] * 2}]))
        expected_extra = [None, 2, None, 4, None, 6]
    elif kind == "reduce":
        op = opened(
            KeyedReduceOperator(
                KeySelector("k"), lambda a, b: {**b, "value": a["value"] + b["value"], "n": 2}
            )
        )
        expected_extra = [None, 2, None]
    else:

        class Tag(KeyedProcessFunction):
            def process_element(self, value, ctx):
                yield {**value, "twice": value["value"] * 2} if value["k"] == 1 else value

        op = opened(KeyedProcessOperator(KeySelector("k"), Tag()))
        expected_extra = [2, 4, None]
    (out,) = op.process(batch)
    extra = out.schema.names[-1]
    assert out.column(extra).to_pylist() == expected_extra


# --- one schema from batch to batch -------------------------------------------------------


def test_a_key_missing_from_a_later_batch_is_filled_with_nulls():
    op = opened(MapOperator(lambda r: {"value": r["value"], "tag": "t"} if r["value"] < 3 else r))
    first, second = op.process(numbers(3))[0], op.process(numbers(2, start=3))[0]
    assert second.schema == first.schema
    assert second.to_pylist() == [{"value": 3, "tag": None}, {"value": 4, "tag": None}]


def test_a_later_batch_in_another_key_order_or_a_castable_type_keeps_the_schema():
    op = opened(MapOperator(lambda r: r))
    first = op.process(pa.record_batch({"a": [1.5], "b": ["x"]}))[0]
    second = op.process(pa.record_batch({"b": ["y"], "a": [2]}))[0]  # int into a float column
    assert second.schema == first.schema
    assert second.to_pylist() == [{"a": 2.0, "b": "y"}]


def test_a_key_new_in_a_later_batch_fails_at_the_operator_naming_it():
    op = opened(MapOperator(lambda r: {**r, "late": 1} if r["value"] >= 3 else r), "Enrich")
    op.process(numbers(3))
    with pytest.raises(SchemaChangeError) as info:
        op.process(numbers(2, start=3))
    message = str(info.value)
    assert "map 'Enrich'" in message and "'late'" in message
    assert "{'value': 3, 'late': 1}" in message  # a sample record
    assert "output_type" in message  # how to declare it


def test_a_type_change_in_a_later_batch_fails_at_the_operator_naming_the_key():
    op = opened(MapOperator(lambda r: {"v": r["value"] if r["value"] < 3 else "three"}), "M")
    op.process(numbers(3))
    with pytest.raises(SchemaChangeError) as info:
        op.process(numbers(1, start=3))
    message = str(info.value)
    assert "map 'M'" in message and "'v'" in message and "int64" in message
    assert "{'v': 'three'}" in message


def test_a_key_that_was_only_none_and_then_gets_a_value_is_explained():
    op = opened(MapOperator(lambda r: {"v": None if r["value"] < 3 else "x"}), "M")
    op.process(numbers(3))
    with pytest.raises(SchemaChangeError) as info:
        op.process(numbers(1, start=3))
    assert "only None" in str(info.value) and "output_type" in str(info.value)


def test_a_nested_field_is_never_dropped_by_the_schema_of_earlier_batches():
    op = opened(MapOperator(lambda r: {"d": {"x": 1} if r["value"] < 3 else {"x": 1, "y": 2}}))
    op.process(numbers(3))
    with pytest.raises(SchemaChangeError):
        op.process(numbers(1, start=3))


def test_a_declared_output_type_holds_what_inference_cannot():
    schema = pa.schema([("value", pa.int64()), ("note", pa.string()), ("late", pa.float64())])
    op = opened(MapOperator(lambda r: {"value": r["value"], "note": None}, schema))
    first = op.process(numbers(2))[0]
    assert first.schema == schema
    op.function = lambda r: {"value": r["value"], "note": "n", "late": 1}
    op.open(OperatorContext("job", "Op", "uid", 0, 1, 128, 0))
    second = op.process(numbers(1, start=2))[0]
    assert second.schema == schema
    assert second.to_pylist() == [{"value": 2, "note": "n", "late": 1.0}]
    op.function = lambda r: {"value": r["value"], "other": 1}
    op.open(OperatorContext("job", "Op", "uid", 0, 1, 128, 0))
    with pytest.raises(SchemaChangeError, match="'other'"):
        op.process(numbers(1))


def test_mixed_types_within_one_batch_name_the_key_and_records():
    op = opened(MapOperator(lambda r: {"v": r["value"] if r["value"] else "zero"}), "Mixed")
    with pytest.raises(SchemaChangeError) as info:
        op.process(numbers(3))
    message = str(info.value)
    assert "map 'Mixed'" in message and "'v'" in message and "'zero'" in message


# --- not a record -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "returned,type_name",
    [(2, "int"), (None, "None"), ((1, 2), "tuple"), ("s", "str"), ([{"a": 1}], "list")],
)
def test_map_returning_a_non_dict_names_operator_and_type(returned, type_name):
    op = opened(MapOperator(lambda r: returned), "Double")
    with pytest.raises(RecordError) as info:
        op.process(numbers(2))
    expected = f"map 'Double' must return a dict (a record), got {type_name}"
    assert str(info.value).startswith(expected)


def test_a_non_dict_after_dicts_in_the_batch_is_found():
    op = opened(MapOperator(lambda r: r if r["value"] < 5 else r["value"]), "Late")
    with pytest.raises(RecordError, match=r"^map 'Late' must return a dict \(a record\), got int"):
        op.process(numbers(8))


def test_keys_must_be_strings():
    op = opened(MapOperator(lambda r: {1: "a"}), "IntKeys")
    with pytest.raises(RecordError, match=r"map .IntKeys.: .*must be str; got key 1 "):
        op.process(numbers(1))


def test_flat_map_items_and_returns_are_checked():
    op = opened(FlatMapOperator(lambda r: [r["value"]]), "Split")
    with pytest.raises(RecordError, match=r"^flat_map 'Split' must return .*dicts.*got an item of"):
        op.process(numbers(2))
    op = opened(FlatMapOperator(lambda r: 5), "Split")
    with pytest.raises(RecordError, match=r"^flat_map 'Split' must return .*, got int"):
        op.process(numbers(2))
    op = opened(FlatMapOperator(lambda r: r), "One")  # one dict, not an iterable of them
    with pytest.raises(RecordError, match=r"flat_map 'One'.*returned a dict"):
        op.process(numbers(2))


def test_reduce_returning_a_non_dict_is_named_before_the_next_call_fails():
    op = opened(KeyedReduceOperator(KeySelector("k"), lambda a, b: a["v"] + b["v"]), "Sum")
    expected = r"^reduce 'Sum' must return a dict \(a record\), got int"
    with pytest.raises(RecordError, match=expected):
        op.process(pa.record_batch({"k": [1, 1, 1], "v": [1, 2, 3]}))
    op = opened(KeyedReduceOperator(KeySelector("k"), lambda a, b: None), "Sum")
    with pytest.raises(RecordError, match=r"got None"):
        op.process(pa.record_batch({"k": [1, 1], "v": [1, 2]}))


def test_process_items_and_returns_are_checked():
    class Bad(KeyedProcessFunction):
        def process_element(self, value, ctx):
            return value["v"]

    class BadItems(KeyedProcessFunction):
        def process_element(self, value, ctx):
            yield (value["k"], value["v"])

    batch = pa.record_batch({"k": [1, 2], "v": [1, 2]})
    with pytest.raises(RecordError, match=r"^process 'P' must .*, got int"):
        opened(KeyedProcessOperator(KeySelector("k"), Bad()), "P").process(batch)
    with pytest.raises(RecordError, match=r"^process 'P' must .*got an item of type tuple"):
        opened(KeyedProcessOperator(KeySelector("k"), BadItems()), "P").process(batch)


def test_output_records_keeps_the_first_schema_it_emitted():
    out = OutputRecords("map 'M'")
    assert out.build([]) == []
    (first,) = out.build([{"a": 1}])
    assert out.schema == first.schema


def test_decimals_inferred_with_fewer_digits_later_fit_the_first_type():
    from decimal import Decimal

    out = OutputRecords("map 'M'")
    (first,) = out.build([{"d": Decimal("1.25")}])
    (second,) = out.build([{"d": Decimal("2.5")}])
    assert second.schema == first.schema
    assert second.to_pylist() == [{"d": Decimal("2.50")}]
    with pytest.raises(SchemaChangeError, match="declare the wider type with output_type"):
        out.build([{"d": Decimal("1000.5")}])


def test_a_float_in_a_later_batch_of_an_int_column_is_never_truncated():
    out = OutputRecords("map 'M'")
    out.build([{"v": 1}])
    with pytest.raises(SchemaChangeError, match="'v' is int64"):
        out.build([{"v": 2.5}])
    out = OutputRecords("map 'M'")
    out.build([{"v": 1.5}])
    (batch,) = out.build([{"v": 2}, {"v": 3}])  # ints into a float column
    assert batch.column("v").to_pylist() == [2.0, 3.0]


@pytest.mark.parametrize(
    "column, values",
    [
        (pa.dictionary(pa.int8(), pa.string()), ["a", "b", "a", None]),
        (pa.dictionary(pa.int32(), pa.int64()), [7, 7, 8, None]),
        (pa.dictionary(pa.int16(), pa.float64()), [1, 2.5, 1, None]),  # ints widen first
        (pa.large_binary(), [b"a", b"", None, b"c"]),
        (pa.large_string(), ["a", "", None, "c"]),
    ],
)
def test_a_declared_dictionary_or_large_column_takes_plain_values(column, values):
    """A column declared dictionary-encoded takes the plain values of its value type (they
    are encoded), and a large text or binary column takes text or bytes: not refused as a
    type change."""
    out = OutputRecords("map 'M'", pa.schema([("c", column)]))
    for _ in range(2):  # the first batch and a later one
        [batch] = out.build([{"c": v} for v in values])
        assert batch.schema.field("c").type == column
        assert batch.column(0).to_pylist() == values


@pytest.mark.parametrize(
    "column, value",
    [
        (pa.string_view(), "a"),
        (pa.binary_view(), b"a"),
        (pa.run_end_encoded(pa.int32(), pa.int64()), 1),
    ],
)
def test_a_declared_view_or_run_end_encoded_column_is_refused_naming_it(column, value):
    """Arrow has no take or filter for view or run-end-encoded arrays (a keyed shuffle and
    a filter use them): such a declared column is refused at the operator, by name."""
    out = OutputRecords("map 'M'", pa.schema([("c", column)]))
    with pytest.raises(SchemaChangeError, match="map 'M'.*'c'"):
        out.build([{"c": value}])


def test_a_dictionary_whose_indices_overflow_says_how_many_values_it_holds():
    out = OutputRecords("map 'M'", pa.schema([("c", pa.dictionary(pa.int8(), pa.int64()))]))
    [batch] = out.build([{"c": v} for v in range(128)])  # int8 indices count 128
    assert batch.column(0).to_pylist() == list(range(128))
    with pytest.raises(SchemaChangeError, match=r"map 'M'.*'c'.*129 distinct.*int8"):
        out.build([{"c": v} for v in range(129)])


#: declared dictionary and large columns, with values for them (a null, repeats)
_DECLARED = [
    (pa.dictionary(pa.int8(), pa.string()), ["a", "b", "a", None, "c", "b"]),
    (pa.dictionary(pa.int32(), pa.int64()), [7, 7, None, -3, 7, 2**40]),
    (pa.large_string(), ["a", "b", None, "a" * 20, "", "b"]),
    (pa.large_binary(), [b"a", b"b", None, b"a" * 20, b"", b"b"]),
]


def _declared(column: pa.DataType, values: list[Any]) -> pa.RecordBatch:
    """What a map declaring ``c`` as ``column`` emits for ``values`` (``k`` numbers them)."""
    schema = pa.schema([("k", pa.int64()), ("c", column)])
    op = opened(MapOperator(lambda r: {"k": r["value"], "c": values[r["value"]]}, schema))
    [batch] = op.process(numbers(len(values)))
    assert batch.schema == schema
    return batch


@pytest.mark.parametrize(
    "column, values, key",
    [(*case, "k") for case in _DECLARED] + [(*case, "c") for case in _DECLARED],
)
def test_a_declared_dictionary_or_large_column_is_routed_by_key_as_its_plain_values(
    column, values, key
):
    """A keyed shuffle of what such an operator emits sends each record where the plain
    value's record goes (keyed state of one key is never split over subtasks), keeping
    the declared type."""
    from rayflow.plan.partitioners import Partitioner, PartitionerSpec, PartitionKind

    batch = _declared(column, values)
    plain = pa.record_batch({"k": list(range(len(values))), "c": values})
    spec = PartitionerSpec(PartitionKind.HASH, KeySelector(key))
    routed = Partitioner(spec, 0, 3, 128).route(batch)
    expected = Partitioner(spec, 0, 3, 128).route(plain)
    assert [(t, b.to_pylist()) for t, b in routed] == [(t, b.to_pylist()) for t, b in expected]
    assert all(b.schema == batch.schema for _, b in routed)


@pytest.mark.parametrize("column, values", _DECLARED)
def test_a_filter_keeps_records_of_a_declared_dictionary_or_large_column(column, values):
    from rayflow.runtime.operators import FilterOperator

    batch = _declared(column, values)
    op = opened(FilterOperator(lambda r: r["k"] % 2 == 0))
    [kept] = op.process(batch)
    assert kept.schema == batch.schema
    assert kept.column("c").to_pylist() == values[::2]


@pytest.mark.parametrize("column, values", _DECLARED)
def test_a_keyed_count_by_a_declared_dictionary_or_large_column_counts_plain_values(column, values):
    from rayflow.runtime.operators import KeyedAggregateOperator

    op = opened(KeyedAggregateOperator(KeySelector("c"), "count", None))
    counted = {}
    for batch in op.process(_declared(column, values)):
        counted.update(zip(batch.column("c").to_pylist(), batch.column("count").to_pylist()))
    assert counted == {v: values.count(v) for v in values}


# --- records without keys -----------------------------------------------------------------


@pytest.mark.parametrize("first", [True, False], ids=["first batch", "later batch"])
def test_records_with_no_keys_fail_at_the_operator_instead_of_vanishing(first: bool) -> None:
    op = opened(MapOperator(lambda r: {} if r["value"] >= 100 else r), "Blank")
    if not first:
        assert values(op.process(numbers(3))[0]) == [0, 1, 2]
    with pytest.raises(RecordError, match=r"map 'Blank': got records with no keys \(\{\}\)"):
        op.process(numbers(5, start=100))
    # a record without keys among records with keys is a record of nulls, as before
    (batch,) = op.process(pa.record_batch({"value": [1, 100, 2]}))
    assert values(batch) == [1, None, 2]
