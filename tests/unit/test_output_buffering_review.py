"""Output buffering under adversarial schedules, without Ray.

The in-process job (``tests/unit/inprocess_job.py``) runs the real subtask class with
pushes and announcements delivered in random order; checkpoints are taken while data
waits in output buffers, then every subtask stops at a random point and the job is
restored from the last completed checkpoint: the values kept at the end must be every
input value exactly once (at least once with AT_LEAST_ONCE).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from rayflow.config import CheckpointAlignment, CheckpointingMode
from tests.unit.inprocess_job import Config, Job


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def _config(seed: int) -> Config:
    rng = random.Random(seed)
    mode = CheckpointingMode.AT_LEAST_ONCE if rng.random() < 0.2 else CheckpointingMode.EXACTLY_ONCE
    return Config(
        n=rng.choice([600, 1500]),
        sources=rng.choice([1, 2]),
        middles=rng.choice([1, 2]),
        batch_size=rng.choice([1, 7, 40]),
        mode=mode,
        alignment=rng.choice(list(CheckpointAlignment)),
        aligned_timeout_s=rng.choice([0.0, 0.001, 0.01]),
        capacity=rng.choice([1, 2, 8]),
        window=rng.choice([1, 2, 8]),
        channel_bytes=rng.choice([1, 200, 1 << 20]),
        buffer_timeout_s=rng.choice([0.0, 0.001, 0.02]),
        buffer_bytes=rng.choice([1, 300, 1 << 20]),
        debloat_target_ms=rng.choice([None, None, 10]),
        latency_interval_ms=rng.choice([0, 1]),
        max_delay_s=rng.choice([0.0, 0.002]),
    )


async def _scenario(seed: int) -> tuple[Config, list[int], list[int]]:
    config = _config(seed)
    rng = random.Random(seed * 7919 + 1)
    job = Job(config, seed)
    await job.deploy()
    job.start()
    cid, completed = 1, None
    for _ in range(rng.randint(1, 4)):
        await asyncio.sleep(rng.random() * 0.02)
        if job.exhausted >= {k for k in job.subtasks if k[0] == 0}:
            break
        if await job.checkpoint(cid):
            completed = cid
        cid += 1
    await asyncio.sleep(rng.random() * 0.01)
    reuse = rng.random() < 0.5  # redeploy into the same subtasks, as a restart may
    await job.crash(reuse)
    await job.deploy(restore_from=completed, reuse=reuse)
    job.start()
    for _ in range(rng.randint(0, 2)):
        await asyncio.sleep(rng.random() * 0.01)
        if job.exhausted >= {k for k in job.subtasks if k[0] == 0}:
            break
        await job.checkpoint(cid)
        cid += 1
    await job.finish(cid)
    return config, sorted(job.kept()), list(range(config.n))


@pytest.mark.parametrize("seed", range(16))
def test_restore_after_a_crash_keeps_every_value_once_whatever_is_buffered(seed):
    config, kept, expected = run(asyncio.wait_for(_scenario(seed), 120))
    if config.mode is CheckpointingMode.EXACTLY_ONCE:
        assert kept == expected, (config, len(kept), len(expected))
    else:
        assert sorted(set(kept)) == expected, config


# --- the buffer timeout while a rate-limited source waits ------------------------------


class _Receiver:
    """Stands for a receiving subtask's handle: records what is pushed, admits at once."""

    def __init__(self) -> None:
        self.messages: list = []
        self.arrived = asyncio.Event()
        self.push = _Remote(self._push)

    async def _push(self, channel, seq, attempt, message):
        self.messages.append(message)
        self.arrived.set()


class _Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


def _source_subtask(source, receiver, buffer_timeout_s: float):
    from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
    from rayflow.plan.physical import VertexSpec
    from rayflow.runtime.subtask import OutputDeployment, SubtaskDeployment
    from tests.unit.inprocess_job import Subtask

    vertex = VertexSpec(0, "src", 1, 128, source=source, source_uid="src")
    return Subtask(
        SubtaskDeployment(
            job_name="j",
            vertex=vertex,
            index=0,
            attempt=0,
            num_input_channels=0,
            outputs=[OutputDeployment(PartitionerSpec(PartitionKind.FORWARD), [(receiver, 0)])],
            source_splits=source.create_splits(1),
            latency_tracking_interval_ms=0,
            buffer_timeout_s=buffer_timeout_s,
        )
    )


def test_a_rate_limited_source_sends_its_batch_within_the_buffer_timeout():
    """Schedule: a source with ``records_per_second`` writes a batch (it waits in the
    output buffer, the 5 ms buffer timeout starts), then sleeps in ``_run_source`` until
    the rate allows the next batch (10 s here). The timeout fires, but ``_BufferTimeout``
    sits in the control queue: the source loop polls it only between batches, so the
    batch goes out when the sleep ends, 10 s late (with buffering off it goes at once)."""
    from rayflow.sources import NumberSequenceSource

    async def go():
        receiver = _Receiver()
        source = NumberSequenceSource(0, 9, batch_size=5, records_per_second=0.5)
        sub = _source_subtask(source, receiver, buffer_timeout_s=0.005)
        task = asyncio.ensure_future(sub.run())
        try:
            await asyncio.wait_for(receiver.arrived.wait(), 3.0)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert run(go()), "the first batch still waits in the output buffer after 3 s (timeout 5 ms)"


