"""Job start: where the time goes between ``env.execute()`` and the first batch at the sink.

Runs the keyed running sum of the peer workload (``NumberSequenceSource`` ->
``map_batches`` adding ``key = value % 1000`` -> ``key_by("key").sum("value")`` ->
sink), EXACTLY_ONCE checkpoints every 1 s to a fresh local directory, at parallelism 1
and 2, on a local Ray that was started before (``ray.init(address="local")``; the
idle workers Ray starts for a new driver are given time to come up first). Every job
is timed by phase, on one clock (``time.time()`` of this machine):

* **master up**: ``execute()`` called -> the job master's ``run()`` starts
  (``JobResult.started_at``): run lock, checkpoint storage, the job master's process;
* **subtasks ready**: -> the last subtask's ``run()`` starts (its metrics'
  ``started_at``): every subtask actor created and constructed;
* **first batch**: -> the sink's writer writes its first batch (it records
  ``time.time()`` and hands it back in its result);
* **job end**: -> the job master's ``run()`` ends (``JobResult.finished_at``);
* **returned**: -> ``execute()`` returns (tear-down, result).

Columns are cumulative seconds from the ``execute()`` call. The first job after
``ray.init`` is reported on its own (``cold``); then ``--runs`` jobs per parallelism,
interleaved (p=1, p=2, p=1, ...), ``--gap-s`` apart, and their median. ``rows/s`` is
rows / (``execute()`` call -> return), the peer workload's whole-job figure when
``--rows 2000000``.

Benchmarks are never timed assertions. Run from the root of the repository whose rayflow
is measured (Ray workers import rayflow from the driver's working directory; the script
checks that they import the driver's), holding the machine-wide benchmark lock::

    PYTHONPATH=. flock /tmp/bench.lock python benchmarks/job_start.py [--rows N] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from rayflow import (
    CheckpointingMode,
    NumberSequenceSource,
    Sink,
    SinkContext,
    SinkWriter,
    StreamExecutionEnvironment,
)

PHASES = ("master up", "subtasks ready", "first batch", "job end", "returned")


class _FirstWriteWriter(SinkWriter):
    def __init__(self) -> None:
        self.first: float | None = None
        self.rows = 0
        self.sums: dict[int, int] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        if self.first is None:
            self.first = time.time()
        self.rows += batch.num_rows
        # a key's running sums reach one subtask, in order, and only grow: the last is
        # the largest
        self.sums.update(zip(batch.column("key").to_pylist(), batch.column("value").to_pylist()))

    def finish(self) -> Any:
        import rayflow

        return {
            "first": self.first,
            "rows": self.rows,
            "sums": self.sums,
            "rayflow": os.path.dirname(rayflow.__file__),
        }


class FirstWriteSink(Sink):
    """Keeps the largest running sum per key and the time of its first write."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _FirstWriteWriter()

    def merge_results(self, results: list[Any]) -> Any:
        firsts = [r["first"] for r in results if r and r["first"] is not None]
        sums: dict[int, int] = {}
        for r in results:
            if r:
                for k, v in r["sums"].items():
                    sums[k] = max(v, sums.get(k, -1))
        return {
            "first": min(firsts) if firsts else None,
            "rows": sum(r["rows"] for r in results if r),
            "sums": sums,
            "rayflow": sorted({r["rayflow"] for r in results if r}),
        }


#: how the jobs' subtasks send data (``--transport``)
DATA_TRANSPORT = "socket"


def _add_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    value = batch.column(0)
    return pa.RecordBatch.from_arrays([value, pc.remainder(value, 1000)], names=["value", "key"])


def expected_sums(rows: int, keys: int = 1000) -> dict[int, int]:
    """The final running sum of every key of ``value = 0..rows-1``, ``key = value % keys``."""
    out = {}
    for k in range(min(keys, rows)):
        n = (rows - 1 - k) // keys + 1  # values k, k + keys, ..., below rows
        out[k] = n * k + keys * n * (n - 1) // 2
    return out


def phases_of(called: float, returned: float, result: Any, first: float | None) -> list[float]:
    """Cumulative seconds from the ``execute()`` call to the end of each of ``PHASES``."""
    ready = max(m["started_at"] for m in result.metrics)
    marks = [result.started_at, ready, first if first is not None else float("nan")]
    marks += [result.finished_at, returned]
    return [m - called for m in marks]


