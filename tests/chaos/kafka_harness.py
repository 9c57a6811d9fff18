"""The Kafka chaos harness: two pipelines on the test broker (tests/kafka_broker.py),
seeded kill plans, and what was committed checked against the exact expected output.

- ``sum``: KafkaSource (bounded) -> key = value % KEYS -> running sum per key ->
  CollectSink (EXACTLY_ONCE). Exact: each key's committed totals rise strictly (a
  total committed twice would repeat) and end at the key's exact sum. (The number of
  totals is not fixed: it follows the batches the consumer happened to return.)
- ``kafka``: KafkaSource (bounded) -> a record per value -> rebalance -> KafkaSink
  (EXACTLY_ONCE), read back with a read_committed ``assign()`` consumer. Exact: every
  input value exactly once (0 lost, 0 duplicated), and nothing left open (the read
  reaches each partition's end).

Input: the values 0..n-1 as UTF-8 text, written in transactions of a few thousand
records over the input topic's partitions (before the job starts).

A plan kills once per attempt, four attempts (``chaos_plan``): attempt 0 draws a point
from the seed (after N records, while aligning, right after a snapshot, before or after
the sink's pre-commit, inside a commit after its records were sent, right after a commit
returned, the job master dying before it notifies); attempt 1 kills a sink subtask
between a checkpoint's completion and its notification (BEFORE_NOTIFY: its records exist
only in the checkpoint); attempt 2 kills a sink subtask inside a commit, after its
records reached the broker (SINK_INSIDE_COMMIT; the ``sum`` pipeline's CollectSink has
no such step, so there a sink subtask dies during recovery instead); attempt 3 draws
again, for the Kafka sink also a *stall* inside a commit (the thread sleeps 2 s there
while the other sink subtask is killed, so the stalled commit outlives its attempt).
Subtasks and checkpoints come from the seed.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayflow import DeliveryGuarantee, StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.connectors.kafka import KafkaOffsetsInitializer, KafkaSink, KafkaSource
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink

KEYS = 100
N = 60_000
P = 2
RATE = 10_000  # records per second per source subtask: several checkpoints per attempt
CHECKPOINT_MS = 200
SINK = "out"  # the sink operator's name in both pipelines
PIPELINES = ("sum", "kafka")

DRAWN_POINTS = [
    FaultPoint.AFTER_RECORDS,
    FaultPoint.DURING_ALIGNMENT,
    FaultPoint.AFTER_SNAPSHOT,
    FaultPoint.SINK_BEFORE_PRE_COMMIT,
    FaultPoint.SINK_AFTER_PRE_COMMIT,
    FaultPoint.SINK_INSIDE_COMMIT,
    FaultPoint.SINK_DURING_COMMIT,
    FaultPoint.JOB_MASTER_BEFORE_NOTIFY,
]
#: attempt 3 of the Kafka pipeline may draw this: a stall inside a commit (not a kill)
STALL_INSIDE_COMMIT = "stall-inside-commit"
_SINK_POINTS = {
    FaultPoint.SINK_BEFORE_PRE_COMMIT,
    FaultPoint.SINK_AFTER_PRE_COMMIT,
    FaultPoint.SINK_INSIDE_COMMIT,
    FaultPoint.SINK_DURING_COMMIT,
    FaultPoint.DURING_RECOVER,
    FaultPoint.BEFORE_NOTIFY,
}


def chaos_plan(seed: int, pipeline: str, n: int = N) -> FaultPlan:
    """Four kills, one per attempt (see the module docstring)."""
    rng = random.Random(f"rayflow-kafka-chaos:{seed}")
    drawn: list = [
        p for p in DRAWN_POINTS if pipeline == "kafka" or p is not FaultPoint.SINK_INSIDE_COMMIT
    ]
    first = rng.choice(drawn)
    last = rng.choice(drawn + ([STALL_INSIDE_COMMIT] if pipeline == "kafka" else []))
    third = FaultPoint.SINK_INSIDE_COMMIT if pipeline == "kafka" else FaultPoint.DURING_RECOVER
    faults = []
    for attempt, point in enumerate([first, FaultPoint.BEFORE_NOTIFY, third, last]):
        stall = point == STALL_INSIDE_COMMIT
        if stall:
            point = FaultPoint.SINK_INSIDE_COMMIT
        fault = Fault(
            point,
            attempt=attempt,
            vertex=SINK if point in _SINK_POINTS else None,
            subtask=rng.randrange(P),
            # later attempts resume near the end: their faults fire at the first checkpoint
            checkpoint=rng.randint(1, 2) if attempt == 0 else 1,
        )
        if point is FaultPoint.AFTER_RECORDS:
            if attempt == 0:
                fault = replace(fault, records=rng.randrange(1000, n // (3 * P)))
            else:  # a restarted attempt may never reach a record count
                fault = replace(fault, point=FaultPoint.AFTER_SNAPSHOT)
        if point is FaultPoint.DURING_RECOVER:
            fault = replace(fault, action="sigkill")  # killed, not stalled, while recovering
        faults.append(fault)
        if stall:
            faults[-1] = replace(fault, action="sleep", seconds=2.0)
            # the other sink subtask dies meanwhile: the stalled commit outlives its attempt
            faults.append(
                Fault(
                    FaultPoint.AFTER_SNAPSHOT,
                    attempt=attempt,
                    vertex=SINK,
                    subtask=(fault.subtask + 1) % P,
                    checkpoint=1,
                )
            )
    return FaultPlan(faults)


def describe(plan: FaultPlan) -> list[str]:
    return [
        f"{f.attempt}:{f.point.value}@{f.vertex or '*'}/{f.subtask}"
        + (f"#{f.records}" if f.point is FaultPoint.AFTER_RECORDS else f"#cp{f.checkpoint}")
        + (f"({f.action} {f.seconds:g}s)" if f.action == "sleep" else "")
        for f in plan.faults
    ]


def fill_input(broker, topic: str, n: int, chunk: int = 5000) -> None:
    """The values 0..n-1 as text, in transactions of ``chunk`` records."""
    for start in range(0, n, chunk):
        broker.produce(topic, [str(i).encode() for i in range(start, min(n, start + chunk))])


def with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    values = pc.cast(batch.column("value"), pa.int64())
    return pa.RecordBatch.from_arrays([pc.remainder(values, KEYS), values], names=["key", "value"])


def to_record(batch: pa.RecordBatch) -> pa.RecordBatch:
    values = pc.cast(batch.column("value"), pa.int64())
    keys = pc.binary_join_element_wise("k", pc.cast(pc.remainder(values, KEYS), pa.string()), "")
    return pa.RecordBatch.from_arrays([keys, batch.column("value")], names=["k", "v"])


def expected_sums(n: int) -> dict[int, int]:
    values = np.arange(n, dtype=np.int64)
    sums = np.bincount(values % KEYS, weights=values, minlength=KEYS).astype(np.int64)
    return {k: int(sums[k]) for k in range(min(KEYS, n))}


def source(broker, topic: str) -> KafkaSource:
    built = (
        KafkaSource.builder()
        .set_bootstrap_servers(broker.bootstrap_servers)
        .set_topics(topic)
        .set_starting_offsets(KafkaOffsetsInitializer.earliest())
        .set_bounded(KafkaOffsetsInitializer.latest())
        .set_value_format("utf-8")
        .set_batch_size(2000)
        .build()
    )
    built.records_per_second = RATE
    return built


def kafka_sink(broker, topic: str) -> KafkaSink:
    return (
        KafkaSink.builder()
        .set_bootstrap_servers(broker.bootstrap_servers)
        .set_topic(topic)
        .set_key_column("k")
        .set_value_column("v")
        .set_delivery_guarantee(DeliveryGuarantee.EXACTLY_ONCE)
        .build()
    )


@dataclass
class KafkaChaosRun:
    seed: int | None
    pipeline: str
    n: int
    restarts: int = 0
    master_restarts: int = 0
    failures: list[str] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rows: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def kills(self) -> int:
        """The kills that happened: restarts of the job, and of its job master."""
        return self.restarts + self.master_restarts

    def line(self) -> str:
        return (
            f"seed={self.seed} pipeline={self.pipeline} restarts={self.restarts} "
            f"jm_restarts={self.master_restarts} "
            f"rows={self.rows} {'PASS' if self.ok else 'FAIL'} {self.seconds:.1f}s "
            f"faults=[{', '.join(self.plan)}]"
            + (f" problems: {'; '.join(self.problems)}" if self.problems else "")
        )


def run_pipeline(
    broker,
    pipeline: str,
    storage: str,
    plan: FaultPlan | None = None,
    seed: int | None = None,
    n: int = N,
    partitions: int = 3,
) -> KafkaChaosRun:
    """Fill a new input topic, run ``pipeline`` under ``plan``, check what was committed."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    run = KafkaChaosRun(seed, pipeline, n, plan=describe(plan) if plan else [])
    input_topic = broker.create_topic(partitions=partitions)
    fill_input(broker, input_topic, n)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(P)
    env.enable_checkpointing(CHECKPOINT_MS)
    env.get_checkpoint_config().set_checkpoint_storage(storage)
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(10, 50))
    if plan is not None:
        inject_faults(env, plan)
    stream = env.from_source(source(broker, input_topic), "kafka").uid("kafka")
    collect: CollectSink | None = None
    output_topic = ""
    if pipeline == "sum":
        collect = CollectSink(DeliveryGuarantee.EXACTLY_ONCE)
        (
            stream.map_batches(with_key, name="with-key")
            .key_by("key")
            .sum("value")
            .uid("running-sum")
            .sink_to(collect, name=SINK)
            .uid(SINK)
        )
    else:
        output_topic = broker.create_topic(partitions=partitions)
        (
            stream.map_batches(to_record, name="to-record")
            .rebalance()
            .sink_to(kafka_sink(broker, output_topic), name=SINK)
            .uid(SINK)
        )
    started = time.time()
    result = env.execute(f"kafka-chaos-{pipeline}-{seed}-{time.time_ns()}")
    run.seconds = time.time() - started
    run.restarts = result.restarts
    run.master_restarts = result.job_master_restarts
    run.failures = list(result.failures)
    if collect is not None:
        check_sums(run, result.sink_result(collect))
    else:
        check_topic(run, broker, output_topic)
    return run


