"""Detached jobs: runs that outlive the driver that submitted them.

``rayflow run --detach JOB.py --address ADDR`` (or ``env.execute_detached(name)``)
hands the job to a *job host*: a detached actor named after the job in the
``rayflow-jobs`` namespace of the cluster. The host does what ``execute_async`` does
on a driver (takes the job name's run lock, picks the restore point, prunes retained
runs, sets the sinks up) and runs the job with a :class:`~rayflow.environment.JobClient`
of its own, so a lost job master is taken over exactly as for an attached run. The job
master and the run lock belong to the host, so they outlive the submitting driver; the
subtasks and the placement group belong to the job master, as always.

After the run ends (finished, failed or cancelled, and cleaned up), the host stays,
holding the outcome, until it is removed (``rayflow jobs remove NAME``) or the name is
submitted again: ``rayflow jobs status NAME`` shows it meanwhile. A detached submission
under the name of an ended job replaces that job's host (a nightly job resubmitted under
its name runs; the handle it gets says which run it replaced); under the name of a live
one it is refused with what holds the name (cancel it first). The run lock still refuses
any second live run of the name, attached or detached.

The host runs on the head node (when Ray marks one), so losing any other node costs the
job a restart or a job master takeover, not its host. What is not covered: a job whose host
is lost (its process dies) is not resumed; its job master and subtasks go with the host. Ray
restarts the host, which cleans the job up as a cancel does (a job master that only commits
what completed checkpoints hold and aborts every other open transaction) and shows it FAILED,
its host lost, until it is removed (a job that had ended before keeps the end its run
recorded).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray

from rayflow.errors import ConcurrentRunError, JobFailedError
from rayflow.status import JobState

__all__ = [
    "NAMESPACE",
    "DetachedJob",
    "DetachedJobRunning",
    "JobDetached",
    "NoSuchDetachedJob",
    "find",
    "is_requested",
    "list_jobs",
    "request",
    "requested",
    "submit",
]

#: the Ray namespace of every job host; a host is named after its job
NAMESPACE = "rayflow-jobs"

#: how long a submission waits for the job to start (its host placed, its job master up)
START_TIMEOUT_S = 300.0

#: how often a host refreshes what it shows of a running job (status, checkpoints)
REFRESH_S = 2.0

#: how often a restarted host tries again to stop the actors of the run it lost, while
#: some do not stop (the job name stays locked until they have)
LOST_ACTORS_RETRY_S = 30.0

_requested = False


def request(on: bool = True) -> None:
    """Submit every job this process starts as a detached job (``rayflow run --detach``)."""
    global _requested
    _requested = on


def is_requested() -> bool:
    return _requested


@contextlib.contextmanager
def requested() -> Iterator[None]:
    """Within: jobs started here are submitted detached."""
    before = _requested
    request(True)
    try:
        yield
    finally:
        request(before)


class JobDetached(BaseException):
    """Raised by ``execute`` / ``execute_async`` once a job was submitted detached: the
    script stops there (its result is not here to use). ``rayflow run --detach`` catches
    it. A BaseException, so that a script's ``except Exception`` does not swallow it."""

    def __init__(self, job: DetachedJob) -> None:
        super().__init__(f"job {job.name!r} submitted detached")
        self.job = job


class NoSuchDetachedJob(LookupError):
    """No detached job of that name on this cluster."""


