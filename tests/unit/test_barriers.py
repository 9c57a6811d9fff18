"""Barrier handlers as explicit states: what blocks, when a snapshot is due, and when an
unaligned one starts, switches, is abandoned. Ray-free: a real InputGate, asyncio pushes."""

import asyncio
import time

import pyarrow as pa
import pytest

from rayflow.runtime.barriers import (
    AlternatingCollectingBarriers,
    AlternatingWaitingForFirstBarrier,
    CollectingBarriers,
    CollectingBarriersUnaligned,
    Snapshot,
    TrackingCounting,
    TrackingWaiting,
    WaitingForFirstBarrier,
    WaitingForFirstBarrierUnaligned,
    aligned_handler,
    alternating_handler,
    tracking_handler,
    unaligned_handler,
)
from rayflow.runtime.channel_state import ChannelStateRecorder
from rayflow.runtime.channels import InputGate
from rayflow.runtime.events import CheckpointBarrier


def barrier(n, ts=0.0, final=False):
    return CheckpointBarrier(n, ts, final)


def batch(tag):
    return pa.record_batch({"tag": [tag]})


def tag(item):
    return item.column(0)[0].as_py() if isinstance(item, pa.RecordBatch) else item


def tags(state):
    return {c: [tag(b) for b in batches] for c, batches in state.items()}


def run(coro):
    return asyncio.new_event_loop().run_until_complete(asyncio.wait_for(coro, 5))


async def settle():
    """Let pushes run until nothing more can move."""
    for _ in range(30):
        await asyncio.sleep(0)


class Subtask:
    """What Subtask does with its handler (``_take``, ``_run_inputs``,
    ``_channel_state_done``, ``_abandoned``), without Ray and without operators."""

    def __init__(self, num_channels, capacity=4):
        self.gate = InputGate(num_channels, capacity)
        self.completed: list[ChannelStateRecorder] = []
        self.abandoned: list[tuple[int, str]] = []
        self.timers: list[tuple[int, float, float]] = []  # (checkpoint, delay, scheduled at)
        self.snapshots: list[Snapshot] = []
        self.taken_at_snapshot: list[list[int]] = []  # gate.taken when each was taken
        self.taken: list[tuple[int, object]] = []
        self._pushes: list[asyncio.Future] = []

    # callbacks
    def channel_state_done(self, recorder):
        self.completed.append(recorder)
        self.gate.stop_recording(recorder)

    def abandon(self, checkpoint_id, why):
        self.abandoned.append((checkpoint_id, why))

    def schedule_timer(self, checkpoint_id, delay_s):
        self.timers.append((checkpoint_id, delay_s, time.time()))

    # handlers
    def unaligned(self):
        self.handler = unaligned_handler(self.gate, self.channel_state_done, self.abandon)
        return self.handler

    def alternating(self, timeout_s):
        self.handler = alternating_handler(
            self.gate, timeout_s, self.schedule_timer, self.channel_state_done, self.abandon
        )
        return self.handler

    # events
    async def push(self, channel, seq, item):
        self._pushes.append(asyncio.ensure_future(self.gate.push(channel, seq, item)))
        await settle()

    async def decide(self, decision):
        if decision is not None:
            self.snapshots.append(decision)
            self.taken_at_snapshot.append(list(self.gate.taken))
            await self.handler.resume()
        return decision

    async def announce(self, channel, b, position):
        return await self.decide(self.handler.on_announcement(channel, b, position))

    async def timer(self, checkpoint_id):
        return await self.decide(self.handler.on_timer(checkpoint_id))

    async def take(self):
        """One message from the gate; a barrier goes to the handler."""
        channel, item = await asyncio.wait_for(self.gate.next(), 1)
        self.taken.append((channel, item))
        if isinstance(item, CheckpointBarrier):
            seq = self.gate.taken[channel] - 1
            await self.decide(self.handler.on_barrier(channel, seq, item))
        await settle()
        return channel, item

    def available(self):
        return any(
            self.gate._buffers[c] and not self.gate._blocked[c]
            for c in range(self.gate.num_channels)
        )

    async def drain(self):
        while self.available() or not all(p.done() for p in self._pushes):
            if self.available():
                await self.take()
            else:
                await settle()


