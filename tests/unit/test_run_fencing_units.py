"""Ray-free unit tests of the run/attempt fencing pieces: the restart supervisor, the
checkpoint id counter and history, versioned checkpoint metadata, per-run checkpoint
storage, the attempt fence, and seeded fault plans."""

from __future__ import annotations

import copy
import datetime
import math
import os
import pickle
import random
import re
import threading
import time
import types

import pytest

from rayflow.checkpoint.coordinator import CheckpointHistory, CheckpointIdCounter
from rayflow.checkpoint.metadata import (
    FORMAT_VERSION,
    CheckpointMetadata,
    SubtaskStateMeta,
    UnsupportedMetadataVersion,
)
from rayflow.checkpoint.storage import (
    METADATA,
    CheckpointStorage,
    JobStorage,
    new_run_id,
)
from rayflow.config import RestartStrategies
from rayflow.runtime.fence import AttemptFence, StaleAttemptError
from rayflow.runtime.hooks import HookPoint
from rayflow.runtime.supervisor import (
    HISTORY,
    IllegalTransition,
    RestartSupervisor,
    SupervisorState,
)
from rayflow.status import CheckpointStatus, FailureKind, JobState
from rayflow.testing import (
    Fault,
    FaultPlan,
    FaultPoint,
    InjectedFault,
    MasterFaults,
    SubtaskFaults,
)

RUN_PATTERN = re.compile(r"^run-\d{8}T\d{6}-[0-9a-f]+$")


# --- the restart supervisor ----------------------------------------------------------------


def _supervisor(strategy=None, run_id: str = "run-x") -> RestartSupervisor:
    return RestartSupervisor.new(run_id, strategy or RestartStrategies.fixed_delay_restart(2, 10))


def _at(state: JobState) -> RestartSupervisor:
    sup = _supervisor(RestartStrategies.fixed_delay_restart(100, 10))
    sup.state.state = state
    return sup


def test_supervisor_lifecycle_created_running_restarting_finished():
    sup = _supervisor()
    assert sup.job_state is JobState.CREATED
    assert sup.state.attempt == -1
    assert sup.start_attempt() == 0
    assert sup.job_state is JobState.RUNNING
    assert sup.on_failure("boom", FailureKind.ATTEMPT, when=1.0) == pytest.approx(0.01)
    assert sup.job_state is JobState.RESTARTING
    assert sup.start_attempt() == 1
    assert sup.job_state is JobState.RESTARTING  # until every subtask of attempt 1 runs
    sup.attempt_running()
    assert sup.job_state is JobState.RUNNING
    sup.move_to(JobState.FINISHED)
    assert sup.job_state is JobState.FINISHED
    with pytest.raises(IllegalTransition, match="FINISHED cannot move to RUNNING"):
        sup.start_attempt()
    assert sup.state.attempt == 1  # a refused start does not use up an attempt number


@pytest.mark.parametrize("source", list(JobState))
@pytest.mark.parametrize("target", list(JobState))
def test_move_to_follows_can_move_to_for_every_pair(source, target):
    sup = _at(source)
    same_state_noop = source is target and target is not JobState.RESTARTING
    if source.can_move_to(target) or same_state_noop:
        sup.move_to(target)
        assert sup.job_state is target
    else:
        with pytest.raises(IllegalTransition):
            sup.move_to(target)
        assert sup.job_state is source  # a refused transition changes nothing


def test_transition_table_shape():
    for terminal in (JobState.FINISHED, JobState.FAILED, JobState.CANCELED):
        assert terminal.is_terminal
        assert not any(terminal.can_move_to(t) for t in JobState)
    assert [t for t in JobState if JobState.FAILING.can_move_to(t)] == [JobState.FAILED]
    assert JobState.RESTARTING.can_move_to(JobState.RESTARTING)
    assert not JobState.RUNNING.can_move_to(JobState.CREATED)
    assert not JobState.CANCELLING.can_move_to(JobState.RUNNING)
    assert JobState.RUNNING == "RUNNING" and str(JobState.RUNNING) == "RUNNING"


def test_start_attempt_numbers_always_grow_across_failures_and_master_restarts():
    sup = _supervisor(RestartStrategies.fixed_delay_restart(math.inf, 0))
    seen = [sup.start_attempt()]
    for i in range(6):
        kind = FailureKind.JOB_MASTER_LOST if i % 2 else FailureKind.ATTEMPT
        assert sup.on_failure(f"f{i}", kind, when=float(i)) == 0
        if i % 3 == 2:  # failures while restarting (setting up the next attempt)
            assert sup.on_failure("setup", FailureKind.RESTART_SETUP, when=float(i)) == 0
        if i % 2:
            # the job master died: a new one starts from the (pickled) snapshot
            sup = RestartSupervisor(pickle.loads(pickle.dumps(sup.snapshot())))
            sup.start_master()
        seen.append(sup.start_attempt())
    assert seen == sorted(set(seen)) and seen == list(range(7))


@pytest.mark.parametrize(
    "kinds",
    [
        (FailureKind.ATTEMPT, FailureKind.ATTEMPT, FailureKind.ATTEMPT),
        (FailureKind.JOB_MASTER_LOST, FailureKind.JOB_MASTER_LOST, FailureKind.JOB_MASTER_LOST),
        (FailureKind.ATTEMPT, FailureKind.JOB_MASTER_LOST, FailureKind.ATTEMPT),
        (FailureKind.JOB_MASTER_LOST, FailureKind.ATTEMPT, FailureKind.JOB_MASTER_LOST),
        (FailureKind.RESTART_SETUP, FailureKind.JOB_MASTER_LOST, FailureKind.RESTART_SETUP),
    ],
)
def test_master_restarts_spend_the_same_budget_as_attempt_failures(kinds):
    sup = _supervisor(RestartStrategies.fixed_delay_restart(2, 10))
    sup.start_attempt()
    first, second, third = kinds
    assert sup.on_failure("one", first, when=1.0) == pytest.approx(0.01)
    sup.start_attempt()
    assert sup.on_failure("two", second, when=2.0) == pytest.approx(0.01)
    assert sup.state.restarts == 2
    masters = sum(k is FailureKind.JOB_MASTER_LOST for k in (first, second))
    assert sup.state.master_restarts == masters
    sup.start_attempt()
    assert sup.on_failure("three", third, when=3.0) is None
    assert sup.job_state is JobState.FAILING
    assert sup.state.restarts == 2  # the refused one is no restart
    assert sup.state.master_restarts == masters
    assert sup.state.failure_count == 3
    assert sup.state.cause == "three"
    sup.move_to(JobState.FAILED)
    msg = sup.failure_message("my-job")
    assert "'my-job'" in msg and "2 restart(s)" in msg and "three" in msg
    assert "fixed delay (2 attempts" in msg


