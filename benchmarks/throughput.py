"""Throughput of rayflow's data plane, next to a bare Ray actor chain moving the same data.

What it measures, in rows per second, for pyarrow RecordBatches of one int64
column ``value`` at 10k and 100k rows per batch:

* **bare reference** -- three plain async Ray actors, source -> relay -> sink,
  no engine. The source builds its batches exactly as ``NumberSequenceSource``
  does and each hop keeps up to 16 ``.remote()`` calls in flight (a deque of
  ObjectRefs; the oldest is awaited when 16 are outstanding). This is what Ray
  alone costs per hop: the floor any engine on Ray pays. It sends one batch per
  call, or as many per call (a list) as the engine's source sent with its default
  output buffering, so that both move the same bytes per call.
* **passthrough-chained** -- source -> map_batches(identity) -> sink, chained
  into one actor per subtask (no Ray call per batch).
* **passthrough-3actor** -- the same job with ``disable_operator_chaining()``,
  so every hop is a Ray call: the like-for-like comparison with the bare chain,
  with buffer timeout 0 (every batch sent at once, against one batch per call) and
  with the default 100 ms (output buffering, against the bare chain sending as many
  batches per call as the engine did).
* **keyed-sum** -- source -> map_batches(key = value % 1000) ->
  key_by("key").sum("value") -> sink (a hash-partitioned exchange).

Every engine pipeline runs at parallelism 1 and 2. The sink discards its input;
it only notes the time of every batch it is given. Reported per pipeline:

* ``rows/s (duration_s)`` = rows / ``JobResult.duration_s``. That is the job
  master's ``run()``, which includes creating the subtask actors (a fresh worker
  process each), so for jobs of a few seconds it is dominated by deployment.
  For the bare chain: the driver's time for the source's ``run`` call, with the
  actors already up.
* ``steady rows/s`` = the data-plane rate without deployment, start-up or
  drain, taken the same way for the bare chain and the engine: the middle 80%
  of all batches arriving at the sink(s) (10th to 90th percentile of arrival
  times, over all sink subtasks together), as rows per second of input.
* ``wall s`` = driver wall time of ``env.execute`` (plan, deploy, run, teardown);
  for the bare chain, the timed call only.

Run-to-run noise on a small machine is large (+-25% between identical runs), so
the bare chain and ``passthrough-3actor`` at parallelism 1 -- the headline
comparison -- run ``--repeat`` times, interleaved so that drift hits both, and
report the median with the range; everything else runs once (to stay within a
few minutes). The ratio columns divide the engine's rate by the bare chain's
median at the same batch size. A small engine job runs first as a warm-up.

Benchmarks are never timed assertions. Run from the repository root::

    python benchmarks/throughput.py [--rows N] [--quick] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
from collections import deque
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from rayflow import NumberSequenceSource, Sink, SinkContext, SinkWriter, StreamExecutionEnvironment

BATCH_SIZES = (10_000, 100_000)
DEFAULT_ROWS = {10_000: 4_000_000, 100_000: 20_000_000}
IN_FLIGHT = 16  # calls in flight per hop in the bare chain
PIPELINES = ("passthrough-chained", "passthrough-3actor", "keyed-sum")
REPEATED = "passthrough-3actor"
DEFAULT_TIMEOUT_MS = 100  # the engine's default buffer timeout
STEADY_TRIM = 0.10  # arrivals left out at each end for the steady rate


# --- arrival timing (shared by the bare chain and the engine's sink) ----------------------


def steady_rate(arrival_times: list[float], rows: int) -> float:
    """Input rows per second over the middle of the arrivals (see module docstring).

    ``arrival_times`` are the ``time.time()`` of every batch written to the sink(s),
    each standing for an equal share of the ``rows`` of input.
    """
    times = sorted(arrival_times)
    n = len(times)
    if n < 2:
        return float("nan")
    lo = int(n * STEADY_TRIM)
    hi = n - 1 - lo
    if times[hi] <= times[lo]:
        lo, hi = 0, n - 1
    return rows * (hi - lo) / n / (times[hi] - times[lo])


class _DiscardWriter(SinkWriter):
    def __init__(self) -> None:
        self.rows = 0
        self.times: list[float] = []

    def write(self, batch: pa.RecordBatch) -> None:
        self.times.append(time.time())
        self.rows += batch.num_rows

    def finish(self) -> Any:
        return {"rows": self.rows, "times": self.times}


class DiscardSink(Sink):
    """Throws every batch away; its result is how many rows it got and when each batch came."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _DiscardWriter()

    def merge_results(self, results: list[Any]) -> Any:
        return {
            "rows": sum(r["rows"] for r in results if r),
            "times": [t for r in results if r for t in r["times"]],
        }


