"""The job master: deploys a job's subtasks, watches them, and reports the result.

One job master actor runs per job. It creates the subtask actors (receivers
first, so each sender is built with handles to its receivers), starts every
``run()``, and waits: the first failure of any ``run()`` (an exception in user
code, an actor that died) fails the job, and every subtask is killed, so no
actor outlives its job.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from rayflow.errors import JobCancelledError, JobFailedError, OperatorError
from rayflow.plan.physical import JobGraph
from rayflow.runtime.subtask import OutputDeployment, SubtaskActor, SubtaskDeployment


@dataclass
class JobSettings:
    job_name: str
    job_id: str = ""
    channel_capacity: int = 8
    send_window: int = 8
    subtask_options: dict[str, Any] = field(default_factory=dict)


def subtask_actor_name(job_id: str, vertex_id: int, index: int, attempt: int) -> str:
    """Subtask actors are named, so tools (and tests) can find every actor of a job."""
    return f"rayflow:{job_id}:v{vertex_id}:s{index}:a{attempt}"


def _unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if cause is not None:
            return cause
    return exc


@ray.remote(max_restarts=0, max_task_retries=0)
class JobMaster:
    def __init__(self, graph: JobGraph, settings: JobSettings) -> None:
        self.graph = graph
        self.settings = settings
        self.state = "CREATED"
        self.failure: str | None = None
        self.actors: dict[tuple[int, int], Any] = {}
        self.attempt = 0
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._cancelled = asyncio.Event()

    async def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "attempt": self.attempt,
            "failure": self.failure,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
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

    async def cancel(self) -> None:
        self._cancelled.set()

    async def run(self) -> dict[str, Any]:
        self.started_at = time.time()
        self.state = "RUNNING"
        try:
            outputs = await self._run_attempt(self.attempt)
        except BaseException as exc:
            self.state = "CANCELED" if isinstance(exc, JobCancelledError) else "FAILED"
            self.failure = str(exc)
            raise
        finally:
            self.finished_at = time.time()
            self._kill_all()
        self.state = "FINISHED"
        return {
            "outputs": outputs,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    # --- one attempt ------------------------------------------------------------------

    def _deploy(self, attempt: int) -> None:
        graph, settings = self.graph, self.settings
        for vertex_id in reversed(graph.topological_order()):
            vertex = graph.vertices[vertex_id]
            splits_by_subtask: list[list[Any]] = [[] for _ in range(vertex.parallelism)]
            if vertex.is_source:
                for i, split in enumerate(vertex.source.create_splits(vertex.parallelism)):
                    splits_by_subtask[i % vertex.parallelism].append(split)
            for index in range(vertex.parallelism):
                outputs = []
                for edge_id in vertex.out_edges:
                    edge = graph.edges[edge_id]
                    target = graph.vertices[edge.target_vertex]
                    if edge.partitioner.kind.name == "FORWARD":
                        receivers = [index]
                    else:
                        receivers = list(range(target.parallelism))
                    outputs.append(
                        OutputDeployment(
                            partitioner=edge.partitioner,
                            receivers=[
                                (
                                    self.actors[(target.vertex_id, r)],
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
                    source_splits=splits_by_subtask[index],
                    channel_capacity=settings.channel_capacity,
                    send_window=settings.send_window,
                )
                self.actors[(vertex_id, index)] = SubtaskActor.options(
                    name=subtask_actor_name(settings.job_id, vertex_id, index, attempt),
                    **settings.subtask_options,
                ).remote(deployment)

    async def _run_attempt(self, attempt: int) -> dict[int, list[Any]]:
        self._deploy(attempt)
        keys = list(self.actors)
        tasks = {
            asyncio.ensure_future(self._await_run(key, self.actors[key].run.remote())): key
            for key in keys
        }
        cancel_task = asyncio.ensure_future(self._cancelled.wait())
        results: dict[tuple[int, int], Any] = {}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(
                    pending | {cancel_task}, return_when=asyncio.FIRST_COMPLETED
                )
                if cancel_task in done:
                    raise JobCancelledError(f"job {self.settings.job_name!r} was cancelled")
                pending.discard(cancel_task)
                for task in done:
                    results[tasks[task]] = task.result()
        finally:
            cancel_task.cancel()
            for task in pending:
                task.cancel()
        outputs: dict[int, list[Any]] = {}
        for (vertex_id, index), value in sorted(results.items()):
            outputs.setdefault(vertex_id, []).append(value)
        return outputs

    async def _await_run(self, key: tuple[int, int], ref: Any) -> Any:
        vertex = self.graph.vertices[key[0]]
        try:
            return await ref
        except Exception as exc:  # noqa: BLE001
            cause = _unwrap(exc)
            if isinstance(cause, OperatorError):
                raise JobFailedError(
                    f"job {self.settings.job_name!r} failed: {cause}"
                ) from None
            if isinstance(cause, RayActorError):
                raise JobFailedError(
                    f"job {self.settings.job_name!r} failed: subtask {key[1] + 1}/"
                    f"{vertex.parallelism} of {vertex.name!r} died: {cause}"
                ) from None
            raise JobFailedError(
                f"job {self.settings.job_name!r} failed in {vertex.name!r} subtask "
                f"{key[1] + 1}/{vertex.parallelism}: {type(cause).__name__}: {cause}"
            ) from None

    def _kill_all(self) -> None:
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