def test_new_supervisor_copies_the_strategy_so_runs_do_not_share_a_budget():
    strategy = RestartStrategies.fixed_delay_restart(1, 0)
    a, b = _supervisor(strategy), _supervisor(strategy)
    a.start_attempt()
    b.start_attempt()
    assert a.on_failure("a", FailureKind.ATTEMPT, when=0.0) == 0
    assert b.on_failure("b", FailureKind.ATTEMPT, when=0.0) == 0  # b still has its own
    assert strategy.next_delay_s(0.0) == 0  # and the caller's object was never spent


def test_snapshot_is_a_deep_copy():
    sup = _supervisor()
    sup.start_attempt()
    sup.on_failure("first", FailureKind.ATTEMPT, when=1.0)
    snap = sup.snapshot()
    assert isinstance(snap, SupervisorState)
    sup.start_attempt()
    sup.on_failure("second", FailureKind.JOB_MASTER_LOST, when=2.0)
    assert snap.restarts == 1 and snap.master_restarts == 0
    assert [f.cause for f in snap.failures] == ["first"]
    assert snap.attempt == 0 and snap.state is JobState.RESTARTING
    assert snap.strategy is not sup.state.strategy
    assert snap.failures is not sup.state.failures
    # the snapshot's strategy still holds the budget as it was: one restart left
    assert RestartSupervisor(snap).on_failure("x", FailureKind.ATTEMPT, when=3.0) is not None


def test_snapshot_survives_pickle_and_continues_the_budget(tmp_path):
    sup = _supervisor(RestartStrategies.fixed_delay_restart(2, 10), run_id="run-keep")
    assert sup.start_master() == 1
    assert sup.start_attempt() == 0
    assert sup.on_failure("attempt died", FailureKind.ATTEMPT, when=5.0) is not None
    assert sup.start_attempt() == 1
    loaded = pickle.loads(pickle.dumps(sup.snapshot()))
    assert loaded == sup.snapshot()  # dataclass equality over the whole state

    # a job client takes over after the job master died: one more restart is left
    client_side = RestartSupervisor(loaded)
    assert client_side.on_failure("master lost", FailureKind.JOB_MASTER_LOST, when=6.0) == 0.01
    assert client_side.state.master_restarts == 1 and client_side.state.restarts == 2

    # ... the new job master starts from the client's snapshot
    master = RestartSupervisor(pickle.loads(pickle.dumps(client_side.snapshot())))
    assert master.start_master() == 2
    assert master.start_attempt() == 2
    assert master.on_failure("again", FailureKind.ATTEMPT, when=7.0) is None
    assert master.job_state is JobState.FAILING
    assert [f.kind for f in master.state.failures] == [
        FailureKind.ATTEMPT,
        FailureKind.JOB_MASTER_LOST,
        FailureKind.ATTEMPT,
    ]
    assert [f.attempt for f in master.state.failures] == [0, 1, 2]
    assert master.state.run_id == "run-keep"


def test_failure_history_is_bounded_while_the_count_keeps_counting():
    sup = _supervisor(RestartStrategies.fixed_delay_restart(math.inf, 0))
    sup.start_attempt()
    total = HISTORY + 7
    for i in range(total):
        assert sup.on_failure(f"f{i}", FailureKind.ATTEMPT, when=float(i)) == 0
    assert HISTORY == 20
    assert len(sup.state.failures) == HISTORY
    assert sup.state.failure_count == total
    assert sup.state.restarts == total
    assert [f.cause for f in sup.state.failures] == [f"f{i}" for i in range(7, total)]
    assert [f.time for f in sup.state.failures] == [float(i) for i in range(7, total)]
    assert len(pickle.loads(pickle.dumps(sup.snapshot())).failures) == HISTORY


def test_failures_after_failing_are_counted_but_restart_nothing():
    sup = _supervisor(RestartStrategies.no_restart())
    sup.start_attempt()
    assert sup.on_failure("first", FailureKind.ATTEMPT, when=1.0) is None
    assert sup.job_state is JobState.FAILING
    assert sup.on_failure("late", FailureKind.JOB_MASTER_LOST, when=2.0) is None
    assert sup.job_state is JobState.FAILING
    assert sup.state.failure_count == 2 and sup.state.restarts == 0
    assert sup.state.master_restarts == 0
    assert sup.state.cause == "late"


def test_cancel_then_failure_returns_none_and_spends_no_budget():
    sup = _supervisor(RestartStrategies.fixed_delay_restart(1, 10))
    sup.start_attempt()
    sup.cancel()
    assert sup.job_state is JobState.CANCELLING
    sup.cancel()  # idempotent
    assert sup.job_state is JobState.CANCELLING
    assert sup.on_failure("during cancel", FailureKind.ATTEMPT, when=1.0) is None
    assert sup.on_failure("master", FailureKind.JOB_MASTER_LOST, when=2.0) is None
    assert sup.job_state is JobState.CANCELLING
    assert sup.state.restarts == 0 and sup.state.master_restarts == 0
    assert sup.state.failure_count == 2
    with pytest.raises(IllegalTransition):
        sup.start_attempt()
    sup.move_to(JobState.CANCELED)
    sup.cancel()  # a terminal state stays as it is
    assert sup.job_state is JobState.CANCELED
    assert sup.on_failure("after", FailureKind.ATTEMPT, when=3.0) is None
    assert sup.job_state is JobState.CANCELED
    # the budget was never touched
    assert sup.state.strategy.next_delay_s(4.0) == pytest.approx(0.01)


def test_cancel_while_restarting():
    sup = _supervisor()
    sup.start_attempt()
    sup.on_failure("x", FailureKind.ATTEMPT, when=1.0)
    sup.cancel()
    assert sup.job_state is JobState.CANCELLING
    assert sup.on_failure("y", FailureKind.RESTART_SETUP, when=2.0) is None
    assert sup.state.restarts == 1


def test_illegal_transitions_raise():
    sup = _supervisor()
    with pytest.raises(IllegalTransition, match="CREATED cannot move to FINISHED"):
        sup.move_to(JobState.FINISHED)
    with pytest.raises(IllegalTransition):
        sup.move_to(JobState.FAILED)
    sup.start_attempt()
    with pytest.raises(IllegalTransition):
        sup.move_to(JobState.CREATED)
    sup.move_to(JobState.FAILING)
    with pytest.raises(IllegalTransition):
        sup.start_attempt()
    with pytest.raises(IllegalTransition):
        sup.move_to(JobState.CANCELLING)
    sup.move_to(JobState.FAILED)
    for target in JobState:
        if target is not JobState.FAILED:
            with pytest.raises(IllegalTransition):
                sup.move_to(target)
    assert issubclass(IllegalTransition, RuntimeError)


def test_start_master_generations_grow():
    sup = _supervisor()
    assert [sup.start_master() for _ in range(3)] == [1, 2, 3]
    assert sup.snapshot().master_generation == 3


