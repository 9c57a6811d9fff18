"""Detached jobs on the suite's Ray, driven through the ``rayflow`` command as a user
would: a driver process submits with ``run --detach`` and exits; the job runs on; other
processes list it, refuse a second submission of its name, cancel it (subtasks dead, run
lock released, the file sink's open transactions aborted, placement group removed), show
the cancelled job, replace it by a new submission of its name, cancel and remove that."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import ray

from rayflow.runtime.placement import job_placement_groups
from rayflow.status import JobState
from tests.integration.detached_support import in_progress as _in_progress
from tests.integration.detached_support import job_actors as _job_actors
from tests.integration.detached_support import run_lock_held as _run_lock_held
from tests.integration.detached_support import until


def _until(predicate, timeout_s: float, what: str):
    return until(predicate, timeout_s, what, poll_s=0.5)


JOB = """
import sys
from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from sinks.files import FileSink

out, chk, name = sys.argv[1:4]
env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
env.enable_checkpointing(200)
env.get_checkpoint_config().set_checkpoint_storage(chk)
(
    env.from_source(
        NumberSequenceSource(0, 10**9, batch_size=200, records_per_second=4000), "numbers"
    )
    .map(lambda r: {"value": r["value"], "twice": 2 * r["value"]}, name="twice")
    .sink_to(FileSink(out), name="files")
)
env.execute(name)
print("not reached: a detached execute() stops the script")
"""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rayflow(*args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-m", "rayflow.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _committed(directory) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return [n for n in os.listdir(directory) if not n.startswith(".")]


def _host_there(name: str) -> bool:
    try:
        ray.get_actor(name, namespace="rayflow-jobs")
        return True
    except ValueError:
        return False


def test_a_detached_job_outlives_its_driver_and_cancels_cleanly(tmp_path):
    address = ray.get_runtime_context().gcs_address
    name = f"detached-{time.time_ns()}"
    out, chk = tmp_path / "out", tmp_path / "chk"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    job_args = [str(script), str(out), str(chk), name]

    submitted = _rayflow("run", "--detach", "--address", address, *job_args)
    assert submitted.returncode == 0, submitted.stderr
    assert f"job {name!r} submitted detached" in submitted.stdout
    assert "not reached" not in submitted.stdout
    job_id = re.search(r"job id (\w+)", submitted.stdout).group(1)
    run_id = re.search(r"run ([\w-]+)\)", submitted.stdout).group(1)
    try:
        # the submitting driver has exited; the job runs on and commits output
        _until(lambda: _committed(out), 120, "committed part files after the driver exited")
        listed = _until(
            lambda: (
                (r := _rayflow("jobs", "list", "--address", address))
                and re.search(rf"{name}\s+RUNNING", r.stdout)
                and r
            ),
            120,
            "the job listed RUNNING",
        )
        assert listed.returncode == 0
        checkpoints = _rayflow("jobs", "checkpoints", name, "--address", address)
        assert checkpoints.returncode == 0 and "COMPLETED" in checkpoints.stdout

        # a second detached run of the name is refused; the first one runs on
        again = _rayflow("run", "--detach", "--address", address, *job_args)
        assert again.returncode == 1
        assert "is RUNNING" in again.stderr and "rayflow jobs cancel" in again.stderr
        status = _rayflow("jobs", "status", name, "--address", address)
        assert status.returncode == 0 and f"job {name!r}: RUNNING" in status.stdout
        assert f"job id {job_id}" in status.stdout

        removed_live = _rayflow("jobs", "remove", name, "--address", address)
        assert removed_live.returncode == 2 and "still running" in removed_live.stderr

        assert job_placement_groups(job_id)
        cancelled = _rayflow("jobs", "cancel", name, "--address", address)
        assert cancelled.returncode == 0, cancelled.stderr
        assert "CANCELED" in cancelled.stdout
        # cleaned up as a cancel is: every subtask and job master actor gone, the
        # placement group removed, the run lock released, no open transaction left
        assert _until(
            lambda: not _job_actors(job_id) and not job_placement_groups(job_id),
            30,
            "the job's actors and placement group to go",
        )
        assert not _run_lock_held(name)
        assert _in_progress(out) == []
        assert _committed(out)

        # the ended job stays inspectable until it is removed or its name submitted again
        status = _rayflow("jobs", "status", name, "--address", address)
        assert status.returncode == 1 and f"job {name!r}: CANCELED" in status.stdout
        again = _rayflow("run", "--detach", "--address", address, *job_args)
        assert again.returncode == 0, again.stderr
        assert "replaces the ended job of that name" in again.stdout
        assert f"run {run_id}, CANCELED" in again.stdout
        status = _rayflow("jobs", "status", name, "--address", address)
        assert f"job {name!r}: RUNNING" in status.stdout or "CREATED" in status.stdout
        assert run_id not in status.stdout
        cancelled = _rayflow("jobs", "cancel", name, "--address", address)
        assert cancelled.returncode == 0, cancelled.stderr
        removed = _rayflow("jobs", "remove", name, "--address", address)
        assert removed.returncode == 0, removed.stderr
        assert _until(lambda: not _host_there(name), 30, "the job host to go")
        listed = _rayflow("jobs", "list", "--address", address)
        assert name not in listed.stdout
    finally:
        if _host_there(name):
            host = ray.get_actor(name, namespace="rayflow-jobs")
            try:
                ray.get(host.cancel.remote(60), timeout=90)
            finally:
                ray.kill(host, no_restart=True)


def test_a_detached_run_needs_a_cluster_address(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    refused = _rayflow("run", "--detach", str(script), "a", "b", "c")
    assert refused.returncode == 2 and "--detach needs a running Ray cluster" in refused.stderr


def _named(prefix: str) -> list[tuple[str, str]]:
    return [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    ]


def _kill_named(prefix: str) -> None:
    name, namespace = _named(prefix)[0]
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)


def test_a_detached_job_restarts_and_survives_its_job_master_after_the_driver_exited(tmp_path):
    """After the submitting driver exited: a killed subtask is restarted (new actors for a
    job whose driver is gone) and a killed job master is taken over by the job host."""
    from rayflow import detached

    address = ray.get_runtime_context().gcs_address
    name = f"detached-restarts-{time.time_ns()}"
    out, chk = tmp_path / "out", tmp_path / "chk"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    submitted = _rayflow(
        "run", "--detach", "--address", address, str(script), str(out), str(chk), name
    )
    assert submitted.returncode == 0, submitted.stderr
    job = detached.find(name)
    try:
        _until(lambda: job.status()["state"] == "RUNNING" and job.checkpoints(), 120, "running")
        _kill_named(f"rayflow:{job.job_id}:v")  # a subtask
        _until(
            lambda: (s := job.status())["restarts"] >= 1 and s["state"] == "RUNNING",
            120,
            "the restarted attempt running",
        )
        _kill_named(f"rayflow:{job.job_id}:master:0")
        _until(lambda: _named(f"rayflow:{job.job_id}:master:1"), 120, "a new job master")
        _until(lambda: job.status()["state"] == "RUNNING", 120, "running after the takeover")
        before = len(_committed(out))
        _until(lambda: len(_committed(out)) > before, 120, "output after the takeover")
        assert job.cancel() is JobState.CANCELED
        assert _until(
            lambda: not _job_actors(job.job_id) and not job_placement_groups(job.job_id),
            30,
            "the job's actors and placement group to go",
        )
        assert not _run_lock_held(name)
        assert _in_progress(out) == []
        status = job.status()
        assert status["state"] == "CANCELED" and status["restarts"] >= 2
    finally:
        if _host_there(name):
            host = ray.get_actor(name, namespace="rayflow-jobs")
            try:
                ray.get(host.cancel.remote(60), timeout=90)
            finally:
                ray.kill(host, no_restart=True)


def test_a_finished_detached_job_shows_its_outcome_until_removed(tmp_path):
    from rayflow import NumberSequenceSource, StreamExecutionEnvironment
    from sinks.files import FileSink

    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(200)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    env.from_source(NumberSequenceSource(0, 19_999, batch_size=1000), "numbers").sink_to(
        FileSink(tmp_path / "out"), name="files"
    )
    name = f"detached-finished-{time.time_ns()}"
    job = env.execute_detached(name)
    try:
        assert job.wait(120) is JobState.FINISHED
        status = job.status()
        assert status["state"] == "FINISHED" and status["error"] is None
        assert status["records"]["numbers -> files"]["records_in"] == 20_000
        assert status["finished_at"] >= status["started_at"] > 0
        assert status["result"]["checkpoints_completed"] >= 1
        assert any(c["status"] == "COMPLETED" for c in job.checkpoints())
        assert not _run_lock_held(name) and _in_progress(tmp_path / "out") == []
        assert job.cancel() is JobState.FINISHED  # ended before: nothing to cancel
    finally:
        job.remove()
    assert _until(lambda: not _host_there(name), 30, "the job host to go")


def test_a_lost_job_host_of_a_job_whose_driver_exited_shows_it_failed(tmp_path):
    """The job host's process dies after the submitting driver exited: Ray restarts the
    host (its job is gone), which shows the job FAILED, nothing of it left running."""
    from rayflow import detached

    address = ray.get_runtime_context().gcs_address
    name = f"detached-host-lost-{time.time_ns()}"
    out, chk = tmp_path / "out", tmp_path / "chk"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    submitted = _rayflow(
        "run", "--detach", "--address", address, str(script), str(out), str(chk), name
    )
    assert submitted.returncode == 0, submitted.stderr
    job = detached.find(name)
    try:
        _until(lambda: job.status()["state"] == "RUNNING" and job.checkpoints(), 120, "running")
        ray.kill(job.host, no_restart=False)  # its process dies
        _until(
            lambda: _host_there(name) and detached.find(name).status()["state"] == "FAILED",
            60,
            "the job shown FAILED",
        )
        assert _until(
            lambda: not _job_actors(job.job_id) and not job_placement_groups(job.job_id),
            30,
            "the job's actors and placement group to go",
        )
        assert not _run_lock_held(name)
        status = _rayflow("jobs", "status", name, "--address", address)
        assert status.returncode == 1 and f"job {name!r}: FAILED" in status.stdout
        assert "job host was lost" in status.stdout
    finally:
        if _host_there(name):
            ray.kill(ray.get_actor(name, namespace="rayflow-jobs"), no_restart=True)
