"""Buffer debloating on a real Ray: under backpressure from a slow subtask, aligned
checkpoints are much shorter with it than without, and the output is exact either way."""

from __future__ import annotations

import statistics

from tests.chaos.harness import build_keyed_sum, expected_rows, expected_sums, outcome, unique_job

N = 120_000
BATCH = 1000  # every source batch holds key 0 once: each of its sub-batches is slow
HOT_DELAY_S = 0.04  # the hot subtask takes 25 batches a second, the other hundreds
TARGET_MS = 200  # about 5 batches in flight into the hot subtask, against 32 without


def _run(tmp_path, debloat: bool) -> tuple[float, list[dict]]:
    env, sink = build_keyed_sum(
        N,
        parallelism=2,
        batch_size=BATCH,
        checkpoint_ms=300,
        storage=str(tmp_path / ("debloat" if debloat else "plain")),
        hot_delay_s=HOT_DELAY_S,
    )
    if debloat:
        env.enable_buffer_debloating(target_ms=TARGET_MS)
    result = env.execute(unique_job("debloat" if debloat else "plain"))
    got = outcome(result, sink)
    assert got.sums == expected_sums(N)
    assert got.rows == expected_rows(N, 2, BATCH)
    durations = [c["duration_s"] for c in result.completed_checkpoints if not c["final"]]
    assert len(durations) >= 2, result.checkpoints
    return statistics.median(durations), [
        m for m in result.metrics if m["vertex"].startswith("Sum")
    ]


def test_debloating_shortens_aligned_checkpoints_under_backpressure(tmp_path):
    plain_p50, plain_metrics = _run(tmp_path, debloat=False)
    debloat_p50, debloat_metrics = _run(tmp_path, debloat=True)
    print(f"checkpoint p50: plain {plain_p50:.3f} s, debloated {debloat_p50:.3f} s")
    assert debloat_p50 < 0.8 * plain_p50, (plain_p50, debloat_p50)
    # without it every channel keeps its capacity; with it the hot subtask's shrank
    assert all(m["channel_capacity_lowest"] == 8 for m in plain_metrics)
    assert all(m["input_throughput"] is None for m in plain_metrics)
    assert min(m["channel_capacity_lowest"] for m in debloat_metrics) < 8
    assert all(m["input_throughput"] > 0 for m in debloat_metrics)
