"""Exactly-once through the data plane's own failure points: a receiving subtask killed,
or slow, while its senders ask where to connect; a receiver killed with pushes in flight
on its connections; a receiver that answers its senders late and then dies, with
what the sources read meanwhile queued on the links still connecting; and the same
seeded kills over both transports."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rayflow import DataTransport
from rayflow.runtime.hooks import HookPoint, RuntimeHooks, SubtaskHooks
from rayflow.runtime.subtask import SOURCE_CONNECT_WAIT_S
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
    asks = str(tmp_path / "asks")
    hooks = _NotingAsks(plan, asks)
    env, sink = build_keyed_sum(N, P, BATCH, storage=str(tmp_path / "chk"), plan=hooks)
    assert env.get_data_transport() is DataTransport.SOCKET  # the default
    result = env.execute(unique_job("data-plane-connect"))
    assert result.restarts == 3, result.failures
    _assert_exactly_once(result, sink)
    # both faults at DURING_CONNECT fired: the first ask of attempt 0, the second of 1
    noted = Path(asks).read_text().split()
    assert "0:1" in noted and "1:2" in noted, noted


class _NotedAsks(SubtaskHooks):
    def __init__(self, inner: SubtaskHooks | None, attempt: int, record: str) -> None:
        self.inner, self.attempt, self.record, self.asks = inner, attempt, record, 0

    def after_records(self, records: int) -> None:
        if self.inner is not None:
            self.inner.after_records(records)

    def at(self, point: HookPoint) -> None:
        if point is HookPoint.DURING_CONNECT:
            self.asks += 1
            with open(self.record, "a") as f:  # before the fault: a kill ends the process
                f.write(f"{self.attempt}:{self.asks}\n")
        if self.inner is not None:
            self.inner.at(point)


class _NotingAsks(RuntimeHooks):
    """``plan``, and every ask where to connect that the sum subtask each attempt's
    DURING_CONNECT fault is aimed at gets, noted in ``record`` as ``attempt:n`` (the n-th
    ask of that attempt) before the plan's faults run."""

    def __init__(self, plan: FaultPlan, record: str) -> None:
        self.plan, self.record = plan, record

    def for_subtask(self, vertex_name: str, index: int, attempt: int) -> SubtaskHooks | None:
        inner = self.plan.for_subtask(vertex_name, index, attempt)
        target = {0: 1, 1: 0}.get(attempt)  # the subtask each attempt's fault is aimed at
        if "Sum" in vertex_name and index == target:
            return _NotedAsks(inner, attempt, self.record)
        return inner

    def for_job_master(self, attempt: int):
        return self.plan.for_job_master(attempt)


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


class _SourceReads(SubtaskHooks):
    def __init__(self, record: str) -> None:
        self.record = record

    def after_records(self, records: int) -> None:
        if records > 0 and not os.path.exists(self.record):
            Path(self.record).write_text(str(records))


class _SlowThenDead(SubtaskHooks):
    def __init__(self, owner: LateAnswerThenKill) -> None:
        self.owner = owner

    def at(self, point: HookPoint) -> None:
        if point is not HookPoint.DURING_CONNECT:
            return
        # the receiver's mailbox stalls past the sources' wait for their links, so they
        # read and push into links still connecting; then the receiver dies
        time.sleep(self.owner.stall_s)
        Path(self.owner.killed).write_text(str(os.path.exists(self.owner.source_read)))
        os.kill(os.getpid(), signal.SIGKILL)


class LateAnswerThenKill(RuntimeHooks):
    """Attempt 0: the sum subtask 1 stalls when first asked where to connect, then dies;
    the sources note (in ``source_read``) that they read records, and the kill notes
    (in ``killed``) whether they had by then."""

    def __init__(self, directory: str, stall_s: float) -> None:
        self.source_read = os.path.join(directory, "source-read")
        self.killed = os.path.join(directory, "killed")
        self.stall_s = stall_s

    def for_subtask(self, vertex_name: str, index: int, attempt: int) -> SubtaskHooks | None:
        if attempt != 0:
            return None
        if "numbers" in vertex_name:
            return _SourceReads(self.source_read)
        if "Sum" in vertex_name and index == 1:
            return _SlowThenDead(self)
        return None


@pytest.mark.chaos
def test_a_receiver_dying_while_pushes_wait_on_its_connecting_links_is_exactly_once(tmp_path):
    """Sources read once their links are connected or after ``SOURCE_CONNECT_WAIT_S``;
    here a receiver answers later than that, so what the sources read is queued on links
    still connecting when the receiver dies: those pushes fail, the attempt with them,
    and the next attempt delivers everything exactly once."""
    hooks = LateAnswerThenKill(str(tmp_path), stall_s=SOURCE_CONNECT_WAIT_S + 1.0)
    env, sink = build_keyed_sum(N, P, BATCH, storage=str(tmp_path / "chk"), plan=hooks)
    result = env.execute(unique_job("data-plane-late-then-dead"))
    assert Path(hooks.killed).read_text() == "True", "the sources had read nothing yet"
    assert result.restarts == 1, result.failures
    _assert_exactly_once(result, sink)
