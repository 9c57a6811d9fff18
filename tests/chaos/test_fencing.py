"""Schedules that broke exactly-once when work did not know its run and attempt.

Each test is one failure schedule: which process dies, or is only slow, right after
which step, and what the user did before (a rerun under the same job name with the
same checkpoint storage, a restore from an older checkpoint, a cancel).
"""

from __future__ import annotations

import os
import pickle
import time

import pyarrow as pa
import pyarrow.json as pjson
import pytest
import ray

from rayflow import (
    ConcurrentRunError,
    JobCancelledError,
    JobFailedError,
    NumberSequenceSource,
    StreamExecutionEnvironment,
)
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.config import RestartStrategies
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults, wait_for_checkpoints
from sinks.basic import CollectSink
from sinks.files import FileSink
from tests.chaos.harness import (
    KEYS,
    build_keyed_sum,
    expected_rows,
    expected_sums,
    outcome,
    unique_job,
    with_key,
)
from tests.chaos.test_file_sink_chaos import in_progress, read_committed, rows_per_key

P = 2
BATCH = 5000


def _job_actors(job_id: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"rayflow:{job_id}:")
    ]


@pytest.mark.chaos
def test_a_rerun_whose_master_dies_before_its_first_checkpoint_restores_only_its_own_run(
    tmp_path,
):
    """Schedule 1: the same job name, the same storage; run 1 finished and retained its
    final checkpoint. Run 2 (more input) loses its job master before its first
    checkpoint: the new master must start run 2 from scratch, not from run 1's end."""
    job = unique_job("nightly")
    env1, sink1 = build_keyed_sum(20_000, P, BATCH, rate=None, storage=str(tmp_path))
    first = env1.execute(job)
    assert outcome(first, sink1).sums == expected_sums(20_000)

    n = 200_000
    plan = FaultPlan([Fault(FaultPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT, attempt=0)])
    env2, sink2 = build_keyed_sum(n, P, BATCH, rate=200_000, storage=str(tmp_path), plan=plan)
    result = env2.execute(job)
    got = outcome(result, sink2)
    assert result.job_master_restarts == 1
    assert result.restored_from is None  # nothing of its own to restore
    assert got.sums == expected_sums(n)
    assert got.rows == expected_rows(n, P, BATCH)
    assert result.run_id != first.run_id
    assert result.checkpoint_location != first.checkpoint_location


@pytest.mark.chaos
def test_a_restored_run_whose_master_dies_early_restarts_from_its_own_restore_point(tmp_path):
    """Schedule 1, second form: a run started with restore_from=X restarts from X after
    its master dies, not from the newest checkpoint in storage (another run's)."""
    job = unique_job("restore-point")
    # 10 s of input at the rate below: the run is still reading when it is cancelled
    # after its second checkpoint, however slow the machine is to take them.
    n = 1_000_000
    env, sink = build_keyed_sum(n, P, BATCH, rate=50_000, storage=str(tmp_path))
    env.get_checkpoint_config().set_num_retained_checkpoints(10)
    client = env.execute_async(job)
    assert wait_for_checkpoints(client, 2, timeout_s=30) >= 2
    client.cancel()
    with pytest.raises(JobFailedError):
        client.wait()
    run_dir = tmp_path / job / client.run_id
    kept = sorted(int(p.name[4:]) for p in run_dir.iterdir() if (p / "_metadata").exists())
    # a newer run of the same name completes: its final checkpoint is the newest in storage
    env_b, _ = build_keyed_sum(5_000, P, BATCH, rate=None, storage=str(tmp_path))
    env_b.execute(job)

    plan = FaultPlan([Fault(FaultPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT, attempt=0)])
    env2, sink2 = build_keyed_sum(n, P, BATCH, rate=None, storage=str(tmp_path), plan=plan)
    result = env2.execute(job, restore_from=str(run_dir / f"chk-{kept[0]}"))
    assert result.job_master_restarts == 1
    assert result.restored_from == kept[0]
    assert outcome(result, sink2).sums == expected_sums(n)


