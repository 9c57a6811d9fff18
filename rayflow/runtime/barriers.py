"""Barrier handling on the receiving side, as explicit states (after Flink's
``SingleCheckpointBarrierHandler`` and ``CheckpointBarrierTracker``).

Contract: the subtask calls ``on_barrier(channel, barrier)`` for every barrier it
takes from its input gate. When the handler returns a barrier, the subtask must
snapshot its operators for that checkpoint *now* (before taking the next message),
forward the barrier on every output, then call ``resume()``. ``abort(n)`` drops
an alignment the coordinator gave up on.

* :class:`AlignedBarrierHandler` (EXACTLY_ONCE): ``WAITING`` -> first barrier n ->
  ``ALIGNING`` (each channel that delivered n is blocked at the gate, so no record
  after the barrier enters the operator before the snapshot) -> barrier n from
  every channel -> snapshot -> ``WAITING``. A newer barrier during alignment
  abandons the older checkpoint; barriers older than the current one are dropped.
* :class:`TrackingBarrierHandler` (AT_LEAST_ONCE): never blocks; counts barriers
  per checkpoint and snapshots when the last channel delivered it, so records that
  followed an early barrier may already be in the state (and are replayed after a
  restore: at least once).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from rayflow.runtime.channels import InputGate
from rayflow.runtime.events import CheckpointBarrier


class AlignmentState(enum.Enum):
    WAITING = "waiting for barrier"
    ALIGNING = "aligning"


@dataclass
class AlignmentTiming:
    checkpoint_id: int
    start_delay_s: float
    alignment_s: float


class AlignedBarrierHandler:
    def __init__(self, gate: InputGate) -> None:
        self.gate = gate
        self.state = AlignmentState.WAITING
        self.current_id = -1
        self._received: set[int] = set()
        self._first_at = 0.0
        self._start_delay = 0.0
        self.last_timing: AlignmentTiming | None = None

    def on_barrier(self, channel: int, barrier: CheckpointBarrier) -> CheckpointBarrier | None:
        cid = barrier.checkpoint_id
        if cid < self.current_id:
            return None
        if cid > self.current_id or self.state is AlignmentState.WAITING:
            if cid == self.current_id:  # already completed or aborted this one
                return None
            self._start(barrier)
        self._received.add(channel)
        if len(self._received) < self.gate.num_channels:
            self.gate.block(channel)
            return None
        self.last_timing = AlignmentTiming(cid, self._start_delay, time.time() - self._first_at)
        self.state = AlignmentState.WAITING
        self._received = set()
        return barrier

    def _start(self, barrier: CheckpointBarrier) -> None:
        self.gate.unblock_sync()
        self.state = AlignmentState.ALIGNING
        self.current_id = barrier.checkpoint_id
        self._received = set()
        self._first_at = time.time()
        self._start_delay = max(0.0, self._first_at - barrier.timestamp)

    @property
    def aligning(self) -> bool:
        return self.state is AlignmentState.ALIGNING

    async def resume(self) -> None:
        await self.gate.unblock_all()

    async def abort(self, checkpoint_id: int) -> None:
        if self.state is AlignmentState.ALIGNING and self.current_id == checkpoint_id:
            self.state = AlignmentState.WAITING
            self._received = set()
            await self.gate.unblock_all()


class TrackingBarrierHandler:
    def __init__(self, gate: InputGate) -> None:
        self.gate = gate
        self._pending: dict[int, tuple[int, float, float]] = {}
        self._latest_done = -1
        self.last_timing: AlignmentTiming | None = None

    @property
    def aligning(self) -> bool:
        return bool(self._pending)

    def on_barrier(self, channel: int, barrier: CheckpointBarrier) -> CheckpointBarrier | None:
        cid = barrier.checkpoint_id
        if cid <= self._latest_done:
            return None
        count, first_at, delay = self._pending.get(cid, (0, time.time(), 0.0))
        if count == 0:
            delay = max(0.0, first_at - barrier.timestamp)
        count += 1
        if count < self.gate.num_channels:
            self._pending[cid] = (count, first_at, delay)
            return None
        self._pending = {k: v for k, v in self._pending.items() if k > cid}
        self._latest_done = cid
        self.last_timing = AlignmentTiming(cid, delay, time.time() - first_at)
        return barrier

    async def resume(self) -> None:
        return None

    async def abort(self, checkpoint_id: int) -> None:
        self._pending.pop(checkpoint_id, None)
