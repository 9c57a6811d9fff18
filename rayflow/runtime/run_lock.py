"""One live run per job name on a Ray cluster.

Two runs of one job name at once would share what their sinks name after the job
(part files, upload keys, transaction prefixes) and abort each other's transactions as
lingering. So a run holds a lock for its job name: a small named actor in the
``rayflow`` namespace, owned by the driver (it goes when the driver goes; for a detached
job, by its job host, see :mod:`rayflow.detached`). A second
run of the same name fails fast, naming the run that holds it.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rayflow.errors import ConcurrentRunError

__all__ = [
    "ConcurrentRunError",
    "acquire_run_lock",
    "release_run_lock",
    "release_run_lock_held_by",
    "release_run_lock_of",
]

NAMESPACE = "rayflow"


@ray.remote(num_cpus=0, max_restarts=0)
class _RunLock:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def holder(self) -> str:
        return self.run_id


def _lock_name(job_name: str) -> str:
    return f"rayflow-run:{job_name}"


def acquire_run_lock(job_name: str, run_id: str):
    """Take the job name's lock for ``run_id``; raises :class:`ConcurrentRunError`.

    Creating a named actor registers its name with the GCS before ``.remote()`` returns
    (a taken name raises ``ValueError`` there), so the lock is held from that moment;
    its process starts in the background and nothing waits for it."""
    name = _lock_name(job_name)
    for _ in range(50):
        try:
            return _RunLock.options(name=name, namespace=NAMESPACE).remote(run_id)
        except ValueError:
            pass  # taken: by a live run, or by a dead holder whose name goes in a moment
        try:
            existing = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue  # released meanwhile
        try:
            holder = ray.get(existing.holder.remote(), timeout=10)
        except RayActorError:
            holder = None  # a dead holder: its name is released in a moment
        except GetTimeoutError:
            holder = "unknown: its lock did not answer within 10 s"  # taken, still starting
        if holder is not None:
            raise ConcurrentRunError(
                f"job {job_name!r} is already running (run {holder}); two runs of one job "
                "name would write the same sink transactions. Wait for it, cancel it, or "
                "run this one under another name."
            )
        time.sleep(0.1)
    raise ConcurrentRunError(f"job {job_name!r}: could not take its run lock")


def release_run_lock(lock) -> None:
    if lock is None:
        return
    try:
        ray.kill(lock, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


async def release_run_lock_of(job_name: str, run_id: str) -> None:
    """Release the job name's lock if ``run_id`` holds it (from an actor's event loop)."""
    import asyncio

    try:
        lock = ray.get_actor(_lock_name(job_name), namespace=NAMESPACE)
        if await asyncio.wait_for(lock.holder.remote(), timeout=10) == run_id:
            release_run_lock(lock)
    except Exception:  # noqa: BLE001 - no lock, or already going
        pass


def release_run_lock_held_by(job_name: str, run_id: str) -> None:
    """Release the job name's lock if ``run_id`` holds it (from a driver or a thread)."""
    try:
        lock = ray.get_actor(_lock_name(job_name), namespace=NAMESPACE)
        if ray.get(lock.holder.remote(), timeout=10) == run_id:
            release_run_lock(lock)
    except Exception:  # noqa: BLE001 - no lock, or already going
        pass
