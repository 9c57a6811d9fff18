"""Checkpoint coordinator CPU per checkpoint against the number of subtasks, without Ray.

Drives :class:`rayflow.checkpoint.coordinator.CheckpointCoordinator` in this process
with N simulated subtasks (half sources, half a keyed vertex, as in a two-vertex job of
parallelism N/2): plain objects whose ``.remote()`` calls are counted, and an in-memory
checkpoint storage that pickles each checkpoint's metadata like the real one. What a
job master does per subtask is called as the job master calls it:

* **start**: every subtask reports running (``subtask_running``), once per attempt;
* **checkpoint**: ``trigger``, one ``acknowledge`` per subtask with the info a subtask
  sends (path, size, timings, source splits), the completion (metadata built and
  pickled: the commit point), the notification of every subtask and the subsumption of
  older checkpoints;
* **late acks**: every subtask acknowledges the checkpoint again after it completed
  (dropped: a repeated or late message);
* **declined**: half the subtasks acknowledge, then one declines: the abort, its
  notification of every subtask and its record.

Each figure is this process's CPU time (``time.process_time``, all threads) per round,
the median of ``--rounds`` rounds, and per subtask. A coordinator whose work is linear
in N shows a flat per-subtask figure from 100 subtasks on.

Not a timed assertion; run holding the machine-wide benchmark lock::

    flock /tmp/bench.lock python benchmarks/coordinator_scale.py [--sizes 10,100,1000,2000] \\
        [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayflow.checkpoint.coordinator import (  # noqa: E402
    CheckpointCoordinator,
    CheckpointHistory,
    CheckpointIdCounter,
)
from rayflow.checkpoint.metadata import CheckpointMetadata  # noqa: E402
from rayflow.config import CheckpointConfig  # noqa: E402
from rayflow.plan.physical import JobGraph, VertexSpec  # noqa: E402

__all__ = ["FakeSubtask", "MemoryStorage", "fake_graph", "new_coordinator", "measure"]


class _Remote:
    __slots__ = ("calls", "name")

    def __init__(self, calls: collections.Counter, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any) -> None:
        self.calls[self.name] += 1


#: the subtask methods the coordinator calls
_METHODS = (
    "trigger_checkpoint",
    "snapshot_blob",
    "notify_checkpoint_complete",
    "notify_checkpoint_aborted",
)


class FakeSubtask:
    """A subtask actor handle: every ``method.remote(...)`` is counted, nothing runs."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        for name in _METHODS:
            setattr(self, name, _Remote(self.calls, name))


class MemoryStorage:
    """The checkpoint storage calls the coordinator makes, in memory (metadata pickled)."""

    def __init__(self) -> None:
        self.metadata: dict[int, bytes] = {}
        self.discarded: list[int] = []
        self.mark = 0

    def reserve_ids(self, up_to: int) -> None:
        self.mark = up_to

    def commit_metadata(self, cid: int, metadata: CheckpointMetadata) -> None:
        self.metadata[cid] = metadata.to_bytes()

    def load_metadata(self, cid: int) -> CheckpointMetadata:
        return CheckpointMetadata.from_bytes(self.metadata[cid])

    def completed_ids(self) -> list[int]:
        return sorted(self.metadata)

    def collect_garbage(self, keep: list[int], in_flight: int | None = None) -> None:
        for cid in list(self.metadata):
            if cid not in keep:
                del self.metadata[cid]

    def discard(self, cid: int) -> None:
        self.discarded.append(cid)
        self.metadata.pop(cid, None)