# --- the bare Ray reference -----------------------------------------------------------------


def _make_batch(lo: int, hi: int) -> pa.RecordBatch:
    # Built exactly as NumberSequenceSource's reader builds its batches.
    return pa.RecordBatch.from_arrays(
        [pa.array(np.arange(lo, hi, dtype=np.int64))], names=["value"]
    )


@ray.remote
class BareSink:
    def __init__(self) -> None:
        self.rows = 0
        self.times: list[float] = []

    async def push(self, batches: list[pa.RecordBatch]) -> None:
        now = time.time()
        for batch in batches:
            self.times.append(now)
            self.rows += batch.num_rows

    async def take(self) -> dict[str, Any]:
        out = {"rows": self.rows, "times": self.times}
        self.rows, self.times = 0, []
        return out


@ray.remote
class BareRelay:
    def __init__(self, downstream: Any) -> None:
        self.downstream = downstream
        self.in_flight: deque = deque()

    async def push(self, batches: list[pa.RecordBatch]) -> None:
        while len(self.in_flight) >= IN_FLIGHT:
            await self.in_flight.popleft()
        self.in_flight.append(self.downstream.push.remote(batches))

    async def flush(self) -> None:
        while self.in_flight:
            await self.in_flight.popleft()


@ray.remote
class BareSource:
    def __init__(self, downstream: Any) -> None:
        self.downstream = downstream

    async def run(self, rows: int, batch_size: int, per_call: int = 1) -> None:
        in_flight: deque = deque()
        call: list[pa.RecordBatch] = []
        for lo in range(0, rows, batch_size):
            call.append(_make_batch(lo, min(rows, lo + batch_size)))
            if len(call) < per_call and lo + batch_size < rows:
                continue
            while len(in_flight) >= IN_FLIGHT:
                await in_flight.popleft()
            in_flight.append(self.downstream.push.remote(call))
            call = []
            await asyncio.sleep(0)
        while in_flight:
            await in_flight.popleft()
        await self.downstream.flush.remote()


class BareChain:
    """source -> relay -> sink as plain actors, created once and reused across runs."""

    def __init__(self) -> None:
        self.sink = BareSink.remote()
        self.relay = BareRelay.remote(self.sink)
        self.source = BareSource.remote(self.relay)
        ray.get(
            [self.sink.take.remote(), self.relay.flush.remote(), self.source.__ray_ready__.remote()]
        )

    def run(self, rows: int, batch_size: int, per_call: int = 1) -> dict[str, Any]:
        started = time.perf_counter()
        ray.get(self.source.run.remote(rows, batch_size, per_call))
        elapsed = time.perf_counter() - started
        arrivals = ray.get(self.sink.take.remote())
        if arrivals["rows"] != rows:
            raise RuntimeError(f"bare chain delivered {arrivals['rows']} rows, expected {rows}")
        return {
            "rows_per_s": rows / elapsed,
            "steady_rows_per_s": steady_rate(arrivals["times"], rows),
            "wall_s": elapsed,
            "actors": 3,
        }

    def close(self) -> None:
        for actor in (self.source, self.relay, self.sink):
            ray.kill(actor)


# --- the engine -----------------------------------------------------------------------------


