"""The Kafka broker of the tests: a Tansu broker (``rayflow.demo.kafkabroker``) per
test session (the ``kafka_broker`` fixture, registered in tests/conftest.py);
``kafka_topic`` gives each test a fresh topic of its own.

Tansu differs from Apache Kafka in its transaction semantics; tests/unit/
test_kafka_broker.py pins each difference, and the Kafka sink's docs say what that
means for what was verified here.

Where the binary is missing or cannot run, tests that need it are skipped with the
reason, unless ``RAYFLOW_REQUIRE_KAFKA=1`` (CI sets it): then they fail, so a CI machine
without the broker is never mistaken for a green run. ``RAYFLOW_TANSU_BIN`` names
another ``tansu`` binary. ``start_broker()`` serves scripts (chaos runners,
benchmarks) outside pytest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from rayflow.demo.kafkabroker import (
    BIN_ENV,
    KafkaBroker,
    KafkaUnavailable,
    find_binary,
    launch_broker,
    start_broker,
    stop_broker,
)

__all__ = [
    "KafkaBroker",
    "KafkaUnavailable",
    "REQUIRE_ENV",
    "BIN_ENV",
    "find_binary",
    "start_broker",
    "kafka_broker",
    "kafka_topic",
]

#: Set to 1 to make a missing broker a test failure instead of a skip (CI does).
REQUIRE_ENV = "RAYFLOW_REQUIRE_KAFKA"

_launch = launch_broker  # a broker of a test's own


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"a Kafka broker is required here ({REQUIRE_ENV}=1): {reason}", pytrace=False)
    pytest.skip(f"no Kafka broker: {reason}")


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """A throwaway Tansu broker on 127.0.0.1 (see the module docstring)."""
    try:
        broker = start_broker()
    except KafkaUnavailable as exc:
        _unavailable(str(exc))
    yield broker
    stop_broker(broker)


@pytest.fixture
def kafka_topic(kafka_broker: KafkaBroker) -> str:
    """A fresh topic with 2 partitions on the test broker."""
    return kafka_broker.create_topic(partitions=2)
