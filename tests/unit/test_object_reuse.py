"""Records emitted by per-record operators keep their values when user code changes the
objects afterwards (object reuse off, the default), as in Flink; with object reuse on
nothing is copied."""

from __future__ import annotations

import datetime
import decimal
import threading
import uuid

import numpy as np
import pyarrow as pa
import pytest

from rayflow import (
    CollectionSource,
    KeyedProcessFunction,
    MapFunction,
    NumberSequenceSource,
    StreamExecutionEnvironment,
    ValueStateDescriptor,
)
from rayflow.config import ExecutionConfig
from rayflow.errors import RecordError, SchemaChangeError
from rayflow.eventtime import Duration, WatermarkStrategy
from rayflow.runtime import record_copy
from rayflow.runtime.record_copy import copy_record, record_copier
from rayflow.testing import run_in_process
from rayflow.windowing import (
    AggregateFunction,
    ProcessWindowFunction,
    SlidingEventTimeWindows,
    TumblingEventTimeWindows,
)

N = 40
KEYS = 3


def _env(parallelism: int = 1, reuse: bool = False) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    if reuse:
        env.get_config().enable_object_reuse()
    return env


def _keyed(env: StreamExecutionEnvironment, batch_size: int = N):
    source = env.from_source(NumberSequenceSource(1, N, batch_size=batch_size))
    return source.map(lambda r: {"k": r["value"] % KEYS, "v": r["value"]}).key_by("k")


def _assert_running_sums(records: list[dict]) -> None:
    """Per key, the emitted values are the running sums of the key's values in some
    order (two source subtasks interleave): sorted, their steps are those values."""
    for k in range(KEYS):
        sums = sorted(r["v"] for r in records if r["k"] == k)
        steps = [b - a for a, b in zip([0, *sums], sums)]
        assert sorted(steps) == [v for v in range(1, N + 1) if v % KEYS == k], (k, sums)


def _running_sums() -> list[tuple[int, int]]:
    sums: dict[int, int] = {}
    out = []
    for v in range(1, N + 1):
        k = v % KEYS
        sums[k] = sums.get(k, 0) + v
        out.append((k, sums[k]))
    return sorted(out)


def _add_into(a: dict, b: dict) -> dict:
    a["v"] += b["v"]
    return a


def _add_into_then_copy(a: dict, b: dict) -> dict:
    a["v"] += b["v"]  # the accumulator changes, a new record goes out
    return dict(a)


@pytest.mark.parametrize("reduce", [_add_into, _add_into_then_copy])
@pytest.mark.parametrize(("parallelism", "batch_size"), [(1, N), (2, 7)])
def test_a_reduce_that_adds_into_its_accumulator_emits_every_running_value(
    reduce, parallelism, batch_size
):
    env = _env(parallelism)
    _keyed(env, batch_size).reduce(reduce)
    _assert_running_sums(run_in_process(env).records)


def test_nested_values_are_copied_deeply():
    def append(a: dict, b: dict) -> dict:
        a["seen"].append(b["seen"][0])
        return a

    env = _env()
    _keyed(env).map(lambda r: {"k": r["k"], "seen": [r["v"]]}).key_by("k").reduce(append)
    records = run_in_process(env).records
    for r in records:  # each record lists the key's values up to its own, in order
        assert r["seen"] == [v for v in range(1, r["seen"][-1] + 1) if v % KEYS == r["k"]]


class _CountInState(KeyedProcessFunction):
    """Keeps one dict per key in state, changes it in place and yields it (per record and
    again from an event-time timer at the end of input)."""

    def open(self, runtime_context):
        self.acc = runtime_context.get_state(ValueStateDescriptor("acc"))

    def process_element(self, value, ctx):
        acc = self.acc.value() or {"k": value["k"], "n": 0, "when": "record"}
        acc["n"] += 1
        self.acc.update(acc)
        ctx.timer_service().register_event_time_timer(1000 + acc["n"])
        yield acc

    def on_timer(self, timestamp, ctx):
        acc = self.acc.value()
        acc["n"] += 1
        acc["when"] = "timer"
        yield acc


