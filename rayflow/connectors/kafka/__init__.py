"""Kafka connectors (the ``kafka`` extra: confluent-kafka).

- :class:`KafkaSource`: partitions are splits, offsets live in checkpoints
  (:mod:`rayflow.connectors.kafka.source`);
- :class:`KafkaSink`: NONE, AT_LEAST_ONCE and EXACTLY_ONCE
  (:mod:`rayflow.connectors.kafka.sink`, where the exactly-once protocol is described).

Client settings (SASL, TLS, ...) are librdkafka's, passed through as given; secret
values never appear in a repr, log line or error message.
"""

from rayflow.connectors.kafka.client import ClientSettings, KafkaConnectorError
from rayflow.connectors.kafka.offsets import KafkaOffsetResetStrategy, KafkaOffsetsInitializer
from rayflow.connectors.kafka.records import RecordEncoder, RecordFormat
from rayflow.connectors.kafka.sink import (
    RECOVERY_HEADER,
    KafkaCommittable,
    KafkaSink,
    KafkaSinkBuilder,
)
from rayflow.connectors.kafka.source import KafkaSource, KafkaSourceBuilder, KafkaSplit

__all__ = [
    "ClientSettings",
    "KafkaConnectorError",
    "KafkaOffsetResetStrategy",
    "KafkaOffsetsInitializer",
    "KafkaCommittable",
    "KafkaSink",
    "KafkaSinkBuilder",
    "KafkaSource",
    "KafkaSourceBuilder",
    "KafkaSplit",
    "RECOVERY_HEADER",
    "RecordEncoder",
    "RecordFormat",
]
