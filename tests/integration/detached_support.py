"""What the detached-job tests look at: the cluster's named actors of a job, the run
lock of a job name, part files, and waiting for a condition."""

from __future__ import annotations

import os
import time

import ray

from rayflow.runtime.run_lock import run_lock_holder

__all__ = ["until", "job_actors", "run_lock_held", "in_progress"]


def until(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    """``predicate()``'s first truthy answer; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def job_actors(job_id: str) -> list[str]:
    """Names of the job's subtask and job master actors still alive."""
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"rayflow:{job_id}:")
    ]


def run_lock_held(name: str) -> bool:
    return run_lock_holder(name) is not None


def in_progress(directory) -> list[str]:
    """A FileSink directory's hidden (in-progress or pending) files."""
    return [n for n in os.listdir(directory) if n.startswith(".")]
