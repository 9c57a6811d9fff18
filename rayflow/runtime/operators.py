"""Runtime operators: the units a subtask chains together.

Contract, for every operator (called only from the subtask's mailbox loop):

* ``open(context)`` once before anything else;
* ``process(batch)`` returns the output batches for one input batch;
* ``end_input()`` returns the last output batches once every input has ended;
* ``snapshot_state(checkpoint_id)`` returns a picklable snapshot (None when stateless) and
  ``restore_state(snapshots)`` loads the snapshots of one or more earlier
  subtasks (several when rescaling);
* ``notify_checkpoint_complete(checkpoint_id)`` / ``result()`` / ``close()``;
* ``on_timer(token)`` when a timer the operator set with ``context.timers.schedule``
  fires (on the mailbox), and ``commits_outstanding()``: True keeps the subtask from
  finishing after its final checkpoint (a sink with commits still due).

Per-record functions convert a batch to dicts and back (:mod:`rayflow.runtime.records`);
``map_batches`` and the built-in keyed aggregations stay vectorized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import pyarrow as pa

from rayflow.functions import (
    FilterFunction,
    FlatMapFunction,
    Function,
    KeyedProcessFunction,
    MapFunction,
    ReduceFunction,
    RuntimeContext,
)
from rayflow.guarantees import DeliveryGuarantee
from rayflow.keygroups import key_group_of, key_groups_of_array, key_groups_of_subtask
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime.hooks import HookPoint
from rayflow.runtime.records import batch_to_columns, batch_to_rows, rows_to_batches
from rayflow.sink import Sink, SinkContext
from rayflow.state import KeyedStateBackend


@dataclass(frozen=True)
class OperatorContext:
    job_name: str
    operator_name: str
    operator_uid: str
    subtask_index: int
    parallelism: int
    max_parallelism: int
    attempt: int
    hooks: Any = None  # rayflow.runtime.hooks.SubtaskHooks, or None
    checkpointing: bool = False
    fence: Any = None  # rayflow.runtime.fence.AttemptFence of this attempt
    run_id: str = ""
    #: ``schedule(delay_s, token)``: call ``on_timer(token)`` on the mailbox after
    #: ``delay_s`` (thread-safe); None outside a subtask
    timers: Any = None


class Operator:
    name = "operator"

    def open(self, context: OperatorContext) -> None:
        self.context = context

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        raise NotImplementedError

    def end_input(self) -> list[pa.RecordBatch]:
        return []

    def snapshot_state(self, checkpoint_id: int) -> Any:
        return None

    def restore_state(self, snapshots: list[Any]) -> None:
        pass

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        pass

    def on_timer(self, token: Any) -> None:
        pass

    def commits_outstanding(self) -> bool:
        return False

    def result(self) -> Any:
        return None

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def _call_open(function: Any, runtime_context: RuntimeContext) -> None:
    if isinstance(function, Function):
        function.open(runtime_context)


def _call_close(function: Any) -> None:
    if isinstance(function, Function):
        function.close()


class _UserFunctionOperator(Operator):
    def __init__(self, function: Any) -> None:
        self.function = function

    def _runtime_context(self, backend: KeyedStateBackend | None = None) -> RuntimeContext:
        c = self.context
        return RuntimeContext(
            c.operator_name, c.subtask_index, c.parallelism, c.max_parallelism, c.attempt, backend
        )

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        _call_open(self.function, self._runtime_context())

    def close(self) -> None:
        _call_close(self.function)


class MapOperator(_UserFunctionOperator):
    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.map if isinstance(fn, MapFunction) else fn

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        return rows_to_batches(list(map(self._call, batch_to_rows(batch))))


class FlatMapOperator(_UserFunctionOperator):
    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.flat_map if isinstance(fn, FlatMapFunction) else fn

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        call = self._call
        out: list[dict[str, Any]] = []
        extend = out.extend
        for record in batch_to_rows(batch):
            produced = call(record)
            if produced is not None:
                extend(produced)
        return rows_to_batches(out)


class FilterOperator(_UserFunctionOperator):
    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.filter if isinstance(fn, FilterFunction) else fn

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        mask = pa.array(list(map(bool, map(self._call, batch_to_rows(batch)))), type=pa.bool_())
        kept = batch.filter(mask)
        return [kept] if kept.num_rows else []


class MapBatchesOperator(_UserFunctionOperator):
    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        out = self.function(batch)
        if out is None:
            return []
        if isinstance(out, pa.RecordBatch):
            return [out] if out.num_rows else []
        if isinstance(out, pa.Table):
            return [b for b in out.to_batches() if b.num_rows]
        raise TypeError(
            f"map_batches function must return a pyarrow.RecordBatch, Table or None, "
            f"got {type(out).__name__}"
        )


class _KeyedOperator(_UserFunctionOperator):
    #: Restored from every earlier subtask's snapshot; the backend keeps its key groups.
    keyed = True

    def __init__(self, key: KeySelector, function: Any = None) -> None:
        super().__init__(function)
        self.key = key

    def open(self, context: OperatorContext) -> None:
        Operator.open(self, context)
        self.backend = KeyedStateBackend(
            context.max_parallelism,
            key_groups_of_subtask(
                context.subtask_index, context.parallelism, context.max_parallelism
            ),
        )
        _call_open(self.function, self._runtime_context(self.backend))

    def _rows_and_keys(self, batch: pa.RecordBatch) -> tuple[list[dict[str, Any]], Any]:
        """The records of ``batch`` and their keys: a list taken up front, or, when the
        key is a user function, a lazy map that calls it per record in turn with the
        operator's function."""
        rows, columns = batch_to_columns(batch)
        key = self.key.key
        if isinstance(key, str):
            names = batch.schema.names
            if names.count(key) == 1:
                return rows, columns[names.index(key)]
            return rows, list(map(itemgetter(key), rows))  # absent (KeyError) or repeated
        if isinstance(key, tuple):
            return rows, list(map(self.key.key_of, rows))
        return rows, map(self.key.key_of, rows)

    def snapshot_state(self, checkpoint_id: int) -> Any:
        return self.backend.snapshot()

    def restore_state(self, snapshots: list[Any]) -> None:
        self.backend.restore(s for s in snapshots if s)


