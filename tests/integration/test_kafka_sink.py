"""KafkaSink in jobs on a real Ray against the test broker: the guarantee each job gives
(and says), AT_LEAST_ONCE losing nothing after a kill, and an unbounded Kafka-to-Kafka
job that is cancelled and resumed from its checkpoint: each input record in the output
once, across both runs, and no transaction left open."""

from __future__ import annotations

import time
from collections import Counter

import pyarrow as pa
import pytest

from rayflow import DeliveryGuarantee, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode, RestartStrategies
from rayflow.errors import JobCancelledError
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults, wait_for_checkpoints

ck = pytest.importorskip("confluent_kafka")

from rayflow.connectors.kafka import KafkaOffsetsInitializer, KafkaSink, KafkaSource  # noqa: E402
from rayflow.sink import UnsupportedGuaranteeError  # noqa: E402
from sinks.basic import CollectSink  # noqa: E402
from tests.chaos.kafka_harness import fill_input, to_record  # noqa: E402

SECRET = "pw-never-in-plans"


def _sink(broker, topic, guarantee=None, **props):
    builder = (
        KafkaSink.builder()
        .set_bootstrap_servers(broker.bootstrap_servers)
        .set_topic(topic)
        .set_key_column("k")
        .set_value_column("v")
        .set_properties(props)
    )
    if guarantee is not None:
        builder.set_delivery_guarantee(guarantee)
    return builder.build()


def _source(broker, topic, bounded=True):
    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(broker.bootstrap_servers)
        .set_topics(topic)
        .set_value_format("utf-8")
        .set_batch_size(1000)
    )
    if bounded:
        builder.set_bounded(KafkaOffsetsInitializer.latest())
    return builder.build()


def test_guarantee_follows_the_checkpointing_and_secrets_stay_out(kafka_broker, kafka_topic):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(500, CheckpointingMode.EXACTLY_ONCE)
    sink = _sink(kafka_broker, kafka_topic, **{"sasl.password": SECRET})
    env.from_collection([{"k": "a", "v": "1"}]).sink_to(sink, name="out")
    text = env.explain()
    assert "exactly-once effect" in text and SECRET not in text
    off = StreamExecutionEnvironment.get_execution_environment()
    off.from_collection([{"k": "a", "v": "1"}]).sink_to(
        _sink(kafka_broker, kafka_topic, DeliveryGuarantee.EXACTLY_ONCE), name="out"
    )
    with pytest.raises(UnsupportedGuaranteeError):
        off.get_job_graph()


def test_at_least_once_loses_nothing_after_a_kill(kafka_broker, tmp_path):
    source_topic = kafka_broker.create_topic(partitions=2)
    out = kafka_broker.create_topic(partitions=2)
    n = 20_000
    fill_input(kafka_broker, source_topic, n)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100, CheckpointingMode.AT_LEAST_ONCE)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 0))
    inject_faults(
        env, FaultPlan([Fault(FaultPoint.AFTER_SNAPSHOT, attempt=0, vertex="out", checkpoint=2)])
    )
    source = _source(kafka_broker, source_topic)
    source.records_per_second = 10_000
    sink = _sink(kafka_broker, out, DeliveryGuarantee.AT_LEAST_ONCE)
    env.from_source(source, "kafka").map_batches(to_record).sink_to(sink, name="out")
    result = env.execute("kafka-at-least-once")
    assert result.restarts == 1
    counts = Counter(int(v) for v in kafka_broker.read_values(out))
    assert set(counts) == set(range(n))  # nothing lost (some may be there twice)
    print(f"AT_LEAST_ONCE: {sum(counts.values()) - n} records written twice")


def test_unbounded_job_cancelled_and_resumed_writes_each_record_once(kafka_broker, tmp_path):
    source_topic = kafka_broker.create_topic(partitions=2)
    out = kafka_broker.create_topic(partitions=2)
    storage = str(tmp_path / "chk")
    job = f"kafka-resume-{time.time_ns()}"

    def start(restore_from=None):
        env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
        env.enable_checkpointing(150)
        env.get_checkpoint_config().set_checkpoint_storage(storage)
        (
            env.from_source(_source(kafka_broker, source_topic, bounded=False), "kafka")
            .uid("kafka")
            .map_batches(to_record, name="to-record")
            .sink_to(_sink(kafka_broker, out, DeliveryGuarantee.EXACTLY_ONCE), name="out")
            .uid("out")
        )
        return env.execute_async(job, restore_from=restore_from)

    def wait_for_output(count, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        values = []
        while time.monotonic() < deadline:
            values = [int(v) for v in kafka_broker.read_values(out)]
            if len(values) >= count:
                return values
            time.sleep(0.5)
        return values

    client = start()
    assert wait_for_checkpoints(client, 1, timeout_s=120) >= 1
    fill_input(kafka_broker, source_topic, 3000)
    assert len(wait_for_output(3000)) == 3000  # read while running: the source idled
    assert client.cancel() is True
    with pytest.raises(JobCancelledError):
        client.wait(timeout=120)
    kafka_broker.produce(source_topic, [str(i).encode() for i in range(3000, 5000)])
    resumed = start(restore_from="latest")
    values = wait_for_output(5000)
    assert resumed.cancel() is True
    with pytest.raises(JobCancelledError):
        resumed.wait(timeout=120)
    values = [int(v) for v in kafka_broker.read_values(out)]  # nothing left open
    assert sorted(values) == list(range(5000))


def test_records_keep_their_keys_partitions_and_headers(kafka_broker, kafka_topic):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(200)
    headers = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    rows = pa.table(
        {
            "k": ["a", "b", "c"],
            "v": ["1", "2", "3"],
            "p": pa.array([1, 0, 1], pa.int32()),
            "h": pa.array([[{"key": "trace", "value": b"x"}], None, []], headers),
        }
    )
    sink = (
        KafkaSink.builder()
        .set_bootstrap_servers(kafka_broker.bootstrap_servers)
        .set_topic(kafka_topic)
        .set_key_column("k")
        .set_value_column("v")
        .set_partition_column("p")
        .set_headers_column("h")
        .build()
    )
    collect = CollectSink()
    stream = env.from_collection(rows)
    stream.sink_to(sink, name="out")
    stream.sink_to(collect, name="seen")
    env.execute("kafka-columns")
    got = {m.key(): m for m in kafka_broker.read(kafka_topic)}
    assert {k: (m.value(), m.partition()) for k, m in got.items()} == {
        b"a": (b"1", 1),
        b"b": (b"2", 0),
        b"c": (b"3", 1),
    }
    assert [h for h in got[b"a"].headers() if h[0] == "trace"] == [("trace", b"x")]
