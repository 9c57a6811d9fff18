"""The data plane's connections: round trips, tokens, attempts, lost receivers, and output
channels over them (no Ray: a receiver's ``data_address`` is a plain coroutine here)."""

from __future__ import annotations

import asyncio
import pickle
import struct
import time

import pyarrow as pa
import pytest

from rayflow.runtime import data_plane
from rayflow.runtime.channels import InputGate, OutputChannel
from rayflow.runtime.data_plane import (
    DataLink,
    DataLinkError,
    DataLinks,
    DataServer,
    RemotePushError,
)
from rayflow.runtime.events import Bundle, CheckpointBarrier, EndOfInput, LatencyMarker


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class _Receiver:
    """What a link needs of a receiver's actor handle: ``data_address.remote()``."""

    def __init__(self, server: DataServer) -> None:
        self.server = server
        self.data_address = _Method(server.address)


class _Subtask:
    """A receiving subtask: its attempt, and what its pushes did."""

    def __init__(self, attempt: int = 0, credit: int | None = None) -> None:
        self.attempt = attempt
        self.credit = credit
        self.pushed: list[tuple[int, int, int, object]] = []
        self.hold: dict[int, asyncio.Event] = {}
        self.fail_seq: int | None = None

    async def push(self, channel: int, seq: int, attempt: int, message: object) -> int | None:
        if seq in self.hold:
            await self.hold[seq].wait()
        if seq == self.fail_seq:
            raise ValueError(f"cannot take message {seq}")
        self.pushed.append((channel, seq, attempt, message))
        return self.credit


class _AskedBy:
    """A receiver's handle whose ``data_address`` is the coroutine function given."""

    def __init__(self, address) -> None:
        self.data_address = _Method(address)


async def _unreachable(attempt):
    raise RuntimeError("The actor died unexpectedly")


def _server(subtask: _Subtask) -> DataServer:
    return DataServer(subtask.push, lambda: subtask.attempt, host="127.0.0.1")


def _batch(n: int = 5) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"v": list(range(n)), "s": [str(i) for i in range(n)]})


def test_messages_arrive_as_sent_and_pushes_return_the_receivers_credit():
    async def main():
        subtask = _Subtask(attempt=3, credit=7)
        server = _server(subtask)
        link = DataLink(_Receiver(server), 3, "subtask 1/1 of 'sum'")
        batch = _batch(100_000)  # buffers out of band, bigger than a socket's buffer
        messages = [
            batch,
            Bundle((_batch(3), LatencyMarker(1.5, "src", 0), _batch(2)), 12.25),
            CheckpointBarrier(4, 9.0),
            EndOfInput(),
        ]
        futures = [link.push(2, seq, 3, m) for seq, m in enumerate(messages)]
        assert await asyncio.gather(*futures) == [7, 7, 7, 7]
        assert [(c, s, a) for c, s, a, _ in subtask.pushed] == [(2, i, 3) for i in range(4)]
        got = [m for *_, m in subtask.pushed]
        assert got[0].equals(batch)
        assert got[1].origin == 12.25 and got[1].items[1] == LatencyMarker(1.5, "src", 0)
        assert got[1].items[0].equals(_batch(3)) and got[1].items[2].equals(_batch(2))
        assert got[2:] == messages[2:]
        link.close()
        server.close()

    asyncio.run(main())


def test_a_push_without_credit_returns_none():
    async def main():
        subtask = _Subtask(credit=None)
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "r")
        assert await link.push(0, 0, 0, _batch()) is None
        link.close()
        server.close()

    asyncio.run(main())


def test_replies_may_come_in_any_order():
    async def main():
        subtask = _Subtask(credit=1)
        subtask.hold[0] = asyncio.Event()
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "r")
        first = link.push(0, 0, 0, _batch())
        second = link.push(0, 1, 0, _batch())
        assert await second == 1
        assert not first.done()
        subtask.hold[0].set()
        assert await first == 1
        assert [s for _, s, _, _ in subtask.pushed] == [1, 0]
        link.close()
        server.close()

    asyncio.run(main())


