"""Runtime operators: the units a subtask chains together.

Contract, for every operator (called only from the subtask's mailbox loop):

* ``open(context)`` once before anything else;
* ``process(batch)`` returns the output batches for one input batch;
* ``end_input()`` returns the last output batches once every input has ended;
* ``snapshot_state(checkpoint_id)`` returns a picklable snapshot (None when stateless) and
  ``restore_state(snapshots)`` loads the snapshots of one or more earlier
  subtasks (several when rescaling);
* ``notify_checkpoint_complete(checkpoint_id)`` / ``result()`` / ``close()``;
* ``process_watermark(watermark)`` when event time advances (before the watermark goes
  on downstream): returns output batches, as ``process`` (timers and windows fire);
* ``on_timer(token)`` when a timer the operator set with ``context.timers.schedule``
  fires (on the mailbox; it may return output batches), and ``commits_outstanding()``:
  True keeps the subtask from finishing after its final checkpoint (a sink with commits
  still due).

Per-record functions convert a batch to dicts and back (:mod:`rayflow.runtime.records`),
which keeps each operator's output in one schema and names records that are not dicts;
a big batch is converted a slice at a time, its records kept in the CPU's caches, and
leaves as one batch;
``map_batches`` and the built-in keyed aggregations stay vectorized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import wraps
from itertools import repeat
from operator import itemgetter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rayflow.errors import RecordError
from rayflow.eventtime.strategy import (
    TIMESTAMP_COLUMN,
    attach_timestamps,
    split_timestamps,
    without_timestamps,
)
from rayflow.eventtime.timers import InternalTimerService, TimeDomain
from rayflow.functions import (
    FilterFunction,
    FlatMapFunction,
    Function,
    KeyedProcessFunction,
    MapFunction,
    ReduceFunction,
    RuntimeContext,
    TimerService,
)
from rayflow.guarantees import DeliveryGuarantee
from rayflow.keygroups import key_group_of, key_groups_of_array, key_groups_of_subtask
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime.hooks import HookPoint
from rayflow.runtime.map_loop import MapLoop, map_loop
from rayflow.runtime.record_copy import (
    copies_shallowly,
    record_copier,
    records_extender,
    take_records,
)
from rayflow.runtime.records import (
    RETURNS_RECORD,
    RETURNS_RECORDS,
    YIELDS_RECORDS,
    Columns,
    OutputRecords,
    batch_to_columns,
    batch_to_rows,
    column_values,
    iter_columns,
)
from rayflow.runtime.reduce_loop import END, ReduceLoop, reduce_loop
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
    #: emitted records are not copied (``ExecutionConfig.enable_object_reuse``)
    object_reuse: bool = False


class Operator:
    name = "operator"
    #: its timers go on after a final barrier (commit retries, which the attempt waits
    #: for); a function's timers are held there: they are in the snapshot
    timers_after_final_barrier = False

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

    def process_watermark(self, watermark: int) -> list[pa.RecordBatch]:
        return []

    def on_timer(self, token: Any) -> list[pa.RecordBatch] | None:
        return None

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
    #: how errors name this kind of operator (``map 'Double' must return ...``)
    kind = "function"
    #: what the function must give, in words
    returns = RETURNS_RECORD

    def __init__(self, function: Any, output_type: pa.Schema | None = None) -> None:
        self.function = function
        self.output_type = output_type

    def _output(self) -> OutputRecords:
        """Where this operator's records become batches of one schema."""
        return OutputRecords(
            f"{self.kind} {self.context.operator_name!r}", self.output_type, self.returns
        )

    def _runtime_context(self, backend: KeyedStateBackend | None = None) -> RuntimeContext:
        c = self.context
        return RuntimeContext(
            c.operator_name, c.subtask_index, c.parallelism, c.max_parallelism, c.attempt, backend
        )

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        _call_open(self.function, self._runtime_context())

    def _copier(self) -> Callable[[Any], Any] | None:
        """How to copy a record this operator emits before user code may change it again
        (see :mod:`rayflow.runtime.record_copy`); None with object reuse on."""
        if self.context.object_reuse:
            return None
        return record_copier(self._out.schema)

    def close(self) -> None:
        _call_close(self.function)


