"""The sink contract: plain writers, and two-phase-commit sinks that make a job's
effect on the outside world exactly once.

A sink object is a *builder*: configuration only, pickled into every subtask. The
objects that talk to the outside world (clients, connections, open files) are made
from it inside each subtask and never travel.

Two kinds of sink:

* :class:`Sink`: ``create_writer(context)`` makes a :class:`SinkWriter` per subtask that
  writes straight through. ``flush()`` is called at every checkpoint barrier; a sink
  whose writer makes everything durable there may offer AT_LEAST_ONCE (replay after a
  failure writes again), otherwise it gives NONE.
* :class:`TwoPhaseCommittingSink` ``[TxnT, CommT]`` (after Flink's Sink V2 with a
  committer, and ``TwoPhaseCommitSinkFunction``). Per subtask it makes a
  :class:`TransactionWriter` (``create_transaction_writer``) and a :class:`Committer`
  (``create_committer``); ``committable_serializer()`` turns committables into
  versioned bytes for checkpoints. The runtime drives them from the subtask's mailbox:

  1. ``begin_transaction(sequence)`` opens a transaction (``TxnT``) whose output nobody
     can see yet (a hidden file, an open multipart upload, a database transaction);
  2. ``write(transaction, batch)`` writes into it (uncommitted);
  3. at checkpoint barrier n, ``pre_commit(transaction, n)`` makes it survive any
     failure and returns a small *committable* (``CommT``) that describes everything
     needed to commit it later from any process. Committables go into checkpoint n's
     state, serialized with the serializer's version (checkpoints outlive code
     changes; a version the code cannot read is a clear error);
  4. when checkpoint n completes, ``commit(committable)`` makes it visible and answers
     with a :class:`CommitOutcome`: COMMITTED, ALREADY_COMMITTED (recognised for sure,
     not guessed), RETRY_LATER (the runtime tries again later, without blocking the
     mailbox, a bounded number of times, then fails the job with the reason) or
     FAILED with a reason (fails the job at once);
  5. ``abort(committable)`` drops a pre-committed transaction, and
     ``abort_transaction(transaction)`` an open one;
  6. after a restore from checkpoint n, every committable in n's state is committed
     again, and ``abort_lingering(context, keep)`` aborts this subtask's transactions
     that the state does not hold (found by ``transaction_prefix(context)``, unique per
     job, operator and subtask). Every committer must implement it: a sink offering
     EXACTLY_ONCE has to find what a crashed attempt left behind.

  Notifications can be lost: told of checkpoint n, the runtime commits every pending
  committable of every checkpoint up to and including n. A transaction may not stay
  open longer than ``max_transaction_lifetime_s`` (declared by the sink; None: no
  limit), so a checkpoint interval + timeout longer than that is refused when the job
  is built.

  ``hold_run(context)`` (optional) marks a run live in the target for the whole run: the
  job master takes it before the first attempt and lets it go once the run is cleaned
  up, so a sink that refuses to run next to another live run of its job name (one on
  another Ray cluster, which the cluster's run lock does not see) finds a run that waits
  between two attempts too.

Delivery guarantees, one rule for every sink: each sink declares the
:class:`~rayflow.guarantees.DeliveryGuarantee` s it can really give
(``supported_guarantees``). Left open (``delivery_guarantee=None``, the default of every
sink), a sink gives in each job the strongest guarantee it supports that the job's
checkpointing can back: EXACTLY_ONCE with exactly-once checkpointing, AT_LEAST_ONCE with
at-least-once checkpointing, NONE without checkpoints. A guarantee asked for is never
weakened: the job refuses to build, naming the sink, when the sink or the checkpointing
cannot give it. What each sink gives is a
:class:`~rayflow.guarantees.GuaranteeResolution` kept in the job graph; building the
graph (``get_job_graph()``, ``explain()``) never changes the sink object. A
two-phase-commit sink in AT_LEAST_ONCE mode commits at the barrier (before the
checkpoint completes), in NONE mode whenever a transaction rolls.

Direct use: a :class:`TwoPhaseCommittingSink` also offers the steps above as its own
methods (``sink.begin_transaction(context, sequence)``, ``sink.commit(committable)``
raising on anything but success, ...), for tools and tests that drive a sink without a
job. They run on writers and a committer this process keeps in a slot of the sink that
never travels (see :mod:`rayflow.process_local`). The runtime does not use them.
"""

