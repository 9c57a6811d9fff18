"""Warm workers: never-used Ray worker processes kept idle on the driver's node, so that
the next job's actors start without waiting for new processes.

Every actor of a job (its job master, each subtask, the run lock) takes a Ray worker
process of its own. A new process costs most of a second of CPU (an interpreter that
imports Ray), and Ray starts only as many at once as the node has CPUs: on a small
machine a job of six actors waits seconds for its processes. Ray keeps idle worker
processes on each node and gives a new actor one that has never run a task or an actor
and whose runtime environment matches; it starts a few itself for the first driver.
Such a process holds nothing of anybody: no thread, no state, no transaction of an
earlier job. Ray never gives an actor a process that ran something else, and rayflow
never reuses a subtask's process across jobs.

When a job ends, :meth:`WarmWorkers.keep_warm` asks the local raylet (through Ray's own
``PrestartWorkers`` call) to start such workers until as many are idle as the job had
actors; Ray keeps each alive for ``keep_alive_s`` before its idle-worker reaping may take
it back. When a job starts, :meth:`WarmWorkers.job_starting` ends a top-up still going,
whose processes would compete with the job for CPU. Only processes are started ahead of
time: which actors a job creates, who owns them and how they are fenced is unchanged.
Where the call is not available (another Ray version, a Ray Client connection, a driver
with a runtime environment, whose actors could not take these workers), nothing happens.

On a Ray that rayflow did not start, a top-up then starts as many workers again with
rayflow's setup hook in their runtime environment (:mod:`rayflow.runtime.hook_env`),
which import rayflow's runtime while idle, and the next job's job master is created with
that environment (:meth:`WarmWorkers.runtime_env_for_job`) when enough of them are there,
so that it and its subtasks take them; the workers without it then go after
:data:`PLAIN_KEEP_ALIVE_S`.
"""

from __future__ import annotations

import atexit
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayflow.runtime.hook_env import runs_the_hook, started_by_a_raylet

__all__ = ["WarmWorkerConfig", "WarmWorkers", "top_up", "warm_workers"]

log = logging.getLogger("rayflow.warm_workers")

#: Workers asked for in one ``PrestartWorkers`` call at most (Ray caps a call at 10).
MAX_PER_CALL = 10

#: How long workers without the hook's environment are kept where workers with it are
#: kept too (Ray's idle-worker reaping takes them back after that).
PLAIN_KEEP_ALIVE_S = 10.0

#: Workers with the hook's environment are started only once no job has started for this
#: long after the last one ended.
HOOKED_AFTER_S = 2.0


@dataclass(frozen=True)
class WarmWorkerConfig:
    """How many never-used workers to keep idle after a job, and for how long.

    ``max_workers`` caps the count (a job asks for as many as it had actors); 0 turns
    warm workers off. Each idle worker holds a Python process with Ray imported (about
    100 MB) until it is used or ``keep_alive_s`` has passed."""

    max_workers: int = 16
    keep_alive_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_workers < 0:
            raise ValueError(f"max_workers must be >= 0, got {self.max_workers}")
        if self.keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {self.keep_alive_s}")

    @property
    def enabled(self) -> bool:
        return self.max_workers > 0 and self.keep_alive_s > 0

    def target(self, actors: int) -> int:
        return max(0, min(actors, self.max_workers))


def top_up(
    idle: Callable[[], int],
    start: Callable[[int], None],
    target: int,
    *,
    per_round: int,
    max_rounds: int,
    round_s: float = 10.0,
    settle_s: float = 2.0,
    stop: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.1,
) -> int:
    """Start workers until ``idle()`` reaches ``target``; returns how many were asked for.

    Each round asks for what is missing, at most ``per_round`` (the raylet starts only as
    many processes at once as the node has CPUs, and drops the rest), then waits until
    those show up idle: until all did, or none more came for ``settle_s`` after one did,
    or ``round_s`` passed. A process still starting is not idle yet, so asking again
    before it shows up would start one too many. A round in which none showed up ends it
    (the processes fail to start, or cannot be counted). At most ``max_rounds`` rounds;
    ``stop()`` ends it between polls."""
    asked = 0
    for _ in range(max_rounds):
        if stop():
            break
        have = idle()
        n = min(target - have, per_round, MAX_PER_CALL)
        if n <= 0:
            break
        start(n)
        asked += n
        deadline = clock() + round_s
        last, last_change, came = have, None, False
        while not stop() and clock() < deadline:
            sleep(poll_s)
            now = idle()
            came = came or now > have
            if now >= have + n:
                break
            if now != last:
                last, last_change = now, clock()
            elif last_change is not None and clock() - last_change >= settle_s:
                break
        if not came:
            break  # none of them showed up: asking again would only start more
    return asked


