"""Per-record operators take a big batch in slices once their output schema is settled:
the records out, their order, their timestamps, the keyed state and the batches
downstream are what the whole batch gives; a batch whose types a slice could not infer
(a key None in its first rows) is still taken whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rayflow.eventtime.strategy import split_timestamps, with_timestamps
from rayflow.functions import KeyedProcessFunction
from rayflow.plan.partitioners import KeySelector
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
