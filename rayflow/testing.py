"""Fault injection for tests of exactly-once behaviour, and running a job in process
for unit tests of its functions (public).

:func:`run_in_process` (from :mod:`rayflow.inprocess`) runs a job without Ray, with the
same operators, partitioners and key groups, and no fault tolerance.

A :class:`FaultPlan` is a list of :class:`Fault` s handed to a job with
:func:`inject_faults`. Each fault fires at most once: in one attempt of the job
(attempt 0 is the first run, each restart adds one), in one subtask (or in the
job master), at one point of the checkpoint protocol. ``FaultPlan.random(seed)``
draws a repeatable plan, one fault per attempt, so a seeded run replays the same
failures.

Points: after a subtask processed N records; while a subtask is aligning
barriers; right after a subtask snapshotted (before it acknowledged); in the
job master after a checkpoint's commit point but before any subtask was
notified (a subtask is killed, or the job master itself dies); and the sink
steps (before/after pre-commit, during commit, during abort).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from rayflow.inprocess import InProcessResult, run_in_process
from rayflow.runtime.hooks import HookPoint, MasterHooks, RuntimeHooks, SubtaskHooks

__all__ = [
    "Fault",
    "FaultPoint",
    "FaultPlan",
    "InjectedFault",
    "inject_faults",
    "wait_for_checkpoints",
    "run_in_process",
    "InProcessResult",
]

#: The points where a fault can fire: the runtime's hook points.
FaultPoint = HookPoint

#: What ``FaultPlan.random`` draws from unless told otherwise: every kind of fault.
ALL_RANDOM_POINTS = [
    FaultPoint.AFTER_RECORDS,
    FaultPoint.DURING_ALIGNMENT,
    FaultPoint.AFTER_SNAPSHOT,
    FaultPoint.BEFORE_NOTIFY,
    FaultPoint.JOB_MASTER_BEFORE_NOTIFY,
    FaultPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT,
    FaultPoint.DURING_RECOVER,
    FaultPoint.DURING_BLOB_WRITE,
    FaultPoint.DURING_RESTART_DELAY,
    FaultPoint.FINAL_NOTIFY,
    FaultPoint.DURING_COMMIT_POINT,
    FaultPoint.DURING_STATE_LOAD,
    FaultPoint.DURING_CONNECT,
]


class InjectedFault(RuntimeError):
    """Raised by a fault whose action is ``raise``."""


@dataclass(frozen=True)
class Fault:
    """One failure: where, when, and how.

    ``vertex`` matches a subtask whose (chained) vertex name contains it; ``records``
    is the count of input records of this attempt after which AFTER_RECORDS fires;
    ``checkpoint`` is the n-th checkpoint (1-based) this attempt sees for the
    checkpoint-bound points. ``action``: ``sigkill`` (the process dies at once, as
    with ``kill -9``), ``raise`` (an exception in the subtask), ``sleep`` (the thread
    stalls ``seconds``; a slow thread, not a dead one) or ``drop`` (the step after the
    point does not happen: a lost notification). DURING_RECOVER and DURING_BLOB_WRITE
    stall by default and kill another subtask meanwhile, so the stalled thread
    outlives its attempt; DURING_RESTART_DELAY kills a subtask kept for reuse;
    FINAL_NOTIFY drops a final notification.
    """

    point: FaultPoint
    attempt: int = 0
    vertex: str | None = None
    subtask: int = 0
    records: int = 0
    checkpoint: int = 1
    action: str = "sigkill"
    seconds: float = 0.0

    def matches(self, vertex_name: str, subtask: int, attempt: int) -> bool:
        return (
            attempt == self.attempt
            and subtask == self.subtask
            and (self.vertex is None or self.vertex in vertex_name)
        )

    def fire(self) -> None:
        if self.action == "raise":
            raise InjectedFault(f"injected fault: {self}")
        if self.action == "sleep":
            time.sleep(self.seconds)
            return
        if self.action == "drop":
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _default_action(point: FaultPoint) -> tuple[str, float]:
    if point in (FaultPoint.DURING_RECOVER, FaultPoint.DURING_BLOB_WRITE):
        return "sleep", 2.0
    if point is FaultPoint.DURING_STATE_LOAD:
        return "sleep", 2.0
    if point is FaultPoint.FINAL_NOTIFY:
        return "drop", 0.0
    if point is FaultPoint.DURING_COMMIT_POINT:
        return "sigkill", 1.0  # a subtask dies while the commit point is being written
    return "sigkill", 0.0


@dataclass
class FaultPlan(RuntimeHooks):
    faults: list[Fault] = field(default_factory=list)

    @classmethod
    def random(
        cls,
        seed: int,
        kills: int = 3,
        vertices: list[str] | None = None,
        parallelism: int = 2,
        max_records: int = 200_000,
        points: list[FaultPoint] | None = None,
    ) -> FaultPlan:
        """``kills`` faults, one in each of the attempts 0..kills-1, drawn from ``seed``.

        A stalled thread (DURING_RECOVER, DURING_BLOB_WRITE) comes with a kill of
        another subtask in the same attempt, so the stalled work outlives its attempt.
        """
        rng = random.Random(seed)
        points = points or [
            FaultPoint.AFTER_RECORDS,
            FaultPoint.DURING_ALIGNMENT,
            FaultPoint.AFTER_SNAPSHOT,
            FaultPoint.BEFORE_NOTIFY,
        ]
        drawn = []
        for attempt in range(kills):
            point = points[attempt % len(points)] if attempt < len(points) else rng.choice(points)
            drawn.append(
                (
                    point,
                    rng.choice(vertices) if vertices else None,
                    rng.randrange(parallelism),
                    rng.randrange(1, max_records),
                    rng.randint(1, 2),
                )
            )
        rng.shuffle(drawn)
        faults = []
        for attempt, (point, vertex, subtask, records, checkpoint) in enumerate(drawn):
            action, seconds = _default_action(point)
            faults.append(
                Fault(point, attempt, vertex, subtask, records, checkpoint, action, seconds)
            )
            if action in ("sleep", "drop") and point is not FaultPoint.FINAL_NOTIFY:
                # the stall must outlive its attempt: something else fails meanwhile
                faults.append(
                    Fault(
                        FaultPoint.AFTER_RECORDS,
                        attempt,
                        None,
                        (subtask + 1) % parallelism,
                        rng.randrange(1, max_records // 4 + 2),
                    )
                )
        return cls(faults)

    @classmethod
    def seeded_kills(
        cls,
        seed: int,
        kills: int,
        parallelism: int,
        records_per_subtask: int,
        vertex: str | None = None,
    ) -> FaultPlan:
        """``kills`` SIGKILLs of subtasks, one in each of the attempts 0..kills-1, drawn
        from ``seed``: in attempt ``a``, subtask ``s`` of the vertex whose name contains
        ``vertex`` dies once it has taken ``r`` input records in that attempt. (With
        ``vertex`` None every vertex's subtask ``s`` carries the fault; sources take no
        input records, so it fires where input arrives first.)

        ``records_per_subtask`` is about how many records one subtask takes in a whole run;
        each ``r`` lies in the ``1/(kills+1)``-th of it, halved at most, so every kill
        still fires in a restarted attempt however far its predecessors got. The plan
        depends on nothing but its arguments: the same arguments give the same failures
        in runs with any checkpointing (AFTER_RECORDS needs no checkpoint).
        """
        if kills < 0:
            raise ValueError(f"seeded_kills: kills must be >= 0, got {kills}")
        if parallelism < 1 or records_per_subtask < 1:
            raise ValueError(
                "seeded_kills: parallelism and records_per_subtask must be >= 1, "
                f"got {parallelism} and {records_per_subtask}"
            )
        rng = random.Random(seed)
        span = max(1, records_per_subtask // (kills + 1))
        faults = [
            Fault(
                FaultPoint.AFTER_RECORDS,
                attempt=attempt,
                vertex=vertex,
                subtask=rng.randrange(parallelism),
                records=rng.randint(max(1, span // 2), span),
            )
            for attempt in range(kills)
        ]
        return cls(faults)

    def for_subtask(self, vertex_name: str, subtask: int, attempt: int) -> SubtaskFaults | None:
        mine = [
            f
            for f in self.faults
            if f.matches(vertex_name, subtask, attempt) and not f.point.in_job_master
        ]
        return SubtaskFaults(mine) if mine else None

    def for_job_master(self, attempt: int) -> MasterFaults | None:
        mine = [f for f in self.faults if f.attempt == attempt and f.point.in_job_master]
        return MasterFaults(mine) if mine else None


class SubtaskFaults(SubtaskHooks):
    """The faults of one subtask attempt, checked at the protocol's points."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)
        self.record_threshold = min(
            (f.records for f in self.faults if f.point is FaultPoint.AFTER_RECORDS),
            default=None,
        )
        self._checkpoints_seen: dict[FaultPoint, int] = {}

    def after_records(self, records: int) -> None:
        if self.record_threshold is not None and records >= self.record_threshold:
            self.record_threshold = None
            for f in self.faults:
                if f.point is FaultPoint.AFTER_RECORDS:
                    f.fire()

    def at(self, point: FaultPoint) -> None:
        """A checkpoint-bound point was reached (once per checkpoint)."""
        if not self.faults:
            return
        seen = self._checkpoints_seen[point] = self._checkpoints_seen.get(point, 0) + 1
        for f in self.faults:
            once = point in (FaultPoint.DURING_RECOVER, FaultPoint.DURING_STATE_LOAD)
            if f.point is point and (f.checkpoint == seen or once):
                f.fire()


