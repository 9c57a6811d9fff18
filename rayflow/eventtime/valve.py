"""A subtask's input watermark: the minimum over its input channels, idle ones excluded.

Each channel's watermark only moves forward. The subtask's watermark is the minimum over
the active channels (Flink's ``StatusWatermarkValve``); while every channel is idle the
subtask is idle too, and its watermark stays where it was.

The valve's watermark is stored in checkpoints. A restored subtask starts every channel
at it (each channel had at least that much), and every restored upstream subtask sends
its own watermark first, which sets each channel back to exactly what it had.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayflow.eventtime.strategy import MIN_WATERMARK

__all__ = ["WatermarkValve", "ValveState", "EVENT_TIME_KEY"]

#: Where a subtask's snapshot keeps its event time (a ``ValveState``), beside the
#: operators' states by uid.
EVENT_TIME_KEY = "\x00event-time"


@dataclass(frozen=True)
class ValveState:
    """What a checkpoint stores of a subtask's event time."""

    watermark: int
    idle: bool = False


class WatermarkValve:
    """Per input channel watermarks and idleness; ``watermark`` is the combined one."""

    def __init__(self, num_channels: int, start: int = MIN_WATERMARK) -> None:
        self._channels = [start] * num_channels
        self._idle = [False] * num_channels
        self.watermark = start
        self.idle = False

    def on_watermark(self, channel: int, timestamp: int) -> int | None:
        """Channel ``channel`` reached ``timestamp``: the new combined watermark if it
        moved forward, else None. A watermark makes an idle channel active."""
        self._idle[channel] = False
        if timestamp > self._channels[channel]:
            self._channels[channel] = timestamp
        return self._recompute()

    def on_status(self, channel: int, idle: bool) -> int | None:
        """Channel ``channel`` turned idle or active: the new combined watermark if it
        moved forward (an idle channel no longer holds it back), else None."""
        self._idle[channel] = idle
        return self._recompute()

    def _recompute(self) -> int | None:
        active = [w for w, idle in zip(self._channels, self._idle) if not idle]
        self.idle = not active
        if not active:
            return None
        lowest = min(active)
        if lowest > self.watermark:
            self.watermark = lowest
            return lowest
        return None

    def snapshot(self) -> ValveState:
        return ValveState(self.watermark, self.idle)
