"""A job's failure history: what failed, where, and how often.

Every failure of a run (an attempt, the setting up of the next attempt, or the job
master) is described by a :class:`Failure`: the operator and subtask where it happened
(when it happened in one), the exception's type and message, and whether a restart can
fix it. A :class:`FailureHistory` folds repeats of the same failure into one
:class:`FailureEntry` with a count and the times of its first and last occurrence, so a
job that fails every attempt at the same record has one entry, not one per restart.

``JobClient.failure_history()`` and ``JobResult.failure_history`` return the entries.
Ray-free and picklable: the history travels with the restart supervisor's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflow.status import FailureKind

__all__ = ["Failure", "FailureEntry", "FailureHistory", "worth_logging"]

#: Distinct failures a history keeps (the oldest distinct one goes first; every failure
#: is still counted in ``FailureHistory.total``).
MAX_ENTRIES = 20

#: A message is cut to this many characters for folding and display.
MAX_MESSAGE = 500


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, cut to ``MAX_MESSAGE`` characters."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:MAX_MESSAGE]
    return ""


@dataclass(frozen=True)
class Failure:
    """One failure of a job.

    ``operator`` and ``subtask`` (0-based, of ``parallelism``) say where it happened when
    it happened in a subtask; ``exception`` is the exception's type name and ``message``
    its first line (no traceback). ``non_recoverable`` says why no restart can fix it
    (None: a restart may)."""

    kind: FailureKind
    exception: str
    message: str
    operator: str | None = None
    subtask: int | None = None
    parallelism: int | None = None
    non_recoverable: str | None = None

    @property
    def recoverable(self) -> bool:
        return self.non_recoverable is None

    @property
    def key(self) -> tuple:
        """Failures with the same key are the same failure (folded into one entry)."""
        return (self.kind, self.operator, self.subtask, self.exception, self.message)

    def where(self) -> str:
        if self.operator is None:
            return "the job master" if self.kind is not FailureKind.ATTEMPT else "the job"
        if self.subtask is None:
            return f"operator {self.operator!r}"
        of = f"/{self.parallelism}" if self.parallelism else ""
        return f"operator {self.operator!r} (subtask {self.subtask + 1}{of})"

    def describe(self) -> str:
        """``operator 'Parse' (subtask 2/4): ValueError: bad record``."""
        what = f"{self.exception}: {self.message}" if self.exception else self.message
        return f"{self.where()}: {what}"

    @classmethod
    def of_text(cls, kind: FailureKind, text: str, non_recoverable: str | None = None) -> Failure:
        """A failure known only by its text (``Type: message`` when it has that shape)."""
        line = first_line(text)
        head, sep, rest = line.partition(": ")
        if sep and head.isidentifier():
            return cls(kind, head, rest, non_recoverable=non_recoverable)
        return cls(kind, "", line, non_recoverable=non_recoverable)

    @classmethod
    def of_exception(
        cls,
        kind: FailureKind,
        exc: BaseException,
        non_recoverable: str | None = None,
        operator: str | None = None,
        subtask: int | None = None,
        parallelism: int | None = None,
    ) -> Failure:
        return cls(
            kind,
            type(exc).__name__,
            first_line(str(exc)),
            operator,
            subtask,
            parallelism,
            non_recoverable,
        )


@dataclass
class FailureEntry:
    """A failure and how often it happened: ``count`` times, the first at
    ``first_time`` and the last at ``time`` (``time.time()`` seconds)."""

    failure: Failure
    count: int
    first_time: float
    time: float

    @property
    def operator(self) -> str | None:
        return self.failure.operator

    @property
    def subtask(self) -> int | None:
        return self.failure.subtask

    @property
    def exception(self) -> str:
        return self.failure.exception

    @property
    def message(self) -> str:
        return self.failure.message

    @property
    def kind(self) -> FailureKind:
        return self.failure.kind

    @property
    def recoverable(self) -> bool:
        return self.failure.recoverable

    def describe(self) -> str:
        times = f" ({self.count} times)" if self.count > 1 else ""
        return self.failure.describe() + times


@dataclass
class FailureHistory:
    """Failures folded by :attr:`Failure.key`, most recent last; bounded."""

    entries: list[FailureEntry] = field(default_factory=list)
    total: int = 0

    def add(self, failure: Failure, when: float) -> FailureEntry:
        """Record ``failure``; returns its entry (``count`` 1 when it is new)."""
        self.total += 1
        for position, entry in enumerate(self.entries):
            if entry.failure.key == failure.key:
                entry.count += 1
                entry.time = when
                entry.failure = failure  # the latest verdict on recoverability
                self.entries.append(self.entries.pop(position))
                return entry
        entry = FailureEntry(failure, 1, when, when)
        self.entries.append(entry)
        del self.entries[:-MAX_ENTRIES]
        return entry

    @property
    def latest(self) -> FailureEntry | None:
        return self.entries[-1] if self.entries else None


def worth_logging(count: int) -> bool:
    """Whether the ``count``-th occurrence of a failure is logged: the first (in full),
    then the 2nd, 4th, 8th, ... with their count, so a restart loop logs a few lines,
    not one traceback per restart."""
    return count >= 1 and count & (count - 1) == 0
