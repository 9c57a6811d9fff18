"""Output buffering without Ray: an output channel coalescing batches into bundles, the
byte limits of the gate and of the sender's window, channel state opening bundles, and
sources sizing their batches by bytes.

Senders and gate run in one event loop; a push is a task (the fake receiver of the
debloating tests), so calls may arrive out of order as with Ray.
"""

from __future__ import annotations

import asyncio
import random

import pyarrow as pa
import pytest

from rayflow import CollectionSource, NumberSequenceSource, StreamExecutionEnvironment
from rayflow.runtime.channel_state import ChannelStateRecorder
from rayflow.runtime.channels import InputGate, OutputChannel, message_bytes
from rayflow.runtime.deployer import Deployer
from rayflow.runtime.events import Bundle, CheckpointBarrier, EndOfInput, LatencyMarker, unbundled
from rayflow.runtime.settings import JobSettings
from rayflow.sources import DEFAULT_BATCH_BYTES, batch_rows
from tests.unit.test_debloat import FakeReceiver, run


def batch(lo: int, rows: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(range(lo, lo + rows), pa.int64())], ["value"])


def _channel(buffer_bytes: int, window: int = 4, window_bytes: int = 1 << 30, rng=None):
    gate = InputGate(1, 64, capacity_bytes=1 << 30)
    sender = OutputChannel(FakeReceiver(gate, rng), 0, 0, window, False, buffer_bytes, window_bytes)
    return gate, sender


async def _drain(gate: InputGate, count: int) -> list:
    return [(await gate.next())[1] for _ in range(count)]


def test_batches_wait_until_the_buffer_is_full_then_go_as_one_bundle():
    async def go():
        gate, sender = _channel(buffer_bytes=3 * 800)  # 3 batches of 100 int64 rows
        started = [await sender.write(batch(100 * i, 100)) for i in range(5)]
        assert started == [True, False, False, True, False]  # full after the third
        assert sender.position == 1 and sender.buffered
        await sender.flush()
        assert sender.position == 2 and not sender.buffered
        first, second = await _drain(gate, 2)
        return first, second, sender.bundles

    first, second, bundles = run(go())
    assert isinstance(first, Bundle) and isinstance(second, Bundle) and bundles == 2
    values = [v for m in (first, second) for b in unbundled(m) for v in b["value"].to_pylist()]
    assert values == list(range(500))
    # batches are kept as written, never concatenated
    assert [b.num_rows for b in first.items] == [100, 100, 100]


def test_an_event_sends_what_is_buffered_first_and_markers_stay_in_order():
    async def go():
        gate, sender = _channel(buffer_bytes=1 << 20)
        await sender.write(batch(0, 10))
        marker = LatencyMarker(1.0, "s", 0)
        await sender.write(marker)
        await sender.write(batch(10, 10))
        await sender.send(CheckpointBarrier(1, 0.0))
        await sender.write(batch(20, 10))
        await sender.send(EndOfInput())
        await sender.flush()
        return await _drain(gate, 4)

    bundle, barrier, single, end = run(go())
    assert isinstance(bundle, Bundle)
    assert [type(i).__name__ for i in bundle.items] == [
        "RecordBatch",
        "LatencyMarker",
        "RecordBatch",
    ]
    assert barrier == CheckpointBarrier(1, 0.0)
    # alone: a bundle of one (it carries its origin)
    assert isinstance(single, Bundle) and len(single.items) == 1
    assert single.items[0]["value"][0].as_py() == 20
    assert end == EndOfInput()


def test_without_buffer_bytes_every_write_goes_at_once():
    async def go():
        gate, sender = _channel(buffer_bytes=0)
        assert [await sender.write(batch(i, 5)) for i in range(3)] == [False] * 3
        assert sender.position == 3 and not sender.buffered
        await sender.flush()
        return await _drain(gate, 3)

    assert all(isinstance(m, pa.RecordBatch) for m in run(go()))