class DetachedJobRunning(RuntimeError):
    """The detached job has not ended (cancel it first)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _result_summary(result: Any) -> dict[str, Any]:
    records: dict[str, dict[str, int]] = {}
    for m in result.metrics:
        r = records.setdefault(m["vertex"], {"records_in": 0, "records_out": 0})
        r["records_in"] += m["records_in"]
        r["records_out"] += m["records_out"]
    return {
        "started_at": result.started_at,
        "finished_at": result.finished_at,
        "duration_s": result.duration_s,
        "records": records,
        "restarts": result.restarts,
        "job_master_restarts": result.job_master_restarts,
        "checkpoints_completed": len(result.completed_checkpoints),
        "restored_from": result.restored_from,
        "guarantees": dict(result.guarantees),
        "latency": dict(result.latency),
    }


def _recorded_end(settings: Any) -> JobState | None:
    """The end (FINISHED, FAILED or CANCELED) the run recorded in its checkpoint storage;
    None when it recorded none (or has no storage)."""
    if not settings.checkpointing:
        return None
    try:
        recorded = settings.storage().read_job_state()
    except Exception:  # noqa: BLE001 - unreadable: not known to have ended
        return None
    if recorded is None or not recorded.state.is_terminal:
        return None
    return recorded.state


#: calls of a host that block until the job starts or ends, by kind: each kind has threads
#: of its own, so that waiting callers never hold up ``status`` or a cancel
_WAITS = {"waits": 32, "cancels": 4}


class JobHost:
    """Runs one detached job and keeps its outcome until it is removed.

    Ray restarts a host whose process died (never one that was killed on purpose: those
    go with ``no_restart``). The restarted host does not run the job again: the job's run
    lock and job master went with the dead process (and the job master's subtasks with
    it), so it makes sure that nothing of the job is left (actors, placement groups), takes
    the run lock again and cleans the run up as a cancel does (what completed checkpoints
    hold committed, every other open transaction aborted; when another run of the name
    holds the lock by then, that run recovers them), then shows the job FAILED, its host
    lost, until it is removed. A job that had ended shows the end its run recorded in its
    checkpoint storage. Where processes of the lost run's actors do not exit, the host
    cleans nothing up and shows the job FAILING (not ended: it can be neither removed nor
    replaced) until they have exited, the job name locked meanwhile (it looks again every
    ``LOST_ACTORS_RETRY_S``); so is a run of its own whose actors do not stop as it ends."""

    def __init__(
        self,
        graph: Any,
        settings: Any,
        restore_from: str | None,
        plan: Any = None,
        allow_non_restored_state: bool = False,
        submitted_at: float | None = None,
    ) -> None:
        self.name = settings.job_name
        self.job_id = settings.job_id
        self.run_id = settings.run_id
        self.submitted_at = submitted_at or time.time()  # the same in a restarted host
        self._client: Any = None
        self._start_error: BaseException | None = None
        self._error: str | None = None
        self._summary: dict[str, Any] | None = None
        self._state = JobState.CREATED
        self._snapshot: dict[str, Any] = {}
        self._checkpoints: list[dict[str, Any]] = []
        self._ended_at: float | None = None
        self._final = False
        self._started = threading.Event()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._lost(graph, settings, restore_from, plan, allow_non_restored_state)
            return
        threading.Thread(
            target=self._run,
            args=(graph, settings, restore_from, plan, allow_non_restored_state),
            daemon=True,
        ).start()

    def _run(
        self,
        graph: Any,
        settings: Any,
        restore_from: str | None,
        plan: Any,
        allow_non_restored_state: bool,
    ) -> None:
        from rayflow.environment import start_run

        try:
            self._client = start_run(
                graph, settings, restore_from, None, plan, allow_non_restored_state
            )
        except BaseException as exc:  # noqa: BLE001 - the submitter gets it from started()
            self._start_error = exc
            self._error = _first_line(exc)
            self._state = JobState.FAILED
            self._ended.set()
            return
        finally:
            self._started.set()
        threading.Thread(target=self._refresh, daemon=True).start()
        try:
            result = self._client.wait()
            self._summary = _result_summary(result)
            with self._lock:
                self._checkpoints = list(result.checkpoints)
                self._final = True  # what the run returned: no later look overwrites it
            state = JobState.FINISHED
        except BaseException as exc:  # noqa: BLE001 - the outcome is what it holds
            self._error = _first_line(exc)
            try:
                state = self._client.get_job_status(timeout=30)
            except Exception:  # noqa: BLE001 - its job master does not say: it failed here
                state = JobState.FAILED
            if not state.is_terminal:
                state = JobState.FAILED
        if self._client.holds_job_name:  # its actors' processes not seen to exit
            self._keep_name_until_stopped(state, self._client)
        self._end(state)

    def _lost(self, *run: Any) -> None:
        """This host is a restart of one whose process died: a job still running died
        with it (and is cleaned up as a cancel is); one that had ended keeps the end its
        run recorded. ``run``: the host's own arguments (graph, settings, restore_from,
        plan, allow_non_restored_state)."""
        self._start_error = JobFailedError(
            f"job {self.name!r} (run {self.run_id}) failed: its job host was lost (its "
            "process died), and its job master and subtasks with it"
        )
        self._error = _first_line(self._start_error)
        self._state = JobState.FAILING
        self._started.set()
        threading.Thread(target=self._clean_up_lost, args=run, daemon=True).start()

    def _clean_up_lost(self, graph: Any, settings: Any, *start: Any) -> None:
        from rayflow.environment import _kill_job_actors, start_lost_run_clean_up
        from rayflow.runtime.run_lock import release_run_lock_held_by

        state = JobState.FAILED
        try:
            # nothing of the lost job master may run beside the one that cleans up
            _kill_job_actors(self.job_id)  # and its placement groups
        except Exception as exc:  # noqa: BLE001 - said in the outcome
            # The lost process's lock record names this run's job: no run of the name
            # takes it while processes of the job's actors run. The job is shown ending
            # (it can be neither removed nor replaced) until they are gone.
            self._error = (
                f"{self._error}; its actors could not all be stopped ({_first_line(exc)}): "
                "its job name stays locked until they are (looked at again every "
                f"{LOST_ACTORS_RETRY_S:g} s), and the next run of it recovers its open "
                "transactions"
            )
            self._stop_lost_actors(_kill_job_actors)
            release_run_lock_held_by(self.name, self.run_id)
            self._end(state)
            return
        recorded = _recorded_end(settings)
        client = None
        if recorded is not None:
            state = recorded
            self._error = (
                f"the job had ended {state.value} before its job host was lost (its "
                "process died); its result went with the host"
            )
            note = ""
        elif not settings.checkpointing:
            note = ""
        else:
            note, client = self._clean_up_transactions(
                start_lost_run_clean_up, graph, settings, *start
            )
        if note:
            self._error = f"{self._error}; {note}"
        if client is not None and client.holds_job_name:
            self._keep_name_until_stopped(state, client)
        self._end(state)

    def _end(self, state: JobState) -> None:
        with self._lock:
            self._state = state
            self._ended_at = time.time()
        self._ended.set()

    def _keep_name_until_stopped(self, state: JobState, client: Any) -> None:
        """The run ended (``state``) holding its job name: its actors' processes were not
        seen to exit. Shown as ending, and the name kept, until ``client`` has stopped
        them and released it."""
        with self._lock:
            self._state = state.while_ending
            self._error = (
                f"{self._error + '; ' if self._error else ''}its actors could not all be "
                "stopped: its job name stays locked until they are (looked at again every "
                f"{LOST_ACTORS_RETRY_S:g} s)"
            )
        while not client.release_stopped():
            time.sleep(LOST_ACTORS_RETRY_S)

    def _stop_lost_actors(self, kill: Any) -> None:
        """Tries to stop the lost run's actors every ``LOST_ACTORS_RETRY_S`` until every
        one of their processes is gone (while this host lives)."""
        while True:
            time.sleep(LOST_ACTORS_RETRY_S)
            try:
                kill(self.job_id)
                return
            except Exception:  # noqa: BLE001 - still there: the job name stays locked
                continue

    def _clean_up_transactions(self, start_clean_up: Any, *run: Any) -> tuple[str, Any]:
        """Cleans the lost run up as a cancel does; what happened, in words, and the
        client that did it (None where none started)."""
        from rayflow.errors import JobCancelledError

        try:
            client = start_clean_up(*run)
        except ConcurrentRunError as exc:
            # another run holds the name now (it recovers the transactions), or this
            # run's own lock record still guards processes of its actors
            return (
                f"its job name could not be taken again ({_first_line(exc)}); the run "
                "that takes it next recovers its open transactions",
                None,
            )
        except Exception as exc:  # noqa: BLE001 - said in the outcome
            return (
                f"cleaning up failed ({_first_line(exc)}); the next run of the job name "
                "recovers its open transactions"
            ), None
        try:
            client.wait()
        except JobCancelledError:
            pass  # cleaned up
        except Exception as exc:  # noqa: BLE001 - said in the outcome
            return (
                f"cleaning up failed ({_first_line(exc)}); the next run of the job name "
                "recovers its open transactions"
            ), client
        return "cleaned up as a cancel is (open transactions aborted)", client

    def _refresh(self) -> None:
        while not self._ended.wait(REFRESH_S):
            self._refresh_once()

    def _refresh_once(self) -> None:
        snapshot = self._client.snapshot(timeout=10)
        if snapshot is not None:
            with self._lock:
                self._snapshot = snapshot
        try:
            checkpoints = self._client.checkpoints()
        except Exception:  # noqa: BLE001 - restarting or over: keep what was seen
            return
        with self._lock:
            if not self._final:
                self._checkpoints = checkpoints

    # --- calls ---------------------------------------------------------------------------

    @ray.method(concurrency_group="waits")
    def started(self, timeout_s: float = 300.0) -> dict[str, str]:
        """Once the run started (its job master is up): its ids; raises what stopped it."""
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"job {self.name!r} did not start within {timeout_s:g} s")
        if self._start_error is not None:
            raise self._start_error
        return {"job_id": self.job_id, "run_id": self.run_id}

    def status(self) -> dict[str, Any]:
        with self._lock:
            snapshot = dict(self._snapshot)
            state = self._state
        if not self._ended.is_set() and self._client is not None:
            live = self._client.snapshot(timeout=5)
            if live is not None:
                snapshot = live
                state = JobState(snapshot.get("state", JobState.CREATED))
            else:
                # no answer: its job master is lost (the next one starts after the restart
                # delay, or finishes a cancel) or busy; the last look says RUNNING, stale
                state = self._state_unanswered(JobState(snapshot.get("state", JobState.CREATED)))
            if state.is_terminal:
                # its end is shown once this host has it (wait and ended agree, and the
                # job can be removed): until then, what it was while its run is released
                state = state.while_ending
        records: dict[str, dict[str, int]] = {}
        for m in snapshot.get("metrics") or []:
            r = records.setdefault(m["vertex"], {"records_in": 0, "records_out": 0})
            r["records_in"] += m["records_in"]
            r["records_out"] += m["records_out"]
        finished_at = snapshot.get("finished_at")
        if self._ended.is_set():
            # the last look at a running job is stale now: the outcome says more
            summary = self._summary or {}
            records = summary.get("records") or records
            snapshot.setdefault("started_at", summary.get("started_at"))
            finished_at = summary.get("finished_at") or finished_at or self._ended_at
        return {
            "name": self.name,
            "job_id": self.job_id,
            "run_id": self.run_id,
            "state": state.value,
            "submitted_at": self.submitted_at,
            "started_at": snapshot.get("started_at"),
            "finished_at": finished_at,
            "attempt": snapshot.get("attempt"),
            "restarts": snapshot.get("restarts", 0),
            "failure": snapshot.get("failure"),
            "error": self._error,
            "last_checkpoint": snapshot.get("last_checkpoint"),
            "checkpoint_summary": snapshot.get("checkpoint_summary"),
            "records": records,
            "result": self._summary,
        }

    def _state_unanswered(self, last_seen: JobState) -> JobState:
        try:
            return self._client.get_job_status(timeout=5)
        except Exception:  # noqa: BLE001 - busy: what was seen last
            return last_seen

    def checkpoints(self) -> list[dict[str, Any]]:
        if not self._ended.is_set() and self._client is not None:
            try:
                found = self._client.checkpoints()
                with self._lock:
                    if not self._final:
                        self._checkpoints = found
            except Exception:  # noqa: BLE001 - restarting: what was seen last
                pass
        with self._lock:
            return list(self._checkpoints)

    @ray.method(concurrency_group="cancels")
    def cancel(self, timeout_s: float = 120.0) -> str:
        """Cancel the job and return its state once it is cleaned up (CANCELED, or the
        state it had ended in before the cancel took effect)."""
        self._started.wait()
        if not self._ended.is_set():
            if self._client is not None:  # None: a lost host's job, being cleaned up
                self._client.request_cancel()
            if not self._ended.wait(timeout_s):
                raise TimeoutError(
                    f"job {self.name!r} is still cancelling after {timeout_s:g} s; "
                    "its status says when it is done"
                )
        return self._state.value

    @ray.method(concurrency_group="waits")
    def wait(self, timeout_s: float) -> str | None:
        """The job's state once it ended, None if it is still going after ``timeout_s``."""
        return self._state.value if self._ended.wait(timeout_s) else None

    def ended(self) -> bool:
        return self._ended.is_set()