from __future__ import annotations

import abc
import enum
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import pyarrow as pa

from rayflow import process_local
from rayflow.guarantees import (
    CheckpointingFacts,
    DeliveryGuarantee,
    GuaranteeResolution,
    UnsupportedGuaranteeError,
    end_to_end,
    resolve_guarantee,
    strongest,
    unsupported_message,
)
from rayflow.recoverability import NonRecoverableError

__all__ = [
    "Sink",
    "SinkWriter",
    "SinkContext",
    "TwoPhaseCommittingSink",
    "TransactionWriter",
    "Committer",
    "CommitStatus",
    "CommitOutcome",
    "CommitFailedError",
    "CommitImpossibleError",
    "CommittableSerializer",
    "UnknownCommittableVersionError",
    "RollingPolicy",
    "RunHold",
    "UnsupportedGuaranteeError",
]

TxnT = TypeVar("TxnT")
CommT = TypeVar("CommT")


@dataclass(frozen=True)
class SinkContext:
    """Where a writer or committer runs, and what it must give."""

    job_name: str
    operator_uid: str
    subtask_index: int
    parallelism: int
    attempt: int
    #: the run this subtask belongs to (``run-<start time>-<random>``); sinks that name
    #: their output put it in the names, so a rerun never writes over an earlier run's
    run_id: str = ""
    #: the guarantee the job resolved for this sink (None: the sink's own default)
    delivery_guarantee: DeliveryGuarantee | None = None
    #: the attempt's fence (``rayflow.runtime.fence.AttemptFence``), None outside a job
    fence: Any = field(default=None, compare=False, repr=False)
    #: the sink's operator name in the job (for messages)
    operator_name: str = ""
    #: the subtask attempt's hooks (``rayflow.runtime.hooks.SubtaskHooks``), None outside
    #: a job: a committer calls ``hooks.at(HookPoint.SINK_INSIDE_COMMIT)`` where dying
    #: leaves its commit half done, so fault injection can kill it there
    hooks: Any = field(default=None, compare=False, repr=False)

    def run_tag(self) -> str:
        """A short, time-sorted name part for the run (empty when there is no run id)."""
        return self.run_id[len("run-") :] if self.run_id.startswith("run-") else self.run_id

    def check_fence(self, what: str) -> None:
        """Raise ``StaleAttemptError`` when this attempt has ended (call right before a
        side effect that work of an older attempt must not have)."""
        if self.fence is not None:
            self.fence.check(what)


# --- plain (write-through) sinks --------------------------------------------------------