# --- bytes: what a channel carries and holds -------------------------------------------


def test_a_bundle_is_never_bigger_than_the_channel_bytes_its_batches_each_fit_in():
    """Schedule: ``set_buffer_limits(channel_bytes=64 KiB)`` with the default 1 MiB output
    buffer; an operator writes 48 KiB batches. ``OutputChannel.write`` sends only at
    ``buffer_bytes`` or at a window of items, so 8 batches (384 KiB) go as one bundle: it
    is sent alone, admitted alone into the receiver's buffer, and both the in-flight and
    the buffered bytes are 6x ``channel_bytes``, although every batch fits in it (without
    bundles each would have gone on its own, 48 KiB at a time)."""
    import pyarrow as pa

    from rayflow.runtime.channels import InputGate, OutputChannel, message_bytes
    from rayflow.runtime.events import unbundled
    from tests.unit.test_debloat import FakeReceiver

    channel_bytes = 64 * 1024

    async def go():
        gate = InputGate(1, 8, capacity_bytes=channel_bytes)
        sender = OutputChannel(
            FakeReceiver(gate), 0, 0, 8, False, 1 << 20, window_bytes=channel_bytes
        )
        one = pa.record_batch([pa.array(range(6 * 1024), pa.int64())], ["value"])  # 48 KiB

        async def write_all():
            for _ in range(8):
                await sender.write(one)
            await sender.flush()

        async def read_all():
            sizes, rows = [], 0
            while rows < 8 * one.num_rows:
                message = (await gate.next())[1]
                sizes.append(message_bytes(message))
                rows += sum(b.num_rows for b in unbundled(message))
            return sizes

        _, sizes = await asyncio.gather(write_all(), read_all())
        return one.nbytes, sizes

    batch_bytes, sizes = run(go())
    assert batch_bytes <= channel_bytes
    assert max(sizes) <= channel_bytes, f"a message of {max(sizes):,} bytes: {sizes}"


def _serialized_bytes(batch) -> int:
    """Bytes of ``batch`` as Ray serializes it: pickle protocol 5, buffers out of band."""
    import pickle

    buffers: list = []
    inline = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    return len(inline) + sum(memoryview(b).nbytes for b in buffers)


def test_a_collection_source_batch_serializes_only_its_own_rows():
    """A source batch is a zero-copy slice of the whole table (``combine_chunks`` of one
    chunk copies nothing): its ``nbytes`` is ~1 MiB, what the byte bounds count, but
    pickle (and so Ray, channel state, a sink's pending batches) carries the table's
    whole buffers, here 16 MB for every 1 MiB batch."""
    import pyarrow as pa

    from rayflow import CollectionSource

    table = pa.table({"value": pa.array(range(2_000_000), pa.int64())})
    source = CollectionSource(table)
    batch = source.create_reader(source.create_splits(1)).read_batch()
    assert batch.num_rows < table.num_rows
    size = _serialized_bytes(batch)
    assert size <= 2 * batch.nbytes, f"{batch.nbytes:,} bytes of rows serialize as {size:,}"


def test_a_parquet_file_source_batch_serializes_only_its_own_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayflow import FileSource

    pq.write_table(
        pa.table({"value": pa.array(range(1_000_000), pa.int64())}), tmp_path / "a.parquet"
    )
    source = FileSource(str(tmp_path), "parquet")
    batch = source.create_reader(source.create_splits(1)).read_batch()
    assert batch.num_rows < 1_000_000
    size = _serialized_bytes(batch)
    assert size <= 2 * batch.nbytes, f"{batch.nbytes:,} bytes of rows serialize as {size:,}"


# --- what the code survives (kept as regression tests) ---------------------------------


def _deploy(vertex, outputs, *, attempt=0, inputs=0, splits=(), buffer_timeout_s=0.05):
    from rayflow.runtime.subtask import SubtaskDeployment
    from tests.unit.inprocess_job import Subtask

    deployment = SubtaskDeployment(
        job_name="j",
        vertex=vertex,
        index=0,
        attempt=attempt,
        num_input_channels=inputs,
        outputs=outputs,
        source_splits=list(splits),
        latency_tracking_interval_ms=0,
        buffer_timeout_s=buffer_timeout_s,
    )
    return deployment, Subtask


def _values(messages) -> list[int]:
    import pyarrow as pa

    from rayflow.runtime.events import unbundled

    return [
        v
        for m in messages
        for item in unbundled(m)
        if isinstance(item, pa.RecordBatch)
        for v in item["value"].to_pylist()
    ]


