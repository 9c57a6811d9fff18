"""Schedules against a job's status, its restart loop and its driver, on a real local Ray.

Each test is one schedule: which process is slow, dies or repeats itself, right after
which line, and what the job must still say and do:

- the driver's stderr or stdout is a closed pipe (``rayflow run job.py | head``) when the
  start line, a live line or the job's prints are written;
- a subtask's "running" report of a failed attempt reaches the job master late, during
  the restart delay;
- the job master is lost after it recorded the end of the run (CANCELED, FINISHED), before
  its reply reaches the driver;
- a sink answers that a commit can never succeed (its pre-committed data is gone);
- a completed checkpoint's commit is refused (PermissionError) for longer than the
  commit retries last, then accepted again.
"""

from __future__ import annotations

import errno
import io
import os
import sys
import time

import pytest
import ray

from rayflow import (
    JobFailedError,
    NumberSequenceSource,
    RestartStrategies,
    StreamExecutionEnvironment,
)
from rayflow.errors import JobCancelledError
from rayflow.runtime.run_lock import run_lock_holder
from rayflow.sink import CommitOutcome
from rayflow.status import JobState
from sinks.basic import CollectSink


def _until(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _status(client) -> dict:
    return ray.get(client._master.status.remote())


def _slow_job(tmp_path=None, strategy=None) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    if tmp_path is not None:
        env.enable_checkpointing(100)
        env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    if strategy is not None:
        env.set_restart_strategy(strategy)
    env.from_source(
        NumberSequenceSource(0, 10**9, batch_size=10, records_per_second=200), "Numbers"
    ).sink_to(CollectSink(), "Out")
    return env


class _BrokenPipe(io.TextIOBase):
    """A stream whose reader went away (``rayflow run job.py 2>&1 | head -1``)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def isatty(self) -> bool:
        return False


def _named_actors() -> set[str]:
    return {
        a["name"] if isinstance(a, dict) else a
        for a in ray.util.list_named_actors(all_namespaces=True)
    }


def _kill_named(names: set[str]) -> None:
    for name in names:
        try:
            ray.kill(ray.get_actor(name), no_restart=True)
        except Exception:  # noqa: BLE001 - gone, or in another namespace
            pass


def test_a_start_line_that_cannot_be_written_leaves_the_job_running_with_its_lock(
    tmp_path, monkeypatch
):
    """Schedule: progress is on (``rayflow run``) and the driver's stderr is a closed pipe.
    The start line is written right after the job master was started. Before: the write
    raised out of ``execute_async``, whose clean-up released the job name's run lock while
    the job master ran on, orphaned: a second run of the same name could then start beside
    it and abort its transactions as lingering. A display must never touch the job."""
    from rayflow import progress

    monkeypatch.setattr(sys, "stderr", _BrokenPipe())
    env = _slow_job(tmp_path)
    before = _named_actors()
    progress.enable()
    try:
        client = env.execute_async("broken-stderr")
    except BrokenPipeError:
        left = _named_actors() - before
        masters = sorted(n for n in left if ":master:" in n)
        holder = run_lock_holder("broken-stderr")
        _kill_named(left)
        pytest.fail(
            f"execute_async raised; job master(s) {masters} left running, run lock holder: {holder}"
        )
    finally:
        progress.enable(False)
    try:
        assert run_lock_holder("broken-stderr") == client.run_id
        _until(lambda: client.get_job_status() is JobState.RUNNING, what="RUNNING")
        with pytest.raises(TimeoutError):
            client.wait(timeout=1.5)  # polls, so tries to redraw and to print: no harm
    finally:
        assert client.cancel() is True


def _shout(record: dict) -> dict:
    print(f"saw {record['value']}")
    return record


def test_prints_that_cannot_be_shown_do_not_change_the_outcome(monkeypatch):
    """Schedule: the driver's stdout is a closed pipe when ``wait()`` prints what the job's
    functions printed. Before: the write raised out of ``wait()`` instead of its result,
    after the job had finished, and the job's actors were never released."""
    env = StreamExecutionEnvironment.get_execution_environment()
    sink = CollectSink()
    env.from_collection([{"value": v} for v in range(20)], "Values").map(_shout, "Shout").sink_to(
        sink, "Out"
    )
    monkeypatch.setattr(sys, "stdout", _BrokenPipe())
    result = env.execute("broken-stdout")
    monkeypatch.undo()
    assert sorted(result.sink_result(sink).column("value").to_pylist()) == list(range(20))


def test_a_late_running_report_of_a_failed_attempt_does_not_end_restarting(tmp_path):
    """Schedule: every subtask of attempt 0 reports "running" to the job master, but the
    reports reach it late (Ray keeps no order across callers): after a subtask's failure
    ended attempt 0 and the job master recorded it. Before: with no actors deployed the
    count of running subtasks (>= 0) made the job RUNNING during its restart delay."""

    def fail_at_100(record: dict) -> dict:
        if record["value"] == 100:
            raise ValueError("bad record 100")
        return record

    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(5, 60_000))
    env.from_source(
        NumberSequenceSource(0, 10**6, batch_size=10, records_per_second=500), "Numbers"
    ).map(fail_at_100, "Bad").sink_to(CollectSink(), "Out")
    client = env.execute_async("late-running-report")
    try:
        _until(lambda: _status(client)["failure_count"] >= 1, what="the first failure")
        assert client.get_job_status() is JobState.RESTARTING
        keys = [
            (v.vertex_id, index)
            for v in client._graph.vertices.values()
            for index in range(v.parallelism)
        ]
        ray.get([client._master.subtask_running.remote(0, key) for key in keys])
        assert _status(client)["attempt"] == 0  # still in the restart delay
        assert client.get_job_status() is JobState.RESTARTING
    finally:
        assert client.cancel() is True


