"""Windows on keyed streams: assigners, window functions, the window operator and
``WindowedStream`` (``key_by(...).window(assigner)``)."""

from rayflow.windowing.assigners import (
    EventTimeSessionWindows,
    ProcessingTimeSessionWindows,
    SlidingEventTimeWindows,
    SlidingProcessingTimeWindows,
    TimeWindow,
    TumblingEventTimeWindows,
    TumblingProcessingTimeWindows,
    WindowAssigner,
)
from rayflow.windowing.functions import AggregateFunction, ProcessWindowFunction
from rayflow.windowing.stream import WindowedStream

__all__ = [
    "TimeWindow",
    "WindowAssigner",
    "TumblingEventTimeWindows",
    "TumblingProcessingTimeWindows",
    "SlidingEventTimeWindows",
    "SlidingProcessingTimeWindows",
    "EventTimeSessionWindows",
    "ProcessingTimeSessionWindows",
    "AggregateFunction",
    "ProcessWindowFunction",
    "WindowedStream",
]