#: A detached job's host as Ray's actor class. ``JobHost`` itself stays a plain class of this
#: module, under its own name: Ray pickles it by reference (a name to import), and a process
#: that unpickles it (making a handle) never writes copies over its methods.
RemoteJobHost = ray.remote(
    num_cpus=0, max_restarts=-1, max_concurrency=16, concurrency_groups=_WAITS
)(JobHost)


def _ask(method: Any, *args: Any, timeout_s: float) -> Any:
    """``method.remote(*args)``'s answer within ``timeout_s``; a host that Ray is
    restarting (its process died) is asked again until it answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(method(*args), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


@dataclass
class DetachedJob:
    """A handle on a detached job (from ``submit``, ``find`` or ``execute_detached``)."""

    name: str
    job_id: str
    run_id: str
    host: Any
    #: each sink's end-to-end guarantee, in words (known to the submitter only)
    guarantees: dict[str, str] = field(default_factory=dict)
    #: the status of the ended job of the same name this submission replaced, if any
    replaced: dict[str, Any] | None = None

    def status(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """State, ids, times, restarts, failure, last checkpoint and records per operator."""
        return _ask(self.host.status.remote, timeout_s=timeout_s)

    def checkpoints(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Statistics of the run's most recent checkpoints (as ``JobClient.checkpoints``)."""
        return _ask(self.host.checkpoints.remote, timeout_s=timeout_s)

    def cancel(self, timeout_s: float = 120.0) -> JobState:
        """Cancel as ``JobClient.cancel`` does (subtasks gone, open transactions aborted,
        run lock released, placement group removed); returns the state it ended in."""
        return JobState(_ask(self.host.cancel.remote, timeout_s, timeout_s=timeout_s + 30))

    def wait(self, timeout_s: float) -> JobState | None:
        """The state once the job ended, None while it still runs after ``timeout_s``."""
        state = _ask(self.host.wait.remote, timeout_s, timeout_s=timeout_s + 30)
        return None if state is None else JobState(state)

    def remove(self) -> None:
        """Forget an ended job (its name is free again); a live one is refused."""
        if not _ask(self.host.ended.remote, timeout_s=30):
            raise DetachedJobRunning(
                f"job {self.name!r} is still running: cancel it first "
                f"(rayflow jobs cancel {self.name})"
            )
        ray.kill(self.host, no_restart=True)


