"""The Kafka sink, next to the other sinks (it lives in :mod:`rayflow.connectors.kafka`,
with the Kafka source; the ``kafka`` extra installs its client library)."""

from rayflow.connectors.kafka import KafkaSink, KafkaSinkBuilder

__all__ = ["KafkaSink", "KafkaSinkBuilder"]