# A job master lost before its first state write: the supervisor starts CREATED.
def test_master_lost_before_the_first_attempt_restarts():
    sup = _supervisor(RestartStrategies.fixed_delay_restart(2, 10))
    assert sup.job_state is JobState.CREATED
    delay = sup.on_failure("job master lost", FailureKind.JOB_MASTER_LOST, when=1.0)
    assert delay == pytest.approx(0.01)
    assert sup.state.master_restarts == 1
    assert sup.start_attempt() == 0


# --- checkpoint ids ------------------------------------------------------------------------


def _run_storage(tmp_path, run_id: str = "run-20240101T000000-aaaaaaaa", job: str = "job"):
    return CheckpointStorage(str(tmp_path), job, run_id=run_id)


class _CountingStorage(CheckpointStorage):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reservations: list[int] = []

    def reserve_ids(self, up_to: int) -> None:
        super().reserve_ids(up_to)
        self.reservations.append(up_to)


def test_id_counter_ids_strictly_increase_and_are_reserved_in_blocks(tmp_path):
    storage = _CountingStorage(str(tmp_path), "job", run_id="run-20240101T000000-aaaaaaaa")
    assert storage.id_mark() == 0
    counter = CheckpointIdCounter(storage, 1)
    block = CheckpointIdCounter.BLOCK
    ids = []
    for _ in range(2 * block + 5):
        ids.append(counter.take())
        # no id is ever handed out before a durable reservation covers it
        assert ids[-1] <= storage.id_mark()
    assert ids == list(range(1, 2 * block + 6))
    assert storage.reservations == [block, 2 * block, 3 * block]
    assert storage.id_mark() == 3 * block


def test_id_counter_clamps_its_start_and_works_without_storage():
    counter = CheckpointIdCounter(None, 0)
    assert [counter.take() for _ in range(3)] == [1, 2, 3]
    later = CheckpointIdCounter(None, 500)
    assert later.take() == 500 and later.reserved == 500 + CheckpointIdCounter.BLOCK - 1


@pytest.mark.parametrize("taken", [0, 1, 63, 64, 65, 130])
def test_id_counter_after_a_crash_never_reuses_an_id(tmp_path, taken):
    run_id = "run-20240101T000000-bbbbbbbb"
    first = CheckpointIdCounter(_run_storage(tmp_path, run_id), 1)
    handed = {first.take() for _ in range(taken)}
    reserved_by_first = set(range(1, first.reserved + 1))
    # the job master dies; a new one opens the run's storage afresh
    reopened = _run_storage(tmp_path, run_id)
    second = CheckpointIdCounter(reopened, reopened.id_mark() + 1)
    after = [second.take() for _ in range(70)]
    assert not handed & set(after)
    assert not reserved_by_first & set(after)
    assert after == sorted(after) and len(set(after)) == len(after)
    assert min(after) > max(handed, default=0)
    # and a third one after the second died
    third = CheckpointIdCounter(reopened, _run_storage(tmp_path, run_id).id_mark() + 1)
    assert third.take() > max(after)


def test_id_counter_failed_reservation_hands_out_nothing(tmp_path):
    class Flaky(CheckpointStorage):
        fail = True

        def reserve_ids(self, up_to: int) -> None:
            if self.fail:
                raise OSError("storage down")
            super().reserve_ids(up_to)

    storage = Flaky(str(tmp_path), "job", run_id="run-20240101T000000-cccccccc")
    counter = CheckpointIdCounter(storage, 1)
    with pytest.raises(OSError):
        counter.take()
    assert storage.id_mark() == 0
    storage.fail = False
    cid = counter.take()
    assert cid == 1 and storage.id_mark() >= cid


# --- checkpoint history ---------------------------------------------------------------------


def _stats(cid: int, status, duration: float = 1.0) -> dict:
    return {"checkpoint_id": cid, "status": status, "duration_s": duration}


def test_history_is_bounded_and_counts_keep_growing():
    history = CheckpointHistory(size=3)
    for cid in range(1, 6):
        history.add(_stats(cid, CheckpointStatus.COMPLETED, duration=float(cid)))
    history.add(_stats(6, CheckpointStatus.FAILED))
    history.add(_stats(7, "ABORTED"))  # a plain string counts the same
    history.add(_stats(8, CheckpointStatus.FAILED))
    assert len(history.recent) == 3
    assert [s["checkpoint_id"] for s in history.recent] == [6, 7, 8]
    assert list(history.completed_ids) == [3, 4, 5]
    summary = history.summary()
    assert summary["counts"] == {
        "IN_PROGRESS": 0,
        "COMPLETED": 5,
        "FAILED": 2,
        "ABORTED": 1,
    }
    assert all(type(k) is str for k in summary["counts"])
    assert summary["latest_completed"] == 5
    assert summary["mean_duration_s"] == pytest.approx(3.0)
    assert summary["max_duration_s"] == 5.0
    for cid in range(9, 30):
        history.add(_stats(cid, CheckpointStatus.COMPLETED, duration=0.5))
    assert len(history.recent) == 3 and len(history.completed_ids) == 3
    assert history.summary()["counts"]["COMPLETED"] == 26
    assert history.summary()["latest_completed"] == 29


def test_the_latest_failed_checkpoint_outlives_the_bounded_history():
    """A long run pushes a failed checkpoint out of ``recent``; the summary still says
    which one failed last and why (Flink's latest failed checkpoint)."""
    history = CheckpointHistory(size=3)
    history.add(_stats(1, CheckpointStatus.COMPLETED))
    assert history.summary()["latest_failed"] is None
    history.add({**_stats(2, CheckpointStatus.FAILED), "failure": "DECLINED: injected fault"})
    for cid in range(3, 20):
        history.add(_stats(cid, CheckpointStatus.COMPLETED))
    assert 2 not in [s["checkpoint_id"] for s in history.recent]
    latest = history.summary()["latest_failed"]
    assert latest["checkpoint_id"] == 2 and "injected fault" in latest["failure"]
    history.add({**_stats(20, "ABORTED"), "failure": "TIMEOUT"})
    assert history.summary()["latest_failed"]["checkpoint_id"] == 20
    history.summary()["latest_failed"]["checkpoint_id"] = 99  # a copy
    assert history.summary()["latest_failed"]["checkpoint_id"] == 20


def test_history_summary_without_completed_checkpoints_and_is_a_copy():
    history = CheckpointHistory()
    history.add(_stats(1, CheckpointStatus.ABORTED))
    summary = history.summary()
    assert summary["mean_duration_s"] is None and summary["latest_completed"] is None
    summary["counts"]["ABORTED"] = 99
    assert history.summary()["counts"]["ABORTED"] == 1


# --- checkpoint metadata --------------------------------------------------------------------


