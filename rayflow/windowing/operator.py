"""The window operator: keyed windows, their state and timers, late records.

State is keyed state (checkpointed, restored and rescaled by key group): for tumbling
and sliding windows ``(key, window start) -> accumulator`` in state ``WINDOW_STATE`` (the
assigner's size gives the end), for
sessions ``key -> {window: accumulator}`` in ``SESSION_STATE``; each window has a timer
(namespace: the window) at its last millisecond, when it fires, and, with allowed
lateness, another at ``max timestamp + lateness``, when its state is dropped. A window
whose first record comes after the watermark passed its end (within the allowed lateness)
gets no firing timer: it fires at once, with that record's batch.

Built-in aggregations (``sum``/``count``/``min``/``max``) on tumbling and sliding windows
keyed by one column are vectorized: a batch is grouped by (key, window start) in Arrow and
only the partial aggregates meet the state. ``reduce``, ``aggregate`` and ``process`` go
record by record. A record whose windows are all past ``max timestamp + allowed
lateness`` at the operator's watermark is late: it goes to the late-data side output, or
is dropped (counted in the metrics). A record within the allowed lateness of a window that
already fired makes that window fire again, with the updated result, once per batch.

Processing-time windows use the subtask's wall clock; at the end of bounded input they
fire whatever they hold. Event-time windows fire at the end-of-input watermark.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from rayflow.errors import RecordError
from rayflow.eventtime.strategy import (
    MAX_WATERMARK,
    attach_timestamps,
    split_timestamps,
    with_timestamps,
)
from rayflow.eventtime.timers import InternalTimerService
from rayflow.functions import ReduceFunction
from rayflow.keygroups import key_groups_of_array
from rayflow.outputs import SideOutput
from rayflow.plan.partitioners import KeySelector
from rayflow.runtime.operators import (
    _AGGREGATIONS,
    OperatorContext,
    _iterable,
    _KeyedOperator,
)
from rayflow.runtime.record_copy import copy_record, take_records
from rayflow.runtime.records import RETURNS_RECORD, YIELDS_RECORDS
from rayflow.windowing.assigners import TimeWindow, WindowAssigner
from rayflow.windowing.functions import AggregateFunction, ProcessWindowFunction

__all__ = ["WindowKind", "WindowSpec", "WindowOperator", "WINDOW_STATE", "SESSION_STATE"]

WINDOW_STATE = "\x00window"
SESSION_STATE = "\x00sessions"
_WAKE = "window timers"
_MISSING = object()


class WindowKind(enum.Enum):
    AGGREGATION = "aggregation"  # built-in sum / count / min / max
    REDUCE = "reduce"
    AGGREGATE = "aggregate"  # an AggregateFunction
    PROCESS = "process"  # a ProcessWindowFunction


@dataclass(frozen=True)
class WindowSpec:
    assigner: WindowAssigner
    allowed_lateness_ms: int = 0
    late_tag: str | None = None


class _Accumulation:
    """How one kind of window function folds records, and what a window gives."""

    def create(self) -> Any:
        return _MISSING

    def add(self, acc: Any, record: dict[str, Any]) -> Any:
        raise NotImplementedError

    def merge(self, a: Any, b: Any) -> Any:
        raise NotImplementedError


class _Builtin(_Accumulation):
    def __init__(self, aggregation: str, field: str | None) -> None:
        self.aggregation = aggregation
        self.field = field
        self.combine = _AGGREGATIONS[aggregation][1]

    def create(self) -> Any:
        return 0 if self.aggregation == "count" else None

    def add(self, acc: Any, record: dict[str, Any]) -> Any:
        value = 1 if self.field is None else record.get(self.field)
        return self.combine(acc, value)

    def merge(self, a: Any, b: Any) -> Any:
        return self.combine(a, b)


class _Reduce(_Accumulation):
    def __init__(self, function: Any) -> None:
        self.call = function.reduce if isinstance(function, ReduceFunction) else function

    def add(self, acc: Any, record: dict[str, Any]) -> Any:
        return record if acc is _MISSING else self.call(acc, record)

    def merge(self, a: Any, b: Any) -> Any:
        return self.call(a, b)


class _Aggregate(_Accumulation):
    def __init__(self, function: AggregateFunction) -> None:
        self.function = function

    def create(self) -> Any:
        return self.function.create_accumulator()

    def add(self, acc: Any, record: dict[str, Any]) -> Any:
        return self.function.add(record, acc)

    def merge(self, a: Any, b: Any) -> Any:
        return self.function.merge(a, b)


class _Collect(_Accumulation):
    def create(self) -> Any:
        return []

    def add(self, acc: Any, record: dict[str, Any]) -> Any:
        acc.append(record)
        return acc

    def merge(self, a: Any, b: Any) -> Any:
        return a + b


class WindowOperator(_KeyedOperator):
    """``key_by(...).window(assigner)`` and the function applied to each window."""

    kind = "window"

    def __init__(
        self,
        key: KeySelector,
        spec: WindowSpec,
        window_kind: WindowKind,
        function: Any = None,
        aggregation: str | None = None,
        field: str | None = None,
        output_type: pa.Schema | None = None,
    ) -> None:
        super().__init__(key, function, output_type)
        self.spec = spec
        self.window_kind = window_kind
        self.aggregation = aggregation
        self.field = field
        self.output_field = field if aggregation != "count" else "count"
        self.returns = YIELDS_RECORDS if window_kind is WindowKind.PROCESS else RETURNS_RECORD
        self.late_dropped = 0
        self.late_side_output = 0

    # --- lifecycle ------------------------------------------------------------------------

    def open(self, context: OperatorContext) -> None:
        super().open(context)
        timers = context.timers
        schedule = (lambda delay_s: timers.schedule(delay_s, _WAKE)) if timers is not None else None
        self.timers = InternalTimerService(self.backend, schedule)
        self._out = self._output()
        self._ended = False
        kind = self.window_kind
        if kind is WindowKind.AGGREGATION:
            self._acc: _Accumulation = _Builtin(self.aggregation, self.field)
        elif kind is WindowKind.REDUCE:
            self._acc = _Reduce(self.function)
        elif kind is WindowKind.AGGREGATE:
            self._acc = _Aggregate(self.function)
        else:
            self._acc = _Collect()
            self._window_ctx = ProcessWindowFunction.Context()
        assigner = self.spec.assigner
        self._event_time = assigner.event_time
        self._lateness = self.spec.allowed_lateness_ms if assigner.event_time else 0
        self._vectorized = (
            kind is WindowKind.AGGREGATION and not assigner.merging and self.key.column is not None
        )

    def restore_state(self, snapshots: list[Any]) -> None:
        super().restore_state(snapshots)
        self.timers.restored()

    def metrics(self) -> dict[str, Any]:
        return {
            "late_records_dropped": self.late_dropped,
            "late_records_side_output": self.late_side_output,
        }

    # --- records --------------------------------------------------------------------------

    def process(self, batch: pa.RecordBatch) -> list[Any]:
        if batch.num_rows == 0:
            return []
        plain, stamps_array = split_timestamps(batch)
        if self._event_time:
            if stamps_array is None:
                raise ValueError(
                    f"window {self.context.operator_name!r}: event-time windows need "
                    "timestamps; read the source with from_source(source, "
                    "WatermarkStrategy...with_timestamp_assigner(...), name)"
                )
            stamps = np.asarray(stamps_array.to_numpy(zero_copy_only=False), dtype=np.int64)
        else:
            stamps = np.full(batch.num_rows, self.timers.current_processing_time(), np.int64)
        out = _Fired(self)
        if self.spec.assigner.merging:
            late = self._add_to_sessions(plain, stamps, out)
        else:
            late = self._add_to_windows(plain, stamps, out)
        results = out.batches()
        if late is not None and late.any():
            results.extend(self._late(batch, late))
        return results

    def _is_late(self, window: TimeWindow) -> bool:
        return self._event_time and self._cleanup_time(window) <= self.timers.watermark

    def _cleanup_time(self, window: TimeWindow) -> int:
        return min(window.max_timestamp() + self._lateness, MAX_WATERMARK)

    def _late(self, batch: pa.RecordBatch, late: np.ndarray) -> list[Any]:
        rows = batch.filter(pa.array(late))
        tag = self.spec.late_tag
        if tag is None:
            self.late_dropped += rows.num_rows
            return []
        self.late_side_output += rows.num_rows
        return [SideOutput(tag, rows)]

    def _add_to_windows(
        self, batch: pa.RecordBatch, stamps: np.ndarray, out: _Fired
    ) -> np.ndarray | None:
        rows_of, starts, size = self.spec.assigner.assign(stamps)
        late = None
        if self._event_time:
            cleanup = np.minimum(starts + (size - 1), MAX_WATERMARK - self._lateness)
            late_pairs = cleanup + self._lateness <= self.timers.watermark
            if late_pairs.any():
                # a record is late when every window it belongs to is
                late = np.ones(len(stamps), dtype=bool)
                late[rows_of[~late_pairs]] = False
                rows_of, starts = rows_of[~late_pairs], starts[~late_pairs]
        if len(rows_of) == 0:
            return late
        if self._vectorized:
            self._add_vectorized(batch, rows_of, starts, size, out)
        else:
            self._add_per_record(batch, rows_of, starts, size, out)
        return late

    def _add_vectorized(
        self,
        batch: pa.RecordBatch,
        rows_of: np.ndarray,
        starts: np.ndarray,
        size: int,
        out: _Fired,
    ) -> None:
        indices = pa.array(rows_of)
        columns = {"k": batch.column(self.key.column).take(indices), "s": pa.array(starts)}
        if self.aggregation == "count":
            aggregate = [([], "count_all")]
            partial_name = "count_all"
        else:
            index = batch.schema.get_field_index(self.field)
            if index < 0:
                raise KeyError(
                    f"{self.aggregation}({self.field!r}): no such column "
                    f"(columns: {batch.schema.names})"
                )
            columns["v"] = batch.column(index).take(indices)
            arrow_agg = _AGGREGATIONS[self.aggregation][0]
            aggregate = [("v", arrow_agg)]
            partial_name = f"v_{arrow_agg}"
        grouped = pa.table(columns).group_by(["k", "s"], use_threads=False).aggregate(aggregate)
        keys = grouped.column("k")
        groups = key_groups_of_array(keys, self.context.max_parallelism).tolist()
        combine = self._acc.merge
        backend, register = self.backend, self._register
        # a window at or before this start has fired already (event time)
        fired_up_to = self.timers.watermark - size + 1 if self._event_time else None
        tables: dict[int, dict] = {}
        for key, start, group, partial in zip(
            keys.to_pylist(),
            grouped.column("s").to_pylist(),
            groups,
            grouped.column(partial_name).to_pylist(),
        ):
            table = tables.get(group)
            if table is None:
                table = tables[group] = backend.table_for_group(group, WINDOW_STATE)
            entry = (key, start)
            previous = table.get(entry, _MISSING)
            if previous is _MISSING:
                table[entry] = partial
                register(key, TimeWindow(start, start + size))
            else:
                table[entry] = combine(previous, partial)
            if fired_up_to is not None and start <= fired_up_to:
                out.touched(key, TimeWindow(start, start + size))

    def _add_per_record(
        self,
        batch: pa.RecordBatch,
        rows_of: np.ndarray,
        starts: np.ndarray,
        size: int,
        out: _Fired,
    ) -> None:
        rows, keys = self._rows_and_keys(batch)
        keys = list(keys)
        acc, backend = self._acc, self.backend
        watermark = self.timers.watermark
        # A reduce keeps a window's first record as its value and may add into it: a
        # record in several (sliding) windows starts each with a copy of its own.
        first = (
            copy_record
            if self.window_kind is WindowKind.REDUCE and not self.context.object_reuse
            else None
        )
        for i, start in zip(rows_of.tolist(), starts.tolist()):
            key = keys[i]
            table = backend.table_of_key(key, WINDOW_STATE)
            entry = (key, start)
            record = rows[i]
            current = table.get(entry, _MISSING)
            if current is _MISSING:
                current = acc.create()
                self._register(key, TimeWindow(start, start + size))
                if first is not None:
                    record = first(record)
            backend.set_current_key(key)
            table[entry] = acc.add(current, record)
            if start + size - 1 <= watermark and self._event_time:
                out.touched(key, TimeWindow(start, start + size))

    def _add_to_sessions(
        self, batch: pa.RecordBatch, stamps: np.ndarray, out: _Fired
    ) -> np.ndarray | None:
        rows, keys = self._rows_and_keys(batch)
        gap = self.spec.assigner.gap
        acc, backend = self._acc, self.backend
        watermark = self.timers.watermark
        late = np.zeros(len(stamps), dtype=bool)
        for i, (key, record) in enumerate(zip(keys, rows)):
            stamp = int(stamps[i])
            window = TimeWindow(stamp, stamp + gap)
            table = backend.table_of_key(key, SESSION_STATE)
            sessions = table.get(key)
            if sessions is None:
                sessions = table[key] = {}
            overlapping = [w for w in sessions if w.intersects(window)]
            merged = window
            for w in overlapping:
                merged = merged.cover(w)
            if self._is_late(merged):
                late[i] = True
                if not sessions:
                    del table[key]
                continue
            backend.set_current_key(key)
            value = acc.add(acc.create(), record)
            for w in overlapping:
                value = acc.merge(sessions.pop(w), value)
                self._delete_timers(key, w)
                out.forget(key, w)
            sessions[merged] = value
            self._register(key, merged)
            if merged.max_timestamp() <= watermark and self._event_time:
                out.touched(key, merged)
        return late

    # --- state and timers -----------------------------------------------------------------

    def _register(self, key: Any, window: TimeWindow) -> None:
        timers = self.timers
        if self._event_time:
            # A window whose end the watermark has passed (a record within the allowed
            # lateness) fires at once, with the batch that made it: a timer in the past
            # would fire it a second time at the next watermark (Flink's trigger
            # registers none either).
            if window.max_timestamp() > timers.watermark:
                timers.register_event_time_timer(key, window, window.max_timestamp())
            if self._lateness:
                timers.register_event_time_timer(key, window, self._cleanup_time(window))
        else:
            timers.register_processing_time_timer(key, window, window.max_timestamp())

    def _delete_timers(self, key: Any, window: TimeWindow) -> None:
        timers = self.timers
        if self._event_time:
            timers.delete_event_time_timer(key, window, window.max_timestamp())
            if self._lateness:
                timers.delete_event_time_timer(key, window, self._cleanup_time(window))
        else:
            timers.delete_processing_time_timer(key, window, window.max_timestamp())

    def lookup(self, key: Any, window: TimeWindow) -> Any:
        if self.spec.assigner.merging:
            sessions = self.backend.table_of_key(key, SESSION_STATE).get(key)
            return _MISSING if sessions is None else sessions.get(window, _MISSING)
        return self.backend.table_of_key(key, WINDOW_STATE).get((key, window.start), _MISSING)

    def _clear(self, key: Any, window: TimeWindow) -> None:
        if self.spec.assigner.merging:
            table = self.backend.table_of_key(key, SESSION_STATE)
            sessions = table.get(key)
            if sessions is not None:
                sessions.pop(window, None)
                if not sessions:
                    del table[key]
        else:
            self.backend.table_of_key(key, WINDOW_STATE).pop((key, window.start), None)
        if self.window_kind is WindowKind.PROCESS:
            self.backend.set_current_key(key)
            self._window_ctx._window = window
            self.function.clear(self._window_ctx)

    # --- firing ---------------------------------------------------------------------------

    def _fire(self, pop: Callable[[], Any]) -> list[Any]:
        out = _Fired(self)
        while (due := pop()) is not None:
            timestamp, key, window = due
            if self.lookup(key, window) is _MISSING:
                continue
            if timestamp == window.max_timestamp():
                out.fire(key, window)
            if timestamp == self._cleanup_time(window) or not self._event_time:
                out.flush_window(key, window)
                self._clear(key, window)
        return out.batches()

    def process_watermark(self, watermark: int) -> list[Any]:
        self.timers.advance_watermark(watermark)
        if not self._event_time:
            return []
        return self._fire(self.timers.pop_event)

    def on_timer(self, token: Any) -> list[Any] | None:
        if token != _WAKE or self._ended:
            return None  # after the end of input nothing more goes out
        self.timers.on_wake()
        return self._fire(self.timers.pop_processing)

    def end_input(self) -> list[Any]:
        self._ended = True
        if self._event_time:
            return []
        # bounded input ends: processing-time windows fire what they hold
        return self._fire(lambda: self.timers.pop_processing(MAX_WATERMARK))


class _Fired:
    """The results of windows that fire during one call, built into batches at the end
    (a window touched again before then gives its latest result once)."""

    def __init__(self, op: WindowOperator) -> None:
        self.op = op
        self._pending: dict[tuple[Any, TimeWindow], None] = {}
        self._results: list[tuple[Any, TimeWindow, Any]] = []

    def touched(self, key: Any, window: TimeWindow) -> None:
        self._pending[(key, window)] = None

    def forget(self, key: Any, window: TimeWindow) -> None:
        self._pending.pop((key, window), None)

    def fire(self, key: Any, window: TimeWindow) -> None:
        self._pending[(key, window)] = None

    def flush_window(self, key: Any, window: TimeWindow) -> None:
        """The window's state goes now: take its result first if it is due."""
        if (key, window) in self._pending:
            del self._pending[(key, window)]
            self._results.append((key, window, self.op.lookup(key, window)))

    def batches(self) -> list[pa.RecordBatch]:
        op = self.op
        results = self._results + [
            (key, window, op.lookup(key, window)) for key, window in self._pending
        ]
        results = [r for r in results if r[2] is not _MISSING]
        if not results:
            return []
        if op.window_kind is WindowKind.AGGREGATION:
            return [self._aggregation_batch(results)]
        records: list[dict[str, Any]] = []
        stamps: list[int] = []
        # each result is copied as it is given: the function may change it later (a
        # result dict it keeps, an element of two sliding windows)
        copy = op._copier()
        for key, window, acc in results:
            produced = self._records(key, window, acc, copy)
            records.extend(produced)
            stamps.extend([window.max_timestamp()] * len(produced))
        return attach_timestamps(op._out.build(records), stamps)

    def _records(
        self, key: Any, window: TimeWindow, acc: Any, copy: Callable[[Any], Any] | None
    ) -> list[dict[str, Any]]:
        op = self.op
        kind = op.window_kind
        if kind is WindowKind.REDUCE:
            return [acc if copy is None else copy(acc)]
        if kind is WindowKind.AGGREGATE:
            op.backend.set_current_key(key)
            result = op.function.get_result(acc)
            return [result if copy is None else copy(result)]
        ctx = op._window_ctx
        ctx._window = window
        ctx._watermark = op.timers.watermark
        ctx._processing_time = op.timers.current_processing_time()
        op.backend.set_current_key(key)
        produced = op.function.process(key, ctx, list(acc))
        if produced is None:
            return []
        try:
            return take_records(produced, copy)
        except TypeError as exc:
            if not _iterable(produced):
                raise RecordError(op._out.not_iterable(produced)) from exc
            raise

    def _aggregation_batch(self, results: list[tuple[Any, TimeWindow, Any]]) -> pa.RecordBatch:
        op = self.op
        key = op.key.key
        columns: dict[str, Any] = {}
        keys = [r[0] for r in results]
        if isinstance(key, str):
            columns[key] = keys
        elif isinstance(key, tuple):
            for position, name in enumerate(key):
                columns[name] = [k[position] for k in keys]
        else:
            columns["key"] = keys
        columns[op.output_field] = [r[2] for r in results]
        columns["window_start"] = [r[1].start for r in results]
        columns["window_end"] = [r[1].end for r in results]
        batch = pa.RecordBatch.from_pydict(columns)
        stamps = pa.array([r[1].max_timestamp() for r in results], type=pa.int64())
        return with_timestamps(batch, stamps)