class _Raylet:
    """The local raylet's ``PrestartWorkers`` and ``GetNodeStats`` calls (Ray internals:
    every use is guarded, and a failure only means no warm workers). ``with
    raylet.calls() as calls:`` opens a channel for one series of calls and closes it
    again, so that none is left open when Ray shuts down."""

    def __init__(self) -> None:
        import ray
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

        from rayflow.runtime.hook_env import actor_runtime_env

        ctx = ray.get_runtime_context()
        if ctx.runtime_env:
            raise RuntimeError("the driver has a runtime environment")
        node_id = ctx.get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"])
        self.address = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
        #: processes the raylet starts at once (Ray's default: the node's CPUs)
        self.startup_concurrency = max(1, int(node["Resources"].get("CPU", 1)))
        self.pb = node_manager_pb2
        self.grpc = node_manager_pb2_grpc
        self.python = common_pb2.PYTHON
        self.worker = common_pb2.WORKER
        self.job_id = bytes.fromhex(ctx.get_job_id())
        self.nil_job = b"\xff" * len(self.job_id)
        self.nil_actor = b"\xff" * len(ray.ActorID.nil().binary())
        #: the runtime environment the workers are started with (None: the driver's), and
        #: the driver connection it was made for
        self.runtime_env = actor_runtime_env()
        self.connection = _current_connection()
        self.runtime_env_info = _runtime_env_info(self.runtime_env)

    def calls(self) -> _RayletCalls:
        return _RayletCalls(self)


class _RayletCalls:
    def __init__(self, raylet: _Raylet) -> None:
        self.r = raylet
        self.channel: Any = None
        self.stub: Any = None

    def __enter__(self) -> _RayletCalls:
        from ray._private.grpc_utils import init_grpc_channel

        self.channel = init_grpc_channel(self.r.address)
        self.stub = self.r.grpc.NodeManagerServiceStub(self.channel)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.channel.close()

    def fresh_idle(self, hooked: bool = False) -> int:
        """Worker processes on the node that never ran a task or an actor and could run
        this driver's actors (bound to no job yet, or to this one): those started with
        the raylet's runtime environment (``hooked``: with :attr:`_Raylet.runtime_env`;
        where that is None, every one)."""
        r = self.r
        request = r.pb.GetNodeStatsRequest(include_memory_info=False)
        reply = self.stub.GetNodeStats(request, timeout=5)
        # a worker that is going away answers with empty stats (pid 0): not counted
        return sum(
            1
            for w in reply.core_workers_stats
            if w.pid > 0
            and w.worker_type == r.worker
            and w.language == r.python
            and w.actor_id in (b"", r.nil_actor)
            and w.num_executed_tasks == 0
            and w.num_running_tasks == 0
            and w.job_id in (b"", r.nil_job, r.job_id)
            and (r.runtime_env is None or runs_the_hook(w.pid, r.runtime_env) == hooked)
        )

    def can_tell_hooked(self) -> bool:
        """Whether this driver can tell the raylet's workers apart by the environment
        they started with: it can read that of one of them (not where the raylet runs as
        another user, or in another process namespace)."""
        r = self.r
        request = r.pb.GetNodeStatsRequest(include_memory_info=False)
        reply = self.stub.GetNodeStats(request, timeout=5)
        return any(
            w.pid > 0 and w.worker_type == r.worker and started_by_a_raylet(w.pid)
            for w in reply.core_workers_stats
        )

    def prestart(self, n: int, keep_alive_s: float, hooked: bool = False) -> None:
        """Start ``n`` workers: with :attr:`_Raylet.runtime_env` where ``hooked``."""
        r = self.r
        with_env = {"runtime_env_info": r.runtime_env_info} if hooked else {}
        self.stub.PrestartWorkers(
            r.pb.PrestartWorkersRequest(
                language=r.python,
                job_id=r.job_id,
                keep_alive_duration_secs=int(keep_alive_s),
                num_workers=n,
                **with_env,
            ),
            timeout=5,
        )


@dataclass
class _HookedWorkers:
    """Workers kept warm with a runtime environment: for which driver connection, until
    when they may be there, and how many the top-up last saw idle."""

    connection: str
    runtime_env: dict[str, Any]
    until: float
    #: until when the plain workers kept warm with them may still be there
    plain_until: float
    ready: int = 0
    #: asked for and not seen idle yet (still starting, as far as the top-up knows)
    starting: int = 0


