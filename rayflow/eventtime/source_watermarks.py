"""Watermark generation at a source subtask, per split.

Each split has its own generator: the largest timestamp it has read. The subtask's
watermark is the minimum over its splits that are not finished and not idle, so a
split that lags (or has not been read yet) holds event time back, as in Flink. A split
is idle once it gave no data for the strategy's idle timeout; if every split is idle (or
the subtask has no split at all) the subtask's output turns idle (downstream it then
holds nobody back) until data comes.

The largest timestamp of each split is stored with the split in a checkpoint
(``SourceSplit.event_time_state``), so a restored source, at any parallelism, goes on
from the watermark it had.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rayflow.eventtime.strategy import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    WatermarkStrategy,
    with_timestamps,
)

__all__ = ["SourceWatermarks"]

#: The split id used for a reader that does not say which split a batch came from.
_WHOLE_READER = "*"


class _SplitGenerator:
    __slots__ = ("max_timestamp", "last_active")

    def __init__(self, max_timestamp: int | None, now: float) -> None:
        self.max_timestamp = max_timestamp
        self.last_active = now


class SourceWatermarks:
    """Timestamps and watermarks of one source subtask's splits."""

    def __init__(
        self,
        strategy: WatermarkStrategy,
        splits: Iterable[Any],
        per_split: bool = True,
        clock: Any = time.monotonic,
    ) -> None:
        self.strategy = strategy
        self._clock = clock
        now = clock()
        self._splits: dict[str, _SplitGenerator] = {}
        states = {s.split_id: getattr(s, "event_time_state", None) for s in splits}
        if per_split:
            for split_id, state in states.items():
                self._splits[split_id] = _SplitGenerator(state, now)
        else:
            # one generator for the reader: it restarts from the lowest split's state
            known = [v for v in states.values() if v is not None]
            self._splits[_WHOLE_READER] = _SplitGenerator(min(known) if known else None, now)
        self._finished: set[str] = set()
        #: the watermark last handed out, and whether the output is idle
        self.emitted = MIN_WATERMARK
        self.idle = False
        self._bound = (strategy.out_of_orderness_ms or 0) + 1

    def restored_watermark(self) -> int | None:
        """The watermark the restored splits stand at (None: nothing restored)."""
        if not any(g.max_timestamp is not None for g in self._splits.values()):
            return None
        return self.current()

    def on_batch(self, batch: pa.RecordBatch, split_id: str | None) -> pa.RecordBatch:
        """``batch`` with its timestamp column; its split's generator advanced."""
        timestamps = self.strategy.timestamps_of(batch)
        if timestamps.null_count:
            raise ValueError(
                f"WatermarkStrategy: {timestamps.null_count} record(s) of a batch have no "
                "timestamp (null)"
            )
        split = split_id if split_id is not None else _WHOLE_READER
        generator = self._splits.get(split)
        now = self._clock()
        if generator is None:
            generator = self._splits[split] = _SplitGenerator(None, now)
        generator.last_active = now
        if len(timestamps):
            top = pc.max(timestamps).as_py()
            if generator.max_timestamp is None or top > generator.max_timestamp:
                generator.max_timestamp = top
        return with_timestamps(batch, timestamps)

    def finished(self, split_ids: Iterable[str]) -> None:
        """These splits will give no more data: they hold nothing back."""
        self._finished.update(split_ids)

    def finished_all(self) -> None:
        self._finished.update(self._splits)

    def _holding(self, now: float) -> list[_SplitGenerator]:
        idle_ms = self.strategy.idleness_ms
        return [
            g
            for s, g in self._splits.items()
            if s not in self._finished
            and (idle_ms is None or (now - g.last_active) * 1000.0 < idle_ms)
        ]

    def current(self) -> int:
        """The subtask's watermark now (the minimum over active splits)."""
        holding = self._holding(self._clock())
        if not holding:
            return self.emitted
        lowest = MAX_WATERMARK
        for g in holding:
            if g.max_timestamp is None:
                return MIN_WATERMARK
            lowest = min(lowest, g.max_timestamp - self._bound)
        return lowest

    def advance(self) -> int | None:
        """The new watermark to send, if it moved forward; else None."""
        if not self.strategy.generates_watermarks:
            return None
        watermark = self.current()
        if watermark > self.emitted:
            self.emitted = watermark
            return watermark
        return None

    def idleness_changed(self) -> bool | None:
        """True when the output just turned idle, False when it just turned active again,
        None when unchanged (only with an idle timeout)."""
        if self.strategy.idleness_ms is None:
            return None
        now = self._clock()
        # Idle: nothing holds back, and not because every split finished (then the end of
        # input follows). A subtask without splits at all (more subtasks than an
        # unbounded source has splits) has nothing to hold back with: idle too.
        unfinished = not self._splits or len(self._finished) < len(self._splits)
        idle = not self._holding(now) and unfinished
        if idle == self.idle:
            return None
        self.idle = idle
        return idle

    def snapshot(self, splits: list[Any]) -> list[Any]:
        """``splits`` (a reader's snapshot) with each one's largest timestamp attached."""
        out = []
        for split in splits:
            generator = self._splits.get(split.split_id) or self._splits.get(_WHOLE_READER)
            state = generator.max_timestamp if generator is not None else None
            if dataclasses.is_dataclass(split) and any(
                f.name == "event_time_state" for f in dataclasses.fields(split)
            ):
                split = dataclasses.replace(split, event_time_state=state)
            out.append(split)
        return out