def _metadata(cid: int = 7, completed_at: float = 100.0, run_id="run-1") -> CheckpointMetadata:
    return CheckpointMetadata(
        checkpoint_id=cid,
        job_name="job",
        run_id=run_id,
        attempt=3,
        trigger_time=completed_at - 1.0,
        completed_at=completed_at,
        final=False,
        subtasks={
            (0, 0): SubtaskStateMeta("/x/a3-v0-s0.state", 10, ("src",), 2, "source"),
            (1, 1): SubtaskStateMeta("/x/a3-v1-s1.state", 32, ("map", "sink"), 2, "map->sink"),
        },
        source_splits={"src": [("split", 1), ("split", 2)]},
    )


def test_metadata_round_trip():
    meta = _metadata()
    loaded = CheckpointMetadata.from_bytes(meta.to_bytes())
    assert loaded == meta
    assert loaded.format_version == FORMAT_VERSION == 3
    assert loaded.size == 42
    assert loaded.subtasks[(1, 1)].uids == ("map", "sink")
    assert pickle.loads(meta.to_bytes())["format_version"] == FORMAT_VERSION


def test_metadata_version_1_loads():
    raw = {  # what version 1 wrote: no format_version, no run_id, no vertex
        "checkpoint_id": 4,
        "job_name": "old-job",
        "attempt": 1,
        "trigger_time": 5.0,
        "completed_at": 6.0,
        "final": True,
        "subtasks": {
            (0, 0): {"path": "/old/chk-4/v0-s0.state", "size": 3, "uids": ["a"], "parallelism": 1}
        },
        "source_splits": {"a": [1]},
    }
    meta = CheckpointMetadata.from_bytes(pickle.dumps(raw))
    assert meta.checkpoint_id == 4 and meta.job_name == "old-job"
    assert meta.run_id is None
    assert meta.final is True and meta.attempt == 1
    assert meta.subtasks == {(0, 0): SubtaskStateMeta("/old/chk-4/v0-s0.state", 3, ("a",), 1, "")}
    assert meta.source_splits == {"a": [1]}
    assert meta.format_version == FORMAT_VERSION
    # it round-trips in the new format
    assert CheckpointMetadata.from_bytes(meta.to_bytes()) == meta


def test_metadata_unknown_version_is_refused_clearly():
    raw = _metadata().to_dict()
    raw["format_version"] = 99
    with pytest.raises(UnsupportedMetadataVersion) as info:
        CheckpointMetadata.from_bytes(pickle.dumps(raw), where="/ckpt/chk-7")
    message = str(info.value)
    assert "/ckpt/chk-7" in message
    assert "format version 99" in message and "not supported" in message
    assert f"1..{FORMAT_VERSION}" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not a pickle at all",
        b"\x80\x05garbage",
        random.Random(0).randbytes(64),
        pickle.dumps([1, 2, 3]),
        pickle.dumps({"job_name": "no id"}),
        pickle.dumps({"checkpoint_id": "seven"}),
    ],
    ids=["empty", "text", "bad-pickle", "random", "list", "no-id", "bad-id"],
)
def test_metadata_garbage_is_refused_without_a_pickle_error(data):
    with pytest.raises(UnsupportedMetadataVersion) as info:
        CheckpointMetadata.from_bytes(data, where="somewhere")
    assert not isinstance(info.value, pickle.UnpicklingError)
    # no pickle traceback chained to it either
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__
    assert "somewhere" in str(info.value)


# --- checkpoint storage ---------------------------------------------------------------------


def _files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


def test_storage_paths_carry_the_run_and_blob_names_the_attempt(tmp_path):
    run_id = new_run_id()
    storage = CheckpointStorage(str(tmp_path), "my job!", run_id=run_id)
    assert storage.location() == f"{tmp_path}/my-job/{run_id}"
    assert storage.checkpoint_dir(3) == f"{tmp_path}/my-job/{run_id}/chk-3"
    assert CheckpointStorage.blob_name(2, 1, 0) == "a2-v1-s0.state"
    assert CheckpointStorage.blob_name(3, 1, 0) != CheckpointStorage.blob_name(2, 1, 0)
    old = storage.write_blob(3, storage.blob_name(2, 1, 0), b"old attempt")
    new = storage.write_blob(3, storage.blob_name(3, 1, 0), b"new attempt")
    assert old != new
    assert new == f"{tmp_path}/my-job/{run_id}/chk-3/a3-v1-s0.state"
    assert storage.read_blob(old) == b"old attempt"
    assert storage.read_blob(new) == b"new attempt"
    # pickled (it travels to subtasks) it addresses the same run
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.run_id == run_id and clone.location() == storage.location()
    # without a run id it is the job directory (the format before runs)
    legacy = CheckpointStorage(str(tmp_path), "my job!")
    assert legacy.checkpoint_dir(1) == f"{tmp_path}/my-job/chk-1"


def test_commit_metadata_leaves_no_temporary_files(tmp_path):
    storage = _run_storage(tmp_path)
    storage.write_blob(1, storage.blob_name(0, 0, 0), b"x")
    assert storage.completed_ids() == [] and storage.checkpoint_ids() == [1]
    path = storage.commit_metadata(1, _metadata(1))
    storage.commit_metadata(1, _metadata(1, completed_at=200.0))  # rewrite in place
    storage.reserve_ids(64)
    storage.write_job_state({"x": 1})
    assert path.endswith(f"/chk-1/{METADATA}")
    files = _files(tmp_path)
    assert not [f for f in files if f.endswith(".tmp") or os.path.basename(f).startswith(".")]
    run = "job/run-20240101T000000-aaaaaaaa"
    assert files == sorted(
        [
            f"{run}/_checkpoint_ids",
            f"{run}/_job_state",
            f"{run}/chk-1/_metadata",
            f"{run}/chk-1/a0-v0-s0.state",
        ]
    )
    assert storage.completed_ids() == [1]
    assert storage.load_metadata(1).completed_at == 200.0
    assert storage.latest() == _metadata(1, completed_at=200.0)


def test_load_metadata_of_a_damaged_file_names_the_checkpoint(tmp_path):
    storage = _run_storage(tmp_path)
    os.makedirs(storage.checkpoint_dir(5))
    with open(f"{storage.checkpoint_dir(5)}/{METADATA}", "wb") as out:
        out.write(b"\x00\x01 definitely not metadata")
    with pytest.raises(UnsupportedMetadataVersion, match="chk-5"):
        storage.load_metadata(5)


def test_collect_garbage_keeps_retained_in_flight_and_newer(tmp_path):
    storage = _run_storage(tmp_path)
    for cid in range(1, 9):
        storage.write_blob(cid, storage.blob_name(0, 0, 0), b"b")
    for cid in (3, 5, 8):
        storage.commit_metadata(cid, _metadata(cid))
    # 1, 2: subsumed/aborted; 4: in flight; 6, 7 (aborted, or late writes) are newer
    # than the newest retained one (5) and stay; 8 is completed and newer as well.
    dropped = storage.collect_garbage([3, 5], in_flight=4)
    assert dropped == [1, 2]
    assert storage.checkpoint_ids() == [3, 4, 5, 6, 7, 8]
    assert storage.completed_ids() == [3, 5, 8]
    assert storage.collect_garbage([5, 8], in_flight=None) == [3, 4, 6, 7]
    assert storage.checkpoint_ids() == [5, 8]
    assert not os.path.exists(storage.checkpoint_dir(3))
    assert storage.collect_garbage([], in_flight=None) == []
    assert storage.checkpoint_ids() == [5, 8]


