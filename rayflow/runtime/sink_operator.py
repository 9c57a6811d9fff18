"""The operators at the end of a stream: :class:`SinkOperator` for write-through sinks and
:class:`TwoPhaseCommitSinkOperator`, which drives a
:class:`~rayflow.sink.TwoPhaseCommittingSink` through the checkpoint protocol (the
contract is in :mod:`rayflow.sink`). Each is built with the guarantee the job resolved
for its sink (:func:`sink_operator_factory`).

EXACTLY_ONCE: at barrier n the open transaction (and any rolled before it) is
pre-committed and its committables become part of checkpoint n's state (serialized with
the sink's versioned serializer); they are committed when the subtask learns that a
checkpoint >= n completed. After a restore every committable of the restored state is
committed (idempotently) and the subtask's lingering transactions are aborted. Once
input has ended and everything is committed, the subtask aborts whatever of its
transactions still lingers (a pre-commit that landed after its process was killed), so
a finished job leaves none behind.

AT_LEAST_ONCE: transactions are committed whenever they roll and at every barrier,
before the checkpoint completes, so nothing before a completed checkpoint is lost and
output written after it is written again on replay.
NONE: committed whenever a transaction rolls and at the end of input; checkpoints
play no part, so a failure loses the open transaction.

Commit outcomes (:class:`~rayflow.sink.CommitOutcome`): COMMITTED and ALREADY_COMMITTED
are success; FAILED fails the attempt at once with the sink's reason; RETRY_LATER keeps
the committable due (in order; due committables are in every snapshot, so a failure
loses none) and tries it again on a timer of the subtask's mailbox, or at the next
notification, with exponential backoff. Nothing sleeps on the mailbox. After
``CommitRetryPolicy.max_retries`` the attempt fails with the last reason. A committer
that raises instead of answering is treated as RETRY_LATER with the exception as the
reason. A subtask does not finish while commits are due.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from rayflow.eventtime.strategy import without_timestamps
from rayflow.guarantees import DeliveryGuarantee
from rayflow.runtime.fence import StaleAttemptError
from rayflow.runtime.hooks import HookPoint
from rayflow.runtime.operators import Operator, OperatorContext, SinkOperator, factory
from rayflow.sink import (
    CommitFailedError,
    CommitImpossibleError,
    CommitOutcome,
    CommitStatus,
    Sink,
    SinkContext,
    TwoPhaseCommittingSink,
)

__all__ = [
    "TwoPhaseCommitSinkOperator",
    "CommitRetryPolicy",
    "sink_operator_factory",
    "STATE_FORMAT",
]

log = logging.getLogger("rayflow.sink")

#: How many notifications' commit statistics a subtask keeps (totals are kept too).
COMMIT_HISTORY = 10
#: The layout of the sink operator's state: 2 stores committables as (version, bytes) of
#: the sink's serializer; states without a format (older) hold committable objects.
STATE_FORMAT = 2
#: The timer token of a commit retry.
RETRY_COMMITS = "retry-commits"


@dataclass(frozen=True)
class CommitRetryPolicy:
    """How often, and how patiently, a RETRY_LATER commit is tried again."""

    max_retries: int = 6
    first_backoff_s: float = 0.1
    max_backoff_s: float = 5.0

    def backoff_s(self, tries: int) -> float:
        """The wait after the ``tries``-th RETRY_LATER answer."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, tries - 1))


DEFAULT_RETRY = CommitRetryPolicy()


def sink_operator_factory(
    sink: Sink, guarantee: DeliveryGuarantee | None = None
) -> Callable[[], Operator]:
    """A picklable builder of the operator for ``sink``, giving ``guarantee`` (None: the
    sink's own)."""
    if isinstance(sink, TwoPhaseCommittingSink):
        return factory(TwoPhaseCommitSinkOperator, sink, guarantee)
    return factory(SinkOperator, sink, guarantee)


@dataclass
class _Due:
    """A committable to commit now, with its RETRY_LATER history."""

    committable: Any
    tries: int = 0
    first_retry_at: float = 0.0
    next_try_at: float = 0.0
    reason: str = ""


