"""User-function contracts and the RuntimeContext they are opened with.

Every per-record function may be a plain callable or an instance of one of the
classes here; the classes add ``open``/``close`` hooks and, for keyed
functions, access to keyed state through :class:`RuntimeContext`. Records are
dicts of column -> value; batches are ``pyarrow.RecordBatch``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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


class KeyedProcessFunction(Function):
    """Per-record processing on a keyed stream, with keyed state.

    ``process_element`` yields (or returns an iterable of) output records;
    state obtained from the runtime context in ``open`` is scoped to the key of
    the record being processed.
    """

    class Context:
        def __init__(self, backend: KeyedStateBackend) -> None:
            self._backend = backend

        def get_current_key(self) -> Any:
            return self._backend.current_key

    def process_element(
        self, value: dict[str, Any], ctx: KeyedProcessFunction.Context
    ) -> Iterable[dict[str, Any]] | None:
        raise NotImplementedError