def test_a_process_function_that_yields_its_state_value_emits_every_count():
    env = _env(2)
    rows = [{"k": i % KEYS, "t": i} for i in range(N)]
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")
    source = env.from_source(CollectionSource(rows, batch_size=N), strategy, "rows")
    source.key_by("k").process(_CountInState())
    records = run_in_process(env).records
    per_key = {k: sum(1 for r in rows if r["k"] == k) for k in range(KEYS)}
    for k, count in per_key.items():
        mine = [r for r in records if r["k"] == k]
        on_records = sorted(r["n"] for r in mine if r["when"] == "record")
        on_timers = sorted(r["n"] for r in mine if r["when"] == "timer")
        assert on_records == list(range(1, count + 1))
        assert on_timers == list(range(count + 1, 2 * count + 1))  # one timer per count


def test_with_object_reuse_on_nothing_is_copied():
    """Flink's contract with object reuse: a function that changes what it emitted sees
    the change in its earlier records; one that does not gets the same results."""
    env = _env(reuse=True)
    _keyed(env).reduce(_add_into)
    records = run_in_process(env).records
    finals = {k: max(v for kk, v in _running_sums() if kk == k) for k in range(KEYS)}
    assert sorted((r["k"], r["v"]) for r in records) == sorted(
        (v % KEYS, finals[v % KEYS]) for v in range(1, N + 1)
    )
    env = _env(reuse=True)
    _keyed(env).reduce(lambda a, b: {"k": a["k"], "v": a["v"] + b["v"]})
    records = run_in_process(env).records
    assert sorted((r["k"], r["v"]) for r in records) == _running_sums()


def test_execution_config_is_flinks():
    config = ExecutionConfig()
    assert not config.is_object_reuse_enabled()
    assert config.enable_object_reuse().is_object_reuse_enabled()
    assert not config.disable_object_reuse().is_object_reuse_enabled()
    env = _env()
    assert env.get_config() is env.get_config()
    assert not env.get_config().is_object_reuse_enabled()


def test_copies_are_shallow_for_scalar_records_and_deep_otherwise():
    scalars = {
        "i": 1,
        "f": 1.5,
        "s": "x",
        "b": b"y",
        "n": None,
        "d": decimal.Decimal("1.5"),
        "t": datetime.datetime(2026, 1, 1),
    }
    copied = copy_record(scalars)
    assert copied == scalars and copied is not scalars
    nested = {"k": 1, "items": [1, 2], "inner": {"a": [3]}}
    copied = copy_record(nested)
    nested["items"].append(9)
    nested["inner"]["a"].append(9)
    assert copied == {"k": 1, "items": [1, 2], "inner": {"a": [3]}}
    not_a_record = [1, 2]
    assert copy_record(not_a_record) is not_a_record  # the output rejects it by name


def test_the_copier_follows_the_output_schema():
    flat = pa.schema([("k", pa.int64()), ("v", pa.float64()), ("s", pa.string())])
    nested = pa.schema([("k", pa.int64()), ("items", pa.list_(pa.int64()))])
    assert record_copier(None) is copy_record  # schema not known yet: look at the values
    assert record_copier(nested) is copy_record
    shallow = record_copier(flat)
    record = {"k": 1, "v": 2.0, "s": "x"}
    assert shallow(record) == record and shallow(record) is not record
    assert shallow(5) == 5


# --- every per-record operator, every value a record may hold ----------------------------


class _KeepsOneRecord(MapFunction):
    """Returns the one dict it keeps, changed for each record."""

    def open(self, runtime_context):
        self.out = {}

    def map(self, value):
        self.out["v"] = value["v"]
        return self.out


