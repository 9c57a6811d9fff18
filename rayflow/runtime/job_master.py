"""The job master: a thin actor that runs one job's attempts under its restart supervisor.

One job master actor runs per job run (a new one replaces it if it dies; see
:mod:`rayflow.runtime.supervisor`). An *attempt* deploys every subtask (receivers
first, so each sender is built with its receivers' handles), restores state and
source positions from the restore point, and starts every ``run()``. The first
failure of any ``run()``, a failed call, an error while setting the attempt up, or
too many failed checkpoints ends the attempt; the supervisor decides whether the
next one starts (after its delay) or the job fails with the cause.

**Restore point.** The newest checkpoint completed in this run, else the point the
run itself started from (``restore_from``), else nothing: never another run's
checkpoint, even after the job master died and a new one took over.

**Fencing.** Attempt numbers only grow within a run, also across job masters. Every
message to and from a subtask carries its attempt and is dropped by the other side
when the attempt is not current. Subtask actors that survive a failed attempt are
reused for the next one only when no thread of the old attempt still runs in them;
otherwise they are killed, and the next attempt starts only once their processes have
exited (:mod:`rayflow.runtime.actor_exit`: Ray reports a killed actor dead a few
milliseconds before its threads stop).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from rayflow.checkpoint.coordinator import (
    CheckpointCoordinator,
    CheckpointHistory,
    CheckpointIdCounter,
    CompletedCheckpoint,
)
from rayflow.checkpoint.failures import CheckpointFailureManager
from rayflow.checkpoint.state_format import UnsupportedStateFormatError
from rayflow.errors import JobCancelledError, JobFailedError, OperatorError
from rayflow.failures import Failure, first_line, worth_logging
from rayflow.plan.physical import JobGraph
from rayflow.recoverability import classify
from rayflow.runtime.actor_exit import (
    ActorProcess,
    ActorsStillAlive,
    kill_and_wait,
    process_of,
)
from rayflow.runtime.deployer import Deployer
from rayflow.runtime.hooks import HookPoint
from rayflow.runtime.job_processes import forget_processes, record_this_process
from rayflow.runtime.output import OutputAck, OutputChunk, OutputCollector
from rayflow.runtime.placement import JobPlacement, PlacementPlan
from rayflow.runtime.ray_metrics import JobMetrics
from rayflow.runtime.run_holds import hold_sinks, release_holds
from rayflow.runtime.run_lock import release_run_lock_of
from rayflow.runtime.settings import JobSettings
from rayflow.runtime.subtask import SubtaskDeployment
from rayflow.runtime.subtask_actor import RemoteSubtaskActor
from rayflow.runtime.supervisor import RestartSupervisor, SupervisorState
from rayflow.sink import TwoPhaseCommittingSink
from rayflow.status import FailureKind, JobState

log = logging.getLogger("rayflow.job")

#: How long a deployed actor may take to say where it runs.
LEARN_TIMEOUT_S = 120.0
#: Why a job fails without another attempt while killed subtask processes still run.
SURVIVORS = (
    "killed subtask actors of this run still run (their processes were not seen to exit), "
    "and no attempt or clean-up starts beside them"
)


def subtask_max_concurrency(channels: int, send_window: int) -> int:
    """Concurrency slots of a subtask actor's data group: every input channel may have a
    full send window of pushes waiting for buffer space (while aligned checkpoints block
    it) and the barrier push on the last channel must still get in."""
    return max(1000, channels * (send_window + 2) + 64)


def subtask_actor_name(job_id: str, vertex_id: int, index: int, incarnation: str) -> str:
    """Subtask actors are named, so tools (and tests) can find every actor of a job."""
    return f"rayflow:{job_id}:v{vertex_id}:s{index}:{incarnation}"


def placement_group_name(job_id: str, generation: int) -> str:
    """The placement group of one job master (named, so tools can find a job's groups)."""
    return f"rayflow:{job_id}:pg:{generation}"


def job_placement(graph: JobGraph, settings: JobSettings, generation: int) -> JobPlacement:
    """The placement of one job master's run of ``graph`` (created by ``create()``)."""
    return JobPlacement(
        PlacementPlan.of(graph, settings.subtask_options, settings.placement),
        settings.placement,
        placement_group_name(settings.job_id, generation),
        settings.job_name,
    )


def _unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if cause is not None:
            return cause
    return exc


def futile_clean_up(results: list[Any]) -> str | None:
    """Why trying a sink clean-up again would fail the same way, given what each failed
    clean-up call gave (None: it may succeed, so try again). Only when every failure was
    raised by the clean-up itself reading a blob of a state format version this rayflow
    does not read (:class:`UnsupportedStateFormatError`: its header is the same on every
    try). A lost or slow actor, a wrong attempt (False), a blob that failed to unpickle
    (the cause may be the process, or a service a state class reached), and any other
    error may go the next time, in a fresh process, and are tried again whatever the
    job's failure classifier says."""
    causes = [_unwrap(r) for r in results if isinstance(r, RayTaskError)]
    if not causes or len(causes) < len(results):
        return None  # nothing failed, or something failed other than inside the clean-up
    if not all(isinstance(c, UnsupportedStateFormatError) for c in causes):
        return None
    return f"{type(causes[0]).__name__}: {first_line(str(causes[0]))}"


class _AttemptFailed(Exception):
    """One attempt failed; ``secondary`` when it only reports a failure elsewhere (a
    subtask that lost the downstream subtask it was sending to). ``failure`` describes it
    for the failure history."""

    def __init__(
        self, message: str, secondary: bool = False, failure: Failure | None = None
    ) -> None:
        super().__init__(message)
        self.secondary = secondary
        self.failure = failure


def _operator_failure(error: OperatorError) -> Failure:
    exception, _, message = error.cause.partition(": ")
    return Failure(
        FailureKind.ATTEMPT,
        exception,
        first_line(message),
        error.operator,
        error.subtask,
        error.parallelism,
        error.non_recoverable,
    )


def failure_log(
    job_name: str, attempt: int, cause: str, delay: float | None, state: SupervisorState
) -> tuple[int, str]:
    """The log level and line of a failure the supervisor just recorded: the first time a
    failure happens in full (its traceback), the same failure again at WARNING only at its
    2nd, 4th, 8th, ... time (and when the job gives up), in one line with its count."""
    entry = state.history.latest
    if delay is not None:
        then = f"; restarting in {delay:g} s ({state.strategy.description})"
    elif state.non_recoverable is not None:
        then = f"; not restarting: no restart can fix it ({state.non_recoverable})"
    elif state.state is JobState.FAILING:
        then = f"; no restart left ({state.strategy.description})"
    else:
        then = ""
    if entry is None or entry.count == 1:
        return logging.WARNING, f"job {job_name!r} attempt {attempt} failed: {cause}{then}"
    again = (
        f"job {job_name!r} attempt {attempt} failed again the same way ({entry.count} times "
        f"so far): {entry.failure.describe()}{then}"
    )
    if worth_logging(entry.count) or delay is None:
        return logging.WARNING, again
    return logging.DEBUG, again


def _rss_bytes() -> int | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 - not available here
        return None


class JobMaster:
    def __init__(self, graph: JobGraph, settings: JobSettings) -> None:
        # before anything of it can write: whoever looks for the job's processes once
        # nobody can ask (a next run of its name) finds this one
        record_this_process()
        self.graph = graph
        self.settings = settings
        state = settings.supervisor
        self.supervisor = RestartSupervisor(state) if state else settings.new_supervisor()
        self.generation = self.supervisor.start_master()
        self.actors: dict[tuple[int, int], Any] = {}
        self.attempt = -1
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.ray_metrics = JobMetrics(settings.job_name)
        self.history = CheckpointHistory(
            settings.checkpoint_config.checkpoint_history_size, self.ray_metrics.checkpoint
        )
        self.checkpoint_failures = CheckpointFailureManager(
            settings.checkpoint_config.tolerable_failed_checkpoints
        )
        self.coordinator: CheckpointCoordinator | None = None
        self.storage = settings.storage() if settings.checkpointing else None
        self.deployer = Deployer(graph, settings, self.storage)
        self.placement = job_placement(graph, settings, self.generation)
        self.latest: CompletedCheckpoint | None = None
        self.ids: CheckpointIdCounter | None = None
        self.restored_from: int | None = None
        #: a stop-with-savepoint completed (its checkpoint id): an attempt after it reads
        #: no input, takes a final checkpoint and finishes
        self._stopped_at: int | None = self.supervisor.state.stopped_at
        #: the directory of that stop's savepoint, which a job master lost after the stop
        #: was recorded may not have written: this one writes it before anything else
        self._stop_savepoint: str | None = (
            getattr(self.supervisor.state, "stop_savepoint", None)
            if self._stopped_at is not None
            else None
        )
        self._looked_up_storage = False
        #: savepoint requests by their caller's id: the coordinator that took each, and the
        #: ids withdrawn (the newest, bounded)
        self._asked: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._withdrawn: collections.deque[str] = collections.deque(maxlen=100)
        self._cancelled = asyncio.Event()
        if settings.cancel_requested:
            self._cancelled.set()
        self._attempt_failure: asyncio.Future | None = None
        self._exhausted: set[tuple[int, int]] = set()
        self._source_keys = frozenset(
            (v.vertex_id, i)
            for v in graph.vertices.values()
            if v.is_source
            for i in range(v.parallelism)
        )
        self._recovery_started: float | None = None
        self._run_refs: dict[tuple[int, int], Any] = {}
        self._spare: dict[tuple[int, int], Any] = {}
        self._incarnations = 0
        self.recovery_times: list[float] = []
        self.clean_up_failure: str | None = None
        #: killed subtask actors not seen to exit: nothing starts beside them (no attempt,
        #: no clean-up from a checkpoint) until they are
        self._survivors: list[Any] = []
        #: where each subtask actor runs, by id() of its handle, learnt once it is deployed
        #: (an actor busy when it is killed may not say in time)
        #: (the handle is kept with it: its id() stays unique while the entry lives)
        self._processes: dict[int, tuple[Any, ActorProcess]] = {}
        self._ended = asyncio.Event()  # run() returned or raised: see _result / _error
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._running: set[tuple[int, int]] = set()  # subtasks of this attempt that run
        #: what the subtasks printed, read from them, until the client acknowledges it
        self._output = OutputCollector()
        #: the marks the run's sinks hold in their targets while it lives (None: not taken)
        self._holds: list[Any] | None = None

    # --- queries ------------------------------------------------------------------------

    async def ready(self) -> bool:
        return True

    async def status(self) -> dict[str, Any]:
        s = self.supervisor.state
        state = s.state
        if not self._ended.is_set():
            # FINISHED, FAILED or CANCELED is shown once the run is cleaned up (its
            # bundles and holds returned, its job name free): a user who sees it may
            # start the job again at once
            state = state.while_ending
        return {
            "state": state,
            "attempt": s.attempt,
            "restarts": s.restarts,
            "master_restarts": s.master_restarts,
            "failure": s.cause,
            "failures": [f.cause for f in s.failures],
            "failure_count": s.failure_count,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "completed_checkpoints": list(self.history.completed_ids),
            "checkpoint_summary": self.history.summary(),
            "rss_bytes": _rss_bytes(),
            "failure_history": list(s.history.entries),
            "non_recoverable": s.non_recoverable,
        }

    async def progress(self) -> dict[str, Any]:
        """What a live progress line shows: the status, every subtask's metrics and the
        newest completed checkpoint's statistics (one call)."""
        status = await self.status()
        status["metrics"] = await self.metrics()
        completed = [c for c in self.history.recent if c["status"] == "COMPLETED"]
        status["last_checkpoint"] = dict(completed[-1]) if completed else None
        if status["last_checkpoint"] is not None:
            status["last_checkpoint"].pop("subtasks", None)
        return status

    async def drain_output(self, ack: OutputAck | None = None) -> OutputChunk:
        """What user functions printed and the client has not acknowledged yet (read
        from the subtasks first)."""
        await self._read_output_of(self.actors.items())
        return self._output.log.read(ack)

    async def _read_output_of(self, actors: Any, timeout_s: float = 2.0) -> None:
        """Read what the given ``(key, actor)`` subtasks printed into this job master's
        log (see ``OutputCollector``; best effort for a subtask that dies first)."""
        await self._output.read(actors, timeout_s)

    async def _read_then_kill(self, actors: dict[tuple[int, int], Any]) -> None:
        """Kill live subtasks of this job master's own will, after a last read of what
        they printed (1 s at most)."""
        try:
            await self._output.last_read(actors.items(), timeout_s=1.0)
        finally:
            seen_exit = False  # every killed actor but the survivors: process seen to exit
            known = self._known()  # the processes the kill waits for (others it asks)
            try:
                await kill_and_wait(actors.values(), known=known)
                seen_exit = True
            except ActorsStillAlive as exc:
                self._survivors.extend(exc.actors)
                seen_exit = True
                raise
            finally:
                exited = []
                for actor in actors.values():
                    if not any(actor is s for s in self._survivors):  # still needed for them
                        self._processes.pop(id(actor), None)
                        if seen_exit and id(actor) in known:
                            exited.append(known[id(actor)])
                if exited:  # nobody needs to look for these again
                    await asyncio.to_thread(forget_processes, self.settings.job_id, exited)

    def _known(self) -> dict[int, ActorProcess]:
        return {key: process for key, (_, process) in self._processes.items()}

    async def _learn_processes(self, actors: list[Any]) -> None:
        """Ask newly deployed actors where they run (in the background; an actor answers
        once it has started, which can take a while on a loaded node)."""
        new = [a for a in actors if id(a) not in self._processes]
        found = await asyncio.gather(*(process_of(a, timeout_s=LEARN_TIMEOUT_S) for a in new))
        live = [*self.actors.values(), *self._spare.values()]
        for actor, process in zip(new, found):
            # not for an actor killed meanwhile (its entry would outlive it)
            if process is not None and any(actor is a for a in live):
                self._processes[id(actor)] = (actor, process)

    async def _survivors_gone(self) -> bool:
        """Kill the survivors of earlier kills again and wait; whether all are gone now."""
        survivors = list(self._survivors)
        if not survivors:
            return True
        known = self._known()  # the processes the kill waits for (others it asks)
        try:
            await kill_and_wait(survivors, known=known)
        except Exception as exc:  # noqa: BLE001 - ActorsStillAlive, or Ray did not answer
            log.error("job %r: %s", self.settings.job_name, exc)
            if isinstance(exc, ActorsStillAlive):
                self._survivors = exc.actors
            return False
        self._survivors = []
        for actor in survivors:
            self._processes.pop(id(actor), None)
        exited = [known[id(actor)] for actor in survivors if id(actor) in known]
        if exited:  # seen to exit: nobody needs to look for these again
            await asyncio.to_thread(forget_processes, self.settings.job_id, exited)
        return True

    def _keep_final_output(self, results: dict[tuple[int, int], Any]) -> None:
        """Move what each finished subtask's ``run()`` returned it printed into this job
        master's log (lines read from it before are not taken again)."""
        for key, value in sorted(results.items()):
            chunk = value.pop("output", None) if isinstance(value, dict) else None
            if isinstance(chunk, OutputChunk):
                self._output.keep(key, chunk)

    async def supervisor_state(self) -> SupervisorState:
        return self.supervisor.snapshot()

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
        """Statistics of the most recent checkpoints (at most the configured history size)."""
        return list(self.history.recent)

    async def cancel(self) -> None:
        self._cancelled.set()

    async def trigger_savepoint(
        self, target: str, stop: bool = False, request_id: str | None = None
    ) -> str:
        """Take a savepoint under ``target`` (with ``stop``: and stop the job at it, Flink's
        stop-with-savepoint); returns the savepoint's directory. Raises
        :class:`~rayflow.checkpoint.savepoint.SavepointError` when it fails (the job then
        goes on, unless it was stopping and the savepoint's checkpoint had completed)."""
        from rayflow.checkpoint.savepoint import SavepointError

        if not self.settings.checkpointing:
            raise SavepointError(
                f"job {self.settings.job_name!r} has no checkpointing: a savepoint is a "
                "checkpoint (env.enable_checkpointing(...))"
            )
        while self.coordinator is None:  # deploying, or between attempts
            if self._ended.is_set() or self._cancelled.is_set():
                raise SavepointError(f"job {self.settings.job_name!r} is not running")
            if request_id is not None and request_id in self._withdrawn:
                raise SavepointError(f"job {self.settings.job_name!r}: savepoint withdrawn")
            await asyncio.sleep(0.05)
        coordinator = self.coordinator
        if request_id is not None:
            self._asked[request_id] = coordinator
            while len(self._asked) > 100:  # the newest requests: any caller's is there
                self._asked.popitem(last=False)
        return await coordinator.trigger_savepoint(target, stop, request_id)

    async def withdraw_savepoint(self, request_id: str) -> str | None:
        """The caller of ``trigger_savepoint(..., request_id)`` stopped waiting: the
        savepoint is not taken (a stop does not happen) unless it was taken already;
        returns its directory then, else None."""
        self._withdrawn.append(request_id)
        coordinator = self._asked.pop(request_id, None)
        if coordinator is None:
            return None
        return await coordinator.withdraw_savepoint(request_id)

    # --- calls from subtasks ------------------------------------------------------------

    async def acknowledge_checkpoint(
        self,
        attempt: int,
        cid: int,
        key: tuple[int, int],
        info: dict[str, Any],
        blob: bytes | None = None,
    ) -> None:
        """``blob``: the snapshot, when it is small enough to come with the call."""
        if attempt == self.attempt and self.coordinator is not None:
            await self.coordinator.acknowledge(cid, key, info, blob)

    async def decline_checkpoint(
        self,
        attempt: int,
        cid: int,
        key: tuple[int, int],
        reason: str,
        non_recoverable: str | None = None,
    ) -> None:
        if attempt == self.attempt and self.coordinator is not None:
            await self.coordinator.decline(cid, key, reason, non_recoverable)

    async def subtask_running(self, attempt: int, key: tuple[int, int]) -> None:
        if attempt != self.attempt:
            return
        if self.coordinator is not None:
            self.coordinator.subtask_running(key)
        if key not in self.actors:
            # a late report of an attempt that ended (its actors are gone or kept for the
            # next one): that attempt does not run, whatever it says
            return
        self._running.add(key)
        if self._running >= self.actors.keys():
            self.supervisor.attempt_running()  # a restarting job runs again

    async def source_exhausted(self, attempt: int, key: tuple[int, int]) -> None:
        if attempt != self.attempt:
            return
        if key in self._source_keys:
            self._exhausted.add(key)
        # counted, not compared as sets: called once by each source subtask
        if len(self._exhausted) == len(self._source_keys) and self.coordinator is not None:
            self.coordinator.request_final()

    # --- the job ------------------------------------------------------------------------

    async def outcome(self) -> dict[str, Any]:
        """What ``run()`` returns (or raises), for a client whose call to ``run()`` was
        lost on the way (the job master was unreachable for a moment)."""
        await self._ended.wait()
        if self._error is not None:
            raise self._error
        return self._result

    async def run(self) -> dict[str, Any]:
        try:
            self._result = await self._run()
            return self._result
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ended.set()

    async def _release_job_name(self) -> None:
        await release_run_lock_of(self.settings.job_name, self.settings.run_id)

    async def _run(self) -> dict[str, Any]:
        self.started_at = time.time()
        try:
            self.placement.create()  # placed while the first attempt reads its storage
            outputs = await self._run_with_restarts()
        finally:
            # every attempt and clean-up of this job master is over: its bundles go back
            await self.placement.remove()
            holds, self._holds = self._holds or [], None
            if holds:
                await asyncio.to_thread(release_holds, holds)
            self.finished_at = time.time()
            if self.supervisor.job_state.is_terminal and not self._survivors:
                # the run is over and cleaned up: the job name is free again, whether or
                # not its client ever waits for the outcome. Not while processes of
                # killed actors may still run: its client releases it once they are gone
                await self._release_job_name()
        return {
            "outputs": outputs,
            # every line not acknowledged by the client yet (it takes each once)
            "output": self._output.log.read(),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "checkpoints": list(self.history.recent),
            "checkpoint_summary": self.history.summary(),
            "restarts": self.supervisor.state.restarts,
            "master_restarts": self.supervisor.state.master_restarts,
            "failures": [f.cause for f in self.supervisor.state.failures],
            "failure_history": list(self.supervisor.state.history.entries),
            "recovery_times": self.recovery_times,
            "restored_from": self.restored_from,
            "run_id": self.settings.run_id,
            "checkpoint_location": self.storage.location() if self.storage else None,
        }

    async def _persist(self) -> None:
        """Write the supervisor's state into the run's storage (what a job master started
        after this one dies continues from)."""
        if self.storage is not None:
            await asyncio.to_thread(self.storage.write_job_state, self.supervisor.snapshot())

    async def _run_with_restarts(self) -> dict[int, list[Any]]:
        supervisor, name = self.supervisor, self.settings.job_name
        while True:
            if self._cancelled.is_set():
                await self._finish_cancel()
            kind = FailureKind.RESTART_SETUP
            try:
                self.attempt = supervisor.start_attempt()
                self.ray_metrics.restarts(supervisor.state.restarts)
                await self._persist()
                await self._take_holds()  # before the run's first attempt touches anything
                kind = FailureKind.ATTEMPT
                outputs = await self._run_attempt(self.attempt)
                await self._stop_attempt()
                supervisor.attempt_running()
                supervisor.move_to(JobState.FINISHED)
                await self._persist_quietly()
                return outputs
            except JobCancelledError:
                await self._finish_cancel()
            except Exception as exc:  # noqa: BLE001 - every failure goes to the supervisor
                if isinstance(exc, _AttemptFailed):
                    cause = str(exc)
                    failure = exc.failure or Failure.of_text(kind, cause)
                else:
                    cause = f"{type(exc).__name__}: {exc}"
                    if kind is FailureKind.ATTEMPT:
                        kind = FailureKind.RESTART_SETUP
                    reason = classify(exc, self.settings.failure_classifier)
                    failure = Failure.of_exception(kind, exc, reason)
                failed_at = time.time()
                attempt = self.attempt
                try:
                    await self._stop_attempt(reuse=True)
                except Exception as stop_exc:  # noqa: BLE001
                    log.warning("job %r: stopping attempt %d: %s", name, self.attempt, stop_exc)
                    await self._kill_everything()
                if not await self._survivors_gone():
                    # no attempt starts beside a process of this one
                    failure = dataclasses.replace(failure, non_recoverable=SURVIVORS)
                delay = supervisor.on_failure(cause, kind, failed_at, failure)
                self._log_failure(attempt, cause, delay)
                if delay is None:
                    await self._persist_quietly()
                    await self._clean_up_outside_world()
                    supervisor.move_to(JobState.FAILED)
                    await self._persist_quietly()
                    note = f" ({self.clean_up_failure})" if self.clean_up_failure else ""
                    error = JobFailedError(supervisor.failure_message(name) + note)
                    error.failure_history = list(supervisor.state.history.entries)
                    error.non_recoverable = supervisor.state.non_recoverable
                    raise error from None
                await self._persist_quietly()
                self._recovery_started = failed_at
                await self._restart_delay(delay)

    async def _take_holds(self) -> None:
        """Take the marks the run's sinks hold in their targets while it lives (once per
        job master); raises when a sink refuses (another run of the job name lives)."""
        if self._holds is None:
            self._holds = await asyncio.to_thread(hold_sinks, self.graph, self.settings)

    def _log_failure(self, attempt: int, cause: str, delay: float | None) -> None:
        level, message = failure_log(
            self.settings.job_name, attempt, cause, delay, self.supervisor.state
        )
        log.log(level, "%s", message)

    async def _persist_quietly(self) -> None:
        try:
            await self._persist()
        except Exception as exc:  # noqa: BLE001 - the next persist retries
            log.warning("job %r: could not record its state: %s", self.settings.job_name, exc)

    async def _restart_delay(self, delay: float) -> None:
        hooks = self.settings.hooks.for_job_master(self.attempt) if self.settings.hooks else None
        if hooks is not None:
            named = {(self.graph.vertices[k[0]].name, k[1]): a for k, a in self._spare.items()}
            hooks.at(HookPoint.DURING_RESTART_DELAY, 0, named)
        try:
            await asyncio.wait_for(self._cancelled.wait(), timeout=delay)
        except asyncio.TimeoutError:
            pass

    async def _finish_cancel(self) -> None:
        """Cancel: stop the attempt, then clean up the outside world, and only then say
        CANCELED. The cancel is recorded first: a job master that takes over after this
        one died finishes the cancel instead of resuming the job."""
        self.supervisor.cancel()
        await self._persist_quietly()
        coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            await coordinator.shutdown()
            if coordinator.latest is not None:
                self.latest = coordinator.latest
        refs = list(self._run_refs.values())
        self._run_refs = {}
        for ref in refs:
            ray.cancel(ref)
        if refs:
            await asyncio.wait([asyncio.ensure_future(self._settle(r)) for r in refs], timeout=30)
        await self._read_output_of(self.actors.items(), timeout_s=1.0)
        await self._clean_up_outside_world()
        self.supervisor.move_to(JobState.CANCELED)
        await self._persist_quietly()
        note = f" ({self.clean_up_failure})" if self.clean_up_failure else ""
        raise JobCancelledError(f"job {self.settings.job_name!r} was cancelled{note}")

    async def _clean_up_outside_world(self) -> None:
        """The run is over (cancelled, or failed for good): commit what completed checkpoints
        hold, abort every other transaction, close every operator, and let every actor go.

        Live subtasks do it themselves. For sink subtasks that could not (dead, never
        started, of another attempt), fresh actors restore the latest completed checkpoint
        and recover from it (commit its committables, abort lingering transactions)."""
        actors = {**self._spare, **self.actors}
        self._spare, self.actors = {}, {}
        try:
            await self._take_holds()
        except Exception as exc:  # noqa: BLE001 - the sinks' own sessions check it too
            log.warning("job %r: a sink's run mark: %s", self.settings.job_name, exc)
        latest = None
        if self.settings.checkpointing:
            try:
                restore = await self._restore_point()
                latest = restore.checkpoint_id if restore is not None else None
            except Exception as exc:  # noqa: BLE001 - then nothing can be committed safely
                log.warning("job %r: no restore point to clean up: %s", self.settings.job_name, exc)
                await self._kill_everything_in(actors)
                self.clean_up_failure = (
                    f"no restore point to clean up from ({type(exc).__name__}: {exc}); "
                    "transactions stay until the next run of this job recovers them"
                )
                return
        keys = list(actors)
        outcomes = await asyncio.gather(
            *(
                asyncio.wait_for(actors[k].close_for_cancel.remote(self.attempt, latest), 300)
                for k in keys
            ),
            return_exceptions=True,
        )
        cleaned = {k for k, ok in zip(keys, outcomes) if ok is True}
        await self._kill_everything_in(actors)
        missing = [k for k in self._two_phase_sink_subtasks() if k not in cleaned]
        if missing and self.settings.checkpointing:
            tries, tried, reason = 2, 0, None
            while missing and reason is None and tried < tries:
                if not await self._survivors_gone():
                    # fresh actors would commit and abort beside a process (of an attempt,
                    # or of the try before) that may still write
                    reason = SURVIVORS
                    break
                # stops when done, or failed in a way no other try can fix
                missing, reason = await self._clean_up_from_checkpoint(missing, latest)
                tried += 1
            if missing:
                why = ""
                if reason is not None:
                    again = "; not tried again: it would fail the same way" if tried < tries else ""
                    why = f" ({reason}{again})"
                self.clean_up_failure = (
                    f"sink subtasks {missing} could not be cleaned up{why}; their "
                    "transactions stay until the next run of this job recovers them"
                )

    async def _kill_everything_in(self, actors: dict[tuple[int, int], Any]) -> None:
        try:
            await self._read_then_kill(actors)
        except ActorsStillAlive as exc:  # their messages are dropped by attempt number
            log.error("job %r: %s", self.settings.job_name, exc)

    def _two_phase_sink_subtasks(self) -> list[tuple[int, int]]:
        return [
            (vertex.vertex_id, index)
            for vertex in self.graph.vertices.values()
            if any(isinstance(s, TwoPhaseCommittingSink) for s in vertex.sinks)
            for index in range(vertex.parallelism)
        ]

    async def _clean_up_from_checkpoint(
        self, keys: list[tuple[int, int]], latest: int | None
    ) -> tuple[list[tuple[int, int]], str | None]:
        """Returns the subtasks whose clean-up failed, and why trying again would fail
        the same way (:func:`futile_clean_up`; None: it may not)."""
        reason: str | None = None
        attempt = self.supervisor.reserve_attempt()
        self.attempt = attempt
        await self._persist_quietly()
        restore = self.latest if latest is not None else None
        actors: dict[tuple[int, int], Any] = {}
        try:
            try:
                await self.placement.ensure()
                in_group = True
            except Exception as exc:  # noqa: BLE001 - clean up outside the group then
                log.warning(
                    "job %r: cleaning up outside its placement group: %s",
                    self.settings.job_name,
                    exc,
                )
                in_group = False
            for key in keys:
                vertex = self.graph.vertices[key[0]]
                deployment = self.deployer.deployment(
                    vertex, key[1], attempt, restore, outputs=[], master=self._me()
                )
                actors[key] = self._new_actor(key, deployment, in_group)
            results = await asyncio.gather(
                *(
                    asyncio.wait_for(a.clean_up.remote(attempt, latest), 300)
                    for a in actors.values()
                ),
                return_exceptions=True,
            )
            failed = [k for k, r in zip(actors, results) if r is not True]
            if failed:
                errors = [r for r in results if r is not True]
                log.warning(
                    "job %r: clean-up of sink subtasks %s failed: %s",
                    self.settings.job_name,
                    failed,
                    errors,
                )
                reason = futile_clean_up(errors)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            log.warning("job %r: clean-up failed: %s", self.settings.job_name, exc)
            failed = list(keys)
        finally:
            await self._kill_everything_in(actors)
        return failed, reason

    def _latest_completed_id(self) -> int | None:
        if self.coordinator is not None and self.coordinator.latest is not None:
            return self.coordinator.latest.checkpoint_id
        return self.latest.checkpoint_id if self.latest is not None else None

    async def _restore_point(self) -> CompletedCheckpoint | None:
        """This run's newest completed checkpoint, else the point the run started from."""
        if self.coordinator is not None and self.coordinator.latest is not None:
            self.latest = self.coordinator.latest
        if self.latest is None and not self._looked_up_storage and self.storage is not None:
            # A job master taking over a run: its predecessor's checkpoints, if any.
            meta = await asyncio.to_thread(self.storage.latest)
            if meta is not None:
                if meta.run_id not in (None, self.settings.run_id):
                    raise RuntimeError(
                        f"checkpoint {meta.checkpoint_id} in {self.storage.location()} belongs "
                        f"to run {meta.run_id}, not {self.settings.run_id}"
                    )
                self.latest = CompletedCheckpoint(meta.checkpoint_id, meta)
            self._looked_up_storage = True
        if self.latest is None and self.settings.initial_restore is not None:
            meta = self.settings.initial_restore
            self.latest = CompletedCheckpoint(meta.checkpoint_id, meta)
        if self.latest is not None:
            self.restored_from = self.latest.checkpoint_id
        return self.latest if self.settings.checkpointing else None

    async def _id_counter(self, restore: CompletedCheckpoint | None) -> CheckpointIdCounter:
        if self.ids is None:
            storage = self.storage
            start = self.settings.first_checkpoint_id
            if storage is not None:
                mark, existing = await asyncio.to_thread(
                    lambda: (storage.id_mark(), storage.checkpoint_ids())
                )
                start = max(start, mark + 1, (existing[-1] + 1) if existing else 1)
            if restore is not None:
                start = max(start, restore.checkpoint_id + 1)
            self.ids = CheckpointIdCounter(storage, start)
        return self.ids

    async def _run_attempt(self, attempt: int) -> dict[int, list[Any]]:
        settings = self.settings
        restore = await self._restore_point()
        if self._stop_savepoint is not None and restore is not None:
            await self._finish_stop_savepoint(restore)
        self._exhausted = set()
        self._running = set()
        ids = await self._id_counter(restore) if settings.checkpointing else None
        # every bundle placed (after a lost node, Ray moves its bundles elsewhere first);
        # a cancel does not wait for that
        await self._unless_cancelled(self.placement.ensure())
        await self._deploy(attempt, restore)
        loop = asyncio.get_running_loop()
        self._attempt_failure = loop.create_future()
        if settings.checkpointing:
            hooks = settings.hooks.for_job_master(attempt) if settings.hooks else None
            self.coordinator = CheckpointCoordinator(
                settings.job_name,
                settings.checkpoint_config,
                self.storage,
                self.graph,
                self.actors,
                attempt,
                ids,
                self._fail_attempt,
                hooks,
                self.history,
                restore,
                run_id=settings.run_id,
                failures=self.checkpoint_failures,
                on_stopped=self._on_stopped,
            )
            self.coordinator.start()
            if self._stopped_at is not None:
                # stopped with a savepoint, then failed before every subtask finished:
                # the sources read nothing; finish at a final checkpoint
                self.coordinator.request_final()
        self._run_refs = {key: actor.run.remote() for key, actor in self.actors.items()}
        if not settings.checkpointing:
            self.supervisor.attempt_running()  # nothing to restore: running once deployed
        tasks = {
            asyncio.ensure_future(self._await_run(key, ref)): key
            for key, ref in self._run_refs.items()
        }
        if self._recovery_started is not None:
            asyncio.ensure_future(self._measure_recovery(self._recovery_started))
            self._recovery_started = None
        cancel_task = asyncio.ensure_future(self._cancelled.wait())
        placement_lost = asyncio.ensure_future(self.placement.watch())
        results: dict[tuple[int, int], Any] = {}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(
                    pending | {cancel_task, self._attempt_failure, placement_lost},
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if cancel_task in done:
                    raise JobCancelledError(f"job {settings.job_name!r} was cancelled")
                if self._attempt_failure in done:
                    error = self._attempt_failure.result()
                    reason = getattr(error, "non_recoverable", None) or classify(
                        error, settings.failure_classifier
                    )
                    raise _AttemptFailed(
                        f"{type(error).__name__}: {error}",
                        failure=Failure.of_exception(FailureKind.ATTEMPT, error, reason),
                    )
                if placement_lost in done:
                    lost = placement_lost.result()
                    raise _AttemptFailed(
                        lost, failure=Failure(FailureKind.ATTEMPT, "PlacementLost", lost)
                    )
                pending.discard(cancel_task)
                pending.discard(self._attempt_failure)
                pending.discard(placement_lost)
                failures = [t.exception() for t in done if t.exception() is not None]
                if failures:
                    raise await self._root_cause(failures, pending)
                for task in done:
                    results[tasks[task]] = task.result()
                    if self.coordinator is not None:
                        self.coordinator.subtask_ended(tasks[task])
        finally:
            cancel_task.cancel()
            placement_lost.cancel()
            for task in pending:
                task.cancel()
        self._keep_final_output(results)
        outputs: dict[int, list[Any]] = {}
        for (vertex_id, _), value in sorted(results.items()):
            outputs.setdefault(vertex_id, []).append(value)
        return outputs

    async def _on_stopped(self, checkpoint_id: int, directory: str) -> None:
        """A stop-with-savepoint completed: recorded in the run's state (with the
        savepoint's directory) before its savepoint is written and before any subtask
        hears of it, so a job master that takes over stops the job too and writes the
        savepoint. Raises when it cannot be recorded (then the job is not stopped)."""
        state = self.supervisor.state
        try:
            state.stopped_at, state.stop_savepoint = checkpoint_id, directory
            await self._persist()
        except BaseException:
            state.stopped_at, state.stop_savepoint = None, None
            raise
        self._stopped_at = checkpoint_id

    async def _finish_stop_savepoint(self, restore: CompletedCheckpoint) -> None:
        """Write the savepoint of the stop a lost job master recorded (unless it did):
        the checkpoint it is a copy of is this run's restore point."""
        from rayflow.checkpoint.savepoint import export_checkpoint

        directory, self._stop_savepoint = self._stop_savepoint, None
        assert directory is not None and self.storage is not None
        options = self.settings.checkpoint_config.storage_options
        options = options if directory.startswith("s3://") else {}
        for pause in (0.2, 1.0, None):
            try:
                await asyncio.to_thread(
                    export_checkpoint, self.storage, restore.metadata, directory, options
                )
                log.info(
                    "job %r: savepoint %d of its stop written to %s",
                    self.settings.job_name,
                    restore.checkpoint_id,
                    directory,
                )
                return
            except Exception as exc:  # noqa: BLE001 - the job stops anyway
                if pause is None:
                    log.warning(
                        "job %r: the savepoint of its stop was not written to %s: %s; the "
                        "same state is checkpoint %d of run %s",
                        self.settings.job_name,
                        directory,
                        exc,
                        restore.checkpoint_id,
                        self.settings.run_id,
                    )
                    return
                await asyncio.sleep(pause)

    async def _unless_cancelled(self, work: Any) -> Any:
        """``await work``, unless the job is cancelled first (then JobCancelledError)."""
        task = asyncio.ensure_future(work)
        cancelled = asyncio.ensure_future(self._cancelled.wait())
        try:
            await asyncio.wait({task, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if task.done():
            return task.result()
        task.cancel()
        raise JobCancelledError(f"job {self.settings.job_name!r} was cancelled")

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

    def _fail_attempt(self, exc: BaseException) -> None:
        if self._attempt_failure is not None and not self._attempt_failure.done():
            self._attempt_failure.set_result(exc)

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
                del self.recovery_times[:-100]
                return
            await asyncio.sleep(0.02)

    async def _await_run(self, key: tuple[int, int], ref: Any) -> Any:
        vertex = self.graph.vertices[key[0]]
        where = f"subtask {key[1] + 1}/{vertex.parallelism} of {vertex.name!r}"
        at = (vertex.name, key[1], vertex.parallelism)
        try:
            return await ref
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            cause = _unwrap(exc)
            if isinstance(cause, OperatorError):
                raise _AttemptFailed(str(cause), failure=_operator_failure(cause)) from None
            if isinstance(cause, RayActorError):
                reason = str(cause).strip().splitlines()[0] if str(cause).strip() else "actor died"
                raise _AttemptFailed(
                    f"{where} died ({reason})",
                    failure=Failure(FailureKind.ATTEMPT, type(cause).__name__, reason, *at),
                ) from None
            reason = classify(cause, self.settings.failure_classifier)
            raise _AttemptFailed(
                f"{where}: {type(cause).__name__}: {cause}",
                secondary=isinstance(cause, ConnectionError),
                failure=Failure.of_exception(FailureKind.ATTEMPT, cause, reason, *at),
            ) from None

    async def _stop_attempt(self, reuse: bool = False) -> None:
        """End the current attempt. Every subtask's ``run()`` has ended when this returns,
        and every actor not kept for reuse is dead, so nothing of this attempt writes next
        to its successor's recovery.

        With ``reuse``, subtasks that are alive and run no thread of this attempt are kept
        for the next attempt (their ``run()`` is cancelled; Flink likewise redeploys into
        surviving slots), so a restart only starts processes for the others.
        """
        coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            # after shutdown: a commit point being written decides the restore point
            await coordinator.shutdown()
            if coordinator.latest is not None:
                self.latest = coordinator.latest
            if coordinator.stopped_at is not None:
                self._stopped_at = coordinator.stopped_at
        actors, refs = self.actors, self._run_refs
        self.actors, self._run_refs = {}, {}
        if not reuse:
            self._kill(actors.values())
        else:
            for ref in refs.values():
                ray.cancel(ref)
        if refs:
            await asyncio.wait(
                [asyncio.ensure_future(self._settle(ref)) for ref in refs.values()], timeout=30
            )
        if reuse:
            attempt = self.attempt
            checks = {
                key: asyncio.ensure_future(self._reusable(a, attempt)) for key, a in actors.items()
            }
            if checks:
                await asyncio.wait(checks.values(), timeout=10)
            doomed = {}
            for key, check in checks.items():
                if check.done() and check.result():
                    self._spare[key] = actors[key]
                else:
                    doomed[key] = actors[key]
            # the spares keep what they printed; read it now all the same
            await self._read_output_of(
                [(k, a) for k, a in actors.items() if k not in doomed], timeout_s=0.0
            )
            await self._read_then_kill(doomed)

    async def _kill_everything(self) -> None:
        actors = {**self._spare, **self.actors}
        self.actors, self._spare, self._run_refs = {}, {}, {}
        await self._kill_everything_in(actors)

    @staticmethod
    def _kill(actors: Any) -> None:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    @staticmethod
    async def _reusable(actor: Any, attempt: int) -> bool:
        try:
            return await asyncio.wait_for(actor.quiesce.remote(attempt), timeout=5)
        except BaseException:  # noqa: BLE001 - dead or hung: not reused
            return False

    @staticmethod
    async def _settle(ref: Any) -> None:
        try:
            await ref
        except BaseException:  # noqa: BLE001 - a killed actor's run() fails; that is the point
            pass

    # --- deployment ---------------------------------------------------------------------

    async def _deploy(
        self, attempt: int, restore: CompletedCheckpoint | None, tries: int = 2
    ) -> None:
        """Create or redeploy every subtask. A kept actor that died meanwhile, or that
        refuses the redeploy, is replaced by a new one. Whatever this call created is
        killed again if it fails part way (nothing leaks across attempts)."""
        graph = self.graph
        actors: dict[tuple[int, int], Any] = {}
        redeploys: dict[tuple[int, int], Any] = {}
        if restore is not None:
            _into_object_store(restore)
        try:
            for vertex_id in reversed(graph.topological_order()):
                vertex = graph.vertices[vertex_id]
                for index in range(vertex.parallelism):
                    key = (vertex_id, index)
                    outputs = self.deployer.outputs(vertex, index, actors)
                    deployment = self.deployer.deployment(
                        vertex, index, attempt, restore, outputs, master=self._me()
                    )
                    deployment.sources_stopped = self._stopped_at is not None
                    spare = self._spare.pop(key, None)
                    if spare is not None:
                        actors[key] = spare
                        redeploys[key] = spare.redeploy.remote(deployment)
                    else:
                        actors[key] = self._new_actor(key, deployment)
        except BaseException:
            kept = {**self._spare, **{key: actors.pop(key) for key in redeploys}}
            try:
                await kill_and_wait(actors.values())  # created just now: nothing printed
            finally:
                await self._read_then_kill(kept)
            self._spare = {}
            raise
        leftover = self._spare
        self._spare = {}
        self.actors = actors
        kept = [*actors.values(), *self._survivors]
        for key, (actor, _) in list(self._processes.items()):
            if not any(actor is a for a in kept):
                del self._processes[key]  # ended, or killed: not needed any more
        asyncio.ensure_future(self._learn_processes(list(actors.values())))
        await self._read_then_kill(leftover)
        failed = []
        for key, ref in redeploys.items():
            try:
                accepted = await asyncio.wait_for(ref, timeout=30)
            except Exception:  # noqa: BLE001 - died during the restart delay, say
                accepted = False
            if not accepted:
                failed.append(key)
        if failed:
            # A kept actor is gone or not clean. Senders were built with its handle, so
            # every subtask is deployed again (nothing ran yet), with fresh actors for those.
            log.info("job %r: replacing kept subtasks %s", self.settings.job_name, failed)
            await self._read_then_kill({key: self.actors.pop(key) for key in failed})
            self._spare, self.actors = dict(self.actors), {}
            if tries <= 0:
                raise RuntimeError(f"subtasks {sorted(failed)} could not be deployed")
            await self._deploy(attempt, restore, tries - 1)

    @staticmethod
    def _me() -> Any:
        return ray.get_runtime_context().current_actor

    def _new_actor(
        self, key: tuple[int, int], deployment: SubtaskDeployment, in_group: bool = True
    ) -> Any:
        """A subtask's actor, in its bundle of the job's placement group (a restarted
        subtask goes into the same bundle)."""
        self._incarnations += 1
        settings = self.settings
        channels = deployment.num_input_channels
        return RemoteSubtaskActor.options(
            name=subtask_actor_name(
                settings.job_id, key[0], key[1], f"g{self.generation}-{self._incarnations}"
            ),
            max_concurrency=subtask_max_concurrency(channels, settings.send_window),
            # never detached, whatever the driver's default: it goes with its job master
            lifetime="non_detached",
            **{**settings.subtask_options, **self.placement.actor_options(key, in_group)},
        ).remote(deployment)


#: The job master as Ray's actor class. ``JobMaster`` itself stays a plain class of this module,
#: under its own name: Ray pickles it by reference (a name to import), and a process that
#: unpickles it (making a handle) never writes copies over its methods.
RemoteJobMaster = ray.remote(max_restarts=0, max_task_retries=0)(JobMaster)


def _into_object_store(checkpoint: CompletedCheckpoint) -> None:
    """Snapshot blobs that came with acknowledgements are kept as bytes: put each in
    Ray's object store once (owned by this process) before a restore hands it to
    subtasks, so that every deployment carries a reference and not the bytes (a keyed
    vertex's subtasks each restore from every old subtask's blob). A blob that cannot be
    put stays bytes: the deployments carry it."""
    for key, ref in list(checkpoint.refs.items()):
        if isinstance(ref, bytes):
            try:
                checkpoint.refs[key] = ray.put(ref)
            except Exception as exc:  # noqa: BLE001 - the bytes still restore
                log.warning("snapshot blob of subtask %s not put in the object store: %s", key, exc)