def test_a_second_run_of_a_running_job_name_fails_fast(tmp_path):
    """Two runs of one name would write the same sink transactions and abort each other's
    as lingering: the second one is refused while the first runs, and allowed after."""
    job = unique_job("twins")
    n = 200_000
    env_a, sink_a = build_keyed_sum(n, P, BATCH, rate=100_000, storage=str(tmp_path))
    a = env_a.execute_async(job)
    env_b, sink_b = build_keyed_sum(n // 2, P, BATCH, rate=None, storage=str(tmp_path))
    with pytest.raises(ConcurrentRunError, match=f"{job}.*already running.*{a.run_id}"):
        env_b.execute_async(job)
    with pytest.raises(ConcurrentRunError):
        env_b.execute_async(job, restore_from="latest")  # never restores a live run
    assert outcome(a.wait(), sink_a).sums == expected_sums(n)
    b = env_b.execute(job)  # the first run has ended: its lock is gone
    assert outcome(b, sink_b).sums == expected_sums(n // 2)
    assert b.checkpoint_location != a.wait().checkpoint_location


def _file_sum_job(directory, n: int, plan: FaultPlan, storage: str, rate: float = 200_000):
    env, _ = build_keyed_sum(
        n, P, BATCH, rate=rate, storage=storage, plan=plan, sink=FileSink(str(directory))
    )
    return env


@pytest.mark.chaos
def test_a_slow_recover_thread_of_a_failed_attempt_never_touches_the_next_attempt(tmp_path):
    """Schedule 2: attempt 1's recover thread of a sink subtask stalls; meanwhile a
    source subtask dies, so attempt 1 fails and attempt 2 starts. The stalled thread
    must not abort attempt 2's in-progress parts (the actor is replaced, or the fence
    stops the thread)."""
    n = 300_000
    out = tmp_path / "out"
    plan = FaultPlan(
        [
            Fault(FaultPoint.AFTER_RECORDS, attempt=0, vertex="numbers", subtask=0, records=60_000),
            Fault(
                FaultPoint.DURING_RECOVER,
                attempt=1,
                vertex="committed",
                subtask=0,
                action="sleep",
                seconds=4.0,
            ),
            Fault(FaultPoint.AFTER_RECORDS, attempt=1, vertex="numbers", subtask=1, records=5_000),
        ]
    )
    env = _file_sum_job(out, n, plan, str(tmp_path / "chk"))
    result = env.execute(unique_job("slow-recover"))
    assert result.restarts == 2
    got = rows_per_key(read_committed(out, "jsonl"))
    assert {k: v[-1] for k, v in got.items()} == expected_sums(n)
    assert sum(len(v) for v in got.values()) == expected_rows(n, P, BATCH)
    assert in_progress(out) == []


@pytest.mark.chaos
def test_keyed_state_survives_a_kill_when_the_keyed_operator_sets_its_own_max_parallelism(
    tmp_path,
):
    """Schedule 3: records must be routed by the receiving operator's key groups."""
    n = 200_000
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(P)
    env.enable_checkpointing(200)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(5, 50))
    inject_faults(
        env,
        FaultPlan(
            [Fault(FaultPoint.AFTER_RECORDS, attempt=0, vertex="sum", subtask=1, records=80_000)]
        ),
    )
    sink = CollectSink()
    (
        env.from_source(
            NumberSequenceSource(0, n - 1, batch_size=BATCH, records_per_second=200_000),
            "numbers",
        )
        .uid("numbers")
        .map_batches(with_key, name="with-key")
        .key_by("key")
        .sum("value", name="sum")
        .uid("sum")
        .set_max_parallelism(256)
        .sink_to(sink, name="committed")
        .uid("committed")
    )
    result = env.execute(unique_job("maxp"))
    assert result.restarts == 1
    assert outcome(result, sink).sums == expected_sums(n)


@pytest.mark.chaos
def test_a_late_blob_write_of_a_failed_attempt_never_corrupts_a_completed_checkpoint(tmp_path):
    """Schedule 4: attempt 0's blob write for its 2nd checkpoint stalls while another
    subtask dies. Attempt 1 must not reuse that checkpoint id, and the late write must
    land where no completed checkpoint looks."""
    n = 300_000
    plan = FaultPlan(
        [
            Fault(
                FaultPoint.DURING_BLOB_WRITE,
                attempt=0,
                vertex="running-sum",
                subtask=0,
                checkpoint=2,
                action="sleep",
                seconds=3.0,
            ),
            Fault(FaultPoint.AFTER_RECORDS, attempt=0, vertex="numbers", subtask=1, records=90_000),
        ]
    )
    env, sink = build_keyed_sum(n, P, BATCH, rate=150_000, storage=str(tmp_path), plan=plan)
    env.get_checkpoint_config().set_num_retained_checkpoints(50)
    job = unique_job("late-blob")
    result = env.execute(job)
    assert result.restarts == 1
    assert outcome(result, sink).sums == expected_sums(n)
    storage = CheckpointStorage(str(tmp_path), job, run_id=result.run_id)
    ids = storage.completed_ids()
    for cid in ids:
        meta = storage.load_metadata(cid)
        for sub in meta.subtasks.values():
            # every blob a checkpoint refers to was written by the attempt that completed it
            assert os.path.basename(sub.path).startswith(f"a{meta.attempt}-")
    # every retained checkpoint restores to a consistent state
    for cid in ids[:-1]:
        env2, sink2 = build_keyed_sum(n, P, BATCH, rate=None, storage=str(tmp_path))
        restored = env2.execute(job, restore_from=f"{result.checkpoint_location}/chk-{cid}")
        assert outcome(restored, sink2).sums == expected_sums(n)
        break  # one older checkpoint is enough to show it; each restore costs a job


@pytest.mark.chaos
def test_a_kept_subtask_killed_during_the_restart_delay_is_replaced_not_escalated(tmp_path):
    """Schedule 5: a subtask kept for reuse dies while the job waits to restart: the next
    attempt replaces it; the job master is not restarted."""
    n = 200_000
    plan = FaultPlan(
        [
            Fault(FaultPoint.AFTER_RECORDS, attempt=0, vertex="numbers", subtask=0, records=50_000),
            Fault(FaultPoint.DURING_RESTART_DELAY, attempt=0, vertex="running-sum", subtask=1),
        ]
    )
    env, sink = build_keyed_sum(
        n, P, BATCH, rate=200_000, storage=str(tmp_path), plan=plan, restart_delay_ms=500
    )
    result = env.execute(unique_job("restart-delay"))
    assert result.job_master_restarts == 0
    assert result.restarts == 1
    assert outcome(result, sink).sums == expected_sums(n)


class _Unloadable:
    """Unpickles only in the process that made it: a job master elsewhere cannot load the
    job graph."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def __reduce__(self):
        return (_Unloadable._load, (self.pid,))

    @staticmethod
    def _load(pid: int) -> _Unloadable:
        if os.getpid() != pid:
            raise RuntimeError("this object cannot be loaded here")
        obj = _Unloadable.__new__(_Unloadable)
        obj.pid = pid
        return obj


def test_a_job_graph_the_master_cannot_load_fails_at_once(tmp_path):
    """Schedule 5: a job master that cannot start is not restarted again and again."""
    env, _ = build_keyed_sum(1000, 1, 100, storage=str(tmp_path))
    thing = _Unloadable()
    env._plan.transformations[0].source.unloadable = thing  # travels with the job graph
    job = unique_job("unloadable")
    client = env.execute_async(job)
    with pytest.raises(JobFailedError, match="could not start"):
        client.wait(timeout=60)
    assert _job_actors(client.job_id) == []
    again = env.execute_async(job)  # the failed run released its job name
    with pytest.raises(JobFailedError, match="could not start"):
        again.wait(timeout=60)


@pytest.mark.chaos
def test_cancel_leaves_no_open_transaction_and_no_actor(tmp_path):
    """Schedule 6: cancel closes every operator and aborts open transactions before the
    actors go; what completed checkpoints hold is committed whole."""
    out = tmp_path / "out"
    env = _file_sum_job(out, 2_000_000, FaultPlan([]), str(tmp_path / "chk"), rate=100_000)
    client = env.execute_async(unique_job("cancel"))
    assert wait_for_checkpoints(client, 2, timeout_s=60) >= 2
    assert client.cancel() is True
    assert in_progress(out) == []
    assert _job_actors(client.job_id) == []
    with pytest.raises(JobFailedError, match="cancelled"):
        client.wait()
    assert client.get_job_status() == "CANCELED"
    table = read_committed(out, "jsonl")  # every committed part is whole and readable
    assert table.num_rows > 0
    assert set(table.column("key").to_pylist()) <= set(range(KEYS))


@pytest.mark.chaos
def test_a_lost_final_notification_is_sent_again(tmp_path):
    plan = FaultPlan(
        [Fault(FaultPoint.FINAL_NOTIFY, attempt=0, vertex="committed", subtask=0, action="drop")]
    )
    n = 50_000
    env, sink = build_keyed_sum(n, P, BATCH, rate=None, storage=str(tmp_path), plan=plan)
    client = env.execute_async(unique_job("final-notify"))
    result = client.wait(timeout=60)
    got = outcome(result, sink)
    assert got.sums == expected_sums(n)
    assert got.rows == expected_rows(n, P, BATCH)


def test_history_of_checkpoints_and_commits_stays_bounded(tmp_path):
    """Schedule 7: a long job's checkpoint history and commit stats do not grow. The job
    reads for 16 s: a loaded machine (a full test run) completed only 11 checkpoints of
    10 ms in 8 s, fewer than the history keeps."""
    n = 800_000
    env, sink = build_keyed_sum(n, P, BATCH, rate=50_000, checkpoint_ms=10, storage=str(tmp_path))
    result = env.execute(unique_job("bounded"))
    assert outcome(result, sink).sums == expected_sums(n)
    completed = result.checkpoint_summary["counts"]["COMPLETED"]
    assert completed > 12  # more than the history keeps
    assert len(result.checkpoints) <= 10
    commits = result.commit_latencies("committed")
    assert len(commits) <= 10 * P
    assert pickle.dumps(result.checkpoints)  # what status()/metrics() ship stays small


@pytest.mark.chaos
def test_a_subtask_lost_while_the_commit_point_is_written_restarts_from_that_checkpoint(
    tmp_path,
):
    """Review schedule: every subtask acknowledged checkpoint 2 and its metadata is being
    written when a source dies. The restart must restore checkpoint 2 (the sinks commit
    it), not checkpoint 1."""
    n = 300_000
    plan = FaultPlan(
        [
            Fault(
                FaultPoint.DURING_COMMIT_POINT,
                attempt=0,
                vertex="numbers",
                subtask=0,
                checkpoint=2,
                seconds=3.0,
            )
        ]
    )
    env, sink = build_keyed_sum(n, P, BATCH, rate=100_000, storage=str(tmp_path), plan=plan)
    result = env.execute(unique_job("commit-point"))
    got = outcome(result, sink)
    assert result.restarts == 1
    assert got.sums == expected_sums(n)
    assert got.rows == expected_rows(n, P, BATCH)


class _KillsMasterOnClose(CollectSink):
    """Closing the sink kills the job master once (a marker file remembers it)."""

    def __init__(self, marker) -> None:
        super().__init__()
        self.marker = str(marker)

    def close(self) -> None:
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            for actor in ray.util.list_named_actors(all_namespaces=True):
                if ":master:" in actor["name"]:
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
        super().close()


@pytest.mark.chaos
def test_a_job_master_lost_during_a_cancel_never_resumes_the_job(tmp_path):
    sink = _KillsMasterOnClose(tmp_path / "killed")
    env, sink = build_keyed_sum(2_000_000, P, BATCH, rate=100_000, storage=str(tmp_path), sink=sink)
    client = env.execute_async(unique_job("cancel-master"))
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    assert client.cancel() is True
    with pytest.raises(JobCancelledError):
        client.wait()
    assert os.path.exists(tmp_path / "killed")
    assert _job_actors(client.job_id) == []


@pytest.mark.chaos
def test_cancel_after_the_job_master_died_finishes_the_cancel(tmp_path):
    env, _ = build_keyed_sum(2_000_000, P, BATCH, rate=100_000, storage=str(tmp_path))
    client = env.execute_async(unique_job("cancel-dead-master"))
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    ray.kill(client._master)
    assert client.cancel() is True
    with pytest.raises(JobCancelledError):
        client.wait()
    assert _job_actors(client.job_id) == []


@pytest.mark.chaos
def test_cancel_while_restarting_commits_a_completed_checkpoint_of_a_dead_sink(tmp_path):
    """Review schedule: a sink subtask dies right after checkpoint 1's commit point; the job
    is cancelled during the restart delay. Checkpoint 1's parts are committed, nothing
    stays in progress."""
    out = tmp_path / "out"
    plan = FaultPlan([Fault(FaultPoint.BEFORE_NOTIFY, attempt=0, vertex="committed", subtask=0)])
    env, _ = build_keyed_sum(
        2_000_000,
        P,
        BATCH,
        rate=100_000,
        storage=str(tmp_path / "chk"),
        plan=plan,
        sink=FileSink(str(out)),
        restart_delay_ms=8000,
    )
    client = env.execute_async(unique_job("cancel-restarting"))
    deadline = time.time() + 60
    while client.get_job_status() != "RESTARTING" and time.time() < deadline:
        time.sleep(0.05)
    assert client.get_job_status() == "RESTARTING"
    assert client.cancel() is True
    with pytest.raises(JobCancelledError):
        client.wait()
    assert in_progress(out) == []
    assert read_committed(out, "jsonl").num_rows > 0  # checkpoint 1 of both subtasks


@pytest.mark.chaos
def test_a_job_that_fails_for_good_leaves_no_transaction_open(tmp_path):
    """Review schedule: the sinks pre-commit for a checkpoint that then times out, and the
    job may not restart: the pre-committed parts are aborted, not left behind."""
    out = tmp_path / "out"
    plan = FaultPlan(
        [
            Fault(
                FaultPoint.DURING_BLOB_WRITE,
                attempt=0,
                vertex="numbers",
                subtask=0,
                action="sleep",
                seconds=3.0,
            )
        ]
    )
    env, _ = build_keyed_sum(
        2_000_000,
        P,
        BATCH,
        rate=100_000,
        storage=str(tmp_path / "chk"),
        plan=plan,
        sink=FileSink(str(out)),
    )
    env.set_restart_strategy(RestartStrategies.no_restart())
    env.get_checkpoint_config().set_checkpoint_timeout(1000)
    client = env.execute_async(unique_job("fails-for-good"))
    with pytest.raises(JobFailedError, match="CheckpointFailureLimit"):
        client.wait(timeout=120)
    assert in_progress(out) == []
    assert _job_actors(client.job_id) == []


def test_a_finished_job_frees_its_name_even_if_nobody_waits_for_it(tmp_path):
    job = unique_job("unwaited")
    env, _ = build_keyed_sum(20_000, P, BATCH, rate=None, storage=str(tmp_path))
    client = env.execute_async(job)
    while client.get_job_status() != "FINISHED":  # the suite's timeout bounds the wait
        time.sleep(0.005)
    # FINISHED is shown once the run is cleaned up: its name is free at once
    env2, sink2 = build_keyed_sum(10_000, P, BATCH, rate=None, storage=str(tmp_path))
    assert outcome(env2.execute(job), sink2).sums == expected_sums(10_000)
    client.wait()


def test_a_restore_from_an_older_run_survives_the_pruning_of_old_runs(tmp_path):
    """Review schedule: with one retained run, starting a run pruned the very run it was
    restoring from."""
    job = unique_job("pruned")
    env1, sink = build_keyed_sum(50_000, P, BATCH, rate=None, storage=str(tmp_path))
    first = env1.execute(job)
    final = max(c["checkpoint_id"] for c in first.checkpoints if c["status"] == "COMPLETED")
    # the same sink (its outside world): a commit of the first run made again on restore
    # counts once, whichever of the first run's checkpoints its transactions were in
    env2, _ = build_keyed_sum(100_000, P, BATCH, rate=None, storage=str(tmp_path), sink=sink)
    env2.get_checkpoint_config().set_num_retained_runs(1)
    second = env2.execute(job, restore_from="latest")
    assert second.restored_from == final
    # restored from the first run's final checkpoint: its state, its sources at their end
    assert outcome(second, sink).sums == expected_sums(50_000)
    env3, _ = build_keyed_sum(10_000, P, BATCH, rate=None, storage=str(tmp_path))
    env3.get_checkpoint_config().set_num_retained_runs(1)
    env3.execute(job)
    runs = sorted(p.name for p in (tmp_path / job).iterdir())
    assert first.run_id not in runs  # pruned once nothing needed it any more


@pytest.mark.chaos
def test_a_cancel_while_a_subtask_still_loads_its_state_keeps_what_it_owes(tmp_path):
    """Review schedule: a sink subtask whose restore is still reading its blobs is
    cancelled: it must not abort the pre-committed parts of the completed checkpoint it
    was restoring (it does not know them yet); a fresh subtask commits them instead."""
    out = tmp_path / "out"
    job = unique_job("cancel-loading")
    plan = FaultPlan(
        [
            # dies surely before checkpoint 2's notification: its part stays pre-committed
            Fault(
                FaultPoint.DURING_COMMIT_POINT,
                attempt=0,
                vertex="committed",
                subtask=0,
                checkpoint=2,
                seconds=1.0,
            ),
            Fault(
                FaultPoint.DURING_STATE_LOAD,
                attempt=1,
                vertex="committed",
                subtask=0,
                action="sleep",
                seconds=6.0,
            ),
        ]
    )
    n = 1_000_000
    env, _ = build_keyed_sum(
        n,
        P,
        BATCH,
        rate=100_000,
        storage=str(tmp_path / "chk"),
        plan=plan,
        sink=FileSink(str(out)),
    )
    client = env.execute_async(job)
    deadline = time.time() + 60
    loading = False
    while not loading and time.time() < deadline:
        loading = any(
            m["attempt"] == 1
            and "committed" in m["vertex"]
            and m["subtask"] == 0
            and m["started_at"] is not None
            and m["records_in"] == 0
            for m in client.metrics()
        )
        time.sleep(0.05)
    assert loading  # attempt 1's sink subtask 0 runs and is reading its state now
    time.sleep(0.5)
    client.cancel()
    with pytest.raises(JobCancelledError):
        client.wait()
    assert in_progress(out) == []
    # The rest of the input from the newest checkpoint: the output is exactly once overall.
    env2, _ = build_keyed_sum(
        n, P, BATCH, rate=None, storage=str(tmp_path / "chk"), sink=FileSink(str(out))
    )
    env2.set_restart_strategy(RestartStrategies.fixed_delay_restart(2, 50))
    env2.execute(job, restore_from="latest")
    got = rows_per_key(read_committed(out, "jsonl"))
    assert {k: v[-1] for k, v in got.items()} == expected_sums(n)
    assert sum(len(v) for v in got.values()) == expected_rows(n, P, BATCH)
    assert in_progress(out) == []


@pytest.mark.chaos
def test_a_clean_up_that_fails_is_retried_and_what_stays_open_is_reported(tmp_path):
    """Review schedule: the job fails for good with a dead sink subtask; the fresh subtask
    that cleans up for it fails too. The clean-up is retried; when every try fails, the
    job's error says what stays open instead of claiming a clean end."""
    out = tmp_path / "out"
    kill = Fault(FaultPoint.AFTER_RECORDS, attempt=0, vertex="committed", subtask=0, records=30_000)
    # the clean-up subtasks take the attempts after the last regular one: 1, then 2
    fail_1 = Fault(FaultPoint.DURING_RECOVER, attempt=1, vertex="committed", action="raise")
    fail_2 = Fault(FaultPoint.DURING_RECOVER, attempt=2, vertex="committed", action="raise")
    for faults, reported in (([kill, fail_1], False), ([kill, fail_1, fail_2], True)):
        env, _ = build_keyed_sum(
            1_000_000,
            P,
            BATCH,
            rate=100_000,
            storage=str(tmp_path / "chk"),
            plan=FaultPlan(faults),
            sink=FileSink(str(out)),
        )
        env.set_restart_strategy(RestartStrategies.no_restart())
        client = env.execute_async(unique_job("clean-up-fails"))
        with pytest.raises(JobFailedError) as failed:
            client.wait(timeout=120)
        assert ("could not be cleaned up" in str(failed.value)) is reported, failed.value
        if not reported:
            assert in_progress(out) == []  # the retry cleaned up


@pytest.mark.chaos
def test_a_cancel_during_a_job_master_takeover_is_not_lost(tmp_path, monkeypatch):
    """Review schedule: one thread waits on the job; its job master dies and the waiter is
    taking over (recording the run's state) when another thread cancels. The new job
    master must get the cancel: the job ends CANCELED, not FINISHED."""
    import threading

    plan = FaultPlan([Fault(FaultPoint.JOB_MASTER_BEFORE_NOTIFY, attempt=0, checkpoint=1)])
    env, _ = build_keyed_sum(2_000_000, P, BATCH, rate=100_000, storage=str(tmp_path), plan=plan)
    taking_over = threading.Event()
    real_write = CheckpointStorage.write_job_state

    def slow_write(self, state):  # in this driver only: the takeover's state write
        taking_over.set()
        time.sleep(3)
        real_write(self, state)

    monkeypatch.setattr(CheckpointStorage, "write_job_state", slow_write)
    client = env.execute_async(unique_job("cancel-takeover"))
    ended: dict[str, object] = {}

    def waiter() -> None:
        try:
            client.wait()
            ended["outcome"] = "finished"
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            ended["outcome"] = exc

    thread = threading.Thread(target=waiter)
    thread.start()
    assert taking_over.wait(60)
    assert client.cancel(timeout=120) is True
    thread.join(120)
    assert isinstance(ended.get("outcome"), JobCancelledError), ended
    assert client.get_job_status() == "CANCELED"


def test_a_rerun_into_the_same_directory_never_writes_over_part_of_the_earlier_run(tmp_path):
    """Review schedule: the nightly rerun writes into yesterday's directory. Its part
    files must not replace some of yesterday's (fewer checkpoints, fewer parts): each
    run's output stays whole, and each run's own files hold exactly its output."""
    job, out, n = unique_job("same-dir"), tmp_path / "out", 200_000
    env1, _ = build_keyed_sum(
        n,
        P,
        BATCH,
        rate=100_000,
        checkpoint_ms=100,
        storage=str(tmp_path / "chk"),
        sink=FileSink(str(out)),
    )
    first = env1.execute(job)
    env2, _ = build_keyed_sum(
        n,
        P,
        BATCH,
        rate=None,
        checkpoint_ms=60_000,
        storage=str(tmp_path / "chk"),
        sink=FileSink(str(out)),
    )
    second = env2.execute(job)
    names = sorted(p for p in os.listdir(out) if not p.startswith("."))
    for result in (first, second):
        mine = [name for name in names if result.run_id[len("run-") :] in name]
        table = pa.concat_tables(
            [pjson.read_json(os.path.join(out, name)) for name in mine]
        ).select(["key", "value"])
        per_key = rows_per_key(table)
        assert {k: v[-1] for k, v in per_key.items()} == expected_sums(n)
        assert table.num_rows == expected_rows(n, P, BATCH)
    assert read_committed(out, "jsonl").num_rows == 2 * expected_rows(n, P, BATCH)
