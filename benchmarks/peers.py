"""The peer workload (a keyed running sum) on rayflow, Bytewax and PyFlink, in one run.

The workload is the same for every engine: N records ``i = 0..N-1`` generated in the
process (bounded, replayable, the position in every checkpoint), key ``i % 1000``, a
running sum per key, and a sink that counts updates and keeps the largest sum per key.
After every run the driver checks that all 1000 sums are exact (and, where one update
per input record is expected, that there were N updates); a wrong result or a failed
run is printed loudly and marked **WRONG** / **FAILED** in the table.

Engines (``Engine``):

* rayflow vectorized: ``NumberSequenceSource(0, N-1)`` -> ``map_batches`` adding
  ``key = value % 1000`` -> ``key_by("key").sum("value")`` (one update per key touched
  per batch, so only the sums are checked).
* rayflow per record: ``map(lambda r: {"key": r["value"] % 1000, "value": r["value"]})``
  -> ``key_by("key").reduce(...)``: one update per record.
* Bytewax (``benchmarks/peers_bytewax.py``), PyFlink SQL (one update per record, as
  ``../shared/peers.md`` defines it), PyFlink SQL mini-batch (Flink's batching of updates
  and local-global aggregation: one setting, not tuned further)
  and PyFlink DataStream (``benchmarks/peers_pyflink.py``): run as subprocesses with
  the python of the peer's own virtual environment (``--bytewax PYTHON``, ``--pyflink
  PYTHON``); each prints one JSON result line. Installing them is never a dependency of rayflow::

      python -m venv /tmp/peers/bytewax && /tmp/peers/bytewax/bin/pip install bytewax==0.21.1
      python -m venv /tmp/peers/pyflink && /tmp/peers/pyflink/bin/pip install apache-flink==2.3.0

Modes (``Mode``): checkpointing off, AT_LEAST_ONCE, EXACTLY_ONCE (aligned), unaligned;
1 s interval, local directory storage in a temporary directory. Bytewax has one kind of
snapshot (``RecoveryConfig``, 1 s epochs), shown as ``recovery`` in the EXACTLY_ONCE rows.

Metric: N / job wall seconds, median of ``--runs``. The job is ``env.execute()`` for
rayflow (Ray started once before everything, then a small warm-up job), ``INSERT ...
.wait()`` / ``execute()`` for PyFlink (JVM start excluded, planning and deployment
included) and ``cli_main()`` for Bytewax. Also shown: rayflow's
``JobResult.duration_s`` rate, and for the peers N / (process start -> job end).
Configurations of every engine run interleaved, block by block, each round in the order
of a row of a Williams design (over enough rounds every configuration follows every other
one equally often, so none always follows the same one), and before every run the
script waits for the CPUs to go quiet (what a job leaves running, a JVM exiting or the
idle workers Ray starts after a rayflow job, is not billed to the next run); the rate
ratios of each acceptance pair are printed per round. The blocks: the whole-job block
(N = ``--records``, 2M) and the steady-state block (EXACTLY_ONCE, 20M, or 10M for
per-record Python paths). The load average is noted per run.

Run from the repository root::

    python benchmarks/peers.py --preset acceptance \
        --bytewax /tmp/peers/bytewax/bin/python --pyflink /tmp/peers/pyflink/bin/python \
        --lock /tmp/bench.lock --write-results after

``--lock PATH`` takes the machine-wide benchmark lock around each block (so no lock is
held for long); for a short run, wrap it in ``flock /tmp/bench.lock`` instead (never
both on the same file). ``--write-results LABEL`` puts the table under ``### LABEL`` in
the ``## Peers`` section of ``benchmarks/RESULTS.md`` (replacing a section of that
label). Benchmarks are never timed assertions.
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
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

from bench_runner import (  # noqa: E402
    holding,
    load1,
    load_text,
    rayflow_revision,
    settle,
    start_ray,
)
from peers_common import KEYS, check_sums, parse_result  # noqa: E402

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

__all__ = [
    "Engine",
    "Mode",
    "Config",
    "Run",
    "Block",
    "PRESETS",
    "plan",
    "summarize",
    "round_order",
    "round_ratios",
    "render_table",
    "upsert_results",
    "parse_args",
    "main",
]

SECTION = "## Peers: `benchmarks/peers.py`"
RESULTS_FILE = HERE / "RESULTS.md"
SINK = "check"
INTERVAL_MS = 1000
WARM_UP_RECORDS = 100_000
PEER_TIMEOUT_S = 600.0
#: Items per Bytewax source batch: Bytewax's rate depends on it strongly (at 2M records,
#: about 8x between 1 and 8192). rayflow's NumberSequenceSource reads 1 MiB of int64 values
#: per batch (131,072 rows); Bytewax ran 10M records with recovery in 21.5 and 23.8 s at
#: 8192 and in 26.1 and 21.8 s at 131,072 (2026-12-07, interleaved), so 8192 is kept.
BYTEWAX_BATCH_SIZE = 8192
#: Before every run, the CPUs must be quiet this long: longer than the 2 s after a rayflow
#: job ends at which Ray is asked for idle workers that import rayflow
#: (``warm_workers.HOOKED_AFTER_S``), so that their start is not billed to the next run.
SETTLE_QUIET_S = 3.0
SETTLE_WINDOW_S = 0.5


class Engine(str, enum.Enum):
    RAYFLOW_VECTORIZED = "rayflow-vectorized"
    RAYFLOW_PER_RECORD = "rayflow-per-record"
    BYTEWAX = "bytewax"
    PYFLINK_SQL = "pyflink-sql"
    PYFLINK_SQL_MINI_BATCH = "pyflink-sql-mini-batch"
    PYFLINK_DATASTREAM = "pyflink-datastream"

    @property
    def label(self) -> str:
        return {
            Engine.RAYFLOW_VECTORIZED: "rayflow vectorized",
            Engine.RAYFLOW_PER_RECORD: "rayflow per record",
            Engine.BYTEWAX: "Bytewax",
            Engine.PYFLINK_SQL: "PyFlink SQL",
            Engine.PYFLINK_SQL_MINI_BATCH: "PyFlink SQL mini-batch",
            Engine.PYFLINK_DATASTREAM: "PyFlink DataStream (thread mode)",
        }[self]

    @property
    def is_rayflow(self) -> bool:
        return self in (Engine.RAYFLOW_VECTORIZED, Engine.RAYFLOW_PER_RECORD)

    @property
    def per_record(self) -> bool:
        """One Python call per record: steady state runs the smaller N."""
        return self in (Engine.RAYFLOW_PER_RECORD, Engine.BYTEWAX, Engine.PYFLINK_DATASTREAM)

    @property
    def one_update_per_record(self) -> bool:
        """The sink sees exactly N updates (so the count is checked too)."""
        return self.per_record

    @property
    def peer(self) -> str | None:
        """The ``--bytewax`` / ``--pyflink`` option that enables it (None for rayflow)."""
        if self.is_rayflow:
            return None
        return "bytewax" if self is Engine.BYTEWAX else "pyflink"

    def supports(self, mode: Mode) -> bool:
        if self is Engine.BYTEWAX:  # one kind of snapshot, shown as EXACTLY_ONCE
            return mode in (Mode.NONE, Mode.EXACTLY_ONCE)
        return True


class Mode(str, enum.Enum):
    NONE = "none"
    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"
    UNALIGNED = "unaligned"

    def label_for(self, engine: Engine) -> str:
        if engine is Engine.BYTEWAX and self is Mode.EXACTLY_ONCE:
            return "recovery"
        return {
            Mode.NONE: "none",
            Mode.AT_LEAST_ONCE: "AT_LEAST_ONCE",
            Mode.EXACTLY_ONCE: "EXACTLY_ONCE",
            Mode.UNALIGNED: "unaligned",
        }[self]


@dataclass(frozen=True)
class Config:
    """One configuration: engine, checkpointing mode, parallelism, records."""

    engine: Engine
    mode: Mode
    parallelism: int
    records: int

    @property
    def label(self) -> str:
        mode = self.mode.label_for(self.engine)
        return f"{self.engine.label} {mode} p={self.parallelism} N={_count(self.records)}"


@dataclass(frozen=True)
class Block:
    """Configurations run interleaved under one hold of the lock."""

    name: str
    configs: tuple[Config, ...]


@dataclass
class Run:
    """What one run of one configuration gave (``error`` set when it failed)."""

    config: Config
    job_s: float = math.nan
    duration_s: float = math.nan  # rayflow: JobResult.duration_s
    total_s: float = math.nan  # peers: process start -> job end
    checkpoints: int | None = None
    count: int | None = None
    check: str = ""
    error: str = ""
    load: float = math.nan
    round: int = 0  # which round of the block (0-based)
    settle_s: float = math.nan  # waited for quiet CPUs before it
    busy_before: float = math.nan  # the CPUs' busy share in the last window before it
    quiet_before: bool = True  # False: the wait for quiet CPUs gave up
    after: Engine | None = None  # the engine of the run before it in its block

    @property
    def rate(self) -> float:
        return self.config.records / self.job_s if self.job_s > 0 else math.nan


#: Per preset: the whole-job block's parallelisms and modes, and whether the
#: steady-state block runs.
PRESETS: dict[str, dict[str, Any]] = {
    "acceptance": {"parallelism": [1], "modes": ["none", "exactly-once"], "steady": True},
    "full": {
        "parallelism": [1, 2],
        "modes": ["none", "at-least-once", "exactly-once", "unaligned"],
        "steady": True,
    },
    "quick": {
        "parallelism": [1],
        "modes": ["none", "exactly-once"],
        "steady": False,
        "records": 200_000,
    },
}


def plan(args: argparse.Namespace) -> list[Block]:
    """The blocks to run, in order, from the parsed arguments."""
    engines = [Engine(e) for e in args.engines]
    available = {"bytewax": args.bytewax, "pyflink": args.pyflink}
    engines = [e for e in engines if e.peer is None or available[e.peer]]
    if not args.datastream:
        engines = [e for e in engines if e is not Engine.PYFLINK_DATASTREAM]
    modes = [Mode(m) for m in args.modes]
    blocks: list[Block] = []
    whole = [e for e in engines if e is not Engine.PYFLINK_DATASTREAM]
    for p in args.parallelism:
        configs = tuple(
            Config(e, m, p, args.records) for m in modes for e in whole if e.supports(m)
        )
        if configs:
            blocks.append(Block(f"whole job, p={p}, N={_count(args.records)}", configs))
    if args.steady:
        configs = tuple(
            Config(
                e,
                Mode.EXACTLY_ONCE,
                1,
                args.steady_records_per_record if e.per_record else args.steady_records,
            )
            for e in whole
        )
        if configs:
            blocks.append(Block("steady state, p=1, EXACTLY_ONCE", configs))
    if Engine.PYFLINK_DATASTREAM in engines:
        # about 20k records/s: a block per mode keeps each hold of the lock short
        for p in args.parallelism:
            for m in modes:
                config = Config(Engine.PYFLINK_DATASTREAM, m, p, args.datastream_records)
                blocks.append(Block(f"PyFlink DataStream, {m.value}, p={p}", (config,)))
    return blocks


# --- rayflow --------------------------------------------------------------------------------


def _add_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pc.remainder(batch.column("value"), KEYS))


class _CountMaxWriter(SinkWriter):
    def __init__(self) -> None:
        self.count = 0
        self.sums: dict[int, int] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        self.count += batch.num_rows
        if not batch.num_rows:
            return
        table = pa.Table.from_batches([batch.select(["key", "value"])])
        largest = table.group_by("key", use_threads=False).aggregate([("value", "max")])
        sums = self.sums
        for key, value in zip(
            largest.column("key").to_pylist(), largest.column("value_max").to_pylist()
        ):
            if value > sums.get(key, -1):
                sums[key] = value

    def finish(self) -> dict[str, Any]:
        import rayflow  # which rayflow this worker runs (it must be the driver's)

        return {"count": self.count, "sums": self.sums, "rayflow": rayflow.__file__}


class CountMaxSink(Sink):
    """Counts the updates it is given and keeps the largest sum per key."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _CountMaxWriter()

    def merge_results(self, results: list[Any]) -> dict[str, Any]:
        sums: dict[int, int] = {}
        for r in results:
            for key, value in (r or {}).get("sums", {}).items():
                if value > sums.get(key, -1):
                    sums[key] = value
        return {
            "count": sum(r["count"] for r in results if r),
            "sums": sums,
            "rayflow": sorted({r["rayflow"] for r in results if r and "rayflow" in r}),
        }