# --- aligned (the old AlignedBarrierHandler's behaviour) --------------------------------


def test_aligned_blocks_each_channel_until_the_last_barrier():
    async def scenario():
        gate = InputGate(3, 4)
        handler = aligned_handler(gate)
        assert isinstance(handler.state, WaitingForFirstBarrier)
        await gate.push(0, 0, barrier(1))
        assert await gate.next() == (0, barrier(1))
        assert handler.on_barrier(0, 0, barrier(1)) is None
        assert isinstance(handler.state, CollectingBarriers)
        assert handler.aligning
        await gate.push(0, 1, "after-barrier-on-0")
        await gate.push(1, 0, "before-barrier-on-1")
        # channel 0 is blocked: only channel 1's record is delivered
        assert await gate.next() == (1, "before-barrier-on-1")
        assert handler.on_barrier(1, 1, barrier(1)) is None
        assert isinstance(handler.state, CollectingBarriers)
        done = handler.on_barrier(2, 0, barrier(1))
        assert done == Snapshot(barrier(1), unaligned=False, recorder=None)
        assert isinstance(handler.state, WaitingForFirstBarrier)
        assert not handler.aligning
        await handler.resume()
        assert await asyncio.wait_for(gate.next(), 1) == (0, "after-barrier-on-0")

    run(scenario())


def test_aligned_newer_barrier_abandons_older_alignment_and_drops_stale_ones():
    async def scenario():
        gate = InputGate(2, 4)
        handler = aligned_handler(gate)
        assert handler.on_barrier(0, 0, barrier(1)) is None
        assert handler.on_barrier(0, 1, barrier(2)) is None  # checkpoint 1 abandoned
        assert isinstance(handler.state, CollectingBarriers)
        assert handler.on_barrier(1, 0, barrier(1)) is None  # stale
        assert isinstance(handler.state, CollectingBarriers)
        done = handler.on_barrier(1, 1, barrier(2))
        assert done is not None and done.barrier == barrier(2) and not done.unaligned
        assert handler.on_barrier(0, 2, barrier(2)) is None  # already done
        assert handler.on_barrier(0, 3, barrier(1)) is None  # stale

    run(scenario())


def test_aligned_abort_unblocks_and_the_aborted_checkpoint_stays_dropped():
    async def scenario():
        gate = InputGate(2, 4)
        handler = aligned_handler(gate)
        handler.on_barrier(0, 0, barrier(5))
        await gate.push(0, 0, "x")
        await handler.abort(4)  # not the one in progress: nothing happens
        assert isinstance(handler.state, CollectingBarriers)
        await handler.abort(5)
        assert isinstance(handler.state, WaitingForFirstBarrier)
        assert await asyncio.wait_for(gate.next(), 1) == (0, "x")
        assert handler.on_barrier(1, 0, barrier(5)) is None  # barrier of the aborted one
        assert isinstance(handler.state, WaitingForFirstBarrier)

    run(scenario())


def test_tracking_never_blocks_and_fires_on_the_last_barrier():
    async def scenario():
        gate = InputGate(2, 4)
        handler = tracking_handler(gate)
        assert isinstance(handler.state, TrackingWaiting)
        assert handler.on_barrier(0, 0, barrier(1)) is None
        assert isinstance(handler.state, TrackingCounting)
        await gate.push(0, 0, "after")
        assert await asyncio.wait_for(gate.next(), 1) == (0, "after")
        done = handler.on_barrier(1, 0, barrier(1))
        assert done == Snapshot(barrier(1), unaligned=False, recorder=None)
        assert isinstance(handler.state, TrackingWaiting)
        assert handler.on_barrier(0, 1, barrier(1)) is None  # already done

    run(scenario())