def test_a_buffer_timeout_of_the_previous_attempt_sends_nothing_in_the_next():
    """Schedule: attempt 0 writes a batch (buffered, its timer armed), the actor is
    redeployed (``_become``) before the timer fires. The timer posts to attempt 0's gate,
    not the new one: attempt 1 sees no stray flush, and attempt 0's buffered batch is
    dropped with it (the restore replays it)."""
    import pyarrow as pa

    from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
    from rayflow.plan.physical import OperatorSpec, VertexSpec
    from rayflow.runtime.operators import factory
    from rayflow.runtime.subtask import OutputDeployment, _BufferTimeout
    from tests.unit.inprocess_job import Cut

    vertex = VertexSpec(1, "cut", 1, 128, operators=[OperatorSpec("cut", "cut", factory(Cut))])
    forward = PartitionerSpec(PartitionKind.FORWARD)

    async def go():
        old, new = _Receiver(), _Receiver()
        d0, cls = _deploy(vertex, [OutputDeployment(forward, [(old, 0)])], inputs=1)
        d1, _ = _deploy(vertex, [OutputDeployment(forward, [(new, 0)])], attempt=1, inputs=1)
        sub = cls(d0)
        sub._loop = asyncio.get_running_loop()
        await sub._emit([pa.record_batch([pa.array([1, 2])], ["value"])])
        assert sub._buffer_deadline and sub.writers[0].channels[0].buffered
        await sub._become(d1)
        await asyncio.sleep(0.2)  # attempt 0's timer has fired
        stray = [c for c in sub.gate._control if isinstance(c, _BufferTimeout)]
        assert not stray and not sub._buffer_deadline
        assert old.messages == [] and new.messages == []
        await sub._emit([pa.record_batch([pa.array([3])], ["value"])])
        await asyncio.sleep(0.2)
        return [c for c in sub.gate._control if isinstance(c, _BufferTimeout)]

    assert len(run(go())) == 1  # attempt 1's own timer


def test_end_of_input_sends_what_every_out_edge_buffered_first():
    """A source with two out-edges (forward, broadcast) and a buffer timeout far longer
    than the job: end of input alone sends the buffered batches, ahead of itself."""
    from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
    from rayflow.plan.physical import VertexSpec
    from rayflow.runtime.events import EndOfInput
    from rayflow.runtime.subtask import OutputDeployment
    from rayflow.sources import NumberSequenceSource

    source = NumberSequenceSource(0, 99, batch_size=7)
    vertex = VertexSpec(0, "src", 1, 128, source=source, source_uid="src")

    async def no_metrics():
        return {}

    async def go():
        a, b, c = _Receiver(), _Receiver(), _Receiver()
        outputs = [
            OutputDeployment(PartitionerSpec(PartitionKind.FORWARD), [(a, 0)]),
            OutputDeployment(PartitionerSpec(PartitionKind.BROADCAST), [(b, 0), (c, 0)]),
        ]
        d, cls = _deploy(vertex, outputs, splits=source.create_splits(1), buffer_timeout_s=60.0)
        sub = cls(d)
        sub.metrics = no_metrics
        await asyncio.wait_for(sub.run(), 10)
        return a.messages, b.messages, c.messages

    for messages in run(go()):
        assert _values(messages) == list(range(100))
        assert messages[-1] == EndOfInput()


def test_a_latency_marker_in_a_bundle_goes_on_every_out_edge_in_order():
    """A bundle (batch, marker, batch) reaches a subtask with two out-edges: both get
    the marker between the two batches' outputs."""
    import pyarrow as pa

    from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
    from rayflow.plan.physical import OperatorSpec, VertexSpec
    from rayflow.runtime.events import Bundle, EndOfInput, LatencyMarker, unbundled
    from rayflow.runtime.operators import factory
    from rayflow.runtime.subtask import OutputDeployment
    from tests.unit.inprocess_job import Cut

    vertex = VertexSpec(1, "cut", 1, 128, operators=[OperatorSpec("cut", "cut", factory(Cut))])
    marker = LatencyMarker(0.0, "src", 0)

    async def no_metrics():
        return {}

    async def go():
        a, b = _Receiver(), _Receiver()
        outputs = [
            OutputDeployment(PartitionerSpec(PartitionKind.FORWARD), [(a, 0)]),
            OutputDeployment(PartitionerSpec(PartitionKind.FORWARD), [(b, 0)]),
        ]
        d, cls = _deploy(vertex, outputs, inputs=1, buffer_timeout_s=60.0)
        sub = cls(d)
        sub.metrics = no_metrics
        running = asyncio.ensure_future(sub.run())
        first = pa.record_batch([pa.array([0, 1, 2, 3])], ["value"])
        second = pa.record_batch([pa.array([4, 5])], ["value"])
        await sub.push(0, 0, 0, Bundle((first, marker, second)))
        await sub.push(0, 1, 0, EndOfInput())
        await asyncio.wait_for(running, 10)
        return a.messages, b.messages

    for messages in run(go()):
        items = [i for m in messages for i in unbundled(m)]
        kinds = [type(i).__name__ for i in items]
        assert kinds.count("LatencyMarker") == 1
        at = kinds.index("LatencyMarker")
        before = [
            v for i in items[:at] if isinstance(i, pa.RecordBatch) for v in i["value"].to_pylist()
        ]
        assert before == [0, 1, 2, 3] and _values(messages) == list(range(6))
