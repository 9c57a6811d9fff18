"""One live run per job name on a Ray cluster.

Two runs of one job name at once would share what their sinks name after the job
(part files, upload keys, transaction prefixes) and abort each other's transactions as
lingering. So a run holds a lock for its job name; a second run of the same name fails
fast, naming the run that holds it.

The lock is a record in Ray's internal key-value store (in the GCS), one key per
*generation* of the job name's lock: ``run-lock:<job name>:<generation>``, holding the
run's id and the name of its owner's *lock host*. A lock host is a small named actor,
one per process that takes locks (a driver, or a detached job's host), owned by that
process: Ray keeps its name registered for as long as its owner lives (also when the
host's own process died, since the owner holds its handle) and releases it when the
owner goes. A record is live while it is not marked released and its lock host's name
is registered; so a lock lives exactly as long as the process that took it, or until
it is released, and taking or refusing one never waits for any process to answer. A
lock host that Ray destroys (killed for good, or its creation failed) takes its name
along, as the earlier lock actor did; the process's next take makes a new one.

A record also names the run's job. A process can go while it holds its lock on purpose:
its run ended while processes of the run's actors were not seen to exit (the lock is kept
for as long as they might still write), or it died. Its lock host goes with it, so a
taker that finds a record not released whose host is gone looks for processes of that
job's actors (for ``SURVIVORS_CHECK_S``, and ``SURVIVORS_TASK_START_S`` for a task that
looks on a node to start) and refuses while any runs, or while that cannot be known.

Taking the lock: read the highest generation; when its record is live, refuse. Else
put generation + 1 only if absent (the store's one atomic step), then check that no
higher generation appeared meanwhile (a taker that read an old listing backs off).
The highest generation is never deleted, so generations only grow: a record below the
highest is never live again, and a taker deletes those once its own is the highest.
Releasing marks the run's own generation released (a late or repeated release touches
only its own generation). One small key (about 150 bytes) stays per job name ever run on
the cluster: deleting the highest generation would let a taker that read an old listing
win beside a live run.

A name held under the earlier run lock (a named actor ``rayflow-run:<job name>`` per run)
is refused too; a driver of that earlier version does not see these records, so runs
it starts on a cluster must not share job names with runs of this version.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass
from urllib.parse import quote

import ray
from ray.experimental import internal_kv

from rayflow.errors import ConcurrentRunError
from rayflow.runtime.actor_exit import wait_named_exited
from rayflow.runtime.job_processes import forget_processes, wait_recorded_exited

__all__ = [
    "ConcurrentRunError",
    "RunLock",
    "acquire_run_lock",
    "release_run_lock",
    "release_run_lock_held_by",
    "release_run_lock_of",
    "run_lock_holder",
]

NAMESPACE = "rayflow"
_KEY_PREFIX = "run-lock:"
_GENERATION_DIGITS = 20
_ATTEMPTS = 50
_RELEASE_PAUSES_S = (0.1, 0.5, 2.0, None)
#: how long a lock host's lookup that fails inside Ray is tried again
_LOOKUP_RETRY_S = 30.0
#: how long a taker waits for processes of a run whose process went without releasing
#: its lock (they were not seen to exit as it ended, or it died)
SURVIVORS_CHECK_S = 5.0
#: how long a task that looks for them may take to start (past that the taker refuses:
#: whether they run is not known): a Ray Client taker's task on the cluster, and the task
#: that looks on each node the taker cannot look at itself
SURVIVORS_TASK_START_S = 15.0


@dataclass(frozen=True)
class RunLock:
    """The job name's lock as ``run_id`` took it: its generation's key."""

    job_name: str
    run_id: str
    key: bytes


@dataclass(frozen=True)
class _Record:
    run_id: str
    host: str
    released: bool = False
    #: the run's job id: whose actors' processes to look for when its host is gone
    #: unreleased (None in records of earlier versions)
    job_id: str | None = None

    def encode(self) -> bytes:
        data: dict[str, object] = {
            "run_id": self.run_id,
            "host": self.host,
            "released": self.released,
        }
        if self.job_id is not None:
            data["job_id"] = self.job_id
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, raw: bytes) -> _Record:
        data = json.loads(raw)
        job_id = data.get("job_id")
        return cls(
            str(data["run_id"]),
            str(data["host"]),
            bool(data.get("released", False)),
            None if job_id is None else str(job_id),
        )


class _LockHost:
    """Nothing but a name tied to its owner's life."""

    def ready(self) -> bool:
        return True


#: The lock host as Ray's actor class. ``_LockHost`` itself stays a plain class of this module,
#: under its own name: Ray pickles it by reference (a name to import), and a process that
#: unpickles it (making a handle) never writes copies over its methods.
_RemoteLockHost = ray.remote(num_cpus=0, max_restarts=0)(_LockHost)