def test_collect_garbage_removes_a_directory_recreated_by_a_late_write(tmp_path):
    storage = _run_storage(tmp_path)
    storage.write_blob(2, storage.blob_name(0, 0, 0), b"x")
    storage.discard(2)  # aborted
    storage.write_blob(2, storage.blob_name(0, 0, 1), b"late")  # a slow writer
    storage.commit_metadata(3, _metadata(3))
    assert storage.collect_garbage([3]) == [2]
    assert storage.checkpoint_ids() == [3]


def test_job_state_round_trip(tmp_path):
    storage = _run_storage(tmp_path)
    assert storage.read_job_state() is None
    sup = _supervisor(RestartStrategies.exponential_delay_restart(10, 100, 2.0, 5, 1000))
    sup.start_master()
    sup.start_attempt()
    sup.on_failure("boom", FailureKind.ATTEMPT, when=1.0)
    storage.write_job_state(sup.snapshot())
    loaded = _run_storage(tmp_path).read_job_state()
    assert isinstance(loaded, SupervisorState)
    assert loaded == sup.snapshot()
    # the strategy's position travels too: the next delay doubles
    assert RestartSupervisor(loaded).on_failure("again", FailureKind.ATTEMPT, when=2.0) == 0.02
    other_run = _run_storage(tmp_path, run_id="run-20240101T000001-dddddddd")
    assert other_run.read_job_state() is None  # runs never share a directory


def test_job_storage_across_two_runs(tmp_path):
    jobs = JobStorage(str(tmp_path), "job")
    assert jobs.runs() == [] and jobs.latest() is None and jobs.max_checkpoint_id() == 0
    old_id, new_id = "run-20240101T000000-aaaaaaaa", "run-20240102T000000-bbbbbbbb"
    old = jobs.run(old_id)
    for cid in (1, 2, 3):
        old.write_blob(cid, old.blob_name(0, 0, 0), b"o")
        old.commit_metadata(cid, _metadata(cid, completed_at=100.0 + cid, run_id=old_id))
    old.reserve_ids(64)
    new = jobs.run(new_id)
    new.write_blob(65, new.blob_name(0, 0, 0), b"n")
    new.commit_metadata(65, _metadata(65, completed_at=500.0, run_id=new_id))
    new.write_blob(66, new.blob_name(0, 0, 0), b"in progress")
    assert sorted(r.run_id for r in jobs.runs()) == [old_id, new_id]
    assert all(r.job_name == "job" for r in jobs.runs())
    assert jobs.max_checkpoint_id() == 66  # the new run reserved nothing yet
    new.reserve_ids(128)
    assert jobs.max_checkpoint_id() == 128
    run, meta = jobs.latest()
    assert run.run_id == new_id and meta.checkpoint_id == 65 and meta.run_id == new_id
    # the newest by completion time wins, not the highest id
    old.commit_metadata(4, _metadata(4, completed_at=900.0, run_id=old_id))
    run, meta = jobs.latest()
    assert run.run_id == old_id and meta.checkpoint_id == 4
    # directories that are not runs are ignored
    os.makedirs(tmp_path / "job" / "not-a-run")
    assert len(jobs.runs()) == 2


def test_job_storage_lists_checkpoints_from_before_runs(tmp_path):
    legacy = CheckpointStorage(str(tmp_path), "job")
    legacy.commit_metadata(9, _metadata(9, completed_at=50.0, run_id=None))
    jobs = JobStorage(str(tmp_path), "job")
    run_id = "run-20240101T000000-aaaaaaaa"
    jobs.run(run_id).commit_metadata(10, _metadata(10, completed_at=40.0, run_id=run_id))
    runs = jobs.runs()
    assert runs[0].run_id is None and runs[0].completed_ids() == [9]
    assert [r.run_id for r in runs[1:]] == [run_id]
    assert jobs.max_checkpoint_id() == 10
    assert jobs.latest()[1].checkpoint_id == 9


def test_job_storage_runs_are_oldest_first(tmp_path):
    rng = random.Random(7)
    run_ids = [f"run-20240101T0000{i:02d}-{rng.getrandbits(32):08x}" for i in range(16)]
    shuffled = run_ids[:]
    rng.shuffle(shuffled)
    for run_id in shuffled:
        os.makedirs(tmp_path / "job" / run_id)
    assert [r.run_id for r in JobStorage(str(tmp_path), "job").runs()] == run_ids


def test_new_run_id_is_unique_and_well_formed():
    ids = [new_run_id() for _ in range(500)]
    assert len(set(ids)) == len(ids)
    assert all(RUN_PATTERN.match(i) for i in ids)


def test_new_run_ids_sort_by_start_time(monkeypatch):
    import rayflow.checkpoint.storage as storage_module

    base = datetime.datetime(2023, 12, 31, 23, 59, 58, tzinfo=datetime.timezone.utc)
    times = iter(base + datetime.timedelta(seconds=s) for s in (0, 1, 2, 61, 3600, 86400 * 40))

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return next(times)

    fake = types.SimpleNamespace(datetime=Clock, timezone=datetime.timezone)
    monkeypatch.setattr(storage_module, "dt", fake)
    ids = [new_run_id() for _ in range(6)]
    assert ids[0].startswith("run-20231231T235958-")
    assert ids[-1].startswith("run-20240209T235958-")
    assert sorted(ids) == ids
    assert all(RUN_PATTERN.match(i) for i in ids)


# --- the attempt fence ----------------------------------------------------------------------


def test_fence_check_raises_after_revoke():
    fence = AttemptFence("run-9", 4)
    fence.check("a commit")  # not revoked: nothing happens
    assert not fence.revoked
    fence.revoke()
    assert fence.revoked
    with pytest.raises(StaleAttemptError) as info:
        fence.check("a commit")
    assert "a commit of attempt 4 of run run-9" in str(info.value)
    fence.revoke()  # idempotent
    with pytest.raises(StaleAttemptError):
        fence.check()
    with pytest.raises(StaleAttemptError, match=r"run \?"):
        revoked = AttemptFence("", 0)
        revoked.revoke()
        revoked.check()


def test_fence_revoked_from_another_thread_stops_a_worker():
    fence = AttemptFence("run-9", 1)
    started, outcome = threading.Event(), []

    def worker() -> None:
        started.set()
        try:
            for _ in range(50_000_000):
                fence.check("recover")
        except StaleAttemptError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert started.wait(2)
    revoker = threading.Thread(target=fence.revoke)
    revoker.start()
    revoker.join(2)
    thread.join(2)
    assert not thread.is_alive()
    assert len(outcome) == 1 and "recover of attempt 1" in str(outcome[0])
    with pytest.raises(StaleAttemptError):
        fence.check()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_fence_cannot_be_pickled(protocol):
    fence = AttemptFence("run-9", 1)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(fence, protocol=protocol)
    with pytest.raises(TypeError):
        pickle.dumps({"nested": [fence]}, protocol=protocol)


