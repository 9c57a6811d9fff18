"""Throughput of rayflow's data plane, next to a bare Ray actor chain moving the same data.

What it measures (rows per second, one int64 column ``value`` in pyarrow
RecordBatches of 1k and 10k rows):

* **bare reference** -- three plain async Ray actors, source -> relay -> sink,
  no engine: the source builds the batches the way ``NumberSequenceSource``
  does, and each hop keeps up to 16 ``.remote()`` calls in flight (a deque of
  ObjectRefs; the oldest is awaited when 16 are outstanding). This is what Ray
  alone costs per hop, the floor any engine on Ray pays.
* **engine, pass-through chained** -- source -> map_batches(identity) -> sink,
  all chained into one actor per subtask (no Ray call per batch).
* **engine, pass-through 3 actors** -- the same job with
  ``disable_operator_chaining()``, so each hop is a Ray call: the
  apples-to-apples comparison with the bare chain (ratio column).
* **engine, keyed sum** -- source -> map_batches(key = value % 1000) ->
  key_by("key").sum("value") -> sink (a hash-partitioned exchange).

Each engine pipeline runs at parallelism 1 and 2. The sink discards its input:
it only counts rows and notes when its first and last batch arrived.
Reported per run:

* ``rows/s`` = rows / ``JobResult.duration_s``. That is the job master's
  ``run()``, so it includes creating the subtask actors (a new worker process
  each, about a second apiece on a 2-core machine): what a user of
  ``execute`` sees for a job of this size. For the bare chain: driver time of
  the source's ``run`` call, actors already up.
* ``steady rows/s`` = rows after the first batch / (last batch at a sink -
  first batch at a sink), measured the same way for the bare chain and the
  engine: the data-plane rate without deployment. With parallelism 2 the window
  runs from the earliest first batch of any sink subtask to the latest last
  one, so start-up skew between the subtasks counts against the engine.
* ``wall s`` = driver wall time of ``env.execute`` (plan, deploy, run, teardown).

The ratio columns compare the 3-actor engine chain with the bare 3-actor chain
at the same batch size; the steady ratio is the like-for-like one.

A small job runs first as a warm-up so that Ray worker start-up is not billed
to the first measurement. Benchmarks are never timed assertions; run as::

    python benchmarks/throughput.py [--rows N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from collections import deque
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from rayflow import NumberSequenceSource, Sink, SinkContext, SinkWriter, StreamExecutionEnvironment

BATCH_SIZES = (10_000, 1_000)
DEFAULT_ROWS = {10_000: 2_000_000, 1_000: 1_000_000}
IN_FLIGHT = 16


# --- a sink that discards ---------------------------------------------------------------


class _Arrivals:
    """Rows seen by one sink and when the first and the last batch arrived (``time.time()``)."""

    def __init__(self) -> None:
        self.rows = 0
        self.first_at: float | None = None
        self.last_at: float | None = None

    def add(self, rows: int) -> None:
        now = time.time()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.rows += rows

    def result(self) -> dict[str, Any]:
        return {"rows": self.rows, "first_at": self.first_at, "last_at": self.last_at}


def merge_arrivals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several sinks' arrivals as one: total rows, earliest first batch, latest last batch."""
    seen = [r for r in results if r and r["first_at"] is not None]
    return {
        "rows": sum(r["rows"] for r in results if r),
        "first_at": min((r["first_at"] for r in seen), default=None),
        "last_at": max((r["last_at"] for r in seen), default=None),
    }


def steady_seconds(arrivals: dict[str, Any]) -> float:
    """First to last batch at the sink(s): the data flow without deployment or start-up."""
    return arrivals["last_at"] - arrivals["first_at"]


class _CountingWriter(SinkWriter):
    def __init__(self) -> None:
        self.arrivals = _Arrivals()

    def write(self, batch: pa.RecordBatch) -> None:
        self.arrivals.add(batch.num_rows)

    def finish(self) -> Any:
        return self.arrivals.result()


