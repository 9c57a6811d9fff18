"""KafkaSink driven directly (no Ray) against the test broker: each failure schedule of the
exactly-once protocol (rayflow/connectors/kafka/sink.py), one test each, then
AT_LEAST_ONCE's flush at the barrier, the committable format, and secrets.

A "crash" here abandons a committer mid-commit without any clean-up (an exception no
code path catches), leaving its producer and its open transaction as a killed process
would; a "restarted subtask" is a new sink object, whose committer starts from nothing.
"""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pytest

ck = pytest.importorskip("confluent_kafka")

from rayflow import DeliveryGuarantee  # noqa: E402
from rayflow.connectors.kafka import (  # noqa: E402
    RECOVERY_HEADER,
    KafkaConnectorError,
    KafkaSink,
)
from rayflow.connectors.kafka.sink import KafkaCommittableSerializer  # noqa: E402
from rayflow.runtime.hooks import HookPoint  # noqa: E402
from rayflow.sink import CommitStatus, SinkContext, UnknownCommittableVersionError  # noqa: E402

SECRET = "pw-hunter2-not-shown"


class Crash(BaseException):
    """Not an Exception: nothing in the sink catches it (like SIGKILL, no clean-up)."""


class _Hooks:
    def __init__(self, crash_at: int = 1) -> None:
        self.crash_at, self.seen = crash_at, 0

    def at(self, point: HookPoint) -> None:
        if point is HookPoint.SINK_INSIDE_COMMIT:
            self.seen += 1
            if self.seen == self.crash_at:
                raise Crash("killed inside the commit, after its records were sent")

    def after_records(self, records: int) -> None:
        pass


def _sink(broker, topic, guarantee=DeliveryGuarantee.EXACTLY_ONCE, **props):
    return (
        KafkaSink.builder()
        .set_bootstrap_servers(broker.bootstrap_servers)
        .set_topic(topic)
        .set_key_column("k")
        .set_value_column("v")
        .set_delivery_guarantee(guarantee)
        .set_properties(props)
        .build()
    )


def _context(job="job", run="run-1", subtask=0, hooks=None, guarantee=None):
    return SinkContext(
        job, "uid", subtask, 2, 0, run_id=run, delivery_guarantee=guarantee, hooks=hooks
    )


def _committable(sink, context, sequence, values, checkpoint=1):
    txn = sink.begin_transaction(context, sequence)
    sink.write(
        txn,
        pa.RecordBatch.from_pydict(
            {"k": [f"k{v % 3}" for v in values], "v": [str(v) for v in values]}
        ),
    )
    return sink.pre_commit(txn, checkpoint)


def _values(broker, topic):
    return sorted(int(m.value()) for m in broker.read(topic))


def _committer(sink, context):
    return sink.create_committer(context)


def _fails_once(committer, method: str, reason: str, when=lambda *args: True) -> None:
    """The committer's ``method`` answers RETRY_LATER (raises ``_Retry(reason)``) the first
    time it is called with arguments ``when`` accepts; else it does what it does."""
    from rayflow.connectors.kafka.sink import _Retry

    real, failed = getattr(committer, method), []

    def flaky(*args):
        if not failed and when(*args):
            failed.append(args)
            raise _Retry(reason)
        return real(*args)

    setattr(committer, method, flaky)


def test_commit_makes_records_visible_with_recovery_headers(kafka_broker, kafka_topic):
    sink = _sink(kafka_broker, kafka_topic)
    c = _committable(sink, _context(), 0, range(5))
    assert kafka_broker.read(kafka_topic) == []  # nothing is sent before the commit
    assert _committer(sink, _context()).commit(c).status is CommitStatus.COMMITTED
    messages = kafka_broker.read(kafka_topic)
    assert sorted(int(m.value()) for m in messages) == list(range(5))
    assert {m.key() for m in messages} == {b"k0", b"k1", b"k2"}
    tags = sorted(dict(m.headers())[RECOVERY_HEADER].decode() for m in messages)
    assert [t.rsplit(":", 2)[1:] for t in tags] == [["0", str(i)] for i in range(5)]


