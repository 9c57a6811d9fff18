"""Timers of keyed operators: event-time and processing-time, per key and namespace.

A timer is ``(timestamp, key, namespace)`` (the namespace is a window, or None for a
``KeyedProcessFunction``). Timers live in the operator's keyed state, in the key group
of their key (state ``TIMERS_EVENT`` / ``TIMERS_PROCESSING``: key -> set of
``(timestamp, namespace)``), so they are checkpointed, restored and rescaled with the
rest of the keyed state. Heaps over them (rebuilt after a restore) say which fire next.

An event-time timer fires when the operator's watermark reaches its timestamp; a
processing-time timer when the wall clock does (the subtask wakes the operator with
``OperatorContext.timers``). Registering one timer twice registers it once.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any

from rayflow.eventtime.strategy import MIN_WATERMARK
from rayflow.state import KeyedStateBackend

__all__ = ["TimeDomain", "InternalTimerService", "TIMERS_EVENT", "TIMERS_PROCESSING"]

TIMERS_EVENT = "\x00timers:event"
TIMERS_PROCESSING = "\x00timers:processing"


class TimeDomain(enum.Enum):
    EVENT_TIME = 0
    PROCESSING_TIME = 1


def processing_time_ms() -> int:
    return int(time.time() * 1000)


class _Timers:
    """One domain's timers: the sets in keyed state and a heap over them."""

    def __init__(self, backend: KeyedStateBackend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._heap: list[tuple[int, int, Any, Any]] = []
        self._seq = itertools.count()

    def register(self, key: Any, namespace: Any, timestamp: int) -> bool:
        """True when the timer is new (and the earliest may have changed)."""
        table = self._backend.table_of_key(key, self._name)
        timers = table.get(key)
        if timers is None:
            timers = table[key] = set()
        entry = (timestamp, namespace)
        if entry in timers:
            return False
        timers.add(entry)
        heapq.heappush(self._heap, (timestamp, next(self._seq), key, namespace))
        return True

    def delete(self, key: Any, namespace: Any, timestamp: int) -> None:
        table = self._backend.table_of_key(key, self._name)
        timers = table.get(key)
        if timers is not None:
            timers.discard((timestamp, namespace))
            if not timers:
                del table[key]

    def earliest(self) -> int | None:
        heap = self._heap
        while heap:
            timestamp, _, key, namespace = heap[0]
            if self._registered(key, namespace, timestamp):
                return timestamp
            heapq.heappop(heap)
        return None

    def _registered(self, key: Any, namespace: Any, timestamp: int) -> bool:
        timers = self._backend.table_of_key(key, self._name).get(key)
        return timers is not None and (timestamp, namespace) in timers

    def pop_due(self, until: int) -> tuple[int, Any, Any] | None:
        """The earliest registered timer at or before ``until``, unregistered; or None."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            timestamp, _, key, namespace = heapq.heappop(heap)
            if self._registered(key, namespace, timestamp):
                self.delete(key, namespace, timestamp)
                return timestamp, key, namespace
        return None

    def rebuild(self) -> None:
        """The heap over what keyed state holds now (after a restore)."""
        self._heap = [
            (timestamp, next(self._seq), key, namespace)
            for key, timers in self._backend.items(self._name)
            for timestamp, namespace in timers
        ]
        heapq.heapify(self._heap)

    def count(self) -> int:
        return sum(len(t) for _, t in self._backend.items(self._name))


class InternalTimerService:
    """The timers of one keyed operator subtask.

    ``schedule(delay_s)`` asks the subtask to wake the operator (``on_timer``) after
    ``delay_s`` seconds, for processing-time timers; None where nobody can (no wake-ups:
    processing-time timers then fire only when ``fire_processing`` is called)."""

    def __init__(
        self,
        backend: KeyedStateBackend,
        schedule: Callable[[float], None] | None = None,
        clock: Callable[[], int] = processing_time_ms,
    ) -> None:
        self.backend = backend
        self.event = _Timers(backend, TIMERS_EVENT)
        self.processing = _Timers(backend, TIMERS_PROCESSING)
        self.watermark = MIN_WATERMARK
        self._schedule = schedule
        self._clock = clock
        self._wake_at: int | None = None

    def current_processing_time(self) -> int:
        return self._clock()

    def register_event_time_timer(self, key: Any, namespace: Any, timestamp: int) -> None:
        self.event.register(key, namespace, int(timestamp))

    def delete_event_time_timer(self, key: Any, namespace: Any, timestamp: int) -> None:
        self.event.delete(key, namespace, int(timestamp))

    def register_processing_time_timer(self, key: Any, namespace: Any, timestamp: int) -> None:
        if self.processing.register(key, namespace, int(timestamp)):
            self._arm()

    def delete_processing_time_timer(self, key: Any, namespace: Any, timestamp: int) -> None:
        self.processing.delete(key, namespace, int(timestamp))

    def _arm(self) -> None:
        """Wake the operator when the earliest processing-time timer is due."""
        earliest = self.processing.earliest()
        if earliest is None or self._schedule is None:
            return
        if self._wake_at is not None and self._wake_at <= earliest:
            return
        self._wake_at = earliest
        self._schedule(max(0.0, (earliest - self._clock()) / 1000.0))

    def on_wake(self) -> None:
        """A wake-up came: the next one is armed by ``fire_processing``."""
        self._wake_at = None

    def advance_watermark(self, watermark: int) -> None:
        if watermark > self.watermark:
            self.watermark = watermark

    def pop_event(self) -> tuple[int, Any, Any] | None:
        """The next event-time timer due at the current watermark, or None."""
        return self.event.pop_due(self.watermark)

    def pop_processing(self, now: int | None = None) -> tuple[int, Any, Any] | None:
        """The next processing-time timer due now, or None (then the next wake-up is
        armed)."""
        due = self.processing.pop_due(self._clock() if now is None else now)
        if due is None:
            self._arm()
        return due

    def restored(self) -> None:
        """Keyed state was restored: rebuild the heaps and arm the wake-up."""
        self.event.rebuild()
        self.processing.rebuild()
        self._wake_at = None
        self._arm()
