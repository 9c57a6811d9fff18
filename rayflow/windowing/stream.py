"""``WindowedStream``: what ``key_by(...).window(assigner)`` returns (PyFlink's shape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rayflow.eventtime.strategy import Duration, to_millis
from rayflow.functions import ReduceFunction
from rayflow.outputs import OutputTag
from rayflow.runtime import operators as ops
from rayflow.windowing.assigners import WindowAssigner
from rayflow.windowing.functions import AggregateFunction, ProcessWindowFunction
from rayflow.windowing.operator import WindowKind, WindowOperator, WindowSpec

if TYPE_CHECKING:
    from rayflow.datastream import DataStream, KeyedStream

__all__ = ["WindowedStream"]


class WindowedStream:
    """A keyed stream cut into windows; one of ``sum``/``count``/``min``/``max``,
    ``reduce``, ``aggregate`` or ``process`` says what each window gives.

    ``sum``/``count``/``min``/``max`` give one row per key and window: the key column(s)
    (``key`` for a key function), the aggregate (``count`` for counts), ``window_start``
    and ``window_end`` (ms). Results carry the window's last millisecond as their event
    timestamp.
    """

    def __init__(self, keyed: KeyedStream, assigner: WindowAssigner) -> None:
        if not isinstance(assigner, WindowAssigner):
            raise TypeError(f"window: expected a WindowAssigner, got {type(assigner).__name__}")
        self._keyed = keyed
        self._assigner = assigner
        self._lateness_ms = 0
        self._late_tag: str | None = None

    def allowed_lateness(self, time_ms: int | Duration) -> WindowedStream:
        """Keep each window's state this long (ms) after it fired; a record that comes
        meanwhile makes it fire again with the updated result (event time only)."""
        self._lateness_ms = to_millis(time_ms, "allowed_lateness")
        return self

    def side_output_late_data(self, output_tag: OutputTag) -> WindowedStream:
        """Send records too late for every window they belong to to ``output_tag``
        (read it with ``get_side_output`` on the window's result stream)."""
        if not isinstance(output_tag, OutputTag):
            raise TypeError(
                f"side_output_late_data: expected an OutputTag, got {type(output_tag).__name__}"
            )
        self._late_tag = output_tag.tag_id
        return self

    def _spec(self) -> WindowSpec:
        return WindowSpec(self._assigner, self._lateness_ms, self._late_tag)

    def _apply(self, name: str, kind: WindowKind, *args: Any) -> DataStream:
        from rayflow.datastream import DataStream

        keyed = self._keyed
        factory = ops.factory(WindowOperator, keyed._key, self._spec(), kind, *args)
        return DataStream(keyed._env, keyed._add(name, factory))

    def _aggregation(self, aggregation: str, field: str | None, name: str) -> DataStream:
        return self._apply(name, WindowKind.AGGREGATION, None, aggregation, field)

    def sum(self, field: str, name: str = "WindowSum") -> DataStream:
        return self._aggregation("sum", field, name)

    def min(self, field: str, name: str = "WindowMin") -> DataStream:
        return self._aggregation("min", field, name)

    def max(self, field: str, name: str = "WindowMax") -> DataStream:
        return self._aggregation("max", field, name)

    def count(self, name: str = "WindowCount") -> DataStream:
        return self._aggregation("count", None, name)

    def reduce(
        self,
        reduce_function: ReduceFunction | Callable[[dict, dict], dict],
        name: str = "WindowReduce",
        output_type: pa.Schema | None = None,
    ) -> DataStream:
        """Each window gives its records folded with ``reduce_function(a, b)``."""
        if not (isinstance(reduce_function, ReduceFunction) or callable(reduce_function)):
            raise TypeError("reduce: expected a ReduceFunction or a function of two records")
        return self._apply(
            name, WindowKind.REDUCE, reduce_function, None, None, _schema(output_type)
        )

    def aggregate(
        self,
        aggregate_function: AggregateFunction,
        name: str = "WindowAggregate",
        output_type: pa.Schema | None = None,
    ) -> DataStream:
        """Each window gives ``aggregate_function.get_result`` of its accumulator."""
        if not isinstance(aggregate_function, AggregateFunction):
            raise TypeError(
                f"aggregate: expected an AggregateFunction, got {type(aggregate_function).__name__}"
            )
        return self._apply(
            name, WindowKind.AGGREGATE, aggregate_function, None, None, _schema(output_type)
        )

    def process(
        self,
        process_window_function: ProcessWindowFunction,
        name: str = "WindowProcess",
        output_type: pa.Schema | None = None,
    ) -> DataStream:
        """Each window gives what ``process(key, context, elements)`` yields."""
        if not isinstance(process_window_function, ProcessWindowFunction):
            raise TypeError(
                f"process: expected a ProcessWindowFunction, got "
                f"{type(process_window_function).__name__}"
            )
        return self._apply(
            name, WindowKind.PROCESS, process_window_function, None, None, _schema(output_type)
        )


def _schema(output_type: Any) -> pa.Schema | None:
    if output_type is not None and not isinstance(output_type, pa.Schema):
        raise TypeError(f"output_type must be a pyarrow.Schema, got {output_type!r}")
    return output_type