def test_schedule_commit_repeated_after_it_succeeded(kafka_broker, kafka_topic):
    """Dies right after commit_transaction returned (the runtime never learned): the
    restored subtask commits the same committable again."""
    sink = _sink(kafka_broker, kafka_topic)
    c = _committable(sink, _context(), 0, range(10))
    assert _committer(sink, _context()).commit(c).done
    again = _committer(_sink(kafka_broker, kafka_topic), _context(run="run-1"))
    outcome = again.commit(c)
    assert outcome.status is CommitStatus.ALREADY_COMMITTED
    assert _values(kafka_broker, kafka_topic) == list(range(10))


def test_schedule_killed_inside_commit_after_records_were_sent(kafka_broker, kafka_topic):
    """Dies after its records reached the broker, before commit_transaction: Kafka would
    abort that transaction when the id is initialised again; Tansu exposes it. Either
    way the restored committer produces exactly what is not visible yet."""
    crashing = _sink(kafka_broker, kafka_topic)
    context = _context(hooks=_Hooks(crash_at=1))
    c = _committable(crashing, context, 0, range(20))
    committer = _committer(crashing, context)
    with pytest.raises(Crash):
        committer.commit(c)
    # the open transaction holds its partitions back
    with pytest.raises(TimeoutError):
        kafka_broker.read(kafka_topic, timeout_s=1.0)
    restored = _committer(_sink(kafka_broker, kafka_topic), _context())
    assert restored.commit(c).done
    assert _values(kafka_broker, kafka_topic) == list(range(20))
    # Tansu exposed all 20 when the id was initialised again (Apache Kafka: 0, aborted)
    assert restored.found_visible == 20
    # the abandoned producer (an older attempt still alive) is fenced: it cannot commit
    zombie = committer._writers[c.transactional_id].producer
    with pytest.raises(ck.KafkaException):  # fenced (or no answer within 2 s)
        zombie.commit_transaction(2)
    assert _values(kafka_broker, kafka_topic) == list(range(20))
    assert restored.commit(c).status is CommitStatus.ALREADY_COMMITTED


def test_schedule_killed_after_part_of_the_records_were_sent(kafka_broker, kafka_topic):
    """Dies with only some records sent (the client sends batches as they fill): on a
    broker that exposes the dead transaction, only the missing records are produced."""
    sink = _sink(kafka_broker, kafka_topic)
    context = _context()
    c = _committable(sink, context, 0, range(12))
    # what the dead commit had sent: records 0..4 of it, with their headers
    dead = ck.Producer(kafka_broker.config(**{"transactional.id": c.transactional_id}))
    dead.init_transactions(30)
    dead.begin_transaction()
    for index in range(5):
        dead.produce(
            kafka_topic,
            value=str(index).encode(),
            key=f"k{index % 3}".encode(),
            headers=[(RECOVERY_HEADER, f"{c.writer_tag}:{c.sequence}:{index}".encode())],
        )
    dead.flush(30)
    restored = _committer(_sink(kafka_broker, kafka_topic), _context())
    assert restored.commit(c).done
    assert _values(kafka_broker, kafka_topic) == list(range(12))
    assert restored.found_visible == 5


def test_schedule_killed_after_init_before_any_record(kafka_broker, kafka_topic):
    sink = _sink(kafka_broker, kafka_topic)
    c = _committable(sink, _context(), 0, range(7))
    _committer(sink, _context())._writer(c, c.run)  # initialised the id, read the marker
    restored = _committer(_sink(kafka_broker, kafka_topic), _context())
    assert restored.commit(c).done
    assert _values(kafka_broker, kafka_topic) == list(range(7))


def test_schedule_killed_between_two_commits_of_a_checkpoint(kafka_broker, kafka_topic):
    """Two committables of one writer (a rolled transaction and the barrier's): dies after
    the first committed and inside the second. The restore commits both again."""
    sink = _sink(kafka_broker, kafka_topic)
    context = _context(hooks=_Hooks(crash_at=2))
    first = _committable(sink, context, 0, range(0, 5))
    second = _committable(sink, context, 1, range(5, 9))
    committer = _committer(sink, context)
    assert committer.commit(first).done
    with pytest.raises(Crash):
        committer.commit(second)
    restored = _committer(_sink(kafka_broker, kafka_topic), _context())
    assert restored.commit(first).status is CommitStatus.ALREADY_COMMITTED
    assert restored.commit(second).done
    assert _values(kafka_broker, kafka_topic) == list(range(9))


