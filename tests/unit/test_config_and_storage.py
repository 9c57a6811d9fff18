"""Restart strategies, checkpoint configuration, and the durable tier's commit point."""

import math

import pytest

from rayflow.checkpoint.storage import CheckpointStorage, open_checkpoint_path
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
    ],
)
def test_bad_checkpoint_options_name_the_option(setter, value):
    with pytest.raises(ValueError, match="checkpoint|pause|concurrent|retained"):
        getattr(CheckpointConfig(), setter)(value)


def test_metadata_is_the_commit_point(tmp_path):
    storage = CheckpointStorage(str(tmp_path), "job/one")
    storage.write_blob(1, "v0-s0.state", b"state")
    assert storage.completed_ids() == []  # blobs without metadata are no checkpoint
    storage.commit_metadata(1, {"checkpoint_id": 1})
    storage.write_blob(2, "v0-s0.state", b"state")
    assert storage.completed_ids() == [1]
    assert storage.latest() == {"checkpoint_id": 1}
    leftovers = [p.name for p in (tmp_path / "job-one" / "chk-1").iterdir()]
    assert sorted(leftovers) == ["_metadata", "v0-s0.state"]  # no temporary file remains
    storage.discard(1)
    assert storage.completed_ids() == []


def test_open_checkpoint_path_accepts_a_job_dir_or_one_checkpoint(tmp_path):
    storage = CheckpointStorage(str(tmp_path), "job")
    storage.commit_metadata(7, {"checkpoint_id": 7})
    s, cid = open_checkpoint_path(str(tmp_path / "job" / "chk-7"))
    assert cid == 7 and s.completed_ids() == [7]
    s, cid = open_checkpoint_path(str(tmp_path / "job"))
    assert cid is None and s.latest() == {"checkpoint_id": 7}


def test_storage_pickles_without_its_filesystem(tmp_path):
    import pickle

    storage = CheckpointStorage(str(tmp_path), "job")
    storage.completed_ids()
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.location() == storage.location()
