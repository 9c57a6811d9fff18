"""The Kafka sink: NONE, AT_LEAST_ONCE and EXACTLY_ONCE, on the two-phase-commit contract
of :mod:`rayflow.sink`.

::

    sink = (
        KafkaSink.builder()
        .set_bootstrap_servers("broker:9092")
        .set_topic("totals")
        .set_key_column("customer")          # optional; no key by default
        .set_value_column("total")           # optional; default: each row as a JSON object
        .set_delivery_guarantee(DeliveryGuarantee.EXACTLY_ONCE)
        .set_properties({"security.protocol": "SASL_SSL", ...})
        .build()
    )
    stream.sink_to(sink, "totals")

NONE and AT_LEAST_ONCE produce each record as it comes, with an idempotent producer
(no duplicates from the client's own retries); AT_LEAST_ONCE flushes at every checkpoint
barrier and fails the checkpoint unless every record written before it is acknowledged,
so a restart from that checkpoint loses nothing (records after it are written again).
NONE flushes only when input ends.

EXACTLY_ONCE: write-ahead, then one Kafka transaction per committable
-----------------------------------------------------------------------

librdkafka cannot resume another producer's transaction, so a transaction that was open
when a process died cannot be committed by the restored subtask (Flink's ``KafkaSink``
does that through reflection into the Java client). Here nothing is sent to Kafka before
the checkpoint that covers it completes:

1. *write*: each subtask encodes its records (key, value, partition, timestamp, headers)
   into Arrow batches held in the open rayflow transaction;
2. *pre-commit* (at barrier n): the records become the committable, and with it part of
   checkpoint n's state (so the checkpoint's size grows with the records written between
   two checkpoints);
3. *commit* (checkpoint n completed): the committer produces the committable's records in
   one Kafka transaction, with ``transactional.id`` = the sink's prefix + the index of the
   subtask that wrote them (``<transactional id prefix>-<index>``, by default the job's
   and the operator's names), and commits it. The same transaction commits a *marker*:
   through ``send_offsets_to_transaction`` the offset ``sequence + 1`` of the committable
   for partition 0 of the topic in the consumer group ``<transactional.id>.<run>.committed``
   (a group nobody joins). Committables of one writer are committed in sequence order.

A Kafka transaction is open only while a commit runs (milliseconds), never across a
checkpoint interval, so ``transaction.timeout.ms`` does not bound the checkpoint interval.

Recovery: before its first commit for a transactional id, a committer calls
``init_transactions()`` (which, on Apache Kafka, fences every older producer of that id
and aborts its open transaction) and reads the marker: a committable whose sequence is
below it was committed already (ALREADY_COMMITTED: a commit repeated after a restore
produces nothing). Otherwise the records are produced and committed again.

Not relying on the broker to abort: the protocol also holds on a broker that, instead of
aborting a dead producer's open transaction, makes its records visible (the test broker,
Tansu 0.6, does: tests/unit/test_kafka_broker.py). At pre-commit, the writer puts into the
committable a lower bound of where its records can land: the end offset of each partition
then (``start_offsets``; no record of it exists before its pre-commit, and end offsets
only grow). Every record carries a header ``rf.txn`` = ``<writer>:<sequence>:<index>``.
A producer that has just called ``init_transactions()`` reads, before each commit of a
run, the topic from the committable's start offsets (with ``read_committed``, up to its
end) and produces only the records of that committable that are not visible yet: none on
Apache Kafka (the crashed transaction was aborted), the missing ones on a broker that
exposed it. It stops looking once a commit found none of its records: commits of one
writer are in order, so no later sequence was committed either. On Apache Kafka that is
the first commit (the marker covers every committed sequence, and the open transaction
was of the first one it does not cover); on the test broker the marker read can lag
behind what was committed (another producer's open transaction holds transactional
offset commits back:
``test_tansu_deviation_open_transaction_holds_back_other_producers_offset_commits``), so
the sequences after the first may have been committed too. The lower bound lives in the
checkpoint: no other attempt, and no zombie of an older one, can move it. (Format-1
committables, written before it existed, fall back to the ``<transactional.id>.<run>.intent``
group an older version wrote before producing, else to the start of each partition.) A
commit that fails half way (a timeout, a lost connection) is never aborted (an abort can
expose records on such a broker too): its producer is dropped, and the next try recovers
as above.

Stale attempts: the runtime checks the attempt's fence before each commit (and
``abort_lingering`` before it initialises an id), replaces a subtask actor that still runs
a thread of an older attempt instead of reusing it, and committers in one process take a
lock per transactional id, so an older attempt's commit finishes (or fails) before a newer
one initialises the id. What remains is a producer of an older attempt in a process that
is still alive (a node cut off from the cluster; actors of a run whose driver died,
outliving its run lock): on Apache Kafka, ``init_transactions`` of the newer producer
fences it; the test broker fenced such a producer's writes too
(``test_fenced_producer_cannot_write``). Such a committer writes nothing outside a
transaction, so being fenced stops all it could do (unit:
``test_schedule_zombie_of_an_older_attempt_retries_a_commit_a_newer_one_died_in``: an
earlier version wrote the scan's start as a plain group commit before producing, which a
fenced zombie could still move past a dead attempt's exposed records).

Failure schedules (who dies right after which step) and what recovery sees:

- before or during pre-commit, or after it but before the checkpoint completes: nothing
  was sent; the checkpoint is not complete, the restore replays the input
  (chaos: SINK_BEFORE_PRE_COMMIT, SINK_AFTER_PRE_COMMIT, AFTER_SNAPSHOT);
- after the checkpoint completed, before the commit (a lost notification, the job master
  dying before it notifies): the committable is in the restored state; the marker is below
  its sequence, the scan finds none of its records, and everything is produced (chaos:
  BEFORE_NOTIFY in every plan, JOB_MASTER_BEFORE_NOTIFY);
- after ``init_transactions``, before the first record: the scan finds nothing,
  everything is produced (unit: ``test_schedule_killed_after_init_before_any_record``);
- after some or all records were sent, before ``commit_transaction``: the restored
  committer's ``init_transactions`` ends the dead transaction (Kafka: aborted; Tansu:
  exposed), the scan finds what is visible and the rest is produced (chaos:
  SINK_INSIDE_COMMIT in every Kafka plan; unit: ``test_schedule_killed_inside_commit_...``,
  ``test_schedule_killed_after_part_of_the_records_were_sent``);
- after ``commit_transaction`` returned, before the runtime recorded it: the marker says
  committed: ALREADY_COMMITTED, nothing produced (chaos: SINK_DURING_COMMIT; unit:
  ``test_schedule_commit_repeated_after_it_succeeded``);
- after two commits of a checkpoint that held two committables (a notification that came
  after the next barrier), while another writer's open transaction held the marker back:
  the restored commits find their records, one after the other, and produce none (chaos:
  the Kafka plans, where a sink subtask dies inside a commit while the other commits;
  unit: ``test_schedule_two_committed_commits_restored_while_another_writer_held_the_marker_back``);
- between two commits of one writer, or inside the second: the first is recognised, the
  second recovered (unit: ``test_schedule_killed_between_two_commits_of_a_checkpoint``);
- a commit that must wait (RETRY_LATER) holds back the writer's later ones, which would
  otherwise move the marker past it, from its first try on, even when that try could not
  read the marker, and again after an earlier one is committed again (unit:
  ``test_commits_of_one_writer_stay_in_order``,
  ``test_a_commit_repeated_after_it_succeeded_keeps_a_later_one_waiting``); a commit its
  retry finds committed (``commit_transaction`` failed after the broker committed) no
  longer holds them back
  (``test_schedule_commit_answered_with_an_error_after_the_broker_committed_it``);
- a commit stalled while its attempt ends (its thread outlives the attempt): the next
  attempt's committer waits for the id's lock or is in another process; either the stalled
  commit completes first (the marker says so) or its producer is fenced (chaos: the stall
  drawn for attempt 3; broker: ``test_fenced_producer_cannot_write``);
- killed during recovery: recovery starts again from the same state (chaos: the ``sum``
  pipeline's DURING_RECOVER; the Kafka plans' kills in attempts 2 and 3 often land in the
  restored attempt's recovery commits).

What was verified where: the protocol, and 0 lost / 0 duplicated under seeded kills
(including between checkpoint completion and commit, and inside a commit after its
records were sent), were verified against Tansu 0.6 only. The Apache-Kafka behaviour it
uses (init_transactions aborting the older transaction, aborted records hidden from
read_committed consumers, transactional offset commits) is Kafka's documented semantics,
not tested here.

On Tansu, a produce request of a fenced producer that the broker processes while a newer
producer with the same id runs ``init_transactions`` can leave a transaction open that no
later init or commit ends, holding read_committed readers back for good
(``test_tansu_deviation_fenced_produce_racing_init_can_hold_a_topic_back``; Kafka refuses
such a request). The committer never initialises an id while a producer it dropped still
has requests in flight (``_drop`` waits for them); the last requests of a killed process
are out of its hands.

A restored commit's scan answers RETRY_LATER (and is tried again, as the sink's commit
retry policy says) when a partition stays short of the scan's end for 10 s with no
progress: held back by a transaction another producer keeps open, whatever other
partitions deliver meanwhile
(``test_a_scan_held_back_on_one_partition_ends_while_others_get_records``). A topic shared
with producers whose transactions stay open longer than the retries last fails the
attempt instead of waiting for them.

Readers must use ``isolation.level=read_committed``. The marker groups hold one committed
offset each per writer and run; they are never joined. Secrets in the settings never
appear in a repr, log line or error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rayflow.connectors.kafka.client import ClientSettings, KafkaConnectorError, client_library
from rayflow.connectors.kafka.records import KAFKA_RECORDS, RecordEncoder, RecordFormat
from rayflow.guarantees import DeliveryGuarantee, GuaranteeResolution
from rayflow.runtime.hooks import HookPoint
from rayflow.sink import (
    CommitOutcome,
    CommittableSerializer,
    Committer,
    RollingPolicy,
    SinkContext,
    TransactionWriter,
    TwoPhaseCommittingSink,
)

__all__ = [
    "KafkaSink",
    "KafkaSinkBuilder",
    "KafkaCommittable",
    "RECOVERY_HEADER",
]

log = logging.getLogger("rayflow.kafka")

#: The header every record of an EXACTLY_ONCE commit carries: ``<writer>:<sequence>:<index>``.
RECOVERY_HEADER = "rf.txn"
_TIMEOUT_S = 30.0
#: How long a recovering commit's scan may go without getting anything (records or the
#: end of a partition) before it gives up for now (RETRY_LATER): held back by an open
#: transaction. A scan that keeps getting records is never cut off.
_SCAN_TIMEOUT_S = 10.0
#: How long a pre-commit waits for the topic's end offsets (then it uses older ones).
_BOUND_TIMEOUT_S = 5.0
#: 2: committables carry ``start_offsets``; 1 (read still): without them
_FORMAT_VERSION = 2


@dataclass
class KafkaCommittable:
    """One committable: what one subtask wrote between two barriers.

    ``records`` (EXACTLY_ONCE): the encoded records (Arrow IPC stream of
    :data:`KAFKA_RECORDS`); None for AT_LEAST_ONCE and NONE, whose records were produced
    and flushed at pre-commit already.

    ``start_offsets`` (EXACTLY_ONCE): per partition of the topic, an offset at or below
    which none of these records can land, taken at pre-commit, before any of them was
    produced by anyone (end offsets only grow). A restored commit looks for records an
    earlier attempt exposed from there. Part of the checkpoint, so nothing outside it
    (no other attempt, no zombie) can move it. None in committables of format 1."""

    topic: str
    writer: int
    transactional_id: str
    run: str
    sequence: int
    checkpoint_id: int | None = None
    records: bytes | None = None
    count: int = 0
    start_offsets: dict[int, int] | None = None

    @property
    def writer_tag(self) -> str:
        """Short and unique per transactional id and run (in the recovery header)."""
        digest = hashlib.sha1(f"{self.transactional_id}\0{self.run}".encode()).hexdigest()
        return digest[:16]

    def table(self) -> pa.Table:
        if not self.records:
            return KAFKA_RECORDS.empty_table()
        return pa.ipc.open_stream(pa.py_buffer(self.records)).read_all()


class KafkaCommittableSerializer(CommittableSerializer[KafkaCommittable]):
    """A JSON header (4-byte length first), then the records' IPC bytes. Version 2 adds
    ``start_offsets`` to the header; version 1 (without it) is still read."""

    @property
    def version(self) -> int:
        return _FORMAT_VERSION

    @property
    def readable_versions(self) -> frozenset[int]:
        return frozenset({1, _FORMAT_VERSION})

    def serialize(self, committable: KafkaCommittable) -> bytes:
        head = {k: v for k, v in dataclasses.asdict(committable).items() if k != "records"}
        head["has_records"] = committable.records is not None
        raw = json.dumps(head, sort_keys=True).encode("utf-8")
        return len(raw).to_bytes(4, "big") + raw + (committable.records or b"")

    def deserialize(self, version: int, data: bytes) -> KafkaCommittable:
        size = int.from_bytes(data[:4], "big")
        head = json.loads(data[4 : 4 + size].decode("utf-8"))
        has_records = head.pop("has_records")
        starts = head.pop("start_offsets", None)
        if starts is not None:
            starts = {int(p): int(o) for p, o in starts.items()}
        return KafkaCommittable(
            **head,
            records=bytes(data[4 + size :]) if has_records else None,
            start_offsets=starts,
        )


# --- writing --------------------------------------------------------------------------------


@dataclass
class _Transaction:
    sequence: int
    batches: list[pa.RecordBatch] = field(default_factory=list)
    size: int = 0
    count: int = 0


class _KafkaWriter(TransactionWriter[_Transaction, KafkaCommittable]):
    """EXACTLY_ONCE keeps the encoded records; NONE and AT_LEAST_ONCE produce them as
    they come and flush at pre-commit."""

    def __init__(self, sink: KafkaSink, context: SinkContext) -> None:
        self.sink = sink
        self.context = context
        self.mode = sink.guarantee_in(context)
        self.label = sink._label(context.operator_name)
        self.transactional_id = sink.transactional_id(context, context.subtask_index)
        self._producer: Any = None
        self._errors: list[str] = []
        self._reader: Any = None  # a consumer for end offsets (EXACTLY_ONCE)
        self._bounds: dict[int, int] = {}  # the end offsets measured last

    def begin_transaction(self, sequence: int) -> _Transaction:
        return _Transaction(sequence)

    def write(self, transaction: _Transaction, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        records = self.sink.encoder.encode(batch, self.label)
        transaction.count += records.num_rows
        if self.mode is DeliveryGuarantee.EXACTLY_ONCE:
            transaction.batches.append(records)
            transaction.size += records.nbytes
            return
        self._produce(records)
        transaction.size += records.nbytes

    def _produce(self, records: pa.RecordBatch) -> None:
        if self._producer is None:
            self._producer = self.sink._producer(
                self.label, {"enable.idempotence": True, "linger.ms": 5}
            )
        producer, topic = self._producer, self.sink.topic
        errors = self._errors

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None and len(errors) < 10:
                errors.append(err.str())

        for i, (key, value, partition, timestamp, headers) in enumerate(_rows(records)):
            try:
                _produce_one(producer, topic, key, value, partition, timestamp, headers, delivered)
            except Exception as exc:  # noqa: BLE001 - the client refused the record
                raise KafkaConnectorError(
                    self.sink.settings.redact(
                        f"{self.label}: record {i} of a batch (partition {partition}): {exc}"
                    )
                ) from None
        producer.poll(0)

    def transaction_size(self, transaction: _Transaction) -> int:
        return transaction.size

    def is_empty(self, transaction: _Transaction) -> bool:
        return transaction.count == 0

    def pre_commit(
        self, transaction: _Transaction, checkpoint_id: int | None = None
    ) -> KafkaCommittable:
        committable = KafkaCommittable(
            topic=self.sink.topic,
            writer=self.context.subtask_index,
            transactional_id=self.transactional_id,
            run=self.context.run_id or "no-run",
            sequence=transaction.sequence,
            checkpoint_id=checkpoint_id,
            count=transaction.count,
        )
        if self.mode is DeliveryGuarantee.EXACTLY_ONCE:
            sink = io.BytesIO()
            with pa.ipc.new_stream(sink, KAFKA_RECORDS) as stream:
                for batch in transaction.batches:
                    stream.write_batch(batch)
            committable.records = sink.getvalue()
            committable.start_offsets = self._start_offsets()
            return committable
        self.flush()
        return committable

    def _start_offsets(self) -> dict[int, int]:
        """End offsets of the topic now: no record of a committable pre-committed now can
        land below them. When they cannot be read in time, those measured earlier (or
        none: 0 everywhere), which are lower bounds too, only looser."""
        try:
            if self._reader is None:
                self._reader = self.sink._consumer(
                    self.label,
                    {
                        "group.id": "rayflow-kafka-sink-reader",
                        "isolation.level": "read_uncommitted",
                    },
                )
            self._bounds = end_offsets(self._reader, self.sink.topic, _BOUND_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - an older bound is still right
            log.warning(
                "%s: end offsets of %r not read at pre-commit (%s); a recovery looks for "
                "this commit's records from earlier offsets",
                self.label,
                self.sink.topic,
                self.sink.settings.redact(str(exc)),
            )
        return dict(self._bounds)

    def flush(self) -> None:
        """Wait until every record produced so far is acknowledged; raise otherwise."""
        if self._producer is None:
            return
        left = self._producer.flush(_TIMEOUT_S)
        if left or self._errors:
            errors, self._errors = self._errors[:3], []
            raise KafkaConnectorError(
                self.sink.settings.redact(
                    f"{self.label}: {left} record(s) not acknowledged within {_TIMEOUT_S} s"
                    + (f"; delivery failed: {'; '.join(errors)}" if errors else "")
                )
            )

    def abort_transaction(self, transaction: _Transaction) -> None:
        transaction.batches.clear()

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.flush(1.0)
            except Exception:  # noqa: BLE001 - closing
                pass
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                reader.close()
            except Exception:  # noqa: BLE001 - closing
                pass


def end_offsets(consumer: Any, topic: str, timeout_s: float) -> dict[int, int]:
    """The end offset (high watermark) of each partition of ``topic``, read fresh."""
    meta = consumer.list_topics(topic, timeout=timeout_s)
    info = meta.topics.get(topic)
    if info is None or info.error is not None or not info.partitions:
        raise KafkaConnectorError(
            f"topic {topic!r}: {info.error if info is not None else 'unknown'}"
        )
    tp = client_library().TopicPartition
    return {
        p: consumer.get_watermark_offsets(tp(topic, p), timeout=timeout_s, cached=False)[1]
        for p in sorted(info.partitions)
    }


def _rows(records: pa.RecordBatch | pa.Table) -> Any:
    return zip(
        records.column("key").to_pylist(),
        records.column("value").to_pylist(),
        records.column("partition").to_pylist(),
        records.column("timestamp").to_pylist(),
        records.column("headers").to_pylist(),
    )


def _produce_one(
    producer: Any,
    topic: str,
    key: Any,
    value: Any,
    partition: Any,
    timestamp: Any,
    headers: Any,
    on_delivery: Any = None,
) -> None:
    kwargs: dict[str, Any] = {"value": value, "key": key}
    if partition is not None:
        kwargs["partition"] = partition
    if timestamp is not None:
        kwargs["timestamp"] = timestamp
    if headers:
        kwargs["headers"] = [(h["key"], h["value"]) for h in headers]
    if on_delivery is not None:
        kwargs["on_delivery"] = on_delivery
    while True:
        try:
            producer.produce(topic, **kwargs)
            return
        except BufferError:  # the client's queue is full: let it send
            producer.poll(0.05)


# --- committing -----------------------------------------------------------------------------

#: One lock per transactional id in this process: committers of different attempts that
#: share a process (a subtask actor kept for the next attempt) never interleave.
_ID_LOCKS: dict[str, threading.Lock] = {}
_ID_LOCKS_GUARD = threading.Lock()


def _id_lock(transactional_id: str) -> threading.Lock:
    with _ID_LOCKS_GUARD:
        lock = _ID_LOCKS.get(transactional_id)
        if lock is None:
            lock = _ID_LOCKS[transactional_id] = threading.Lock()
        return lock


class _Retry(Exception):
    """Not now: the committer answers RETRY_LATER with this reason."""


class _Failed(Exception):
    """Never: the committer answers FAILED with this reason."""


class _NotYet(Exception):
    """An earlier committable of the same writer is still due: RETRY_LATER, and the
    producer is fine (nothing was sent)."""


@dataclass
class _Writer:
    """A committer's producer for one transactional id, and what it knows of each run."""

    producer: Any
    #: run -> the next sequence to commit (the marker), as read or as last committed
    markers: dict[str, int] = field(default_factory=dict)
    #: runs whose next commit must first look for records an earlier producer of the id
    #: sent: every run until a commit of this producer found none of its records there
    #: (its init_transactions ended whatever transaction was open, which Tansu exposes
    #: instead of aborting; and the marker read may lag behind what was committed)
    recovering: set[str] = field(default_factory=set)