class MasterFaults(MasterHooks):
    """The faults of one job master attempt."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)

    def at(self, point: FaultPoint, checkpoint: int, subtasks: dict[tuple[str, int], Any]) -> bool:
        import ray

        proceed = True
        for fault in list(self.faults):
            if fault.point is not point:
                continue
            bound = point in (
                FaultPoint.BEFORE_NOTIFY,
                FaultPoint.JOB_MASTER_BEFORE_NOTIFY,
                FaultPoint.DURING_COMMIT_POINT,
                FaultPoint.JOB_MASTER_BEFORE_STOP_RECORD,
                FaultPoint.JOB_MASTER_BEFORE_SAVEPOINT_WRITE,
            )
            if bound and fault.checkpoint != checkpoint:
                continue
            targets = [
                handle
                for (name, index), handle in subtasks.items()
                if index == fault.subtask and (fault.vertex is None or fault.vertex in name)
            ]
            if point in (
                FaultPoint.JOB_MASTER_BEFORE_NOTIFY,
                FaultPoint.JOB_MASTER_BEFORE_STOP_RECORD,
                FaultPoint.JOB_MASTER_BEFORE_SAVEPOINT_WRITE,
            ):
                self.faults.remove(fault)
                os.kill(os.getpid(), signal.SIGKILL)
            if point is FaultPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT:
                self.faults.remove(fault)
                os.kill(os.getpid(), signal.SIGKILL)
            if not targets:
                continue
            self.faults.remove(fault)
            if point is FaultPoint.FINAL_NOTIFY:
                proceed = False
            else:
                ray.kill(targets[0], no_restart=True)
                # dead before the step after the point (a notification, a redeploy)
                _wait_until_dead(targets[0])
            if point is FaultPoint.DURING_COMMIT_POINT and fault.seconds:
                time.sleep(fault.seconds)  # the commit point outlives the subtask's death
        return proceed


def _wait_until_dead(handle: Any, timeout_s: float = 120.0) -> None:
    """Return once the actor behind ``handle`` is dead. A kill travels through Ray's
    control plane while calls go to the actor directly: without this wait, the step
    after the point (a notification) can reach the actor before its death does."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ActorDiedError:
            return
        except ActorUnavailableError:
            pass  # dying, or unreachable for a moment: ask again
        except GetTimeoutError:
            break
        time.sleep(0.01)
    raise RuntimeError(
        f"fault injection: the killed actor {handle} was still alive after {timeout_s:.0f} s"
    )


def inject_faults(env, plan: RuntimeHooks) -> None:
    """Run ``env`` 's next job with ``plan``'s faults (any :class:`RuntimeHooks`).

    The plan belongs to that one run: it travels with the run's settings to the run's own
    job master and subtasks (attempts are counted within the run), and ``env`` forgets it
    once the run has started, so a later ``execute`` of the same environment runs without
    faults unless given a plan again."""
    env._fault_plan = plan


def wait_for_checkpoints(client, count: int, timeout_s: float = 60.0) -> int:
    """Block until ``client`` 's job has completed ``count`` checkpoints (or the job ended,
    or ``timeout_s`` passed); returns how many it has completed."""
    import time

    deadline = time.time() + timeout_s
    completed = 0
    while time.time() < deadline:
        try:
            completed = sum(1 for c in client.checkpoints() if c["status"] == "COMPLETED")
        except Exception:  # noqa: BLE001 - the job master is restarting or already gone
            completed = completed
        if completed >= count:
            break
        time.sleep(0.05)
    return completed