class TwoPhaseCommitSinkOperator(Operator):
    timers_after_final_barrier = True  # its timers retry commits the attempt waits for

    def __init__(
        self,
        sink: TwoPhaseCommittingSink,
        guarantee: DeliveryGuarantee | None = None,
        retry: CommitRetryPolicy | None = None,
    ) -> None:
        self.sink = sink
        self.mode = guarantee if guarantee is not None else sink.delivery_guarantee
        self.retry = retry or DEFAULT_RETRY
        self.writer: Any = None
        self.committer: Any = None
        self._serializer: Any = None
        self.transaction: Any = None
        self.opened_at = 0.0
        self.next_sequence = 0
        self.rolled: list[Any] = []  # pre-committed, not yet part of a checkpoint
        self.pending: dict[int, list[Any]] = {}  # checkpoint id -> committables
        self.due: list[_Due] = []  # to commit now, in order
        self.restored: list[Any] = []
        self.restored_old_indices: set[int] = set()
        self.input_ended = False
        self.swept_at_end = False
        self.committed = 0
        self.commit_retries = 0
        self.commit_stats: collections.deque[dict[str, float]] = collections.deque(
            maxlen=COMMIT_HISTORY
        )
        self.commit_totals = {"notifications": 0, "transactions": 0, "commit_s": 0.0}
        self.fence: Any = None
        self.hooks: Any = None
        self.timers: Any = None
        self._timer_armed = False
        self._closed = False

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        self.hooks = context.hooks
        self.fence = context.fence
        self.timers = context.timers
        self.label = f"sink {context.operator_name!r} ({type(self.sink).__name__})"
        self.sink_context = SinkContext(
            job_name=context.job_name,
            operator_uid=context.operator_uid,
            subtask_index=context.subtask_index,
            parallelism=context.parallelism,
            attempt=context.attempt,
            run_id=context.run_id,
            delivery_guarantee=self.mode,
            fence=context.fence,
            operator_name=context.operator_name,
            hooks=context.hooks,
        )
        policy = self.sink.rolling_policy
        self.max_size = policy.max_part_size
        self.max_open_s = policy.rollover_interval_s
        self.writer = self.sink.create_transaction_writer(self.sink_context)
        self.committer = self.sink.create_committer(self.sink_context)

    @property
    def serializer(self) -> Any:
        if self._serializer is None:
            self._serializer = self.sink.committable_serializer()
        return self._serializer

    # --- writing ------------------------------------------------------------------------

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        if self.transaction is None:
            self.transaction = self.writer.begin_transaction(self.next_sequence)
            self.next_sequence += 1
            self.opened_at = time.monotonic()
        self.writer.write(self.transaction, without_timestamps(batch))
        if (
            self.max_size is not None
            and self.writer.transaction_size(self.transaction) >= self.max_size
        ) or (self.max_open_s is not None and time.monotonic() - self.opened_at >= self.max_open_s):
            self._roll(None)
        return []

    def _roll(self, checkpoint_id: int | None) -> None:
        """Pre-commit the open transaction (if it holds anything)."""
        transaction, self.transaction = self.transaction, None
        if transaction is None:
            return
        if self.writer.is_empty(transaction):
            self.writer.abort_transaction(transaction)
            return
        committable = self.writer.pre_commit(transaction, checkpoint_id)
        if self.mode is DeliveryGuarantee.EXACTLY_ONCE:
            self.rolled.append(committable)
        else:
            self.due.append(_Due(committable))
            self._commit_due()

    # --- checkpoints --------------------------------------------------------------------

    def snapshot_state(self, checkpoint_id: int) -> Any:
        if self.hooks is not None:
            self.hooks.at(HookPoint.SINK_BEFORE_PRE_COMMIT)
        if self.mode is not DeliveryGuarantee.NONE:
            self._roll(checkpoint_id)
        if self.hooks is not None:
            self.hooks.at(HookPoint.SINK_AFTER_PRE_COMMIT)
        if self.mode is DeliveryGuarantee.EXACTLY_ONCE:
            if self.rolled:
                self.pending[checkpoint_id] = self.rolled
            self.rolled = []
        encode = self.serializer.encode
        return {
            "format": STATE_FORMAT,
            "pending": {cid: [encode(c) for c in cs] for cid, cs in self.pending.items()},
            "due": [encode(d.committable) for d in self.due],
            "next_sequence": self.next_sequence,
            "subtask": self.context.subtask_index,
        }

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        started = time.time()
        for cid in sorted(c for c in self.pending if c <= checkpoint_id):
            self.due.extend(_Due(c) for c in self.pending.pop(cid))
        count = self._commit_due()
        if count:
            took = time.time() - started
            self.commit_stats.append(
                {
                    "checkpoint_id": checkpoint_id,
                    "transactions": count,
                    "commit_s": took,
                    "committed_at": time.time(),
                }
            )
            totals = self.commit_totals
            totals["notifications"] += 1
            totals["transactions"] += count
            totals["commit_s"] += took

    def on_timer(self, token: Any) -> None:
        if token == RETRY_COMMITS:
            self._timer_armed = False
            self._commit_due()

    def commits_outstanding(self) -> bool:
        return bool(self.due)

    def restore_state(self, snapshots: list[Any]) -> None:
        for state in snapshots:
            if not state:
                continue
            decode = self._decoder(state)
            for entry in state.get("due", []):
                self.restored.append(decode(entry))
            for cid in sorted(state["pending"]):
                self.restored.extend(decode(entry) for entry in state["pending"][cid])
            self.next_sequence = max(self.next_sequence, state["next_sequence"])
            self.restored_old_indices.add(state["subtask"])

    def _decoder(self, state: dict[str, Any]) -> Callable[[Any], Any]:
        if state.get("format") is None:
            return lambda committable: committable  # pickled objects, as older versions did
        serializer = self.serializer
        label = self.label if hasattr(self, "label") else type(self.sink).__name__
        return lambda entry: serializer.decode(entry[0], entry[1], label)

    def restore_global(self, snapshots: list[Any]) -> None:
        """Sequences never repeat, whatever the rescaling: continue after the highest."""
        for state in snapshots:
            if state:
                self.next_sequence = max(self.next_sequence, state["next_sequence"])

    def recover(self, checkpoint_id: int | None) -> None:
        """After a restore from ``checkpoint_id``: commit its committables, abort the rest.

        Runs in a thread that may outlive its attempt; the fence stops it before any
        side effect once the next attempt has started. A committable that answers
        RETRY_LATER stays due for the mailbox to try again (and is kept from the
        lingering abort).

        A committable leaves ``restored`` only once it is committed or due (it is put in
        ``due`` first): a cancel's ``on_cancel`` may run while this thread still does
        (only ``run()`` is cancelled), and it must find every committable of the
        restored checkpoint not yet committed, whenever this thread stops."""
        keep = list(self.restored)
        for committable in keep:
            outcome = self._try_commit(committable)
            if outcome.done:
                self._committed_one()
            elif outcome.status is CommitStatus.FAILED:
                raise self._failure(committable, outcome)
            else:
                self.due.append(self._note_retry(_Due(committable), outcome, time.monotonic()))
            self._forget_restored(committable)
        aborted = 0
        if self.hooks is not None:
            self.hooks.at(HookPoint.DURING_RECOVER)
        for index in sorted(self.restored_old_indices | {self.context.subtask_index}):
            context = replace(self.sink_context, subtask_index=index)
            self._check_fence("abort of lingering transactions")
            aborted += self.committer.abort_lingering(context, keep)
            if self.hooks is not None and aborted:
                self.hooks.at(HookPoint.SINK_DURING_ABORT)
        if aborted:
            log.info(
                "%s: aborted %d lingering transaction(s) after restoring checkpoint %s",
                self.label,
                aborted,
                checkpoint_id,
            )
        if self.due:
            self._arm_timer()

    def _forget_restored(self, committable: Any) -> None:
        for position, held in enumerate(self.restored):
            if held is committable:
                del self.restored[position]
                return

    # --- committing ---------------------------------------------------------------------

    def _check_fence(self, what: str) -> None:
        if self.fence is not None:
            self.fence.check(f"{self.context.operator_name}: {what}")

    def _try_commit(self, committable: Any, fenced: bool = True) -> CommitOutcome:
        if fenced:
            self._check_fence(f"commit of {self.committer.committable_id(committable)}")
        try:
            outcome = self.committer.commit(committable)
        except StaleAttemptError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unanswered commit is tried again
            return CommitOutcome.retry_later(f"{type(exc).__name__}: {exc}", exc)
        if not isinstance(outcome, CommitOutcome):
            raise TypeError(
                f"{self.label}: {type(self.committer).__name__}.commit returned "
                f"{outcome!r}, not a CommitOutcome"
            )
        return outcome

    def _committed_one(self) -> None:
        self.committed += 1
        if self.hooks is not None:
            self.hooks.at(HookPoint.SINK_DURING_COMMIT)

    def _failure(self, committable: Any, outcome: CommitOutcome, tries: int = 0) -> Exception:
        what = self.committer.committable_id(committable)
        if outcome.status is CommitStatus.FAILED:
            # the sink's verdict: no retry, and so no restart, commits this committable
            text = f"{self.label}: commit of {what} failed: {outcome.reason}"
            error: CommitFailedError = CommitImpossibleError(text)
        else:
            text = (
                f"{self.label}: commit of {what} still not possible after {tries} tries "
                f"({self.retry.max_retries} retries): {outcome.reason}"
            )
            error = CommitFailedError(text)
        error.__cause__ = outcome.error
        return error

    def _note_retry(self, entry: _Due, outcome: CommitOutcome, now: float) -> _Due:
        entry.tries += 1
        entry.reason = outcome.reason
        if entry.tries == 1:
            entry.first_retry_at = now
        if entry.tries > self.retry.max_retries:
            raise self._failure(entry.committable, outcome, entry.tries)
        entry.next_try_at = now + self.retry.backoff_s(entry.tries)
        self.commit_retries += 1
        log.warning(
            "%s: commit of %s: %s; trying again in %.1f s (%d of %d)",
            self.label,
            self.committer.committable_id(entry.committable),
            outcome.reason,
            entry.next_try_at - now,
            entry.tries,
            self.retry.max_retries,
        )
        return entry

    def _commit_due(self) -> int:
        """Commit the due committables in order, until one must wait; returns how many
        were committed."""
        count = 0
        now = time.monotonic()
        while self.due:
            entry = self.due[0]
            if entry.next_try_at > now:
                break
            outcome = self._try_commit(entry.committable)
            if outcome.done:
                self.due.pop(0)
                count += 1
                self._committed_one()
                continue
            if outcome.status is CommitStatus.FAILED:
                raise self._failure(entry.committable, outcome)
            self._note_retry(entry, outcome, now)
            break
        if self.due:
            self._arm_timer()
        else:
            self._sweep_at_end()
        return count

    def _arm_timer(self) -> None:
        if self.timers is None or self._timer_armed or not self.due:
            return
        self._timer_armed = True
        self.timers.schedule(max(0.0, self.due[0].next_try_at - time.monotonic()), RETRY_COMMITS)

    def _sweep_at_end(self) -> None:
        """Input has ended and everything is committed: abort whatever of this subtask's
        transactions still lingers (once)."""
        if (
            self.mode is not DeliveryGuarantee.EXACTLY_ONCE
            or not self.input_ended
            or self.swept_at_end
            or self.transaction is not None
            or self.rolled
            or self.pending
            or self.due
        ):
            return
        self.swept_at_end = True
        aborted = 0
        for index in sorted(self.restored_old_indices | {self.context.subtask_index}):
            self._check_fence("abort of lingering transactions at the end of input")
            aborted += self.committer.abort_lingering(
                replace(self.sink_context, subtask_index=index), []
            )
        if aborted:
            log.info("%s: aborted %d lingering transaction(s) at the end", self.label, aborted)

    # --- end ----------------------------------------------------------------------------

    def end_input(self) -> list[pa.RecordBatch]:
        self.input_ended = True
        if self.mode is not DeliveryGuarantee.EXACTLY_ONCE:
            self._roll(None)
            self._commit_due()
        return []

    def result(self) -> Any:
        return self.committed

    def metrics(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "commit_retries": self.commit_retries,
            "commits": list(self.commit_stats),
            "commit_totals": dict(self.commit_totals),
        }

    def on_cancel(self, latest_completed: int | None) -> None:
        """The job is cancelled (or failed for good): commit what the latest completed
        checkpoint (and those before it) pre-committed, abort every other transaction of
        this subtask, and the lingering ones of earlier attempts (everything legitimate
        is committed by then). Runs in a clean-up thread, never on the mailbox: a
        RETRY_LATER commit is retried here, bounded."""
        try:
            # Of a completed checkpoint, not yet committed by ``recover`` (whose thread may
            # still run: a repeated commit is recognised). ``restored`` is read before
            # ``due``: a committable ``recover`` moves between them is in one or both.
            completed = list(self.restored) + [entry.committable for entry in self.due]
            for cid in sorted(self.pending):
                if latest_completed is not None and cid <= latest_completed:
                    completed.extend(self.pending[cid])
            self._commit_in_clean_up(completed)
            self.restored, self.due = [], []
            for cid in sorted(self.pending):
                if latest_completed is None or cid > latest_completed:
                    for committable in self.pending[cid]:
                        self.committer.abort(committable)
            self.pending = {}
            for committable in self.rolled:
                self.committer.abort(committable)
            self.rolled = []
            transaction, self.transaction = self.transaction, None
            if transaction is not None:
                self.writer.abort_transaction(transaction)
            if self.mode is DeliveryGuarantee.EXACTLY_ONCE:
                for index in sorted(self.restored_old_indices | {self.context.subtask_index}):
                    # The attempt's fence is revoked by now: this clean-up is the run's last
                    # word, done by the subtask that owns it.
                    context = replace(self.sink_context, subtask_index=index, fence=None)
                    self.committer.abort_lingering(context, [])
        finally:
            self._close_clients()

    def _commit_in_clean_up(self, committables: list[Any]) -> None:
        """Commit ``committables``, trying each in turn, again and again, until all are
        committed. Their order in the lists need not be the one the committer needs (a
        Kafka writer's are committed in sequence order; ``due`` may hold an earlier one
        than ``restored``): a round in which one was committed counts no retry for the
        others and gives them their whole budget again (they may have waited on it); only
        a round without any progress counts one (then waits out the backoff)."""
        entries = [_Due(committable) for committable in committables]
        while entries:
            now = time.monotonic()
            waiting: list[_Due] = []
            answers: list[tuple[_Due, CommitOutcome]] = []
            for entry in entries:
                if entry.next_try_at > now:
                    waiting.append(entry)
                    continue
                outcome = self._try_commit(entry.committable, fenced=False)
                if outcome.done:
                    self._committed_one()
                    continue
                if outcome.status is CommitStatus.FAILED:
                    raise self._failure(entry.committable, outcome)
                answers.append((entry, outcome))
                waiting.append(entry)
            progressed = len(waiting) < len(entries)
            entries = waiting
            if progressed:
                for entry in entries:  # what waited on the one committed starts afresh
                    entry.tries = 0
                continue
            if not entries:
                continue
            for entry, outcome in answers:
                self._note_retry(entry, outcome, now)
            wake = min(entry.next_try_at for entry in entries)
            time.sleep(max(0.0, wake - time.monotonic()))  # a clean-up thread, not the mailbox

    def close(self) -> None:
        """Abort the open transaction (a failed or cancelled attempt); pre-committed ones
        stay for the restored state to commit or for ``abort_lingering``."""
        transaction, self.transaction = self.transaction, None
        try:
            if transaction is not None and self.writer is not None:
                self.writer.abort_transaction(transaction)
        except Exception as exc:  # noqa: BLE001 - recovery aborts it as lingering
            log.warning(
                "%s: could not abort an open transaction on close: %s",
                getattr(self, "label", type(self.sink).__name__),
                exc,
            )
        finally:
            self._close_clients()

    def _close_clients(self) -> None:
        if self._closed:
            return
        self._closed = True
        for part in (self.writer, self.committer):
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - closing must not hide the first error
                log.warning("%s: close of %s failed: %s", type(self.sink).__name__, part, exc)
