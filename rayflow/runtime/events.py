"""Control events that travel on data channels, ordered with the batches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EndOfInput:
    """The sender will send nothing more on this channel."""


@dataclass(frozen=True)
class CheckpointBarrier:
    """Everything before it on the channel belongs to checkpoint ``checkpoint_id``."""

    checkpoint_id: int
    timestamp: float
    final: bool = False


@dataclass(frozen=True)
class LatencyMarker:
    """Sent by source subtask ``subtask`` of ``source`` at wall time ``created_at``
    (``time.time()``: receivers may be on other nodes). It passes no operator: every
    subtask forwards it on one channel of each out-edge, in order with the batches, and
    the sink end of the job records how long it took to arrive."""

    created_at: float
    source: str
    subtask: int
