"""Detached jobs when something goes wrong around their job host: the host's process
dies while the job runs, after it ended, or while it starts the job (run lock taken, job
master not up); its status is asked while the job master is being replaced; many callers
wait on it at once; two submissions overlap (of one name, or from two threads of one
driver). Each test drives a real detached job on the suite's Ray (submitted from this
process, which stays alive: so a placement group of the job is not removed by Ray on its
own)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from rayflow import NumberSequenceSource, RestartStrategies, StreamExecutionEnvironment, detached
from rayflow.errors import ConcurrentRunError
from rayflow.runtime.placement import job_placement_groups
from rayflow.status import JobState
from sinks.files import FileSink
from tests.integration.detached_support import job_actors as _job_actors
from tests.integration.detached_support import run_lock_held as _run_lock_held
from tests.integration.detached_support import until as _until


def _host(name: str):
    try:
        return ray.get_actor(name, namespace=detached.NAMESPACE)
    except ValueError:
        return None


def _forget(name: str) -> None:
    host = _host(name)
    if host is not None:
        try:
            ray.get(host.cancel.remote(60), timeout=90)
        except Exception:  # noqa: BLE001 - ended, lost or never started
            pass
        ray.kill(host, no_restart=True)


def _unbounded_env(tmp_path, sink=None) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(200)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    env.from_source(
        NumberSequenceSource(0, 10**9, batch_size=200, records_per_second=4000), "numbers"
    ).sink_to(sink or FileSink(tmp_path / "out"), name="files")
    return env


def _running_with_a_checkpoint(job) -> bool:
    return job.status()["state"] == "RUNNING" and any(
        c["status"] == "COMPLETED" for c in job.checkpoints()
    )


def test_a_lost_job_host_shows_its_job_failed_and_leaves_nothing_running(tmp_path):
    """The host's process dies while its job runs: the job is not silently gone from
    ``rayflow jobs`` (it shows FAILED, saying its host was lost, until it is removed), and
    it is cleaned up as a cancel is: no job master or subtask, no placement group, no run
    lock, no open transaction left (what completed checkpoints hold is committed)."""
    name = f"host-lost-{time.time_ns()}"
    job = _unbounded_env(tmp_path).execute_detached(name)
    try:
        _until(lambda: _running_with_a_checkpoint(job), 60, "the job running")
        assert job_placement_groups(job.job_id)
        submitted_at = job.status()["submitted_at"]
        ray.kill(job.host, no_restart=False)  # its process dies (as when killed by the OS)

        _until(lambda: not _job_actors(job.job_id), 30, "the job's actors to go")
        found = _until(
            lambda: (
                _host(name) is not None
                and (j := detached.find(name)).status()["state"] == "FAILED"
                and j
            ),
            30,
            "the job shown FAILED",
        )
        status = found.status()
        assert status["run_id"] == job.run_id and status["submitted_at"] == submitted_at
        out = tmp_path / "out"
        assert [n for n in os.listdir(out) if not n.startswith(".")]  # committed output
        assert [n for n in os.listdir(out) if n.startswith(".")] == []  # none left open
        assert "job host was lost" in status["error"]
        assert "open transactions aborted" in status["error"]
        assert found.cancel() is JobState.FAILED  # nothing to cancel
        assert not job_placement_groups(job.job_id)
        assert not _run_lock_held(name)
        # a resubmission of the name replaces the ended job's record and runs
        again = _unbounded_env(tmp_path).execute_detached(name)
        assert again.replaced is not None and again.replaced["run_id"] == job.run_id
        assert again.replaced["state"] == "FAILED"
        assert again.run_id != job.run_id
        assert again.status()["state"] in ("CREATED", "RUNNING")
        assert again.cancel() is JobState.CANCELED
        again.remove()
        _until(lambda: _host(name) is None, 30, "the job host to go")
    finally:
        _forget(name)


class _SlowSetupSink(FileSink):
    """A file sink whose set-up (run by the job host once it holds the run lock, before
    the job master starts) says it began and then takes its time."""

    def __init__(self, directory, marker) -> None:
        super().__init__(directory)
        self.marker = str(marker)

    def setup(self, job_name, guarantee=None) -> None:
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
        super().setup(job_name, guarantee)


def test_a_job_host_lost_while_it_starts_the_job_fails_the_submission_and_frees_the_name(
    tmp_path,
):
    name = f"host-lost-starting-{time.time_ns()}"
    marker = tmp_path / "setting-up"
    env = _unbounded_env(tmp_path, _SlowSetupSink(tmp_path / "out", marker))
    outcome: dict = {}

    def submit() -> None:
        try:
            outcome["job"] = env.execute_detached(name)
        except BaseException as exc:  # noqa: BLE001 - what the submitter is told
            outcome["error"] = exc

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    try:
        _until(lambda: marker.exists() and marker.read_text(), 60, "the host setting up")
        assert _run_lock_held(name)
        ray.kill(_host(name), no_restart=False)  # its process dies
        submitter.join(60)
        assert not submitter.is_alive()
        assert "job" not in outcome and "error" in outcome
        _until(lambda: _host(name) is None, 30, "the name free again")
        _until(lambda: not _run_lock_held(name), 30, "the run lock released")
        with pytest.raises(detached.NoSuchDetachedJob):
            detached.find(name)
    finally:
        _forget(name)


def test_status_says_restarting_while_the_job_master_is_replaced(tmp_path):
    """The job master is lost and the next one starts only after the restart delay: in
    between, the job is not shown RUNNING."""
    name = f"master-restarting-{time.time_ns()}"
    env = _unbounded_env(tmp_path)
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 8_000))
    job = env.execute_detached(name)
    try:
        _until(lambda: _running_with_a_checkpoint(job), 60, "the job running")
        ((master, namespace),) = [
            (a["name"], a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"] == f"rayflow:{job.job_id}:master:0"
        ]
        ray.kill(ray.get_actor(master, namespace=namespace), no_restart=True)
        _until(
            lambda: f"rayflow:{job.job_id}:master:0" not in _job_actors(job.job_id),
            30,
            "the job master gone",
        )
        status = job.status()
        assert status["state"] == "RESTARTING", status
        assert job.cancel() is JobState.CANCELED
        # cleaned up as any cancel: actors, placement group, run lock, open transactions
        assert not _job_actors(job.job_id) and not _run_lock_held(name)
        assert not job_placement_groups(job.job_id)
        assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".")]
        assert job.status()["state"] == "CANCELED"
    finally:
        _forget(name)


def test_a_finished_job_whose_host_is_lost_still_shows_finished(tmp_path):
    """The host of a job that had finished dies while it keeps the outcome: the job is not
    shown FAILED (nor gone), it shows the end its run recorded, FINISHED."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(200)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    env.from_source(NumberSequenceSource(0, 9_999, batch_size=1000), "numbers").sink_to(
        FileSink(tmp_path / "out"), name="files"
    )
    name = f"finished-host-lost-{time.time_ns()}"
    job = env.execute_detached(name)
    try:
        assert job.wait(60) is JobState.FINISHED
        ray.kill(job.host, no_restart=False)  # its process dies
        found = _until(
            lambda: (
                _host(name) is not None
                and (j := detached.find(name)).status()["state"] in ("FINISHED", "FAILED")
                and j
            ),
            30,
            "the job's outcome shown again",
        )
        status = found.status()
        assert status["state"] == "FINISHED", status
        assert "job host was lost" in status["error"]
        assert found.wait(1) is JobState.FINISHED
        found.remove()
    finally:
        _forget(name)


