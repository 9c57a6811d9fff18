"""The driver's wait() under a job master it cannot reach, without Ray: ``ray.get`` is
replaced by what it answers during a network partition."""

from __future__ import annotations

import time

import pytest
import ray

from rayflow import environment
from rayflow.environment import JobClient


class _Call:
    def remote(self, *args, **kwargs):
        return object()


class _UnreachableMaster:
    def __getattr__(self, name):
        return _Call()


def _client() -> JobClient:
    client = object.__new__(JobClient)
    client.job_name = "partitioned"
    client.job_id = "0123456789ab"
    client._result = None
    client._outcome = None
    client._run_ref = object()
    client._master = _UnreachableMaster()
    client._reporter = None
    client._output_lost = False
    client._unreachable_since = None
    client._takeover = environment.threading.Lock()
    return client


def test_wait_with_a_timeout_returns_in_time_while_the_job_master_is_unreachable(monkeypatch):
    """Schedule: the job master's node is cut off (every call answers
    ActorUnavailableError) while the driver waits with ``timeout=2``. Before: wait()
    retried every second without looking at its deadline, for up to
    MASTER_UNREACHABLE_S (60 s), and then took the job master over, instead of raising
    TimeoutError after 2 s as documented."""

    def unreachable(*args, **kwargs):
        raise ray.exceptions.ActorUnavailableError("the node is unreachable", None)

    monkeypatch.setattr(environment.ray, "get", unreachable)
    monkeypatch.setattr(environment, "MASTER_UNREACHABLE_S", 8.0)

    class TookOver(Exception):
        pass

    def take_over(self, ref, exc):
        raise TookOver(f"took the job master over after {time.monotonic() - started:.0f} s")

    monkeypatch.setattr(JobClient, "_take_over", take_over)
    client = _client()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="'partitioned'"):
        client.wait(timeout=2)
    assert time.monotonic() - started < 6


def test_waiting_in_short_slices_still_takes_an_unreachable_job_master_over(monkeypatch):
    """The time a job master has been unreachable counts across calls of wait(): a driver
    that waits in 2 s slices takes it over after MASTER_UNREACHABLE_S like one that waits
    without a timeout."""

    def unreachable(*args, **kwargs):
        raise ray.exceptions.ActorUnavailableError("the node is unreachable", None)

    class TookOver(Exception):
        pass

    def take_over(self, ref, exc):
        raise TookOver()

    monkeypatch.setattr(environment.ray, "get", unreachable)
    monkeypatch.setattr(environment, "MASTER_UNREACHABLE_S", 5.0)
    monkeypatch.setattr(JobClient, "_take_over", take_over)
    client = _client()
    slices = 0
    with pytest.raises(TookOver):
        while slices < 10:
            slices += 1
            try:
                client.wait(timeout=2)
            except TimeoutError:
                continue
    assert slices <= 4


def test_a_second_wait_after_a_failed_restart_of_the_job_master_does_not_restart_it(
    monkeypatch,
):
    """Schedule: the job master dies; the driver's restart of it fails (its run's state
    could not be read); the run is released (its job name free for a next run) and
    wait() raises. Before: a second wait() found the dead job master again and restarted
    it: a job master of a released run, beside whatever next run took the name."""

    def lost(*args, **kwargs):
        raise ray.exceptions.RayActorError()

    restarts: list[BaseException] = []

    def restart_master(self, exc):
        restarts.append(exc)
        raise environment.JobFailedError("job 'partitioned': reading its state failed")

    released: list[bool] = []
    monkeypatch.setattr(environment.ray, "get", lost)
    monkeypatch.setattr(JobClient, "_restart_master", restart_master)
    monkeypatch.setattr(JobClient, "_release", lambda self: released.append(True))
    client = _client()
    with pytest.raises(environment.JobFailedError, match="reading its state failed"):
        client.wait(timeout=5)
    assert len(restarts) == 1 and released == [True]
    with pytest.raises(environment.JobFailedError, match="reading its state failed"):
        client.wait(timeout=5)
    assert len(restarts) == 1, "a second wait() restarted the job master of a released run"