def test_a_map_that_returns_a_dict_it_keeps_emits_every_value():
    env = _env()
    env.from_collection([{"v": v} for v in range(5)]).map(_KeepsOneRecord())
    assert [r["v"] for r in run_in_process(env).records] == [0, 1, 2, 3, 4]


def _explode(record: dict):
    for i in range(3):
        record["i"] = i  # the same dict, changed and yielded again
        yield record


def test_a_flat_map_that_changes_and_yields_one_dict_again_emits_every_version():
    env = _env()
    env.from_collection([{"v": 1}, {"v": 2}]).flat_map(_explode)
    records = run_in_process(env).records
    assert sorted((r["v"], r["i"]) for r in records) == [(v, i) for v in (1, 2) for i in range(3)]


def _timed(env: StreamExecutionEnvironment, rows: list[dict]):
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("t")
    return env.from_source(CollectionSource(rows, batch_size=len(rows)), strategy, "rows")


class _SumIntoOneResult(AggregateFunction):
    """``get_result`` fills in and returns the one dict it keeps."""

    def open(self, runtime_context):
        self.result = {}

    def create_accumulator(self):
        return 0

    def add(self, value, accumulator):
        return accumulator + value["v"]

    def get_result(self, accumulator):
        self.result["n"] = accumulator
        return self.result


def test_windows_that_fire_together_keep_each_result_of_an_aggregate_function():
    env = _env()
    rows = [{"k": 0, "v": 1, "t": t} for t in range(20)] + [{"k": 1, "v": 2, "t": 0}]
    window = TumblingEventTimeWindows.of(Duration.of_millis(5))
    _timed(env, rows).key_by("k").window(window).aggregate(_SumIntoOneResult())
    assert sorted(r["n"] for r in run_in_process(env).records) == [2, 5, 5, 5, 5]


def test_a_sliding_window_reduce_that_adds_into_its_accumulator_keeps_windows_apart():
    """A record is in two sliding windows; the first record of both must not be one dict
    that the reduce of either window adds into."""
    env = _env()
    rows = [{"k": 0, "v": 1, "t": t} for t in range(20)]
    window = SlidingEventTimeWindows.of(Duration.of_millis(10), Duration.of_millis(5))
    _timed(env, rows).key_by("k").window(window).reduce(_add_into)
    assert [r["v"] for r in run_in_process(env).records] == [5, 10, 10, 10, 5]


class _WithWindowEnd(ProcessWindowFunction):
    """Sets the window's end in each element and yields the element."""

    def process(self, key, context, elements):
        for element in elements:
            element["end"] = context.window().end
            yield element


def test_a_process_window_function_that_yields_its_elements_keeps_each_window_s_values():
    env = _env()
    rows = [{"k": 0, "t": t} for t in range(10)]
    window = SlidingEventTimeWindows.of(Duration.of_millis(10), Duration.of_millis(5))
    _timed(env, rows).key_by("k").window(window).process(_WithWindowEnd())
    ends = sorted((r["end"], r["t"]) for r in run_in_process(env).records)
    assert ends == [(5, t) for t in range(5)] + [(10, t) for t in range(10)] + [
        (15, t) for t in range(5, 10)
    ]


class _CountsUp(ProcessWindowFunction):
    """Yields one dict per element, changed before each yield."""

    def process(self, key, context, elements):
        out = {"k": key, "n": 0}
        for _ in elements:
            out["n"] += 1
            yield out


def test_a_process_window_function_that_changes_and_yields_one_dict_emits_every_version():
    env = _env()
    rows = [{"k": 0, "t": t} for t in range(3)]
    window = TumblingEventTimeWindows.of(Duration.of_millis(10))
    _timed(env, rows).key_by("k").window(window).process(_CountsUp())
    assert [r["n"] for r in run_in_process(env).records] == [1, 2, 3]


class _GivesANumber(ProcessWindowFunction):
    def process(self, key, context, elements):
        return len(elements)  # not an iterable of records