def _rayflow_env(
    config: Config, storage: str, channel_bytes: int | None = None
) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment()
    env.set_parallelism(config.parallelism)
    if channel_bytes is not None:
        env.set_buffer_limits(channel_bytes=channel_bytes)
    env.set_restart_strategy(RestartStrategies.no_restart())  # a restart would skew numbers
    if config.mode is not Mode.NONE:
        mode = (
            CheckpointingMode.AT_LEAST_ONCE
            if config.mode is Mode.AT_LEAST_ONCE
            else CheckpointingMode.EXACTLY_ONCE
        )
        env.enable_checkpointing(INTERVAL_MS, mode)
        checkpoints = env.get_checkpoint_config()
        checkpoints.set_checkpoint_storage(storage)
        if config.mode is Mode.UNALIGNED:
            checkpoints.enable_unaligned_checkpoints()
    # batch_size left to the source's default on purpose
    numbers = env.from_source(NumberSequenceSource(0, config.records - 1), "numbers")
    if config.engine is Engine.RAYFLOW_VECTORIZED:
        sums = numbers.map_batches(_add_key, "add-key").key_by("key").sum("value", "sum")
    else:
        sums = (
            numbers.map(lambda r: {"key": r["value"] % 1000, "value": r["value"]}, "add-key")
            .key_by("key")
            .reduce(lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]}, "sum")
        )
    sums.sink_to(CountMaxSink(DeliveryGuarantee.NONE), SINK)
    return env