def _recorded(client) -> JobState | None:
    """The state the job master wrote into the run's storage (what a takeover reads)."""
    state = client._settings.storage().read_job_state()
    return state.state if state is not None else None


def _lose_the_reply(client) -> None:
    """The job master's node goes now: its reply to ``run()`` never reaches the driver."""
    master = client._master
    ray.kill(master, no_restart=True)
    # Once it is dead: a call made before the kill took effect may still be answered,
    # and the driver would hold that answer instead of the lost reply.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(master.ready.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the job master was not dead 60 s after ray.kill")
    client._run_ref = master.ready.remote()  # what the driver holds: a dead actor's call


def test_a_job_master_lost_after_it_recorded_canceled_leaves_the_job_canceled(tmp_path):
    """Schedule: ``cancel()``; the job master cleans up and records CANCELED, then its node
    is lost (while it removes its placement group, say) before its reply reaches the
    driver. Before: the driver found the run ended and reported it FAILED ("its job
    master died"), and ``cancel()`` returned False, for a run cancelled and cleaned up."""
    client = _slow_job(tmp_path).execute_async("lost-after-cancel")
    _until(lambda: client.get_job_status() is JobState.RUNNING, what="RUNNING")
    client._cancel_requested = True  # what cancel() records before it asks the master
    ray.get(client._master.cancel.remote())
    _until(lambda: _recorded(client) is JobState.CANCELED, what="CANCELED recorded")
    _lose_the_reply(client)
    with pytest.raises(JobCancelledError):
        client.wait(timeout=60)
    assert client.get_job_status() is JobState.CANCELED