class _KafkaCommitter(Committer[KafkaCommittable]):
    def __init__(self, sink: KafkaSink, context: SinkContext | None) -> None:
        self.sink = sink
        self.context = context
        self.label = sink._label(context.operator_name if context else "")
        self._writers: dict[str, _Writer] = {}
        #: (transactional id, run) -> a sequence that did not commit yet (RETRY_LATER):
        #: later sequences of that writer and run wait for it (commits stay in order)
        self._waiting: dict[tuple[str, str], int] = {}
        #: consumers of the marker groups, kept for their group metadata
        self._marker_clients: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._client: Any = None  # a consumer for metadata and end offsets
        #: records a recovering commit found visible already, and so did not produce
        self.found_visible = 0
        #: close() came while a commit ran in another thread: release when it ends
        self._close_requested = False

    def committable_id(self, committable: KafkaCommittable) -> str:
        return (
            f"{committable.transactional_id} sequence {committable.sequence} "
            f"(checkpoint {committable.checkpoint_id}, {committable.count} records)"
        )

    # --- helpers ----------------------------------------------------------------------

    def _hook_inside_commit(self) -> None:
        hooks = self.context.hooks if self.context is not None else None
        if hooks is not None:
            hooks.at(HookPoint.SINK_INSIDE_COMMIT)

    def _consumer(self) -> Any:
        if self._client is None:
            self._client = self.sink._consumer(
                self.label,
                {"group.id": "rayflow-kafka-sink-reader", "isolation.level": "read_uncommitted"},
            )
        return self._client

    def _group_client(self, group: str, isolation: str = "read_committed") -> Any:
        return self.sink._consumer(self.label, {"group.id": group, "isolation.level": isolation})

    def _writer(self, committable: KafkaCommittable, run: str | None) -> _Writer:
        """The producer of ``committable``'s transactional id, initialised by this
        committer (which ends any transaction an earlier producer of the id left open)."""
        txn_id = committable.transactional_id
        writer = self._writers.get(txn_id)
        if writer is None:
            producer = self.sink._producer(self.label, {"transactional.id": txn_id})
            try:
                producer.init_transactions(_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - classified below
                raise self._classify(f"init_transactions of {txn_id}", exc) from None
            writer = self._writers[txn_id] = _Writer(producer)
        if run is not None and run not in writer.markers:
            writer.markers[run] = self._read_marker(committable)
            writer.recovering.add(run)
        return writer

    def _marker_client(self, c: KafkaCommittable) -> Any:
        group = _marker_group(c)
        client = self._marker_clients.get(group)
        if client is None:
            client = self._marker_clients[group] = self._group_client(group, "read_uncommitted")
        return client

    def _drop(self, txn_id: str) -> None:
        """Forget a producer that failed half way (never aborted: see the module notes).

        Records it queued are dropped; those already sent are waited for (up to
        ``_TIMEOUT_S``): the next try initialises the id with a new producer, and a
        request of the old one that the broker processes meanwhile is refused by Apache
        Kafka but can leave a transaction open for good on the test broker
        (``test_tansu_deviation_fenced_produce_racing_init_can_hold_a_topic_back``)."""
        writer = self._writers.pop(txn_id, None)
        if writer is not None:
            try:
                writer.producer.purge(in_queue=True, in_flight=False)
                writer.producer.flush(_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - fenced or failed: answered already
                pass

    def _read_marker(self, committable: KafkaCommittable) -> int:
        client = self._group_client(_marker_group(committable))
        tp = client_library().TopicPartition
        try:
            (part,) = client.committed([tp(committable.topic, 0)], timeout=_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            raise self._classify("reading the commit marker", exc) from None
        finally:
            client.close()
        if part.error is not None:
            raise _Retry(f"reading the commit marker: {part.error}")
        return max(0, part.offset)

    def _read_intent(self, committable: KafkaCommittable) -> dict[int, int] | None:
        partitions = self._partitions(committable.topic)
        client = self._group_client(_intent_group(committable), "read_uncommitted")
        tp = client_library().TopicPartition
        try:
            parts = client.committed(
                [tp(committable.topic, p) for p in partitions], timeout=_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001
            raise self._classify("reading the commit intent", exc) from None
        finally:
            client.close()
        found = {part.partition: part.offset for part in parts if part.offset >= 0}
        return found or None

    def _partitions(self, topic: str) -> list[int]:
        try:
            meta = self._consumer().list_topics(topic, timeout=_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            raise self._classify(f"metadata of {topic!r}", exc) from None
        info = meta.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            raise _Retry(f"topic {topic!r}: {info.error if info is not None else 'unknown'}")
        return sorted(info.partitions)

    def _end_offsets(self, topic: str) -> dict[int, int]:
        try:
            return end_offsets(self._consumer(), topic, _TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            raise self._classify(f"end offsets of {topic!r}", exc) from None

    def _scan_start(self, c: KafkaCommittable) -> dict[int, int]:
        """Where records of ``c`` can be, at the lowest: its own start offsets; for a
        committable of format 1, the intent an older version of this sink wrote before
        its records (0 everywhere without one)."""
        if c.start_offsets is not None:
            return c.start_offsets
        return self._read_intent(c) or {}

    def _visible(self, committable: KafkaCommittable, start: dict[int, int]) -> set[int]:
        """Indices of ``committable``'s records that read_committed consumers see,
        looking from ``start`` to the end of each partition."""
        ck = client_library()
        tp = ck.TopicPartition
        ends = self._end_offsets(committable.topic)
        todo = {p for p, end in ends.items() if end > start.get(p, 0)}
        if not todo:
            return set()
        prefix = f"{committable.writer_tag}:{committable.sequence}:".encode()
        reader = self._group_client("rayflow-kafka-sink-recovery", "read_committed")
        try:
            reader.assign([tp(committable.topic, p, start.get(p, 0)) for p in todo])
            found: set[int] = set()
            deadline = time.monotonic() + _SCAN_TIMEOUT_S
            #: partition -> (its stable end, since when the reader has stood there) while
            #: that is short of the scan's end: an open transaction holds the rest back
            held: dict[int, tuple[int, float]] = {}
            while todo:
                now = time.monotonic()
                stuck = sorted(p for p, (_, t) in held.items() if now - t > _SCAN_TIMEOUT_S)
                if now > deadline or stuck:
                    raise _Retry(
                        f"looking for records of {self.committable_id(committable)} that an "
                        f"earlier attempt produced: partitions {stuck or sorted(todo)} of "
                        f"{committable.topic!r} gave nothing for {_SCAN_TIMEOUT_S:.0f} s "
                        "short of their end (held back by an open transaction?)"
                    )
                messages = reader.consume(1000, 0.2)
                if any(msg.partition() in todo for msg in messages):
                    # progress where the scan still reads (records on partitions read to
                    # their end already say nothing of one that is held back)
                    deadline = time.monotonic() + _SCAN_TIMEOUT_S
                for msg in messages:
                    error = msg.error()
                    if error is None:
                        held.pop(msg.partition(), None)
                        for key, value in msg.headers() or ():
                            if key == RECOVERY_HEADER and value and value.startswith(prefix):
                                found.add(int(value[len(prefix) :]))
                    elif error.code() == ck.KafkaError._PARTITION_EOF:
                        if msg.offset() >= ends.get(msg.partition(), 0):
                            todo.discard(msg.partition())
                            held.pop(msg.partition(), None)
                        elif held.get(msg.partition(), (-1, 0.0))[0] < msg.offset():
                            # short of the end, at a new place (a transaction ended): from
                            # now on, nothing more for the scan timeout is no progress,
                            # whatever other partitions deliver
                            held[msg.partition()] = (msg.offset(), time.monotonic())
                    elif error.fatal():
                        raise _Retry(f"reading {committable.topic!r}: {error.str()}")
            return found
        finally:
            reader.close()

    def _classify(self, what: str, exc: BaseException) -> Exception:
        ck = client_library()
        text = self.sink.settings.redact(f"{what}: {exc}")
        error = exc.args[0] if exc.args and isinstance(exc.args[0], ck.KafkaError) else None
        if error is not None and error.code() in _PERMANENT_CODES():
            return _Failed(text)
        return _Retry(text)

    # --- the contract ----------------------------------------------------------------------

    def commit(self, committable: KafkaCommittable) -> CommitOutcome:
        if committable.records is None:
            return CommitOutcome.committed()  # produced and flushed at pre-commit
        with _id_lock(committable.transactional_id), self._lock:
            self._close_requested = False  # used again (a clean-up after close)
            try:
                return self._commit(committable)
            except _Failed as exc:
                self._drop(committable.transactional_id)
                return CommitOutcome.failed(str(exc))
            except _Retry as exc:
                self._drop(committable.transactional_id)
                return CommitOutcome.retry_later(str(exc))
            except _NotYet as exc:
                return CommitOutcome.retry_later(str(exc))
            finally:
                if self._close_requested:  # closed while this commit ran: release now
                    self._release()

    def _commit(self, c: KafkaCommittable) -> CommitOutcome:
        # The writer's lowest sequence not known to be committed holds back the later ones
        # from its first try on, whatever step of it fails (even the marker's read):
        # committed first, a later one would move the marker past it.
        ordered = (c.transactional_id, c.run)
        waiting = self._waiting.get(ordered)
        if waiting is not None and waiting < c.sequence:
            raise _NotYet(f"sequence {waiting} of {c.transactional_id} is not committed yet")
        self._waiting[ordered] = c.sequence
        writer = self._writer(c, c.run)
        marker = writer.markers[c.run]
        if c.sequence < marker:
            self._done_waiting(ordered, c.sequence, waiting)
            return CommitOutcome.already_committed(
                f"the commit marker of {c.transactional_id} says sequence {marker - 1} is committed"
            )
        table = c.table()
        skip: set[int] = set()
        if c.run in writer.recovering:
            skip = self._visible(c, self._scan_start(c))
            self.found_visible += len(skip)
            if skip:
                log.warning(
                    "%s: %d of %d records of %s are visible already (the broker exposed an "
                    "earlier attempt's transaction instead of aborting it): producing the rest",
                    self.label,
                    len(skip),
                    table.num_rows,
                    self.committable_id(c),
                )
        producer = writer.producer
        tp = client_library().TopicPartition
        try:
            producer.begin_transaction()
            errors: list[str] = []

            def delivered(err: Any, _msg: Any) -> None:
                if err is not None and len(errors) < 10:
                    errors.append(err.str())

            tag = c.writer_tag
            for index, (key, value, partition, timestamp, headers) in enumerate(_rows(table)):
                if index in skip:
                    continue
                marked = list(headers or ()) + [
                    {"key": RECOVERY_HEADER, "value": f"{tag}:{c.sequence}:{index}".encode()}
                ]
                _produce_one(producer, c.topic, key, value, partition, timestamp, marked, delivered)
            left = producer.flush(_TIMEOUT_S)
            if left or errors:
                raise _Retry(
                    f"{left} record(s) not acknowledged"
                    + (f"; delivery failed: {'; '.join(errors[:3])}" if errors else "")
                )
            self._hook_inside_commit()
            producer.send_offsets_to_transaction(
                [tp(c.topic, 0, c.sequence + 1)],
                self._marker_client(c).consumer_group_metadata(),
                _TIMEOUT_S,
            )
            producer.commit_transaction(_TIMEOUT_S)
        except (_Retry, _Failed):
            raise
        except Exception as exc:  # noqa: BLE001 - a client error: classified
            raise self._classify(f"commit of {self.committable_id(c)}", exc) from None
        writer.markers[c.run] = c.sequence + 1
        self._done_waiting(ordered, c.sequence, waiting)
        if not skip:
            # none of its records was there: no earlier producer committed it, nor (in
            # order) any later one; from here on this producer's commits are the only ones
            writer.recovering.discard(c.run)
        return CommitOutcome.committed()

    def _done_waiting(self, key: tuple[str, str], sequence: int, before: int | None) -> None:
        """``sequence`` is committed: a higher one that was waiting (RETRY_LATER) before it
        came holds the writer's later ones back again."""
        if before is not None and before > sequence:
            self._waiting[key] = before
        else:
            self._waiting.pop(key, None)

    def abort(self, committable: KafkaCommittable) -> None:
        """Nothing to do: an uncommitted committable's records were never sent."""

    def abort_lingering(self, context: SinkContext, keep: Sequence[KafkaCommittable]) -> int:
        """End whatever transaction an earlier producer of this subtask's transactional id
        left open (``init_transactions``). Returns 0: Kafka does not say whether there
        was one."""
        if self.sink.guarantee_in(context) is not DeliveryGuarantee.EXACTLY_ONCE:
            return 0
        txn_id = self.sink.transactional_id(context, context.subtask_index)
        with _id_lock(txn_id), self._lock:
            if txn_id in self._writers:
                return 0  # initialised by this committer: nothing of an earlier one is open
            context.check_fence(f"{self.label}: init_transactions of {txn_id}")
            probe = KafkaCommittable(
                topic=self.sink.topic,
                writer=context.subtask_index,
                transactional_id=txn_id,
                run=context.run_id or "no-run",
                sequence=0,
            )
            try:
                self._writer(probe, None)
            except (_Retry, _Failed) as exc:
                raise KafkaConnectorError(str(exc)) from None
        return 0

    def close(self) -> None:
        """Release the clients: now, or when a commit running in another thread (a
        recovery) ends, never under it. A later commit (a clean-up) makes new ones."""
        self._close_requested = True
        if self._lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._lock.release()

    def _release(self) -> None:
        for txn_id in list(self._writers):
            self._drop(txn_id)
        clients = [*self._marker_clients.values(), self._client]
        self._marker_clients, self._client = {}, None
        for client in clients:
            if client is None:
                continue
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass


def _marker_group(c: KafkaCommittable) -> str:
    return f"{c.transactional_id}.{c.run}.committed"


def _intent_group(c: KafkaCommittable) -> str:
    return f"{c.transactional_id}.{c.run}.intent"


def _PERMANENT_CODES() -> frozenset[int]:  # noqa: N802 - a constant made on first use
    ck = client_library()
    codes = []
    for name in (
        "TOPIC_AUTHORIZATION_FAILED",
        "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
        "GROUP_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
        "SASL_AUTHENTICATION_FAILED",
        "MSG_SIZE_TOO_LARGE",
        "_MSG_SIZE_TOO_LARGE",
        "_UNKNOWN_PARTITION",
        "_UNKNOWN_TOPIC",
        "UNKNOWN_TOPIC_OR_PART",
        "INVALID_TRANSACTION_TIMEOUT",
        "UNSUPPORTED_VERSION",
        "_INVALID_ARG",
    ):
        code = getattr(ck.KafkaError, name, None)
        if code is not None:
            codes.append(code)
    return frozenset(codes)


# --- the sink -------------------------------------------------------------------------------


class KafkaSink(TwoPhaseCommittingSink[_Transaction, KafkaCommittable]):
    """Writes a stream to one Kafka topic (see the module docstring); make one with
    :meth:`builder`."""

    #: Kafka transactions are open only while a commit runs: no limit on the interval.
    max_transaction_lifetime_s = None

    def __init__(
        self,
        settings: ClientSettings,
        topic: str,
        encoder: RecordEncoder | None = None,
        delivery_guarantee: DeliveryGuarantee | None = None,
        transactional_id_prefix: str | None = None,
        rolling_policy: RollingPolicy | None = None,
    ) -> None:
        super().__init__(delivery_guarantee, rolling_policy)
        if not settings.bootstrap_servers:
            raise ValueError("KafkaSink: bootstrap servers are required")
        if not topic:
            raise ValueError("KafkaSink: a topic is required")
        forbidden = [k for k in settings.values if k in ("transactional.id",)]
        if forbidden:
            raise ValueError(
                "KafkaSink: the sink sets transactional.id itself (per subtask); use "
                "set_transactional_id_prefix"
            )
        self.settings = settings
        self.topic = topic
        self.encoder = encoder or RecordEncoder()
        self.transactional_id_prefix = transactional_id_prefix

    @staticmethod
    def builder() -> KafkaSinkBuilder:
        return KafkaSinkBuilder()

    def _label(self, name: str = "") -> str:
        return f"KafkaSink{f' {name!r}' if name else ''} (topic {self.topic!r})"

    def __repr__(self) -> str:
        return (
            f"KafkaSink(topic {self.topic!r} on {self.settings.bootstrap_servers}, "
            f"{self.delivery_guarantee.name})"
        )

    def transactional_id(self, context: SinkContext, writer: int) -> str:
        """The transactional.id of subtask ``writer``'s commits."""
        if self.transactional_id_prefix:
            return f"{self.transactional_id_prefix}-{writer}"
        prefix = self.transaction_prefix(dataclasses.replace(context, subtask_index=writer))
        return prefix.rstrip("_")

    def _producer(self, label: str, overrides: Mapping[str, Any]) -> Any:
        ck = client_library()
        try:
            return ck.Producer(self.settings.client_config(**overrides))
        except Exception as exc:  # noqa: BLE001 - the message may quote a setting
            raise KafkaConnectorError(
                f"{label}: cannot make a producer: {self.settings.redact(str(exc))}"
            ) from None

    def _consumer(self, label: str, overrides: Mapping[str, Any]) -> Any:
        ck = client_library()
        conf = {"enable.auto.commit": False, "enable.partition.eof": True, **overrides}
        try:
            return ck.Consumer(self.settings.client_config(**conf))
        except Exception as exc:  # noqa: BLE001
            raise KafkaConnectorError(
                f"{label}: cannot make a consumer: {self.settings.redact(str(exc))}"
            ) from None

    def setup(self, job_name: str, guarantee: GuaranteeResolution | None = None) -> None:
        """The topic must exist before the job starts (checked on the driver)."""
        consumer = self._consumer(self._label(), {"group.id": f"rayflow-setup-{uuid.uuid4().hex}"})
        try:
            meta = consumer.list_topics(self.topic, timeout=_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            raise KafkaConnectorError(
                f"{self._label()}: cannot reach {self.settings.bootstrap_servers}: "
                f"{self.settings.redact(str(exc))}"
            ) from None
        finally:
            consumer.close()
        info = meta.topics.get(self.topic)
        if info is None or info.error is not None or not info.partitions:
            reason = info.error.str() if info is not None and info.error else "no partitions"
            raise KafkaConnectorError(
                f"{self._label()}: the topic does not exist or cannot be written ({reason}); "
                "create it first"
            )

    def create_transaction_writer(self, context: SinkContext) -> _KafkaWriter:
        return _KafkaWriter(self, context)

    def create_committer(self, context: SinkContext | None) -> _KafkaCommitter:
        return _KafkaCommitter(self, context)

    def committable_serializer(self) -> KafkaCommittableSerializer:
        return KafkaCommittableSerializer()


class KafkaSinkBuilder:
    """PyFlink's ``KafkaSink.builder()``, with Arrow columns instead of a record
    serialization schema."""

    def __init__(self) -> None:
        self._settings: dict[str, Any] = {}
        self._topic = ""
        self._encoder: dict[str, Any] = {}
        self._guarantee: DeliveryGuarantee | None = None
        self._prefix: str | None = None
        self._rolling: RollingPolicy | None = None

    def set_bootstrap_servers(self, servers: str) -> KafkaSinkBuilder:
        self._settings["bootstrap.servers"] = servers
        return self

    def set_topic(self, topic: str) -> KafkaSinkBuilder:
        self._topic = topic
        return self

    def set_value_column(
        self, column: str, fmt: RecordFormat | str | None = None
    ) -> KafkaSinkBuilder:
        self._encoder.update(value_column=column, value_format=fmt)
        return self

    def set_value_format(self, fmt: RecordFormat | str) -> KafkaSinkBuilder:
        self._encoder["value_format"] = fmt
        return self

    def set_key_column(
        self, column: str, fmt: RecordFormat | str | None = None
    ) -> KafkaSinkBuilder:
        self._encoder.update(key_column=column, key_format=fmt)
        return self

    def set_partition_column(self, column: str) -> KafkaSinkBuilder:
        self._encoder["partition_column"] = column
        return self

    def set_timestamp_column(self, column: str) -> KafkaSinkBuilder:
        self._encoder["timestamp_column"] = column
        return self

    def set_headers_column(self, column: str) -> KafkaSinkBuilder:
        self._encoder["headers_column"] = column
        return self

    def set_delivery_guarantee(self, guarantee: DeliveryGuarantee) -> KafkaSinkBuilder:
        self._guarantee = guarantee
        return self

    def set_transactional_id_prefix(self, prefix: str) -> KafkaSinkBuilder:
        """Transactional ids are ``<prefix>-<subtask>`` (default: made of the job's and
        the operator's names). Two jobs writing at once need different prefixes."""
        self._prefix = prefix
        return self

    def set_rolling_policy(self, policy: RollingPolicy) -> KafkaSinkBuilder:
        self._rolling = policy
        return self

    def set_property(self, key: str, value: Any) -> KafkaSinkBuilder:
        """A librdkafka setting, passed to every producer and consumer as given."""
        self._settings[key] = value
        return self

    def set_properties(self, properties: Mapping[str, Any]) -> KafkaSinkBuilder:
        self._settings.update(properties)
        return self

    def build(self) -> KafkaSink:
        return KafkaSink(
            ClientSettings(self._settings),
            self._topic,
            RecordEncoder(**self._encoder),
            self._guarantee,
            self._prefix,
            self._rolling,
        )
