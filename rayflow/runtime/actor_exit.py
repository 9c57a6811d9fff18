"""Killing subtask actors and knowing they are gone: :func:`kill_and_wait`.

Ray answers calls to a killed actor with ``RayActorError`` as soon as its control plane
marks the actor dead, which is before the actor's process has exited: a thread of it can
still run (and write to the outside world) for milliseconds after, longer on a loaded
machine. So an actor counts as gone only once its process is seen to have exited: on this
node by its pid, from the process's own PID namespace (a driver in another one, beside
the raylet's, would see other processes by those pids), else by a task pinned to the
actor's node (a node that is gone took the process with it); a pid no look can see
counts as running. Where each actor runs (node and pid) is
what the caller learnt earlier (a job master asks every actor it deploys) or, else, asked
right before the kill; one that cannot say (dead already, or no such method) is taken as
gone once Ray says so. The processes of a lost job master's actors, which nobody can ask
any more, come from Ray's actor table (:func:`processes_named`); a table that cannot be
read raises rather than saying none run, and a Ray Client driver, which cannot read it
and is no node of the cluster, waits for them in a task on the cluster
(:func:`wait_named_exited`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

__all__ = [
    "ActorsNotPlaced",
    "ActorsStillAlive",
    "ActorTableUnavailable",
    "ActorProcess",
    "KILL_TIMEOUT_S",
    "PROBE_START_S",
    "STARTED_SLACK_S",
    "UNREACHABLE_IS_GONE_S",
    "kill_and_wait",
    "process_of",
    "processes_named",
    "this_process",
    "wait_exited",
    "wait_named_exited",
]

#: A killed actor that cannot be reached for this long counts as gone (its node is lost
#: and not yet declared dead; Ray offers no surer proof across a partition).
UNREACHABLE_IS_GONE_S = 10.0
#: A process that started this long after its actor did (by the GCS's clock) is another
#: one with the same pid.
STARTED_SLACK_S = 30.0
#: How long killed actors may take to die and their processes to exit.
KILL_TIMEOUT_S = 30.0
#: How long, by default, a task that looks at processes on their node may take to start
#: (a worker process may have to start there, with the job's runtime environment); a
#: task that waits for processes on behalf of a Ray Client driver too.
PROBE_START_S = 30.0
#: How long an actor may take to say where it runs before it is killed.
_WHEREABOUTS_TIMEOUT_S = 1.0
#: How often the exit of a process on this node is looked for.
_POLL_S = 0.005
#: How often Ray's actor table is read again while an actor looked for is not placed.
_UNPLACED_POLL_S = 0.1
#: How many times Ray's actor table is read before its reader gives up, and the pause
#: between reads.
_TABLE_TRIES = 3
_TABLE_RETRY_S = 1.0


class ActorTableUnavailable(RuntimeError):
    """Ray's actor table could not be read: which processes of actors still run is not
    known (never taken as none)."""


class ActorsStillAlive(RuntimeError):
    """Killed actors did not die in time: the next attempt must not start beside them.
    ``actors``: their handles (to try again)."""

    def __init__(self, message: str, actors: list[Any] | None = None) -> None:
        super().__init__(message)
        self.actors = list(actors or [])


@dataclass(frozen=True)
class ActorProcess:
    """Where an actor runs: its node and its process there. ``started_by``: when known,
    the latest time (``time.time()``) the actor's process can have started; a process
    with that pid started later is another one (the pid was used again). ``start_ticks``:
    when known, the process's start as its node's kernel counts it (clock ticks since
    boot): a process with that pid and another start is another one, whatever the
    clocks say. ``pid_ns``: when known, the PID namespace the pid is in (the device and
    inode of the process's ``/proc/self/ns/pid``): only a process of that namespace can
    look at it by its pid."""

    node_id: str
    pid: int
    started_by: float | None = None
    start_ticks: int | None = None
    pid_ns: int | None = None


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` of this node started, in clock ticks since boot (None where
    it is gone or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace() -> int | None:
    """This process's PID namespace, as its device and inode (None where it cannot be
    told)."""
    try:
        found = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return (found.st_dev << 32) | found.st_ino if found.st_ino < 2**32 else None


def _proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's PID namespace: a process in a namespace of
    its own under a ``/proc`` mounted from another (``unshare --pid`` without a ``/proc``
    of its own) would read other processes by its pids."""
    try:
        if not os.path.isdir("/proc/self/task") or os.readlink("/proc/self") != str(os.getpid()):
            return False
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    # this process's pid in each namespace from /proc's own down to its
                    # own: one where /proc is of its namespace (the pids may match by
                    # chance in two)
                    return len(line.split()) == 2
    except OSError:
        return False
    return True  # a kernel that does not say (before Linux 4.1)


_this: ActorProcess | None = None