def fake_graph(subtasks: int) -> JobGraph:
    """Two vertices of parallelism ``subtasks // 2``: sources and a keyed vertex."""
    p = max(1, subtasks // 2)
    vertices = {
        0: VertexSpec(0, "numbers", p, 128, source=object(), source_uid="numbers"),
        1: VertexSpec(1, "running-sum -> committed", p, 128),
    }
    return JobGraph(vertices=vertices, edges={})


def ack_info(key: tuple[int, int], cid: int, source: bool) -> dict[str, Any]:
    return {
        "start_delay_s": 0.001,
        "alignment_s": 0.002,
        "sync_s": 0.0005,
        "async_s": 0.003,
        "size": 4096,
        "uids": ["running-sum", "committed"] if not source else [],
        "source_splits": [("split", key[1], 1000 * cid)] if source else None,
        "unaligned": False,
        "channel_state_size": 0,
        "path": f"/ckpt/run/chk-{cid}/a0-v{key[0]}-s{key[1]}.state",
    }


def new_coordinator(
    graph: JobGraph, failures: list[BaseException] | None = None
) -> tuple[CheckpointCoordinator, dict[tuple[int, int], FakeSubtask], MemoryStorage]:
    tasks = {
        (v.vertex_id, i): FakeSubtask()
        for v in graph.vertices.values()
        for i in range(v.parallelism)
    }
    storage = MemoryStorage()
    config = CheckpointConfig()
    config.set_checkpoint_interval(3_600_000)  # rounds are triggered here, never by a timer
    config.set_num_retained_checkpoints(1)
    failures = failures if failures is not None else []
    coordinator = CheckpointCoordinator(
        "scale",
        config,
        storage,  # type: ignore[arg-type]
        graph,
        tasks,
        0,
        CheckpointIdCounter(storage, 1),  # type: ignore[arg-type]
        failures.append,
        None,
        CheckpointHistory(10),
        None,
        run_id="run-scale",
    )
    return coordinator, tasks, storage


async def _settle(coordinator: CheckpointCoordinator) -> None:
    """Wait for the coordinator's background work (subsume, discard) of the last round."""
    while coordinator._background:
        await asyncio.wait(list(coordinator._background))


async def measure(subtasks: int, rounds: int) -> dict[str, Any]:
    """CPU seconds per round of each kind (median of ``rounds``)."""
    graph = fake_graph(subtasks)
    coordinator, tasks, storage = new_coordinator(graph)
    keys = list(tasks)
    n = len(keys)

    starts = []
    for _ in range(rounds):
        coordinator._running.clear()
        coordinator._all_running.clear()
        begin = time.process_time()
        for key in keys:
            coordinator.subtask_running(key)
        starts.append(time.process_time() - begin)
    assert coordinator._all_running.is_set()

    checkpoints, lates, declines = [], [], []
    for _ in range(rounds):
        cid = coordinator.ids.next_id
        infos = [(key, ack_info(key, cid, key[0] == 0)) for key in keys]  # not measured
        begin = time.process_time()
        assert await coordinator.trigger() == cid
        for key, info in infos:
            await coordinator.acknowledge(cid, key, info)
        await _settle(coordinator)
        checkpoints.append(time.process_time() - begin)
        assert coordinator.latest is not None and coordinator.latest.checkpoint_id == cid
        assert len(coordinator.latest.metadata.subtasks) == n

        begin = time.process_time()
        for key, info in infos:
            await coordinator.acknowledge(cid, key, info)  # late: dropped
        lates.append(time.process_time() - begin)

        aborted = coordinator.ids.next_id
        half = [(key, ack_info(key, aborted, key[0] == 0)) for key in keys[: n // 2]]
        begin = time.process_time()
        assert await coordinator.trigger() == aborted
        for key, info in half:
            await coordinator.acknowledge(aborted, key, info)
        await coordinator.decline(aborted, keys[-1], "simulated")
        await _settle(coordinator)
        declines.append(time.process_time() - begin)
        assert coordinator.pending is None and aborted in storage.discarded
    calls = collections.Counter()
    for task in tasks.values():
        calls.update(task.calls)
    await coordinator.shutdown()
    return {
        "subtasks": n,
        "start_s": statistics.median(starts),
        "checkpoint_s": statistics.median(checkpoints),
        "late_acks_s": statistics.median(lates),
        "declined_s": statistics.median(declines),
        "metadata_bytes": len(storage.metadata[max(storage.metadata)]),
        "calls": dict(calls),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| subtasks | checkpoint: CPU ms | per subtask µs | late acks: per subtask µs "
        "| declined: CPU ms | start: per subtask µs | metadata bytes |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["subtasks"]
        lines.append(
            f"| {n:,} | {r['checkpoint_s'] * 1e3:.2f} | {r['checkpoint_s'] / n * 1e6:.1f} "
            f"| {r['late_acks_s'] / n * 1e6:.2f} | {r['declined_s'] * 1e3:.2f} "
            f"| {r['start_s'] / n * 1e6:.2f} | {r['metadata_bytes']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,2000")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    logging.getLogger("rayflow").setLevel(logging.ERROR)  # each declined round warns
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [asyncio.run(measure(n, args.rounds)) for n in sizes]
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
