"""Where a job's actors run, recorded in Ray's key-value store by each actor itself.

A run that ended (or whose process died) without seeing the processes of its actors
exit keeps its job name locked for as long as they may still write; whoever looks for
them later (a next run of the name, a driver's clean-up) cannot ask the actors any more.
Ray's actor table lists dead actors with their processes, but not for ever: it drops the
dead actors of a Ray job some minutes after that job (the driver) ended, and keeps a
bounded number of them. So every actor of a job (its job master and each subtask)
records its own process as it starts, before it can write anything
(:func:`record_this_process`; an actor that cannot record itself fails to start). A
record is one key, ``job-processes:<job id>:<node id>:<pid>:<start ticks>:<started
by>:<PID namespace>``, with the process's start as its node's kernel counts it (so a
later process with the same pid is never taken for it), for a node without ``/proc`` by
when it had started (this node's clock), and the PID namespace its pid is in (only a
process of that namespace looks at it by its pid; a record without one is of an
earlier version).

A record is dropped once its process is known to have exited: by the job master once
it killed that actor and saw its process exit, and by whoever looked for the processes
of a gone run and saw every one it read exit (:func:`forget_processes` deletes exactly
the records read). A record that cannot be read raises (after a few tries): never
taken as no process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.experimental import internal_kv

from rayflow.runtime.actor_exit import ActorProcess, this_process, wait_named_exited

__all__ = ["forget_processes", "record_processes", "record_this_process", "recorded_processes"]

NAMESPACE = "rayflow"
_PREFIX = "job-processes:"
#: How many times the records are read before their reader gives up, and the pause.
_TRIES = 3
_RETRY_S = 1.0


def _job_prefix(job_id: str) -> bytes:
    return f"{_PREFIX}{job_id}:".encode()


def _key(job_id: str, process: ActorProcess) -> bytes:
    ticks = "" if process.start_ticks is None else str(process.start_ticks)
    started_by = "" if process.started_by is None else str(int(process.started_by))
    key = f"{process.node_id}:{process.pid}:{ticks}:{started_by}"
    if process.pid_ns is not None:
        key += f":{process.pid_ns}"
    return _job_prefix(job_id) + key.encode()


def _parse(prefix: bytes, key: bytes) -> ActorProcess:
    node_id, pid, ticks, started_by, *pid_ns = key[len(prefix) :].decode().split(":")
    if len(pid_ns) > 1:
        raise ValueError(f"not a record of a process: {key!r}")
    return ActorProcess(
        node_id,
        int(pid),
        float(started_by) if started_by else None,
        int(ticks) if ticks else None,
        int(pid_ns[0]) if pid_ns and pid_ns[0] else None,
    )


def record_this_process() -> ActorProcess | None:
    """Record this actor's process under its job's id (from the actor's name,
    ``rayflow:<job id>:...``); None (nothing recorded) where this is no named rayflow
    actor. Raises where the store cannot be written: the actor must not start then."""
    try:
        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - not an actor (a driver, a test)
        return None
    parts = (name or "").split(":")
    if len(parts) < 3 or parts[0] != "rayflow" or not parts[1]:
        return None
    process = this_process()
    record_processes(parts[1], [process])
    return process


def record_processes(job_id: str, processes: Iterable[ActorProcess]) -> None:
    """Record ``processes`` as processes of job ``job_id``'s actors. Raises where the
    store cannot be written."""
    for process in processes:
        internal_kv._internal_kv_put(_key(job_id, process), b"1", namespace=NAMESPACE)


def recorded_processes(job_id: str) -> list[ActorProcess]:
    """The processes recorded for job ``job_id``'s actors (none when none were). Raises
    where the store cannot be read after a few tries."""
    prefix = _job_prefix(job_id)
    for attempt in range(_TRIES):
        try:
            keys = internal_kv._internal_kv_list(prefix, namespace=NAMESPACE)
            break
        except Exception:  # noqa: BLE001 - raised once the tries are spent
            if attempt + 1 == _TRIES:
                raise
            time.sleep(_RETRY_S)
    return [_parse(prefix, key) for key in keys]


#: How many times a look for a gone run's processes reads the records again after its
#: wait: an actor that a dying job master created meanwhile records itself before it can
#: write, and is waited for in the next round.
_ROUNDS = 10
#: The least time a round of that look gets (a process on another node is looked at by
#: a task, which needs a moment to start).
_MIN_ROUND_S = 1.0


def wait_recorded_exited(
    job_id: str,
    timeout_s: float,
    wait: Callable[..., bool] = wait_named_exited,
    **options: Any,
) -> list[ActorProcess] | None:
    """Wait for the processes of job ``job_id``'s actors, Ray's table's and the recorded
    ones (``wait``: :func:`~rayflow.runtime.actor_exit.wait_named_exited`, given
    ``options``), until a read of the records after a wait shows none it did not wait
    for. Returns the recorded processes it saw exit (to forget), or None when one still
    runs after ``timeout_s`` or records kept appearing. Raises where the records cannot
    be read or the processes cannot be looked at: never taken as exited."""
    deadline = time.monotonic() + timeout_s
    waited: list[ActorProcess] = []
    recorded = recorded_processes(job_id)
    for _ in range(_ROUNDS):
        # a round past the deadline still looks once, on every node
        left = max(_MIN_ROUND_S, deadline - time.monotonic())
        if not wait(f"rayflow:{job_id}:", left, recorded, **options):
            return None
        seen = set(waited)
        waited += [p for p in recorded if p not in seen]
        seen.update(recorded)
        recorded = recorded_processes(job_id)
        if seen.issuperset(recorded):
            return waited
    return None


def forget_processes(job_id: str, processes: Iterable[ActorProcess]) -> None:
    """Drop the records of ``processes`` (as :func:`recorded_processes` or the actors
    themselves gave them), which have exited; best effort: a record left names a process
    that has exited, which costs its reader one look."""
    for process in processes:
        try:
            internal_kv._internal_kv_del(_key(job_id, process), namespace=NAMESPACE)
        except Exception:  # noqa: BLE001 - left for a later reader, harmless
            pass
