"""A window's first record arriving after the watermark passed the window's end, but
within the allowed lateness: the window fires at once with it, and once only (the
watermark moving on later must not fire it again); for tumbling windows (vectorized and
record by record) and for sessions."""

from __future__ import annotations

import pytest

from rayflow.eventtime import MAX_WATERMARK, Duration
from rayflow.windowing import EventTimeSessionWindows, TumblingEventTimeWindows
from rayflow.windowing.operator import WindowKind
from tests.unit.test_windows_unit import batch, operator, results


def _reduce_sum(a, b):
    return {"k": a["k"], "t": max(a["t"], b["t"]), "v": a["v"] + b["v"]}


@pytest.mark.parametrize("kind", [WindowKind.AGGREGATION, WindowKind.REDUCE])
def test_a_first_record_within_the_lateness_fires_its_window_once(kind):
    tumbling = TumblingEventTimeWindows.of(Duration.of_millis(10))
    function = _reduce_sum if kind is WindowKind.REDUCE else None
    op = operator(tumbling, kind=kind, function=function, lateness=20, tag="late")
    assert results(op.process_watermark(15)) == ([], [])
    main, side = results(op.process(batch([{"k": 1, "t": 4, "v": 5}])))
    assert side == []
    assert [r["v"] for r in main] == [5]  # fired at once: the watermark is past its end
    main, _ = results(op.process_watermark(16))
    assert main == [], "the window fired a second time when the watermark moved on"
    assert results(op.process_watermark(MAX_WATERMARK)) == ([], [])


def test_a_late_record_that_starts_a_session_within_the_lateness_fires_it_once():
    sessions = EventTimeSessionWindows.with_gap(Duration.of_millis(10))
    op = operator(sessions, lateness=50, tag="late")
    op.process_watermark(40)
    main, side = results(op.process(batch([{"k": 1, "t": 5, "v": 3}])))
    assert side == []
    assert [(r["window_start"], r["window_end"], r["v"]) for r in main] == [(5, 15, 3)]
    assert results(op.process_watermark(41)) == ([], [])
    assert results(op.process_watermark(MAX_WATERMARK)) == ([], [])
