"""Objects that a picklable owner keeps in this process only.

A sink is a builder: it is pickled into every subtask and holds configuration only.
What talks to the outside world (a client, a connection, the writers of direct use)
is made from it in the process that uses it and kept in a :class:`ProcessLocal` slot
of the owner. The slot never travels: pickled or deep-copied it comes out empty, so
the owner needs no ``__getstate__``, a copy unpickled in another process starts
without any of it, and it goes with the owner when the owner is garbage collected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ProcessLocal", "local", "drop"]

T = TypeVar("T")

#: the owner's attribute that holds its slot (made on first use)
ATTRIBUTE = "_process_local"

_create = threading.Lock()


class ProcessLocal:
    """Objects of this process, by key. Pickles, copies and compares as an empty slot."""

    __slots__ = ("objects", "lock")

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.lock = threading.RLock()

    def __reduce__(self) -> tuple[type, tuple]:
        return ProcessLocal, ()

    def __deepcopy__(self, memo: dict) -> ProcessLocal:
        return ProcessLocal()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessLocal)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "ProcessLocal()"


def local(owner: object, key: str, make: Callable[[], T] | None = None) -> T | None:
    """``owner``'s object under ``key`` in this process; made with ``make()`` on first
    use (None when there is none and no ``make``)."""
    slot = owner.__dict__.get(ATTRIBUTE)
    if slot is None:
        if make is None:
            return None
        with _create:
            slot = owner.__dict__.setdefault(ATTRIBUTE, ProcessLocal())
    with slot.lock:
        if key not in slot.objects:
            if make is None:
                return None
            slot.objects[key] = make()
        return slot.objects[key]


def drop(owner: object, key: str) -> Any:
    """Forget ``owner``'s object under ``key`` in this process; returns it (or None)."""
    slot = owner.__dict__.get(ATTRIBUTE)
    if slot is None:
        return None
    with slot.lock:
        return slot.objects.pop(key, None)
