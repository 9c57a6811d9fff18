"""Fault injection for tests of exactly-once behaviour (public).

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

import enum
import os
import random
import signal
from dataclasses import dataclass, field

__all__ = [
    "Fault",
    "FaultPoint",
    "FaultPlan",
    "InjectedFault",
    "inject_faults",
    "wait_for_checkpoints",
]


class InjectedFault(RuntimeError):
    """Raised by a fault whose action is ``raise``."""


class FaultPoint(str, enum.Enum):
    AFTER_RECORDS = "after-records"
    DURING_ALIGNMENT = "during-alignment"
    AFTER_SNAPSHOT = "after-snapshot"
    BEFORE_NOTIFY = "before-notify"  # job master kills the subtask after the commit point
    JOB_MASTER_BEFORE_NOTIFY = "job-master-before-notify"  # the job master dies there
    SINK_BEFORE_PRE_COMMIT = "sink-before-pre-commit"
    SINK_AFTER_PRE_COMMIT = "sink-after-pre-commit"
    SINK_DURING_COMMIT = "sink-during-commit"
    SINK_DURING_ABORT = "sink-during-abort"


@dataclass(frozen=True)
class Fault:
    """One failure: where, when, and how.

    ``vertex`` matches a subtask whose (chained) vertex name contains it; ``records``
    is the count of input records of this attempt after which AFTER_RECORDS fires;
    ``checkpoint`` is the n-th checkpoint (1-based) this attempt sees for the
    checkpoint-bound points. ``action`` is ``sigkill`` (the process dies at once,
    as with ``kill -9``) or ``raise`` (an exception in the subtask).
    """

    point: FaultPoint
    attempt: int = 0
    vertex: str | None = None
    subtask: int = 0
    records: int = 0
    checkpoint: int = 1
    action: str = "sigkill"

    def matches(self, vertex_name: str, subtask: int, attempt: int) -> bool:
        return (
            attempt == self.attempt
            and subtask == self.subtask
            and (self.vertex is None or self.vertex in vertex_name)
        )

    def fire(self) -> None:
        if self.action == "raise":
            raise InjectedFault(f"injected fault: {self}")
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class FaultPlan:
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
        """``kills`` faults, one in each of the attempts 0..kills-1, drawn from ``seed``."""
        rng = random.Random(seed)
        points = points or [
            FaultPoint.AFTER_RECORDS,
            FaultPoint.DURING_ALIGNMENT,
            FaultPoint.AFTER_SNAPSHOT,
            FaultPoint.BEFORE_NOTIFY,
        ]
        faults = []
        for attempt in range(kills):
            point = points[attempt % len(points)] if attempt < len(points) else rng.choice(points)
            faults.append(
                Fault(
                    point=point,
                    attempt=attempt,
                    vertex=rng.choice(vertices) if vertices else None,
                    subtask=rng.randrange(parallelism),
                    records=rng.randrange(1, max_records),
                    checkpoint=rng.randint(1, 2),
                )
            )
        rng.shuffle(faults)
        faults = [
            Fault(f.point, attempt, f.vertex, f.subtask, f.records, f.checkpoint, f.action)
            for attempt, f in enumerate(faults)
        ]
        return cls(faults)

    def for_subtask(self, vertex_name: str, subtask: int, attempt: int) -> list[Fault]:
        return [f for f in self.faults if f.matches(vertex_name, subtask, attempt)]

    def for_job_master(self, attempt: int) -> list[Fault]:
        return [
            f
            for f in self.faults
            if f.attempt == attempt
            and f.point in (FaultPoint.BEFORE_NOTIFY, FaultPoint.JOB_MASTER_BEFORE_NOTIFY)
        ]


class SubtaskFaults:
    """The faults of one subtask attempt, checked at the protocol's points."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = [
            f
            for f in faults
            if f.point not in (FaultPoint.BEFORE_NOTIFY, FaultPoint.JOB_MASTER_BEFORE_NOTIFY)
        ]
        self.record_threshold = min(
            (f.records for f in self.faults if f.point is FaultPoint.AFTER_RECORDS),
            default=None,
        )
        self._checkpoints_seen: dict[FaultPoint, int] = {}

    def after_records(self, records: int) -> None:
        if self.record_threshold is not None and records >= self.record_threshold:
            for f in self.faults:
                if f.point is FaultPoint.AFTER_RECORDS:
                    f.fire()

    def at(self, point: FaultPoint) -> None:
        """A checkpoint-bound point was reached (once per checkpoint)."""
        if not self.faults:
            return
        seen = self._checkpoints_seen[point] = self._checkpoints_seen.get(point, 0) + 1
        for f in self.faults:
            if f.point is point and f.checkpoint == seen:
                f.fire()


def inject_faults(env, plan: FaultPlan) -> None:
    """Run ``env`` 's next job with ``plan``'s faults."""
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