def test_schedule_zombie_of_an_older_attempt_retries_a_commit_a_newer_one_died_in(
    kafka_broker, kafka_topic
):
    """A committer of an older attempt that is still alive in another process (a node cut
    off from the cluster, or actors of a run whose driver died outliving its run lock), with
    the marker it last committed cached, retries a commit after a newer attempt died
    inside the same commit with its records sent. Its producer is fenced, so it writes no
    record; nothing else it does may make the next attempt's recovery miss the records
    the dead attempt sent (Tansu exposes them when the id is initialised again)."""
    sink = _sink(kafka_broker, kafka_topic)
    first = _committable(sink, _context(), 0, range(0, 4))
    second = _committable(sink, _context(), 1, range(4, 12))
    zombie = _committer(sink, _context())
    assert zombie.commit(first).done  # the older attempt committed the first one
    newer = _committer(_sink(kafka_broker, kafka_topic), _context(hooks=_Hooks(crash_at=1)))
    with pytest.raises(Crash):
        newer.commit(second)  # the newer attempt dies inside the second commit
    assert zombie.commit(second).status is CommitStatus.RETRY_LATER  # fenced: nothing written
    restored = _committer(_sink(kafka_broker, kafka_topic), _context())
    assert restored.commit(second).done
    assert _values(kafka_broker, kafka_topic) == list(range(12))


def test_schedule_two_committed_commits_restored_while_another_writer_held_the_marker_back(
    kafka_broker, kafka_topic
):
    """Writer 1 dies inside a commit with its records sent (its transaction stays open).
    Writer 0 then commits two committables (a checkpoint whose notification came after the
    next barrier holds both), and the job restarts from that checkpoint. On the test broker
    writer 1's open transaction holds writer 0's commit marker back
    (``test_tansu_deviation_open_transaction_holds_back_other_producers_offset_commits``):
    writer 0's restored committer reads a marker that covers neither, and writer 1's
    restart ends the open transaction right after. The restored commit of the first
    finds all of its records; the second, committed too, must not be produced again."""
    sink = _sink(kafka_broker, kafka_topic)
    dying = _context(subtask=1, hooks=_Hooks(crash_at=1))
    other = _committable(sink, dying, 0, range(100, 104))
    with pytest.raises(Crash):
        _committer(sink, dying).commit(other)  # writer 1's transaction stays open
    first = _committable(sink, _context(), 0, range(0, 5))
    second = _committable(sink, _context(), 1, range(5, 13))
    old = _committer(sink, _context())
    assert old.commit(first).done and old.commit(second).done
    restored = _committer(_sink(kafka_broker, kafka_topic), _context())
    read_marker = restored._read_marker

    def marker_then_writer_1_restarts(committable):
        marker = read_marker(committable)
        assert marker == 0  # held back: neither commit is covered
        # writer 1's restart: initialising its id ends its open transaction
        assert _committer(_sink(kafka_broker, kafka_topic), _context(subtask=1)).commit(other).done
        return marker

    restored._read_marker = marker_then_writer_1_restarts
    assert restored.commit(first).done
    assert restored.commit(second).done
    assert _values(kafka_broker, kafka_topic) == list(range(13)) + list(range(100, 104))


def test_recovery_scan_that_keeps_reading_is_not_cut_off(kafka_broker, kafka_topic, monkeypatch):
    """A restored commit looks for its records from the end offsets at its pre-commit; a
    job restored long after (other producers wrote much to the topic meanwhile) reads a
    long way. A scan that keeps getting records must not time out: a fixed deadline would
    answer RETRY_LATER on every try, and the job could never recover."""
    from rayflow.connectors.kafka import sink as kafka_sink

    sink = _sink(kafka_broker, kafka_topic)
    c = _committable(sink, _context(), 0, range(5))
    kafka_broker.produce(kafka_topic, [b"%d" % v for v in range(100, 160)])  # others' records
    monkeypatch.setattr(kafka_sink, "_SCAN_TIMEOUT_S", 1.0)
    restored = _committer(_sink(kafka_broker, kafka_topic), _context())
    real = restored._group_client

    class Slow:  # a reader that gets a few records at a time, slowly
        def __init__(self, consumer):
            self.consumer = consumer

        def consume(self, count, timeout):
            time.sleep(0.1)
            return self.consumer.consume(min(count, 2), timeout)

        def __getattr__(self, name):
            return getattr(self.consumer, name)

    monkeypatch.setattr(restored, "_group_client", lambda *a: Slow(real(*a)))
    assert restored.commit(c).status is CommitStatus.COMMITTED
    assert _values(kafka_broker, kafka_topic) == list(range(5)) + list(range(100, 160))


