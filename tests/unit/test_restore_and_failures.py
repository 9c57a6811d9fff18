"""The restore assigner and the checkpoint failure manager, without Ray."""

from __future__ import annotations

import pytest

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.checkpoint.failures import CheckpointFailureLimit, CheckpointFailureManager
from rayflow.checkpoint.metadata import CheckpointMetadata, SubtaskStateMeta
from rayflow.runtime.restore import assign_source_splits, state_handles
from rayflow.sources import NumberSplit
from rayflow.status import CheckpointFailureReason
from sinks.basic import CollectSink


def _graph(parallelism: int):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    (
        env.from_source(NumberSequenceSource(0, 99), "numbers")
        .uid("numbers")
        .key_by("value")
        .sum("value")
        .uid("sum")
        .sink_to(CollectSink(), name="out")
        .uid("out")
    )
    graph = env.get_job_graph()
    source = next(v for v in graph.vertices.values() if v.is_source)
    summing = next(v for v in graph.vertices.values() if not v.is_source)
    return source, summing


def _meta(subtasks, splits) -> CheckpointMetadata:
    return CheckpointMetadata(5, "job", "run-x", 0, 0.0, 1.0, False, subtasks, splits)


def test_fresh_source_splits_cover_the_input_once():
    source, _ = _graph(3)
    per_subtask = assign_source_splits(source, None)
    assert len(per_subtask) == 3 and all(len(s) == 1 for s in per_subtask)
    covered = sorted((s.next_value, s.end) for subtask in per_subtask for s in subtask)
    assert covered[0][0] == 0 and covered[-1][1] == 99  # ends are inclusive
    assert all(a[1] + 1 == b[0] for a, b in zip(covered, covered[1:]))


def test_saved_splits_are_dealt_round_robin_in_split_order_when_rescaling():
    source, _ = _graph(2)
    saved = [
        NumberSplit(split_id=f"numbers-{i}", next_value=10 * i + 5, end=10 * i + 10)
        for i in (2, 0, 1)
    ]
    meta = _meta({}, {source.source_uid: saved})
    per_subtask = assign_source_splits(source, meta)
    assert [[s.split_id for s in subtask] for subtask in per_subtask] == [
        ["numbers-0", "numbers-2"],
        ["numbers-1"],
    ]
    assert per_subtask[0][0].next_value == 5  # restored positions, not fresh ones


def test_state_handles_pick_the_snapshots_holding_the_vertex_operators():
    source, summing = _graph(2)
    sum_uids = tuple(op.uid for op in summing.operators)
    subtasks = {
        (source.vertex_id, 0): SubtaskStateMeta("p/a0-v0-s0", 1, ("numbers",), 2, "numbers"),
        (summing.vertex_id, 1): SubtaskStateMeta("p/a0-v1-s1", 1, sum_uids, 2, "sum"),
        (summing.vertex_id, 0): SubtaskStateMeta("p/a0-v1-s0", 1, sum_uids, 2, "sum"),
    }
    refs = {(summing.vertex_id, 0): "ref-0"}
    handles = state_handles(summing, _meta(subtasks, {}), refs)
    assert [(h.old_index, h.path, h.ref) for h in handles] == [
        (0, "p/a0-v1-s0", "ref-0"),
        (1, "p/a0-v1-s1", None),
    ]
    assert state_handles(summing, None) == []


def test_failure_manager_fails_after_the_tolerated_number_in_a_row_and_starts_again():
    manager = CheckpointFailureManager(tolerable=2)
    timeout = CheckpointFailureReason.TIMEOUT
    assert manager.on_failure(1, timeout, "t") is None
    manager.on_success()
    assert manager.on_failure(2, timeout, "t") is None
    assert manager.on_failure(3, timeout, "t") is None
    limit = manager.on_failure(4, timeout, "slow")
    assert isinstance(limit, CheckpointFailureLimit)
    assert "checkpoint 4 failed (slow); 3 failed in a row, 2 tolerated" in str(limit)
    assert manager.in_a_row == 0  # the next attempt gets the same allowance
    assert manager.on_failure(5, timeout, "t") is None


def test_a_checkpoint_aborted_because_its_attempt_ended_is_not_counted():
    manager = CheckpointFailureManager(tolerable=0)
    assert manager.on_failure(1, CheckpointFailureReason.ATTEMPT_ENDED, "x") is None
    assert manager.in_a_row == 0
    assert manager.on_failure(2, CheckpointFailureReason.DECLINED, "x") is not None
    with pytest.raises(ValueError, match="tolerable"):
        CheckpointFailureManager(-1)
