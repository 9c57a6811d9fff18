"""Channel state of unaligned checkpoints: what was in flight when a subtask snapshotted.

An unaligned barrier overtakes the data queued before it. The receiving subtask
snapshots its operators at the *first* barrier of checkpoint n (in-band or announced
out of band) and, for every input channel ``c``, notes ``start[c]``: the sequence
number of the next message it would take. The sender says where the barrier belongs:
``end[c]``, the number of messages it had sent on ``c`` before the barrier. The
messages ``start[c] <= seq < end[c]`` are then neither in the operator state (not
processed yet) nor after the checkpoint (the sender sent them before its own
snapshot): they are the channel state of n, and a restore replays them, in channel
order, before any new input.

Every one of those messages has already been sent when the sender announces the
barrier, so the :class:`ChannelStateRecorder` gets them from the input gate however
slow the subtask is: those buffered, those waiting for buffer space, and those still
arriving (see :meth:`rayflow.runtime.channels.InputGate.record`). It is complete when
every channel's end is known and every message of every range has arrived; only then
is the checkpoint's blob written and acknowledged.

A blob with channel state is ``MAGIC`` + pickle of (operator blob, channel state);
without channel state the blob is the operator blob unchanged (aligned checkpoints and
those of earlier versions read as before).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

from rayflow.checkpoint.state_format import StateFormatError, blob_name, decode_operator_states
from rayflow.runtime.events import Watermark, WatermarkStatus, unbundled

__all__ = [
    "ChannelStateRecorder",
    "ChannelState",
    "encode_snapshot",
    "decode_snapshot",
    "channel_state_size",
]

#: Per input channel, the record batches (and watermark events between them) in flight
#: before the barrier, in sequence order.
ChannelState = dict[int, list[pa.RecordBatch | Watermark | WatermarkStatus]]

#: What channel state keeps of a channel's messages: data, and the watermarks among it
#: (replayed in order, so event time after a restore is what it was).
_KEPT = (pa.RecordBatch, Watermark, WatermarkStatus)

_MAGIC = b"RAYFLOW-CHANNEL-STATE-1\n"


class ChannelStateRecorder:
    """Collects the channel state of one unaligned checkpoint at one subtask."""

    def __init__(
        self,
        checkpoint_id: int,
        start: list[int],
        on_complete: Callable[[ChannelStateRecorder], None],
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self._start = list(start)
        self._end: list[int | None] = [None] * len(start)
        self._items: list[dict[int, Any]] = [{} for _ in start]
        self._open = set(range(len(start)))
        self._on_complete = on_complete
        self.done = False
        self.abandoned = False
        if not start:
            self._finish()

    def offer(self, channel: int, seq: int, item: Any) -> None:
        """A message of ``channel`` (any message: kept only if it is in the range)."""
        if seq < self._start[channel] or channel not in self._open:
            return
        end = self._end[channel]
        if end is not None and seq >= end:
            return
        self._items[channel][seq] = item
        if end is not None:
            self._check(channel)

    def set_end(self, channel: int, end: int) -> None:
        """The sender put the barrier after its message ``end - 1`` on ``channel``."""
        if self._end[channel] is not None:
            return
        self._end[channel] = end
        items = self._items[channel]
        for seq in [s for s in items if s >= end]:
            del items[seq]
        self._check(channel)

    def start(self, channel: int) -> int:
        return self._start[channel]

    def end_known(self, channel: int) -> bool:
        return self._end[channel] is not None

    def _check(self, channel: int) -> None:
        end = self._end[channel]
        if end is None or channel not in self._open:
            return
        if len(self._items[channel]) >= end - self._start[channel]:
            self._open.discard(channel)
            if not self._open:
                self._finish()

    def _finish(self) -> None:
        if self.done or self.abandoned:
            return
        self.done = True
        self._on_complete(self)

    def abandon(self) -> None:
        self.abandoned = True
        self._items = [{} for _ in self._items]

    def channel_state(self) -> ChannelState:
        """The record batches and watermark events of every channel's range, in sequence
        order, bundles opened (end-of-input, latency markers and older barriers are left
        out: the restored senders send their own)."""
        state: ChannelState = {}
        for channel, items in enumerate(self._items):
            batches = [
                item
                for s in sorted(items)
                for item in unbundled(items[s])
                if isinstance(item, _KEPT)
            ]
            if any(isinstance(b, pa.RecordBatch) for b in batches):
                state[channel] = batches
        return state


def encode_snapshot(operator_blob: bytes, channel_state: ChannelState) -> bytes:
    """One subtask's blob: its operators' state plus, if any, its channel state."""
    if not channel_state:
        return operator_blob
    return _MAGIC + pickle.dumps((operator_blob, channel_state), protocol=pickle.HIGHEST_PROTOCOL)


def decode_snapshot(
    blob: bytes, where: str = "state", names: Mapping[str, str] | None = None
) -> tuple[Mapping[str, Any], ChannelState]:
    """The operators' states (by operator uid) and the channel state of a blob (operator
    states in any known format: :mod:`rayflow.checkpoint.state_format`)."""
    if blob.startswith(_MAGIC):
        try:
            operator_blob, channel_state = pickle.loads(blob[len(_MAGIC) :])
        except Exception as exc:  # noqa: BLE001 - a damaged file
            raise StateFormatError(
                f"{blob_name(where, names)}: state with in-flight data cannot be read "
                f"({type(exc).__name__}: {exc})"
            ) from None
        return decode_operator_states(operator_blob, where, names), channel_state
    return decode_operator_states(blob, where, names), {}


def channel_state_size(channel_state: ChannelState) -> int:
    """Bytes of record batches held in ``channel_state``."""
    return sum(
        b.nbytes
        for batches in channel_state.values()
        for b in batches
        if isinstance(b, pa.RecordBatch)
    )