def test_an_error_of_one_push_fails_that_push_only():
    async def main():
        subtask = _Subtask(credit=2)
        subtask.fail_seq = 1
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "subtask 2/2 of 'sink'")
        futures = [link.push(0, seq, 0, _batch()) for seq in range(3)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert results[0] == 2 and results[2] == 2
        # the receiver's own exception, not a lost connection (which would mark the
        # sender's failure secondary and hide what decides whether a restart helps)
        assert isinstance(results[1], RemotePushError)
        assert not isinstance(results[1], ConnectionError)
        assert "subtask 2/2 of 'sink'" in str(results[1])
        assert "ValueError: cannot take message 1" in str(results[1])
        link.close()
        server.close()

    asyncio.run(main())


def test_a_lost_receiver_fails_every_push_in_flight_and_every_later_one():
    async def main():
        subtask = _Subtask(credit=1)
        subtask.hold[1] = asyncio.Event()  # never set: in flight when the receiver goes
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "subtask 1/2 of 'sum'")
        assert await link.push(0, 0, 0, _batch()) == 1
        in_flight = link.push(0, 1, 0, _batch())
        await asyncio.sleep(0.05)
        server.close()  # as the receiver's process dying closes its sockets
        with pytest.raises(DataLinkError, match="subtask 1/2 of 'sum'"):
            await asyncio.wait_for(in_flight, 5)
        with pytest.raises(DataLinkError):
            await link.push(0, 2, 0, _batch())
        link.close()

    asyncio.run(main())


def test_a_receiver_that_cannot_be_asked_fails_the_link():
    async def main():
        link = DataLink(_AskedBy(_unreachable), 0, "subtask 1/1 of 'sink'")
        with pytest.raises(DataLinkError, match="actor died unexpectedly"):
            await link.push(0, 0, 0, _batch())

    asyncio.run(main())


def test_connect_opens_the_link_before_the_first_push():
    async def main():
        subtask = _Subtask(credit=4)
        server = _server(subtask)
        links = DataLinks(0)
        link = links.link(_Receiver(server), "r")
        assert await links.connected(0.01)  # nothing started: nothing to wait for
        links.connect()
        assert await links.connected(5.0)
        assert link.state is data_plane._LinkState.OPEN
        assert len(server._connections) == 1 and subtask.pushed == []  # nothing sent
        assert await link.push(0, 0, 0, _batch()) == 4
        assert len(server._connections) == 1  # the push went over that connection
        links.connect()  # again: nothing changes
        assert link.state is data_plane._LinkState.OPEN
        links.close()
        server.close()

    asyncio.run(main())


def test_waiting_for_connections_is_bounded_and_pushes_meanwhile_still_go():
    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        answer = asyncio.Event()

        async def slow_address(attempt):
            await answer.wait()  # the receiver's mailbox is held up
            return await server.address(attempt)

        links = DataLinks(0)
        link = links.link(_AskedBy(slow_address), "r")
        links.connect()
        started = time.monotonic()
        assert not await links.connected(0.05)
        assert 0.04 < time.monotonic() - started < 2.0
        assert link.state is data_plane._LinkState.CONNECTING
        pushed = link.push(0, 0, 0, _batch())  # queued until the link is open
        answer.set()
        assert await pushed == 1
        assert [s for _, s, _, _ in subtask.pushed] == [0]
        links.close()
        server.close()

    asyncio.run(main())


def test_a_link_that_fails_to_connect_ends_the_wait_and_is_reported():
    async def main():
        failures = []
        links = DataLinks(0, failures.append)
        link = links.link(_AskedBy(_unreachable), "subtask 1/1 of 'sink'")
        links.connect()
        assert await links.connected(5.0)
        assert link.state is data_plane._LinkState.FAILED
        assert len(failures) == 1 and "actor died unexpectedly" in str(failures[0])
        with pytest.raises(DataLinkError, match="actor died unexpectedly"):
            await link.push(0, 0, 0, _batch())

    asyncio.run(main())