def test_a_thread_waiting_on_the_same_lost_job_master_does_not_restart_it_after_a_failure(
    monkeypatch,
):
    """Schedule: two threads wait on the same lost job master (one cancelling, say). The
    first one's restart fails and releases the run; the second then takes its turn at the
    takeover. Before: it restarted the job master of the released run."""
    restarts: list[str] = []

    def restart_master(self, exc):
        restarts.append(environment.threading.current_thread().name)
        raise environment.JobFailedError("job 'partitioned': reading its state failed")

    monkeypatch.setattr(JobClient, "_restart_master", restart_master)
    monkeypatch.setattr(JobClient, "_release", lambda self: None)
    client = _client()
    ref = client._run_ref
    lost = ray.exceptions.RayActorError()
    with pytest.raises(environment.JobFailedError):
        client._take_over(ref, lost)
    with pytest.raises(environment.JobFailedError, match="reading its state failed"):
        client._take_over(ref, lost)  # the second thread, after the first
    assert len(restarts) == 1


def test_an_unknown_answer_about_processes_is_a_failure_not_a_timeout(monkeypatch):
    """Schedule: a Ray Client driver's task that waits for a lost run's processes is not
    scheduled in time (``GetTimeoutError``, a ``TimeoutError``). Before: that became the
    run's outcome, which every later wait() raised as a timeout (so callers waited on)."""

    def unknown(prefix, timeout_s):
        raise ray.exceptions.GetTimeoutError("the task did not run")

    monkeypatch.setattr(environment.ray.util, "list_named_actors", lambda **kwargs: [])
    monkeypatch.setattr(environment, "wait_named_exited", unknown)
    monkeypatch.setattr(environment, "remove_job_placement_groups", lambda job_id: None)
    with pytest.raises(environment.JobFailedError, match="not known") as raised:
        environment._kill_job_actors("0123456789ab", timeout_s=1.0)
    assert not isinstance(raised.value, TimeoutError)


def _ended_client(monkeypatch, release_s: float = 0.0) -> tuple[JobClient, list[str]]:
    """A client whose run failed (``ray.get`` raises the failure), counting its releases
    and the end lines it shows; a release takes ``release_s``."""
    calls: list[str] = []

    def failed(*args, **kwargs):
        raise environment.JobFailedError("job 'partitioned' failed: boom")

    def release(self):
        calls.append("release")
        time.sleep(release_s)

    monkeypatch.setattr(environment.ray, "get", failed)
    monkeypatch.setattr(JobClient, "_release", release)
    monkeypatch.setattr(JobClient, "_report_end", lambda self, detail="": calls.append("end"))
    monkeypatch.setattr(JobClient, "_print_output", lambda self, output=None: None)
    monkeypatch.setattr(JobClient, "failure_history", lambda self: [])
    client = _client()
    client._failure = None
    client._state = None
    client._ending = None
    client._end = environment.threading.Lock()
    return client, calls


def test_a_second_wait_after_a_failure_raises_it_without_releasing_or_reporting_again(
    monkeypatch,
):
    """Schedule: the run fails and its actors cannot be stopped, so a thread of the driver
    holds the release while it tries again (up to a minute). Before: a second wait()
    asked the job master again, waited behind that thread to release once more, and
    showed the end line a second time."""
    client, calls = _ended_client(monkeypatch)
    with pytest.raises(environment.JobFailedError, match="boom"):
        client.wait(timeout=5)
    assert calls == ["release", "end"]
    monkeypatch.setattr(JobClient, "_release", lambda self: pytest.fail("released again"))
    with pytest.raises(environment.JobFailedError, match="boom"):
        client.wait(timeout=5)
    assert calls == ["release", "end"], "the end was handled twice"
    assert client._state is environment.JobState.FAILED


def test_two_threads_that_see_the_failure_at_once_handle_its_end_once(monkeypatch):
    """Schedule: two threads wait(); both see the failure; the first is slow to release.
    Both raise it once the run is released; the end line is shown once."""
    client, calls = _ended_client(monkeypatch, release_s=0.3)
    raised: list[BaseException] = []

    def waiter():
        try:
            client.wait(timeout=5)
        except BaseException as exc:  # noqa: BLE001 - what each thread raised
            raised.append(exc)

    threads = [environment.threading.Thread(target=waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(raised) == 2 and all(isinstance(e, environment.JobFailedError) for e in raised)
    assert calls == ["release", "end"], calls


def test_waiting_again_and_again_after_a_failure_does_not_grow_its_traceback(monkeypatch):
    """A poll loop of ``wait(timeout=1)`` after the end raised one exception object again
    and again, each raise adding its frames to that object's traceback."""
    client, _ = _ended_client(monkeypatch)
    depths = []
    for _ in range(50):
        with pytest.raises(environment.JobFailedError) as info:
            client.wait(timeout=1)
        depth, tb = 0, info.value.__traceback__
        while tb is not None:
            depth, tb = depth + 1, tb.tb_next
        depths.append(depth)
    assert max(depths[1:]) <= depths[1] + 1, depths[:5] + depths[-3:]
