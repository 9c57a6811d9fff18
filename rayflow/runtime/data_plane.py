"""The data plane: channel messages between subtasks over TCP connections of their own.

A push as a Ray actor call costs about 1-2 ms of CPU on each side whatever it carries
(``benchmarks/RESULTS.md``, Transport), which an unchained job pays on every hop for
every message. Here each subtask process serves its input channels on a TCP port of its
node (:class:`DataServer`, on the mailbox's event loop) and each sender keeps one
connection per receiving subtask (:class:`DataLink`): a push is a frame with the same
``(channel, seq, attempt, message)`` as the Ray call, answered by a reply frame with what
the call would return (the channel's credit, or the error). Ordering, credit and barriers
stay where they were (:mod:`rayflow.runtime.channels`): replies may come in any order,
and the gate admits by sequence number. Checkpoint triggers, barrier announcements and
every other control call still go through Ray.

**Who may connect.** A sender learns the address with a Ray call to the receiver's actor
(``data_address``), so only a holder of its handle can: the address comes with a random
token of the receiver's current attempt, which the connection's first frame must carry;
nothing on a connection is unpickled before its token was checked.

**Fencing.** A connection belongs to one attempt (its hello names it). The receiver
hands out a token only for its current attempt, drops the tokens of others, and closes
a connection as soon as a frame arrives on it after the subtask became another
attempt's; a push whose attempt is not the receiver's is dropped by the subtask, as
through Ray. A link is opened for one attempt and closed with it: what a cancelled
attempt still had in flight fails there and reaches no one.

**Failures are never silent.** A link that loses its connection (the receiver died, or
closed it as stale) fails every push in flight and every later one with
:class:`DataLinkError`, a :class:`ConnectionError` naming the receiver: the sender's
attempt fails, as it does when a Ray call finds its receiver dead. A message the
receiver could not take fails its push with :class:`RemotePushError`. Either is handed to
the sender's mailbox as it happens, not only when the channel next waits on that push.
No deadline is measured on a loop that runs user code: a receiver keeps at most
:data:`MAX_UNAUTHENTICATED` connections that have not shown their token, and a sender's
connect timeout counts only the time its loop ran.

Frames (little endian): *hello* ``b"RFD1"``, attempt ``q``, token ``16s``; *push* kind
``B``, request ``Q``, channel ``i``, seq ``q``, attempt ``q``, buffer count ``I``, then
the byte lengths (``Q``) of the pickle and of each out-of-band buffer (pickle protocol 5:
a batch's Arrow buffers go as they are), then those bytes; *reply* kind ``B``, request
``Q``, credit ``q`` (-1: none), and for an error or a refusal a length ``I`` and UTF-8
text; an error then also the receiver's verdict (text: why no restart can fix it, empty
when one may), its operator (text), and its subtask index and parallelism (``ii``).
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import pickle
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rayflow.config import DataTransport

__all__ = [
    "DataAddress",
    "DataLink",
    "DataLinkError",
    "DataLinks",
    "DataServer",
    "DataTransport",
    "RemotePushError",
]


class DataLinkError(ConnectionError):
    """A link to a receiving subtask is lost: what was in flight on it, and anything sent
    on it later, did not arrive."""


class RemotePushError(RuntimeError):
    """The receiving subtask failed to take a message (it could not unpickle it, or its
    input gate raised): the push fails with this, naming the receiver's exception (its
    type and message: a sender unpickles nothing a receiver sends), the receiver
    (``operator``, ``subtask``, ``parallelism``) and its own verdict on it
    (``non_recoverable``: why no restart can fix it, None when one may), which the sender
    reports as the receiver's failure without judging it again. Not a lost connection:
    the sender's attempt fails with it at once (:class:`DataLinks` hands it to the
    sender's mailbox)."""

    def __init__(
        self,
        message: str,
        operator: str = "",
        subtask: int = 0,
        parallelism: int = 1,
        non_recoverable: str | None = None,
    ) -> None:
        super().__init__(message)
        self.operator = operator
        self.subtask = subtask
        self.parallelism = parallelism
        self.non_recoverable = non_recoverable


@dataclass(frozen=True)
class DataAddress:
    """Where a subtask serves its input channels for one attempt, and the token a
    connection of that attempt must show."""

    host: str
    port: int
    attempt: int
    token: bytes


_log = logging.getLogger(__name__)