def test_a_cancelled_job_whose_host_is_lost_still_shows_cancelled(tmp_path):
    name = f"cancelled-host-lost-{time.time_ns()}"
    job = _unbounded_env(tmp_path).execute_detached(name)
    try:
        _until(lambda: _running_with_a_checkpoint(job), 60, "the job running")
        assert job.cancel() is JobState.CANCELED
        ray.kill(job.host, no_restart=False)  # its process dies
        found = _until(
            lambda: (
                _host(name) is not None
                and (j := detached.find(name)).status()["state"] in ("CANCELED", "FAILED")
                and j
            ),
            30,
            "the job's outcome shown again",
        )
        assert found.status()["state"] == "CANCELED"
        found.remove()
    finally:
        _forget(name)


class _GatedSetupSink(FileSink):
    """A file sink whose set-up (in the job host) waits until ``gate`` exists."""

    def __init__(self, directory, gate) -> None:
        super().__init__(directory)
        self.gate = str(gate)

    def setup(self, job_name, guarantee=None) -> None:
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        super().setup(job_name, guarantee)


def _bounded_env(tmp_path, tag: str, sink=None) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.from_source(NumberSequenceSource(0, 999, batch_size=100), "numbers").sink_to(
        sink or FileSink(tmp_path / f"out-{tag}"), name="files"
    )
    return env