def test_schedule_commit_failed_with_records_in_flight_then_retried(
    kafka_broker, kafka_topic, monkeypatch
):
    """A commit gives up while some of its records are still on their way (the broker did
    not answer within the timeout); the committer drops that producer and the retry
    initialises the id with a new one. A request of the old producer processed while the
    new one initialises can leave a transaction open that nothing ends on the test broker
    (test_tansu_deviation_fenced_produce_racing_init_can_hold_a_topic_back): the old
    producer's requests must be answered before the id is initialised again. Producers
    here are a model of the client: records stay "on the wire" until the producer that
    sent them gets its answers (a purge of in-flight records only stops waiting)."""
    from rayflow.connectors.kafka import sink as kafka_sink

    wire = {"in_flight": 0, "races": 0, "flushes": 0}

    class Producer:
        def __init__(self, conf):
            self.sent = 0

        def init_transactions(self, timeout):
            wire["races"] += wire["in_flight"] > 0

        def begin_transaction(self):
            pass

        def produce(self, topic, **kwargs):
            self.sent += 1
            wire["in_flight"] += 1

        def poll(self, timeout=0):
            return 0

        def flush(self, timeout=None):
            wire["flushes"] += 1
            if wire["flushes"] == 1:  # the commit's flush: no answer in time
                return self.sent
            wire["in_flight"] -= self.sent  # answered (or refused: fenced)
            self.sent = 0
            return 0

        def purge(self, in_queue=True, in_flight=True, blocking=True):
            if in_flight:
                self.sent = 0  # no longer waited for; still on the wire

        def send_offsets_to_transaction(self, *args):
            pass

        def commit_transaction(self, timeout=None):
            pass

    sink = _sink(kafka_broker, kafka_topic)
    c = _committable(sink, _context(), 0, range(6))
    committer = _committer(sink, _context())
    monkeypatch.setattr(kafka_sink.KafkaSink, "_producer", lambda self, label, conf: Producer(conf))
    assert committer.commit(c).status is CommitStatus.RETRY_LATER
    assert committer.commit(c).status is CommitStatus.COMMITTED
    assert wire["races"] == 0


@pytest.mark.parametrize("step", ["_writer", "_read_marker", "_visible"])
def test_commits_of_one_writer_stay_in_order(kafka_broker, kafka_topic, step):
    """A committable that must wait (RETRY_LATER) holds back the later ones of its writer,
    whichever step of its first try failed: initialising the producer, reading the marker
    (the group coordinator still loading) or looking for records already there. Committed
    first, a later one would move the marker past it, whose retry would then answer
    ALREADY_COMMITTED: its records lost."""
    sink = _sink(kafka_broker, kafka_topic)
    first = _committable(sink, _context(), 0, range(0, 5))
    second = _committable(sink, _context(), 1, range(5, 9))
    committer = _committer(sink, _context())
    _fails_once(committer, step, f"{step}: timed out")
    assert committer.commit(first).status is CommitStatus.RETRY_LATER
    held = committer.commit(second)
    assert held.status is CommitStatus.RETRY_LATER and "not committed yet" in held.reason
    assert committer.commit(first).done and committer.commit(second).done
    assert _values(kafka_broker, kafka_topic) == list(range(9))


def test_a_commit_repeated_after_it_succeeded_keeps_a_later_one_waiting(kafka_broker, kafka_topic):
    """The second committable cannot be committed now (RETRY_LATER before its producer is
    ready); then the first, committed already, is committed again (ALREADY_COMMITTED).
    The second still holds the third back: committed first, the third would move the
    marker past the second, whose retry would answer ALREADY_COMMITTED (records lost)."""
    sink = _sink(kafka_broker, kafka_topic)
    c0, c1, c2 = (_committable(sink, _context(), s, range(3 * s, 3 * s + 3)) for s in range(3))
    committer = _committer(sink, _context())
    _fails_once(committer, "_writer", "init_transactions: timed out", lambda c, _: c.sequence == 1)
    assert committer.commit(c0).status is CommitStatus.COMMITTED
    assert committer.commit(c1).status is CommitStatus.RETRY_LATER
    assert committer.commit(c0).status is CommitStatus.ALREADY_COMMITTED
    assert committer.commit(c2).status is CommitStatus.RETRY_LATER
    assert committer.commit(c1).done and committer.commit(c2).done
    assert _values(kafka_broker, kafka_topic) == list(range(9))


