"""Event time on Ray: watermarks per source split through channels and barriers, and
keyed event-time timers that fire exactly once across kills and restores."""

from __future__ import annotations

import random
import time
from collections import Counter

import pyarrow as pa
import pytest

from rayflow import StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.eventtime import MAX_WATERMARK, Duration, WatermarkStrategy
from rayflow.functions import KeyedProcessFunction
from rayflow.sources import CollectionSource, Source, SourceReader, SourceSplit
from rayflow.state import MapStateDescriptor
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink

KEYS = 7
BUCKET = 100
DISORDER = 50


def records(n: int, seed: int = 1) -> list[dict]:
    """``n`` records whose timestamps run late by at most ``DISORDER`` ms."""
    rng = random.Random(seed)
    return [{"k": i % KEYS, "t": i * 3 + rng.randrange(DISORDER)} for i in range(n)]


class BucketCounts(KeyedProcessFunction):
    """Counts each key's records per bucket of event time; an event-time timer at the
    bucket's end emits the count once and clears it."""

    def open(self, runtime_context):
        self.counts = runtime_context.get_map_state(MapStateDescriptor("counts"))

    def process_element(self, value, ctx):
        end = (value["t"] // BUCKET + 1) * BUCKET
        assert ctx.timestamp() == value["t"]
        self.counts.put(end, self.counts.get(end, 0) + 1)
        ctx.timer_service().register_event_time_timer(end - 1)
        return None

    def on_timer(self, timestamp, ctx):
        end = timestamp + 1
        count = self.counts.get(end)
        self.counts.remove(end)
        watermark = ctx.timer_service().current_watermark()
        yield {"k": ctx.get_current_key(), "end": end, "count": count, "wm": watermark}


def expected(rows: list[dict]) -> Counter:
    return Counter((r["k"], (r["t"] // BUCKET + 1) * BUCKET) for r in rows)


def build(rows, parallelism, plan=None, storage=None, source_parallelism=None):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    env.enable_checkpointing(100)
    if storage is not None:
        env.get_checkpoint_config().set_checkpoint_storage(storage)
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(10, 50))
    if plan is not None:
        inject_faults(env, plan)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_millis(DISORDER)
    ).with_timestamp_assigner("t")
    sink = CollectSink()
    source = env.from_source(CollectionSource(rows, batch_size=50), strategy, "events")
    if source_parallelism is not None:
        source.set_parallelism(source_parallelism)
    (
        source.uid("events")
        .key_by("k")
        .process(BucketCounts(), "buckets")
        .uid("buckets")
        .sink_to(sink, "out")
        .uid("out")
    )
    return env, sink


def fired(result, sink) -> Counter:
    table = result.sink_result(sink)
    out: Counter = Counter()
    for k, end, count in zip(*(table.column(c).to_pylist() for c in ("k", "end", "count"))):
        out[(k, end)] += count
    firings = Counter(zip(table.column("k").to_pylist(), table.column("end").to_pylist()))
    assert max(firings.values()) == 1, "a timer fired twice"
    return out


@pytest.mark.parametrize("parallelism", [1, 2])
def test_event_time_timers_fire_once_per_registration(parallelism):
    rows = records(3000)
    env, sink = build(rows, parallelism)
    result = env.execute("event-time-timers")
    assert fired(result, sink) == expected(rows)
    # Watermarks came through the channels while the input ran, not only at its end.
    watermarks = result.sink_result(sink).column("wm").to_pylist()
    assert min(watermarks) < rows[-1]["t"] - DISORDER
    assert max(watermarks) == MAX_WATERMARK


def test_event_time_timers_exactly_once_across_kills(tmp_path):
    rows = records(6000, seed=3)
    plan = FaultPlan(
        [
            Fault(FaultPoint.AFTER_RECORDS, attempt=0, vertex="buckets", subtask=0, records=900),
            Fault(FaultPoint.AFTER_SNAPSHOT, attempt=1, vertex="buckets", subtask=1),
            Fault(FaultPoint.AFTER_RECORDS, attempt=2, vertex="buckets", subtask=1, records=700),
        ]
    )
    env, sink = build(rows, 2, plan=plan, storage=str(tmp_path))
    result = env.execute("event-time-timers-chaos")
    assert result.restarts >= 3, result.failures
    assert fired(result, sink) == expected(rows)


class _IdleOrData(SourceReader):
    """Reads ``rows`` in batches of 50 if it has the data split; with the idle split it
    has nothing to read (empty batches) for ``idle_s``, then ends."""

    def __init__(self, splits, rows, idle_s):
        self.splits = splits
        self.rows = rows if splits and splits[0].split_id == "data" else []
        self.offset = 0
        self.ends_at = time.monotonic() + idle_s

    def read_batch(self):
        if self.rows:
            if self.offset >= len(self.rows):
                return None
            chunk = self.rows[self.offset : self.offset + 50]
            self.offset += len(chunk)
            time.sleep(0.04)  # still reading well after the other split turned idle
            return pa.RecordBatch.from_pylist(chunk)
        if time.monotonic() < self.ends_at:
            return pa.RecordBatch.from_pylist([], schema=pa.schema([("k", pa.int64())]))
        return None

    def snapshot_splits(self):
        return list(self.splits)


class IdleOrDataSource(Source):
    def __init__(self, rows, idle_s):
        self.rows = rows
        self.idle_s = idle_s

    def create_splits(self, parallelism):
        return [SourceSplit("data"), SourceSplit("idle")]

    def create_reader(self, splits):
        return _IdleOrData(splits, self.rows, self.idle_s)


def test_an_idle_source_subtask_holds_event_time_back_no_longer():
    rows = records(1000)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    strategy = (
        WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(DISORDER))
        .with_timestamp_assigner("t")
        .with_idleness(Duration.of_millis(100))
    )
    sink = CollectSink()
    (
        env.from_source(IdleOrDataSource(rows, idle_s=4.0), strategy, "events")
        .key_by("k")
        .process(BucketCounts(), "buckets")
        .set_parallelism(1)
        .sink_to(sink, "out")
        .set_parallelism(1)
    )
    result = env.execute("idle-source")
    assert fired(result, sink) == expected(rows)
    # the idle subtask was left out: windows fired on the data subtask's watermarks alone
    watermarks = result.sink_result(sink).column("wm").to_pylist()
    assert min(watermarks) < MAX_WATERMARK