def test_a_process_window_function_returning_a_non_iterable_is_named():
    env = _env()
    window = TumblingEventTimeWindows.of(Duration.of_millis(10))
    _timed(env, [{"k": 0, "t": 1}]).key_by("k").window(window).process(
        _GivesANumber(), name="Count"
    )
    with pytest.raises(RecordError, match="window 'Count' must yield dicts .*, got int: 1"):
        run_in_process(env)


class _AppendToBuffer(KeyedProcessFunction):
    """Keeps a bytearray per key in state, appends to it and yields it."""

    def open(self, runtime_context):
        self.buffer = runtime_context.get_state(ValueStateDescriptor("buffer"))

    def process_element(self, value, ctx):
        buffer = self.buffer.value()
        if buffer is None:
            buffer = bytearray()
            self.buffer.update(buffer)
        buffer.append(ord("a") + value["i"])
        yield {"k": value["k"], "buffer": buffer}


def test_a_bytearray_is_copied_in_every_batch_not_only_the_first():
    """After the first batch the output's schema is known (``k``: int64, ``buffer``:
    binary): a binary column still takes a bytearray, which can change."""
    env = _env()
    rows = [{"k": 0, "i": i} for i in range(6)]
    env.from_source(CollectionSource(rows, batch_size=3)).key_by("k").process(_AppendToBuffer())
    assert [r["buffer"] for r in run_in_process(env).records] == [
        b"a",
        b"ab",
        b"abc",
        b"abcd",
        b"abcde",
        b"abcdef",
    ]


@pytest.mark.parametrize("column", [pa.binary(), pa.string(), pa.large_binary()])
def test_the_copier_of_a_text_or_binary_column_copies_a_bytearray(column):
    """Arrow takes a bytearray (or memoryview) into a text or binary column."""
    schema = pa.schema([("k", pa.int64()), ("b", column)])
    buffer = bytearray(b"x")
    copied = record_copier(schema)({"k": 1, "b": buffer})
    buffer.extend(b"yz")
    assert copied == {"k": 1, "b": b"x"}


class _Tagged(pa.ExtensionType):
    """A user's extension type over ``storage``."""

    def __init__(self, storage: pa.DataType) -> None:
        super().__init__(storage, "rayflow.test.tagged")

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type, serialized):
        return cls(storage_type)


@pytest.mark.parametrize("storage", [pa.binary(), pa.string(), pa.list_(pa.int64())])
def test_the_copier_of_an_extension_column_copies_what_its_storage_takes(storage):
    """An extension type takes what its storage type takes: over text or binary a
    bytearray, over a list a list; both can change after the record was emitted."""
    schema = pa.schema([("k", pa.int64()), ("b", _Tagged(storage))])
    value = [1] if pa.types.is_list(storage) else bytearray(b"x")
    copied = record_copier(schema)({"k": 1, "b": value})
    if isinstance(value, list):
        value.append(2)
    else:
        value.extend(b"yz")
    assert copied["b"] in ([1], b"x")


class _Row(dict):
    """A record type of the user's: a dict with more to it."""


def _add_into_a_row(a: dict, b: dict) -> dict:
    a = a if isinstance(a, _Row) else _Row(a)
    a["v"] += b["v"]
    return a


@pytest.mark.parametrize("schema_known", [False, True])
def test_a_record_of_a_dict_subclass_is_copied(schema_known):
    env = _env()
    rows = [{"k": 0, "v": v} for v in (1, 2, 3, 4)]
    output_type = pa.schema([("k", pa.int64()), ("v", pa.int64())]) if schema_known else None
    env.from_collection(rows).key_by("k").reduce(_add_into_a_row, output_type=output_type)
    assert [r["v"] for r in run_in_process(env).records] == [1, 3, 6, 10]


class _YieldsALock(KeyedProcessFunction):
    def process_element(self, value, ctx):
        yield {"k": value["k"], "lock": threading.Lock()}


