"""StreamExecutionEnvironment: where a job is defined and from where it runs.

``execute`` runs the job on Ray (joining ``RAY_ADDRESS`` when set, else a new
local Ray) and returns a :class:`JobResult`; ``execute_async`` returns a
:class:`JobClient` at once.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from rayflow.datastream import DataStream
from rayflow.keygroups import DEFAULT_MAX_PARALLELISM
from rayflow.plan.logical import LogicalPlan
from rayflow.plan.physical import JobGraph, build_job_graph
from rayflow.runtime.job_master import JobMaster, JobSettings, _unwrap
from rayflow.sink import Sink
from rayflow.sources import CollectionSource, Source

__all__ = ["StreamExecutionEnvironment", "JobClient", "JobResult"]


def ensure_ray(address: str | None = None) -> None:
    """Start or join Ray once per process: ``address``, else ``RAY_ADDRESS``, else a local Ray."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {"address": address, "logging_level": "WARNING"}
    if address == "local":
        kwargs["include_dashboard"] = False
    ray.init(**kwargs)


@dataclass
class JobResult:
    """What a finished job reports: timing, per-subtask metrics and sink results."""

    job_name: str
    started_at: float
    finished_at: float
    metrics: list[dict[str, Any]] = field(default_factory=list)
    sink_results: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    def get_net_runtime(self) -> float:
        """Runtime in milliseconds (PyFlink's name)."""
        return self.duration_s * 1000.0

    def sink_result(self, sink: str | Sink) -> Any:
        """The merged result of a sink, by operator name or by the sink object itself."""
        key = sink if isinstance(sink, str) else getattr(sink, "_rayflow_name", None)
        if key not in self.sink_results:
            raise KeyError(f"no sink named {key!r} (sinks: {sorted(self.sink_results)})")
        return self.sink_results[key]

    def records_in(self, vertex_prefix: str) -> int:
        """Records that entered the vertices whose name starts with ``vertex_prefix``."""
        return sum(m["records_in"] for m in self.metrics if m["vertex"].startswith(vertex_prefix))


