"""Window functions (PyFlink's shapes): ``AggregateFunction`` and
``ProcessWindowFunction``; ``reduce`` takes a ``ReduceFunction`` or a function."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rayflow.functions import Function
from rayflow.windowing.assigners import TimeWindow

__all__ = ["AggregateFunction", "ProcessWindowFunction"]


class AggregateFunction(Function):
    """An incremental aggregation: one accumulator per key and window.

    ``add(value, accumulator)`` returns the new accumulator; ``get_result(accumulator)``
    the window's output record (a dict); ``merge(a, b)`` is needed by session windows."""

    def create_accumulator(self) -> Any:
        raise NotImplementedError

    def add(self, value: dict[str, Any], accumulator: Any) -> Any:
        raise NotImplementedError

    def get_result(self, accumulator: Any) -> dict[str, Any]:
        raise NotImplementedError

    def merge(self, acc_a: Any, acc_b: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}.merge: session windows merge accumulators"
        )


class ProcessWindowFunction(Function):
    """Sees all the records of a key's window at once, when it fires."""

    class Context:
        def __init__(self) -> None:
            self._window: TimeWindow | None = None
            self._watermark = 0
            self._processing_time = 0

        def window(self) -> TimeWindow:
            assert self._window is not None
            return self._window

        def current_watermark(self) -> int:
            return self._watermark

        def current_processing_time(self) -> int:
            return self._processing_time

    def process(
        self, key: Any, context: ProcessWindowFunction.Context, elements: Iterable[dict[str, Any]]
    ) -> Iterable[dict[str, Any]]:
        raise NotImplementedError

    def clear(self, context: ProcessWindowFunction.Context) -> None:  # noqa: B027
        """The window's state is being dropped."""