def test_a_value_that_cannot_be_copied_is_rejected_naming_the_operator():
    env = _env()
    env.from_collection([{"k": 0}]).key_by("k").process(_YieldsALock(), name="Locks")
    with pytest.raises(SchemaChangeError, match="process 'Locks'.*'lock'"):
        run_in_process(env)
    env = _env()
    env.from_collection([{"k": 0, "v": 1}, {"k": 0, "v": 2}]).key_by("k").reduce(
        lambda a, b: {"k": 0, "v": threading.Lock()}, name="LockReduce"
    )
    with pytest.raises(SchemaChangeError, match="reduce 'LockReduce'.*'v'"):
        run_in_process(env)


def test_with_object_reuse_on_a_map_copies_nothing_either():
    env = _env(reuse=True)
    env.from_collection([{"v": v} for v in range(3)]).map(_KeepsOneRecord())
    assert [r["v"] for r in run_in_process(env).records] == [2, 2, 2]


def test_numpy_scalars_are_copied_shallowly(monkeypatch):
    """numpy's scalars cannot change: a record of them and text is copied with
    ``dict.copy``, not deeply (a deep copy costs microseconds per record)."""
    deep_copies = []
    monkeypatch.setattr(record_copy.copy, "deepcopy", deep_copies.append)
    record = {"s": "x", "i": np.int64(1), "f": np.float32(1.5), "b": np.bool_(True)}
    schema = pa.schema([("s", pa.string()), ("i", pa.int64()), ("f", pa.float32())])
    for copier in (copy_record, record_copier(schema)):
        copied = copier(record)
        assert copied == record and copied is not record
    assert deep_copies == []


# --- values Arrow takes that can change in place ---------------------------------------------


def test_the_copier_of_an_interval_column_copies_a_relativedelta():
    """Arrow takes dateutil's relativedelta (botocore's dependency) into a
    month_day_nano_interval column, and its fields can be set: a column of that type
    does not take only immutable values."""
    from dateutil.relativedelta import relativedelta

    schema = pa.schema([("k", pa.int64()), ("period", pa.month_day_nano_interval())])
    period = relativedelta(months=1)
    copied = record_copier(schema)({"k": 1, "period": period})
    period.months = 7
    assert pa.array([copied["period"]]).to_pylist() == [pa.MonthDayNano([1, 0, 0])]


class _LengthensAPeriod(KeyedProcessFunction):
    """Keeps a relativedelta per key in state, lengthens it by a month and yields it."""

    def open(self, runtime_context):
        self.period = runtime_context.get_state(ValueStateDescriptor("period"))

    def process_element(self, value, ctx):
        from dateutil.relativedelta import relativedelta

        period = self.period.value()
        if period is None:
            period = relativedelta()
            self.period.update(period)
        period.months += 1
        yield {"k": value["k"], "period": period}


@pytest.mark.parametrize("declared", [False, True])
def test_a_relativedelta_is_copied_in_every_batch_not_only_the_first(declared):
    """From the second batch on (or from the first, with a declared output_type) the
    output's schema is known: an interval column still takes a value that can change."""
    env = _env()
    rows = [{"k": 0, "i": i} for i in range(6)]
    output_type = (
        pa.schema([("k", pa.int64()), ("period", pa.month_day_nano_interval())])
        if declared
        else None
    )
    env.from_source(CollectionSource(rows, batch_size=3)).key_by("k").process(
        _LengthensAPeriod(), output_type=output_type
    )
    assert [r["period"].months for r in run_in_process(env).records] == [1, 2, 3, 4, 5, 6]