def test_tracking_abort_forgets_the_checkpoint():
    async def scenario():
        gate = InputGate(2, 4)
        handler = tracking_handler(gate)
        handler.on_barrier(0, 0, barrier(3))
        await handler.abort(3)
        assert isinstance(handler.state, TrackingWaiting)
        assert handler.on_barrier(1, 0, barrier(3)) is None

    run(scenario())


def test_gate_delivers_in_sequence_order_whatever_the_arrival_order():
    async def scenario():
        gate = InputGate(1, 10)
        pushes = [asyncio.ensure_future(gate.push(0, seq, seq)) for seq in (3, 1, 0, 2)]
        got = [(await gate.next())[1] for _ in range(4)]
        await asyncio.gather(*pushes)
        assert got == [0, 1, 2, 3]
        assert gate.taken == [4]

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
        assert gate._waiting[0] == {2: "c"}
        await gate.next()
        await asyncio.wait_for(third, 1)
        assert gate._waiting[0] == {}
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


# --- unaligned ------------------------------------------------------------------------


def test_unaligned_snapshots_at_the_first_announcement_and_never_blocks():
    async def scenario():
        s = Subtask(2)
        h = s.unaligned()
        assert isinstance(h.state, WaitingForFirstBarrierUnaligned)
        await s.push(0, 0, batch("a0"))
        await s.push(1, 0, batch("b0"))
        snap = await s.announce(1, barrier(1), 1)
        assert snap is not None and snap.unaligned and snap.barrier == barrier(1)
        assert isinstance(snap.recorder, ChannelStateRecorder)
        assert snap.recorder.checkpoint_id == 1
        assert isinstance(h.state, CollectingBarriersUnaligned)
        assert h.aligning
        # nothing is blocked: both channels deliver
        got = {tag((await s.take())[1]) for _ in range(2)}
        assert got == {"a0", "b0"}
        assert s.completed == []  # channel 0's end is unknown
        assert await s.announce(0, barrier(1), 0) is None  # no second snapshot
        assert isinstance(h.state, WaitingForFirstBarrierUnaligned)
        assert not h.aligning
        assert s.completed == [snap.recorder]
        assert tags(snap.recorder.channel_state()) == {1: ["b0"]}

    run(scenario())


def test_unaligned_snapshots_at_the_first_in_band_barrier():
    async def scenario():
        s = Subtask(2)
        s.unaligned()
        await s.push(0, 0, barrier(1))
        await s.push(0, 1, batch("after"))
        await s.take()
        assert len(s.snapshots) == 1 and s.snapshots[0].unaligned
        recorder = s.snapshots[0].recorder
        assert isinstance(s.handler.state, CollectingBarriersUnaligned)
        assert tag((await s.take())[1]) == "after"  # not blocked
        await s.announce(1, barrier(1), 0)
        assert s.completed == [recorder]
        assert recorder.channel_state() == {}

    run(scenario())


def test_unaligned_repeated_and_stale_announcements_are_ignored():
    async def scenario():
        s = Subtask(2)
        h = s.unaligned()
        first = await s.announce(0, barrier(2), 0)
        assert first is not None
        assert await s.announce(0, barrier(2), 5) is None  # same channel again
        assert await s.announce(1, barrier(1), 0) is None  # older checkpoint: stale
        assert isinstance(h.state, CollectingBarriersUnaligned)
        assert s.completed == [] and s.abandoned == []
        assert await s.announce(1, barrier(2), 0) is None
        assert s.completed == [first.recorder]
        assert first.recorder.channel_state() == {}
        # after completion: every announcement of 2 or older is stale
        for cid in (1, 2):
            assert await s.announce(0, barrier(cid), 0) is None
        assert isinstance(h.state, WaitingForFirstBarrierUnaligned)
        assert len(s.snapshots) == 1

    run(scenario())


