"""The typed vocabulary of job and checkpoint lifecycles.

States and reasons are ``str`` enums, so they compare equal to their names
(``JobState.RUNNING == "RUNNING"``) and print as such in stats and logs.
"""

from __future__ import annotations

import enum

__all__ = ["JobState", "CheckpointStatus", "CheckpointFailureReason", "FailureKind"]


class JobState(str, enum.Enum):
    """Flink's job states, as a state machine (see ``JobState.can_move_to``)."""

    CREATED = "CREATED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    FAILING = "FAILING"
    CANCELLING = "CANCELLING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED, JobState.CANCELED)

    @property
    def while_ending(self) -> JobState:
        """What is shown for a run that reached this state while its clean-up still runs
        (its bundles, holds and job name not yet released): a terminal state is shown
        only once the job name is free, so RUNNING, FAILING or CANCELLING until then."""
        return _ENDING.get(self, self)

    def can_move_to(self, target: JobState) -> bool:
        return target in _TRANSITIONS[self]

    def __str__(self) -> str:
        return self.value


_ENDING: dict[JobState, JobState] = {
    JobState.FINISHED: JobState.RUNNING,
    JobState.FAILED: JobState.FAILING,
    JobState.CANCELED: JobState.CANCELLING,
}

_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.CREATED: frozenset(
        {JobState.RUNNING, JobState.RESTARTING, JobState.CANCELLING, JobState.FAILING}
    ),
    JobState.RUNNING: frozenset(
        {JobState.RESTARTING, JobState.FAILING, JobState.CANCELLING, JobState.FINISHED}
    ),
    JobState.RESTARTING: frozenset(
        {JobState.RUNNING, JobState.RESTARTING, JobState.FAILING, JobState.CANCELLING}
    ),
    JobState.FAILING: frozenset({JobState.FAILED}),
    JobState.CANCELLING: frozenset({JobState.CANCELED, JobState.FAILED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELED: frozenset(),
}


class CheckpointStatus(str, enum.Enum):
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"

    def __str__(self) -> str:
        return self.value


class CheckpointFailureReason(str, enum.Enum):
    """Why a checkpoint did not complete (after Flink's ``CheckpointFailureReason``)."""

    TIMEOUT = "TIMEOUT"
    DECLINED = "DECLINED"
    METADATA_WRITE_FAILED = "METADATA_WRITE_FAILED"
    ATTEMPT_ENDED = "ATTEMPT_ENDED"
    WITHDRAWN = "WITHDRAWN"  # a savepoint whose caller stopped waiting for it

    def __str__(self) -> str:
        return self.value


class FailureKind(str, enum.Enum):
    """What failed, for the restart supervisor's history."""

    ATTEMPT = "ATTEMPT"  # a subtask, a call into one, or too many failed checkpoints
    RESTART_SETUP = "RESTART_SETUP"  # stopping, restoring or deploying an attempt
    JOB_MASTER_LOST = "JOB_MASTER_LOST"  # the job master's process or node

    def __str__(self) -> str:
        return self.value
