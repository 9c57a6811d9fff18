"""DataStream and KeyedStream: the fluent API that builds a job's logical plan.

Shaped like PyFlink's DataStream API. A record is a dict of column -> value;
``map_batches`` works on whole ``pyarrow.RecordBatch`` es (the fast path).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rayflow.functions import KeyedProcessFunction
from rayflow.plan.logical import InputEdge, Transformation, check_parallelism
from rayflow.plan.partitioners import KeySelector, PartitionerSpec, PartitionKind
from rayflow.runtime import operators as ops
from rayflow.runtime.sink_operator import sink_operator_factory
from rayflow.sink import Sink

if TYPE_CHECKING:
    from rayflow.environment import StreamExecutionEnvironment

__all__ = ["DataStream", "KeyedStream", "DataStreamSink"]


def _output_type(output_type: Any) -> pa.Schema | None:
    if output_type is not None and not isinstance(output_type, pa.Schema):
        raise TypeError(
            f"output_type must be a pyarrow.Schema (pa.schema([...])), got {output_type!r}"
        )
    return output_type


class DataStream:
    """A stream of records produced by one transformation."""

    def __init__(
        self,
        env: StreamExecutionEnvironment,
        transformation: Transformation,
        partitioner: PartitionerSpec | None = None,
    ) -> None:
        self._env = env
        self._transformation = transformation
        self._partitioner = partitioner or PartitionerSpec()

    # --- naming and parallelism of the producing transformation --------------------------

    def name(self, name: str) -> DataStream:
        self._transformation.name = name
        return self

    def uid(self, uid: str) -> DataStream:
        """A stable id for this operator's state across job versions and restores."""
        self._transformation.uid = uid
        return self

    def set_parallelism(self, parallelism: int) -> DataStream:
        owner = f"operator {self._transformation.name!r}"
        self._transformation.parallelism = check_parallelism(owner, parallelism)
        return self

    def set_max_parallelism(self, max_parallelism: int) -> DataStream:
        owner = f"operator {self._transformation.name!r}"
        self._transformation.max_parallelism = check_parallelism(
            owner, max_parallelism, "max parallelism"
        )
        return self

    def disable_chaining(self) -> DataStream:
        self._transformation.chainable = False
        return self

    def get_name(self) -> str:
        return self._transformation.name

    # --- partitioning ---------------------------------------------------------------------

    def forward(self) -> DataStream:
        return DataStream(self._env, self._transformation, PartitionerSpec(PartitionKind.FORWARD))

    def rebalance(self) -> DataStream:
        return DataStream(self._env, self._transformation, PartitionerSpec(PartitionKind.REBALANCE))

    def broadcast(self) -> DataStream:
        return DataStream(self._env, self._transformation, PartitionerSpec(PartitionKind.BROADCAST))

    def key_by(self, key: str | list[str] | Callable[[dict[str, Any]], Hashable]) -> KeyedStream:
        """Partition by key: a column name, a list of columns, or a function of the record."""
        selector = KeySelector(key)
        return KeyedStream(
            self._env, self._transformation, PartitionerSpec(PartitionKind.HASH, selector)
        )

    # --- transformations -----------------------------------------------------------------

    def _add(
        self, name: str, factory: Callable[[], Any], kind: str = "operator", sink: Any = None
    ) -> Transformation:
        return self._env._plan.add(
            name=name,
            kind=kind,
            inputs=[InputEdge(self._transformation.id, self._partitioner)],
            operator_factory=factory,
            sink=sink,
        )

    def map(
        self,
        func: Callable[[dict[str, Any]], dict[str, Any]],
        name: str = "Map",
        output_type: pa.Schema | None = None,
    ) -> DataStream:
        """One record out per record in. The output keeps one schema: the first batch's
        (keys some records lack are None), or ``output_type`` when given."""
        factory = ops.factory(ops.MapOperator, func, _output_type(output_type))
        return DataStream(self._env, self._add(name, factory))

    def flat_map(
        self,
        func: Callable[[dict[str, Any]], Any],
        name: str = "FlatMap",
        output_type: pa.Schema | None = None,
    ) -> DataStream:
        """Any number of records out per record in (an iterable, or None for none)."""
        factory = ops.factory(ops.FlatMapOperator, func, _output_type(output_type))
        return DataStream(self._env, self._add(name, factory))

    def filter(self, func: Callable[[dict[str, Any]], bool], name: str = "Filter") -> DataStream:
        return DataStream(self._env, self._add(name, ops.factory(ops.FilterOperator, func)))

    def map_batches(
        self,
        func: Callable[[pa.RecordBatch], pa.RecordBatch | pa.Table | None],
        name: str = "MapBatches",
    ) -> DataStream:
        """Apply ``func`` to whole record batches (vectorized; the fast path)."""
        return DataStream(self._env, self._add(name, ops.factory(ops.MapBatchesOperator, func)))

    def union(self, *streams: DataStream) -> DataStream:
        inputs = [InputEdge(s._transformation.id, s._partitioner) for s in (self, *streams)]
        for s in streams:
            if s._env is not self._env:
                raise ValueError("union: all streams must come from the same environment")
        return DataStream(self._env, self._env._plan.add(name="Union", kind="union", inputs=inputs))

    def sink_to(self, sink: Sink, name: str | None = None) -> DataStreamSink:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink_to: expected a rayflow Sink, got {type(sink).__name__}")
        name = name or type(sink).__name__
        transformation = self._add(name, sink_operator_factory(sink), "sink", sink)
        return DataStreamSink(self._env, transformation)

    def execute_and_collect(self, job_name: str = "rayflow job", limit: int | None = None) -> Any:
        """Run the job on Ray and return the records of this stream (PyFlink's name; see
        ``StreamExecutionEnvironment.execute_and_collect``)."""
        return self._env._execute_and_collect(self, job_name, limit)

    def print(self, name: str = "Print") -> DataStreamSink:
        from sinks.basic import PrintSink

        return self.sink_to(PrintSink(), name)