def test_closing_a_connecting_link_ends_the_wait():
    async def main():
        never = asyncio.Event()

        async def stalled(attempt):
            await never.wait()

        links = DataLinks(0)
        link = links.link(_AskedBy(stalled), "r")
        links.connect()
        waiting = asyncio.ensure_future(links.connected(5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        link.close()
        assert await asyncio.wait_for(waiting, 1.0)
        assert link.state is data_plane._LinkState.CLOSED

    asyncio.run(main())


def test_an_address_is_given_only_for_the_current_attempt():
    async def main():
        subtask = _Subtask(attempt=2)
        server = _server(subtask)
        with pytest.raises(DataLinkError, match="runs attempt 2; no connection for attempt 1"):
            await server.address(1)
        with pytest.raises(DataLinkError, match="attempt 3"):
            await server.address(3)
        stale = DataLink(_Receiver(server), 1, "r")
        with pytest.raises(DataLinkError, match="runs attempt 2"):
            await stale.push(0, 0, 1, _batch())
        assert subtask.pushed == []
        server.close()

    asyncio.run(main())


class _Armed:
    """Unpickling this sets a flag (what a forged frame could make a receiver run)."""

    fired: list[bool] = []

    def __reduce__(self):
        return (_Armed.fired.append, (True,))


async def _raw_connection(address, attempt, token, message):
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(data_plane._HELLO.pack(data_plane._MAGIC, attempt, token))
    for frame in data_plane._push_frames(1, 0, 0, attempt, message):
        writer.write(frame)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(4096), 5)  # the reply (or refusal)
    writer.close()
    return reply


def test_a_connection_without_the_attempts_token_is_refused_before_anything_is_unpickled():
    async def main():
        _Armed.fired.clear()
        subtask = _Subtask(attempt=1)
        server = _server(subtask)
        address = await server.address(1)
        wrong = bytes(16) if address.token != bytes(16) else b"x" * 16
        reply = await _raw_connection(address, 1, wrong, _Armed())
        kind, _, _ = data_plane._REPLY.unpack(reply[: data_plane._REPLY.size])
        assert kind == data_plane._REFUSED and b"refused" in reply
        # the right token but another attempt's number
        reply = await _raw_connection(address, 0, address.token, _Armed())
        assert b"refused" in reply
        assert _Armed.fired == [] and subtask.pushed == [] and server.refused == 2
        # and the right token for the right attempt is served
        reply = await _raw_connection(address, 1, address.token, [1, 2])
        assert data_plane._REPLY.unpack(reply[: data_plane._REPLY.size])[0] == data_plane._ACK
        assert _Armed.fired == [] and subtask.pushed == [(0, 0, 1, [1, 2])]
        server.close()

    asyncio.run(main())


def test_a_connection_of_an_earlier_attempt_is_closed_at_its_next_frame():
    """The subtask is redeployed for attempt 1 while a link of attempt 0 is open: the
    next frame on it is not handed to the subtask, and the link fails."""

    async def main():
        subtask = _Subtask(attempt=0, credit=1)
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "subtask 1/1 of 'sum'")
        assert await link.push(0, 0, 0, _batch()) == 1
        subtask.attempt = 1  # redeployed
        with pytest.raises(DataLinkError, match="lost the connection to subtask 1/1 of 'sum'"):
            await asyncio.wait_for(link.push(0, 1, 0, _batch()), 5)
        assert [s for _, s, _, _ in subtask.pushed] == [0]
        assert server.closed_stale == 1
        # the new attempt connects with a token of its own
        fresh = DataLink(_Receiver(server), 1, "r")
        assert await fresh.push(0, 0, 1, _batch()) == 1
        assert [(s, a) for _, s, a, _ in subtask.pushed] == [(0, 0), (0, 1)]
        fresh.close()
        server.close()

    asyncio.run(main())


def test_a_closed_link_fails_what_it_had_in_flight_and_sends_nothing_more():
    async def main():
        subtask = _Subtask(credit=1)
        subtask.hold[0] = asyncio.Event()
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "r")
        pending = link.push(0, 0, 0, _batch())
        await asyncio.sleep(0.05)
        link.close()
        with pytest.raises(DataLinkError, match="closed"):
            await pending
        with pytest.raises(DataLinkError, match="closed"):
            await link.push(0, 1, 0, _batch())
        subtask.hold[0].set()
        await asyncio.sleep(0.05)
        assert [s for _, s, _, _ in subtask.pushed] == [0]  # taken before the close only
        server.close()

    asyncio.run(main())


