"""The buffer timer counted from the data's origin, under adversarial schedules.

Without Ray: the real subtask class with recording receivers (see
``tests/unit/test_buffer_deadline.py``). What must hold: data never waits in an output
buffer with no timer that will send it; it is sent at the latest at the deadline of its
oldest item (its origin + the timeout, kept within [write, write + timeout]); never
before the barrier it precedes is sent after it; and a timer that was superseded by a
sooner one does not send data written after it.
"""

from __future__ import annotations

import asyncio
import random
import time

import pyarrow as pa

from rayflow.config import CheckpointingMode
from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
from rayflow.plan.physical import OperatorSpec, VertexSpec
from rayflow.runtime.events import Bundle, CheckpointBarrier, EndOfInput
from rayflow.runtime.operators import factory
from rayflow.runtime.subtask import OutputDeployment, _BufferTimeout
from tests.unit.inprocess_job import Cut
from tests.unit.test_debloat import run
from tests.unit.test_output_buffering_review import _deploy, _Receiver, _values

#: what a timer may fire ahead of its time (the loop's clock resolution, two clocks)
_EARLY_S = 0.01


def _batch(values: list[int]) -> pa.RecordBatch:
    return pa.record_batch([pa.array(values, pa.int64())], ["value"])


def _cut_vertex() -> VertexSpec:
    return VertexSpec(1, "cut", 1, 128, operators=[OperatorSpec("cut", "cut", factory(Cut))])


def _subtask(outputs, timeout_s: float, inputs: int = 1, **settings):
    deployment, cls = _deploy(_cut_vertex(), outputs, inputs=inputs, buffer_timeout_s=timeout_s)
    for name, value in settings.items():
        setattr(deployment, name, value)
    return cls(deployment)


class _TimedReceiver(_Receiver):
    """Records what is pushed and when."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    async def _push(self, channel, seq, attempt, message):
        self.times.append(time.time())
        await super()._push(channel, seq, attempt, message)


async def _serve(sub, until: float) -> None:
    """The mailbox's part for timers: take each buffer timeout as it is posted."""
    while time.monotonic() < until:
        item = sub.gate.poll_control()
        if item is not None:
            await sub._on_control(item)
        await asyncio.sleep(0.002)


def test_a_superseded_timer_does_not_send_data_written_after_it():
    """Schedule: fresh data is written (timer A armed for now + T); older data follows
    (timer B armed sooner, for now: it supersedes A); B fires and the mailbox sends both.
    T/2 later fresh data C is written: its timer is due T after it. A, superseded, still
    fires at the first write + T and sends C half a timeout before C's deadline: every
    re-arm leaves a timer behind that cuts a later buffer short."""
    timeout = 0.4

    async def go():
        receiver = _TimedReceiver()
        forward = PartitionerSpec(PartitionKind.FORWARD)
        sub = _subtask([OutputDeployment(forward, [(receiver, 0)])], timeout)
        sub._loop = asyncio.get_running_loop()
        await sub._emit([_batch([1])])  # A
        sub._origin = time.time() - timeout  # due at once
        await sub._emit([_batch([2])])  # B
        sub._origin = 0.0
        await _serve(sub, time.monotonic() + timeout / 2)
        assert _values(receiver.messages) == [1, 2]
        written = time.time()
        await sub._emit([_batch([3])])  # C
        due = sub._buffer_deadline
        assert due is not None and due >= written + timeout - _EARLY_S
        await _serve(sub, time.monotonic() + 2 * timeout)
        sent = [t for t, m in zip(receiver.times, receiver.messages) if 3 in _values([m])]
        return due, sent

    due, sent = run(go())
    assert len(sent) == 1
    assert sent[0] >= due - _EARLY_S, f"C sent {due - sent[0]:.3f} s before its deadline"


