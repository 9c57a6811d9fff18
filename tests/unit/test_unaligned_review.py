"""Adversarial review of unaligned checkpoints / the aligned-checkpoint timeout (3d5c8f0,
8eb91bd). Each test is a schedule that breaks a stated guarantee; all fail on the code
under review. Ray-free."""

import asyncio
import time

import pyarrow as pa
import pytest

from rayflow.checkpoint.metadata import CheckpointMetadata, SubtaskStateMeta
from rayflow.plan.physical import JobGraph, OperatorSpec, VertexSpec
from rayflow.runtime.barriers import alternating_handler, unaligned_handler
from rayflow.runtime.channel_state import channel_state_size
from rayflow.runtime.channels import InputGate
from rayflow.runtime.restore import check_channel_state
from tests.unit.test_barriers import barrier, batch, run, settle

# --- 1. the restore check keys parallelism by vertex *name* ---------------------------------
#
# Default operator names repeat ("MapBatches", "Map", "Filter", ...): a job
#   numbers -> MapBatches --rebalance--> MapBatches --rebalance--> MapBatches --> Sink
# has two vertices both named "MapBatches" (checked with get_job_graph()). The check builds
# {name: parallelism} dicts, so the last subtask of either vertex wins (in ack order for the
# old checkpoint, vertex-id order for the new graph).


def _graph(vertices):
    return JobGraph(
        vertices={
            i: VertexSpec(i, name, p, 128, [OperatorSpec(name, f"u{i}", dict)])
            for i, (name, p) in enumerate(vertices)
        },
        edges={},
    )


def _checkpoint(vertices, with_channel_state, order=None):
    """Subtask entries inserted in ``order`` of vertex ids (the coordinator inserts them
    in ack order, and from_dict/to_dict keep that order)."""
    subtasks = {}
    for v in order or range(len(vertices)):
        name, p = vertices[v]
        for i in range(p):
            size = 100 if (v, i) in with_channel_state else 0
            subtasks[(v, i)] = SubtaskStateMeta(f"b-{v}-{i}", 10, (f"u{v}",), p, name, size)
    return CheckpointMetadata(7, "job", "run", 0, 0.0, 1.0, False, subtasks)


def test_restore_check_refuses_an_unchanged_graph_when_two_vertices_share_a_name():
    graph = [("numbers -> MapBatches", 4), ("MapBatches", 2), ("MapBatches", 4), ("Sink", 4)]
    # vertex 1 (parallelism 2) happened to acknowledge last
    meta = _checkpoint(graph, {(1, 0)}, order=[0, 2, 3, 1])
    # nothing changed: this restore must be allowed (today: "'MapBatches' 2 -> 4")
    check_channel_state(_graph(graph), meta, "restore_from='x'")


def test_restore_check_misses_a_rescale_of_a_vertex_whose_name_repeats():
    old = [("numbers -> MapBatches", 4), ("MapBatches", 4), ("MapBatches", 4), ("Sink", 4)]
    new = [("numbers -> MapBatches", 4), ("MapBatches", 2), ("MapBatches", 4), ("Sink", 4)]
    # old subtasks 2 and 3 of vertex 1 hold in-flight data. After the rescale no new subtask
    # has index 2 or 3, and Subtask._load_state replays channel state only from the
    # handle with old_index == self.index (and only checks parallelism for that one), so
    # those records are silently lost.
    meta = _checkpoint(old, {(1, 2), (1, 3)})
    with pytest.raises(ValueError):
        check_channel_state(_graph(new), meta, "restore_from='x'")


def test_channel_state_of_null_typed_batches_counts_as_channel_state():
    # A batch of a null-typed column has nbytes == 0: the checkpoint must still count as
    # holding channel state (by its batch count), so a rescale from it is refused.
    state = {0: [pa.record_batch({"x": pa.nulls(3)})]}
    assert channel_state_size(state) == 0
    subtasks = {
        (0, 0): SubtaskStateMeta("b", 10, ("u0",), 1, "Map", 0, channel_state_batches=1),
    }
    meta = CheckpointMetadata(7, "job", "run", 0, 0.0, 1.0, False, subtasks)
    assert meta.has_channel_state
    assert CheckpointMetadata.from_dict(meta.to_dict()).has_channel_state
    with pytest.raises(ValueError, match="unaligned"):
        check_channel_state(_graph([("Map", 2)]), meta, "restore_from='x'")


# --- 2. an abort that arrives before the checkpoint's first barrier is forgotten ------------
#
# Coordinator aborts n (timeout under backpressure, or a decline). notify_checkpoint_aborted
# is a control call: it overtakes the in-band barrier n (and, with no order between Ray
# calls, the announcement) at subtask R. BarrierHandler.abort(n) is a no-op when n is not
# current and does not raise _latest_id, so the late barrier *starts* n: R snapshots (the
# 2PC sink rolls and pre-commits a transaction), forwards n, records channel state. A sender
# that had given n up before it forwarded it (alternating mode: it was aligning n when the
# abort came) never sends n's barrier or announcement, so R's recorder keeps every message
# of that channel (end unknown) until checkpoint n+1 reaches R.


def test_unaligned_late_announcement_of_an_aborted_checkpoint_starts_nothing():
    async def scenario():
        gate = InputGate(2, 4)
        done = []
        handler = unaligned_handler(gate, done.append, lambda *a: None)
        await handler.abort(1)  # the abort overtook every barrier of checkpoint 1
        decision = handler.on_announcement(0, barrier(1), 0)
        assert decision is None, "snapshot taken for a checkpoint already aborted"

    run(scenario())


def test_unaligned_recorder_of_an_aborted_checkpoint_keeps_a_whole_channel():
    async def scenario():
        gate = InputGate(2, 4)
        handler = unaligned_handler(gate, lambda r: None, lambda *a: None)
        await handler.abort(1)
        decision = handler.on_announcement(0, barrier(1), 0)
        pushes = []
        if decision is not None:
            # channel 1's sender gave checkpoint 1 up: its end never comes; the subtask
            # keeps taking channel 1's data (unaligned never blocks), the recorder keeps it
            for seq in range(200):
                pushes.append(asyncio.ensure_future(gate.push(1, seq, batch(seq))))
                await settle()
                await gate.next()
            kept = len(decision.recorder._items[1])
            for p in pushes:
                p.cancel()
            assert kept == 0, f"recorder of aborted checkpoint 1 holds {kept} messages"

    run(scenario())


def test_alternating_late_barrier_of_an_aborted_checkpoint_blocks_nothing():
    async def scenario():
        gate = InputGate(2, 4)
        timers = []
        handler = alternating_handler(
            gate, 60.0, lambda c, d: timers.append(c), lambda r: None, lambda *a: None
        )
        await handler.abort(1)
        assert handler.on_barrier(0, 0, barrier(1, ts=time.time())) is None
        # today: channel 0 is blocked until the alignment timeout (then an unaligned
        # snapshot of the aborted checkpoint) or until checkpoint 2 reaches this subtask
        assert not gate._blocked[0], "input blocked for a checkpoint already aborted"
        assert timers == []

    run(scenario())
