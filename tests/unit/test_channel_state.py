"""Channel state of unaligned checkpoints: what the recorder captures through a real
InputGate, in every order of pushes, announcements, in-band barriers and takes; the blob
format; the restore check; the configuration. Ray-free."""

import pickle
import random
import re
import time

import pyarrow as pa
import pytest

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.checkpoint.metadata import CheckpointMetadata, SubtaskStateMeta
from rayflow.config import CheckpointAlignment, CheckpointConfig, CheckpointingMode
from rayflow.plan.physical import JobGraph, OperatorSpec, VertexSpec
from rayflow.runtime.barriers import (
    AlternatingWaitingForFirstBarrier,
    WaitingForFirstBarrierUnaligned,
)
from rayflow.runtime.channel_state import (
    ChannelStateRecorder,
    channel_state_size,
    decode_snapshot,
    encode_snapshot,
)
from rayflow.runtime.events import CheckpointBarrier, EndOfInput
from rayflow.runtime.restore import check_channel_state
from sinks.basic import CollectSink
from tests.unit.test_barriers import Subtask, barrier, batch, run, tag, tags

# --- the recorder on its own ------------------------------------------------------------


def test_recorder_keeps_exactly_its_range_and_completes_once():
    calls = []
    r = ChannelStateRecorder(3, [2, 0], calls.append)
    r.offer(0, 1, batch("taken"))  # before start
    r.offer(0, 2, batch("a2"))
    r.offer(0, 5, batch("a5"))  # end unknown yet: kept for now
    assert not r.end_known(0)
    r.set_end(0, 4)
    assert r.end_known(0)
    r.set_end(0, 9)  # the first end stays
    r.offer(0, 4, batch("a4"))  # at the barrier position: after it
    r.offer(0, 3, EndOfInput())
    assert calls == [] and not r.done  # channel 1's end is unknown
    r.offer(1, 1, CheckpointBarrier(2, 0.0))
    r.set_end(1, 2)
    assert calls == []  # b0 missing
    r.offer(1, 0, batch("b0"))
    assert calls == [r] and r.done
    r.offer(1, 0, batch("again"))
    r.offer(0, 2, batch("again"))
    assert calls == [r]
    # end-of-input and barriers in range are left out
    assert tags(r.channel_state()) == {0: ["a2"], 1: ["b0"]}


def test_recorder_with_empty_ranges_completes_when_the_ends_are_known():
    calls = []
    r = ChannelStateRecorder(1, [3, 0], calls.append)
    r.set_end(0, 3)
    assert calls == []
    r.set_end(1, 0)
    assert calls == [r]
    assert r.channel_state() == {}


def test_recorder_without_channels_completes_at_once():
    calls = []
    r = ChannelStateRecorder(1, [], calls.append)
    assert calls == [r] and r.done


def test_abandoned_recorder_never_completes():
    calls = []
    r = ChannelStateRecorder(1, [0], calls.append)
    r.offer(0, 0, batch("a0"))
    r.abandon()
    r.set_end(0, 2)
    r.offer(0, 1, batch("a1"))
    assert calls == [] and r.abandoned and not r.done


# --- the recorder through the handler and a real gate ------------------------------------


def test_unaligned_channel_state_is_buffered_waiting_and_late_messages_of_the_range():
    async def scenario():
        s = Subtask(2, capacity=2)
        s.unaligned()
        b = barrier(1)
        for seq in range(5):
            await s.push(0, seq, batch(f"a{seq}"))
        assert tag((await s.take())[1]) == "a0"  # processed before the snapshot
        # channel 0: a1 a2 buffered, a3 a4 waiting for buffer space
        assert sorted(s.gate._waiting[0]) == [3, 4]
        # the announcement of channel 1 comes before any of its data
        snap = await s.announce(1, b, 3)
        assert snap is not None and snap.unaligned
        await s.push(1, 2, batch("b2"))  # out of sequence order
        await s.push(1, 3, batch("b3"))  # after the barrier
        await s.push(1, 0, batch("b0"))
        assert s.completed == []
        await s.announce(0, b, 4)  # a4 is after the barrier
        assert s.completed == []  # b1 is still due
        await s.push(1, 1, batch("b1"))
        assert s.completed == [snap.recorder]
        await s.drain()
        assert s.completed == [snap.recorder]
        assert tags(snap.recorder.channel_state()) == {
            0: ["a1", "a2", "a3"],
            1: ["b0", "b1", "b2"],
        }
        assert isinstance(s.handler.state, WaitingForFirstBarrierUnaligned)

    run(scenario())


