"""KafkaSource without Ray, against the test broker: partitions listed and offsets resolved
once when a job starts (earliest, latest, committed, given), splits dealt again at another
parallelism, the reader (bounded, idle while unbounded), record formats, and settings
whose secrets never show."""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pytest

ck = pytest.importorskip("confluent_kafka")

from rayflow.connectors.kafka import (  # noqa: E402
    KafkaConnectorError,
    KafkaOffsetResetStrategy,
    KafkaOffsetsInitializer,
    KafkaSource,
    KafkaSplit,
)
from rayflow.connectors.kafka.records import RecordFormat, decode_column  # noqa: E402

SECRET = "pw-hunter2-do-not-show"


def _builder(broker, *topics):
    return KafkaSource.builder().set_bootstrap_servers(broker.bootstrap_servers).set_topics(*topics)


def _drain(reader, limit=200):
    rows, idle = [], 0
    for _ in range(limit):
        batch = reader.read_batch()
        if batch is None:
            return rows, idle, True
        if batch.num_rows == 0:
            idle += 1
            time.sleep(0.01)
            continue
        rows += batch.to_pylist()
    return rows, idle, False


def test_offsets_resolve_once_to_numbers(kafka_broker):
    topic = kafka_broker.create_topic(partitions=2)
    kafka_broker.produce(topic, [b"a", b"b", b"c"], partition=0)  # offsets 0-2, marker 3
    kafka_broker.produce(topic, [b"d"], partition=1)  # offset 0, marker 1
    earliest = _builder(kafka_broker, topic).build().create_splits(2)
    assert [(s.split_id, s.next_offset, s.stop_offset) for s in earliest] == [
        (f"{topic}:000000", 0, None),
        (f"{topic}:000001", 0, None),
    ]
    latest = (
        _builder(kafka_broker, topic)
        .set_starting_offsets(KafkaOffsetsInitializer.latest())
        .build()
        .create_splits(1)
    )
    assert [s.next_offset for s in latest] == [4, 2]
    given = (
        _builder(kafka_broker, topic)
        .set_starting_offsets(KafkaOffsetsInitializer.offsets({(topic, 0): 2}))
        .set_bounded(KafkaOffsetsInitializer.latest())
        .build()
        .create_splits(1)
    )
    assert [(s.next_offset, s.stop_offset) for s in given] == [(2, 4), (0, 2)]


def test_committed_offsets_with_and_without_a_reset(kafka_broker):
    topic = kafka_broker.create_topic(partitions=2)
    kafka_broker.produce(topic, [b"a", b"b"], partition=0)
    kafka_broker.produce(topic, [b"c"], partition=1)
    group = "committed-test"
    consumer = ck.Consumer(kafka_broker.config(**{"group.id": group}))
    consumer.commit(offsets=[ck.TopicPartition(topic, 0, 1)], asynchronous=False)
    consumer.close()
    strict = (
        _builder(kafka_broker, topic)
        .set_group_id(group)
        .set_starting_offsets(KafkaOffsetsInitializer.committed_offsets())
        .build()
    )
    with pytest.raises(KafkaConnectorError, match=r"no committed offset for .*\[1\]"):
        strict.create_splits(1)
    lenient = (
        _builder(kafka_broker, topic)
        .set_group_id(group)
        .set_starting_offsets(
            KafkaOffsetsInitializer.committed_offsets(KafkaOffsetResetStrategy.LATEST)
        )
        .build()
    )
    assert [s.next_offset for s in lenient.create_splits(1)] == [1, 2]
    with pytest.raises(KafkaConnectorError, match="needs a group id"):
        _builder(kafka_broker, topic).set_starting_offsets(
            KafkaOffsetsInitializer.committed_offsets()
        ).build().create_splits(1)


def test_topic_pattern_and_missing_topics(kafka_broker):
    first = kafka_broker.create_topic(f"pat-{uuid.uuid4().hex[:8]}-a", partitions=1)
    second = kafka_broker.create_topic(first[:-1] + "b", partitions=2)
    source = (
        KafkaSource.builder()
        .set_bootstrap_servers(kafka_broker.bootstrap_servers)
        .set_topic_pattern(first[:-1] + "[ab]")
        .build()
    )
    assert [(s.topic, s.partition) for s in source.create_splits(2)] == [
        (first, 0),
        (second, 0),
        (second, 1),
    ]
    with pytest.raises(KafkaConnectorError, match="no-such-topic"):
        _builder(kafka_broker, "no-such-topic").build().create_splits(1)
    with pytest.raises(ValueError, match="exactly one of"):
        KafkaSource.builder().set_bootstrap_servers("x:1").build()


def test_saved_partitions_are_dealt_again_at_another_parallelism():
    from rayflow.runtime.restore import assign_source_splits

    class Meta:
        source_splits = {
            "src": [
                KafkaSplit(split_id=f"t:{p:06d}", topic="t", partition=p, next_offset=10 * p)
                for p in (3, 0, 2, 1, 4)
            ]
        }

    class Vertex:
        source_uid = "src"

        def __init__(self, parallelism):
            self.parallelism = parallelism

    for parallelism in (1, 2, 3, 7):
        dealt = assign_source_splits(Vertex(parallelism), Meta)
        assert len(dealt) == parallelism
        flat = sorted((s.partition, s.next_offset) for subtask in dealt for s in subtask)
        assert flat == [(p, 10 * p) for p in range(5)]


