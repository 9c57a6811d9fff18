"""The operator that drives a :class:`~rayflow.sink.TwoPhaseCommittingSink` through
the checkpoint protocol (the contract is in :mod:`rayflow.sink`).

EXACTLY_ONCE: at barrier n the open transaction (and any rolled before it) is
pre-committed and its committables become part of checkpoint n's state; they are
committed when the subtask learns that a checkpoint >= n completed. After a
restore every committable of the restored state is committed (idempotently) and
the subtask's lingering transactions are aborted.

AT_LEAST_ONCE: transactions are committed whenever they roll and at every barrier,
before the checkpoint completes, so nothing before a completed checkpoint is lost and
output written after it is written again on replay.
NONE: committed whenever a transaction rolls and at the end of input; checkpoints
play no part, so a failure loses the open transaction.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import replace
from typing import Any

import pyarrow as pa

from rayflow.guarantees import DeliveryGuarantee
from rayflow.runtime.hooks import HookPoint
from rayflow.runtime.operators import Operator, OperatorContext
from rayflow.sink import SinkContext, TwoPhaseCommittingSink

log = logging.getLogger("rayflow.sink")

COMMIT_RETRIES = 5
COMMIT_BACKOFF_S = 0.1
#: How many notifications' commit statistics a subtask keeps (totals are kept too).
COMMIT_HISTORY = 10


class TwoPhaseCommitSinkOperator(Operator):
    def __init__(self, sink: TwoPhaseCommittingSink) -> None:
        self.sink = sink
        self.transaction: Any = None
        self.opened_at = 0.0
        self.next_sequence = 0
        self.rolled: list[Any] = []  # pre-committed, not yet part of a checkpoint
        self.pending: dict[int, list[Any]] = {}  # checkpoint id -> committables
        self.restored: list[Any] = []
        self.restored_old_indices: set[int] = set()
        self.committed = 0
        self.commit_stats: collections.deque[dict[str, float]] = collections.deque(
            maxlen=COMMIT_HISTORY
        )
        self.commit_totals = {"notifications": 0, "transactions": 0, "commit_s": 0.0}
        self.fence: Any = None

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        self.mode = self.sink.delivery_guarantee
        self.hooks = context.hooks
        self.fence = context.fence
        self.sink_context = SinkContext(
            job_name=context.job_name,
            operator_uid=context.operator_uid,
            subtask_index=context.subtask_index,
            parallelism=context.parallelism,
            attempt=context.attempt,
            run_id=context.run_id,
        )
        policy = self.sink.rolling_policy
        self.max_size = policy.max_part_size
        self.max_open_s = policy.rollover_interval_s

    # --- writing ------------------------------------------------------------------------

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        if self.transaction is None:
            self.transaction = self.sink.begin_transaction(self.sink_context, self.next_sequence)
            self.next_sequence += 1
            self.opened_at = time.monotonic()
        self.sink.write(self.transaction, batch)
        if (
            self.max_size is not None
            and self.sink.transaction_size(self.transaction) >= self.max_size
        ) or (self.max_open_s is not None and time.monotonic() - self.opened_at >= self.max_open_s):
            self._roll()
        return []

    def _roll(self) -> None:
        """Pre-commit the open transaction (if it holds anything)."""
        transaction, self.transaction = self.transaction, None
        if transaction is None:
            return
        if self.sink.is_empty(transaction):
            self.sink.abort_transaction(transaction)
            return
        committable = self.sink.pre_commit(transaction)
        if self.mode is not DeliveryGuarantee.EXACTLY_ONCE:
            self._commit(committable)
        else:
            self.rolled.append(committable)

    # --- checkpoints --------------------------------------------------------------------

    def snapshot_state(self, checkpoint_id: int) -> Any:
        if self.hooks is not None:
            self.hooks.at(HookPoint.SINK_BEFORE_PRE_COMMIT)
        if self.mode is not DeliveryGuarantee.NONE:
            self._roll()
        if self.hooks is not None:
            self.hooks.at(HookPoint.SINK_AFTER_PRE_COMMIT)
        if self.mode is DeliveryGuarantee.EXACTLY_ONCE:
            if self.rolled:
                self.pending[checkpoint_id] = self.rolled
            self.rolled = []
        elif self.mode is DeliveryGuarantee.AT_LEAST_ONCE:
            for committable in self.rolled:
                self._commit(committable)
            self.rolled = []
        return {
            "pending": {cid: list(cs) for cid, cs in self.pending.items()},
            "next_sequence": self.next_sequence,
            "subtask": self.context.subtask_index,
        }

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        started = time.time()
        count = 0
        for cid in sorted(c for c in self.pending if c <= checkpoint_id):
            for committable in self.pending[cid]:
                self._commit(committable)
                count += 1
            del self.pending[cid]
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

    def restore_state(self, snapshots: list[Any]) -> None:
        for state in snapshots:
            if not state:
                continue
            for cid in sorted(state["pending"]):
                self.restored.extend(state["pending"][cid])
            self.next_sequence = max(self.next_sequence, state["next_sequence"])
            self.restored_old_indices.add(state["subtask"])

    def restore_global(self, snapshots: list[Any]) -> None:
        """Sequences never repeat, whatever the rescaling: continue after the highest."""
        for state in snapshots:
            if state:
                self.next_sequence = max(self.next_sequence, state["next_sequence"])

    def recover(self, checkpoint_id: int | None) -> None:
        """After a restore from ``checkpoint_id``: commit its committables, abort the rest.

        Runs in a thread that may outlive its attempt; the fence stops it before any
        side effect once the next attempt has started."""
        for committable in self.restored:
            self._commit(committable)
        keep = list(self.restored)
        self.restored = []
        aborted = 0
        if self.hooks is not None:
            self.hooks.at(HookPoint.DURING_RECOVER)
        indices = self.restored_old_indices | {self.context.subtask_index}
        for index in sorted(indices):
            context = replace(self.sink_context, subtask_index=index)
            self._check_fence("abort of lingering transactions")
            aborted += self.sink.abort_lingering(context, keep)
            if self.hooks is not None and aborted:
                self.hooks.at(HookPoint.SINK_DURING_ABORT)
        if aborted:
            log.info(
                "%s: aborted %d lingering transaction(s) after restoring checkpoint %s",
                self.context.operator_name,
                aborted,
                checkpoint_id,
            )

    def _check_fence(self, what: str) -> None:
        if self.fence is not None:
            self.fence.check(f"{self.context.operator_name}: {what}")

    def _commit(self, committable: Any, fenced: bool = True) -> None:
        delay = COMMIT_BACKOFF_S
        for attempt in range(COMMIT_RETRIES + 1):
            if fenced:
                self._check_fence(f"commit of {self.sink.committable_id(committable)}")
            try:
                self.sink.commit(committable)
                break
            except Exception as exc:  # noqa: BLE001 - retried, then fails the job attempt
                if attempt == COMMIT_RETRIES:
                    raise RuntimeError(
                        f"commit of {self.sink.committable_id(committable)} failed after "
                        f"{COMMIT_RETRIES} retries: {type(exc).__name__}: {exc}"
                    ) from exc
                log.warning(
                    "commit of %s failed (%s); retrying in %.1f s",
                    self.sink.committable_id(committable),
                    exc,
                    delay,
                )
                time.sleep(delay)
                delay *= 2
        self.committed += 1
        if self.hooks is not None:
            self.hooks.at(HookPoint.SINK_DURING_COMMIT)

    # --- end ----------------------------------------------------------------------------

    def end_input(self) -> list[pa.RecordBatch]:
        if self.mode is not DeliveryGuarantee.EXACTLY_ONCE:
            self._roll()
            for committable in self.rolled:
                self._commit(committable)
            self.rolled = []
        return []

    def result(self) -> Any:
        return self.committed

    def metrics(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "commits": list(self.commit_stats),
            "commit_totals": dict(self.commit_totals),
        }

    def on_cancel(self, latest_completed: int | None) -> None:
        """The job is cancelled: commit what the latest completed checkpoint (and those
        before it) pre-committed, abort every other transaction of this subtask, and the
        lingering ones of earlier attempts (everything legitimate is committed by then)."""
        try:
            for committable in self.restored:  # of a completed checkpoint; not yet recovered
                self._commit(committable, fenced=False)
            self.restored = []
            for cid in sorted(self.pending):
                for committable in self.pending[cid]:
                    if latest_completed is not None and cid <= latest_completed:
                        self._commit(committable, fenced=False)
                    else:
                        self.sink.abort(committable)
            self.pending = {}
            for committable in self.rolled:
                self.sink.abort(committable)
            self.rolled = []
            transaction, self.transaction = self.transaction, None
            if transaction is not None:
                self.sink.abort_transaction(transaction)
            if self.mode is DeliveryGuarantee.EXACTLY_ONCE:
                for index in sorted(self.restored_old_indices | {self.context.subtask_index}):
                    self.sink.abort_lingering(replace(self.sink_context, subtask_index=index), [])
        finally:
            self.sink.close()

    def close(self) -> None:
        """Abort the open transaction (a failed or cancelled attempt); pre-committed ones
        stay for the restored state to commit or for ``abort_lingering``."""
        transaction, self.transaction = self.transaction, None
        try:
            if transaction is not None:
                self.sink.abort_transaction(transaction)
        except Exception as exc:  # noqa: BLE001 - recovery aborts it as lingering
            log.warning(
                "%s: could not abort an open transaction on close: %s",
                self.context.operator_name,
                exc,
            )
        finally:
            self.sink.close()
