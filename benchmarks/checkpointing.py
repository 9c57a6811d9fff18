"""What exactly-once costs: throughput with checkpointing off, AT_LEAST_ONCE and
EXACTLY_ONCE, checkpoint duration and alignment time, and recovery time.

One run, one Ray, the same keyed running-sum pipeline for every configuration:
NumberSequenceSource -> map_batches(key = value % 1000) -> key_by(key).sum(value)
-> a sink that discards rows, at parallelism 2, 10k-row batches. The three
checkpointing configurations are interleaved ``--repeat`` times so drift on a
shared machine hits each alike; medians are reported, with the ratio to
checkpointing off. Throughput is the steady rate: the middle 80% of batches
arriving at the sinks. Checkpoint stats come from ``JobResult.checkpoints``.

Recovery: the same job with EXACTLY_ONCE checkpoints and one subtask SIGKILLed
after N records, restart delay 0; recovery time is from the failure being seen
by the job master to records flowing again from every source subtask.

    python benchmarks/checkpointing.py [--rows N] [--interval-ms 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from rayflow import (
    DeliveryGuarantee,
    NumberSequenceSource,
    Sink,
    SinkContext,
    SinkWriter,
    StreamExecutionEnvironment,
)
from rayflow.config import CheckpointingMode, RestartStrategies
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults


class _TimingWriter(SinkWriter):
    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []

    def write(self, batch: pa.RecordBatch) -> None:
        self.arrivals.append((time.time(), batch.num_rows))

    def finish(self) -> Any:
        return self.arrivals


class TimingSink(Sink):
    """Discards rows, remembers when each batch arrived."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _TimingWriter()

    def merge_results(self, results: list[Any]) -> list[tuple[float, int]]:
        return sorted(a for r in results if r for a in r)


def with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pa.array(batch.column("value").to_numpy() % 1000))


def steady_rate(arrivals: list[tuple[float, int]], rows_in: int) -> float:
    times = np.array([t for t, _ in arrivals])
    lo, hi = np.percentile(times, 10), np.percentile(times, 90)
    return 0.8 * rows_in / (hi - lo) if hi > lo else float("nan")


def run_job(
    rows: int,
    mode: CheckpointingMode | None,
    interval_ms: int,
    plan: FaultPlan | None = None,
    storage: str | None = None,
):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    if mode is not None:
        env.enable_checkpointing(interval_ms, mode)
        if storage:
            env.get_checkpoint_config().set_checkpoint_storage(storage)
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 0))
    if plan is not None:
        inject_faults(env, plan)
    sink = TimingSink(DeliveryGuarantee.NONE)
    (
        env.from_source(NumberSequenceSource(0, rows - 1, batch_size=10_000), "numbers")
        .map_batches(with_key, name="with-key")
        .key_by("key")
        .sum("value")
        .sink_to(sink, name="discard")
    )
    return env.execute(f"bench-{mode.value if mode else 'off'}-{time.time_ns()}"), sink


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6_000_000)
    parser.add_argument("--interval-ms", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--recoveries", type=int, default=3)
    args = parser.parse_args()
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    run_job(100_000, None, args.interval_ms)  # warm-up

    configs = [
        ("off", None),
        ("AT_LEAST_ONCE", CheckpointingMode.AT_LEAST_ONCE),
        ("EXACTLY_ONCE", CheckpointingMode.EXACTLY_ONCE),
    ]
    rates: dict[str, list[float]] = {name: [] for name, _ in configs}
    stats: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for _ in range(args.repeat):
        for name, mode in configs:
            result, sink = run_job(args.rows, mode, args.interval_ms)
            rates[name].append(steady_rate(result.sink_result("discard"), args.rows))
            stats[name].extend(c for c in result.completed_checkpoints if not c["final"])

    base = statistics.median(rates["off"])
    print(
        f"\n### Throughput, keyed running sum, parallelism 2, 10k-row batches, "
        f"{args.rows:,} rows, checkpoint interval {args.interval_ms} ms, "
        f"median of {args.repeat}\n"
    )
    print(
        "| checkpointing | steady rows/s | range | vs off | checkpoints | "
        "duration mean / p99 (ms) | alignment mean / p99 (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, _ in configs:
        r = rates[name]
        durations = [c["duration_s"] * 1000 for c in stats[name]]
        aligns = [
            s["alignment_s"] * 1000
            for c in stats[name]
            for s in c["subtasks"].values()
            if s["alignment_s"] is not None
        ]
        ckpt = f"{statistics.mean(durations):.0f} / {pct(durations, 99):.0f}" if durations else "-"
        align = f"{statistics.mean(aligns):.1f} / {pct(aligns, 99):.1f}" if aligns else "-"
        print(
            f"| {name} | {statistics.median(r):,.0f} | {min(r):,.0f}-{max(r):,.0f} | "
            f"{statistics.median(r) / base:.1%} | {len(stats[name])} | {ckpt} | {align} |"
        )

    recoveries: list[float] = []
    for i in range(args.recoveries):
        plan = FaultPlan(
            [
                Fault(
                    FaultPoint.AFTER_RECORDS,
                    attempt=0,
                    subtask=i % 2,
                    vertex="Sum",
                    records=args.rows // 6,
                )
            ]
        )
        result, _ = run_job(args.rows // 2, CheckpointingMode.EXACTLY_ONCE, args.interval_ms, plan)
        recoveries.extend(result.recovery_times_s)
    print("\n### Recovery: SIGKILL of a keyed subtask, restart delay 0\n")
    print("| recoveries | mean (s) | min (s) | max (s) |")
    print("|---:|---:|---:|---:|")
    if recoveries:
        print(
            f"| {len(recoveries)} | {statistics.mean(recoveries):.2f} | "
            f"{min(recoveries):.2f} | {max(recoveries):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
