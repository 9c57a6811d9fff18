"""Barrier handling on the receiving side, as explicit states (after Flink's
``SingleCheckpointBarrierHandler`` with its ``BarrierHandlerState`` classes, and
``CheckpointBarrierTracker``).

The subtask feeds its :class:`BarrierHandler` three kinds of events:

* ``on_barrier(channel, seq, barrier)``: barrier n taken from the input gate in channel
  order (``seq`` is its position on the channel);
* ``on_announcement(channel, barrier, position)``: barrier n announced out of band by
  the sender (unaligned checkpoints): it belongs after the sender's first ``position``
  messages on that channel, whatever is still queued before it;
* ``on_timer(checkpoint_id)``: the alignment timeout of checkpoint n has passed.

Each returns a :class:`Snapshot` when the subtask must snapshot *now* (before it takes
the next message): aligned (everything before barrier n on every channel was
processed, nothing after it) or unaligned (the subtask then records channel state with
a :class:`~rayflow.runtime.channel_state.ChannelStateRecorder` that it
:meth:`~BarrierHandler.attach`-es here, so later announcements and barriers give the
recorder each channel's end). After the snapshot the subtask forwards the barrier and
calls ``resume()``, which unblocks every channel.

The states, one class each; every transition returns the next state:

* aligned (EXACTLY_ONCE): :class:`WaitingForFirstBarrier` -> barrier n, channel
  blocked -> :class:`CollectingBarriers` -> barrier n from every channel -> snapshot
  -> waiting;
* unaligned (EXACTLY_ONCE, ``enable_unaligned_checkpoints``):
  :class:`WaitingForFirstBarrierUnaligned` -> first barrier or announcement of n ->
  snapshot with channel state -> :class:`CollectingBarriersUnaligned` until every
  channel's end is known -> waiting;
* aligned with timeout (``set_aligned_checkpoint_timeout``):
  :class:`AlternatingWaitingForFirstBarrier` -> :class:`AlternatingCollectingBarriers`
  (aligned, channels blocked); barrier n from every channel in time -> aligned
  snapshot; the timeout first -> unaligned snapshot, channels unblocked ->
  :class:`CollectingBarriersUnaligned` -> back to alternating waiting;
* at least once (AT_LEAST_ONCE): :class:`TrackingWaiting` / :class:`TrackingCounting`
  never block; the snapshot is taken when the last channel delivered barrier n.

The final checkpoint (after end of input) is always aligned: a subtask finishes when
it completes, so nothing may still be in flight; so is a savepoint. Common to all: a
barrier older than the current checkpoint is dropped; a newer one abandons the current
checkpoint (its alignment or its channel state) and starts the newer one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rayflow.runtime.channel_state import ChannelStateRecorder
from rayflow.runtime.channels import InputGate
from rayflow.runtime.events import CheckpointBarrier

__all__ = [
    "AlignmentTiming",
    "BarrierHandler",
    "BarrierHandlerState",
    "Snapshot",
    "aligned_handler",
    "alternating_handler",
    "tracking_handler",
    "unaligned_handler",
]


@dataclass
class AlignmentTiming:
    checkpoint_id: int
    start_delay_s: float
    alignment_s: float


@dataclass(frozen=True)
class Snapshot:
    """Snapshot now for ``barrier``; ``unaligned``: with channel state."""

    barrier: CheckpointBarrier
    unaligned: bool = False
    #: for an unaligned snapshot: already recording the input gate's channel state
    recorder: ChannelStateRecorder | None = None


@dataclass
class _Checkpoint:
    """What the handler knows of the checkpoint in progress."""

    barrier: CheckpointBarrier
    first_at: float
    received: set[int] = field(default_factory=set)  # channels whose in-band barrier was taken
    positions: dict[int, int] = field(default_factory=dict)  # channel -> end of its range
    recorder: ChannelStateRecorder | None = None

    @property
    def checkpoint_id(self) -> int:
        return self.barrier.checkpoint_id


class BarrierHandlerState:
    """One state of barrier handling. Every method returns the next state."""

    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return self

    def announcement_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return self

    def timer_fired(self, h: BarrierHandler) -> BarrierHandlerState:
        return self

    def aborted(self, h: BarrierHandler) -> BarrierHandlerState:
        """The checkpoint in progress is given up (abort, or a newer one came)."""
        h.unblock()
        return h.waiting_state()


# --- aligned ----------------------------------------------------------------------------


class WaitingForFirstBarrier(BarrierHandlerState):
    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return CollectingBarriers().barrier_received(h, channel)


class CollectingBarriers(BarrierHandlerState):
    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        if h.all_received():
            h.snapshot_aligned()
            return h.waiting_state()
        h.block(channel)
        return self


# --- unaligned --------------------------------------------------------------------------


class WaitingForFirstBarrierUnaligned(BarrierHandlerState):
    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        h.snapshot_unaligned()
        return CollectingBarriersUnaligned().barrier_received(h, channel)

    def announcement_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return self.barrier_received(h, channel)


class CollectingBarriersUnaligned(BarrierHandlerState):
    """The snapshot is taken; the recorder learns each channel's end as it comes."""

    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        h.pass_positions()
        if h.all_positions_known():
            h.done()
            return h.waiting_state()
        return self

    def announcement_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return self.barrier_received(h, channel)

    def aborted(self, h: BarrierHandler) -> BarrierHandlerState:
        h.unblock()
        return h.waiting_state()


