"""Messages that travel on data channels besides batches: control events, ordered with
the batches, and bundles of batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EndOfInput:
    """The sender will send nothing more on this channel."""


@dataclass(frozen=True)
class CheckpointBarrier:
    """Everything before it on the channel belongs to checkpoint ``checkpoint_id``.

    ``final``: every subtask finishes once this checkpoint completes (the job's input
    ended, or it is stopped with a savepoint; sources read nothing after it).
    ``savepoint``: the checkpoint is also written out as a savepoint."""

    checkpoint_id: int
    timestamp: float
    final: bool = False
    savepoint: bool = False

    @property
    def must_align(self) -> bool:
        """Always aligned (no in-flight data in its state): final checkpoints, and
        savepoints, which must restore into another job graph."""
        return self.final or self.savepoint


@dataclass(frozen=True, slots=True)
class Watermark:
    """Event time has reached ``timestamp`` (milliseconds) on this channel: no record with
    a timestamp at or before it should follow. Travels in order with the batches."""

    timestamp: int


@dataclass(frozen=True, slots=True)
class WatermarkStatus:
    """The channel turned idle (``idle``: its watermark holds nobody back) or active."""

    idle: bool


@dataclass(frozen=True)
class LatencyMarker:
    """Sent by source subtask ``subtask`` of ``source`` at wall time ``created_at``
    (``time.time()``: receivers may be on other nodes). It passes no operator: every
    subtask forwards it on one channel of each out-edge, in order with the batches, and
    the sink end of the job records how long it took to arrive."""

    created_at: float
    source: str
    subtask: int


@dataclass(frozen=True, slots=True)
class Bundle:
    """Several batches and latency markers, in channel order, sent as one message (an
    output channel's buffer); the batches are kept as they were written.

    ``origin`` is the wall time (``time.time()``) at which the oldest of its items entered
    the job: when a source read the data it came from. A receiver's outputs inherit it, so
    that the buffer timeout bounds a record's wait in output buffers over its whole path,
    not once per hop; 0.0 when unknown (the receiver takes its arrival)."""

    items: tuple[Any, ...]
    origin: float = 0.0


def unbundled(message: Any) -> tuple[Any, ...]:
    """The items a channel message carries, in order: a bundle's items, else itself."""
    return message.items if isinstance(message, Bundle) else (message,)