class SinkWriter(abc.ABC):
    """Writes the batches of one sink subtask (write-through)."""

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Write one batch."""

    def flush(self) -> None:  # noqa: B027
        """At a checkpoint barrier: make everything written so far durable in the target
        (what lets a sink offer AT_LEAST_ONCE)."""

    def finish(self) -> Any:
        """Input has ended: flush everything; the return value reaches ``JobResult``."""
        return None

    def close(self) -> None:  # noqa: B027
        """Release resources; called on success and on failure."""


class Sink(abc.ABC):
    """Where a stream ends: a picklable builder of the writers of each subtask."""

    #: The guarantees this sink can really give.
    supported_guarantees: ClassVar[frozenset[DeliveryGuarantee]] = frozenset(
        {DeliveryGuarantee.NONE}
    )

    def __init__(self, delivery_guarantee: DeliveryGuarantee | None = None) -> None:
        #: False when the user left the guarantee open: each job then gives the strongest
        #: one that both the sink and the job's checkpointing can give, and says so.
        self.guarantee_requested = delivery_guarantee is not None
        if delivery_guarantee is None:
            delivery_guarantee = strongest(self.supported_guarantees)
        if not isinstance(delivery_guarantee, DeliveryGuarantee):
            raise TypeError(
                f"{type(self).__name__}: delivery_guarantee must be a DeliveryGuarantee, "
                f"got {delivery_guarantee!r}"
            )
        if delivery_guarantee not in self.supported_guarantees:
            raise UnsupportedGuaranteeError(
                unsupported_message(
                    type(self).__name__, delivery_guarantee, self.supported_guarantees
                )
            )
        #: What the sink was asked for; when left open, the strongest it supports (what it
        #: gives used on its own). A job's own resolution is in its job graph.
        self.delivery_guarantee = delivery_guarantee

    @property
    def requested_guarantee(self) -> DeliveryGuarantee | None:
        """The guarantee asked for, None when left open."""
        return self.delivery_guarantee if self.guarantee_requested else None

    def create_writer(self, context: SinkContext) -> SinkWriter:
        """A writer for one subtask (write-through sinks)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement create_writer")

    def setup(  # noqa: B027
        self, job_name: str, guarantee: GuaranteeResolution | None = None
    ) -> None:
        """Called on the driver before the job is deployed, with what the sink gives in
        the job (a sink checks its target here: it fails the job before it starts)."""

    def merge_results(self, results: list[Any]) -> Any:
        """Combine the ``finish()`` results of every subtask (in subtask order)."""
        return results

    # --- the job's guarantee ------------------------------------------------------------

    def resolve_guarantee(
        self, name: str, checkpointing: CheckpointingFacts
    ) -> GuaranteeResolution:
        """What this sink gives as operator ``name`` of a job with this checkpointing (the
        rule in the module docstring); raises ``UnsupportedGuaranteeError`` naming the
        sink. Changes nothing on the sink."""
        given = resolve_guarantee(
            name,
            type(self).__name__,
            self.supported_guarantees,
            self.requested_guarantee,
            checkpointing,
            self._transaction_lifetime_s(),
        )
        return GuaranteeResolution(
            sink_name=name,
            sink_type=type(self).__name__,
            requested=self.requested_guarantee,
            delivery_guarantee=given,
            end_to_end=self.describe_end_to_end(given, checkpointing),
        )

    def describe_end_to_end(
        self, guarantee: DeliveryGuarantee, checkpointing: CheckpointingFacts
    ) -> str:
        """What the job promises through this sink, in words (never more than holds)."""
        return end_to_end(
            guarantee, checkpointing.enabled, checkpointing.mode, checkpointing.alignment
        )

    def _transaction_lifetime_s(self) -> float | None:
        return None


def _id_part(name: str, limit: int) -> str:
    clean = re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "x"
    if clean != name or len(clean) > limit:
        digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]
        clean = f"{clean[: limit - 9]}-{digest}"
    return clean


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


# --- commit outcomes ----------------------------------------------------------------------


class CommitStatus(enum.Enum):
    """How a commit went."""

    COMMITTED = "committed"
    #: committed before (a commit repeated after a failure); recognised for sure
    ALREADY_COMMITTED = "already committed"
    #: not now (throttled, unreachable, locked); the runtime tries again later
    RETRY_LATER = "retry later"
    #: cannot be committed, for the reason given (data lost, another writer's output)
    FAILED = "failed"


@dataclass(frozen=True)
class CommitOutcome:
    """The answer of :meth:`Committer.commit`: a status, why, and the sink's own error
    (raised as it is in direct use, chained to the job's error by the runtime)."""

    status: CommitStatus
    reason: str = ""
    error: BaseException | None = field(default=None, compare=False)

    @classmethod
    def committed(cls) -> CommitOutcome:
        return cls(CommitStatus.COMMITTED)

    @classmethod
    def already_committed(cls, reason: str = "") -> CommitOutcome:
        return cls(CommitStatus.ALREADY_COMMITTED, reason)

    @classmethod
    def retry_later(cls, reason: str, error: BaseException | None = None) -> CommitOutcome:
        return cls(CommitStatus.RETRY_LATER, reason, error)

    @classmethod
    def failed(cls, reason: str, error: BaseException | None = None) -> CommitOutcome:
        return cls(CommitStatus.FAILED, reason, error)

    @property
    def done(self) -> bool:
        """The committable is visible (committed now or before)."""
        return self.status in (CommitStatus.COMMITTED, CommitStatus.ALREADY_COMMITTED)