_MAGIC = b"RFD1"
_HELLO = struct.Struct("<4sq16s")
_PUSH = struct.Struct("<BQiqqI")
_REPLY = struct.Struct("<BQq")
_TEXT = struct.Struct("<I")
_WHERE = struct.Struct("<ii")
_PUSH_KIND = 1
_ACK = 2
_ERROR = 3
_REFUSED = 4
#: A stream reader pauses its socket at twice this many buffered bytes: room for a
#: channel's biggest message (the default limit, 64 KiB, pauses and resumes it every
#: 128 KiB of a batch).
_READ_LIMIT = 8 << 20
_TOKEN_BYTES = 16
#: The longest text of an error sent back.
_MAX_TEXT = 4096
#: A sender gives up connecting after this long (a firewall that drops what it refuses
#: would otherwise hold it for minutes of SYN retries), counted while its event loop
#: runs: a loop held by user code for longer does not time out a connection meanwhile.
CONNECT_TIMEOUT_S = 30.0
#: The slices in which that time is counted.
_CONNECT_SLICE_S = 0.5
#: The most connections a receiver keeps that have not shown their token yet, beyond one
#: per input channel it has (a sender writes its token at once, unless user code holds
#: its loop): past it, the oldest is closed. No deadline: a sender's loop may be held by
#: user code for as long as it takes.
MAX_UNAUTHENTICATED = 256
#: Keepalive probes find a peer whose node went away without closing its connections.
_KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
#: The most out-of-band buffers, and bytes, one frame may announce (a peer that announces
#: more is not speaking this protocol).
_MAX_BUFFERS = 1 << 16
_MAX_FRAME_BYTES = 1 << 36

#: What a receiver does with a push: ``(channel, seq, attempt, message) -> credit``.
PushHandler = Callable[[int, int, int, Any], Awaitable["int | None"]]


def _push_frames(request: int, channel: int, seq: int, attempt: int, message: Any) -> list[Any]:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    lengths = struct.pack(f"<{len(raws) + 1}Q", len(data), *(r.nbytes for r in raws))
    return [
        _PUSH.pack(_PUSH_KIND, request, channel, seq, attempt, len(raws)),
        lengths,
        data,
        *raws,
    ]


def _text_frame(kind: int, request: int, text: str) -> bytes:
    raw = text.encode("utf-8", "replace")[:_MAX_TEXT]
    return _REPLY.pack(kind, request, -1) + _TEXT.pack(len(raw)) + raw


def _keep_alive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass  # keepalive is a help, not a condition


