"""The sink contract: plain writers, and two-phase-commit sinks that make a job's
effect on the outside world exactly once.

Two kinds of sink:

* :class:`Sink` with a :class:`SinkWriter` per subtask: write-through, no part in
  checkpoints. It can give at most ``DeliveryGuarantee.NONE``.
* :class:`TwoPhaseCommittingSink` (after Flink's ``TwoPhaseCommitSinkFunction``
  and Sink V2 committer). The runtime drives it per subtask:

  1. ``begin_transaction(context, sequence)`` opens a transaction whose output
     nobody can see yet (an open multipart upload, a hidden file, an open
     database transaction);
  2. ``write(transaction, batch)`` writes into it (uncommitted);
  3. at checkpoint barrier n, ``pre_commit(transaction)`` flushes it and returns a
     small picklable *committable* that describes everything needed to commit
     it later from any process. Committables go into checkpoint n's state;
  4. when checkpoint n completes, ``commit(committable)`` makes it visible. It
     must be idempotent: "already committed" is success. Failed commits are
     retried with backoff and fail the job only after the retries;
  5. ``abort(committable)`` drops a pre-committed transaction, and
     ``abort_transaction(transaction)`` an open one;
  6. after a restore from checkpoint n, every committable in n's state is
     committed again (``commit`` is idempotent), and
     ``abort_lingering(context, keep)`` aborts this subtask's transactions that
     the state does not hold. They are found by ``transaction_prefix(context)``,
     unique per job, operator and subtask.

  Notifications can be lost: told of checkpoint n, the runtime commits every
  pending committable of every checkpoint up to and including n.

Each sink declares the :class:`~rayflow.guarantees.DeliveryGuarantee` s it can
really give (``supported_guarantees``); asking for more fails when the job is
built, as does EXACTLY_ONCE with checkpointing off. A two-phase-commit sink in
AT_LEAST_ONCE mode commits at the barrier (before the checkpoint completes), in
NONE mode whenever a transaction rolls, independent of checkpoints.
"""

from __future__ import annotations

import abc
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rayflow.guarantees import DeliveryGuarantee

__all__ = [
    "Sink",
    "SinkWriter",
    "SinkContext",
    "TwoPhaseCommittingSink",
    "RollingPolicy",
    "UnsupportedGuaranteeError",
]


class UnsupportedGuaranteeError(ValueError):
    """A sink was asked for a delivery guarantee it cannot give."""


@dataclass(frozen=True)
class SinkContext:
    """Where a writer or transaction runs."""

    job_name: str
    operator_uid: str
    subtask_index: int
    parallelism: int
    attempt: int
    #: the run this subtask belongs to (``run-<start time>-<random>``); sinks that name
    #: their output put it in the names, so a rerun never writes over an earlier run's
    run_id: str = ""

    def run_tag(self) -> str:
        """A short, time-sorted name part for the run (empty when there is no run id)."""
        return self.run_id[len("run-") :] if self.run_id.startswith("run-") else self.run_id


class SinkWriter(abc.ABC):
    """Writes the batches of one sink subtask (write-through)."""

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Write one batch."""

    def finish(self) -> Any:
        """Input has ended: flush everything; the return value reaches ``JobResult``."""
        return None

    def close(self) -> None:  # noqa: B027
        """Release resources; called on success and on failure."""


class Sink(abc.ABC):
    """Where a stream ends."""

    #: The guarantees this sink can really give.
    supported_guarantees: frozenset[DeliveryGuarantee] = frozenset({DeliveryGuarantee.NONE})

    def __init__(self, delivery_guarantee: DeliveryGuarantee | None = None) -> None:
        #: False when the user left the guarantee open: the job then picks the strongest
        #: one that both the sink and the job's checkpointing can give, and says so.
        self.guarantee_requested = delivery_guarantee is not None
        if delivery_guarantee is None:
            delivery_guarantee = max(self.supported_guarantees, key=lambda g: g.rank)
        if not isinstance(delivery_guarantee, DeliveryGuarantee):
            raise TypeError(
                f"{type(self).__name__}: delivery_guarantee must be a DeliveryGuarantee, "
                f"got {delivery_guarantee!r}"
            )
        if delivery_guarantee not in self.supported_guarantees:
            raise UnsupportedGuaranteeError(
                _unsupported(type(self).__name__, delivery_guarantee, self.supported_guarantees)
            )
        self.delivery_guarantee = delivery_guarantee

    def create_writer(self, context: SinkContext) -> SinkWriter:
        """A writer for one subtask (write-through sinks)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement create_writer")

    def setup(self, job_name: str) -> None:  # noqa: B027
        """Called on the driver before the job is deployed."""

    def merge_results(self, results: list[Any]) -> Any:
        """Combine the ``finish()`` results of every subtask (in subtask order)."""
        return results