class CommitFailedError(RuntimeError):
    """A committable could not be committed (FAILED, or still RETRY_LATER after the
    runtime's bounded retries)."""

    #: Read by :mod:`rayflow.recoverability`: a commit that ran out of retries may succeed
    #: after a restart, whatever made it fail. Its committable belongs to a completed
    #: checkpoint, whose output must become visible: the restart strategy, not the cause,
    #: decides when to give up on it.
    restart_may_fix: ClassVar[bool] = True


class CommitImpossibleError(CommitFailedError, NonRecoverableError):
    """The sink answered FAILED: this committable can never be committed (its
    pre-committed data is gone, or another writer's output holds its name). Every restart
    would restore the same committable and fail the same way, so no restart is tried
    (see :mod:`rayflow.recoverability`)."""

    restart_may_fix: ClassVar[bool] = False


# --- committables in checkpoints ----------------------------------------------------------


class UnknownCommittableVersionError(ValueError):
    """A checkpoint holds committables in a serializer version this code cannot read."""


class CommittableSerializer(abc.ABC, Generic[CommT]):
    """Committables to bytes and back, for checkpoints.

    Checkpoints outlive code changes: every serialized committable is stored with the
    ``version`` that wrote it, and :meth:`decode` hands that version to
    :meth:`deserialize`. A serializer reads every version in ``readable_versions``
    (its own by default); anything else is :class:`UnknownCommittableVersionError`.
    """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The version :meth:`serialize` writes (bump it when the format changes)."""

    @property
    def readable_versions(self) -> frozenset[int]:
        return frozenset({self.version})

    @abc.abstractmethod
    def serialize(self, committable: CommT) -> bytes: ...

    @abc.abstractmethod
    def deserialize(self, version: int, data: bytes) -> CommT:
        """A committable of ``version`` (one of ``readable_versions``)."""

    def encode(self, committable: CommT) -> tuple[int, bytes]:
        return self.version, self.serialize(committable)

    def decode(self, version: int, data: bytes, owner: str = "") -> CommT:
        if version not in self.readable_versions:
            raise UnknownCommittableVersionError(
                f"{owner or type(self).__name__}: the checkpoint holds committables of "
                f"serializer version {version}, but this code reads versions "
                f"{sorted(self.readable_versions)} ({type(self).__name__}). Restore it "
                "with the version of the sink that wrote it, or start without it."
            )
        return self.deserialize(version, data)


# --- two-phase commit ---------------------------------------------------------------------


class TransactionWriter(abc.ABC, Generic[TxnT, CommT]):
    """One sink subtask's transactions; made in the subtask by
    :meth:`TwoPhaseCommittingSink.create_transaction_writer`. Called from the subtask's
    mailbox only (never concurrently)."""

    @abc.abstractmethod
    def begin_transaction(self, sequence: int) -> TxnT:
        """Open transaction number ``sequence`` of this subtask (sequences never repeat
        within a job's committed history)."""

    @abc.abstractmethod
    def write(self, transaction: TxnT, batch: pa.RecordBatch) -> None:
        """Write ``batch`` into ``transaction``; invisible until commit."""

    def transaction_size(self, transaction: TxnT) -> int:
        """Bytes written into ``transaction`` so far (drives size-based rolling)."""
        return 0

    def is_empty(self, transaction: TxnT) -> bool:
        """True when nothing was written; an empty transaction is not pre-committed."""
        return False

    @abc.abstractmethod
    def pre_commit(self, transaction: TxnT, checkpoint_id: int | None = None) -> CommT:
        """Make ``transaction`` survive any failure; return its committable.
        ``checkpoint_id``: the checkpoint whose barrier closes it (None when it closes
        for another reason: its size or age, the end of input without checkpoints)."""

    @abc.abstractmethod
    def abort_transaction(self, transaction: TxnT) -> None:
        """Drop an open (not pre-committed) transaction."""

    def close(self) -> None:  # noqa: B027
        """Release connections; drop transactions still open here (never pre-committed
        ones: a checkpoint may hold them)."""


class Committer(abc.ABC, Generic[CommT]):
    """Commits and aborts one sink subtask's committables; made in the subtask by
    :meth:`TwoPhaseCommittingSink.create_committer`. A committable may come from any
    process and any earlier attempt."""

    @abc.abstractmethod
    def commit(self, committable: CommT) -> CommitOutcome:
        """Make ``committable`` visible. Idempotent: a repeated commit answers
        ALREADY_COMMITTED when it can tell for sure that this committable is what is
        visible, FAILED when something else is."""

    @abc.abstractmethod
    def abort(self, committable: CommT) -> None:
        """Drop a pre-committed transaction; already gone (or committed) is success."""

    @abc.abstractmethod
    def abort_lingering(self, context: SinkContext, keep: Sequence[CommT]) -> int:
        """Abort the transactions of the subtask ``context`` names (by its
        ``transaction_prefix``) that are not in ``keep``; returns how many. Required:
        without it, what a crashed attempt pre-committed would stay forever."""

    def committable_id(self, committable: CommT) -> str:
        """A stable id of a committable (for logs and errors)."""
        return repr(committable)

    def close(self) -> None:  # noqa: B027
        """Release clients and connections."""


class RunHold(abc.ABC):
    """What :meth:`TwoPhaseCommittingSink.hold_run` returns: closed when the run is over."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let the mark go (idempotent; must not raise)."""


class TwoPhaseCommittingSink(Sink, Generic[TxnT, CommT]):
    """A sink that writes into transactions committed when a checkpoint completes.

    Subclasses are builders: they implement :meth:`create_transaction_writer`,
    :meth:`create_committer` and :meth:`committable_serializer`; the objects those make
    live in the subtask. Transactions stay in the subtask; committables travel in
    checkpoints (through the serializer).
    """

    supported_guarantees = frozenset(
        {DeliveryGuarantee.NONE, DeliveryGuarantee.AT_LEAST_ONCE, DeliveryGuarantee.EXACTLY_ONCE}
    )

    #: How long the target keeps an open transaction before it drops it (an S3 bucket's
    #: lifecycle rule, a database's idle transaction timeout); None: no limit. A job whose
    #: checkpoint interval + timeout is longer refuses to build with EXACTLY_ONCE.
    max_transaction_lifetime_s: float | None = None

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

    def guarantee_in(self, context: SinkContext | None) -> DeliveryGuarantee:
        """The guarantee to give where ``context`` runs (the job's resolution, else the
        sink's own)."""
        if context is not None and context.delivery_guarantee is not None:
            return context.delivery_guarantee
        return self.delivery_guarantee

    @abc.abstractmethod
    def create_transaction_writer(self, context: SinkContext) -> TransactionWriter[TxnT, CommT]:
        """The writer of subtask ``context`` (called in the subtask)."""

    @abc.abstractmethod
    def create_committer(self, context: SinkContext | None) -> Committer[CommT]:
        """The committer of subtask ``context`` (None in direct use)."""

    @abc.abstractmethod
    def committable_serializer(self) -> CommittableSerializer[CommT]:
        """How this sink's committables are stored in checkpoints."""

    def hold_run(self, context: SinkContext) -> RunHold | None:
        """Mark run ``context.run_id`` of this sink as live in the target for as long as
        the run lives, across its attempts (``context`` names subtask 0; its attempt is
        -1). The job master calls it before the run's first attempt (a job master that
        takes over a run calls it again) and closes what it returns once the run is over
        and cleaned up. A sink whose subtasks refuse to run next to another live run of
        the same job name (``sinks.postgres.PostgresSink``) holds its mark here, so a run that
        waits between two attempts, with no subtask connected, is still found. It may
        raise (another run lives): the run then fails with that error. None: nothing to
        hold (the default)."""
        return None

    def _transaction_lifetime_s(self) -> float | None:
        return self.max_transaction_lifetime_s

    # --- direct use (tools and tests; the runtime never calls these) ---------------------

    def _direct(self) -> _DirectUse:
        return process_local.local(self, "direct-use", lambda: _DirectUse(self))

    def begin_transaction(self, context: SinkContext, sequence: int) -> TxnT:
        return self._direct().begin(context, sequence)

    def write(self, transaction: TxnT, batch: pa.RecordBatch) -> None:
        self._direct().writer_of(transaction).write(transaction, batch)

    def transaction_size(self, transaction: TxnT) -> int:
        return self._direct().writer_of(transaction).transaction_size(transaction)

    def is_empty(self, transaction: TxnT) -> bool:
        return self._direct().writer_of(transaction).is_empty(transaction)

    def pre_commit(self, transaction: TxnT, checkpoint_id: int | None = None) -> CommT:
        return self._direct().release(transaction).pre_commit(transaction, checkpoint_id)

    def abort_transaction(self, transaction: TxnT) -> None:
        self._direct().release(transaction).abort_transaction(transaction)

    def commit(self, committable: CommT) -> None:
        """Commit; raises the sink's error (or :class:`CommitFailedError`) unless the
        outcome is COMMITTED or ALREADY_COMMITTED."""
        committer = self._direct().committer()
        outcome = committer.commit(committable)
        if not outcome.done:
            if outcome.error is not None:
                raise outcome.error
            raise CommitFailedError(
                f"{type(self).__name__}: commit of {committer.committable_id(committable)}: "
                f"{outcome.status.value}: {outcome.reason}"
            )

    def abort(self, committable: CommT) -> None:
        self._direct().committer().abort(committable)

    def abort_lingering(self, context: SinkContext, keep: Sequence[CommT]) -> int:
        return self._direct().committer().abort_lingering(context, keep)

    def committable_id(self, committable: CommT) -> str:
        return self._direct().committer().committable_id(committable)

    def close(self) -> None:
        """Close this process's direct-use writers (their open transactions are dropped)
        and committer."""
        direct = process_local.drop(self, "direct-use")
        if direct is not None:
            direct.close()


class _DirectUse:
    """The writers (one per context) and the committer that direct use of one sink
    object runs on in this process."""

    def __init__(self, sink: TwoPhaseCommittingSink) -> None:
        self.sink = sink
        self.writers: dict[SinkContext, TransactionWriter] = {}
        self.owners: dict[int, tuple[Any, TransactionWriter]] = {}
        self._committer: Committer | None = None

    def begin(self, context: SinkContext, sequence: int) -> Any:
        writer = self.writers.get(context)
        if writer is None:
            writer = self.writers[context] = self.sink.create_transaction_writer(context)
        transaction = writer.begin_transaction(sequence)
        self.owners[id(transaction)] = (transaction, writer)
        return transaction

    def writer_of(self, transaction: Any) -> TransactionWriter:
        entry = self.owners.get(id(transaction))
        if entry is None or entry[0] is not transaction:
            raise ValueError(
                f"{type(self.sink).__name__}: not an open transaction of this sink object "
                "(pre-committed or aborted already, or begun by another copy)"
            )
        return entry[1]

    def release(self, transaction: Any) -> TransactionWriter:
        writer = self.writer_of(transaction)
        del self.owners[id(transaction)]
        return writer

    def committer(self) -> Committer:
        if self._committer is None:
            self._committer = self.sink.create_committer(None)
        return self._committer

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        if self._committer is not None:
            self._committer.close()
        self.writers, self.owners, self._committer = {}, {}, None