def _error_frame(
    request: int, exc: BaseException, reason: str | None, receiver: tuple[str, int, int]
) -> bytes:
    """A push's failure, as text (a sender unpickles nothing a receiver sends: it never
    checked who answers on the port it was given), with why no restart can fix it (the
    receiver's classification; empty when one may) and the receiver (operator, subtask,
    parallelism). Never raises."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - an exception whose str() fails
        text = f"{type(exc).__name__} (its message could not be read)"
    operator, subtask, parallelism = receiver
    return (
        _text_frame(_ERROR, request, text)
        + _packed_text(reason or "")
        + _packed_text(operator)
        + _WHERE.pack(subtask, parallelism)
    )


def _packed_text(text: str) -> bytes:
    raw = text.encode("utf-8", "replace")[:_MAX_TEXT]
    return _TEXT.pack(len(raw)) + raw


def _node_host() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


class DataServer:
    """Serves one subtask process's input channels: accepts connections that show the
    token of the subtask's current attempt and hands their pushes to ``handler``.

    Lives on the mailbox's event loop: :meth:`address` is called there (it starts the
    server the first time), and every push is handled there."""

    def __init__(
        self,
        handler: PushHandler,
        current_attempt: Callable[[], int],
        host: str | None = None,
        senders: Callable[[], int] = lambda: 0,
        classify: Callable[[BaseException], str | None] = lambda exc: None,
        receiver: Callable[[], tuple[str, int, int]] = lambda: ("", 0, 1),
    ) -> None:
        self._handler = handler
        self._current_attempt = current_attempt
        #: how many senders the subtask expects (its input channels)
        self._senders = senders
        #: why no restart can fix an error of a push (None: one may)
        self._classify = classify
        #: who fails when a push fails here: (operator, subtask index, parallelism)
        self._receiver = receiver
        self._host = host
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Future[asyncio.AbstractServer] | None = None
        self._tokens: dict[int, bytes] = {}
        self._connections: set[asyncio.StreamWriter] = set()
        #: connections that have not shown their token yet, oldest first
        self._unauthenticated: dict[asyncio.StreamWriter, None] = {}
        #: pushes received and not answered yet (kept referenced until they are)
        self._answering: set[asyncio.Task[None]] = set()
        #: connections refused (a wrong token or attempt) and closed as stale
        self.refused = 0
        self.closed_stale = 0
        self.evicted = 0

    async def address(self, attempt: int) -> DataAddress:
        """Where to connect for ``attempt``: only the subtask's current attempt is
        served (a sender of any other is stale, or deployed before its receiver)."""
        current = self._current_attempt()
        if attempt != current:
            raise DataLinkError(
                f"this subtask runs attempt {current}; no connection for attempt {attempt}"
            )
        if self._server is None:
            if self._starting is None:  # once, however many senders ask at the same time
                host = self._host or _node_host()
                self._starting = asyncio.ensure_future(
                    asyncio.start_server(self._serve, host, 0, limit=_READ_LIMIT)
                )
            starting = self._starting
            try:
                server = await asyncio.shield(starting)
            except Exception:
                if self._starting is starting:
                    self._starting = None  # the next ask tries again
                raise
            if self._server is None and self._starting is not None:
                self._server = server
            if self._server is not server:  # closed meanwhile
                raise DataLinkError("this subtask's data server is closed")
        for other in [a for a in self._tokens if a != attempt]:
            del self._tokens[other]
        token = self._tokens.get(attempt)
        if token is None:
            token = self._tokens[attempt] = secrets.token_bytes(_TOKEN_BYTES)
        host, port = self._server.sockets[0].getsockname()[:2]
        return DataAddress(host, port, attempt, token)

    def _accepts(self, attempt: int, token: bytes) -> bool:
        expected = self._tokens.get(attempt)
        return (
            expected is not None
            and attempt == self._current_attempt()
            and hmac.compare_digest(expected, token)
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        waiting = self._unauthenticated
        waiting[writer] = None
        while len(waiting) > MAX_UNAUTHENTICATED + self._senders():
            oldest = next(iter(waiting))
            del waiting[oldest]
            oldest.close()
            self.evicted += 1
            _log.warning(
                "closed a connection that had not shown its token: more than %d wait",
                MAX_UNAUTHENTICATED + self._senders(),
            )
        try:
            hello = await reader.readexactly(_HELLO.size)
            waiting.pop(writer, None)
            magic, attempt, token = _HELLO.unpack(hello)
            if magic != _MAGIC or not self._accepts(attempt, token):
                self.refused += 1
                writer.write(_text_frame(_REFUSED, 0, "refused: not this subtask's attempt"))
                return
            _keep_alive(writer)
            await self._read_pushes(reader, writer, attempt)
        except (asyncio.IncompleteReadError, ConnectionError, struct.error):
            pass  # the sender went away (or spoke nonsense): it learns so from the close
        finally:
            waiting.pop(writer, None)
            self._connections.discard(writer)
            writer.close()

    async def _read_pushes(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, attempt: int
    ) -> None:
        loop = asyncio.get_running_loop()
        head_size = _PUSH.size
        while True:
            kind, request, channel, seq, pushed_attempt, count = _PUSH.unpack(
                await reader.readexactly(head_size)
            )
            if kind != _PUSH_KIND or count > _MAX_BUFFERS:
                return
            lengths = struct.unpack(f"<{count + 1}Q", await reader.readexactly(8 * (count + 1)))
            if sum(lengths) > _MAX_FRAME_BYTES:
                return
            data = await reader.readexactly(lengths[0])
            buffers = [await reader.readexactly(n) for n in lengths[1:]]
            if self._current_attempt() != attempt:
                # The subtask became another attempt's: this connection is stale.
                self.closed_stale += 1
                return
            try:
                message = pickle.loads(data, buffers=buffers)
            except Exception as exc:  # noqa: BLE001 - e.g. a class this process cannot import
                # the sender's attempt fails with it
                writer.write(self._error_frame(request, exc))
                continue
            task = loop.create_task(
                self._answer(writer, request, channel, seq, pushed_attempt, message)
            )
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        request: int,
        channel: int,
        seq: int,
        attempt: int,
        message: Any,
    ) -> None:
        try:
            credit = await self._handler(channel, seq, attempt, message)
        except Exception as exc:  # noqa: BLE001 - the sender's push raises it
            frame = self._error_frame(request, exc)
        else:
            frame = _REPLY.pack(_ACK, request, -1 if credit is None else credit)
        if not writer.is_closing():
            writer.write(frame)

    def _error_frame(self, request: int, exc: BaseException) -> bytes:
        try:
            reason = self._classify(exc)
        except Exception:  # noqa: BLE001 - a failing classifier: a restart may help
            reason = None
        try:
            receiver = self._receiver()
        except Exception:  # noqa: BLE001 - the sender names the link instead
            receiver = ("", 0, 1)
        return _error_frame(request, exc, reason, receiver)

    def close(self) -> None:
        """Stop serving; every connection is closed (their senders' pushes fail)."""
        if self._server is not None:
            self._server.close()
        elif self._starting is not None:  # close it once it has started
            self._starting.add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None or f.result().close()
            )
        self._server = None
        self._starting = None
        for writer in list(self._connections):
            writer.close()
        self._connections.clear()
        self._tokens.clear()


