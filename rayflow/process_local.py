"""Objects that a picklable owner keeps in this process only.

A sink is a builder: it is pickled into every subtask and holds configuration only.
What talks to the outside world (a client, a connection, the writers of direct use)
is made from it in the process that uses it, and kept *beside* the owner here, not
in its ``__dict__``: pickling the owner never carries it (no ``__getstate__`` needed),
a copy unpickled in another process starts without it, and it goes when the owner is
garbage collected.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["local", "drop"]

T = TypeVar("T")

_store: dict[int, dict[str, Any]] = {}
_lock = threading.RLock()


def local(owner: object, key: str, make: Callable[[], T] | None = None) -> T | None:
    """``owner``'s object under ``key`` in this process; made with ``make()`` on first
    use (None when there is none and no ``make``)."""
    with _lock:
        slots = _store.get(id(owner))
        if slots is None:
            if make is None:
                return None
            slots = _store[id(owner)] = {}
            weakref.finalize(owner, _store.pop, id(owner), None)
        if key not in slots:
            if make is None:
                return None
            slots[key] = make()
        return slots[key]


def drop(owner: object, key: str) -> Any:
    """Forget ``owner``'s object under ``key`` in this process; returns it (or None)."""
    with _lock:
        slots = _store.get(id(owner))
        return None if slots is None else slots.pop(key, None)