def test_a_link_closed_while_it_connects_sends_nothing():
    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        asked = asyncio.Event()
        release = asyncio.Event()

        async def slow_address(attempt):
            asked.set()
            await release.wait()
            return await server.address(attempt)

        link = DataLink(_AskedBy(slow_address), 0, "r")
        pending = link.push(0, 0, 0, _batch())
        await asked.wait()
        link.close()
        release.set()
        with pytest.raises(DataLinkError, match="closed"):
            await pending
        await asyncio.sleep(0.05)
        assert subtask.pushed == []
        server.close()

    asyncio.run(main())


def test_links_are_one_per_receiver_and_close_together():
    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        receiver = _Receiver(server)
        links = DataLinks(0)
        a = links.link(receiver, "r")
        assert links.link(receiver, "r") is a
        assert links.link(_Receiver(server), "other") is not a
        assert await a.push(0, 0, 0, _batch()) == 1
        links.close()
        with pytest.raises(DataLinkError):
            await a.push(0, 1, 0, _batch())
        server.close()

    asyncio.run(main())


def test_a_frame_of_another_kind_closes_the_connection():
    async def main():
        subtask = _Subtask(attempt=0)
        server = _server(subtask)
        address = await server.address(0)
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(data_plane._HELLO.pack(data_plane._MAGIC, 0, address.token))
        writer.write(struct.pack("<B", 9) + bytes(data_plane._PUSH.size - 1))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert subtask.pushed == []
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("eager", [False, True])
def test_output_channels_deliver_in_order_over_a_link_into_an_input_gate(eager):
    """An output channel whose window is smaller than what it sends, over a link, into a
    real input gate of two messages: every batch arrives once, in order."""

    async def main():
        gate = InputGate(1, capacity=2, capacity_bytes=1 << 20)
        attempt = {"n": 0}

        async def push(channel, seq, attempt_no, message):
            return await gate.push(channel, seq, message)

        server = DataServer(push, lambda: attempt["n"], host="127.0.0.1")
        link = DataLink(_Receiver(server), 0, "r")
        out = OutputChannel(None, 0, 0, window=2, buffer_bytes=1 << 20, eager=eager, link=link)
        received: list[int] = []

        async def read():
            while True:
                _, item = await gate.next()
                for part in item.items if isinstance(item, Bundle) else (item,):
                    if isinstance(part, EndOfInput):
                        return
                    received.extend(part.column("v").to_pylist())
                await asyncio.sleep(0)

        reader = asyncio.get_running_loop().create_task(read())
        for i in range(200):
            await out.write(pa.RecordBatch.from_pydict({"v": [i]}), 0.0)
            if i % 7 == 0:
                await out.send_buffered()
        await out.send(EndOfInput())
        await out.flush()
        await asyncio.wait_for(reader, 10)
        assert received == list(range(200))
        assert out.max_in_flight <= 3  # the window (one bigger message may go alone)
        link.close()
        server.close()

    asyncio.run(main())


def test_a_message_that_cannot_be_pickled_fails_the_write_itself():
    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "r")
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
            link.push(0, 0, 0, lambda: None)
        assert await link.push(0, 0, 0, _batch()) == 1  # the link is still usable
        link.close()
        server.close()

    asyncio.run(main())


class _Unloadable:
    """Pickles at the sender; cannot be unpickled at the receiver."""

    def __reduce__(self):
        return (_missing_module, ())


def _missing_module():
    raise ModuleNotFoundError("No module named 'user_udfs'")


def test_a_message_the_receiver_cannot_unpickle_fails_that_push_with_its_cause():
    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        link = DataLink(_Receiver(server), 0, "subtask 1/1 of 'sink'")
        assert await link.push(0, 0, 0, _batch()) == 1
        with pytest.raises(
            RemotePushError, match="ModuleNotFoundError: No module named 'user_udfs'"
        ):
            await asyncio.wait_for(link.push(0, 1, 0, _Unloadable()), 5)
        assert await link.push(0, 2, 0, _batch()) == 1  # the connection goes on
        assert [s for _, s, _, _ in subtask.pushed] == [0, 2]
        link.close()
        server.close()

    asyncio.run(main())