def test_stale_barrier_and_end_of_input_in_the_range_are_left_out():
    async def scenario():
        s = Subtask(2)
        h = s.alternating(1.0)
        b1 = barrier(1, ts=time.time())
        await s.push(0, 0, b1)
        await s.take()  # aligning checkpoint 1, channel 0 blocked
        await s.push(1, 0, batch("b0"))
        await s.take()
        await s.push(1, 1, b1)  # checkpoint 1's barrier, not taken yet
        await h.abort(1)
        await s.push(1, 2, batch("b2"))
        await s.push(1, 3, EndOfInput())
        b2 = barrier(2, ts=time.time() - 10)  # late: unaligned at once
        snap = await s.announce(1, b2, 4)
        assert snap is not None and snap.unaligned
        await s.announce(0, b2, 1)
        assert s.completed == [snap.recorder]
        assert tags(snap.recorder.channel_state()) == {1: ["b2"]}
        await s.drain()  # checkpoint 1's barrier is taken now: stale, dropped
        assert len(s.snapshots) == 1
        assert isinstance(h.state, AlternatingWaitingForFirstBarrier)

    run(scenario())


def _channels(rng, num_channels, in_band):
    """Per channel, the sender's messages and the barrier's position (how many come
    before it); with ``in_band`` the barrier itself is the message at that position."""
    channels = []
    for c in range(num_channels):
        before = rng.randint(0, 4)
        items = [batch(f"{c}:{seq}") for seq in range(before)]
        ended = before > 0 and rng.random() < 0.25
        if ended:
            items[-1] = EndOfInput()
        if in_band:
            items.append("BARRIER")
        after = 0 if ended else rng.randint(0, 3)
        items += [batch(f"{c}:{seq}") for seq in range(len(items), len(items) + after)]
        channels.append((items, before))
    return channels


def _pushes(channels):
    return [("push", c, seq) for c, (items, _) in enumerate(channels) for seq in range(len(items))]


def _expected(channels, start, skip=()):
    state = {}
    for c, (items, position) in enumerate(channels):
        if c in skip:
            continue
        batches = [
            tag(items[seq])
            for seq in range(start[c], position)
            if isinstance(items[seq], pa.RecordBatch)
        ]
        if batches:
            state[c] = batches
    return state


@pytest.mark.parametrize("seed", range(60))
def test_unaligned_channel_state_is_exactly_the_range_in_any_order(seed):
    """Random interleavings of pushes (out of sequence order, some waiting for space),
    announcements and takes. The subtask never takes a message after the barrier of a
    channel whose announcement it has not handled yet (see the race test below)."""
    rng = random.Random(seed)
    n = rng.randint(1, 3)
    channels = _channels(rng, n, in_band=False)
    b = barrier(1)
    events = _pushes(channels)
    events += [("announce", c) for c in range(n)]
    events += [("take",)] * rng.randint(0, 10)
    rng.shuffle(events)

    async def scenario():
        s = Subtask(n, capacity=rng.randint(1, 3))
        s.unaligned()
        announced, pushed = set(), set()
        snap, start = None, None

        def may_take():
            return s.available() and all(
                c in announced or s.gate._next_seq[c] <= channels[c][1] for c in range(n)
            )

        def due():
            return (
                snap is not None
                and len(announced) == n
                and all(
                    (c, seq) in pushed for c in range(n) for seq in range(start[c], channels[c][1])
                )
            )

        for event in events:
            if event[0] == "push":
                _, c, seq = event
                await s.push(c, seq, channels[c][0][seq])
                pushed.add((c, seq))
            elif event[0] == "announce":
                c = event[1]
                taken = list(s.gate.taken)
                decision = await s.announce(c, b, channels[c][1])
                announced.add(c)
                if snap is None:
                    assert decision is not None and decision.unaligned, event
                    snap, start = decision, taken
                else:
                    assert decision is None, event
            elif may_take():
                await s.take()
            expected = [snap.recorder] if due() else []
            assert s.completed == expected, (event, start)
        await s.drain()
        assert s.completed == [snap.recorder]
        assert tags(snap.recorder.channel_state()) == _expected(channels, start)
        assert isinstance(s.handler.state, WaitingForFirstBarrierUnaligned)
        assert s.abandoned == []

    run(scenario())


