"""End-to-end latency at half of the maximum throughput, per buffer timeout.

The workload is the peer workload's vectorized keyed running sum::

    NumberSequenceSource -> map_batches(key = value % 1000) -> key_by("key").sum("value")
    -> a sink that discards

with EXACTLY_ONCE checkpoints every second (local directory storage), operator chaining
as by default (two subtasks per parallel instance: ``numbers -> add-key`` and ``sum ->
discard``, one Ray hop between them) and, as a second block, with
``disable_operator_chaining()`` (four subtasks, a Ray hop between every two operators:
where output buffering matters).

For every buffer timeout (``--timeouts``, default 0, 10 and 100 ms) a *round* is:

1. **maximum throughput**: the job unthrottled (source batches sized by bytes, the
   default), ``rows / steady time``, the steady time being the middle 80% of batch
   arrivals at the sink (10th to 90th percentile), as in ``benchmarks/throughput.py``;
2. **latency at 50% load**: the same job with ``NumberSequenceSource(...,
   records_per_second=0.5 * max / parallelism)`` (the rate is per source subtask) for
   ``--seconds`` (default 12), latency markers every ``--marker-ms`` (default 50 ms).
   Reported: ``JobResult.latency`` p50 / p99 / max over every marker that reached the
   sink end (a marker's age is taken from right after the source emitted the batch
   it follows to the moment the sink-end subtask takes it); the same without the
   markers of the first second (start-up: the *after 1 s* columns, from the sink-end
   subtasks' samples, which are in arrival order); and the achieved rate (the steady
   rate of that run, as above).

Rounds run ``--runs`` times (default 3), interleaved over the timeouts (0, 10, 100, 0,
10, 100, ...), and every figure is the median over the runs. The maximum of a run sizes
the next unthrottled run of the same timeout (``--max-seconds`` worth of rows).

A rate-limited source cuts its batches to 10 ms worth of records (``sources.py``), so the
latency runs move the same rows in more, smaller batches than the unthrottled ones: the
table shows the batch size of each. A job carries less in small batches than in 1 MiB
ones, so half of the 1 MiB maximum may be most of what it carries in the latency run's
batches; ``--max-at-latency-batches N`` measures the maximum again (up to N times) with
the batches the latency run will read, 10 ms worth of half the last maximum, and takes
half of that as the load. The target checked (a reading, never asserted) is
``p99 <= buffer timeout + 50 ms``.

Run from the repository root (each block -- one chaining setting at one parallelism --
takes the lock on its own, a few minutes each)::

    python benchmarks/latency.py --lock /tmp/bench.lock [--parallelism 1 2] \
        [--write-results]

or, for a short run, ``flock /tmp/bench.lock python benchmarks/latency.py ...`` (never
both on the same file). ``--write-results`` puts the table, the command and the load
averages into ``benchmarks/RESULTS.md`` under the section ``SECTION`` (replacing it).
Benchmarks are never timed assertions.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

HERE = Path(__file__).resolve().parent
# This checkout's rayflow unless PYTHONPATH names another (appended: PYTHONPATH wins).
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))

if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_runner import holding, load1, load_text, rayflow_revision, start_ray  # noqa: E402

import rayflow  # noqa: E402
from rayflow import (  # noqa: E402
    NumberSequenceSource,
    Sink,
    SinkContext,
    SinkWriter,
    StreamExecutionEnvironment,
)
from rayflow.config import CheckpointingMode, RestartStrategies  # noqa: E402
from rayflow.guarantees import DeliveryGuarantee  # noqa: E402
from rayflow.sources import batch_rows  # noqa: E402

__all__ = [
    "Config",
    "Run",
    "Summary",
    "steady_rate",
    "source_rate",
    "rows_for",
    "target_p99_ms",
    "percentile",
    "steady_latency",
    "interleaved",
    "summarize",
    "render_table",
    "upsert_section",
    "parse_args",
    "main",
]

SECTION = "## End-to-end latency vs buffer timeout: `benchmarks/latency.py`"
RESULTS_FILE = HERE / "RESULTS.md"
SINK = "discard"
KEYS = 1000
CHECKPOINT_INTERVAL_MS = 1000
LOAD_FRACTION = 0.5
#: the target read off the table: p99 <= buffer timeout + this
TARGET_SLACK_MS = 50.0
STEADY_TRIM = 0.10  # arrivals left out at each end for the steady rate
WARM_UP_ROWS = 2_000_000
#: the first guess of the maximum (rows/s) before anything of a block was measured
FIRST_GUESS_RATE = 2_000_000.0
MIN_ROWS = 200_000
#: markers of the first this many seconds are left out of the *steady* figures
STEADY_SKIP_S = 1.0
#: how the job's subtasks send data (``--transport``)
DATA_TRANSPORT = "socket"


# --- what is run and what it gives ---------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measured setting: buffer timeout, operator chaining and parallelism."""

    timeout_ms: int
    chaining: bool
    parallelism: int

    @property
    def label(self) -> str:
        chaining = "chained" if self.chaining else "unchained"
        return f"timeout {self.timeout_ms} ms, {chaining}, p={self.parallelism}"