class KeyedStream(DataStream):
    """A stream partitioned by key; its operators have keyed state."""

    @property
    def _key(self) -> KeySelector:
        assert self._partitioner.key is not None
        return self._partitioner.key

    def reduce(
        self,
        func: Callable[[dict, dict], dict],
        name: str = "Reduce",
        output_type: pa.Schema | None = None,
    ) -> DataStream:
        """Per record, emit ``func(previous result of its key, record)``; a key's first
        record is emitted as it is."""
        factory = ops.factory(ops.KeyedReduceOperator, self._key, func, _output_type(output_type))
        return DataStream(self._env, self._add(name, factory))

    def process(
        self,
        func: KeyedProcessFunction,
        name: str = "KeyedProcess",
        output_type: pa.Schema | None = None,
    ) -> DataStream:
        if not isinstance(func, KeyedProcessFunction):
            raise TypeError(f"process: expected a KeyedProcessFunction, got {type(func).__name__}")
        factory = ops.factory(ops.KeyedProcessOperator, self._key, func, _output_type(output_type))
        return DataStream(self._env, self._add(name, factory))

    def _aggregate(self, aggregation: str, field: str | None, name: str) -> DataStream:
        return DataStream(
            self._env,
            self._add(name, ops.factory(ops.KeyedAggregateOperator, self._key, aggregation, field)),
        )

    def sum(self, field: str, name: str = "Sum") -> DataStream:
        """Running sum of ``field`` per key (vectorized; one row per key touched per batch)."""
        return self._aggregate("sum", field, name)

    def min(self, field: str, name: str = "Min") -> DataStream:
        return self._aggregate("min", field, name)

    def max(self, field: str, name: str = "Max") -> DataStream:
        return self._aggregate("max", field, name)

    def count(self, name: str = "Count") -> DataStream:
        return self._aggregate("count", None, name)


class DataStreamSink:
    """The end of a stream; names and parallelism apply to the sink operator."""

    def __init__(self, env: StreamExecutionEnvironment, transformation: Transformation) -> None:
        self._env = env
        self._transformation = transformation

    def name(self, name: str) -> DataStreamSink:
        self._transformation.name = name
        return self

    def uid(self, uid: str) -> DataStreamSink:
        self._transformation.uid = uid
        return self

    def set_parallelism(self, parallelism: int) -> DataStreamSink:
        owner = f"sink {self._transformation.name!r}"
        self._transformation.parallelism = check_parallelism(owner, parallelism)
        return self

    def set_max_parallelism(self, max_parallelism: int) -> DataStreamSink:
        owner = f"sink {self._transformation.name!r}"
        self._transformation.max_parallelism = check_parallelism(
            owner, max_parallelism, "max parallelism"
        )
        return self
