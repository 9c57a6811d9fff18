"""A small job run in one event loop, without Ray: real subtask classes, fake actor handles.

Sources (a :class:`NumberSequenceSource`) -> rebalance -> a pass-through operator that
cuts each batch in pieces -> rebalance -> one subtask keeping every value it saw in its
operator state. Pushes and announcements are tasks that start after a random delay
(Ray keeps no call order); the test drives checkpoints as the coordinator would, can
stop every subtask at any time and restore all of them from a completed checkpoint.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rayflow.config import CheckpointAlignment, CheckpointingMode
from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
from rayflow.plan.physical import OperatorSpec, VertexSpec
from rayflow.runtime.operators import Operator, factory
from rayflow.runtime.restore import StateHandle
from rayflow.runtime.subtask import OutputDeployment, Subtask, SubtaskDeployment
from rayflow.sources import NumberSequenceSource


class Cut(Operator):
    """Passes every batch on, cut into up to three pieces (more messages per channel)."""

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        n = batch.num_rows
        if n < 3:
            return [batch]
        a, b = n // 3, 2 * n // 3
        return [batch.slice(0, a), batch.slice(a, b - a), batch.slice(b)]


class Keep(Operator):
    """Keeps every value it processed, in its state."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        self.values.extend(batch["value"].to_pylist())
        return []

    def snapshot_state(self, checkpoint_id: int) -> Any:
        return list(self.values)

    def restore_state(self, snapshots: list[Any]) -> None:
        for values in snapshots:
            self.values.extend(values)


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class Handle:
    """Stands for a subtask's actor handle: each call is a task after a random delay."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.target: Any = None
        self.push = _Call(self._push)
        self.announce_barrier = _Call(self._announce)

    def _task(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.job.calls.add(task)
        task.add_done_callback(self.job.calls.discard)
        return task

    async def _delay(self) -> None:
        delay = self.job.rng.random() * self.job.max_delay_s
        await asyncio.sleep(delay)

    def _push(self, *args: Any) -> asyncio.Task:
        async def go() -> Any:
            await self._delay()
            return await self.target.push(*args)

        return self._task(go())

    def _announce(self, *args: Any) -> asyncio.Task:
        async def go() -> Any:
            await self._delay()
            return await self.target.announce_barrier(*args)

        return self._task(go())


class Master:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.source_exhausted = _Call(self._exhausted)
        self.acknowledge_checkpoint = _Call(self._ack)
        self.decline_checkpoint = _Call(self._decline)
        self.subtask_running = _Call(lambda *a: None)

    def _exhausted(self, attempt: int, key: Any) -> None:
        if attempt == self.job.attempt:
            self.job.exhausted.add(key)

    def _ack(self, attempt: int, cid: int, key: Any, info: dict, blob: Any = None) -> None:
        if attempt == self.job.attempt:
            self.job.acks.setdefault(cid, {})[key] = info
            self.job.blobs.setdefault(cid, {})[key] = blob

    def _decline(self, attempt: int, cid: int, key: Any, why: str) -> None:
        if attempt == self.job.attempt:
            self.job.declined[cid] = why


class Storage:
    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def write_blob(self, cid: int, name: str, data: bytes) -> str:
        path = f"{cid}/{name}"
        self.blobs[path] = data
        return path

    def read_blob(self, path: str) -> bytes:
        return self.blobs[path]


@dataclass
class Config:
    n: int = 1500
    sources: int = 2
    middles: int = 2
    batch_size: int = 20
    mode: CheckpointingMode = CheckpointingMode.EXACTLY_ONCE
    alignment: CheckpointAlignment = CheckpointAlignment.UNALIGNED
    aligned_timeout_s: float = 0.0
    capacity: int = 4
    window: int = 4
    channel_bytes: int = 1 << 20
    buffer_timeout_s: float = 0.005
    buffer_bytes: int = 1 << 20
    debloat_target_ms: int | None = None
    latency_interval_ms: int = 0
    max_delay_s: float = 0.001
    extra: dict = field(default_factory=dict)


class Job:
    def __init__(self, config: Config, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.max_delay_s = config.max_delay_s
        self.calls: set[asyncio.Task] = set()
        self.master = Master(self)
        self.storage = Storage()
        self.attempt = 0
        self.acks: dict[int, dict] = {}
        #: the blob that came with each acknowledgement (None: left for a fetch)
        self.blobs: dict[int, dict] = {}
        self.declined: dict[int, str] = {}
        self.exhausted: set = set()
        self.subtasks: dict[tuple[int, int], Any] = {}
        self.runs: dict[tuple[int, int], asyncio.Task] = {}
        c = config
        source = NumberSequenceSource(0, c.n - 1, batch_size=c.batch_size)
        self.source_vertex = VertexSpec(0, "src", c.sources, 128, source=source, source_uid="src")
        self.middle_vertex = VertexSpec(
            1, "cut", c.middles, 128, operators=[OperatorSpec("cut", "cut", factory(Cut))]
        )
        self.keep_vertex = VertexSpec(
            2, "keep", 1, 128, operators=[OperatorSpec("keep", "keep", factory(Keep))]
        )
        self.splits = source.create_splits(c.sources)

    @property
    def keys(self) -> list[tuple[int, int]]:
        return list(self.subtasks)

    def _deployment(self, vertex, index, inputs, outputs, splits, restore, restored):
        c = self.config
        return SubtaskDeployment(
            job_name="inprocess",
            vertex=vertex,
            index=index,
            attempt=self.attempt,
            num_input_channels=inputs,
            outputs=outputs,
            source_splits=splits,
            channel_capacity=c.capacity,
            send_window=c.window,
            debloat_target_ms=c.debloat_target_ms,
            checkpointing=c.mode,
            alignment=c.alignment,
            aligned_checkpoint_timeout_s=c.aligned_timeout_s,
            storage=self.storage,
            master=self.master,
            restore=restore,
            restored_checkpoint=restored,
            run_id="run",
            latency_tracking_interval_ms=c.latency_interval_ms,
            buffer_timeout_s=c.buffer_timeout_s,
            buffer_bytes=c.buffer_bytes,
            channel_bytes=c.channel_bytes,
            send_bytes=c.channel_bytes,
        )

    async def deploy(self, restore_from: int | None = None, reuse: bool = False) -> None:
        """Deploy every subtask of the current attempt (from checkpoint ``restore_from``):
        new subtask objects, or with ``reuse`` the previous attempt's, redeployed."""
        c = self.config
        rebalance = PartitionerSpec(PartitionKind.REBALANCE)
        keep_handle = Handle(self)
        middle_handles = [Handle(self) for _ in range(c.middles)]
        infos = self.acks.get(restore_from, {}) if restore_from is not None else {}
        splits = self.splits
        if restore_from is not None:
            saved = [s for k, i in infos.items() if k[0] == 0 for s in i["source_splits"]]
            splits = sorted(saved, key=lambda s: s.split_id)

        def handles(vertex_id: int, parallelism: int) -> list[StateHandle]:
            return [
                StateHandle(index, parallelism, infos[(vertex_id, index)]["path"])
                for index in range(parallelism)
                if (vertex_id, index) in infos
            ]

        previous = self.subtasks
        subtasks: dict[tuple[int, int], Any] = {}

        async def place(key: tuple[int, int], deployment: SubtaskDeployment) -> Any:
            if reuse and key in previous:
                sub = previous[key]
                assert await sub.redeploy(deployment)
            else:
                sub = Subtask(deployment)
            subtasks[key] = sub
            return sub

        keep_handle.target = await place(
            (2, 0),
            self._deployment(self.keep_vertex, 0, c.middles, [], [], handles(2, 1), restore_from),
        )
        for j in range(c.middles):
            out = OutputDeployment(rebalance, [(keep_handle, j)])
            middle_handles[j].target = await place(
                (1, j),
                self._deployment(
                    self.middle_vertex, j, c.sources, [out], [], handles(1, c.middles), restore_from
                ),
            )
        for i in range(c.sources):
            out = OutputDeployment(rebalance, [(h, i) for h in middle_handles])
            mine = [s for k, s in enumerate(splits) if k % c.sources == i]
            await place(
                (0, i), self._deployment(self.source_vertex, i, 0, [out], mine, [], restore_from)
            )

        async def no_metrics() -> dict:
            return {}

        for sub in subtasks.values():
            sub.metrics = no_metrics
        self.subtasks = subtasks

    def start(self) -> None:
        self.runs = {k: asyncio.ensure_future(s.run()) for k, s in self.subtasks.items()}

    async def checkpoint(self, cid: int, final: bool = False, timeout_s: float = 20.0) -> bool:
        """Trigger ``cid`` at every source; True once every subtask acknowledged it (then
        every subtask is notified), False when declined."""
        for key, sub in self.subtasks.items():
            if key[0] == 0:
                await sub.trigger_checkpoint(self.attempt, cid, time.time(), final)
        deadline = time.monotonic() + timeout_s
        while len(self.acks.get(cid, {})) < len(self.subtasks) and cid not in self.declined:
            self.check_runs()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"checkpoint {cid}: acknowledged by {sorted(self.acks.get(cid, {}))} only"
                )
            await asyncio.sleep(0.001)
        if cid in self.declined:
            return False
        for sub in self.subtasks.values():
            await sub.notify_checkpoint_complete(self.attempt, cid)
        return True

    def check_runs(self) -> None:
        for key, task in self.runs.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"subtask {key} failed") from task.exception()

    async def crash(self, reuse: bool = False) -> None:
        """Every subtask of this attempt stops at once (what it buffered is lost); with
        ``reuse`` they are only cancelled and quiesced, to be redeployed."""
        for task in self.runs.values():
            task.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        for sub in self.subtasks.values():
            if reuse:
                assert await sub.quiesce(self.attempt)
            else:
                sub.fence.revoke()
                await sub.gate.close()
        self.attempt += 1
        self.exhausted = set()

    async def finish(self, first_cid: int, timeout_s: float = 30.0) -> int:
        """Wait for every source to be exhausted, then take final checkpoints until one
        completes; wait for every subtask to end. Returns the next checkpoint id."""
        deadline = time.monotonic() + timeout_s
        sources = {k for k in self.subtasks if k[0] == 0}
        while not sources <= self.exhausted:
            self.check_runs()
            if time.monotonic() > deadline:
                raise TimeoutError(f"sources exhausted: {sorted(self.exhausted)}")
            await asyncio.sleep(0.001)
        cid = first_cid
        while not await self.checkpoint(cid, final=True, timeout_s=timeout_s):
            cid += 1
        done, pending = await asyncio.wait(self.runs.values(), timeout=timeout_s)
        if pending:
            raise TimeoutError(f"{len(pending)} subtasks did not end")
        self.check_runs()
        return cid + 1

    def kept(self) -> list[int]:
        return self.subtasks[(2, 0)].operators[0].values