def test_unaligned_newer_checkpoint_abandons_the_incomplete_one():
    async def scenario():
        s = Subtask(2)
        h = s.unaligned()
        old = await s.announce(0, barrier(1), 2)  # messages 0 and 1 of channel 0 still due
        assert old is not None
        new = await s.announce(0, barrier(2), 3)
        assert new is not None and new.barrier == barrier(2) and new.unaligned
        assert [cid for cid, _ in s.abandoned] == [1]
        assert "2" in s.abandoned[0][1]
        assert old.recorder.abandoned and not old.recorder.done
        assert isinstance(h.state, CollectingBarriersUnaligned)
        # the data checkpoint 1 waited for arrives: only checkpoint 2 gets it
        for seq in range(3):
            await s.push(0, seq, batch(f"a{seq}"))
        assert await s.announce(1, barrier(1), 0) is None  # stale
        await s.announce(1, barrier(2), 0)
        assert s.completed == [new.recorder]
        assert tags(new.recorder.channel_state()) == {0: ["a0", "a1", "a2"]}
        assert old.recorder.channel_state() == {}
        assert len(s.abandoned) == 1

    run(scenario())


def test_unaligned_abort_abandons_the_incomplete_checkpoint():
    async def scenario():
        s = Subtask(2)
        h = s.unaligned()
        snap = await s.announce(1, barrier(4), 1)
        await h.abort(3)  # another checkpoint: nothing happens
        assert s.abandoned == [] and isinstance(h.state, CollectingBarriersUnaligned)
        await h.abort(4)
        assert [cid for cid, _ in s.abandoned] == [4]
        assert "abort" in s.abandoned[0][1]
        assert isinstance(h.state, WaitingForFirstBarrierUnaligned)
        assert snap.recorder.abandoned
        await s.push(1, 0, batch("b0"))
        assert await s.announce(0, barrier(4), 0) is None  # aborted: stale
        assert s.completed == []
        assert len(s.snapshots) == 1
        # the next checkpoint works
        nxt = await s.announce(0, barrier(5), 0)
        assert nxt is not None and nxt.unaligned

    run(scenario())


def test_unaligned_abort_of_a_complete_checkpoint_does_not_call_on_abandon():
    async def scenario():
        s = Subtask(1)
        h = s.unaligned()
        snap = await s.announce(0, barrier(1), 0)
        assert s.completed == [snap.recorder]
        await h.abort(1)
        assert s.abandoned == []

    run(scenario())


@pytest.mark.parametrize("savepoint", [False, True])
def test_unaligned_handler_takes_the_final_checkpoint_aligned(savepoint):
    """Also a savepoint (not final): its state restores into other job graphs."""

    async def scenario():
        s = Subtask(2)
        h = s.unaligned()
        final = CheckpointBarrier(3, 0.0, final=not savepoint, savepoint=savepoint)
        await s.push(0, 0, final)
        await s.push(0, 1, batch("after-final"))
        await s.push(1, 0, batch("b0"))
        await s.take()  # the final barrier on channel 0
        assert s.snapshots == []
        assert isinstance(h.state, CollectingBarriers)
        # channel 0 is blocked
        assert tag((await s.take())[1]) == "b0"
        assert not s.available()
        await s.push(1, 1, final)
        await s.take()
        assert s.snapshots == [Snapshot(final, unaligned=False, recorder=None)]
        assert s.completed == [] and s.abandoned == []
        assert isinstance(h.state, WaitingForFirstBarrierUnaligned)
        assert tag((await s.take())[1]) == "after-final"

    run(scenario())


