"""A terminal state (FINISHED, FAILED, CANCELED) is shown only once the run is released:
its job master and actors gone and its job name's lock free, so that a user who sees it
may start the job name again at once.

Each test is one schedule: the driver's ``wait()`` has the run's end and is releasing the
run (its job master killed, the run lock not yet released) when another thread asks
``get_job_status()``. The lock's release is where the status is looked at.
"""

from __future__ import annotations

import threading
import time

import pytest

import rayflow.environment as environment
from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.errors import JobCancelledError
from rayflow.status import JobState
from sinks.basic import CollectSink


def _job(records: int, rate: float | None) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_source(
        NumberSequenceSource(0, records, batch_size=10, records_per_second=rate), "Numbers"
    ).sink_to(CollectSink(), "Out")
    return env


@pytest.fixture
def seen_at_release(monkeypatch):
    """The states get_job_status() showed (from another thread) as the driver was about
    to release the run's lock."""
    seen: list[JobState] = []
    clients: list = []
    release = environment.release_run_lock

    def looked_at(lock) -> None:
        if lock is not None and clients:
            found: list[JobState] = []
            asker = threading.Thread(
                target=lambda: found.append(clients[0].get_job_status(timeout=30))
            )
            asker.start()
            asker.join()
            seen.extend(found)
        release(lock)

    monkeypatch.setattr(environment, "release_run_lock", looked_at)
    return seen, clients


def test_finished_is_not_shown_before_the_run_lock_is_released(seen_at_release):
    seen, clients = seen_at_release
    client = _job(2_000, None).execute_async("status-end-finished")
    clients.append(client)
    assert client.wait().sink_result("Out").num_rows == 2_001  # 0 .. 2000
    assert seen and not any(state.is_terminal for state in seen), seen
    assert client.get_job_status() is JobState.FINISHED


def test_canceled_is_not_shown_before_the_run_lock_is_released(seen_at_release):
    seen, clients = seen_at_release
    client = _job(10**9, 200).execute_async("status-end-canceled")
    clients.append(client)
    while client.get_job_status() is not JobState.RUNNING:
        time.sleep(0.05)
    assert client.cancel() is True
    assert seen and not any(state.is_terminal for state in seen), seen
    assert client.get_job_status() is JobState.CANCELED
    with pytest.raises(JobCancelledError):
        client.wait()
