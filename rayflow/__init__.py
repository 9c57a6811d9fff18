"""rayflow: Flink-style exactly-once stream processing on Ray.

The public surface is what ``__all__`` lists; everything under
``rayflow.runtime``, ``rayflow.plan`` and ``rayflow.checkpoint`` is internal.
"""

from rayflow.config import (
    CheckpointConfig,
    CheckpointingMode,
    RestartStrategies,
    RestartStrategy,
)
from rayflow.datastream import DataStream, DataStreamSink, KeyedStream
from rayflow.environment import JobClient, JobResult, StreamExecutionEnvironment
from rayflow.errors import ConcurrentRunError, JobCancelledError, JobFailedError, OperatorError
from rayflow.functions import (
    FilterFunction,
    FlatMapFunction,
    KeyedProcessFunction,
    MapFunction,
    ReduceFunction,
    RuntimeContext,
)
from rayflow.guarantees import DeliveryGuarantee
from rayflow.sink import (
    RollingPolicy,
    Sink,
    SinkContext,
    SinkWriter,
    TwoPhaseCommittingSink,
    UnsupportedGuaranteeError,
)
from rayflow.sources import CollectionSource, FileSource, NumberSequenceSource, Source
from rayflow.state import (
    ListState,
    ListStateDescriptor,
    MapState,
    MapStateDescriptor,
    ReducingState,
    ReducingStateDescriptor,
    ValueState,
    ValueStateDescriptor,
)

__version__ = "0.1.0"

__all__ = [
    "StreamExecutionEnvironment",
    "JobClient",
    "JobResult",
    "DataStream",
    "KeyedStream",
    "DataStreamSink",
    "MapFunction",
    "FlatMapFunction",
    "FilterFunction",
    "ReduceFunction",
    "KeyedProcessFunction",
    "RuntimeContext",
    "ValueStateDescriptor",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "ReducingStateDescriptor",
    "ValueState",
    "ListState",
    "MapState",
    "ReducingState",
    "Source",
    "NumberSequenceSource",
    "CollectionSource",
    "FileSource",
    "Sink",
    "SinkWriter",
    "SinkContext",
    "TwoPhaseCommittingSink",
    "RollingPolicy",
    "UnsupportedGuaranteeError",
    "CheckpointConfig",
    "CheckpointingMode",
    "RestartStrategies",
    "RestartStrategy",
    "DeliveryGuarantee",
    "JobFailedError",
    "JobCancelledError",
    "ConcurrentRunError",
    "OperatorError",
    "__version__",
]