def test_final_barrier_abandons_an_incomplete_unaligned_checkpoint_and_aligns():
    async def scenario():
        s = Subtask(2)
        h = s.unaligned()
        snap = await s.announce(0, barrier(1), 3)
        final = barrier(2, final=True)
        await s.push(1, 0, final)
        await s.take()
        assert [cid for cid, _ in s.abandoned] == [1]
        assert snap.recorder.abandoned
        assert isinstance(h.state, CollectingBarriers)
        for seq in range(3):
            await s.push(0, seq, batch(f"a{seq}"))
        await s.push(0, 3, final)
        for _ in range(4):
            await s.take()
        assert s.snapshots[-1] == Snapshot(final, unaligned=False, recorder=None)
        assert s.completed == []

    run(scenario())


# --- aligned, switching to unaligned after a timeout -----------------------------------


def test_alternating_aligns_when_every_barrier_comes_in_time():
    async def scenario():
        s = Subtask(2)
        h = s.alternating(60.0)
        assert isinstance(h.state, AlternatingWaitingForFirstBarrier)
        b = barrier(1, ts=time.time())
        await s.push(0, 0, batch("a0"))
        await s.push(0, 1, b)
        await s.push(0, 2, batch("a2"))
        await s.take()
        await s.take()
        assert s.snapshots == []
        assert isinstance(h.state, AlternatingCollectingBarriers)
        assert [t[0] for t in s.timers] == [1]
        assert not s.available()  # channel 0 blocked after its barrier
        await s.announce(1, b, 1)  # in time: still aligned
        assert isinstance(h.state, AlternatingCollectingBarriers)
        await s.push(1, 0, batch("b0"))
        await s.push(1, 1, b)
        assert tag((await s.take())[1]) == "b0"
        await s.take()
        assert s.snapshots == [Snapshot(b, unaligned=False, recorder=None)]
        assert s.completed == [] and s.abandoned == []
        assert isinstance(h.state, AlternatingWaitingForFirstBarrier)
        assert tag((await s.take())[1]) == "a2"
        assert await s.timer(1) is None  # the timer of a completed checkpoint
        assert len(s.timers) == 1

    run(scenario())


def test_alternating_schedules_its_timer_at_barrier_timestamp_plus_timeout():
    async def scenario():
        s = Subtask(2)
        s.alternating(2.0)
        b = barrier(7, ts=time.time() - 0.5)
        assert await s.announce(1, b, 0) is None
        [(cid, delay, at)] = s.timers
        assert cid == 7
        assert at + delay == pytest.approx(b.timestamp + 2.0, abs=0.05)
        assert await s.announce(0, b, 0) is None  # no second timer
        assert len(s.timers) == 1

    run(scenario())


def test_alternating_switches_to_unaligned_when_its_timer_fires():
    async def scenario():
        s = Subtask(3, capacity=2)
        h = s.alternating(60.0)
        b = barrier(1, ts=time.time())
        # channel 0: its barrier is taken before the timeout; data after it is blocked
        await s.push(0, 0, batch("a0"))
        await s.push(0, 1, b)
        await s.take()
        await s.take()
        await s.push(0, 2, batch("a2"))
        await s.push(0, 3, batch("a3"))
        await s.push(0, 4, batch("a4"))  # waits for buffer space
        # channel 1: b0 taken, b1 b2 buffered, barrier announced at 3
        await s.push(1, 0, batch("b0"))
        await s.take()
        await s.push(1, 1, batch("b1"))
        await s.push(1, 2, batch("b2"))
        await s.announce(1, b, 3)
        # channel 2: c0 buffered, c1 not sent yet, end unknown
        await s.push(2, 0, batch("c0"))
        assert s.snapshots == []
        assert isinstance(h.state, AlternatingCollectingBarriers)
        assert await s.timer(2) is None  # another checkpoint's timer
        snap = h.on_timer(1)
        assert snap is not None and snap.unaligned and snap.recorder is not None
        assert not any(s.gate._blocked)  # unblocked by the switch itself
        await s.decide(snap)
        assert isinstance(h.state, CollectingBarriersUnaligned)
        assert await s.timer(1) is None
        # unblocked: channel 0's data after its barrier flows again
        seen = {tag((await s.take())[1]) for _ in range(4)}
        assert "a2" in seen
        await s.push(1, 3, b)
        await s.push(2, 1, batch("c1"))
        assert s.completed == []
        await s.push(2, 2, b)
        await s.drain()
        assert s.completed == [snap.recorder]
        assert tags(snap.recorder.channel_state()) == {1: ["b1", "b2"], 2: ["c0", "c1"]}
        assert isinstance(h.state, AlternatingWaitingForFirstBarrier)
        assert len(s.snapshots) == 1 and s.abandoned == []

    run(scenario())


