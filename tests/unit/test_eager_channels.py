"""Output channels at a buffer timeout of 0 (``eager``), without Ray: every item goes at
once while the window has room; what is written while it is full gathers and goes as one
bundle when a push is acknowledged; only a full buffer holds the writer; order, events
and failures are kept.

Senders and gate run in one event loop; a push is a task (the fake receiver), so calls
may arrive out of order as with Ray.
"""

from __future__ import annotations

import asyncio
import random

import pyarrow as pa
import pytest

from rayflow.runtime.channels import InputGate, OutputChannel
from rayflow.runtime.events import Bundle, CheckpointBarrier, EndOfInput, LatencyMarker, unbundled
from tests.unit.test_debloat import FakeReceiver, run


def batch(lo: int, rows: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(range(lo, lo + rows), pa.int64())], ["value"])


def eager(gate: InputGate, window: int = 2, buffer_bytes: int = 1 << 20, rng=None, **kw):
    return OutputChannel(
        FakeReceiver(gate, rng), 0, 0, window, False, buffer_bytes, 1 << 30, True, **kw
    )


def values_of(messages) -> list[int]:
    return [
        v
        for m in messages
        for item in unbundled(m)
        if isinstance(item, pa.RecordBatch)
        for v in item["value"].to_pylist()
    ]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_an_eager_channel_needs_a_buffer_size():
    with pytest.raises(ValueError, match="buffer_bytes"):
        OutputChannel(None, 0, 0, 2, False, 0, 1 << 20, True)


def test_with_room_every_item_goes_at_once_as_it_is():
    async def go():
        gate = InputGate(1, 64, capacity_bytes=1 << 30)
        sender = eager(gate, window=8)
        for i in range(5):
            assert await sender.write(batch(10 * i, 10)) is False
            await settle()  # acknowledged before the next write
        assert sender.position == 5 and not sender.buffered and sender.bundles == 0
        await sender.flush()
        return [(await gate.next())[1] for _ in range(5)]

    messages = run(go())
    assert all(isinstance(m, pa.RecordBatch) for m in messages)
    assert values_of(messages) == list(range(50))


def test_a_full_window_does_not_hold_the_writer_and_what_it_wrote_goes_as_one_bundle():
    async def go():
        # The receiver has room for one message: pushes after it wait for the reader.
        gate = InputGate(1, 1, capacity_bytes=1 << 30)
        sender = eager(gate, window=4)
        for i in range(5):  # 0 admitted and acknowledged; 1-4 in flight (the window)
            await sender.write(batch(10 * i, 10))
            await settle()
        assert sender.position == 5 and not sender.buffered
        for i in range(5, 8):
            # would wait for the reader if a full window held the writer
            await asyncio.wait_for(sender.write(batch(10 * i, 10)), 1.0)
        assert sender.position == 5 and sender.buffered  # gathered, nothing sent
        # the reader takes messages: acknowledgements make room, the gathered go as one
        taken = [(await gate.next())[1] for _ in range(4)]
        for _ in range(20):
            await settle()
            if not sender.buffered:
                break
        assert not sender.buffered and sender.position == 6
        await sender.send(EndOfInput())
        flushing = asyncio.ensure_future(sender.flush())
        while not isinstance(message := (await gate.next())[1], EndOfInput):
            taken.append(message)
        await flushing
        return taken, sender.bundles

    taken, bundles = run(go())
    assert values_of(taken) == list(range(80))
    assert isinstance(taken[-1], Bundle) and len(taken[-1].items) == 3  # 5, 6, 7
    assert bundles == 1


def test_only_a_full_buffer_makes_the_writer_wait():
    async def go():
        gate = InputGate(1, 1, capacity_bytes=1 << 30)
        sender = eager(gate, window=4, buffer_bytes=3 * 80)  # 3 batches of 10 int64 rows
        for i in range(5):  # 0 admitted; 1-4 in flight: the window is full
            await sender.write(batch(10 * i, 10))
            await settle()
        for i in range(5, 7):
            await asyncio.wait_for(sender.write(batch(10 * i, 10)), 1.0)
        # the third gathered batch fills the buffer (240 bytes): now the writer waits
        blocked = asyncio.ensure_future(sender.write(batch(70, 10)))
        await asyncio.sleep(0.05)
        assert not blocked.done() and sender.position == 5
        taken = [(await gate.next())[1] for _ in range(3)]  # acknowledges 1-3
        await asyncio.wait_for(blocked, 1.0)
        assert sender.position == 6  # the three went as one bundle

        async def finish():
            await sender.send(EndOfInput())
            await sender.flush()

        flushing = asyncio.ensure_future(finish())
        while not isinstance(message := (await gate.next())[1], EndOfInput):
            taken.append(message)
        await flushing
        return taken

    taken = run(go())
    assert values_of(taken) == list(range(80))
    assert [len(unbundled(m)) for m in taken] == [1, 1, 1, 1, 1, 3]