def test_fence_cannot_be_copied():
    with pytest.raises(TypeError):
        copy.deepcopy(AttemptFence("run-9", 1))


# --- seeded fault plans ---------------------------------------------------------------------

STALLS = (FaultPoint.DURING_RECOVER, FaultPoint.DURING_BLOB_WRITE, FaultPoint.DURING_STATE_LOAD)
MIXED_POINTS = [
    FaultPoint.DURING_RECOVER,
    FaultPoint.DURING_BLOB_WRITE,
    FaultPoint.AFTER_RECORDS,
    FaultPoint.FINAL_NOTIFY,
    FaultPoint.JOB_MASTER_BEFORE_NOTIFY,
    FaultPoint.DURING_ALIGNMENT,
]


@pytest.mark.parametrize("seed", [0, 1, 42, 12345])
def test_fault_plan_random_is_deterministic_for_a_seed(seed):
    kwargs = dict(kills=6, vertices=["source", "map", "sink"], parallelism=3, points=MIXED_POINTS)
    first = FaultPlan.random(seed, **kwargs)
    second = FaultPlan.random(seed, **kwargs)
    assert first.faults == second.faults
    assert first.faults  # not trivially equal
    other = FaultPlan.random(seed + 1, **kwargs)
    assert other.faults != first.faults


def test_fault_plan_random_with_default_points():
    plan = FaultPlan.random(3, kills=4)
    assert [f.attempt for f in plan.faults] == [0, 1, 2, 3]
    assert {f.point for f in plan.faults} == {
        FaultPoint.AFTER_RECORDS,
        FaultPoint.DURING_ALIGNMENT,
        FaultPoint.AFTER_SNAPSHOT,
        FaultPoint.BEFORE_NOTIFY,
    }
    assert all(f.action == "sigkill" for f in plan.faults)
    assert all(0 <= f.subtask < 2 and 1 <= f.records < 200_000 for f in plan.faults)
    assert all(f.checkpoint in (1, 2) for f in plan.faults)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("parallelism", [2, 3, 4])
def test_fault_plan_pairs_stalled_threads_with_a_kill_elsewhere(seed, parallelism):
    kills = len(MIXED_POINTS) + 2
    plan = FaultPlan.random(
        seed,
        kills=kills,
        vertices=["source", "map", "sink"],
        parallelism=parallelism,
        max_records=1000,
        points=MIXED_POINTS,
    )
    by_attempt: dict[int, list[Fault]] = {}
    for fault in plan.faults:
        by_attempt.setdefault(fault.attempt, []).append(fault)
    assert sorted(by_attempt) == list(range(kills))  # one drawn fault per attempt
    primaries = [faults[0] for faults in by_attempt.values()]
    # every point is drawn at least once when there are as many kills as points
    assert {f.point for f in primaries} == set(MIXED_POINTS)
    for attempt, faults in by_attempt.items():
        primary = faults[0]
        if primary.point in STALLS:
            assert primary.action == "sleep" and primary.seconds > 0
            assert len(faults) == 2, faults
            kill = faults[1]
            assert kill.point is FaultPoint.AFTER_RECORDS
            assert kill.attempt == attempt
            assert kill.action == "sigkill"
            assert kill.subtask != primary.subtask
            assert 0 <= kill.subtask < parallelism
            assert 1 <= kill.records <= 1000 // 4 + 1
        else:
            assert len(faults) == 1, faults
            expected = "drop" if primary.point is FaultPoint.FINAL_NOTIFY else "sigkill"
            assert primary.action == expected


def test_hook_points_in_the_job_master():
    assert {p for p in HookPoint if p.in_job_master} == {
        HookPoint.BEFORE_NOTIFY,
        HookPoint.JOB_MASTER_BEFORE_NOTIFY,
        HookPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT,
        HookPoint.DURING_RESTART_DELAY,
        HookPoint.FINAL_NOTIFY,
        HookPoint.DURING_COMMIT_POINT,
        HookPoint.JOB_MASTER_BEFORE_STOP_RECORD,
        HookPoint.JOB_MASTER_BEFORE_SAVEPOINT_WRITE,
    }


def test_fault_plan_splits_faults_between_subtasks_and_the_job_master():
    records = Fault(FaultPoint.AFTER_RECORDS, 0, "map", 1, records=5)
    notify = Fault(FaultPoint.BEFORE_NOTIFY, 0, "map", 1)
    master = Fault(FaultPoint.JOB_MASTER_BEFORE_NOTIFY, 0)
    recover = Fault(FaultPoint.DURING_RECOVER, 1, None, 0, action="sleep", seconds=2.0)
    final = Fault(FaultPoint.FINAL_NOTIFY, 1, action="drop")
    delay = Fault(FaultPoint.DURING_RESTART_DELAY, 2, "sink", 0)
    plan = FaultPlan([records, notify, master, recover, final, delay])

    mine = plan.for_subtask("source->map", 1, 0)
    assert isinstance(mine, SubtaskFaults) and mine.faults == [records]
    assert mine.record_threshold == 5
    assert plan.for_subtask("sink", 1, 0) is None  # other vertex
    assert plan.for_subtask("source->map", 0, 0) is None  # other subtask
    assert plan.for_subtask("source->map", 1, 1) is None  # other attempt
    assert plan.for_subtask("anything", 0, 1).faults == [recover]
    assert plan.for_subtask("sink", 0, 2) is None  # a master point, though it names a sink

    first = plan.for_job_master(0)
    assert isinstance(first, MasterFaults) and first.faults == [notify, master]
    assert plan.for_job_master(1).faults == [final]
    assert plan.for_job_master(2).faults == [delay]
    assert plan.for_job_master(3) is None


@pytest.mark.parametrize("seed", range(10))
def test_every_random_fault_lands_on_exactly_one_side(seed):
    plan = FaultPlan.random(seed, kills=8, vertices=["v"], parallelism=2, points=MIXED_POINTS)
    for fault in plan.faults:
        subtask = plan.for_subtask("v", fault.subtask, fault.attempt)
        master = plan.for_job_master(fault.attempt)
        in_subtask = subtask is not None and fault in subtask.faults
        in_master = master is not None and fault in master.faults
        assert in_subtask != in_master
        assert in_master == fault.point.in_job_master


