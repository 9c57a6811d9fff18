"""Checkpointing on a real Ray without faults: stats, the final checkpoint, retained
checkpoints on disk, resuming a job from one, and `rayflow checkpoints`."""

from __future__ import annotations

import os
import time

import pytest

from rayflow import JobFailedError
from rayflow.cli import main as cli_main
from rayflow.config import CheckpointingMode
from rayflow.runtime.hooks import HookPoint, MasterHooks, RuntimeHooks, SubtaskHooks
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults, wait_for_checkpoints
from sinks.basic import CollectSink
from tests.chaos.harness import build_keyed_sum, expected_rows, expected_sums, outcome, unique_job

N = 200_000


@pytest.mark.parametrize("mode", [CheckpointingMode.EXACTLY_ONCE, CheckpointingMode.AT_LEAST_ONCE])
def test_periodic_and_final_checkpoints_are_recorded(mode, tmp_path):
    env, sink = build_keyed_sum(
        # 2.5 s of input: room for two periodic checkpoints even when each takes ~0.7 s
        N,
        2,
        5000,
        rate=40_000,
        checkpoint_ms=150,
        mode=mode,
        storage=str(tmp_path),
    )
    env.get_checkpoint_config().set_num_retained_checkpoints(2)
    job = unique_job("stats")
    result = env.execute(job)
    got = outcome(result, sink)
    assert got.sums == expected_sums(N)
    completed = result.completed_checkpoints
    assert len(completed) >= 3
    assert completed[-1]["final"] and not any(c["final"] for c in completed[:-1])
    ids = [c["checkpoint_id"] for c in completed]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for stats in completed:
        assert len(stats["subtasks"]) == 4  # two chained vertices x parallelism 2
        assert stats["size"] > 0 and stats["duration_s"] > 0
        for sub in stats["subtasks"].values():
            assert sub["alignment_s"] >= 0 and sub["sync_s"] >= 0
    if mode is CheckpointingMode.EXACTLY_ONCE:
        assert got.rows == expected_rows(N, 2, 5000)
        commits = result.commit_latencies("committed")
        assert commits and all(c["commit_s"] >= 0 and c["transactions"] >= 1 for c in commits)
        # commits follow checkpoints: none refers to a checkpoint that never completed
        # (the statistics keep the last 10 checkpoints: older commits are not checked)
        assert {c["checkpoint_id"] for c in commits if c["checkpoint_id"] >= ids[0]} <= set(ids)
    # retained: the two newest, each with its metadata, in this run's own directory
    run_dir = tmp_path / job / result.run_id
    assert result.checkpoint_location == str(run_dir)
    retained = sorted(
        (p.name for p in run_dir.iterdir() if p.name.startswith("chk-")),
        key=lambda name: int(name.removeprefix("chk-")),
    )
    assert retained == [f"chk-{i}" for i in ids[-2:]]
    assert all((run_dir / name / "_metadata").exists() for name in retained)


def test_resume_from_a_retained_checkpoint_of_a_cancelled_run(tmp_path, capsys):
    job = unique_job("resume")
    env, sink = build_keyed_sum(N, 2, 5000, rate=50_000, checkpoint_ms=100, storage=str(tmp_path))
    client = env.execute_async(job)
    assert wait_for_checkpoints(client, 2, timeout_s=30) >= 2
    client.cancel()
    with pytest.raises(JobFailedError, match="cancelled"):
        client.wait()

    assert cli_main(["checkpoints", str(tmp_path / job)]) == 0
    listing = capsys.readouterr().out
    # operators by name (the running sum's uid is running-sum, its name Sum)
    assert "        Sum " in listing and "numbers" in listing and "running-sum" not in listing

    env2, _ = build_keyed_sum(
        N, 2, 5000, rate=None, checkpoint_ms=100, storage=str(tmp_path), sink=sink
    )
    result = env2.execute(job, restore_from=str(tmp_path / job))
    assert result.restored_from is not None and result.restored_from >= 2
    got = outcome(result, sink)
    assert got.sums == expected_sums(N)
    assert got.rows == expected_rows(N, 2, 5000)