@pytest.mark.parametrize("first", ["barrier", "announcement"])
def test_alternating_switches_at_once_when_the_first_barrier_is_late(first):
    async def scenario():
        s = Subtask(2)
        h = s.alternating(1.0)
        b = barrier(1, ts=time.time() - 10)
        if first == "barrier":
            await s.push(0, 0, b)
            await s.take()
        else:
            await s.announce(0, b, 0)
        assert len(s.snapshots) == 1 and s.snapshots[0].unaligned
        assert s.timers == []
        assert isinstance(h.state, CollectingBarriersUnaligned)
        await s.push(0, 1 if first == "barrier" else 0, batch("after"))
        assert tag((await s.take())[1]) == "after"  # not blocked
        await s.announce(1, b, 0)
        assert s.completed == [s.snapshots[0].recorder]
        assert isinstance(h.state, AlternatingWaitingForFirstBarrier)

    run(scenario())


def test_alternating_single_channel_aligns_even_when_late():
    async def scenario():
        s = Subtask(1)
        s.alternating(1.0)
        b = barrier(1, ts=time.time() - 10)
        await s.push(0, 0, b)
        await s.take()
        assert s.snapshots == [Snapshot(b, unaligned=False, recorder=None)]

    run(scenario())


@pytest.mark.parametrize("savepoint", [False, True])
def test_alternating_takes_the_final_checkpoint_aligned_even_when_late(savepoint):
    async def scenario():
        s = Subtask(2)
        h = s.alternating(1.0)
        final = CheckpointBarrier(2, time.time() - 10, final=not savepoint, savepoint=savepoint)
        await s.push(0, 0, final)
        await s.push(0, 1, batch("after"))
        await s.take()
        assert s.snapshots == [] and s.timers == []
        assert isinstance(h.state, CollectingBarriers)
        assert not s.available()
        assert await s.timer(2) is None
        await s.push(1, 0, final)
        await s.take()
        assert s.snapshots == [Snapshot(final, unaligned=False, recorder=None)]
        assert isinstance(h.state, AlternatingWaitingForFirstBarrier)

    run(scenario())


def test_alternating_abort_while_aligning_unblocks():
    async def scenario():
        s = Subtask(2)
        h = s.alternating(60.0)
        b = barrier(1, ts=time.time())
        await s.push(0, 0, b)
        await s.push(0, 1, batch("after"))
        await s.take()
        assert not s.available()
        await h.abort(1)
        assert isinstance(h.state, AlternatingWaitingForFirstBarrier)
        assert tag((await s.take())[1]) == "after"
        assert await s.timer(1) is None
        assert s.abandoned == []  # nothing was recorded

    run(scenario())


def test_alternating_newer_checkpoint_abandons_the_unaligned_one():
    async def scenario():
        s = Subtask(2)
        h = s.alternating(60.0)
        b1 = barrier(1, ts=time.time())
        await s.announce(0, b1, 2)
        snap = await s.timer(1)
        assert snap is not None and snap.unaligned
        b2 = barrier(2, ts=time.time())
        assert await s.announce(1, b2, 0) is None  # aligned again: waits
        assert [cid for cid, _ in s.abandoned] == [1]
        assert snap.recorder.abandoned
        assert isinstance(h.state, AlternatingCollectingBarriers)

    run(scenario())
