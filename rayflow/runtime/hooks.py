"""Points in the runtime where an observer may act, and the do-nothing default.

The runtime calls hooks at the points of the checkpoint and restart protocol named
by :class:`HookPoint`; by default nothing happens there. ``rayflow.testing`` builds
fault injection on this interface (its ``FaultPlan`` is a :class:`RuntimeHooks`), so
the runtime never imports test code.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["HookPoint", "SubtaskHooks", "MasterHooks", "RuntimeHooks"]


class HookPoint(str, enum.Enum):
    # in a subtask
    AFTER_RECORDS = "after-records"
    DURING_ALIGNMENT = "during-alignment"
    AFTER_SNAPSHOT = "after-snapshot"
    DURING_BLOB_WRITE = "during-blob-write"  # in the blob-writing thread, before the write
    # in the blob-writing thread, before writing a blob that holds channel state
    DURING_CHANNEL_STATE_WRITE = "during-channel-state-write"
    DURING_RECOVER = "during-recover"  # in the recover thread, before lingering aborts
    DURING_STATE_LOAD = "during-state-load"  # in a thread, before a restore reads its blobs
    # in a receiving subtask, when a sender asks where to connect (the n-th time in this
    # attempt): before it answers
    DURING_CONNECT = "during-connect"
    SINK_BEFORE_PRE_COMMIT = "sink-before-pre-commit"
    SINK_AFTER_PRE_COMMIT = "sink-after-pre-commit"
    SINK_DURING_COMMIT = "sink-during-commit"
    SINK_DURING_ABORT = "sink-during-abort"
    # inside a sink's commit, between its first effect on the outside world and its last
    # (reached only by sinks whose commit has several steps, through SinkContext.hooks)
    SINK_INSIDE_COMMIT = "sink-inside-commit"
    # in the job master
    BEFORE_NOTIFY = "before-notify"  # a subtask dies after the commit point
    JOB_MASTER_BEFORE_NOTIFY = "job-master-before-notify"  # the job master dies there
    JOB_MASTER_BEFORE_FIRST_CHECKPOINT = "job-master-before-first-checkpoint"
    DURING_RESTART_DELAY = "during-restart-delay"  # a subtask kept for reuse dies
    FINAL_NOTIFY = "final-notify"  # the final checkpoint's notification is lost
    DURING_COMMIT_POINT = "during-commit-point"  # in the thread writing a checkpoint's metadata
    # a stop with savepoint: the job master dies after its commit point, before the stop
    # is recorded in the run's state
    JOB_MASTER_BEFORE_STOP_RECORD = "job-master-before-stop-record"
    # a savepoint: the job master dies after its commit point (and the stop recorded),
    # before the savepoint's directory is written
    JOB_MASTER_BEFORE_SAVEPOINT_WRITE = "job-master-before-savepoint-write"

    def __str__(self) -> str:
        return self.value

    @property
    def in_job_master(self) -> bool:
        return self in _MASTER_POINTS


_MASTER_POINTS = frozenset(
    {
        HookPoint.BEFORE_NOTIFY,
        HookPoint.JOB_MASTER_BEFORE_NOTIFY,
        HookPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT,
        HookPoint.DURING_RESTART_DELAY,
        HookPoint.FINAL_NOTIFY,
        HookPoint.DURING_COMMIT_POINT,
        HookPoint.JOB_MASTER_BEFORE_STOP_RECORD,
        HookPoint.JOB_MASTER_BEFORE_SAVEPOINT_WRITE,
    }
)


class SubtaskHooks:
    """Called by one subtask attempt. ``at`` may run in a worker thread."""

    def after_records(self, records: int) -> None:
        """The subtask has taken ``records`` input records in this attempt."""

    def at(self, point: HookPoint) -> None:
        """A point of the protocol was reached (once per checkpoint for those bound to one)."""


class MasterHooks:
    """Called by the job master of one attempt."""

    def at(self, point: HookPoint, checkpoint: int, subtasks: dict[tuple[str, int], Any]) -> bool:
        """``checkpoint`` counts this attempt's completed checkpoints; ``subtasks`` maps
        (vertex name, index) to actor handles. Returns False to suppress the step that
        follows the point (a notification, say), True to let it happen."""
        return True


class RuntimeHooks:
    """Hands out the hooks of each subtask and job master attempt."""

    def for_subtask(self, vertex_name: str, index: int, attempt: int) -> SubtaskHooks | None:
        return None

    def for_job_master(self, attempt: int) -> MasterHooks | None:
        return None
