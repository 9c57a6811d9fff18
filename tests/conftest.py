"""Shared fixtures: one real local Ray per test session; a throwaway PostgreSQL server
(``postgres``, session) and a fresh database on it per test (``postgres_db``), from
tests/pg_server.py; a throwaway Kafka-protocol broker (``kafka_broker``, session) and a
fresh topic on it per test (``kafka_topic``), from tests/kafka_broker.py; rayflow's C
loop (``speedups``)."""

from __future__ import annotations

import os
import warnings
import weakref

import pytest

from tests.kafka_broker import kafka_broker, kafka_topic  # noqa: F401 - fixtures
from tests.pg_server import postgres, postgres_db  # noqa: F401 - fixtures

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

#: set (CI sets it): a rayflow without its C loop fails the tests of that loop, not skips
REQUIRE_SPEEDUPS_ENV = "RAYFLOW_REQUIRE_SPEEDUPS"


@pytest.fixture(scope="session")
def speedups():
    """The C module :mod:`rayflow.runtime._speedups` (built by ``pip install``)."""
    try:
        from rayflow.runtime import _speedups
    except ImportError as exc:
        if os.environ.get(REQUIRE_SPEEDUPS_ENV):
            pytest.fail(
                f"rayflow.runtime._speedups was not built ({exc}); {REQUIRE_SPEEDUPS_ENV} is set"
            )
        pytest.skip(f"rayflow.runtime._speedups was not built: {exc}")
    return _speedups


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(monkeypatch):
    """A job the test started and left running (it failed or timed out before it ended
    the job) is cancelled when the test ends: owned by this worker process, it would
    otherwise run on, and restart on, through every later test of the worker."""
    from rayflow.environment import JobClient

    # Held weakly: a client holds its job's graph and sinks, which a test may wait to see
    # collected. The client of a test that failed is held by its traceback until here.
    clients: weakref.WeakValueDictionary[int, JobClient] = weakref.WeakValueDictionary()
    start_master = JobClient._start_master

    def recording(client: JobClient) -> None:
        clients[id(client)] = client
        start_master(client)

    monkeypatch.setattr(JobClient, "_start_master", recording)
    yield
    for client in list(clients.values()):
        _end(client)


def _end(client) -> None:
    """Cancel ``client``'s job unless it has ended; its job master is killed when the
    cancel does not end it."""
    import ray

    if not ray.is_initialized():
        return  # its Ray was shut down, and the job with it (ray.kill would start one)
    try:
        if client.get_job_status(timeout=10).is_terminal:
            return
        warnings.warn(f"the test left job {client.job_name!r} running: cancelled", stacklevel=1)
        client.cancel(timeout=60)
    except Exception:  # noqa: BLE001 - cancelled or not, nothing of it may run on
        try:
            ray.kill(client._master)
        except Exception:  # noqa: BLE001 - gone already
            pass


#: Settings of Ray's own daemons for the local Ray each test process starts. Its log
#: monitor lists the log directory every 0.1 s while it has fewer than 1000 files (each
#: worker process adds its own: thousands by the end of the suite); its reporter agent
#: reads every worker process's stats, and its dashboard process its own, every 5 s.
#: With three test processes on two cores, each with its own Ray, they took a tenth or
#: more of the suite's CPU. None of it is under test: the log monitor now lists the
#: directory every 2 s (worker logs still reach the driver), the others read every
#: minute. Set only while ``ray.init`` starts them: a Ray that a test starts in a
#: subprocess of its own keeps Ray's defaults.
RAY_DAEMON_SETTINGS = {
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "METRICS_RECORD_INTERVAL_S": "60",
}


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        with pytest.MonkeyPatch.context() as env:
            for name, value in RAY_DAEMON_SETTINGS.items():
                env.setenv(name, value)
            ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