@dataclass
class Run:
    """One round of a config: the unthrottled run and the latency run at the target rate."""

    config: Config
    max_rate: float = math.nan  # rows/s, unthrottled, steady
    max_batch_rows: int = 0
    target_rate: float = math.nan  # rows/s over all source subtasks
    batch_rows: int = 0  # rows per source batch in the latency run
    achieved_rate: float = math.nan  # rows/s, steady, latency run
    latency: dict[str, float] = field(default_factory=dict)
    #: the same figures without the markers of the first STEADY_SKIP_S seconds
    steady: dict[str, float] = field(default_factory=dict)
    checkpoints: int = 0
    load: float = math.nan  # 1-minute load average when the latency run started
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.latency.get("count"))


@dataclass(frozen=True)
class Summary:
    """Medians over the runs of one config (NaN where no run succeeded)."""

    config: Config
    runs: int
    failed: int
    max_rate: float
    max_batch_rows: int
    target_rate: float
    batch_rows: int
    achieved_rate: float
    markers: int
    p50_ms: float
    p99_ms: float
    p99_min_ms: float
    p99_max_ms: float
    max_ms: float
    steady_p50_ms: float
    steady_p99_ms: float
    checkpoints: float
    load: float

    @property
    def target_ms(self) -> float:
        return target_p99_ms(self.config.timeout_ms)

    @property
    def batches_per_s(self) -> tuple[float, float]:
        """Batches a second of one source subtask in the unthrottled run and in the latency
        run (at timeout 0 each is a Ray call on every hop)."""
        p = self.config.parallelism
        return (
            self.max_rate / (p * self.max_batch_rows) if self.max_batch_rows else math.nan,
            self.target_rate / (p * self.batch_rows) if self.batch_rows else math.nan,
        )

    @property
    def met(self) -> bool | None:
        """Whether the median p99 is within the target (None without a measurement)."""
        return None if math.isnan(self.p99_ms) else self.p99_ms <= self.target_ms

    @property
    def steady_met(self) -> bool | None:
        """The same for the steady p99 (the first seconds' markers left out)."""
        return None if math.isnan(self.steady_p99_ms) else self.steady_p99_ms <= self.target_ms


# --- pure arithmetic -------------------------------------------------------------------------


def steady_rate(arrival_times: Sequence[float], rows: int) -> float:
    """Input rows per second over the middle 80% of batch arrivals at the sink(s).

    ``arrival_times`` are the ``time.time()`` of every batch the sink(s) got, each standing
    for an equal share of the ``rows`` of input. NaN with fewer than two arrivals."""
    times = sorted(arrival_times)
    n = len(times)
    if n < 2:
        return math.nan
    lo = int(n * STEADY_TRIM)
    hi = n - 1 - lo
    if times[hi] <= times[lo]:
        lo, hi = 0, n - 1
        if times[hi] <= times[lo]:
            return math.nan
    return rows * (hi - lo) / n / (times[hi] - times[lo])