def test_a_job_master_lost_after_it_recorded_finished_is_no_failure(tmp_path):
    """Schedule: a bounded job finishes (its final checkpoint committed, FINISHED recorded),
    then its job master's node is lost before the reply reaches the driver. Before: the
    driver reported the job FAILED ("its job master died"): a rerun of a job whose output
    is complete and committed writes it all again. Its result (outputs, metrics) is lost
    with the job master, so ``wait()`` cannot return one, but it must not say FAILED."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.from_source(NumberSequenceSource(0, 99, batch_size=10), "Numbers").sink_to(
        CollectSink(), "Out"
    )
    client = env.execute_async("lost-after-finish")
    _until(lambda: _recorded(client) is JobState.FINISHED, what="FINISHED recorded")
    _lose_the_reply(client)
    with pytest.raises(Exception) as info:
        client.wait(timeout=60)
    assert not isinstance(info.value, JobFailedError), info.value
    assert "FINISHED" in str(info.value)
    assert client.get_job_status() is JobState.FINISHED


class _LostCommitSink(CollectSink):
    """A sink whose every commit answers FAILED: the pre-committed data is gone (a staging
    directory cleaned under the job, an upload expired by a lifecycle rule)."""

    def commit_outcome(self, committable, guarantee=None) -> CommitOutcome:
        return CommitOutcome.failed("pre-committed data lost: its staged file is gone")


def test_a_commit_the_sink_says_can_never_succeed_is_not_restarted_forever(tmp_path):
    """Schedule: checkpoint n completes; its notification's commit answers FAILED. Every
    restart restores checkpoint n and commits the same committable again, FAILED again.
    Before: the default (unbounded) restart strategy restarted forever, RUNNING and
    RESTARTING in turn; a FAILED commit is by the sink contract one no retry can fix."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.from_source(
        NumberSequenceSource(0, 10**6, batch_size=10, records_per_second=500), "Numbers"
    ).sink_to(_LostCommitSink(), "Out")
    client = env.execute_async("lost-commit")
    try:
        with pytest.raises(JobFailedError) as info:
            client.wait(timeout=120)  # a loop of restarts never ends; the clean-up does
    except BaseException:
        client.cancel()
        raise
    text = str(info.value)
    assert "no restart can fix it" in text, text
    assert "pre-committed data lost" in text
    assert info.value.failure_history[-1].recoverable is False


class _CommitDeniedForAWhile(CollectSink):
    """A sink whose target refuses commits for a while (an S3 bucket policy or credentials
    being rotated, an NFS server failing over): the first ``denials`` commit calls, counted
    in a file every process and attempt shares, raise PermissionError."""

    def __init__(self, counter: str, denials: int) -> None:
        super().__init__()
        self.counter = counter
        self.denials = denials

    def commit_outcome(self, committable, guarantee=None) -> CommitOutcome:
        with open(self.counter, "ab") as out:
            out.write(b"x")
        if os.path.getsize(self.counter) <= self.denials:
            raise PermissionError(errno.EACCES, "Access Denied", "s3://bucket/out/part-0")
        return super().commit_outcome(committable, guarantee)


def test_a_completed_checkpoint_whose_commit_is_refused_for_a_while_is_not_given_up(tmp_path):
    """Schedule: checkpoint n completes (its commit point is written); its commit is refused
    with PermissionError for longer than the commit retries last (7 tries, ~6 s). Before:
    the retried-out commit was classified by its cause, "permission denied", and the job
    failed at once, although its default strategy restarts forever: a completed
    checkpoint's output, which must become visible, was given up after seconds, left
    pre-committed for a rerun to sweep. A restart commits it once the target accepts
    commits again; the restart strategy bounds how long that is tried."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "ckpt"))
    sink = _CommitDeniedForAWhile(str(tmp_path / "commit-calls"), denials=10)
    env.from_source(
        NumberSequenceSource(0, 999, batch_size=10, records_per_second=500), "Numbers"
    ).sink_to(sink, "Out")
    client = env.execute_async("commit-denied-for-a-while")
    try:
        result = client.wait(timeout=120)
    except TimeoutError:
        client.cancel()
        raise
    assert sorted(result.sink_result(sink).column("value").to_pylist()) == list(range(1000))
    assert result.restarts >= 1