def test_splits_are_cut_once_per_run(tmp_path):
    from rayflow.checkpoint.storage import CheckpointStorage, new_run_id
    from rayflow.runtime.deployer import Deployer

    calls = []

    class Source:
        def create_splits(self, parallelism):
            calls.append(parallelism)
            return [KafkaSplit(split_id=f"t:{p:06d}", topic="t", partition=p) for p in range(3)]

    class Vertex:
        vertex_id = 1
        parallelism = 2
        source_uid = "kafka"
        source = Source()

    def deployer(storage):
        made = Deployer.__new__(Deployer)
        made._fresh_splits, made.storage = {}, storage
        return made

    first_master = deployer(None)  # no storage (checkpointing off): once per deployer
    first = first_master.fresh_splits(Vertex)
    first[0].next_offset = 99  # a reader advancing its copy
    again = first_master.fresh_splits(Vertex)
    assert calls == [2]
    assert again[0].next_offset == 0
    # with the run's storage: a job master started later in the run gets the same cut
    storage = CheckpointStorage(str(tmp_path), "job", {}, new_run_id())
    assert deployer(storage).fresh_splits(Vertex)[2].partition == 2
    assert [s.split_id for s in deployer(storage).fresh_splits(Vertex)] == [
        s.split_id for s in again
    ]
    assert calls == [2, 2]


def test_reader_stops_at_the_bound_and_keeps_positions(kafka_broker):
    topic = kafka_broker.create_topic(partitions=2)
    kafka_broker.produce(topic, [str(i) for i in range(50)])
    source = (
        _builder(kafka_broker, topic)
        .set_bounded(KafkaOffsetsInitializer.latest())
        .set_value_format("utf-8")
        .set_batch_size(7)
        .build()
    )
    splits = source.create_splits(1)
    kafka_broker.produce(topic, ["late"] * 5)  # after the bound
    reader = source.create_reader(splits)
    rows, _, ended = _drain(reader)
    reader.close()
    assert ended
    assert sorted(int(r["value"]) for r in rows) == list(range(50))
    ends = {s.partition: s.stop_offset for s in splits}
    assert {s.partition: s.next_offset for s in reader.snapshot_splits()} == ends
    # a reader made from saved positions reads nothing more
    again = source.create_reader(reader.snapshot_splits())
    assert again.read_batch() is None


def test_unbounded_reader_idles_then_reads_new_records(kafka_broker, kafka_topic):
    source = _builder(kafka_broker, kafka_topic).set_value_format("utf-8").build()
    reader = source.create_reader(source.create_splits(1))
    rows, idle, ended = _drain(reader, limit=20)
    assert (rows, ended) == ([], False) and idle == 20
    kafka_broker.produce(kafka_topic, ["x", "y"], keys=["k", "k"])
    rows, idle, ended = _drain(reader, limit=300)
    assert sorted(r["value"] for r in rows) == ["x", "y"] and not ended
    assert {r["key"] for r in rows} == {b"k"}
    reader.close()


def test_json_values_with_a_type_nulls_and_bad_records():
    def where(i):
        return f"record t[0]@{i}"

    values = [b'{"id": 1, "name": "a"}', None, b'{\n  "id": 2,\n  "extra": true\n}']
    typed = decode_column(
        values, RecordFormat.JSON, pa.struct([("id", pa.int64()), ("name", pa.string())]), where
    )
    assert typed.to_pylist() == [{"id": 1, "name": "a"}, None, {"id": 2, "name": None}]
    inferred = decode_column(values, RecordFormat.JSON, None, where)
    assert inferred.to_pylist()[0]["id"] == 1
    with pytest.raises(KafkaConnectorError, match=r"record t\[0\]@1: not JSON"):
        decode_column([b'{"id": 1}', b"{nope"], RecordFormat.JSON, None, where)
    with pytest.raises(KafkaConnectorError, match=r"@0: a JSON value must be an object"):
        decode_column([b"[1, 2]"], RecordFormat.JSON, None, where)
    with pytest.raises(KafkaConnectorError, match=r"@1: not UTF-8"):
        decode_column([b"ok", b"\xff\xfe"], RecordFormat.UTF8, None, where)


def test_secrets_never_show(kafka_broker):
    source = (
        _builder(kafka_broker, "no-such-topic-for-secrets")
        .set_properties({"sasl.username": "alice", "sasl.password": SECRET})
        .build()
    )
    assert SECRET not in repr(source) and SECRET not in source.describe()
    assert SECRET not in repr(source.settings)
    with pytest.raises(KafkaConnectorError) as caught:
        source.create_splits(1)  # SASL settings without SASL: the client refuses
    assert SECRET not in str(caught.value)
    bad = _builder(kafka_broker, "t").set_property("no.such.setting", SECRET).build()
    with pytest.raises(KafkaConnectorError) as caught:
        bad.create_splits(1)
    assert "no.such.setting" in str(caught.value) or "No such" in str(caught.value)
    assert source.settings.redact(f"x {SECRET} y") == "x *** y"
