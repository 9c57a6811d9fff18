"""Windows on Ray: sliding, session and processing-time windows with reduce, aggregate
and process, against a direct computation; processing-time timers of a
KeyedProcessFunction."""

from __future__ import annotations

import random

from rayflow import StreamExecutionEnvironment
from rayflow.eventtime import Duration, WatermarkStrategy
from rayflow.functions import KeyedProcessFunction
from rayflow.sources import CollectionSource
from rayflow.state import ValueStateDescriptor
from rayflow.windowing import (
    AggregateFunction,
    EventTimeSessionWindows,
    ProcessWindowFunction,
    SlidingEventTimeWindows,
    TumblingProcessingTimeWindows,
)
from sinks.basic import CollectSink

N = 4000
KEYS = 9


def rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    # bursts of activity per key with quiet gaps, so sessions form; disorder < 40 ms
    return [
        {"k": i % KEYS, "t": i * 5 + (i // 200) * 700 + rng.randrange(40), "v": rng.randrange(50)}
        for i in range(N)
    ]


class Sum(AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, accumulator):
        return accumulator + value["v"]

    def get_result(self, accumulator):
        return {"total": accumulator}

    def merge(self, a, b):
        return a + b


class Span(ProcessWindowFunction):
    def process(self, key, context, elements):
        w = context.window()
        yield {"k": key, "start": w.start, "end": w.end, "n": len(list(elements))}


def sessions_of(data: list[dict], gap: int) -> dict[tuple[int, int, int], tuple[int, int]]:
    """Per (key, start, end) of each session: (sum of v, count)."""
    out = {}
    for k in range(KEYS):
        ts = sorted((r["t"], r["v"]) for r in data if r["k"] == k)
        start, end, total, n = None, None, 0, 0
        for t, v in ts:
            if start is not None and t <= end:
                end = max(end, t + gap)
                total, n = total + v, n + 1
                continue
            if start is not None:
                out[(k, start, end)] = (total, n)
            start, end, total, n = t, t + gap, v, 1
        out[(k, start, end)] = (total, n)
    return out


def test_sliding_and_session_windows_with_every_window_function():
    data = rows()
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_millis(40)
    ).with_timestamp_assigner("t")
    keyed = env.from_source(CollectionSource(data, batch_size=100), strategy, "events").key_by("k")
    sinks = {name: CollectSink() for name in ("sliding", "reduce", "aggregate", "process")}
    (
        keyed.window(SlidingEventTimeWindows.of(Duration.of_millis(300), Duration.of_millis(100)))
        .sum("v")
        .sink_to(sinks["sliding"], "sliding")
    )
    gap = EventTimeSessionWindows.with_gap(Duration.of_millis(200))
    (
        keyed.window(gap)
        .reduce(lambda a, b: {"k": a["k"], "t": max(a["t"], b["t"]), "v": a["v"] + b["v"]})
        .sink_to(sinks["reduce"], "reduce")
    )
    keyed.window(gap).aggregate(Sum()).sink_to(sinks["aggregate"], "aggregate")
    keyed.window(gap).process(Span()).sink_to(sinks["process"], "process")
    result = env.execute("windows")

    sliding = {}
    for r in data:
        last = r["t"] - r["t"] % 100
        for s in range(last, r["t"] - 300, -100):
            sliding[(r["k"], s)] = sliding.get((r["k"], s), 0) + r["v"]
    got = result.sink_result(sinks["sliding"]).to_pylist()
    assert {(r["k"], r["window_start"]): r["v"] for r in got} == sliding
    assert len(got) == len(sliding)

    sessions = sessions_of(data, 200)
    reduced = result.sink_result(sinks["reduce"]).to_pylist()
    assert sorted((r["k"], r["v"]) for r in reduced) == sorted(
        (k, total) for (k, _, _), (total, _) in sessions.items()
    )
    totals = sorted(r["total"] for r in result.sink_result(sinks["aggregate"]).to_pylist())
    assert totals == sorted(total for total, _ in sessions.values())
    spans = result.sink_result(sinks["process"]).to_pylist()
    assert {(r["k"], r["start"], r["end"]): r["n"] for r in spans} == {
        w: n for w, (_, n) in sessions.items()
    }


class OncePerKey(KeyedProcessFunction):
    """A processing-time timer 20 ms after a key's first record emits the key once."""

    def open(self, runtime_context):
        self.seen = runtime_context.get_state(ValueStateDescriptor("seen", False))

    def process_element(self, value, ctx):
        if not self.seen.value():
            self.seen.update(True)
            service = ctx.timer_service()
            service.register_processing_time_timer(service.current_processing_time() + 20)

    def on_timer(self, timestamp, ctx):
        yield {"k": ctx.get_current_key(), "domain": ctx.time_domain().name}


def test_processing_time_windows_and_timers():
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100)
    source = CollectionSource([{"k": i % KEYS, "v": 1} for i in range(N)], batch_size=50)
    source.records_per_second = 5000  # the job runs about 0.8 s: the timers come due
    keyed = env.from_source(source, "events").key_by("k")
    counts, timers = CollectSink(), CollectSink()
    keyed.window(TumblingProcessingTimeWindows.of(Duration.of_millis(200))).count().sink_to(counts)
    keyed.process(OncePerKey()).sink_to(timers, "timers")
    result = env.execute("processing-time")
    got = result.sink_result(counts).to_pylist()
    assert sum(r["count"] for r in got) == N
    assert all(r["window_end"] - r["window_start"] == 200 for r in got)
    fired = result.sink_result(timers).to_pylist()
    assert sorted(r["k"] for r in fired) == list(range(KEYS))
    assert {r["domain"] for r in fired} == {"PROCESSING_TIME"}
