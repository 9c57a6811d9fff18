"""The restart supervisor: one owner of a job's lifecycle, its restarts and their budget.

Every failure of a run goes through one :class:`RestartSupervisor`, whatever failed:
an attempt (a subtask, a call into one, too many failed checkpoints), the setting up
of the next attempt (stopping, restoring, deploying), or the job master itself. One
restart strategy decides, with one budget, whether the run goes on and after what
delay. The job master consults it for attempts; when the job master dies, its
``JobClient`` loads the same supervisor from the run's ``_job_state`` file (written on
every change) and consults it again, so a master restart spends the same budget.

Ray-free and picklable: the state travels to a new job master and into storage.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from rayflow.config import RestartStrategy
from rayflow.failures import Failure, FailureHistory
from rayflow.status import FailureKind, JobState

__all__ = ["FailureRecord", "SupervisorState", "RestartSupervisor", "IllegalTransition"]

#: How many failures the history keeps (a count of all of them is kept too).
HISTORY = 20


class IllegalTransition(RuntimeError):
    """A job state change the lifecycle does not allow (a bug, not a user error)."""


@dataclass(frozen=True)
class FailureRecord:
    time: float
    kind: FailureKind
    attempt: int
    cause: str


@dataclass
class SupervisorState:
    """Everything the supervisor knows; what a new job master starts from."""

    run_id: str
    strategy: RestartStrategy
    state: JobState = JobState.CREATED
    attempt: int = -1  # the attempt started last; -1 before the first
    master_generation: int = 0
    restarts: int = 0
    master_restarts: int = 0
    failure_count: int = 0
    failures: list[FailureRecord] = field(default_factory=list)
    cause: str | None = None
    #: every failure, the same ones folded with a count (``JobClient.failure_history``)
    history: FailureHistory = field(default_factory=FailureHistory)
    #: why the run failed without restarting (no restart can fix its failure)
    non_recoverable: str | None = None
    #: the checkpoint id of a completed stop-with-savepoint: every later attempt, of any
    #: job master, reads no input and finishes at a final checkpoint
    stopped_at: int | None = None
    #: the directory of that stop's savepoint (written by the job master that recorded
    #: the stop, or else by the one that takes over)
    stop_savepoint: str | None = None


class RestartSupervisor:
    def __init__(self, state: SupervisorState) -> None:
        self.state = state

    @classmethod
    def new(cls, run_id: str, strategy: RestartStrategy) -> RestartSupervisor:
        return cls(SupervisorState(run_id=run_id, strategy=copy.deepcopy(strategy)))

    def snapshot(self) -> SupervisorState:
        return copy.deepcopy(self.state)

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def job_state(self) -> JobState:
        return self.state.state

    def move_to(self, target: JobState) -> None:
        current = self.state.state
        if current is target and target is not JobState.RESTARTING:
            return
        if not current.can_move_to(target):
            raise IllegalTransition(f"job state {current.value} cannot move to {target.value}")
        self.state.state = target

    def start_attempt(self) -> int:
        """The next attempt starts; its number is above every attempt of this run so far,
        also those of a job master that died. The first attempt makes the job RUNNING; a
        restarted job stays RESTARTING until :meth:`attempt_running`."""
        if self.state.state is not JobState.RESTARTING:
            self.move_to(JobState.RUNNING)
        self.state.attempt += 1
        return self.state.attempt

    def attempt_running(self) -> None:
        """Every subtask of the current attempt is deployed and restored, and runs: a
        restarting job is RUNNING again (a job in any other state stays as it is)."""
        if self.state.state is JobState.RESTARTING:
            self.move_to(JobState.RUNNING)

    def reserve_attempt(self) -> int:
        """An attempt number for work that is no regular attempt (a clean-up after the
        run ended), so that its messages are told apart from every attempt's."""
        self.state.attempt += 1
        return self.state.attempt

    def start_master(self) -> int:
        """A job master (re)starts for this run; returns its generation."""
        self.state.master_generation += 1
        return self.state.master_generation

    # --- failures -------------------------------------------------------------------------

    def on_failure(
        self,
        cause: str,
        kind: FailureKind,
        when: float | None = None,
        failure: Failure | None = None,
    ) -> float | None:
        """Record a failure; returns the delay before the next attempt, or None when the
        run must fail (the state is then FAILING): the restart strategy says so, or
        ``failure`` is one that no restart can fix. ``failure`` describes it for the
        folded history (made from ``cause`` when not given)."""
        when = time.time() if when is None else when
        failure = failure or Failure.of_text(kind, cause)
        s = self.state
        s.failure_count += 1
        s.failures.append(FailureRecord(when, kind, s.attempt, cause))
        del s.failures[:-HISTORY]
        s.history.add(failure, when)
        s.cause = cause
        if s.state in (JobState.CANCELLING, JobState.FAILING) or s.state.is_terminal:
            return None
        if not failure.recoverable:
            s.non_recoverable = failure.non_recoverable
            self.move_to(JobState.FAILING)
            return None
        delay = s.strategy.next_delay_s(when)
        if delay is None:
            self.move_to(JobState.FAILING)
            return None
        self.move_to(JobState.RESTARTING)
        s.restarts += 1
        if kind is FailureKind.JOB_MASTER_LOST:
            s.master_restarts += 1
        return delay

    def failure_message(self, job_name: str) -> str:
        s = self.state
        if s.non_recoverable is not None:
            return (
                f"job {job_name!r} failed after {s.restarts} restart(s), without another: "
                f"no restart can fix it ({s.non_recoverable}); cause: {s.cause}"
            )
        return (
            f"job {job_name!r} failed after {s.restarts} restart(s) "
            f"(restart strategy: {s.strategy.description}); cause: {s.cause}"
        )

    def begin_clean_up(self) -> None:
        """The run is over (cancelled, or failed for good) but its transactions still need
        their clean-up: CANCELLING, from any state that is not final."""
        if not self.state.state.is_terminal:
            self.state.state = JobState.CANCELLING

    def cancel(self) -> None:
        if not self.state.state.is_terminal and self.state.state is not JobState.CANCELLING:
            self.move_to(JobState.CANCELLING)