def source_rate(max_rate: float, parallelism: int, fraction: float = LOAD_FRACTION) -> float:
    """``records_per_second`` of each source subtask for ``fraction`` of ``max_rate``
    (rows/s of the whole job): the source's rate limit is per subtask."""
    if not max_rate > 0 or parallelism < 1:
        raise ValueError(
            f"source_rate: need max_rate > 0 and parallelism >= 1, got "
            f"{max_rate!r}, {parallelism!r}"
        )
    return fraction * max_rate / parallelism


def latency_batch_rows(rate_per_subtask: float) -> int:
    """Rows per batch of a source of int64 values limited to ``rate_per_subtask``."""
    return batch_rows(8, None, rate_per_subtask)


def rows_for(rate: float, seconds: float, minimum: int = MIN_ROWS) -> int:
    """Rows that take ``seconds`` at ``rate`` rows/s, at least ``minimum`` (and
    ``minimum`` when the rate is unknown)."""
    if not rate > 0 or math.isinf(rate):
        return minimum
    return max(minimum, int(rate * seconds))


def target_p99_ms(timeout_ms: float, slack_ms: float = TARGET_SLACK_MS) -> float:
    """The p99 latency aimed at for a buffer timeout: the timeout plus ``slack_ms``."""
    return timeout_ms + slack_ms


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated as ``LatencyTracker`` does;
    NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def steady_latency(
    summaries: Sequence[dict[str, Any]], markers_per_s: float, skip_s: float = STEADY_SKIP_S
) -> dict[str, float]:
    """p50/p99/max (ms) of the markers that reached the sink end after the first ``skip_s``
    seconds, from each sink-end subtask's latency ``summary()`` (its ``samples_ms`` are in
    arrival order while it kept every marker). ``markers_per_s`` is how many markers one
    sink-end subtask gets a second; that many times ``skip_s`` are left out of each. Empty
    when a subtask's sample is a reservoir (order lost) or nothing is left."""
    skip = round(markers_per_s * skip_s)
    kept: list[float] = []
    for summary in summaries:
        samples = list(summary.get("samples_ms", ()))
        if len(samples) < summary.get("count", 0):
            return {}
        kept.extend(samples[skip:])
    if not kept:
        return {}
    return {
        "count": len(kept),
        "p50_ms": percentile(kept, 50.0),
        "p99_ms": percentile(kept, 99.0),
        "max_ms": max(kept),
    }


def interleaved(configs: Sequence[Config], runs: int) -> list[tuple[int, Config]]:
    """``(round, config)`` in the order they run: every config once per round."""
    return [(r, c) for r in range(runs) for c in configs]


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarize(config: Config, runs: Sequence[Run]) -> Summary:
    """Medians over the successful ``runs`` of ``config``."""
    good = [r for r in runs if r.ok]
    p99s = [r.latency["p99_ms"] for r in good]
    return Summary(
        config=config,
        runs=len(good),
        failed=len(runs) - len(good),
        max_rate=_median([r.max_rate for r in good]),
        max_batch_rows=int(_median([r.max_batch_rows for r in good]) or 0) if good else 0,
        target_rate=_median([r.target_rate for r in good]),
        batch_rows=int(_median([r.batch_rows for r in good])) if good else 0,
        achieved_rate=_median([r.achieved_rate for r in good]),
        markers=int(_median([r.latency["count"] for r in good])) if good else 0,
        p50_ms=_median([r.latency["p50_ms"] for r in good]),
        p99_ms=_median(p99s),
        p99_min_ms=min(p99s) if p99s else math.nan,
        p99_max_ms=max(p99s) if p99s else math.nan,
        max_ms=_median([r.latency["max_ms"] for r in good]),
        steady_p50_ms=_median([r.steady.get("p50_ms", math.nan) for r in good]),
        steady_p99_ms=_median([r.steady.get("p99_ms", math.nan) for r in good]),
        checkpoints=_median([float(r.checkpoints) for r in good]),
        load=_median([r.load for r in runs]),
    )


