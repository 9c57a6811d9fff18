"""Channel sizes sized per subtask (Flink's network memory) under adversarial topologies,
without Ray.

The deployer sizes a subtask's input gate by its count of input channels and its output
windows by its count of output channels, each on its own: a sender with few output
channels gets a big window (16 MiB, messages of 4 MiB) while its receiver, with many
input channels, buffers 1 MiB per channel. What the receiver's gate does not admit waits
at the receiver anyway (a push call is in its process, its argument in the receiver's
node's object store), and is recorded as channel state by an unaligned checkpoint.
"""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from rayflow.runtime.channels import InputGate, OutputChannel, message_bytes
from rayflow.runtime.deployer import Deployer
from rayflow.runtime.settings import JobSettings
from rayflow.sources import DEFAULT_BATCH_BYTES
from tests.unit.inprocess_job import Config, Job
from tests.unit.test_debloat import FakeReceiver, run
from tests.unit.test_deployer import _wide_graph

MiB = 1 << 20


def _fan_in(senders: int, settings: JobSettings):
    """Deployments of ``senders`` source subtasks feeding one keyed sum."""
    graph, source, summing = _wide_graph(senders, 1)
    deployer = Deployer(graph, settings, None)
    actors = {(summing.vertex_id, 0): "handle-0"}
    sending = [
        deployer.deployment(source, i, 0, None, deployer.outputs(source, i, actors))
        for i in range(senders)
    ]
    receiving = deployer.deployment(summing, 0, 0, None, outputs=[])
    return sending, receiving


class _Counted:
    """A recorder that counts the bytes of every message offered (what an unaligned
    checkpoint's channel state would hold if its barrier came after them)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.messages = 0

    def offer(self, channel: int, seq: int, item) -> None:
        self.bytes += message_bytes(item)
        self.messages += 1


@pytest.mark.parametrize(
    "channel_bytes",
    [None, MiB],  # automatic (the default), or every channel 1 MiB as before
    ids=["automatic", "set-1MiB"],
)
def test_what_a_fan_in_receiver_holds_stays_within_what_its_gate_was_sized_for(channel_bytes):
    """Schedule: 64 source subtasks (one output channel each: a 16 MiB window, 4 MiB
    messages) feed one keyed sum (64 input channels: its gate buffers 1 MiB each). The
    sum is slow (it takes nothing here). Each sender keeps sending while its window has
    room: the gate admits one 4 MiB bundle per channel alone, the next ones wait in the
    receiver's ``push`` calls. Before sizes were automatic a channel's window and its
    gate were the same size, so the receiver held at most twice its gate bytes per
    channel (128 MiB here); now it holds the senders' windows (8-16 MiB per channel,
    0.5-1 GiB for one subtask whose inputs "share 32 MiB"), in the receiver's object
    store, and all of it is one unaligned checkpoint's channel state."""
    senders = 64
    settings = JobSettings("job", run_id="run-x", channel_bytes=channel_bytes)
    sending, receiving = _fan_in(senders, settings)
    assert receiving.num_input_channels == senders
    gate_bytes = receiving.channel_bytes
    rows = DEFAULT_BATCH_BYTES // 8  # a source's default batch: ~1 MiB of int64
    one = pa.record_batch([pa.array(range(rows), pa.int64())], ["value"])  # shared by all

    async def go() -> _Counted:
        gate = InputGate(senders, receiving.channel_capacity, None, gate_bytes)
        receiver = FakeReceiver(gate)
        channels = []
        for d in sending:
            ((_, channel),) = d.outputs[0].receivers
            channels.append(
                OutputChannel(
                    receiver, channel, 0, d.send_window, False, d.buffer_bytes, d.send_bytes
                )
            )

        async def write(ch: OutputChannel) -> None:
            for _ in range(64):
                await ch.write(one)

        writers = [asyncio.ensure_future(write(ch)) for ch in channels]
        await asyncio.sleep(0.2)  # every writer now waits for its window
        held = _Counted()
        gate.record(held)  # everything buffered or waiting at the receiver
        for w in writers:
            w.cancel()
        await gate.close()
        await asyncio.gather(*writers, return_exceptions=True)
        return held

    held = run(go())
    bound = 2 * senders * gate_bytes  # gate plus an equal window per channel
    assert held.bytes <= bound, (
        f"one subtask with {senders} input channels of {gate_bytes / MiB:.0f} MiB holds "
        f"{held.bytes / MiB:.0f} MiB ({held.messages} messages) for its inputs; "
        f"at most {bound / MiB:.0f} MiB expected (senders' windows: "
        f"{sending[0].send_bytes / MiB:.0f} MiB, messages {sending[0].buffer_bytes / MiB:.0f} MiB)"
    )


def test_the_inprocess_job_gives_its_senders_the_channel_bytes_it_is_configured_with():
    """The adversarial in-process job (``inprocess_job``) draws ``channel_bytes`` of 1,
    200 or 1 MiB to test tiny channels on both sides (one message in flight at a time,
    bundles cut at the window). Since the window has a field of its own
    (``SubtaskDeployment.send_bytes``) the job sets only the gate's: every sender keeps
    the default 1 MiB window, and the seeds drawing 1 or 200 no longer test a small
    window at all."""

    async def go() -> list[int]:
        job = Job(Config(channel_bytes=200, sources=1, middles=1), seed=0)
        await job.deploy()
        return [
            ch.window_bytes
            for sub in job.subtasks.values()
            for writer in sub.writers
            for ch in writer.channels
        ]

    windows = run(go())
    assert windows and all(w == 200 for w in windows), windows


class _Busy:
    """A receiving subtask busy with what it has: no push is acknowledged."""

    class _Push:
        def remote(self, *args):
            return asyncio.get_running_loop().create_future()

    push = _Push()


async def _write_all(ch: OutputChannel, batch: pa.RecordBatch) -> None:
    for _ in range(64):
        await ch.write(batch)


def test_a_channel_keeps_several_messages_in_flight_with_default_batches():
    """README (set_buffer_limits): a channel keeps up to its bytes, or ``send_window``
    batches, in flight, several messages, so the sender works while the receiver does.
    With a source's default ~1 MiB batches a 4 MiB message holds 4 of them: the 8-batch
    window lets two such messages out (8 MiB of the 16 MiB window), where the old 1 MiB
    channel let one batch out at a time."""
    sending, _ = _fan_in(1, JobSettings("job", run_id="run-x"))
    (d,) = sending
    rows = DEFAULT_BATCH_BYTES // 8
    one = pa.record_batch([pa.array(range(rows), pa.int64())], ["value"])

    async def go() -> OutputChannel:
        ch = OutputChannel(_Busy(), 0, 0, d.send_window, False, d.buffer_bytes, d.send_bytes)
        writing = asyncio.ensure_future(_write_all(ch, one))
        await asyncio.sleep(0.05)  # the receiver is busy: the writer now waits for it
        assert not writing.done()
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        return ch

    ch = run(go())
    assert (d.send_bytes, d.buffer_bytes) == (16 * MiB, 4 * MiB)
    assert ch.max_in_flight >= 2, f"{ch.max_in_flight} messages in flight"
