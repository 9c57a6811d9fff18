"""Windowed aggregation throughput: tumbling 1 s event-time windows over the peer workload
with a timestamp column, on rayflow, PyFlink SQL (``TUMBLE``) and Bytewax, in one run.

The workload: records ``i = 0..N-1``, key ``i % 1000``, value ``i``, event time
``i // 100`` ms (100,000 records per 1 s window, in order); the sum of the values per key
and window (1,000 results per window). Parallelism 1, checkpointing off; rayflow also with
EXACTLY_ONCE checkpoints every 1 s.

* rayflow: ``CollectionSource`` over the Arrow table (key, value, t), batches of 10,000 ->
  ``from_source(source, WatermarkStrategy.for_monotonous_timestamps()
  .with_timestamp_assigner("t"), ...)`` -> ``key_by("key").window(
  TumblingEventTimeWindows.of(Duration.of_seconds(1))).sum("value")`` -> ``CollectSink``;
  the results are checked (count and total). Ray is started once, then a warm-up job.
* PyFlink SQL and Bytewax: ``benchmarks/windowed_peers.py`` in each peer's venv
  (``--pyflink PYTHON``, ``--bytewax PYTHON``; see ``benchmarks/peers.py`` for installing
  them).

Metric: N / job seconds (``env.execute()``; PyFlink: after the JVM started, planning and
deployment included; Bytewax: ``cli_main()``), median of ``--runs``, engines interleaved.
Take the lock around it: ``flock /tmp/bench.gate flock /tmp/bench.lock python
benchmarks/windowed.py ...``. Never a timed assertion.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers_common import parse_result  # noqa: E402
from windowed_peers import expected_total  # noqa: E402

HERE = Path(__file__).resolve().parent


def workload(records: int) -> pa.Table:
    i = np.arange(records, dtype=np.int64)
    return pa.table({"key": i % 1000, "value": i, "t": i // 100})


def run_rayflow(table: pa.Table, checkpointing: bool) -> tuple[float, str]:
    from rayflow import (
        Duration,
        StreamExecutionEnvironment,
        TumblingEventTimeWindows,
        WatermarkStrategy,
    )
    from rayflow.sources import CollectionSource
    from sinks.basic import CollectSink

    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    if checkpointing:
        env.enable_checkpointing(1000)
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")
    sink = CollectSink()
    (
        env.from_source(CollectionSource(table, batch_size=10_000), strategy, "numbers")
        .key_by("key")
        .window(TumblingEventTimeWindows.of(Duration.of_seconds(1)))
        .sum("value")
        .sink_to(sink, "sums")
    )
    started = time.perf_counter()
    result = env.execute("windowed")
    seconds = time.perf_counter() - started
    out = result.sink_result(sink)
    got = (out.num_rows, int(pa.compute.sum(out.column("value")).as_py()))
    expect = expected_total(table.num_rows)
    return seconds, "ok" if got == expect else f"WRONG: {got} vs {expect}"


def run_peer(python: str, engine: str, records: int) -> tuple[float, str]:
    proc = subprocess.run(
        [python, str(HERE / "windowed_peers.py"), "--engine", engine, "--records", str(records)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    found = parse_result(proc.stdout)
    if found is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return float("nan"), "FAILED: " + " | ".join(tail)
    return found["seconds"], found["check"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pyflink", help="python of PyFlink's venv")
    parser.add_argument("--bytewax", help="python of Bytewax's venv")
    args = parser.parse_args()
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    table = workload(args.records)
    run_rayflow(workload(200_000), False)  # warm-up
    engines = {
        "rayflow (checkpointing off)": lambda: run_rayflow(table, False),
        "rayflow (EXACTLY_ONCE, 1 s)": lambda: run_rayflow(table, True),
    }
    if args.pyflink:
        engines["PyFlink SQL TUMBLE"] = lambda: run_peer(args.pyflink, "pyflink-sql", args.records)
    if args.bytewax:
        engines["Bytewax fold_window"] = lambda: run_peer(args.bytewax, "bytewax", args.records)
    times: dict[str, list[float]] = {name: [] for name in engines}
    checks: dict[str, set[str]] = {name: set() for name in engines}
    loads = []
    for _ in range(args.runs):
        for name, run in engines.items():
            seconds, check = run()
            times[name].append(seconds)
            checks[name].add(check)
            loads.append(os.getloadavg()[0])
    print(
        f"{args.records:,} records, tumbling 1 s event-time windows, 1,000 keys, parallelism 1, "
        f"median of {args.runs}; load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print("| engine | records/s | job s (median) | result |")
    print("|---|---:|---:|---|")
    for name in engines:
        median = statistics.median(times[name])
        rate = args.records / median if median == median else float("nan")
        print(f"| {name} | {rate:,.0f} | {median:.2f} | {', '.join(sorted(checks[name]))} |")


if __name__ == "__main__":
    main()
