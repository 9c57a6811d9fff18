"""Source watermarks of a subtask without splits: with an idle timeout its output is
idle (it holds nobody back) until a batch of a split comes; without one it stays as it
is; a subtask whose splits all finished is not idle (its end of input follows)."""

from __future__ import annotations

import pyarrow as pa

from rayflow.eventtime import Duration, WatermarkStrategy
from rayflow.eventtime.source_watermarks import SourceWatermarks
from rayflow.sources import CollectionSplit

STRATEGY = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")


def test_a_subtask_without_splits_is_idle_with_an_idle_timeout():
    sw = SourceWatermarks(STRATEGY.with_idleness(Duration.of_seconds(1)), [], clock=lambda: 0.0)
    assert sw.idleness_changed() is True
    assert sw.advance() is None
    sw.on_batch(pa.RecordBatch.from_pydict({"t": [50]}), "new")
    assert sw.idleness_changed() is False
    assert sw.advance() == 49
    assert SourceWatermarks(STRATEGY, []).idleness_changed() is None


def test_a_subtask_whose_splits_all_finished_is_not_idle():
    strategy = STRATEGY.with_idleness(Duration.of_seconds(1))
    sw = SourceWatermarks(strategy, [CollectionSplit("a")], clock=lambda: 0.0)
    sw.finished(["a"])
    assert sw.idleness_changed() is None