def test_overlapping_detached_submissions_leave_later_runs_attached(tmp_path):
    """Two threads of one driver submit detached jobs; the first returns while the second
    still waits for its job to start. Afterwards an ``execute()`` of this driver runs the
    job here, as it always does, not detached."""
    gate = tmp_path / "go"
    first, second = f"overlap-a-{time.time_ns()}", f"overlap-b-{time.time_ns()}"
    handles: dict = {}

    def submit(name: str, env) -> None:
        try:
            handles[name] = env.execute_detached(name)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            handles[name] = exc

    a = threading.Thread(target=submit, args=(first, _bounded_env(tmp_path, "a")), daemon=True)
    b_env = _bounded_env(tmp_path, "b", _GatedSetupSink(tmp_path / "out-b", gate))
    b = threading.Thread(target=submit, args=(second, b_env), daemon=True)
    try:
        a.start()
        _until(lambda: _host(first) is not None, 60, "the first submission under way")
        b.start()
        _until(lambda: _host(second) is not None, 60, "the second submission under way")
        a.join(60)
        gate.write_text("go")
        b.join(60)
        assert isinstance(handles[first], detached.DetachedJob), handles[first]
        assert isinstance(handles[second], detached.DetachedJob), handles[second]
        assert handles[first].wait(60) is JobState.FINISHED
        assert handles[second].wait(60) is JobState.FINISHED

        result = _bounded_env(tmp_path, "c").execute(f"attached-{time.time_ns()}")
        assert result.records_in("numbers") == 1000
    finally:
        _forget(first)
        _forget(second)


def test_a_job_host_answers_status_and_cancel_while_many_wait_for_the_job(tmp_path):
    """Many callers wait for the job's end (``DetachedJob.wait``) at once: the host still
    answers ``status`` and carries out a cancel."""
    name = f"many-waiters-{time.time_ns()}"
    job = _unbounded_env(tmp_path).execute_detached(name)
    try:
        _until(lambda: _running_with_a_checkpoint(job), 60, "the job running")
        waiting = [job.host.wait.remote(60) for _ in range(40)]
        assert job.status(timeout_s=20)["state"] == "RUNNING"
        assert job.cancel() is JobState.CANCELED
        assert set(ray.get(waiting, timeout=30)) == {"CANCELED"}
        assert not _job_actors(job.job_id) and not _run_lock_held(name)
    finally:
        _forget(name)


def test_a_second_submission_of_a_name_while_the_first_starts_is_refused(tmp_path):
    """Two submissions of one name at once: while the first one's host starts the job
    (run lock taken, sinks being set up) the second is refused, naming the first."""
    gate = tmp_path / "go"
    name = f"same-name-{time.time_ns()}"
    handles: dict = {}

    def submit() -> None:
        env = _bounded_env(tmp_path, "a", _GatedSetupSink(tmp_path / "out-a", gate))
        try:
            handles["first"] = env.execute_detached(name)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            handles["first"] = exc

    first = threading.Thread(target=submit, daemon=True)
    try:
        first.start()
        _until(lambda: _run_lock_held(name), 60, "the first submission holding the run lock")
        with pytest.raises(ConcurrentRunError, match="is CREATED"):
            _bounded_env(tmp_path, "b").execute_detached(name)
        gate.write_text("go")
        first.join(60)
        job = handles["first"]
        assert isinstance(job, detached.DetachedJob), job
        assert job.wait(60) is JobState.FINISHED
        assert job.status()["records"]["numbers -> files"]["records_in"] == 1000
        assert os.listdir(tmp_path / "out-b") == []  # the refused one wrote nothing
    finally:
        _forget(name)