@pytest.mark.parametrize("seed", range(60))
def test_alternating_aligns_or_records_exactly_the_range_in_any_order(seed):
    """Random interleavings of pushes, announcements, takes and, in most, the alignment
    timer (which fires at a random point once scheduled)."""
    rng = random.Random(seed)
    n = rng.randint(1, 3)
    channels = _channels(rng, n, in_band=True)
    events = _pushes(channels)
    events += [("announce", c) for c in range(n)]
    if rng.random() < 0.6:  # else every barrier comes in time
        events += [("timer",)]
    events += [("take",)] * rng.randint(0, 12)
    rng.shuffle(events)

    async def scenario():
        s = Subtask(n, capacity=rng.randint(1, 3))
        s.alternating(60.0)
        b = barrier(1, ts=time.time())
        known, pushed = set(), set()  # channels whose end is known; messages pushed
        timer_due = fired = False
        snap, start, in_band_before = None, None, set()

        def barriers_taken():
            return {c for c, item in s.taken if isinstance(item, CheckpointBarrier)}

        def due():
            return (
                snap is not None
                and snap.unaligned
                and len(known) == n
                and all(
                    (c, seq) in pushed
                    for c in range(n)
                    if c not in in_band_before
                    for seq in range(start[c], channels[c][1])
                )
            )

        async def fire():
            nonlocal fired, snap, start, in_band_before
            fired = True
            taken, received = list(s.gate.taken), barriers_taken()
            decision = await s.timer(1)
            if snap is not None:
                assert decision is None
            else:
                assert decision is not None and decision.unaligned
                snap, start, in_band_before = decision, taken, received

        for event in events:
            before = len(s.snapshots)
            if event[0] == "push":
                _, c, seq = event
                item = channels[c][0][seq]
                await s.push(c, seq, b if item == "BARRIER" else item)
                pushed.add((c, seq))
            elif event[0] == "announce":
                c = event[1]
                assert await s.announce(c, b, channels[c][1]) is None, event  # in time
                known.add(c)
            elif event[0] == "timer":
                timer_due = True
            elif s.available():
                await s.take()
            known |= barriers_taken()
            if len(s.snapshots) > before and snap is None:
                snap = s.snapshots[-1]  # aligned (the timer's is set by fire())
            if timer_due and not fired and s.timers:
                assert s.timers[0][0] == 1
                await fire()
            assert len(s.snapshots) <= 1
            assert s.completed == ([snap.recorder] if due() else []), (event, start)
        await s.drain()
        assert len(s.snapshots) == 1 and len(s.timers) == 1
        snap = s.snapshots[0]
        if snap.unaligned:
            assert fired
            assert s.completed == [snap.recorder]
            # a channel whose in-band barrier was taken before the switch gives nothing
            assert tags(snap.recorder.channel_state()) == _expected(channels, start, in_band_before)
            assert all(start[c] <= channels[c][1] for c in range(n) if c not in in_band_before)
            assert s.taken_at_snapshot == [start]
        else:
            assert snap.recorder is None and s.completed == []
            # aligned: all before every barrier was taken, nothing after
            assert s.taken_at_snapshot == [[position + 1 for _, position in channels]]
        assert isinstance(s.handler.state, AlternatingWaitingForFirstBarrier)
        assert s.abandoned == []

    run(scenario())


