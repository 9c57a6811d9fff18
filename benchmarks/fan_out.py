"""Records per second of a job whose stream has two consumers: written to a sink as it is,
and keyed into a running sum (the shape of a raw archive beside an aggregate)::

    keyed = env.from_source(NumberSequenceSource(0, N - 1)).map_batches(<key = value % 1000>)
    keyed.sink_to(<raw: counts rows, adds values>)
    keyed.key_by("key").sum("value").sink_to(<sums: largest sum per key>)

EXACTLY_ONCE checkpoints every second; every run checks that the raw sink got N rows
whose values add up, and that every one of the 1000 sums is exact. The rate is N / wall
seconds of ``env.execute()`` (deploy included; Ray started and a warm-up job run first);
the table also says how many subtasks the job ran (its vertices x parallelism).

Benchmarks are never timed assertions. Ray's workers import rayflow from the directory the
driver was started in: to time another checkout, start from there::

    cd <tree> && PYTHONPATH=<tree> flock /tmp/bench.lock python <this file> --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import rayflow
from rayflow import NumberSequenceSource, Sink, SinkContext, SinkWriter, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode
from rayflow.environment import ensure_ray

KEYS = 1000


def _with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pc.remainder(batch.column("value"), KEYS))


class _RawWriter(SinkWriter):
    def __init__(self) -> None:
        self.rows = 0
        self.total = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows
        self.total += pc.sum(batch.column("value")).as_py() or 0

    def finish(self) -> dict[str, Any]:
        return {"rows": self.rows, "total": self.total, "rayflow": rayflow.__file__}


class RawSink(Sink):
    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _RawWriter()

    def merge_results(self, results: list[Any]) -> dict[str, Any]:
        return {
            "rows": sum(r["rows"] for r in results),
            "total": sum(r["total"] for r in results),
            "rayflow": sorted({r["rayflow"] for r in results}),
        }


class _MaxWriter(SinkWriter):
    def __init__(self) -> None:
        self.best: dict[int, int] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        grouped = pa.table(batch).group_by("key").aggregate([("value", "max")])
        for key, value in zip(grouped["key"].to_pylist(), grouped["value_max"].to_pylist()):
            if value > self.best.get(key, -1):
                self.best[key] = value

    def finish(self) -> dict[int, int]:
        return self.best


class MaxSink(Sink):
    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _MaxWriter()

    def merge_results(self, results: list[Any]) -> dict[int, int]:
        best: dict[int, int] = {}
        for part in results:
            for key, value in (part or {}).items():
                best[key] = max(value, best.get(key, -1))
        return best


def run_job(records: int, parallelism: int, storage: str) -> tuple[float, int, list[str]]:
    """One run: (wall seconds of execute(), subtasks the job ran, the workers' rayflow)."""
    env = StreamExecutionEnvironment()
    env.set_parallelism(parallelism)
    env.enable_checkpointing(1000, CheckpointingMode.EXACTLY_ONCE)
    env.get_checkpoint_config().set_checkpoint_storage(storage)
    raw, sums = RawSink(), MaxSink()
    keyed = env.from_source(NumberSequenceSource(0, records - 1), "numbers").map_batches(
        _with_key, "with-key"
    )
    keyed.sink_to(raw, "raw")
    keyed.key_by("key").sum("value").sink_to(sums, "sums")
    subtasks = sum(v.parallelism for v in env.get_job_graph().vertices.values())
    started = time.perf_counter()
    result = env.execute(f"fan-out-{time.time_ns()}")
    wall = time.perf_counter() - started
    got = result.sink_result(raw)
    if got["rows"] != records or got["total"] != records * (records - 1) // 2:
        raise RuntimeError(f"raw sink got {got['rows']} rows adding up to {got['total']}")
    values = np.arange(records, dtype=np.int64)
    expected = np.bincount(values % KEYS, weights=values, minlength=KEYS).astype(np.int64)
    if result.sink_result(sums) != {k: int(expected[k]) for k in range(KEYS)}:
        raise RuntimeError("the sums are not exact")
    return wall, subtasks, got["rayflow"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parallelism", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    ensure_ray()
    storage = tempfile.mkdtemp(prefix="fan-out-chk-")
    try:
        _, _, where = run_job(200_000, 1, storage)  # warm-up: processes, imports
        print(f"workers run {where}", flush=True)
        for p in args.parallelism:
            rates = []
            for _ in range(args.repeat):
                wall, subtasks, _ = run_job(args.records, p, storage)
                rates.append(args.records / wall)
                print(f"p={p}: {rates[-1] / 1e6:.2f} M records/s ({subtasks} subtasks)", flush=True)
            print(
                f"p={p} N={args.records:,}: median {statistics.median(rates) / 1e6:.2f} M "
                f"records/s ({', '.join(f'{r / 1e6:.2f}' for r in rates)}); load "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":
    main()
