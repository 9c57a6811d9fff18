"""User-function contracts and the RuntimeContext they are opened with.

Every per-record function may be a plain callable or an instance of one of the
classes here; the classes add ``open``/``close`` hooks and, for keyed
functions, access to keyed state through :class:`RuntimeContext`. Records are
dicts of column -> value; batches are ``pyarrow.RecordBatch``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rayflow.eventtime.timers import InternalTimerService, TimeDomain
from rayflow.state import (
    KeyedStateBackend,
    ListState,
    ListStateDescriptor,
    MapState,
    MapStateDescriptor,
    ReducingState,
    ReducingStateDescriptor,
    ValueState,
    ValueStateDescriptor,
)

__all__ = [
    "RuntimeContext",
    "Function",
    "MapFunction",
    "FlatMapFunction",
    "FilterFunction",
    "ReduceFunction",
    "KeyedProcessFunction",
    "TimerService",
]


class RuntimeContext:
    """What a function knows about the subtask it runs in, and its keyed state."""

    def __init__(
        self,
        task_name: str,
        index_of_this_subtask: int,
        number_of_parallel_subtasks: int,
        max_number_of_parallel_subtasks: int,
        attempt_number: int = 0,
        keyed_backend: KeyedStateBackend | None = None,
    ) -> None:
        self._task_name = task_name
        self._index = index_of_this_subtask
        self._parallelism = number_of_parallel_subtasks
        self._max_parallelism = max_number_of_parallel_subtasks
        self._attempt = attempt_number
        self._keyed_backend = keyed_backend

    def get_task_name(self) -> str:
        return self._task_name

    def get_index_of_this_subtask(self) -> int:
        return self._index

    def get_number_of_parallel_subtasks(self) -> int:
        return self._parallelism

    def get_max_number_of_parallel_subtasks(self) -> int:
        return self._max_parallelism

    def get_attempt_number(self) -> int:
        return self._attempt

    def _backend(self) -> KeyedStateBackend:
        if self._keyed_backend is None:
            raise RuntimeError(
                f"operator {self._task_name!r}: keyed state is only available after key_by()"
            )
        return self._keyed_backend

    def get_state(self, descriptor: ValueStateDescriptor) -> ValueState:
        return ValueState(self._backend(), descriptor)

    def get_list_state(self, descriptor: ListStateDescriptor) -> ListState:
        return ListState(self._backend(), descriptor.name)

    def get_map_state(self, descriptor: MapStateDescriptor) -> MapState:
        return MapState(self._backend(), descriptor.name)

    def get_reducing_state(self, descriptor: ReducingStateDescriptor) -> ReducingState:
        return ReducingState(self._backend(), descriptor)


class Function:
    """Base of user functions: lifecycle hooks called once per subtask."""

    def open(self, runtime_context: RuntimeContext) -> None:  # noqa: B027
        """Called before the first record."""

    def close(self) -> None:  # noqa: B027
        """Called after the last record, or when the subtask stops."""


class MapFunction(Function):
    def map(self, value: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class FlatMapFunction(Function):
    def flat_map(self, value: dict[str, Any]) -> Iterable[dict[str, Any]]:
        raise NotImplementedError


class FilterFunction(Function):
    def filter(self, value: dict[str, Any]) -> bool:
        raise NotImplementedError


class ReduceFunction(Function):
    def reduce(self, value1: dict[str, Any], value2: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class TimerService:
    """Time and timers of the current key (PyFlink's ``TimerService``); timestamps are
    milliseconds. Timers are keyed state: checkpointed, restored and rescaled with the
    key, and one timer registered twice fires once."""

    def __init__(self, timers: InternalTimerService, backend: KeyedStateBackend) -> None:
        self._timers = timers
        self._backend = backend

    def current_processing_time(self) -> int:
        return self._timers.current_processing_time()

    def current_watermark(self) -> int:
        return self._timers.watermark

    def register_event_time_timer(self, timestamp: int) -> None:
        """``on_timer`` once the watermark reaches ``timestamp``."""
        self._timers.register_event_time_timer(self._backend.current_key, None, timestamp)

    def register_processing_time_timer(self, timestamp: int) -> None:
        """``on_timer`` once the wall clock reaches ``timestamp`` (ms since the epoch)."""
        self._timers.register_processing_time_timer(self._backend.current_key, None, timestamp)

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._timers.delete_event_time_timer(self._backend.current_key, None, timestamp)

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._timers.delete_processing_time_timer(self._backend.current_key, None, timestamp)


class KeyedProcessFunction(Function):
    """Per-record processing on a keyed stream, with keyed state and timers.

    ``process_element`` yields (or returns an iterable of) output records;
    state obtained from the runtime context in ``open`` is scoped to the key of
    the record being processed. ``ctx.timer_service()`` registers event-time and
    processing-time timers for the current key; ``on_timer(timestamp, ctx)`` is called
    when one fires, with that key current, and yields records like ``process_element``.
    """

    class Context:
        def __init__(
            self, backend: KeyedStateBackend, timer_service: TimerService | None = None
        ) -> None:
            self._backend = backend
            self._timer_service = timer_service
            self._timestamp: int | None = None

        def get_current_key(self) -> Any:
            return self._backend.current_key

        def timestamp(self) -> int | None:
            """The event timestamp of the record (or of the firing timer); None without
            event time."""
            return self._timestamp

        def timer_service(self) -> TimerService:
            if self._timer_service is None:
                raise RuntimeError("timers are only available in a running job")
            return self._timer_service

    class OnTimerContext(Context):
        def __init__(
            self, backend: KeyedStateBackend, timer_service: TimerService | None = None
        ) -> None:
            super().__init__(backend, timer_service)
            self._time_domain = TimeDomain.EVENT_TIME

        def time_domain(self) -> TimeDomain:
            return self._time_domain

    def process_element(
        self, value: dict[str, Any], ctx: KeyedProcessFunction.Context
    ) -> Iterable[dict[str, Any]] | None:
        raise NotImplementedError

    def on_timer(
        self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext
    ) -> Iterable[dict[str, Any]] | None:
        """A timer of the current key fired at ``timestamp``."""
        return None