_host_guard = threading.Lock()
#: this process's lock host per Ray connection: its name and handle
_hosts: dict[tuple[str, str, str], tuple[str, object]] = {}
#: every lock host this process made, never dropped: a lock host whose last handle goes
#: is destroyed, and every lock naming it is free
_kept: list[object] = []


def _host_name() -> str:
    """The name of this process's lock host on its current Ray connection, made when there
    is none or when its name is gone (Ray destroyed it: killed, or its creation failed),
    so a record never names a host already gone. Creating a named actor registers the name
    before ``.remote()`` returns; its process starts in the background and nothing waits
    for it.

    A connection is told apart by its node's id too: a process that reconnects to a
    cluster restarted at the same address gets job id ``01000000`` (and the driver's
    worker id made from it) again. Ray client connections in several threads each have
    their own host."""
    context = ray.get_runtime_context()
    where = (str(context.gcs_address), str(context.get_job_id()), str(context.get_node_id()))
    with _host_guard:
        cached = _hosts.get(where)
        if cached is not None and _host_alive(cached[0]):
            return cached[0]
        name = f"rayflow-lock-host:{uuid.uuid4().hex}"
        # non-detached whatever the driver's default lifetime: the host (and so the
        # lock) goes with the process that took it
        handle = _RemoteLockHost.options(
            name=name, namespace=NAMESPACE, lifetime="non_detached"
        ).remote()
        _kept.append(handle)
        # registered before any record names it (Ray client mode creates actors
        # asynchronously: the lookup waits for the name)
        ray.get_actor(name, namespace=NAMESPACE)
        _hosts[where] = (name, handle)
        return name


def _host_alive(name: str) -> bool:
    """Whether the lock host's name is registered.

    Ray answers a lookup that failed (a connection to its control store that broke, for
    one) with the same ValueError as a name that is not registered, so "not found" is
    confirmed in Ray's list of named actors, which raises where the lookup failed and
    lists only actors that are not dead, before the host counts as gone.

    A lookup or listing that fails in another way says nothing about the host (right
    after a driver died, Ray can still hold its actor's name while its job's class data
    is gone already, and ``get_actor`` fails inside Ray): it is tried again, for up to
    ``_LOOKUP_RETRY_S``, never read as gone (that would hand a held lock to a second
    run), and then raised naming the host."""
    deadline = time.monotonic() + _LOOKUP_RETRY_S
    while True:
        try:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return _listed(name)  # its owner is gone, and with it the name, or not
        except Exception as exc:  # noqa: BLE001 - Ray's own failure: look again
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"run lock: looking up lock host {name!r} keeps failing "
                    f"({type(exc).__name__}: {exc}); whether its run lives is unknown"
                ) from exc
            time.sleep(0.2)
            continue
        return True


def _listed(name: str) -> bool:
    """Whether Ray lists ``name`` among the named actors that are not dead (raises when
    it cannot tell)."""
    return any(
        entry["name"] == name and entry["namespace"] == NAMESPACE
        for entry in ray.util.list_named_actors(all_namespaces=True)
    )


def _older_lock_holder(job_name: str) -> str | None:
    """The run holding the job name under rayflow's earlier run lock (a named actor per
    run), so a run of this version refuses a live run started by an earlier one."""
    try:
        ray.get_actor(f"rayflow-run:{job_name}", namespace=NAMESPACE)
    except ValueError:
        return None
    return "started by an earlier rayflow version"


def _prefix(job_name: str) -> bytes:
    return f"{_KEY_PREFIX}{quote(job_name, safe='')}:".encode()


def _key(prefix: bytes, generation: int) -> bytes:
    return prefix + str(generation).zfill(_GENERATION_DIGITS).encode()


def _generations(prefix: bytes) -> list[tuple[int, bytes]]:
    found = []
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
        tail = key[len(prefix) :]
        if tail.isdigit():
            found.append((int(tail), key))
    return sorted(found)


def _read(key: bytes) -> _Record | None:
    raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
    return None if raw is None else _Record.decode(raw)


def _live(record: _Record) -> bool:
    return not record.released and _host_alive(record.host)


def _refusal(job_name: str, holder: str) -> ConcurrentRunError:
    return ConcurrentRunError(
        f"job {job_name!r} is already running ({holder}); two runs of one job name would "
        "write the same sink transactions. Wait for it, cancel it, or run this one under "
        "another name."
    )