def test_a_recorder_completing_during_a_push_does_not_hide_the_message_from_another():
    """Two unaligned checkpoints record at once (the handler is done with checkpoint 1
    once every end is known, while its data is still arriving). The push that completes
    checkpoint 1 makes the subtask stop recording it (``_channel_state_done``) while the
    gate is still handing that message to the recorders."""

    async def scenario():
        s = Subtask(1)
        h = s.unaligned()
        first = await s.announce(0, barrier(1), 2)
        assert isinstance(h.state, WaitingForFirstBarrierUnaligned)
        second = await s.announce(0, barrier(2), 3)
        assert second is not None and s.abandoned == []
        for seq in range(3):
            await s.push(0, seq, batch(f"a{seq}"))
        assert tags(first.recorder.channel_state()) == {0: ["a0", "a1"]}
        assert s.completed == [first.recorder, second.recorder]
        assert tags(second.recorder.channel_state()) == {0: ["a0", "a1", "a2"]}

    run(scenario())


@pytest.mark.parametrize("first", [0, 1])
def test_an_announcement_behind_data_already_taken_never_completes(first):
    """Announcements travel out of band (a Ray call of the control group, hopping loops),
    data in band: Ray keeps no order between them, so messages the sender sent after the
    barrier can be taken before the announcement is handled. The operator state then
    holds messages a restored sender sends again: the checkpoint must not complete."""

    async def scenario():
        s = Subtask(2)
        s.unaligned()
        b = barrier(1)
        position = {0: 0, 1: 1}  # channel 1: barrier 1 after b0
        for seq in range(3):
            await s.push(1, seq, batch(f"b{seq}"))
            await s.take()  # b1 and b2 come after the barrier
        await s.announce(first, b, position[first])
        await s.announce(1 - first, b, position[1 - first])
        assert s.completed == [], tags(s.completed[0].channel_state())
        assert [cid for cid, _ in s.abandoned] == [1]

    run(scenario())


# --- the blob --------------------------------------------------------------------------


def test_snapshot_blob_round_trip_with_channel_state():
    states = {"uid-a": {"count": 3}, "uid-b": [1, 2]}
    operator_blob = pickle.dumps(states)
    channel_state = {0: [batch("x"), batch("y")], 2: [batch("z")]}
    blob = encode_snapshot(operator_blob, channel_state)
    assert blob != operator_blob
    got_states, got_channel_state = decode_snapshot(blob)
    assert got_states == states
    assert sorted(got_channel_state) == [0, 2]
    for c, batches in channel_state.items():
        assert len(got_channel_state[c]) == len(batches)
        assert all(a.equals(b) for a, b in zip(got_channel_state[c], batches))
    assert channel_state_size(got_channel_state) == sum(
        b.nbytes for bs in channel_state.values() for b in bs
    )


def test_blob_without_channel_state_is_the_plain_operator_blob():
    states = {"uid-a": {"count": 3}}
    operator_blob = pickle.dumps(states)
    assert encode_snapshot(operator_blob, {}) == operator_blob
    # a blob of an aligned checkpoint, or of an earlier version, reads as before
    assert decode_snapshot(operator_blob) == (states, {})
    assert channel_state_size({}) == 0


# --- restoring ---------------------------------------------------------------------------


def _graph(parallelism):
    return JobGraph(
        vertices={
            i: VertexSpec(i, name, p, 128, [OperatorSpec(name, f"u{i}", dict)])
            for i, (name, p) in enumerate(parallelism.items())
        },
        edges={},
    )


def _checkpoint(parallelism, channel_state_size=100):
    subtasks = {}
    for v, (name, p) in enumerate(parallelism.items()):
        for i in range(p):
            size = channel_state_size if (v, i) == (1, 0) else 0
            subtasks[(v, i)] = SubtaskStateMeta(f"b-{v}-{i}", 10, (f"u{v}",), p, name, size)
    return CheckpointMetadata(7, "job", "run", 0, 0.0, 1.0, False, subtasks)


