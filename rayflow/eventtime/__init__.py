"""Event time: timestamps, watermarks and timers.

* :mod:`rayflow.eventtime.strategy`: ``WatermarkStrategy``, ``Duration``,
  ``TimestampAssigner`` and the timestamp column records carry;
* :mod:`rayflow.eventtime.source_watermarks`: watermarks generated per source split;
* :mod:`rayflow.eventtime.valve`: a subtask's watermark over its input channels;
* :mod:`rayflow.eventtime.timers`: event- and processing-time timers in keyed state.
"""

from rayflow.eventtime.strategy import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    TIMESTAMP_COLUMN,
    Duration,
    TimestampAssigner,
    WatermarkStrategy,
)
from rayflow.eventtime.timers import TimeDomain

__all__ = [
    "Duration",
    "TimestampAssigner",
    "WatermarkStrategy",
    "TimeDomain",
    "TIMESTAMP_COLUMN",
    "MIN_WATERMARK",
    "MAX_WATERMARK",
]