def test_schedule_commit_answered_with_an_error_after_the_broker_committed_it(
    kafka_broker, kafka_topic, monkeypatch
):
    """``commit_transaction`` fails (a timeout) although the broker committed the
    transaction. The retry finds it committed (ALREADY_COMMITTED); the writer's next
    committables must not keep waiting for it."""
    from rayflow.connectors.kafka import sink as kafka_sink

    real_producer = kafka_sink.KafkaSink._producer
    made = []

    class CommitsThenTimesOut:
        def __init__(self, producer):
            self.producer = producer

        def commit_transaction(self, timeout=None):
            self.producer.commit_transaction(timeout)
            if len(made) == 1:
                raise ck.KafkaException(ck.KafkaError(ck.KafkaError._TIMED_OUT, "timed out"))

        def __getattr__(self, name):
            return getattr(self.producer, name)

    def producer(self, label, overrides):
        made.append(label)
        return CommitsThenTimesOut(real_producer(self, label, overrides))

    monkeypatch.setattr(kafka_sink.KafkaSink, "_producer", producer)
    sink = _sink(kafka_broker, kafka_topic)
    first = _committable(sink, _context(), 0, range(0, 5))
    second = _committable(sink, _context(), 1, range(5, 9))
    committer = _committer(sink, _context())
    assert committer.commit(first).status is CommitStatus.RETRY_LATER
    assert committer.commit(first).status is CommitStatus.ALREADY_COMMITTED
    assert committer.commit(second).status is CommitStatus.COMMITTED
    assert _values(kafka_broker, kafka_topic) == list(range(9))


def test_a_scan_held_back_on_one_partition_ends_while_others_get_records(
    kafka_broker, kafka_topic, monkeypatch
):
    """A restored commit's scan cannot read one partition to its end (an open transaction
    of another producer holds it back) while other producers keep writing to another
    partition, already read to its end. Records the scan does not need must not keep it
    waiting: it answers RETRY_LATER once the held-back partition gave nothing for the
    scan timeout."""
    import threading

    from rayflow.connectors.kafka import sink as kafka_sink

    monkeypatch.setattr(kafka_sink, "_SCAN_TIMEOUT_S", 1.0)
    sink = _sink(kafka_broker, kafka_topic)
    c = _committable(sink, _context(), 0, range(5))
    stuck = ck.Producer(
        kafka_broker.config(**{"transactional.id": f"stuck-{uuid.uuid4().hex[:8]}"})
    )
    stuck.init_transactions(30)
    stuck.begin_transaction()
    stuck.produce(kafka_topic, b"held", partition=0)
    stuck.flush(30)
    stop = threading.Event()

    def keep_writing() -> None:
        plain = ck.Producer(kafka_broker.config())
        while not stop.is_set():
            plain.produce(kafka_topic, b"1000", partition=1)
            plain.flush(10)
            time.sleep(0.2)

    writer = threading.Thread(target=keep_writing, daemon=True)
    writer.start()
    answers = []
    committing = threading.Thread(
        target=lambda: answers.append(_committer(sink, _context()).commit(c)), daemon=True
    )
    try:
        committing.start()
        committing.join(15)
        assert answers and answers[0].status is CommitStatus.RETRY_LATER
    finally:
        stop.set()
        writer.join(10)
        committing.join(30)
        stuck.commit_transaction(30)  # (leave nothing open for the tests that follow)