class KeyedReduceOperator(_KeyedOperator):
    """Emits, for every record, the reduced value of its key so far (Flink's ``reduce``)."""

    STATE = "reduce"

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.reduce if isinstance(fn, ReduceFunction) else fn
        # A Function was opened with the runtime context and may use keyed state in
        # reduce(): it needs the current key set per record. A plain callable cannot
        # reach the state, so its loop skips that.
        self._sets_key = isinstance(fn, Function)
        self._tables = self.backend.key_tables(self.STATE)

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        rows, keys = self._rows_and_keys(batch)
        if not rows:
            return []
        backend, call, name = self.backend, self._call, self.STATE
        tables, table_of_key = self._tables, backend.table_of_key
        set_key = backend.set_current_key if self._sets_key else None
        out: list[dict[str, Any]] = []
        append = out.append
        key = None
        for key, record in zip(keys, rows):
            if set_key is not None:
                set_key(key)
            table = tables.get(key)
            if table is None:
                table = table_of_key(key, name)
            previous = table.get(key)
            value = record if previous is None else call(previous, record)
            table[key] = value
            append(value)
        backend.set_current_key(key)  # where setting it per record would have left it
        return rows_to_batches(out)


class KeyedProcessOperator(_KeyedOperator):
    def open(self, context: OperatorContext) -> None:
        super().open(context)
        if not isinstance(self.function, KeyedProcessFunction):
            raise TypeError("process() takes a KeyedProcessFunction")
        self._ctx = KeyedProcessFunction.Context(self.backend)

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        rows, keys = self._rows_and_keys(batch)
        set_key, process_element, ctx = (
            self.backend.set_current_key,
            self.function.process_element,
            self._ctx,
        )
        out: list[dict[str, Any]] = []
        extend = out.extend
        for key, record in zip(keys, rows):
            set_key(key)
            produced = process_element(record, ctx)
            if produced is not None:
                extend(produced)
        return rows_to_batches(out)


_AGGREGATIONS: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    "sum": ("sum", lambda a, b: a + b),
    "count": ("count", lambda a, b: a + b),
    "min": ("min", min),
    "max": ("max", max),
}


