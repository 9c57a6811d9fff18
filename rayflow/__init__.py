"""rayflow: Flink-style exactly-once stream processing on Ray.

The public surface is what ``__all__`` lists; everything under
``rayflow.runtime``, ``rayflow.plan`` and ``rayflow.checkpoint`` is internal.

Public names are imported on first use: a Ray worker process that only needs part of
rayflow (a subtask, the job master, the run lock) imports only that part, which
shortens the start of every actor of a job.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayflow.config import (
        CheckpointConfig,
        CheckpointingMode,
        DataTransport,
        ExecutionConfig,
        RestartStrategies,
        RestartStrategy,
    )
    from rayflow.datagen import DataGeneratorSource
    from rayflow.datastream import DataStream, DataStreamSink, KeyedStream
    from rayflow.environment import JobClient, JobResult, StreamExecutionEnvironment
    from rayflow.errors import (
        ConcurrentRunError,
        JobCancelledError,
        JobFailedError,
        JobResultLostError,
        OperatorError,
        SavepointError,
    )
    from rayflow.eventtime import Duration, TimeDomain, TimestampAssigner, WatermarkStrategy
    from rayflow.failures import FailureEntry
    from rayflow.functions import (
        FilterFunction,
        FlatMapFunction,
        KeyedProcessFunction,
        MapFunction,
        ReduceFunction,
        RuntimeContext,
        TimerService,
    )
    from rayflow.guarantees import DeliveryGuarantee
    from rayflow.outputs import OutputTag
    from rayflow.recoverability import NonRecoverableError
    from rayflow.sink import (
        CommitOutcome,
        CommitStatus,
        CommittableSerializer,
        Committer,
        RollingPolicy,
        Sink,
        SinkContext,
        SinkWriter,
        TransactionWriter,
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
    from rayflow.windowing import (
        AggregateFunction,
        EventTimeSessionWindows,
        ProcessingTimeSessionWindows,
        ProcessWindowFunction,
        SlidingEventTimeWindows,
        SlidingProcessingTimeWindows,
        TimeWindow,
        TumblingEventTimeWindows,
        TumblingProcessingTimeWindows,
        WindowedStream,
    )

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "StreamExecutionEnvironment": "rayflow.environment",
    "JobClient": "rayflow.environment",
    "JobResult": "rayflow.environment",
    "DataStream": "rayflow.datastream",
    "KeyedStream": "rayflow.datastream",
    "DataStreamSink": "rayflow.datastream",
    "MapFunction": "rayflow.functions",
    "FlatMapFunction": "rayflow.functions",
    "FilterFunction": "rayflow.functions",
    "ReduceFunction": "rayflow.functions",
    "KeyedProcessFunction": "rayflow.functions",
    "RuntimeContext": "rayflow.functions",
    "ValueStateDescriptor": "rayflow.state",
    "ListStateDescriptor": "rayflow.state",
    "MapStateDescriptor": "rayflow.state",
    "ReducingStateDescriptor": "rayflow.state",
    "ValueState": "rayflow.state",
    "ListState": "rayflow.state",
    "MapState": "rayflow.state",
    "ReducingState": "rayflow.state",
    "Source": "rayflow.sources",
    "NumberSequenceSource": "rayflow.sources",
    "CollectionSource": "rayflow.sources",
    "FileSource": "rayflow.sources",
    "Sink": "rayflow.sink",
    "SinkWriter": "rayflow.sink",
    "SinkContext": "rayflow.sink",
    "TwoPhaseCommittingSink": "rayflow.sink",
    "RollingPolicy": "rayflow.sink",
    "UnsupportedGuaranteeError": "rayflow.sink",
    "TransactionWriter": "rayflow.sink",
    "Committer": "rayflow.sink",
    "CommitOutcome": "rayflow.sink",
    "CommitStatus": "rayflow.sink",
    "CommittableSerializer": "rayflow.sink",
    "CheckpointConfig": "rayflow.config",
    "CheckpointingMode": "rayflow.config",
    "DataTransport": "rayflow.config",
    "ExecutionConfig": "rayflow.config",
    "RestartStrategies": "rayflow.config",
    "RestartStrategy": "rayflow.config",
    "DeliveryGuarantee": "rayflow.guarantees",
    "JobFailedError": "rayflow.errors",
    "JobCancelledError": "rayflow.errors",
    "JobResultLostError": "rayflow.errors",
    "ConcurrentRunError": "rayflow.errors",
    "SavepointError": "rayflow.errors",
    "DataGeneratorSource": "rayflow.datagen",
    "OperatorError": "rayflow.errors",
    "NonRecoverableError": "rayflow.recoverability",
    "FailureEntry": "rayflow.failures",
    "WatermarkStrategy": "rayflow.eventtime",
    "Duration": "rayflow.eventtime",
    "TimestampAssigner": "rayflow.eventtime",
    "TimeDomain": "rayflow.eventtime",
    "TimerService": "rayflow.functions",
    "OutputTag": "rayflow.outputs",
    "WindowedStream": "rayflow.windowing",
    "TimeWindow": "rayflow.windowing",
    "TumblingEventTimeWindows": "rayflow.windowing",
    "TumblingProcessingTimeWindows": "rayflow.windowing",
    "SlidingEventTimeWindows": "rayflow.windowing",
    "SlidingProcessingTimeWindows": "rayflow.windowing",
    "EventTimeSessionWindows": "rayflow.windowing",
    "ProcessingTimeSessionWindows": "rayflow.windowing",
    "AggregateFunction": "rayflow.windowing",
    "ProcessWindowFunction": "rayflow.windowing",
}

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
    "DataGeneratorSource",
    "Sink",
    "SinkWriter",
    "SinkContext",
    "TwoPhaseCommittingSink",
    "RollingPolicy",
    "UnsupportedGuaranteeError",
    "TransactionWriter",
    "Committer",
    "CommitOutcome",
    "CommitStatus",
    "CommittableSerializer",
    "CheckpointConfig",
    "CheckpointingMode",
    "DataTransport",
    "ExecutionConfig",
    "RestartStrategies",
    "RestartStrategy",
    "DeliveryGuarantee",
    "JobFailedError",
    "JobCancelledError",
    "JobResultLostError",
    "ConcurrentRunError",
    "SavepointError",
    "OperatorError",
    "NonRecoverableError",
    "FailureEntry",
    "WatermarkStrategy",
    "Duration",
    "TimestampAssigner",
    "TimeDomain",
    "TimerService",
    "OutputTag",
    "WindowedStream",
    "TimeWindow",
    "TumblingEventTimeWindows",
    "TumblingProcessingTimeWindows",
    "SlidingEventTimeWindows",
    "SlidingProcessingTimeWindows",
    "EventTimeSessionWindows",
    "ProcessingTimeSessionWindows",
    "AggregateFunction",
    "ProcessWindowFunction",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in _SUBMODULES:  # ``import rayflow; rayflow.sources`` as before
            return importlib.import_module(f"rayflow.{name}")
        raise AttributeError(f"module 'rayflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


#: Submodules reachable as attributes of the package without importing them first.
_SUBMODULES = frozenset(
    {
        "config",
        "datastream",
        "durability",
        "environment",
        "errors",
        "failures",
        "functions",
        "eventtime",
        "windowing",
        "outputs",
        "guarantees",
        "inprocess",
        "keygroups",
        "progress",
        "recoverability",
        "sink",
        "sources",
        "state",
        "status",
        "testing",
        "checkpoint",
        "plan",
        "runtime",
        "bench",
        "jobs",
        "cli",
    }
)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
