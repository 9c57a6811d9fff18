"""The versioned format of one subtask's operator states in a checkpoint or savepoint blob.

Format 2 (written now)::

    b"RAYFLOW-STATE\\n" + version (1 byte) + pickle({uid: pickle(state of that operator)})

Each operator's state is pickled on its own, so a restore unpickles only the states of
operators the job still has (state of a removed operator whose classes are gone does not
stop a restore with ``allow_non_restored_state``), and a state that cannot be read names
its operator. Format 1 (blobs written before the header existed) is a plain pickle of
``{uid: state}`` and still loads. A blob of an unknown format, or a state whose classes
cannot be imported here, fails with :class:`StateFormatError`, never with a bare pickle
error; it names the blob and its operators, and is not recoverable (every restart would
read the same bytes with the same code: the job fails at once instead of restarting).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from typing import Any

from rayflow.recoverability import NonRecoverableError

__all__ = [
    "STATE_FORMAT_VERSION",
    "StateFormatError",
    "UnsupportedStateFormatError",
    "OperatorStates",
    "encode_operator_states",
    "decode_operator_states",
    "blob_name",
]

_MAGIC = b"RAYFLOW-STATE\n"
#: The format written: 2 (a header, then one pickle per operator). 1: a bare pickle.
STATE_FORMAT_VERSION = 2


class StateFormatError(NonRecoverableError, ValueError):
    """A state blob (or one operator's state in it) this rayflow cannot read; no restart
    can fix it."""


class UnsupportedStateFormatError(StateFormatError):
    """A blob whose header names a state format version this rayflow does not read: every
    read of it, in any process of this rayflow, fails the same way (unlike a failure while
    unpickling, which may come from the process or what it reached out to)."""


def blob_name(where: str, names: Mapping[str, str] | None) -> str:
    """``where``, with the names of the operators whose state the blob holds."""
    if not names:
        return where
    return f"{where} (read for operators {', '.join(repr(n) for n in names.values())})"


def encode_operator_states(states: Mapping[str, Any]) -> bytes:
    """The blob of ``states`` (operator uid -> the operator's snapshot)."""
    inner = {
        uid: pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL) for uid, state in states.items()
    }
    return (
        _MAGIC
        + bytes([STATE_FORMAT_VERSION])
        + pickle.dumps(inner, protocol=pickle.HIGHEST_PROTOCOL)
    )


class OperatorStates(Mapping[str, Any]):
    """Operator uid -> state, each unpickled when first asked for."""

    def __init__(self, raw: dict[str, bytes], where: str, names: Mapping[str, str]) -> None:
        self._raw = raw
        self._where = where
        self._names = names
        self._decoded: dict[str, Any] = {}

    def __getitem__(self, uid: str) -> Any:
        if uid not in self._decoded:
            data = self._raw[uid]
            try:
                self._decoded[uid] = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - a class moved, renamed or removed
                name = self._names.get(uid)
                what = f"operator {name!r} (uid {uid!r})" if name else f"operator uid {uid!r}"
                raise StateFormatError(
                    f"{self._where}: the state of {what} cannot be read by this code "
                    f"({type(exc).__name__}: {exc}). The classes it was written with must be "
                    "importable under the same names; restore with the code that wrote it, "
                    "or give the operator a new uid (with allow_non_restored_state) to start "
                    "it without state"
                ) from None
        return self._decoded[uid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, uid: object) -> bool:
        return uid in self._raw


def decode_operator_states(
    blob: bytes, where: str = "state", names: Mapping[str, str] | None = None
) -> Mapping[str, Any]:
    """The operator states of ``blob`` (any known format); ``names`` (uid -> operator name)
    make errors name the operator."""
    whose = blob_name(where, names)
    if blob.startswith(_MAGIC):
        version = blob[len(_MAGIC)] if len(blob) > len(_MAGIC) else None
        if version != STATE_FORMAT_VERSION:
            raise UnsupportedStateFormatError(
                f"{whose}: state format version {version} is not supported by this rayflow "
                f"(it reads versions 1..{STATE_FORMAT_VERSION}); restore it with the rayflow "
                "that wrote it"
            )
        try:
            raw = pickle.loads(blob[len(_MAGIC) + 1 :])
        except Exception as exc:  # noqa: BLE001 - a damaged file
            raise StateFormatError(
                f"{whose}: state cannot be read ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(raw, dict):
            raise StateFormatError(f"{whose}: not a rayflow state blob")
        return OperatorStates(raw, where, names or {})
    try:
        states = pickle.loads(blob)  # format 1: one pickle of {uid: state}
    except Exception as exc:  # noqa: BLE001 - damaged, foreign, or classes gone
        raise StateFormatError(
            f"{whose}: state cannot be read ({type(exc).__name__}: {exc}); it is not a "
            "rayflow state blob, or it was written by code whose classes are not "
            "importable here"
        ) from None
    if not isinstance(states, dict):
        raise StateFormatError(f"{whose}: not a rayflow state blob")
    return states
