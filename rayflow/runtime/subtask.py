"""The subtask actor: one parallel instance of a chain of operators.

A subtask is an async Ray actor. Its ``run()`` coroutine is the mailbox loop:
the only code that touches operator state. ``push`` (data from upstream
subtasks) only fills the :class:`~rayflow.runtime.channels.InputGate`; control
calls only enqueue into the mailbox. Source subtasks read their splits;
other subtasks take messages from the gate in channel order and run each batch
through the chain, then route the chain's output to the downstream subtasks.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray

from rayflow.errors import OperatorError
from rayflow.plan.partitioners import Partitioner, PartitionerSpec
from rayflow.plan.physical import VertexSpec
from rayflow.runtime.channels import InputGate, OutputChannel
from rayflow.runtime.events import EndOfInput
from rayflow.runtime.operators import Operator, OperatorContext


@dataclass
class OutputDeployment:
    """One out-edge of a subtask: its partitioner and, per target subtask, the receiver."""

    partitioner: PartitionerSpec
    receivers: list[tuple[Any, int]]  # (actor handle, channel index at that receiver)


@dataclass
class SubtaskDeployment:
    job_name: str
    vertex: VertexSpec
    index: int
    attempt: int
    num_input_channels: int
    outputs: list[OutputDeployment]
    source_splits: list[Any] = field(default_factory=list)
    channel_capacity: int = 8
    send_window: int = 8


class _RecordWriter:
    def __init__(self, output: OutputDeployment, index: int, attempt: int, window: int, maxp: int):
        self.channels = [OutputChannel(h, c, attempt, window) for h, c in output.receivers]
        self.partitioner = Partitioner(output.partitioner, index, len(self.channels), maxp)

    async def emit(self, batch: pa.RecordBatch) -> int:
        rows = 0
        for target, part in self.partitioner.route(batch):
            await self.channels[target].send(part)
            rows += part.num_rows
        return rows

    async def broadcast(self, event: Any) -> None:
        for channel in self.channels:
            await channel.send(event)

    async def flush(self) -> None:
        for channel in self.channels:
            await channel.flush()


@ray.remote(max_restarts=0, max_task_retries=0)
class SubtaskActor:
    def __init__(self, deployment: SubtaskDeployment) -> None:
        self.d = deployment
        vertex = deployment.vertex
        self.name = vertex.name
        self.index = deployment.index
        self.parallelism = vertex.parallelism
        self.attempt = deployment.attempt
        self.gate = InputGate(deployment.num_input_channels, deployment.channel_capacity)
        self.writers = [
            _RecordWriter(o, self.index, self.attempt, deployment.send_window,
                          vertex.max_parallelism)
            for o in deployment.outputs
        ]
        self.operators: list[Operator] = [spec.factory() for spec in vertex.operators]
        self._current_operator = vertex.source_uid and vertex.name
        self.metrics_ = {
            "records_in": 0,
            "records_out": 0,
            "batches_in": 0,
            "batches_out": 0,
            "started_at": None,
            "finished_at": None,
        }

    # --- calls from other actors --------------------------------------------------------

    async def push(self, channel: int, seq: int, attempt: int, message: Any) -> None:
        if attempt != self.attempt:
            return
        await self.gate.push(channel, seq, message)

    async def metrics(self) -> dict[str, Any]:
        m = dict(self.metrics_)
        m["vertex"] = self.name
        m["subtask"] = self.index
        m["buffered"] = self.gate.buffered()
        m["max_buffered"] = self.gate.max_buffered
        m["max_in_flight"] = max(
            (c.max_in_flight for w in self.writers for c in w.channels), default=0
        )
        return m

    async def ready(self) -> bool:
        return True

    # --- the mailbox loop ---------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        self.metrics_["started_at"] = time.time()
        try:
            self._open()
            if self.d.vertex.is_source:
                await self._run_source()
            else:
                await self._run_inputs()
            await self._end_of_input()
            self.metrics_["finished_at"] = time.time()
            return {
                "results": [op.result() for op in self.operators],
                "metrics": await self.metrics(),
            }
        except OperatorError:
            raise
        except Exception as exc:
            raise self._operator_error(exc) from None
        finally:
            for op in self.operators:
                try:
                    op.close()
                except Exception:  # noqa: BLE001 - closing must not hide the first error
                    pass

    def _operator_error(self, exc: BaseException) -> OperatorError:
        return OperatorError(
            self._current_operator or self.name,
            self.index,
            self.parallelism,
            f"{type(exc).__name__}: {exc}",
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    def _open(self) -> None:
        vertex = self.d.vertex
        for spec, op in zip(vertex.operators, self.operators):
            self._current_operator = spec.name
            op.open(
                OperatorContext(
                    job_name=self.d.job_name,
                    operator_name=spec.name,
                    operator_uid=spec.uid,
                    subtask_index=self.index,
                    parallelism=self.parallelism,
                    max_parallelism=vertex.max_parallelism,
                    attempt=self.attempt,
                )
            )

    async def _run_source(self) -> None:
        source = self.d.vertex.source
        self._current_operator = self.name.split(" -> ")[0]
        reader = source.create_reader(list(self.d.source_splits))
        rate = source.records_per_second
        started = time.monotonic()
        emitted = 0
        try:
            while True:
                self._current_operator = self.name.split(" -> ")[0]
                batch = reader.read_batch()
                if batch is None:
                    break
                emitted += batch.num_rows
                self.metrics_["records_in"] += batch.num_rows
                self.metrics_["batches_in"] += 1
                await self._process(batch)
                if rate:
                    delay = started + emitted / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)
        finally:
            reader.close()

    async def _run_inputs(self) -> None:
        open_channels = self.gate.num_channels
        while open_channels:
            _, message = await self.gate.next()
            if isinstance(message, pa.RecordBatch):
                self.metrics_["records_in"] += message.num_rows
                self.metrics_["batches_in"] += 1
                await self._process(message)
            elif isinstance(message, EndOfInput):
                open_channels -= 1

    async def _process(self, batch: pa.RecordBatch, start: int = 0) -> None:
        batches = [batch]
        operators = self.operators
        for position in range(start, len(operators)):
            op = operators[position]
            self._current_operator = self.d.vertex.operators[position].name
            produced: list[pa.RecordBatch] = []
            for b in batches:
                produced.extend(op.process(b))
            if not produced:
                return
            batches = produced
        await self._emit(batches)

    async def _emit(self, batches: list[pa.RecordBatch]) -> None:
        for b in batches:
            if b.num_rows == 0:
                continue
            for writer in self.writers:
                self.metrics_["records_out"] += await writer.emit(b)
            self.metrics_["batches_out"] += 1

    async def _end_of_input(self) -> None:
        for position, op in enumerate(self.operators):
            self._current_operator = self.d.vertex.operators[position].name
            tail = op.end_input()
            for batch in tail:
                await self._process(batch, position + 1)
        for writer in self.writers:
            await writer.broadcast(EndOfInput())
        for writer in self.writers:
            await writer.flush()
