"""End-to-end latency figures: what the sink end of a job records of the latency markers
that reach it (see :class:`~rayflow.runtime.events.LatencyMarker`).

A :class:`LatencyTracker` keeps an exact count and maximum and a bounded, uniform
reservoir sample of the latencies (in milliseconds) from which percentiles are read.
Trackers of several subtasks merge into one whose reservoir is again a uniform sample
of every latency they recorded together. ``summary()`` is the plain dict a subtask
reports in its metrics; ``from_summary`` rebuilds a tracker from one, so the driver
merges the summaries of every sink-end subtask of a job.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DEFAULT_LATENCY_TRACKING_INTERVAL_MS", "DEFAULT_RESERVOIR_SIZE", "LatencyTracker"]

#: how often (ms) a source emits a latency marker unless configured otherwise
DEFAULT_LATENCY_TRACKING_INTERVAL_MS = 200
#: samples a tracker keeps at most
DEFAULT_RESERVOIR_SIZE = 2000


class LatencyTracker:
    """Count, maximum and a bounded uniform sample of latencies, in milliseconds."""

    def __init__(self, capacity: int = DEFAULT_RESERVOIR_SIZE, seed: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"LatencyTracker: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.count = 0
        self.max_ms = 0.0
        self._samples: list[float] = []
        self._random = random.Random(seed)

    def record_ms(self, latency_ms: float) -> None:
        """Record one latency (negative ones, from clocks of two nodes apart, count as 0)."""
        latency_ms = max(0.0, latency_ms)
        self.count += 1
        if latency_ms > self.max_ms:
            self.max_ms = latency_ms
        samples = self._samples
        if len(samples) == self.count - 1 and len(samples) < self.capacity:
            samples.append(latency_ms)  # every latency so far is kept
        else:  # reservoir sampling (Vitter's algorithm R) over the sample's size
            slot = self._random.randrange(self.count)
            if slot < len(samples):
                samples[slot] = latency_ms

    def samples_ms(self) -> list[float]:
        """A copy of the kept sample (at most ``capacity`` latencies), in no order."""
        return list(self._samples)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) of the sample, linearly interpolated; 0.0
        when nothing was recorded."""
        if not 0.0 <= q <= 100.0:
            raise ValueError(f"percentile: q must be in 0..100, got {q}")
        return _percentile(sorted(self._samples), q)

    def summary(self) -> dict[str, Any]:
        """``count``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``max_ms`` and ``samples_ms``."""
        return {**self.figures(), "samples_ms": self.samples_ms()}

    def figures(self) -> dict[str, float]:
        """``count``, ``p50_ms``, ``p90_ms``, ``p99_ms`` and ``max_ms`` (no sample)."""
        ordered = sorted(self._samples)
        return {
            "count": self.count,
            "p50_ms": _percentile(ordered, 50.0),
            "p90_ms": _percentile(ordered, 90.0),
            "p99_ms": _percentile(ordered, 99.0),
            "max_ms": self.max_ms,
        }

    def merge(self, other: LatencyTracker) -> None:
        """Fold ``other`` into this tracker (``other`` is left as it is)."""
        if other.count == 0:
            return
        parts = [(self.count, self._samples), (other.count, other._samples)]
        self._samples = _merge_samples(parts, self.capacity, self._random)
        self.count += other.count
        self.max_ms = max(self.max_ms, other.max_ms)

    @classmethod
    def merged(
        cls,
        trackers: Iterable[LatencyTracker],
        capacity: int = DEFAULT_RESERVOIR_SIZE,
        seed: int | None = None,
    ) -> LatencyTracker:
        """One tracker holding what every one of ``trackers`` recorded."""
        result = cls(capacity, seed)
        recorded = [t for t in trackers if t.count]
        parts = [(t.count, t._samples) for t in recorded]
        result._samples = _merge_samples(parts, capacity, result._random)
        result.count = sum(t.count for t in recorded)
        result.max_ms = max((t.max_ms for t in recorded), default=0.0)
        return result

    @classmethod
    def from_summary(
        cls, summary: Mapping[str, Any], capacity: int = DEFAULT_RESERVOIR_SIZE
    ) -> LatencyTracker:
        """A tracker with the count, maximum and sample of a ``summary()``."""
        tracker = cls(capacity)
        samples = [float(s) for s in summary.get("samples_ms", ())]
        tracker.count = max(int(summary.get("count", 0)), len(samples))
        tracker.max_ms = float(summary.get("max_ms", max(samples, default=0.0)))
        if len(samples) > capacity:
            samples = tracker._random.sample(samples, capacity)
        tracker._samples = samples
        return tracker


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _merge_samples(
    parts: list[tuple[int, list[float]]], capacity: int, rng: random.Random
) -> list[float]:
    """A uniform sample of the latencies behind ``parts`` (each a count and a uniform
    sample of that many latencies), as large as ``capacity`` and the parts allow: how
    many come from each part is drawn as from the latencies themselves (multivariate
    hypergeometric), then that many are picked from the part's sample."""
    parts = [(count, samples) for count, samples in parts if count and samples]
    if not parts:
        return []
    total = sum(count for count, _ in parts)
    # a part of n latencies with k kept can give its share of at most k * total / n
    size = min(capacity, *(len(samples) * total // count for count, samples in parts))
    remaining = [count for count, _ in parts]
    take = [0] * len(parts)
    for _ in range(size):
        if total <= 0:
            break
        r = rng.randrange(total)
        i = 0
        while r >= remaining[i]:
            r -= remaining[i]
            i += 1
        take[i] += 1
        remaining[i] -= 1
        total -= 1
        if take[i] == len(parts[i][1]):  # its sample is used up
            total -= remaining[i]
            remaining[i] = 0
    return [s for (_, samples), k in zip(parts, take) for s in rng.sample(samples, k)]