def _handle(name: str, host: Any, timeout_s: float = 30.0) -> DetachedJob:
    status = _ask(host.status.remote, timeout_s=timeout_s)
    return DetachedJob(name, status["job_id"], status["run_id"], host)


def find(name: str) -> DetachedJob:
    """The detached job of that name on the connected cluster."""
    try:
        host = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise NoSuchDetachedJob(f"no detached job named {name!r} on this cluster") from None
    return _handle(name, host)


def list_jobs(timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The status of every detached job on the connected cluster (by name); a host that
    does not answer in time is listed with state UNKNOWN."""
    names = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE
    )
    rows = []
    for name in names:
        try:
            host = ray.get_actor(name, namespace=NAMESPACE)
            rows.append(_ask(host.status.remote, timeout_s=timeout_s))
        except Exception as exc:  # noqa: BLE001 - gone meanwhile, or busy
            rows.append({"name": name, "state": "UNKNOWN", "error": _first_line(exc)})
    return rows


#: the resource Ray gives the head node only
HEAD_NODE_RESOURCE = "node:__internal_head__"


def _on_the_head_node() -> dict[str, Any]:
    """Actor options that put the job host on the head node, where one is marked: the
    cluster lives as long as it does, so losing any other node costs the job a restart
    or a job master takeover, never its host."""
    if any(HEAD_NODE_RESOURCE in n.get("Resources", {}) for n in ray.nodes() if n["Alive"]):
        return {"resources": {HEAD_NODE_RESOURCE: 0.001}}
    return {}


_ENDED = frozenset(s.value for s in JobState if s.is_terminal)


def _refusal(name: str, status: dict[str, Any]) -> ConcurrentRunError:
    state = status.get("state", "UNKNOWN")
    if state in (s.value for s in JobState if s.is_terminal):
        # shown ended, but its host has not (yet again) cleaned the run up: a host that
        # Ray restarted after its process died, cleaning up; replaced once it is done
        return ConcurrentRunError(
            f"a detached job named {name!r} ended {state} (run {status.get('run_id')}) and "
            f"its job host is cleaning the run up again (its process died); submit the name "
            f"again once rayflow jobs status {name} shows it ended"
        )
    return ConcurrentRunError(
        f"detached job {name!r} is {state} (run {status.get('run_id')}); wait for it or "
        f"cancel it (rayflow jobs cancel {name}), or submit this one under another name"
    )


def _clear_job(job_id: str) -> None:
    """Stop whatever a host that did not start its job left of it (a host lost after its
    job master came up leaves the job master's placement group while this process lives)."""
    from rayflow.environment import _kill_job_actors

    try:
        _kill_job_actors(job_id)
    except Exception:  # noqa: BLE001 - said by the error raised instead
        pass


def submit(
    graph: Any,
    settings: Any,
    restore_from: str | None,
    guarantees: dict[str, str],
    plan: Any = None,
    allow_non_restored_state: bool = False,
) -> DetachedJob:
    """Start a detached job on the connected cluster; returns once its job master is up
    (or raises what stopped it: the name is taken, a run of it holds the run lock, the
    restore point is missing, ...)."""
    from rayflow.runtime.job_master import _unwrap

    name = settings.job_name
    submitted_at = time.time()
    replaced: dict[str, Any] | None = None
    for _ in range(50):
        try:
            host = RemoteJobHost.options(
                name=name, namespace=NAMESPACE, lifetime="detached", **_on_the_head_node()
            ).remote(graph, settings, restore_from, plan, allow_non_restored_state, submitted_at)
            break
        except ValueError:
            pass  # the name is taken: by a host, or by a dead one whose name goes soon
        try:
            existing = ray.get_actor(name, namespace=NAMESPACE)
            status = _ask(existing.status.remote, timeout_s=30)
        except ValueError:
            continue  # removed meanwhile
        except ray.exceptions.RayActorError:
            time.sleep(0.1)  # a dead host: its name is released in a moment
            continue
        except ray.exceptions.GetTimeoutError:
            status = {"state": "UNKNOWN (its host did not answer within 30 s)"}
        try:
            ended = status.get("state") in _ENDED and _ask(existing.ended.remote, timeout_s=30)
        except ray.exceptions.RayActorError:
            if status.get("state") in _ENDED:
                # another submission (or a remove) took the ended host away: whichever
                # submission registers the name next replaces that ended run
                replaced = status
            continue  # removed or replaced meanwhile
        if ended:
            # a rerun of an ended job (a nightly job, say): its record gives way
            ray.kill(existing, no_restart=True)
            replaced = status
            continue
        raise _refusal(name, status)
    else:
        raise ConcurrentRunError(f"job {name!r}: could not register its detached job name")
    try:
        ids = ray.get(host.started.remote(START_TIMEOUT_S), timeout=START_TIMEOUT_S + 60)
    except BaseException as exc:
        ray.kill(host, no_restart=True)  # nothing started: the name is free again
        _clear_job(settings.job_id)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise TimeoutError(
                f"job {name!r}: its job host did not start within {START_TIMEOUT_S + 60:g} s "
                "(no room for it on the head node?)"
            ) from None
        raise _unwrap(exc) from None
    return DetachedJob(
        name, ids["job_id"], ids["run_id"], host, dict(guarantees), replaced=replaced
    )