def test_events_and_markers_go_after_what_was_gathered_before_them():
    async def go():
        gate = InputGate(1, 1, capacity_bytes=1 << 30)
        sender = eager(gate, window=3)
        for i in range(4):  # 0 admitted; 1-3 in flight
            await sender.write(batch(10 * i, 10))
            await settle()
        await sender.write(LatencyMarker(1.0, "s", 0))  # gathered
        await sender.write(batch(40, 10))  # gathered
        assert sender.buffered and sender.position == 4
        sending = asyncio.ensure_future(sender.send(CheckpointBarrier(1, 0.0)))
        messages = []
        while not isinstance(message := (await gate.next())[1], CheckpointBarrier):
            messages.append(message)
        await sending
        await sender.flush()
        return messages

    messages = run(go())
    assert values_of(messages) == list(range(50))
    kinds = [type(i).__name__ for m in messages for i in unbundled(m)]
    assert kinds == ["RecordBatch"] * 4 + ["LatencyMarker", "RecordBatch"]
    assert isinstance(messages[-1], Bundle)


class _Receiver:
    """A receiver whose n-th push does ``behaviour[n]``: "ok", "fail" (a lost subtask) or
    "hang" (never acknowledged)."""

    def __init__(self, *behaviour: str) -> None:
        self.behaviour = behaviour
        self.push = self

    def remote(self, channel, seq, attempt, message):
        what = self.behaviour[seq]

        async def push():
            await asyncio.sleep(0.005)
            if what == "fail":
                raise ConnectionError(f"push {seq} lost")
            if what == "hang":
                await asyncio.Event().wait()

        return asyncio.ensure_future(push())


def test_a_failed_push_fails_the_next_write_even_when_a_callback_saw_it_first():
    async def go():
        sender = OutputChannel(
            _Receiver("ok", "fail", "hang"), 0, 0, 2, False, 1 << 20, 1 << 30, True
        )
        await sender.write(batch(0, 10))
        await asyncio.sleep(0.02)  # acknowledged
        await sender.write(batch(10, 10))  # fails soon
        await sender.write(batch(20, 10))  # never acknowledged
        await sender.write(batch(30, 10))  # gathered: the window is full
        await asyncio.sleep(0.03)  # the failure reached the callback first
        assert sender.buffered and sender.position == 3  # not sent past a failed push
        with pytest.raises(ConnectionError, match="push 1 lost"):
            await sender.write(batch(40, 10))
        with pytest.raises(ConnectionError, match="push 1 lost"):
            await sender.flush()

    run(go())


def test_a_failed_push_fails_the_flush():
    async def go():
        sender = OutputChannel(_Receiver("fail"), 0, 0, 4, False, 1 << 20, 1 << 30, True)
        await sender.write(batch(0, 10))
        with pytest.raises(ConnectionError):
            await sender.flush()

    run(go())


@pytest.mark.parametrize("seed", range(6))
def test_out_of_order_pushes_and_a_slow_reader_keep_order_exactly_once(seed):
    rng = random.Random(seed)

    async def go():
        gate = InputGate(1, rng.choice([1, 2, 4]), capacity_bytes=1 << 30)
        sender = eager(
            gate,
            window=rng.choice([1, 2, 4, 8]),
            buffer_bytes=rng.choice([80, 400, 1 << 20]),
            rng=random.Random(seed + 100),
        )

        async def write_all():
            for i in range(300):
                await sender.write(batch(10 * i, 10))
                if rng.random() < 0.05:
                    await sender.send(CheckpointBarrier(i, 0.0))
                if rng.random() < 0.1:
                    await asyncio.sleep(rng.random() * 0.002)
            await sender.send(EndOfInput())
            await sender.flush()

        async def read_all():
            values = []
            while True:
                _, message = await gate.next()
                if isinstance(message, EndOfInput):
                    return values
                values.extend(values_of([message]))
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.random() * 0.003)

        _, values = await asyncio.gather(write_all(), read_all())
        return values, sender.bundles

    values, bundles = run(go())
    assert values == list(range(3000))


