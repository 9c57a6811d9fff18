"""LatencyTracker: percentiles, the bounded reservoir, merging; and the latency tracking
interval, from the environment to every subtask's deployment."""

from __future__ import annotations

import pytest

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.runtime.deployer import Deployer
from rayflow.runtime.latency import LatencyTracker
from rayflow.runtime.settings import JobSettings
from sinks.basic import CollectSink


def _tracker(values, capacity: int = 2000, seed: int = 0) -> LatencyTracker:
    tracker = LatencyTracker(capacity, seed=seed)
    for v in values:
        tracker.record_ms(v)
    return tracker


def test_an_empty_tracker_reports_zero():
    figures = LatencyTracker().figures()
    assert figures == {"count": 0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}


def test_percentiles_are_interpolated_over_the_sorted_sample():
    tracker = _tracker([float(v) for v in range(100, 0, -1)])  # 100 .. 1, unsorted
    assert tracker.count == 100
    assert tracker.percentile(0) == 1.0
    assert tracker.percentile(100) == 100.0
    assert tracker.percentile(50) == pytest.approx(50.5)
    summary = tracker.summary()
    assert summary["p90_ms"] == pytest.approx(90.1)
    assert summary["p99_ms"] == pytest.approx(99.01)
    assert summary["max_ms"] == 100.0
    assert sorted(summary["samples_ms"]) == [float(v) for v in range(1, 101)]
    with pytest.raises(ValueError):
        tracker.percentile(101)


def test_negative_latencies_count_as_zero():
    tracker = _tracker([-3.0, 2.0])
    assert sorted(tracker.samples_ms()) == [0.0, 2.0]


def test_the_reservoir_stays_bounded_and_uniform():
    tracker = _tracker([float(v) for v in range(100_000)], capacity=1000, seed=7)
    assert tracker.count == 100_000
    assert len(tracker.samples_ms()) == 1000
    assert tracker.max_ms == 99_999.0  # exact, not read from the sample
    # a uniform sample of 0..99999: its median is near 50000
    assert 45_000 < tracker.percentile(50) < 55_000
    assert 85_000 < tracker.percentile(90) < 95_000


def test_merging_keeps_counts_max_and_weighs_each_tracker_by_its_count():
    small = _tracker([1.0] * 1000, seed=1)  # every latency kept
    large = _tracker([100.0] * 9000, seed=2)  # sampled down to 2000
    merged = LatencyTracker.merged([small, large, LatencyTracker()], seed=3)
    assert merged.count == 10_000
    assert merged.max_ms == 100.0
    samples = merged.samples_ms()
    assert len(samples) == 2000
    # a tenth of all latencies were 1 ms: about a tenth of the merged sample is
    share = samples.count(1.0) / len(samples)
    assert 0.06 < share < 0.14
    assert merged.percentile(50) == 100.0


def test_merge_in_place_and_from_summary_round_trip():
    a = _tracker([float(v) for v in range(10)], seed=1)
    b = LatencyTracker.from_summary(_tracker([float(v) for v in range(10, 20)]).summary())
    assert b.count == 10 and b.max_ms == 19.0
    a.merge(b)
    assert a.count == 20 and a.max_ms == 19.0
    assert sorted(a.samples_ms()) == [float(v) for v in range(20)]
    a.merge(LatencyTracker())
    assert a.count == 20
    # recording after a merge keeps the sample bounded
    for _ in range(5000):
        a.record_ms(1.0)
    assert len(a.samples_ms()) <= a.capacity and a.count == 5020


def test_merging_small_trackers_keeps_everything():
    parts = [_tracker([float(i)] * 3, seed=i) for i in range(5)]
    merged = LatencyTracker.merged(parts)
    assert merged.count == 15
    assert sorted(merged.samples_ms()) == sorted(float(i) for i in range(5) for _ in range(3))


def test_latency_tracking_interval_is_validated():
    env = StreamExecutionEnvironment.get_execution_environment()
    assert env.get_latency_tracking_interval() == 200
    assert env.set_latency_tracking_interval(0) is env
    assert env.get_latency_tracking_interval() == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="interval_ms must be an int >= 0"):
            env.set_latency_tracking_interval(bad)


def test_the_interval_reaches_every_subtask_deployment():
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.from_source(NumberSequenceSource(0, 99), "numbers").key_by("value").sink_to(
        CollectSink(), name="out"
    )
    graph = env.get_job_graph()
    deployer = Deployer(graph, JobSettings("job", latency_tracking_interval_ms=35), None)
    for vertex in graph.vertices.values():
        deployment = deployer.deployment(vertex, 0, 0, None, [])
        assert deployment.latency_tracking_interval_ms == 35
    assert JobSettings("job").latency_tracking_interval_ms == 200
