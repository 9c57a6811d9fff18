"""Simple sinks: print to stdout, and collect rows back to the driver.

``PrintSink`` writes straight through (``DeliveryGuarantee.NONE``).
``CollectSink`` is a two-phase-commit sink whose "outside world" is a collector
actor owned by the driver: a subtask's rows are pre-committed into the checkpoint
and handed to the collector when the checkpoint completes, keyed by transaction
id, so a commit repeated after a failure is not counted twice. It can give every
guarantee, which makes it the reference sink for exactly-once tests.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayflow.guarantees import DeliveryGuarantee
from rayflow.sink import Sink, SinkContext, SinkWriter, TwoPhaseCommittingSink

__all__ = ["PrintSink", "CollectSink"]


class _PrintWriter(SinkWriter):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def write(self, batch: pa.RecordBatch) -> None:
        out = sys.stdout
        for record in batch.to_pylist():
            out.write(f"{self.prefix}{record}\n")
        out.flush()


class PrintSink(Sink):
    """Prints every record, prefixed with the subtask number when parallel."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        prefix = f"{context.subtask_index + 1}> " if context.parallelism > 1 else ""
        return _PrintWriter(prefix)


@ray.remote(num_cpus=0, max_restarts=0)
class _Collector:
    """Committed transactions of one CollectSink, keyed by transaction id."""

    def __init__(self) -> None:
        self.committed: dict[str, tuple[int, int, bytes]] = {}
        self.commit_calls = 0
        self.visible_batches: list[tuple[str, bytes]] = []

    def commit(self, txn_id: str, subtask: int, sequence: int, data: bytes) -> bool:
        self.commit_calls += 1
        if txn_id in self.committed:
            return False
        self.committed[txn_id] = (subtask, sequence, data)
        return True

    def append(self, txn_id: str, data: bytes) -> None:
        self.visible_batches.append((txn_id, data))

    def contents(self) -> dict[str, Any]:
        ordered = sorted(self.committed.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
        return {
            "transactions": [(t, d) for t, (_, _, d) in ordered] + self.visible_batches,
            "commit_calls": self.commit_calls,
        }


@dataclass
class _Buffer:
    txn_id: str
    subtask: int
    sequence: int
    batches: list[pa.RecordBatch] = field(default_factory=list)
    size: int = 0


def _to_ipc(batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    table = pa.Table.from_batches(batches)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


class CollectSink(TwoPhaseCommittingSink):
    """Brings the committed rows back to the driver as one ``pyarrow.Table``.

    Read them with ``result.sink_result(sink)``. Rows of one subtask keep their order;
    subtasks follow in index order. ``commit_calls`` counts commit calls, repeated
    ones included, for tests that want to see idempotence at work.
    """

    def __init__(self, delivery_guarantee=None, rolling_policy=None) -> None:
        super().__init__(delivery_guarantee, rolling_policy)
        self._collector = None

    def setup(self, job_name: str) -> None:
        if self._collector is None:
            # The collector stands for the outside world: it lives on the driver's node,
            # whatever happens to the nodes the job runs on.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
            self._collector = _Collector.options(scheduling_strategy=here).remote()

    def _require(self):
        if self._collector is None:
            raise RuntimeError("CollectSink used outside of a job (setup() was not called)")
        return self._collector

    def begin_transaction(self, context: SinkContext, sequence: int) -> _Buffer:
        return _Buffer(
            f"{self.transaction_prefix(context)}{sequence}", context.subtask_index, sequence
        )

    def write(self, transaction: _Buffer, batch: pa.RecordBatch) -> None:
        transaction.batches.append(batch)
        transaction.size += batch.nbytes

    def transaction_size(self, transaction: _Buffer) -> int:
        return transaction.size

    def is_empty(self, transaction: _Buffer) -> bool:
        return not transaction.batches

    def pre_commit(self, transaction: _Buffer) -> tuple[str, int, int, bytes]:
        return (
            transaction.txn_id,
            transaction.subtask,
            transaction.sequence,
            _to_ipc(transaction.batches),
        )

    def commit(self, committable: tuple[str, int, int, bytes]) -> None:
        collector = self._require()
        if self.delivery_guarantee is DeliveryGuarantee.EXACTLY_ONCE:
            ref = collector.commit.remote(*committable)
        else:
            # Without exactly-once, commits are plain appends: a replayed transaction
            # shows up again, as it would in any write-through store.
            ref = collector.append.remote(committable[0], committable[3])
        ref.future().result()

    def abort(self, committable: Any) -> None:
        return None

    def abort_transaction(self, transaction: Any) -> None:
        return None

    def committable_id(self, committable: tuple[str, int, int, bytes]) -> str:
        return committable[0]

    def merge_results(self, results: list[Any]) -> pa.Table:
        contents = ray.get(self._require().contents.remote())
        self.commit_calls = contents["commit_calls"]
        tables = [_from_ipc(data) for _, data in contents["transactions"]]
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="default").combine_chunks()