class _LinkState(enum.Enum):
    NEW = "new"
    CONNECTING = "connecting"
    OPEN = "open"
    FAILED = "failed"
    CLOSED = "closed"


class DataLink:
    """One sender's connection to one receiving subtask, for one attempt.

    :meth:`push` returns a future of the receiver's answer at once: the first push (or
    :meth:`connect`, when the run starts) starts connecting (the address through a Ray
    call to ``receiver``), and what is pushed meanwhile is sent, in order, once
    connected."""

    def __init__(
        self,
        receiver: Any,
        attempt: int,
        describe: str,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._receiver = receiver
        self._on_failure = on_failure
        self.attempt = attempt
        self.describe = describe
        self.state = _LinkState.NEW
        self._queued: list[list[Any]] = []
        self._waiting: dict[int, asyncio.Future[int | None]] = {}
        self._request = 0
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._failure: DataLinkError | None = None
        #: set once connecting is over: the link is open, failed or closed
        self._settled: asyncio.Event | None = None

    def connect(self) -> None:
        """Start connecting now, before the first push (which then finds the link open
        instead of waiting a Ray call and a TCP handshake); nothing is sent."""
        if self.state is _LinkState.NEW and self._task is None:
            self.state = _LinkState.CONNECTING
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def settled(self) -> None:
        """Return once connecting is over (open, failed or closed); at once for a link
        that never started connecting."""
        if self.state is not _LinkState.CONNECTING:
            return
        if self._settled is None:
            self._settled = asyncio.Event()
        await self._settled.wait()

    def _settle(self) -> None:
        if self._settled is not None:
            self._settled.set()

    def push(self, channel: int, seq: int, attempt: int, message: Any) -> asyncio.Future:
        """Send message ``seq`` of ``channel``; the future holds the receiver's credit
        (None without one), or raises :class:`DataLinkError` (the link is lost or closed),
        :class:`RemotePushError` (the receiver could not take it), or the failure another
        link of the same attempt met first (:meth:`DataLinks._failed`)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int | None] = loop.create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        if self.state is _LinkState.CLOSED:
            future.set_exception(DataLinkError(f"the link to {self.describe} is closed"))
            return future
        self._request += 1
        request = self._request
        frames = _push_frames(request, channel, seq, attempt, message)
        self._waiting[request] = future
        if self.state is _LinkState.OPEN:
            self._writer.writelines(frames)
        else:
            self._queued.append(frames)
            if self._task is None:
                self.state = _LinkState.CONNECTING
                self._task = loop.create_task(self._run())
        return future

    async def _run(self) -> None:
        writer = None
        try:
            address = await self._receiver.data_address.remote(self.attempt)
            reader, writer = await self._connect(address)
            if self.state is not _LinkState.CONNECTING:  # closed meanwhile
                return
            _keep_alive(writer)
            writer.write(_HELLO.pack(_MAGIC, self.attempt, address.token))
            for frames in self._queued:
                writer.writelines(frames)
            self._queued = []
            self._writer = writer
            self.state = _LinkState.OPEN
            self._settle()
            await self._read_replies(reader)
        except asyncio.CancelledError:
            self._fail(DataLinkError(f"the link to {self.describe} is closed"))
            raise
        except Exception as exc:  # noqa: BLE001 - every push in flight fails with it
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            error = DataLinkError(
                f"lost the connection to {self.describe}: {type(exc).__name__}"
                + (f": {first}" if first else "")
            )
            self._fail(error)
            self._report(error)
        finally:
            if writer is not None:
                writer.close()

    async def _connect(
        self, address: DataAddress
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open the connection, giving up after :data:`CONNECT_TIMEOUT_S` of this loop's
        running time (a slice the loop overran, held by user code, counts as one slice)."""
        loop = asyncio.get_running_loop()
        connecting = loop.create_task(
            asyncio.open_connection(address.host, address.port, limit=_READ_LIMIT)
        )
        waited = 0.0
        try:
            while waited < CONNECT_TIMEOUT_S:
                started = loop.time()
                done, _ = await asyncio.wait({connecting}, timeout=_CONNECT_SLICE_S)
                if done:
                    return connecting.result()
                waited += min(loop.time() - started, _CONNECT_SLICE_S)
        except asyncio.CancelledError:
            # closed while connecting: a connection made anyway is closed, not left open
            connecting.add_done_callback(_close_made)
            raise
        connecting.cancel()
        connecting.add_done_callback(_close_made)
        raise DataLinkError(
            f"could not connect to {self.describe} at {address.host}:{address.port} "
            f"within {CONNECT_TIMEOUT_S:.0f} s (do the nodes allow connections to each "
            "other's ephemeral ports? else set_data_transport('ray'))"
        )

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        waiting = self._waiting
        while True:
            kind, request, credit = _REPLY.unpack(await reader.readexactly(_REPLY.size))
            if kind == _ACK:
                future = waiting.pop(request, None)
                if future is not None and not future.done():
                    future.set_result(None if credit < 0 else credit)
                continue
            (length,) = _TEXT.unpack(await reader.readexactly(_TEXT.size))
            text = (await reader.readexactly(length)).decode("utf-8", "replace")
            if kind == _ERROR:
                reason = await _read_text(reader)
                operator = await _read_text(reader)
                subtask, parallelism = _WHERE.unpack(await reader.readexactly(_WHERE.size))
                error = RemotePushError(
                    f"{self.describe} failed to take a message: {text}",
                    operator,
                    subtask,
                    parallelism,
                    reason or None,
                )
                future = waiting.pop(request, None)
                if future is not None and not future.done():
                    future.set_exception(error)
                self._report(error)
                continue
            raise DataLinkError(f"{self.describe} {text}")

    def _report(self, error: BaseException) -> None:
        """Hand a failure to the owner at once (not only when it next awaits this push:
        an idle channel may not for long, and what follows it waits behind the gap)."""
        if self._on_failure is not None and self.state is not _LinkState.CLOSED:
            self._on_failure(error)

    def fail_waiting(self, error: BaseException) -> None:
        """Fail every push waiting for an answer (their answers, if any come, are
        dropped); the link stays as it is."""
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)

    def _fail(self, error: DataLinkError) -> None:
        if self._failure is None:
            self._failure = error
        if self.state is not _LinkState.CLOSED:
            self.state = _LinkState.FAILED
        self._settle()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
        self._queued = []

    def close(self) -> None:
        """Close the connection; pushes still in flight fail (the attempt is over)."""
        if self.state is _LinkState.CLOSED:
            return
        self._fail(DataLinkError(f"the link to {self.describe} is closed"))
        self.state = _LinkState.CLOSED
        if self._task is not None:
            self._task.cancel()
        if self._writer is not None:
            self._writer.close()


