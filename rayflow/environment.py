"""StreamExecutionEnvironment: where a job is defined and from where it runs.

``execute`` runs the job on Ray (joining ``RAY_ADDRESS`` when set, else a new
local Ray) and returns a :class:`JobResult`; ``execute_async`` returns a
:class:`JobClient` at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NoReturn

import ray

from rayflow import detached, preflight, progress
from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.checkpoint.savepoint import is_savepoint, load_savepoint
from rayflow.checkpoint.state_mapping import check_state_mapping
from rayflow.checkpoint.storage import JobStorage, new_run_id, open_checkpoint_path
from rayflow.config import (
    CheckpointConfig,
    CheckpointingMode,
    DataTransport,
    ExecutionConfig,
    RestartStrategy,
)
from rayflow.datastream import DataStream
from rayflow.errors import JobCancelledError, JobFailedError, JobResultLostError, SavepointError
from rayflow.eventtime.strategy import WatermarkStrategy
from rayflow.failures import FailureEntry
from rayflow.guarantees import CheckpointingFacts, GuaranteeResolution
from rayflow.keygroups import DEFAULT_MAX_PARALLELISM
from rayflow.plan.checks import check_aggregations, check_picklable
from rayflow.plan.logical import LogicalPlan, check_parallelism
from rayflow.plan.physical import JobGraph, build_job_graph
from rayflow.plan.resources import ResourceSpec
from rayflow.ray_connect import check_address, quiet_local_start
from rayflow.recoverability import FailureClassifier
from rayflow.runtime.actor_exit import ActorTableUnavailable, wait_named_exited
from rayflow.runtime.channels import DEFAULT_BUFFER_TIMEOUT_MS
from rayflow.runtime.debloat import MIN_TARGET_MS
from rayflow.runtime.hook_env import mark_hooked_raylet
from rayflow.runtime.job_master import RemoteJobMaster, _unwrap
from rayflow.runtime.job_processes import forget_processes, wait_recorded_exited
from rayflow.runtime.latency import DEFAULT_LATENCY_TRACKING_INTERVAL_MS, LatencyTracker
from rayflow.runtime.output import OutputChunk, OutputReader
from rayflow.runtime.placement import (
    PlacementConfig,
    PlacementPlan,
    PlacementStrategy,
    remove_job_placement_groups,
)
from rayflow.runtime.preload import worker_setup_hook
from rayflow.runtime.restore import check_channel_state
from rayflow.runtime.run_lock import acquire_run_lock, release_run_lock
from rayflow.runtime.settings import JobSettings
from rayflow.runtime.sink_operator import sink_operator_factory
from rayflow.runtime.supervisor import RestartSupervisor, SupervisorState
from rayflow.runtime.warm_workers import WarmWorkerConfig, warm_workers
from rayflow.sink import Sink
from rayflow.sources import CollectionSource, Source
from rayflow.status import FailureKind, JobState

__all__ = [
    "StreamExecutionEnvironment",
    "JobClient",
    "JobResult",
    "CollectedRecords",
    "request_savepoint",
]


#: Ray's inline-argument limit rayflow sets when it starts a local Ray: messages of up to
#: an output buffer (1 MiB) go inline with the call instead of through the object store
#: (measured 1.2-2.6x faster for 200 KiB-1 MiB messages; benchmarks/transport.py).
INLINE_ARGUMENT_BYTES = 1 << 20


log = logging.getLogger("rayflow.job")


def local_ray_system_config() -> dict[str, Any]:
    """The Ray system config rayflow starts a local Ray with (empty when the user set
    ``RAY_max_direct_call_object_size`` themselves: theirs applies)."""
    if "RAY_max_direct_call_object_size" in os.environ:
        return {}
    return {"max_direct_call_object_size": INLINE_ARGUMENT_BYTES}


def ensure_ray(address: str | None = None, log_to_driver: bool = True) -> None:
    """Start or join Ray once per process: ``address``, else ``RAY_ADDRESS``, else a local Ray.

    A local Ray started here passes arguments of up to 1 MiB inline
    (``max_direct_call_object_size``); on a cluster, set
    ``RAY_max_direct_call_object_size=1048576`` in the environment of ``ray start`` on
    every node for the same effect (a joining driver cannot change it). Its worker
    processes import rayflow's runtime before they take work
    (:mod:`rayflow.runtime.preload`).
    ``log_to_driver=False`` keeps the actors' log lines out of this process's output
    (they stay in Ray's log files). An address where nothing answers fails within
    seconds (:class:`~rayflow.ray_connect.NoRayClusterError`)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        quiet_local_start()
    else:
        check_address(address)
    kwargs: dict[str, Any] = {
        "address": address,
        "logging_level": "WARNING",
        "log_to_driver": log_to_driver,
    }
    if address == "local":
        kwargs["include_dashboard"] = False
        if config := local_ray_system_config():
            kwargs["_system_config"] = config
        # Its workers import rayflow's runtime while they wait idle, not when a job starts.
        with worker_setup_hook() as hooked:
            ray.init(**kwargs)
        if hooked:
            mark_hooked_raylet(ray.get_runtime_context().gcs_address)
        return
    ray.init(**kwargs)


@dataclass
class JobResult:
    """What a finished job reports: timing, per-subtask metrics and sink results."""

    job_name: str
    started_at: float
    finished_at: float
    metrics: list[dict[str, Any]] = field(default_factory=list)
    sink_results: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    failures: list[str] = field(default_factory=list)
    recovery_times_s: list[float] = field(default_factory=list)
    restored_from: int | None = None
    job_master_restarts: int = 0
    guarantees: dict[str, str] = field(default_factory=dict)
    run_id: str = ""
    #: this run's checkpoint directory (``<storage>/<job>/<run id>``), None without checkpoints
    checkpoint_location: str | None = None
    #: counts of every checkpoint of the run by status, and running duration figures
    #: (``checkpoints`` holds only the most recent ones)
    checkpoint_summary: dict[str, Any] = field(default_factory=dict)
    #: end-to-end latency of the latency markers that reached the job's sink-end
    #: subtasks, merged over all of them: ``count``, ``p50_ms``, ``p90_ms``, ``p99_ms``,
    #: ``max_ms`` (count 0 when latency tracking is off)
    latency: dict[str, float] = field(default_factory=dict)
    #: a bounded uniform sample of those latencies in milliseconds (for a CDF)
    latency_samples_ms: list[float] = field(default_factory=list)
    #: every failure of the run, the same ones folded with a count
    failure_history: list[FailureEntry] = field(default_factory=list)
    #: each sink object of the job with its operator name (``sink_result(sink)``)
    sink_names: list[tuple[Sink, str]] = field(default_factory=list, repr=False, compare=False)
    #: what each sink gave in this job (``GuaranteeResolution`` by operator name)
    sink_guarantees: dict[str, GuaranteeResolution] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def completed_checkpoints(self) -> list[dict[str, Any]]:
        return [c for c in self.checkpoints if c["status"] == "COMPLETED"]

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    def get_net_runtime(self) -> float:
        """Runtime in milliseconds (PyFlink's name)."""
        return self.duration_s * 1000.0

    def sink_result(self, sink: str | Sink) -> Any:
        """The merged result of a sink, by operator name or by the sink object itself."""
        key = sink
        if not isinstance(sink, str):
            key = next((name for s, name in self.sink_names if s is sink), None)
        if key not in self.sink_results:
            raise KeyError(f"no sink named {key!r} (sinks: {sorted(self.sink_results)})")
        return self.sink_results[key]

    def commit_latencies(self, sink_name: str) -> list[dict[str, float]]:
        """Per checkpoint notification of each subtask of a two-phase-commit sink: how
        many transactions it committed and how long that took (``commit_s``)."""
        return [
            c
            for m in self.metrics
            for c in m.get("operators", {}).get(sink_name, {}).get("commits", [])
        ]

    def records_in(self, vertex_prefix: str) -> int:
        """Records that entered the vertices whose name starts with ``vertex_prefix``."""
        return sum(m["records_in"] for m in self.metrics if m["vertex"].startswith(vertex_prefix))


class _MasterLost(Exception):
    """The job master was lost during a call (a stop with savepoint takes it over)."""


class JobWaitTimeout(ray.exceptions.GetTimeoutError):
    """``JobClient.wait(timeout)`` ran out; the job keeps running. A ``TimeoutError`` (and,
    for code written against earlier versions, Ray's ``GetTimeoutError``)."""


def request_savepoint(
    master: Any, directory: str, stop: bool, timeout: float | None, job: str
) -> str:
    """Ask job master ``master`` for a savepoint into ``directory`` (with ``stop``: and
    to stop there) and return its directory. When ``timeout`` runs out, or the wait is
    interrupted (Ctrl-C), the request is withdrawn, so that the job does not stop, nor a
    savepoint appear, after the caller was told there is none; one taken meanwhile stands
    and is returned. Otherwise raises :class:`JobWaitTimeout`, or the
    ``KeyboardInterrupt`` with a note saying what became of the request; Ray's errors of
    the call pass through."""
    request_id = uuid.uuid4().hex
    interrupted: KeyboardInterrupt | None = None
    try:
        return ray.get(
            master.trigger_savepoint.remote(directory, stop, request_id), timeout=timeout
        )
    except ray.exceptions.GetTimeoutError:
        pass
    except KeyboardInterrupt as exc:
        interrupted = exc
    why = "interrupted" if interrupted is not None else f"no savepoint after {timeout:g} s"
    try:
        taken = ray.get(master.withdraw_savepoint.remote(request_id), timeout=120)
    except Exception as exc:  # noqa: BLE001 - the job master does not answer
        message = (
            f"{job}: {why}, and the request could not be withdrawn ({type(exc).__name__}): "
            "it may still be taken" + (" and stop the job" if stop else "")
        )
        if interrupted is not None:
            interrupted.add_note(message)
            raise interrupted from None
        raise JobWaitTimeout(message) from None
    if taken is not None:
        return taken
    message = (
        f"{job}: {why}; the request was withdrawn (its checkpoint, if started, aborted) "
        "and the job goes on"
    )
    if interrupted is not None:
        interrupted.add_note(message)
        raise interrupted
    raise JobWaitTimeout(message)


class JobClient:
    """A handle on a running job.

    The client also takes over when the job master dies (its process or node is
    lost): it loads the run's restart supervisor from the run's checkpoint storage,
    spends one restart of the same budget that attempt restarts use, makes sure every
    actor of the old job master is dead, and starts a new job master, which restores
    this run's newest checkpoint (or the point the run started from). A job master lost
    after it recorded the run's end leaves that end: CANCELED, FAILED, or FINISHED, where
    ``wait()`` raises :class:`~rayflow.errors.JobResultLostError` (the output is complete,
    the result is gone with the job master).
    """

    def __init__(
        self,
        job_name: str,
        job_id: str,
        graph: JobGraph,
        settings: JobSettings,
        lock: Any = None,
        warm: WarmWorkerConfig | None = None,
    ) -> None:
        self.job_name = job_name
        self._lock = lock
        self._warm = warm
        #: the job master's runtime environment: the one of the workers kept warm, if any
        self._actor_env = warm_workers.runtime_env_for_job(warm, job_actor_count(graph))
        self.job_id = job_id
        self.run_id = settings.run_id
        self._graph = graph
        self._settings = settings
        self._result: JobResult | None = None
        self._guarantees: dict[str, str] = {}
        self._state: JobState | None = None
        #: the end wait() found while it releases the run (its job master, actors and
        #: job name): shown as ``JobState.while_ending`` until ``_state`` is set
        self._ending: JobState | None = None
        self._cancel_requested = False
        self._takeover = threading.Lock()  # one job master takeover at a time
        self._release_lock = threading.Lock()  # one release at a time
        #: one thread handles the run's end (release, end line); the others, and any later
        #: wait(), take what it found
        self._end = threading.Lock()
        self._retrying = False  # a thread releases the job name once actors have stopped
        self._released = False  # its job master and actors gone, its job name free
        #: (checkpoint id, savepoint directory) of the stop a lost job master had recorded,
        #: read when a new one takes over
        self._recorded_stop: tuple[int | None, str | None] | None = None
        self._clean_up_masters = 0
        self._failure: str | None = None
        self._outcome: BaseException | None = None
        self._history: list[FailureEntry] | None = None  # kept once the run is over
        #: the state a lost job master had recorded as the run's end, if it had
        self._ended_as: SupervisorState | None = None
        #: since when calls to the job master answer "unreachable" (None: they do not)
        self._unreachable_since: float | None = None
        self._reporter = progress.reporter()
        self._output_lost = False  # the driver's stdout refused a write: no more tries
        #: what this client took of the job master's output (one reader at a time)
        self._output_read = OutputReader()
        self._output_lock = threading.Lock()
        self._start_master()
        # from here the job runs: nothing the driver shows may fail this call (it would
        # leave the job master running without a client, and the run lock released)
        self._report(lambda reporter: reporter.job_started(self))

    def _start_master(self) -> None:
        generation = settings_generation(self._settings)
        options: dict[str, Any] = {}
        if self._actor_env is not None:
            options["runtime_env"] = self._actor_env  # its subtasks inherit it
        self._master = RemoteJobMaster.options(
            name=f"rayflow:{self.job_id}:master:{generation}",
            max_concurrency=1000,
            # never detached, whatever the driver's default: it goes with its owner
            lifetime="non_detached",
            **options,
        ).remote(self._graph, self._settings)
        self._run_ref = self._master.run.remote()
        if self._cancel_requested and not self._settings.cancel_requested:
            self._master.cancel.remote()  # a cancel asked while this master was starting

    def _restart_master(self, exc: BaseException) -> bool:
        """One supervisor for every restart: the master's loss spends the run's budget.

        A cancel (asked here, or recorded by the dead master) is never resumed: the new
        job master only finishes it. A run that cannot restart any more gets a job master
        that cleans up its transactions, and then fails."""
        settings = self._settings
        if getattr(exc, "actor_init_failed", False):
            raise JobFailedError(
                f"job {self.job_name!r} failed: its job master could not start, so no restart "
                f"can help ({str(exc).strip().splitlines()[0]})"
            ) from None
        if not settings.checkpointing:
            return False
        storage = settings.storage()
        state = _retry(storage.read_job_state, f"job {self.job_name!r}: reading its state")
        if state is None:
            state = settings.supervisor or settings.new_supervisor().state
        # a stop with savepoint the lost job master recorded (stop_with_savepoint asks)
        self._recorded_stop = (
            getattr(state, "stopped_at", None),
            getattr(state, "stop_savepoint", None),
        )
        supervisor = RestartSupervisor(state)
        if supervisor.job_state.is_terminal:
            # it ended before it died (its reply was lost with it): nothing to resume or
            # clean up, and its recorded end is the run's
            self._ended_as = state
            return False
        lost = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        delay = 0.0
        if supervisor.job_state is JobState.FAILING:
            self._failure = supervisor.failure_message(self.job_name)
            supervisor.begin_clean_up()  # it failed for good: finish its clean-up, then fail
        elif self._cancel_requested or supervisor.job_state is JobState.CANCELLING:
            supervisor.begin_clean_up()
        else:
            found = supervisor.on_failure(f"job master lost: {lost}", FailureKind.JOB_MASTER_LOST)
            if found is None:
                self._failure = supervisor.failure_message(self.job_name)
                supervisor.begin_clean_up()
            else:
                delay = found
        if supervisor.job_state is JobState.CANCELLING:
            self._clean_up_masters += 1
            if self._clean_up_masters > MAX_CLEAN_UP_MASTERS:
                self._failure = (
                    f"job {self.job_name!r}: its job master was lost {MAX_CLEAN_UP_MASTERS} times "
                    "while cleaning up; transactions may linger until the next run recovers them"
                )
                return False
        _kill_job_actors(self.job_id)
        time.sleep(delay)
        if self._cancel_requested and supervisor.job_state is not JobState.CANCELLING:
            supervisor.begin_clean_up()  # cancelled while waiting to restart
        settings.supervisor = supervisor.snapshot()
        settings.cancel_requested = supervisor.job_state is JobState.CANCELLING
        _retry(
            lambda: storage.write_job_state(settings.supervisor),
            f"job {self.job_name!r}: recording its state",
        )
        self._start_master()
        return True

    def get_job_status(self, timeout: float | None = None) -> JobState:
        """CREATED, RUNNING, RESTARTING, FINISHED, FAILED, CANCELLING or CANCELED; raises
        Ray's ``GetTimeoutError`` when the job master does not answer within ``timeout``."""
        known = self._known_state()
        if known is not None:
            return known
        try:
            return JobState(ray.get(self._master.status.remote(), timeout=timeout)["state"])
        except ray.exceptions.RayActorError:
            known = self._known_state()  # killed by wait() as the run ended
            if known is not None:
                return known
            if self._cancel_requested:
                return JobState.CANCELLING  # its job master is gone: being cleaned up
            return JobState.RESTARTING if self._settings.checkpointing else JobState.FAILED

    def _known_state(self) -> JobState | None:
        """The state wait() found, if it found the run's end: terminal once the run is
        released (its job name free), what it was while that runs."""
        if self._result is not None:
            return JobState.FINISHED
        if self._state is not None:
            return self._state
        ending = self._ending
        return None if ending is None else ending.while_ending

    def failure_history(self) -> list[FailureEntry]:
        """Every failure of the run so far, most recent last; the same failure (operator,
        subtask, exception type and message) is one entry with a count and the times
        of its first and last occurrence."""
        if self._history is not None:
            return list(self._history)
        try:
            return list(ray.get(self._master.status.remote(), timeout=30)["failure_history"])
        except Exception:  # noqa: BLE001 - the job master is being replaced
            return []

    def _master_status(self) -> dict[str, Any]:
        return ray.get(self._master.status.remote())

    def checkpoints(self) -> list[dict[str, Any]]:
        """Statistics of the most recent checkpoints (completed, failed and aborted)."""
        return ray.get(self._master.checkpoints.remote())

    def metrics(self) -> list[dict[str, Any]]:
        """Per-subtask metrics of the running job (records in/out, buffers, in-flight pushes)."""
        return ray.get(self._master.metrics.remote())

    def trigger_savepoint(self, path: str, timeout: float | None = 300.0) -> str:
        """Take a savepoint of the running job into a new directory under ``path`` (local,
        or any URI of the checkpoint storage's kind, e.g. ``s3://bucket/savepoints``) and
        return that directory; the job goes on. A savepoint is self-contained (it may be
        moved) and ``execute(restore_from=<it>)`` starts a new run from it. Raises
        :class:`~rayflow.errors.SavepointError` when it fails (the job goes on)."""
        return self._savepoint(path, stop=False, timeout=timeout)

    def stop_with_savepoint(self, path: str, timeout: float | None = 300.0) -> str:
        """Stop the job with a savepoint (Flink's stop-with-savepoint): the sources stop at
        the savepoint's barrier, every operator snapshots, two-phase-commit sinks commit
        their last transactions once it completes, and every subtask finishes; returns the
        savepoint's directory once the job has ended (FINISHED). If the savepoint fails
        before it completes the job goes on, and this raises
        :class:`~rayflow.errors.SavepointError`.

        When the job master is lost meanwhile, a new one takes over here: if the lost one
        had recorded the stop, the new one writes the savepoint (unless it was written)
        and finishes the job, and this returns the savepoint; otherwise the job goes on
        from its last checkpoint and this raises :class:`~rayflow.errors.SavepointError`
        saying so."""
        deadline = None if timeout is None else time.time() + timeout
        lost = self._master
        try:
            directory = self._savepoint(path, stop=True, timeout=timeout)
        except _MasterLost as exc:
            return self._stop_after_master_loss(lost, exc, deadline)
        try:
            self.wait(None if deadline is None else max(1.0, deadline - time.time()))
        except JobWaitTimeout as slow:
            # the stop happened: the caller must learn where its savepoint is
            error = JobWaitTimeout(
                f"{slow} (it was stopped with savepoint {directory}, which is complete; "
                "the job is finishing: committing the savepoint's transactions)"
            )
            error.savepoint = directory
            raise error from None
        return directory

    def _stop_after_master_loss(self, lost: Any, exc: BaseException, deadline: float | None) -> str:
        """The job master ``lost`` was lost during a stop with savepoint: take it over, and
        return the savepoint if it had recorded the stop; else raise (the job goes on)."""

        def left() -> float | None:
            return None if deadline is None else max(1.0, deadline - time.time())

        try:
            while self._master is lost and self._result is None and self._outcome is None:
                try:
                    self.wait(min(POLL_S, left() or POLL_S))
                except JobWaitTimeout:
                    if deadline is not None and time.time() >= deadline:
                        raise
            stopped_at, directory = self._recorded_stop or self._stop_in_storage()
            if stopped_at is None or directory is None:
                if self._result is not None or self._state is JobState.FINISHED:
                    raise SavepointError(
                        f"job {self.job_name!r}: its job master was lost during the stop with "
                        f"savepoint ({exc}), and the job ended before the stop: no savepoint"
                    )
                raise SavepointError(
                    f"job {self.job_name!r}: its job master was lost before the stop with "
                    f"savepoint completed ({exc}); no savepoint was taken, and the job goes on "
                    "from its last checkpoint under a new job master (stop it again)"
                )
            self.wait(left())
        except JobResultLostError:
            # the lost job master had finished the job: the stop happened if it recorded it
            stopped_at, directory = self._recorded_stop or self._stop_in_storage()
            if stopped_at is None or directory is None:
                raise
        except (JobFailedError, JobCancelledError) as ended:
            raise SavepointError(
                f"job {self.job_name!r}: its job master was lost during the stop with "
                f"savepoint, and the job then ended: {ended}"
            ) from None
        if not is_savepoint(directory, self._savepoint_options(directory)):
            raise SavepointError(
                f"job {self.job_name!r} stopped at checkpoint {stopped_at}, but its savepoint "
                f"could not be written to {directory!r} after its job master was lost; the "
                f"same state is checkpoint {stopped_at} of run {self.run_id}, which "
                "restore_from accepts while it is retained"
            )
        return directory

    def _stop_in_storage(self) -> tuple[int | None, str | None]:
        """The stop with savepoint recorded in the run's state (a job that ended without
        a job master takeover: its state is final)."""
        try:
            state = self._settings.storage().read_job_state()
        except Exception:  # noqa: BLE001 - then none is known
            state = None
        return getattr(state, "stopped_at", None), getattr(state, "stop_savepoint", None)

    def _savepoint_options(self, directory: str) -> dict[str, Any]:
        options = self._settings.checkpoint_config.storage_options
        return dict(options or {}) if directory.startswith("s3://") else {}

    def _savepoint(self, path: str, stop: bool, timeout: float | None) -> str:
        if not isinstance(path, str) or not path:
            raise TypeError(f"savepoint: path must be a non-empty str, got {path!r}")
        if self._result is not None or self._state is not None:
            raise SavepointError(f"job {self.job_name!r} has ended: no savepoint")
        if "://" not in path:
            path = os.path.abspath(path)
        try:
            return request_savepoint(self._master, path, stop, timeout, f"job {self.job_name!r}")
        except ray.exceptions.RayActorError as exc:
            if stop:
                raise _MasterLost(str(exc).strip().splitlines()[0] if str(exc) else "") from None
            raise SavepointError(
                f"job {self.job_name!r}: its job master was lost during the savepoint ({exc}); "
                "the job goes on from its last checkpoint under a new job master once this "
                "client waits for it"
            ) from None
        except Exception as exc:  # noqa: BLE001 - the cause, not Ray's wrapper
            raise _unwrap(exc) from None

    def cancel(self, timeout: float | None = 120.0) -> bool:
        """Cancel the job and return once it is cleaned up: every operator closed, open
        transactions aborted (what completed checkpoints hold is committed), every actor
        gone. ``wait()`` then raises :class:`~rayflow.errors.JobCancelledError`.

        Returns True when the job ended cancelled, False when it had ended before the
        cancel took effect (finished: its result stays available from ``wait()``; or
        failed)."""
        if self._result is not None:
            return False
        if self._state is not None:
            return self._state is JobState.CANCELED
        self.request_cancel()
        try:
            self.wait(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"job {self.job_name!r} is still cancelling after {timeout:g} s; "
                "wait() returns when it is done"
            ) from None
        except JobCancelledError as exc:
            self._outcome = exc
            return True
        except Exception as exc:  # noqa: BLE001 - what wait() raises from now on
            self._outcome = exc
        return False

    def request_cancel(self) -> None:
        """Ask the job to cancel and return at once; ``wait()`` (in any thread) returns
        once it is cleaned up (see ``cancel``)."""
        self._cancel_requested = True
        try:
            ray.get(self._master.cancel.remote())
        except ray.exceptions.RayActorError:
            pass  # wait() lets a new job master finish the cancel

    def snapshot(self, timeout: float = 10.0) -> dict[str, Any] | None:
        """The job master's status, every subtask's metrics and the newest completed
        checkpoint in one call; None while the job master does not answer."""
        try:
            return ray.get(self._master.progress.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - restarting, or over
            return None

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until the job ends and return its result; raises
        :class:`~rayflow.errors.JobFailedError` if it failed, and ``TimeoutError``
        (naming the job, which keeps running) when ``timeout`` seconds pass first.

        While it waits, what the job's functions print is printed here (prefixed with
        operator and subtask); all of it is printed before this returns or raises."""
        if self._result is not None:
            return self._result
        if self._outcome is not None:
            raise self._outcome.with_traceback(None)
        deadline = None if timeout is None else time.time() + timeout
        while True:
            if self._outcome is not None:  # another thread's takeover ended the run
                raise self._outcome.with_traceback(None)
            remaining = None if deadline is None else max(0.0, deadline - time.time())
            ref = self._run_ref
            try:
                raw = ray.get(ref, timeout=POLL_S if remaining is None else min(POLL_S, remaining))
                break
            except ray.exceptions.GetTimeoutError:
                self._unreachable_since = None
                if deadline is not None and time.time() >= deadline:
                    raise self._still(self._state_word(), timeout) from None
                self._poll()
                continue
            except ray.exceptions.ActorUnavailableError as exc:
                # Unreachable for now (a network blip, or a node not yet declared dead). The
                # failed call keeps its error: ask the job master again with a fresh call.
                # How long it has been unreachable counts across calls of wait(), so that
                # waiting in short slices still takes over a job master that is gone.
                self._unreachable_since = self._unreachable_since or time.time()
                if time.time() - self._unreachable_since < MASTER_UNREACHABLE_S:
                    with self._takeover:
                        if self._run_ref is ref:
                            self._run_ref = self._master.outcome.remote()
                    if deadline is not None and time.time() >= deadline:
                        raise self._still("unreachable", timeout) from None
                    left = 1.0 if deadline is None else deadline - time.time()
                    time.sleep(max(0.0, min(1.0, left)))
                    continue
                self._unreachable_since = None
                self._take_over(ref, exc)
            except ray.exceptions.RayActorError as exc:
                self._take_over(ref, exc)
            except Exception as exc:
                with self._end:
                    if self._outcome is not None:  # another thread handled the end
                        raise self._outcome.with_traceback(None) from None
                    self._ended_with(_unwrap(exc))
        with self._end:
            if self._result is not None:  # another thread handled the end
                return self._result
            if self._outcome is not None:
                raise self._outcome.with_traceback(None)
            self._ending = JobState.FINISHED
            self._print_output(raw.get("output"))  # every line not printed here yet
            self._release()
            self._result = _build_result(self.job_name, self._graph, raw)
            self._result.guarantees = dict(self._guarantees)
            self._history = self._result.failure_history
            self._report_end()
            return self._result

    def _ended_with(self, cause: BaseException) -> NoReturn:
        """The run ended with ``cause`` (under ``_end``): release it, show its end, and
        raise ``cause``, which every later wait() raises at once (a release held up by
        actors that do not stop is tried again by a thread, never by a wait())."""
        if self._failure is not None and isinstance(cause, JobCancelledError):
            cause = JobFailedError(self._failure)  # cleaned up after a final failure
        self._ending = (
            JobState.CANCELED if isinstance(cause, JobCancelledError) else JobState.FAILED
        )
        self._history = getattr(cause, "failure_history", None) or self.failure_history()
        self._print_output()
        self._release()
        self._state = self._ending  # shown once the job name is free
        self._outcome = cause
        self._report_end(str(cause).strip().splitlines()[0] if str(cause) else "")
        raise cause from None

    def _still(self, state: str, timeout: float) -> JobWaitTimeout:
        return JobWaitTimeout(
            f"job {self.job_name!r} (job id {self.job_id}) is still {state} after "
            f"{timeout:g} s; it keeps running: wait() again, or cancel() it"
        )

    # --- what the driver shows while it waits ----------------------------------------------

    def _state_word(self) -> str:
        try:
            return ray.get(self._master.status.remote(), timeout=5)["state"].value
        except Exception:  # noqa: BLE001 - busy or being replaced
            return "running"

    def _poll(self) -> None:
        """Print what the job's functions printed since the last poll; redraw the
        progress line (when on)."""
        self._print_output()
        self._report(lambda reporter: reporter.tick(self))

    def _report(self, show: Any) -> None:
        """``show(reporter)``, if reporting is on. What the driver shows never changes
        what the job does or what ``wait()`` returns: a reporter that fails (its stream
        closed, a broken pipe) is turned off."""
        reporter = self._reporter
        if reporter is None:
            return
        try:
            show(reporter)
        except Exception as exc:  # noqa: BLE001 - a display, not the job
            self._reporter = None
            log.warning(
                "job %r: progress display off: %s: %s", self.job_name, type(exc).__name__, exc
            )

    def _print_output(self, chunk: OutputChunk | None = None) -> None:
        """Print what the job's functions printed that this client has not printed yet:
        the lines of ``chunk`` (the outcome's), else of a read from the job master now. A
        read that times out loses nothing (the job master keeps each line until a later
        read acknowledges it); lines are taken and printed under one lock, so two threads
        waiting for the job print each line once and in order."""
        if chunk is None:
            with self._output_lock:
                ack = self._output_read.ack(_MASTER_OUTPUT)  # a new job master ignores it
            try:
                chunk = ray.get(self._master.drain_output.remote(ack), timeout=30)
            except Exception:  # noqa: BLE001 - the job master is gone or replaced: none to show
                return
        with self._output_lock:
            self._write_output(self._output_read.take(_MASTER_OUTPUT, chunk))

    def _write_output(self, lines: list[str]) -> None:
        """Print what the job's functions printed. A stdout that refuses the write (closed,
        a broken pipe) loses the lines, never the job's outcome."""
        if not lines or self._output_lost:
            return
        if self._reporter is not None:
            self._report(lambda reporter: reporter.write_output(lines))
            return
        try:
            sys.stdout.write("".join(line + "\n" for line in lines))
            sys.stdout.flush()
        except (OSError, ValueError) as exc:  # closed, or its reader went away
            self._output_lost = True
            log.warning(
                "job %r: what its functions print is no longer shown (stdout: %s: %s)",
                self.job_name,
                type(exc).__name__,
                exc,
            )

    def _progress_snapshot(self) -> dict[str, Any] | None:
        return self.snapshot()

    def _report_end(self, detail: str = "") -> None:
        state = self._state.value if self._state is not None else JobState.FINISHED.value
        self._report(lambda reporter: reporter.job_ended(self, state, detail))

    get_job_execution_result = wait

    def _take_over(self, ref: Any, exc: BaseException) -> None:
        """The job master behind ``ref`` is lost: start the next one, once, whichever
        thread sees it first; raise if the run cannot go on."""
        with self._takeover:
            if self._outcome is not None:
                # another thread's takeover failed and released the run: no job master
                # of it starts again (beside a next run of its name)
                raise self._outcome.with_traceback(None)
            if self._run_ref is not ref:
                return  # another thread took over already
            try:
                restarted = self._restart_master(exc)
            except BaseException as failed:
                # the run's outcome before its release (which may be interrupted): a
                # later wait() raises it again, and never restarts a job master of it
                self._outcome = (
                    failed
                    if isinstance(failed, Exception)
                    else JobFailedError(
                        f"job {self.job_name!r} failed: the restart of its lost job master "
                        f"was interrupted ({type(failed).__name__})"
                    )
                )
                self._ending = JobState.FAILED
                try:
                    self._release()
                finally:
                    self._state = self._ending  # shown once the job name is free
                raise
        if not restarted:
            error = self._lost_master_error(exc)
            self._release()
            self._state = self._ending  # shown once the job name is free
            self._outcome = error
            raise error from None

    def _lost_master_error(self, exc: BaseException) -> BaseException:
        """What ``wait()`` raises when the job master is lost and no new one can go on:
        the end the lost one recorded, if it recorded one (sets ``_ending``)."""
        ended = self._ended_as
        if ended is not None:
            self._history = list(ended.history.entries)
        if ended is not None and ended.state is JobState.FINISHED:
            self._ending = JobState.FINISHED
            return JobResultLostError(
                f"job {self.job_name!r} FINISHED: every record was processed and its final "
                "checkpoint committed, but its job master was lost before its result "
                "(outputs, metrics) reached this driver; what its sinks committed is complete"
            )
        if ended is not None and ended.state is JobState.CANCELED and self._failure is None:
            self._ending = JobState.CANCELED
            return JobCancelledError(
                f"job {self.job_name!r} was cancelled (its job master was lost after it had "
                "cleaned up)"
            )
        self._ending = JobState.FAILED
        if self._failure is None and ended is not None and ended.state is JobState.FAILED:
            self._failure = RestartSupervisor(ended).failure_message(self.job_name)
        error = JobFailedError(
            self._failure or f"job {self.job_name!r} failed: its job master died ({exc})"
        )
        if ended is not None:
            error.failure_history = list(ended.history.entries)
            error.non_recoverable = ended.non_recoverable
        return error

    @property
    def holds_job_name(self) -> bool:
        """Whether this run holds its job name's lock: while it runs, and after its end
        for as long as processes of its actors are not known to have exited."""
        return self._lock is not None

    def release_stopped(self) -> bool:
        """For a run that ended holding its job name: stop its actors again, and release
        the name once their processes have exited. True once it is released. (Late: the
        workers this run had kept warm are not topped up, whatever runs by then.)"""
        self._release(retry=False)
        return self._released

    def _release(self, retry: bool = True) -> None:
        """The run is over: its job master (and any actor of the job left) goes, and
        only then its job name's lock. While processes of its actors still run (or
        whether they do is not known), the lock stays: no next run of the name starts
        beside them; a thread of this process looks again every ``RELEASE_RETRY_S`` and
        releases it once they have exited (:meth:`release_stopped`)."""
        with self._release_lock:
            if self._released:
                return
            try:
                ray.kill(self._master, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            try:
                _kill_job_actors(self.job_id)
            except BaseException as exc:  # not known to be stopped: the lock is kept
                log.error(
                    "job %r: its actors could not all be stopped (%s: %s); its job name "
                    "stays locked until they are (looked at again every %g s)",
                    self.job_name,
                    type(exc).__name__,
                    exc,
                    RELEASE_RETRY_S,
                )
                if not self._retrying:  # also after an interrupt: someone must release
                    self._retrying = True
                    threading.Thread(target=self._release_later, daemon=True).start()
                if not isinstance(exc, Exception):
                    raise
                return
            try:
                release_run_lock(self._lock)
            except BaseException:  # an interrupt (a failed release is tried inside)
                if not self._retrying:  # someone must still release it
                    self._retrying = True
                    threading.Thread(target=self._release_later, daemon=True).start()
                raise
            self._lock = None
            self._released = True
            if retry and self._warm is not None:
                # the next job of this driver finds its processes started
                warm_workers.keep_warm(job_actor_count(self._graph), self._warm)
                self._warm = None

    def _release_later(self) -> None:
        while not self.release_stopped():
            time.sleep(RELEASE_RETRY_S)


class CollectedRecords(list):
    """The records ``execute_and_collect`` returns: a list, which also works as PyFlink's
    ``with stream.execute_and_collect() as results:``."""

    def __enter__(self) -> CollectedRecords:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: the job has ended."""


def job_actor_count(graph: JobGraph) -> int:
    """Actors a run of ``graph`` takes: one per subtask and the job master (the run lock is
    a record, its driver's lock host an actor made once per driver)."""
    return sum(v.parallelism for v in graph.vertices.values()) + 1


def settings_generation(settings: JobSettings) -> int:
    return settings.supervisor.master_generation if settings.supervisor else 0


#: actor options of a subtask that only rayflow sets (set_subtask_options refuses them)
_OWN_SUBTASK_OPTIONS = (
    "max_restarts",
    "max_task_retries",
    "lifetime",
    "name",
    "namespace",
    "get_if_exists",
    "max_concurrency",
    "concurrency_groups",
)

#: an unreachable job master is taken for lost after this long
MASTER_UNREACHABLE_S = 60.0
#: how often a run that ended holding its job name (its actors not known to have
#: stopped) tries again to stop them and release the name
RELEASE_RETRY_S = 30.0

#: while waiting for a job, the driver polls its job master this often (for what the
#: job's functions print, and the progress line)
POLL_S = 1.0
#: whom a client reads printed lines from (its job master, whichever incarnation)
_MASTER_OUTPUT = "job master"

#: job masters started only to finish a cancel or a final failure's clean-up, at most
MAX_CLEAN_UP_MASTERS = 3


def _retry(call: Any, what: str, tries: int = 4) -> Any:
    """``call()``, retried with backoff on errors (storage may fail for a moment)."""
    delay = 0.2
    for attempt in range(tries):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001
            if attempt == tries - 1:
                raise JobFailedError(f"{what} failed: {type(exc).__name__}: {exc}") from None
            time.sleep(delay)
            delay *= 2
    return None


def _kill_job_actors(job_id: str, timeout_s: float = 30.0) -> None:
    """Kill every actor of a job and wait until each is dead: the next job master must
    not deploy next to subtasks of the old one that still write. Then remove the
    placement groups of its job masters (Ray keeps those of a dead job master while
    the driver lives)."""
    handles = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"rayflow:{job_id}:"):
            try:
                handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                ray.kill(handle, no_restart=True)
                handles.append(handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
    try:
        _wait_until_dead(job_id, handles, timeout_s)
        # Ray calls the actors of a lost job master dead before their processes exit
        try:
            exited = wait_recorded_exited(job_id, timeout_s, wait_named_exited)
        except Exception as exc:  # noqa: BLE001 - not known: never taken as exited
            what = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            if not isinstance(exc, ActorTableUnavailable):
                what = f"{type(exc).__name__}: {what}"
            raise JobFailedError(
                f"job {job_id}: whether processes of its actors still run is not known "
                f"({what}); nothing of it starts again before that is known"
            ) from None
        if exited is None:
            raise JobFailedError(
                f"job {job_id}: processes of its actors (a lost job master's, or those of "
                f"its run) still run after {timeout_s:g} s; nothing of it starts again "
                "beside them"
            )
        forget_processes(job_id, exited)  # exited: nobody needs to look for them again
    finally:
        # also when some still answer: Ray kills what runs in a removed group
        remove_job_placement_groups(job_id)


def _wait_until_dead(job_id: str, handles: list[Any], timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    for handle in handles:
        while True:
            try:
                ray.get(handle.ready.remote(), timeout=1.0)
            except ray.exceptions.ActorUnavailableError:
                pass  # unreachable for now: maybe alive, maybe its node is not declared dead
            except ray.exceptions.RayActorError:
                break
            except Exception:  # noqa: BLE001 - not answering yet
                pass
            if time.time() > deadline:
                raise JobFailedError(
                    f"job {job_id}: actors of its lost job master are still alive after "
                    f"{timeout_s:g} s; not starting another one beside them"
                )
            time.sleep(0.05)


def _build_result(job_name: str, graph: JobGraph, raw: dict[str, Any]) -> JobResult:
    metrics: list[dict[str, Any]] = []
    sink_results: dict[str, Any] = {}
    sink_end_latencies: list[LatencyTracker] = []
    for vertex_id, subtask_outputs in raw["outputs"].items():
        vertex = graph.vertices[vertex_id]
        metrics.extend(o["metrics"] for o in subtask_outputs)
        if not vertex.out_edges or (vertex.sinks and not vertex.is_source):  # a sink's
            sink_end_latencies.extend(
                LatencyTracker.from_summary(o["metrics"]["latency"])
                for o in subtask_outputs
                if "latency" in o["metrics"]
            )
        for position, spec in enumerate(vertex.operators):
            sink = spec.sink
            if sink is not None:
                sink_results[spec.name] = sink.merge_results(
                    [o["results"][position] for o in subtask_outputs]
                )
    latency = LatencyTracker.merged(sink_end_latencies)
    return JobResult(
        job_name=job_name,
        started_at=raw["started_at"],
        finished_at=raw["finished_at"],
        metrics=metrics,
        sink_results=sink_results,
        checkpoints=raw["checkpoints"],
        restarts=raw["restarts"] - raw["master_restarts"],
        failures=raw["failures"],
        recovery_times_s=raw["recovery_times"],
        restored_from=raw["restored_from"],
        job_master_restarts=raw["master_restarts"],
        run_id=raw["run_id"],
        checkpoint_location=raw["checkpoint_location"],
        checkpoint_summary=raw["checkpoint_summary"],
        latency=latency.figures(),
        latency_samples_ms=latency.samples_ms(),
        failure_history=list(raw.get("failure_history", [])),
        sink_names=[(spec.sink, spec.name) for spec in graph.sink_specs()],
        sink_guarantees=dict(graph.sink_guarantees()),
    )


def _guarantee_words(graph: JobGraph) -> dict[str, str]:
    return {name: r.end_to_end for name, r in graph.sink_guarantees().items() if r is not None}


def start_run(
    graph: JobGraph,
    settings: JobSettings,
    restore_from: str | None,
    warm: WarmWorkerConfig | None = None,
    plan: LogicalPlan | None = None,
    allow_non_restored_state: bool = False,
) -> JobClient:
    """Start a run of ``graph`` on the connected Ray: take the job name's run lock, pick
    what to restore (a checkpoint or a savepoint, state matched by operator uid), prune
    retained runs, set the sinks up and start the job master. The lock is released again
    when any of that fails. ``plan`` (the job's logical plan) names the operators without
    an explicit uid in the warning a restore gives about them."""
    job_name = settings.job_name
    config = settings.checkpoint_config
    lock = acquire_run_lock(job_name, settings.run_id, settings.job_id)  # before restoring
    try:
        _load_initial_restore(graph, settings, restore_from, plan, allow_non_restored_state)
        if config.is_checkpointing_enabled():
            jobs = JobStorage(config.checkpoint_storage, job_name, config.storage_options)
            source = settings.initial_restore.run_id if settings.initial_restore else None
            jobs.prune_runs(config.num_retained_runs - 1, {settings.run_id, source})
            settings.first_checkpoint_id = jobs.max_checkpoint_id() + 1
        for spec in graph.sink_specs():
            spec.sink.setup(job_name, spec.guarantee)
        client = JobClient(job_name, settings.job_id, graph, settings, lock, warm)
    except BaseException:
        release_run_lock(lock)
        raise
    client._guarantees = _guarantee_words(graph)
    return client


def _load_initial_restore(
    graph: JobGraph,
    settings: JobSettings,
    restore_from: str | None,
    plan: LogicalPlan | None,
    allow_non_restored_state: bool,
) -> None:
    """Load what the run starts from into ``settings.initial_restore`` (checked against
    the graph)."""
    if restore_from is None:
        return
    config = settings.checkpoint_config
    where = f"restore_from={restore_from!r}"
    if not config.is_checkpointing_enabled():
        raise ValueError(f"{where}: restoring needs checkpointing (env.enable_checkpointing(...))")
    settings.initial_restore = _load_restore(config, settings.job_name, restore_from)
    check_channel_state(graph, settings.initial_restore, where)
    check_state_mapping(plan, graph, settings.initial_restore, allow_non_restored_state, where)


def start_lost_run_clean_up(
    graph: JobGraph,
    settings: JobSettings,
    restore_from: str | None,
    plan: LogicalPlan | None = None,
    allow_non_restored_state: bool = False,
) -> JobClient:
    """Start cleaning up a run whose job master was lost with the process that ran it (a
    detached job's host) as a cancel does: a job master that only cleans up, committing
    what the run's completed checkpoints hold and aborting every other open transaction.
    Takes the job name's run lock for the run again (:class:`ConcurrentRunError` when
    another run holds it: that run recovers the transactions). The caller makes sure no
    actor of the lost job master is left, and waits for the client returned: its
    ``wait()`` raises ``JobCancelledError`` once cleaned up, and releases the lock once
    the clean-up's actors are gone (``holds_job_name`` says when it could not yet)."""
    job_name = settings.job_name
    config = settings.checkpoint_config
    storage = settings.storage()
    lock = acquire_run_lock(job_name, settings.run_id, settings.job_id)
    try:
        _load_initial_restore(graph, settings, restore_from, plan, allow_non_restored_state)
        jobs = JobStorage(config.checkpoint_storage, job_name, config.storage_options)
        settings.first_checkpoint_id = jobs.max_checkpoint_id() + 1
        for spec in graph.sink_specs():
            spec.sink.setup(job_name, spec.guarantee)
        state = _retry(storage.read_job_state, f"job {job_name!r}: reading its state")
        supervisor = RestartSupervisor(state or settings.new_supervisor().state)
        supervisor.begin_clean_up()
        settings.supervisor = supervisor.snapshot()
        settings.cancel_requested = True
        _retry(
            lambda: storage.write_job_state(settings.supervisor),
            f"job {job_name!r}: recording its state",
        )
        return JobClient(job_name, settings.job_id, graph, settings, lock)
    except BaseException:
        release_run_lock(lock)
        raise


def _load_restore(config: CheckpointConfig, job_name: str, restore_from: str) -> CheckpointMetadata:
    if restore_from != "latest" and is_savepoint(restore_from, config.storage_options):
        return load_savepoint(restore_from, config.storage_options)
    if restore_from == "latest":
        storage: Any = JobStorage(config.checkpoint_storage, job_name, config.storage_options)
        checkpoint = None
    else:
        storage, checkpoint = open_checkpoint_path(restore_from, config.storage_options)
    if isinstance(storage, JobStorage):
        found = storage.latest()
        if found is None:
            raise FileNotFoundError(
                f"restore_from={restore_from!r}: no completed checkpoint under "
                f"{storage.location()!r}"
            )
        return found[1]
    ids = storage.completed_ids()
    if checkpoint is None:
        if not ids:
            raise FileNotFoundError(
                f"restore_from={restore_from!r}: no completed checkpoint under "
                f"{storage.location()!r}"
            )
        checkpoint = ids[-1]
    elif checkpoint not in ids:
        raise FileNotFoundError(
            f"restore_from={restore_from!r}: checkpoint {checkpoint} is not complete "
            f"(completed: {ids})"
        )
    return storage.load_metadata(checkpoint)


class StreamExecutionEnvironment:
    """The context in which a streaming job is defined and executed."""

    def __init__(self) -> None:
        self._plan = LogicalPlan()
        self._parallelism = 1
        self._max_parallelism = DEFAULT_MAX_PARALLELISM
        self._chaining = True
        self._channel_capacity = 8
        self._send_window = 8
        self._latency_tracking_interval_ms = DEFAULT_LATENCY_TRACKING_INTERVAL_MS
        self._debloat_target_ms: int | None = None
        self._buffer_timeout_ms = DEFAULT_BUFFER_TIMEOUT_MS
        self._data_transport = DataTransport.SOCKET
        self._buffer_bytes: int | None = None  # sized by the channel's bytes
        self._channel_bytes: int | None = None  # sized by each subtask's channels
        self._subtask_options: dict[str, Any] = {}
        self._placement = PlacementConfig()
        self._checkpoint_config = CheckpointConfig()
        self._execution_config = ExecutionConfig()
        self._restart_strategy: RestartStrategy | None = None
        self._fault_plan = None
        self._warm_workers = WarmWorkerConfig()
        self._failure_classifier: FailureClassifier | None = None
        self._preflight_checks = True

    @staticmethod
    def get_execution_environment() -> StreamExecutionEnvironment:
        return StreamExecutionEnvironment()

    # --- configuration -------------------------------------------------------------------

    def set_parallelism(self, parallelism: int) -> StreamExecutionEnvironment:
        self._parallelism = check_parallelism("set_parallelism", parallelism)
        return self

    def get_parallelism(self) -> int:
        return self._parallelism

    def set_max_parallelism(self, max_parallelism: int) -> StreamExecutionEnvironment:
        self._max_parallelism = check_parallelism(
            "set_max_parallelism", max_parallelism, "max parallelism"
        )
        return self

    def get_max_parallelism(self) -> int:
        return self._max_parallelism

    def enable_checkpointing(
        self, interval_ms: int, mode: CheckpointingMode = CheckpointingMode.EXACTLY_ONCE
    ) -> StreamExecutionEnvironment:
        """Take a checkpoint every ``interval_ms`` in ``mode``."""
        self._checkpoint_config.set_checkpoint_interval(interval_ms)
        self._checkpoint_config.set_checkpointing_mode(mode)
        return self

    def get_checkpoint_config(self) -> CheckpointConfig:
        return self._checkpoint_config

    def get_config(self) -> ExecutionConfig:
        """How operators treat records (object reuse), as Flink's ``ExecutionConfig``."""
        return self._execution_config

    def get_checkpoint_interval(self) -> int | None:
        return self._checkpoint_config.interval_ms

    def set_restart_strategy(self, strategy: RestartStrategy) -> StreamExecutionEnvironment:
        """See :class:`~rayflow.config.RestartStrategies`. Without one, a job with
        checkpoints restarts forever, 1 s apart (Flink's default); one without never
        restarts. Failures that no restart can fix fail the job at once either way
        (see ``set_failure_classifier``)."""
        if not isinstance(strategy, RestartStrategy):
            raise TypeError(
                "set_restart_strategy: expected a RestartStrategy (from RestartStrategies), "
                f"got {type(strategy).__name__}"
            )
        self._restart_strategy = strategy
        return self

    def set_failure_classifier(
        self, classifier: FailureClassifier | None
    ) -> StreamExecutionEnvironment:
        """Decide which failures a restart can fix (see :mod:`rayflow.recoverability`):
        ``classifier(exc)`` returns True (restart as the strategy says), False (fail the
        job now) or None (the default rules: read-only or missing paths, missing buckets
        and rejected credentials are not recoverable). None restores the defaults."""
        if classifier is not None and not callable(classifier):
            raise TypeError(
                f"set_failure_classifier: expected a function or None, got {classifier!r}"
            )
        if classifier is not None:
            import cloudpickle

            try:
                cloudpickle.dumps(classifier)
            except Exception as exc:  # noqa: BLE001 - it must travel to every subtask
                raise TypeError(
                    f"set_failure_classifier: {classifier!r} cannot be pickled to go to the "
                    f"job's subtasks ({type(exc).__name__}: {exc}); give a module-level "
                    "function that captures nothing that cannot be pickled"
                ) from None
        self._failure_classifier = classifier
        return self

    def set_preflight_checks(self, enabled: bool) -> StreamExecutionEnvironment:
        """Check input paths, output directories, buckets and checkpoint storage on the
        driver before the job deploys (on by default; see :mod:`rayflow.preflight`)."""
        self._preflight_checks = bool(enabled)
        return self

    def disable_operator_chaining(self) -> StreamExecutionEnvironment:
        self._chaining = False
        return self

    def set_buffer_limits(
        self,
        channel_capacity: int = 8,
        send_window: int = 8,
        channel_bytes: int | None = None,
    ) -> StreamExecutionEnvironment:
        """Backpressure bounds, per channel: messages buffered at the receiving subtask
        (``channel_capacity``), unacknowledged pushes of the sender (``send_window``), and
        bytes of batches for each of the two (``channel_bytes``; a message bigger than
        that still goes, alone). What is in flight bounds how long an aligned barrier
        waits behind data under backpressure.

        ``channel_bytes`` None (the default) sizes each subtask's channels by their
        count, like Flink's network memory, when the buffer timeout is 100 ms or more
        (a lower one asks for latency: every channel and message stays at 1 MiB): its
        input channels share 32 MiB, and so do its output channels, each getting 1 to 16
        MiB (16 MiB for up to two channels, 1 MiB from 32 on; an output channel never
        more than its receiver buffers per input channel); a channel then sends messages
        of a quarter of that (1 to 4 MiB) unless :meth:`set_output_buffer_size` says
        otherwise."""
        if channel_bytes is not None and (
            isinstance(channel_bytes, bool) or not isinstance(channel_bytes, int)
        ):
            raise ValueError(
                f"set_buffer_limits: channel_bytes must be an int or None, got {channel_bytes!r}"
            )
        too_small = channel_bytes is not None and channel_bytes < 1
        if channel_capacity < 1 or send_window < 1 or too_small:
            raise ValueError("set_buffer_limits: every limit must be >= 1")
        self._channel_capacity = channel_capacity
        self._send_window = send_window
        self._channel_bytes = channel_bytes
        return self

    def set_buffer_timeout(self, timeout_ms: int) -> StreamExecutionEnvironment:
        """The longest time data waits in output channels before it is sent (Flink's
        ``execution.buffer-timeout``, 100 ms by default). Batches written within the
        timeout go together as one message, at the latest once they reach the output
        buffer size; a barrier or the end of input sends them first. 0 sends every batch
        at once (lowest latency, one call per batch) while the receiver has room for it;
        what is written while it has none goes as one message as soon as it has (up to
        the output buffer size), so a saturated channel sends fewer, bigger messages.

        Unlike Flink, where the timeout holds at every network hop, it is counted from
        when the source read the data, over the data's whole path: a channel sends at
        the latest ``timeout_ms`` after the origin of the oldest data it holds (and never
        holds it longer than ``timeout_ms`` itself), so n unchained hops do not add up
        to n timeouts."""
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 0:
            raise ValueError(
                "set_buffer_timeout: timeout_ms must be an int >= 0 (0 sends every batch at "
                f"once), got {timeout_ms!r}"
            )
        self._buffer_timeout_ms = timeout_ms
        return self

    def get_buffer_timeout(self) -> int:
        """Milliseconds written data may wait in an output channel (0: sent at once)."""
        return self._buffer_timeout_ms

    def set_data_transport(self, transport: DataTransport | str) -> StreamExecutionEnvironment:
        """How subtasks send batches and events to each other (Flink's network stack).

        ``DataTransport.SOCKET`` (the default): each subtask serves its input channels on
        a TCP port of its node, and a sender keeps one connection per receiving subtask
        (opened through a Ray call to the receiver, which hands out a token of its
        current attempt; see :mod:`rayflow.runtime.data_plane`). ``DataTransport.RAY``:
        every message is a Ray actor call, about a millisecond or two of CPU on each
        side; for clusters whose nodes may not open connections to each other's
        ephemeral ports (Ray's own calls use its configured worker ports). Ordering,
        credit, barriers and exactly-once are the same on both."""
        try:
            self._data_transport = DataTransport(
                transport.value if isinstance(transport, DataTransport) else transport
            )
        except ValueError:
            raise ValueError(
                "set_data_transport: transport must be one of "
                f"{[t.value for t in DataTransport]}, got {transport!r}"
            ) from None
        return self

    def get_data_transport(self) -> DataTransport:
        """How subtasks send batches and events to each other."""
        return self._data_transport

    def set_output_buffer_size(self, size_bytes: int) -> StreamExecutionEnvironment:
        """An output channel sends what it holds once its batches reach ``size_bytes``
        (by default a quarter of the channel's bytes, 1 to 4 MiB: see
        :meth:`set_buffer_limits`); the buffer timeout bounds how long they wait for
        that."""
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 1:
            raise ValueError(
                f"set_output_buffer_size: size_bytes must be an int >= 1, got {size_bytes!r}"
            )
        self._buffer_bytes = size_bytes
        return self

    def get_output_buffer_size(self) -> int | None:
        """The size set by :meth:`set_output_buffer_size`; None: sized per channel."""
        return self._buffer_bytes

    def set_latency_tracking_interval(self, interval_ms: int) -> StreamExecutionEnvironment:
        """Sources send a latency marker every ``interval_ms`` (0 turns tracking off); the
        job's sink end reports how long markers took in ``JobResult.latency``."""
        if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) or interval_ms < 0:
            raise ValueError(
                "set_latency_tracking_interval: interval_ms must be an int >= 0 "
                f"(0 turns latency tracking off), got {interval_ms!r}"
            )
        self._latency_tracking_interval_ms = interval_ms
        return self

    def get_latency_tracking_interval(self) -> int:
        """Milliseconds between two latency markers of a source (0: tracking is off)."""
        return self._latency_tracking_interval_ms

    def enable_buffer_debloating(self, target_ms: int = 1000) -> StreamExecutionEnvironment:
        """Adapt the in-flight data of every input channel to the receiving subtask's
        throughput (Flink's buffer debloating): each subtask measures how fast it takes
        its input and bounds every channel's buffer, and its senders' windows, to what it
        drains in ``target_ms``, between 1 and the limits of ``set_buffer_limits``. Aligned
        checkpoint barriers then wait behind less data under backpressure.
        Off by default."""
        if isinstance(target_ms, bool) or not isinstance(target_ms, int):
            raise TypeError(
                f"enable_buffer_debloating: target_ms must be an int (ms), got {target_ms!r}"
            )
        if target_ms < MIN_TARGET_MS:
            raise ValueError(
                f"enable_buffer_debloating: target_ms must be >= {MIN_TARGET_MS}, got {target_ms}"
            )
        self._debloat_target_ms = target_ms
        return self

    def disable_buffer_debloating(self) -> StreamExecutionEnvironment:
        """Every channel keeps the full limits of ``set_buffer_limits`` (the default)."""
        self._debloat_target_ms = None
        return self

    def get_buffer_debloat_target_ms(self) -> int | None:
        """Buffer debloating's target in ms, None when it is off."""
        return self._debloat_target_ms

    def set_subtask_options(self, **options: Any) -> StreamExecutionEnvironment:
        """Ray actor options for every subtask (``runtime_env``, ...). Resource options
        (``num_cpus``, ``num_gpus``, ``memory``, ``resources``) are every subtask's request
        where its operators' ``set_resources`` leave a field unset; a
        ``scheduling_strategy`` or ``placement_group`` of its own turns the job's
        placement group off (see ``set_placement``). Options that decide a subtask's
        life and name (``max_restarts``, ``max_task_retries``, ``lifetime``, ``name``,
        ``namespace``, ``get_if_exists``, and its concurrency: ``max_concurrency``,
        ``concurrency_groups``) are rayflow's own and raise ``ValueError``: a
        subtask is never restarted by Ray (its job master deploys the next attempt) and
        lives no longer than its job."""
        for option in _OWN_SUBTASK_OPTIONS:
            if option in options:
                raise ValueError(
                    f"set_subtask_options: {option!r} is rayflow's own: a subtask is never "
                    "restarted or kept by Ray (its job master deploys the next attempt, "
                    "and every process of a run is looked for before its job name is "
                    "taken again); use the restart strategy instead"
                )
        ResourceSpec.of(
            "set_subtask_options",
            **{
                k: options[k]
                for k in ("num_cpus", "num_gpus", "memory", "resources")
                if k in options
            },
        )
        self._subtask_options = options
        return self

    def set_placement(
        self,
        strategy: PlacementStrategy | str = PlacementStrategy.SPREAD,
        ready_timeout_s: float = 60.0,
    ) -> StreamExecutionEnvironment:
        """How the job's subtasks are placed on the cluster's nodes: one Ray placement
        group per job, a bundle per subtask (or per slot sharing group and index), with
        Ray's ``strategy``: SPREAD (the default: over as many nodes as have room), PACK,
        STRICT_SPREAD, STRICT_PACK, or NONE (no placement group: Ray places each subtask
        on its own). An attempt waits at most ``ready_timeout_s`` for every bundle to be
        placed (after a node is lost, Ray moves its bundles once it declared the node
        dead), then fails with what is missing."""
        self._placement = PlacementConfig.of(strategy, ready_timeout_s)
        return self

    def get_placement(self) -> PlacementConfig:
        return self._placement

    def set_warm_workers(
        self, max_workers: int = 16, keep_alive_s: float = 120.0
    ) -> StreamExecutionEnvironment:
        """After each job, keep never-used Ray worker processes idle on this driver's node,
        as many as the job had actors (at most ``max_workers``), for ``keep_alive_s``: the
        next job's actors then start without starting processes. Each idle worker holds
        about 100 MB. On a Ray that this driver started or joined (not one rayflow
        started), as many again are kept with rayflow's setup hook in their runtime
        environment (each about 55 MB more: rayflow's runtime imported while idle), and
        then the plain ones go after 10 s (see :mod:`rayflow.runtime.hook_env`).
        ``max_workers=0`` turns it off. On by default (16, 120 s)."""
        self._warm_workers = WarmWorkerConfig(max_workers, keep_alive_s)
        return self

    # --- sources -------------------------------------------------------------------------

    def from_source(
        self,
        source: Source,
        watermark_strategy: WatermarkStrategy | str | None = None,
        source_name: str = "Source",
    ) -> DataStream:
        """A stream read from ``source`` (PyFlink's ``from_source(source,
        watermark_strategy, source_name)``). With a ``WatermarkStrategy`` every record
        gets an event timestamp and each split generates watermarks; the strategy may be
        left out (``from_source(source, "name")``)."""
        if not isinstance(source, Source):
            raise TypeError(f"from_source: expected a rayflow Source, got {type(source).__name__}")
        if isinstance(watermark_strategy, str):
            watermark_strategy, source_name = None, watermark_strategy
        if watermark_strategy is not None and not isinstance(watermark_strategy, WatermarkStrategy):
            raise TypeError(
                "from_source: watermark_strategy must be a WatermarkStrategy, got "
                f"{type(watermark_strategy).__name__}"
            )
        return DataStream(
            self,
            self._plan.add(
                name=source_name,
                kind="source",
                source=source,
                watermark_strategy=watermark_strategy,
            ),
        )

    def from_collection(self, collection: Any, source_name: str = "Collection") -> DataStream:
        """Records from a list: dicts (column -> value), tuples (columns ``f0, f1, ...``)
        or scalars (one column ``value``), all of one kind; or an Arrow table."""
        return self.from_source(CollectionSource(collection), source_name)

    # --- running -------------------------------------------------------------------------

    def get_job_graph(self) -> JobGraph:
        """The physical plan; raises if a sink is asked for more than the job can give."""
        config = self._checkpoint_config
        if config.unaligned_checkpoints and config.mode is not CheckpointingMode.EXACTLY_ONCE:
            raise ValueError(
                "unaligned checkpoints (enable_unaligned_checkpoints / "
                "set_aligned_checkpoint_timeout) need CheckpointingMode.EXACTLY_ONCE; "
                f"the checkpointing mode is {config.mode.name}, which never aligns barriers"
            )
        graph = build_job_graph(
            self._plan, self._parallelism, self._max_parallelism, self._chaining
        )
        check_aggregations(graph)
        facts = self._checkpointing_facts()
        for spec in graph.sink_specs():
            # The resolution is the graph's: the user's sink object is never changed.
            spec.guarantee = spec.sink.resolve_guarantee(spec.name, facts)
            spec.factory = sink_operator_factory(spec.sink, spec.guarantee.delivery_guarantee)
        return graph

    def _checkpointing_facts(self) -> CheckpointingFacts:
        config = self._checkpoint_config
        enabled = config.is_checkpointing_enabled()
        return CheckpointingFacts(
            enabled=enabled,
            mode=config.mode.value if enabled else None,
            alignment=config.alignment.value,
            longest_transaction_s=(config.interval_ms + config.timeout_ms) / 1000.0
            if enabled
            else None,
        )

    def guarantees(self) -> dict[str, str]:
        """Each sink's end-to-end guarantee, in words."""
        return _guarantee_words(self.get_job_graph())

    def explain(self) -> str:
        """The physical plan (chained vertices, parallelism, partitioners), checkpointing
        and each sink's end-to-end guarantee."""
        text = self.get_job_graph().explain()
        config = self._checkpoint_config
        if config.is_checkpointing_enabled():
            text += (
                f"\ncheckpointing: {config.mode.name} every {config.interval_ms} ms "
                f"to {config.checkpoint_storage}"
            )
            if config.mode is CheckpointingMode.EXACTLY_ONCE:
                text += f", {config.alignment.value}"
                if config.aligned_checkpoint_timeout_ms:
                    text += f" ({config.aligned_checkpoint_timeout_ms} ms)"
        else:
            text += "\ncheckpointing: off"
        if self._debloat_target_ms is not None:
            text += f"\nbuffer debloating: target {self._debloat_target_ms} ms"
        for name, words in self.guarantees().items():
            text += f"\nsink {name!r}: {words}"
        return text

    def execute_async(
        self,
        job_name: str = "rayflow job",
        restore_from: str | None = None,
        allow_non_restored_state: bool = False,
    ) -> JobClient:
        """Start the job and return at once.

        Every execution is a *run* with its own id; its checkpoints go to
        ``<storage>/<job name>/<run id>/``, and a restart (of a subtask or of the job
        master) only ever restores this run's checkpoints or the point the run started
        from. ``restore_from`` starts from a retained checkpoint of an earlier run: a
        ``chk-<n>`` directory, a run directory (its newest checkpoint), a job's
        directory or ``"latest"`` (the newest completed checkpoint of ``job_name``
        across all its runs in the configured storage), or a savepoint's directory
        (``JobClient.trigger_savepoint`` / ``stop_with_savepoint``, wherever it was moved).
        The parallelism may differ from the run that took it, and so may the job's code:
        state is matched by operator uid (``.uid(...)``; operators without one get a
        warning), new operators start empty, and state that no operator takes fails the
        start unless ``allow_non_restored_state`` drops it.
        """
        return self._start(
            job_name, restore_from, allow_non_restored_state, detached.is_requested()
        )

    def _start(
        self,
        job_name: str,
        restore_from: str | None,
        allow_non_restored_state: bool,
        detach: bool,
    ) -> JobClient:
        """Start the job here, or (``detach``) submit it detached: raises
        :class:`~rayflow.detached.JobDetached` once it is."""
        graph = self.get_job_graph()
        if not graph.vertices:
            raise ValueError("execute: the job has no operators; add a source and a sink")
        check_picklable(graph)  # here, not as Ray's error once the job deploys
        PlacementPlan.of(graph, self._subtask_options, self._placement)  # checks the requests
        config = self._checkpoint_config
        settings = JobSettings(
            job_name=job_name,
            job_id=uuid.uuid4().hex[:12],
            run_id=new_run_id(),
            channel_capacity=self._channel_capacity,
            send_window=self._send_window,
            latency_tracking_interval_ms=self._latency_tracking_interval_ms,
            buffer_timeout_ms=self._buffer_timeout_ms,
            data_transport=self._data_transport,
            buffer_bytes=self._buffer_bytes,
            object_reuse=self._execution_config.object_reuse,
            channel_bytes=self._channel_bytes,
            debloat_target_ms=self._debloat_target_ms,
            subtask_options=dict(self._subtask_options),
            placement=self._placement,
            checkpoint_config=config,
            restart_strategy=self._restart_strategy,
            hooks=self._fault_plan,
            failure_classifier=self._failure_classifier,
        )
        if self._preflight_checks:
            preflight.check_job(job_name, graph, config)  # before Ray starts
        ensure_ray()
        if detach:
            job = detached.submit(
                graph,
                settings,
                restore_from,
                _guarantee_words(graph),
                self._plan,
                allow_non_restored_state,
            )
            self._fault_plan = None  # a fault plan targets one run (rayflow.testing)
            raise detached.JobDetached(job)
        warm_workers.job_starting()
        warm = self._warm_workers if not settings.subtask_options.get("runtime_env") else None
        client = start_run(
            graph, settings, restore_from, warm, self._plan, allow_non_restored_state
        )
        self._fault_plan = None  # a fault plan targets one run (rayflow.testing)
        return client

    def execute_detached(
        self,
        job_name: str = "rayflow job",
        restore_from: str | None = None,
        allow_non_restored_state: bool = False,
    ) -> detached.DetachedJob:
        """Start the job as a detached job and return a handle on it at once: it runs on
        the Ray cluster of ``RAY_ADDRESS`` after this process exits (see
        :mod:`rayflow.detached`; ``rayflow jobs`` lists, inspects and cancels it)."""
        try:
            # not through detached.requested(): that is the whole process's, and another
            # thread may be starting a job of its own meanwhile
            self._start(job_name, restore_from, allow_non_restored_state, detach=True)
        except detached.JobDetached as submitted:
            return submitted.job
        raise AssertionError("_start returned without submitting the detached job")

    def execute(
        self,
        job_name: str = "rayflow job",
        restore_from: str | None = None,
        allow_non_restored_state: bool = False,
    ) -> JobResult:
        """Run the job to the end and return its result (see ``execute_async``)."""
        return self.execute_async(job_name, restore_from, allow_non_restored_state).wait()

    def execute_and_collect(
        self, job_name: str = "rayflow job", limit: int | None = None
    ) -> CollectedRecords:
        """Run the job on Ray and return the records of its stream that ends without a
        sink (PyFlink's name; for tests and notebooks). The job must be bounded; records
        of parallel subtasks come in no particular order across subtasks; ``limit`` keeps
        the first ``limit``. ``stream.execute_and_collect()`` picks the stream itself."""
        ends = self._plan.open_ends()
        if len(ends) != 1:
            names = ", ".join(repr(t.name) for t in ends)
            raise ValueError(
                "execute_and_collect: collects the one stream that ends without a sink; "
                + (
                    f"{len(ends)} do ({names}): call execute_and_collect() on one of them"
                    if ends
                    else "every stream ends in a sink (leave the one to collect without)"
                )
            )
        stream = DataStream(self, ends[0])
        return self._execute_and_collect(stream, job_name, limit)

    def _execute_and_collect(
        self, stream: DataStream, job_name: str, limit: int | None
    ) -> CollectedRecords:
        from sinks.basic import CollectSink

        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"execute_and_collect: limit must be an int or None, got {limit!r}")
        sink = CollectSink()
        end = stream.sink_to(sink, name="execute_and_collect")
        try:
            result = self.execute(job_name)
        finally:
            self._plan.remove(end._transformation.id)
        records = result.sink_result(sink).to_pylist()
        return CollectedRecords(records if limit is None else records[:limit])
