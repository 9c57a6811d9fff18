"""Channels between subtasks: in-order delivery and credit-based backpressure.

Ray keeps no call order for async actors, so every message carries
``(channel, seq, attempt)``. The receiving :class:`InputGate` admits message
``seq`` of a channel only after ``seq - 1`` and only while that channel's
buffer has room; a ``push`` call waits until then, so a fast sender is held
back by a slow receiver. The sending :class:`OutputChannel` keeps at most
``window`` pushes unacknowledged and awaits the oldest when the window is full.
Per channel, at most ``window`` items (batches, events) are in flight and ``capacity``
are buffered, and in bytes of batches at most ``window_bytes`` in flight and
``capacity_bytes`` buffered (a bigger message is admitted alone, into an empty buffer,
or sent alone, with nothing else in flight): memory stays bounded whatever the speed of
the receiver and whatever the size of the messages.

Messages of another attempt (a previous incarnation of the job) are dropped.

Output buffering (Flink's network buffers with ``execution.buffer-timeout``): with a
``buffer_bytes`` target an :class:`OutputChannel` holds the batches and latency markers
written to it and sends them together, as one :class:`Bundle` message, once they reach
``buffer_bytes`` or when the subtask flushes it (its buffer timeout expired, or an event
-- a barrier, end of input -- must follow them). A bundle keeps its batches as they were
(no concatenation), so every operator downstream sees the same batches whatever the
timing: results do not depend on how messages were coalesced. A bundle is one message
of the channel: one sequence number, one credit.

With a buffer timeout of 0 (``eager``) a channel sends every item at once while its
window has room. When the window is full it does not hold the subtask up: what is
written meanwhile gathers in the buffer (up to ``buffer_bytes`` or a window's worth of
items) and goes as one bundle as soon as the receiver acknowledges a push (Flink's
buffers filling while a channel waits for credit). A saturated channel so sends fewer,
bigger messages instead of one call per batch queued behind the others; only a full
buffer makes the writer wait.

With buffer debloating (a :class:`~rayflow.runtime.debloat.BufferDebloater` handed to the
gate) a channel's buffer is bounded by its *credit* instead, between 1 and ``capacity``,
sized to what the subtask drains in a target time; ``push`` returns the channel's credit
and the sender uses it as its window (between 1 and ``window``). A smaller credit only
makes pushes wait longer: admission stays in sequence order.

For unaligned checkpoints the gate also knows, per channel, the sequence number of the
next message the subtask will take (``taken``) and the messages that arrived but wait
for buffer space; a :class:`ChannelRecorder` registered with :meth:`InputGate.record`
is handed every message of a channel range, whether already buffered, waiting, or
arriving later (see :mod:`rayflow.runtime.channel_state`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Protocol

import pyarrow as pa

from rayflow.runtime.debloat import BufferDebloater
from rayflow.runtime.events import (
    Bundle,
    CheckpointBarrier,
    EndOfInput,
    LatencyMarker,
    Watermark,
    WatermarkStatus,
)

CONTROL = -1

#: The longest time written data waits in an output channel by default (Flink's
#: ``execution.buffer-timeout``); 0 sends every batch at once.
DEFAULT_BUFFER_TIMEOUT_MS = 100
#: An output channel sends what it holds once its batches reach this many bytes: the
#: size of a channel built without one, and the least a job's channels are given.
DEFAULT_BUFFER_BYTES = 1 << 20
#: Per channel, the most bytes of batches buffered at the receiver, and the most in
#: flight from the sender (a bigger message still goes, alone): the size of a channel
#: built without one, and the least a job's channels are given.
DEFAULT_CHANNEL_BYTES = 1 << 20
#: What a subtask's input channels share, and what its output channels share, unless
#: the job sets a size per channel (Flink's network memory, per subtask): a subtask with
#: few channels gives each up to :data:`MAX_CHANNEL_BYTES`, one with many at least
#: :data:`DEFAULT_CHANNEL_BYTES` (see :func:`channel_bytes_for`).
NETWORK_BYTES = 32 << 20
#: The most bytes of one channel sized by :func:`channel_bytes_for`.
MAX_CHANNEL_BYTES = 16 << 20
#: The most bytes of one message sized by :func:`buffer_bytes_for`.
MAX_BUFFER_BYTES = 4 << 20


def channel_bytes_for(channels: int) -> int:
    """Bytes per channel for a subtask with ``channels`` input (or output) channels: an
    even share of :data:`NETWORK_BYTES`, within [1 MiB, :data:`MAX_CHANNEL_BYTES`].
    Several messages in flight per channel keep the sender busy while the receiver
    works (a channel with room for one message waits a whole turn for each)."""
    share = NETWORK_BYTES // max(1, channels)
    return max(DEFAULT_CHANNEL_BYTES, min(MAX_CHANNEL_BYTES, share))


def buffer_bytes_for(window_bytes: int) -> int:
    """The size at which a channel with ``window_bytes`` in flight sends what it holds: a
    quarter of the window (several messages in flight, as far as the channel's window
    of batches, ``send_window``, allows), within [1 MiB,
    :data:`MAX_BUFFER_BYTES`]. Bigger messages cost fewer calls per byte: through Ray's
    object store a call costs ~4.5 ms plus ~0.4 ms per MB, inline ~1.5 ms plus ~2 ms per
    MB (``benchmarks/RESULTS.md``, Transport)."""
    return max(DEFAULT_BUFFER_BYTES, min(MAX_BUFFER_BYTES, window_bytes // 4))


def message_bytes(message: Any) -> int:
    """Bytes of record batches a channel message carries (0 for an event): every buffer
    they reference, whole, as Ray serializes them (a slice carries its parent's)."""
    if isinstance(message, pa.RecordBatch):
        return message.get_total_buffer_size()
    if isinstance(message, Bundle):
        return sum(
            i.get_total_buffer_size() for i in message.items if isinstance(i, pa.RecordBatch)
        )
    return 0


def message_items(message: Any) -> int:
    """How many buffer slots a channel message takes: one per item (a bundle's batches
    and markers), so that buffers and windows hold as many batches as without bundles."""
    return len(message.items) if isinstance(message, Bundle) else 1


def _data_items(message: Any) -> int:
    """Batches in a message (what buffer debloating counts as data)."""
    if isinstance(message, Bundle):
        return sum(1 for i in message.items if not isinstance(i, _EVENTS))
    return 0 if isinstance(message, _EVENTS) else 1


#: Messages on a channel that are not data: not counted by buffer debloating.
_EVENTS = (CheckpointBarrier, EndOfInput, LatencyMarker, Watermark, WatermarkStatus)


def _retrieved(future: asyncio.Future) -> None:
    """Mark what a push raised as seen (see ``OutputChannel._push``)."""
    if not future.cancelled():
        future.exception()


class ChannelRecorder(Protocol):
    """Takes the messages of some sequence range of some channels (channel state)."""

    def offer(self, channel: int, seq: int, item: Any) -> None: ...


class InputGate:
    """Bounded, in-order buffers for the input channels of one subtask, plus the
    subtask's mailbox of control messages (channel ``CONTROL``, never blocked, served
    before data).

    Each channel has its own condition, so admitting a message wakes only the pushers
    of that channel; the reader waits on one condition of its own.
    """

    def __init__(
        self,
        num_channels: int,
        capacity: int,
        debloater: BufferDebloater | None = None,
        capacity_bytes: int = DEFAULT_CHANNEL_BYTES,
    ) -> None:
        self.num_channels = num_channels
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        #: per channel, the items and bytes buffered, and each buffered message's
        self._items = [0] * num_channels
        self._bytes = [0] * num_channels
        self._sizes: list[deque[tuple[int, int]]] = [deque() for _ in range(num_channels)]
        self.debloater = debloater
        #: per channel, the most messages buffered: ``capacity``, or the debloater's credit
        self._limits = debloater.credits if debloater is not None else [capacity] * num_channels
        self._control: deque[Any] = deque()
        self._buffers: list[deque[Any]] = [deque() for _ in range(num_channels)]
        self._next_seq = [0] * num_channels
        self._blocked = [False] * num_channels
        self._space = [asyncio.Condition() for _ in range(num_channels)]
        self._available = asyncio.Condition()
        self._cursor = 0
        self._buffered = 0
        self.max_buffered = 0
        #: bytes of batches taken by the subtask so far
        self.bytes_taken = 0
        self._closed = False
        #: per channel, the sequence number of the next message ``next()`` hands out
        self.taken = [0] * num_channels
        #: per channel, messages that arrived and wait for buffer space, by sequence number
        self._waiting: list[dict[int, Any]] = [{} for _ in range(num_channels)]
        self._recorders: list[ChannelRecorder] = []
        self._waking: set[asyncio.Task[None]] = set()

    async def push(self, channel: int, seq: int, item: Any) -> int | None:
        """Admit message ``seq`` of ``channel`` in order; waits while the buffer is full.
        Returns the channel's credit with buffer debloating (the sender's window), else
        None."""
        buffer, next_seq = self._buffers[channel], self._next_seq
        space = self._space[channel]
        size, items = message_bytes(item), message_items(item)
        held, held_items, cap_bytes = self._bytes, self._items, self.capacity_bytes

        def admissible() -> bool:
            return next_seq[channel] == seq and (
                not buffer
                or (
                    held_items[channel] + items <= self._limits[channel]
                    and held[channel] + size <= cap_bytes
                )
            )

        # Visible to a recorder from here on, before anything can wait.
        waiting = self._waiting[channel]
        waiting[seq] = item
        for recorder in list(self._recorders):  # a completing recorder leaves the list
            recorder.offer(channel, seq, item)
        try:
            async with space:
                if not admissible():
                    await space.wait_for(lambda: self._closed or admissible())
                if self._closed:
                    return None
                buffer.append(item)
                self._sizes[channel].append((items, size))
                held_items[channel] += items
                held[channel] += size
                next_seq[channel] = seq + 1
                space.notify_all()
        finally:
            del waiting[seq]
        self._buffered += 1
        if self._buffered > self.max_buffered:
            self.max_buffered = self._buffered
        async with self._available:
            self._available.notify()
        return self._limits[channel] if self.debloater is not None else None

    async def put_control(self, item: Any) -> None:
        self._control.append(item)
        async with self._available:
            self._available.notify()

    def put_control_soon(self, item: Any) -> None:
        """:meth:`put_control` from a callback on the gate's loop (it cannot await): the
        item is in the mailbox at once, the reader woken as soon as the loop runs."""
        self._control.append(item)
        waking = asyncio.get_running_loop().create_task(self._wake())
        self._waking.add(waking)
        waking.add_done_callback(self._waking.discard)

    async def _wake(self) -> None:
        async with self._available:
            self._available.notify()

    async def wait_control(self, timeout_s: float) -> None:
        """Wait until a control message is there, at most ``timeout_s`` (a source held
        back by its rate still serves timers and triggers)."""
        if self._control:
            return
        async with self._available:
            if self._control:
                return
            try:
                await asyncio.wait_for(self._available.wait(), timeout_s)
            except TimeoutError:
                pass

    def poll_control(self) -> Any | None:
        """The oldest control message, or None (never waits)."""
        return self._control.popleft() if self._control else None

    def _pick(self) -> int | None:
        if self._control:
            return CONTROL
        n = self.num_channels
        for step in range(n):
            channel = (self._cursor + step) % n
            if self._buffers[channel] and not self._blocked[channel]:
                self._cursor = (channel + 1) % n
                return channel
        return None

    async def next(self) -> tuple[int, Any]:
        """The next message from any unblocked channel (round robin)."""
        debloater = self.debloater
        if debloater is not None and debloater.reading():
            self._limits = debloater.credits
            for space in self._space:  # a raised credit may admit waiting pushes
                async with space:
                    space.notify_all()
        channel = self._pick()
        if channel is None:
            waited_from = debloater.clock() if debloater is not None else 0.0
            async with self._available:
                channel = self._pick()
                while channel is None:
                    await self._available.wait()
                    channel = self._pick()
            if debloater is not None:
                debloater.idle(debloater.clock() - waited_from)
        if channel == CONTROL:
            return CONTROL, self._control.popleft()
        item = self._buffers[channel].popleft()
        items, size = self._sizes[channel].popleft()
        self._items[channel] -= items
        self._bytes[channel] -= size
        self.bytes_taken += size
        self.taken[channel] += 1
        self._buffered -= 1
        if debloater is not None:
            if data := _data_items(item):
                debloater.taken(data)  # barriers, markers, end of input: no data to size for
            elif isinstance(item, EndOfInput):
                debloater.channel_ended()
        space = self._space[channel]
        async with space:
            space.notify_all()
        return channel, item

    def record(self, recorder: ChannelRecorder) -> None:
        """From now on hand ``recorder`` every message that arrives; first, every message
        already here that the subtask has not taken (buffered or waiting for space)."""
        for channel in range(self.num_channels):
            seq = self.taken[channel]
            for item in self._buffers[channel]:
                recorder.offer(channel, seq, item)
                seq += 1
            for seq, item in sorted(self._waiting[channel].items()):
                recorder.offer(channel, seq, item)
        self._recorders.append(recorder)

    def stop_recording(self, recorder: ChannelRecorder) -> None:
        if recorder in self._recorders:
            self._recorders.remove(recorder)

    def block(self, channel: int) -> None:
        """Stop delivering ``channel`` (barrier alignment); pushes still buffer up to capacity."""
        self._blocked[channel] = True

    def unblock_sync(self) -> None:
        """Unblock every channel; a waiting reader notices at the next admission."""
        self._blocked = [False] * self.num_channels

    async def unblock_all(self) -> None:
        self._blocked = [False] * self.num_channels
        async with self._available:
            self._available.notify()

    async def close(self) -> None:
        """Release every waiting ``push``; nothing more is admitted."""
        self._closed = True
        for space in self._space:
            async with space:
                space.notify_all()

    def buffered(self) -> int:
        return self._buffered

    def limits(self) -> list[int]:
        """Per channel, the most messages it may buffer now."""
        return list(self._limits)


class OutputChannel:
    """Sends messages on one channel to one receiving subtask, at most ``window`` in flight.

    With ``adaptive`` (buffer debloating) the window follows the credit the receiver
    returns from each push, bounded by ``[1, window]``; it is read whenever the sender
    awaits its oldest push.

    With ``buffer_bytes`` > 0, :meth:`write` buffers batches and latency markers and sends
    them as one :class:`Bundle` once the buffered batches reach ``buffer_bytes`` or the
    buffer holds a window's worth of items (the window in force); the
    owner sends what is buffered with :meth:`send_buffered` (its buffer timeout). Events
    sent with :meth:`send` always go after everything written before them.
    """

    def __init__(
        self,
        receiver: Any,
        channel: int,
        attempt: int,
        window: int,
        adaptive: bool = False,
        buffer_bytes: int = 0,
        window_bytes: int = DEFAULT_CHANNEL_BYTES,
        eager: bool = False,
        link: Any = None,
    ) -> None:
        if eager and buffer_bytes <= 0:
            raise ValueError("an eager output channel needs buffer_bytes > 0")
        self.receiver = receiver
        #: the connection messages go over (:class:`~rayflow.runtime.data_plane.DataLink`);
        #: None: a Ray call to ``receiver`` per message
        self.link = link
        #: send at once while the window has room; gather while it is full (timeout 0)
        self.eager = eager
        #: a callback is registered on the oldest push, to send the buffer when it returns
        self._credit_armed = False
        #: (eager) what a push made by the callback raised: every later push and the
        #: flush raise it (what the callback took is lost, and must not go unnoticed)
        self._failure: BaseException | None = None
        self.channel = channel
        self.attempt = attempt
        self.window = window
        self.adaptive = adaptive
        self.buffer_bytes = buffer_bytes
        #: the window in force: ``window``, or the receiver's latest credit within it
        self.current_window = window
        self._seq = 0
        #: pushes not yet acknowledged: Ray object refs, or (eager) futures of them
        self._in_flight: deque[Any] = deque()
        self._in_flight_sizes: deque[tuple[int, int]] = deque()
        self._in_flight_items = 0
        self._in_flight_bytes = 0
        self.window_bytes = window_bytes
        self.max_in_flight = 0
        self._buffer: list[Any] = []
        self._buffer_bytes = 0
        self._buffer_origin = 0.0
        #: messages that carried more than one item, and messages that carried batches
        self.bundles = 0
        self.data_messages = 0
        #: bytes of batches sent, and seconds spent waiting for the window (backpressure)
        self.bytes_sent = 0
        self.backpressure_s = 0.0

    async def _acknowledged(self) -> None:
        """Await the oldest push; with ``adaptive``, take the credit it returns."""
        if self.eager:
            await self._in_flight[0]  # raises what the push raised
            self._reap()  # pops it, and any younger one done meanwhile
            return
        credit = await self._in_flight.popleft()
        self._took(credit)

    def _took(self, credit: int | None) -> None:
        """The oldest push in flight was acknowledged with ``credit``."""
        items, size = self._in_flight_sizes.popleft()
        self._in_flight_items -= items
        self._in_flight_bytes -= size
        if self.adaptive and credit is not None:
            self.current_window = max(1, min(self.window, credit))

    def _reap(self, raising: bool = True) -> None:
        """(eager) Take every push at the front that is done, oldest first, without
        waiting. A failed one stays at the front: it raises here with ``raising``, and
        in the next write or flush otherwise (a callback must not swallow it)."""
        if raising and self._failure is not None:
            raise self._failure
        in_flight = self._in_flight
        while in_flight and in_flight[0].done():
            future = in_flight[0]
            if future.cancelled() or future.exception() is not None:
                if raising:
                    future.result()
                return
            in_flight.popleft()
            self._took(future.result())

    def _has_room(self, items: int, size: int) -> bool:
        """Whether a message of ``items`` and ``size`` bytes may go without waiting (one
        bigger than the window goes alone, with nothing else in flight)."""
        return not self._in_flight or (
            self._in_flight_items + items <= self.current_window
            and self._in_flight_bytes + size <= self.window_bytes
        )

    def _arm_credit(self) -> None:
        """(eager) Send the buffer as soon as the oldest push is acknowledged."""
        if not self._credit_armed and self._in_flight:
            self._credit_armed = True
            self._in_flight[0].add_done_callback(self._on_credit)

    def _on_credit(self, _: Any) -> None:
        self._credit_armed = False
        if not self._buffer:
            return
        self._reap(raising=False)
        if self._has_room(len(self._buffer), self._buffer_bytes):
            message = self._take_buffer()
            try:
                self._push(message, message_items(message), message_bytes(message))
            except Exception as exc:  # noqa: BLE001 - raised by the next write, send or flush
                self._failure = exc
        elif not (self._in_flight and self._in_flight[0].done()):
            self._arm_credit()  # still full: wait for the next acknowledgement
        # else the oldest push failed: the next write or flush raises it

    @property
    def position(self) -> int:
        """How many messages were sent on this channel (the next one's sequence number)."""
        return self._seq

    @property
    def buffered(self) -> bool:
        """Whether items were written that are not sent yet."""
        return bool(self._buffer)

    def _push(self, message: Any, items: int, size: int) -> None:
        if self._failure is not None:
            raise self._failure  # a message went missing before this one
        in_flight = self._in_flight
        if self.link is not None:
            # a future already; a failure is raised where it is awaited or reaped (the
            # younger pushes of the same lost link must not each be logged as unseen)
            pushed = self.link.push(self.channel, self._seq, self.attempt, message)
            pushed.add_done_callback(_retrieved)
        elif self.eager:  # a future, so that whether it is done can be seen without waiting
            pushed = self.receiver.push.remote(self.channel, self._seq, self.attempt, message)
            future = getattr(pushed, "future", None)  # a Ray ObjectRef's
            pushed = asyncio.wrap_future(future()) if future else asyncio.ensure_future(pushed)
            # The oldest failure is raised by the next write or flush; the younger ones,
            # of the same lost receiver, must not each be logged as never retrieved.
            pushed.add_done_callback(_retrieved)
        else:
            pushed = self.receiver.push.remote(self.channel, self._seq, self.attempt, message)
        in_flight.append(pushed)
        self._in_flight_sizes.append((items, size))
        self._in_flight_items += items
        self._in_flight_bytes += size
        if size:
            self.data_messages += 1
            self.bytes_sent += size
        self._seq += 1
        if len(in_flight) > self.max_in_flight:
            self.max_in_flight = len(in_flight)

    async def _send(self, message: Any) -> None:
        size, items = message_bytes(message), message_items(message)
        in_flight = self._in_flight
        waited_from = 0.0
        while in_flight and not self._has_room(items, size):
            if not waited_from:
                waited_from = time.monotonic()
            await self._acknowledged()
        if waited_from:
            self.backpressure_s += time.monotonic() - waited_from
        self._push(message, items, size)

    def _take_buffer(self) -> Bundle:
        buffer = self._buffer
        self._buffer = []
        self._buffer_bytes = 0
        if len(buffer) > 1:
            self.bundles += 1
        # Always a bundle, one item or more: it carries the origin of its oldest item.
        return Bundle(tuple(buffer), self._buffer_origin)

    async def write(self, item: Any, origin: float = 0.0) -> bool:
        """Buffer a batch or latency marker (or send it at once without ``buffer_bytes``).
        ``origin`` is when the data ``item`` comes from entered the job (see
        :class:`Bundle`). Returns True when the buffer's oldest origin is now ``origin``:
        the buffer was empty, or ``item`` is older than what it held (the owner arms its
        buffer timeout for ``origin``)."""
        if not self.buffer_bytes:
            await self._send(item)
            return False
        if self.eager:
            await self._write_eagerly(item, origin)
            return False
        limit = min(self.buffer_bytes, self.window_bytes)
        size = item.get_total_buffer_size() if isinstance(item, pa.RecordBatch) else 0
        if self._buffer and self._buffer_bytes + size > limit:
            # would make the bundle bigger than a channel holds: send what is there first
            await self._send(self._take_buffer())
        oldest = not self._buffer or origin < self._buffer_origin
        if oldest:
            self._buffer_origin = origin
        self._buffer.append(item)
        self._buffer_bytes += size
        if self._buffer_bytes >= limit or len(self._buffer) >= self.current_window:
            await self._send(self._take_buffer())
            return False
        return oldest

    async def _write_eagerly(self, item: Any, origin: float) -> None:
        """Send ``item`` now if the window has room and nothing waits before it; else
        add it to the buffer, which goes when a push is acknowledged (or now, when full)."""
        size = item.get_total_buffer_size() if isinstance(item, pa.RecordBatch) else 0
        self._reap()
        if not self._buffer:
            if self._has_room(1, size):
                self._push(item, 1, size)
                return
        elif self._buffer_bytes + size > min(self.buffer_bytes, self.window_bytes):
            await self._send(self._take_buffer())  # room for the bundle before this item
            self._reap()
            if self._has_room(1, size):
                self._push(item, 1, size)
                return
        if not self._buffer or origin < self._buffer_origin:
            self._buffer_origin = origin
        self._buffer.append(item)
        self._buffer_bytes += size
        if self._has_room(len(self._buffer), self._buffer_bytes):
            message = self._take_buffer()  # acknowledged meanwhile, the callback not yet run
            self._push(message, message_items(message), message_bytes(message))
        elif (
            self._buffer_bytes >= min(self.buffer_bytes, self.window_bytes)
            or len(self._buffer) >= self.current_window
        ):
            await self._send(self._take_buffer())  # full: only now does the writer wait
        else:
            self._arm_credit()

    async def send_buffered(self) -> None:
        """Send what is buffered, as one message, once the window has room."""
        if self._buffer:
            await self._send(self._take_buffer())

    def send_buffered_now(self) -> None:
        """Send what is buffered without waiting for the window (one push over it at
        most): the position then counts it, e.g. for a barrier announced out of band."""
        if self._failure is not None:
            raise self._failure  # a position after a lost message is announced to no one
        if self._buffer:
            message = self._take_buffer()
            self._push(message, message_items(message), message_bytes(message))

    async def send(self, message: Any) -> None:
        """Send ``message`` after everything written so far."""
        await self.send_buffered()
        await self._send(message)

    async def flush(self) -> None:
        """Send what is buffered and wait until the receiver has admitted every message."""
        if self._failure is not None:
            raise self._failure
        await self.send_buffered()
        while self._in_flight:
            await self._acknowledged()
