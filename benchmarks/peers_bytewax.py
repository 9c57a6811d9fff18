"""The peer workload (keyed running sum) on Bytewax; run inside Bytewax's own venv.

``benchmarks/peers.py`` starts this script with the venv's python::

    /tmp/peers/bytewax/bin/python benchmarks/peers_bytewax.py \
        --records 2000000 --parallelism 1 --mode exactly-once

The dataflow: a replayable source of ``i`` for ``i = 0..N-1`` (one partition per
process, its position in every snapshot) -> ``key_on(str(i % 1000))`` ->
``stateful_map`` (running sum) -> a sink that counts updates and keeps the largest sum
per key. Mode ``none`` runs without recovery; any other mode runs with a
``RecoveryConfig`` on a fresh directory made with ``init_db_dir`` and an epoch
(snapshot) interval of 1 s: Bytewax has one kind of snapshot, reported as ``recovery``.

Parallelism P runs P processes with one worker each (``cli_main(flow, process_id=i,
addresses=...)`` over TCP on 127.0.0.1): this script starts them as children of
itself and merges what they report. The job time is ``cli_main()``: from the first
process entering it to the last one leaving it. Prints one result line
(``peers_common.RESULT_PREFIX`` + JSON).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from bytewax.outputs import DynamicSink, StatelessSinkPartition
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.run import cli_main
from peers_common import KEYS, MODES, check_sums, emit, merge_max, parse_result

__all__ = ["build_flow", "main"]

EPOCH_INTERVAL = timedelta(seconds=1)


class _RangePartition(StatefulSourcePartition):
    def __init__(self, position: int, end: int, batch_size: int) -> None:
        self.position = position
        self.end = end
        self.batch_size = batch_size

    def next_batch(self) -> list[int]:
        if self.position >= self.end:
            raise StopIteration
        stop = min(self.end, self.position + self.batch_size)
        batch = list(range(self.position, stop))
        self.position = stop
        return batch

    def snapshot(self) -> int:
        return self.position


class RangeSource(FixedPartitionedSource):
    """``0..records-1`` cut into one partition per process; this process lists its own."""

    def __init__(self, records: int, processes: int, process_id: int, batch_size: int) -> None:
        self.records = records
        self.processes = processes
        self.process_id = process_id
        self.batch_size = batch_size

    def _bounds(self, index: int) -> tuple[int, int]:
        n, p = self.records, self.processes
        return n * index // p, n * (index + 1) // p

    def list_parts(self) -> list[str]:
        return [f"part-{self.process_id}"]

    def build_part(self, step_id: str, for_part: str, resume_state: int | None):
        lo, hi = self._bounds(int(for_part.rsplit("-", 1)[1]))
        return _RangePartition(lo if resume_state is None else resume_state, hi, self.batch_size)


_SINK_PARTS: list[_MaxPartition] = []


class _MaxPartition(StatelessSinkPartition):
    def __init__(self) -> None:
        self.count = 0
        self.sums: dict[str, int] = {}

    def write_batch(self, items: list[tuple[str, int]]) -> None:
        self.count += len(items)
        sums = self.sums
        for key, value in items:
            if value > sums.get(key, -1):
                sums[key] = value


class CountMaxSink(DynamicSink):
    """Counts updates and keeps the largest sum per key (read back after ``cli_main``)."""

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _MaxPartition:
        part = _MaxPartition()
        _SINK_PARTS.append(part)
        return part


def _running_sum(state: int | None, value: int) -> tuple[int, int]:
    total = value if state is None else state + value
    return total, total


def build_flow(records: int, processes: int, process_id: int, batch_size: int) -> Dataflow:
    flow = Dataflow("peers_keyed_sum")
    numbers = op.input("numbers", flow, RangeSource(records, processes, process_id, batch_size))
    keyed = op.key_on("key", numbers, lambda i: str(i % KEYS))
    sums = op.stateful_map("sum", keyed, _running_sum)
    op.output("sink", sums, CountMaxSink())
    return flow


def _run_process(args: argparse.Namespace, process_id: int, addresses: list[str] | None) -> dict:
    """Run this process's share of the dataflow; what its sink saw and when."""
    _SINK_PARTS.clear()
    flow = build_flow(args.records, args.parallelism, process_id, args.batch_size)
    recovery = RecoveryConfig(Path(args.recovery_dir)) if args.recovery_dir else None
    started = time.time()
    cli_main(
        flow,
        workers_per_process=1,
        process_id=process_id if addresses else None,
        addresses=addresses,
        epoch_interval=EPOCH_INTERVAL if recovery else None,
        recovery_config=recovery,
    )
    finished = time.time()
    return {
        "start": started,
        "end": finished,
        "count": sum(p.count for p in _SINK_PARTS),
        "sums": merge_max([p.sums for p in _SINK_PARTS]),
    }


def committed_epochs(recovery_dir: str) -> int | None:
    """The highest epoch committed in any recovery partition (epochs are 1 s snapshots)."""
    epochs = []
    for part in sorted(Path(recovery_dir).glob("*.sqlite3")):
        with sqlite3.connect(part) as db:
            (epoch,) = db.execute("SELECT MAX(commit_epoch) FROM commits").fetchone()
        if epoch is not None:
            epochs.append(epoch)
    return max(epochs, default=None)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_children(args: argparse.Namespace) -> list[dict]:
    addresses = ";".join(f"127.0.0.1:{port}" for port in _free_ports(args.parallelism))
    base = [sys.executable, os.path.abspath(__file__), "--records", str(args.records)]
    base += ["--parallelism", str(args.parallelism), "--batch-size", str(args.batch_size)]
    base += ["--mode", args.mode, "--addresses", addresses]
    if args.recovery_dir:
        base += ["--recovery-dir", args.recovery_dir]
    children = [
        subprocess.Popen([*base, "--process-id", str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(args.parallelism)
    ]
    parts = []
    for i, child in enumerate(children):
        out, _ = child.communicate()
        part = parse_result(out)
        if child.returncode != 0 or part is None:
            for other in children:
                other.kill()
            raise RuntimeError(f"bytewax process {i} exited with {child.returncode}")
        parts.append(part)
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--parallelism", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, default="none")
    parser.add_argument("--batch-size", type=int, default=8192, help="items per source batch")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--addresses", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--recovery-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.process_id is not None:  # one process of a multi-process run
        part = _run_process(args, args.process_id, args.addresses.split(";"))
        emit({**part, "sums": {str(k): v for k, v in part["sums"].items()}})
        return 0

    base: dict[str, Any] = {
        "engine": "bytewax",
        "mode": args.mode,
        "parallelism": args.parallelism,
        "records": args.records,
    }
    scratch = None
    try:
        if args.mode != "none":
            scratch = tempfile.mkdtemp(prefix="peers-bytewax-recovery-")
            init_db_dir(Path(scratch), args.parallelism)
            args.recovery_dir = scratch
        if args.parallelism == 1:
            parts = [_run_process(args, 0, None)]
        else:
            parts = _run_children(args)
        start = min(p["start"] for p in parts)
        end = max(p["end"] for p in parts)
        count = sum(p["count"] for p in parts)
        sums = merge_max([p["sums"] for p in parts])
        emit(
            {
                **base,
                "job_s": end - start,
                "job_end": end,
                "count": count,
                "check": check_sums(args.records, sums, count),
                "checkpoints": committed_epochs(scratch) if scratch else None,
            }
        )
    except Exception as exc:  # reported, never silently lost
        emit({**base, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
        return 1
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