def test_send_buffered_now_counts_the_buffer_in_the_position_without_waiting():
    async def go():
        gate, sender = _channel(buffer_bytes=1 << 20, window=1)
        await sender.write(batch(0, 10))
        await sender.send_buffered()  # one push in flight: the window is full
        await sender.write(batch(10, 10))
        sender.send_buffered_now()  # does not wait for the window
        assert sender.position == 2 and not sender.buffered
        await sender.flush()
        return await _drain(gate, 2)

    first, second = (unbundled(m) for m in run(go()))
    assert len(first) == len(second) == 1
    assert first[0]["value"][0].as_py() == 0 and second[0]["value"][0].as_py() == 10


def test_the_window_in_bytes_holds_the_sender_back_but_a_big_message_still_goes():
    async def go():
        gate = InputGate(1, 64, capacity_bytes=1 << 30)
        sender = OutputChannel(FakeReceiver(gate), 0, 0, 64, False, 0, window_bytes=2000)
        big = batch(0, 1000)  # 8000 bytes: over the window, goes alone
        await sender.write(big)
        assert len(sender._in_flight) == 1
        await sender.write(batch(0, 100))  # waits for the big one first
        assert len(sender._in_flight) == 1
        await sender.write(batch(0, 100))  # 800 + 800 <= 2000: both in flight
        assert len(sender._in_flight) == 2
        await sender.flush()

    run(go())


def test_the_gate_admits_by_bytes_and_a_big_message_only_into_an_empty_buffer():
    async def go():
        gate = InputGate(1, 16, capacity_bytes=2000)
        pushes = [asyncio.ensure_future(gate.push(0, s, batch(s, 100))) for s in range(3)]
        big = asyncio.ensure_future(gate.push(0, 3, batch(3, 1000)))
        await asyncio.sleep(0.01)
        assert gate.buffered() == 2  # 1600 bytes; a third would exceed 2000
        taken = [(await gate.next())[1]["value"][0].as_py() for _ in range(3)]
        await asyncio.sleep(0.01)
        assert gate.buffered() == 1 and big.done()  # the big one, alone
        await asyncio.gather(*pushes)
        assert (await gate.next())[1].num_rows == 1000
        return taken

    assert run(go()) == [0, 1, 2]


def test_out_of_order_pushes_keep_order_with_bundles():
    async def go():
        gate = InputGate(1, 4, capacity_bytes=4000)
        sender = OutputChannel(
            FakeReceiver(gate, random.Random(7)), 0, 0, 4, False, 1600, window_bytes=4000
        )

        async def write_all():
            for i in range(200):
                await sender.write(batch(10 * i, 10))
                if i % 37 == 0:
                    await sender.send(CheckpointBarrier(i, 0.0))
            await sender.send(EndOfInput())
            await sender.flush()

        async def read_all():
            values = []
            while True:
                _, message = await gate.next()
                if isinstance(message, EndOfInput):
                    return values
                for item in unbundled(message):
                    if isinstance(item, pa.RecordBatch):
                        values.extend(item["value"].to_pylist())

        _, values = await asyncio.gather(write_all(), read_all())
        return values

    assert run(go()) == list(range(2000))


def test_message_bytes_counts_only_batches():
    b = batch(0, 100)
    assert message_bytes(b) == b.nbytes == 800
    assert message_bytes(Bundle((b, LatencyMarker(0.0, "s", 0), b))) == 1600
    assert message_bytes(CheckpointBarrier(1, 0.0)) == message_bytes(EndOfInput()) == 0


def test_channel_state_opens_bundles_and_leaves_markers_out():
    done = []
    recorder = ChannelStateRecorder(4, [0], done.append)
    b0, b1, b2 = batch(0, 3), batch(3, 3), batch(6, 3)
    recorder.offer(0, 0, Bundle((b0, LatencyMarker(0.0, "s", 0), b1)))
    recorder.offer(0, 1, b2)
    recorder.set_end(0, 2)
    assert done == [recorder]
    assert recorder.channel_state() == {0: [b0, b1, b2]}


