"""The checkpoint coordinator: periodic rounds of trigger, acknowledge, complete,
notify (after Flink's ``CheckpointCoordinator``).

It runs inside the job master actor, one per job attempt. A round:

1. **trigger** checkpoint n at every source subtask (at most one pending, at
   least ``min_pause`` after the previous one ended);
2. collect an **ack** from every subtask with its snapshot's durable path and
   stats; on each ack, fetch the blob by a call whose result the job master owns
   (the object-store tier: it outlives any subtask);
3. **complete**: write the checkpoint's metadata in one atomic durable write,
   the commit point. Before it the checkpoint does not exist; after it, it is
   what a restore starts from and its sink transactions must be committed;
4. **notify** every subtask (best effort; sinks commit everything up to n);
5. subsume older checkpoints beyond the retained count.

A checkpoint is aborted on timeout, on a decline, or when the attempt fails;
more failed checkpoints in a row than tolerated fail the job attempt.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.config import CheckpointConfig
from rayflow.plan.physical import JobGraph
from rayflow.testing import Fault, FaultPoint

log = logging.getLogger("rayflow.checkpoint")

SubtaskKey = tuple[int, int]


@dataclass
class PendingCheckpoint:
    checkpoint_id: int
    trigger_time: float
    final: bool
    expected: set[SubtaskKey]
    acks: dict[SubtaskKey, dict[str, Any]] = field(default_factory=dict)
    refs: dict[SubtaskKey, Any] = field(default_factory=dict)


@dataclass
class CompletedCheckpoint:
    checkpoint_id: int
    metadata: dict[str, Any]
    refs: dict[SubtaskKey, Any] = field(default_factory=dict)


class CheckpointFailureLimit(RuntimeError):
    """More checkpoints failed in a row than the configuration tolerates."""


class CheckpointCoordinator:
    def __init__(
        self,
        job_name: str,
        config: CheckpointConfig,
        storage: CheckpointStorage,
        graph: JobGraph,
        tasks: dict[SubtaskKey, Any],
        attempt: int,
        next_checkpoint_id: int,
        on_failure: Callable[[BaseException], None],
        faults: list[Fault],
        stats: list[dict[str, Any]],
        latest: CompletedCheckpoint | None,
    ) -> None:
        self.job_name = job_name
        self.config = config
        self.storage = storage
        self.graph = graph
        self.tasks = tasks
        self.attempt = attempt
        self.next_id = next_checkpoint_id
        self.on_failure = on_failure
        self.faults = list(faults)
        self.stats = stats
        self.latest = latest
        self.sources = [k for k in tasks if graph.vertices[k[0]].is_source]
        self.pending: PendingCheckpoint | None = None
        self._final_requested = False
        self._final_done = False
        self._consecutive_failures = 0
        self._last_end = 0.0
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._timeout_task: asyncio.Task | None = None
        self._checkpoints_this_attempt = 0
        self._completing: asyncio.Future | None = None
        self._running: set[SubtaskKey] = set()
        self._all_running = asyncio.Event()

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._periodic())

    async def shutdown(self) -> None:
        for task in (self._loop_task, self._timeout_task):
            if task is not None:
                task.cancel()
        if self._completing is not None and not self._completing.done():
            # A commit point being written decides what the next attempt restores from.
            await asyncio.wait([self._completing], timeout=60)
        if self.pending is not None:
            self._record(self.pending, "ABORTED", "job attempt ended")
            self.pending = None

    def subtask_running(self, key: SubtaskKey) -> None:
        """A subtask restored its state and runs; checkpoints start once all of them do
        (a barrier sent earlier would wait in a starting actor's queue and time out)."""
        self._running.add(key)
        if self._running >= set(self.tasks):
            self._all_running.set()

    def request_final(self) -> None:
        """Every source is exhausted: take the final checkpoint next."""
        self._final_requested = True
        self._wakeup.set()

    # --- triggering ---------------------------------------------------------------------

    async def _periodic(self) -> None:
        interval = self.config.interval_ms / 1000.0
        min_pause = self.config.min_pause_between_checkpoints_ms / 1000.0
        try:
            await self._all_running.wait()
            last_trigger = time.time()
            while not self._final_done:
                if self.pending is None:
                    now = time.time()
                    due = max(last_trigger + interval, self._last_end + min_pause)
                    if self._final_requested:
                        due = self._last_end + min_pause if self._last_end else now
                    if now >= due:
                        last_trigger = now
                        await self.trigger(final=self._final_requested)
                        continue
                    timeout = due - now
                else:
                    timeout = interval
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=timeout)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaces as a failure of the attempt
            self.on_failure(exc)

    async def trigger(self, final: bool = False) -> int:
        cid = self.next_id
        self.next_id += 1
        now = time.time()
        self.pending = PendingCheckpoint(cid, now, final, set(self.tasks))
        self._timeout_task = asyncio.ensure_future(self._expire(cid))
        for key in self.sources:
            self.tasks[key].trigger_checkpoint.remote(cid, now, final)
        return cid

    async def _expire(self, cid: int) -> None:
        await asyncio.sleep(self.config.timeout_ms / 1000.0)
        pending = self.pending
        if pending is not None and pending.checkpoint_id == cid:
            missing = sorted(pending.expected - set(pending.acks))
            await self._abort(
                pending,
                f"timed out after {self.config.timeout_ms} ms waiting for subtasks {missing}",
            )

    # --- acknowledgements ---------------------------------------------------------------

    async def acknowledge(self, cid: int, key: SubtaskKey, info: dict[str, Any]) -> None:
        pending = self.pending
        if pending is None or pending.checkpoint_id != cid or key not in pending.expected:
            return
        if key in pending.acks:
            return
        pending.acks[key] = info
        pending.refs[key] = self.tasks[key].snapshot_blob.remote(cid)
        if len(pending.acks) == len(pending.expected):
            self._completing = asyncio.ensure_future(self._complete(pending))
            await self._completing

    async def decline(self, cid: int, key: SubtaskKey, reason: str) -> None:
        pending = self.pending
        if pending is not None and pending.checkpoint_id == cid:
            await self._abort(pending, f"declined by subtask {key}: {reason}")

    async def _complete(self, pending: PendingCheckpoint) -> None:
        cid = pending.checkpoint_id
        if self._timeout_task is not None:
            self._timeout_task.cancel()
        completed_at = time.time()
        metadata = self._metadata(pending, completed_at)
        try:
            await asyncio.to_thread(self.storage.commit_metadata, cid, metadata)
        except Exception as exc:  # noqa: BLE001
            await self._abort(
                pending, f"metadata write failed: {type(exc).__name__}: {exc}", force=True
            )
            return
        # ---- commit point: checkpoint `cid` exists from here on ----
        self.pending = None
        self._consecutive_failures = 0
        self._last_end = time.time()
        self._checkpoints_this_attempt += 1
        previous = self.latest
        self.latest = CompletedCheckpoint(cid, metadata, dict(pending.refs))
        self._record(pending, "COMPLETED", None, completed_at)
        self._fire_master_faults()
        for actor in self.tasks.values():
            actor.notify_checkpoint_complete.remote(cid)
        if pending.final:
            self._final_done = True
        self._subsume(previous)
        self._wakeup.set()

    def _fire_master_faults(self) -> None:
        for fault in list(self.faults):
            if fault.checkpoint != self._checkpoints_this_attempt:
                continue
            self.faults.remove(fault)
            if fault.point is FaultPoint.JOB_MASTER_BEFORE_NOTIFY:
                os.kill(os.getpid(), signal.SIGKILL)
            target = [
                k
                for k in self.tasks
                if k[1] == fault.subtask
                and (fault.vertex is None or fault.vertex in self.graph.vertices[k[0]].name)
            ]
            if target:
                ray.kill(self.tasks[target[0]], no_restart=True)

    def _subsume(self, previous: CompletedCheckpoint | None) -> None:
        retained = self.config.num_retained_checkpoints
        ids = self.storage.completed_ids()
        for old in ids[:-retained] if len(ids) > retained else []:
            self.storage.discard(old)
        del previous  # its object refs go out of scope here

    async def _abort(self, pending: PendingCheckpoint, reason: str, force: bool = False) -> None:
        if self.pending is not pending:
            return
        if len(pending.acks) == len(pending.expected) and not force:
            return  # every subtask acknowledged: it is being completed
        self.pending = None
        if self._timeout_task is not None:
            self._timeout_task.cancel()
        self._last_end = time.time()
        log.warning("checkpoint %d of %r aborted: %s", pending.checkpoint_id, self.job_name, reason)
        self._record(pending, "FAILED", reason)
        for actor in self.tasks.values():
            actor.notify_checkpoint_aborted.remote(pending.checkpoint_id)
        self.storage.discard(pending.checkpoint_id)
        self._consecutive_failures += 1
        if self._consecutive_failures > self.config.tolerable_failed_checkpoints:
            self.on_failure(
                CheckpointFailureLimit(
                    f"checkpoint {pending.checkpoint_id} failed ({reason}); "
                    f"{self._consecutive_failures} failed in a row, "
                    f"{self.config.tolerable_failed_checkpoints} tolerated"
                )
            )
        self._wakeup.set()

    # --- metadata and stats ---------------------------------------------------------------

    def _metadata(self, pending: PendingCheckpoint, completed_at: float) -> dict[str, Any]:
        subtasks = {}
        source_splits: dict[str, list[Any]] = {}
        for key, info in pending.acks.items():
            vertex = self.graph.vertices[key[0]]
            uids = list(info["uids"])
            if vertex.is_source:
                uids.append(vertex.source_uid)
                source_splits.setdefault(vertex.source_uid, []).extend(info["source_splits"] or [])
            subtasks[key] = {
                "path": info["path"],
                "size": info["size"],
                "uids": uids,
                "parallelism": vertex.parallelism,
                "vertex": vertex.name,
            }
        return {
            "checkpoint_id": pending.checkpoint_id,
            "job_name": self.job_name,
            "trigger_time": pending.trigger_time,
            "completed_at": completed_at,
            "attempt": self.attempt,
            "final": pending.final,
            "subtasks": subtasks,
            "source_splits": source_splits,
        }

    def _record(
        self,
        pending: PendingCheckpoint,
        status: str,
        reason: str | None,
        completed_at: float | None = None,
    ) -> None:
        end = completed_at or time.time()
        self.stats.append(
            {
                "checkpoint_id": pending.checkpoint_id,
                "status": status,
                "final": pending.final,
                "attempt": self.attempt,
                "trigger_time": pending.trigger_time,
                "duration_s": end - pending.trigger_time,
                "size": sum(a["size"] for a in pending.acks.values()),
                "failure": reason,
                "subtasks": {
                    f"{self.graph.vertices[k[0]].name}#{k[1]}": {
                        n: a.get(n)
                        for n in ("start_delay_s", "alignment_s", "sync_s", "async_s", "size")
                    }
                    for k, a in pending.acks.items()
                },
            }
        )
