"""The metrics a job hands to Ray (no Ray here: the metric objects are stood in for):
counters get only their growth, each commit and alignment is observed once, operators'
figures carry the operator's name, and an error stops reporting without failing anything."""

from __future__ import annotations

import pytest

from rayflow.runtime import ray_metrics
from rayflow.runtime.ray_metrics import METRICS, JobMetrics, SubtaskMetricsExporter


class _Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def inc(self, value, tags):
        self.calls.append((self.name, "inc", value, dict(tags)))

    def set(self, value, tags):
        self.calls.append((self.name, "set", value, dict(tags)))

    def observe(self, value, tags):
        self.calls.append((self.name, "observe", value, dict(tags)))


@pytest.fixture
def calls(monkeypatch):
    recorded: list = []
    monkeypatch.setattr(
        ray_metrics, "_objects", {spec.name: _Recorder(spec.name, recorded) for spec in METRICS}
    )
    return recorded


def _counters(records_in=0, records_out=0, bytes_in=0, bytes_out=0, backpressure_s=0.0):
    return {
        "records_in": records_in,
        "records_out": records_out,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "backpressure_s": backpressure_s,
    }


def test_counters_get_their_growth_only(calls):
    exporter = SubtaskMetricsExporter("job", "numbers -> Map", 1)
    exporter.export(_counters(100, 90, 800, 720, 0.5), [], {})
    exporter.export(_counters(100, 90, 800, 720, 0.5), [], {})  # nothing new: no call
    exporter.export(_counters(250, 90, 2000, 720, 0.75), [], {})
    incs = [(name, value) for name, kind, value, _ in calls if kind == "inc"]
    assert incs == [
        ("rayflow_records_in", 100),
        ("rayflow_records_out", 90),
        ("rayflow_bytes_in", 800),
        ("rayflow_bytes_out", 720),
        ("rayflow_backpressure_seconds", 0.5),
        ("rayflow_records_in", 150),
        ("rayflow_bytes_in", 1200),
        ("rayflow_backpressure_seconds", 0.25),
    ]
    assert all(t == {"job": "job", "operator": "numbers -> Map", "subtask": "1"} for *_, t in calls)


def test_each_commit_and_alignment_is_observed_once_under_its_operator(calls):
    exporter = SubtaskMetricsExporter("job", "total -> out", 0)
    sink = {"commits": [{"commit_s": 0.1}], "commit_totals": {"notifications": 1}}
    exporter.export(_counters(), [0.01, 0.02], {"out": sink, "total": {"nulls_skipped": 3}})
    sink = {
        "commits": [{"commit_s": 0.1}, {"commit_s": 0.2}, {"commit_s": 0.3}],
        "commit_totals": {"notifications": 3},
    }
    exporter.export(_counters(), [], {"out": sink, "total": {"nulls_skipped": 3}})
    observed = [(n, v, t["operator"]) for n, kind, v, t in calls if kind == "observe"]
    assert observed == [
        ("rayflow_checkpoint_alignment_seconds", 0.01, "total -> out"),
        ("rayflow_checkpoint_alignment_seconds", 0.02, "total -> out"),
        ("rayflow_commit_latency_seconds", 0.1, "out"),
        ("rayflow_commit_latency_seconds", 0.2, "out"),
        ("rayflow_commit_latency_seconds", 0.3, "out"),
    ]
    nulls = [(v, t["operator"]) for n, _, v, t in calls if n == "rayflow_nulls_skipped"]
    assert nulls == [(3, "total")]


def test_the_job_master_reports_each_checkpoint_and_the_restarts(calls):
    metrics = JobMetrics("job")
    metrics.checkpoint({"status": "COMPLETED", "duration_s": 0.4, "size": 1234})
    metrics.checkpoint({"status": "FAILED", "duration_s": 9.0, "size": 0})
    metrics.restarts(2)
    assert calls == [
        ("rayflow_checkpoints", "inc", 1, {"job": "job", "status": "COMPLETED"}),
        ("rayflow_checkpoint_duration_seconds", "observe", 0.4, {"job": "job"}),
        ("rayflow_checkpoint_size_bytes", "set", 1234, {"job": "job"}),
        ("rayflow_checkpoints", "inc", 1, {"job": "job", "status": "FAILED"}),
        ("rayflow_restarts", "set", 2, {"job": "job"}),
    ]


def test_an_error_stops_reporting_and_never_raises(calls, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("no metrics agent")

    monkeypatch.setattr(ray_metrics._objects["rayflow_restarts"], "set", broken)
    metrics = JobMetrics("job")
    metrics.restarts(1)  # logged, not raised
    assert not metrics.enabled
    metrics.checkpoint({"status": "COMPLETED", "duration_s": 0.4, "size": 1})
    assert calls == []


def test_every_metric_has_the_job_tag_and_a_description():
    assert len({spec.name for spec in METRICS}) == len(METRICS)
    for spec in METRICS:
        assert spec.name.startswith("rayflow_") and spec.tags[0] == "job" and spec.description


def test_the_restarts_gauge_is_set_again_with_each_checkpoint(calls):
    """A gauge set once, when the attempt starts, is lost if that first export is (the
    metrics agent still starting on a loaded node): each checkpoint sets it again."""
    metrics = JobMetrics("job")
    metrics.restarts(1)
    metrics.checkpoint({"status": "COMPLETED", "duration_s": 0.1, "size": 10})
    metrics.checkpoint({"status": "FAILED", "duration_s": 0.1, "size": 0})
    restarts = [c for c in calls if c[0] == "rayflow_restarts"]
    assert restarts == [("rayflow_restarts", "set", 1, {"job": "job"})] * 3