class JobClient:
    """A handle on a running job."""

    def __init__(
        self, job_name: str, job_id: str, master: Any, run_ref: Any, graph: JobGraph
    ) -> None:
        self.job_name = job_name
        self.job_id = job_id
        self._master = master
        self._run_ref = run_ref
        self._graph = graph
        self._result: JobResult | None = None

    def get_job_status(self) -> str:
        """CREATED, RUNNING, FINISHED, FAILED or CANCELED."""
        if self._result is not None:
            return "FINISHED"
        try:
            return ray.get(self._master.status.remote())["state"]
        except ray.exceptions.RayActorError:
            return "FAILED"

    def metrics(self) -> list[dict[str, Any]]:
        """Per-subtask metrics of the running job (records in/out, buffers, in-flight pushes)."""
        return ray.get(self._master.metrics.remote())

    def cancel(self) -> None:
        self._master.cancel.remote()

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until the job ends; raises :class:`~rayflow.errors.JobFailedError` if it failed."""
        if self._result is not None:
            return self._result
        try:
            raw = ray.get(self._run_ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise
        except Exception as exc:
            self._release()
            raise _unwrap(exc) from None
        self._release()
        self._result = _build_result(self.job_name, self._graph, raw)
        return self._result

    get_job_execution_result = wait

    def _release(self) -> None:
        try:
            ray.kill(self._master, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _build_result(job_name: str, graph: JobGraph, raw: dict[str, Any]) -> JobResult:
    metrics: list[dict[str, Any]] = []
    sink_results: dict[str, Any] = {}
    for vertex_id, subtask_outputs in raw["outputs"].items():
        vertex = graph.vertices[vertex_id]
        metrics.extend(o["metrics"] for o in subtask_outputs)
        for position, spec in enumerate(vertex.operators):
            sink = _sink_of(spec)
            if sink is not None:
                sink_results[spec.name] = sink.merge_results(
                    [o["results"][position] for o in subtask_outputs]
                )
    return JobResult(
        job_name=job_name,
        started_at=raw["started_at"],
        finished_at=raw["finished_at"],
        metrics=metrics,
        sink_results=sink_results,
    )


def _sink_of(spec: Any) -> Sink | None:
    factory = spec.factory
    for arg in getattr(factory, "args", ()):
        if isinstance(arg, Sink):
            return arg
    return None


class StreamExecutionEnvironment:
    """The context in which a streaming job is defined and executed."""

    def __init__(self) -> None:
        self._plan = LogicalPlan()
        self._parallelism = 1
        self._max_parallelism = DEFAULT_MAX_PARALLELISM
        self._chaining = True
        self._channel_capacity = 8
        self._send_window = 8
        self._subtask_options: dict[str, Any] = {}

    @staticmethod
    def get_execution_environment() -> StreamExecutionEnvironment:
        return StreamExecutionEnvironment()

    # --- configuration -------------------------------------------------------------------

    def set_parallelism(self, parallelism: int) -> StreamExecutionEnvironment:
        if parallelism < 1:
            raise ValueError(f"set_parallelism: must be >= 1, got {parallelism}")
        self._parallelism = parallelism
        return self

    def get_parallelism(self) -> int:
        return self._parallelism

    def set_max_parallelism(self, max_parallelism: int) -> StreamExecutionEnvironment:
        if not 1 <= max_parallelism <= 32768:
            raise ValueError(f"set_max_parallelism: must be in 1..32768, got {max_parallelism}")
        self._max_parallelism = max_parallelism
        return self

    def get_max_parallelism(self) -> int:
        return self._max_parallelism

    def disable_operator_chaining(self) -> StreamExecutionEnvironment:
        self._chaining = False
        return self

    def set_buffer_limits(
        self, channel_capacity: int = 8, send_window: int = 8
    ) -> StreamExecutionEnvironment:
        """Backpressure bounds: batches buffered per input channel, unacknowledged pushes per
        output channel."""
        if channel_capacity < 1 or send_window < 1:
            raise ValueError("set_buffer_limits: both limits must be >= 1")
        self._channel_capacity = channel_capacity
        self._send_window = send_window
        return self

    def set_subtask_options(self, **options: Any) -> StreamExecutionEnvironment:
        """Ray actor options for every subtask (``num_cpus``, ``scheduling_strategy``, ...)."""
        self._subtask_options = options
        return self

    # --- sources -------------------------------------------------------------------------

    def from_source(self, source: Source, source_name: str = "Source") -> DataStream:
        if not isinstance(source, Source):
            raise TypeError(f"from_source: expected a rayflow Source, got {type(source).__name__}")
        return DataStream(self, self._plan.add(name=source_name, kind="source", source=source))

    def from_collection(self, collection: Any, source_name: str = "Collection") -> DataStream:
        return self.from_source(CollectionSource(collection), source_name)

    # --- running -------------------------------------------------------------------------

    def get_job_graph(self) -> JobGraph:
        graph = build_job_graph(self._plan, self._parallelism, self._max_parallelism,
                                self._chaining)
        for vertex in graph.vertices.values():
            for spec in vertex.operators:
                sink = _sink_of(spec)
                if sink is not None:
                    sink._rayflow_name = spec.name
        return graph

    def explain(self) -> str:
        """The physical plan: chained vertices, parallelism and partitioners."""
        return self.get_job_graph().explain()

    def execute_async(self, job_name: str = "rayflow job") -> JobClient:
        graph = self.get_job_graph()
        if not graph.vertices:
            raise ValueError("execute: the job has no operators; add a source and a sink")
        ensure_ray()
        settings = JobSettings(
            job_name=job_name,
            job_id=uuid.uuid4().hex[:12],
            channel_capacity=self._channel_capacity,
            send_window=self._send_window,
            subtask_options=dict(self._subtask_options),
        )
        master = JobMaster.options(max_concurrency=1000).remote(graph, settings)
        return JobClient(job_name, settings.job_id, master, master.run.remote(), graph)

    def execute(self, job_name: str = "rayflow job") -> JobResult:
        return self.execute_async(job_name).wait()