def test_a_memoryview_and_what_else_its_record_holds_are_copied():
    """Arrow takes a memoryview into a text or binary column, but ``copy.deepcopy``
    cannot copy one: the record must not fall back to a shallow copy, which keeps the
    view (of a bytearray that can change) and every other mutable value it holds."""
    buffer = bytearray(b"x")
    items = [1]
    record = {"k": 1, "b": memoryview(buffer), "items": items}
    schema = pa.schema([("k", pa.int64()), ("b", pa.binary()), ("items", pa.list_(pa.int64()))])
    for copier in (copy_record, record_copier(schema)):
        copied = copier(record)
        buffer[0] = ord("y")
        items.append(2)
        assert pa.RecordBatch.from_pylist([copied], schema=schema).to_pylist() == [
            {"k": 1, "b": b"x", "items": [1]}
        ]
        buffer[0] = ord("x")
        items[:] = [1]


class _ViewsACounter(KeyedProcessFunction):
    """Keeps a one-byte bytearray per key in state, counts up in it and yields a
    memoryview of it."""

    def open(self, runtime_context):
        self.counter = runtime_context.get_state(ValueStateDescriptor("counter"))

    def process_element(self, value, ctx):
        counter = self.counter.value()
        if counter is None:
            counter = bytearray(b"`")
            self.counter.update(counter)
        counter[0] += 1
        yield {"k": value["k"], "counter": memoryview(counter)}


def test_a_memoryview_of_a_state_value_emits_every_count():
    env = _env()
    rows = [{"k": 0, "i": i} for i in range(6)]
    env.from_source(CollectionSource(rows, batch_size=3)).key_by("k").process(_ViewsACounter())
    assert [r["counter"] for r in run_in_process(env).records] == [
        b"a",
        b"b",
        b"c",
        b"d",
        b"e",
        b"f",
    ]


@pytest.mark.parametrize(
    ("column", "values"),
    [
        (_Tagged(pa.binary()), [b"a", b"b"]),
        (_Tagged(pa.list_(pa.int64())), [[1], [1, 2]]),
        (pa.json_(), ['{"n": 1}', '{"n": 2}']),
    ],
)
def test_a_declared_extension_column_takes_values_of_its_storage_type(column, values):
    """What an extension column takes is what its storage type takes (the copier goes by
    it too): a map emitting such values into a declared extension column is not rejected."""
    env = _env()
    output_type = pa.schema([("k", pa.int64()), ("c", column)])
    env.from_collection([{"i": i} for i in range(len(values))]).map(
        lambda r: {"k": r["i"], "c": values[r["i"]]}, output_type=output_type
    )
    assert [r["c"] for r in run_in_process(env).records] == values


class _AppendsToAList(KeyedProcessFunction):
    """Keeps a list per key in state, appends to it and yields it."""

    def open(self, runtime_context):
        self.items = runtime_context.get_state(ValueStateDescriptor("items"))

    def process_element(self, value, ctx):
        items = self.items.value()
        if items is None:
            items = []
            self.items.update(items)
        items.append(value["i"])
        yield {"k": value["k"], "items": items}


def test_a_list_in_a_declared_extension_column_over_a_list_is_copied():
    """The copier goes by an extension type's storage: over a list it takes a list."""
    env = _env()
    rows = [{"k": 0, "i": i} for i in range(4)]
    output_type = pa.schema([("k", pa.int64()), ("items", _Tagged(pa.list_(pa.int64())))])
    env.from_source(CollectionSource(rows, batch_size=2)).key_by("k").process(
        _AppendsToAList(), output_type=output_type
    )
    assert [r["items"] for r in run_in_process(env).records] == [
        [0],
        [0, 1],
        [0, 1, 2],
        [0, 1, 2, 3],
    ]


def test_a_uuid_is_copied_shallowly(monkeypatch):
    """A ``uuid.UUID`` (Arrow's uuid type) cannot change: no deep copy for it."""
    deep_copies = []
    monkeypatch.setattr(record_copy.copy, "deepcopy", deep_copies.append)
    record = {"id": uuid.uuid4(), "n": 1}
    with pytest.raises(TypeError, match="immutable"):
        record["id"].int = 0  # what makes it safe to share
    copied = copy_record(record)
    assert copied == record and copied is not record
    assert deep_copies == []