def test_subtask_faults_fire_once_at_their_threshold_and_checkpoint():
    faults = SubtaskFaults(
        [
            Fault(FaultPoint.AFTER_RECORDS, records=10, action="raise"),
            Fault(FaultPoint.DURING_ALIGNMENT, checkpoint=2, action="raise"),
        ]
    )
    faults.after_records(9)
    with pytest.raises(InjectedFault):
        faults.after_records(10)
    faults.after_records(11)  # fired once: the threshold is gone
    faults.at(FaultPoint.DURING_ALIGNMENT)  # checkpoint 1: nothing
    faults.at(FaultPoint.AFTER_SNAPSHOT)  # another point: nothing
    with pytest.raises(InjectedFault):
        faults.at(FaultPoint.DURING_ALIGNMENT)  # checkpoint 2
    faults.at(FaultPoint.DURING_ALIGNMENT)


def test_a_run_that_failed_for_good_is_cleaned_up_before_it_fails():
    sup = _supervisor(RestartStrategies.no_restart())
    sup.start_attempt()
    assert sup.on_failure("boom", FailureKind.ATTEMPT, when=1.0) is None
    assert sup.job_state is JobState.FAILING
    sup.begin_clean_up()  # a job master taking over a final failure finishes the clean-up
    assert sup.job_state is JobState.CANCELLING
    sup.move_to(JobState.CANCELED)
    sup.begin_clean_up()  # final states stay final
    assert sup.job_state is JobState.CANCELED


def test_an_unreachable_actor_is_not_taken_for_dead(monkeypatch):
    import asyncio

    import ray
    from ray.exceptions import ActorUnavailableError

    from rayflow.runtime.actor_exit import ActorsStillAlive, kill_and_wait

    class _Call:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def __await__(self):
            raise self.error
            yield  # pragma: no cover

    class _Method:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def remote(self) -> _Call:
            return _Call(self.error)

    class _Handle:
        def __init__(self, error: BaseException) -> None:
            self.ready = _Method(error)

    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)  # no Ray here
    unreachable = _Handle(ActorUnavailableError("unreachable", b"\x00" * 16))
    with pytest.raises(ActorsStillAlive):
        asyncio.run(kill_and_wait([unreachable], timeout_s=0.3))


