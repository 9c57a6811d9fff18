"""What handing a subtask's figures to Ray's metrics costs, per export, in a Ray actor.

A subtask exports once a second (``rayflow.runtime.ray_metrics.EXPORT_INTERVAL_S``) and once
when its run ends; each export hands the growth of five counters to Ray, observes the
alignments and commits since the last one, and the operators' figures. This times
``SubtaskMetricsExporter.export`` in a Ray actor (where ``ray.util.metrics`` records for
real) with every counter grown, two alignments and one commit each time: the worst case of
one export. Its cost per second of a subtask's time is that figure once a second.

Benchmarks are never timed assertions. Run from the repository root::

    python benchmarks/metrics_cost.py [--exports 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ray


@ray.remote
class _Exporting:
    def run(self, exports: int) -> list[float]:
        from rayflow.runtime.ray_metrics import SubtaskMetricsExporter

        exporter = SubtaskMetricsExporter("bench", "numbers -> Map", 0)
        took = []
        for i in range(1, exports + 1):
            counters = {
                "records_in": 1000 * i,
                "records_out": 1000 * i,
                "bytes_in": 8000 * i,
                "bytes_out": 8000 * i,
                "backpressure_s": 0.001 * i,
            }
            operators = {
                "out": {
                    "commits": [{"commit_s": 0.002}],
                    "commit_totals": {"notifications": i},
                },
                "total": {"nulls_skipped": i},
            }
            started = time.perf_counter()
            exporter.export(counters, [0.001, 0.002], operators)
            took.append(time.perf_counter() - started)
        assert exporter.enabled
        return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", type=int, default=2000)
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    took = ray.get(_Exporting.remote().run.remote(args.exports))
    steady = sorted(took[10:])  # the first exports create the metric objects
    median_us = statistics.median(steady) * 1e6
    p99_us = steady[int(len(steady) * 0.99)] * 1e6
    print("command: `python " + " ".join(["benchmarks/metrics_cost.py", *sys.argv[1:]]) + "`")
    print(f"exports: {len(took)}, first (creates the metrics): {took[0] * 1e6:.0f} us")
    print(f"per export: median {median_us:.0f} us, p99 {p99_us:.0f} us")
    print(f"at one export a second: {median_us / 1e4:.3f}% of one core per subtask")
    print(f"load average at end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
