"""The Kafka source: partitions are splits, offsets live in checkpoints.

Built like PyFlink's ``KafkaSource.builder()``::

    source = (
        KafkaSource.builder()
        .set_bootstrap_servers("broker:9092")
        .set_topics("orders")                      # or .set_topic_pattern("orders-.*")
        .set_starting_offsets(KafkaOffsetsInitializer.earliest())
        .set_bounded(KafkaOffsetsInitializer.latest())   # stop at the end as of job start
        .set_value_format("json")                  # bytes (default), utf-8, json
        .set_properties({"security.protocol": "SASL_SSL", ...})
        .build()
    )
    env.from_source(source, "orders")

Each topic partition is one :class:`KafkaSplit` carrying its next offset (and, bounded,
its stop offset). When a job starts, the source lists the partitions (topics or a
pattern) and resolves the starting (and stopping) offsets to concrete numbers once; the
splits are dealt to the source's subtasks, and a restore at another parallelism deals the
saved splits again. Each subtask reads its partitions with one consumer using
``assign()`` at the split's offsets: no consumer group decides anything, and a
checkpoint stores exactly the offsets after the last record each subtask emitted before
its barrier. With a group id, the offsets of each completed checkpoint are also committed
to that group (for monitoring tools only; ``set_commit_offsets_on_checkpoint(False)``
turns it off); they are never read back, except by
``KafkaOffsetsInitializer.committed_offsets()`` when a new job starts.

Batches have the columns ``key``, ``value`` (per the key and value formats), ``topic``,
``partition``, ``offset``, ``timestamp`` (ms; null where the broker gives none) and
``headers`` (a list of key/value structs; null when a record has none).

The consumer reads with ``isolation.level=read_committed`` unless the settings say
otherwise: records of open or aborted transactions are not read. Settings (SASL, TLS,
...) go to the client as given; secret values never appear in a repr, log line or error.
New partitions of a topic are not picked up while a job runs (restart the job: a
restore keeps the saved partitions and adds none).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rayflow.connectors.kafka.client import ClientSettings, KafkaConnectorError, client_library
from rayflow.connectors.kafka.offsets import KafkaOffsetsInitializer
from rayflow.connectors.kafka.records import (
    RecordFormat,
    decode_column,
    headers_column,
)
from rayflow.sources import Source, SourceReader, SourceSplit

__all__ = ["KafkaSource", "KafkaSourceBuilder", "KafkaSplit"]

log = logging.getLogger("rayflow.kafka")

#: Records per batch unless set (``set_batch_size``).
DEFAULT_BATCH_SIZE = 10_000
#: The consumer's group id when none is set: never joined, never committed to.
_READ_ONLY_GROUP = "rayflow-kafka-source"
_METADATA_TIMEOUT_S = 30.0
#: An empty batch: nothing to read now (the subtask waits a little and asks again).
_NOTHING_YET = pa.RecordBatch.from_pylist([])


@dataclass
class KafkaSplit(SourceSplit):
    """One topic partition and the offset of the next record to read (``stop_offset``:
    the first offset not to read, for a bounded source; None: unbounded)."""

    topic: str = ""
    partition: int = 0
    next_offset: int = 0
    stop_offset: int | None = None

    @property
    def finished(self) -> bool:
        return self.stop_offset is not None and self.next_offset >= self.stop_offset


def split_id(topic: str, partition: int) -> str:
    """Sorts by topic, then partition number (a restore deals splits in id order)."""
    return f"{topic}:{partition:06d}"


class KafkaSource(Source):
    """Reads Kafka topics (see the module docstring); make one with :meth:`builder`."""

    def __init__(
        self,
        settings: ClientSettings,
        topics: list[str] | None = None,
        topic_pattern: str | None = None,
        partitions: list[tuple[str, int]] | None = None,
        group_id: str | None = None,
        starting_offsets: KafkaOffsetsInitializer | None = None,
        stopping_offsets: KafkaOffsetsInitializer | None = None,
        key_format: RecordFormat | str = RecordFormat.BYTES,
        value_format: RecordFormat | str = RecordFormat.BYTES,
        key_type: pa.DataType | None = None,
        value_type: pa.DataType | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        commit_offsets_on_checkpoint: bool | None = None,
    ) -> None:
        chosen = sum(x is not None for x in (topics, topic_pattern, partitions))
        if chosen != 1:
            raise ValueError(
                "KafkaSource: give exactly one of topics, a topic pattern or partitions"
            )
        if not settings.bootstrap_servers:
            raise ValueError("KafkaSource: bootstrap servers are required")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"KafkaSource: batch_size must be a positive int, got {batch_size!r}")
        if topic_pattern is not None:
            re.compile(topic_pattern)
        self.settings = settings
        self.topics = list(topics) if topics is not None else None
        self.topic_pattern = topic_pattern
        self.partitions = [(str(t), int(p)) for t, p in partitions] if partitions else None
        self.group_id = group_id
        self.starting_offsets = starting_offsets or KafkaOffsetsInitializer.earliest()
        self.stopping_offsets = stopping_offsets
        self.key_format = RecordFormat.of(key_format, "KafkaSource key")
        self.value_format = RecordFormat.of(value_format, "KafkaSource value")
        self.key_type = key_type
        self.value_type = value_type
        self.batch_size = batch_size
        if commit_offsets_on_checkpoint is None:
            commit_offsets_on_checkpoint = group_id is not None
        if commit_offsets_on_checkpoint and group_id is None:
            raise ValueError("KafkaSource: committing offsets on checkpoints needs a group id")
        self.commit_offsets_on_checkpoint = commit_offsets_on_checkpoint

    @staticmethod
    def builder() -> KafkaSourceBuilder:
        return KafkaSourceBuilder()

    @property
    def bounded(self) -> bool:
        return self.stopping_offsets is not None

    def describe(self) -> str:
        what = (
            f"topics {', '.join(self.topics)}"
            if self.topics is not None
            else f"pattern {self.topic_pattern!r}"
            if self.topic_pattern is not None
            else f"{len(self.partitions or [])} partitions"
        )
        end = f", bounded at {self.stopping_offsets.describe()}" if self.bounded else ""
        return (
            f"KafkaSource({what} on {self.settings.bootstrap_servers}, from "
            f"{self.starting_offsets.describe()}{end})"
        )

    def __repr__(self) -> str:
        return self.describe()

    def consumer_config(self, **overrides: Any) -> dict[str, Any]:
        """The consumer's settings: defaults, then the source's settings, then what the
        source needs (no automatic commits or offset stores, end-of-partition events)."""
        conf: dict[str, Any] = {
            "group.id": self.group_id or _READ_ONLY_GROUP,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            # keep fetching ahead until the byte bound (queued.max.messages.kbytes, 64 MiB
            # by default) rather than pausing at librdkafka's 100,000 queued messages: about
            # twice the read rate here (benchmarks/RESULTS.md)
            "queued.min.messages": 1_000_000,
        }
        conf.update(self.settings.values)
        if self.group_id is not None:
            conf["group.id"] = self.group_id
        conf.update(
            {
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
            }
        )
        conf.update(overrides)
        return conf

    def _consumer(self, **overrides: Any) -> Any:
        ck = client_library()
        try:
            return ck.Consumer(self.consumer_config(**overrides))
        except Exception as exc:  # noqa: BLE001 - the message may quote a setting
            raise KafkaConnectorError(
                f"{self.describe()}: cannot make a consumer: {self.settings.redact(str(exc))}"
            ) from None

    # --- splits -------------------------------------------------------------------------

    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        consumer = self._consumer()
        try:
            partitions = self._list_partitions(consumer)
            starts = self.starting_offsets.resolve(
                consumer, partitions, self.group_id, self.describe()
            )
            stops = (
                self.stopping_offsets.resolve(consumer, partitions, self.group_id, self.describe())
                if self.stopping_offsets is not None
                else {}
            )
        except KafkaConnectorError:
            raise
        except Exception as exc:  # noqa: BLE001 - a client error: name the source
            raise KafkaConnectorError(
                f"{self.describe()}: {self.settings.redact(str(exc))}"
            ) from None
        finally:
            consumer.close()
        splits = []
        for topic, partition in partitions:
            start = starts[(topic, partition)]
            stop = stops.get((topic, partition)) if stops else None
            if stop is not None and stop < start:
                stop = start  # nothing to read
            splits.append(
                KafkaSplit(
                    split_id=split_id(topic, partition),
                    topic=topic,
                    partition=partition,
                    next_offset=start,
                    stop_offset=stop,
                )
            )
        log.info(
            "%s: %d partitions, from %s",
            self.describe(),
            len(splits),
            {s.split_id: s.next_offset for s in splits[:8]},
        )
        return splits

    def _list_partitions(self, consumer: Any) -> list[tuple[str, int]]:
        if self.partitions is not None:
            return sorted(set(self.partitions))
        if self.topics is not None:
            found = []
            for topic in self.topics:
                meta = consumer.list_topics(topic, timeout=_METADATA_TIMEOUT_S)
                info = meta.topics.get(topic)
                if info is None or info.error is not None or not info.partitions:
                    reason = (
                        info.error.str() if info is not None and info.error else "no partitions"
                    )
                    raise KafkaConnectorError(f"{self.describe()}: topic {topic!r}: {reason}")
                found += [(topic, p) for p in info.partitions]
            return sorted(set(found))
        pattern = re.compile(self.topic_pattern or "")
        meta = consumer.list_topics(timeout=_METADATA_TIMEOUT_S)
        found = [
            (topic, p)
            for topic, info in meta.topics.items()
            if pattern.fullmatch(topic) and info.error is None
            for p in info.partitions
        ]
        if not found:
            raise KafkaConnectorError(f"{self.describe()}: no topic matches the pattern")
        return sorted(found)

    def create_reader(self, splits: list[SourceSplit]) -> SourceReader:
        return KafkaSourceReader(self, [dataclasses.replace(s) for s in splits])


class KafkaSourceReader(SourceReader):
    """One subtask's partitions, read by one ``assign()`` consumer."""

    def __init__(self, source: KafkaSource, splits: list[KafkaSplit]) -> None:
        self.source = source
        self.splits = {(s.topic, s.partition): s for s in splits}
        self._consumer: Any = None
        self._tp = client_library().TopicPartition
        self._checkpoints: dict[int, dict[tuple[str, int], int]] = {}
        self._logged_errors = 0

    def _open(self) -> Any:
        if self._consumer is None:
            self._consumer = self.source._consumer()
            todo = [s for s in self.splits.values() if not s.finished]
            if todo:
                self._consumer.assign([self._tp(s.topic, s.partition, s.next_offset) for s in todo])
        return self._consumer

    def _done(self) -> bool:
        return (
            bool(self.splits)
            and all(s.finished for s in self.splits.values())
            or (not self.splits and self.source.bounded)
        )

    def read_batch(self) -> pa.RecordBatch | None:
        if self._done():
            return None
        if not self.splits:  # an unbounded source with more subtasks than partitions
            return _NOTHING_YET
        consumer = self._open()
        try:
            messages = consumer.consume(self.source.batch_size, 0)
        except Exception as exc:  # noqa: BLE001 - fatal client errors
            raise KafkaConnectorError(
                f"{self.source.describe()}: {self.source.settings.redact(str(exc))}"
            ) from None
        taken: list[Any] = []
        finished_now: list[KafkaSplit] = []
        current: tuple[str, int] | None = None
        split: KafkaSplit | None = None
        stop: int | None = None
        for msg in messages:
            error = msg.error()
            if error is not None:
                self._on_error(error, self.splits.get((msg.topic(), msg.partition())), msg)
                current = None  # the error may have moved the split on
                continue
            where = (msg.topic(), msg.partition())
            if where != current:  # messages come in runs of one partition
                current, split = where, self.splits.get(where)
                stop = split.stop_offset if split is not None else None
            if split is None or (stop is not None and split.next_offset >= stop):
                continue
            offset = msg.offset()
            if stop is not None and offset >= stop:
                split.next_offset = stop
                finished_now.append(split)
                continue
            taken.append(msg)
            split.next_offset = offset + 1
            if stop is not None and offset + 1 >= stop:
                finished_now.append(split)
        if finished_now:
            consumer.pause([self._tp(s.topic, s.partition) for s in finished_now])
        if not taken:
            return None if self._done() else _NOTHING_YET
        return self._batch(taken)

    def _on_error(self, error: Any, split: KafkaSplit | None, msg: Any) -> None:
        ck = client_library()
        if error.code() == ck.KafkaError._PARTITION_EOF:
            # The end the consumer could read to (past commit markers and aborted
            # records, which are never delivered): everything before it is read.
            if split is not None and msg.offset() is not None and msg.offset() > split.next_offset:
                split.next_offset = (
                    msg.offset()
                    if split.stop_offset is None
                    else min(msg.offset(), split.stop_offset)
                )
                if split.finished:
                    self._consumer.pause([self._tp(split.topic, split.partition)])
            return
        text = self.source.settings.redact(error.str())
        if error.fatal() or error.code() in (
            ck.KafkaError._AUTO_OFFSET_RESET,
            ck.KafkaError.TOPIC_AUTHORIZATION_FAILED,
            ck.KafkaError.SASL_AUTHENTICATION_FAILED,
            ck.KafkaError._AUTHENTICATION,
        ):
            where = f" {split.topic}[{split.partition}]" if split is not None else ""
            raise KafkaConnectorError(f"{self.source.describe()}{where}: {text}")
        if self._logged_errors < 20:  # transient: the client retries by itself
            self._logged_errors += 1
            log.warning("%s: %s", self.source.describe(), text)

    def _batch(self, messages: list[Any]) -> pa.RecordBatch:
        source = self.source
        topics = [m.topic() for m in messages]
        partitions = [m.partition() for m in messages]
        offsets = [m.offset() for m in messages]

        def where(i: int) -> str:
            return f"{source.describe()}: record {topics[i]}[{partitions[i]}]@{offsets[i]}"

        stamps = [m.timestamp() for m in messages]
        return pa.RecordBatch.from_arrays(
            [
                decode_column(
                    [m.key() for m in messages], source.key_format, source.key_type, where
                ),
                decode_column(
                    [m.value() for m in messages], source.value_format, source.value_type, where
                ),
                pa.array(topics, pa.string()),
                pa.array(partitions, pa.int32()),
                pa.array(offsets, pa.int64()),
                pa.array([ts if kind else None for kind, ts in stamps], pa.int64()).cast(
                    pa.timestamp("ms")
                ),
                headers_column([m.headers() for m in messages]),
            ],
            names=["key", "value", "topic", "partition", "offset", "timestamp", "headers"],
        )

    def snapshot_splits(self) -> list[SourceSplit]:
        return [dataclasses.replace(s) for s in self.splits.values()]

    def snapshot_state(self, checkpoint_id: int) -> list[SourceSplit]:
        splits = self.snapshot_splits()
        if self.source.commit_offsets_on_checkpoint:
            self._checkpoints[checkpoint_id] = {
                (s.topic, s.partition): s.next_offset for s in splits
            }
        return splits

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Commit the completed checkpoint's offsets to the group (monitoring only)."""
        offsets = self._checkpoints.pop(checkpoint_id, None)
        for older in [c for c in self._checkpoints if c < checkpoint_id]:
            del self._checkpoints[older]
        if not offsets or self._consumer is None:
            return
        try:
            self._consumer.commit(
                offsets=[self._tp(t, p, o) for (t, p), o in offsets.items()], asynchronous=True
            )
        except Exception as exc:  # noqa: BLE001 - monitoring only: never fails the job
            log.warning(
                "%s: committing the offsets of checkpoint %d to group %r: %s",
                self.source.describe(),
                checkpoint_id,
                self.source.group_id,
                self.source.settings.redact(str(exc)),
            )

    def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close()
            except Exception:  # noqa: BLE001 - closing a failed client
                pass