def check_sums(run: KafkaChaosRun, table: pa.Table) -> None:
    run.rows = table.num_rows
    per_key: dict[int, list[int]] = {}
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist()):
        per_key.setdefault(key, []).append(value)
    exact = expected_sums(run.n)
    wrong = sorted(k for k in exact if (per_key.get(k) or [None])[-1] != exact[k])
    if wrong or set(per_key) - set(exact):
        k = wrong[0] if wrong else sorted(set(per_key) - set(exact))[0]
        run.problems.append(
            f"{len(wrong)} keys end on a wrong total (key {k}: "
            f"{(per_key.get(k) or [None])[-1]} committed, {exact.get(k)} exact)"
        )
    repeated = [k for k, v in per_key.items() if any(a >= b for a, b in zip(v, v[1:]))]
    if repeated:
        run.problems.append(f"{len(repeated)} keys repeat or lower a committed total")


def held_back(broker, topic: str) -> str:
    """Which commits the records past each partition's stable offset came from (their
    recovery headers), to tell whose transaction is open."""
    import confluent_kafka

    consumer = confluent_kafka.Consumer(
        broker.config(**{"group.id": "held-back", "isolation.level": "read_committed"})
    )
    try:
        stable = {
            p: consumer.get_watermark_offsets(
                confluent_kafka.TopicPartition(topic, p), timeout=10, cached=False
            )[1]
            for p in range(broker.partitions(topic))
        }
    finally:
        consumer.close()
    found: Counter = Counter()
    for m in broker.read(topic, "read_uncommitted"):
        if m.offset() >= stable[m.partition()]:
            tag = dict(m.headers() or []).get("rf.txn", b"?").decode().rsplit(":", 1)[0]
            found[(m.partition(), tag)] += 1
    return f"stable offsets {stable}; past them (partition, writer:sequence): {dict(found)}"


