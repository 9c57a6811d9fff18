"""The checkpoint coordinator: periodic rounds of trigger, acknowledge, complete,
notify (after Flink's ``CheckpointCoordinator``).

It runs inside the job master actor, one per job attempt. A round:

1. **trigger** checkpoint n at every source subtask (at most one pending, at
   least ``min_pause`` after the previous one ended);
2. collect an **ack** from every subtask with its snapshot's durable path and
   stats; a small snapshot comes with the ack and is kept here, a larger one is
   fetched by a call whose result the job master owns (the object-store tier:
   either way it outlives any subtask);
3. **complete**: write the checkpoint's metadata in one atomic durable write,
   the commit point. Before it the checkpoint does not exist; after it, it is
   what a restore starts from and its sink transactions must be committed;
4. **notify** the subtasks that act on it (best effort; sinks commit everything
   up to n; a subtask says in its ack whether it does), every subtask of a final one;
5. subsume older checkpoints beyond the retained count.

A checkpoint is aborted on timeout, on a decline, or when the attempt fails;
more failed checkpoints in a row than tolerated fail the job attempt.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rayflow.checkpoint.failures import CheckpointFailureManager
from rayflow.checkpoint.metadata import CheckpointMetadata, SubtaskStateMeta
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.config import CheckpointConfig
from rayflow.plan.physical import JobGraph
from rayflow.runtime.hooks import HookPoint, MasterHooks
from rayflow.status import CheckpointFailureReason, CheckpointStatus

log = logging.getLogger("rayflow.checkpoint")

SubtaskKey = tuple[int, int]


@dataclass
class SavepointRequest:
    """A savepoint asked for: written to ``target`` (a parent directory); with ``stop``
    the job stops at its barrier. ``done`` resolves to the savepoint's directory,
    ``directory`` (named when it is triggered: a stop records it, so that a job master
    taking over writes it if this one could not)."""

    target: str
    stop: bool
    done: asyncio.Future
    directory: str | None = None
    #: its caller stopped waiting: never triggered from now on
    withdrawn: bool = False


@dataclass
class PendingCheckpoint:
    checkpoint_id: int
    trigger_time: float
    final: bool
    expected: set[SubtaskKey]
    acks: dict[SubtaskKey, dict[str, Any]] = field(default_factory=dict)
    refs: dict[SubtaskKey, Any] = field(default_factory=dict)
    savepoint: SavepointRequest | None = None


@dataclass
class CompletedCheckpoint:
    checkpoint_id: int
    metadata: CheckpointMetadata
    refs: dict[SubtaskKey, Any] = field(default_factory=dict)


class CheckpointIdCounter:
    """Checkpoint ids of one run: strictly increasing across attempts and job master
    restarts, never reused (after Flink's ``CheckpointIDCounter``). Ids are reserved in
    blocks in the run's storage, so a job master started after this one died begins
    above every id this one could have handed out."""

    BLOCK = 64

    def __init__(self, storage: CheckpointStorage | None, start: int) -> None:
        self.storage = storage
        self.next_id = max(1, start)
        self.reserved = self.next_id - 1

    @property
    def needs_reservation(self) -> bool:
        return self.next_id > self.reserved

    def reserve(self) -> None:
        """Durably reserve the next block of ids (blocking: storage may be remote)."""
        reserved = self.next_id + self.BLOCK - 1
        if self.storage is not None:
            self.storage.reserve_ids(reserved)
        self.reserved = reserved

    def take(self) -> int:
        if self.needs_reservation:
            self.reserve()
        cid = self.next_id
        self.next_id += 1
        return cid


class CheckpointHistory:
    """Statistics of the last ``size`` checkpoints plus running totals since the job
    started: memory stays flat however long a job runs (Flink keeps 10 by default)."""

    def __init__(
        self, size: int = 10, on_add: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        #: called with the statistics of each checkpoint as it ends (Ray's metrics)
        self.on_add = on_add
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self.counts: dict[str, int] = {s.value: 0 for s in CheckpointStatus}
        self.completed_ids: collections.deque[int] = collections.deque(maxlen=size)
        self.total_duration_s = 0.0
        self.max_duration_s = 0.0
        self.latest_completed: int | None = None
        #: statistics of the most recent checkpoint that did not complete (Flink's
        #: "latest failed checkpoint"), kept after it leaves ``recent``
        self.latest_failed: dict[str, Any] | None = None

    def add(self, stats: dict[str, Any]) -> None:
        self.recent.append(stats)
        if self.on_add is not None:
            self.on_add(stats)
        status = stats["status"]
        self.counts[status] = self.counts.get(status, 0) + 1
        if status == CheckpointStatus.COMPLETED:
            self.completed_ids.append(stats["checkpoint_id"])
            self.latest_completed = stats["checkpoint_id"]
            self.total_duration_s += stats["duration_s"]
            self.max_duration_s = max(self.max_duration_s, stats["duration_s"])
        elif status != CheckpointStatus.IN_PROGRESS:
            self.latest_failed = dict(stats)

    def summary(self) -> dict[str, Any]:
        completed = self.counts[CheckpointStatus.COMPLETED.value]
        return {
            "counts": dict(self.counts),
            "latest_completed": self.latest_completed,
            "latest_failed": dict(self.latest_failed) if self.latest_failed else None,
            "mean_duration_s": self.total_duration_s / completed if completed else None,
            "max_duration_s": self.max_duration_s,
        }


class CheckpointCoordinator:
    def __init__(
        self,
        job_name: str,
        config: CheckpointConfig,
        storage: CheckpointStorage,
        graph: JobGraph,
        tasks: dict[SubtaskKey, Any],
        attempt: int,
        ids: CheckpointIdCounter,
        on_failure: Callable[[BaseException], None],
        hooks: MasterHooks | None,
        history: CheckpointHistory,
        latest: CompletedCheckpoint | None,
        run_id: str | None = None,
        failures: CheckpointFailureManager | None = None,
        on_stopped: Callable[[int, str], Awaitable[None]] | None = None,
    ) -> None:
        """``on_stopped(checkpoint_id, directory)`` is awaited when a stop-with-savepoint
        completed, before its savepoint is written and before any subtask hears of it (the
        job master records it durably; when it raises, the stop did not happen: the
        attempt fails and the job goes on from that checkpoint)."""
        self.job_name = job_name
        self.run_id = run_id
        self.config = config
        self.storage = storage
        self.graph = graph
        self.tasks = tasks
        self.attempt = attempt
        self.ids = ids
        self.on_failure = on_failure
        self.hooks = hooks or MasterHooks()
        self.history = history
        self.latest = latest
        self.sources = [k for k in tasks if graph.vertices[k[0]].is_source]
        self.pending: PendingCheckpoint | None = None
        self._final_requested = False
        self._final_done = False
        self.failures = failures or CheckpointFailureManager(config.tolerable_failed_checkpoints)
        self.on_stopped = on_stopped
        self._last_end = 0.0
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._timeout_task: asyncio.Task | None = None
        self._checkpoints_this_attempt = 0
        self._completing: asyncio.Future | None = None
        self._running: set[SubtaskKey] = set()
        self._all_running = asyncio.Event()
        self._ended: set[SubtaskKey] = set()
        self._final_id: int | None = None
        self._renotify_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        #: one trigger at a time (the periodic one and a savepoint's)
        self._trigger_lock = asyncio.Lock()
        #: savepoint requests by the id their caller gave (to withdraw them), newest last
        self._savepoints: collections.OrderedDict[str, SavepointRequest] = collections.OrderedDict()
        #: checkpoints being copied into savepoints: never subsumed meanwhile
        self._exporting: set[int] = set()
        self._closed = asyncio.Event()  # shut down: the attempt ended
        #: the id of a completed stop-with-savepoint: the job stops there, also when this
        #: attempt fails before every subtask finished
        self.stopped_at: int | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._periodic())

    async def shutdown(self) -> None:
        self._closed.set()
        for task in (self._loop_task, self._timeout_task, self._renotify_task):
            if task is not None:
                task.cancel()
        while self._completing is not None and not self._completing.done():
            # A commit point being written decides what the next attempt restores from and
            # what a cancel commits: its outcome must be known, however long it takes.
            done, _ = await asyncio.wait([self._completing], timeout=30)
            if not done:
                log.warning("checkpoint of %r: still writing its commit point", self.job_name)
        if self.pending is not None:
            reason = f"{CheckpointFailureReason.ATTEMPT_ENDED}: job attempt ended"
            self._record(self.pending, CheckpointStatus.ABORTED, reason)
            self._fail_savepoint(self.pending, reason)
            self.pending = None
        if self._background:
            await asyncio.wait(list(self._background), timeout=30)

    def subtask_ended(self, key: SubtaskKey) -> None:
        """A subtask's ``run()`` returned: it needs no more notifications."""
        self._ended.add(key)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def subtask_running(self, key: SubtaskKey) -> None:
        """A subtask restored its state and runs; checkpoints start once all of them do
        (a barrier sent earlier would wait in a starting actor's queue and time out)."""
        if key in self.tasks:
            self._running.add(key)
        if len(self._running) == len(self.tasks):  # O(1): called once per subtask
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
            self.hooks.at(HookPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT, 0, self._named_tasks())
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

    async def trigger(
        self, final: bool = False, savepoint: SavepointRequest | None = None
    ) -> int | None:
        """Trigger the next checkpoint; None when one is pending already (or the final
        one is done)."""
        async with self._trigger_lock:
            if self.pending is not None or self._final_done:
                return None
            if self.ids.needs_reservation:
                await asyncio.to_thread(self.ids.reserve)
            if savepoint is not None and savepoint.withdrawn:
                return None
            cid = self.ids.take()
            now = time.time()
            if savepoint is not None:
                from rayflow.checkpoint.savepoint import savepoint_directory

                savepoint.directory = savepoint_directory(savepoint.target, cid)
            final = final or (savepoint is not None and savepoint.stop)
            self.pending = PendingCheckpoint(cid, now, final, set(self.tasks), savepoint=savepoint)
            self._timeout_task = asyncio.ensure_future(self._expire(cid))
            for key in self.sources:
                self.tasks[key].trigger_checkpoint.remote(
                    self.attempt, cid, now, final, savepoint is not None
                )
            return cid

    async def trigger_savepoint(
        self, target: str, stop: bool, request_id: str | None = None
    ) -> str:
        """Take a savepoint into a new directory under ``target`` once no checkpoint is
        pending (with ``stop``: the sources stop at its barrier, and every subtask finishes
        once it completes); returns the savepoint's directory. Its id comes from the
        run's counter like any checkpoint's; a failed savepoint is a failed checkpoint
        that never counts against the tolerated checkpoint failures. ``request_id``
        names it for :meth:`withdraw_savepoint`."""
        from rayflow.checkpoint.savepoint import SavepointError

        request = SavepointRequest(target, stop, asyncio.get_running_loop().create_future())
        if request_id is not None:
            self._savepoints[request_id] = request
            while len(self._savepoints) > 100:  # the newest requests: any caller's is there
                self._savepoints.popitem(last=False)
        while True:
            if request.withdrawn:
                raise SavepointError(
                    f"job {self.job_name!r}: the savepoint was withdrawn before it was taken"
                )
            if self._closed.is_set():
                raise SavepointError(
                    f"job {self.job_name!r}: its attempt ended before the savepoint was "
                    "taken (the job is restarting, cancelled or done)"
                )
            if self._final_done or self._final_requested:
                raise SavepointError(
                    f"job {self.job_name!r} is finishing (its input ended, or it is being "
                    "stopped): no savepoint"
                )
            if (
                self._all_running.is_set()
                and self.pending is None
                and await self.trigger(savepoint=request) is not None
            ):
                break
            await asyncio.sleep(0.01)
        return await request.done

    async def withdraw_savepoint(self, request_id: str) -> str | None:
        """Its caller stopped waiting for savepoint ``request_id``: never trigger it, and
        abort its checkpoint if that is pending (a stop then does not happen: the job goes
        on). Returns the savepoint's directory when it was taken anyway (it completed, or
        every subtask had acknowledged it: it stands), else None."""
        request = self._savepoints.pop(request_id, None)
        if request is None:
            return None
        request.withdrawn = True
        if request.directory is None:
            return None  # never triggered, and never will be (trigger checks it)
        pending = self.pending
        if pending is not None and pending.savepoint is request:
            await self._abort(
                pending, CheckpointFailureReason.WITHDRAWN, "its caller stopped waiting for it"
            )
        try:
            return await asyncio.shield(request.done)
        except Exception:  # noqa: BLE001 - failed or aborted: no savepoint
            return None

    def _fail_savepoint(self, pending: PendingCheckpoint, reason: str) -> None:
        request = pending.savepoint
        if request is not None and not request.done.done():
            from rayflow.checkpoint.savepoint import SavepointError

            then = "; the job goes on" if request.stop else ""
            request.done.set_exception(
                SavepointError(f"savepoint {pending.checkpoint_id} failed: {reason}{then}")
            )

    async def _expire(self, cid: int) -> None:
        await asyncio.sleep(self.config.timeout_ms / 1000.0)
        pending = self.pending
        if pending is not None and pending.checkpoint_id == cid:
            missing = sorted(pending.expected - set(pending.acks))
            await self._abort(
                pending,
                CheckpointFailureReason.TIMEOUT,
                f"timed out after {self.config.timeout_ms} ms waiting for subtasks {missing}",
            )

    # --- acknowledgements ---------------------------------------------------------------

    async def acknowledge(
        self, cid: int, key: SubtaskKey, info: dict[str, Any], blob: bytes | None = None
    ) -> None:
        """``blob``: the subtask's snapshot when it came along (kept here as it is, as
        Ray keeps a small call result in its caller's memory); otherwise it is fetched
        from the subtask, so that this process owns the object either way."""
        pending = self.pending
        if pending is None or pending.checkpoint_id != cid or key not in pending.expected:
            return
        if key in pending.acks:
            return
        pending.acks[key] = info
        if blob is None:
            pending.refs[key] = self.tasks[key].snapshot_blob.remote(self.attempt, cid)
        else:
            pending.refs[key] = blob
        if len(pending.acks) == len(pending.expected):
            self._completing = asyncio.ensure_future(self._complete(pending))
            await self._completing

    async def decline(
        self, cid: int, key: SubtaskKey, reason: str, non_recoverable: str | None = None
    ) -> None:
        """``non_recoverable``: why no restart can fix what made the subtask decline."""
        pending = self.pending
        if pending is not None and pending.checkpoint_id == cid:
            await self._abort(
                pending,
                CheckpointFailureReason.DECLINED,
                f"declined by subtask {key}: {reason}",
                non_recoverable=non_recoverable,
            )

    async def _complete(self, pending: PendingCheckpoint) -> None:
        cid = pending.checkpoint_id
        if self._timeout_task is not None:
            self._timeout_task.cancel()
        completed_at = time.time()
        metadata = self._metadata(pending, completed_at)
        n, named = self._checkpoints_this_attempt + 1, self._named_tasks()

        def write() -> None:
            self.hooks.at(HookPoint.DURING_COMMIT_POINT, n, named)
            try:
                self.storage.commit_metadata(cid, metadata)
            except Exception:
                # The outcome is unknown (an object store may have taken the PUT and lost
                # the answer): the checkpoint exists exactly when its metadata reads back.
                if not self._reads_back(cid, metadata):
                    raise
                log.warning(
                    "checkpoint %d of %r: metadata write reported an error but "
                    "the metadata is there: completed",
                    cid,
                    self.job_name,
                )

        try:
            await asyncio.to_thread(write)
        except Exception as exc:  # noqa: BLE001
            await self._abort(
                pending,
                CheckpointFailureReason.METADATA_WRITE_FAILED,
                f"metadata write failed: {type(exc).__name__}: {exc}",
                force=True,
                error=exc,
            )
            return
        # ---- commit point: checkpoint `cid` exists from here on ----
        self.pending = None
        self.failures.on_success()
        self._last_end = time.time()
        self._checkpoints_this_attempt += 1
        previous = self.latest
        self.latest = CompletedCheckpoint(cid, metadata, dict(pending.refs))
        self._record(pending, CheckpointStatus.COMPLETED, None, completed_at)
        if pending.final:
            self._final_done = True  # nothing is triggered after it, not while exporting
        named = self._named_tasks()
        n = self._checkpoints_this_attempt
        if pending.savepoint is not None and pending.savepoint.stop:
            self.hooks.at(HookPoint.JOB_MASTER_BEFORE_STOP_RECORD, n, named)
            self.stopped_at = cid
            if self.on_stopped is not None:
                try:
                    await self.on_stopped(cid, pending.savepoint.directory or "")
                except Exception as exc:  # noqa: BLE001 - not stopped: the job goes on
                    # Nobody heard of the checkpoint yet: the attempt fails and the next
                    # one restores it as a checkpoint (committing its transactions once)
                    # and reads on. Stopping without the stop recorded could not be
                    # undone: a job master taking over would read on past the savepoint.
                    self.stopped_at = None
                    reason = f"the stop could not be recorded ({type(exc).__name__}: {exc})"
                    self._fail_savepoint(pending, reason)
                    self.on_failure(RuntimeError(f"stop with savepoint {cid}: {reason}"))
                    return
        if pending.savepoint is not None:
            # Before the notification: a stopped job's subtasks finish on it, and the
            # savepoint's transactions are committed only once it is written (or failed).
            self.hooks.at(HookPoint.JOB_MASTER_BEFORE_SAVEPOINT_WRITE, n, named)
            await self._write_savepoint(pending, metadata)
        self.hooks.at(HookPoint.JOB_MASTER_BEFORE_NOTIFY, n, named)
        self.hooks.at(HookPoint.BEFORE_NOTIFY, n, named)
        self._notify_complete(cid, pending.final, pending.acks)
        if pending.final:
            self._final_id = cid
            self._renotify_task = asyncio.ensure_future(self._renotify_final(cid))
        del previous  # its object refs go out of scope here
        self._spawn(self._subsume(cid))
        self._wakeup.set()

    async def _write_savepoint(
        self, pending: PendingCheckpoint, metadata: CheckpointMetadata
    ) -> None:
        """Copy completed checkpoint ``pending`` into its savepoint directory; resolve the
        request with the directory, or with an error saying where the same state is."""
        from rayflow.checkpoint.savepoint import (
            SavepointError,
            savepoint_directory,
            write_savepoint,
        )

        request = pending.savepoint
        assert request is not None
        cid = pending.checkpoint_id
        directory = request.directory or savepoint_directory(request.target, cid)
        self._exporting.add(cid)
        try:

            def blobs(key: SubtaskKey) -> bytes:
                """One blob at a time (in the writing thread): the whole state is never
                in this process at once."""
                ref = pending.refs.get(key)
                if isinstance(ref, bytes):  # kept as it came with the acknowledgement
                    return ref
                if ref is not None:
                    import ray

                    try:
                        return ray.get(ref, timeout=30)
                    except Exception:  # noqa: BLE001 - from the durable tier then
                        pass
                return self.storage.read_blob(metadata.subtasks[key].path)

            options = self.config.storage_options if request.target.startswith("s3://") else {}
            error: BaseException | None = None
            for pause in (0.2, 1.0, 0.0):
                try:
                    await asyncio.to_thread(write_savepoint, directory, metadata, blobs, options)
                    error = None
                    break
                except SavepointError as exc:
                    error = exc  # another savepoint in its directory: never overwritten
                    break
                except Exception as exc:  # noqa: BLE001 - storage may fail for a moment
                    error = exc
                    await asyncio.sleep(pause)
            if error is not None:
                raise error
        except Exception as exc:  # noqa: BLE001 - the checkpoint stands; the copy failed
            where = self.storage.checkpoint_dir(cid)
            then = "the job stops anyway" if request.stop else "the job goes on"
            log.warning("savepoint %d of %r not written: %s", cid, self.job_name, exc)
            if not request.done.done():
                request.done.set_exception(
                    SavepointError(
                        f"savepoint {cid} could not be written to {request.target!r} "
                        f"({type(exc).__name__}: {exc}); {then}. The same state is checkpoint "
                        f"{cid} of run {self.run_id} ({where}), which restore_from accepts "
                        "while it is retained"
                    )
                )
            return
        finally:
            self._exporting.discard(cid)
        log.info("savepoint %d of %r written to %s", cid, self.job_name, directory)
        for stats in self.history.recent:
            if stats["checkpoint_id"] == cid:
                stats["savepoint"] = directory
        if not request.done.done():
            request.done.set_result(directory)

    def _reads_back(self, cid: int, metadata: CheckpointMetadata) -> bool:
        for _ in range(3):
            try:
                found = self.storage.load_metadata(cid)
            except FileNotFoundError:
                return False
            except Exception:  # noqa: BLE001 - storage still failing: try again
                time.sleep(0.5)
                continue
            return (found.run_id, found.attempt, found.completed_at) == (
                metadata.run_id,
                metadata.attempt,
                metadata.completed_at,
            )
        raise RuntimeError(f"checkpoint {cid}: cannot tell whether its metadata was written")

    def _named_tasks(self) -> dict[tuple[str, int], Any]:
        return {(self.graph.vertices[k[0]].name, k[1]): a for k, a in self.tasks.items()}

    def _notify_complete(self, cid: int, final: bool, acks: dict[SubtaskKey, Any]) -> None:
        """Every subtask hears of a final checkpoint; of any other, those that said in
        their acknowledgement that they act on it (a subtask that did not say is told)."""
        for key, actor in self.tasks.items():
            if key in self._ended:
                continue
            if not final and not acks.get(key, {}).get("notify", True):
                continue
            if final and not self.hooks.at(
                HookPoint.FINAL_NOTIFY, 0, {(self.graph.vertices[key[0]].name, key[1]): actor}
            ):
                continue  # the notification is lost on its way
            actor.notify_checkpoint_complete.remote(self.attempt, cid)

    async def _renotify_final(self, cid: int) -> None:
        """Notifications are best effort: a subtask that missed the final one would wait
        for it forever, so it is sent again until every subtask has ended."""
        pause = 0.5
        while len(self._ended) < len(self.tasks):
            await asyncio.sleep(pause)
            pause = min(pause * 2, 10.0)  # a subtask busy with its final commit: no pile-up
            for key, actor in self.tasks.items():
                if key not in self._ended:
                    actor.notify_checkpoint_complete.remote(self.attempt, cid)

    async def _subsume(self, newest: int) -> None:
        """Drop checkpoints beyond the retained count, and directories of aborted ones
        that late writes created again; off the event loop (storage may be remote)."""
        retained = self.config.num_retained_checkpoints

        def collect() -> None:
            ids = self.storage.completed_ids()
            keep = (ids[-retained:] if ids else [newest]) + sorted(self._exporting)
            pending = self.pending.checkpoint_id if self.pending is not None else None
            self.storage.collect_garbage(keep, in_flight=pending)

        try:
            await asyncio.to_thread(collect)
        except Exception as exc:  # noqa: BLE001 - retried at the next completion
            log.warning("checkpoint clean-up of %r failed: %s", self.job_name, exc)

    async def _abort(
        self,
        pending: PendingCheckpoint,
        cause: CheckpointFailureReason,
        detail: str,
        force: bool = False,
        error: BaseException | None = None,
        non_recoverable: str | None = None,
    ) -> None:
        """``error`` (the exception behind the failure) and ``non_recoverable`` go with
        the error that fails the attempt, if this failure is one too many: whoever
        classifies it sees what went wrong."""
        reason = f"{cause}: {detail}"
        if self.pending is not pending:
            return
        if len(pending.acks) == len(pending.expected) and not force:
            return  # every subtask acknowledged: it is being completed
        self.pending = None
        if self._timeout_task is not None:
            self._timeout_task.cancel()
        self._last_end = time.time()
        log.warning("checkpoint %d of %r aborted: %s", pending.checkpoint_id, self.job_name, reason)
        self._record(pending, CheckpointStatus.FAILED, reason)
        for actor in self.tasks.values():
            actor.notify_checkpoint_aborted.remote(self.attempt, pending.checkpoint_id)
        self._spawn(asyncio.to_thread(self.storage.discard, pending.checkpoint_id))
        if pending.savepoint is not None:
            # Flink's rule: a failed savepoint never fails the job.
            self._fail_savepoint(pending, reason)
            self._wakeup.set()
            return
        limit = self.failures.on_failure(pending.checkpoint_id, cause, reason)
        if limit is not None:
            limit.__cause__ = error
            limit.non_recoverable = non_recoverable
            self.on_failure(limit)
        self._wakeup.set()

    # --- metadata and stats ---------------------------------------------------------------

    def _metadata(self, pending: PendingCheckpoint, completed_at: float) -> CheckpointMetadata:
        subtasks = {}
        source_splits: dict[str, list[Any]] = {}
        for key, info in pending.acks.items():
            vertex = self.graph.vertices[key[0]]
            uids = list(info["uids"])
            stateful = info.get("stateful_uids")
            stateful = list(stateful) if stateful is not None else None
            if vertex.is_source:
                uids.append(vertex.source_uid)
                if stateful is not None:
                    stateful.append(vertex.source_uid)
                source_splits.setdefault(vertex.source_uid, []).extend(info["source_splits"] or [])
            subtasks[key] = SubtaskStateMeta(
                path=info["path"],
                size=info["size"],
                uids=tuple(uids),
                parallelism=vertex.parallelism,
                vertex=vertex.name,
                channel_state_size=info.get("channel_state_size", 0),
                channel_state_batches=info.get("channel_state_batches", 0),
                stateful_uids=tuple(stateful) if stateful is not None else None,
                keyed_uids=tuple(info.get("keyed_uids") or ()),
                max_parallelism=info.get("max_parallelism"),
            )
        return CheckpointMetadata(
            checkpoint_id=pending.checkpoint_id,
            job_name=self.job_name,
            run_id=self.run_id,
            attempt=self.attempt,
            trigger_time=pending.trigger_time,
            completed_at=completed_at,
            final=pending.final,
            subtasks=subtasks,
            source_splits=source_splits,
            operator_names=self._operator_names(),
        )

    def _operator_names(self) -> dict[str, str]:
        names: dict[str, str] = {}
        for vertex in self.graph.vertices.values():
            if vertex.source_uid is not None:
                names[vertex.source_uid] = vertex.name.split(" -> ")[0]
            for spec in vertex.operators:
                names[spec.uid] = spec.name
        return names

    def _record(
        self,
        pending: PendingCheckpoint,
        status: CheckpointStatus,
        reason: str | None,
        completed_at: float | None = None,
    ) -> None:
        end = completed_at or time.time()
        self.history.add(
            {
                "checkpoint_id": pending.checkpoint_id,
                "status": status,
                "final": pending.final,
                "savepoint": None,
                "attempt": self.attempt,
                "trigger_time": pending.trigger_time,
                "duration_s": end - pending.trigger_time,
                "size": sum(a["size"] for a in pending.acks.values()),
                "channel_state_size": sum(
                    a.get("channel_state_size", 0) for a in pending.acks.values()
                ),
                "unaligned": any(a.get("unaligned") for a in pending.acks.values()),
                "failure": reason,
                "subtasks": {
                    f"{self.graph.vertices[k[0]].name}#{k[1]}": {
                        n: a.get(n)
                        for n in (
                            "start_delay_s",
                            "alignment_s",
                            "sync_s",
                            "async_s",
                            "size",
                            "unaligned",
                            "channel_state_size",
                            "channel_state_wait_s",
                        )
                    }
                    for k, a in pending.acks.items()
                },
            }
        )
