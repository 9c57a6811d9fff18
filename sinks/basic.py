"""Simple sinks: print to stdout, and collect rows back to the driver.

``PrintSink`` writes straight through (``DeliveryGuarantee.NONE``).
``CollectSink`` is a two-phase-commit sink whose "outside world" is a collector
actor owned by the driver: a subtask's rows are pre-committed into the checkpoint
and handed to the collector when the checkpoint completes, keyed by transaction
id, so a commit repeated after a failure is not counted twice. It can give every
guarantee, which makes it the reference sink for exactly-once tests.

The CollectSinks set up by one process share one collector actor (a Ray actor is a
process of its own: one per sink would cost a process start per job), each sink
keeping its own transactions under its own id, drawn when the sink is set up (so
copies made before that are sinks of their own). A copy made after it (as every
subtask's is) writes the same rows. A sink's rows are dropped from the collector once
no copy of it is left in the process that set it up, and a commit arriving for it
after that is not kept. A collector that is gone (killed, its process died) is
replaced for the sinks set up afterwards.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayflow.guarantees import DeliveryGuarantee
from rayflow.sink import (
    CommitOutcome,
    CommittableSerializer,
    Committer,
    Sink,
    SinkContext,
    SinkWriter,
    TransactionWriter,
    TwoPhaseCommittingSink,
)

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


@dataclass
class _Collected:
    """What one CollectSink committed: transactions by id, and plain appends."""

    committed: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)
    commit_calls: int = 0
    visible_batches: list[tuple[str, bytes]] = field(default_factory=list)


@ray.remote(num_cpus=0, max_restarts=0)
class _Collector:
    """Committed transactions of the CollectSinks of one process, by sink id and
    transaction id."""

    def __init__(self) -> None:
        self.sinks: dict[str, _Collected] = {}
        #: ids of sinks whose rows went: a late commit for one is not kept
        self.released: set[str] = set()

    def _sink(self, sink_id: str) -> _Collected:
        if sink_id in self.released:
            return _Collected()  # nobody reads it any more: kept nowhere
        return self.sinks.setdefault(sink_id, _Collected())

    def commit(self, sink_id: str, txn_id: str, subtask: int, sequence: int, data: bytes) -> bool:
        sink = self._sink(sink_id)
        sink.commit_calls += 1
        if txn_id in sink.committed:
            return False
        sink.committed[txn_id] = (subtask, sequence, data)
        return True

    def append(self, sink_id: str, txn_id: str, data: bytes) -> None:
        self._sink(sink_id).visible_batches.append((txn_id, data))

    def contents(self, sink_id: str) -> dict[str, Any]:
        sink = self.sinks.get(sink_id) or _Collected()
        ordered = sorted(sink.committed.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
        return {
            "transactions": [(t, d) for t, (_, _, d) in ordered] + sink.visible_batches,
            "commit_calls": sink.commit_calls,
        }

    def release(self, sink_id: str) -> None:
        self.sinks.pop(sink_id, None)
        self.released.add(sink_id)


#: This process's collector on the Ray cluster it is connected to (by node id and Ray
#: job id; an entry of an earlier connection goes when the next one sets a sink up).
_collectors: dict[tuple[str, str], Any] = {}
#: How many sink objects of this process hold each sink id (copies share it).
_holders: dict[str, int] = {}
#: Reentrant: a finalizer may run (garbage collection) in a thread that holds it.
_collectors_lock = threading.RLock()


def _alive(collector: Any) -> bool:
    try:
        ray.get(collector.__ray_ready__.remote())
    except ray.exceptions.RayActorError:
        return False
    return True


def _collector_here() -> Any:
    """The collector shared by this process's CollectSinks: it stands for the outside
    world, so it lives on this process's node, whatever happens to the job's nodes. One
    that is gone is replaced."""
    context = ray.get_runtime_context()
    key = (context.get_node_id(), context.get_job_id())
    with _collectors_lock:
        collector = _collectors.get(key)
    if collector is not None and _alive(collector):
        return collector
    with _collectors_lock:
        if _collectors.get(key) is collector:  # not replaced meanwhile by another thread
            here = NodeAffinitySchedulingStrategy(key[0], False)
            _collectors.clear()  # any other key is of an earlier Ray connection
            _collectors[key] = _Collector.options(scheduling_strategy=here).remote()
        return _collectors[key]


def _owned_here(collector: Any) -> bool:
    """Whether ``collector`` is this process's collector on the Ray it is connected to
    (not one of an earlier connection, nor one that was replaced)."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    with _collectors_lock:
        current = _collectors.get((context.get_node_id(), context.get_job_id()))
    return current is not None and current._actor_id == collector._actor_id