class KafkaSourceBuilder:
    """PyFlink's ``KafkaSource.builder()``: set what you need, then :meth:`build`."""

    def __init__(self) -> None:
        self._settings: dict[str, Any] = {}
        self._topics: list[str] | None = None
        self._pattern: str | None = None
        self._partitions: list[tuple[str, int]] | None = None
        self._group_id: str | None = None
        self._starting: KafkaOffsetsInitializer | None = None
        self._stopping: KafkaOffsetsInitializer | None = None
        self._key_format: RecordFormat | str = RecordFormat.BYTES
        self._value_format: RecordFormat | str = RecordFormat.BYTES
        self._key_type: pa.DataType | None = None
        self._value_type: pa.DataType | None = None
        self._batch_size = DEFAULT_BATCH_SIZE
        self._commit: bool | None = None

    def set_bootstrap_servers(self, servers: str) -> KafkaSourceBuilder:
        self._settings["bootstrap.servers"] = servers
        return self

    def set_topics(self, *topics: str | Iterable[str]) -> KafkaSourceBuilder:
        names: list[str] = []
        for t in topics:
            names += [t] if isinstance(t, str) else list(t)
        if not names:
            raise ValueError("KafkaSource: set_topics needs at least one topic")
        self._topics = names
        return self

    def set_topic_pattern(self, pattern: str) -> KafkaSourceBuilder:
        """Every topic whose whole name matches the regular expression (at job start)."""
        self._pattern = pattern
        return self

    def set_partitions(self, partitions: Iterable[tuple[str, int]]) -> KafkaSourceBuilder:
        self._partitions = list(partitions)
        return self

    def set_group_id(self, group_id: str) -> KafkaSourceBuilder:
        self._group_id = group_id
        return self

    def set_starting_offsets(self, offsets: KafkaOffsetsInitializer) -> KafkaSourceBuilder:
        self._starting = offsets
        return self

    def set_bounded(self, stopping: KafkaOffsetsInitializer) -> KafkaSourceBuilder:
        """Stop at these offsets, resolved when the job starts (``latest()``: the end of
        each partition then): the job finishes once every partition got there."""
        self._stopping = stopping
        return self

    def set_unbounded(self) -> KafkaSourceBuilder:
        self._stopping = None
        return self

    def set_key_format(
        self, fmt: RecordFormat | str, json_type: pa.DataType | None = None
    ) -> KafkaSourceBuilder:
        self._key_format, self._key_type = fmt, json_type
        return self

    def set_value_format(
        self, fmt: RecordFormat | str, json_type: pa.DataType | None = None
    ) -> KafkaSourceBuilder:
        """``bytes``, ``utf-8`` or ``json`` (a struct column; ``json_type`` fixes its
        fields, else they are inferred per batch)."""
        self._value_format, self._value_type = fmt, json_type
        return self

    def set_value_only_deserializer(self, fmt: RecordFormat | str) -> KafkaSourceBuilder:
        return self.set_value_format(fmt)

    def set_property(self, key: str, value: Any) -> KafkaSourceBuilder:
        """A librdkafka setting, passed to the consumer as given."""
        self._settings[key] = value
        return self

    def set_properties(self, properties: Mapping[str, Any]) -> KafkaSourceBuilder:
        self._settings.update(properties)
        return self

    def set_client_id_prefix(self, prefix: str) -> KafkaSourceBuilder:
        self._settings["client.id"] = prefix
        return self

    def set_batch_size(self, records: int) -> KafkaSourceBuilder:
        self._batch_size = records
        return self

    def set_commit_offsets_on_checkpoint(self, commit: bool) -> KafkaSourceBuilder:
        self._commit = commit
        return self

    def build(self) -> KafkaSource:
        return KafkaSource(
            ClientSettings(self._settings),
            topics=self._topics,
            topic_pattern=self._pattern,
            partitions=self._partitions,
            group_id=self._group_id,
            starting_offsets=self._starting,
            stopping_offsets=self._stopping,
            key_format=self._key_format,
            value_format=self._value_format,
            key_type=self._key_type,
            value_type=self._value_type,
            batch_size=self._batch_size,
            commit_offsets_on_checkpoint=self._commit,
        )
