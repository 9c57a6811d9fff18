"""Shared fixtures: one real local Ray per test session; a throwaway PostgreSQL server
(``postgres``, session) and a fresh database on it per test (``postgres_db``), from
tests/pg_server.py; a throwaway Kafka-protocol broker (``kafka_broker``, session) and a
fresh topic on it per test (``kafka_topic``), from tests/kafka_broker.py."""

from __future__ import annotations

import os

import pytest

from tests.kafka_broker import kafka_broker, kafka_topic  # noqa: F401 - fixtures
from tests.pg_server import postgres, postgres_db  # noqa: F401 - fixtures

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