class KeyedAggregateOperator(_KeyedOperator):
    """Running sum / count / min / max per key, vectorized per batch.

    Like Flink's mini-batch aggregation, each input batch emits one row per key
    it touched, holding that key's running aggregate after the batch: the
    columns are the key column (``key`` for a key function) and the field
    (``count`` for counts).
    """

    def __init__(self, key: KeySelector, aggregation: str, field: str | None) -> None:
        super().__init__(key)
        if aggregation not in _AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}")
        self.aggregation = aggregation
        self.field = field
        self.output_field = field if aggregation != "count" else "count"
        self.state_name = f"{aggregation}:{self.output_field}"

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        if batch.num_rows == 0:
            return []
        key_column = self.key.column
        if self.field is not None and self.field not in batch.schema.names:
            raise KeyError(
                f"{self.aggregation}({self.field!r}): no such column "
                f"(columns: {batch.schema.names})"
            )
        if key_column is not None:
            keys, partials = self._partials_vectorized(batch, key_column)
        else:
            keys, partials = self._partials_per_record(batch)
        combine = _AGGREGATIONS[self.aggregation][1]
        backend, name, maxp = self.backend, self.state_name, self.context.max_parallelism
        if key_column is not None:
            groups = key_groups_of_array(pa.array(keys), maxp).tolist()
        else:
            groups = [key_group_of(k, maxp) for k in keys]
        totals = []
        for key, group, partial in zip(keys, groups, partials):
            table = backend.table_for_group(group, name)
            previous = table.get(key)
            total = partial if previous is None else combine(previous, partial)
            table[key] = total
            totals.append(total)
        key_name = key_column or "key"
        return [pa.RecordBatch.from_pydict({key_name: keys, self.output_field: totals})]

    def _partials_vectorized(self, batch: pa.RecordBatch, key_column: str) -> tuple[list, list]:
        table = pa.Table.from_batches([batch])
        arrow_agg = _AGGREGATIONS[self.aggregation][0]
        if self.aggregation == "count":
            grouped = table.group_by(key_column, use_threads=False).aggregate([([], "count_all")])
            partial_column = "count_all"
        else:
            grouped = table.group_by(key_column, use_threads=False).aggregate(
                [(self.field, arrow_agg)]
            )
            partial_column = f"{self.field}_{arrow_agg}"
        return grouped.column(key_column).to_pylist(), grouped.column(partial_column).to_pylist()

    def _partials_per_record(self, batch: pa.RecordBatch) -> tuple[list, list]:
        combine = _AGGREGATIONS[self.aggregation][1]
        keys = self.key.keys_of_batch(batch)
        values = [1] * len(keys) if self.field is None else batch.column(self.field).to_pylist()
        partials: dict[Any, Any] = {}
        for key, value in zip(keys, values):
            partials[key] = value if key not in partials else combine(partials[key], value)
        return list(partials.keys()), list(partials.values())


class SinkOperator(Operator):
    """Hands batches to the sink's writer for this subtask; flushes it at every barrier."""

    def __init__(self, sink: Sink, guarantee: DeliveryGuarantee | None = None) -> None:
        self.sink = sink
        self.mode = guarantee if guarantee is not None else sink.delivery_guarantee
        self._result: Any = None

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        self.writer = self.sink.create_writer(
            SinkContext(
                job_name=context.job_name,
                operator_uid=context.operator_uid,
                subtask_index=context.subtask_index,
                parallelism=context.parallelism,
                attempt=context.attempt,
                run_id=context.run_id,
                delivery_guarantee=self.mode,
                fence=context.fence,
                operator_name=context.operator_name,
            )
        )

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        self.writer.write(batch)
        return []

    def snapshot_state(self, checkpoint_id: int) -> Any:
        hooks = self.context.hooks
        if hooks is not None:
            hooks.at(HookPoint.SINK_BEFORE_PRE_COMMIT)
        self.writer.flush()
        if hooks is not None:
            hooks.at(HookPoint.SINK_AFTER_PRE_COMMIT)
        return None

    def end_input(self) -> list[pa.RecordBatch]:
        self._result = self.writer.finish()
        return []

    def result(self) -> Any:
        return self._result

    def close(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.close()


def factory(cls: type[Operator], *args: Any) -> Callable[[], Operator]:
    """A picklable zero-argument builder of ``cls(*args)``."""
    return _Factory(cls, args)


class _Factory:
    def __init__(self, cls: type[Operator], args: Iterable[Any]) -> None:
        self.cls = cls
        self.args = tuple(args)

    def __call__(self) -> Operator:
        return self.cls(*self.args)