def _identity(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def _add_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    value = batch.column(0)
    return pa.RecordBatch.from_arrays([value, pc.remainder(value, 1000)], names=["value", "key"])


def engine_job(
    kind: str, rows: int, batch_size: int, parallelism: int, buffer_timeout_ms: int | None = None
) -> dict[str, Any]:
    env = StreamExecutionEnvironment()
    env.set_parallelism(parallelism)
    env.set_data_transport(DATA_TRANSPORT)
    if buffer_timeout_ms is not None:
        env.set_buffer_timeout(buffer_timeout_ms)
    if kind == "passthrough-3actor":
        env.disable_operator_chaining()
    stream = env.from_source(NumberSequenceSource(0, rows - 1, batch_size=batch_size), "Source")
    if kind == "keyed-sum":
        stream = stream.map_batches(_add_key, "AddKey").key_by("key").sum("value", "Sum")
    else:
        stream = stream.map_batches(_identity, "Identity")
    stream.sink_to(DiscardSink(), "Discard")

    started = time.perf_counter()
    result = env.execute(f"throughput-{kind}-{batch_size}-p{parallelism}")
    wall = time.perf_counter() - started

    arrivals = result.sink_result("Discard")
    got = result.records_in("Sum") if kind == "keyed-sum" else arrivals["rows"]
    if got != rows:
        raise RuntimeError(f"{kind}: {got} rows arrived, expected {rows}")
    sources = [m for m in result.metrics if m["vertex"].startswith("Source")]
    messages = sum(m.get("data_messages_out", m["batches_out"]) for m in sources)
    return {
        "rows_per_s": rows / result.duration_s,
        "steady_rows_per_s": steady_rate(arrivals["times"], rows),
        "wall_s": wall,
        "actors": len(result.metrics),
        "per_call": sum(m["batches_out"] for m in sources) / max(messages, 1),
    }


# --- main -----------------------------------------------------------------------------------


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [r["steady_rows_per_s"] for r in runs]
    return {
        "rows_per_s": statistics.median(r["rows_per_s"] for r in runs),
        "steady_rows_per_s": statistics.median(steady),
        "steady_min": min(steady),
        "steady_max": max(steady),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "actors": runs[0]["actors"],
        "runs": len(runs),
        "per_call": statistics.median(r.get("per_call", 1.0) for r in runs),
    }


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def _load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _short(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="rayflow throughput next to a bare Ray actor chain (rows/s)"
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows per run, for every batch size (default: 4,000,000 for 10k-row batches, "
        "20,000,000 for 100k-row batches)",
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the rows")
    parser.add_argument(
        "--transport",
        choices=["socket", "ray"],
        default="socket",
        help="how the engine's subtasks send data (set_data_transport; default socket)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help=f"runs of the bare chain and of {REPEATED} at parallelism 1 "
        "(median reported; default 3)",
    )
    args = parser.parse_args(argv)
    global DATA_TRANSPORT
    DATA_TRANSPORT = args.transport
    repeat = max(1, args.repeat)

    def rows_for(batch_size: int) -> int:
        rows = args.rows if args.rows is not None else DEFAULT_ROWS[batch_size]
        return max(10 * batch_size, rows // 4 if args.quick else rows)

    command = "python " + shlex.join(
        sys.argv if argv is None else ["benchmarks/throughput.py", *argv]
    )
    machine = (
        f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), Ray {ray.__version__}, "
        f"pyarrow {pa.__version__}, Python {sys.version.split()[0]}"
    )
    print(f"command: {command}")
    print(f"machine: {machine}")
    print(f"load average at start (1/5/15 min): {_load()}", flush=True)

    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    total_started = time.perf_counter()

    def log(name: str, batch_size: int, parallelism: int, r: dict[str, Any]) -> None:
        print(
            f"  {name:<19} {batch_size:>6} rows/batch p={parallelism}: "
            f"{_rate(r['rows_per_s']):>10} rows/s, steady {_rate(r['steady_rows_per_s']):>10}, "
            f"wall {r['wall_s']:.2f}s",
            flush=True,
        )

    # Warm-up: one small engine job (worker start-up, imports, first calls).
    engine_job("passthrough-3actor", 20_000, 1_000, 1)

    # The bare chain and the 3-actor engine chain at parallelism 1, interleaved: the
    # engine sending every batch at once (buffer timeout 0) next to the bare chain
    # sending one batch per call, and the engine with its default output buffering next
    # to the bare chain sending as many batches per call as the engine's source did.
    bare: dict[tuple[int, int], dict[str, Any]] = {}
    repeated: dict[tuple[int, int], dict[str, Any]] = {}
    chain = BareChain()
    chain.run(20 * BATCH_SIZES[0], BATCH_SIZES[0])  # warm the call paths
    for batch_size in BATCH_SIZES:
        rows = rows_for(batch_size)
        per_call = max(1, round(engine_job(REPEATED, rows // 4, batch_size, 1)["per_call"]))
        print(f"  default buffering sends {per_call} batch(es) per call", flush=True)
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for _ in range(repeat):
            for timeout_ms, k in ((0, 1), (DEFAULT_TIMEOUT_MS, per_call)):
                r = chain.run(rows, batch_size, k)
                runs.setdefault(("bare", timeout_ms), []).append(r)
                log(f"bare chain x{k}", batch_size, 1, r)
                r = engine_job(REPEATED, rows, batch_size, 1, timeout_ms)
                runs.setdefault(("engine", timeout_ms), []).append(r)
                log(f"{REPEATED} {timeout_ms}ms", batch_size, 1, r)
        for timeout_ms in (0, DEFAULT_TIMEOUT_MS):
            bare[batch_size, timeout_ms] = _median_of(runs["bare", timeout_ms])
            bare[batch_size, timeout_ms]["per_call"] = 1 if timeout_ms == 0 else per_call
            repeated[batch_size, timeout_ms] = _median_of(runs["engine", timeout_ms])
    chain.close()

    results: list[tuple[str, int, int, dict[str, Any]]] = []
    for kind in PIPELINES:
        for batch_size in BATCH_SIZES:
            for parallelism in (1, 2):
                if kind == REPEATED and parallelism == 1:
                    continue
                else:
                    r = _median_of(
                        [engine_job(kind, rows_for(batch_size), batch_size, parallelism)]
                    )
                    log(kind, batch_size, parallelism, r)
                results.append((kind, batch_size, parallelism, r))
    total = time.perf_counter() - total_started
    load_at_end = _load()

    print()
    print(f"command: `{command}`")
    print(f"machine: {machine}")
    print()
    print(
        "| pipeline | batch rows | batches per call | parallelism | actors | rows | runs "
        "| rows/s (duration_s) | steady rows/s | steady min-max | wall s | vs bare: rows/s "
        "| vs bare: steady |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def row(
        name: str,
        batch_size: int,
        parallelism: int,
        r: dict[str, Any],
        ratio: str = "",
        steady_ratio: str = "",
    ) -> None:
        spread = f"{_short(r['steady_min'])}-{_short(r['steady_max'])}" if r["runs"] > 1 else ""
        print(
            f"| {name} | {batch_size:,} | {r.get('per_call', 1):.1f} | {parallelism} "
            f"| {r['actors']} "
            f"| {rows_for(batch_size):,} | {r['runs']} | {_rate(r['rows_per_s'])} "
            f"| {_rate(r['steady_rows_per_s'])} | {spread} | {r['wall_s']:.2f} "
            f"| {ratio} | {steady_ratio} |"
        )

    for (batch_size, timeout_ms), b in bare.items():
        row("bare Ray chain (reference)", batch_size, 1, b, "1.00", "1.00")
        r = repeated[batch_size, timeout_ms]
        row(
            f"{REPEATED}, buffer timeout {timeout_ms} ms",
            batch_size,
            1,
            r,
            f"{r['rows_per_s'] / b['rows_per_s']:.2f}",
            f"{r['steady_rows_per_s'] / b['steady_rows_per_s']:.2f}",
        )
    for kind, batch_size, parallelism, r in results:
        row(kind, batch_size, parallelism, r)
    print()
    print(
        f"total benchmark time (after ray.init): {total:.0f}s; "
        f"load average at end: {load_at_end} (other work on the machine skews every number)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
