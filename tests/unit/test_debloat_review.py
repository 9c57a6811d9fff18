"""Adversarial review of buffer debloating and latency markers (Ray-free).

Stress: random fan-in, senders whose pushes arrive in random order, a reader whose
speed changes (so credits go down to 1 and back up), channels blocked and unblocked as
in barrier alignment, and an unaligned-style recorder registered mid-stream. Checks:
in order, exactly once, bounded, no deadlock. Plus the metric findings.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from rayflow.runtime.channels import InputGate, OutputChannel
from rayflow.runtime.debloat import BufferDebloater
from rayflow.runtime.events import CheckpointBarrier, EndOfInput, LatencyMarker
from tests.unit.test_debloat import FakeClock, FakeReceiver


def run(coro: Any) -> Any:
    return asyncio.new_event_loop().run_until_complete(asyncio.wait_for(coro, 30))


class Recorder:
    def __init__(self) -> None:
        self.offered: dict[tuple[int, int], Any] = {}

    def offer(self, channel: int, seq: int, item: Any) -> None:
        assert (channel, seq) not in self.offered or self.offered[(channel, seq)] is item
        self.offered[(channel, seq)] = item


@pytest.mark.parametrize("seed", range(12))
def test_stress_alignment_credits_and_recording(seed: int) -> None:
    """Every channel gets barriers at the same positions; the reader blocks a channel at
    its barrier until every channel delivered it (aligned), its speed swings so credits
    go to 1 and back; a recorder registered at a barrier sees every later message."""
    rng = random.Random(seed)
    channels = rng.choice([1, 2, 3, 5, 8])
    capacity, window = rng.choice([(1, 1), (2, 8), (8, 8), (4, 2)])
    per_channel, barrier_every = 120, rng.choice([7, 13, 40])

    async def scenario() -> None:
        clock = FakeClock()
        debloater = BufferDebloater(channels, capacity, 0.05, period_s=0.05, clock=clock)
        gate = InputGate(channels, capacity, debloater)
        receiver = FakeReceiver(gate, rng)
        senders = [OutputChannel(receiver, c, 0, window, adaptive=True) for c in range(channels)]
        max_waiting = 0

        async def send(sender: OutputChannel) -> None:
            nonlocal max_waiting
            for i in range(per_channel):
                await sender.send(("data", sender.channel, i))
                if i % 5 == 0:
                    await sender.send(LatencyMarker(0.0, "s", sender.channel))
                if (i + 1) % barrier_every == 0:
                    await sender.send(CheckpointBarrier((i + 1) // barrier_every, 0.0, False))
                max_waiting = max(max_waiting, sum(len(w) for w in gate._waiting))
            await sender.send(EndOfInput())
            await sender.flush()

        seen: list[list[int]] = [[] for _ in range(channels)]
        pending_barrier: set[int] = set()
        recorders: list[Recorder] = []
        ended = 0
        taken_count = 0
        tasks = [asyncio.ensure_future(send(s)) for s in senders]
        while ended < channels:
            channel, item = await gate.next()
            taken_count += 1
            # the reader's speed swings: slow phases drive credits to 1
            slow = (taken_count // 50) % 2 == 1
            clock.now += 0.2 if slow else 0.0001
            if isinstance(item, tuple):
                seen[channel].append(item[2])
            elif isinstance(item, CheckpointBarrier):
                pending_barrier.add(channel)
                if len(pending_barrier) == channels:
                    pending_barrier.clear()
                    if rng.random() < 0.5:
                        r = Recorder()
                        gate.record(r)
                        recorders.append(r)
                    await gate.unblock_all()
                else:
                    gate.block(channel)
            elif isinstance(item, EndOfInput):
                ended += 1
                if pending_barrier:  # an ended channel never sends more barriers
                    pass
            assert gate.buffered() <= channels * capacity
        await asyncio.gather(*tasks)
        for c in range(channels):
            assert seen[c] == list(range(per_channel)), c
        assert debloater.lowest_credit >= 1
        assert max_waiting <= channels * window
        for r in recorders:
            for _channel, seq in r.offered:
                assert seq >= 0

    run(scenario())


def test_markers_and_barriers_are_counted_as_processed_data_messages() -> None:
    """Metric finding: ``input_throughput`` is documented as *data* messages per busy
    second and ``BufferDebloater.taken`` says 'when what it hands out is a data message',
    but ``InputGate.next`` calls ``taken()`` for every channel message: barriers, latency
    markers and EndOfInput. A reader that took no record batch at all reports a
    throughput, and credits are sized from it."""

    async def scenario() -> float | None:
        clock = FakeClock()
        debloater = BufferDebloater(1, 8, 1.0, period_s=0.1, clock=clock)
        gate = InputGate(1, 8, debloater)
        for seq in range(5):
            await gate.push(0, seq, LatencyMarker(0.0, "s", 0))
        for _ in range(5):
            await gate.next()
            clock.now += 0.05
        await gate.push(0, 5, LatencyMarker(0.0, "s", 0))
        await gate.next()
        return debloater.throughput

    throughput = run(scenario())
    assert throughput is None, f"no data message was processed, yet throughput={throughput}"


def test_ended_channels_take_no_share_of_the_credit() -> None:
    """credit = throughput * target / open channels / 2: with 8 channels of which 7
    delivered EndOfInput, the one live channel gets what the reader drains, not 1/8."""
    debloater = BufferDebloater(8, 64, 1.0)
    # the reader drains 80 msgs/s: in a 1 s target, 80 messages; 8 open channels get
    # round(80/8/2) = 5 each, one open channel round(80/2) = 40
    assert debloater.credit_for(80.0) == 5
    gate = InputGate(8, 64, debloater)

    async def scenario() -> None:
        for channel in range(7):
            await gate.push(channel, 0, EndOfInput())
            await gate.next()

    run(scenario())
    assert debloater.open_channels == 1
    assert debloater.credit_for(80.0) == 40
