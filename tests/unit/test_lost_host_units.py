"""A detached job's host keeping its job name while processes of the run's actors may
still run, without Ray: a restarted host cleaning up after its lost predecessor, and a
host whose run ended with its actors not seen to stop."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from rayflow import detached, environment
from rayflow.errors import JobCancelledError, JobFailedError
from rayflow.runtime import run_lock
from rayflow.status import JobState

pytestmark = pytest.mark.timeout(60)

Host = detached.JobHost


def _host() -> Host:
    host = object.__new__(Host)
    host.name = "lost-host"
    host.job_id = "0123456789ab"
    host.run_id = "run-1"
    host._client = None
    host._error = "its job host was lost"
    host._summary = None
    host._state = JobState.FAILING
    host._ended_at = None
    host._started = threading.Event()
    host._ended = threading.Event()
    host._lock = threading.Lock()
    return host


class _Locks:
    """Records what is taken and released of the run lock."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[str] = []
        monkeypatch.setattr(run_lock, "acquire_run_lock", self.acquire)
        monkeypatch.setattr(run_lock, "release_run_lock", self.release)
        monkeypatch.setattr(run_lock, "release_run_lock_held_by", self.release_held_by)

    def acquire(self, name, run_id):
        self.events.append(f"take {name} {run_id}")
        return "lock"

    def release(self, lock):
        self.events.append(f"release {lock}")

    def release_held_by(self, name, run_id):
        self.events.append(f"release held by {run_id}")


class _KeptClient:
    """A run's client whose actors stop only after ``tries`` more tries."""

    def __init__(self, tries: int, ends_with: BaseException | None = None) -> None:
        self.tries = tries
        self.ends_with = ends_with
        self.holds_job_name = True

    def wait(self):
        if self.ends_with is not None:
            raise self.ends_with
        return None

    def release_stopped(self) -> bool:
        self.tries -= 1
        if self.tries <= 0:
            self.holds_job_name = False
        return not self.holds_job_name

    def get_job_status(self, timeout=None):
        return JobState.FAILED

    def watched(self, host: Host) -> list[tuple[JobState, bool]]:
        """What ``host`` shows (state, ended) at each of its tries to release."""
        seen: list[tuple[JobState, bool]] = []
        release = self.release_stopped

        def release_stopped() -> bool:
            seen.append((host._state, host._ended.is_set()))
            return release()

        self.release_stopped = release_stopped
        return seen


def test_a_restarted_host_holds_the_job_name_while_actors_of_the_lost_run_still_run(
    monkeypatch,
):
    """Schedule: a job host dies; Ray restarts it; its kill of the lost run's actors
    finds processes that do not exit. Before: the host released the name and showed the
    job ended (so a resubmission replaced it at once): a next run could start beside
    processes of this one that still write. Now the lost host's lock record, which names
    the job, stays (no run takes it while the job's processes run: see
    ``test_run_lock_survivors``), the host shows the job FAILING (not ended: it cannot be
    removed or replaced) and keeps trying; once they are gone it releases the record and
    shows FAILED."""
    gone = threading.Event()
    kills: list[float] = []

    def kill(job_id, timeout_s=30.0):
        kills.append(time.monotonic())
        if not gone.is_set():
            raise JobFailedError(f"job {job_id}: processes of its actors still run")

    locks = _Locks(monkeypatch)
    monkeypatch.setattr(environment, "_kill_job_actors", kill)
    monkeypatch.setattr(detached, "LOST_ACTORS_RETRY_S", 0.05)
    host = _host()
    worker = threading.Thread(
        target=host._clean_up_lost, args=(object(), SimpleNamespace(checkpointing=True))
    )
    worker.start()
    time.sleep(0.4)
    assert locks.events == []
    assert not host._ended.is_set() and host._state is JobState.FAILING
    assert "could not all be stopped" in host._error and "stays locked" in host._error
    assert len(kills) >= 3  # it keeps trying
    gone.set()
    worker.join(10)
    assert locks.events == ["release held by run-1"]
    assert host._ended.is_set() and host._state is JobState.FAILED


def test_a_lost_run_whose_actors_are_stopped_is_cleaned_up(monkeypatch):
    calls: list[str] = []
    locks = _Locks(monkeypatch)
    monkeypatch.setattr(environment, "_kill_job_actors", lambda job_id: calls.append("kill"))
    monkeypatch.setattr(
        environment,
        "start_lost_run_clean_up",
        lambda *run: _KeptClient(0, JobCancelledError("cleaned up")),
    )
    monkeypatch.setattr(detached, "_recorded_end", lambda settings: None)
    host = _host()
    host._clean_up_lost(object(), SimpleNamespace(checkpointing=True))
    assert calls == ["kill"] and locks.events == []
    assert host._state is JobState.FAILED and host._ended.is_set()
    assert "cleaned up as a cancel is" in host._error


def test_a_clean_up_whose_actors_do_not_stop_keeps_the_job_name(monkeypatch):
    """Schedule: the restarted host's clean-up (a job master that only cleans up) ends,
    but its own actors are not seen to exit, so its client keeps the job name. Before:
    the host released the name anyway (``release_run_lock_held_by``) and showed the job
    ended. Now it shows it FAILING until the client has released the name."""
    locks = _Locks(monkeypatch)
    client = _KeptClient(3, JobCancelledError("cleaned up"))
    monkeypatch.setattr(environment, "_kill_job_actors", lambda job_id: None)
    monkeypatch.setattr(environment, "start_lost_run_clean_up", lambda *run: client)
    monkeypatch.setattr(detached, "_recorded_end", lambda settings: None)
    monkeypatch.setattr(detached, "LOST_ACTORS_RETRY_S", 0.05)
    host = _host()
    seen = client.watched(host)
    host._clean_up_lost(object(), SimpleNamespace(checkpointing=True))
    assert seen == [(JobState.FAILING, False)] * 3
    assert locks.events == []  # the client releases its own lock, once stopped
    assert host._state is JobState.FAILED and host._ended.is_set()


def test_a_run_that_ends_with_actors_still_running_is_not_shown_ended(monkeypatch):
    """Schedule: a detached run fails; its client's release finds processes of its actors
    still running and keeps the job name. Before: the host showed the job FAILED (ended),
    so ``rayflow jobs remove`` or a resubmission killed the host, and the lock with it,
    beside those processes. Now it shows FAILING until the name is released."""
    client = _KeptClient(2, JobFailedError("job 'lost-host' failed: a subtask failed"))
    monkeypatch.setattr(environment, "start_run", lambda *args: client)
    monkeypatch.setattr(Host, "_refresh", lambda self: None)
    monkeypatch.setattr(detached, "LOST_ACTORS_RETRY_S", 0.05)
    host = _host()
    states = client.watched(host)
    host._run(object(), SimpleNamespace(), None, None, False)
    assert states == [(JobState.FAILING, False)] * 2
    assert host._state is JobState.FAILED and host._ended.is_set()
