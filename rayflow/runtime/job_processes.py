"""Where a job's actors run, recorded in Ray's key-value store while the job runs.

A run that ended (or whose process died) without seeing the processes of its actors
exit keeps its job name locked for as long as they may still write; whoever looks for
them later (a next run of the name, a driver's clean-up) cannot ask the actors any more.
Ray's actor table lists dead actors with their processes, but keeps a bounded number of
them: on a cluster that runs very many actors, the entry of a survivor can be dropped
before anyone looks. So the job master records each process of its actors as it learns
it (:func:`record_processes`), one key per process, ``job-processes:<job id>:<node
id>:<pid>``, holding by when (this process's clock, plus a slack for clocks that differ
between nodes) that process had started; a process with that pid that started later is
another one. The records of a job are dropped (:func:`forget_processes`) once its
processes are known to have exited. A record that cannot be read says so (it raises):
never taken as no process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from ray.experimental import internal_kv

from rayflow.runtime.actor_exit import STARTED_SLACK_S, ActorProcess

__all__ = ["forget_processes", "record_processes", "recorded_processes"]

NAMESPACE = "rayflow"
_PREFIX = "job-processes:"


def _job_prefix(job_id: str) -> bytes:
    return f"{_PREFIX}{job_id}:".encode()


def record_processes(job_id: str, processes: Iterable[ActorProcess]) -> None:
    """Record that ``processes`` (each as its actor said where it runs, just now) are
    processes of job ``job_id``'s actors. Raises where the store cannot be written."""
    started_by = time.time() + STARTED_SLACK_S
    for process in processes:
        key = _job_prefix(job_id) + f"{process.node_id}:{process.pid}".encode()
        value = json.dumps({"started_by": process.started_by or started_by}).encode()
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


def recorded_processes(job_id: str) -> list[ActorProcess]:
    """The processes recorded for job ``job_id``'s actors (none when none were).
    Raises where the store cannot be read."""
    prefix = _job_prefix(job_id)
    found = []
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw is None:
            continue  # forgotten meanwhile: its processes had exited
        node_id, _, pid = key[len(prefix) :].decode().rpartition(":")
        started_by = json.loads(raw).get("started_by")
        found.append(ActorProcess(node_id, int(pid), None if started_by is None else started_by))
    return found


def forget_processes(job_id: str) -> None:
    """Drop the records of job ``job_id`` (its processes have exited); best effort: a
    record left names a process that has exited, which costs its reader one look."""
    try:
        for key in internal_kv._internal_kv_list(_job_prefix(job_id), namespace=NAMESPACE):
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - left for a later reader, harmless
        pass