OLD = {"Source: numbers": 2, "Map -> Sink": 2}


def test_restore_check_refuses_channel_state_at_another_parallelism():
    changed = dict(OLD, **{"Map -> Sink": 3})
    with pytest.raises(ValueError) as info:
        check_channel_state(_graph(changed), _checkpoint(OLD), "restore_from='x'")
    message = str(info.value)
    assert "restore_from='x'" in message
    assert "checkpoint 7" in message
    assert "'Map -> Sink' 2 -> 3" in message
    assert "Source: numbers" not in message.split("changed:")[1]
    assert re.search(r"take an aligned checkpoint", message)


def test_restore_check_names_a_vertex_that_is_new_or_gone():
    # vertices are known by their operators' uids, not their names: the sink unchained
    # into a vertex of its own is a new vertex
    unchained = {"Source: numbers": 2, "Map": 2, "Sink": 2}
    with pytest.raises(ValueError, match=r"'Sink' absent -> 2") as info:
        check_channel_state(_graph(unchained), _checkpoint(OLD), "restore")
    # a chain can change without a change of code: the way back is named
    assert "disable_chaining()" in str(info.value)
    renamed_only = {"Source: numbers": 2, "Map": 2}
    check_channel_state(_graph(renamed_only), _checkpoint(OLD), "restore")


def test_restore_check_passes_at_the_same_parallelism_and_without_channel_state():
    check_channel_state(_graph(OLD), _checkpoint(OLD), "restore")
    aligned = _checkpoint(OLD, channel_state_size=0)
    assert not aligned.has_channel_state
    check_channel_state(_graph({"Source: numbers": 4, "Map -> Sink": 1}), aligned, "restore")
    # metadata written before channel state existed reads as aligned
    roundtrip = CheckpointMetadata.from_dict(aligned.to_dict())
    assert not roundtrip.has_channel_state


# --- configuration -----------------------------------------------------------------------


def test_aligned_checkpoint_timeout_configuration():
    config = CheckpointConfig()
    assert config.alignment is CheckpointAlignment.ALIGNED
    assert not config.is_unaligned_checkpoints_enabled()
    with pytest.raises(ValueError, match="timeout"):
        config.set_aligned_checkpoint_timeout(-1)
    assert config.alignment is CheckpointAlignment.ALIGNED
    config.set_aligned_checkpoint_timeout(500)
    assert config.is_unaligned_checkpoints_enabled()
    assert config.get_aligned_checkpoint_timeout() == 500
    assert config.alignment is CheckpointAlignment.ALIGNED_WITH_TIMEOUT
    config.enable_unaligned_checkpoints(False)
    assert config.alignment is CheckpointAlignment.ALIGNED
    assert config.get_aligned_checkpoint_timeout() == 0
    assert not config.is_unaligned_checkpoints_enabled()
    config.enable_unaligned_checkpoints()
    assert config.alignment is CheckpointAlignment.UNALIGNED


def _env(mode, configure):
    env = StreamExecutionEnvironment()
    env.enable_checkpointing(1000, mode)
    configure(env.get_checkpoint_config())
    env.from_source(NumberSequenceSource(0, 9)).map(lambda r: r).sink_to(CollectSink())
    return env


@pytest.mark.parametrize(
    "configure",
    [
        lambda c: c.enable_unaligned_checkpoints(),
        lambda c: c.set_aligned_checkpoint_timeout(100),
    ],
)
def test_unaligned_checkpoints_need_exactly_once(configure):
    env = _env(CheckpointingMode.AT_LEAST_ONCE, configure)
    with pytest.raises(ValueError, match=r"unaligned.*EXACTLY_ONCE.*AT_LEAST_ONCE"):
        env.get_job_graph()
    assert _env(CheckpointingMode.EXACTLY_ONCE, configure).get_job_graph().vertices
    assert _env(CheckpointingMode.AT_LEAST_ONCE, lambda c: None).get_job_graph().vertices
