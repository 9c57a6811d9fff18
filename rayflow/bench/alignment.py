"""What barrier alignment costs: every checkpointing mode, balanced and under backpressure.

This module owns the alignment benchmark: its job, its sweeps, its measurements and
its outputs (CSV, PNG plots, a markdown summary). ``rayflow bench alignment`` and
``python benchmarks/alignment.py`` both run :func:`main`.

The job, for every configuration::

    NumberSequenceSource -> map_batches(with_key)      key = value % 1000; under skew a
                                                       share of rows gets the hot key 0
      -> key_by(key).map_batches(hot_key_cost)        sleeps per hot-key row: under skew the
                                                       subtask that owns key 0 is the
                                                       bottleneck (real backpressure)
      -> key_by(key).sum(value) -> timing sink        keyed state; the sink notes arrivals

Checkpointing modes (``MODES``): ``off``; ``at-least-once`` (barriers not aligned);
``aligned`` (EXACTLY_ONCE); ``aligned+debloat`` (aligned, adaptive in-flight data);
``unaligned`` (EXACTLY_ONCE, barriers overtake in-flight data, which is stored as
channel state); ``aligned-timeout`` (aligned, switching to unaligned once alignment
takes longer than a timeout). Workloads: ``balanced`` (no cost per key) and ``skew``.

Sweeps (not the full cross product; a configuration in several sweeps runs once):

* A: every mode x {balanced, skew}, 1 s interval, parallelism 2
* B: every mode x intervals {0.2, 1, 5} s, balanced, parallelism 2
* C: every mode x parallelism {1, 2, 4}, skew, 1 s interval
* throughput check: off vs aligned, balanced, 1 s, parallelism 2, at least 5 runs

``--quick`` (under 2 minutes on 2 cores): every mode under skew, 1 s, parallelism 2,
fewer rows and a cheaper hot key, one run each, no warm-up, no throughput check.

Configurations run interleaved, ``repeat`` rounds (so drift on a shared machine hits
each alike), after a warm-up job. Per configuration: the median steady throughput (the
middle 80% of batch arrivals at the sink, as in ``benchmarks/checkpointing.py``) and its
ratio to ``off`` at the same workload and parallelism; p50/p99 of checkpoint duration
and of per-subtask alignment time over the completed, non-final checkpoints; the
median checkpoint size split into operator state and channel state; and the median
over runs of the end-to-end latency p50/p99 from latency markers.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from rayflow.argtypes import float_at_least, int_at_least
from rayflow.config import CheckpointingMode, RestartStrategies
from rayflow.environment import JobResult, StreamExecutionEnvironment
from rayflow.guarantees import DeliveryGuarantee
from rayflow.runtime.debloat import MIN_TARGET_MS
from rayflow.sink import Sink, SinkContext, SinkWriter
from rayflow.sources import NumberSequenceSource
from rayflow.status import CheckpointStatus

__all__ = [
    "MODES",
    "WORKLOADS",
    "PRESETS",
    "Config",
    "Settings",
    "Measurement",
    "sweeps",
    "with_key",
    "hot_key_cost",
    "TimingSink",
    "build_job",
    "execute_collecting",
    "measure",
    "run_benchmark",
    "summarize",
    "write_csv",
    "write_plots",
    "write_summary",
    "add_arguments",
    "settings_from",
    "run",
    "main",
]

MODES = ("off", "at-least-once", "aligned", "aligned+debloat", "unaligned", "aligned-timeout")
WORKLOADS = ("balanced", "skew")
KEYS = 1000
HOT_KEY = 0
DEFAULT_OUT = os.path.join("benchmarks", "results", "alignment")
POLL_S = 0.5  # how often checkpoint statistics are read from a running job


@dataclass(frozen=True)
class Config:
    """One benchmark configuration; ``interval_s`` is 0 when checkpointing is off."""

    mode: str
    workload: str
    interval_s: float
    parallelism: int

    @staticmethod
    def of(mode: str, workload: str, interval_s: float, parallelism: int) -> Config:
        return Config(mode, workload, 0.0 if mode == "off" else interval_s, parallelism)

    @property
    def label(self) -> str:
        interval = f" {self.interval_s:g}s" if self.interval_s else ""
        return f"{self.workload} {self.mode} p={self.parallelism}{interval}"


@dataclass(frozen=True)
class Settings:
    """Sizes and knobs shared by every configuration of one run."""

    preset: str = "full"
    rows: int = 6_000_000  # balanced job at a 1 s interval; x interval_s for longer ones
    skew_rows: int = 1_200_000  # skewed job at parallelism 2 (x parallelism / 2)
    batch_size: int = 10_000
    hot_share: float = 0.2  # share of rows with the hot key under skew
    hot_cost_us: float = 50.0  # sleep per hot-key row under skew
    repeat: int = 1  # interleaved rounds over every configuration
    check_runs: int = 5  # runs of each throughput-check configuration (at least)
    latency_interval_ms: int = 200
    aligned_timeout_ms: int = 100
    debloat_target_ms: int = 1000
    warm_up: bool = True
    checkpoint_dir: str = ""  # set by run_benchmark


#: Per preset, what differs from ``Settings``' defaults (``--quick`` is ``quick``; the
#: unit test runs ``smoke``).
PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    "quick": {"skew_rows": 800_000, "hot_cost_us": 25.0, "warm_up": False},
    "smoke": {
        "rows": 300_000,
        "skew_rows": 600_000,
        "hot_cost_us": 10.0,
        "check_runs": 1,
        "warm_up": False,
    },
}

CHECK = (Config.of("off", "balanced", 1.0, 2), Config.of("aligned", "balanced", 1.0, 2))


def _all_configs(preset: str) -> list[Config]:
    return list(dict.fromkeys(c for group in sweeps(preset).values() for c in group))


def sweeps(preset: str) -> dict[str, list[Config]]:
    """The configurations of every sweep of ``preset``, by sweep name."""
    if preset == "smoke":
        return {"smoke": [Config.of(m, "skew", 0.2, 2) for m in ("off", "unaligned")]}
    found = {
        "A": [Config.of(m, w, 1.0, 2) for w in WORKLOADS for m in MODES],
        "B": [Config.of(m, "balanced", i, 2) for i in (0.2, 1.0, 5.0) for m in MODES],
        "C": [Config.of(m, "skew", 1.0, p) for p in (1, 2, 4) for m in MODES],
    }
    if preset == "quick":  # the modes under skew
        found = {"quick": [Config.of(m, "skew", 1.0, 2) for m in MODES]}
    return {name: list(dict.fromkeys(configs)) for name, configs in found.items()}


# --- the job ------------------------------------------------------------------------------


def with_key(batch: pa.RecordBatch, hot_share: float) -> pa.RecordBatch:
    """Add ``key`` = value % 1000; the first ``hot_share`` of every 100 values get key 0."""
    values = batch.column("value").to_numpy()
    keys = values % KEYS
    if hot_share:
        keys = np.where(values % 100 < round(hot_share * 100), HOT_KEY, keys)
    return batch.append_column("key", pa.array(keys))


def hot_key_cost(batch: pa.RecordBatch, cost_s: float) -> pa.RecordBatch:
    """Sleep ``cost_s`` per row with the hot key (the skewed operator's extra work)."""
    if cost_s:
        hot = pc.sum(pc.equal(batch.column("key"), HOT_KEY)).as_py() or 0
        if hot:
            time.sleep(hot * cost_s)
    return batch


class _TimingWriter(SinkWriter):
    def __init__(self) -> None:
        self.arrivals: list[float] = []

    def write(self, batch: pa.RecordBatch) -> None:
        self.arrivals.append(time.time())

    def finish(self) -> list[float]:
        return self.arrivals


class TimingSink(Sink):
    """Discards rows, remembers when each batch arrived."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _TimingWriter()

    def merge_results(self, results: list[Any]) -> list[float]:
        return sorted(t for r in results if r for t in r)


def rows_of(config: Config, settings: Settings) -> int:
    """Input rows of a configuration: longer intervals get longer jobs, and skewed ones
    grow with parallelism, as the data in flight to the slow subtask does (each source
    subtask fills its channel to it): the input must be several times that, or the
    sources finish, and checkpoints stop, long before the sink has caught up."""
    if config.workload == "balanced":
        rows = settings.rows
    else:
        rows = settings.skew_rows * config.parallelism / 2
    return int(rows * max(1.0, config.interval_s))


def build_job(config: Config, settings: Settings) -> StreamExecutionEnvironment:
    """The environment of one configuration, its pipeline built (sink named ``timing``)."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(config.parallelism)
    env.set_restart_strategy(RestartStrategies.no_restart())  # a restart would skew numbers
    env.set_latency_tracking_interval(settings.latency_interval_ms)
    if config.mode != "off":
        mode = (
            CheckpointingMode.AT_LEAST_ONCE
            if config.mode == "at-least-once"
            else CheckpointingMode.EXACTLY_ONCE
        )
        env.enable_checkpointing(round(config.interval_s * 1000), mode)
        checkpoints = env.get_checkpoint_config()
        checkpoints.set_checkpoint_storage(settings.checkpoint_dir)
        if config.mode == "unaligned":
            checkpoints.enable_unaligned_checkpoints()
        elif config.mode == "aligned-timeout":
            checkpoints.set_aligned_checkpoint_timeout(settings.aligned_timeout_ms)
        elif config.mode == "aligned+debloat":
            env.enable_buffer_debloating(target_ms=settings.debloat_target_ms)
    skew = config.workload == "skew"
    cost_s = settings.hot_cost_us / 1e6 if skew else 0.0
    (
        env.from_source(
            NumberSequenceSource(0, rows_of(config, settings) - 1, batch_size=settings.batch_size),
            "numbers",
        )
        .map_batches(
            functools.partial(with_key, hot_share=settings.hot_share if skew else 0.0),
            name="with-key",
        )
        .key_by("key")
        .map_batches(functools.partial(hot_key_cost, cost_s=cost_s), name="hot-key-cost")
        .key_by("key")
        .sum("value", name="sum")
        .sink_to(TimingSink(DeliveryGuarantee.NONE), name="timing")
    )
    return env


# --- measuring ----------------------------------------------------------------------------


@dataclass
class Measurement:
    """What one run of one configuration gave (``error`` set when it failed)."""

    config: Config
    rate: float = math.nan
    wall_s: float = math.nan
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    latency: dict[str, Any] = field(default_factory=dict)
    latency_samples_ms: list[float] = field(default_factory=list)
    #: completed checkpoints whose statistics the polling missed (0 unless it lagged)
    missed_checkpoints: int = 0
    error: str = ""


def steady_rate(arrivals: list[float], rows: int) -> float:
    """Input rows per second over the middle 80% of batch arrivals at the sink."""
    if len(arrivals) < 2:
        return math.nan
    lo, hi = np.percentile(arrivals, 10), np.percentile(arrivals, 90)
    return 0.8 * rows / (hi - lo) if hi > lo else math.nan


def execute_collecting(
    env: StreamExecutionEnvironment, job_name: str, poll_s: float = POLL_S
) -> tuple[JobResult, list[dict[str, Any]]]:
    """Run the job; return its result and every completed checkpoint it took, in order.

    ``JobResult.checkpoints`` keeps only the last 10, so the job master's recent
    checkpoints are read every ``poll_s`` while the job runs."""
    client = env.execute_async(job_name)
    seen: dict[int, dict[str, Any]] = {}
    while True:
        try:
            result = client.wait(timeout=poll_s)
            break
        except TimeoutError:
            try:
                recent = client.checkpoints()
            except ray.exceptions.RayError:  # the job master ending: the result has the rest
                continue
            seen.update((c["checkpoint_id"], c) for c in recent if c["status"] == "COMPLETED")
    seen.update((c["checkpoint_id"], c) for c in result.completed_checkpoints)
    return result, [seen[i] for i in sorted(seen)]


def measure(config: Config, settings: Settings) -> Measurement:
    """Run one configuration once; an exception becomes ``Measurement.error``."""
    started = time.perf_counter()
    try:
        env = build_job(config, settings)
        slug = config.label.replace(" ", "-").replace("=", "").replace("+", "-")
        result, checkpoints = execute_collecting(env, f"bench-alignment-{slug}-{time.time_ns()}")
    except Exception as exc:  # one failed configuration must not lose the others
        return Measurement(config, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    completed = result.checkpoint_summary["counts"][CheckpointStatus.COMPLETED.value]
    return Measurement(
        config,
        rate=steady_rate(result.sink_result("timing"), rows_of(config, settings)),
        wall_s=time.perf_counter() - started,
        checkpoints=[c for c in checkpoints if not c["final"]],
        latency=result.latency,
        latency_samples_ms=list(result.latency_samples_ms),
        missed_checkpoints=completed - len(checkpoints),
    )


def _rounds(configs: list[Config], settings: Settings) -> list[Config]:
    """Every job to run, in order: ``repeat`` rounds, then more runs of the check pair."""
    order = configs * settings.repeat
    extra = max(0, settings.check_runs - settings.repeat)
    return order + [c for _ in range(extra) for c in CHECK if c in configs]


def run_benchmark(
    settings: Settings, progress: Callable[[str], None] = print
) -> dict[Config, list[Measurement]]:
    """Run every configuration of ``settings.preset``, interleaved; Ray must be up."""
    configs = _all_configs(settings.preset)
    order = _rounds(configs, settings)
    results: dict[Config, list[Measurement]] = {c: [] for c in configs}
    storage = tempfile.mkdtemp(prefix="rayflow-bench-alignment-")
    settings = replace(settings, checkpoint_dir=storage)
    try:
        if settings.warm_up:
            measure(Config.of("aligned", "balanced", 1.0, 2), replace(settings, rows=200_000))
        for i, config in enumerate(order, 1):
            m = measure(config, settings)
            results[config].append(m)
            done = (
                f"FAILED: {m.error}"
                if m.error
                else f"{_rate(m.rate)} rows/s ({len(m.checkpoints)} checkpoints, {m.wall_s:.1f} s)"
            )
            if m.missed_checkpoints:
                done += f"; statistics of {m.missed_checkpoints} checkpoints missed"
            progress(f"[{i}/{len(order)}] {config.label} ... {done}")
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return results


# --- summarizing --------------------------------------------------------------------------


def _pct(values: Iterable[float], q: float) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.percentile(values, q)) if values else math.nan


def _median(values: Iterable[float]) -> float:
    return _pct(values, 50)


def _latency(runs: list[Measurement], key: str) -> float:
    return _median(math.nan if m.latency.get(key) is None else m.latency[key] for m in runs)


def summarize(results: dict[Config, list[Measurement]]) -> list[dict[str, Any]]:
    """One row per configuration (the CSV's rows), in run order."""
    rows = []
    for config, runs in results.items():
        ok = [m for m in runs if not m.error]
        checkpoints = [c for m in ok for c in m.checkpoints]
        subtasks = [s for c in checkpoints for s in c["subtasks"].values()]
        rates = [m.rate for m in ok if not math.isnan(m.rate)]
        rows.append(
            {
                "workload": config.workload,
                "mode": config.mode,
                "parallelism": config.parallelism,
                "interval_s": config.interval_s,
                "runs": len(ok),
                "rows_per_s": _median(rates),
                "rows_per_s_min": min(rates, default=math.nan),
                "rows_per_s_max": max(rates, default=math.nan),
                "vs_off": math.nan,
                "checkpoints": len(checkpoints),
                "checkpoints_missed": sum(m.missed_checkpoints for m in ok),
                "unaligned_checkpoints": sum(bool(c["unaligned"]) for c in checkpoints),
                "checkpoint_p50_ms": _pct((c["duration_s"] * 1e3 for c in checkpoints), 50),
                "checkpoint_p99_ms": _pct((c["duration_s"] * 1e3 for c in checkpoints), 99),
                "alignment_p50_ms": _pct((_ms(s["alignment_s"]) for s in subtasks), 50),
                "alignment_p99_ms": _pct((_ms(s["alignment_s"]) for s in subtasks), 99),
                "operator_state_bytes": _median(
                    c["size"] - c["channel_state_size"] for c in checkpoints
                ),
                "channel_state_bytes": _median(c["channel_state_size"] for c in checkpoints),
                "channel_state_max_bytes": max(
                    (c["channel_state_size"] for c in checkpoints), default=math.nan
                ),
                "latency_p50_ms": _latency(ok, "p50_ms"),
                "latency_p99_ms": _latency(ok, "p99_ms"),
                "error": "; ".join(sorted({m.error for m in runs if m.error})),
            }
        )
    base = {(r["workload"], r["parallelism"]): r["rows_per_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        off = base.get((r["workload"], r["parallelism"]), math.nan)
        r["vs_off"] = r["rows_per_s"] / off if off else math.nan
    return rows


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else seconds * 1e3


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:  # NaN (nothing measured) as an empty cell
            writer.writerow(
                {
                    k: "" if _isnan(v) else round(v, 3) if isinstance(v, float) else v
                    for k, v in row.items()
                }
            )


def _isnan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _label(row: dict[str, Any]) -> str:
    return Config(row["mode"], row["workload"], row["interval_s"], row["parallelism"]).label


def _find(rows: list[dict[str, Any]], config: Config) -> dict[str, Any]:
    return next(
        r
        for r in rows
        if (r["mode"], r["workload"], r["interval_s"], r["parallelism"])
        == (config.mode, config.workload, config.interval_s, config.parallelism)
    )


_COLORS = {mode: f"C{i}" for i, mode in enumerate(MODES)}  # one color per mode, every plot
_WORKLOAD_COLORS = {"balanced": "#8da0cb", "skew": "#fc8d62"}


def write_plots(
    rows: list[dict[str, Any]], results: dict[Config, list[Measurement]], out: Path
) -> list[Path]:
    """Throughput vs interval, checkpoint duration by mode and workload, latency CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    # the interval sweep is balanced; a run without balanced jobs (--quick) shows skew
    workload = "balanced" if any(r["workload"] == "balanced" for r in rows) else "skew"
    for mode in MODES[1:]:
        points = sorted(
            (r["interval_s"], r["rows_per_s"])
            for r in rows
            if (r["mode"], r["workload"], r["parallelism"]) == (mode, workload, 2)
            and not math.isnan(r["rows_per_s"])
        )
        if points:
            ax.plot(*zip(*points), marker="o", color=_COLORS[mode], label=mode)
    for r in rows:
        if (r["mode"], r["workload"], r["parallelism"]) == ("off", workload, 2):
            ax.axhline(r["rows_per_s"], color=_COLORS["off"], linestyle="--", label="off")
    intervals = sorted({r["interval_s"] for r in rows} - {0.0})
    ax.set(xscale="log", xlabel="checkpoint interval (s)", ylabel="steady rows/s")
    ax.set_xticks(intervals, [f"{i:g}" for i in intervals])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _rate(y)))
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput vs checkpoint interval ({workload}, p=2)")
    _legend(ax)
    images = [_save(fig, out / "throughput_vs_interval.png")]

    fig, ax = plt.subplots(figsize=(7, 4))
    modes, width = MODES[1:], 0.4
    for k, workload in enumerate(WORKLOADS):
        found = {
            r["mode"]: r
            for r in rows
            if (r["workload"], r["interval_s"], r["parallelism"]) == (workload, 1.0, 2)
        }
        xs = [i + (k - 0.5) * width for i, m in enumerate(modes) if m in found]
        ax.bar(
            xs,
            [found[m]["checkpoint_p50_ms"] for m in modes if m in found],
            width,
            color=_WORKLOAD_COLORS[workload],
            label=f"{workload} p50",
        )
        p99 = [found[m]["checkpoint_p99_ms"] for m in modes if m in found]
        ax.scatter(xs, p99, marker="_", s=200, color="black", zorder=3)
    ax.scatter([], [], marker="_", color="black", label="p99")
    ax.set_xticks(range(len(modes)), modes, rotation=20, fontsize=8)
    ax.set(ylabel="checkpoint duration (ms)")
    ax.set_title("Checkpoint duration by mode, balanced vs skew (1 s, p=2)")
    _legend(ax)
    images.append(_save(fig, out / "checkpoint_duration.png"))

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(10, 4), sharey=True)
    for ax, workload in zip(axes, WORKLOADS):
        for config, runs in results.items():
            if config == Config.of(config.mode, workload, 1.0, 2):
                samples = np.sort([s for m in runs for s in m.latency_samples_ms])
                if len(samples):
                    fraction = np.arange(1, len(samples) + 1) / len(samples)
                    ax.plot(samples, fraction, color=_COLORS[config.mode], label=config.mode)
        ax.set(xscale="log", xlabel="end-to-end latency (ms)", title=f"{workload} (1 s, p=2)")
        _legend(ax)
    axes[0].set_ylabel("fraction of latency markers")
    images.append(_save(fig, out / "latency_cdf.png"))
    return images


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rate(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.0f}k"


def _bytes(value: float) -> str:
    if math.isnan(value):
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if value < 1024 or unit == "MiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return ""


def _pair(a: float, b: float, digits: int = 0) -> str:
    if math.isnan(a) and math.isnan(b):
        return "-"
    return f"{a:.{digits}f} / {b:.{digits}f}"


_TABLE_HEAD = (
    "| configuration | runs | steady rows/s | vs off | checkpoints (unaligned) | "
    "checkpoint p50 / p99 ms | alignment p50 / p99 ms | operator state | channel state | "
    "latency p50 / p99 ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _table_row(r: dict[str, Any], label: str) -> str:
    if r["error"] and not r["runs"]:
        return f"| {label} | 0 | failed: {r['error']} |" + " |" * 7
    vs_off = "-" if math.isnan(r["vs_off"]) else f"{r['vs_off']:.2f}"
    return (
        f"| {label} | {r['runs']} | {_rate(r['rows_per_s'])} | {vs_off} | "
        f"{r['checkpoints']} ({r['unaligned_checkpoints']}) | "
        f"{_pair(r['checkpoint_p50_ms'], r['checkpoint_p99_ms'])} | "
        f"{_pair(r['alignment_p50_ms'], r['alignment_p99_ms'], 1)} | "
        f"{_bytes(r['operator_state_bytes'])} | {_bytes(r['channel_state_bytes'])} | "
        f"{_pair(r['latency_p50_ms'], r['latency_p99_ms'])} |"
    )


_SWEEP_TITLES = {
    "A": "Sweep A: every mode, balanced vs skew (1 s interval, parallelism 2)",
    "B": "Sweep B: checkpoint interval (balanced, parallelism 2)",
    "C": "Sweep C: parallelism (skew, 1 s interval)",
    "quick": "Every mode under skew (1 s interval, parallelism 2; --quick)",
    "smoke": "Smoke: off vs unaligned (skew, 0.2 s interval, parallelism 2)",
}


def write_summary(
    rows: list[dict[str, Any]],
    settings: Settings,
    images: list[Path],
    path: Path,
    command: str,
    link_base: Path,
    elapsed_s: float,
) -> str:
    """Write the markdown summary to ``path`` and return it; image links are relative to
    ``link_base`` (the directory of the RESULTS.md it is meant to be pasted into)."""
    lines = [
        "## Barrier alignment: `benchmarks/alignment.py`",
        "",
        f"command: `{command}`  ",
        f"machine: {os.cpu_count()} CPUs, Ray {ray.__version__}, pyarrow {pa.__version__}, "
        f"Python {platform.python_version()}; {elapsed_s:.0f} s in all, load average at end "
        + "/".join(f"{x:.1f}" for x in os.getloadavg())
        + "  ",
        f"job: source -> with-key -> key_by -> hot-key-cost -> key_by -> sum -> sink, "
        f"{settings.batch_size:,}-row batches, {settings.rows:,} rows balanced (x interval "
        f"when > 1 s), {settings.skew_rows:,} rows skewed at p=2 (x p / 2; "
        f"{settings.hot_share:.0%} of rows "
        f"on one key, {settings.hot_cost_us:g} us each); latency markers every "
        f"{settings.latency_interval_ms} ms; aligned timeout {settings.aligned_timeout_ms} ms; "
        f"debloat target {settings.debloat_target_ms} ms; {settings.repeat} interleaved "
        "round(s), medians",
        "",
        "*vs off* divides by checkpointing off at the same workload and parallelism. "
        "Checkpoint figures are over every completed checkpoint but the final one; sizes "
        "are medians per checkpoint, channel state being the in-flight batches' bytes and "
        "operator state the rest of the checkpoint (its stored size less the channel "
        "state). Alignment is per subtask with inputs.",
    ]
    for name, configs in sweeps(settings.preset).items():
        lines += ["", f"### {_SWEEP_TITLES[name]}", "", _TABLE_HEAD]
        lines += [_table_row(_find(rows, c), c.label) for c in configs]
    check = [_find(rows, c) for c in CHECK if c in _all_configs(settings.preset)]
    if len(check) == 2:
        off, aligned = check
        ratio = aligned["rows_per_s"] / off["rows_per_s"]
        lines += [
            "",
            "### Throughput check: off vs EXACTLY_ONCE aligned (balanced, 1 s, p=2)",
            "",
            "| checkpointing | runs | median rows/s | range |",
            "|---|---:|---:|---:|",
        ]
        for r in check:
            lines.append(
                f"| {r['mode']} | {r['runs']} | {_rate(r['rows_per_s'])} | "
                f"{_rate(r['rows_per_s_min'])}-{_rate(r['rows_per_s_max'])} |"
            )
        lines += ["", f"aligned / off: **{ratio:.2f}** (median of each)"]
    failed = [f"- {_label(r)}: {r['error']}" for r in rows if r["error"]]
    if failed:
        lines += ["", "Failed runs (left out of the medians):", "", *failed]
    lines.append("")
    for image in images:
        link = os.path.relpath(image.resolve(), link_base.resolve())
        lines.append(f"![{image.stem.replace('_', ' ')}]({link})")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


# --- command line -------------------------------------------------------------------------


#: Options that override a ``Settings`` field: (name, type, help).
_OPTIONS = (
    ("rows", int_at_least(1), "balanced rows at a 1 s interval (x the interval above 1 s)"),
    ("skew_rows", int_at_least(1), "rows of a skewed job at parallelism 2 (x parallelism / 2)"),
    ("repeat", int_at_least(1), "interleaved rounds over every configuration"),
    ("check_runs", int_at_least(1), "runs of each configuration of the off vs aligned check"),
    ("hot_cost_us", float_at_least(0.0), "sleep per hot-key row under skew, microseconds"),
    ("aligned_timeout_ms", int_at_least(1), "timeout of the aligned-timeout mode"),
    ("debloat_target_ms", int_at_least(MIN_TARGET_MS), "target of the aligned+debloat mode"),
    ("latency_interval_ms", int_at_least(0), "interval of latency markers"),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (shared by ``main`` and ``rayflow bench alignment``)."""
    parser.add_argument(
        "--quick",
        action="store_const",
        const="quick",
        dest="preset",
        help="every mode under skew only, 1 s, p=2, fewer rows, 1 run each "
        "(under 2 minutes on 2 cores)",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help=argparse.SUPPRESS)
    parser.set_defaults(preset="full")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help="output directory (default: %(default)s)"
    )
    for name, kind, text in _OPTIONS:
        default = getattr(Settings(), name)
        quick = PRESETS["quick"].get(name, default)
        shown = f"{default:,}" + (f"; --quick: {quick:,}" if quick != default else "")
        parser.add_argument(
            "--" + name.replace("_", "-"), type=kind, metavar="N", help=f"{text} (default: {shown})"
        )
    parser.add_argument(
        "--address", metavar="ADDR", help="Ray cluster to join (default: $RAY_ADDRESS, else local)"
    )
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    """The preset's settings with the options given on the command line."""
    options = dict(PRESETS[args.preset], preset=args.preset)
    for name, _, _ in _OPTIONS:
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return Settings(**options)


def run(args: argparse.Namespace, command: str) -> int:
    """Run the benchmark as ``args`` say and write its outputs; 1 if a configuration failed.

    ``command`` is how it was started, for the summary."""
    settings = settings_from(args)
    try:
        import matplotlib  # noqa: F401  (the plots come last: fail before the runs, not after)
    except ImportError:
        print("alignment benchmark: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    print(f"command: {command}")
    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS") or "local"
        extra = {"include_dashboard": False} if address == "local" else {}
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, **extra)
    started = time.perf_counter()
    results = run_benchmark(settings)
    rows = summarize(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "results.csv")
    images = write_plots(rows, results, out)
    link_base = Path("benchmarks") if Path("benchmarks").is_dir() else out
    text = write_summary(
        rows,
        settings,
        images,
        out / "summary.md",
        command,
        link_base,
        time.perf_counter() - started,
    )
    print("\n" + text)
    print(f"wrote {out / 'results.csv'}, {out / 'summary.md'} and {len(images)} plots")
    return 1 if any(r["error"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/alignment.py [options]``; ``argv`` defaults to ``sys.argv[1:]``."""
    parser = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    argv = sys.argv[1:] if argv is None else argv
    command = "python benchmarks/alignment.py " + " ".join(shlex.quote(a) for a in argv)
    return run(parser.parse_args(argv), command.strip())


if __name__ == "__main__":
    sys.exit(main())
