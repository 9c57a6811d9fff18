"""What a job reports to Ray's metrics (``ray.util.metrics``), so it reaches Ray's
Prometheus endpoint and the Grafana dashboards Ray generates.

Nothing here runs per record: each subtask keeps its plain counters as it does for
``JobResult.metrics`` and a :class:`SubtaskMetricsExporter` hands their growth to Ray on
a timer (every ``EXPORT_INTERVAL_S``, and once more when the subtask's run ends); the
job master reports each checkpoint as it completes or fails, and its restarts. Ray
exports what it was given on its own schedule (``metrics_report_interval_ms``, 10 s by
default), prefixed with ``ray_``.

Every metric has the tag ``job`` (the job name); subtask metrics also ``operator`` (the
subtask's chained vertex, e.g. ``numbers -> twice``, or the sink or aggregation named by
the metric) and ``subtask`` (its index, from 0). :data:`METRICS` lists them all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "METRICS",
    "EXPORT_INTERVAL_S",
    "MetricKind",
    "MetricSpec",
    "JobMetrics",
    "SubtaskMetricsExporter",
]

log = logging.getLogger("rayflow.metrics")

#: how often a subtask hands its counters to Ray
EXPORT_INTERVAL_S = 1.0

#: bucket boundaries (seconds) of every duration histogram
SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]


class MetricKind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: MetricKind
    tags: tuple[str, ...]
    description: str


_SUBTASK = ("job", "operator", "subtask")
_JOB = ("job",)

#: Every metric rayflow reports, by its name in Ray (exported with Ray's ``ray_`` prefix).
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("rayflow_records_in", MetricKind.COUNTER, _SUBTASK, "Records a subtask took in"),
    MetricSpec("rayflow_records_out", MetricKind.COUNTER, _SUBTASK, "Records a subtask sent on"),
    MetricSpec(
        "rayflow_bytes_in", MetricKind.COUNTER, _SUBTASK, "Bytes of batches a subtask took in"
    ),
    MetricSpec(
        "rayflow_bytes_out", MetricKind.COUNTER, _SUBTASK, "Bytes of batches a subtask sent"
    ),
    MetricSpec(
        "rayflow_backpressure_seconds",
        MetricKind.COUNTER,
        _SUBTASK,
        "Seconds a subtask waited to send because a downstream subtask's buffer was full",
    ),
    MetricSpec(
        "rayflow_checkpoint_alignment_seconds",
        MetricKind.HISTOGRAM,
        _SUBTASK,
        "Per checkpoint, seconds from a subtask's first barrier to its last (alignment)",
    ),
    MetricSpec(
        "rayflow_commit_latency_seconds",
        MetricKind.HISTOGRAM,
        _SUBTASK,
        "Per completed checkpoint, seconds a two-phase-commit sink subtask took to commit "
        "(operator: the sink)",
    ),
    MetricSpec(
        "rayflow_nulls_skipped",
        MetricKind.COUNTER,
        _SUBTASK,
        "Null values a sum/min/max aggregation skipped (operator: the aggregation)",
    ),
    MetricSpec(
        "rayflow_checkpoint_duration_seconds",
        MetricKind.HISTOGRAM,
        _JOB,
        "Seconds from a checkpoint's trigger to its completion",
    ),
    MetricSpec(
        "rayflow_checkpoint_size_bytes",
        MetricKind.GAUGE,
        _JOB,
        "Bytes of state of the last completed checkpoint",
    ),
    MetricSpec(
        "rayflow_checkpoints",
        MetricKind.COUNTER,
        ("job", "status"),
        "Checkpoints by how they ended (COMPLETED, FAILED, ABORTED)",
    ),
    MetricSpec(
        "rayflow_restarts",
        MetricKind.GAUGE,
        _JOB,
        "Restarts of the job's run so far (attempt restarts and job master takeovers)",
    ),
)

_SPECS = {spec.name: spec for spec in METRICS}
_objects: dict[str, Any] = {}


def _metric(name: str) -> Any:
    """The process's Ray metric object of ``name`` (created once per process)."""
    found = _objects.get(name)
    if found is None:
        from ray.util import metrics

        spec = _SPECS[name]
        if spec.kind is MetricKind.COUNTER:
            found = metrics.Counter(name, spec.description, tag_keys=spec.tags)
        elif spec.kind is MetricKind.GAUGE:
            found = metrics.Gauge(name, spec.description, tag_keys=spec.tags)
        else:
            found = metrics.Histogram(
                name, spec.description, boundaries=SECONDS_BUCKETS, tag_keys=spec.tags
            )
        _objects[name] = found
    return found


