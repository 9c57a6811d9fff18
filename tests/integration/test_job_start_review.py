"""Review tests of the run lock held from its actor's registration, before its process
runs: a lock whose process dies while starting, or is killed while its run goes on,
still refuses a second run of the job name (Ray keeps a dead owned actor's name while
its owner holds the handle); once released, the name is free again at once."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import ray

import rayflow.runtime.run_lock as run_lock
from rayflow.errors import ConcurrentRunError
from rayflow.runtime.run_lock import acquire_run_lock, release_run_lock


def _job_name(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@ray.remote(num_cpus=0, max_restarts=0)
class _DiesWhileStarting:
    """A lock whose process goes away before it ever answers."""

    def __init__(self, run_id: str) -> None:
        os._exit(1)

    def holder(self) -> str:
        return "never"


def test_a_lock_whose_process_dies_while_starting_still_refuses_a_second_run(monkeypatch):
    job = _job_name("dies-starting")
    monkeypatch.setattr(run_lock, "_RunLock", _DiesWhileStarting)
    first = acquire_run_lock(job, "run-first")  # returns before its process ran
    monkeypatch.undo()
    time.sleep(2)  # its process is gone by now
    try:
        with pytest.raises(ConcurrentRunError):
            acquire_run_lock(job, "run-second")
    finally:
        release_run_lock(first)
    second = acquire_run_lock(job, "run-second")  # released: taken again
    release_run_lock(second)


def test_a_lock_killed_while_its_run_goes_on_still_refuses_a_second_run():
    job = _job_name("killed")
    first = acquire_run_lock(job, "run-first")
    pid = ray.get(first.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    try:
        with pytest.raises(ConcurrentRunError):
            acquire_run_lock(job, "run-second")
    finally:
        release_run_lock(first)
    second = acquire_run_lock(job, "run-second")
    release_run_lock(second)


def test_the_same_driver_takes_the_lock_again_right_after_releasing_it():
    job = _job_name("rerun")
    for i in range(10):
        lock = acquire_run_lock(job, f"run-{i}")
        if i % 2:
            assert ray.get(lock.holder.remote()) == f"run-{i}"  # started, or not yet
        release_run_lock(lock)