def test_a_write_after_a_timer_fired_and_before_it_was_served_is_sent_by_it():
    """Schedule: the timer fires and posts its flush while the mailbox is busy (the flush
    waits in the control queue, the deadline already past); the mailbox writes more data
    (no new timer: the one armed is due); then it serves the flush: everything goes, and
    the next write arms a timer again."""

    async def go():
        receiver = _Receiver()
        forward = PartitionerSpec(PartitionKind.FORWARD)
        sub = _subtask([OutputDeployment(forward, [(receiver, 0)])], 0.01)
        sub._loop = asyncio.get_running_loop()
        await sub._emit([_batch([1])])
        while not any(isinstance(c, _BufferTimeout) for c in sub.gate._control):
            await asyncio.sleep(0.002)  # fired, not served
        await sub._emit([_batch([2])])
        queued = sub._buffer_deadline
        await sub._on_control(sub.gate.poll_control())
        await asyncio.sleep(0)  # the pushes run
        after_flush = (sub._buffer_deadline, sub.writers[0].channels[0].buffered)
        await sub._emit([_batch([3])])
        return queued, after_flush, sub._buffer_deadline, _values(receiver.messages)

    queued, after_flush, rearmed, values = run(go())
    assert queued is not None and after_flush == (None, False)
    assert rearmed is not None and values == [1, 2]


def test_output_buffered_while_a_barrier_is_aligned_is_sent_by_the_timer():
    """Schedule (aligned checkpoint): the barrier comes on channel 0, which is blocked;
    a bundle on channel 1 is processed and its outputs wait in the output buffer; the
    barrier on channel 1 does not come. The timer still sends them (control messages are
    served while a channel is blocked): the data before a barrier is not held back until
    the alignment ends."""

    async def go():
        receiver = _Receiver()
        forward = PartitionerSpec(PartitionKind.FORWARD)
        sub = _subtask(
            [OutputDeployment(forward, [(receiver, 0)])],
            0.02,
            inputs=2,
            checkpointing=CheckpointingMode.EXACTLY_ONCE,
        )

        async def no_metrics():
            return {}

        sub.metrics = no_metrics
        running = asyncio.ensure_future(sub.run())
        await sub.push(0, 0, 0, CheckpointBarrier(1, time.time()))
        await sub.push(1, 0, 0, Bundle((_batch([1, 2, 3]),), time.time()))
        try:
            await asyncio.wait_for(receiver.arrived.wait(), 5.0)
            return sub.barriers.aligning, _values(receiver.messages)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    aligning, values = run(go())
    assert aligning and values == [1, 2, 3]