def _safely(report: Any) -> Any:
    """Reporting metrics never fails a job: an error is logged once and reporting stops."""

    def guarded(self: Any, *args: Any) -> None:
        if not self.enabled:
            return
        try:
            report(self, *args)
        except Exception as exc:  # noqa: BLE001 - no Ray metrics here (no Ray, say)
            self.enabled = False
            log.warning("rayflow metrics: not reporting to Ray any more: %s", exc)

    return guarded


class SubtaskMetricsExporter:
    """Hands a subtask's counters to Ray: the growth since the last export (counters
    start at 0 again in the next attempt of a reused actor: a new exporter then)."""

    def __init__(self, job: str, operator: str, subtask: int, enabled: bool = True) -> None:
        self.tags = {"job": job, "operator": operator, "subtask": str(subtask)}
        self.enabled = enabled
        self._seen: dict[tuple[str, str], float] = {}
        self._commits_seen: dict[str, int] = {}
        self.exported_at = 0.0

    def _add(self, name: str, value: float, operator: str | None = None) -> None:
        key = (name, operator or "")
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            tags = self.tags if operator is None else {**self.tags, "operator": operator}
            _metric(name).inc(delta, tags=tags)
            self._seen[key] = value

    @_safely
    def export(
        self,
        counters: dict[str, float],
        alignments_s: list[float],
        operators: dict[str, dict[str, Any]],
    ) -> None:
        """``counters``: records_in, records_out, bytes_in, bytes_out, backpressure_s
        (totals); ``alignments_s``: alignment of each checkpoint acknowledged since the
        last export; ``operators``: each operator's ``metrics()`` by name."""
        self.exported_at = time.monotonic()
        self._add("rayflow_records_in", counters["records_in"])
        self._add("rayflow_records_out", counters["records_out"])
        self._add("rayflow_bytes_in", counters["bytes_in"])
        self._add("rayflow_bytes_out", counters["bytes_out"])
        self._add("rayflow_backpressure_seconds", counters["backpressure_s"])
        if alignments_s:
            histogram = _metric("rayflow_checkpoint_alignment_seconds")
            for seconds in alignments_s:
                histogram.observe(seconds, tags=self.tags)
        for name, m in operators.items():
            if "nulls_skipped" in m:
                self._add("rayflow_nulls_skipped", m["nulls_skipped"], name)
            totals = m.get("commit_totals")
            if totals:
                new = totals["notifications"] - self._commits_seen.get(name, 0)
                self._commits_seen[name] = totals["notifications"]
                commits = m.get("commits", [])
                if new > 0 and commits:
                    histogram = _metric("rayflow_commit_latency_seconds")
                    tags = {**self.tags, "operator": name}
                    for c in commits[-new:]:
                        histogram.observe(c["commit_s"], tags=tags)


class JobMetrics:
    """What the job master reports: each checkpoint as it ends, and the restarts."""

    def __init__(self, job: str, enabled: bool = True) -> None:
        self.tags = {"job": job}
        self.enabled = enabled
        #: the restarts so far, set again with each checkpoint (None: none reported yet)
        self._restarts: int | None = None

    @_safely
    def checkpoint(self, stats: dict[str, Any]) -> None:
        """A checkpoint ended (its statistics, as ``JobClient.checkpoints`` lists them).
        The restarts gauge is set again too: set only when an attempt starts, it would be
        lost with that one export (a node's metrics agent may still be starting then)."""
        if self._restarts is not None:
            _metric("rayflow_restarts").set(self._restarts, tags=self.tags)
        status = getattr(stats["status"], "value", str(stats["status"]))
        _metric("rayflow_checkpoints").inc(1, tags={**self.tags, "status": status})
        if status == "COMPLETED":
            _metric("rayflow_checkpoint_duration_seconds").observe(
                stats["duration_s"], tags=self.tags
            )
            _metric("rayflow_checkpoint_size_bytes").set(stats["size"], tags=self.tags)

    @_safely
    def restarts(self, count: int) -> None:
        self._restarts = count
        _metric("rayflow_restarts").set(count, tags=self.tags)