def run_rayflow(config: Config, storage: str, channel_bytes: int | None = None) -> Run:
    run = Run(config, load=load1())
    try:
        env = _rayflow_env(config, storage, channel_bytes)
        name = f"peers-{config.engine.value}-{config.mode.value}-p{config.parallelism}"
        started = time.perf_counter()
        result = env.execute(f"{name}-{time.time_ns()}")
        run.job_s = time.perf_counter() - started
    except Exception as exc:  # one failed configuration must not lose the others
        run.error = _one_line(exc)
        return run
    run.duration_s = result.duration_s
    run.checkpoints = result.checkpoint_summary.get("counts", {}).get("COMPLETED")
    out = result.sink_result(SINK)
    if [os.path.realpath(f) for f in out["rayflow"]] != [os.path.realpath(rayflow.__file__)]:
        run.error = f"workers ran rayflow {out['rayflow']}, the driver {rayflow.__file__}"
        return run
    run.count = out["count"]
    expected_count = config.records if config.engine.one_update_per_record else None
    run.check = check_sums(config.records, out["sums"], expected_count)
    return run


# --- peers ----------------------------------------------------------------------------------


def peer_command(
    config: Config, python: str, bytewax_batch_size: int = BYTEWAX_BATCH_SIZE
) -> list[str]:
    """The command line that runs ``config`` on its peer engine."""
    common = ["--records", str(config.records), "--parallelism", str(config.parallelism)]
    common += ["--mode", config.mode.value]
    if config.engine is Engine.BYTEWAX:
        batch = ["--batch-size", str(bytewax_batch_size)]
        return [python, str(HERE / "peers_bytewax.py"), *common, *batch]
    api = {
        Engine.PYFLINK_SQL: "sql",
        Engine.PYFLINK_SQL_MINI_BATCH: "sql-mini-batch",
    }.get(config.engine, "datastream")
    return [python, str(HERE / "peers_pyflink.py"), "--api", api, *common]


