"""The job master: deploys a job's subtasks, runs its checkpoint coordinator,
watches every subtask, and restarts the job from its latest checkpoint.

One job master actor runs per job. An *attempt* deploys every subtask (receivers
first, so each sender is built with its receivers' handles), restores state and
source positions from the latest completed checkpoint, and starts every
``run()``. The first failure of any ``run()`` (an exception in user code, an
actor or process that died), a failed call, or too many failed checkpoints ends
the attempt: the pending checkpoint is aborted, every subtask is killed, and the
restart strategy decides whether attempt + 1 starts (after its delay) or the job
fails with the cause. No actor outlives its job.

Restore prefers the snapshot blobs the job master owns in the object store and
falls back to the durable tier. If the job master itself dies, its driver-side
``JobClient`` starts a new one from the latest checkpoint in durable storage.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from rayflow.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.config import CheckpointConfig, RestartStrategy, default_restart_strategy
from rayflow.errors import JobCancelledError, JobFailedError, OperatorError
from rayflow.plan.partitioners import PartitionKind
from rayflow.plan.physical import JobGraph
from rayflow.runtime.subtask import (
    OutputDeployment,
    StateHandle,
    SubtaskActor,
    SubtaskDeployment,
)
from rayflow.testing import FaultPlan

log = logging.getLogger("rayflow.job")


@dataclass
class JobSettings:
    job_name: str
    job_id: str = ""
    channel_capacity: int = 8
    send_window: int = 8
    subtask_options: dict[str, Any] = field(default_factory=dict)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    restart_strategy: RestartStrategy | None = None
    fault_plan: FaultPlan | None = None
    restore_metadata: dict[str, Any] | None = None
    attempt_base: int = 0

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint_config.is_checkpointing_enabled()

    def storage(self) -> CheckpointStorage:
        c = self.checkpoint_config
        return CheckpointStorage(c.checkpoint_storage, self.job_name, c.storage_options)


def subtask_actor_name(job_id: str, vertex_id: int, index: int, incarnation: int) -> str:
    """Subtask actors are named, so tools (and tests) can find every actor of a job."""
    return f"rayflow:{job_id}:v{vertex_id}:s{index}:{incarnation}"


def _unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if cause is not None:
            return cause
    return exc


class _AttemptFailed(Exception):
    """One attempt failed; ``secondary`` when it only reports a failure elsewhere (a
    subtask that lost the downstream subtask it was sending to)."""

    def __init__(self, message: str, secondary: bool = False) -> None:
        super().__init__(message)
        self.secondary = secondary


@ray.remote(max_restarts=0, max_task_retries=0)
class JobMaster:
    def __init__(self, graph: JobGraph, settings: JobSettings) -> None:
        self.graph = graph
        self.settings = settings
        self.state = "CREATED"
        self.failure: str | None = None
        self.failures: list[str] = []
        self.actors: dict[tuple[int, int], Any] = {}
        self.attempt = settings.attempt_base
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.checkpoint_stats: list[dict[str, Any]] = []
        self.coordinator: CheckpointCoordinator | None = None
        self.storage = settings.storage() if settings.checkpointing else None
        self.restart_strategy = copy.deepcopy(
            settings.restart_strategy or default_restart_strategy(settings.checkpointing)
        )
        self.latest: CompletedCheckpoint | None = None
        if settings.restore_metadata is not None:
            meta = settings.restore_metadata
            self.latest = CompletedCheckpoint(meta["checkpoint_id"], meta)
        self.restored_from = self.latest.checkpoint_id if self.latest else None
        self._cancelled = asyncio.Event()
        self._attempt_failure: asyncio.Future | None = None
        self._exhausted: set[tuple[int, int]] = set()
        self._recovery_started: float | None = None
        self._run_refs: dict[tuple[int, int], Any] = {}
        self._spare: dict[tuple[int, int], Any] = {}
        self._incarnations = 0
        self.recovery_times: list[float] = []

    # --- queries ------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "attempt": self.attempt,
            "restarts": self.attempt - self.settings.attempt_base,
            "failure": self.failure,
            "failures": list(self.failures),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "completed_checkpoints": [
                s["checkpoint_id"] for s in self.checkpoint_stats if s["status"] == "COMPLETED"
            ],
        }

    async def metrics(self) -> list[dict[str, Any]]:
        refs = [actor.metrics.remote() for actor in self.actors.values()]
        out = []
        for ref in refs:
            try:
                out.append(await ref)
            except Exception:  # noqa: BLE001 - a subtask that just ended or died has no metrics
                continue
        return out

    async def checkpoints(self) -> list[dict[str, Any]]:
        return list(self.checkpoint_stats)

    async def cancel(self) -> None:
        self._cancelled.set()

    # --- calls from subtasks ------------------------------------------------------------

    async def acknowledge_checkpoint(
        self, attempt: int, cid: int, key: tuple[int, int], info: dict[str, Any]
    ) -> None:
        if attempt == self.attempt and self.coordinator is not None:
            await self.coordinator.acknowledge(cid, key, info)

    async def decline_checkpoint(
        self, attempt: int, cid: int, key: tuple[int, int], reason: str
    ) -> None:
        if attempt == self.attempt and self.coordinator is not None:
            await self.coordinator.decline(cid, key, reason)

    async def subtask_running(self, attempt: int, key: tuple[int, int]) -> None:
        if attempt == self.attempt and self.coordinator is not None:
            self.coordinator.subtask_running(key)

    async def source_exhausted(self, attempt: int, key: tuple[int, int]) -> None:
        if attempt != self.attempt:
            return
        self._exhausted.add(key)
        sources = {k for k in self.actors if self.graph.vertices[k[0]].is_source}
        if self._exhausted >= sources and self.coordinator is not None:
            self.coordinator.request_final()

    # --- the job ------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        self.started_at = time.time()
        self.state = "RUNNING"
        try:
            outputs = await self._run_with_restarts()
        except BaseException as exc:
            self.state = "CANCELED" if isinstance(exc, JobCancelledError) else "FAILED"
            self.failure = str(exc)
            raise
        finally:
            self.finished_at = time.time()
            await self._stop_attempt()
        self.state = "FINISHED"
        return {
            "outputs": outputs,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "checkpoints": self.checkpoint_stats,
            "restarts": self.attempt - self.settings.attempt_base,
            "failures": self.failures,
            "recovery_times": self.recovery_times,
            "restored_from": self.restored_from,
        }

    async def _run_with_restarts(self) -> dict[int, list[Any]]:
        while True:
            try:
                return await self._run_attempt()
            except _AttemptFailed as failed:
                cause = str(failed)
                self.failures.append(cause)
                log.warning(
                    "job %r attempt %d failed: %s", self.settings.job_name, self.attempt, cause
                )
                failed_at = time.time()
                await self._stop_attempt(reuse=True)
                delay = self.restart_strategy.next_delay_s(failed_at)
                if delay is None:
                    restarts = self.attempt - self.settings.attempt_base
                    raise JobFailedError(
                        f"job {self.settings.job_name!r} failed after {restarts} restart(s) "
                        f"(restart strategy: {self.restart_strategy.description}); "
                        f"cause: {cause}"
                    ) from None
                self._recovery_started = failed_at
                await asyncio.sleep(delay)
                self.attempt += 1

    async def _run_attempt(self) -> dict[int, list[Any]]:
        settings = self.settings
        attempt = self.attempt
        if self.coordinator is not None and self.coordinator.latest is not None:
            self.latest = self.coordinator.latest
        restore = self.latest if settings.checkpointing else None
        self._exhausted = set()
        await asyncio.gather(*self._deploy(attempt, restore))
        loop = asyncio.get_running_loop()
        self._attempt_failure = loop.create_future()
        if settings.checkpointing:
            plan = settings.fault_plan
            self.coordinator = CheckpointCoordinator(
                settings.job_name,
                settings.checkpoint_config,
                self.storage,
                self.graph,
                self.actors,
                attempt,
                self._next_checkpoint_id(restore),
                self._fail_attempt,
                plan.for_job_master(attempt) if plan else [],
                self.checkpoint_stats,
                restore,
            )
            self.coordinator.start()
        self._run_refs = {key: actor.run.remote() for key, actor in self.actors.items()}
        tasks = {
            asyncio.ensure_future(self._await_run(key, ref)): key
            for key, ref in self._run_refs.items()
        }
        if self._recovery_started is not None:
            asyncio.ensure_future(self._measure_recovery(self._recovery_started))
            self._recovery_started = None
        cancel_task = asyncio.ensure_future(self._cancelled.wait())
        results: dict[tuple[int, int], Any] = {}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(
                    pending | {cancel_task, self._attempt_failure},
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if cancel_task in done:
                    raise JobCancelledError(f"job {settings.job_name!r} was cancelled")
                if self._attempt_failure in done:
                    raise _AttemptFailed(str(self._attempt_failure.result()))
                pending.discard(cancel_task)
                pending.discard(self._attempt_failure)
                failures = [t.exception() for t in done if t.exception() is not None]
                if failures:
                    raise await self._root_cause(failures, pending)
                for task in done:
                    results[tasks[task]] = task.result()
        finally:
            cancel_task.cancel()
            for task in pending:
                task.cancel()
        outputs: dict[int, list[Any]] = {}
        for (vertex_id, _), value in sorted(results.items()):
            outputs.setdefault(vertex_id, []).append(value)
        return outputs

    @staticmethod
    async def _root_cause(
        failures: list[BaseException], pending: set[asyncio.Future]
    ) -> BaseException:
        """The failure to report: a subtask's own death or error rather than a neighbour's
        report of having lost it (those arrive in any order)."""
        if all(getattr(f, "secondary", False) for f in failures) and pending:
            done, _ = await asyncio.wait(pending, timeout=1.0)
            failures += [t.exception() for t in done if t.exception() is not None]
        primary = [f for f in failures if not getattr(f, "secondary", False)]
        return (primary or failures)[0]

    def _next_checkpoint_id(self, restore: CompletedCheckpoint | None) -> int:
        """Above every id in storage, not only above the restored one: restoring an older
        checkpoint must never write blobs into a newer one's directory, whose metadata
        would then describe foreign blobs."""
        ids = self.storage.completed_ids() if self.storage else []
        newest = max([*ids, restore.checkpoint_id if restore else 0])
        return newest + 1

    def _fail_attempt(self, exc: BaseException) -> None:
        if self._attempt_failure is not None and not self._attempt_failure.done():
            self._attempt_failure.set_result(f"{type(exc).__name__}: {exc}")

    async def _measure_recovery(self, failed_at: float) -> None:
        """Time from a failure until records flow again through every subtask."""
        actors = list(self.actors.values())
        attempt = self.attempt
        while self.attempt == attempt:
            try:
                metrics = await asyncio.gather(*[a.metrics.remote() for a in actors])
            except Exception:  # noqa: BLE001
                return
            if all(m["attempt"] == attempt and m["records_in"] > 0 for m in metrics):
                self.recovery_times.append(time.time() - failed_at)
                return
            await asyncio.sleep(0.02)

    async def _await_run(self, key: tuple[int, int], ref: Any) -> Any:
        vertex = self.graph.vertices[key[0]]
        where = f"subtask {key[1] + 1}/{vertex.parallelism} of {vertex.name!r}"
        try:
            return await ref
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            cause = _unwrap(exc)
            if isinstance(cause, OperatorError):
                raise _AttemptFailed(str(cause)) from None
            if isinstance(cause, RayActorError):
                reason = str(cause).strip().splitlines()[0] if str(cause).strip() else "actor died"
                raise _AttemptFailed(f"{where} died ({reason})") from None
            raise _AttemptFailed(
                f"{where}: {type(cause).__name__}: {cause}",
                secondary=isinstance(cause, ConnectionError),
            ) from None

    async def _stop_attempt(self, reuse: bool = False) -> None:
        """End the current attempt. Every subtask's ``run()`` has ended when this returns,
        so nothing of this attempt writes next to its successor's recovery.

        With ``reuse``, subtasks that are still alive are kept for the next attempt (their
        ``run()`` is cancelled; Flink likewise redeploys into surviving slots), so a
        restart only starts processes for the subtasks that died.
        """
        if self.coordinator is not None:
            await self.coordinator.shutdown()
        self._kill(self._spare.values())
        self._spare = {}
        actors, refs = self.actors, self._run_refs
        self.actors, self._run_refs = {}, {}
        if reuse:
            for ref in refs.values():
                ray.cancel(ref)
        else:
            self._kill(actors.values())
        if refs:
            await asyncio.wait(
                [asyncio.ensure_future(self._settle(ref)) for ref in refs.values()], timeout=30
            )
        if reuse:
            checks = {key: asyncio.ensure_future(self._alive(a)) for key, a in actors.items()}
            await asyncio.wait(checks.values(), timeout=10)
            for key, check in checks.items():
                if check.done() and check.result():
                    self._spare[key] = actors[key]
                else:
                    self._kill([actors[key]])

    @staticmethod
    def _kill(actors: Any) -> None:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    @staticmethod
    async def _alive(actor: Any) -> bool:
        try:
            return await asyncio.wait_for(actor.ready.remote(), timeout=5)
        except BaseException:  # noqa: BLE001 - dead or hung: not reused
            return False

    @staticmethod
    async def _settle(ref: Any) -> None:
        try:
            await ref
        except BaseException:  # noqa: BLE001 - a killed actor's run() fails; that is the point
            pass

    # --- deployment ---------------------------------------------------------------------

    def _deploy(self, attempt: int, restore: CompletedCheckpoint | None) -> list[Any]:
        """Create or redeploy every subtask; returns the redeploy calls to await."""
        graph, settings = self.graph, self.settings
        me = ray.get_runtime_context().current_actor
        plan = settings.fault_plan
        actors: dict[tuple[int, int], Any] = {}
        redeploys: list[Any] = []
        for vertex_id in reversed(graph.topological_order()):
            vertex = graph.vertices[vertex_id]
            splits = self._source_splits(vertex, restore) if vertex.is_source else None
            handles = self._state_handles(vertex, restore)
            for index in range(vertex.parallelism):
                outputs = []
                for edge_id in vertex.out_edges:
                    edge = graph.edges[edge_id]
                    target = graph.vertices[edge.target_vertex]
                    if edge.partitioner.kind is PartitionKind.FORWARD:
                        receivers = [index]
                    else:
                        receivers = list(range(target.parallelism))
                    outputs.append(
                        OutputDeployment(
                            partitioner=edge.partitioner,
                            receivers=[
                                (
                                    actors[(target.vertex_id, r)],
                                    graph.channel_index(edge_id, index, r),
                                )
                                for r in receivers
                            ],
                        )
                    )
                deployment = SubtaskDeployment(
                    job_name=settings.job_name,
                    vertex=vertex,
                    index=index,
                    attempt=attempt,
                    num_input_channels=len(graph.input_channels(vertex_id, index)),
                    outputs=outputs,
                    source_splits=splits[index] if splits else [],
                    channel_capacity=settings.channel_capacity,
                    send_window=settings.send_window,
                    checkpointing=(
                        settings.checkpoint_config.mode if settings.checkpointing else None
                    ),
                    storage=self.storage,
                    master=me,
                    restore=handles,
                    restored_checkpoint=restore.checkpoint_id if restore else None,
                    faults=plan.for_subtask(vertex.name, index, attempt) if plan else [],
                )
                spare = self._spare.pop((vertex_id, index), None)
                if spare is not None:
                    actors[(vertex_id, index)] = spare
                    redeploys.append(spare.redeploy.remote(deployment))
                    continue
                self._incarnations += 1
                actors[(vertex_id, index)] = SubtaskActor.options(
                    name=subtask_actor_name(settings.job_id, vertex_id, index, self._incarnations),
                    **settings.subtask_options,
                ).remote(deployment)
        self._kill(self._spare.values())
        self._spare = {}
        self.actors = actors
        return redeploys

    def _source_splits(self, vertex: Any, restore: CompletedCheckpoint | None) -> list[list[Any]]:
        per_subtask: list[list[Any]] = [[] for _ in range(vertex.parallelism)]
        saved = restore.metadata["source_splits"].get(vertex.source_uid) if restore else None
        if saved is not None:
            splits = sorted(saved, key=lambda s: s.split_id)
        else:
            splits = vertex.source.create_splits(vertex.parallelism)
        for i, split in enumerate(splits):
            per_subtask[i % vertex.parallelism].append(split)
        return per_subtask

    def _state_handles(self, vertex: Any, restore: CompletedCheckpoint | None) -> list[StateHandle]:
        if restore is None:
            return []
        uids = {op.uid for op in vertex.operators}
        handles = []
        for key, entry in sorted(restore.metadata["subtasks"].items()):
            if uids & set(entry["uids"]):
                handles.append(
                    StateHandle(
                        old_index=key[1],
                        old_parallelism=entry["parallelism"],
                        path=entry["path"],
                        ref=restore.refs.get(key),
                    )
                )
        return handles