def test_connections_that_never_show_their_token_are_bounded(monkeypatch):
    monkeypatch.setattr(data_plane, "MAX_UNAUTHENTICATED", 5)

    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        address = await server.address(0)
        opened = []
        for _ in range(20):
            opened.append(await asyncio.open_connection(address.host, address.port))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert len(server._unauthenticated) == 5
        # the oldest were closed
        assert await asyncio.wait_for(opened[0][0].read(), 5) == b""
        # a sender still connects and is served
        link = DataLink(_Receiver(server), 0, "r")
        assert await link.push(0, 0, 0, _batch()) == 1
        link.close()
        for _, writer in opened:
            writer.close()
        server.close()

    asyncio.run(main())


def test_a_sender_that_shows_its_token_late_is_served():
    """User code may hold a sender's loop between its connect and its hello: no
    deadline on the receiver fails a healthy link for that."""

    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        address = await server.address(0)
        reader, writer = await asyncio.open_connection(address.host, address.port)
        await asyncio.sleep(1.5)
        writer.write(data_plane._HELLO.pack(data_plane._MAGIC, 0, address.token))
        for frame in data_plane._push_frames(1, 0, 0, 0, "late"):
            writer.write(frame)
        reply = await asyncio.wait_for(reader.readexactly(data_plane._REPLY.size), 5)
        assert data_plane._REPLY.unpack(reply)[0] == data_plane._ACK
        assert subtask.pushed == [(0, 0, 0, "late")]
        writer.close()
        server.close()

    asyncio.run(main())


