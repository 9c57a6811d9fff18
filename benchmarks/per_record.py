"""Records per second of rayflow's per-record Python path (the peer workload's keyed reduce).

The job, written as in ``/work/shared/peers.md``::

    env.from_source(NumberSequenceSource(0, N - 1))
       .map(lambda r: {"key": r["value"] % 1000, "value": r["value"]})
       .key_by("key")
       .reduce(lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]})
       .sink_to(<counting sink>)

at parallelism 1 with EXACTLY_ONCE checkpoints every second. The sink counts records
and keeps the largest value per key; every run checks that the count is N and every
one of the 1000 sums is exact.

Two modes:

* ``job`` -- the whole job on Ray; the rate is N / wall seconds of ``env.execute()``
  (Ray already started, a small warm-up job first).
* ``chain`` -- no Ray: the job graph the environment builds, with every vertex's
  operators opened in this process and driven the way a subtask drives them (batches
  from the source's reader, each vertex's output handed to the next, every batch
  between vertices pickled and unpickled as the transport would, a snapshot of every
  operator every ``--snapshot-every`` batches), with the collector settings of a
  subtask's process (``--default-gc`` keeps Python's). Fast to iterate and to profile::

      py-spy record -o /tmp/chain.svg -- env PYTHONPATH=. python benchmarks/per_record.py chain

Benchmarks are never timed assertions. Run from the repository root, holding the lock::

    PYTHONPATH=. flock /tmp/bench.lock python benchmarks/per_record.py job --repeat 3
    PYTHONPATH=. python benchmarks/per_record.py chain --records 2000000

Ray's workers import rayflow from the directory the driver was started in (Ray adds it
to their path), not from the driver's ``PYTHONPATH`` alone: to time another checkout,
start from there (``cd <tree> && PYTHONPATH=<tree> python <this file> job``). The job
mode prints which rayflow the workers ran.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import pyarrow as pa

from rayflow import NumberSequenceSource, Sink, SinkContext, SinkWriter, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode
from rayflow.plan.partitioners import Partitioner
from rayflow.runtime.operators import OperatorContext

KEYS = 1000


class _MaxWriter(SinkWriter):
    """Counts records and keeps the largest ``value`` per ``key``."""

    def __init__(self) -> None:
        self.count = 0
        self.best: dict[Any, int] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        self.count += batch.num_rows
        grouped = pa.Table.from_batches([batch]).group_by("key", use_threads=False)
        top = grouped.aggregate([("value", "max")])
        best = self.best
        for k, v in zip(top.column("key").to_pylist(), top.column("value_max").to_pylist()):
            if v > best.get(k, -1):
                best[k] = v

    def finish(self) -> Any:
        import rayflow
        from rayflow.runtime import speedups

        loops = "C" if speedups.loaded() else "Python"
        return {
            "count": self.count,
            "best": self.best,
            "rayflow": f"{rayflow.__file__}, loops in {loops}",
        }


class MaxSink(Sink):
    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _MaxWriter()


def build(env: StreamExecutionEnvironment, records: int, sink: Sink) -> None:
    (
        env.from_source(NumberSequenceSource(0, records - 1), "numbers")
        .map(lambda r: {"key": r["value"] % KEYS, "value": r["value"]})
        .key_by("key")
        .reduce(lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]})
        .sink_to(sink)
    )


def make_env(
    storage: str, parallelism: int = 1, object_reuse: bool = False
) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    env.enable_checkpointing(1000, CheckpointingMode.EXACTLY_ONCE)
    env.get_checkpoint_config().set_checkpoint_storage(storage)
    if object_reuse:
        env.get_config().enable_object_reuse()
    return env


def check(records: int, result: dict[str, Any]) -> None:
    if result["count"] != records:
        raise AssertionError(f"sink saw {result['count']} records, expected {records}")
    for k in range(KEYS):
        n = len(range(k, records, KEYS))
        expected = n * k + KEYS * n * (n - 1) // 2
        if result["best"].get(k) != expected:
            raise AssertionError(f"key {k}: sum {result['best'].get(k)}, expected {expected}")


# --- whole job on Ray -------------------------------------------------------------------


def run_job(
    records: int, storage: str, parallelism: int, object_reuse: bool = False
) -> tuple[float, int, str]:
    sink = MaxSink()
    env = make_env(storage, parallelism, object_reuse)
    build(env, records, sink)
    started = time.perf_counter()
    result = env.execute("per-record")
    wall = time.perf_counter() - started
    merged: dict[str, Any] = {"count": 0, "best": {}}
    parts = result.sink_result(sink)
    for part in parts:
        merged["count"] += part["count"]
        for k, v in part["best"].items():
            merged["best"][k] = max(v, merged["best"].get(k, -1))
    check(records, merged)
    return wall, len(result.completed_checkpoints), parts[0]["rayflow"]


def job_mode(args: argparse.Namespace) -> None:
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    storage = tempfile.mkdtemp(prefix="per-record-chk-")
    try:
        # warm-up: worker processes, imports
        _, _, where = run_job(100_000, storage, args.parallelism, args.object_reuse)
        print(f"workers run {where}", flush=True)
        rates = []
        for i in range(args.repeat):
            wall, checkpoints, _ = run_job(
                args.records, storage, args.parallelism, args.object_reuse
            )
            rates.append(args.records / wall)
            print(
                f"run {i + 1}: {args.records:,} records in {wall:.2f} s = "
                f"{rates[-1] / 1e6:.3f} M records/s ({checkpoints} checkpoints)",
                flush=True,
            )
        print(
            f"job p={args.parallelism} N={args.records:,}: median "
            f"{statistics.median(rates) / 1e6:.3f} M records/s "
            f"(min {min(rates) / 1e6:.3f}, max {max(rates) / 1e6:.3f}); "
            f"load {os.getloadavg()[0]:.2f}"
        )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        ray.shutdown()


# --- the operator chain in this process ---------------------------------------------------


def _tune_gc_as_a_subtask() -> str:
    """The collector settings a subtask's actor process runs with (where this rayflow
    has them); returns them in words."""
    try:
        from rayflow.runtime.gc_tuning import tune_gc
    except ImportError:
        return f"gc thresholds {gc.get_threshold()} (this rayflow does not tune them)"
    tune_gc()
    return f"gc thresholds {gc.get_threshold()} (as a subtask's process)"


def run_chain(records: int, snapshot_every: int, object_reuse: bool = False) -> tuple[float, float]:
    sink = MaxSink()
    env = make_env(tempfile.gettempdir(), object_reuse=object_reuse)
    build(env, records, sink)
    graph = env.get_job_graph()
    order = graph.topological_order()
    chains: dict[int, list[Any]] = {}
    for vid in order:
        vertex = graph.vertices[vid]
        chains[vid] = []
        for spec in vertex.operators:
            op = spec.factory()
            op.open(
                OperatorContext(
                    job_name="per-record",
                    operator_name=spec.name,
                    operator_uid=spec.uid,
                    subtask_index=0,
                    parallelism=1,
                    max_parallelism=vertex.max_parallelism,
                    attempt=0,
                    checkpointing=True,
                    object_reuse=object_reuse,
                )
            )
            chains[vid].append(op)
    routers = {
        eid: Partitioner(edge.partitioner, 0, 1, graph.vertices[edge.target_vertex].max_parallelism)
        for eid, edge in graph.edges.items()
    }
    source_vertex = graph.vertices[order[0]]
    reader = source_vertex.source.create_reader(source_vertex.source.create_splits(1))

    spent: dict[str, float] = {}  # CPU seconds: the machine may be shared
    clock = time.process_time

    def process(vid: int, batch: pa.RecordBatch) -> None:
        batches = [batch]
        for spec, op in zip(graph.vertices[vid].operators, chains[vid]):
            t0 = clock()
            produced: list[pa.RecordBatch] = []
            for b in batches:
                produced.extend(op.process(b))
            spent[spec.name] = spent.get(spec.name, 0.0) + clock() - t0
            if not produced:
                return
            batches = produced
        for eid in graph.vertices[vid].out_edges:
            target = graph.edges[eid].target_vertex
            for b in batches:
                t0 = clock()
                parts = [
                    pickle.loads(pickle.dumps(part, pickle.HIGHEST_PROTOCOL))
                    for _, part in routers[eid].route(b)
                ]
                spent["(route+pickle)"] = spent.get("(route+pickle)", 0.0) + clock() - t0
                for part in parts:
                    process(target, part)

    started, cpu_started = time.perf_counter(), time.process_time()
    count = 0
    while True:
        t0 = clock()
        batch = reader.read_batch()
        spent["(source)"] = spent.get("(source)", 0.0) + clock() - t0
        if batch is None:
            break
        process(source_vertex.vertex_id, batch)
        count += 1
        if snapshot_every and count % snapshot_every == 0:
            for vid in order:
                for op in chains[vid]:
                    pickle.dumps(op.snapshot_state(count), pickle.HIGHEST_PROTOCOL)
    for vid in order:
        for op in chains[vid]:
            for batch in op.end_input():
                assert not batch.num_rows, "per-record operators end without output"
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    (sink_op,) = [op for ops in chains.values() for op in ops if hasattr(op, "writer")]
    check(records, sink_op.result())
    for vid in order:
        vertex = graph.vertices[vid]
        names = [spec.name for spec in vertex.operators]
        own = sum(spent.get(n, 0.0) for n in names)
        detail = ", ".join(f"{n} {spent.get(n, 0.0):.2f}" for n in names)
        print(f"  vertex [{vid}] {vertex.name}: {own:.2f} CPU s in operators ({detail})")
    transport = spent.get("(route+pickle)", 0.0)
    print(f"  source {spent['(source)']:.2f} CPU s, route+pickle {transport:.2f} CPU s")
    return elapsed, cpu


def chain_mode(args: argparse.Namespace) -> None:
    print(_tune_gc_as_a_subtask() if not args.default_gc else f"gc thresholds {gc.get_threshold()}")
    rates, cpu_rates = [], []
    for _ in range(args.repeat):
        elapsed, cpu = run_chain(args.records, args.snapshot_every, args.object_reuse)
        rates.append(args.records / elapsed)
        cpu_rates.append(args.records / cpu)
        print(
            f"{args.records:,} records in {elapsed:.2f} s ({cpu:.2f} CPU s) = "
            f"{rates[-1] / 1e6:.3f} M records/s ({cpu_rates[-1] / 1e6:.3f} per CPU s)"
        )
    print(
        f"chain N={args.records:,}: median {statistics.median(rates) / 1e6:.3f} M records/s, "
        f"{statistics.median(cpu_rates) / 1e6:.3f} M per CPU second; "
        f"load {os.getloadavg()[0]:.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["job", "chain"])
    parser.add_argument("--records", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--parallelism", type=int, default=1)
    parser.add_argument("--snapshot-every", type=int, default=100)
    parser.add_argument(
        "--object-reuse",
        action="store_true",
        help="operators do not copy the records they emit (ExecutionConfig)",
    )
    parser.add_argument(
        "--default-gc",
        action="store_true",
        help="chain: keep Python's collector settings (not a subtask's)",
    )
    args = parser.parse_args(argv)
    if args.records is None:
        args.records = 10_000_000 if args.mode == "job" else 2_000_000
    if args.mode == "job":
        job_mode(args)
    else:
        chain_mode(args)


if __name__ == "__main__":
    sys.exit(main())