def _runtime_env_info(runtime_env: dict[str, Any] | None) -> Any:
    """Ray's ``RuntimeEnvInfo`` message for ``runtime_env``, as Ray makes it for an actor
    created with it (its workers are kept apart by it); None for None."""
    if runtime_env is None:
        return None
    from ray._private.utils import get_runtime_env_info
    from ray.runtime_env import RuntimeEnv

    return get_runtime_env_info(RuntimeEnv(**runtime_env), is_job_runtime_env=False)


def _current_connection() -> str:
    """This driver's connection: its cluster, its Ray job and its node (a cluster
    restarted at the same address numbers its jobs from the start again)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized")
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}/{context.get_node_id()}"


def _current_node_id() -> str:
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized")
    return ray.get_runtime_context().get_node_id()


class WarmWorkers:
    """Keeps never-used workers idle on the driver's node between jobs (one per driver)."""

    def __init__(
        self,
        raylet_factory: Callable[[], Any] = _Raylet,
        node_id: Callable[[], str] | None = None,
        connection: Callable[[], str] | None = None,
    ) -> None:
        self._factory = raylet_factory
        self._node_id = node_id or _current_node_id
        self._connection = connection or _current_connection
        #: the workers kept warm last with a runtime environment (None: without one)
        self._hooked: _HookedWorkers | None = None
        # the raylet handle of the current connection only; None where unavailable
        self._raylets: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._generation = 0  # a job start or a newer top-up ends the running top-up
        self._thread: threading.Thread | None = None
        self._exit_hook = False
        self._recent: list[tuple[float, int]] = []  # (when, actors) of jobs that ended
        self._clock = time.monotonic
        self._hooked_after_s = HOOKED_AFTER_S
        self._round_s = 10.0  # how long a top-up round waits for its workers at most

    def _get(self) -> Any:
        try:
            node_id = self._node_id()
        except Exception:  # noqa: BLE001 - not connected
            return None
        # Made anew each time, never cached: a driver that leaves and joins the same
        # cluster again keeps its node id but has a new Ray job id, and workers must be
        # started for the job it runs now. Made outside the lock (it may export the setup
        # hook to Ray): a job start waits for no such call.
        try:
            raylet = self._factory()
        except Exception as exc:  # noqa: BLE001 - no warm workers, nothing else changes
            log.debug("warm workers unavailable: %s", exc)
            raylet = None
        with self._lock:
            self._raylets.clear()
            self._raylets[node_id] = raylet
        return raylet

    def job_starting(self) -> None:
        """A job is starting: end any top-up. Its processes would compete with the job
        for CPU (the ones already starting are taken by the job's actors as they come
        up). Asking for the missing workers here does not help either: they start no
        sooner than the job's own actors would start them, and slow its job master."""
        self.stop(timeout_s=0)

    def keep_warm(self, actors: int, config: WarmWorkerConfig) -> threading.Thread | None:
        """A job with ``actors`` actors ended: top up idle never-used workers, in a
        background thread (replacing a top-up still running) until the next job starts,
        to as many as the largest job that ended within ``keep_alive_s`` had actors (jobs
        of different sizes take turns). Returns the thread, None when there is nothing
        to do."""
        with self._lock:
            now = self._clock()
            self._recent = [(t, n) for t, n in self._recent if now - t < config.keep_alive_s]
            self._recent.append((now, actors))
            ended = now
            largest = max(n for _, n in self._recent)
            target = config.target(largest)
            covers = target >= largest
            self._generation += 1
            generation = self._generation
            if not self._exit_hook:
                # registered after ray.init's own hook, so it runs before Ray shuts down
                atexit.register(self.stop)
                self._exit_hook = True
        if not config.enabled or target == 0:
            return None

        def stopped() -> bool:
            return self._generation != generation

        def run() -> None:
            raylet = self._get()
            if raylet is None or stopped():
                return
            runtime_env = getattr(raylet, "runtime_env", None)
            # the connection the raylet handle (and the hook it exported) belongs to
            connection = getattr(raylet, "connection", None)
            self._note_runtime_env(None, 0.0, generation)  # until this top-up knows better
            per_round = raylet.startup_concurrency
            rounds = 2 * (target // per_round + 1)
            try:
                with raylet.calls() as calls:
                    if runtime_env is not None and not calls.can_tell_hooked():
                        runtime_env = None  # its workers could not be counted
                    self._note_runtime_env(runtime_env, config.keep_alive_s, generation, connection)
                    # first workers any actor can take (they start soonest); where workers
                    # with the hook's environment can serve the largest recent job, the
                    # plain ones go after a short keep-alive
                    plain_keep_alive = config.keep_alive_s
                    if runtime_env is not None and covers:
                        plain_keep_alive = min(plain_keep_alive, PLAIN_KEEP_ALIVE_S)
                    top_up(
                        calls.fresh_idle,
                        lambda n: calls.prestart(n, plain_keep_alive),
                        target,
                        per_round=per_round,
                        max_rounds=rounds,
                        round_s=self._round_s,
                        stop=stopped,
                    )
                    if runtime_env is None:
                        return
                    # then, once no job has followed for a while, workers with the hook's
                    # environment, for the jobs after a pause (jobs back to back would
                    # only have them compete for CPU)
                    while not stopped() and self._clock() < ended + self._hooked_after_s:
                        time.sleep(0.05)
                    if stopped():
                        return

                    def idle() -> int:
                        count = calls.fresh_idle(hooked=True)
                        self._note_ready(count, generation)
                        return count

                    def start(n: int) -> None:
                        calls.prestart(n, config.keep_alive_s, hooked=True)
                        self._note_starting(n, generation)

                    top_up(
                        idle,
                        start,
                        target,
                        per_round=per_round,
                        max_rounds=rounds,
                        round_s=self._round_s,
                        stop=stopped,
                    )
                    # not ended by a job: what has not shown up by now is not coming
                    self._note_starting(None, generation)
            except Exception as exc:  # noqa: BLE001 - Ray going away, say
                log.debug("keeping workers warm: %s", exc)

        thread = threading.Thread(target=run, name="rayflow-warm-workers", daemon=True)
        with self._lock:
            self._thread = thread
        thread.start()
        return thread

    def _note_runtime_env(
        self,
        runtime_env: dict[str, Any] | None,
        keep_alive_s: float,
        generation: int,
        connection: str | None = None,
    ) -> None:
        """Record the environment of the workers the running top-up keeps (a top-up that
        a job start or a newer top-up ended records nothing), for ``connection``, the
        driver connection they were started for (the current one where not given)."""
        if connection is None:
            try:
                connection = self._connection()
            except Exception:  # noqa: BLE001 - not connected
                return
        with self._lock:
            if generation != self._generation:
                return
            if runtime_env is None:
                self._hooked = None
            else:
                now = self._clock()
                until, plain_until = now + keep_alive_s, now + PLAIN_KEEP_ALIVE_S
                self._hooked = _HookedWorkers(connection, runtime_env, until, plain_until)

    def _note_ready(self, count: int, generation: int) -> None:
        """The running top-up saw ``count`` workers of its environment idle (a top-up that
        a job start or a newer top-up ended no longer counts)."""
        with self._lock:
            hooked = self._hooked
            if hooked is not None and generation == self._generation:
                hooked.starting = max(0, hooked.starting - max(0, count - hooked.ready))
                hooked.ready = count

    def _note_starting(self, n: int | None, generation: int) -> None:
        """The running top-up asked for ``n`` more workers (None: it ended, and counts on
        none still starting)."""
        with self._lock:
            if self._hooked is not None and generation == self._generation:
                self._hooked.starting = 0 if n is None else self._hooked.starting + n

    def runtime_env_for_job(
        self, config: WarmWorkerConfig | None, actors: int
    ) -> dict[str, Any] | None:
        """The runtime environment for a job of ``actors`` actors that starts now, for its
        job master (its subtasks inherit it): the one the workers kept warm after a job of
        this connection were started with, while they may still be there and serve the
        job better than the workers kept without it; None otherwise, and the actors take
        the workers kept warm without it (or whichever Ray has). A process started for
        that environment costs more than one without (Ray asks its runtime environment
        agent for it, and it imports rayflow's runtime before it takes work), so each
        top-up first starts workers without it, which a job that follows at once takes,
        and only then the ones with it, for the jobs after a pause: while the plain ones
        may still be there, the job takes the environment only where as many of its
        workers as it has actors are idle; after that, where at least half of them are
        idle or starting. The workers it counts on are taken off the count.
        """
        if config is None or not config.enabled:
            return None
        try:
            connection = self._connection()
        except Exception:  # noqa: BLE001 - not connected
            return None
        with self._lock:
            hooked = self._hooked
            if hooked is None or hooked.connection != connection:
                return None
            now = self._clock()
            if now >= hooked.until:
                return None
            if now < hooked.plain_until:
                enough = hooked.ready >= actors  # else the plain ones serve it better
            else:
                enough = hooked.ready + hooked.starting >= (actors + 1) // 2
            if not enough:
                return None
            taken = min(actors, hooked.ready)
            hooked.ready -= taken
            hooked.starting = max(0, hooked.starting - (actors - taken))
            return copy.deepcopy(hooked.runtime_env)

    def stop(self, timeout_s: float = 1.0) -> None:
        """End a running top-up (its channel to the raylet is closed on the way out)."""
        with self._lock:
            self._generation += 1
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


#: The driver's warm workers.
warm_workers = WarmWorkers()