def _id_part(name: str, limit: int) -> str:
    clean = re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "x"
    if clean != name or len(clean) > limit:
        digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]
        clean = f"{clean[: limit - 9]}-{digest}"
    return clean


def _unsupported(name: str, asked: DeliveryGuarantee, supported) -> str:
    best = max(supported, key=lambda g: g.rank)
    return (
        f"{name} cannot give {asked.name} delivery: it supports "
        f"{', '.join(sorted(g.name for g in supported))}. Ask for {best.name} or use a sink "
        "that commits through transactions (EXACTLY_ONCE needs two-phase commit)."
    )


@dataclass(frozen=True)
class RollingPolicy:
    """When a transaction (a part file) is closed and a new one begun.

    ``on_checkpoint``: always at a checkpoint barrier (the only choice for
    EXACTLY_ONCE: output becomes visible when the checkpoint completes).
    ``max_part_size``: roll when a transaction holds this many bytes.
    ``rollover_interval_s``: roll when a transaction has been open this long.
    """

    on_checkpoint: bool = True
    max_part_size: int | None = 128 * 1024 * 1024
    rollover_interval_s: float | None = None

    @classmethod
    def default(cls) -> RollingPolicy:
        return cls()


class TwoPhaseCommittingSink(Sink):
    """A sink that writes into transactions committed when a checkpoint completes.

    Subclasses implement the transaction methods below; the runtime calls them from
    the sink subtask's mailbox (never concurrently). ``transaction`` objects stay in
    the subtask; committables travel in checkpoints and must be picklable.
    """

    supported_guarantees = frozenset(
        {DeliveryGuarantee.NONE, DeliveryGuarantee.AT_LEAST_ONCE, DeliveryGuarantee.EXACTLY_ONCE}
    )

    def __init__(
        self,
        delivery_guarantee: DeliveryGuarantee | None = None,
        rolling_policy: RollingPolicy | None = None,
    ) -> None:
        super().__init__(delivery_guarantee)
        self.rolling_policy = rolling_policy or RollingPolicy.default()

    def transaction_prefix(self, context: SinkContext) -> str:
        """Prefix of every transaction id of one subtask: unique per job, operator, subtask.

        Parts are cleaned to ``[A-Za-z0-9-]`` and joined with ``_`` (which no part
        contains); a part that had to be changed or shortened carries a hash of the
        original, so two different names never share a prefix.
        """
        job = _id_part(context.job_name, 40)
        uid = _id_part(context.operator_uid, 40)
        return f"{job}_{uid}_{context.subtask_index:04d}_"

    @abc.abstractmethod
    def begin_transaction(self, context: SinkContext, sequence: int) -> Any:
        """Open transaction number ``sequence`` of this subtask (sequences never repeat
        within a job's committed history)."""

    @abc.abstractmethod
    def write(self, transaction: Any, batch: pa.RecordBatch) -> None:
        """Write ``batch`` into ``transaction``; invisible until commit."""

    def transaction_size(self, transaction: Any) -> int:
        """Bytes written into ``transaction`` so far (drives size-based rolling)."""
        return 0

    def is_empty(self, transaction: Any) -> bool:
        """True when nothing was written; an empty transaction is not pre-committed."""
        return False

    @abc.abstractmethod
    def pre_commit(self, transaction: Any) -> Any:
        """Flush ``transaction`` so it survives any failure; return its committable."""

    @abc.abstractmethod
    def commit(self, committable: Any) -> None:
        """Make ``committable`` visible; already committed is success."""

    @abc.abstractmethod
    def abort(self, committable: Any) -> None:
        """Drop a pre-committed transaction; already gone is success."""

    def abort_transaction(self, transaction: Any) -> None:
        """Drop an open (not pre-committed) transaction."""
        self.abort(self.pre_commit(transaction))

    def abort_lingering(self, context: SinkContext, keep: list[Any]) -> int:
        """Abort this subtask's transactions that are not in ``keep``; returns how many."""
        return 0

    def committable_id(self, committable: Any) -> str:
        """A stable id of a committable (for logs and idempotence checks)."""
        return repr(committable)

    def close(self) -> None:  # noqa: B027
        """Release clients and connections in this subtask."""