class _Held:
    """A receiver whose pushes are acknowledged only when released (``release(seq)``);
    the calls numbered in ``refuse`` (0: the first) raise from ``remote`` at once (Ray
    raises from ``.remote()`` itself, e.g. when the object store cannot take the
    argument); a later call with the same sequence number goes through."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.refuse = refuse
        self.calls = 0
        self.push = self
        self.messages: dict[int, object] = {}
        self._released: dict[int, asyncio.Event] = {}

    def _event(self, seq: int) -> asyncio.Event:
        return self._released.setdefault(seq, asyncio.Event())

    def release(self, *seqs: int) -> None:
        for seq in seqs:
            self._event(seq).set()

    def remote(self, channel, seq, attempt, message):
        self.calls += 1
        if self.calls - 1 in self.refuse:
            raise MemoryError(f"push {seq} refused")
        self.messages[seq] = message

        async def push():
            await self._event(seq).wait()

        return asyncio.ensure_future(push())


def test_a_push_the_callback_could_not_make_fails_the_next_flush_and_loses_nothing():
    """Schedule: the window is full, a batch is gathered and the callback is armed; the
    oldest push is acknowledged and the callback takes the buffer and pushes it, but
    ``.remote()`` raises (the object store is full). In a done-callback the error only
    reaches the loop's exception handler: the taken bundle is gone without having used a
    sequence number, so what is written next takes its place and arrives in order, and
    the flush at the end succeeds -- the job reports success for a batch never sent."""

    async def go():
        receiver = _Held(refuse=(2,))
        sender = OutputChannel(receiver, 0, 0, 2, False, 1 << 20, 1 << 30, True)
        await sender.write(batch(0, 10))  # seq 0
        await sender.write(batch(10, 10))  # seq 1: the window is full
        await sender.write(batch(20, 10))  # gathered, the callback armed on seq 0
        assert sender.buffered and sender.position == 2
        receiver.release(0)
        await settle()  # the callback ran: the push of the gathered batch raised
        receiver.release(*range(1, 10))
        failed = None
        try:
            await sender.write(batch(30, 10))
            await sender.flush()
        except MemoryError as exc:
            failed = exc
        return failed, receiver.messages

    failed, messages = run(go())
    sent = values_of(messages[s] for s in sorted(messages))
    # Either the failure surfaces, or nothing was lost: never a gap that nobody sees.
    assert failed is not None or sent == list(range(40)), sent
    assert failed is not None and "push 2 refused" in str(failed)


def test_failed_pushes_behind_the_one_raised_are_not_reported_as_unretrieved_errors():
    """Schedule: the receiver dies with several pushes in flight; the next write raises
    the oldest failure and the attempt ends. The younger failed pushes were never awaited:
    as futures (``as_future``) each logs "exception was never retrieved" with its
    traceback when collected -- on every restart, one error log per push in flight, for a
    failure already raised (an object ref that is never awaited logs nothing)."""
    import gc

    reported: list[str] = []

    async def go():
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: reported.append(context["message"])
        )
        sender = OutputChannel(
            _Receiver("ok", "fail", "fail", "fail"), 0, 0, 4, False, 1 << 20, 1 << 30, True
        )
        for i in range(4):
            await sender.write(batch(10 * i, 10))
        await asyncio.sleep(0.03)  # every push has failed
        with pytest.raises(ConnectionError, match="push 1 lost"):
            await sender.write(batch(40, 10))
        del sender
        for _ in range(3):
            gc.collect()
            await settle()

    run(go())
    assert not [m for m in reported if "never retrieved" in m], reported


def test_no_barrier_is_announced_after_a_push_the_callback_could_not_make():
    """Schedule: the callback's push of the gathered bundle raised (nothing of it was
    sent, no sequence number used); then an unaligned checkpoint announces its barrier
    with the channel's position. That position counts none of the lost batches: the
    receiver would take its channel state and acknowledge a checkpoint behind which
    they are missing. The announcement must fail instead."""

    async def go():
        receiver = _Held(refuse=(2,))
        sender = OutputChannel(receiver, 0, 0, 2, False, 1 << 20, 1 << 30, True)
        await sender.write(batch(0, 10))
        await sender.write(batch(10, 10))
        await sender.write(batch(20, 10))  # gathered
        receiver.release(0)
        await settle()  # the callback's push raised
        with pytest.raises(MemoryError, match="push 2 refused"):
            sender.send_buffered_now()
            _ = sender.position  # what an announcement would carry

    run(go())
