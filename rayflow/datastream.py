"""DataStream and KeyedStream: the fluent API that builds a job's logical plan.

Shaped like PyFlink's DataStream API. A record is a dict of column -> value;
``map_batches`` works on whole ``pyarrow.RecordBatch`` es (the fast path).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rayflow.functions import KeyedProcessFunction
from rayflow.outputs import OutputTag
from rayflow.plan.logical import InputEdge, Transformation, check_parallelism
from rayflow.plan.partitioners import KeySelector, PartitionerSpec, PartitionKind
from rayflow.plan.resources import ResourceSpec, check_slot_sharing_group
from rayflow.runtime import operators as ops
from rayflow.runtime.sink_operator import sink_operator_factory
from rayflow.sink import Sink

if TYPE_CHECKING:
    from rayflow.environment import StreamExecutionEnvironment
    from rayflow.windowing.assigners import WindowAssigner
    from rayflow.windowing.stream import WindowedStream

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
        side_output: str | None = None,
    ) -> None:
        self._env = env
        self._transformation = transformation
        self._partitioner = partitioner or PartitionerSpec()
        #: the side output of ``transformation`` this stream is (a tag id); None: its main
        self._side_output = side_output

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
        """Run this operator in subtasks of its own: chained neither to its input nor to
        what follows it (Flink's ``disableChaining``)."""
        self._transformation.chainable = False
        return self

    def start_new_chain(self) -> DataStream:
        """Begin a new chain at this operator: it is not chained to its input, while what
        follows it may still chain to it (Flink's ``startNewChain``)."""
        self._transformation.starts_chain = True
        return self

    def set_resources(
        self,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        memory: int | None = None,
        resources: dict[str, float] | None = None,
    ) -> DataStream:
        """What each subtask of this operator asks of the cluster, like Ray's ``.options``:
        CPUs, GPUs, bytes of memory and custom resources (``{"rayflow_node_w1": 0.01}``
        pins it to a node started with that resource). Operators chained into one subtask
        add up their requests; without any, a subtask reserves a token 0.001 CPU."""
        _set_resources(self._transformation, num_cpus, num_gpus, memory, resources)
        return self

    def slot_sharing_group(self, name: str) -> DataStream:
        """Subtask i of every operator in group ``name`` shares one placement bundle, so
        they run on one node (Flink's slot sharing); operators downstream inherit the
        group while all their inputs have it. Without a group every subtask has a bundle
        of its own and the job's subtasks spread over the cluster's nodes."""
        _set_slot_sharing_group(self._transformation, name)
        return self

    def get_name(self) -> str:
        return self._transformation.name

    # --- partitioning ---------------------------------------------------------------------

    def _repartitioned(self, partitioner: PartitionerSpec) -> DataStream:
        return DataStream(self._env, self._transformation, partitioner, self._side_output)

    def forward(self) -> DataStream:
        return self._repartitioned(PartitionerSpec(PartitionKind.FORWARD))

    def rebalance(self) -> DataStream:
        return self._repartitioned(PartitionerSpec(PartitionKind.REBALANCE))

    def broadcast(self) -> DataStream:
        return self._repartitioned(PartitionerSpec(PartitionKind.BROADCAST))

    def key_by(self, key: str | list[str] | Callable[[dict[str, Any]], Hashable]) -> KeyedStream:
        """Partition by key: a column name, a list of columns, or a function of the record."""
        selector = KeySelector(key)
        return KeyedStream(
            self._env,
            self._transformation,
            PartitionerSpec(PartitionKind.HASH, selector),
            self._side_output,
        )

    def get_side_output(self, output_tag: OutputTag) -> DataStream:
        """The records this stream's operator sent to the side output ``output_tag``
        (e.g. a window's late records, ``side_output_late_data``)."""
        if not isinstance(output_tag, OutputTag):
            raise TypeError(
                f"get_side_output: expected an OutputTag, got {type(output_tag).__name__}"
            )
        return DataStream(self._env, self._transformation, PartitionerSpec(), output_tag.tag_id)

    # --- transformations -----------------------------------------------------------------

    def _add(
        self, name: str, factory: Callable[[], Any], kind: str = "operator", sink: Any = None
    ) -> Transformation:
        return self._env._plan.add(
            name=name,
            kind=kind,
            inputs=[InputEdge(self._transformation.id, self._partitioner, self._side_output)],
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
        inputs = [
            InputEdge(s._transformation.id, s._partitioner, s._side_output)
            for s in (self, *streams)
        ]
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

    def window(self, window_assigner: WindowAssigner) -> WindowedStream:
        """Cut each key's records into windows (``TumblingEventTimeWindows.of(...)``,
        sliding, session; event or processing time)."""
        from rayflow.windowing.stream import WindowedStream

        return WindowedStream(self, window_assigner)

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

    def set_resources(
        self,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        memory: int | None = None,
        resources: dict[str, float] | None = None,
    ) -> DataStreamSink:
        """See :meth:`DataStream.set_resources`."""
        _set_resources(self._transformation, num_cpus, num_gpus, memory, resources)
        return self

    def slot_sharing_group(self, name: str) -> DataStreamSink:
        """See :meth:`DataStream.slot_sharing_group`."""
        _set_slot_sharing_group(self._transformation, name)
        return self

    def disable_chaining(self) -> DataStreamSink:
        """Run this sink in subtasks of its own, never chained to the operator before it
        (Flink's ``DataStreamSink.disableChaining``): e.g. a slow sink written beside a
        keyed stream, which chained would hold up the keyed edge."""
        self._transformation.chainable = False
        return self


def _set_resources(
    transformation: Transformation,
    num_cpus: float | None,
    num_gpus: float | None,
    memory: int | None,
    resources: dict[str, float] | None,
) -> None:
    transformation.resources = ResourceSpec.of(
        f"operator {transformation.name!r}: set_resources", num_cpus, num_gpus, memory, resources
    )


def _set_slot_sharing_group(transformation: Transformation, name: str) -> None:
    transformation.slot_sharing_group = check_slot_sharing_group(
        f"operator {transformation.name!r}", name
    )