def _hold(sink: CollectSink) -> None:
    """Count ``sink`` as a holder of its rows until it is garbage collected."""
    with _collectors_lock:
        _holders[sink._sink_id] = _holders.get(sink._sink_id, 0) + 1
    weakref.finalize(sink, _release, sink._collector, sink._sink_id).atexit = False


def _release(collector: Any, sink_id: str) -> None:
    with _collectors_lock:
        left = _holders.pop(sink_id, 1) - 1
        if left > 0:
            _holders[sink_id] = left
            return
    try:
        collector.release.remote(sink_id)
    except Exception:  # noqa: BLE001 - Ray is shut down: the collector went with it
        pass


@dataclass
class _Buffer:
    txn_id: str
    subtask: int
    sequence: int
    batches: list[pa.RecordBatch] = field(default_factory=list)
    size: int = 0


#: A pre-committed CollectSink transaction: (transaction id, subtask, sequence, Arrow IPC).
CollectCommittable = tuple[str, int, int, bytes]


def _to_ipc(batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    table = pa.Table.from_batches(batches)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


class _CollectSerializer(CommittableSerializer[CollectCommittable]):
    """Version 1: a 4-byte length, a JSON header (id, subtask, sequence), the IPC bytes."""

    version = 1

    def serialize(self, committable: CollectCommittable) -> bytes:
        txn_id, subtask, sequence, data = committable
        header = json.dumps([txn_id, subtask, sequence]).encode("utf-8")
        return len(header).to_bytes(4, "big") + header + data

    def deserialize(self, version: int, data: bytes) -> CollectCommittable:
        size = int.from_bytes(data[:4], "big")
        txn_id, subtask, sequence = json.loads(data[4 : 4 + size])
        return (txn_id, subtask, sequence, bytes(data[4 + size :]))


class _CollectWriter(TransactionWriter[_Buffer, CollectCommittable]):
    """A view of the CollectSink's own transaction methods for one subtask."""

    def __init__(self, sink: CollectSink, context: SinkContext) -> None:
        self.sink = sink
        self.context = context

    def begin_transaction(self, sequence: int) -> _Buffer:
        return self.sink.begin_transaction(self.context, sequence)

    def write(self, transaction: _Buffer, batch: pa.RecordBatch) -> None:
        self.sink.write(transaction, batch)

    def transaction_size(self, transaction: _Buffer) -> int:
        return self.sink.transaction_size(transaction)

    def is_empty(self, transaction: _Buffer) -> bool:
        return self.sink.is_empty(transaction)

    def pre_commit(
        self, transaction: _Buffer, checkpoint_id: int | None = None
    ) -> CollectCommittable:
        return self.sink.pre_commit(transaction)

    def abort_transaction(self, transaction: _Buffer) -> None:
        self.sink.abort_transaction(transaction)

    def close(self) -> None:
        self.sink.close()


class _CollectCommitter(Committer[CollectCommittable]):
    """A view of the CollectSink's own commit methods, giving ``guarantee``."""

    def __init__(self, sink: CollectSink, guarantee: DeliveryGuarantee) -> None:
        self.sink = sink
        self.guarantee = guarantee

    def commit(self, committable: CollectCommittable) -> CommitOutcome:
        return self.sink.commit_outcome(committable, self.guarantee)

    def abort(self, committable: CollectCommittable) -> None:
        self.sink.abort(committable)

    def abort_lingering(self, context: SinkContext, keep: Sequence[CollectCommittable]) -> int:
        return self.sink.abort_lingering(context, keep)

    def committable_id(self, committable: CollectCommittable) -> str:
        return self.sink.committable_id(committable)


class CollectSink(TwoPhaseCommittingSink[_Buffer, CollectCommittable]):
    """Brings the committed rows back to the driver as one ``pyarrow.Table``.

    Read them with ``result.sink_result(sink)``. Rows of one subtask keep their order;
    subtasks follow in index order. ``commit_calls`` counts commit calls, repeated
    ones included, for tests that want to see idempotence at work.

    CollectSink keeps nothing in a subtask but in-memory buffers, and its outside world
    is the collector actor (a handle that pickles with the sink). So its transaction
    steps are its own methods, and the writer and committer it makes for a subtask
    only call them: a subclass overrides a step (tests inject faults that way).
    """

    def __init__(self, delivery_guarantee=None, rolling_policy=None) -> None:
        super().__init__(delivery_guarantee, rolling_policy)
        #: the collector actor (a handle: it pickles into every subtask), from ``setup``
        self._collector = None
        #: this sink's key in the collector, from ``setup``
        self._sink_id: str | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        collector = self._collector
        if collector is not None and _owned_here(collector):
            _hold(self)  # a copy in the process that set it up: its rows stay while it lives

    def setup(self, job_name: str, guarantee: Any = None) -> None:
        # A sink of an earlier job keeps its collector (its rows so far stay with it),
        # unless that one is not this process's on the Ray it is connected to now: the
        # handle of a collector that went with an earlier Ray must not travel.
        if self._collector is None or not _owned_here(self._collector):
            self._sink_id = uuid.uuid4().hex  # drawn here: copies made before are sinks apart
            self._collector = _collector_here()
            # the rows stay collected while this sink object (or a copy) lives here
            _hold(self)

    def _require(self):
        if self._collector is None:
            raise RuntimeError("CollectSink used outside of a job (setup() was not called)")
        return self._collector

    def create_transaction_writer(self, context: SinkContext) -> _CollectWriter:
        return _CollectWriter(self, context)

    def create_committer(self, context: SinkContext | None) -> _CollectCommitter:
        return _CollectCommitter(self, self.guarantee_in(context))

    def committable_serializer(self) -> _CollectSerializer:
        return _CollectSerializer()

    # --- the transaction steps ----------------------------------------------------------

    def begin_transaction(self, context: SinkContext, sequence: int) -> _Buffer:
        # the run is in the id: a rerun of the job name with this sink object (not a
        # restore) starts its sequences again, and its transactions are new ones
        run = f"{context.run_tag()}-" if context.run_id else ""
        return _Buffer(
            f"{self.transaction_prefix(context)}{run}{sequence}", context.subtask_index, sequence
        )

    def write(self, transaction: _Buffer, batch: pa.RecordBatch) -> None:
        transaction.batches.append(batch)
        transaction.size += batch.nbytes

    def transaction_size(self, transaction: _Buffer) -> int:
        return transaction.size

    def is_empty(self, transaction: _Buffer) -> bool:
        return not transaction.batches

    def pre_commit(
        self, transaction: _Buffer, checkpoint_id: int | None = None
    ) -> CollectCommittable:
        return (
            transaction.txn_id,
            transaction.subtask,
            transaction.sequence,
            _to_ipc(transaction.batches),
        )

    def abort_transaction(self, transaction: _Buffer) -> None:
        transaction.batches.clear()

    def commit_outcome(
        self, committable: CollectCommittable, guarantee: DeliveryGuarantee | None = None
    ) -> CommitOutcome:
        collector = self._require()
        if (guarantee or self.delivery_guarantee) is DeliveryGuarantee.EXACTLY_ONCE:
            new = collector.commit.remote(self._sink_id, *committable).future().result()
            return CommitOutcome.committed() if new else CommitOutcome.already_committed()
        # Without exactly-once, commits are plain appends: a replayed transaction
        # shows up again, as it would in any write-through store.
        collector.append.remote(self._sink_id, committable[0], committable[3]).future().result()
        return CommitOutcome.committed()

    def commit(self, committable: CollectCommittable) -> None:
        self.commit_outcome(committable)  # answers done, or raises

    def abort(self, committable: CollectCommittable) -> None:
        return None  # nothing of it is outside the checkpoint before commit

    def abort_lingering(self, context: SinkContext, keep: Sequence[CollectCommittable]) -> int:
        return 0  # transactions live in checkpoints only: none can linger outside

    def committable_id(self, committable: CollectCommittable) -> str:
        return committable[0]

    def close(self) -> None:
        """Called once per subtask attempt when its writer closes (nothing to release)."""

    def merge_results(self, results: list[Any]) -> pa.Table:
        contents = ray.get(self._require().contents.remote(self._sink_id))
        self.commit_calls = contents["commit_calls"]
        tables = [_from_ipc(data) for _, data in contents["transactions"]]
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="default").combine_chunks()