# --- aligned, switching to unaligned after a timeout ------------------------------------


class AlternatingWaitingForFirstBarrier(BarrierHandlerState):
    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return self._start(h).barrier_received(h, channel)

    def announcement_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return self._start(h).announcement_received(h, channel)

    @staticmethod
    def _start(h: BarrierHandler) -> BarrierHandlerState:
        h.start_timer()
        return AlternatingCollectingBarriers()


class AlternatingCollectingBarriers(BarrierHandlerState):
    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        if h.all_received():
            h.snapshot_aligned()
            return h.waiting_state()
        h.block(channel)
        if h.timed_out():
            return self.timer_fired(h)
        return self

    def announcement_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        if h.timed_out():
            return self.timer_fired(h)
        return self

    def timer_fired(self, h: BarrierHandler) -> BarrierHandlerState:
        h.snapshot_unaligned()
        h.unblock()
        h.pass_positions()
        if h.all_positions_known():
            h.done()
            return h.waiting_state()
        return CollectingBarriersUnaligned()


# --- at least once ----------------------------------------------------------------------


class TrackingWaiting(BarrierHandlerState):
    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        return TrackingCounting().barrier_received(h, channel)


class TrackingCounting(BarrierHandlerState):
    """Never blocks: records after an early barrier may enter the state of n."""

    def barrier_received(self, h: BarrierHandler, channel: int) -> BarrierHandlerState:
        if h.all_received():
            h.snapshot_aligned()
            return h.waiting_state()
        return self

    def aborted(self, h: BarrierHandler) -> BarrierHandlerState:
        return h.waiting_state()


# --- the handler ------------------------------------------------------------------------