def test_a_job_shown_finished_can_be_removed_and_submitted_again_at_once(tmp_path):
    """FINISHED is shown once the job host has the run's outcome (its job master and
    actors gone, its run lock free): a user who sees it may remove the job and submit
    its name again at once."""

    def submit(out: str) -> detached.DetachedJob:
        env = StreamExecutionEnvironment.get_execution_environment()
        env.from_source(NumberSequenceSource(0, 999, batch_size=100), "numbers").sink_to(
            FileSink(tmp_path / out), name="files"
        )
        return env.execute_detached(name)

    name = f"finished-then-again-{time.time_ns()}"
    job = submit("first")
    try:
        state = job.status()["state"]
        while not JobState(state).is_terminal:  # the suite's timeout bounds the wait
            time.sleep(0.005)
            state = job.status()["state"]
        assert state == "FINISHED"
        job.remove()  # refused while the host has not ended
        again = submit("second")
        assert again.wait(60) is JobState.FINISHED
        again.remove()
    finally:
        _forget(name)


def test_two_resubmissions_of_an_ended_name_start_one_job_and_refuse_the_other(tmp_path):
    """Two submissions of the name of an ended job race: each sees the ended host and
    replaces it, but exactly one new job starts under the name (its handle says which run
    it replaced); the other is refused with what holds the name, and wrote nothing."""

    def env_for(out: str) -> StreamExecutionEnvironment:
        env = StreamExecutionEnvironment.get_execution_environment()
        env.from_source(
            NumberSequenceSource(0, 10**9, batch_size=200, records_per_second=2000), "numbers"
        ).sink_to(FileSink(tmp_path / out), name="files")
        return env

    name = f"replaced-twice-{time.time_ns()}"
    first = env_for("first")
    old = first.execute_detached(name)
    try:
        assert old.cancel() is JobState.CANCELED
        envs = {"a": env_for("out-a"), "b": env_for("out-b")}
        barrier = threading.Barrier(2)
        outcomes: dict[str, object] = {}

        def submit(tag: str) -> None:
            barrier.wait()
            try:
                outcomes[tag] = envs[tag].execute_detached(name)
            except ConcurrentRunError as exc:
                outcomes[tag] = exc

        threads = [threading.Thread(target=submit, args=(t,)) for t in envs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        started = {t: o for t, o in outcomes.items() if isinstance(o, detached.DetachedJob)}
        refused = {t: o for t, o in outcomes.items() if isinstance(o, ConcurrentRunError)}
        assert len(started) == 1 and len(refused) == 1, outcomes
        [(tag, job)] = started.items()
        [(other, error)] = refused.items()
        assert job.replaced is not None and job.replaced["run_id"] == old.run_id
        assert job.replaced["state"] == "CANCELED"
        assert name in str(error)
        found = detached.find(name)
        assert found.run_id == job.run_id
        assert found.status()["state"] in ("CREATED", "RUNNING")
        assert job.cancel() is JobState.CANCELED
        assert not os.path.exists(tmp_path / f"out-{other}") or not [
            n for n in os.listdir(tmp_path / f"out-{other}") if not n.startswith(".")
        ]
        job.remove()
    finally:
        _forget(name)


def test_a_resubmission_while_an_ended_jobs_host_restarts_never_kills_it_mid_clean_up(
    tmp_path,
):
    """The host of an ended job dies (Ray restarts it, and the restarted host cleans the
    run up again) just as the name is submitted again. The submission may hear the ended
    job from the dying process (then its kill lands on the restarting host, whose clean-up
    repeats what the ended run had already done) or from the restarted host once it has
    ended again; while it cleans up, the submission is refused, saying so (not that the job
    must be removed, which is refused too meanwhile). Either way the name ends up with
    exactly the new job, the replaced one shown with the end its run recorded, and nothing
    of the old job left."""
    name = f"replaced-while-restarting-{time.time_ns()}"
    old = _unbounded_env(tmp_path).execute_detached(name)
    try:
        _until(lambda: _running_with_a_checkpoint(old), 60, "the job running")
        assert old.cancel() is JobState.CANCELED
        ray.kill(old.host, no_restart=False)  # its process dies: Ray restarts it
        refusals = []
        while True:  # the suite's timeout bounds the loop
            try:
                job = _unbounded_env(tmp_path).execute_detached(name)
                break
            except ConcurrentRunError as exc:
                refusals.append(str(exc))
                time.sleep(0.05)
        assert job.replaced is not None and job.replaced["run_id"] == old.run_id
        assert job.replaced["state"] == "CANCELED", job.replaced
        for text in refusals:
            assert "remove it" not in text, text
        assert not job_placement_groups(old.job_id)
        assert job.status()["state"] in ("CREATED", "RUNNING")
        assert job.cancel() is JobState.CANCELED
        job.remove()
    finally:
        _forget(name)
