"""Buffer debloating without Ray: the throughput measurement, the credit it gives each
channel, the gate admitting by that credit, and the sender's window following it.

Senders and gate run in one event loop (a push is a task); the reader's processing time
is a fake clock it advances itself, so the outcome does not depend on the machine.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from rayflow import StreamExecutionEnvironment
from rayflow.runtime.channels import InputGate, OutputChannel
from rayflow.runtime.debloat import BufferDebloater
from rayflow.runtime.deployer import Deployer
from rayflow.runtime.settings import JobSettings


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Task:
        return asyncio.ensure_future(self.fn(*args))


class FakeReceiver:
    """Stands for a subtask actor: ``push.remote`` pushes into ``gate`` in a task, after
    a random delay with ``rng`` (Ray keeps no call order)."""

    def __init__(self, gate: InputGate, rng: random.Random | None = None) -> None:
        self.gate = gate
        self.rng = rng
        self.push = _Remote(self._push)

    async def _push(self, channel: int, seq: int, attempt: int, message: Any) -> int | None:
        if self.rng is not None:
            await asyncio.sleep(self.rng.random() * 0.002)
        return await self.gate.push(channel, seq, message)


def run(coro: Any) -> Any:
    return asyncio.new_event_loop().run_until_complete(coro)


def _pipeline(channels: int, capacity: int, window: int, target_s: float, rng=None):
    clock = FakeClock()
    debloater = BufferDebloater(channels, capacity, target_s, clock=clock)
    gate = InputGate(channels, capacity, debloater)
    receiver = FakeReceiver(gate, rng)
    senders = [OutputChannel(receiver, c, 0, window, adaptive=True) for c in range(channels)]
    return clock, debloater, gate, senders


async def _send_all(sender: OutputChannel, count: int) -> None:
    for seq in range(count):
        await sender.send((sender.channel, seq))
    await sender.flush()


async def _read(gate: InputGate, clock: FakeClock, count: int, seconds_each, seen) -> None:
    """Take ``count`` messages, spending ``seconds_each(i)`` of fake time on message i."""
    for i in range(count):
        channel, item = await gate.next()
        assert item[0] == channel
        seen.append(item)
        clock.advance(seconds_each(i))
        await asyncio.sleep(0)


def _in_order(seen: list[tuple[int, int]], channels: int, count: int) -> None:
    for channel in range(channels):
        seqs = [seq for c, seq in seen if c == channel]
        assert seqs == list(range(count)), f"channel {channel} out of order or incomplete"


# --- the arithmetic --------------------------------------------------------------------


def _process(d: BufferDebloater, clock: FakeClock, count: int, seconds_each: float) -> None:
    """The reader takes ``count`` messages at once, each processed in ``seconds_each``."""
    for _ in range(count):
        d.reading()
        d.taken()
        clock.advance(seconds_each)


def test_a_slow_reader_gets_the_smallest_credit():
    clock = FakeClock()
    d = BufferDebloater(2, capacity=8, target_s=0.2, clock=clock)
    _process(d, clock, 40, 0.05)  # 20 per second: 4 drain in 0.2 s, 2 per channel
    assert d.throughput == pytest.approx(20.0, rel=0.01)
    assert d.credits == [1, 1]
    assert d.lowest_credit == 1


def test_a_fast_reader_keeps_the_full_capacity():
    clock = FakeClock()
    d = BufferDebloater(4, capacity=8, target_s=0.2, clock=clock)
    _process(d, clock, 2000, 0.0005)  # 2000 per second: 100 per channel in 0.2 s
    assert d.periods >= 4
    assert d.credits == [8, 8, 8, 8]
    assert d.lowest_credit == 8


def test_the_credit_is_half_of_each_channels_share_within_bounds():
    d = BufferDebloater(2, capacity=8, target_s=1.0, clock=FakeClock())
    assert d.credit_for(0.0) == 1
    assert d.credit_for(10.0) == 3  # 10 in 1 s, 5 per channel: 2.5 each to the buffer and window
    assert d.credit_for(9.0) == 2
    assert d.credit_for(1e9) == 8
    assert d.credit_for(float("inf")) == 8


def test_idle_time_is_not_counted_as_slowness():
    clock = FakeClock()
    d = BufferDebloater(2, capacity=8, target_s=0.2, clock=clock)
    d.reading()
    for _ in range(10):
        clock.advance(0.19)  # waiting for data: a starved reader, not a slow one
        d.idle(0.19)
        _process(d, clock, 10, 0.001)
    assert d.throughput == pytest.approx(1000.0, rel=0.01)
    assert d.credits == [8, 8]


def test_a_period_of_waiting_with_a_quick_message_does_not_swing_it():
    clock = FakeClock()
    d = BufferDebloater(1, capacity=8, target_s=0.2, clock=clock)
    _process(d, clock, 30, 0.1)  # 10 per second
    assert d.credits == [1]
    d.reading()
    clock.advance(0.3)  # the upstream paused
    d.idle(0.3)
    d.taken()
    clock.advance(0.000001)  # a marker, processed at once
    d.reading()
    assert d.throughput == pytest.approx(10.0, rel=0.25)  # not thousands
    assert d.credits == [1]


def test_the_credit_follows_the_reader_back_up():
    clock = FakeClock()
    d = BufferDebloater(1, capacity=8, target_s=0.2, clock=clock)
    _process(d, clock, 60, 0.1)
    assert d.credits == [1]
    _process(d, clock, 5000, 0.0002)
    assert d.credits == [8]
    assert d.lowest_credit == 1


def test_the_start_up_is_not_measured():
    clock = FakeClock()
    d = BufferDebloater(2, capacity=8, target_s=0.2, clock=clock)
    clock.advance(3.0)  # opening operators, restoring state: no data asked for yet
    d.reading()
    clock.advance(1.0)  # waiting for the first data
    d.idle(1.0)
    _process(d, clock, 1000, 0.001)
    assert d.throughput == pytest.approx(1000.0, rel=0.01)
    assert d.lowest_credit == 8


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="target"):
        BufferDebloater(1, 8, 0.0)
    with pytest.raises(ValueError, match="smoothing"):
        BufferDebloater(1, 8, 1.0, smoothing=0.0)


# --- gate and senders ------------------------------------------------------------------


def test_a_gate_with_a_slow_reader_ends_with_small_capacity_and_windows():
    async def main():
        clock, debloater, gate, senders = _pipeline(2, capacity=8, window=8, target_s=0.2)
        count = 120
        sending = [asyncio.ensure_future(_send_all(s, count)) for s in senders]
        seen: list = []
        await _read(gate, clock, 150, lambda i: 0.05, seen)
        # adapted: the reader drains 20 per second, 4 in the target, 2 per channel
        assert gate.limits() == [1, 1]
        assert [s.current_window for s in senders] == [1, 1]
        assert gate.buffered() <= 2
        assert all(len(s._in_flight) <= 1 for s in senders)
        await _read(gate, clock, 2 * count - 150, lambda i: 0.05, seen)
        await asyncio.gather(*sending)
        _in_order(seen, 2, count)
        assert debloater.lowest_credit == 1

    run(main())


def test_a_gate_with_a_fast_reader_keeps_full_capacity_and_windows():
    async def main():
        clock, debloater, gate, senders = _pipeline(2, capacity=8, window=6, target_s=0.2)
        count = 1500
        sending = [asyncio.ensure_future(_send_all(s, count)) for s in senders]
        seen: list = []
        await _read(gate, clock, 2 * count, lambda i: 0.0005, seen)
        await asyncio.gather(*sending)
        assert debloater.periods >= 5
        assert gate.limits() == [8, 8]
        assert debloater.lowest_credit == 8
        assert [s.current_window for s in senders] == [6, 6]  # bounded by its own window
        assert gate.max_buffered > 2
        _in_order(seen, 2, count)

    run(main())


def test_order_and_completeness_survive_credits_going_down_and_up():
    async def main():
        rng = random.Random(7)
        clock, debloater, gate, senders = _pipeline(3, 6, 5, target_s=0.3, rng=rng)
        count = 300
        sending = [asyncio.ensure_future(_send_all(s, count)) for s in senders]
        seen: list = []
        windows: set[int] = set()

        def speed(i: int) -> float:
            windows.update(s.current_window for s in senders)
            return 0.04 if (i // 150) % 2 == 0 else 0.0002  # slow, fast, slow, ...

        await _read(gate, clock, 3 * count, speed, seen)
        await asyncio.gather(*sending)
        _in_order(seen, 3, count)
        assert debloater.lowest_credit == 1  # it went down...
        assert max(windows) == 5 and min(windows) == 1  # ...and the windows followed

    run(main())


def test_a_raised_credit_admits_waiting_pushes():
    async def main():
        clock, debloater, gate, senders = _pipeline(1, capacity=8, window=8, target_s=0.2)
        sending = asyncio.ensure_future(_send_all(senders[0], 1060))
        seen: list = []
        await _read(gate, clock, 60, lambda i: 0.1, seen)
        assert gate.limits() == [1]
        buffered: list[int] = []

        def fast(i: int) -> float:
            buffered.append(gate.buffered())
            return 0.001

        await _read(gate, clock, 1000, fast, seen)
        await sending
        assert gate.limits() == [8]
        assert max(buffered[:20]) <= 1 and max(buffered) > 1  # the raise admitted more
        _in_order(seen, 1, 1060)

    run(main())


def test_off_the_gate_returns_no_credit_and_windows_stay():
    async def main():
        gate = InputGate(1, 3)
        receiver = FakeReceiver(gate)
        sender = OutputChannel(receiver, 0, 0, 4, adaptive=True)
        assert await gate.push(0, 0, "a") is None
        sender._seq = 1
        sending = asyncio.ensure_future(_send_all_from(sender, 1, 40))
        seen = []
        for _ in range(40):
            seen.append((await gate.next())[1])
            await asyncio.sleep(0)
        await sending
        assert sender.current_window == 4
        assert gate.limits() == [3]
        assert seen == ["a"] + [(0, s) for s in range(1, 40)]

    run(main())


async def _send_all_from(sender: OutputChannel, first: int, count: int) -> None:
    for seq in range(first, count):
        await sender.send((sender.channel, seq))
    await sender.flush()


def test_a_recorder_still_sees_buffered_and_waiting_messages():
    class Recorder:
        def __init__(self) -> None:
            self.offered: list[tuple[int, int]] = []

        def offer(self, channel: int, seq: int, item: Any) -> None:
            self.offered.append((channel, seq))

    async def main():
        clock, debloater, gate, senders = _pipeline(1, capacity=8, window=8, target_s=0.2)
        sending = asyncio.ensure_future(_send_all(senders[0], 100))
        seen: list = []
        await _read(gate, clock, 40, lambda i: 0.1, seen)
        assert gate.limits() == [1]
        recorder = Recorder()
        gate.record(recorder)
        first = gate.taken[0]
        await _read(gate, clock, 60, lambda i: 0.1, seen)
        await sending
        gate.stop_recording(recorder)
        assert sorted(recorder.offered) == [(0, s) for s in range(first, 100)]
        _in_order(seen, 1, 100)

    run(main())


# --- configuration ---------------------------------------------------------------------


def test_the_environment_validates_and_carries_the_target():
    env = StreamExecutionEnvironment.get_execution_environment()
    assert env.get_buffer_debloat_target_ms() is None
    with pytest.raises(ValueError, match="target_ms"):
        env.enable_buffer_debloating(target_ms=5)
    with pytest.raises(TypeError, match="target_ms"):
        env.enable_buffer_debloating(target_ms=0.5)
    assert env.enable_buffer_debloating() is env
    assert env.get_buffer_debloat_target_ms() == 1000
    env.enable_buffer_debloating(target_ms=200)
    assert env.get_buffer_debloat_target_ms() == 200
    env.disable_buffer_debloating()
    assert env.get_buffer_debloat_target_ms() is None


def test_the_deployer_hands_the_target_to_every_subtask():
    from rayflow import NumberSequenceSource
    from sinks.basic import CollectSink

    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.from_source(NumberSequenceSource(0, 9), "n").key_by("value").sum("value").sink_to(
        CollectSink()
    )
    graph = env.get_job_graph()
    for target in (None, 250):
        deployer = Deployer(graph, JobSettings("job", debloat_target_ms=target), None)
        for vertex in graph.vertices.values():
            d = deployer.deployment(vertex, 0, 0, None, [])
            assert d.debloat_target_ms == target
