"""Errors a job raises to its driver, and the errors that name a mistake in a job's own
definition or functions (raised on the driver before the job deploys, or in the operator
where the mistake shows)."""

from __future__ import annotations

__all__ = [
    "JobFailedError",
    "OperatorError",
    "JobCancelledError",
    "JobResultLostError",
    "ConcurrentRunError",
    "RecordError",
    "SchemaChangeError",
    "NotPicklableError",
    "SavepointError",
]


class OperatorError(RuntimeError):
    """User code in one operator subtask raised; carries the original traceback text, and
    why no restart can fix it (``non_recoverable``; None when a restart may)."""

    def __init__(
        self,
        operator: str,
        subtask: int,
        parallelism: int,
        cause: str,
        tb: str,
        non_recoverable: str | None = None,
    ):
        self.operator = operator
        self.subtask = subtask
        self.parallelism = parallelism
        self.cause = cause
        self.traceback_text = tb
        self.non_recoverable = non_recoverable
        super().__init__(
            f"operator {operator!r} (subtask {subtask + 1}/{parallelism}) failed: {cause}\n"
            f"--- original traceback ---\n{tb}"
        )

    def __reduce__(self):
        return (
            OperatorError,
            (
                self.operator,
                self.subtask,
                self.parallelism,
                self.cause,
                self.traceback_text,
                self.non_recoverable,
            ),
        )


class JobFailedError(RuntimeError):
    """The job stopped without finishing; the message says why."""


class JobCancelledError(JobFailedError):
    """The job was cancelled through its JobClient."""


class JobResultLostError(RuntimeError):
    """The job FINISHED (every record processed, its final checkpoint committed), but its
    job master was lost before its result (outputs, metrics) reached the driver. Not a
    failure: what the job's sinks committed is complete; only the result is gone."""


class ConcurrentRunError(RuntimeError):
    """A run of the same job name is already running on this Ray cluster."""


class RecordError(TypeError):
    """A user function gave something that is not a record (a dict with str keys)."""


class SchemaChangeError(ValueError):
    """An operator's records changed in a way the schema of its output cannot hold
    (a key its earlier records did not have, or a value of another type)."""


class NotPicklableError(TypeError):
    """A function, source or sink of a job cannot be pickled to be sent to its subtasks."""


class SavepointError(RuntimeError):
    """A savepoint could not be taken, written or restored; the message says what became
    of the job."""
