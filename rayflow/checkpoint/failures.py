"""Decides when failed checkpoints fail the job attempt (after Flink's
``CheckpointFailureManager``).

Counts checkpoints that failed in a row, across the attempts of one job master; a
completed checkpoint resets the count. More failures in a row than tolerated fail
the attempt, and the count starts again, so the next attempt gets the same allowance.
A checkpoint aborted because its attempt ended is not the checkpoint's fault and is
not counted.
"""

from __future__ import annotations

from rayflow.status import CheckpointFailureReason

__all__ = ["CheckpointFailureManager", "CheckpointFailureLimit"]


class CheckpointFailureLimit(RuntimeError):
    """More checkpoints failed in a row than the configuration tolerates.
    ``non_recoverable`` says why no restart can fix the last failure (None: one may)."""

    non_recoverable: str | None = None


class CheckpointFailureManager:
    def __init__(self, tolerable: int) -> None:
        if tolerable < 0:
            raise ValueError(f"tolerable checkpoint failures must be >= 0, got {tolerable}")
        self.tolerable = tolerable
        self.in_a_row = 0

    def on_success(self) -> None:
        self.in_a_row = 0

    def on_failure(
        self, checkpoint_id: int, reason: CheckpointFailureReason, detail: str
    ) -> CheckpointFailureLimit | None:
        """Record a failed checkpoint; returns the error that fails the attempt, if any."""
        if reason is CheckpointFailureReason.ATTEMPT_ENDED:
            return None
        self.in_a_row += 1
        if self.in_a_row <= self.tolerable:
            return None
        failed = self.in_a_row
        self.in_a_row = 0
        return CheckpointFailureLimit(
            f"checkpoint {checkpoint_id} failed ({detail}); {failed} failed in a row, "
            f"{self.tolerable} tolerated"
        )
