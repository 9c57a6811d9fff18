"""Watermark strategies (PyFlink's ``WatermarkStrategy``): where a record's event time
comes from and how far behind the largest timestamp seen the watermark stays.

Timestamps are integer milliseconds (as in Flink). A source with a strategy gives every
batch a timestamp column (:data:`TIMESTAMP_COLUMN`) and, per split, generates watermarks
once per batch (see :mod:`rayflow.eventtime.source_watermarks`).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "Duration",
    "TimestampAssigner",
    "WatermarkStrategy",
    "TIMESTAMP_COLUMN",
    "MIN_WATERMARK",
    "MAX_WATERMARK",
]

#: The column that carries each record's event timestamp (int64 milliseconds).
TIMESTAMP_COLUMN = "__rayflow_timestamp"
#: The watermark before any was generated, and the one at the end of input.
MIN_WATERMARK = -(2**63)
MAX_WATERMARK = 2**63 - 1


@dataclass(frozen=True, order=True)
class Duration:
    """A span of time in milliseconds (PyFlink's ``Duration``)."""

    milliseconds: int

    @staticmethod
    def of_millis(millis: int) -> Duration:
        return Duration(int(millis))

    @staticmethod
    def of_seconds(seconds: float) -> Duration:
        return Duration(int(round(seconds * 1000)))

    @staticmethod
    def of_minutes(minutes: float) -> Duration:
        return Duration(int(round(minutes * 60_000)))

    @staticmethod
    def of_hours(hours: float) -> Duration:
        return Duration(int(round(hours * 3_600_000)))

    @staticmethod
    def of_days(days: float) -> Duration:
        return Duration(int(round(days * 86_400_000)))

    @staticmethod
    def zero() -> Duration:
        return Duration(0)

    def to_milliseconds(self) -> int:
        return self.milliseconds


def to_millis(value: Duration | int | float | _dt.timedelta, what: str) -> int:
    """Milliseconds of a ``Duration``, a ``timedelta`` or a number of milliseconds."""
    if isinstance(value, Duration):
        millis = value.milliseconds
    elif isinstance(value, _dt.timedelta):
        millis = int(value / _dt.timedelta(milliseconds=1))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        millis = int(value)
    else:
        raise TypeError(f"{what}: expected a Duration, got {type(value).__name__}")
    if millis < 0:
        raise ValueError(f"{what}: must not be negative, got {millis} ms")
    return millis


class TimestampAssigner:
    """Extracts a record's event timestamp (ms); ``record_timestamp`` is the timestamp it
    had before (None at a source)."""

    def extract_timestamp(self, value: dict[str, Any], record_timestamp: int | None) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class WatermarkStrategy:
    """How a source assigns timestamps and generates watermarks.

    ``for_bounded_out_of_orderness(d)``: the watermark is the largest timestamp seen
    minus ``d`` minus 1 ms (records up to ``d`` late are on time);
    ``for_monotonous_timestamps()``: the same with ``d = 0``. Build the rest with
    ``with_timestamp_assigner`` (a column name, a :class:`TimestampAssigner` or a function
    of the record) and ``with_idleness`` (a split that gave no data for that long stops
    holding the watermark back).
    """

    out_of_orderness_ms: int | None = 0
    assigner: Any = None
    idleness_ms: int | None = None

    @staticmethod
    def for_bounded_out_of_orderness(max_out_of_orderness: Duration) -> WatermarkStrategy:
        millis = to_millis(max_out_of_orderness, "for_bounded_out_of_orderness")
        return WatermarkStrategy(out_of_orderness_ms=millis)

    @staticmethod
    def for_monotonous_timestamps() -> WatermarkStrategy:
        return WatermarkStrategy(out_of_orderness_ms=0)

    @staticmethod
    def no_watermarks() -> WatermarkStrategy:
        """Timestamps (if an assigner is given) but no watermarks."""
        return WatermarkStrategy(out_of_orderness_ms=None)

    def with_timestamp_assigner(
        self, assigner: str | TimestampAssigner | Callable[[dict[str, Any]], int]
    ) -> WatermarkStrategy:
        if not (isinstance(assigner, (str, TimestampAssigner)) or callable(assigner)):
            raise TypeError(
                "with_timestamp_assigner: expected a column name, a TimestampAssigner or a "
                f"function of the record, got {type(assigner).__name__}"
            )
        return replace(self, assigner=assigner)

    def with_idleness(self, idle_timeout: Duration) -> WatermarkStrategy:
        return replace(self, idleness_ms=to_millis(idle_timeout, "with_idleness"))

    @property
    def generates_watermarks(self) -> bool:
        return self.out_of_orderness_ms is not None

    def timestamps_of(self, batch: pa.RecordBatch) -> pa.Array:
        """The event timestamps of ``batch``'s records, int64 milliseconds."""
        assigner = self.assigner
        if assigner is None:
            index = batch.schema.get_field_index(TIMESTAMP_COLUMN)
            if index < 0:
                raise ValueError(
                    "WatermarkStrategy: no timestamp assigner, and the records carry no "
                    "timestamp; use .with_timestamp_assigner(column or function)"
                )
            return batch.column(index)
        if isinstance(assigner, str):
            index = batch.schema.get_field_index(assigner)
            if index < 0:
                raise KeyError(
                    f"with_timestamp_assigner({assigner!r}): no such column "
                    f"(columns: {batch.schema.names})"
                )
            return column_millis(batch.column(index), assigner)
        from rayflow.runtime.records import batch_to_rows

        extract = (
            assigner.extract_timestamp
            if isinstance(assigner, TimestampAssigner)
            else (lambda record, _previous: assigner(record))
        )
        previous = (
            batch.column(TIMESTAMP_COLUMN).to_pylist()
            if TIMESTAMP_COLUMN in batch.schema.names
            else None
        )
        rows = batch_to_rows(without_timestamps(batch))
        if previous is None:
            values = [extract(r, None) for r in rows]
        else:
            values = [extract(r, p) for r, p in zip(rows, previous)]
        return pa.array(np.asarray(values, dtype=np.int64), type=pa.int64())


def column_millis(column: pa.Array, name: str) -> pa.Array:
    """A timestamp column as int64 milliseconds: integers are taken as milliseconds,
    Arrow timestamps and dates are converted."""
    t = column.type
    if pa.types.is_timestamp(t):
        return pc.cast(pc.cast(column, pa.timestamp("ms", t.tz)), pa.int64())
    if pa.types.is_date(t):
        return pc.cast(pc.cast(column, pa.timestamp("ms")), pa.int64())
    if pa.types.is_integer(t):
        return pc.cast(column, pa.int64())
    if pa.types.is_floating(t):
        return pc.cast(pc.floor(column), pa.int64())
    raise TypeError(
        f"timestamp column {name!r} is {t}; it must hold integers (milliseconds), "
        "timestamps or dates"
    )


def without_timestamps(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` without its timestamp column (as user functions see records)."""
    index = batch.schema.get_field_index(TIMESTAMP_COLUMN)
    return batch if index < 0 else batch.remove_column(index)


def with_timestamps(batch: pa.RecordBatch, timestamps: pa.Array) -> pa.RecordBatch:
    """``batch`` with ``timestamps`` as its timestamp column (replacing one it had)."""
    index = batch.schema.get_field_index(TIMESTAMP_COLUMN)
    if index >= 0:
        return batch.set_column(index, TIMESTAMP_COLUMN, timestamps)
    return batch.append_column(TIMESTAMP_COLUMN, timestamps)


def split_timestamps(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.Array | None]:
    """``batch`` without its timestamp column, and that column (None if it had none)."""
    index = batch.schema.get_field_index(TIMESTAMP_COLUMN)
    if index < 0:
        return batch, None
    return batch.remove_column(index), batch.column(index)


def attach_timestamps(
    batches: list[pa.RecordBatch], timestamps: list[int] | None
) -> list[pa.RecordBatch]:
    """``batches`` (built from records, in order) with ``timestamps``, one per record."""
    if timestamps is None:
        return batches
    out = []
    offset = 0
    for batch in batches:
        column = pa.array(timestamps[offset : offset + batch.num_rows], type=pa.int64())
        offset += batch.num_rows
        out.append(with_timestamps(batch, column))
    return out