def acquire_run_lock(job_name: str, run_id: str, job_id: str | None = None) -> RunLock:
    """Take the job name's lock for ``run_id`` (of job ``job_id``); raises
    :class:`ConcurrentRunError` when a live run holds it, or when the process that took
    it went without releasing it while processes of that run's actors may still run
    (they are looked for for at most ``SURVIVORS_CHECK_S``)."""
    prefix = _prefix(job_name)
    mine = _Record(run_id, _host_name(), job_id=job_id).encode()
    older = _older_lock_holder(job_name)
    if older is not None:
        raise _refusal(job_name, f"a run {older}")
    for _ in range(_ATTEMPTS):
        generations = _generations(prefix)
        top = 0
        if generations:
            top, top_key = generations[-1]
            record = _read(top_key)
            if record is None:
                continue  # a taker that read an old listing backed off meanwhile
            if _live(record):
                raise _refusal(job_name, f"run {record.run_id}")
            if not record.released:
                _refuse_beside_survivors(job_name, record)
        key = _key(prefix, top + 1)
        lock = RunLock(job_name, run_id, key)
        if not _put_if_absent(key, mine):
            continue  # another run took this generation first: look again
        try:
            now = _generations(prefix)
            if now[-1][0] == top + 1:
                for _generation, below in now[:-1]:
                    _delete_quietly(below)  # never live again
                return lock
            # a higher generation appeared: this one was taken from an old listing
            _delete_quietly(key)
        except BaseException:
            release_run_lock(lock)  # a record that names this live process: free it
            raise
        time.sleep(0.01)
    raise ConcurrentRunError(f"job {job_name!r}: could not take its run lock")


def _refuse_beside_survivors(job_name: str, record: _Record) -> None:
    """The process that held ``record`` went without releasing it (it ended while its
    run's actors were not seen to stop, or it died): refuse while processes of that
    run's actors still run, or whether they do is not known."""
    if record.job_id is None:
        return  # a record of an earlier version: nothing to look for
    try:
        exited = wait_recorded_exited(
            record.job_id,
            SURVIVORS_CHECK_S,
            wait_named_exited,
            task_start_s=SURVIVORS_TASK_START_S,
        )
    except Exception as exc:  # noqa: BLE001 - not known: never taken as exited
        raise _survivors_refusal(
            job_name,
            record.run_id,
            f"whether processes of its actors still run is not known ({type(exc).__name__}: {exc})",
        ) from None
    if exited is None:
        raise _survivors_refusal(
            job_name,
            record.run_id,
            "processes of its actors still run (or could not be looked at within "
            f"{SURVIVORS_CHECK_S:g} s)",
        )
    forget_processes(record.job_id, exited)  # exited: nobody needs to look again


def _survivors_refusal(job_name: str, run_id: str, why: str) -> ConcurrentRunError:
    return ConcurrentRunError(
        f"job {job_name!r} cannot start yet: its run {run_id} ended without releasing the "
        f"job name, and {why}; they may still write to its sinks, which a run of the same "
        "name would share. Run it again once they have exited, stop them, or run this one "
        "under another name."
    )


def _put_if_absent(key: bytes, value: bytes) -> bool:
    """Put ``value`` under ``key`` unless the key exists; True when this put made it (also
    when a retried call found the value its own first try had put)."""
    if not internal_kv._internal_kv_put(key, value, overwrite=False, namespace=NAMESPACE):
        return True
    return internal_kv._internal_kv_get(key, namespace=NAMESPACE) == value


def _delete_quietly(key: bytes) -> None:
    try:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - a generation below the highest: harmless if left
        pass


def release_run_lock(lock: RunLock | None) -> None:
    """Release ``lock`` (its own generation only; repeating it does nothing more). A
    failed release is tried again: a record left live would hold the job name for as long
    as the process that took it lives."""
    if lock is None:
        return
    for pause in _RELEASE_PAUSES_S:
        try:
            record = _read(lock.key)
            if record is not None and record.run_id == lock.run_id and not record.released:
                released = _Record(record.run_id, record.host, released=True)
                internal_kv._internal_kv_put(lock.key, released.encode(), namespace=NAMESPACE)
            return
        except Exception:  # noqa: BLE001 - the GCS busy or restarting: again, or gone
            if pause is None or not ray.is_initialized():
                return
            time.sleep(pause)


def _holding(job_name: str, run_id: str) -> RunLock | None:
    generations = _generations(_prefix(job_name))
    if not generations:
        return None
    key = generations[-1][1]
    record = _read(key)
    if record is None or record.released or record.run_id != run_id:
        return None
    return RunLock(job_name, run_id, key)


def release_run_lock_held_by(job_name: str, run_id: str) -> None:
    """Release the job name's lock if ``run_id`` holds it (from a driver or a thread)."""
    try:
        release_run_lock(_holding(job_name, run_id))
    except Exception:  # noqa: BLE001 - no lock, or Ray is gone
        pass


async def release_run_lock_of(job_name: str, run_id: str) -> None:
    """Release the job name's lock if ``run_id`` holds it (from an actor's event loop)."""
    await asyncio.to_thread(release_run_lock_held_by, job_name, run_id)


def run_lock_holder(job_name: str) -> str | None:
    """The run that holds the job name's lock now, or None when it is free."""
    generations = _generations(_prefix(job_name))
    if not generations:
        return None
    record = _read(generations[-1][1])
    return record.run_id if record is not None and _live(record) else None