class BarrierHandler:
    """Drives the states for one subtask's input gate; see the module docstring."""

    def __init__(
        self,
        gate: InputGate,
        waiting: type[BarrierHandlerState],
        timeout_s: float | None = None,
        schedule_timer: Callable[[int, float], None] | None = None,
        on_abandon: Callable[[int, str], None] | None = None,
        on_channel_state: Callable[[ChannelStateRecorder], None] | None = None,
    ) -> None:
        self.gate = gate
        self._on_channel_state = on_channel_state or (lambda recorder: None)
        self._waiting = waiting
        self.state: BarrierHandlerState = waiting()
        self.timeout_s = timeout_s
        self._schedule_timer = schedule_timer
        self._on_abandon = on_abandon
        self._current: _Checkpoint | None = None
        self._latest_id = -1  # the newest checkpoint seen
        self._decision: Snapshot | None = None
        self.last_timing: AlignmentTiming | None = None

    # --- events -------------------------------------------------------------------------

    def on_barrier(self, channel: int, seq: int, barrier: CheckpointBarrier) -> Snapshot | None:
        """Barrier ``barrier`` taken from ``channel``, where it had sequence number ``seq``."""
        checkpoint = self._checkpoint_for(barrier)
        if checkpoint is None or channel in checkpoint.received:
            return None
        if barrier.must_align and not checkpoint.received and checkpoint.recorder is None:
            # The final checkpoint is always aligned: everything before it (end of
            # input included) must be processed before the job may finish. So is a
            # savepoint: its state restores into other job graphs.
            self.state = WaitingForFirstBarrier()
        checkpoint.received.add(channel)
        checkpoint.positions.setdefault(channel, seq)
        return self._step(lambda: self.state.barrier_received(self, channel))

    def on_announcement(
        self, channel: int, barrier: CheckpointBarrier, position: int
    ) -> Snapshot | None:
        """The sender put ``barrier`` after its first ``position`` messages on ``channel``."""
        checkpoint = self._checkpoint_for(barrier)
        if checkpoint is None or channel in checkpoint.positions:
            return None
        recorder = checkpoint.recorder
        start = recorder.start(channel) if recorder is not None else self.gate.taken[channel]
        if position < start:
            # Data after the barrier was already taken: no consistent snapshot of this
            # checkpoint is possible here (the in-band barrier rules this out; never
            # acknowledge one that would hold records twice).
            self._give_up(
                checkpoint, f"barrier {barrier.checkpoint_id} came after its data", decline=True
            )
            return None
        checkpoint.positions[channel] = position
        return self._step(lambda: self.state.announcement_received(self, channel))

    def on_timer(self, checkpoint_id: int) -> Snapshot | None:
        checkpoint = self._current
        if checkpoint is None or checkpoint.checkpoint_id != checkpoint_id:
            return None
        return self._step(lambda: self.state.timer_fired(self))

    async def resume(self) -> None:
        await self.gate.unblock_all()

    async def abort(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` was aborted: give it up (and every older one); its
        barriers, should they come later, are stale and start nothing."""
        checkpoint = self._current
        if checkpoint is not None and checkpoint.checkpoint_id <= checkpoint_id:
            self._give_up(checkpoint, f"checkpoint {checkpoint_id} was aborted")
            await self.gate.unblock_all()
        self._latest_id = max(self._latest_id, checkpoint_id)

    @property
    def aligning(self) -> bool:
        return self._current is not None

    # --- actions for the states ---------------------------------------------------------

    def waiting_state(self) -> BarrierHandlerState:
        self._current = None
        return self._waiting()

    def all_received(self) -> bool:
        assert self._current is not None
        return len(self._current.received) >= self.gate.num_channels

    def all_positions_known(self) -> bool:
        assert self._current is not None
        return len(self._current.positions) >= self.gate.num_channels

    def block(self, channel: int) -> None:
        self.gate.block(channel)

    def unblock(self) -> None:
        self.gate.unblock_sync()

    def snapshot_aligned(self) -> None:
        checkpoint = self._current
        assert checkpoint is not None
        self._set_timing(checkpoint)
        self._decision = Snapshot(checkpoint.barrier, unaligned=False)

    def snapshot_unaligned(self) -> None:
        checkpoint = self._current
        assert checkpoint is not None
        self._set_timing(checkpoint)
        recorder = ChannelStateRecorder(
            checkpoint.checkpoint_id, list(self.gate.taken), self._on_channel_state
        )
        checkpoint.recorder = recorder
        self.pass_positions()
        self.gate.record(recorder)
        self._decision = Snapshot(checkpoint.barrier, unaligned=True, recorder=recorder)

    def pass_positions(self) -> None:
        checkpoint = self._current
        if checkpoint is None or checkpoint.recorder is None:
            return
        for channel, position in checkpoint.positions.items():
            checkpoint.recorder.set_end(channel, position)

    def done(self) -> None:
        """Every channel's end is known; the recorder completes on its own."""

    def start_timer(self) -> None:
        checkpoint = self._current
        assert checkpoint is not None and self.timeout_s is not None
        delay = checkpoint.barrier.timestamp + self.timeout_s - time.time()
        if delay > 0 and self._schedule_timer is not None:
            self._schedule_timer(checkpoint.checkpoint_id, delay)

    def timed_out(self) -> bool:
        checkpoint = self._current
        assert checkpoint is not None and self.timeout_s is not None
        return time.time() >= checkpoint.barrier.timestamp + self.timeout_s

    # --- internals ----------------------------------------------------------------------

    def _checkpoint_for(self, barrier: CheckpointBarrier) -> _Checkpoint | None:
        """The checkpoint in progress for ``barrier``: None for a stale barrier; a newer
        one abandons the checkpoint in progress."""
        cid = barrier.checkpoint_id
        current = self._current
        if current is not None and cid == current.checkpoint_id:
            return current
        if cid <= self._latest_id:
            return None
        if current is not None:
            self._give_up(current, f"checkpoint {cid} started first")
        self._latest_id = cid
        self._current = _Checkpoint(barrier, time.time())
        return self._current

    def _give_up(self, checkpoint: _Checkpoint, why: str, decline: bool = False) -> None:
        """Drop ``checkpoint``; ``on_abandon`` (which declines it) when channel state was
        being recorded for it or when ``decline``."""
        self.state = self.state.aborted(self)
        self._current = None
        recorder = checkpoint.recorder
        if recorder is not None and not recorder.done:
            recorder.abandon()
            self.gate.stop_recording(recorder)
            decline = True
        if decline and self._on_abandon is not None:
            self._on_abandon(checkpoint.checkpoint_id, why)

    def _step(self, transition: Callable[[], BarrierHandlerState]) -> Snapshot | None:
        self._decision = None
        self.state = transition()
        decision, self._decision = self._decision, None
        return decision

    def _set_timing(self, checkpoint: _Checkpoint) -> None:
        now = time.time()
        self.last_timing = AlignmentTiming(
            checkpoint.checkpoint_id,
            max(0.0, checkpoint.first_at - checkpoint.barrier.timestamp),
            now - checkpoint.first_at,
        )


def aligned_handler(gate: InputGate) -> BarrierHandler:
    return BarrierHandler(gate, WaitingForFirstBarrier)


def unaligned_handler(
    gate: InputGate,
    on_channel_state: Callable[[ChannelStateRecorder], None],
    on_abandon: Callable[[int, str], None] | None = None,
) -> BarrierHandler:
    return BarrierHandler(
        gate,
        WaitingForFirstBarrierUnaligned,
        on_abandon=on_abandon,
        on_channel_state=on_channel_state,
    )


def alternating_handler(
    gate: InputGate,
    timeout_s: float,
    schedule_timer: Callable[[int, float], None],
    on_channel_state: Callable[[ChannelStateRecorder], None],
    on_abandon: Callable[[int, str], None] | None = None,
) -> BarrierHandler:
    return BarrierHandler(
        gate,
        AlternatingWaitingForFirstBarrier,
        timeout_s=timeout_s,
        schedule_timer=schedule_timer,
        on_abandon=on_abandon,
        on_channel_state=on_channel_state,
    )


def tracking_handler(gate: InputGate) -> BarrierHandler:
    return BarrierHandler(gate, TrackingWaiting)
