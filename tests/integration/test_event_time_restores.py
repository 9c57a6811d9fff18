"""Event time on a real Ray across a stop and where inputs end: the tumbling event-time
window sum of tests/chaos/window_harness.py stopped with a savepoint (no end-of-input
watermark) and resumed from it rescaled 2 -> 3 gives exactly the directly computed sums,
each window once, and every late record once in the late side output; an input that
ended before the first watermark holds event time back no longer."""

from __future__ import annotations

import time

import pyarrow as pa

from rayflow import StreamExecutionEnvironment
from rayflow.eventtime import MAX_WATERMARK, Duration, WatermarkStrategy
from rayflow.sources import CollectionSource, Source, SourceReader, SourceSplit
from rayflow.testing import wait_for_checkpoints
from sinks.basic import CollectSink
from tests.chaos import window_harness
from tests.integration.test_event_time import DISORDER, BucketCounts, expected, fired, records

N = 8_000
SCHEMA = pa.schema([("k", pa.int64()), ("t", pa.int64())])


def check(got, table):
    sums, late = window_harness.expected(table)
    assert max(got.windows_emitted.values()) == 1, "a window fired twice"
    assert got.sums == sums
    assert got.late == late and sum(late.values()) > 20


def test_stop_with_savepoint_fires_no_window_and_a_rescaled_resume_fires_each_once(
    tmp_path, ray_session
):
    h = window_harness
    table = h.make_records(N, 21)
    env, sums, late = h.build(table, 2, str(tmp_path / "chk"), rate=N / 4)
    client = env.execute_async(h.unique_job("window-stop"))
    assert wait_for_checkpoints(client, 2) >= 2
    savepoint = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=60)
    stopped = h.outcome(client.wait(), sums, late)
    # no end-of-input watermark at a stop: windows still open are in the savepoint only
    assert len(stopped.sums) < len(h.expected(table)[0])
    env3, _, _ = h.build(table, 3, str(tmp_path / "chk2"), sinks=(sums, late))
    result = env3.execute(h.unique_job("window-resumed"), restore_from=savepoint)
    assert result.restored_from is not None
    check(h.outcome(result, sums, late), table)


class _LateStart(SourceReader):
    """Reads ``rows`` in batches of 50, the first one only after ``delay_s`` (so that an
    input without event time has ended by then)."""

    def __init__(self, splits, rows, delay_s):
        self.splits = splits
        self.rows = rows
        self.offset = 0
        self.start_at = time.monotonic() + delay_s

    def read_batch(self):
        if time.monotonic() < self.start_at:
            return pa.RecordBatch.from_pylist([], schema=SCHEMA)
        if self.offset >= len(self.rows):
            return None
        chunk = self.rows[self.offset : self.offset + 50]
        self.offset += len(chunk)
        time.sleep(0.01)
        return pa.RecordBatch.from_pylist(chunk, schema=SCHEMA)

    def snapshot_splits(self):
        return list(self.splits)


class LateStartSource(Source):
    def __init__(self, rows, delay_s):
        self.rows = rows
        self.delay_s = delay_s

    def create_splits(self, parallelism):
        return [SourceSplit("late-start")]

    def create_reader(self, splits):
        return _LateStart(splits, self.rows, self.delay_s)


def test_an_input_that_ended_before_the_first_watermark_holds_event_time_back_no_longer(
    ray_session,
):
    # A union of an event-time input with one without event time that ends at once: its
    # channel ends before any watermark arrives, and must hold nothing back afterwards.
    rows = records(2000)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_millis(DISORDER)
    ).with_timestamp_assigner("t")
    sink = CollectSink()
    events = env.from_source(LateStartSource(rows, delay_s=1.0), strategy, "events")
    empty = env.from_source(CollectionSource(pa.table({"k": [], "t": []}, schema=SCHEMA)), "empty")
    events.union(empty).key_by("k").process(BucketCounts(), "buckets").sink_to(sink, "out")
    result = env.execute("ended-input-then-watermarks")
    assert fired(result, sink) == expected(rows)
    # timers fired on the events' watermarks while they ran, not all at the end of input
    watermarks = result.sink_result(sink).column("wm").to_pylist()
    assert min(watermarks) < MAX_WATERMARK


class _DataOrNothing(SourceReader):
    """Reads its splits' ``rows`` in batches of 50; a reader without splits has nothing
    to read (empty batches, as an unbounded source with more subtasks than partitions)
    for ``idle_s``, then ends. Watermarks per split."""

    def __init__(self, splits, rows, idle_s):
        self.splits = splits
        self.rows = rows if splits else []
        self.offset = 0
        self.ends_at = time.monotonic() + idle_s

    def read_batch(self):
        if self.splits:
            if self.offset >= len(self.rows):
                return None
            chunk = self.rows[self.offset : self.offset + 50]
            self.offset += len(chunk)
            time.sleep(0.06)  # still reading well after the other subtask started
            return pa.RecordBatch.from_pylist(chunk, schema=SCHEMA)
        if time.monotonic() < self.ends_at:
            return pa.RecordBatch.from_pylist([], schema=SCHEMA)
        return None

    def last_split_id(self):
        return self.splits[0].split_id if self.splits else None

    def snapshot_splits(self):
        return list(self.splits)


class OneSplitSource(Source):
    def __init__(self, rows, idle_s):
        self.rows = rows
        self.idle_s = idle_s

    def create_splits(self, parallelism):
        return [SourceSplit("only")]

    def create_reader(self, splits):
        return _DataOrNothing(splits, self.rows, self.idle_s)


def test_a_source_subtask_without_splits_turns_idle(ray_session):
    # parallelism 2 over one split: subtask 2 reads nothing, and with an idle timeout it
    # must hold event time back no longer (as a Kafka source with more subtasks than
    # partitions)
    rows = records(2000)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    strategy = (
        WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(DISORDER))
        .with_timestamp_assigner("t")
        .with_idleness(Duration.of_millis(100))
    )
    sink = CollectSink()
    (
        env.from_source(OneSplitSource(rows, idle_s=6.0), strategy, "events")
        .key_by("k")
        .process(BucketCounts(), "buckets")
        .set_parallelism(1)
        .sink_to(sink, "out")
        .set_parallelism(1)
    )
    result = env.execute("source-without-splits")
    assert fired(result, sink) == expected(rows)
    watermarks = result.sink_result(sink).column("wm").to_pylist()
    assert min(watermarks) < MAX_WATERMARK