def run_peer(
    config: Config,
    python: str,
    timeout_s: float = PEER_TIMEOUT_S,
    bytewax_batch_size: int = BYTEWAX_BATCH_SIZE,
) -> Run:
    run = Run(config, load=load1())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    launched = time.time()
    try:
        proc = subprocess.run(
            peer_command(config, python, bytewax_batch_size),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=str(HERE),
        )
    except subprocess.TimeoutExpired:
        run.error = f"timed out after {timeout_s:.0f} s"
        return run
    result = parse_result(proc.stdout)
    if result is None or result.get("error"):
        reason = result["error"] if result else f"exit code {proc.returncode}, no result line"
        tail = (proc.stderr or "").strip().splitlines()[-1:] if not result else []
        run.error = reason + (f" ({tail[0][:200]})" if tail else "")
        return run
    run.job_s = result["job_s"]
    run.total_s = result["job_end"] - launched
    run.checkpoints = result.get("checkpoints")
    run.count = result.get("count")
    run.check = result["check"]
    return run


def peer_version(python: str, distribution: str) -> str:
    """The installed version of ``distribution`` in the peer's venv ("?" when unknown)."""
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


# --- summarizing ----------------------------------------------------------------------------

#: The pairs the acceptance compares: (rayflow engine, peer engine).
ACCEPTANCE_PAIRS: tuple[tuple[Engine, Engine], ...] = (
    (Engine.RAYFLOW_VECTORIZED, Engine.PYFLINK_SQL),
    (Engine.RAYFLOW_VECTORIZED, Engine.PYFLINK_SQL_MINI_BATCH),
    (Engine.RAYFLOW_PER_RECORD, Engine.BYTEWAX),
)


