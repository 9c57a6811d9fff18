"""Exactly-once state and sink output under kills with unaligned checkpoints.

The keyed running sum (tests/chaos/harness.py) runs with unaligned checkpoints, or with
aligned ones that switch to unaligned after a short timeout, while the sum subtask that
owns key 0 sleeps per batch (``hot_delay_s``): its input channels back up, so barriers
overtake real in-flight data and checkpoints hold channel state. Every test checks the
committed output against the exact one: each key ends on its exact sum, its committed
totals rise strictly, and the row count is the exact one (0 lost, 0 duplicated).

* seeded kills at every point of the protocol, DURING_CHANNEL_STATE_WRITE included,
  unaligned and aligned-with-timeout;
* a restore that must replay channel state: a subtask is killed right after a
  checkpoint holding channel state completed (the fault waits for one), optionally
  again while the next attempt replays it;
* a kill (or an error) in the blob-writing thread before a blob with channel state is
  written;
* an unaligned checkpoint with channel state is refused at another parallelism (a
  ValueError that says to take an aligned checkpoint) and resumes at the same one.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import replace

import pytest
import ray

from rayflow import JobFailedError
from rayflow.checkpoint.storage import CheckpointStorage, JobStorage
from rayflow.config import CheckpointAlignment
from rayflow.keygroups import DEFAULT_MAX_PARALLELISM, key_group_of, subtask_of_key_group
from rayflow.runtime.hooks import MasterHooks, RuntimeHooks
from rayflow.testing import Fault, FaultPlan, FaultPoint, SubtaskFaults
from tests.chaos.harness import (
    build_keyed_sum,
    expected_rows,
    expected_sums,
    outcome,
    unique_job,
)
from tests.chaos.run_chaos import check_exactly_once

N = 1_000_000
P = 2
BATCH = 5000
HOT_DELAY_S = 0.03  # the hot subtask takes ~33 batches/s; the sources send ~200
SUM_VERTEX = "Sum"  # the chained vertex "Sum -> hot-key -> committed"
HOT = subtask_of_key_group(key_group_of(0, DEFAULT_MAX_PARALLELISM), P, DEFAULT_MAX_PARALLELISM)

SEEDED_POINTS = [
    FaultPoint.AFTER_RECORDS,
    FaultPoint.DURING_ALIGNMENT,
    FaultPoint.AFTER_SNAPSHOT,
    FaultPoint.BEFORE_NOTIFY,
    FaultPoint.DURING_CHANNEL_STATE_WRITE,
]


def seeded_plan(seed: int) -> FaultPlan:
    """One fault at each of ``SEEDED_POINTS``, one per attempt, in a seeded order; the
    channel-state write fault is aimed at the hot subtask (the one whose blobs hold
    channel state)."""
    points = list(SEEDED_POINTS)
    random.Random(seed).shuffle(points)
    plan = FaultPlan.random(
        seed, kills=len(points), parallelism=P, max_records=N // 10, points=points
    )
    return FaultPlan(
        [
            replace(f, vertex=SUM_VERTEX, subtask=HOT)
            if f.point is FaultPoint.DURING_CHANNEL_STATE_WRITE
            else f
            for f in plan.faults
        ]
    )


def assert_exactly_once(result, sink, n: int = N) -> None:
    got = outcome(result, sink)
    problems = check_exactly_once(got.table, n, P, "committed")
    assert not problems, (problems, result.failures)
    assert got.sums == expected_sums(n)
    assert got.rows == expected_rows(n, P, BATCH)


def describe(result) -> str:
    lines = [f"restarts={result.restarts} restored_from={result.restored_from}"]
    lines += [
        f"  chk {c['checkpoint_id']} {c['status']} attempt={c['attempt']} "
        f"unaligned={c['unaligned']} channel_state={c['channel_state_size']}"
        for c in result.checkpoints
    ]
    lines += [f"  failure: {f}" for f in result.failures]
    return "\n".join(lines)


# --- (a), (b): seeded kills -----------------------------------------------------------


@pytest.mark.chaos
@pytest.mark.parametrize(
    "alignment, seed",
    [
        (CheckpointAlignment.UNALIGNED, 11),
        (CheckpointAlignment.UNALIGNED, 23),
        (CheckpointAlignment.ALIGNED_WITH_TIMEOUT, 37),
    ],
)
def test_seeded_kills_are_exactly_once(alignment, seed, tmp_path):
    plan = seeded_plan(seed)
    assert {f.point for f in plan.faults} == set(SEEDED_POINTS)
    env, sink = build_keyed_sum(
        N,
        P,
        BATCH,
        storage=str(tmp_path),
        plan=plan,
        alignment=alignment,
        alignment_timeout_ms=20,
        hot_delay_s=HOT_DELAY_S,
    )
    result = env.execute(unique_job(f"unaligned-{alignment.value}-{seed}"))
    print(describe(result))
    assert result.restarts >= 3, describe(result)
    assert_exactly_once(result, sink)
    completed = result.completed_checkpoints
    # the last completed checkpoints (history keeps 10) include unaligned ones that
    # hold channel state: the alignment timeout did switch, and there was backpressure
    assert any(c["unaligned"] for c in completed), describe(result)
    assert any(c["channel_state_size"] > 0 for c in completed), describe(result)


# --- (c): a restore replays channel state ---------------------------------------------


class _MasterKill(MasterHooks):
    def __init__(self, owner: KillAfterChannelState) -> None:
        self.owner = owner

    def at(self, point, checkpoint, subtasks) -> bool:
        return self.owner.before_notify(point, subtasks)


class KillAfterChannelState(RuntimeHooks):
    """Attempt 0: at BEFORE_NOTIFY (after the commit point, before any notification) of
    the first completed checkpoint whose metadata holds channel state, kill the sum
    subtask holding it; the next attempt must restore that checkpoint and replay it.
    ``replay_kill``: kill that subtask again in attempt 1 after its first input batch,
    which is the first batch of the replayed channel state. What fired is written to
    ``record`` (the job master runs in another process)."""

    def __init__(self, storage: str, job: str, record: str, replay_kill: bool) -> None:
        self.storage, self.job, self.record, self.replay_kill = storage, job, record, replay_kill
        self.fired: dict | None = None

    def for_job_master(self, attempt: int) -> MasterHooks | None:
        return _MasterKill(self) if attempt == 0 else None

    def for_subtask(self, vertex_name: str, index: int, attempt: int):
        if not self.replay_kill or attempt != 1 or self.fired is None:
            return None
        if SUM_VERTEX not in vertex_name or index != self.fired["subtask"]:
            return None
        return SubtaskFaults([Fault(FaultPoint.AFTER_RECORDS, 1, SUM_VERTEX, index, records=1)])

    def before_notify(self, point, subtasks) -> bool:
        if point is not FaultPoint.BEFORE_NOTIFY or self.fired is not None:
            return True
        found = JobStorage(self.storage, self.job).latest()  # the commit point is written
        if found is None:
            return True
        meta = found[1]
        holding = sorted(
            (s.channel_state_size, key[1])
            for key, s in meta.subtasks.items()
            if SUM_VERTEX in s.vertex and s.channel_state_size > 0
        )
        if not holding or meta.final:
            return True
        size, index = holding[-1]
        self.fired = {
            "checkpoint_id": meta.checkpoint_id,
            "subtask": index,
            "channel_state_size": size,
        }
        with open(self.record, "w") as out:
            json.dump(self.fired, out)
        target = next(h for (name, i), h in subtasks.items() if SUM_VERTEX in name and i == index)
        ray.kill(target, no_restart=True)
        return True


@pytest.mark.chaos
@pytest.mark.parametrize("replay_kill", [False, True], ids=["restore", "kill-during-replay"])
def test_restore_replays_channel_state(replay_kill, tmp_path):
    job = unique_job("unaligned-replay")
    storage = str(tmp_path / "chk")
    record = str(tmp_path / "fired.json")
    hooks = KillAfterChannelState(storage, job, record, replay_kill)
    env, sink = build_keyed_sum(
        N,
        P,
        BATCH,
        storage=storage,
        plan=hooks,
        alignment=CheckpointAlignment.UNALIGNED,
        hot_delay_s=HOT_DELAY_S,
    )
    env.get_checkpoint_config().set_num_retained_checkpoints(1000)  # keep what was restored
    result = env.execute(job)
    print(describe(result))
    assert os.path.exists(record), "no checkpoint with channel state completed\n" + describe(result)
    with open(record) as f:
        fired = json.load(f)
    assert result.restarts == (2 if replay_kill else 1), describe(result)
    # every restore of the run (attempt 1, and attempt 2 after the kill during replay:
    # attempt 1 died before any checkpoint of its own) came from that checkpoint
    assert result.restored_from == fired["checkpoint_id"], describe(result)
    meta = CheckpointStorage(storage, job, run_id=result.run_id).load_metadata(result.restored_from)
    assert meta.has_channel_state and not meta.final
    assert meta.attempt == 0
    restored = [c for c in result.checkpoints if c["checkpoint_id"] == result.restored_from]
    if restored:  # still in the history of the last 10
        assert restored[0]["attempt"] == 0 and restored[0]["channel_state_size"] > 0
        assert restored[0]["unaligned"]
    last_attempt = result.restarts
    assert any(c["attempt"] == last_attempt for c in result.completed_checkpoints)
    assert_exactly_once(result, sink)


# --- (d): a kill while channel state is being written ---------------------------------


@pytest.mark.chaos
def test_kill_during_channel_state_write(tmp_path):
    # attempt 0 dies before its first channel-state blob, attempt 1 before its second
    plan = FaultPlan(
        [
            Fault(FaultPoint.DURING_CHANNEL_STATE_WRITE, 0, SUM_VERTEX, HOT, checkpoint=1),
            Fault(FaultPoint.DURING_CHANNEL_STATE_WRITE, 1, SUM_VERTEX, HOT, checkpoint=2),
        ]
    )
    assert all(f.action == "sigkill" for f in plan.faults)
    env, sink = build_keyed_sum(
        N,
        P,
        BATCH,
        storage=str(tmp_path),
        plan=plan,
        alignment=CheckpointAlignment.UNALIGNED,
        hot_delay_s=HOT_DELAY_S,
    )
    result = env.execute(unique_job("unaligned-cs-write-kill"))
    print(describe(result))
    assert result.restarts == 2, describe(result)
    assert_exactly_once(result, sink)


@pytest.mark.chaos
def test_error_during_channel_state_write_declines_the_checkpoint(tmp_path):
    """A failed channel-state write declines its checkpoint; the job goes on (failures
    tolerated) and later checkpoints complete."""
    plan = FaultPlan(
        [
            Fault(
                FaultPoint.DURING_CHANNEL_STATE_WRITE,
                0,
                SUM_VERTEX,
                HOT,
                checkpoint=1,
                action="raise",
            )
        ]
    )
    env, sink = build_keyed_sum(
        N,
        P,
        BATCH,
        storage=str(tmp_path),
        plan=plan,
        alignment=CheckpointAlignment.UNALIGNED,
        hot_delay_s=HOT_DELAY_S,
    )
    config = env.get_checkpoint_config()
    config.set_tolerable_checkpoint_failure_number(3)
    # a loaded machine runs many checkpoints after the failed one: keep them all
    config.set_checkpoint_history_size(1000)
    result = env.execute(unique_job("unaligned-cs-write-error"))
    print(describe(result))
    assert result.restarts == 0, describe(result)
    failed = [c for c in result.checkpoints if c["status"] != "COMPLETED"]
    first = [c for c in failed if c["checkpoint_id"] == 1]
    assert first and "injected fault" in (first[0]["failure"] or ""), describe(result)
    assert result.checkpoint_summary["latest_failed"]["checkpoint_id"] == 1
    assert any(c["channel_state_size"] > 0 for c in result.completed_checkpoints)
    assert_exactly_once(result, sink)


# --- (e): rescale is refused from channel state; the same parallelism resumes -----------


@pytest.mark.chaos
def test_rescale_from_channel_state_is_refused_and_same_parallelism_resumes(tmp_path):
    n = 2 * N
    job = unique_job("unaligned-rescale")
    storage = str(tmp_path)

    def build(parallelism, sink=None):
        env, sink = build_keyed_sum(
            n,
            parallelism,
            BATCH,
            checkpoint_ms=1000,  # a cancel lands long before the next checkpoint
            storage=storage,
            sink=sink,
            alignment=CheckpointAlignment.UNALIGNED,
            hot_delay_s=HOT_DELAY_S,
        )
        return env, sink

    env, sink = build(P)
    client = env.execute_async(job)
    with_state = None
    for _ in range(600):
        done = [c for c in client.checkpoints() if c["status"] == "COMPLETED"]
        with_state = next((c for c in done if c["channel_state_size"] > 0 and not c["final"]), None)
        if with_state is not None:
            break
        time.sleep(0.05)
    assert with_state is not None, "no checkpoint with channel state completed"
    assert client.cancel() is True
    with pytest.raises(JobFailedError):
        client.wait()

    run = CheckpointStorage(storage, job, run_id=client.run_id)
    meta = run.latest()
    assert meta is not None and meta.has_channel_state, (
        f"the newest checkpoint {meta and meta.checkpoint_id} holds no channel state"
    )
    chk_dir = run.checkpoint_dir(meta.checkpoint_id)

    # another parallelism: refused before anything runs, whichever way it is named
    for restore_from in (chk_dir, run.location(), "latest"):
        env3, _ = build(3, sink)
        with pytest.raises(ValueError, match=r"is unaligned[\s\S]*take an aligned checkpoint"):
            env3.execute(job, restore_from=restore_from)

    # the same parallelism: resumes, replaying the channel state; the cancelled run's
    # commits and the resumed run's are exactly once together (one collector)
    env2, _ = build(P, sink)
    result = env2.execute(job, restore_from=chk_dir)
    print(describe(result))
    assert result.restored_from == meta.checkpoint_id
    assert_exactly_once(result, sink, n)


# --- buffer timeout 0: channels gather while they wait for credit ------------------------


@pytest.mark.chaos
@pytest.mark.parametrize(
    "alignment, seed",
    [(CheckpointAlignment.ALIGNED, 41), (CheckpointAlignment.UNALIGNED, 43)],
)
def test_seeded_kills_at_buffer_timeout_zero_are_exactly_once(alignment, seed, tmp_path):
    """At timeout 0 a channel that waits for credit gathers what is written meanwhile and
    sends it as one bundle when a push is acknowledged (from a callback, not from the
    subtask's own loop): under backpressure, kills, aligned barriers and unaligned
    announcements, everything still arrives once and in order."""
    plan = seeded_plan(seed)
    env, sink = build_keyed_sum(
        N,
        P,
        BATCH,
        storage=str(tmp_path),
        plan=plan,
        alignment=alignment,
        hot_delay_s=HOT_DELAY_S,
        buffer_timeout_ms=0,
    )
    result = env.execute(unique_job(f"eager-{alignment.value}-{seed}"))
    print(describe(result))
    assert result.restarts >= 3, describe(result)
    assert_exactly_once(result, sink)
    # backpressure made the channels gather: some messages carried several batches
    assert sum(m.get("bundles_out", 0) for m in result.metrics) > 0, result.metrics
