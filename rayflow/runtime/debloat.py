"""Buffer debloating: how much data may be in flight on each input channel of a subtask.

Without it every channel holds up to ``capacity`` buffered batches plus ``window``
pushes its sender has not had acknowledged, whatever the speed of the receiver, and an
aligned checkpoint barrier waits behind all of them: a slow receiver makes long
checkpoints. A :class:`BufferDebloater` (owned by one
:class:`~rayflow.runtime.channels.InputGate`) measures how fast the subtask takes data
from its gate and sizes the in-flight data so that the subtask drains it in a target
time (Flink's buffer debloating, FLIP-183):

* **Throughput** is measured over periods of ``period_s`` (like Flink's
  ``taskmanager.network.memory.buffer-debloat.period``): data messages processed per
  second of *busy* time, i.e. the period less the time the reader waited in the gate
  for data (an idle reader is starved, not slow: counting its idle time would shrink
  its buffers and starve it further). A message counts as processed when the reader
  comes back for the next one, so each message is matched with the time spent on it.
  The periods are smoothed exponentially, weighted by their busy time: the throughput
  is the decayed sum of messages over the decayed sum of busy seconds (``smoothing`` is
  the weight of the newest period), so a period that was nearly all idle, with a
  message or two in a few microseconds, cannot swing it.
* **Credit**: the subtask drains ``throughput * target_s`` messages in the target time;
  split evenly over its input channels, and again in two halves, one for what the
  gate buffers and one for what the sender has pushed and not had admitted (in flight
  on a channel is at most buffered plus unacknowledged). That half, rounded and
  bounded by ``[1, capacity]``, is the channel's *credit*: the gate admits at most that
  many buffered messages on the channel, and each ``push`` returns it, so the sender
  uses it as its window (bounded by ``[1, window]``).

In-flight data is counted in messages, not bytes. Buffers and windows are bounded in
messages, and what is measured is the average time a message takes to be processed,
which already covers both a per-batch and a per-byte cost. The batches of one channel
come from the same upstream operator and are much alike in size, and the few barriers
and latency markers between them (processed at once) are in flight in the same mix as
they are taken, so the recent average stands for the messages in flight. Bytes would
matter where sizes vary a lot from one batch to the next (Flink weighs by bytes because
its buffers are fixed-size memory segments); the smoothing spreads such variation over
several periods.

A message here is one batch: a bundle (an output channel's buffer sent as one call)
counts as its batches, in the throughput, in the gate's buffers and in the sender's
window, and the sender bundles at most its window's worth, so a credit of n still means
n batches in flight, as without output buffering.

The class is plain code with an injectable clock, so its arithmetic is unit-tested
without Ray or an event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["BufferDebloater", "DEFAULT_PERIOD_S", "DEFAULT_SMOOTHING", "MIN_TARGET_MS"]

#: the length of one throughput measurement
DEFAULT_PERIOD_S = 0.2
#: the weight of the newest period in the moving average
DEFAULT_SMOOTHING = 0.3
#: the smallest target accepted (``enable_buffer_debloating(target_ms=...)``)
MIN_TARGET_MS = 10


class BufferDebloater:
    """Measures the throughput of one gate's reader and says each channel's credit.

    The gate calls :meth:`reading` each time its reader asks for a message, :meth:`idle`
    with the time the reader then waited for data, and :meth:`taken` when what it hands
    out is a data message. :meth:`reading` closes a period once ``period_s`` have passed
    and returns True when the credits changed (the gate then wakes the pushers: some may
    now be admitted).
    """

    def __init__(
        self,
        num_channels: int,
        capacity: int,
        target_s: float,
        period_s: float = DEFAULT_PERIOD_S,
        smoothing: float = DEFAULT_SMOOTHING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if target_s <= 0:
            raise ValueError(f"buffer debloating: target must be > 0 s, got {target_s}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"buffer debloating: smoothing must be in (0, 1], got {smoothing}")
        self.num_channels = num_channels
        #: channels that have not delivered end of input: they share the credit
        self.open_channels = num_channels
        self.capacity = capacity
        self.target_s = target_s
        self.period_s = period_s
        self.smoothing = smoothing
        #: the clock periods and idle time are measured with
        self.clock = clock
        #: per channel, the credit: the gate's capacity for it and its sender's window
        self.credits = [capacity] * num_channels
        #: smoothed data messages processed per busy second; None before the first period
        #: with a processed message
        self.throughput: float | None = None
        #: the lowest credit any channel had so far
        self.lowest_credit = capacity
        self.periods = 0
        #: seconds the reader waited for data in all
        self.idle_total_s = 0.0
        #: when the current period began; None until the reader first asks for data (the
        #: subtask's start-up, opening operators and restoring state, is not measured)
        self._period_start: float | None = None
        self._count = 0  # messages processed in the current period
        self._idle_s = 0.0  # seconds waited in the current period
        self._holding = 0  # batches the reader took and is processing
        self._messages = 0.0  # decayed sum of messages processed
        self._busy_s = 0.0  # decayed sum of busy seconds

    def reading(self) -> bool:
        """The reader asks for its next message: the data message it took before, if
        any, is processed. At the end of a period, update the credits; True when a credit
        changed."""
        now = self.clock()
        if self._period_start is None:
            self._period_start = now
            return False
        if self._holding:
            self._count += self._holding
            self._holding = 0
        elapsed = now - self._period_start
        if elapsed < self.period_s:
            return False
        busy = max(elapsed - self._idle_s, 0.0)
        count = self._count
        self._period_start = now
        self._count = 0
        self._idle_s = 0.0
        self.periods += 1
        keep = 1.0 - self.smoothing
        self._messages = keep * self._messages + count
        self._busy_s = keep * self._busy_s + busy
        if self._messages <= 0:
            return False  # nothing processed yet: nothing known
        self.throughput = self._messages / self._busy_s if self._busy_s > 0 else math.inf
        return self._set_credit(self.credit_for(self.throughput))

    def idle(self, seconds: float) -> None:
        """The reader waited ``seconds`` for data (not counted as busy time)."""
        self.idle_total_s += seconds
        if self._period_start is not None:
            self._idle_s += seconds

    def taken(self, batches: int = 1) -> None:
        """The reader took a data message of ``batches`` batches (a bundle holds several;
        counted once it comes back for the next)."""
        self._holding += batches

    def channel_ended(self) -> None:
        """A channel delivered end of input: the open ones share what the reader drains."""
        self.open_channels = max(self.open_channels - 1, 0)

    def credit_for(self, throughput: float) -> int:
        """The per-channel credit at ``throughput`` messages per busy second, shared by
        the channels still open."""
        per_channel = throughput * self.target_s / max(self.open_channels, 1)
        if not math.isfinite(per_channel):
            return self.capacity
        half = math.floor(per_channel / 2 + 0.5)
        return max(1, min(self.capacity, half))

    def _set_credit(self, credit: int) -> bool:
        if all(c == credit for c in self.credits):
            return False
        self.credits = [credit] * self.num_channels
        self.lowest_credit = min(self.lowest_credit, credit)
        return True