def copies_of(messages: list, duplicated: dict[int, int]) -> str:
    """Where the copies of duplicated values are: per (partition, writer:sequence of the
    commit that produced them, from the recovery header), how many and at which offsets.
    The same writer and sequence twice means one committable was committed twice."""
    where: dict[tuple[int, str], list[int]] = {}
    for m in messages:
        if int(m.value()) in duplicated:
            tag = dict(m.headers() or []).get("rf.txn", b"?").decode().rsplit(":", 1)[0]
            where.setdefault((m.partition(), tag), []).append(m.offset())
    return "copies (partition, writer:sequence): " + ", ".join(
        f"{key}: {len(offsets)} at {min(offsets)}..{max(offsets)}"
        for key, offsets in sorted(where.items())
    )


def check_topic(run: KafkaChaosRun, broker, topic: str) -> None:
    try:
        messages = broker.read(topic, timeout_s=60)
    except TimeoutError as exc:
        run.problems.append(
            f"the output is held back by an open transaction: {exc}; {held_back(broker, topic)}"
        )
        return
    run.rows = len(messages)
    counts = Counter(int(m.value()) for m in messages)
    lost = [v for v in range(run.n) if v not in counts]
    duplicated = {v: c for v, c in counts.items() if c > 1}
    extra = [v for v in counts if not 0 <= v < run.n]
    if lost:
        run.problems.append(f"{len(lost)} values lost (first {lost[:5]})")
    if duplicated:
        first = sorted(duplicated)[:5]
        run.problems.append(
            f"{sum(c - 1 for c in duplicated.values())} duplicates of {len(duplicated)} "
            f"values (first {first}); {copies_of(messages, duplicated)}"
        )
    if extra:
        run.problems.append(f"{len(extra)} values not in the input")
    keys_ok = all(m.key() == f"k{int(m.value()) % KEYS}".encode() for m in messages)
    if not keys_ok:
        run.problems.append("a record's key does not match its value")
