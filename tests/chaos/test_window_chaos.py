"""Exactly-once event-time windows under seeded kills: a tumbling 1 s window sum over
out-of-order input with very late records gives exactly the directly computed window
sums, each window once, and every late record once in the late side output, after
>= 3 kills at parallelism 1 and 2, and after a rescale 2 -> 3 from a checkpoint."""

from __future__ import annotations

import pytest

from rayflow import JobFailedError
from rayflow.testing import Fault, FaultPlan, FaultPoint, wait_for_checkpoints
from tests.chaos.window_harness import build, expected, make_records, outcome, unique_job

N = 12_000
RATE = 20_000  # about 0.6 s of input per attempt


def check(got, table):
    sums, late = expected(table)
    assert got.sums == sums
    assert max(got.windows_emitted.values()) == 1, "a window fired twice"
    assert got.late == late and sum(late.values()) > 50


@pytest.mark.chaos
@pytest.mark.parametrize("parallelism, seed", [(1, 4), (2, 9)])
def test_window_sums_exactly_once_after_seeded_kills(parallelism, seed, tmp_path):
    table = make_records(N, seed)
    plan = FaultPlan.seeded_kills(
        seed,
        kills=3,
        parallelism=parallelism,
        records_per_subtask=N // parallelism,
        vertex="window-sum",
    )
    plan.faults.append(Fault(FaultPoint.AFTER_SNAPSHOT, attempt=3, vertex="window-sum"))
    env, sums, late = build(table, parallelism, str(tmp_path), plan=plan, rate=RATE)
    result = env.execute(unique_job(f"window-eo-{parallelism}-{seed}"))
    assert result.restarts >= 3, result.failures
    check(outcome(result, sums, late), table)


@pytest.mark.chaos
def test_window_sums_exactly_once_with_unaligned_checkpoints(tmp_path):
    # watermarks in flight are channel state, replayed in order after a restore
    table = make_records(N, 13)
    plan = FaultPlan.seeded_kills(
        13, kills=3, parallelism=2, records_per_subtask=N // 2, vertex="window-sum"
    )
    env, sums, late = build(table, 2, str(tmp_path), plan=plan, rate=RATE, unaligned=True)
    result = env.execute(unique_job("window-unaligned"))
    assert result.restarts >= 3, result.failures
    check(outcome(result, sums, late), table)


@pytest.mark.chaos
def test_window_rescale_from_2_to_3(tmp_path):
    table = make_records(N, 5)
    job = unique_job("window-rescale")
    env, sums, late = build(table, 2, str(tmp_path), rate=RATE / 2)
    client = env.execute_async(job)
    assert wait_for_checkpoints(client, 3) >= 3
    client.cancel()
    with pytest.raises(JobFailedError):
        client.wait()
    env3, _, _ = build(table, 3, str(tmp_path), sinks=(sums, late))
    result = env3.execute(job, restore_from="latest")
    assert result.restored_from is not None
    check(outcome(result, sums, late), table)
