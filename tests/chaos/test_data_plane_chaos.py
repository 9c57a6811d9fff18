"""Exactly-once through the data plane's own failure points: a receiving subtask killed,
or slow, while its senders ask where to connect; a receiver killed with pushes in flight
on its connections; and the same seeded kills over both transports."""

from __future__ import annotations

import pytest

from rayflow import DataTransport
from rayflow.testing import Fault, FaultPlan, FaultPoint
from tests.chaos.harness import (
    build_keyed_sum,
    expected_rows,
    expected_sums,
    outcome,
    unique_job,
)

N = 400_000
P = 2
BATCH = 5000


def _assert_exactly_once(result, sink) -> None:
    got = outcome(result, sink)
    assert got.sums == expected_sums(N), result.failures
    # every emitted running total committed exactly once: none lost, none twice
    assert got.rows == expected_rows(N, P, BATCH), result.failures


@pytest.mark.chaos
def test_receivers_killed_or_slow_while_senders_connect_are_exactly_once(tmp_path):
    plan = FaultPlan(
        [
            # attempt 0: a receiver dies as the first sender asks where to connect
            Fault(FaultPoint.DURING_CONNECT, 0, "Sum", 1, checkpoint=1),
            # attempt 1: a receiver answers its second sender a second late (its mailbox
            # stalls), and a source dies meanwhile: the attempt ends while links of it
            # are still connecting
            Fault(FaultPoint.DURING_CONNECT, 1, "Sum", 0, checkpoint=2, action="sleep", seconds=1),
            Fault(FaultPoint.AFTER_RECORDS, 1, "numbers", 1, records=1),
            # attempt 2: a receiver dies with pushes in flight on its connections
            Fault(FaultPoint.AFTER_RECORDS, 2, "Sum", 1, records=30_000),
        ]
    )
    env, sink = build_keyed_sum(N, P, BATCH, storage=str(tmp_path), plan=plan)
    assert env.get_data_transport() is DataTransport.SOCKET  # the default
    result = env.execute(unique_job("data-plane-connect"))
    assert result.restarts == 3, result.failures
    _assert_exactly_once(result, sink)


@pytest.mark.chaos
@pytest.mark.parametrize("transport", [DataTransport.SOCKET, DataTransport.RAY])
def test_seeded_kills_are_exactly_once_over_either_transport(transport, tmp_path):
    plan = FaultPlan.random(
        7,
        kills=3,
        parallelism=P,
        max_records=N // 10,
        points=[FaultPoint.AFTER_RECORDS, FaultPoint.DURING_ALIGNMENT, FaultPoint.AFTER_SNAPSHOT],
    )
    env, sink = build_keyed_sum(N, P, BATCH, storage=str(tmp_path), plan=plan)
    env.set_data_transport(transport)
    result = env.execute(unique_job(f"data-plane-{transport.value}"))
    assert result.restarts >= 2, result.failures
    _assert_exactly_once(result, sink)