#: Values (rows x columns) a per-record operator turns into Python records at a time.
#: A source's 1 MiB batch is 131072 rows of one int64 column: its records, their
#: copies and the output lists are tens of MB, far past the CPU's caches, and every
#: record then costs about a third more than in a slice of 8192 rows of two columns
#: (``benchmarks/per_record.py``).
SLICE_VALUES = 16_384
#: ... and never fewer rows than this at a time (wide records).
MIN_SLICE_ROWS = 1024


def slice_rows(batch: pa.RecordBatch) -> int:
    """Rows of ``batch`` a per-record operator takes at a time."""
    return max(MIN_SLICE_ROWS, SLICE_VALUES // max(1, batch.num_columns))


def _join(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """``batches`` (of one schema) as one batch (``pa.concat_batches`` is in pyarrow 19 and
    later)."""
    concat = getattr(pa, "concat_batches", None)
    if concat is not None:
        return concat(batches)
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def _in_slices(
    process: Callable[[Any, pa.RecordBatch], list[pa.RecordBatch]],
) -> Callable[[Any, pa.RecordBatch], list[pa.RecordBatch]]:
    """``process``, whose output is rows of its input (a filter's), run on consecutive
    slices of a big batch; their outputs leave as one batch."""

    @wraps(process)
    def in_slices(self: Any, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        rows = batch.num_rows
        step = slice_rows(batch)
        if rows <= step:
            return process(self, batch)
        out: list[pa.RecordBatch] = []
        for offset in range(0, rows, step):
            out.extend(process(self, batch.slice(offset, step)))
        return [_join(out)] if len(out) > 1 else out

    return in_slices


#: A per-record operator's records out for a batch (or their values as columns), and
#: their timestamps (None where the batch has none, or the operator emits none).
Records = tuple[list[Any] | Columns, list[int] | None]


def _process_records(op: Any, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """A per-record operator's ``process``: ``op._records(batch)`` calls its function on
    each record and gathers what it emitted; the records are built into a batch of the
    output's schema. Once that schema is settled a big batch's records are gathered and
    built a slice at a time, and leave as one batch; until then a whole batch infers the
    schema, as it always did.

    The batch out is the one the whole batch's records build. Arrow types a column by the
    values it sees together (a slice of only ints for a decimal column, or of only naive
    datetimes for an aware one, is typed apart from the batch's first values), so where a
    slice's records do not build, or the slices do not join, the batch is built whole
    (:func:`_as_whole`): what the whole batch gives, batch or error, it gives."""
    rows = batch.num_rows
    step = slice_rows(batch)
    if rows <= step or not op._out.settled:
        records, stamps = op._records(batch)
        return attach_timestamps(op._out.build(records), stamps)
    out: list[pa.RecordBatch] = []
    for offset in range(0, rows, step):
        records, stamps = op._records(batch.slice(offset, step))
        try:
            out.extend(attach_timestamps(op._out.build(records), stamps))
            continue
        except Exception:  # noqa: BLE001 - the whole batch says what is wrong, if anything
            pass
        # (outside the except: an error of the whole batch is raised as its own)
        rest = (op._records(batch.slice(at, step)) for at in range(offset + step, rows, step))
        return _as_whole(op, out, [(records, stamps), *rest])
    if len(out) <= 1:
        return out
    try:
        return [_join(out)]
    except pa.ArrowException:  # e.g. more distinct values than a dictionary's index counts
        pass
    return _as_whole(op, out, [])


def _as_whole(op: Any, done: list[pa.RecordBatch], rest: Iterable[Records]) -> list[pa.RecordBatch]:
    """The batch out built whole: the records of the slices already built (``done``, taken
    back from their batches), then the records of the rest of the batch (gathered as they
    are read, the function called on each record as the whole batch calls it)."""
    rows: list[Any] = []
    stamps: list[int] = []
    timed = False
    for batch in done:
        batch, timestamps = split_timestamps(batch)
        rows += batch_to_rows(batch)
        if timestamps is not None:
            timed = True
            stamps += timestamps.to_pylist()
    for records, more in rest:
        rows += records.rows() if isinstance(records, Columns) else records
        if more is not None:
            timed = True
            stamps += more
    return attach_timestamps(op._out.build(rows), stamps if timed else None)


def _stopped(what: str, part: str = "function") -> RuntimeError:
    """The error for a user function that raised StopIteration: inside ``map()`` or a
    ``for`` loop it would otherwise end the batch early, dropping the records after it."""
    return RuntimeError(
        f"{what}: its {part} raised StopIteration, which would end the batch early; "
        "raise another exception, or return a value"
    )


def _keys_of(key_of: Callable[[Any], Any], rows: Iterable[Any], what: str) -> Iterator[Any]:
    """``map(key_of, rows)``, except that a key function raising StopIteration fails
    instead of ending the keys (and so the batch) early."""
    try:
        for row in rows:
            yield key_of(row)
    except StopIteration as exc:
        raise _stopped(what, "key function") from exc


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


class MapOperator(_UserFunctionOperator):
    kind = "map"

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.map if isinstance(fn, MapFunction) else fn
        self._out = self._output()
        self._loop_for: tuple[Any, ...] | None = None
        self._loop: MapLoop | None = None

    def _column_loop(self, batch: pa.RecordBatch) -> MapLoop | None:
        """The loop that emits into columns (:mod:`rayflow.runtime.map_loop`), once the
        output's schema is settled; None before, and where there is none."""
        out = self._out
        schema = out.schema
        if not out.settled or schema is None or not batch.num_rows:
            return None
        if self.context.object_reuse:
            # object reuse: the record path emits a dict the function keeps changing as
            # it is when the batch is built; so must a map without the C module, so the
            # records do not go through the columns (which take each value as returned)
            return None
        inputs = batch.schema.names
        signature = (schema, inputs)
        if self._loop_for != signature:
            self._loop_for, self._loop = signature, map_loop(tuple(inputs), schema)
        return self._loop

    def _records(self, batch: pa.RecordBatch) -> Records:
        batch, timestamps = split_timestamps(batch)
        stamps = None if timestamps is None else timestamps.to_pylist()
        loop = self._column_loop(batch)
        if loop is not None:
            return self._mapped_columns(loop, batch), stamps
        return self._mapped(batch, self._copier()), stamps

    def _mapped(self, batch: pa.RecordBatch, copy: Callable[[Any], Any] | None) -> list[Any]:
        # the function may return a dict it keeps and changes: each is copied as returned
        mapped = take_records(map(self._call, iter_columns(batch)[0]), copy)
        if len(mapped) != batch.num_rows:  # map() ended at a StopIteration the call raised
            raise _stopped(self._out.what)
        return mapped

    def _mapped_columns(self, loop: MapLoop, batch: pa.RecordBatch) -> list[Any] | Columns:
        """The values ``batch``'s records map to, taken apart into columns as returned;
        from the first that is not a record of the schema on, as records."""
        schema = self._out.schema
        assert schema is not None
        columns = Columns(tuple(schema.names), [[] for _ in schema.names])
        try:
            row, value = loop(self._call, columns.lists, *map(column_values, batch.columns))
        except StopIteration as exc:
            raise _stopped(self._out.what) from exc
        if value is END:
            if row != batch.num_rows:  # as _mapped: the input's lists ended early
                raise _stopped(self._out.what)
            return columns
        copy = self._copier()
        out = columns.rows()
        out.append(value if copy is None else copy(value))
        rest = batch.slice(row + 1)
        if rest.num_rows:
            out += self._mapped(rest, copy)
        return out

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        return _process_records(self, batch)


class FlatMapOperator(_UserFunctionOperator):
    kind = "flat_map"
    returns = RETURNS_RECORDS

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.flat_map if isinstance(fn, FlatMapFunction) else fn
        self._out = self._output()

    def _records(self, batch: pa.RecordBatch) -> Records:
        call = self._call
        batch, timestamps = split_timestamps(batch)
        out: list[dict[str, Any]] = []
        copy = self._copier()  # a generator may change and yield one dict again
        extend = records_extender(out, copy)
        produced = None
        out_ts: list[int] | None = None if timestamps is None else []
        stamps: Any = repeat(None) if timestamps is None else timestamps.to_pylist()
        try:
            for record, stamp in zip(batch_to_rows(batch), stamps):
                produced = call(record)
                if produced is not None:
                    before = len(out)
                    extend(produced)
                    if out_ts is not None:
                        out_ts.extend([stamp] * (len(out) - before))
        except TypeError as exc:
            if produced is not None and not _iterable(produced):
                raise RecordError(self._out.not_iterable(produced)) from exc
            raise
        except StopIteration as exc:
            raise _stopped(self._out.what) from exc
        return out, out_ts

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        return _process_records(self, batch)


class FilterOperator(_UserFunctionOperator):
    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.filter if isinstance(fn, FilterFunction) else fn

    @_in_slices
    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        rows = batch_to_rows(without_timestamps(batch))
        kept_flags = list(map(bool, map(self._call, rows)))
        if len(kept_flags) != len(rows):  # map() ended at a StopIteration the call raised
            raise _stopped(f"filter {self.context.operator_name!r}")
        mask = pa.array(kept_flags, type=pa.bool_())
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

    def __init__(
        self, key: KeySelector, function: Any = None, output_type: pa.Schema | None = None
    ) -> None:
        super().__init__(function, output_type)
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
        return rows, _keys_of(key, rows, f"{self.kind} {self.context.operator_name!r}")

    def _lazy_rows_and_keys(self, batch: pa.RecordBatch) -> tuple[Iterable[dict[str, Any]], Any]:
        """As :meth:`_rows_and_keys` for a loop that reads each record once, in order:
        where the key is a column of its own the records are built one at a time as the
        loop reads them (:func:`iter_columns`)."""
        key = self.key.key
        if isinstance(key, str):
            names = batch.schema.names
            if names.count(key) == 1:
                rows, columns = iter_columns(batch)
                return rows, columns[names.index(key)]
        return self._rows_and_keys(batch)

    def snapshot_state(self, checkpoint_id: int) -> Any:
        return self.backend.snapshot()

    def restore_state(self, snapshots: list[Any]) -> None:
        self.backend.restore(s for s in snapshots if s)


class KeyedReduceOperator(_KeyedOperator):
    """Emits, for every record, the reduced value of its key so far (Flink's ``reduce``)."""

    STATE = "reduce"
    kind = "reduce"

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        fn = self.function
        self._call = fn.reduce if isinstance(fn, ReduceFunction) else fn
        # A Function was opened with the runtime context and may use keyed state in
        # reduce(): it needs the current key set per record. A plain callable cannot
        # reach the state, so its loop skips that.
        self._sets_key = isinstance(fn, Function)
        self._tables = self.backend.key_tables(self.STATE)
        self._out = self._output()
        self._loop_for: tuple[Any, ...] | None = None
        self._loop: ReduceLoop | None = None

    def restore_state(self, snapshots: list[Any]) -> None:
        super().restore_state(snapshots)
        # The reduce of an earlier version kept event time's timestamp column in the
        # values it reduced (it now stays out of every record): restored, a value that
        # still holds it would emit it as a key of its own.
        for table in self.backend.tables(self.STATE):
            for value in table.values():
                if isinstance(value, dict):
                    value.pop(TIMESTAMP_COLUMN, None)

    def _compiled_loop(self, batch: pa.RecordBatch) -> ReduceLoop | None:
        """The loop that builds ``batch``'s records and emits into columns, once the
        output's schema is settled (None before, where the key is not one column of the
        batch, and for a schema it cannot take: :mod:`rayflow.runtime.reduce_loop`)."""
        out = self._out
        schema = out.schema
        if not out.settled or schema is None:
            return None
        inputs = batch.schema.names
        signature = (schema, inputs)
        if self._loop_for != signature:
            key = self.key.key
            loop = None
            if isinstance(key, str) and inputs.count(key) == 1:
                loop = reduce_loop(tuple(inputs), inputs.index(key), schema, self._sets_key)
            self._loop_for, self._loop = signature, loop
        return self._loop

    def _records(self, batch: pa.RecordBatch) -> Records:
        if not batch.num_rows:
            return [], None
        # event time: each record out carries the timestamp of the record it came from
        batch, timestamps = split_timestamps(batch)
        stamps = None if timestamps is None else timestamps.to_pylist()
        return self._reduced(batch), stamps

    def _reduced(self, batch: pa.RecordBatch) -> list[Any] | Columns:
        """What the records of ``batch`` (no timestamps) reduce to, one per record."""
        backend = self.backend
        # the state keeps the value, the output a copy: the next call may change the value
        copy = self._copier()
        loop = self._compiled_loop(batch)
        if loop is None:
            rows, keys = self._lazy_rows_and_keys(batch)
            return self._reduced_records(zip(keys, rows), [], copy, None)
        schema = self._out.schema
        assert schema is not None
        columns = Columns(tuple(schema.names), [[] for _ in schema.names])
        where: list[Any] = [None, None]
        try:
            key, value = loop(
                self._tables,
                backend.table_of_key,
                self.STATE,
                self._call,
                backend.set_current_key,
                columns.lists,
                where,
                *map(column_values, batch.columns),
            )
        except Exception as exc:
            error = self._failed(where[1], exc)
            if error is exc:
                raise
            raise error from exc
        if value is END:
            if len(columns) != batch.num_rows:  # the input's lists ended early
                raise RuntimeError(
                    f"{self._out.what}: {len(columns)} of its batch's {batch.num_rows} records "
                    "were reduced: its function changed the operator's own lists"
                )
            backend.set_current_key(key)  # where setting it per record would have left it
            return columns
        # not a record of the schema's keys and types: it and the rest go as records
        out = columns.rows()
        out.append(value if copy is None else copy(value))
        rest = batch.slice(len(out))
        if rest.num_rows:
            rows, keys = self._lazy_rows_and_keys(rest)
            return self._reduced_records(zip(keys, rows), out, copy, key)
        backend.set_current_key(key)
        return out

    def _reduced_records(
        self, pairs: Iterator[tuple[Any, Any]], out: list[Any], copy: Any, key: Any
    ) -> list[Any]:
        """Reduces the records of ``pairs`` (key, record), appending what is emitted to
        ``out`` (copied with ``copy``); ``key`` is the key of the last record before."""
        backend, call, name = self.backend, self._call, self.STATE
        tables, table_of_key = self._tables, backend.table_of_key
        set_key = backend.set_current_key if self._sets_key else None
        append = out.append
        shallow = copies_shallowly(copy)  # a plain dict: dict.copy, called at once
        previous = None
        try:
            for key, record in pairs:
                if set_key is not None:
                    set_key(key)
                table = tables.get(key)
                if table is None:
                    table = table_of_key(key, name)
                previous = table.get(key)
                value = record if previous is None else call(previous, record)
                table[key] = value
                if copy is None:
                    append(value)
                elif shallow and type(value) is dict:
                    append(value.copy())
                else:
                    append(copy(value))
        except Exception as exc:
            error = self._failed(previous, exc)
            if error is exc:
                raise
            raise error from exc
        backend.set_current_key(key)  # where setting it per record would have left it
        return out

    def _failed(self, previous: Any, exc: Exception) -> Exception:
        """The error to raise for ``exc``, raised by the call on ``previous`` (the state's
        value): a StopIteration in words, and an earlier call that returned no record
        (the cause of this one's failure) named; else ``exc`` itself."""
        if isinstance(exc, StopIteration):
            return _stopped(self._out.what)
        if previous is not None and not isinstance(previous, dict):
            return RecordError(self._out.not_a_record(previous))
        return exc

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        return _process_records(self, batch)


#: The token of a processing-time wake-up of a keyed operator's timers.
_PROCESSING_WAKE = "processing-time timers"


class KeyedProcessOperator(_KeyedOperator):
    """Runs a ``KeyedProcessFunction``: per record, and per timer that fires (event-time
    timers when the watermark reaches them, processing-time timers on the wall clock).
    Records out carry the timestamp of the record (or timer) they came from."""

    kind = "process"
    returns = YIELDS_RECORDS

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        if not isinstance(self.function, KeyedProcessFunction):
            raise TypeError("process() takes a KeyedProcessFunction")
        timers = context.timers
        schedule = (
            (lambda delay_s: timers.schedule(delay_s, _PROCESSING_WAKE))
            if timers is not None
            else None
        )
        self.timers = InternalTimerService(self.backend, schedule)
        service = TimerService(self.timers, self.backend)
        self._ctx = KeyedProcessFunction.Context(self.backend, service)
        self._timer_ctx = KeyedProcessFunction.OnTimerContext(self.backend, service)
        self._out = self._output()
        self._timed = False  # the input carries event timestamps
        self._ended = False

    def restore_state(self, snapshots: list[Any]) -> None:
        super().restore_state(snapshots)
        self.timers.restored()

    def _records(self, batch: pa.RecordBatch) -> Records:
        batch, timestamps = split_timestamps(batch)
        rows, keys = self._rows_and_keys(batch)
        set_key, process_element, ctx = (
            self.backend.set_current_key,
            self.function.process_element,
            self._ctx,
        )
        out: list[dict[str, Any]] = []
        copy = self._copier()  # a yielded record may be what the state holds
        extend = records_extender(out, copy)
        produced = None
        if timestamps is None:
            out_ts = None
            stamps: Any = repeat(None)
        else:
            self._timed = True
            out_ts = []
            stamps = timestamps.to_pylist()
        try:
            for key, record, stamp in zip(keys, rows, stamps):
                set_key(key)
                ctx._timestamp = stamp
                produced = process_element(record, ctx)
                if produced is not None:
                    before = len(out)
                    extend(produced)
                    if out_ts is not None:
                        out_ts.extend([stamp] * (len(out) - before))
        except TypeError as exc:
            if produced is not None and not _iterable(produced):
                raise RecordError(self._out.not_iterable(produced)) from exc
            raise
        except StopIteration as exc:
            raise _stopped(self._out.what) from exc
        return out, out_ts

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        return _process_records(self, batch)

    def _fire(self, pop: Callable[[], Any], domain: TimeDomain) -> list[pa.RecordBatch]:
        out: list[dict[str, Any]] = []
        out_ts: list[int] = []
        ctx = self._timer_ctx
        ctx._time_domain = domain
        on_timer = self.function.on_timer
        copy = self._copier()
        while (due := pop()) is not None:
            timestamp, key, _ = due
            self.backend.set_current_key(key)
            ctx._timestamp = timestamp
            produced = on_timer(timestamp, ctx)
            if produced is not None:
                before = len(out)
                try:
                    out.extend(take_records(produced, copy))
                except TypeError as exc:
                    if not _iterable(produced):
                        raise RecordError(self._out.not_iterable(produced)) from exc
                    raise
                out_ts.extend([timestamp] * (len(out) - before))
        if not out:
            return []
        return attach_timestamps(self._out.build(out), out_ts if self._timed else None)

    def process_watermark(self, watermark: int) -> list[pa.RecordBatch]:
        self.timers.advance_watermark(watermark)
        return self._fire(self.timers.pop_event, TimeDomain.EVENT_TIME)

    def on_timer(self, token: Any) -> list[pa.RecordBatch] | None:
        if token != _PROCESSING_WAKE or self._ended:
            return None  # after the end of input nothing more goes out (as in Flink)
        self.timers.on_wake()
        return self._fire(self.timers.pop_processing, TimeDomain.PROCESSING_TIME)

    def end_input(self) -> list[pa.RecordBatch]:
        self._ended = True
        return []


#: The one NaN key of a keyed aggregate (see ``KeyedAggregateOperator._float_keys``).
_NAN = float("nan")


def _one_nan(keys: list[Any]) -> list[Any]:
    """``keys`` with every NaN the same object, so that a dict finds it."""
    return [_NAN if k != k else k for k in keys]  # noqa: PLR0124 - only NaN differs from itself


#: Up to this many keys, key groups are computed key by key rather than for a column
#: (which costs ~30 us a call whatever its length).
_KEY_GROUPS_ONE_BY_ONE = 32


def _skipping_nulls(combine: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``combine`` where a null (None) on either side is skipped."""

    def combined(a: Any, b: Any) -> Any:
        if b is None:
            return a
        if a is None:
            return b
        return combine(a, b)

    return combined


_AGGREGATIONS: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    "sum": ("sum", _skipping_nulls(lambda a, b: a + b)),
    "count": ("count", lambda a, b: a + b),
    "min": ("min", _skipping_nulls(min)),
    "max": ("max", _skipping_nulls(max)),
}


def _has_order(t: pa.DataType) -> bool:
    nested = (
        pa.types.is_list,
        pa.types.is_large_list,
        pa.types.is_fixed_size_list,
        pa.types.is_struct,
        pa.types.is_map,
        pa.types.is_union,
    )
    return not any(f(t) for f in nested)


class KeyedAggregateOperator(_KeyedOperator):
    """Running sum / count / min / max per key, vectorized per batch.

    Like Flink's mini-batch aggregation, each input batch emits one row per key
    it touched, holding that key's running aggregate after the batch: the
    columns are the key column (``key`` for a key function) and the field
    (``count`` for counts).

    Nulls as in Flink SQL: ``sum``, ``min`` and ``max`` skip null values (a key a
    record lacked upstream is null; a batch without the field, after batches with it,
    holds only nulls), the result of a key whose values were all null so far is null,
    and ``count`` counts records. ``metrics()`` counts the nulls skipped
    (``nulls_skipped``). The field must be numeric for ``sum`` and have an order for
    ``min`` and ``max`` (numbers, strings, times): checked when the job is built if the
    source's schema is known, else on the first batch.
    """

    #: A batch of at most this many rows is aggregated in a Python loop where that gives
    #: the same partials (:meth:`_same_in_python`): Arrow's group-by costs ~70 us a call
    #: whatever the rows, the loop well under a microsecond a row.
    small_batch_rows = 512

    def __init__(self, key: KeySelector, aggregation: str, field: str | None) -> None:
        super().__init__(key)
        if aggregation not in _AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}")
        self.aggregation = aggregation
        self.field = field
        self.output_field = field if aggregation != "count" else "count"
        self.state_name = f"{aggregation}:{self.output_field}"
        self.nulls_skipped = 0
        self._field_type: pa.DataType | None = None  # of the field in the last batch
        self._total_type: pa.DataType | None = None  # of the aggregate column emitted
        self._key_type: pa.DataType | None = None  # of the key column; None: any object

    @staticmethod
    def check_field(aggregation: str, field: str | None, schema: pa.Schema) -> pa.DataType | None:
        """The type of ``field`` in ``schema`` if ``aggregation`` can aggregate it, else a
        KeyError (no such field) or TypeError (a field of the wrong type)."""
        if field is None:
            return None
        index = schema.get_field_index(field)
        if index < 0:
            raise KeyError(f"{aggregation}({field!r}): no such column (columns: {schema.names})")
        t = schema.field(index).type
        if pa.types.is_null(t):
            return t  # only nulls so far: nothing to check
        if aggregation == "sum":
            if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
                raise TypeError(
                    f"sum({field!r}): field {field!r} is {t}; sum needs a numeric field"
                )
        elif not _has_order(t):
            raise TypeError(
                f"{aggregation}({field!r}): field {field!r} is {t}; {aggregation} needs a "
                "field with an order (a number, string, date or time)"
            )
        return t

    def metrics(self) -> dict[str, Any]:
        return {} if self.field is None else {"nulls_skipped": self.nulls_skipped}

    def _checked(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` with the field checked (and as nulls where a batch lacks it after
        earlier batches had it); counts the nulls the aggregation skips."""
        field = self.field
        if field is None:
            return batch
        index = batch.schema.get_field_index(field)
        if index < 0 and self._field_type is not None and field not in batch.schema.names:
            batch = batch.append_column(field, pa.nulls(batch.num_rows, self._field_type))
            index = batch.num_columns - 1
        t = batch.schema.field(index).type if index >= 0 else None
        if t is None or t != self._field_type:
            t = self.check_field(self.aggregation, field, batch.schema)
            if self._field_type is None or not pa.types.is_null(t):
                self._field_type = t
            if self._total_type is None or pa.types.is_null(self._total_type):
                self._total_type = self._aggregate_type(t)
        self.nulls_skipped += batch.column(index).null_count
        return batch

    def _aggregate_type(self, t: pa.DataType) -> pa.DataType:
        if self.aggregation == "count":
            return pa.int64()
        if self.aggregation == "sum" and not pa.types.is_null(t):
            return pc.sum(pa.array([], type=t)).type
        return t

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        if batch.num_rows == 0:
            return []
        batch = self._checked(batch)
        key_column = self.key.column
        if key_column is not None:
            index = batch.schema.get_field_index(key_column)
            self._key_type = batch.schema.field(index).type if index >= 0 else None
        if key_column is not None and not (
            (batch.num_rows <= self.small_batch_rows and self._same_in_python())
            or self._may_wrap(batch)
        ):
            keys, partials = self._partials_vectorized(batch, key_column)
            if self._float_keys:
                keys = _one_nan(keys)
        else:
            keys, partials = self._partials_per_record(batch)
        combine = _AGGREGATIONS[self.aggregation][1]
        backend, name, maxp = self.backend, self.state_name, self.context.max_parallelism
        if key_column is not None and len(keys) > _KEY_GROUPS_ONE_BY_ONE:
            groups = key_groups_of_array(pa.array(keys), maxp).tolist()
        else:
            groups = [key_group_of(k, maxp) for k in keys]
        totals = []
        append = totals.append
        tables: dict[int, dict[Any, Any]] = {}  # this batch's key groups' tables
        for key, group, partial in zip(keys, groups, partials):
            table = tables.get(group)
            if table is None:
                table = tables[group] = backend.table_for_group(group, name)
            previous = table.get(key)
            total = partial if previous is None else combine(previous, partial)
            table[key] = total
            append(total)
        key_name = key_column or "key"
        columns: dict[str, Any] = {key_name: keys}
        # An integer total out of its type's range fails the attempt here (its state,
        # written above, goes with it): never wrapped around, never emitted.
        columns[self.output_field] = self._totals_array(totals, keys)
        return [pa.RecordBatch.from_pydict(columns)]

    @property
    def _float_keys(self) -> bool:
        """Keys may be floats: a NaN key is one key (as Java's ``Double.equals`` has it),
        while every NaN Arrow converts is an object of its own that equals nothing."""
        t = self._key_type
        return t is None or pa.types.is_floating(t)

    def restore_state(self, snapshots: list[Any]) -> None:
        super().restore_state(snapshots)
        # A NaN key comes back as a new object (or, from a version that kept them apart,
        # as several): one NaN key again, whatever its totals add up to.
        combine = _AGGREGATIONS[self.aggregation][1]
        for table in self.backend.tables(self.state_name):
            nans = [k for k in table if k != k]  # noqa: PLR0124 - NaN only
            if not nans:
                continue
            totals = [table.pop(k) for k in nans]
            total = totals[0]
            for more in totals[1:]:
                total = combine(total, more)
            table[_NAN] = total

    def _may_wrap(self, batch: pa.RecordBatch) -> bool:
        """Whether Arrow's group-by could wrap around a sum of this batch's integers (it
        does so silently): rows times the largest magnitude leaves the total's range.
        Such a batch is summed in Python, exactly, and a total out of range is an error."""
        t = self._field_type
        if self.aggregation != "sum" or t is None or not pa.types.is_integer(t):
            return False
        total = self._total_type
        if total is None or not pa.types.is_integer(total):
            return False
        column = batch.column(self.field)
        rows = len(column) - column.null_count
        widest = 1 << (t.bit_width - (1 if pa.types.is_signed_integer(t) else 0))
        limit = 1 << (total.bit_width - (1 if pa.types.is_signed_integer(total) else 0))
        if rows * widest < limit:
            return False  # e.g. int32 into an int64 total: no batch can wrap it
        low, high = (v.as_py() for v in pc.min_max(column).values())
        if low is None:
            return False
        return rows * max(abs(low), abs(high)) >= limit

    def _same_in_python(self) -> bool:
        """Whether a Python loop aggregates this batch's field exactly as Arrow's group-by
        does: counts, and integers (no rounding, no NaN, no decimal scale to keep)."""
        if self.aggregation == "count":
            return True
        t = self._field_type
        return t is not None and pa.types.is_integer(t)

    def _totals_array(self, totals: list[Any], keys: list[Any]) -> pa.Array:
        """The totals in the aggregate's type (the same from batch to batch, also while a
        key's total is still null), or as inferred when the input's type changed. An
        integer total outside its type's range raises an OverflowError naming the key."""
        total_type = self._total_type if self.field is not None else pa.int64()
        field_type = self._field_type if self.field is not None else pa.int64()
        if (
            total_type is not None
            and pa.types.is_integer(total_type)
            and field_type is not None
            and pa.types.is_integer(field_type)
        ):
            try:
                # typed: ints only (after batches of floats the inferred way below, as a
                # typed conversion truncates a float), and a uint64 total over 2**63 - 1
                # is no int64
                return pa.array(totals, type=total_type)
            except OverflowError:
                raise self._out_of_range(totals, keys, total_type) from None
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                pass  # not ints (the input's type changed): inferred below
        array = pa.array(totals)  # inferred: a typed conversion would truncate floats
        if total_type is None or array.type == total_type:
            return array
        try:
            return array.cast(total_type, safe=True)
        except pa.ArrowException:
            self._total_type = array.type
            return array

    def _out_of_range(self, totals: list[Any], keys: list[Any], t: pa.DataType) -> OverflowError:
        low, high = (0, (1 << t.bit_width) - 1)
        if pa.types.is_signed_integer(t):
            low, high = -(1 << (t.bit_width - 1)), (1 << (t.bit_width - 1)) - 1
        key, total = next(
            ((k, v) for k, v in zip(keys, totals) if v is not None and not low <= v <= high),
            (None, None),
        )
        what = f"{self.aggregation}({self.field!r})" if self.field else self.aggregation
        return OverflowError(
            f"{what} of {self.context.operator_name!r}: the total of key {key!r} is "
            f"{total}, outside the range of {t} ({low} to {high}); it is neither wrapped "
            "around nor emitted. Cast the field to float64 or a decimal upstream"
        )

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
        if self._float_keys:
            keys = _one_nan(keys)
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
        self.writer.write(without_timestamps(batch))
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
