"""The buffer timeout bounds a record's wait in output buffers over its whole path.

A bundle carries the origin of its oldest item (when a source read the data); a subtask's
outputs inherit the origin of the bundle they come from, and its buffer timer fires at
origin + timeout, kept within [now, now + timeout]. Without Ray: the real subtask class
with recording receivers.
"""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa

from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
from rayflow.plan.physical import OperatorSpec, VertexSpec
from rayflow.runtime.channels import InputGate, OutputChannel
from rayflow.runtime.events import Bundle, EndOfInput, LatencyMarker
from rayflow.runtime.operators import factory
from rayflow.runtime.subtask import OutputDeployment
from tests.unit.inprocess_job import Cut
from tests.unit.test_debloat import FakeReceiver, run
from tests.unit.test_output_buffering_review import _deploy, _Receiver, _values


def _batch(values: list[int]) -> pa.RecordBatch:
    return pa.record_batch([pa.array(values, pa.int64())], ["value"])


def test_a_bundle_carries_the_origin_of_its_oldest_item():
    async def go():
        gate = InputGate(1, 64, capacity_bytes=1 << 30)
        sender = OutputChannel(FakeReceiver(gate), 0, 0, 8, False, 1 << 20, 1 << 30)
        first = await sender.write(_batch([1]), origin=50.0)
        later = await sender.write(_batch([2]), origin=70.0)
        older = await sender.write(LatencyMarker(40.0, "s", 0), origin=40.0)
        await sender.flush()
        _, bundle = await gate.next()
        return first, later, older, bundle

    first, later, older, bundle = run(go())
    # the owner arms its timer when the buffer starts, and again when an older item comes
    assert (first, later, older) == (True, False, True)
    assert isinstance(bundle, Bundle) and bundle.origin == 40.0 and len(bundle.items) == 3


def _cut_subtask(receiver: _Receiver, timeout_s: float):
    vertex = VertexSpec(1, "cut", 1, 128, operators=[OperatorSpec("cut", "cut", factory(Cut))])
    outputs = [OutputDeployment(PartitionerSpec(PartitionKind.FORWARD), [(receiver, 0)])]
    deployment, cls = _deploy(vertex, outputs, inputs=1, buffer_timeout_s=timeout_s)
    return cls(deployment)


def test_outputs_inherit_the_origin_of_the_bundle_they_come_from():
    async def no_metrics():
        return {}

    async def go():
        receiver = _Receiver()
        sub = _cut_subtask(receiver, timeout_s=60.0)
        sub.metrics = no_metrics
        running = asyncio.ensure_future(sub.run())
        origin = time.time() - 0.001
        await sub.push(0, 0, 0, Bundle((_batch([1, 2, 3]), LatencyMarker(origin, "s", 0)), origin))
        await sub.push(0, 1, 0, EndOfInput())
        await asyncio.wait_for(running, 10)
        return origin, receiver.messages

    origin, messages = run(go())
    assert _values(messages) == [1, 2, 3] and messages[-1] == EndOfInput()
    bundles = [m for m in messages if isinstance(m, Bundle)]
    assert bundles and all(b.origin == origin for b in bundles)


def test_the_timer_counts_from_the_origin_not_from_the_hop():
    """Data that already waited longer than the timeout upstream is sent at once; fresh
    data waits at most one timeout; an origin ahead of this clock never holds data longer
    than one timeout."""

    async def go():
        timeout = 5.0
        deadlines = []
        for origin in (time.time() - 10 * timeout, 0.0, time.time() + 10 * timeout):
            sub = _cut_subtask(_Receiver(), timeout_s=timeout)
            sub._loop = asyncio.get_running_loop()
            sub._origin = origin
            before = time.time()
            await sub._emit([_batch([1])])
            deadlines.append((sub._buffer_deadline - before, sub._buffer_deadline - time.time()))
        return timeout, deadlines

    timeout, ((stale_lo, stale_hi), (fresh_lo, fresh_hi), (ahead_lo, ahead_hi)) = run(go())
    assert stale_hi <= 0.0  # already due: sent at the next turn of the mailbox
    # deadline - (time before the write) and deadline - (time after it)
    assert fresh_hi <= timeout and fresh_lo > timeout / 2
    assert ahead_hi <= timeout and ahead_lo > timeout / 2


def test_an_earlier_origin_rearms_the_timer_sooner():
    async def go():
        sub = _cut_subtask(_Receiver(), timeout_s=5.0)
        sub._loop = asyncio.get_running_loop()
        await sub._emit([_batch([1])])  # fresh data: due in one timeout
        first = sub._buffer_deadline
        sub._origin = time.time() - 4.0  # older data on the same channel
        await sub._emit([_batch([2])])
        return first, sub._buffer_deadline

    first, second = run(go())
    assert second < first - 3.0