async def _read_text(reader: asyncio.StreamReader) -> str:
    (length,) = _TEXT.unpack(await reader.readexactly(_TEXT.size))
    return (await reader.readexactly(length)).decode("utf-8", "replace")


def _close_made(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result()[1].close()


class DataLinks:
    """A sending subtask's links of one attempt, one per receiving subtask."""

    def __init__(
        self, attempt: int, on_failure: Callable[[BaseException], None] | None = None
    ) -> None:
        self.attempt = attempt
        self._on_failure = on_failure
        self._links: dict[Any, DataLink] = {}
        #: the first failure one of the links handed over
        self.error: BaseException | None = None

    def link(self, receiver: Any, describe: str) -> DataLink:
        key = getattr(receiver, "_actor_id", None) or id(receiver)
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = DataLink(receiver, self.attempt, describe, self._failed)
        return link

    def _failed(self, error: BaseException) -> None:
        """A link failed: the attempt fails of it. Every push still waiting for an
        answer on any link fails with it too, so that a channel waiting for room (perhaps
        behind a receiver stuck at the failed push) raises it at once."""
        if self.error is None:
            self.error = error
        for link in self._links.values():
            link.fail_waiting(error)
        if self._on_failure is not None:
            self._on_failure(error)

    def connect(self) -> None:
        """Start connecting every link (see :meth:`DataLink.connect`)."""
        for link in self._links.values():
            link.connect()

    async def connected(self, timeout_s: float) -> bool:
        """Wait until every link is open (or failed: the failure is reported as it
        would be at a push), at most ``timeout_s``; True if none is still connecting."""
        links = list(self._links.values())
        if not links:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*(link.settled() for link in links)), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