def test_restore_from_a_missing_checkpoint_is_a_clear_error(tmp_path):
    env, _ = build_keyed_sum(1000, 1, 100, storage=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no completed checkpoint"):
        env.execute_async("nothing-here", restore_from="latest")


class _SlowFirstPreCommit(CollectSink):
    """The first pre-commit of the job stalls (a marker file remembers it across
    attempts): the checkpoint it belongs to times out."""

    def __init__(self, stall_s: float, marker) -> None:
        super().__init__()
        self.stall_s = stall_s
        self.marker = str(marker)

    def pre_commit(self, transaction):
        if not os.path.exists(self.marker):
            time.sleep(self.stall_s)
            open(self.marker, "w").close()
        return super().pre_commit(transaction)


def test_a_checkpoint_that_times_out_is_aborted_and_later_ones_complete(tmp_path):
    sink = _SlowFirstPreCommit(stall_s=3.0, marker=tmp_path / "stalled")
    env, sink = build_keyed_sum(
        N, 2, 5000, rate=100_000, checkpoint_ms=100, storage=str(tmp_path), sink=sink
    )
    config = env.get_checkpoint_config()
    config.set_checkpoint_timeout(1500)
    config.set_tolerable_checkpoint_failure_number(5)
    config.set_checkpoint_history_size(1000)  # checkpoints every 100 ms: keep them all
    result = env.execute(unique_job("timeout"))
    failed = [c for c in result.checkpoints if c["status"] == "FAILED"]
    assert failed and "timed out after 1500 ms" in failed[0]["failure"]
    assert result.checkpoint_summary["counts"]["FAILED"] == len(failed)
    assert result.completed_checkpoints and result.restarts == 0
    got = outcome(result, sink)
    assert got.sums == expected_sums(N)
    assert got.rows == expected_rows(N, 2, 5000)


def test_too_many_failed_checkpoints_fail_the_attempt(tmp_path):
    sink = _SlowFirstPreCommit(stall_s=3.0, marker=tmp_path / "stalled")
    env, sink = build_keyed_sum(
        N, 2, 5000, rate=100_000, checkpoint_ms=100, storage=str(tmp_path), sink=sink
    )
    env.get_checkpoint_config().set_checkpoint_timeout(1500)  # 0 failures tolerated
    result = env.execute(unique_job("timeout-restart"))
    assert result.restarts >= 1
    assert "CheckpointFailureLimit" in result.failures[0]
    got = outcome(result, sink)
    assert got.sums == expected_sums(N)
    assert got.rows == expected_rows(N, 2, 5000)


def test_restoring_an_older_checkpoint_never_reuses_a_newer_ones_id(tmp_path):
    job = unique_job("older")
    env, sink = build_keyed_sum(N, 2, 5000, rate=50_000, checkpoint_ms=100, storage=str(tmp_path))
    env.get_checkpoint_config().set_num_retained_checkpoints(10)
    client = env.execute_async(job)
    assert wait_for_checkpoints(client, 3, timeout_s=30) >= 3
    client.cancel()
    with pytest.raises(JobFailedError):
        client.wait()
    run_dir = tmp_path / job / client.run_id
    kept = sorted(int(p.name[4:]) for p in run_dir.iterdir() if (p / "_metadata").exists())
    # Output committed after the restored checkpoint was already out; a new sink shows
    # that the state restored from the older checkpoint still ends at the exact sums.
    env2, sink = build_keyed_sum(N, 2, 5000, rate=None, checkpoint_ms=100, storage=str(tmp_path))
    env2.get_checkpoint_config().set_num_retained_checkpoints(10)
    result = env2.execute(job, restore_from=str(run_dir / f"chk-{kept[0]}"))
    assert result.restored_from == kept[0]
    new_ids = [c["checkpoint_id"] for c in result.checkpoints]
    assert min(new_ids) > max(kept)
    got = outcome(result, sink)
    assert got.sums == expected_sums(N)


class _BlobHider(SubtaskHooks):
    """Before a restore reads its blobs: every durable blob under ``root`` renamed away,
    so that only the job master's copies are left to restore from; each one hidden is
    recorded by name in ``record`` (the checkpoint directories go with later
    checkpoints)."""

    def __init__(self, root: str, record: str) -> None:
        self.root, self.record = root, record

    def after_records(self, records: int) -> None:
        pass

    def at(self, point: HookPoint) -> None:
        if point is not HookPoint.DURING_STATE_LOAD:
            return
        for directory, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(".state"):
                    path = os.path.join(directory, name)
                    try:
                        os.replace(path, path + ".hidden")
                    except FileNotFoundError:
                        continue  # another subtask of the attempt hid it
                    with open(os.path.join(self.record, name), "w"):
                        pass


class _KillThenHideBlobs(RuntimeHooks):
    """Attempt 0: the keyed subtask 0 dies after its second snapshot (so the first
    checkpoint completed); later attempts restore with the durable blobs hidden."""

    def __init__(self, root: str, record: str) -> None:
        self.root, self.record = root, record
        self.plan = FaultPlan([Fault(FaultPoint.AFTER_SNAPSHOT, 0, "Sum", 0, checkpoint=2)])

    def for_subtask(self, vertex_name: str, index: int, attempt: int) -> SubtaskHooks | None:
        if attempt == 0:
            return self.plan.for_subtask(vertex_name, index, attempt)
        return _BlobHider(self.root, self.record)

    def for_job_master(self, attempt: int) -> MasterHooks | None:
        return None


def test_a_restore_reads_the_job_masters_copies_when_the_durable_blobs_are_gone(tmp_path):
    """The object-store tier: a subtask's snapshot reaches the job master with its
    acknowledgement (or by a fetch), and a restart restores from those copies, which
    outlive the subtask that made them, without reading the durable tier."""
    n = 120_000
    storage, record = tmp_path / "checkpoints", tmp_path / "hidden"
    record.mkdir()
    env, sink = build_keyed_sum(n, 2, 2000, rate=60_000, checkpoint_ms=100, storage=str(storage))
    inject_faults(env, _KillThenHideBlobs(str(storage), str(record)))
    result = env.execute(unique_job("object-store-tier"))
    got = outcome(result, sink)
    assert result.restarts >= 1
    hidden = sorted(p.name for p in record.iterdir())
    # every subtask's blob of the restored checkpoint: sources and the keyed vertex
    assert {name.split("-", 1)[1] for name in hidden} >= {
        "v0-s0.state",
        "v0-s1.state",
        "v1-s0.state",
        "v1-s1.state",
    }, hidden
    assert got.sums == expected_sums(n)
