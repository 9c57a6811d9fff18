"""A subtask: one parallel instance of a chain of operators.

A subtask runs in an async Ray actor (:mod:`rayflow.runtime.subtask_actor`, which hands
it every call). Its ``run()`` coroutine is the mailbox loop:
the only code that touches operator state. ``push`` (data from upstream
subtasks) only fills the :class:`~rayflow.runtime.channels.InputGate`; control
calls (trigger, notify, abort) only enqueue into the gate's control mailbox.

Source subtasks read their splits and, when triggered, snapshot their split
positions and emit barrier n in order with their data. Other subtasks take
messages from the gate in channel order; a barrier handler (aligned or
tracking, see :mod:`rayflow.runtime.barriers`) says when to snapshot.

Snapshot (the synchronous part) pickles every operator's state, then the barrier
is forwarded; the asynchronous part writes the blob to the durable tier and
acknowledges to the coordinator, which then fetches the blob by a call whose
return value it owns (the object-store tier).

Latency markers: every ``latency_tracking_interval_ms`` a source subtask sends a
:class:`~rayflow.runtime.events.LatencyMarker` after the batch it just emitted, on one
channel of each out-edge (the next one each time). Other subtasks forward a marker they
take from the gate the same way, past their operators; a subtask without outputs, or whose
chain holds a sink (a stream written to a sink and also sent on) and no source, records its
age in a :class:`~rayflow.runtime.latency.LatencyTracker`.

End of input: sources whose splits are exhausted send ``EndOfInput`` but, when
checkpointing is on, stay alive for the final checkpoint; every subtask finishes
once the final checkpoint (taken after all input ended) is complete.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

# numpy.ma: imported by pyarrow at the first array built from numpy; imported here with
# the actor's code, before its run, not while the first batches wait behind the import
# (Acero, imported at the first ``group_by``, likewise, below).
import numpy.ma  # noqa: F401
import pyarrow as pa
import ray

from rayflow.checkpoint.state_format import encode_operator_states
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.config import CheckpointAlignment, CheckpointingMode
from rayflow.errors import OperatorError
from rayflow.eventtime.source_watermarks import SourceWatermarks
from rayflow.eventtime.strategy import MAX_WATERMARK, MIN_WATERMARK
from rayflow.eventtime.valve import EVENT_TIME_KEY, ValveState, WatermarkValve
from rayflow.outputs import SideOutput
from rayflow.plan.partitioners import Partitioner, PartitionerSpec
from rayflow.plan.physical import VertexSpec
from rayflow.recoverability import classify
from rayflow.runtime.barriers import (
    BarrierHandler,
    Snapshot,
    aligned_handler,
    alternating_handler,
    tracking_handler,
    unaligned_handler,
)
from rayflow.runtime.channel_state import (
    ChannelStateRecorder,
    channel_state_size,
    decode_snapshot,
    encode_snapshot,
)
from rayflow.runtime.channels import (
    CONTROL,
    DEFAULT_BUFFER_BYTES,
    DEFAULT_BUFFER_TIMEOUT_MS,
    DEFAULT_CHANNEL_BYTES,
    InputGate,
    OutputChannel,
)
from rayflow.runtime.data_plane import DataLinkError, DataLinks, DataTransport, RemotePushError
from rayflow.runtime.debloat import BufferDebloater
from rayflow.runtime.events import (
    Bundle,
    CheckpointBarrier,
    EndOfInput,
    LatencyMarker,
    Watermark,
    WatermarkStatus,
)
from rayflow.runtime.fence import AttemptFence
from rayflow.runtime.gc_tuning import tune_for_subtask
from rayflow.runtime.hooks import HookPoint, SubtaskHooks
from rayflow.runtime.latency import DEFAULT_LATENCY_TRACKING_INTERVAL_MS, LatencyTracker
from rayflow.runtime.operators import Operator, OperatorContext
from rayflow.runtime.output import OutputAck, OutputChunk, capture_stdout
from rayflow.runtime.ray_metrics import EXPORT_INTERVAL_S, SubtaskMetricsExporter
from rayflow.runtime.restore import StateHandle
from rayflow.sources import SourceReader
from rayflow.state import KeyedStateBackend

try:  # a pyarrow built without Acero fails only at a group_by, as it would anyway
    import pyarrow.acero  # noqa: F401
except ImportError:  # pragma: no cover - depends on how pyarrow was built
    pass

__all__ = [
    "CONTROL_GROUP",
    "OutputDeployment",
    "Subtask",
    "SubtaskDeployment",
]

#: Concurrency group of control calls: never queued behind data pushes that wait for
#: buffer space (at high fan-in those could take every slot while a barrier is aligned).
CONTROL_GROUP = "control"
#: How long an idle source (its reader had nothing to read) waits before it asks again:
#: doubling from the first to the second while it stays idle; control messages end a wait.
SOURCE_IDLE_MIN_S = 0.001
SOURCE_IDLE_MAX_S = 0.02
#: Every subtask starts connecting to its receivers as its run starts; a source reads its
#: first batch once they are connected, or after this long (then what it pushes waits in
#: the links until they are): data is not read before its path is up.
SOURCE_CONNECT_WAIT_S = 0.5
#: A snapshot blob up to this size goes to the job master inside the acknowledgement
#: (an argument Ray sends inline); a larger one stays here until the job master asks for
#: it, so that the job master owns its object and a crash of this subtask keeps it.
INLINE_BLOB_BYTES = 64 * 1024


@dataclass
class OutputDeployment:
    """One out-edge of a subtask: its partitioner and, per target subtask, the receiver."""

    partitioner: PartitionerSpec
    receivers: list[tuple[Any, int]]  # (actor handle, channel index at that receiver)
    max_parallelism: int = 128  # the receiving operator's: keys go to its key groups
    #: the side output (tag id) this edge carries; None: the main output
    side_output: str | None = None
    #: the operator whose output this edge carries: its index in the vertex's operators,
    #: -1 for the source; None: the chain's last (an edge may leave a chain midway)
    position: int | None = None
    #: per receiver, how errors name it
    receiver_names: list[str] = field(default_factory=list)


@dataclass
class SubtaskDeployment:
    job_name: str
    vertex: VertexSpec
    index: int
    attempt: int
    num_input_channels: int
    outputs: list[OutputDeployment]
    source_splits: list[Any] = field(default_factory=list)
    channel_capacity: int = 8
    send_window: int = 8
    #: buffer debloating's target (ms), None when it is off
    debloat_target_ms: int | None = None
    checkpointing: CheckpointingMode | None = None
    alignment: CheckpointAlignment = CheckpointAlignment.ALIGNED
    aligned_checkpoint_timeout_s: float = 0.0
    storage: CheckpointStorage | None = None
    master: Any = None
    restore: list[StateHandle] = field(default_factory=list)
    restored_checkpoint: int | None = None
    hooks: SubtaskHooks | None = None
    run_id: str = ""
    #: a source sends a latency marker this often (0: never)
    latency_tracking_interval_ms: int = DEFAULT_LATENCY_TRACKING_INTERVAL_MS
    #: output buffering: the longest time written data waits in an output channel (0:
    #: every batch is sent at once) and the size at which a channel sends what it holds
    buffer_timeout_s: float = DEFAULT_BUFFER_TIMEOUT_MS / 1000.0
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    #: per input channel, the most bytes of batches buffered here
    channel_bytes: int = DEFAULT_CHANNEL_BYTES
    #: per output channel, the most bytes of batches in flight from here
    send_bytes: int = DEFAULT_CHANNEL_BYTES
    #: the job's failure classifier (``rayflow.recoverability``), None: the default rules
    failure_classifier: Any = None
    object_reuse: bool = False
    #: the job was stopped with a savepoint: a source reads nothing and no operator timer
    #: fires (the attempt only waits for the final checkpoint)
    sources_stopped: bool = False
    #: how channel messages travel to the receivers (the deployer sets the job's; by
    #: default a call of each receiver's ``push``, which needs nothing of the receiver
    #: but that method)
    data_transport: DataTransport = DataTransport.RAY


async def _acknowledgements_out() -> None:
    """Let the loop run twice before processing a message taken from the input gate.

    A push returns (and Ray replies to its sender: the acknowledgement that frees the
    sender's window) only when the loop runs its task to the end and then the task's
    completion callback. Processing runs on the loop and holds it for the whole message,
    and the reader is woken before a push that was admitted meanwhile has finished: left
    to the order of the loop, the acknowledgement of the next message would wait for the
    processing of this one, and sender and receiver would wait for each other at every
    message. The first turn runs a push that was admitted, or woken by the room
    ``next()`` just made; the second its completion, which hands the reply to Ray."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


@dataclass(frozen=True)
class _PushFailed:
    """A push of this attempt failed (its receiver could not take it, or the connection
    to it is lost): the attempt fails now, not when the channel next waits on it."""

    error: BaseException


@dataclass(frozen=True)
class _Trigger:
    checkpoint_id: int
    timestamp: float
    final: bool
    savepoint: bool = False


@dataclass(frozen=True)
class _Complete:
    checkpoint_id: int


@dataclass(frozen=True)
class _Abort:
    checkpoint_id: int


@dataclass(frozen=True)
class _Announcement:
    channel: int
    barrier: CheckpointBarrier
    position: int


@dataclass(frozen=True)
class _AlignmentTimer:
    checkpoint_id: int


@dataclass(frozen=True)
class _BufferTimeout:
    """The buffer timeout expired: send what the output channels hold."""


@dataclass(frozen=True)
class _OperatorTimer:
    """A timer an operator set (``OperatorContext.timers``) fired."""

    attempt: int
    position: int
    token: Any


class _OperatorTimers:
    """``schedule(delay_s, token)``: the operator at ``position`` gets ``on_timer(token)``
    on the mailbox after ``delay_s``. Thread-safe (a recover thread may set one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, gate: Any, attempt: int, position: int):
        self._loop = loop
        self._gate = gate
        self._attempt = attempt
        self._position = position

    def schedule(self, delay_s: float, token: Any) -> None:
        gate, item = self._gate, _OperatorTimer(self._attempt, self._position, token)

        def fire() -> None:
            asyncio.ensure_future(gate.put_control(item))

        def arm() -> None:
            self._loop.call_later(max(0.0, delay_s), fire)

        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(arm)


@dataclass
class _UnalignedSnapshot:
    """An unaligned snapshot whose channel state is still arriving."""

    operator_blob: bytes
    info: dict[str, Any]
    recorder: ChannelStateRecorder
    taken_at: float


class _RecordWriter:
    """The output channels of one out-edge and its partitioner. ``on_buffered(origin)`` is
    called whenever a channel's oldest buffered data is now from ``origin`` (the subtask
    arms its buffer timeout for it)."""

    def __init__(
        self,
        output: OutputDeployment,
        index: int,
        attempt: int,
        window: int,
        adaptive: bool = False,
        buffer_bytes: int = 0,
        on_buffered: Any = None,
        window_bytes: int = DEFAULT_CHANNEL_BYTES,
        eager: bool = False,
        links: DataLinks | None = None,
    ) -> None:
        names = output.receiver_names or [f"receiver of channel {c}" for _, c in output.receivers]
        self.channels = [
            OutputChannel(
                h,
                c,
                attempt,
                window,
                adaptive,
                buffer_bytes,
                window_bytes,
                eager,
                links.link(h, name) if links is not None else None,
            )
            for (h, c), name in zip(output.receivers, names)
        ]
        self.partitioner = Partitioner(
            output.partitioner, index, len(self.channels), output.max_parallelism
        )
        self._next_marker_channel = 0
        self._on_buffered = on_buffered
        self.side_output = output.side_output
        self.position = output.position

    async def emit(self, batch: pa.RecordBatch, origin: float) -> int:
        rows = 0
        for target, part in self.partitioner.route(batch):
            if await self.channels[target].write(part, origin):
                self._on_buffered(origin)
            rows += part.num_rows
        return rows

    async def send_marker(self, marker: LatencyMarker, origin: float) -> None:
        """Write ``marker`` on one channel, the next one each time: it goes with the data
        buffered there, so it measures the buffer timeout as well."""
        channel = self.channels[self._next_marker_channel]
        self._next_marker_channel = (self._next_marker_channel + 1) % len(self.channels)
        if await channel.write(marker, origin):
            self._on_buffered(origin)

    async def write_event(self, event: Any, origin: float) -> None:
        """Write ``event`` (a watermark) on every channel, in order with the data."""
        for channel in self.channels:
            if await channel.write(event, origin):
                self._on_buffered(origin)

    async def send_buffered(self) -> None:
        for channel in self.channels:
            await channel.send_buffered()

    async def broadcast(self, event: Any) -> None:
        for channel in self.channels:
            await channel.send(event)

    def announce(self, barrier: CheckpointBarrier) -> None:
        """Send ``barrier`` out of band on every channel, with the position it belongs at
        (after every message sent so far, buffered ones included); nothing is awaited."""
        for channel in self.channels:
            channel.send_buffered_now()
            channel.receiver.announce_barrier.remote(
                channel.attempt, channel.channel, barrier, channel.position
            )

    async def flush(self) -> None:
        for channel in self.channels:
            await channel.flush()


class Subtask:
    """One parallel instance of a vertex: its mailbox loop, barrier handling, operators,
    input gate and output writers. :class:`rayflow.runtime.subtask_actor.SubtaskActor`
    is the Ray actor around it (the calls other actors make); this class is plain, so
    Ray exports and disassembles only that thin surface when a job starts one."""

    def __init__(self, deployment: SubtaskDeployment) -> None:
        if not hasattr(self, "_threads"):
            tune_for_subtask()  # this actor's own process: fewer collector runs
            self._threads = 0  # threads started by any attempt that are still running
            self._threads_lock = threading.Lock()
            # The mailbox's event loop. Control calls run in their own concurrency group,
            # which Ray serves from another thread and loop: they hop over to this one.
            self._loop: asyncio.AbstractEventLoop | None = None
        self.d = deployment
        vertex = deployment.vertex
        self.name = vertex.name
        self.key = (vertex.vertex_id, deployment.index)
        self.index = deployment.index
        self.parallelism = vertex.parallelism
        self.attempt = deployment.attempt
        debloating = deployment.debloat_target_ms is not None
        debloater = None
        if debloating and deployment.num_input_channels:
            debloater = BufferDebloater(
                deployment.num_input_channels,
                deployment.channel_capacity,
                deployment.debloat_target_ms / 1000.0,
            )
        self.gate = InputGate(
            deployment.num_input_channels,
            deployment.channel_capacity,
            debloater,
            deployment.channel_bytes,
        )
        # Buffer timeout 0: every batch goes at once while a channel has credit, and what
        # is written while it has none goes as one bundle when it returns (``eager``).
        eager = deployment.buffer_timeout_s <= 0 and deployment.buffer_bytes > 0
        buffer_bytes = deployment.buffer_bytes
        gate = self.gate  # this attempt's: a failure of its links goes nowhere else
        #: this attempt's connections to the receivers (closed when its run ends)
        self._links = (
            DataLinks(self.attempt, lambda error: gate.put_control_soon(_PushFailed(error)))
            if deployment.data_transport is DataTransport.SOCKET
            else None
        )
        self.writers = [
            _RecordWriter(
                o,
                self.index,
                self.attempt,
                deployment.send_window,
                debloating,
                buffer_bytes,
                self._start_buffer_timeout,
                deployment.send_bytes,
                eager,
                self._links,
            )
            for o in deployment.outputs
        ]
        # The writers of each operator's output, by its position in the chain (-1: the
        # source); an edge without one leaves at the chain's end.
        last = len(deployment.vertex.operators) - 1
        self._writers_at: dict[int, list[_RecordWriter]] = {}
        for writer in self.writers:
            position = last if writer.position is None else writer.position
            self._writers_at.setdefault(position, []).append(writer)
        #: the armed buffer timer, the only one (a sooner one cancels it), and when it
        #: fires by the wall clock; None when none is armed or its flush was served
        self._buffer_timer: asyncio.TimerHandle | None = None
        self._buffer_deadline: float | None = None
        #: the origin (see ``Bundle``) of the data being processed; 0.0: now
        self._origin = 0.0
        self.fence = AttemptFence(deployment.run_id, self.attempt)
        self.operators: list[Operator] = [spec.factory() for spec in vertex.operators]
        self.barriers = self._barrier_handler(deployment)
        self._unaligned: dict[int, _UnalignedSnapshot] = {}
        self._replay: list[tuple[int, pa.RecordBatch]] = []
        self.hooks = deployment.hooks
        self._current_operator = vertex.name
        # what user functions print goes to the driver, prefixed (rayflow.runtime.output)
        self._output = capture_stdout(self._output_prefix)
        self._final_checkpoint: int | None = None
        #: a final barrier left this source: it reads nothing more (unless it is aborted)
        self._source_stopped = deployment.sources_stopped
        #: operator timers due after a final barrier, fired if its checkpoint is aborted
        self._held_timers: list[_OperatorTimer] = []
        #: the newest checkpoint this subtask heard was aborted: a later trigger of it or
        #: of an older one is stale
        self._aborted_up_to = 0
        self._final_completed = False
        self._finished = False
        self._opened = False
        self._closed = False
        self._state_loaded = False
        self._blobs: dict[int, bytes] = {}
        #: whether an operator or the source reader acts on completed checkpoints (known
        #: once the reader exists)
        self._listening: bool | None = None
        self._async_parts: set[asyncio.Task] = set()
        self._source_reader = None
        #: event time: the input valve (None until a watermark arrives), the watermark
        #: the operators are at, whether watermarks flow out of this subtask, the one
        #: restored from a checkpoint, and a source's watermark generators
        self._valve: WatermarkValve | None = None
        #: input channels that delivered end of input
        self._ended_channels: set[int] = set()
        self._watermark = MIN_WATERMARK
        self._event_time = False
        self._restored_time: ValveState | None = None
        self._source_watermarks: SourceWatermarks | None = None
        self.latency = LatencyTracker()
        self.metrics_ = {
            "records_in": 0,
            "records_out": 0,
            "batches_in": 0,
            "batches_out": 0,
            "bundles_in": 0,
            "checkpoints": 0,
            "started_at": None,
            "finished_at": None,
        }
        #: alignment (s) of each checkpoint acknowledged since the last metrics export
        self._alignments: list[float] = []
        self._exporter = SubtaskMetricsExporter(
            deployment.job_name, vertex.name, deployment.index, enabled=ray.is_initialized()
        )

    def __repr__(self) -> str:
        # Ray names the actor by this in the log lines it forwards to the driver
        return f"{self.name} {self.index + 1}/{self.parallelism}"

    def _output_prefix(self) -> str:
        return f"[{self._current_operator} {self.index + 1}/{self.parallelism}] "

    def _barrier_handler(self, d: SubtaskDeployment) -> BarrierHandler:
        if d.checkpointing is CheckpointingMode.AT_LEAST_ONCE:
            return tracking_handler(self.gate)
        if d.alignment is CheckpointAlignment.UNALIGNED:
            return unaligned_handler(self.gate, self._channel_state_done, self._abandoned)
        if d.alignment is CheckpointAlignment.ALIGNED_WITH_TIMEOUT:
            return alternating_handler(
                self.gate,
                d.aligned_checkpoint_timeout_s,
                self._schedule_alignment_timer,
                self._channel_state_done,
                self._abandoned,
            )
        return aligned_handler(self.gate)

    @property
    def _announces(self) -> bool:
        """Barriers are announced out of band (unaligned checkpoints may happen)."""
        return (
            self.d.checkpointing is CheckpointingMode.EXACTLY_ONCE
            and self.d.alignment is not CheckpointAlignment.ALIGNED
        )

    # --- calls from other actors --------------------------------------------------------

    async def push(self, channel: int, seq: int, attempt: int, message: Any) -> int | None:
        """Data from upstream; returns the channel's credit with buffer debloating."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if attempt != self.attempt:
            return None
        return await self.gate.push(channel, seq, message)

    def asked_to_connect(self, attempt: int) -> None:
        """A sender of ``attempt`` asks where to connect (a point of the protocol)."""
        if attempt == self.attempt and self.hooks is not None:
            self.hooks.at(HookPoint.DURING_CONNECT)

    async def trigger_checkpoint(
        self,
        attempt: int,
        checkpoint_id: int,
        timestamp: float,
        final: bool,
        savepoint: bool = False,
    ) -> None:
        """``final`` with sources still reading: stop with a savepoint (the sources read
        nothing after its barrier; every subtask finishes once it completes)."""
        if attempt == self.attempt:
            await self._on_mailbox_loop(
                self.gate.put_control(_Trigger(checkpoint_id, timestamp, final, savepoint))
            )

    async def announce_barrier(
        self, attempt: int, channel: int, barrier: CheckpointBarrier, position: int
    ) -> None:
        """Barrier ``barrier`` belongs after the sender's first ``position`` messages on
        ``channel`` (unaligned checkpoints): it overtakes whatever is queued."""
        if attempt == self.attempt:
            await self._on_mailbox_loop(
                self.gate.put_control(_Announcement(channel, barrier, position))
            )

    async def notify_checkpoint_complete(self, attempt: int, checkpoint_id: int) -> None:
        if attempt == self.attempt:
            await self._on_mailbox_loop(self.gate.put_control(_Complete(checkpoint_id)))

    async def notify_checkpoint_aborted(self, attempt: int, checkpoint_id: int) -> None:
        if attempt == self.attempt:
            await self._on_mailbox_loop(self.gate.put_control(_Abort(checkpoint_id)))

    async def snapshot_blob(self, attempt: int, checkpoint_id: int) -> bytes:
        """The blob of a checkpoint; the caller (the job master) owns the returned object."""
        if attempt != self.attempt:
            raise RuntimeError(f"blob of attempt {attempt} asked from attempt {self.attempt}")
        return self._blobs.pop(checkpoint_id)

    async def metrics(self) -> dict[str, Any]:
        m = dict(self.metrics_)
        m["vertex"] = self.name
        m["subtask"] = self.index
        m["attempt"] = self.attempt
        m["node_id"] = ray.get_runtime_context().get_node_id()
        m["buffered"] = self.gate.buffered()
        m["input_capacity"] = sum(self.gate.limits())  # messages its inputs may buffer
        m["max_buffered"] = self.gate.max_buffered
        m["max_in_flight"] = max(
            (c.max_in_flight for w in self.writers for c in w.channels), default=0
        )
        m["bundles_out"] = sum(c.bundles for w in self.writers for c in w.channels)
        m["data_messages_out"] = sum(c.data_messages for w in self.writers for c in w.channels)
        m["latency"] = self.latency.summary()
        m.update(self._debloat_metrics())
        m["operators"] = {
            spec.name: op.metrics()
            for spec, op in zip(self.d.vertex.operators, self.operators)
            if op.metrics()
        }
        return m

    def _debloat_metrics(self) -> dict[str, Any]:
        """Buffer debloating as it stands: per input channel the capacity now in force
        (min/max), the lowest so far, the measured throughput (data messages per busy
        second, smoothed; None before the first period or when it is off), the seconds
        the subtask waited for input, and the output channels' windows (min/max)."""
        limits = self.gate.limits()
        windows = [c.current_window for w in self.writers for c in w.channels]
        debloater = self.gate.debloater
        return {
            "debloating": self.d.debloat_target_ms is not None,
            "channel_capacity_min": min(limits, default=None),
            "channel_capacity_max": max(limits, default=None),
            "channel_capacity_lowest": (
                debloater.lowest_credit if debloater else min(limits, default=None)
            ),
            "input_throughput": debloater.throughput if debloater else None,
            "input_idle_s": debloater.idle_total_s if debloater else None,
            "send_window_min": min(windows, default=None),
            "send_window_max": max(windows, default=None),
        }

    async def ready(self) -> bool:
        return True

    async def drain_output(self, ack: OutputAck | None = None, final: bool = False) -> OutputChunk:
        """Lines user functions printed here and the reader has not acknowledged yet,
        prefixed (see ``rayflow.runtime.output``); with ``final`` an unfinished line too
        (the last read before the subtask goes)."""
        return self._output.read(ack, final=final)

    async def quiesce(self, attempt: int, wait_s: float = 2.0) -> bool:
        """The attempt ended: revoke its fence, stop its background work, and say whether
        this actor is clean enough to be reused (no thread of the attempt still runs;
        Python threads cannot be stopped, so an actor with one is replaced instead)."""
        if attempt == self.attempt:
            self.fence.revoke()
        await self._on_mailbox_loop(self._cancel_async_parts())
        deadline = time.monotonic() + wait_s
        while self._threads and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._threads == 0

    async def redeploy(self, deployment: SubtaskDeployment) -> bool:
        """Become a subtask of a new attempt (the previous ``run()`` was cancelled).
        Refused (False) while a thread of an earlier attempt still runs here."""
        self.fence.revoke()
        if self._threads:
            return False
        return await self._on_mailbox_loop(self._become(deployment))

    async def _cancel_async_parts(self) -> None:
        for task in list(self._async_parts):
            task.cancel()
        for checkpoint_id in list(self._unaligned):
            self._drop_unaligned(checkpoint_id)

    async def _become(self, deployment: SubtaskDeployment) -> bool:
        self._cancel_buffer_timer()  # the next attempt arms its own
        if self._links is not None:
            self._links.close()
        await self.gate.close()
        await self._cancel_async_parts()
        self.__init__(deployment)
        return True

    async def _on_mailbox_loop(self, coro: Any) -> Any:
        """Run ``coro`` on the mailbox's event loop (the gate's primitives live there)."""
        loop = self._loop
        if loop is None or loop is asyncio.get_running_loop() or loop.is_closed():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def close_for_cancel(self, attempt: int, latest_completed: int | None) -> bool:
        """The run is over (``run()`` has ended): commit what completed checkpoints hold,
        abort every other transaction, close every operator. False when this subtask
        cannot (another attempt's, or its state not restored yet): the job master then
        cleans up from the checkpoint instead."""
        if attempt != self.attempt or not self._state_loaded:
            return False
        self.fence.revoke()
        for spec, op in zip(self.d.vertex.operators, self.operators):
            on_cancel = getattr(op, "on_cancel", None)
            if on_cancel is not None:
                self._current_operator = spec.name
                await self._on_mailbox_loop(self._in_thread(on_cancel, latest_completed))
        return True

    async def clean_up(self, attempt: int, latest_completed: int | None) -> bool:
        """A clean-up subtask (no input, no output): restore the latest completed
        checkpoint, recover from it (commit its committables, abort this subtask's
        lingering transactions), close."""
        if attempt != self.attempt:
            return False
        self._loop = asyncio.get_running_loop()
        try:
            self._open()
            await self._restore()
            for spec, op in zip(self.d.vertex.operators, self.operators):
                on_cancel = getattr(op, "on_cancel", None)
                if on_cancel is not None:
                    self._current_operator = spec.name  # what it prints is named after it
                    await self._in_thread(on_cancel, latest_completed)
        finally:
            self._close_operators()
        return True

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` in a worker thread, counted until the thread itself ends (a cancelled
        coroutine does not stop its thread). Cancelled before a worker thread took it up,
        ``fn`` never runs and is counted no more (else the count would never fall back
        and the actor could never be reused)."""
        lock = self._threads_lock
        with lock:
            self._threads += 1
        started = dropped = False

        def counted() -> Any:
            nonlocal started
            with lock:
                if dropped:
                    return None  # its caller was cancelled first: nobody waits for it
                started = True
            try:
                return fn(*args)
            finally:
                with lock:
                    self._threads -= 1

        try:
            return await asyncio.to_thread(counted)
        except asyncio.CancelledError:
            with lock:
                if not started:
                    dropped = True
                    self._threads -= 1
            raise

    # --- the mailbox loop ---------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        self._loop = asyncio.get_running_loop()
        self.metrics_["started_at"] = time.time()
        exporting = asyncio.ensure_future(self._export_metrics_periodically())
        try:
            if self._links is not None:
                self._links.connect()  # meanwhile: operators open, state is restored
            self._open()
            await self._restore()
            if self.d.master is not None and self.d.checkpointing is not None:
                self.d.master.subtask_running.remote(self.attempt, self.key)
            if self._restored_time is not None and not self.d.vertex.is_source:
                await self._resume_event_time(self._restored_time)
            if self.d.vertex.is_source:
                if self._links is not None:
                    await self._links.connected(SOURCE_CONNECT_WAIT_S)
                await self._run_source()
            else:
                await self._run_inputs()
            for writer in self.writers:
                await writer.flush()
            self.metrics_["finished_at"] = time.time()
            done = {
                "results": [op.result() for op in self.operators],
                "metrics": await self.metrics(),
            }
            self._close_operators()  # what close() prints goes with the output below
            done["output"] = self._output.read(final=True)
            return done
        except OperatorError:
            raise
        except RemotePushError as exc:
            # the receiver's failure, as the receiver judged it (not judged again here)
            raise OperatorError(
                exc.operator or self.name,
                exc.subtask if exc.operator else self.index,
                exc.parallelism if exc.operator else self.parallelism,
                str(exc),
                f"(raised in the receiving subtask, taking a message from subtask "
                f"{self.index + 1}/{self.parallelism} of {self.name!r})",
                non_recoverable=exc.non_recoverable,
            ) from None
        except (ray.exceptions.RayActorError, DataLinkError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "actor died"
            raise ConnectionError(
                f"subtask {self.index + 1}/{self.parallelism} of {self.name!r} lost a "
                f"downstream subtask ({first})"
            ) from None
        except Exception as exc:
            raise self._operator_error(exc) from None
        finally:
            exporting.cancel()
            if self._links is not None:
                self._links.close()  # nothing of this attempt arrives after its run
            self._export_metrics()
            self._close_operators()

    async def _export_metrics_periodically(self) -> None:
        while True:
            await asyncio.sleep(EXPORT_INTERVAL_S)
            self._export_metrics()

    def _export_metrics(self) -> None:
        """Hand the counters' growth to Ray's metrics (see :mod:`rayflow.runtime.ray_metrics`)."""
        alignments, self._alignments = self._alignments, []
        if not self._exporter.enabled:
            return
        channels = [c for w in self.writers for c in w.channels]
        m = self.metrics_
        try:
            operators = {
                spec.name: op.metrics() for spec, op in zip(self.d.vertex.operators, self.operators)
            }
        except Exception:  # noqa: BLE001 - an operator's own figures: skip them this time
            operators = {}
        self._exporter.export(
            {
                "records_in": m["records_in"],
                "records_out": m["records_out"],
                "bytes_in": self.gate.bytes_taken,
                "bytes_out": sum(c.bytes_sent for c in channels),
                "backpressure_s": sum(c.backpressure_s for c in channels),
            },
            alignments,
            operators,
        )

    def _close_operators(self) -> None:
        """Close every operator, once (what each prints is named after it)."""
        if self._closed:
            return
        self._closed = True
        for spec, op in zip(self.d.vertex.operators, self.operators):
            self._current_operator = spec.name
            try:
                op.close()
            except Exception:  # noqa: BLE001 - closing must not hide the first error
                pass

    def _operator_error(self, exc: BaseException) -> OperatorError:
        return OperatorError(
            self._current_operator or self.name,
            self.index,
            self.parallelism,
            f"{type(exc).__name__}: {exc}",
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            non_recoverable=classify(exc, self.d.failure_classifier),
        )

    def _open(self) -> None:
        self._opened = True
        vertex = self.d.vertex
        for position, (spec, op) in enumerate(zip(vertex.operators, self.operators)):
            self._current_operator = spec.name
            timers = (
                _OperatorTimers(self._loop, self.gate, self.attempt, position)
                if self._loop is not None
                else None
            )
            op.open(
                OperatorContext(
                    job_name=self.d.job_name,
                    operator_name=spec.name,
                    operator_uid=spec.uid,
                    subtask_index=self.index,
                    parallelism=self.parallelism,
                    max_parallelism=vertex.max_parallelism,
                    attempt=self.attempt,
                    hooks=self.hooks,
                    checkpointing=self.d.checkpointing is not None,
                    fence=self.fence,
                    run_id=self.d.run_id,
                    timers=timers,
                    object_reuse=self.d.object_reuse,
                )
            )

    async def _restore(self) -> None:
        if self.d.restore:
            await self._load_state()
        self._state_loaded = True  # from here a clean-up knows what this subtask owes
        for spec, op in zip(self.d.vertex.operators, self.operators):
            recover = getattr(op, "recover", None)
            if recover is not None:
                self._current_operator = spec.name
                await self._in_thread(recover, self.d.restored_checkpoint)

    async def _load_state(self) -> None:
        if self.hooks is not None:
            await self._in_thread(self.hooks.at, HookPoint.DURING_STATE_LOAD)
        snapshots = []
        for handle in self.d.restore:
            blob = None
            if isinstance(handle.ref, bytes):  # kept as it came, not in the object store
                blob = handle.ref
            elif handle.ref is not None:
                try:
                    blob = await asyncio.wait_for(handle.ref, timeout=10)
                except Exception:  # noqa: BLE001 - owner gone: fall back to the durable tier
                    blob = None
            if blob is None:
                storage = handle.storage or self.d.storage
                blob = await self._in_thread(storage.read_blob, handle.path)
            names = {spec.uid: spec.name for spec in self.d.vertex.operators}
            states, channel_state = decode_snapshot(blob, handle.path, names)
            snapshots.append((handle, states))
            if channel_state and handle.old_parallelism != self.parallelism:
                raise RuntimeError(
                    f"{self.name!r}: the checkpoint holds channel state (it was "
                    "unaligned) and cannot be restored at another parallelism"
                )
            if channel_state and handle.old_index == self.index:
                self._replay = [
                    (channel, batch)
                    for channel in sorted(channel_state)
                    for batch in channel_state[channel]
                ]
        self._restored_time = self._restored_event_time(snapshots)
        for spec, op in zip(self.d.vertex.operators, self.operators):
            self._current_operator = spec.name
            if getattr(op, "keyed", False):
                states = [s[spec.uid] for _, s in snapshots if spec.uid in s]
            else:
                states = [
                    s[spec.uid]
                    for h, s in snapshots
                    if spec.uid in s and h.old_index % self.parallelism == self.index
                ]
            op.restore_state(states)
            restore_global = getattr(op, "restore_global", None)
            if restore_global is not None:
                restore_global([s[spec.uid] for _, s in snapshots if spec.uid in s])

    def _restored_event_time(self, snapshots: list[tuple[StateHandle, dict]]) -> ValveState | None:
        """The event time this subtask resumes from: its own old subtask's at the same
        parallelism, else the lowest of the old subtasks' (each had at least that). An old
        subtask whose snapshot holds no event time had no watermark yet: it stood at the
        minimum (an unaligned checkpoint may find one subtask past its first watermarks
        and another with its first one still in flight, as channel state, behind records
        that must not be judged against the other's watermark)."""
        if not any(EVENT_TIME_KEY in s for _, s in snapshots):
            return None

        def state_of(snapshot: Any) -> ValveState:
            if EVENT_TIME_KEY in snapshot:
                return snapshot[EVENT_TIME_KEY]
            return ValveState(MIN_WATERMARK)

        own = [
            s
            for h, s in snapshots
            if h.old_parallelism == self.parallelism and h.old_index == self.index
        ]
        if own:
            return next(
                (s[EVENT_TIME_KEY] for s in own if EVENT_TIME_KEY in s), ValveState(MIN_WATERMARK)
            )
        return ValveState(min(state_of(s).watermark for _, s in snapshots))

    async def _resume_event_time(self, state: ValveState) -> None:
        """Restored: every input channel starts at the snapshot's watermark, and it is
        sent on first (a restored receiver's channel from here is then exact again)."""
        self._event_time = True
        self._valve = self._new_valve(state.watermark)
        if state.watermark > MIN_WATERMARK:
            await self._advance_watermark(state.watermark)

    async def _on_watermark(self, channel: int, watermark: int) -> None:
        """A watermark arrived on ``channel``."""
        valve = self._input_valve()
        was_idle = valve.idle
        advanced = valve.on_watermark(channel, watermark)
        if was_idle and not valve.idle:
            await self._send_status(False)
        if advanced is not None:
            await self._advance_watermark(advanced)

    async def _on_watermark_status(self, channel: int, status: WatermarkStatus) -> None:
        valve = self._input_valve()
        was_idle = valve.idle
        advanced = valve.on_status(channel, status.idle)
        if advanced is not None:
            await self._advance_watermark(advanced)
        if valve.idle != was_idle:
            await self._send_status(valve.idle)

    def _input_valve(self) -> WatermarkValve:
        if self._valve is None:
            self._valve = self._new_valve(MIN_WATERMARK)
            self._event_time = True
        return self._valve

    def _new_valve(self, start: int) -> WatermarkValve:
        """A valve over the input channels; a channel whose input already ended (before
        any watermark came, e.g. an input without event time) holds nothing back."""
        valve = WatermarkValve(self.gate.num_channels, start)
        for channel in self._ended_channels:
            valve.on_watermark(channel, MAX_WATERMARK)
        return valve

    async def _advance_watermark(self, watermark: int, forward: bool = True) -> None:
        """Event time reached ``watermark``: each operator in turn handles it (firing
        timers; what it emits goes through the operators after it), then it is sent on."""
        if watermark <= self._watermark:
            return
        self._watermark = watermark
        for position, op in enumerate(self.operators):
            self._current_operator = self.d.vertex.operators[position].name
            for batch in op.process_watermark(watermark):
                await self._process(batch, position + 1)
        if forward and self._event_time:
            origin = self._origin or time.time()
            event = Watermark(watermark)
            for writer in self.writers:
                await writer.write_event(event, origin)

    async def _send_status(self, idle: bool) -> None:
        origin = self._origin or time.time()
        for writer in self.writers:
            await writer.write_event(WatermarkStatus(idle), origin)

    async def _source_event_time(self, reader: SourceReader) -> None:
        """A source with a watermark strategy: its generators, from the splits' state."""
        strategy = self.d.vertex.watermark_strategy
        if strategy is None:
            return
        per_split = type(reader).last_split_id is not SourceReader.last_split_id
        sw = SourceWatermarks(strategy, self.d.source_splits, per_split)
        self._source_watermarks = sw
        self._event_time = True
        restored = sw.restored_watermark()
        if restored is not None and restored > MIN_WATERMARK and strategy.generates_watermarks:
            sw.emitted = restored
            await self._advance_watermark(restored)

    async def _source_batch(self, reader: SourceReader, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Timestamps for a batch the reader read; active again if the source was idle."""
        sw = self._source_watermarks
        batch = sw.on_batch(batch, reader.last_split_id())
        sw.finished(reader.finished_split_ids())
        if sw.idleness_changed() is False:
            await self._send_status(False)
        return batch

    async def _source_watermark(self, reader: SourceReader | None = None) -> None:
        """After a batch, or while the source has nothing to read: a new watermark, idle."""
        sw = self._source_watermarks
        if reader is not None:
            sw.finished(reader.finished_split_ids())
        watermark = sw.advance()
        if watermark is not None:
            await self._advance_watermark(watermark)
        if sw.idleness_changed() is True:
            await self._send_status(True)

    async def _run_source(self) -> None:
        source = self.d.vertex.source
        source_name = self.name.split(" -> ")[0]
        self._source_reader = reader = source.create_reader(list(self.d.source_splits))
        await self._source_event_time(reader)
        rate = source.records_per_second
        started = time.monotonic()
        marker_interval = self.d.latency_tracking_interval_ms / 1000.0
        next_marker = started
        emitted = 0
        exhausted = False
        idle_s = 0.0
        checkpointing = self.d.checkpointing is not None
        try:
            while not self._finished:
                item = self.gate.poll_control()
                if item is None and (exhausted or self._source_stopped):
                    _, item = await self.gate.next()
                if item is not None:
                    await self._on_control(item)
                    continue
                if rate and emitted:
                    delay = started + emitted / rate - time.monotonic()
                    if delay > 0:
                        # Not a plain sleep: the buffer timeout and checkpoint triggers
                        # are served while the rate holds the source back.
                        await self.gate.wait_control(delay)
                        continue
                    if delay < -0.05:
                        # Held back (backpressure, a starting receiver): keep the rate,
                        # do not burst to catch up.
                        started = time.monotonic() - emitted / rate
                self._current_operator = source_name
                batch = reader.read_batch()
                if batch is None:
                    exhausted = True
                    await self._end_of_input()
                    if not checkpointing:
                        self._finished = True
                    else:
                        self.d.master.source_exhausted.remote(self.attempt, self.key)
                    continue
                if batch.num_rows == 0:
                    # Nothing to read now (an unbounded source is idle): serve control
                    # messages for a moment, waiting longer while it stays idle.
                    if self._source_watermarks is not None:
                        await self._source_watermark(reader)
                    idle_s = min(max(idle_s * 2, SOURCE_IDLE_MIN_S), SOURCE_IDLE_MAX_S)
                    await self.gate.wait_control(idle_s)
                    continue
                idle_s = 0.0
                if self._source_watermarks is not None:
                    batch = await self._source_batch(reader, batch)
                emitted += batch.num_rows
                self._count_in(batch)
                await self._process(batch)
                if self._source_watermarks is not None:
                    await self._source_watermark()
                if marker_interval and (now := time.monotonic()) >= next_marker:
                    next_marker = now + marker_interval
                    await self._on_latency_marker(
                        LatencyMarker(time.time(), source_name, self.index)
                    )
                await asyncio.sleep(0)
        finally:
            reader.close()

    async def _run_inputs(self) -> None:
        open_channels = self.gate.num_channels
        checkpointing = self.d.checkpointing is not None
        # Channel state of an unaligned checkpoint first, in channel order.
        replay, self._replay = self._replay, []
        for replay_channel, item in replay:
            if isinstance(item, pa.RecordBatch):
                self._count_in(item)
                await self._process(item)
            else:
                await self._on_event(replay_channel, item)
        while not self._finished:
            channel, message = await self.gate.next()
            if isinstance(message, (pa.RecordBatch, Bundle)):
                await _acknowledgements_out()
            if isinstance(message, pa.RecordBatch):
                self._count_in(message)
                await self._process(message)
                # Let the loop run: control messages (announced barriers, triggers) hop
                # here from another thread, and pushes wait to be admitted.
                await asyncio.sleep(0)
            elif isinstance(message, Bundle):
                self._origin = message.origin
                try:
                    for item in message.items:
                        if isinstance(item, pa.RecordBatch):
                            self._count_in(item)
                            await self._process(item)
                        else:
                            await self._on_event(channel, item)
                finally:
                    self._origin = 0.0
                self.metrics_["bundles_in"] += 1
                await asyncio.sleep(0)
            elif isinstance(message, (LatencyMarker, Watermark, WatermarkStatus)):
                await self._on_event(channel, message)
            elif isinstance(message, CheckpointBarrier):
                if self.hooks and self.barriers.aligning is False and self.gate.num_channels > 1:
                    self.hooks.at(HookPoint.DURING_ALIGNMENT)
                seq = self.gate.taken[channel] - 1
                await self._take(self.barriers.on_barrier(channel, seq, message))
            elif isinstance(message, EndOfInput):
                open_channels -= 1
                self._ended_channels.add(channel)
                if self._valve is not None and open_channels:
                    # an ended channel holds event time back no more
                    await self._on_watermark(channel, MAX_WATERMARK)
                if open_channels == 0:
                    await self._end_of_input()
                    if not checkpointing:
                        self._finished = True
            elif channel == CONTROL:
                await self._on_control(message)

    async def _on_event(self, channel: int, event: Any) -> None:
        """An event that came in order with the data on ``channel``."""
        if isinstance(event, Watermark):
            await self._on_watermark(channel, event.timestamp)
        elif isinstance(event, WatermarkStatus):
            await self._on_watermark_status(channel, event)
        else:
            await self._on_latency_marker(event)

    async def _on_latency_marker(self, marker: LatencyMarker) -> None:
        """Record ``marker``'s age where a sink is reached, and forward it past the
        operators on the outputs."""
        vertex = self.d.vertex
        if not self.writers or (vertex.sinks and not vertex.is_source):
            # (a sink chained to the source, where markers start, would record only zeros)
            self.latency.record_ms((time.time() - marker.created_at) * 1000.0)
        if self.writers:
            origin = self._origin or time.time()
            for writer in self.writers:
                await writer.send_marker(marker, origin)

    def _count_in(self, batch: pa.RecordBatch) -> None:
        m = self.metrics_
        m["records_in"] += batch.num_rows
        m["batches_in"] += 1
        if self.hooks is not None:
            self.hooks.after_records(m["records_in"])

    async def _take(self, decision: Snapshot | None) -> None:
        if decision is not None:
            await self._checkpoint(decision.barrier, decision.recorder)
            await self.barriers.resume()

    async def _on_control(self, item: Any) -> None:
        if isinstance(item, _PushFailed):
            raise item.error
        if isinstance(item, _Announcement):
            if self.hooks and self.barriers.aligning is False and self.gate.num_channels > 1:
                self.hooks.at(HookPoint.DURING_ALIGNMENT)
            await self._take(
                self.barriers.on_announcement(item.channel, item.barrier, item.position)
            )
        elif isinstance(item, _BufferTimeout):
            self._cancel_buffer_timer()
            for writer in self.writers:
                await writer.send_buffered()
        elif isinstance(item, _AlignmentTimer):
            await self._take(self.barriers.on_timer(item.checkpoint_id))
        elif isinstance(item, _Trigger):
            if item.checkpoint_id <= self._aborted_up_to:
                return  # aborted before its trigger got here: stale (ids only grow)
            await self._checkpoint(
                CheckpointBarrier(item.checkpoint_id, item.timestamp, item.final, item.savepoint)
            )
        elif isinstance(item, _Complete):
            for old in [c for c in self._blobs if c < item.checkpoint_id]:
                del self._blobs[old]
            for old in [c for c in self._unaligned if c < item.checkpoint_id]:
                self._drop_unaligned(old)
            for spec, op in zip(self.d.vertex.operators, self.operators):
                self._current_operator = spec.name
                op.notify_checkpoint_complete(item.checkpoint_id)
            if self._source_reader is not None:
                self._source_reader.notify_checkpoint_complete(item.checkpoint_id)
            if self._final_checkpoint is not None and item.checkpoint_id >= self._final_checkpoint:
                self._final_completed = True
            self._maybe_finish()
        elif isinstance(item, _OperatorTimer):
            # In an attempt after a stop with savepoint no timer of a function fires: the
            # attempt only finishes, and what a timer emitted would be committed at its
            # final checkpoint while a restore from the savepoint fires the same timer
            # again. A sink's commit retries go on (the attempt finishes after them).
            operator = self.operators[item.position]
            commits = operator.timers_after_final_barrier
            stopped = self.d.sources_stopped and not commits
            if item.attempt == self.attempt and not stopped:
                if self._final_checkpoint is not None and not commits:
                    # After a final barrier (a stop with savepoint, or the end of input)
                    # the timer is in the snapshot: what it emitted now would reach a
                    # sink after it, and a restore would fire it again. Held until the
                    # final checkpoint completes (dropped: the attempt ends) or is
                    # aborted (fired then: the job goes on), as Flink's synchronous
                    # savepoint holds a task's timers.
                    self._held_timers.append(item)
                    return
                self._current_operator = self.d.vertex.operators[item.position].name
                produced = self.operators[item.position].on_timer(item.token)
                for batch in produced or ():
                    await self._process(batch, item.position + 1)
                self._maybe_finish()
        elif isinstance(item, _Abort):
            self._aborted_up_to = max(self._aborted_up_to, item.checkpoint_id)
            held: list[_OperatorTimer] = []
            if self._final_checkpoint == item.checkpoint_id:
                # A stop with a savepoint failed: the job goes on (sources read again; a
                # final checkpoint after end of input is triggered again), and so do the
                # timers held since its barrier.
                self._final_checkpoint = None
                self._source_stopped = self.d.sources_stopped
                held, self._held_timers = self._held_timers, []
            await self.barriers.abort(item.checkpoint_id)
            self._drop_unaligned(item.checkpoint_id)
            for op in self.operators:
                notify = getattr(op, "notify_checkpoint_aborted", None)
                if notify is not None:
                    notify(item.checkpoint_id)
            for timer in held:
                await self._on_control(timer)

    def _maybe_finish(self) -> None:
        """The final checkpoint is complete and no operator has commits due: done."""
        if self._final_completed and not any(op.commits_outstanding() for op in self.operators):
            self._finished = True

    async def _process(self, batch: pa.RecordBatch, start: int = 0) -> None:
        """``batch``, the output of the operator before ``start`` (the source's, or the
        vertex's input, at 0), through the operators from ``start`` on. Each operator's
        output goes to the edges that leave the chain there, then on to the next."""
        operators = self.operators
        batches: list[Any] = [batch]
        if start - 1 in self._writers_at:
            await self._emit(batches, start - 1)
        for position in range(start, len(operators)):
            op = operators[position]
            self._current_operator = self.d.vertex.operators[position].name
            produced: list[pa.RecordBatch] = []
            for b in batches:
                if isinstance(b, SideOutput):
                    continue  # emitted where it was made (or read by nothing)
                produced.extend(op.process(b))
            if not produced:
                return
            if position in self._writers_at:
                await self._emit(produced, position)
            batches = produced

    async def _emit(
        self, batches: list[pa.RecordBatch | SideOutput], position: int | None = None
    ) -> None:
        """Send ``batches``, the output of the operator at ``position`` (None: the chain's
        last), on the edges that leave the chain there."""
        if position is None:
            position = len(self.operators) - 1
        writers = self._writers_at.get(position, ())
        origin = self._origin or time.time()
        for b in batches:
            if b.num_rows == 0:
                continue
            if isinstance(b, SideOutput):
                for writer in writers:
                    if writer.side_output == b.tag:
                        self.metrics_["records_out"] += await writer.emit(b.batch, origin)
                continue
            for writer in writers:
                if writer.side_output is None:
                    self.metrics_["records_out"] += await writer.emit(b, origin)
            self.metrics_["batches_out"] += 1

    async def _end_of_input(self) -> None:
        # Event time ends too (Flink's end-of-input watermark): every event-time timer
        # fires; the watermark goes on only where watermarks flow.
        if self._source_watermarks is not None:
            self._source_watermarks.finished_all()
        await self._advance_watermark(MAX_WATERMARK, forward=self._event_time)
        for position, op in enumerate(self.operators):
            self._current_operator = self.d.vertex.operators[position].name
            tail = op.end_input()
            for batch in tail:
                await self._process(batch, position + 1)
        for writer in self.writers:
            await writer.broadcast(EndOfInput())

    # --- checkpoints --------------------------------------------------------------------

    async def _checkpoint(
        self, barrier: CheckpointBarrier, recorder: ChannelStateRecorder | None = None
    ) -> None:
        """Snapshot every operator for ``barrier`` and forward it; with ``recorder`` (an
        unaligned snapshot) the blob is written once the channel state is complete."""
        cid = barrier.checkpoint_id
        started = time.time()
        timing = self.barriers.last_timing if not self.d.vertex.is_source else None
        snapshot: dict[str, Any] = {}
        for spec, op in zip(self.d.vertex.operators, self.operators):
            self._current_operator = spec.name
            snapshot[spec.uid] = op.snapshot_state(cid)
        uids = list(snapshot)
        if self._event_time:
            idle = self._valve.idle if self._valve is not None else False
            snapshot[EVENT_TIME_KEY] = ValveState(self._watermark, idle)
        splits = self._source_reader.snapshot_state(cid) if self._source_reader else None
        if splits is not None and self._source_watermarks is not None:
            splits = self._source_watermarks.snapshot(splits)
        blob = encode_operator_states(snapshot)
        sync_s = time.time() - started
        if barrier.final:
            self._final_checkpoint = cid
            self._source_stopped = True  # a source reads nothing after a final barrier
        if self.hooks is not None:
            self.hooks.at(HookPoint.AFTER_SNAPSHOT)
        if self._announces and not barrier.must_align:
            for writer in self.writers:
                writer.announce(barrier)
        # The barrier also goes in band, also when announced: an announcement may come
        # after data that follows it, and the receiver must not take that data before
        # it has snapshotted (it snapshots at whichever of the two comes first).
        for writer in self.writers:
            await writer.broadcast(barrier)
        self.metrics_["checkpoints"] += 1
        info = {
            "start_delay_s": timing.start_delay_s
            if timing and timing.checkpoint_id == cid
            else max(0.0, started - barrier.timestamp),
            "alignment_s": timing.alignment_s if timing and timing.checkpoint_id == cid else 0.0,
            "sync_s": sync_s,
            "size": len(blob),
            "uids": uids,
            "stateful_uids": [uid for uid in uids if snapshot[uid] is not None],
            # keyed state is cut into key groups by the max parallelism
            "keyed_uids": [
                spec.uid
                for spec, op in zip(self.d.vertex.operators, self.operators)
                if isinstance(getattr(op, "backend", None), KeyedStateBackend)
                and snapshot.get(spec.uid) is not None
            ],
            "max_parallelism": self.d.vertex.max_parallelism,
            "source_splits": splits,
            "unaligned": recorder is not None,
            "channel_state_size": 0,
        }
        if recorder is None:
            self._start_async_part(cid, blob, info)
            return
        self._unaligned[cid] = _UnalignedSnapshot(blob, info, recorder, time.time())
        if recorder.done:
            self._channel_state_done(recorder)

    # --- unaligned checkpoints ----------------------------------------------------------

    def _channel_state_done(self, recorder: ChannelStateRecorder) -> None:
        """Every message in flight before the barrier arrived: write the blob."""
        pending = self._unaligned.pop(recorder.checkpoint_id, None)
        if pending is None:  # the snapshot is being taken; it checks ``done`` itself
            return
        self.gate.stop_recording(recorder)
        if self.fence.revoked:  # a push of an ended attempt completed it: drop it
            return
        channel_state = recorder.channel_state()
        blob = encode_snapshot(pending.operator_blob, channel_state)
        info = pending.info
        info["size"] = len(blob)
        info["channel_state_size"] = channel_state_size(channel_state)
        info["channel_state_batches"] = sum(
            isinstance(b, pa.RecordBatch) for items in channel_state.values() for b in items
        )
        info["channel_state_wait_s"] = time.time() - pending.taken_at
        self._start_async_part(recorder.checkpoint_id, blob, info)

    def _drop_unaligned(self, checkpoint_id: int) -> None:
        pending = self._unaligned.pop(checkpoint_id, None)
        if pending is not None:
            pending.recorder.abandon()
            self.gate.stop_recording(pending.recorder)

    def _abandoned(self, checkpoint_id: int, why: str) -> None:
        """The handler gave up an unaligned checkpoint (its channel state incomplete, or
        no consistent snapshot possible): it cannot be acknowledged, so decline it."""
        self._drop_unaligned(checkpoint_id)
        if self.d.master is not None:
            self.d.master.decline_checkpoint.remote(self.attempt, checkpoint_id, self.key, why)

    def _start_buffer_timeout(self, origin: float) -> None:
        """Output data from ``origin`` (see ``Bundle``) waits in a channel: send what the
        channels hold once the buffer timeout has passed since ``origin`` (one timer for
        all channels, like Flink's output flusher). Counting from the origin rather than
        from now bounds a record's wait in buffers over its whole path through the job,
        Ray calls and queues included; the timer is kept within ``[now, now + timeout]``
        so that a clock apart on another node neither holds data longer than one timeout
        nor sends it later than at once."""
        now = time.time()
        timeout = self.d.buffer_timeout_s
        deadline = min(max(origin + timeout, now), now + timeout)
        loop = asyncio.get_running_loop()
        # Compared on the loop's clock, which a wall clock set back or forth leaves alone.
        when = loop.time() + (deadline - now)
        if self._buffer_timer is not None and self._buffer_timer.when() <= when:
            return
        # Superseded: left armed, it would send a buffer started after this one is served
        # before that buffer's own deadline.
        self._cancel_buffer_timer()
        self._buffer_deadline = deadline
        gate = self.gate

        def fire() -> None:
            asyncio.ensure_future(gate.put_control(_BufferTimeout()))

        self._buffer_timer = loop.call_at(when, fire)

    def _cancel_buffer_timer(self) -> None:
        """No buffer timer armed any more (one that already fired has posted its flush)."""
        if self._buffer_timer is not None:
            self._buffer_timer.cancel()
            self._buffer_timer = None
        self._buffer_deadline = None

    def _schedule_alignment_timer(self, checkpoint_id: int, delay_s: float) -> None:
        gate = self.gate

        def fire() -> None:
            asyncio.ensure_future(gate.put_control(_AlignmentTimer(checkpoint_id)))

        asyncio.get_running_loop().call_later(delay_s, fire)

    def _start_async_part(self, cid: int, blob: bytes, info: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self._async_part(cid, blob, info))
        self._async_parts.add(task)
        task.add_done_callback(self._async_parts.discard)

    async def _async_part(self, cid: int, blob: bytes, info: dict[str, Any]) -> None:
        started = time.time()
        vertex_id, index = self.key
        name = CheckpointStorage.blob_name(self.attempt, vertex_id, index)
        hooks = self.hooks

        with_channel_state = bool(info.get("channel_state_size"))

        fence = self.fence

        def write() -> str:
            fence.check("checkpoint blob write")
            if hooks is not None:
                hooks.at(HookPoint.DURING_BLOB_WRITE)
                if with_channel_state:
                    hooks.at(HookPoint.DURING_CHANNEL_STATE_WRITE)
            return self.d.storage.write_blob(cid, name, blob)

        try:
            info["path"] = await self._in_thread(write)
        except Exception as exc:  # noqa: BLE001 - the coordinator declines the checkpoint
            self.d.master.decline_checkpoint.remote(
                self.attempt,
                cid,
                self.key,
                f"{type(exc).__name__}: {exc}",
                classify(exc, self.d.failure_classifier),
            )
            return
        info["async_s"] = time.time() - started
        inline = len(blob) <= INLINE_BLOB_BYTES
        if not inline:
            self._blobs[cid] = blob
        # Whether this subtask needs to hear that the checkpoint completed: the job
        # master leaves out the others (a final checkpoint goes to every subtask).
        info["notify"] = self._listens_for_completion()
        self._alignments.append(info.get("alignment_s") or 0.0)
        self.d.master.acknowledge_checkpoint.remote(
            self.attempt, cid, self.key, info, blob if inline else None
        )

    def _listens_for_completion(self) -> bool:
        """An operator or the source reader acts on a completed checkpoint (a sink
        commits, a reader commits offsets), or this subtask holds a blob or an unaligned
        snapshot that a completion lets it drop."""
        if self._blobs or self._unaligned:
            return True
        if self._listening is not None:
            return self._listening
        reader = self._source_reader
        if reader is None and self.d.vertex.is_source:
            return True  # no reader yet to ask
        self._listening = any(
            type(op).notify_checkpoint_complete is not Operator.notify_checkpoint_complete
            for op in self.operators
        ) or (
            reader is not None
            and type(reader).notify_checkpoint_complete
            is not SourceReader.notify_checkpoint_complete
        )
        return self._listening
