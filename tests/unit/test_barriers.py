"""Barrier handlers as explicit states: what blocks, when a snapshot is due."""

import asyncio

import pytest

from rayflow.runtime.barriers import AlignedBarrierHandler, AlignmentState, TrackingBarrierHandler
from rayflow.runtime.channels import InputGate
from rayflow.runtime.events import CheckpointBarrier


def barrier(n):
    return CheckpointBarrier(n, 0.0)


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_aligned_blocks_each_channel_until_the_last_barrier():
    async def scenario():
        gate = InputGate(3, 4)
        handler = AlignedBarrierHandler(gate)
        assert handler.state is AlignmentState.WAITING
        assert handler.on_barrier(0, barrier(1)) is None
        assert handler.state is AlignmentState.ALIGNING
        await gate.push(0, 0, "after-barrier-on-0")
        await gate.push(1, 0, "before-barrier-on-1")
        # channel 0 is blocked: only channel 1's record is delivered
        assert await gate.next() == (1, "before-barrier-on-1")
        assert handler.on_barrier(1, barrier(1)) is None
        done = handler.on_barrier(2, barrier(1))
        assert done == barrier(1)
        assert handler.state is AlignmentState.WAITING
        await handler.resume()
        assert await gate.next() == (0, "after-barrier-on-0")

    run(scenario())


def test_aligned_newer_barrier_abandons_older_alignment_and_drops_stale_ones():
    gate = InputGate(2, 4)
    handler = AlignedBarrierHandler(gate)
    handler.on_barrier(0, barrier(1))
    assert handler.on_barrier(0, barrier(2)) is None  # checkpoint 1 abandoned
    assert handler.current_id == 2
    assert handler.on_barrier(1, barrier(1)) is None  # stale
    assert handler.on_barrier(1, barrier(2)) == barrier(2)


def test_aligned_abort_unblocks():
    async def scenario():
        gate = InputGate(2, 4)
        handler = AlignedBarrierHandler(gate)
        handler.on_barrier(0, barrier(5))
        await gate.push(0, 0, "x")
        await handler.abort(5)
        assert handler.state is AlignmentState.WAITING
        assert await asyncio.wait_for(gate.next(), 1) == (0, "x")

    run(scenario())


def test_tracking_never_blocks_and_fires_on_the_last_barrier():
    async def scenario():
        gate = InputGate(2, 4)
        handler = TrackingBarrierHandler(gate)
        assert handler.on_barrier(0, barrier(1)) is None
        await gate.push(0, 0, "after")
        assert await asyncio.wait_for(gate.next(), 1) == (0, "after")
        assert handler.on_barrier(1, barrier(1)) == barrier(1)
        assert handler.on_barrier(0, barrier(1)) is None  # already done

    run(scenario())


def test_gate_delivers_in_sequence_order_whatever_the_arrival_order():
    async def scenario():
        gate = InputGate(1, 10)
        pushes = [asyncio.ensure_future(gate.push(0, seq, seq)) for seq in (3, 1, 0, 2)]
        got = [(await gate.next())[1] for _ in range(4)]
        await asyncio.gather(*pushes)
        assert got == [0, 1, 2, 3]

    run(scenario())


def test_gate_push_waits_while_the_channel_buffer_is_full():
    async def scenario():
        gate = InputGate(1, 2)
        await gate.push(0, 0, "a")
        await gate.push(0, 1, "b")
        third = asyncio.ensure_future(gate.push(0, 2, "c"))
        await asyncio.sleep(0.01)
        assert not third.done()
        assert gate.buffered() == 2
        await gate.next()
        await asyncio.wait_for(third, 1)
        assert gate.max_buffered == 2

    run(scenario())


@pytest.mark.parametrize("capacity", [1, 3])
def test_control_messages_overtake_data(capacity):
    async def scenario():
        gate = InputGate(1, capacity)
        await gate.push(0, 0, "data")
        await gate.put_control("notify")
        assert (await gate.next())[1] == "notify"

    run(scenario())