def test_sources_size_batches_by_bytes_unless_given_rows():
    assert NumberSequenceSource(0, 10).batch_size == DEFAULT_BATCH_BYTES // 8
    assert NumberSequenceSource(0, 10, batch_size=7).batch_size == 7
    # a rate-limited source reads at most 10 ms worth per batch
    assert NumberSequenceSource(0, 10, records_per_second=50_000).batch_size == 500
    wide = pa.table(
        {"a": pa.array(range(1000), pa.int64()), "b": pa.array(range(1000), pa.int64())}
    )
    assert CollectionSource(wide).batch_size == DEFAULT_BATCH_BYTES // 16
    assert batch_rows(1e9, None) == 1  # a row bigger than the target: one per batch
    with pytest.raises(ValueError, match="NumberSequenceSource: batch_size must be a positive int"):
        NumberSequenceSource(0, 10, batch_size=0)
    with pytest.raises(ValueError, match="CollectionSource: batch_size"):
        CollectionSource([{"a": 1}], batch_size=-1)


def test_buffer_settings_reach_every_subtask_and_bad_values_name_the_option():
    env = StreamExecutionEnvironment.get_execution_environment()
    assert env.get_buffer_timeout() == 100
    env.set_buffer_timeout(0).set_output_buffer_size(4096).set_buffer_limits(4, 2, 10_000)
    env.from_collection([{"a": 1}]).key_by("a").sum("a").print()
    graph = env.get_job_graph()
    settings = JobSettings(
        job_name="j",
        buffer_timeout_ms=env.get_buffer_timeout(),
        buffer_bytes=4096,
        channel_bytes=10_000,
    )
    vertex = next(iter(graph.vertices.values()))
    d = Deployer(graph, settings, None).deployment(vertex, 0, 0, None, [])
    assert (d.buffer_timeout_s, d.buffer_bytes, d.channel_bytes) == (0.0, 4096, 10_000)
    with pytest.raises(ValueError, match="set_buffer_timeout: timeout_ms"):
        env.set_buffer_timeout(-1)
    with pytest.raises(ValueError, match="set_buffer_timeout"):
        env.set_buffer_timeout(1.5)
    with pytest.raises(ValueError, match="set_output_buffer_size"):
        env.set_output_buffer_size(0)
    with pytest.raises(ValueError, match="set_buffer_limits"):
        env.set_buffer_limits(8, 8, 0)
    with pytest.raises(ValueError, match="set_buffer_limits: channel_bytes"):
        env.set_buffer_limits(8, 8, 2.5)


def test_the_message_size_is_automatic_until_a_job_sets_it():
    env = StreamExecutionEnvironment.get_execution_environment()
    assert env.get_output_buffer_size() is None  # sized per channel (test_deployer)
    assert env.set_output_buffer_size(4096).get_output_buffer_size() == 4096


def test_a_bundle_holds_at_most_a_window_of_items_and_the_gate_counts_items():
    async def go():
        gate = InputGate(1, 4, capacity_bytes=1 << 30)
        sender = OutputChannel(FakeReceiver(gate), 0, 0, 3, False, 1 << 30, window_bytes=1 << 30)
        for i in range(7):
            await sender.write(batch(10 * i, 10))
        assert sender.position == 2 and sender.buffered  # 3 + 3 sent, 1 buffered
        await asyncio.sleep(0.01)
        # the gate holds 4 items: the first bundle (3) is in, the second (3) waits
        assert gate.buffered() == 1
        _, first = await gate.next()
        await asyncio.sleep(0.01)
        assert gate.buffered() == 1
        await sender.flush()
        rest = await _drain(gate, 2)
        return [len(unbundled(m)) for m in [first, *rest]]

    assert run(go()) == [3, 3, 1]


def test_a_local_ray_passes_a_whole_output_buffer_inline_unless_the_user_set_it(monkeypatch):
    from rayflow.environment import local_ray_system_config

    monkeypatch.delenv("RAY_max_direct_call_object_size", raising=False)
    assert local_ray_system_config() == {"max_direct_call_object_size": 1 << 20}
    monkeypatch.setenv("RAY_max_direct_call_object_size", "4096")
    assert local_ray_system_config() == {}