def _williams_rows(n: int) -> list[list[int]]:
    """The rows of a Williams design for ``n`` items: over its rows each item comes right
    after each other item equally often (once for even ``n``, in ``2n`` rows twice for odd)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2 == 0:
        return rows
    # odd: each row then its reverse, so that a few rounds already mix both halves
    return [row for forward in rows for row in (forward, forward[::-1])]


def round_order(configs: Sequence[Config], runs: int) -> list[tuple[int, Config]]:
    """(round, config) in run order, each round a row of a Williams design.

    A fixed order, or one rotated each round, runs every engine right after the same other
    one (whatever that one leaves behind, such as the idle workers Ray starts after a
    rayflow job, it leaves to the same engine); here, over enough rounds, every
    configuration follows every other one equally often."""
    rows = _williams_rows(len(configs)) if configs else [[]]
    return [(r, configs[i]) for r in range(runs) for i in rows[r % len(rows)]]


def round_ratios(
    blocks: Sequence[Block], results: dict[Config, list[Run]]
) -> list[tuple[str, list[float]]]:
    """Per acceptance pair, block, mode and parallelism: rayflow's rate over the peer's,
    one ratio per round in which both ran without error (a ratio within one round
    compares runs minutes apart, not the medians of the whole block)."""
    out: list[tuple[str, list[float]]] = []
    for block in blocks:
        for ours, theirs in ACCEPTANCE_PAIRS:
            for a in (c for c in block.configs if c.engine is ours):
                b = next(
                    (
                        c
                        for c in block.configs
                        if c.engine is theirs
                        and c.mode is a.mode
                        and c.parallelism == a.parallelism
                    ),
                    None,
                )
                if b is None:
                    continue
                by_round = {r.round: r for r in results.get(b, []) if not r.error}
                ratios = [
                    r.rate / by_round[r.round].rate
                    for r in results.get(a, [])
                    if not r.error and r.round in by_round and by_round[r.round].rate > 0
                ]
                if ratios:
                    out.append((f"{a.label} / {b.label}", ratios))
    return out


def _ratios_text(ratios: list[tuple[str, list[float]]]) -> str:
    lines = []
    for label, values in ratios:
        each = ", ".join(f"{v:.2f}" for v in values)
        lines.append(
            f"- {label}: {each} (median {statistics.median(values):.2f}x, "
            f"lowest {min(values):.2f}x)"
        )
    return "Ratios per round (rayflow / peer, runs of the same round):\n\n" + "\n".join(lines)


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarize(runs: list[Run]) -> dict[str, Any]:
    """One table row's figures from the runs of one configuration."""
    ok = [r for r in runs if not r.error]
    rates = [r.rate for r in ok]
    records = runs[0].config.records if runs else 0
    wrong = [r for r in ok if r.check.startswith("WRONG")]
    failed = [r for r in runs if r.error]
    if wrong:
        check = f"**WRONG** ({len(wrong)}/{len(runs)}): {wrong[0].check[len('WRONG: ') :]}"
    elif failed:
        check = f"**FAILED** ({len(failed)}/{len(runs)}): {failed[0].error}"
    elif ok and all(r.check.startswith("unchecked") for r in ok):
        check = ok[0].check
    else:
        check = "ok" if ok else ""
    if wrong and failed:
        check += f"; **FAILED** ({len(failed)}/{len(runs)}): {failed[0].error}"
    checkpoints = [r.checkpoints for r in ok if r.checkpoints is not None]
    return {
        "runs": len(ok),
        "of": len(runs),
        "rate": _median(rates),
        "rate_min": min(rates, default=math.nan),
        "rate_max": max(rates, default=math.nan),
        "duration_rate": _median([records / r.duration_s for r in ok if r.duration_s > 0]),
        "total_rate": _median([records / r.total_s for r in ok if r.total_s > 0]),
        "job_s": _median([r.job_s for r in ok]),
        "checkpoints": _median(checkpoints) if checkpoints else None,
        "check": check,
        "load": _median([r.load for r in runs]),
        "bad": bool(wrong or failed),
    }


def _rate(x: float) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x / 1e6:.2f} M" if x >= 0.1e6 else f"{x / 1e6:.3f} M"


