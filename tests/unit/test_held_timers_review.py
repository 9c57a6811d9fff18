"""Operator timers held after a final barrier, under adversarial schedules.

Without Ray: the real subtask class with a recording receiver, a fake job master and
storage. A subtask that took a final barrier (a stop with savepoint, or the final
checkpoint after end of input) holds its operators' timers: what they emitted would
follow the barrier while the snapshot still holds them. What must hold: nothing a timer
emits follows a final barrier that completes; once the final checkpoint is aborted every
held timer fires, once, in order, after the barrier; an abort that arrives before its
barrier, or one of an older final checkpoint, releases nothing early; a held timer that
raises fails the subtask as any timer does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pyarrow as pa
import pytest

from rayflow.config import CheckpointAlignment, CheckpointingMode
from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
from rayflow.plan.physical import OperatorSpec, VertexSpec
from rayflow.runtime.events import CheckpointBarrier, EndOfInput
from rayflow.runtime.operators import Operator, factory
from rayflow.runtime.subtask import OutputDeployment, _OperatorTimer
from tests.unit.test_debloat import run
from tests.unit.test_output_buffering_review import _deploy, _Receiver, _values


class Ticker(Operator):
    """Passes batches on; a timer with token ``n`` emits ``n`` (``-1`` raises)."""

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        return [batch]

    def on_timer(self, token: Any) -> list[pa.RecordBatch]:
        if token == -1:
            raise RuntimeError("the timer failed")
        return [pa.record_batch([pa.array([token], pa.int64())], ["value"])]


class _Storage:
    def write_blob(self, checkpoint_id: int, name: str, blob: bytes) -> str:
        return f"chk-{checkpoint_id}/{name}"


class _Call:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def remote(self, *args: Any) -> None:
        self.log.append((self.name, *args))


class _Master:
    """Records acknowledgements and declines."""

    def __init__(self) -> None:
        self.calls: list = []
        for name in ("acknowledge_checkpoint", "decline_checkpoint", "subtask_running"):
            setattr(self, name, _Call(self.calls, name))
        self.source_exhausted = _Call(self.calls, "source_exhausted")

    def acked(self) -> list[int]:
        return [c[2] for c in self.calls if c[0] == "acknowledge_checkpoint"]


def _subtask(receiver: _Receiver, inputs: int = 1, alignment: CheckpointAlignment | None = None):
    vertex = VertexSpec(
        1, "ticker", 1, 128, operators=[OperatorSpec("ticker", "ticker", factory(Ticker))]
    )
    forward = PartitionerSpec(PartitionKind.FORWARD)
    deployment, cls = _deploy(
        vertex, [OutputDeployment(forward, [(receiver, 0)])], inputs=inputs, buffer_timeout_s=0.0
    )
    deployment.checkpointing = CheckpointingMode.EXACTLY_ONCE
    if alignment is not None:
        deployment.alignment = alignment
        deployment.aligned_checkpoint_timeout_s = 0.0
    deployment.storage = _Storage()
    deployment.master = _Master()
    sub = cls(deployment)

    async def no_metrics() -> dict:
        return {}

    sub.metrics = no_metrics
    return sub


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


async def _timer(sub, token: int) -> None:
    await sub.gate.put_control(_OperatorTimer(sub.attempt, 0, token))


def _after_barrier(messages: list, checkpoint_id: int) -> tuple[list[int], list[int]]:
    """The values the receiver got before and after barrier ``checkpoint_id``."""
    for position, message in enumerate(messages):
        if isinstance(message, CheckpointBarrier) and message.checkpoint_id == checkpoint_id:
            return _values(messages[:position]), _values(messages[position + 1 :])
    raise AssertionError(f"barrier {checkpoint_id} never went out: {messages}")


class _Job:
    """One subtask running, fed on channel 0."""

    def __init__(self, inputs: int = 1, alignment: CheckpointAlignment | None = None) -> None:
        self.receiver = _Receiver()
        self.sub = _subtask(self.receiver, inputs, alignment)
        self.seqs = [0] * inputs
        self.running: asyncio.Future | None = None

    async def __aenter__(self) -> _Job:
        self.running = asyncio.ensure_future(self.sub.run())
        await _settle()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.running is not None
        if not self.running.done():
            self.running.cancel()
        await asyncio.gather(self.running, return_exceptions=True)

    async def push(self, message: Any, channel: int = 0) -> None:
        await self.sub.push(channel, self.seqs[channel], self.sub.attempt, message)
        self.seqs[channel] += 1
        await _settle()

    async def abort(self, checkpoint_id: int) -> None:
        await self.sub.notify_checkpoint_aborted(self.sub.attempt, checkpoint_id)
        await _settle()

    async def complete(self, checkpoint_id: int) -> None:
        await self.sub.notify_checkpoint_complete(self.sub.attempt, checkpoint_id)
        await _settle()


def _stop(checkpoint_id: int) -> CheckpointBarrier:
    return CheckpointBarrier(checkpoint_id, time.time(), final=True, savepoint=True)


def test_timers_due_after_a_stop_barrier_fire_once_in_order_after_it_when_it_is_aborted():
    async def go():
        async with _Job() as job:
            await _timer(job.sub, 1)
            await job.push(_stop(1))
            for token in (2, 3, 4):
                await _timer(job.sub, token)
            await _settle()
            held = _after_barrier(job.receiver.messages, 1)
            await job.abort(1)
            await _timer(job.sub, 5)
            await _settle()
            return held, _after_barrier(job.receiver.messages, 1), job.sub.d.master.acked()

    held, released, acked = run(go())
    assert held == ([1], []), "a timer fired after the stop's barrier"
    assert released == ([1], [2, 3, 4, 5])
    assert acked == [1]


def test_held_timers_are_dropped_when_the_stop_completes_and_the_subtask_finishes():
    async def go():
        async with _Job() as job:
            await job.push(_stop(1))
            await _timer(job.sub, 2)
            await job.complete(1)
            await _timer(job.sub, 3)  # the loop has ended: nobody takes it
            await _settle()
            assert job.running is not None
            done = job.running.done()
            return done, _after_barrier(job.receiver.messages, 1)

    done, (before, after) = run(go())
    assert done, "the subtask did not finish after its final checkpoint"
    assert after == []


def test_an_abort_that_comes_before_the_stop_barrier_makes_it_stale_and_holds_nothing():
    async def go():
        async with _Job() as job:
            await job.abort(1)
            await job.push(_stop(1))  # stale: not taken
            await _timer(job.sub, 7)
            await _settle()
            return job.sub._final_checkpoint, job.sub.d.master.acked(), job.receiver.messages

    final, acked, messages = run(go())
    assert final is None and acked == []
    assert _values(messages) == [7]


def test_a_newer_final_barrier_before_the_older_abort_keeps_holding_until_its_own_outcome():
    """The stop's checkpoint 1 is aborted and checkpoint 2 (final) is taken before the
    abort of 1 arrives: the timers held since 1 are in 2's snapshot and stay held."""

    async def go():
        async with _Job() as job:
            await job.push(_stop(1))
            await _timer(job.sub, 1)
            await job.push(_stop(2))  # a newer final barrier: the first is given up
            await _timer(job.sub, 2)
            await job.abort(1)
            during = _after_barrier(job.receiver.messages, 2)
            await job.abort(2)
            return during, _after_barrier(job.receiver.messages, 2)

    during, after = run(go())
    assert during == ([], []), "the abort of an older checkpoint released timers held for 2"
    assert after == ([], [1, 2])