def test_a_sender_loop_held_while_it_connects_does_not_time_the_connect_out(monkeypatch):
    monkeypatch.setattr(data_plane, "CONNECT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(data_plane, "_CONNECT_SLICE_S", 0.05)

    async def main():
        subtask = _Subtask(credit=1)
        server = _server(subtask)
        await server.address(0)  # started
        link = DataLink(_Receiver(server), 0, "r")
        pushed = link.push(0, 0, 0, _batch())
        await asyncio.sleep(0)  # the link asks for the address and starts connecting
        await asyncio.sleep(0)
        time.sleep(0.6)  # user code holds the loop for 3 connect timeouts
        assert await asyncio.wait_for(pushed, 5) == 1
        link.close()
        server.close()

    asyncio.run(main())


def test_a_server_that_failed_to_start_starts_at_the_next_ask(monkeypatch):
    real = asyncio.start_server
    calls = []

    async def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(24, "Too many open files")
        return await real(*args, **kwargs)

    monkeypatch.setattr(data_plane.asyncio, "start_server", flaky)

    async def main():
        server = _server(_Subtask())
        with pytest.raises(OSError, match="Too many open files"):
            await server.address(0)
        address = await server.address(0)
        assert address.port > 0 and len(calls) == 2
        server.close()

    asyncio.run(main())


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def test_a_receiver_error_whose_text_cannot_be_read_still_fails_the_push():
    async def main():
        async def push(channel, seq, attempt, message):
            raise _Unprintable()

        server = DataServer(push, lambda: 0, host="127.0.0.1")
        link = DataLink(_Receiver(server), 0, "r")
        with pytest.raises(RemotePushError, match="_Unprintable"):
            await asyncio.wait_for(link.push(0, 0, 0, _batch()), 5)
        link.close()
        server.close()

    asyncio.run(main())


def test_failures_are_handed_to_the_owner_at_once_and_a_close_is_not_one():
    """A push the receiver could not take, or a lost connection, reaches the sender's
    mailbox without waiting for the channel to await that push (an idle channel might
    not for long, while everything after it waits behind the gap)."""

    async def main():
        subtask = _Subtask(credit=1)
        subtask.fail_seq = 1
        server = _server(subtask)
        reported: list[BaseException] = []
        links = DataLinks(0, reported.append)
        link = links.link(_Receiver(server), "subtask 1/1 of 'sum'")
        assert await link.push(0, 0, 0, _batch()) == 1
        failed = link.push(0, 1, 0, _batch())
        with pytest.raises(RemotePushError):
            await failed
        assert [type(e) for e in reported] == [RemotePushError]
        server.close()  # the receiver goes
        for _ in range(100):
            if len(reported) == 2:
                break
            await asyncio.sleep(0.02)
        assert isinstance(reported[1], DataLinkError)
        assert "subtask 1/1 of 'sum'" in str(reported[1])
        # closing the links at the end of an attempt reports nothing
        server2 = _server(_Subtask(credit=1))
        reported.clear()
        more = DataLinks(0, reported.append)
        other = more.link(_Receiver(server2), "r")
        assert await other.push(0, 0, 0, _batch()) == 1
        more.close()
        await asyncio.sleep(0.1)
        assert reported == []
        server2.close()

    asyncio.run(main())


def test_senders_asking_at_once_get_one_server():
    async def main():
        server = _server(_Subtask())
        addresses = await asyncio.gather(*(server.address(0) for _ in range(4)))
        assert len({a.port for a in addresses}) == 1
        assert len({a.token for a in addresses}) == 1
        port = addresses[0].port
        server.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    asyncio.run(main())


def test_a_server_closed_while_it_starts_serves_nothing():
    async def main():
        server = _server(_Subtask())
        asking = asyncio.ensure_future(server.address(0))
        await asyncio.sleep(0)  # starting
        server.close()
        with pytest.raises(DataLinkError, match="closed"):
            await asking
        assert server._server is None

    asyncio.run(main())


def test_a_connection_that_cannot_be_made_fails_within_the_connect_timeout(monkeypatch):
    monkeypatch.setattr(data_plane, "CONNECT_TIMEOUT_S", 0.2)

    async def never(*args, **kwargs):
        await asyncio.Event().wait()  # as SYNs a firewall drops

    async def main():
        server = _server(_Subtask())
        link = DataLink(_Receiver(server), 0, "subtask 2/2 of 'sum'")
        monkeypatch.setattr(data_plane.asyncio, "open_connection", never)
        with pytest.raises(DataLinkError, match="could not connect to subtask 2/2 of 'sum'"):
            await asyncio.wait_for(link.push(0, 0, 0, _batch()), 5)
        server.close()

    asyncio.run(main())


def test_a_receiver_expecting_many_senders_keeps_them_all_while_they_connect(monkeypatch):
    """Fan-in above the bound: a receiver with more input channels than
    MAX_UNAUTHENTICATED keeps one connection per channel waiting for its token."""
    monkeypatch.setattr(data_plane, "MAX_UNAUTHENTICATED", 5)

    async def main():
        subtask = _Subtask(credit=1)
        server = DataServer(subtask.push, lambda: 0, host="127.0.0.1", senders=lambda: 10)
        address = await server.address(0)
        opened = []
        for _ in range(15):
            opened.append(await asyncio.open_connection(address.host, address.port))
        await asyncio.sleep(0.1)
        assert len(server._unauthenticated) == 15 and server.evicted == 0
        for _ in range(5):
            opened.append(await asyncio.open_connection(address.host, address.port))
        await asyncio.sleep(0.1)
        assert len(server._unauthenticated) == 15 and server.evicted == 5
        for _, writer in opened:
            writer.close()
        server.close()

    asyncio.run(main())


def test_a_channel_waiting_for_room_raises_a_failure_of_another_push_of_its_subtask():
    """One receiver cannot take a push (its gate is stuck behind it); the subtask's next
    writes go to another receiver that holds them: the wait for room there ends with the
    first receiver's error, not after a checkpoint timeout."""

    async def main():
        broken = _Subtask(credit=1)
        broken.fail_seq = 0
        slow = _Subtask(credit=1)
        slow.hold[1] = asyncio.Event()  # never set
        servers = [_server(broken), _server(slow)]
        reported: list[BaseException] = []
        links = DataLinks(0, reported.append)
        to_broken = OutputChannel(
            None, 0, 0, window=1, link=links.link(_Receiver(servers[0]), "subtask 1/2 of 'a'")
        )
        to_slow = OutputChannel(
            None, 0, 0, window=1, link=links.link(_Receiver(servers[1]), "subtask 2/2 of 'a'")
        )
        await to_broken.write(_batch(), 0.0)

        async def write_on():
            for _ in range(3):  # seq 1 is held: from then the window stays full
                await to_slow.write(_batch(), 0.0)

        with pytest.raises(RemotePushError, match="subtask 1/2 of 'a'"):
            await asyncio.wait_for(write_on(), 5)
        assert [type(e) for e in reported] == [RemotePushError]
        slow.hold[1].set()
        links.close()
        for server in servers:
            server.close()

    asyncio.run(main())


def test_a_receivers_error_carries_the_receiver_and_its_own_verdict():
    """The receiver classifies what it raised (with the job's classifier) and names
    itself: the sender reports the receiver's failure as the receiver judged it."""
    from rayflow.recoverability import NonRecoverableError, default_reason

    async def main():
        async def push(channel, seq, attempt, message):
            raise NonRecoverableError("the schema of this input cannot be read here")

        server = DataServer(
            push,
            lambda: 0,
            host="127.0.0.1",
            classify=default_reason,
            receiver=lambda: ("sink", 1, 2),
        )
        link = DataLink(_Receiver(server), 0, "subtask 2/2 of 'sink'")
        with pytest.raises(RemotePushError) as info:
            await asyncio.wait_for(link.push(0, 0, 0, _batch()), 5)
        error = info.value
        assert (error.operator, error.subtask, error.parallelism) == ("sink", 1, 2)
        assert error.non_recoverable is not None
        assert "the schema of this input cannot be read here" in str(error)
        assert "subtask 2/2 of 'sink'" in str(error)
        link.close()
        server.close()

    asyncio.run(main())


def test_a_receivers_error_a_restart_may_fix_says_so():
    async def main():
        subtask = _Subtask(credit=1)
        subtask.fail_seq = 0
        server = DataServer(subtask.push, lambda: 0, host="127.0.0.1", classify=lambda exc: None)
        link = DataLink(_Receiver(server), 0, "r")
        with pytest.raises(RemotePushError) as info:
            await asyncio.wait_for(link.push(0, 0, 0, _batch()), 5)
        assert info.value.non_recoverable is None
        link.close()
        server.close()

    asyncio.run(main())


def test_a_subtask_fails_with_its_receivers_error_as_the_receiver_judged_it():
    """The real subtask class over a link: the receiver cannot take a message and says
    no restart can fix it; the sender's run fails at once with an operator error naming
    the receiver, not its own operator, and the sender's classifier (which would call
    anything recoverable) does not judge it again."""
    import dataclasses

    from rayflow.errors import OperatorError
    from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
    from rayflow.plan.physical import OperatorSpec, VertexSpec
    from rayflow.recoverability import NonRecoverableError, default_reason
    from rayflow.runtime.data_plane import DataTransport
    from rayflow.runtime.operators import factory
    from rayflow.runtime.subtask import OutputDeployment
    from tests.unit.inprocess_job import Cut
    from tests.unit.test_output_buffering_review import _deploy

    async def main():
        async def push(channel, seq, attempt, message):
            raise NonRecoverableError("cannot read this here")

        server = DataServer(
            push,
            lambda: 0,
            host="127.0.0.1",
            classify=default_reason,
            receiver=lambda: ("sink", 0, 1),
        )
        vertex = VertexSpec(1, "cut", 1, 128, operators=[OperatorSpec("cut", "cut", factory(Cut))])
        outputs = [
            OutputDeployment(PartitionerSpec(PartitionKind.FORWARD), [(_Receiver(server), 0)])
        ]
        deployment, cls = _deploy(vertex, outputs, inputs=1, buffer_timeout_s=0.0)
        deployment = dataclasses.replace(
            deployment,
            data_transport=DataTransport.SOCKET,
            failure_classifier=lambda exc: True,  # "a restart fixes anything"
        )
        sub = cls(deployment)

        async def no_metrics():
            return {}

        sub.metrics = no_metrics
        running = asyncio.ensure_future(sub.run())
        await sub.push(0, 0, 0, _batch(3))
        with pytest.raises(OperatorError) as info:
            await asyncio.wait_for(running, 10)
        error = info.value
        assert (error.operator, error.subtask, error.parallelism) == ("sink", 0, 1)
        assert error.non_recoverable is not None
        assert "cannot read this here" in str(error)
        server.close()

    asyncio.run(main())
