"""Does the job master's memory stay flat in a long job? Many checkpoints, measured.

Runs the keyed running sum into an exactly-once CollectSink with checkpoints every
``--interval-ms`` (10 ms by default) until ``--checkpoints`` (2,000) have completed,
sampling the job master's resident memory (RSS) as it goes, then cancels the job.
Checkpoint history and commit statistics are bounded (the last 10, plus running
totals), so after a warm-up the RSS should stay within a few percent.

    python benchmarks/master_memory.py [--checkpoints 2000] [--interval-ms 10]

Prints a table of (checkpoints completed, RSS in MiB) and the change from the sample
at ``--warmup`` (200) checkpoints to the last one; exits 1 if it grew more than 10%.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time

import ray

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.errors import JobFailedError
from sinks.basic import CollectSink


def _build(storage: str, interval_ms: int) -> StreamExecutionEnvironment:
    import pyarrow as pa

    def with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch.append_column("key", pa.array(batch.column("value").to_numpy() % 100))

    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(interval_ms)
    config = env.get_checkpoint_config()
    config.set_checkpoint_storage(storage)
    config.set_min_pause_between_checkpoints(0)
    (
        env.from_source(
            NumberSequenceSource(0, 10**12, batch_size=100, records_per_second=2_000), "numbers"
        )
        .map_batches(with_key, name="with-key")
        .key_by("key")
        .sum("value")
        .sink_to(CollectSink(), name="committed")
    )
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=2000)
    parser.add_argument("--interval-ms", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--every", type=int, default=100, help="sample every N checkpoints")
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    samples: list[tuple[int, float, float]] = []
    with tempfile.TemporaryDirectory() as storage:
        client = _build(storage, args.interval_ms).execute_async("master-memory")
        started = time.time()
        next_sample = 0
        while True:
            status = ray.get(client._master.status.remote())
            done = status["checkpoint_summary"]["counts"]["COMPLETED"]
            if done >= next_sample or done >= args.checkpoints:
                samples.append((done, status["rss_bytes"] / 2**20, time.time() - started))
                print(f"{done:>6} checkpoints  {samples[-1][1]:8.1f} MiB", flush=True)
                next_sample = done + args.every
            if done >= args.checkpoints:
                break
            if status["state"] not in ("RUNNING", "CREATED", "RESTARTING"):
                print(f"job ended early: {status['state']} {status['failure']}")
                return 1
            time.sleep(0.2)
        client.cancel()
        try:
            client.wait()
        except JobFailedError:
            pass
    after_warmup = [s for s in samples if s[0] >= args.warmup]
    base, last = after_warmup[0], after_warmup[-1]
    change = (last[1] - base[1]) / base[1]
    elapsed = last[2] - base[2]
    print(
        f"\ncommand: python benchmarks/{shlex.join(sys.argv).split('benchmarks/')[-1]}\n"
        f"job master RSS at {base[0]} checkpoints: {base[1]:.1f} MiB; at {last[0]}: "
        f"{last[1]:.1f} MiB ({change:+.1%}); max {max(s[1] for s in after_warmup):.1f} MiB; "
        f"{(last[0] - base[0]) / elapsed:.0f} checkpoints/s"
    )
    return 0 if change <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
