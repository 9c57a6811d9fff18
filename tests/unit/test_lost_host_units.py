"""A restarted detached job host cleaning up after its lost predecessor, without Ray:
what it does while the lost run's actors cannot all be stopped."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from rayflow import detached, environment
from rayflow.errors import JobFailedError
from rayflow.runtime import run_lock
from rayflow.status import JobState

pytestmark = pytest.mark.timeout(60)

Host = detached.JobHost.__ray_metadata__.modified_class


def _host() -> Host:
    host = object.__new__(Host)
    host.name = "lost-host"
    host.job_id = "0123456789ab"
    host.run_id = "run-1"
    host._error = "its job host was lost"
    host._state = JobState.FAILING
    host._ended_at = None
    host._ended = threading.Event()
    host._lock = threading.Lock()
    return host


def test_the_job_name_stays_locked_while_actors_of_the_lost_run_still_run(monkeypatch):
    """Schedule: a job host dies; Ray restarts it; its kill of the lost run's actors
    finds processes that do not exit (a subtask stuck in a native call). Before: the host
    released the job name's lock anyway, so a next run of the name could start beside
    processes of this one that still write. Now the lock stays until they are gone (the
    host keeps checking), and the host shows the job FAILED meanwhile."""
    gone = threading.Event()
    kills: list[float] = []

    def kill(job_id, timeout_s=30.0):
        kills.append(time.monotonic())
        if not gone.is_set():
            raise JobFailedError(f"job {job_id}: processes of its actors still run")

    released: list[tuple[str, str]] = []
    monkeypatch.setattr(environment, "_kill_job_actors", kill)
    monkeypatch.setattr(
        run_lock, "release_run_lock_held_by", lambda name, run: released.append((name, run))
    )
    monkeypatch.setattr(detached, "LOST_ACTORS_RETRY_S", 0.05)
    host = _host()
    settings = SimpleNamespace(checkpointing=True)
    worker = threading.Thread(target=host._clean_up_lost, args=(object(), settings), daemon=True)
    worker.start()
    assert host._ended.wait(10)
    assert host._state is JobState.FAILED
    assert "could not all be stopped" in host._error and "stays locked" in host._error
    time.sleep(0.3)
    assert released == [], "the job name was released while the lost run's actors still ran"
    assert len(kills) >= 3  # it keeps trying
    gone.set()
    worker.join(10)
    assert not worker.is_alive()
    assert released == [("lost-host", "run-1")]


def test_a_lost_run_whose_actors_are_stopped_is_cleaned_up_and_released(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(environment, "_kill_job_actors", lambda job_id: calls.append("kill"))
    monkeypatch.setattr(environment, "clean_up_lost_run", lambda *run: calls.append("clean up"))
    monkeypatch.setattr(detached, "_recorded_end", lambda settings: None)
    monkeypatch.setattr(
        run_lock, "release_run_lock_held_by", lambda name, run: calls.append("release")
    )
    host = _host()
    host._clean_up_lost(object(), SimpleNamespace(checkpointing=True))
    assert calls == ["kill", "clean up", "release"]
    assert host._state is JobState.FAILED and host._ended.is_set()
    assert "cleaned up as a cancel is" in host._error
