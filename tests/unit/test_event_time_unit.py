"""Watermark strategies, per-split generation, the input valve and keyed timers, on
their own (no Ray)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from rayflow.eventtime import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    TIMESTAMP_COLUMN,
    Duration,
    TimestampAssigner,
    WatermarkStrategy,
)
from rayflow.eventtime.source_watermarks import SourceWatermarks
from rayflow.eventtime.timers import InternalTimerService
from rayflow.eventtime.valve import WatermarkValve
from rayflow.keygroups import key_groups_of_subtask
from rayflow.sources import CollectionSource, CollectionSplit
from rayflow.state import KeyedStateBackend


def batch(ts: list[int], **cols) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"t": ts, **cols})


def test_durations_and_strategy_shapes():
    assert Duration.of_seconds(2).to_milliseconds() == 2000
    assert Duration.of_minutes(1) == Duration.of_millis(60_000)
    s = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(5))
    assert s.out_of_orderness_ms == 5
    s2 = s.with_timestamp_assigner("t").with_idleness(dt.timedelta(seconds=1))
    assert (s2.assigner, s2.idleness_ms, s.assigner) == ("t", 1000, None)
    assert WatermarkStrategy.for_monotonous_timestamps().out_of_orderness_ms == 0
    with pytest.raises(ValueError):
        Duration.of_millis(-1) and WatermarkStrategy.for_bounded_out_of_orderness(-1)
    with pytest.raises(TypeError):
        WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(3)


def test_timestamps_from_a_column_a_function_or_an_assigner():
    b = batch([3, 1], v=[10, 20])
    by_column = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")
    assert by_column.timestamps_of(b).to_pylist() == [3, 1]

    class Twice(TimestampAssigner):
        def extract_timestamp(self, value, record_timestamp):
            assert record_timestamp is None and TIMESTAMP_COLUMN not in value
            return value["t"] * 2

    assert by_column.with_timestamp_assigner(Twice()).timestamps_of(b).to_pylist() == [6, 2]
    fn = by_column.with_timestamp_assigner(lambda r: r["v"])
    assert fn.timestamps_of(b).to_pylist() == [10, 20]
    stamps = pa.array([dt.datetime(1970, 1, 1, 0, 0, 1)], type=pa.timestamp("us"))
    b2 = pa.RecordBatch.from_pydict({"t": stamps})
    assert by_column.timestamps_of(b2).to_pylist() == [1000]
    with pytest.raises(KeyError):
        by_column.with_timestamp_assigner("nope").timestamps_of(b)


def test_source_watermarks_are_the_minimum_over_unfinished_splits():
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_millis(10)
    ).with_timestamp_assigner("t")
    splits = [CollectionSplit("a"), CollectionSplit("b")]
    sw = SourceWatermarks(strategy, splits)
    out = sw.on_batch(batch([100, 50]), "a")
    assert out.column(TIMESTAMP_COLUMN).to_pylist() == [100, 50]
    assert sw.advance() is None  # split b has not been read: it holds event time back
    sw.on_batch(batch([40]), "b")
    assert sw.advance() == 40 - 11
    sw.finished(["b"])
    assert sw.advance() == 100 - 11
    assert sw.advance() is None  # no progress, nothing new
    # the state goes with the splits into a checkpoint, and comes back from it
    saved = sw.snapshot([CollectionSplit("a", offset=2), CollectionSplit("b", offset=1)])
    assert [s.event_time_state for s in saved] == [100, 40]
    restored = SourceWatermarks(strategy, saved[:1])
    assert restored.restored_watermark() == 100 - 11


def test_idle_splits_hold_nothing_back():
    now = [0.0]
    strategy = (
        WatermarkStrategy.for_monotonous_timestamps()
        .with_timestamp_assigner("t")
        .with_idleness(Duration.of_seconds(1))
    )
    sw = SourceWatermarks(
        strategy, [CollectionSplit("a"), CollectionSplit("b")], clock=lambda: now[0]
    )
    sw.on_batch(batch([500]), "a")
    assert sw.advance() is None
    now[0] = 0.5
    sw.on_batch(batch([600]), "a")
    now[0] = 1.2  # b never read for over a second: idle
    assert sw.advance() == 599
    assert sw.idleness_changed() is None  # a is still active
    now[0] = 3.0
    assert sw.idleness_changed() is True  # every split idle: the output is idle
    sw.on_batch(batch([700]), "b")
    assert sw.idleness_changed() is False


def test_valve_takes_the_minimum_over_active_channels():
    valve = WatermarkValve(3)
    assert valve.on_watermark(0, 10) is None
    assert valve.on_watermark(1, 20) is None
    assert valve.on_watermark(2, 5) == 5
    assert valve.on_watermark(2, 30) == 10
    assert valve.on_status(0, True) == 20  # idle channel 0 no longer holds it back
    assert valve.on_watermark(1, 15) is None  # a channel never goes back
    assert valve.on_status(1, True) == 30
    assert valve.on_status(2, True) is None and valve.idle
    assert valve.on_watermark(0, 40) == 40 and not valve.idle
    assert valve.on_watermark(0, 3) is None
    restarted = WatermarkValve(2, start=40)
    assert restarted.watermark == 40 and restarted.on_watermark(0, 50) is None
    assert restarted.on_watermark(1, 45) == 45


def test_timers_fire_once_in_order_and_survive_a_rescale():
    backend = KeyedStateBackend(8, range(8))
    timers = InternalTimerService(backend)
    for key, ts in [("a", 30), ("b", 10), ("a", 10), ("a", 30), ("c", 20)]:
        timers.register_event_time_timer(key, None, ts)
    timers.delete_event_time_timer("c", None, 20)
    timers.advance_watermark(25)
    fired = []
    while (due := timers.pop_event()) is not None:
        fired.append(due[:2])
    assert sorted(fired) == [(10, "a"), (10, "b")]
    snapshot = backend.snapshot()
    # rescaled to two subtasks: each restores its key groups' timers only
    remaining = []
    for index in range(2):
        b = KeyedStateBackend(8, key_groups_of_subtask(index, 2, 8))
        b.restore([snapshot])
        t = InternalTimerService(b)
        t.restored()
        t.advance_watermark(MAX_WATERMARK)
        while (due := t.pop_event()) is not None:
            remaining.append(due[:2])
    assert remaining == [(30, "a")]


def test_processing_time_timers_arm_a_wake_up():
    now = [1000]
    woken = []
    timers = InternalTimerService(
        KeyedStateBackend(8, range(8)), schedule=woken.append, clock=lambda: now[0]
    )
    timers.register_processing_time_timer("k", None, 1500)
    timers.register_processing_time_timer("k", None, 1200)
    assert woken == [0.5, 0.2]
    timers.on_wake()
    now[0] = 1300
    assert timers.pop_processing()[:2] == (1200, "k")
    assert timers.pop_processing() is None
    assert woken[-1] == pytest.approx(0.2)  # re-armed for the one at 1500
    assert timers.watermark == MIN_WATERMARK


def test_from_source_takes_a_strategy_or_a_name():
    from rayflow import StreamExecutionEnvironment

    env = StreamExecutionEnvironment.get_execution_environment()
    s = env.from_source(CollectionSource([{"t": 1}]), "named")
    assert s.get_name() == "named"
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")
    s2 = env.from_source(CollectionSource([{"t": 1}]), strategy, "timed")
    assert s2._transformation.watermark_strategy is strategy
    with pytest.raises(TypeError):
        env.from_source(CollectionSource([{"t": 1}]), object(), "x")


def test_channel_state_keeps_watermarks_in_order_with_the_data():
    from rayflow.runtime.channel_state import ChannelStateRecorder, channel_state_size
    from rayflow.runtime.events import Bundle, LatencyMarker, Watermark, WatermarkStatus

    data = pa.RecordBatch.from_pydict({"x": [1, 2]})
    recorder = ChannelStateRecorder(1, [0, 0], lambda r: None)
    recorder.offer(0, 0, Bundle((data, Watermark(5), LatencyMarker(0.0, "s", 0))))
    recorder.offer(0, 1, WatermarkStatus(True))
    recorder.offer(1, 0, Watermark(7))  # a channel with watermarks alone: nothing to keep
    recorder.set_end(0, 2)
    recorder.set_end(1, 1)
    state = recorder.channel_state()
    assert state == {0: [data, Watermark(5), WatermarkStatus(True)]}
    assert channel_state_size(state) == data.nbytes