def _rate(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def render_table(summaries: Sequence[Summary]) -> str:
    """The markdown table of ``summaries`` (one row each, in order)."""
    lines = [
        "| chaining | p | buffer timeout ms | max rows/s (batch rows) | target rows/s "
        "(batch rows) | source batches/s: max / target | achieved rows/s | achieved / target "
        "| markers | p50 ms "
        "| p99 ms (min-max) | max ms | p99 target ms | p99 met | after 1 s: p50 / p99 ms "
        "| after 1 s: p99 met | runs | load 1 min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for s in summaries:
        c = s.config
        ratio = (
            "-"
            if math.isnan(s.achieved_rate) or math.isnan(s.target_rate)
            else f"{s.achieved_rate / s.target_rate:.2f}"
        )
        verdict = {None: "-", True: "yes", False: "**no**"}
        met, steady_met = verdict[s.met], verdict[s.steady_met]
        steady = f"{_ms(s.steady_p50_ms)} / {_ms(s.steady_p99_ms)}"
        runs = f"{s.runs}" + (f" (+{s.failed} failed)" if s.failed else "")
        p99 = (
            "-"
            if math.isnan(s.p99_ms)
            else f"{_ms(s.p99_ms)} ({_ms(s.p99_min_ms)}-{_ms(s.p99_max_ms)})"
        )
        lines.append(
            f"| {'on' if c.chaining else 'off'} | {c.parallelism} | {c.timeout_ms} "
            f"| {_rate(s.max_rate)} ({s.max_batch_rows:,}) "
            f"| {_rate(s.target_rate)} ({s.batch_rows:,}) "
            f"| {_ms(s.batches_per_s[0])} / {_ms(s.batches_per_s[1])} | {_rate(s.achieved_rate)} "
            f"| {ratio} | {s.markers} | {_ms(s.p50_ms)} | {p99} | {_ms(s.max_ms)} "
            f"| {_ms(s.target_ms)} | {met} | {steady} | {steady_met} | {runs} | "
            f"{'-' if math.isnan(s.load) else f'{s.load:.1f}'} |"
        )
    return "\n".join(lines)


def upsert_section(text: str, heading: str, body: str) -> str:
    """``text`` (RESULTS.md) with the ``heading`` section (a ``## `` line up to the next
    ``## `` heading) set to ``body``; added at the end when missing."""
    block = f"{heading}\n\n{body.strip()}\n"
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        head = text.rstrip("\n")
        return (head + "\n\n" if head else "") + block
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    before = "\n".join(lines[:start]).rstrip("\n")
    after = "\n".join(lines[end:]).rstrip("\n")
    return (before + "\n\n" if before else "") + block + ("\n" + after + "\n" if after else "")


# --- the engine ------------------------------------------------------------------------------


def _add_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pc.remainder(batch.column("value"), KEYS))


class _ArrivalWriter(SinkWriter):
    def __init__(self) -> None:
        self.times: list[float] = []

    def write(self, batch: pa.RecordBatch) -> None:
        self.times.append(time.time())

    def finish(self) -> dict[str, Any]:
        import rayflow  # which rayflow this worker runs (it must be the driver's)

        return {"times": self.times, "rayflow": rayflow.__file__}


class ArrivalSink(Sink):
    """Discards every batch; its result is when each batch came (and which rayflow ran)."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _ArrivalWriter()

    def merge_results(self, results: list[Any]) -> dict[str, Any]:
        return {
            "times": [t for r in results if r for t in r["times"]],
            "rayflow": sorted({r["rayflow"] for r in results if r}),
        }


@dataclass
class _JobOutcome:
    rate: float
    batch_rows: int
    latency: dict[str, float]
    steady: dict[str, float]
    checkpoints: int


def run_job(
    config: Config,
    records: int,
    storage: str,
    marker_ms: int,
    rate_per_subtask: float | None = None,
    batch_rows: int | None = None,
    configure: Callable[[StreamExecutionEnvironment], Any] | None = None,
) -> _JobOutcome:
    """Run the keyed running sum once (source batches of ``batch_rows``, else sized as by
    default; ``configure`` may change the environment further); raise when it did not
    process every record or its workers ran another rayflow than this driver."""
    env = StreamExecutionEnvironment()
    env.set_parallelism(config.parallelism)
    env.set_restart_strategy(RestartStrategies.no_restart())  # a restart would skew numbers
    env.enable_checkpointing(CHECKPOINT_INTERVAL_MS, CheckpointingMode.EXACTLY_ONCE)
    env.get_checkpoint_config().set_checkpoint_storage(storage)
    env.set_buffer_timeout(config.timeout_ms)
    env.set_data_transport(DATA_TRANSPORT)
    env.set_latency_tracking_interval(marker_ms)
    if not config.chaining:
        env.disable_operator_chaining()
    if configure is not None:
        configure(env)
    source = NumberSequenceSource(
        0, records - 1, batch_size=batch_rows, records_per_second=rate_per_subtask
    )
    (
        env.from_source(source, "numbers")
        .map_batches(_add_key, "add-key")
        .key_by("key")
        .sum("value", "sum")
        .sink_to(ArrivalSink(DeliveryGuarantee.NONE), SINK)
    )
    throttled = "max" if rate_per_subtask is None else "lat"
    name = f"latency-{throttled}-t{config.timeout_ms}-c{int(config.chaining)}-p{config.parallelism}"
    result = env.execute(f"{name}-{time.time_ns()}")
    out = result.sink_result(SINK)
    ran = [os.path.realpath(f) for f in out["rayflow"]]
    if ran != [os.path.realpath(rayflow.__file__)]:
        raise RuntimeError(f"workers ran rayflow {out['rayflow']}, the driver {rayflow.__file__}")
    summed = result.records_in("sum")
    if summed != records:
        raise RuntimeError(f"{summed} records reached the sum, expected {records}")
    sink_end = [m["latency"] for m in result.metrics if m.get("latency", {}).get("count")]
    return _JobOutcome(
        rate=steady_rate(out["times"], records),
        batch_rows=source.batch_size,
        latency=dict(result.latency),
        steady=steady_latency(
            sink_end, config.parallelism * 1000.0 / marker_ms / max(1, len(sink_end))
        ),
        checkpoints=int(result.checkpoint_summary.get("counts", {}).get("COMPLETED", 0)),
    )


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def measure(
    config: Config,
    estimate: float,
    args: argparse.Namespace,
    storage: str,
) -> Run:
    """One round of ``config``: the unthrottled run (``estimate`` rows/s sizes it), then
    the latency run at ``LOAD_FRACTION`` of the maximum it measured."""
    run = Run(config)
    try:
        rows = rows_for(estimate, args.max_seconds)
        peak = run_job(config, rows, storage, args.marker_ms)
        if not peak.rate > 0:
            raise RuntimeError(f"no steady rate from {rows:,} rows")
        per_subtask = source_rate(peak.rate, config.parallelism)
        for _ in range(args.max_at_latency_batches):
            # the maximum with the batches the latency run's source reads (10 ms worth
            # of its rate): half of that is the load, and sets the batches in turn
            batch = latency_batch_rows(per_subtask)
            if batch >= peak.batch_rows:
                break
            peak = run_job(
                config,
                rows_for(peak.rate, args.max_seconds),
                storage,
                args.marker_ms,
                batch_rows=batch,
            )
            if not peak.rate > 0:
                raise RuntimeError(f"no steady rate with {batch:,}-row batches")
            per_subtask = source_rate(peak.rate, config.parallelism)
        run.max_rate, run.max_batch_rows = peak.rate, peak.batch_rows
        run.target_rate = per_subtask * config.parallelism
        run.load = load1()
        outcome = run_job(
            config,
            rows_for(run.target_rate, args.seconds),
            storage,
            args.marker_ms,
            per_subtask,
        )
    except Exception as exc:  # one failed run must not lose the others
        run.error = _one_line(exc)
        return run
    run.batch_rows = outcome.batch_rows
    run.achieved_rate = outcome.rate
    run.latency = outcome.latency
    run.steady = outcome.steady
    run.checkpoints = outcome.checkpoints
    return run


def _describe(run: Run) -> str:
    if run.error:
        return f"FAILED: {run.error}"
    lat = run.latency
    return (
        f"max {_rate(run.max_rate)} rows/s ({run.max_batch_rows:,}-row batches); "
        f"target {_rate(run.target_rate)} ({run.batch_rows:,}-row batches), achieved "
        f"{_rate(run.achieved_rate)}; {lat.get('count', 0)} markers p50 "
        f"{lat.get('p50_ms', math.nan):.1f} p99 {lat.get('p99_ms', math.nan):.1f} "
        f"max {lat.get('max_ms', math.nan):.1f} ms (after 1 s: p50 "
        f"{run.steady.get('p50_ms', math.nan):.1f} p99 {run.steady.get('p99_ms', math.nan):.1f}"
        f"); {run.checkpoints} checkpoints; "
        f"load {run.load:.1f}"
    )


INTRO = """\
Keyed running sum (the peer workload, vectorized): `NumberSequenceSource` ->
`map_batches(key = value % 1000)` -> `key_by("key").sum("value")` -> a discarding sink,
EXACTLY_ONCE checkpoints every 1 s. Per buffer timeout, each run first measures the
maximum throughput (unthrottled; rows over the middle 80% of batch arrivals at the sink),
then runs the job for a fixed time with the source limited to half of it
(`records_per_second`, per source subtask) and latency markers every few tens of ms;
p50/p99/max are `JobResult.latency` over every marker that reached the sink end; *after 1 s*
the same without the markers of the first second (start-up). Runs are interleaved over the
timeouts; medians of the runs (p99's range in brackets). A rate-limited source cuts batches
of 10 ms worth of records, the unthrottled one of 1 MiB: *batch rows* shows both, *source
batches/s* how many batches a second one source subtask sends in each (at timeout 0 every
batch is a Ray call on every hop). *Chaining on* is two subtasks per parallel instance
(one Ray hop, the keyed exchange), *off* four (a Ray hop between every two operators).
Target read off the table: p99 <= buffer timeout + 50 ms."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="End-to-end latency p50/p99 at half of the maximum throughput, per "
        "buffer timeout"
    )
    parser.add_argument(
        "--timeouts", type=int, nargs="+", default=[0, 10, 100], help="buffer timeouts (ms)"
    )
    parser.add_argument(
        "--parallelism", type=int, nargs="+", default=[1], help="parallelisms (default 1)"
    )
    parser.add_argument(
        "--chaining",
        choices=("both", "on", "off"),
        default="both",
        help="operator chaining as by default (on), disabled (off), or both (default)",
    )
    parser.add_argument("--runs", type=int, default=3, help="rounds per config (median)")
    parser.add_argument(
        "--seconds", type=float, default=12.0, help="length of each latency run (s)"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=3.0,
        help="length of each unthrottled run, at the last measured maximum (s)",
    )
    parser.add_argument("--marker-ms", type=int, default=50, help="latency marker interval (ms)")
    parser.add_argument(
        "--max-at-latency-batches",
        type=int,
        default=0,
        metavar="N",
        help="measure the maximum again, up to N times, with the source batches the latency "
        "run reads (10 ms worth of half the last maximum) instead of 1 MiB ones: smaller "
        "batches carry less, so half of that maximum is the load (default 0: the maximum "
        "with 1 MiB batches)",
    )
    parser.add_argument(
        "--lock",
        default=None,
        help="take this lock file around each block (one chaining setting at one "
        "parallelism); do not also wrap the run in flock on the same file",
    )
    parser.add_argument(
        "--transport",
        choices=["socket", "ray"],
        default="socket",
        help="how subtasks send data (set_data_transport; default socket)",
    )
    parser.add_argument(
        "--write-results",
        action="store_true",
        help=f"put the table into {RESULTS_FILE.name} under '{SECTION}'",
    )
    parser.add_argument("--results-file", default=str(RESULTS_FILE), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.seconds <= 0 or args.max_seconds <= 0 or args.marker_ms < 1:
        parser.error("--runs, --seconds, --max-seconds and --marker-ms must be positive")
    if any(t < 0 for t in args.timeouts) or any(p < 1 for p in args.parallelism):
        parser.error("timeouts must be >= 0 and parallelisms >= 1")
    if args.lock:
        args.lock = os.path.abspath(args.lock)
    return args


def blocks(args: argparse.Namespace) -> list[list[Config]]:
    """The configs of each block (one chaining setting at one parallelism), in order."""
    chainings = {"both": (True, False), "on": (True,), "off": (False,)}[args.chaining]
    return [
        [Config(t, chaining, p) for t in args.timeouts]
        for p in args.parallelism
        for chaining in chainings
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    global DATA_TRANSPORT
    DATA_TRANSPORT = args.transport
    command = "python " + shlex.join(sys.argv if argv is None else ["benchmarks/latency.py", *argv])

    def progress(line: str) -> None:
        print(line, flush=True)

    machine = (
        f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), Python "
        f"{platform.python_version()}, Ray {ray.__version__}, pyarrow {pa.__version__}, "
        f"rayflow {rayflow_revision(Path(rayflow.__file__).resolve().parent, short=True)}"
    )
    load_start = load_text()
    progress(f"command: {command}")
    progress(f"machine: {machine}")
    progress(f"load average at start (1/5/15 min): {load_start}")

    # Ray puts the driver's working directory first on its workers' sys.path: work from
    # the directory holding the rayflow this driver imported, so that workers import it.
    os.chdir(Path(rayflow.__file__).resolve().parents[1])
    start_ray()
    storage = tempfile.mkdtemp(prefix="rayflow-bench-latency-")
    plan = blocks(args)
    results: dict[Config, list[Run]] = {c: [] for block in plan for c in block}
    block_loads: list[str] = []
    started = time.perf_counter()
    try:
        for block in plan:
            with holding(args.lock, progress):
                first = block[0]
                progress(
                    f"== {'chained' if first.chaining else 'unchained'}, "
                    f"p={first.parallelism} (load {load_text()})"
                )
                # Warm-up (worker start-up, imports) and the first estimate of the maximum.
                try:
                    warm = run_job(first, WARM_UP_ROWS, storage, args.marker_ms)
                    guess = warm.rate if warm.rate > 0 else FIRST_GUESS_RATE
                    progress(f"warm-up: {_rate(warm.rate)} rows/s")
                except Exception as exc:
                    guess = FIRST_GUESS_RATE
                    progress(f"warm-up FAILED: {_one_line(exc)}")
                estimates = {c: guess for c in block}
                order = interleaved(block, args.runs)
                for i, (_, config) in enumerate(order, 1):
                    run = measure(config, estimates[config], args, storage)
                    if run.max_rate > 0:
                        estimates[config] = run.max_rate
                    results[config].append(run)
                    progress(f"[{i}/{len(order)}] {config.label}: {_describe(run)}")
                block_loads.append(
                    f"{'chained' if first.chaining else 'unchained'} p={first.parallelism}: "
                    f"{load_text()}"
                )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    total = time.perf_counter() - started

    summaries = [summarize(c, results[c]) for block in plan for c in block]
    table = render_table(summaries)
    notes = [
        f"Command: `{command}`",
        f"Machine: {machine}.",
        f"Runs per config: {args.runs} (median), interleaved over the timeouts; latency "
        f"runs of {args.seconds:g} s, markers every {args.marker_ms} ms; unthrottled runs "
        f"of about {args.max_seconds:g} s; checkpoints every {CHECKPOINT_INTERVAL_MS} ms; "
        + (
            f"the maximum measured again (up to {args.max_at_latency_batches} times) with "
            "the latency run's source batches."
            if args.max_at_latency_batches
            else "the maximum measured with 1 MiB source batches."
        ),
        f"Load average (1/5/15 min) at start {load_start}; at the end of each block "
        + "; ".join(block_loads)
        + f"; total {total:.0f} s.",
    ]
    print()
    print("\n\n".join(notes))
    print()
    print(table)
    failed = [s.config.label for s in summaries if s.failed]
    if failed:
        print("\n!!! FAILED RUNS: " + "; ".join(failed) + " !!!")
    if args.write_results:
        path = Path(args.results_file)
        text = path.read_text() if path.exists() else ""
        body = INTRO + "\n\n" + "\n\n".join(notes) + "\n\n" + table
        path.write_text(upsert_section(text, SECTION, body))
        print(f"\nwritten to {path} under '{SECTION}'")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