def run_job(rows: int, parallelism: int, storage: str, batch_size: int) -> dict[str, Any]:
    env = StreamExecutionEnvironment()
    env.set_data_transport(DATA_TRANSPORT)
    env.set_parallelism(parallelism)
    env.enable_checkpointing(1000, CheckpointingMode.EXACTLY_ONCE)
    env.get_checkpoint_config().set_checkpoint_storage(storage)
    sink = FirstWriteSink()
    (
        env.from_source(NumberSequenceSource(0, rows - 1, batch_size=batch_size), "Source")
        .map_batches(_add_key, "AddKey")
        .key_by("key")
        .sum("value", "Sum")
        .sink_to(sink, "Sink")
    )
    called = time.time()
    result = env.execute(f"job-start-p{parallelism}")
    returned = time.time()
    out = result.sink_result("Sink")
    if out["sums"] != expected_sums(rows):
        raise RuntimeError(f"p={parallelism}: wrong sums")
    import rayflow

    if out["rayflow"] != [os.path.dirname(rayflow.__file__)]:
        raise RuntimeError(
            f"workers import rayflow from {out['rayflow']}, the driver from "
            f"{os.path.dirname(rayflow.__file__)}: run from its repository root"
        )
    return {
        "phases": phases_of(called, returned, result, out["first"]),
        "rows_per_s": rows / (returned - called),
        "checkpoints": len(result.completed_checkpoints),
    }


def fresh_idle_workers() -> int | None:
    """Never-used idle worker processes on this node (what a new actor can take without
    a process start), from the raylet's node stats; None where that is not available."""
    try:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

        ctx = ray.get_runtime_context()
        node = next(n for n in ray.nodes() if n["NodeID"] == ctx.get_node_id())
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        try:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            request = node_manager_pb2.GetNodeStatsRequest(include_memory_info=False)
            stats = stub.GetNodeStats(request, timeout=5).core_workers_stats
        finally:
            channel.close()
        return sum(
            1
            for w in stats
            if w.pid > 0
            and w.worker_type == 0
            and w.actor_id in (b"", b"\xff" * 16)
            and w.num_executed_tasks == 0
        )
    except Exception:  # noqa: BLE001
        return None


def _load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _row(label: str, parallelism: int, runs: list[dict[str, Any]]) -> str:
    phases = [statistics.median(r["phases"][i] for r in runs) for i in range(len(PHASES))]
    rate = statistics.median(r["rows_per_s"] for r in runs)
    first = [r["phases"][2] for r in runs]
    spread = f"{min(first):.2f}-{max(first):.2f}" if len(runs) > 1 else ""
    cells = " | ".join(f"{p:.2f}" for p in phases)
    return f"| {label} | {parallelism} | {len(runs)} | {cells} | {spread} | {rate:,.0f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rayflow job start, by phase")
    parser.add_argument("--rows", type=int, default=200_000, help="rows per job (200,000)")
    parser.add_argument("--batch-size", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5, help="jobs per parallelism (5)")
    parser.add_argument(
        "--transport",
        choices=["socket", "ray"],
        default="socket",
        help="how subtasks send data (set_data_transport; default socket)",
    )
    parser.add_argument("--parallelism", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gap-s", type=float, default=1.0, help="pause between jobs (1 s)")
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause after ray.init (3 s)")
    parser.add_argument(
        "--rayflow-starts-ray",
        action="store_true",
        help="start the local Ray as rayflow does when none is running (ensure_ray), "
        "instead of ray.init(address='local')",
    )
    args = parser.parse_args(argv)
    global DATA_TRANSPORT
    DATA_TRANSPORT = args.transport

    command = "python " + shlex.join(
        sys.argv if argv is None else ["benchmarks/job_start.py", *argv]
    )
    import rayflow

    print(f"command: {command}")
    print(f"rayflow: {os.path.dirname(rayflow.__file__)}")
    print(f"load average at start: {_load()}", flush=True)
    if args.rayflow_starts_ray:
        from rayflow.environment import ensure_ray

        ensure_ray("local")
    else:
        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    time.sleep(args.settle_s)
    storage = tempfile.mkdtemp(prefix="rayflow-job-start-")

    def one(p: int) -> dict[str, Any]:
        idle = fresh_idle_workers()
        r = run_job(args.rows, p, storage, args.batch_size)
        cells = " ".join(f"{x:6.2f}" for x in r["phases"])
        print(
            f"  p={p}: {cells}  {r['rows_per_s']:>12,.0f} rows/s  ({idle} idle workers before)",
            flush=True,
        )
        time.sleep(args.gap_s)
        return r

    print(f"  phases (s from execute()): {', '.join(PHASES)}")
    cold = one(args.parallelism[-1])
    runs: dict[int, list[dict[str, Any]]] = {p: [] for p in args.parallelism}
    for _ in range(args.runs):
        for p in args.parallelism:
            runs[p].append(one(p))
    print()
    print(f"command: `{command}`; load average at end: {_load()}")
    print()
    header = " | ".join(PHASES)
    print(f"| job | parallelism | runs | {header} | first batch min-max | rows/s |")
    print("|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|")
    print(_row("cold (first job after ray.init)", args.parallelism[-1], [cold]))
    for p in args.parallelism:
        print(_row("median", p, runs[p]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