def test_runs_and_writers_have_their_own_markers(kafka_broker, kafka_topic):
    """A new run of the job (sequences start again) and another subtask's writer are not
    mistaken for what was committed already."""
    sink = _sink(kafka_broker, kafka_topic)
    a = _committable(sink, _context(run="run-a"), 0, range(0, 3))
    b = _committable(sink, _context(run="run-b"), 0, range(3, 6))
    other = _committable(sink, _context(run="run-a", subtask=1), 0, range(6, 9))
    assert a.transactional_id != other.transactional_id
    committer = _committer(sink, _context(run="run-b"))
    assert all(committer.commit(c).done for c in (a, b, other))
    assert {committer.commit(c).status for c in (a, b, other)} == {CommitStatus.ALREADY_COMMITTED}
    assert _values(kafka_broker, kafka_topic) == list(range(9))


def test_lingering_transaction_is_ended_for_the_next_writer(kafka_broker, kafka_topic):
    """abort_lingering initialises the subtask's transactional id: an open transaction of a
    dead producer stops holding the partitions back (Kafka aborts it; Tansu exposes it,
    which the protocol never lets happen to records that are not also committed)."""
    sink = _sink(kafka_broker, kafka_topic)
    context = _context(job=f"linger-{uuid.uuid4().hex[:6]}")
    txn_id = sink.transactional_id(context, 0)
    dead = ck.Producer(kafka_broker.config(**{"transactional.id": txn_id}))
    dead.init_transactions(30)
    dead.begin_transaction()
    dead.produce(kafka_topic, b"x", partition=0)
    dead.flush(30)
    assert _committer(sink, context).abort_lingering(context, []) == 0
    kafka_broker.read(kafka_topic, timeout_s=10)  # no longer held back


def test_at_least_once_flushes_at_the_barrier_and_fails_it_on_errors(kafka_broker, kafka_topic):
    sink = (
        KafkaSink.builder()
        .set_bootstrap_servers(kafka_broker.bootstrap_servers)
        .set_topic(kafka_topic)
        .set_value_column("v")
        .set_partition_column("p")
        .set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE)
        .build()
    )
    context = _context(guarantee=DeliveryGuarantee.AT_LEAST_ONCE)
    txn = sink.begin_transaction(context, 0)
    sink.write(txn, pa.RecordBatch.from_pydict({"v": ["1", "2"], "p": [0, 1]}))
    c = sink.pre_commit(txn, 1)  # the barrier: flushed and acknowledged
    assert c.records is None
    assert sorted(kafka_broker.read_values(kafka_topic)) == [b"1", b"2"]
    assert sink.create_committer(context).commit(c).done
    txn = sink.begin_transaction(context, 1)
    with pytest.raises(KafkaConnectorError, match="partition 7"):  # the topic has 2
        sink.write(txn, pa.RecordBatch.from_pydict({"v": ["3"], "p": [7]}))
        sink.pre_commit(txn, 2)
    sink.close()


def test_committable_format_is_versioned():
    serializer = KafkaCommittableSerializer()
    from rayflow.connectors.kafka import KafkaCommittable

    c = KafkaCommittable("t", 1, "txn-1", "run-x", 4, 9, b"ipc-bytes", 3, {0: 17, 2: 5})
    version, data = serializer.encode(c)
    assert serializer.decode(version, data) == c
    # format 1 (no start offsets) is still read
    head = b'{"checkpoint_id": 9, "count": 3, "has_records": true, "run": "run-x", '
    head += b'"sequence": 4, "topic": "t", "transactional_id": "txn-1", "writer": 1}'
    old = serializer.decode(1, len(head).to_bytes(4, "big") + head + b"ipc-bytes")
    assert old == KafkaCommittable("t", 1, "txn-1", "run-x", 4, 9, b"ipc-bytes", 3, None)
    flushed = KafkaCommittable("t", 0, "txn-0", "run-x", 5, None, None, 2)
    assert serializer.decode(*serializer.encode(flushed)) == flushed
    with pytest.raises(UnknownCommittableVersionError):
        serializer.decode(version + 1, data)


def test_secrets_never_show(kafka_broker):
    sink = _sink(kafka_broker, "no-such-topic-here", **{"sasl.password": SECRET})
    assert SECRET not in repr(sink) and SECRET not in repr(sink.settings)
    with pytest.raises(KafkaConnectorError) as caught:
        sink.setup("job")
    assert "does not exist" in str(caught.value) or "cannot" in str(caught.value)
    assert SECRET not in str(caught.value)
    with pytest.raises(ValueError, match="transactional.id"):
        _sink(kafka_broker, "t", **{"transactional.id": "mine"})
