"""Window assigners (PyFlink's names): which windows a record belongs to.

Windows are :class:`TimeWindow` s ``[start, end)`` in milliseconds. Tumbling and sliding
assigners work on whole timestamp columns (numpy); session assigners give each record
the window ``[t, t + gap)``, which the window operator merges with the key's sessions
it overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayflow.eventtime.strategy import Duration, to_millis

__all__ = [
    "TimeWindow",
    "WindowAssigner",
    "TumblingEventTimeWindows",
    "TumblingProcessingTimeWindows",
    "SlidingEventTimeWindows",
    "SlidingProcessingTimeWindows",
    "EventTimeSessionWindows",
    "ProcessingTimeSessionWindows",
]


@dataclass(frozen=True, order=True, slots=True)
class TimeWindow:
    """The window ``[start, end)``; ``max_timestamp()`` is its last millisecond."""

    start: int
    end: int

    def max_timestamp(self) -> int:
        return self.end - 1

    def intersects(self, other: TimeWindow) -> bool:
        return self.start <= other.end and self.end >= other.start

    def cover(self, other: TimeWindow) -> TimeWindow:
        return TimeWindow(min(self.start, other.start), max(self.end, other.end))


class WindowAssigner:
    """Assigns records to windows; ``event_time`` says which clock drives them."""

    event_time = True
    merging = False

    def assign(self, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """For int64 ``timestamps``: (row index, window start) per (record, window) pair,
        and the windows' size. Not for merging assigners."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


def _window_start(timestamps: np.ndarray, offset: int, size: int) -> np.ndarray:
    # numpy's mod takes the divisor's sign: the start is at or before the timestamp
    return timestamps - np.mod(timestamps - offset, size)


class _Tumbling(WindowAssigner):
    def __init__(self, size: int, offset: int) -> None:
        if size <= 0:
            raise ValueError(f"{type(self).__name__}: size must be positive, got {size} ms")
        if abs(offset) >= size:
            raise ValueError(f"{type(self).__name__}: |offset| must be less than the size")
        self.size = size
        self.offset = offset

    def assign(self, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        rows = np.arange(len(timestamps), dtype=np.int64)
        return rows, _window_start(timestamps, self.offset, self.size), self.size

    def describe(self) -> str:
        return f"{type(self).__name__}({self.size} ms)"


class TumblingEventTimeWindows(_Tumbling):
    """Windows of ``size`` that follow each other by event time."""

    @staticmethod
    def of(size: Duration, offset: Duration | None = None) -> TumblingEventTimeWindows:
        return TumblingEventTimeWindows(
            to_millis(size, "TumblingEventTimeWindows.of"), _offset(offset)
        )


class TumblingProcessingTimeWindows(_Tumbling):
    """Windows of ``size`` by the wall clock of the subtask."""

    event_time = False

    @staticmethod
    def of(size: Duration, offset: Duration | None = None) -> TumblingProcessingTimeWindows:
        return TumblingProcessingTimeWindows(
            to_millis(size, "TumblingProcessingTimeWindows.of"), _offset(offset)
        )


def _offset(offset: Duration | None) -> int:
    if offset is None:
        return 0
    if isinstance(offset, Duration):
        return offset.milliseconds  # may be negative (a time zone)
    return int(offset)


class _Sliding(WindowAssigner):
    def __init__(self, size: int, slide: int, offset: int) -> None:
        if size <= 0 or slide <= 0:
            raise ValueError(f"{type(self).__name__}: size and slide must be positive")
        if abs(offset) >= slide:
            raise ValueError(f"{type(self).__name__}: |offset| must be less than the slide")
        self.size = size
        self.slide = slide
        self.offset = offset

    def assign(self, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        last = _window_start(timestamps, self.offset, self.slide)
        per_record = -(-self.size // self.slide)  # windows a record can be in, at most
        rows = np.repeat(np.arange(len(timestamps), dtype=np.int64), per_record)
        steps = np.tile(np.arange(per_record, dtype=np.int64) * self.slide, len(timestamps))
        starts = np.repeat(last, per_record) - steps
        keep = starts + self.size > np.repeat(timestamps, per_record)
        return rows[keep], starts[keep], self.size

    def describe(self) -> str:
        return f"{type(self).__name__}({self.size} ms, slide {self.slide} ms)"


class SlidingEventTimeWindows(_Sliding):
    """Windows of ``size`` starting every ``slide``, by event time."""

    @staticmethod
    def of(
        size: Duration, slide: Duration, offset: Duration | None = None
    ) -> SlidingEventTimeWindows:
        what = "SlidingEventTimeWindows.of"
        return SlidingEventTimeWindows(
            to_millis(size, what), to_millis(slide, what), _offset(offset)
        )


class SlidingProcessingTimeWindows(_Sliding):
    """Windows of ``size`` starting every ``slide``, by the wall clock."""

    event_time = False

    @staticmethod
    def of(
        size: Duration, slide: Duration, offset: Duration | None = None
    ) -> SlidingProcessingTimeWindows:
        what = "SlidingProcessingTimeWindows.of"
        return SlidingProcessingTimeWindows(
            to_millis(size, what), to_millis(slide, what), _offset(offset)
        )


class _Sessions(WindowAssigner):
    merging = True

    def __init__(self, gap: int) -> None:
        if gap <= 0:
            raise ValueError(f"{type(self).__name__}: the gap must be positive")
        self.gap = gap

    def describe(self) -> str:
        return f"{type(self).__name__}(gap {self.gap} ms)"


class EventTimeSessionWindows(_Sessions):
    """A key's records closer than ``gap`` in event time share a session."""

    @staticmethod
    def with_gap(size: Duration) -> EventTimeSessionWindows:
        return EventTimeSessionWindows(to_millis(size, "EventTimeSessionWindows.with_gap"))


class ProcessingTimeSessionWindows(_Sessions):
    """A key's records that arrive closer than ``gap`` apart share a session."""

    event_time = False

    @staticmethod
    def with_gap(size: Duration) -> ProcessingTimeSessionWindows:
        return ProcessingTimeSessionWindows(
            to_millis(size, "ProcessingTimeSessionWindows.with_gap")
        )