class _RecordingLoop:
    """Notes every timer the subtask arms: its wall-time deadline, whether it fired."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timers: list[tuple[float, asyncio.TimerHandle, list[bool]]] = []
        original = loop.call_at  # ``call_later`` arms its timer with it too

        def call_at(when, callback, *args, **kwargs):
            fired = [False]

            def fire(*a):
                fired[0] = True
                callback(*a)

            handle = original(when, fire, *args, **kwargs)
            self.timers.append((time.time() + (when - loop.time()), handle, fired))
            return handle

        loop.call_at = call_at

    def pending(self) -> list[float]:
        """Deadlines of the timers armed that have neither fired nor been cancelled."""
        return [d for d, h, fired in self.timers if not fired[0] and not h.cancelled()]


def test_every_buffered_item_has_a_timer_due_by_its_deadline_whatever_the_schedule():
    """Random schedules of writes with origins of every kind (now, older, older than the
    timeout, ahead of this clock), timers served late or early, buffers sent by a size
    limit, by an announced barrier (``send_buffered_now``) or by a barrier in band: after
    each step, every channel holding data has a timer armed (or its flush posted) due at
    the latest at the deadline of its oldest item; and each receiver gets every value
    once, in order, with no value written before a barrier after it."""
    timeout = 0.02

    async def go(seed: int) -> None:
        rng = random.Random(seed)
        loop = asyncio.get_running_loop()
        timers = _RecordingLoop(loop)
        receivers = [_Receiver() for _ in range(4)]
        rebalance = PartitionerSpec(PartitionKind.REBALANCE)
        forward = PartitionerSpec(PartitionKind.FORWARD)
        outputs = [
            OutputDeployment(rebalance, [(r, 0) for r in receivers[:3]]),
            OutputDeployment(forward, [(receivers[3], 0)]),
        ]
        sub = _subtask(outputs, timeout, buffer_bytes=rng.choice([64, 400, 1 << 20]))
        sub._loop = loop

        def post_at_once(item):  # a fired timer's flush is in the queue when it returns
            sub.gate._control.append(item)
            done = loop.create_future()
            done.set_result(None)
            return done

        sub.gate.put_control = post_at_once
        channels = [c for w in sub.writers for c in w.channels]
        due: dict[int, float] = {}  # per channel, the deadline of its oldest item
        written: list[int] = []
        barriers: list[tuple[int, int]] = []  # (checkpoint, values written before it)
        value = 0
        for _ in range(150):
            step = rng.random()
            if step < 0.45:
                now = time.time()
                chosen = rng.choice(
                    [0.0, now - rng.random() * timeout, now - 10 * timeout, now + timeout]
                )
                sub._origin = chosen
                held = [len(c._buffer) for c in channels]
                batch = _batch(list(range(value, value + rng.randint(1, 4))))
                value += batch.num_rows
                await sub._emit([batch])
                sub._origin = 0.0
                written.extend(batch["value"].to_pylist())
                after = time.time()
                origin = chosen or after  # 0.0: the time of the write
                bound = min(max(origin + timeout, after), after + timeout)
                for i, c in enumerate(channels):
                    if not c.buffered:
                        due.pop(i, None)
                    elif len(c._buffer) > held[i] or i not in due:
                        due[i] = min(due.get(i, bound), bound)
            elif step < 0.7:
                await asyncio.sleep(rng.random() * timeout)
            elif step < 0.85:
                while (item := sub.gate.poll_control()) is not None:
                    await sub._on_control(item)
            elif step < 0.93:
                rng.choice(channels).send_buffered_now()
            else:
                barrier = CheckpointBarrier(len(barriers) + 1, time.time())
                barriers.append((barrier.checkpoint_id, len(written)))
                for w in sub.writers:
                    await w.broadcast(barrier)
            for i, c in enumerate(channels):
                if not c.buffered:
                    due.pop(i, None)
            posted = any(isinstance(c, _BufferTimeout) for c in sub.gate._control)
            for i in due:
                assert sub._buffer_deadline is not None, (seed, i)
                assert sub._buffer_deadline <= due[i] + 1e-6, (seed, i)
                soonest = min(timers.pending(), default=None)
                # (a timer's deadline is noted a moment after the subtask computed it)
                assert posted or (soonest is not None and soonest <= due[i] + 1e-3), (seed, i)
        for w in sub.writers:
            await w.broadcast(EndOfInput())
        await asyncio.sleep(0)
        # every value once per out-edge, in order per channel, and none written before a
        # barrier after it
        for edge in (receivers[:3], receivers[3:]):
            got = [v for r in edge for v in _values(r.messages)]
            assert sorted(got) == sorted(written) and len(got) == len(written), seed
            for r in edge:
                assert _values(r.messages) == sorted(_values(r.messages)), seed
                for at, m in enumerate(r.messages):
                    if isinstance(m, CheckpointBarrier):
                        before = set(written[: dict(barriers)[m.checkpoint_id]])
                        assert not before & set(_values(r.messages[at:])), seed

    for seed in range(12):
        run(go(seed))


def test_a_wall_clock_stepped_back_does_not_postpone_the_armed_timer(monkeypatch):
    """Schedule: fresh data is written (its timer due one timeout T later); the wall
    clock then steps back by T (a clock set by NTP, a resumed VM); a moment later more
    fresh data is written. By the stepped clock that data is due before the armed timer,
    in fact after it: the armed timer must stay, or the first data waits longer than
    one timeout at this hop."""
    from types import SimpleNamespace

    from rayflow.runtime import subtask as subtask_module

    timeout = 1.0
    step = [0.0]
    clock = SimpleNamespace(
        time=lambda: time.time() - step[0], monotonic=time.monotonic, sleep=time.sleep
    )
    monkeypatch.setattr(subtask_module, "time", clock)

    async def go():
        timers = _RecordingLoop(asyncio.get_running_loop())
        forward = PartitionerSpec(PartitionKind.FORWARD)
        sub = _subtask([OutputDeployment(forward, [(_Receiver(), 0)])], timeout)
        sub._loop = asyncio.get_running_loop()
        await sub._emit([_batch([1])])
        first_due = time.time() + timeout
        step[0] = timeout
        await asyncio.sleep(0.1)
        await sub._emit([_batch([2])])
        return first_due, min(timers.pending())

    first_due, soonest = run(go())
    assert soonest <= first_due + 0.01, f"the first data is sent {soonest - first_due:.3f} s late"
