"""Where latency markers wait, hop by hop: one run of the latency benchmark's job with
every marker traced through the output channels and input gates of every subtask.

A diagnostic, not a benchmark: it runs the keyed running sum of
``benchmarks/latency.py`` once unthrottled (its maximum sizes the load; ``--rate`` skips
it) and once at ``--fraction`` of that maximum, in its own local Ray whose worker
processes wrap (at start-up, through ``worker_process_setup_hook``) a few methods of the
runtime to note, per marker, the time it was

* ``write``: written into an output channel (the subtask took it; at the source, right
  after the batch it follows was emitted),
* ``push``: sent from that channel (alone, or in a bundle: the output buffer's wait ends),
* ``admit``: admitted into the receiver's input buffer (the Ray call arrived and found room),
* ``take``: taken by the receiving subtask's mailbox loop,

and, for every message pushed, its kind, items and bytes; every checkpoint barrier sent;
garbage collector pauses; and each process's CPU time. Nothing of the runtime is changed;
the wrappers only note times (a list per process, written out as it reports its metrics).

Per marker the stages between two hops are summed over the job: *buffer* (write ->
push), *flight* (push -> admit: the Ray call and waiting for buffer room at the
receiver) and *queue* (admit -> take: behind earlier messages in the receiver's
buffer), and *operator* (take -> write on the next hop). Printed: p50/p99/max of each
stage and of the total, the same per hop, the stage that dominates the markers above the
target (buffer timeout + 50 ms), how close those are to a checkpoint barrier, the
slowest ones hop by hop, and per sending subtask its messages and CPU use.

    python benchmarks/latency_trace.py --timeout-ms 0 --chaining off [--parallelism P] \
        [--fraction 0.5 | --rate ROWS_PER_S] [--seconds 10] [--marker-ms 50] \
        [--batch-rows N] [--unthrottled] [--channel-mib MIB]

Run it under the benchmark lock (``flock /tmp/bench.lock python ...``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import latency as bench  # noqa: E402

__all__ = ["install_tracing", "stage_times", "main"]

TRACE_DIR_ENV = "RAYFLOW_LATENCY_TRACE_DIR"
#: the directory holding the driver's rayflow (the hook runs before Ray puts the driver's
#: working directory on the worker's path)
ROOT_ENV = "RAYFLOW_LATENCY_TRACE_ROOT"
GC_THRESHOLD_ENV = "RAYFLOW_LATENCY_TRACE_GC_THRESHOLD0"
GC_TYPES_ENV = "RAYFLOW_LATENCY_TRACE_GC_TYPES"
SOURCE_HOLD_ENV = "RAYFLOW_LATENCY_TRACE_SOURCE_HOLD_S"


def install_tracing() -> None:
    """Wrap the channel and gate methods of this worker process so that they note marker
    times (see module docstring); notes go to a file of this process when it exits or
    every few hundred notes."""
    import atexit

    root = os.environ.get(ROOT_ENV)
    if root and root not in sys.path:
        sys.path.insert(0, root)
    from rayflow.runtime import channels
    from rayflow.runtime.events import Bundle, CheckpointBarrier, LatencyMarker

    out_dir = os.environ.get(TRACE_DIR_ENV)
    if not out_dir:
        return
    path = os.path.join(out_dir, f"{os.getpid()}.jsonl")
    notes: list[str] = []
    pid = os.getpid()
    first: list[tuple[float, float]] = []  # (wall time, CPU time) of the first note

    def note(**fields: Any) -> None:
        fields["pid"] = pid
        if not first:
            first.append((time.time(), time.process_time()))
        notes.append(json.dumps(fields))
        if len(notes) >= 200:
            dump()

    def dump() -> None:
        if first:  # CPU seconds this process used since its first note
            t0, cpu0 = first[0]
            notes.append(
                json.dumps(
                    {
                        "ev": "cpu",
                        "pid": pid,
                        "t": time.time(),
                        "wall": time.time() - t0,
                        "cpu": time.process_time() - cpu0,
                    }
                )
            )
        if notes:
            with open(path, "a") as f:
                f.write("\n".join(notes) + "\n")
            notes.clear()

    atexit.register(dump)

    def markers(message: Any) -> list[LatencyMarker]:
        items = message.items if isinstance(message, Bundle) else (message,)
        return [i for i in items if isinstance(i, LatencyMarker)]

    def kind(message: Any) -> str:
        if isinstance(message, Bundle):
            return "bundle"
        return type(message).__name__

    threshold0 = os.environ.get(GC_THRESHOLD_ENV)
    if threshold0:  # the young generation's threshold subtask processes take
        from rayflow.runtime import gc_tuning

        gc_tuning.tune_gc.__defaults__ = (int(threshold0),)

    hold = float(os.environ.get(SOURCE_HOLD_ENV) or 0)
    if hold:  # sources start reading this long after their subtask's run() started
        from rayflow.runtime import subtask as subtask_module

        orig_run_source = subtask_module.Subtask._run_source

        async def _run_source(self: Any) -> None:
            import asyncio

            await asyncio.sleep(hold)
            await orig_run_source(self)

        subtask_module.Subtask._run_source = _run_source

    out = channels.OutputChannel
    gate = channels.InputGate
    orig_write, orig_push, orig_send = out.write, out._push, out.send
    orig_admit, orig_next = gate.push, gate.next

    async def write(self: Any, item: Any, *args: Any, **kwargs: Any) -> bool:
        if isinstance(item, LatencyMarker):
            note(ev="write", m=item.created_at, t=time.time(), ch=self.channel)
        return await orig_write(self, item, *args, **kwargs)

    def _push(self: Any, message: Any, items: int, size: int) -> None:
        now = time.time()
        for m in markers(message):
            note(ev="push", m=m.created_at, t=now, ch=self.channel)
        note(ev="msg", t=now, kind=kind(message), items=items, bytes=size, ch=self.channel)
        orig_push(self, message, items, size)

    async def send(self: Any, message: Any) -> None:
        if isinstance(message, CheckpointBarrier):
            note(ev="barrier", t=time.time(), id=message.checkpoint_id, ch=self.channel)
        await orig_send(self, message)

    async def admit(self: Any, channel: int, seq: int, item: Any) -> Any:
        result = await orig_admit(self, channel, seq, item)
        now = time.time()
        for m in markers(item):
            note(ev="admit", m=m.created_at, t=now, ch=channel)
        return result

    async def next_(self: Any) -> tuple[int, Any]:
        channel, item = await orig_next(self)
        if channel >= 0:
            now = time.time()
            for m in markers(item):
                note(ev="take", m=m.created_at, t=now, ch=channel)
        return channel, item

    out.write, out._push, out.send = write, _push, send
    gate.push, gate.next = admit, next_

    import gc
    import threading

    gc_started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started[:] = [time.perf_counter()]
        elif gc_started:
            took = time.perf_counter() - gc_started[0]
            if took > 0.001:  # pauses of a millisecond or more
                note(
                    ev="gc",
                    t=time.time(),
                    s=took,
                    gen=info.get("generation"),
                    collected=info.get("collected", 0),
                )

    gc.callbacks.append(on_gc)

    if os.environ.get(GC_TYPES_ENV):  # what the collector's generations hold, every 3 s

        def census() -> None:
            from collections import Counter

            while True:
                time.sleep(3.0)
                counts = Counter(type(o).__name__ for o in gc.get_objects())
                note(
                    ev="census", t=time.time(), top=counts.most_common(8), all=sum(counts.values())
                )

        threading.Thread(target=census, daemon=True).start()

    # Subtask actors are killed at the end of a job: write the notes out as each
    # subtask reports its metrics (the last call it answers).
    from rayflow.runtime import latency as latency_module

    tracker = latency_module.LatencyTracker
    orig_summary = tracker.summary

    def summary(self: Any) -> dict[str, Any]:
        dump()
        return orig_summary(self)

    tracker.summary = summary


# --- analysis --------------------------------------------------------------------------------


def load_notes(directory: str) -> list[dict[str, Any]]:
    notes = []
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        with open(path) as f:
            notes.extend(json.loads(line) for line in f if line.strip())
    return notes


def stage_times(notes: Sequence[dict[str, Any]]) -> dict[float, dict[str, float]]:
    """Per marker (by creation time): seconds spent in each stage summed over its hops
    (``buffer``, ``flight``, ``queue``, and ``operator``: from taking it to writing it on),
    the same per hop (``"flight@2"``: the hop into the second receiving subtask;
    ``"operator@0"``: at the source), the hop count and ``total`` (creation -> the last
    ``take``), from the notes of a linear job (one path per marker)."""
    by_marker: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for n in notes:
        if "m" in n:
            by_marker[n["m"]].append(n)
    stages = {"write": None, "push": "buffer", "admit": "flight", "take": "queue"}
    out: dict[float, dict[str, float]] = {}
    for created, events in by_marker.items():
        events.sort(key=lambda e: (e["t"], list(stages).index(e["ev"])))
        times = {"buffer": 0.0, "flight": 0.0, "queue": 0.0}
        last = created
        hops = 0
        complete = bool(events) and events[-1]["ev"] == "take"
        for e in events:
            stage = stages[e["ev"]]
            if stage is None:
                stage = "operator"  # take -> write: the work of the subtask it is in
                times.setdefault(stage, 0.0)
                at = f"{stage}@{hops}"  # @0: the source
            else:
                at = f"{stage}@{hops + 1}"  # the hop into the (hops + 1)-th receiver
            times[stage] += e["t"] - last
            times[at] = times.get(at, 0.0) + e["t"] - last
            if e["ev"] == "take":
                hops += 1
            last = e["t"]
        if complete:
            out[created] = {**times, "hops": hops, "total": last - created}
    return out


def _by_checkpoint_phase(
    notes: Sequence[dict[str, Any]], stages: dict[float, dict[str, float]]
) -> list[str]:
    """Marker latency by how long after a checkpoint's first barrier the marker was
    created, and when each sending process sent that checkpoint's barrier."""
    first: dict[int, float] = {}
    sent: dict[int, dict[int, float]] = defaultdict(dict)
    for n in notes:
        if n["ev"] == "barrier":
            first[n["id"]] = min(first.get(n["id"], math.inf), n["t"])
            sent[n["id"]][n["pid"]] = min(sent[n["id"]].get(n["pid"], math.inf), n["t"])
    if not first:
        return []
    starts = sorted(first.values())
    bins = [(0, 50), (50, 100), (100, 200), (200, 400), (400, 700), (700, 10_000)]
    by_bin: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)
    for created, s in stages.items():
        before = [b for b in starts if b <= created]
        if not before:
            continue
        since = (created - before[-1]) * 1000
        for lo, hi in bins:
            if lo <= since < hi:
                by_bin[(lo, hi)].append(s)
    lines = [
        "",
        "| created ms after a checkpoint's first barrier | markers | p50 ms | p99 ms | "
        "mean buffer / flight / queue / operator ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for lo, hi in bins:
        group = by_bin.get((lo, hi), [])
        if not group:
            continue
        totals = [g["total"] * 1000 for g in group]
        means = " / ".join(
            f"{statistics.fmean(g.get(name, 0.0) for g in group) * 1000:.1f}"
            for name in ("buffer", "flight", "queue", "operator")
        )
        lines.append(
            f"| {lo}-{hi} | {len(group)} | {bench.percentile(totals, 50):.1f} "
            f"| {bench.percentile(totals, 99):.1f} | {means} |"
        )
    lines.append("barrier sent, ms after the checkpoint's first, per sending process:")
    for cid in sorted(sent)[:6]:
        cells = ", ".join(
            f"{pid}:{(t - first[cid]) * 1000:.0f}" for pid, t in sorted(sent[cid].items())
        )
        lines.append(f"  checkpoint {cid}: {cells}")
    return lines


def _busy(cpu: dict[str, Any] | None) -> str:
    if not cpu or cpu["wall"] <= 0:
        return "-"
    return f"{cpu['cpu']:.1f} / {cpu['wall']:.1f} = {cpu['cpu'] / cpu['wall']:.0%}"


def report(notes: Sequence[dict[str, Any]], target_ms: float, source_started: float | None) -> str:
    stages = stage_times(notes)
    if not stages:
        return "no complete marker trace"
    names = ["operator", "buffer", "flight", "queue", "total"]
    lines = [
        f"markers traced end to end: {len(stages)}; hops per marker: "
        f"{sorted({int(s['hops']) for s in stages.values()})}",
        "",
        "| stage (summed over hops) | p50 ms | p90 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        values = [s.get(name, 0.0) * 1000 for s in stages.values()]
        lines.append(
            f"| {name} | {bench.percentile(values, 50):.1f} | {bench.percentile(values, 90):.1f} "
            f"| {bench.percentile(values, 99):.1f} | {max(values):.1f} |"
        )
    if source_started is not None:
        later = [s["total"] * 1000 for m, s in stages.items() if m - source_started >= 1.0]
        if later:
            lines.append(
                f"| total, markers created 1 s or more after the source started ({len(later)}) "
                f"| {bench.percentile(later, 50):.1f} | {bench.percentile(later, 90):.1f} "
                f"| {bench.percentile(later, 99):.1f} | {max(later):.1f} |"
            )
    hop_count = max(int(s["hops"]) for s in stages.values())
    lines.append("")
    lines.append(
        "| hop (into receiver n) | buffer p50 / p99 ms | flight p50 / p99 ms "
        "| queue p50 / p99 ms | receiver's operator p50 / p99 ms |"
    )
    lines.append("|---|---:|---:|---:|---:|")
    for hop in range(1, hop_count + 1):
        cells = []
        for name in ("buffer", "flight", "queue", "operator"):
            values = [s.get(f"{name}@{hop}", 0.0) * 1000 for s in stages.values()]
            cells.append(f"{bench.percentile(values, 50):.1f} / {bench.percentile(values, 99):.1f}")
        lines.append(f"| {hop} | " + " | ".join(cells) + " |")
    slow = {m: s for m, s in stages.items() if s["total"] * 1000 > target_ms}
    lines.append("")
    lines.append(f"markers above the target ({target_ms:.0f} ms): {len(slow)} of {len(stages)}")
    if slow:
        share = {
            n: statistics.mean(s.get(n, 0.0) / s["total"] for s in slow.values())
            for n in names[:-1]
        }
        lines.append(
            "  mean share of their latency: " + ", ".join(f"{n} {share[n]:.0%}" for n in names[:-1])
        )
        barriers = sorted(n["t"] for n in notes if n["ev"] == "barrier")
        if barriers:

            def since_barrier(t: float) -> float:
                before = [b for b in barriers if b <= t]
                return (t - before[-1]) * 1000 if before else math.inf

            near = [since_barrier(m) for m in slow]
            within = sum(1 for x in near if x <= 200)
            base = sum(1 for m in stages if since_barrier(m) <= 200) / len(stages)
            lines.append(
                f"  created within 200 ms after a barrier was sent: {within} of {len(slow)} "
                f"(of all markers: {base:.0%})"
            )
        lines.extend(_by_checkpoint_phase(notes, stages))
        if source_started is not None:
            at = sorted((m - source_started, s["total"] * 1000) for m, s in slow.items())
            lines.append(
                "  when (s after the source started) and how long (ms): "
                + ", ".join(f"{t:.1f}s:{ms:.0f}" for t, ms in at[:40])
            )
            worst = sorted(slow.items(), key=lambda kv: -kv[1]["total"])[:5]
            lines.append("  the slowest, per hop (buffer/flight/queue ms):")
            for m, s in worst:
                hops = "; ".join(
                    f"hop {h} "
                    + "/".join(
                        f"{s.get(f'{n}@{h}', 0.0) * 1000:.0f}"
                        for n in ("buffer", "flight", "queue")
                    )
                    for h in range(1, int(s["hops"]) + 1)
                )
                lines.append(
                    f"    at {m - source_started:.2f}s: {s['total'] * 1000:.0f} ms: {hops}"
                )
    cpu: dict[int, dict[str, Any]] = {}
    for n in notes:
        if n["ev"] == "cpu" and n["wall"] >= cpu.get(n["pid"], {"wall": -1.0})["wall"]:
            cpu[n["pid"]] = n
    pauses = [n for n in notes if n["ev"] == "gc"]
    if pauses:
        lines.append("")
        lines.append(
            f"garbage collector pauses >= 1 ms: {len(pauses)}, "
            f"{sum(p['s'] for p in pauses) * 1000:.0f} ms in all, longest "
            f"{max(p['s'] for p in pauses) * 1000:.0f} ms"
        )
        per: dict[tuple[int, Any], list[float]] = defaultdict(list)
        freed: dict[tuple[int, Any], int] = defaultdict(int)
        for p in pauses:
            per[(p["pid"], p.get("gen"))].append(p["s"] * 1000)
            freed[(p["pid"], p.get("gen"))] += p.get("collected", 0)
        for (pid, gen), took in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            lines.append(
                f"  process {pid}, generation {gen}: {len(took)} pauses, "
                f"{sum(took):.0f} ms in all, longest {max(took):.0f} ms, "
                f"{freed[(pid, gen)]:,} objects freed"
            )
    census = [n for n in notes if n["ev"] == "census"]
    if census:
        lines.append("")
        lines.append("objects the collector tracks, per process every 3 s (the most of a type):")
        for n in sorted(census, key=lambda n: (n["pid"], n["t"])):
            top = ", ".join(f"{name} {count:,}" for name, count in n["top"][:5])
            lines.append(f"  {n['pid']} at {n['t'] - source_started:.0f}s: {n['all']:,}: {top}")
    messages = [n for n in notes if n["ev"] == "msg"]
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for n in messages:
        by_pid[n["pid"]].append(n)
    lines.append("")
    lines.append(
        "| sender process | messages | per s | items/message | KiB/message | kinds "
        "| CPU s / wall s |"
    )
    lines.append("|---|---:|---:|---:|---:|---|---:|")
    for pid, ms in sorted(by_pid.items()):
        span = max(m["t"] for m in ms) - min(m["t"] for m in ms)
        kinds: dict[str, int] = defaultdict(int)
        for m in ms:
            kinds[m["kind"]] += 1
        lines.append(
            f"| {pid} | {len(ms)} | {len(ms) / span if span > 0 else math.nan:.0f} "
            f"| {statistics.mean(m['items'] for m in ms):.2f} "
            f"| {statistics.mean(m['bytes'] for m in ms) / 1024:.0f} "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} "
            f"| {_busy(cpu.get(pid))} |"
        )
    receivers = sorted(set(cpu) - set(by_pid))
    for pid in receivers:
        lines.append(f"| {pid} (sends nothing) | | | | | | {_busy(cpu.get(pid))} |")
    total = sum(c["cpu"] for c in cpu.values())
    wall = max((c["wall"] for c in cpu.values()), default=0.0)
    if wall > 0:
        lines.append("")
        lines.append(
            f"subtask processes together: {total:.1f} CPU s over {wall:.1f} s "
            f"= {total / wall:.2f} cores (machine: {os.cpu_count()})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Where latency markers wait, hop by hop")
    parser.add_argument("--timeout-ms", type=int, default=0)
    parser.add_argument("--chaining", choices=("on", "off"), default="off")
    parser.add_argument("--parallelism", type=int, default=1)
    parser.add_argument("--fraction", type=float, default=0.5, help="of the measured maximum")
    parser.add_argument("--rate", type=float, default=None, help="rows/s (skips the maximum)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--marker-ms", type=int, default=50)
    parser.add_argument(
        "--batch-rows",
        type=int,
        default=None,
        help="source batch rows of the traced run (default: as the rate-limited source "
        "cuts them, 10 ms worth)",
    )
    parser.add_argument(
        "--channel-mib",
        type=float,
        default=None,
        help="per channel, MiB of batches buffered at the receiver and in flight "
        "(set_buffer_limits' channel_bytes; default: the runtime's)",
    )
    parser.add_argument(
        "--checkpoints",
        choices=("aligned", "unaligned", "off"),
        default="aligned",
        help="checkpoints of the traced run: EXACTLY_ONCE aligned as the benchmark's "
        "(default), unaligned, or none",
    )
    parser.add_argument(
        "--gc-threshold0",
        type=int,
        default=None,
        help="the young generation's collector threshold in subtask processes (default: "
        "the runtime's)",
    )
    parser.add_argument(
        "--gc-census",
        action="store_true",
        help="every 3 s, count the objects the collector tracks in each process, by type",
    )
    parser.add_argument(
        "--source-hold-s",
        type=float,
        default=0.0,
        help="sources start reading this long after their subtask started (to tell the "
        "start-up's share of the tail)",
    )
    parser.add_argument(
        "--unthrottled",
        action="store_true",
        help="trace the run without a rate limit (--rate then only sizes it)",
    )
    args = parser.parse_args(argv)
    print("command: python " + shlex.join(sys.argv if argv is None else [__file__, *argv]))
    print(f"load average: {bench.load_text()}", flush=True)

    trace_dir = tempfile.mkdtemp(prefix="rayflow-latency-trace-")
    storage = tempfile.mkdtemp(prefix="rayflow-latency-trace-ckpt-")
    os.chdir(HERE.parent)
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={
            "worker_process_setup_hook": install_tracing,
            "env_vars": {
                TRACE_DIR_ENV: trace_dir,
                ROOT_ENV: str(HERE.parent),
                **({GC_THRESHOLD_ENV: str(args.gc_threshold0)} if args.gc_threshold0 else {}),
                **({GC_TYPES_ENV: "1"} if args.gc_census else {}),
                **({SOURCE_HOLD_ENV: str(args.source_hold_s)} if args.source_hold_s else {}),
            },
        },
    )
    config = bench.Config(args.timeout_ms, args.chaining == "on", args.parallelism)

    def configure(env: Any) -> None:
        if args.channel_mib is not None:
            env.set_buffer_limits(channel_bytes=int(args.channel_mib * (1 << 20)))

    def configure_traced(env: Any) -> None:
        configure(env)
        if args.checkpoints == "unaligned":
            env.get_checkpoint_config().enable_unaligned_checkpoints()
        elif args.checkpoints == "off":
            env.get_checkpoint_config().interval_ms = None

    try:
        if args.rate is None:
            warm = bench.run_job(
                config, bench.WARM_UP_ROWS, storage, args.marker_ms, configure=configure
            )
            peak = bench.run_job(
                config, bench.rows_for(warm.rate, 3.0), storage, args.marker_ms, configure=configure
            )
            print(f"maximum: {peak.rate:,.0f} rows/s ({peak.batch_rows:,}-row batches)")
            rate = args.fraction * peak.rate
        else:
            rate = args.rate
        for path in glob.glob(os.path.join(trace_dir, "*.jsonl")):
            os.remove(path)
        started = time.time()
        outcome = bench.run_job(
            config,
            bench.rows_for(rate, args.seconds),
            storage,
            args.marker_ms,
            None if args.unthrottled else bench.source_rate(rate, args.parallelism, 1.0),
            args.batch_rows,
            configure_traced,
        )
        print(
            f"{config.label}: target {rate:,.0f} rows/s ({outcome.batch_rows:,}-row batches), "
            f"achieved {outcome.rate:,.0f}; JobResult.latency "
            + ", ".join(f"{k} {v:.1f}" for k, v in outcome.latency.items())
        )
        notes = load_notes(trace_dir)
        writes = [n["t"] for n in notes if n["ev"] == "write"]
        source_started = min(writes) if writes else started
        print()
        print(report(notes, bench.target_p99_ms(args.timeout_ms), source_started))
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
