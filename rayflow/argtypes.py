"""argparse types for rayflow's commands: a bad value is an argparse error naming the
option, before Ray starts (never a traceback from deep inside a job)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_at_least", "float_at_least", "checkpoint_interval_ms", "MIN_CHECKPOINT_MS"]

#: the shortest checkpoint interval (``CheckpointConfig.set_checkpoint_interval``)
MIN_CHECKPOINT_MS = 10


def _number(text: str, kind: type) -> float:
    cleaned = text.replace("_", "").replace(",", "")
    try:
        return kind(cleaned)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None


def int_at_least(low: int) -> Callable[[str], int]:
    """An int >= ``low`` (``1_000`` and ``1,000`` are read as 1000)."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"  # what argparse names in its error
    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(_number(text, float))
        if not value >= low:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        return value

    parse.__name__ = f"number >= {low:g}"
    return parse


def checkpoint_interval_ms(allow_off: bool) -> Callable[[str], int]:
    """A checkpoint interval in ms: >= ``MIN_CHECKPOINT_MS``, or 0 (off) if allowed."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if allow_off and value == 0:
            return 0
        if value < MIN_CHECKPOINT_MS:
            off = " or 0 for checkpointing off" if allow_off else ""
            raise argparse.ArgumentTypeError(
                f"must be >= {MIN_CHECKPOINT_MS} (ms){off}, got {value}"
            )
        return value

    parse.__name__ = "checkpoint interval"
    return parse
