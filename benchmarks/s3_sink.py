"""What the S3 sink's guarantee costs: the same job into S3FileSink at EXACTLY_ONCE,
AT_LEAST_ONCE and NONE, in one run, plus the commit latency per checkpoint.

The S3 API is moto's server on 127.0.0.1 (started here; no outside service), so
absolute rates are moto's, not AWS's: compare the ratios. The job: NumberSequenceSource
-> map_batches(add a 100-byte payload) -> S3FileSink (JSON lines), parallelism 2.
EXACTLY_ONCE and AT_LEAST_ONCE checkpoint every ``--interval-ms``; NONE runs with
checkpointing off. Each configuration runs ``--repeat`` times, interleaved.

    python benchmarks/s3_sink.py [--rows N] [--interval-ms 1000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayflow import (  # noqa: E402
    CheckpointingMode,
    DeliveryGuarantee,
    NumberSequenceSource,
    StreamExecutionEnvironment,
)
from sinks.s3 import S3FileSink  # noqa: E402
from tests.s3_server import start_server  # noqa: E402

PAYLOAD = "x" * 100


def with_payload(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("payload", pa.array([PAYLOAD] * batch.num_rows))


def run(
    server, bucket: str, rows: int, guarantee: DeliveryGuarantee, interval_ms: int, storage: str
):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    if guarantee is not DeliveryGuarantee.NONE:
        mode = (
            CheckpointingMode.EXACTLY_ONCE
            if guarantee is DeliveryGuarantee.EXACTLY_ONCE
            else CheckpointingMode.AT_LEAST_ONCE
        )
        env.enable_checkpointing(interval_ms, mode)
        env.get_checkpoint_config().set_checkpoint_storage(storage)
    prefix = f"bench/{guarantee.name}/{time.time_ns()}"
    sink = S3FileSink(
        bucket, prefix, format="jsonl", delivery_guarantee=guarantee, **server.sink_options()
    )
    (
        env.from_source(NumberSequenceSource(0, rows - 1, batch_size=10_000), "numbers")
        .map_batches(with_payload, name="payload")
        .sink_to(sink, name="s3")
    )
    result = env.execute(f"s3-bench-{guarantee.name}-{time.time_ns()}")
    written = sum(o["Size"] for o in server.objects(bucket, prefix))
    return result, written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--interval-ms", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    server = start_server()
    bucket = server.create_bucket()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    guarantees = [
        DeliveryGuarantee.EXACTLY_ONCE,
        DeliveryGuarantee.AT_LEAST_ONCE,
        DeliveryGuarantee.NONE,
    ]
    rates: dict[str, list[float]] = {g.name: [] for g in guarantees}
    mib: dict[str, list[float]] = {g.name: [] for g in guarantees}
    commits: list[float] = []
    transactions: list[int] = []
    with tempfile.TemporaryDirectory() as storage:
        run(server, bucket, 50_000, DeliveryGuarantee.NONE, args.interval_ms, storage)  # warm-up
        for _ in range(args.repeat):
            for g in guarantees:
                result, written = run(server, bucket, args.rows, g, args.interval_ms, storage)
                rates[g.name].append(args.rows / result.duration_s)
                mib[g.name].append(written / 2**20 / result.duration_s)
                if g is DeliveryGuarantee.EXACTLY_ONCE:
                    for c in result.commit_latencies("s3"):
                        commits.append(c["commit_s"] * 1000)
                        transactions.append(c["transactions"])
    base = statistics.median(rates["NONE"])
    print(
        f"\n### S3FileSink (moto server), {args.rows:,} rows of ~120 bytes, parallelism 2, "
        f"checkpoint interval {args.interval_ms} ms, median of {args.repeat}\n"
    )
    print("| guarantee | rows/s | MiB/s | vs NONE |")
    print("|---|---:|---:|---:|")
    for g in guarantees:
        r = statistics.median(rates[g.name])
        print(f"| {g.name} | {r:,.0f} | {statistics.median(mib[g.name]):.1f} | {r / base:.0%} |")
    if commits:
        print("\n### Commit latency per checkpoint notification (EXACTLY_ONCE, per subtask)\n")
        print("| notifications | transactions each (mean) | mean ms | p50 ms | p99 ms | max ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {len(commits)} | {statistics.mean(transactions):.1f} | "
            f"{statistics.mean(commits):.1f} | {np.percentile(commits, 50):.1f} | "
            f"{np.percentile(commits, 99):.1f} | {max(commits):.1f} |"
        )
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
