"""KafkaSource on a real Ray against the test broker: partitions split over subtasks,
records with their metadata columns, bounded at the offsets of job start, read positions
restored after kills (each record reaches the committed output once), and the offsets of
completed checkpoints committed to the group for monitoring."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rayflow import StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults, wait_for_checkpoints
from sinks.basic import CollectSink

ck = pytest.importorskip("confluent_kafka")

from rayflow.connectors.kafka import KafkaOffsetsInitializer, KafkaSource  # noqa: E402


def _source(broker, topic, **kwargs):
    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(broker.bootstrap_servers)
        .set_topics(topic)
        .set_starting_offsets(KafkaOffsetsInitializer.earliest())
        .set_bounded(KafkaOffsetsInitializer.latest())
        .set_value_format("utf-8")
        .set_batch_size(kwargs.pop("batch_size", 500))
    )
    if "group_id" in kwargs:
        builder.set_group_id(kwargs.pop("group_id"))
    return builder.build()


def test_partitions_split_over_subtasks_each_record_once(kafka_broker):
    topic = kafka_broker.create_topic(partitions=3)
    n = 3000
    kafka_broker.produce(topic, [str(i) for i in range(n)], keys=[f"k{i % 7}" for i in range(n)])
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    sink = CollectSink()
    env.from_source(_source(kafka_broker, topic, group_id="monitor"), "kafka").sink_to(sink)
    env.enable_checkpointing(200)
    table = env.execute("kafka-source").sink_result(sink)
    assert sorted(int(v) for v in table.column("value").to_pylist()) == list(range(n))
    assert table.schema.field("key").type == pa.binary()
    assert table.schema.field("value").type == pa.string()
    assert table.schema.field("timestamp").type == pa.timestamp("ms")
    assert set(table.column("topic").to_pylist()) == {topic}
    assert set(table.column("partition").to_pylist()) == {0, 1, 2}
    # per partition, each offset once: 0 .. end - 2 (the last is the commit marker)
    ends = kafka_broker.high_watermarks(topic)
    for p in range(3):
        offsets = table.filter(pc.equal(table.column("partition"), p)).column("offset")
        assert sorted(offsets.to_pylist()) == list(range(ends[p] - 1))
    assert table.column("headers").null_count == n
    # the offsets of the last completed checkpoint went to the group (monitoring only)
    consumer = ck.Consumer(kafka_broker.config(**{"group.id": "monitor"}))
    committed = consumer.committed([ck.TopicPartition(topic, p) for p in range(3)], timeout=10)
    consumer.close()
    assert {c.partition: c.offset for c in committed} == ends


def test_bounded_at_job_start_and_positions_survive_kills(kafka_broker, tmp_path):
    topic = kafka_broker.create_topic(partitions=2)
    n = 40_000
    for partition in (0, 1):  # half each: each source subtask reaches its kill's count
        kafka_broker.produce(topic, [str(i) for i in range(partition, n, 2)], partition=partition)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(5, 0))
    inject_faults(
        env,
        FaultPlan(
            [
                Fault(FaultPoint.AFTER_RECORDS, attempt=0, subtask=1, records=9_000),
                Fault(FaultPoint.AFTER_SNAPSHOT, attempt=1, subtask=0, checkpoint=2),
            ]
        ),
    )
    source = _source(kafka_broker, topic, batch_size=1000)
    source.records_per_second = 40_000
    sink = CollectSink()
    env.from_source(source, "kafka").map_batches(lambda b: b, name="relay").sink_to(sink)
    client = env.execute_async("kafka-source-chaos")
    assert wait_for_checkpoints(client, 1, timeout_s=120) >= 1
    # written after the job started (its splits and their bounds exist by its first
    # checkpoint): past the bound, never read
    kafka_broker.produce(topic, [str(n + i) for i in range(100)])
    result = client.wait(timeout=240)
    assert result.restarts == 2
    values = sorted(int(v) for v in result.sink_result(sink).column("value").to_pylist())
    assert values == list(range(n))
