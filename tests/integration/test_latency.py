"""End-to-end latency markers on a real Ray: markers reach every sink-end subtask,
tracking off records nothing, a slow sink shows in the latency, and markers leave
exactly-once results, checkpoints and restarts as they were."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode
from rayflow.sink import Sink, SinkContext, SinkWriter
from rayflow.testing import Fault, FaultPlan, FaultPoint
from sinks.basic import CollectSink
from tests.chaos.harness import build_keyed_sum, expected_rows, expected_sums, outcome, unique_job


class _SleepingWriter(SinkWriter):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        self.rows += batch.num_rows

    def finish(self) -> int:
        return self.rows


class _SleepingSink(Sink):
    """Counts rows, sleeping ``delay_s`` per batch."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _SleepingWriter(self.delay_s)

    def merge_results(self, results: list[int]) -> int:
        return sum(results)


def _keyed_job(n: int, parallelism: int, rate: float, interval_ms: int | None, sink: Sink):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    if interval_ms is not None:
        env.set_latency_tracking_interval(interval_ms)
    (
        env.from_source(
            NumberSequenceSource(0, n - 1, batch_size=50, records_per_second=rate), "numbers"
        )
        .key_by("value")
        .map_batches(lambda b: b, name="identity")
        .sink_to(sink, name="out")
    )
    return env


def _sink_end_metrics(result) -> list[dict]:
    return [m for m in result.metrics if "out" in m["vertex"]]


@pytest.mark.parametrize("mode", [CheckpointingMode.EXACTLY_ONCE, CheckpointingMode.AT_LEAST_ONCE])
def test_markers_reach_every_sink_end_subtask(mode, tmp_path):
    n = 4000
    env = _keyed_job(n, 2, rate=2000, interval_ms=20, sink=CollectSink())
    env.enable_checkpointing(100, mode)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    result = env.execute(unique_job("latency"))

    assert result.sink_result("out").num_rows == n
    assert result.completed_checkpoints and result.completed_checkpoints[-1]["final"]
    latency = result.latency
    assert set(latency) == {"count", "p50_ms", "p90_ms", "p99_ms", "max_ms"}
    # two sources, ~1 s each, a marker every 20 ms
    assert latency["count"] >= 20
    assert 0 <= latency["p50_ms"] <= latency["p90_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert len(result.latency_samples_ms) == latency["count"]  # below the reservoir's bound
    assert max(result.latency_samples_ms) == latency["max_ms"]

    sink_ends = _sink_end_metrics(result)
    assert len(sink_ends) == 2
    # markers rotate over the channels of the key_by edge: every receiver gets some
    assert all(m["latency"]["count"] > 0 for m in sink_ends)
    assert sum(m["latency"]["count"] for m in sink_ends) == latency["count"]
    # sources forward their markers, they record none
    assert all(m["latency"]["count"] == 0 for m in result.metrics if m not in sink_ends)


def test_tracking_off_records_nothing():
    sink = _SleepingSink(0.0)
    result = _keyed_job(2000, 2, rate=4000, interval_ms=0, sink=sink).execute()
    assert result.sink_result(sink) == 2000
    assert result.latency["count"] == 0
    assert result.latency_samples_ms == []
    assert all(m["latency"]["count"] == 0 for m in result.metrics)


def test_a_slow_sink_shows_a_higher_latency_than_a_fast_one():
    def p50(delay_s: float) -> float:
        sink = _SleepingSink(delay_s)
        # 40 batches a second from the source; the slow sink takes 250 ms a batch (a tenth
        # of the pace), so batches (and the markers behind them) queue up to the channel's
        # bounds, each queued batch a quarter second: far above what a busy machine adds
        # to the fast sink's (a few hundred ms seen under a full test run)
        result = _keyed_job(1000, 1, rate=2000, interval_ms=20, sink=sink).execute()
        assert result.sink_result(sink) == 1000
        assert result.latency["count"] > 0
        return result.latency["p50_ms"]

    fast, slow = p50(0.0), p50(0.25)
    assert slow > 3 * max(fast, 1.0), (fast, slow)


def test_markers_leave_a_restarted_exactly_once_job_exact(tmp_path):
    n = 40_000
    plan = FaultPlan(
        [Fault(FaultPoint.AFTER_RECORDS, attempt=0, vertex="committed", records=10_000)]
    )
    env, sink = build_keyed_sum(
        n, 2, 500, rate=20_000, checkpoint_ms=100, storage=str(tmp_path), plan=plan
    )
    env.set_latency_tracking_interval(5)
    result = env.execute(unique_job("latency-restart"))
    got = outcome(result, sink)
    assert result.restarts == 1
    assert got.sums == expected_sums(n)
    assert got.rows == expected_rows(n, 2, 500)
    assert result.latency["count"] > 0
