"""Which sink clean-up failures the job master tries again (:func:`futile_clean_up`)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError, RayTaskError

from rayflow.checkpoint.state_format import (
    StateFormatError,
    UnsupportedStateFormatError,
    decode_operator_states,
    encode_operator_states,
)
from rayflow.recoverability import NonRecoverableError
from rayflow.runtime.job_master import futile_clean_up

#: a blob that failed to unpickle (the cause may be the process, not the bytes)
UNREADABLE = (
    "/ckpt/a0-v2-s0.state (read for operators 'Sum'): state cannot be read "
    "(UnpicklingError: pickle data was truncated)"
)


def _raised_by_clean_up(cause: BaseException) -> RayTaskError:
    """``cause`` as a Ray call to an actor's ``clean_up`` hands it to the caller."""
    return RayTaskError(
        "SubtaskActor.clean_up", 'Traceback (most recent call last):\n  File "x.py"', cause
    ).as_instanceof_cause()


def _unsupported() -> UnsupportedStateFormatError:
    """What decoding a blob of a format version from the future raises."""
    blob = bytearray(encode_operator_states({"uid": 1}))
    blob[len(b"RAYFLOW-STATE\n")] = 9
    with pytest.raises(UnsupportedStateFormatError) as raised:
        decode_operator_states(bytes(blob), "/ckpt/a0-v2-s0.state", {"uid": "Sum"})
    return raised.value


def _unpickling_fails(error: BaseException) -> StateFormatError:
    """What decoding a blob raises when a state class's rebuild fails with ``error``."""

    class _Rebuilt:
        def __reduce__(self):
            return (_raise, (error,))

    blob = encode_operator_states({"uid": _Rebuilt()})
    with pytest.raises(StateFormatError) as raised:
        dict(decode_operator_states(blob, "/ckpt/a0-v2-s0.state", {"uid": "Sum"}))
    return raised.value


def _raise(error: BaseException):
    raise error


def test_a_state_format_version_it_does_not_read_in_every_failed_clean_up_is_not_tried_again():
    error = _unsupported()
    reason = futile_clean_up([_raised_by_clean_up(error)] * 2)
    assert reason == f"UnsupportedStateFormatError: {error}"  # not Ray's traceback
    assert "state format version 9" in reason and "Sum" in reason


@pytest.mark.parametrize(
    "other",
    [
        ActorDiedError(),  # the actor or its node went
        asyncio.TimeoutError(),  # the master's own wait ran out
        GetTimeoutError(),
        False,  # the actor answered for another attempt
        asyncio.CancelledError(),
        _raised_by_clean_up(MemoryError()),
        _raised_by_clean_up(PermissionError("read-only, for now")),
        _raised_by_clean_up(NonRecoverableError("a sink says so")),
        _raised_by_clean_up(StateFormatError(UNREADABLE)),
        _raised_by_clean_up(_unpickling_fails(ConnectionError("secrets service down"))),
        _raised_by_clean_up(_unpickling_fails(MemoryError())),
    ],
    ids=repr,
)
def test_anything_else_among_the_failures_is_tried_again(other):
    assert futile_clean_up([other]) is None
    assert futile_clean_up([_raised_by_clean_up(_unsupported()), other]) is None