class DiscardSink(Sink):
    """Throws every batch away; its result is how many rows it got, and when."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _CountingWriter()

    def merge_results(self, results: list[Any]) -> Any:
        return merge_arrivals(results)


# --- the bare Ray reference -----------------------------------------------------------------


def _make_batch(lo: int, hi: int) -> pa.RecordBatch:
    # Built exactly as NumberSequenceSource's reader builds its batches.
    return pa.RecordBatch.from_arrays([pa.array(range(lo, hi), type=pa.int64())], names=["value"])


@ray.remote
class BareSink:
    def __init__(self) -> None:
        self.arrivals = _Arrivals()

    async def push(self, batch: pa.RecordBatch) -> None:
        self.arrivals.add(batch.num_rows)

    async def count(self) -> dict[str, Any]:
        return self.arrivals.result()

    async def reset(self) -> None:
        self.arrivals = _Arrivals()


@ray.remote
class BareRelay:
    def __init__(self, downstream: Any) -> None:
        self.downstream = downstream
        self.in_flight: deque = deque()

    async def push(self, batch: pa.RecordBatch) -> None:
        while len(self.in_flight) >= IN_FLIGHT:
            await self.in_flight.popleft()
        self.in_flight.append(self.downstream.push.remote(batch))

    async def flush(self) -> None:
        while self.in_flight:
            await self.in_flight.popleft()


@ray.remote
class BareSource:
    def __init__(self, downstream: Any) -> None:
        self.downstream = downstream

    async def run(self, rows: int, batch_size: int) -> None:
        in_flight: deque = deque()
        for lo in range(0, rows, batch_size):
            batch = _make_batch(lo, min(rows, lo + batch_size))
            while len(in_flight) >= IN_FLIGHT:
                await in_flight.popleft()
            in_flight.append(self.downstream.push.remote(batch))
            await asyncio.sleep(0)
        while in_flight:
            await in_flight.popleft()
        await self.downstream.flush.remote()


def bare_chain(rows: int, batch_size: int) -> dict[str, Any]:
    sink = BareSink.remote()
    relay = BareRelay.remote(sink)
    source = BareSource.remote(relay)
    ray.get([sink.count.remote(), relay.flush.remote(), source.__ray_ready__.remote()])
    # warm the call paths once, then measure
    ray.get(source.run.remote(20 * batch_size, batch_size))
    ray.get(sink.reset.remote())
    started = time.perf_counter()
    ray.get(source.run.remote(rows, batch_size))
    elapsed = time.perf_counter() - started
    arrivals = ray.get(sink.count.remote())
    for actor in (source, relay, sink):
        ray.kill(actor)
    if arrivals["rows"] != rows:
        raise RuntimeError(f"bare chain delivered {arrivals['rows']} rows, expected {rows}")
    return {
        "seconds": elapsed,
        "rows_per_s": rows / elapsed,
        "steady_rows_per_s": (rows - batch_size) / steady_seconds(arrivals),
    }


# --- the engine -----------------------------------------------------------------------------


def _identity(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def _add_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    key = pc.remainder(batch.column(0), 1000)
    return pa.RecordBatch.from_arrays([batch.column(0), key], names=["value", "key"])


def engine_job(kind: str, rows: int, batch_size: int, parallelism: int) -> dict[str, Any]:
    env = StreamExecutionEnvironment()
    env.set_parallelism(parallelism)
    if kind == "passthrough-3actor":
        env.disable_operator_chaining()
    stream = env.from_source(NumberSequenceSource(0, rows - 1, batch_size=batch_size), "Source")
    sink = DiscardSink()
    if kind == "keyed-sum":
        stream.map_batches(_add_key, "AddKey").key_by("key").sum("value", "Sum").sink_to(
            sink, "Discard"
        )
    else:
        stream.map_batches(_identity, "Identity").sink_to(sink, "Discard")
    wall_started = time.perf_counter()
    result = env.execute(f"throughput-{kind}-{batch_size}-p{parallelism}")
    wall = time.perf_counter() - wall_started

    arrivals = result.sink_result("Discard")
    got = result.records_in("Sum") if kind == "keyed-sum" else arrivals["rows"]
    if got != rows:
        raise RuntimeError(f"{kind}: {got} rows arrived, expected {rows}")
    return {
        "duration_s": result.duration_s,
        "rows_per_s": rows / result.duration_s,
        "steady_rows_per_s": (rows - batch_size) / steady_seconds(arrivals),
        "wall_s": wall,
        "actors": len(result.metrics),
    }


PIPELINES = ("passthrough-chained", "passthrough-3actor", "keyed-sum")


# --- main -----------------------------------------------------------------------------------


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="rayflow throughput vs a bare Ray actor chain (rows/s)"
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows per run, for every batch size (default: 2,000,000 for 10k-row batches, "
        "1,000,000 for 1k-row batches)",
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the rows")
    args = parser.parse_args(argv)

    def rows_for(batch_size: int) -> int:
        rows = args.rows if args.rows is not None else DEFAULT_ROWS[batch_size]
        return max(2 * batch_size, rows // 4 if args.quick else rows)

    command = "python " + shlex.join(
        sys.argv if argv is None else ["benchmarks/throughput.py", *argv]
    )
    machine = (
        f"{os.cpu_count()} CPUs, Ray {ray.__version__}, pyarrow {pa.__version__}, "
        f"Python {sys.version.split()[0]}"
    )
    print(f"command: {command}")
    print(f"machine: {machine}", flush=True)

    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    total_started = time.perf_counter()

    # Warm-up: one small job through the engine (worker start-up, imports, first calls).
    engine_job("passthrough-3actor", 20_000, 1_000, 1)

    bare: dict[int, dict[str, Any]] = {}
    for batch_size in BATCH_SIZES:
        b = bare_chain(rows_for(batch_size), batch_size)
        bare[batch_size] = b
        print(f"  bare chain          {batch_size:>6} rows/batch    : "
              f"{_fmt_rate(b['rows_per_s'])} rows/s (steady {_fmt_rate(b['steady_rows_per_s'])})",
              flush=True)

    runs: list[tuple[str, int, int, dict[str, Any]]] = []
    for kind in PIPELINES:
        for batch_size in BATCH_SIZES:
            for parallelism in (1, 2):
                r = engine_job(kind, rows_for(batch_size), batch_size, parallelism)
                runs.append((kind, batch_size, parallelism, r))
                print(f"  {kind:<19} {batch_size:>6} rows/batch p={parallelism}: "
                      f"{_fmt_rate(r['rows_per_s'])} rows/s "
                      f"(steady {_fmt_rate(r['steady_rows_per_s'])}, wall {r['wall_s']:.2f}s)",
                      flush=True)
    total = time.perf_counter() - total_started

    print()
    print(f"command: `{command}`")
    print(f"machine: {machine}")
    print()
    print("| pipeline | batch rows | parallelism | actors | rows | rows/s (duration_s) "
          "| steady rows/s | wall s | vs bare, rows/s | vs bare, steady |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch_size in BATCH_SIZES:
        b = bare[batch_size]
        print(f"| bare Ray chain (reference) | {batch_size:,} | 1 | 3 | {rows_for(batch_size):,} "
              f"| {_fmt_rate(b['rows_per_s'])} | {_fmt_rate(b['steady_rows_per_s'])} "
              f"| {b['seconds']:.2f} | 1.00 | 1.00 |")
    for kind, batch_size, parallelism, r in runs:
        ratio = steady_ratio = ""
        if kind == "passthrough-3actor":
            b = bare[batch_size]
            ratio = f"{r['rows_per_s'] / b['rows_per_s']:.2f}"
            steady_ratio = f"{r['steady_rows_per_s'] / b['steady_rows_per_s']:.2f}"
        print(f"| {kind} | {batch_size:,} | {parallelism} | {r['actors']} "
              f"| {rows_for(batch_size):,} | {_fmt_rate(r['rows_per_s'])} "
              f"| {_fmt_rate(r['steady_rows_per_s'])} | {r['wall_s']:.2f} "
              f"| {ratio} | {steady_ratio} |")
    print()
    print(f"total benchmark time (after ray.init): {total:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