def test_local_checkpoint_files_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    """A power loss right after a commit point must not leave an empty "completed"
    checkpoint: the blob, the metadata and the directory entry are each fsynced."""
    import os as _os

    synced: list[str] = []
    real_fsync = _os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(_os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(_os, "fsync", recording_fsync)
    storage = CheckpointStorage(str(tmp_path), "job", run_id="run-20260101T000000-abc")
    blob = storage.write_blob(3, storage.blob_name(0, 1, 0), b"state")
    assert blob in synced
    synced.clear()
    meta = CheckpointMetadata(3, "job", storage.run_id, 0, 0.0, 1.0, False)
    final = storage.commit_metadata(3, meta)
    chk_dir = _os.path.dirname(final)
    temp_synced = [p for p in synced if _os.path.basename(p).startswith(".")]
    assert temp_synced, synced  # the data, under its temporary name, before the rename
    assert synced.index(temp_synced[0]) < synced.index(chk_dir)  # then the directory


def test_a_metadata_write_whose_answer_was_lost_counts_if_it_reads_back(tmp_path):
    """An object store may take the PUT of a commit point and lose the answer: the
    checkpoint exists exactly when its own metadata reads back."""
    from rayflow import StreamExecutionEnvironment
    from rayflow.checkpoint.coordinator import CheckpointCoordinator
    from rayflow.config import CheckpointConfig

    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_collection([{"a": 1}]).print()
    storage = CheckpointStorage(str(tmp_path), "job", run_id="run-20260101T000000-abc")
    coordinator = CheckpointCoordinator(
        "job",
        CheckpointConfig(),
        storage,
        env.get_job_graph(),
        {},
        3,
        CheckpointIdCounter(storage, 1),
        lambda exc: None,
        None,
        CheckpointHistory(),
        None,
        run_id=storage.run_id,
    )
    ours = CheckpointMetadata(5, "job", storage.run_id, 3, 0.0, 12.5, False)
    assert coordinator._reads_back(5, ours) is False  # nothing was written
    storage.commit_metadata(5, ours)
    assert coordinator._reads_back(5, ours) is True
    other = CheckpointMetadata(5, "job", storage.run_id, 2, 0.0, 11.0, False)
    assert coordinator._reads_back(5, other) is False  # someone else's write


@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_kills_one_per_attempt_each_within_reach_of_a_restart(seed):
    plan = FaultPlan.seeded_kills(seed, 4, parallelism=3, records_per_subtask=10_000, vertex="v")
    assert plan.faults == FaultPlan.seeded_kills(seed, 4, 3, 10_000, "v").faults
    assert [f.attempt for f in plan.faults] == [0, 1, 2, 3]
    assert all(f.point is FaultPoint.AFTER_RECORDS and f.action == "sigkill" for f in plan.faults)
    assert all(f.vertex == "v" and 0 <= f.subtask < 3 for f in plan.faults)
    # each within a fifth of a subtask's records, at least half of it: all kills together
    # stay below one subtask's share, so a restarted attempt still reaches its threshold
    assert all(1_000 <= f.records <= 2_000 for f in plan.faults)
    assert FaultPlan.seeded_kills(seed, 0, 3, 10_000).faults == []


def test_seeded_kills_rejects_nonsense():
    with pytest.raises(ValueError, match="kills"):
        FaultPlan.seeded_kills(1, -1, 2, 100)
    with pytest.raises(ValueError, match="parallelism"):
        FaultPlan.seeded_kills(1, 1, 0, 100)


def test_an_ending_run_shows_the_state_its_end_is_reached_from():
    for state in JobState:
        shown = state.while_ending
        if state.is_terminal:
            assert not shown.is_terminal and shown.can_move_to(state), (state, shown)
        else:
            assert shown is state


def test_no_attempt_starts_beside_a_killed_subtask_whose_process_still_runs(monkeypatch):
    """Stopping a failed attempt kills a subtask whose process is not seen to exit (a
    thread stuck in the kernel, a node cut off): the job fails without another attempt,
    and without a clean-up from the checkpoint beside it, naming why."""
    import asyncio
    from types import SimpleNamespace

    import rayflow.runtime.job_master as job_master
    from rayflow.errors import JobFailedError
    from rayflow.runtime.actor_exit import ActorsStillAlive

    survivor = object()

    async def never_gone(actors, timeout_s=30.0, known=None):
        raise ActorsStillAlive("1 killed subtask actor(s) still run", list(actors))

    monkeypatch.setattr(job_master, "kill_and_wait", never_gone)
    master = object.__new__(job_master.JobMaster)
    master.supervisor = _supervisor(RestartStrategies.fixed_delay_restart(5, 10))
    master.settings = SimpleNamespace(job_name="j", hooks=None, failure_classifier=None)
    master.ray_metrics = SimpleNamespace(restarts=lambda n: None)
    master._cancelled = asyncio.Event()
    master._survivors = []
    master._processes = {}
    master.attempt = -1
    master.clean_up_failure = None
    attempts, cleaned = [], []

    async def nothing(*args, **kwargs):
        return None

    async def run_attempt(attempt):
        attempts.append(attempt)
        raise RuntimeError("subtask 1/2 of 'out' died")

    async def stop_attempt(reuse=False):
        await master._read_then_kill({(1, 0): survivor})

    async def clean_up():
        cleaned.append(await master._survivors_gone())
        if not cleaned[-1]:
            master.clean_up_failure = "not cleaned up: " + job_master.SURVIVORS

    master._output = SimpleNamespace(last_read=nothing)
    for name, fn in {
        "_persist": nothing,
        "_persist_quietly": nothing,
        "_take_holds": nothing,
        "_kill_everything": nothing,
        "_restart_delay": nothing,
        "_run_attempt": run_attempt,
        "_stop_attempt": stop_attempt,
        "_clean_up_outside_world": clean_up,
    }.items():
        setattr(master, name, fn)
    with pytest.raises(JobFailedError, match="no attempt or clean-up starts beside them"):
        asyncio.run(master._run_with_restarts())
    assert attempts == [0] and cleaned == [False] and master._survivors == [survivor]


def test_a_run_whose_actors_cannot_be_checked_keeps_its_job_name(monkeypatch):
    """Schedule: as a run ends, the check that its actors' processes have exited fails
    (Ray's actor table unreadable, a probe lost). Before: any error but the one saying
    processes still run released the job name's lock, so a next run could start beside
    them. Now the lock stays while this driver lives."""
    from rayflow import environment as env_module
    from rayflow.environment import JobClient

    released: list[object] = []

    def unknown(job_id, timeout_s=30.0):
        raise RuntimeError("Ray's actor table could not be read")

    monkeypatch.setattr(env_module, "_kill_job_actors", unknown)
    monkeypatch.setattr(env_module, "release_run_lock", lambda lock: released.append(lock))
    monkeypatch.setattr(env_module.ray, "kill", lambda *args, **kwargs: None)
    client = object.__new__(JobClient)
    client.job_name = "unchecked"
    client.job_id = "0123456789ab"
    client._master = object()
    client._lock = "the lock"
    client._warm = None
    client._release_lock = env_module.threading.Lock()
    client._retrying = False
    client._released = False
    monkeypatch.setattr(env_module, "RELEASE_RETRY_S", 0.05)
    client._release()
    assert released == [], "released the job name while its actors' processes were unknown"
    assert client._lock == "the lock" and client.holds_job_name
    time.sleep(0.3)
    assert released == []  # still not known: still held
    monkeypatch.setattr(env_module, "_kill_job_actors", lambda job_id, timeout_s=30.0: None)
    deadline = time.monotonic() + 10
    while client.holds_job_name and time.monotonic() < deadline:
        time.sleep(0.02)
    assert released == ["the lock"], "a thread of the driver releases it once they stopped"
    assert not client.holds_job_name


def test_an_interrupt_while_stopping_a_run_s_actors_still_releases_its_name_later(
    monkeypatch,
):
    """Review schedule: Ctrl-C lands while a run's end stops its actors. Before: the
    interrupt skipped the thread that releases the name once they have stopped, so the
    name stayed locked for as long as the process (a notebook's kernel) lived."""
    from rayflow import environment as env_module

    released: list[object] = []
    kills: list[int] = []

    def kill(job_id, timeout_s=30.0):
        kills.append(1)
        if len(kills) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(env_module, "_kill_job_actors", kill)
    monkeypatch.setattr(env_module, "release_run_lock", lambda lock: released.append(lock))
    _interrupt_a_release_then_wait(monkeypatch)
    assert released == ["the lock"]


def test_a_job_master_ending_with_survivors_does_not_release_the_job_name(monkeypatch):
    """Review schedule: killed subtask processes are not seen to exit; the run fails as
    one that no restart can help, and its job master's last step released the job
    name's lock. Before: the record was marked released, so a next run of the name took
    it at once, beside the survivors (the driver's keeping of its lock came too late).
    Now the job master leaves the name to its client, which releases it once they are
    gone."""
    import asyncio
    from types import SimpleNamespace

    from rayflow.runtime import job_master

    released: list[tuple[str, str]] = []

    async def release():
        released.append((master.settings.job_name, master.settings.run_id))

    async def nothing(*args, **kwargs):
        return None

    async def failed_for_good():
        master.supervisor.on_failure("subtask 1/2 of 'out' died", FailureKind.ATTEMPT)
        master.supervisor.move_to(JobState.FAILED)
        raise RuntimeError("killed subtask actor(s) still run")

    master = object.__new__(job_master.JobMaster)
    master._release_job_name = release
    master.supervisor = _supervisor(RestartStrategies.no_restart())
    master.settings = SimpleNamespace(job_name="j", run_id="run-x")
    master.placement = SimpleNamespace(create=lambda: None, remove=nothing)
    master._holds = None
    master._run_with_restarts = failed_for_good
    for survivors, expected in (([object()], []), ([], [("j", "run-x")])):
        released.clear()
        master.supervisor = _supervisor(RestartStrategies.no_restart())
        master._survivors = survivors
        with pytest.raises(RuntimeError):
            asyncio.run(master._run())
        assert master.supervisor.job_state.is_terminal
        assert released == expected


def test_an_interrupt_while_releasing_the_job_name_still_releases_it_later(monkeypatch):
    """Review schedule: the run's actors are gone; Ctrl-C lands inside the release of
    its job name's lock (which pauses between tries). Before: nothing released it after,
    for as long as the process (a notebook's kernel) lived."""
    from rayflow import environment as env_module

    released: list[object] = []

    def release(lock):
        if not released:
            released.append("interrupted")
            raise KeyboardInterrupt
        released.append(lock)

    monkeypatch.setattr(env_module, "_kill_job_actors", lambda job_id, timeout_s=30.0: None)
    monkeypatch.setattr(env_module, "release_run_lock", release)
    _interrupt_a_release_then_wait(monkeypatch)
    assert released == ["interrupted", "the lock"]


def _interrupt_a_release_then_wait(monkeypatch) -> None:
    """Ends a run whose job name is held, where Ctrl-C lands inside the release (the
    patched kill or release raises it); waits up to 10 s for a thread to release it."""
    from rayflow import environment as env_module
    from rayflow.environment import JobClient

    monkeypatch.setattr(env_module.ray, "kill", lambda *args, **kwargs: None)
    monkeypatch.setattr(env_module, "RELEASE_RETRY_S", 0.05)
    client = object.__new__(JobClient)
    client.job_name, client.job_id = "interrupted", "0123456789ab"
    client._master, client._lock, client._warm = object(), "the lock", None
    client._release_lock = env_module.threading.Lock()
    client._retrying = False
    client._released = False
    with pytest.raises(KeyboardInterrupt):
        client._release()
    deadline = time.monotonic() + 10
    while client.holds_job_name and time.monotonic() < deadline:
        time.sleep(0.02)