def this_process() -> ActorProcess:
    """This process as an :class:`ActorProcess` (in a Ray worker: its node's id), the same
    every time it is asked."""
    global _this
    if _this is None:
        pid = os.getpid()
        _this = ActorProcess(
            str(ray.get_runtime_context().get_node_id()),
            pid,
            float(int(time.time()) + 1),  # it started before now
            _start_ticks(pid) if _PROC else None,
            _PID_NS,
        )
    return _this


async def process_of(actor: Any, timeout_s: float | None = None) -> ActorProcess | None:
    """Where ``actor`` runs, as it says (an :class:`ActorProcess`, or its node and pid;
    None when it cannot say within ``timeout_s``)."""
    try:
        answer = await asyncio.wait_for(
            actor.whereabouts.remote(), timeout=timeout_s or _WHEREABOUTS_TIMEOUT_S
        )
        if isinstance(answer, ActorProcess):
            return answer
        node_id, pid = answer
    except BaseException:  # noqa: BLE001 - dead, hung, or not a subtask actor: unknown
        return None
    return ActorProcess(str(node_id), int(pid))


#: whether this process looks at processes through ``/proc`` (else it asks the kernel)
_PROC = _proc_is_ours()
_PID_NS = _pid_namespace() if _PROC else None
#: Ray's name of a node's raylet among the processes a driver started
_RAYLET = "raylet"


def _boot_time() -> float:
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


_BOOT_TIME = _boot_time() if _PROC else 0.0
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _running(
    pid: int,
    started_by: float | None = None,
    start_ticks: int | None = None,
    pid_ns: int | None = None,
) -> bool:
    """Whether any thread of process ``pid`` of this node still runs (a killed process's
    main thread can show as exited while its other threads still run), the process
    having started at ``start_ticks`` (clock ticks since boot), else by ``started_by``
    (``time.time()``), when that is given. A pid of another PID namespace than this
    process's (``pid_ns``) cannot be looked at from here: it counts as running."""
    if pid_ns is not None and pid_ns != _PID_NS:
        return True
    if not _PROC:  # no /proc here: ask the kernel
        return _kernel_has(pid)
    if start_ticks is not None:
        ticks = _start_ticks(pid)
        if ticks is None:
            return _kernel_has(pid)  # gone, or hidden from this process's /proc
        if ticks != start_ticks:
            return False  # another process with the same pid
    elif started_by is not None and _BOOT_TIME:
        ticks = _start_ticks(pid)
        if ticks is None:
            return _kernel_has(pid)
        if _BOOT_TIME + ticks / _TICKS > started_by:
            return False  # another process with the same pid
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return _kernel_has(pid)
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state not in ("Z", "X"):
            return True
    return False


