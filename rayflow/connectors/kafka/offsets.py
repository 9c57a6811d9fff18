"""Where a Kafka source starts and (bounded) stops: offsets initializers, after PyFlink's
``KafkaOffsetsInitializer``, resolved to concrete offsets when a job starts.

A source resolves them once per run (see ``KafkaSource.create_splits``), so every
subtask, and every restart before the first checkpoint, reads from the same offsets.
"Latest" is the partition's end as the source's consumer sees it: the last stable offset
for ``isolation.level=read_committed`` (the default), the high watermark otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KafkaOffsetsInitializer", "KafkaOffsetResetStrategy", "OffsetSpec"]


class KafkaOffsetResetStrategy(enum.Enum):
    """For ``committed_offsets``: where a partition without a committed offset starts."""

    EARLIEST = "earliest"
    LATEST = "latest"
    #: no committed offset is an error
    NONE = "none"


class OffsetSpec(enum.Enum):
    EARLIEST = "earliest"
    LATEST = "latest"
    COMMITTED = "committed"
    TIMESTAMP = "timestamp"
    SPECIFIC = "specific"


@dataclass(frozen=True)
class KafkaOffsetsInitializer:
    """Which offset of each partition: earliest, latest, the group's committed one, the
    first at or after a timestamp, or given per partition."""

    spec: OffsetSpec
    reset: KafkaOffsetResetStrategy = KafkaOffsetResetStrategy.EARLIEST
    timestamp_ms: int | None = None
    #: (topic, partition) -> offset, for ``offsets()``
    specific: Mapping[tuple[str, int], int] = field(default_factory=dict)

    @classmethod
    def earliest(cls) -> KafkaOffsetsInitializer:
        return cls(OffsetSpec.EARLIEST)

    @classmethod
    def latest(cls) -> KafkaOffsetsInitializer:
        return cls(OffsetSpec.LATEST)

    @classmethod
    def committed_offsets(
        cls, reset: KafkaOffsetResetStrategy = KafkaOffsetResetStrategy.NONE
    ) -> KafkaOffsetsInitializer:
        """The source's group's committed offsets (``set_group_id`` is required);
        ``reset`` for partitions without one."""
        return cls(OffsetSpec.COMMITTED, reset=KafkaOffsetResetStrategy(reset))

    @classmethod
    def timestamp(cls, timestamp_ms: int) -> KafkaOffsetsInitializer:
        """The first record whose timestamp is at or after ``timestamp_ms`` (the end of
        the partition where there is none)."""
        if isinstance(timestamp_ms, bool) or not isinstance(timestamp_ms, int):
            raise TypeError(
                f"timestamp_ms must be an int (ms since the epoch), got {timestamp_ms!r}"
            )
        return cls(OffsetSpec.TIMESTAMP, timestamp_ms=timestamp_ms)

    @classmethod
    def offsets(
        cls,
        offsets: Mapping[tuple[str, int], int],
        reset: KafkaOffsetResetStrategy = KafkaOffsetResetStrategy.EARLIEST,
    ) -> KafkaOffsetsInitializer:
        """``{(topic, partition): offset}``; partitions not named start at ``reset``."""
        clean = {}
        for key, offset in dict(offsets).items():
            topic, partition = key
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"offset of {topic}[{partition}] must be an int >= 0: {offset!r}")
            clean[(str(topic), int(partition))] = offset
        return cls(OffsetSpec.SPECIFIC, reset=KafkaOffsetResetStrategy(reset), specific=clean)

    def describe(self) -> str:
        if self.spec is OffsetSpec.TIMESTAMP:
            return f"timestamp {self.timestamp_ms}"
        if self.spec is OffsetSpec.COMMITTED:
            return f"committed (else {self.reset.value})"
        if self.spec is OffsetSpec.SPECIFIC:
            return f"{len(self.specific)} given offsets (else {self.reset.value})"
        return self.spec.value

    def resolve(
        self,
        consumer: Any,
        partitions: list[tuple[str, int]],
        group_id: str | None,
        what: str,
        timeout_s: float = 30.0,
    ) -> dict[tuple[str, int], int]:
        """Concrete offsets of ``partitions`` through ``consumer`` (a confluent_kafka
        Consumer with the source's settings). ``what`` names the source in errors."""
        from rayflow.connectors.kafka.client import KafkaConnectorError, client_library

        tp = client_library().TopicPartition
        spec = self.spec
        if spec is OffsetSpec.EARLIEST:
            return {p: _watermarks(consumer, tp, p, timeout_s)[0] for p in partitions}
        if spec is OffsetSpec.LATEST:
            return {p: _watermarks(consumer, tp, p, timeout_s)[1] for p in partitions}
        if spec is OffsetSpec.TIMESTAMP:
            found = consumer.offsets_for_times(
                [tp(t, p, self.timestamp_ms) for t, p in partitions], timeout=timeout_s
            )
            result = {}
            for part in found:
                key = (part.topic, part.partition)
                if part.error is not None:
                    raise KafkaConnectorError(f"{what}: offsets for times of {key}: {part.error}")
                # -1: no record at or after the timestamp: the end of the partition
                offset = part.offset
                result[key] = (
                    offset if offset >= 0 else _watermarks(consumer, tp, key, timeout_s)[1]
                )
            return result
        if spec is OffsetSpec.SPECIFIC:
            given = {p: self.specific[p] for p in partitions if p in self.specific}
            rest = [p for p in partitions if p not in given]
            given.update(self._reset(consumer, tp, rest, what, timeout_s))
            return given
        # committed
        if not group_id:
            raise KafkaConnectorError(
                f"{what}: starting from committed offsets needs a group id (set_group_id)"
            )
        committed = consumer.committed([tp(t, p) for t, p in partitions], timeout=timeout_s)
        result, missing = {}, []
        for part in committed:
            key = (part.topic, part.partition)
            if part.error is not None:
                raise KafkaConnectorError(
                    f"{what}: committed offset of {key} in group {group_id!r}: {part.error}"
                )
            if part.offset >= 0:
                result[key] = part.offset
            else:
                missing.append(key)
        if missing and self.reset is KafkaOffsetResetStrategy.NONE:
            raise KafkaConnectorError(
                f"{what}: group {group_id!r} has no committed offset for "
                f"{', '.join(f'{t}[{p}]' for t, p in missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} (reset strategy NONE)"
            )
        result.update(self._reset(consumer, tp, missing, what, timeout_s))
        return result

    def _reset(
        self,
        consumer: Any,
        tp: Any,
        partitions: list[tuple[str, int]],
        what: str,
        timeout_s: float,
    ) -> dict[tuple[str, int], int]:
        side = 1 if self.reset is KafkaOffsetResetStrategy.LATEST else 0
        return {p: _watermarks(consumer, tp, p, timeout_s)[side] for p in partitions}


def _watermarks(consumer: Any, tp: Any, key: tuple[str, int], timeout_s: float) -> tuple[int, int]:
    low, high = consumer.get_watermark_offsets(tp(*key), timeout=timeout_s, cached=False)
    return int(low), int(high)
