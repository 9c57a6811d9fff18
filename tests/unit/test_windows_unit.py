"""The window operator on its own: assigners, the window functions, lateness and the
late side output, sessions, and its state through a snapshot and a rescaled restore."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from rayflow.eventtime import MAX_WATERMARK, TIMESTAMP_COLUMN, Duration
from rayflow.eventtime.strategy import with_timestamps, without_timestamps
from rayflow.keygroups import key_group_of, key_groups_of_subtask
from rayflow.outputs import SideOutput
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime.operators import OperatorContext
from rayflow.windowing import (
    AggregateFunction,
    EventTimeSessionWindows,
    ProcessWindowFunction,
    SlidingEventTimeWindows,
    TumblingEventTimeWindows,
    TumblingProcessingTimeWindows,
)
from rayflow.windowing.operator import WindowKind, WindowOperator, WindowSpec

MAXP = 8


def operator(
    assigner,
    kind=WindowKind.AGGREGATION,
    function=None,
    aggregation="sum",
    field="v",
    key="k",
    lateness=0,
    tag=None,
    index=0,
    parallelism=1,
):
    op = WindowOperator(
        KeySelector(key), WindowSpec(assigner, lateness, tag), kind, function, aggregation, field
    )
    op.open(OperatorContext("job", "win", "win", index, parallelism, MAXP, 0))
    return op


def batch(rows):
    b = pa.RecordBatch.from_pylist(rows)
    return with_timestamps(b, pa.array([r["t"] for r in rows], type=pa.int64()))


def results(outputs):
    main, side = [], []
    for b in outputs:
        if isinstance(b, SideOutput):
            side.extend(without_timestamps(b.batch).to_pylist())
        else:
            assert TIMESTAMP_COLUMN in b.schema.names
            main.extend(b.drop_columns([TIMESTAMP_COLUMN]).to_pylist())
    return main, side


def run(op, batches, watermark_after_each=None):
    out = []
    for b in batches:
        out.extend(op.process(b))
        if watermark_after_each is not None:
            out.extend(op.process_watermark(watermark_after_each(b)))
    out.extend(op.process_watermark(MAX_WATERMARK))
    return results(out)


def random_rows(n, seed=0, keys=5, span=1000):
    rng = random.Random(seed)
    return [
        {"k": rng.randrange(keys), "t": rng.randrange(span), "v": rng.randrange(100)}
        for _ in range(n)
    ]


def brute_windows(rows, starts_of, size):
    sums = {}
    for r in rows:
        for s in starts_of(r["t"]):
            sums[(r["k"], s)] = sums.get((r["k"], s), 0) + r["v"]
    return {(k, s, s + size): v for (k, s), v in sums.items()}


def as_sums(main, key="k", field="v"):
    return {(r[key], r["window_start"], r["window_end"]): r[field] for r in main}


def test_tumbling_sum_vectorized_and_per_record_agree():
    rows = random_rows(500)
    chunks = [batch(rows[i : i + 50]) for i in range(0, 500, 50)]
    tumbling = TumblingEventTimeWindows.of(Duration.of_millis(100))
    expect = brute_windows(rows, lambda t: [t - t % 100], 100)
    assert as_sums(run(operator(tumbling), chunks)[0]) == expect
    by_function = operator(tumbling, key=lambda r: r["k"])
    assert as_sums(run(by_function, chunks)[0], key="key") == expect


def test_sliding_windows_hold_each_record_in_size_over_slide_windows():
    rows = random_rows(300, seed=2)
    sliding = SlidingEventTimeWindows.of(Duration.of_millis(100), Duration.of_millis(30))
    main, _ = run(operator(sliding), [batch(rows)])

    def starts(t):
        last = t - t % 30
        return [s for s in range(last, t - 100, -30) if s + 100 > t]

    assert as_sums(main) == brute_windows(rows, starts, 100)


def test_count_min_max():
    rows = random_rows(200, seed=3)
    tumbling = TumblingEventTimeWindows.of(Duration.of_millis(250))
    counts = Counter((r["k"], r["t"] - r["t"] % 250) for r in rows)
    main, _ = run(operator(tumbling, aggregation="count", field=None), [batch(rows)])
    assert {(r["k"], r["window_start"]): r["count"] for r in main} == counts
    main, _ = run(operator(tumbling, aggregation="max"), [batch(rows)])
    top = {}
    for r in rows:
        w = (r["k"], r["t"] - r["t"] % 250)
        top[w] = max(top.get(w, -1), r["v"])
    assert {(r["k"], r["window_start"]): r["v"] for r in main} == top


def test_windows_fire_when_the_watermark_passes_them_and_late_records_go_aside():
    tumbling = TumblingEventTimeWindows.of(Duration.of_millis(10))
    op = operator(tumbling, tag="late")
    out = op.process(batch([{"k": 1, "t": 3, "v": 1}, {"k": 1, "t": 12, "v": 2}]))
    assert results(out) == ([], [])
    main, _ = results(op.process_watermark(9))
    assert main == [{"k": 1, "v": 1, "window_start": 0, "window_end": 10}]
    assert results(op.process_watermark(9)) == ([], [])  # nothing fires twice
    main, side = results(op.process(batch([{"k": 1, "t": 5, "v": 7}, {"k": 1, "t": 15, "v": 3}])))
    assert (main, side) == ([], [{"k": 1, "t": 5, "v": 7}])
    assert op.metrics()["late_records_side_output"] == 1
    main, _ = results(op.process_watermark(MAX_WATERMARK))
    assert main == [{"k": 1, "v": 5, "window_start": 10, "window_end": 20}]
    dropped = operator(tumbling)
    dropped.process_watermark(100)
    assert dropped.process(batch([{"k": 1, "t": 5, "v": 7}])) == []
    assert dropped.metrics()["late_records_dropped"] == 1


def test_allowed_lateness_fires_again_then_drops_the_window():
    tumbling = TumblingEventTimeWindows.of(Duration.of_millis(10))
    op = operator(tumbling, lateness=20, tag="late")
    op.process(batch([{"k": 1, "t": 3, "v": 1}]))
    assert results(op.process_watermark(10))[0] == [
        {"k": 1, "v": 1, "window_start": 0, "window_end": 10}
    ]
    # within the lateness: fires again at once with the updated sum
    main, side = results(op.process(batch([{"k": 1, "t": 4, "v": 5}])))
    assert (main, side) == ([{"k": 1, "v": 6, "window_start": 0, "window_end": 10}], [])
    assert results(op.process_watermark(29)) == ([], [])  # state dropped at 9 + 20
    main, side = results(op.process(batch([{"k": 1, "t": 4, "v": 5}])))
    assert (main, side) == ([], [{"k": 1, "t": 4, "v": 5}])


def test_sessions_merge_and_fire_once_per_session():
    sessions = EventTimeSessionWindows.with_gap(Duration.of_millis(10))
    op = operator(sessions, tag="late")
    rows = [{"k": 1, "t": 1, "v": 1}, {"k": 1, "t": 30, "v": 2}, {"k": 2, "t": 5, "v": 4}]
    op.process(batch(rows))
    op.process(batch([{"k": 1, "t": 8, "v": 10}, {"k": 1, "t": 22, "v": 100}]))
    # k=1: [1,11) and [8,18) merge to [1,18); [22,32) and [30,40) merge to [22,40)
    main, side = results(op.process_watermark(MAX_WATERMARK))
    assert sorted((r["k"], r["window_start"], r["window_end"], r["v"]) for r in main) == [
        (1, 1, 18, 11),
        (1, 22, 40, 102),
        (2, 5, 15, 4),
    ]
    assert side == []


def test_a_late_record_that_bridges_into_an_open_session_is_not_late():
    sessions = EventTimeSessionWindows.with_gap(Duration.of_millis(10))
    op = operator(sessions, tag="late")
    op.process(batch([{"k": 1, "t": 100, "v": 1}]))
    op.process_watermark(105)
    main, side = results(op.process(batch([{"k": 1, "t": 95, "v": 2}, {"k": 1, "t": 50, "v": 4}])))
    assert side == [{"k": 1, "t": 50, "v": 4}]
    main, _ = results(op.process_watermark(MAX_WATERMARK))
    assert [(r["window_start"], r["window_end"], r["v"]) for r in main] == [(95, 110, 3)]


class Average(AggregateFunction):
    def create_accumulator(self):
        return (0, 0)

    def add(self, value, accumulator):
        return accumulator[0] + value["v"], accumulator[1] + 1

    def get_result(self, accumulator):
        return {"avg": accumulator[0] / accumulator[1]}

    def merge(self, a, b):
        return a[0] + b[0], a[1] + b[1]


class Describe(ProcessWindowFunction):
    def process(self, key, context, elements):
        w = context.window()
        values = sorted(e["v"] for e in elements)
        yield {"key": key, "start": w.start, "values": values}


@pytest.mark.parametrize(
    "assigner",
    [
        TumblingEventTimeWindows.of(Duration.of_millis(10)),
        EventTimeSessionWindows.with_gap(Duration.of_millis(3)),
    ],
)
def test_reduce_aggregate_and_process(assigner):
    rows = [{"k": 1, "t": 1, "v": 2}, {"k": 1, "t": 2, "v": 4}, {"k": 2, "t": 3, "v": 9}]
    main, _ = run(
        operator(assigner, WindowKind.REDUCE, lambda a, b: {**a, "v": a["v"] + b["v"]}),
        [batch(rows)],
    )
    assert sorted((r["k"], r["v"]) for r in main) == [(1, 6), (2, 9)]
    main, _ = run(operator(assigner, WindowKind.AGGREGATE, Average()), [batch(rows)])
    assert sorted(r["avg"] for r in main) == [3.0, 9.0]
    main, _ = run(operator(assigner, WindowKind.PROCESS, Describe()), [batch(rows)])
    assert sorted((r["key"], r["values"]) for r in main) == [(1, [2, 4]), (2, [9])]


def test_window_state_and_timers_survive_a_snapshot_and_a_rescaled_restore():
    rows = random_rows(400, seed=7, keys=20)
    tumbling = TumblingEventTimeWindows.of(Duration.of_millis(100))
    first = operator(tumbling)
    before, _ = results(first.process(batch(rows[:200])) + first.process_watermark(499))
    snapshot = first.snapshot_state(1)
    after = []
    for index in range(3):
        op = operator(tumbling, index=index, parallelism=3)
        op.restore_state([snapshot])
        op.process_watermark(499)  # a restored subtask resumes at its watermark
        owned = key_groups_of_subtask(index, 3, MAXP)
        mine = [r for r in rows[200:] if key_group_of(r["k"], MAXP) in owned]
        after.extend(run(op, [batch(mine)] if mine else [])[0])
    # records after the snapshot into windows that had fired are late (dropped)
    on_time = rows[:200] + [r for r in rows[200:] if r["t"] >= 500]
    expect = brute_windows(on_time, lambda t: [t - t % 100], 100)
    got = Counter((r["k"], r["window_start"], r["window_end"]) for r in before + after)
    assert max(got.values()) == 1  # every window fired once, before or after
    assert as_sums(before + after) == expect


def test_processing_time_windows_fire_at_the_end_of_bounded_input():
    op = operator(TumblingProcessingTimeWindows.of(Duration.of_seconds(3600)))
    op.process(pa.RecordBatch.from_pylist([{"k": 1, "v": 2}, {"k": 1, "v": 3}]))
    assert op.process_watermark(MAX_WATERMARK) == []
    main, _ = results(op.end_input())
    assert [r["v"] for r in main] == [5]


def test_event_time_windows_need_timestamps():
    op = operator(TumblingEventTimeWindows.of(Duration.of_millis(10)))
    with pytest.raises(ValueError, match="timestamps"):
        op.process(pa.RecordBatch.from_pylist([{"k": 1, "v": 2}]))


def test_sliding_assigner_is_vectorized_over_the_column():
    sliding = SlidingEventTimeWindows.of(Duration.of_millis(10), Duration.of_millis(5))
    rows, starts, size = sliding.assign(np.array([7, -3], dtype=np.int64))
    assert (rows.tolist(), starts.tolist(), size) == ([0, 0, 1, 1], [5, 0, -5, -10], 10)