def _kernel_has(pid: int) -> bool:
    """Whether the kernel has a process ``pid`` (in this process's PID namespace) that
    may be an actor's: what ``/proc`` does not show may still run (a ``/proc`` mounted
    with ``hidepid`` hides other users' processes); "no such process" says it is gone.
    "Not permitted" says it is another user's: an actor's to a process of another user
    than the workers', another process (the pid used again) to a worker or the driver
    that started the workers, which run as the actors' user."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return not _sees_worker_pids()
    except OSError:  # not known: counted as running
        return True
    return True


#: a process to look for on its node: pid, started by, start ticks, PID namespace (see
#: ActorProcess)
_Pid = tuple[int, float | None, int | None, int | None]


async def _gone_here(pid: _Pid, deadline: float) -> bool:
    while _running(*pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


@ray.remote(num_cpus=0, max_retries=0)
def _gone_there(pids: list[_Pid], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_running(*pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _node_alive(node_id: str) -> bool:
    return any(node.get("NodeID") == node_id and node.get("Alive") for node in ray.nodes())


def _sees_worker_pids() -> bool:
    """Whether this process sees the worker processes of its own node by their pids: a
    worker does (its raylet starts every worker, in the raylet's PID namespace), as does
    a driver that started its node's raylet. A driver that joined a running node may run
    in a PID namespace of its own (a container beside the raylet's, sharing its network):
    there a worker's pid names another process, or none, so it asks a task on the node."""
    try:
        if ray._private.worker.global_worker.mode == ray.WORKER_MODE:
            return True
        node = ray._private.worker._global_node
        return node is not None and bool(node.all_processes.get(_RAYLET))
    except Exception:  # noqa: BLE001 - another Ray: not known, so ask the node
        return False


def _sees(pids: list[_Pid]) -> bool:
    """Whether this process can look at ``pids`` of its own node by their pids: those
    whose PID namespace is known are all in this process's, and at least one is (they
    say which namespace this node's workers are in), or, where none is known, this
    process sees the node's workers (:func:`_sees_worker_pids`)."""
    known = {pid[3] for pid in pids if pid[3] is not None}
    if known:
        return known == {_PID_NS}
    return _sees_worker_pids()


async def _exited(
    node_id: str, pids: list[_Pid], deadline: float, start_s: float = PROBE_START_S
) -> bool:
    """Whether the processes ``pids`` of node ``node_id`` have all exited by
    ``deadline`` (a task that looks at them there may take ``start_s`` more to start)."""
    if node_id == ray.get_runtime_context().get_node_id() and _sees(pids):
        for pid in pids:
            if not await _gone_here(pid, deadline):
                return False
        return True
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        probe = _gone_there.options(scheduling_strategy=pinned).remote(pids, left)
        try:
            return await asyncio.wait_for(probe, timeout=left + start_s)
        except asyncio.TimeoutError:
            ray.cancel(probe, force=True)
            return False
        except Exception:  # noqa: BLE001 - the probe did not run or died
            if not await asyncio.to_thread(_node_alive, node_id):
                return True  # the node is gone, and its processes with it
            await asyncio.sleep(0.2)  # its worker was killed (memory?), say: again


async def _dead(actor: Any, deadline: float) -> bool:
    unreachable_since: float | None = None
    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(actor.ready.remote(), timeout=1.0)
            unreachable_since = None
        except ActorUnavailableError:
            # Unreachable: maybe alive behind a network fault, maybe on a node that is
            # gone and not yet declared dead. Killed, and unreachable for a while: gone.
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since >= UNREACHABLE_IS_GONE_S:
                return True
        except RayActorError:
            return True
        except Exception:  # noqa: BLE001 - still going away
            pass
        await asyncio.sleep(0.05)
    return False


async def kill_and_wait(
    actors: Any,
    timeout_s: float | None = None,
    known: Mapping[int, ActorProcess] | None = None,
) -> None:
    """Kill actors and return once each is dead and its process has exited: after this
    no thread of theirs writes anything. ``known``: where actors run, by ``id()`` of
    their handle, as learnt earlier (an actor busy when it is killed may not answer in
    time); the others are asked. Raises :class:`ActorsStillAlive` when one still
    answers, or its process still runs, after ``timeout_s`` (:data:`KILL_TIMEOUT_S`)."""
    actors = list(actors)
    if not actors:
        return
    known = known or {}

    async def where(actor: Any) -> ActorProcess | None:
        return known.get(id(actor)) or await process_of(actor)

    asked = await asyncio.gather(*map(where, actors))
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    deadline = time.monotonic() + (KILL_TIMEOUT_S if timeout_s is None else timeout_s)
    dead = await asyncio.gather(*(_dead(actor, deadline) for actor in actors))
    exited = await _exited_by_node(
        [p for p, ok in zip(asked, dead) if ok and p is not None], deadline
    )
    alive = [
        actor
        for actor, process, ok in zip(actors, asked, dead)
        if not ok or (process is not None and not exited[process.node_id])
    ]
    if alive:
        raise ActorsStillAlive(
            f"{len(alive)} killed subtask actor(s) still answer or their process still runs",
            alive,
        )


async def _exited_by_node(
    processes: list[ActorProcess], deadline: float, start_s: float = PROBE_START_S
) -> dict[str, bool]:
    """Per node of ``processes``: whether all of them there have exited by ``deadline``
    (a task that looks at them on their node may take ``start_s`` more to start)."""
    by_node: dict[str, list[_Pid]] = {}
    for process in processes:
        by_node.setdefault(process.node_id, []).append(
            (process.pid, process.started_by, process.start_ticks, process.pid_ns)
        )
    nodes = list(by_node)
    answers = await asyncio.gather(*(_exited(n, by_node[n], deadline, start_s) for n in nodes))
    return dict(zip(nodes, answers))


class ActorsNotPlaced(RuntimeError):
    """Actors of the name looked for are not dead and have no process in Ray's table yet
    (being created, or restarted): a process may start for them at any time."""


def processes_named(prefix: str, placed: bool = False) -> list[ActorProcess]:
    """The processes of every actor whose name starts with ``prefix``, alive or dead, from
    Ray's actor table: for actors whose owner died, which Ray calls dead before their
    processes exit, and which nobody can ask any more. Each process counts as the
    actor's only if it started by :data:`STARTED_SLACK_S` after the actor did (the GCS's
    clock and a node's may differ a little; a pid used again belongs to a process started
    after the actor died). Raises :class:`ActorTableUnavailable` where the table cannot
    be read (the GCS does not answer; an internal interface, not in Ray Client mode:
    there, see :func:`wait_named_exited`). ``placed``: raise :class:`ActorsNotPlaced`
    where such an actor is not dead and has no process yet."""
    from ray._private import state

    for attempt in range(_TABLE_TRIES):
        try:
            read_at = time.time()
            table = state.actors()
            break
        except Exception as exc:  # noqa: BLE001 - said in the error, after a few tries
            error = exc
            if attempt + 1 < _TABLE_TRIES:
                time.sleep(_TABLE_RETRY_S)
    else:
        raise ActorTableUnavailable(
            f"Ray's actor table could not be read ({type(error).__name__}: {error}): "
            f"whether processes of actors named {prefix!r}... still run is not known"
        )
    found = []
    for info in table.values():
        if not str(info.get("Name") or "").startswith(prefix):
            continue
        pid, node = info.get("Pid"), (info.get("Address") or {}).get("NodeID")
        dead = info.get("State") == "DEAD"
        if placed and not dead and not (pid and node):
            raise ActorsNotPlaced(
                f"actor {info.get('Name')!r} is {info.get('State')} and has no process yet"
            )
        if pid and node:
            found.append(ActorProcess(str(node), int(pid), _started_by(info, dead, read_at)))
    return found


def _started_by(info: Mapping[str, Any], dead: bool, read_at: float) -> float:
    """By when (``time.time()``) the process of the actor of table entry ``info`` (read
    at ``read_at``) had started: by the actor's start (Ray sets it once the actor is
    created), else by its death (a process given to an actor that died while it was
    being created), else by the read (Ray lists a pid once it gave the actor a worker)."""
    started = info.get("StartTime") or 0
    if started:
        return started / 1000.0 + STARTED_SLACK_S
    ended = (info.get("EndTime") or 0) or (info.get("Timestamp") or 0) if dead else 0
    return min(ended / 1000.0 if ended else read_at, read_at) + STARTED_SLACK_S


def wait_named_exited(
    prefix: str,
    timeout_s: float,
    also: Sequence[ActorProcess] = (),
    task_start_s: float = PROBE_START_S,
) -> bool:
    """``wait_exited(processes_named(prefix) + also, timeout_s)``, on the cluster: a Ray
    Client driver (``ray://``) runs it in a task there (its own machine is no node of the
    cluster, and cannot read Ray's actor table), given ``task_start_s`` to start, and as
    long again for the tasks it starts to look on other nodes (raises
    ``GetTimeoutError`` past that: not known). A task that looks at processes on their
    node gets ``task_start_s`` to start. ``also``: processes of those actors known
    otherwise (Ray's table may have dropped the entries of long-dead actors)."""
    if _client_mode():
        task = _wait_named_there.options(num_cpus=0, max_retries=0)
        ref = task.remote(prefix, timeout_s, list(also), task_start_s)
        try:
            return bool(ray.get(ref, timeout=timeout_s + 2 * task_start_s))
        except BaseException:
            try:
                ray.cancel(ref, force=True)  # not left looking in the background
            except Exception:  # noqa: BLE001 - ended meanwhile, or cannot be
                pass
            raise
    return _wait_named(prefix, timeout_s, also, task_start_s)


def _wait_named(
    prefix: str, timeout_s: float, also: Sequence[ActorProcess], start_s: float = PROBE_START_S
) -> bool:
    """:func:`wait_named_exited` on a node of the cluster: an actor of the name not yet
    placed (no process yet, not dead) is waited for until it is dead or has a process,
    else it counts as running (``start_s``: as :func:`wait_exited`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = processes_named(prefix, placed=True)
            break
        except ActorsNotPlaced:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_UNPLACED_POLL_S)
    return wait_exited(_together(found, also), max(0.0, deadline - time.monotonic()), start_s)


def _together(found: list[ActorProcess], also: Sequence[ActorProcess]) -> list[ActorProcess]:
    """``found`` and ``also``, each kept: one process may be in both, told apart there by
    different means (Ray's start time against a record's start ticks), and each must say
    it has exited."""
    listed = set(found)
    return found + [p for p in also if p not in listed]


def _client_mode() -> bool:
    try:
        from ray.util.client import ray as client

        return bool(client.is_connected())
    except Exception:  # noqa: BLE001 - a Ray without a client
        return False


@ray.remote(num_cpus=0, max_retries=0)
def _wait_named_there(
    prefix: str,
    timeout_s: float,
    also: Sequence[ActorProcess] = (),
    start_s: float = PROBE_START_S,
) -> bool:
    return _wait_named(prefix, timeout_s, also, start_s)


def wait_exited(
    processes: list[ActorProcess], timeout_s: float, start_s: float = PROBE_START_S
) -> bool:
    """Block (no event loop needed) until ``processes`` have exited; False when one still
    runs after ``timeout_s`` (a task that looks at processes on their node may take
    ``start_s`` more to start)."""
    if not processes:
        return True
    deadline = time.monotonic() + timeout_s

    async def every_node() -> bool:
        return all((await _exited_by_node(processes, deadline, start_s)).values())

    # in a thread of its own: the caller's thread may run an event loop (a notebook's)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, every_node()).result()
