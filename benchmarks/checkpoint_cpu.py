"""CPU a checkpoint costs, by process: the job master, the subtasks, the driver and Ray's
own processes.

The job is the latency benchmark's keyed running sum (``benchmarks/latency.py``: numbers
-> add-key -> ``key_by("key").sum("value")`` -> a discarding sink), its sources held to
``--rate`` rows/s, run for ``--seconds`` once without checkpoints and once with
EXACTLY_ONCE checkpoints every ``--interval-ms`` (local directory storage), the two
taking turns ``--runs`` times. While a job runs, a thread reads the CPU time of every
Ray process of this node from ``/proc`` every 0.2 s (a subtask's process ends with its
job: its last reading counts). Per kind of process, the CPU of a run with checkpoints
minus the median of the runs without, divided by the checkpoints it completed, is the
CPU of one checkpoint; every figure is the median over the runs.

    flock /tmp/bench.lock python benchmarks/checkpoint_cpu.py [--parallelism 2] \
        [--chaining off] [--interval-ms 100] [--rate 200000] [--seconds 10] [--runs 3]

Run it from the root of the checkout to measure (the workers import rayflow from the
driver's working directory, and ``latency`` from this script's). Linux only.
Benchmarks are never timed assertions.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import latency as bench  # noqa: E402

__all__ = ["CpuSampler", "main"]

KINDS = ("job master", "subtasks", "idle workers", "driver", "ray")


def _kind(pid: int, comm: str, cmdline: str) -> str | None:
    if pid == os.getpid():
        return "driver"
    if comm.startswith("ray::"):
        if "JobMaster" in comm or ":master:" in comm:
            return "job master"
        if "Subtask" in comm or ":subtask" in comm or comm.startswith("ray::rayflow"):
            return "subtasks"
        if comm.startswith("ray::IDLE"):
            return "idle workers"
        return "ray"
    if "/ray/" in cmdline:
        return "ray"
    return None


class CpuSampler:
    """CPU seconds per kind of process while it runs: the last reading of each process
    since :meth:`start` (its CPU before that subtracted)."""

    def __init__(self, period_s: float = 0.2) -> None:
        self._period_s = period_s
        self._tick = os.sysconf("SC_CLK_TCK")
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        #: (wall time, CPU seconds per kind so far) at every reading, each interval's
        #: CPU counted for the kind a process had at its end
        self.timeline: list[tuple[float, dict[str, float]]] = []
        self._spent = dict.fromkeys(KINDS, 0.0)

    def _read(self) -> dict[int, tuple[str, float]]:
        out: dict[int, tuple[str, float]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kind = _kind(pid, comm, cmdline)
            if kind is not None:
                out[pid] = (kind, (int(fields[11]) + int(fields[12])) / self._tick)
        return out

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            for pid, (kind, cpu) in self._read().items():
                before = self._last.get(pid, (kind, self._first.get(pid, 0.0)))[1]
                # by the kind a process has now: a worker is idle, then a subtask
                self._spent[kind] += cpu - before
                self._last[pid] = (kind, cpu)
            self.timeline.append((time.time(), dict(self._spent)))

    def _totals(self) -> dict[str, float]:
        totals = dict.fromkeys(KINDS, 0.0)
        for pid, (kind, cpu) in self._last.items():
            totals[kind] += cpu - self._first.get(pid, 0.0)
        return totals

    def start(self) -> CpuSampler:
        self._first = {pid: cpu for pid, (_, cpu) in self._read().items()}
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        for pid, reading in self._read().items():
            self._last[pid] = reading
        return self._totals()


def _run(config: bench.Config, args: argparse.Namespace, interval_ms: int | None) -> dict:
    storage = tempfile.mkdtemp(prefix="rayflow-checkpoint-cpu-")

    def configure(env: Any) -> None:
        if interval_ms is None:
            env.get_checkpoint_config().interval_ms = None
        else:
            env.get_checkpoint_config().set_checkpoint_interval(interval_ms)

    sampler = CpuSampler(args.period_s).start()
    started = time.time()
    outcome = bench.run_job(
        config,
        bench.rows_for(args.rate, args.seconds),
        storage,
        args.marker_ms,
        bench.source_rate(args.rate, config.parallelism, 1.0),
        None,
        configure,
    )
    wall = time.time() - started
    cpu = sampler.stop()
    return {
        "interval": interval_ms,
        "wall": wall,
        "checkpoints": outcome.checkpoints,
        "cpu": cpu,
        "p99": outcome.latency.get("p99_ms", float("nan")),
        "steady_p99": outcome.steady.get("p99_ms", float("nan")),
        "timeline": [(at - started, spent) for at, spent in sampler.timeline],
    }


def _print_timeline(timeline: list[tuple[float, dict[str, float]]], seconds: float) -> None:
    """Cores used per kind of process in each sampling period of the first ``seconds``
    of a run (from just before ``execute()``)."""
    print("| s after execute() | " + " | ".join(KINDS) + " |")
    print("|---:|" + "---:|" * len(KINDS))
    previous_at, previous = 0.0, dict.fromkeys(KINDS, 0.0)
    for at, spent in timeline:
        if at > seconds:
            break
        span = max(at - previous_at, 1e-9)
        cells = " | ".join(f"{(spent[k] - previous[k]) / span:.2f}" for k in KINDS)
        print(f"| {at:.1f} | {cells} |")
        previous_at, previous = at, spent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU a checkpoint costs, by process")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--chaining", choices=("on", "off"), default="off")
    parser.add_argument("--timeout-ms", type=int, default=0, help="buffer timeout")
    parser.add_argument("--interval-ms", type=int, default=100)
    parser.add_argument("--rate", type=float, default=200_000.0, help="rows/s of the job")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--marker-ms", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--period-s", type=float, default=0.2, help="CPU sampling period")
    parser.add_argument(
        "--timeline-s",
        type=float,
        default=0.0,
        help="print the cores each kind of process used per sampling period over the "
        "first this many seconds of every run (start-up)",
    )
    args = parser.parse_args(argv)
    print("command: python " + shlex.join(sys.argv if argv is None else [__file__, *argv]))
    print(f"load average: {bench.load_text()}", flush=True)
    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    config = bench.Config(args.timeout_ms, args.chaining == "on", args.parallelism)
    runs: list[dict] = []
    for round_ in range(args.runs):
        for interval in (None, args.interval_ms):
            run = _run(config, args, interval)
            runs.append(run)
            cells = ", ".join(f"{k} {v:.2f}" for k, v in run["cpu"].items())
            print(
                f"round {round_ + 1}, checkpoints every {interval or '-'} ms: "
                f"{run['checkpoints']} completed in {run['wall']:.1f} s; CPU s: {cells}; "
                f"latency p99 {run['p99']:.0f} ms (after 1 s {run['steady_p99']:.0f})",
                flush=True,
            )
            if args.timeline_s:
                _print_timeline(run["timeline"], args.timeline_s)
    base = {
        kind: statistics.median(r["cpu"][kind] / r["wall"] for r in runs if r["interval"] is None)
        for kind in KINDS
    }
    per = {
        kind: statistics.median(
            (r["cpu"][kind] - base[kind] * r["wall"]) / r["checkpoints"] * 1000
            for r in runs
            if r["interval"] is not None and r["checkpoints"]
        )
        for kind in KINDS
    }
    print()
    print(
        f"{config.label}, {args.rate:,.0f} rows/s, checkpoints every {args.interval_ms} ms, "
        f"median of {args.runs}:"
    )
    print("| process | CPU without checkpoints (cores) | CPU per checkpoint (ms) |")
    print("|---|---:|---:|")
    for kind in KINDS:
        print(f"| {kind} | {base[kind]:.2f} | {per[kind]:.1f} |")
    print(f"| all | {sum(base.values()):.2f} | {sum(per.values()):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
