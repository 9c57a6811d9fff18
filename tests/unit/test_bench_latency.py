"""The latency benchmark (``benchmarks/latency.py``): its rates, run sizes, order of runs,
medians, target, table, arguments and RESULTS.md section, without running any job."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_latency", BENCHMARKS / "latency.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_latency"] = module
    spec.loader.exec_module(module)
    return module


def _latency(p50: float, p99: float, mx: float, count: int = 200) -> dict[str, float]:
    return {"count": count, "p50_ms": p50, "p90_ms": p99, "p99_ms": p99, "max_ms": mx}


def _run(bench, config, rates=(1e6, 5e5, 5e5), batches=(131_072, 5_000), latency=None, **kw):
    max_rate, target, achieved = rates
    return bench.Run(
        config,
        max_rate=max_rate,
        max_batch_rows=batches[0],
        target_rate=target,
        batch_rows=batches[1],
        achieved_rate=achieved,
        latency=latency or {},
        **kw,
    )


def test_steady_rate_uses_the_middle_of_the_arrivals(bench):
    # 100 batches, one every 10 ms: 100 rows per batch -> 10,000 rows/s whatever the ends.
    times = [i * 0.01 for i in range(100)]
    assert bench.steady_rate(times, 10_000) == pytest.approx(10_000 * 79 / 100 / 0.79)
    # A slow start and a late straggler do not move it.
    skewed = [-5.0] + times[1:-1] + [60.0]
    assert bench.steady_rate(skewed, 10_000) == pytest.approx(10_000.0)
    # Order does not matter.
    assert bench.steady_rate(list(reversed(times)), 10_000) == pytest.approx(10_000.0)


def test_steady_rate_without_a_time_span_is_nan(bench):
    assert math.isnan(bench.steady_rate([], 10))
    assert math.isnan(bench.steady_rate([1.0], 10))
    assert math.isnan(bench.steady_rate([2.0, 2.0, 2.0], 10))
    # Every arrival in the middle at once: falls back to the whole span (the rows of the
    # 9 intervals between 10 arrivals, over 2 s).
    assert bench.steady_rate([0.0] + [1.0] * 8 + [2.0], 100) == pytest.approx(45.0)


def test_source_rate_is_per_subtask(bench):
    assert bench.source_rate(1_000_000, 1) == pytest.approx(500_000)
    assert bench.source_rate(1_000_000, 2) == pytest.approx(250_000)
    assert bench.source_rate(1_000_000, 4, fraction=0.25) == pytest.approx(62_500)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            bench.source_rate(bad, 1)
    with pytest.raises(ValueError):
        bench.source_rate(1.0, 0)


def test_rows_for_a_duration_with_a_floor(bench):
    assert bench.rows_for(1_000_000, 3.0) == 3_000_000
    assert bench.rows_for(10.0, 3.0) == bench.MIN_ROWS
    assert bench.rows_for(10.0, 3.0, minimum=7) == 30
    for unknown in (math.nan, 0.0, -5.0, math.inf):
        assert bench.rows_for(unknown, 3.0) == bench.MIN_ROWS


def test_target_is_the_timeout_plus_the_slack(bench):
    assert bench.target_p99_ms(0) == 50.0
    assert bench.target_p99_ms(10) == 60.0
    assert bench.target_p99_ms(100) == 150.0
    assert bench.target_p99_ms(100, slack_ms=5) == 105.0


def test_percentile_interpolates_as_the_latency_tracker(bench):
    from rayflow.runtime.latency import LatencyTracker

    values = [7.0, 1.0, 3.0, 9.0, 4.0, 12.5, 2.0]
    tracker = LatencyTracker()
    for v in values:
        tracker.record_ms(v)
    for q in (0, 50, 90, 99, 100):
        assert bench.percentile(values, q) == pytest.approx(tracker.percentile(q))
    assert math.isnan(bench.percentile([], 50))


def test_steady_latency_leaves_out_the_first_second_of_each_sink_subtask(bench):
    # 20 markers a second per sink-end subtask: the first 20 of each are start-up.
    first = {"count": 25, "samples_ms": [500.0] * 20 + [1.0, 2.0, 3.0, 4.0, 5.0]}
    second = {"count": 22, "samples_ms": [400.0] * 20 + [6.0, 7.0]}
    steady = bench.steady_latency([first, second], markers_per_s=20.0)
    assert steady["count"] == 7
    assert steady["max_ms"] == 7.0
    assert steady["p50_ms"] == pytest.approx(4.0)
    assert steady["p99_ms"] == pytest.approx(bench.percentile([1, 2, 3, 4, 5, 6, 7], 99))
    # Half a second left out: 10 of each.
    assert bench.steady_latency([first], 20.0, skip_s=0.5)["max_ms"] == 500.0
    # A sample that is a reservoir (fewer kept than recorded) has no order: no figures.
    reservoir = {"count": 5000, "samples_ms": [1.0] * 2000}
    assert bench.steady_latency([first, reservoir], 20.0) == {}
    # Nothing after the first second.
    assert bench.steady_latency([{"count": 3, "samples_ms": [1.0, 2.0, 3.0]}], 20.0) == {}


def test_runs_interleave_over_the_timeouts(bench):
    configs = [bench.Config(t, True, 1) for t in (0, 10, 100)]
    order = bench.interleaved(configs, 2)
    assert [(r, c.timeout_ms) for r, c in order] == [
        (0, 0),
        (0, 10),
        (0, 100),
        (1, 0),
        (1, 10),
        (1, 100),
    ]
    assert bench.interleaved(configs, 0) == []


def test_summarize_takes_medians_of_the_good_runs(bench):
    config = bench.Config(10, False, 1)
    runs = [
        _run(
            bench,
            config,
            (1e6, 5e5, 4.9e5),
            (131_072, 5_000),
            _latency(20, 40, 80),
            steady=_latency(15, 30, 35),
            checkpoints=10,
            load=3.0,
        ),
        _run(
            bench,
            config,
            (3e6, 1.5e6, 1.4e6),
            (131_072, 15_000),
            _latency(30, 90, 95),
            steady=_latency(25, 70, 75),
            checkpoints=12,
            load=5.0,
        ),
        _run(
            bench,
            config,
            (2e6, 1e6, 0.9e6),
            (131_072, 10_000),
            _latency(10, 50, 60),
            checkpoints=11,  # no steady figures (reservoir): left out of their median
            load=4.0,
        ),
        bench.Run(config, error="RuntimeError: boom", load=9.0),
        bench.Run(config, max_rate=2e6, latency={"count": 0}),  # no marker: not a result
    ]
    s = bench.summarize(config, runs)
    assert (s.runs, s.failed) == (3, 2)
    assert s.max_rate == 2e6
    assert s.target_rate == 1e6
    assert s.batch_rows == 10_000
    assert s.max_batch_rows == 131_072
    assert s.achieved_rate == 0.9e6
    assert (s.p50_ms, s.p99_ms, s.max_ms) == (20, 50, 80)
    assert (s.p99_min_ms, s.p99_max_ms) == (40, 90)
    assert s.markers == 200
    assert s.checkpoints == 11
    assert s.load == 4.5  # over every run, failed ones too
    assert (s.steady_p50_ms, s.steady_p99_ms) == (20, 50)
    assert s.target_ms == 60.0
    assert s.met is True
    assert s.steady_met is True


def test_summarize_without_a_good_run(bench):
    config = bench.Config(0, True, 2)
    s = bench.summarize(config, [bench.Run(config, error="x")])
    assert (s.runs, s.failed) == (0, 1)
    assert math.isnan(s.p99_ms) and s.met is None
    row = bench.render_table([s]).splitlines()[2]
    assert row.startswith(
        "| on | 2 | 0 | - (0) | - (0) | - / - | - | - | 0 | - | - | - | 50 | - | - / - | - |"
    )
    assert "| 0 (+1 failed) |" in row


def test_met_compares_the_median_p99_with_the_target(bench):
    config = bench.Config(0, True, 1)
    over = _run(bench, config, latency=_latency(5, 50.5, 60), steady=_latency(5, 49.0, 50))
    at = _run(bench, config, latency=_latency(5, 50.0, 60))
    assert bench.summarize(config, [over]).met is False
    assert bench.summarize(config, [over]).steady_met is True
    assert bench.summarize(config, [at]).met is True
    assert bench.summarize(config, [at]).steady_met is None


def test_table_has_a_row_per_config(bench):
    on, off = bench.Config(0, True, 1), bench.Config(100, False, 2)
    runs = {
        on: _run(
            bench,
            on,
            (2.5e6, 1.25e6, 1.2e6),
            (131_072, 12_500),
            _latency(4, 30, 41),
            steady=_latency(3, 20, 30),
        ),
        off: _run(bench, off, (8e5, 4e5, 2e5), (131_072, 2_000), _latency(90, 400, 512)),
    }
    table = bench.render_table([bench.summarize(c, [r]) for c, r in runs.items()])
    lines = table.splitlines()
    assert len(lines) == 4
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert (
        "| on | 1 | 0 | 2.50M (131,072) | 1.25M (12,500) | 19 / 100 | 1.20M | 0.96 | 200 | 4 "
        "| 30 (30-30) | 41 | 50 | yes | 3 / 20 | yes | 1 |" in lines[2]
    )
    assert "| off | 2 | 100 | 800k (131,072) | 400k (2,000) | 3 / 100 | 200k | 0.50 |" in lines[3]
    assert "| 400 (400-400) | 512 | 150 | **no** | - / - | - | 1 |" in lines[3]


def test_upsert_section_adds_then_replaces_only_its_section(bench):
    heading = bench.SECTION
    text = "# Results\n\n## A\n\nkeep a\n\n## B\n\nkeep b\n"
    added = bench.upsert_section(text, heading, "first table")
    assert added.startswith(text.rstrip("\n") + "\n\n" + heading + "\n\nfirst table\n")
    # Put a section after it, then replace ours: the others stay as they were.
    added += "\n## C\n\nkeep c\n"
    replaced = bench.upsert_section(added, heading, "second table\n")
    assert "first table" not in replaced
    assert replaced.count(heading) == 1
    for kept in ("## A\n\nkeep a", "## B\n\nkeep b", "## C\n\nkeep c"):
        assert kept in replaced
    assert replaced.index("## B") < replaced.index(heading) < replaced.index("## C")
    assert f"{heading}\n\nsecond table\n\n## C" in replaced
    assert bench.upsert_section("", heading, "t") == f"{heading}\n\nt\n"


def test_arguments_and_blocks(bench):
    args = bench.parse_args([])
    assert args.timeouts == [0, 10, 100]
    assert args.parallelism == [1]
    assert args.runs == 3 and args.marker_ms == 50 and not args.write_results
    plan = bench.blocks(args)
    assert [[(c.timeout_ms, c.chaining, c.parallelism) for c in b] for b in plan] == [
        [(0, True, 1), (10, True, 1), (100, True, 1)],
        [(0, False, 1), (10, False, 1), (100, False, 1)],
    ]
    args = bench.parse_args(["--parallelism", "1", "2", "--chaining", "off", "--timeouts", "5"])
    assert [[(c.timeout_ms, c.chaining, c.parallelism) for c in b] for b in bench.blocks(args)] == [
        [(5, False, 1)],
        [(5, False, 2)],
    ]
    for bad in (["--runs", "0"], ["--timeouts", "-1"], ["--parallelism", "0"], ["--seconds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_maximum_is_measured_again_with_the_latency_runs_batches(bench, monkeypatch):
    # a job whose maximum grows with its batches: 1,000 rows/s per row of a batch
    calls = []

    def job(config, records, storage, marker_ms, rate_per_subtask=None, batch_rows=None):
        rows = batch_rows or 131_072
        calls.append((rate_per_subtask, batch_rows))
        rate = 1_000.0 * rows if rate_per_subtask is None else rate_per_subtask
        return job_outcome(rate, rows)

    def job_outcome(rate, rows):
        return bench._JobOutcome(rate, rows, {"count": 1, "p99_ms": 5.0}, {}, 1)

    monkeypatch.setattr(bench, "run_job", job)
    config = bench.Config(10, False, 1)
    args = bench.parse_args(["--max-at-latency-batches", "2"])
    run = bench.measure(config, 1e6, args, "/unused")
    # 131,072-row batches: 131M rows/s; 10 ms of half of it is 655,360 rows, more than
    # a 1 MiB batch holds: the latency run reads 1 MiB batches too, that maximum stands
    assert calls[0] == (None, None) and len(calls) == 2
    assert run.max_batch_rows == 131_072
    # a job whose maximum is 1M rows/s per row of its batches up to 50 rows, with
    # batches of one row per 1M rows/s: each maximum halves the next batches
    calls.clear()

    def saturating(config, records, storage, marker_ms, rate_per_subtask=None, batch_rows=None):
        rows = batch_rows or 131_072
        calls.append((rate_per_subtask, batch_rows))
        rate = 1e6 * min(rows, 50) if rate_per_subtask is None else rate_per_subtask
        return job_outcome(rate, rows)

    monkeypatch.setattr(bench, "run_job", saturating)
    monkeypatch.setattr(bench, "latency_batch_rows", lambda rate: int(rate // 1e6))
    run = bench.measure(config, 1e6, args, "/unused")
    # 50M with 1 MiB batches -> 25-row batches: 25M -> 12-row batches: 12M (two again)
    assert [c[1] for c in calls] == [None, 25, 12, None]
    assert run.max_batch_rows == 12 and run.max_rate == 12e6
    assert run.target_rate == 6e6 and calls[-1][0] == 6e6
    # without the option the 1 MiB maximum sets the load
    calls.clear()
    run = bench.measure(config, 1e6, bench.parse_args([]), "/unused")
    assert [c[1] for c in calls] == [None, None] and run.max_rate == 50e6


@pytest.fixture(scope="module")
def trace(bench):
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(
            "bench_latency_trace", BENCHMARKS / "latency_trace.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


def _hop(marker: float, write: float, push: float, admit: float, take: float) -> list[dict]:
    return [
        {"ev": "write", "m": marker, "t": write, "pid": 1},
        {"ev": "push", "m": marker, "t": push, "pid": 1},
        {"ev": "admit", "m": marker, "t": admit, "pid": 2},
        {"ev": "take", "m": marker, "t": take, "pid": 2},
    ]


def test_stage_times_sum_each_stage_over_the_hops(trace):
    # Two hops: created at 10.0; buffered 5 ms, 1 ms in flight, 2 ms queued; the next
    # subtask forwards it 1 ms after taking it, then 20 + 3 + 4 ms.
    notes = _hop(10.0, 10.000, 10.005, 10.006, 10.008) + _hop(10.0, 10.009, 10.029, 10.032, 10.036)
    notes.append({"ev": "msg", "t": 10.005, "kind": "bundle", "items": 2, "bytes": 9, "pid": 1})
    stages = trace.stage_times(list(reversed(notes)))  # order of the notes does not matter
    s = stages[10.0]
    assert s["hops"] == 2
    assert s["buffer"] == pytest.approx(0.025)
    assert s["flight"] == pytest.approx(0.004)
    assert s["queue"] == pytest.approx(0.006)
    assert s["operator"] == pytest.approx(0.001)
    assert s["total"] == pytest.approx(0.036)
    # ... and per hop: into the first receiver, then into the second.
    assert s["buffer@1"] == pytest.approx(0.005)
    assert s["flight@1"] == pytest.approx(0.001)
    assert s["queue@1"] == pytest.approx(0.002)
    assert s["operator@0"] == pytest.approx(0.0)
    assert s["operator@1"] == pytest.approx(0.001)
    assert s["buffer@2"] == pytest.approx(0.020)
    assert s["flight@2"] == pytest.approx(0.003)
    assert s["queue@2"] == pytest.approx(0.004)


def test_stage_times_leave_out_markers_that_did_not_arrive(trace):
    arrived = _hop(1.0, 1.0, 1.01, 1.02, 1.03)
    lost = _hop(2.0, 2.0, 2.01, 2.02, 2.03)[:2]  # pushed, never admitted
    assert list(trace.stage_times(arrived + lost)) == [1.0]
    report = trace.report(arrived + lost, target_ms=5.0, source_started=1.0)
    assert "markers traced end to end: 1" in report
    assert "markers above the target (5 ms): 1 of 1" in report
    assert trace.report([], 5.0, None) == "no complete marker trace"


def test_the_traced_channel_write_passes_the_origin_on(trace, monkeypatch, tmp_path):
    """``install_tracing`` wraps ``OutputChannel.write``; a subtask writes
    ``write(item, origin)``: the wrapper must take the origin and pass it on (a wrapper of
    ``write(item)`` alone fails every traced subtask's first write)."""
    import asyncio
    import atexit
    import gc

    from rayflow.runtime import channels, latency
    from rayflow.runtime.events import Bundle, LatencyMarker
    from tests.unit.test_debloat import FakeReceiver

    wrapped = [
        (channels.OutputChannel, ("write", "_push", "send")),
        (channels.InputGate, ("push", "next")),
        (latency.LatencyTracker, ("summary",)),
    ]
    for cls, names in wrapped:  # put back once the test ends
        for name in names:
            monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.setattr(atexit, "register", lambda fn: fn)
    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(tmp_path))
    callbacks = list(gc.callbacks)
    try:
        trace.install_tracing()

        async def go():
            gate = channels.InputGate(1, 8)
            sender = channels.OutputChannel(FakeReceiver(gate), 0, 0, 8, False, 1 << 20)
            await sender.write(LatencyMarker(1.0, "src", 0), 5.0)
            await sender.flush()
            return (await gate.next())[1]

        message = asyncio.new_event_loop().run_until_complete(go())
    finally:
        gc.callbacks[:] = callbacks
    assert isinstance(message, Bundle) and message.origin == 5.0