def test_the_end_of_input_final_checkpoint_holds_and_releases_timers_too():
    async def go():
        async with _Job() as job:
            await job.push(EndOfInput())
            await job.push(CheckpointBarrier(1, time.time(), final=True))
            await _timer(job.sub, 1)
            held = _after_barrier(job.receiver.messages, 1)
            await job.abort(1)
            released = _after_barrier(job.receiver.messages, 1)
            await job.push(CheckpointBarrier(2, time.time(), final=True))
            await _timer(job.sub, 2)
            await job.complete(2)
            assert job.running is not None
            return held, released, _after_barrier(job.receiver.messages, 2), job.running.done()

    held, released, second, done = run(go())
    assert held == ([], []) and released == ([], [1])
    assert second == ([1], []) and done


def test_a_held_timer_that_raises_when_released_fails_the_subtask():
    from rayflow.errors import OperatorError

    async def go():
        async with _Job() as job:
            await job.push(_stop(1))
            await _timer(job.sub, -1)
            await _timer(job.sub, 2)
            await job.abort(1)
            assert job.running is not None
            await asyncio.wait_for(asyncio.shield(job.running), 5.0)

    with pytest.raises(OperatorError, match="the timer failed"):
        run(go())


@pytest.mark.parametrize("alignment", list(CheckpointAlignment))
def test_a_final_barrier_aligns_in_every_mode_and_holds_only_once_taken(alignment):
    """Unaligned, or aligned with a timeout of 0: the stop's barrier still aligns. A
    timer due while it waits for the second channel's barrier fires before it (the
    snapshot is not taken: its output belongs before the barrier), with the first
    channel's data behind the barrier held back; one due after the snapshot is held."""

    def batch(value: int) -> pa.RecordBatch:
        return pa.record_batch([pa.array([value], pa.int64())], ["value"])

    async def go():
        async with _Job(inputs=2, alignment=alignment) as job:
            await job.push(_stop(1), channel=0)
            await job.push(batch(10), channel=0)  # after the barrier: waits
            await job.push(batch(11), channel=1)  # before it
            await _timer(job.sub, 1)
            await _settle()
            aligning = [m for m in job.receiver.messages if isinstance(m, CheckpointBarrier)]
            await job.push(_stop(1), channel=1)
            await _timer(job.sub, 2)
            held = _after_barrier(job.receiver.messages, 1)
            await job.abort(1)
            return aligning, held, _after_barrier(job.receiver.messages, 1)

    aligning, held, released = run(go())
    assert aligning == [], "the final barrier went out before every channel's came"
    assert held == ([11, 1], [10])
    assert released == ([11, 1], [10, 2])
