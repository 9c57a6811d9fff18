"""Restart strategies, checkpoint configuration, and the durable tier's commit point."""

import math

import pytest

from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.checkpoint.storage import CheckpointStorage, JobStorage, open_checkpoint_path
from rayflow.config import CheckpointConfig, RestartStrategies, default_restart_strategy


def test_fixed_delay_gives_up_after_its_attempts():
    s = RestartStrategies.fixed_delay_restart(2, 500)
    assert [s.next_delay_s(t) for t in (1, 2, 3)] == [0.5, 0.5, None]


def test_exponential_delay_grows_to_its_cap_and_resets_after_quiet_time():
    s = RestartStrategies.exponential_delay_restart(100, 350, 2.0, None, 10_000)
    assert [s.next_delay_s(t) for t in (1, 2, 3, 4)] == [0.1, 0.2, 0.35, 0.35]
    assert s.next_delay_s(100) == 0.1


def test_failure_rate_gives_up_when_too_many_failures_in_the_interval():
    s = RestartStrategies.failure_rate_restart(2, 10_000, 0)
    assert s.next_delay_s(0) == 0 and s.next_delay_s(1) == 0
    assert s.next_delay_s(2) is None
    s2 = RestartStrategies.failure_rate_restart(2, 1_000, 0)
    assert [s2.next_delay_s(t) for t in (0, 5, 10, 15)] == [0, 0, 0, 0]


def test_defaults_follow_flink():
    assert default_restart_strategy(False).next_delay_s(0) is None
    assert default_restart_strategy(True).attempts == math.inf


@pytest.mark.parametrize(
    ("setter", "value"),
    [
        ("set_checkpoint_interval", 1),
        ("set_checkpoint_timeout", 0),
        ("set_min_pause_between_checkpoints", -1),
        ("set_max_concurrent_checkpoints", 2),
        ("set_num_retained_checkpoints", 0),
        ("set_checkpoint_history_size", 0),
    ],
)
def test_bad_checkpoint_options_name_the_option(setter, value):
    with pytest.raises(ValueError, match="checkpoint|pause|concurrent|retained"):
        getattr(CheckpointConfig(), setter)(value)


def _meta(cid: int, run_id: str | None = None, completed_at: float = 0.0) -> CheckpointMetadata:
    return CheckpointMetadata(cid, "job", run_id, 0, 0.0, completed_at, False)


def test_metadata_is_the_commit_point(tmp_path):
    storage = CheckpointStorage(str(tmp_path), "job/one", run_id="run-20260101T000000-abc")
    storage.write_blob(1, "a0-v0-s0.state", b"state")
    assert storage.completed_ids() == []  # blobs without metadata are no checkpoint
    storage.commit_metadata(1, _meta(1))
    storage.write_blob(2, "a0-v0-s0.state", b"state")
    assert storage.completed_ids() == [1]
    assert storage.latest() == _meta(1)
    run_dir = tmp_path / "job-one" / "run-20260101T000000-abc"
    leftovers = [p.name for p in (run_dir / "chk-1").iterdir()]
    assert sorted(leftovers) == ["_metadata", "a0-v0-s0.state"]  # no temporary file remains
    storage.discard(1)
    assert storage.completed_ids() == []


def test_open_checkpoint_path_accepts_a_job_dir_a_run_dir_or_one_checkpoint(tmp_path):
    old = CheckpointStorage(str(tmp_path), "job", run_id="run-20260101T000000-aaa")
    new = CheckpointStorage(str(tmp_path), "job", run_id="run-20260102T000000-bbb")
    old.commit_metadata(7, _meta(7, old.run_id, completed_at=2.0))
    new.commit_metadata(3, _meta(3, new.run_id, completed_at=1.0))
    s, cid = open_checkpoint_path(str(tmp_path / "job" / old.run_id / "chk-7"))
    assert cid == 7 and s.completed_ids() == [7]
    s, cid = open_checkpoint_path(str(tmp_path / "job" / new.run_id))
    assert cid is None and s.latest().checkpoint_id == 3
    s, cid = open_checkpoint_path(str(tmp_path / "job"))
    assert cid is None and isinstance(s, JobStorage)
    store, meta = s.latest()  # newest by completion time, across runs
    assert (store.run_id, meta.checkpoint_id) == (old.run_id, 7)
    assert s.max_checkpoint_id() == 7


def test_storage_pickles_without_its_filesystem(tmp_path):
    import pickle

    storage = CheckpointStorage(str(tmp_path), "job")
    storage.completed_ids()
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.location() == storage.location()
