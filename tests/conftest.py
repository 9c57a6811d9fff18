"""Shared fixtures: one real local Ray per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