def _count(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k" if n >= 1000 else str(n)


TABLE_HEAD = (
    "| engine | mode | p | N | runs | records/s (job, median) | min - max "
    "| records/s (rayflow `duration_s`) | records/s (process start -> job end) | job s "
    "| checkpoints | check | load (1 min) |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
)


def render_table(results: list[tuple[Config, list[Run]]]) -> str:
    """The markdown table, one row per configuration, in the given order."""
    lines = [TABLE_HEAD]
    for config, runs in results:
        s = summarize(runs)
        spread = f"{_rate(s['rate_min'])} - {_rate(s['rate_max'])}" if s["runs"] > 1 else ""
        none = s["checkpoints"] is None or config.mode is Mode.NONE
        checkpoints = "-" if none else f"{s['checkpoints']:g}"
        job_s = "-" if math.isnan(s["job_s"]) else f"{s['job_s']:.2f}"
        load = "-" if math.isnan(s["load"]) else f"{s['load']:.2f}"
        runs_cell = f"{s['runs']}" if s["runs"] == s["of"] else f"{s['runs']} of {s['of']}"
        lines.append(
            f"| {config.engine.label} | {config.mode.label_for(config.engine)} "
            f"| {config.parallelism} | {_count(config.records)} | {runs_cell} "
            f"| {_rate(s['rate'])} | {spread} | {_rate(s['duration_rate'])} "
            f"| {_rate(s['total_rate'])} | {job_s} | {checkpoints} | {s['check']} | {load} |"
        )
    return "\n".join(lines)


def upsert_results(text: str, label: str, body: str, intro: str = "") -> str:
    """``text`` (RESULTS.md) with ``### label`` in the Peers section set to ``body``.

    An existing subsection of that label is replaced (up to the next ``##``/``###``
    heading); otherwise the subsection is added at the end of the Peers section, which
    is added at the end of the file (with ``intro``) when missing."""
    sub = f"### {label}"
    block = f"{sub}\n\n{body.strip()}\n"
    lines = text.splitlines()
    try:
        start = lines.index(SECTION)
    except ValueError:
        head = text.rstrip("\n")
        parts = [head, "", SECTION, ""] if head else [SECTION, ""]
        if intro:
            parts += [intro.strip(), ""]
        return "\n".join(parts) + "\n" + block
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    try:
        at = next(i for i in range(start + 1, end) if lines[i].strip() == sub)
    except StopIteration:
        before = "\n".join(lines[:end]).rstrip("\n")
        after = "\n".join(lines[end:])
        return before + "\n\n" + block + ("\n" + after.rstrip("\n") + "\n" if after else "")
    stop = next((i for i in range(at + 1, end) if lines[i].startswith(("### ", "## "))), end)
    before = "\n".join(lines[:at])
    after = "\n".join(lines[stop:])
    return before + "\n" + block + ("\n" + after.rstrip("\n") + "\n" if after else "")


INTRO = """\
The peer workload, the same on every engine: N records `i = 0..N-1` generated in the
process, key `i % 1000`, a running sum per key, a sink that counts updates and keeps the
largest sum per key; every run's 1000 sums are checked exact (and the count of updates
where one per record is expected). Records/s = N / job wall seconds: rayflow
`env.execute()` with Ray already started, PyFlink `INSERT ... .wait()` / `execute()`
(JVM start excluded), Bytewax `cli_main()`. Medians of the runs; engines interleaved.
Bytewax and PyFlink run from their own venvs (never rayflow dependencies). The PyFlink SQL
job ends in a `blackhole` sink, so its sums are not checked."""


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The keyed running sum on rayflow, Bytewax and PyFlink (records/s)"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="acceptance")
    parser.add_argument("--bytewax", metavar="PYTHON", help="python of a venv with bytewax")
    parser.add_argument("--pyflink", metavar="PYTHON", help="python of a venv with apache-flink")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=[e.value for e in Engine],
        default=[e.value for e in Engine],
        help="engines to run (peers also need their --bytewax / --pyflink python)",
    )
    parser.add_argument(
        "--datastream",
        action="store_true",
        help="also run PyFlink DataStream (about 20k records/s: slow), in blocks of its own",
    )
    parser.add_argument("--records", type=int, help="N of the whole-job block (default 2M)")
    parser.add_argument("--steady-records", type=int, default=20_000_000)
    parser.add_argument(
        "--steady-records-per-record",
        type=int,
        default=10_000_000,
        help="steady-state N of the per-record Python paths",
    )
    parser.add_argument("--datastream-records", type=int, default=2_000_000)
    parser.add_argument("--parallelism", type=int, nargs="+", help="whole-job parallelisms")
    parser.add_argument("--modes", nargs="+", choices=[m.value for m in Mode])
    parser.add_argument(
        "--no-steady", dest="steady", action="store_false", default=None, help="skip steady state"
    )
    parser.add_argument("--steady-only", action="store_true", help="only the steady-state block")
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration (median)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    parser.add_argument(
        "--rayflow-starts-ray",
        action="store_true",
        help="start the local Ray as a job that finds none does (ensure_ray: 1 MiB inline "
        "arguments, workers import rayflow while idle) instead of ray.init(address='local')",
    )
    parser.add_argument(
        "--channel-bytes",
        type=int,
        metavar="BYTES",
        help="rayflow's bytes of batches in flight per channel (set_buffer_limits; "
        "default: rayflow's own)",
    )
    parser.add_argument(
        "--inline-bytes",
        type=int,
        metavar="BYTES",
        help="Ray's inline-argument limit for the Ray this run starts "
        "(RAY_max_direct_call_object_size; default: what the starter sets)",
    )
    parser.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S)
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="before every run, wait up to S seconds for the CPUs to be quiet "
        f"(under 25%% busy for {SETTLE_QUIET_S:g} s; 0: do not wait)",
    )
    parser.add_argument(
        "--bytewax-batch-size",
        type=int,
        default=BYTEWAX_BATCH_SIZE,
        help=f"items per Bytewax source batch (default {BYTEWAX_BATCH_SIZE})",
    )
    parser.add_argument(
        "--lock", metavar="PATH", help="hold this flock (e.g. /tmp/bench.lock) around each block"
    )
    parser.add_argument(
        "--write-results",
        metavar="LABEL",
        help="put the table under '### LABEL' in the Peers section of benchmarks/RESULTS.md",
    )
    parser.add_argument("--results-file", default=str(RESULTS_FILE), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.records is None:
        args.records = preset.get("records", 2_000_000)
    if args.parallelism is None:
        args.parallelism = list(preset["parallelism"])
    if args.modes is None:
        args.modes = list(preset["modes"])
    if args.steady is None:
        args.steady = preset["steady"]
    if args.steady_only:
        args.steady, args.parallelism = True, []
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    for name in ("bytewax", "pyflink"):
        python = getattr(args, name)
        if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
            parser.error(f"--{name} {python}: not an executable python")
        if python:  # absolute (main changes directory), symlinks kept (a venv's python is one)
            setattr(args, name, os.path.abspath(python))
    for name in ("channel_bytes", "inline_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be >= 1")
    args.results_file = os.path.abspath(args.results_file)
    if args.lock:
        args.lock = os.path.abspath(args.lock)
    return args


def _waits_by_predecessor(runs: Sequence[Run]) -> str:
    """The median wait for quiet CPUs after a rayflow run and after a peer's run."""
    parts = []
    for label, ours in (("a rayflow run", True), ("a peer's run", False)):
        waits = [
            r.settle_s
            for r in runs
            if r.after is not None and r.after.is_rayflow is ours and not math.isnan(r.settle_s)
        ]
        if waits:
            parts.append(f"after {label} {statistics.median(waits):.1f} s ({len(waits)} runs)")
    return (" Median wait " + "; ".join(parts) + ".") if parts else ""


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _describe(run: Run) -> str:
    if run.error:
        return f"FAILED: {run.error}"
    parts = [f"{_rate(run.rate)} records/s", f"job {run.job_s:.2f} s"]
    if not math.isnan(run.duration_s):
        parts.append(f"duration_s {run.duration_s:.2f} s")
    if not math.isnan(run.total_s):
        parts.append(f"from process start {run.total_s:.2f} s")
    if run.checkpoints is not None:
        parts.append(f"{run.checkpoints} checkpoints")
    check = run.check if not run.check.startswith("WRONG") else f"!!! {run.check} !!!"
    return ", ".join(parts) + f"; {check}; load {run.load:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    blocks = plan(args)
    command = "python " + shlex.join(sys.argv if argv is None else ["benchmarks/peers.py", *argv])

    def progress(line: str) -> None:
        print(line, flush=True)

    peers = {"bytewax": args.bytewax, "pyflink": args.pyflink}
    versions = [
        f"Ray {ray.__version__}",
        f"pyarrow {pa.__version__}",
        f"rayflow source batches of {NumberSequenceSource(0, 1).batch_size}",
    ]
    if args.bytewax:
        bytewax = peer_version(args.bytewax, "bytewax")
        versions.append(f"Bytewax {bytewax} (source batches of {args.bytewax_batch_size})")
    if args.pyflink:
        versions.append(f"PyFlink {peer_version(args.pyflink, 'apache-flink')}")
    machine = f"{os.cpu_count()} CPUs, Python {platform.python_version()}, " + ", ".join(versions)
    where = Path(rayflow.__file__).resolve().parent
    revision = f"{rayflow_revision(where)} ({where})"
    load_start = load_text()
    progress(f"command: {command}")
    progress(f"rayflow: {revision}")
    progress(f"machine: {machine}")
    progress(f"load average at start (1/5/15 min): {load_start}")
    for block in blocks:
        progress(f"block {block.name}: " + "; ".join(c.label for c in block.configs))

    # Ray puts the driver's working directory first on its workers' sys.path: work from
    # the directory holding the rayflow this driver imported, so that workers import the
    # same one (checked again by the sink after every job).
    os.chdir(Path(rayflow.__file__).resolve().parents[1])
    if args.inline_bytes is not None:  # read by every process of the Ray started below
        os.environ["RAY_max_direct_call_object_size"] = str(args.inline_bytes)
    start_ray(rayflow_starts=args.rayflow_starts_ray)
    starter = "rayflow (ensure_ray)" if args.rayflow_starts_ray else "ray.init"
    inline = os.environ.get("RAY_max_direct_call_object_size", "the starter's")
    channel = args.channel_bytes or "rayflow's default"
    progress(f"Ray started by {starter}; inline limit {inline}; channel bytes {channel}")
    storage = tempfile.mkdtemp(prefix="rayflow-bench-peers-")
    results: dict[Config, list[Run]] = {c: [] for b in blocks for c in b.configs}
    started = time.perf_counter()
    try:
        warmed: set[Engine] = set()
        for block in blocks:
            with holding(args.lock, progress):
                progress(f"== {block.name} (load {load_text()})")
                # a small untimed job of each engine the first time it runs
                for engine in dict.fromkeys(c.engine for c in block.configs):
                    if args.warm_up and engine not in warmed:
                        warmed.add(engine)
                        if engine.is_rayflow:
                            warm_config = Config(engine, Mode.EXACTLY_ONCE, 1, WARM_UP_RECORDS)
                            warm = run_rayflow(warm_config, storage, args.channel_bytes)
                        else:
                            warm_config = Config(engine, Mode.NONE, 1, WARM_UP_RECORDS)
                            warm = run_peer(
                                warm_config,
                                peers[engine.peer],
                                args.peer_timeout,
                                args.bytewax_batch_size,
                            )
                        progress(f"warm-up {warm.config.label}: {_describe(warm)}")
                order = round_order(block.configs, args.runs)
                previous: Engine | None = None
                for i, (round_, config) in enumerate(order, 1):
                    waited, busy, quiet = (
                        settle(
                            quiet_windows=int(SETTLE_QUIET_S / SETTLE_WINDOW_S),
                            window_s=SETTLE_WINDOW_S,
                            timeout_s=args.settle_timeout,
                        )
                        if args.settle_timeout > 0
                        else (0.0, math.nan, True)
                    )
                    if config.engine.is_rayflow:
                        run = run_rayflow(config, storage, args.channel_bytes)
                    else:
                        run = run_peer(
                            config,
                            peers[config.engine.peer],
                            args.peer_timeout,
                            args.bytewax_batch_size,
                        )
                    run.round, run.settle_s, run.busy_before = round_, waited, busy
                    run.quiet_before, run.after = quiet, previous
                    previous = config.engine
                    results[config].append(run)
                    progress(
                        f"[{i}/{len(order)}] round {round_ + 1} {config.label}: "
                        f"{_describe(run)}; settled {waited:.1f} s (busy {busy:.0%})"
                    )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    total = time.perf_counter() - started
    load_end = load_text()

    rows = [(c, results[c]) for b in blocks for c in b.configs if results[c]]
    table = render_table(rows)
    ratios = round_ratios(blocks, results)
    every = [r for runs in results.values() for r in runs]
    waits = [r.settle_s for r in every if not math.isnan(r.settle_s)]
    bad = [c for c, runs in rows if summarize(runs)["bad"]]
    notes = [
        f"Command: `{command}`",
        f"rayflow measured: {revision}",
        f"Machine: {machine}. Runs per configuration: {args.runs} (median), interleaved "
        f"within each block ({'; '.join(b.name for b in blocks)}).",
        f"Load average (1/5/15 min) at start {load_start}, at end {load_end}; total {total:.0f} s.",
    ]
    if waits:
        gave_up = sum(1 for r in every if not r.quiet_before)
        notes.append(
            f"Each round's order is a row of a Williams design. Before every "
            f"run the CPUs were let go quiet (under 25% busy for {SETTLE_QUIET_S:g} s, at most "
            f"{args.settle_timeout:g} s): waits {min(waits):.1f} - {max(waits):.1f} s, "
            f"median {statistics.median(waits):.1f} s; {gave_up} of {len(waits)} gave up."
            + _waits_by_predecessor(every)
        )
    print()
    print("\n\n".join(notes))
    print()
    print(table)
    if ratios:
        print()
        print(_ratios_text(ratios))
    if bad:
        print()
        print("!!! WRONG RESULTS OR FAILED RUNS: " + "; ".join(c.label for c in bad) + " !!!")
    if args.write_results:
        path = Path(args.results_file)
        text = path.read_text() if path.exists() else ""
        body = "\n\n".join(notes) + "\n\n" + table
        if ratios:
            body += "\n\n" + _ratios_text(ratios)
        path.write_text(upsert_results(text, args.write_results, body, INTRO))
        print(f"\nwritten to {path} under '### {args.write_results}'")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
