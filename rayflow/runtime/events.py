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
