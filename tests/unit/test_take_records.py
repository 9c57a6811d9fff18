"""Records taken from user functions: a plain dict of a number/time output that nothing
else holds is kept, not copied; every dict something else can still reach is copied as it
is taken, in every batch (the shallow copier is in force from an operator's second batch,
once its output's schema is known)."""

from __future__ import annotations

import functools
import sys

import pyarrow as pa
import pytest

from rayflow import (
    FlatMapFunction,
    KeyedProcessFunction,
    MapFunction,
    NumberSequenceSource,
    StreamExecutionEnvironment,
    ValueStateDescriptor,
)
from rayflow.runtime import record_copy
from rayflow.runtime.record_copy import (
    copy_record,
    record_copier,
    records_extender,
    take_records,
)
from rayflow.testing import run_in_process

FLAT = pa.schema([("k", pa.int64()), ("v", pa.int64())])
N = 24
BATCH = 4  # six batches: the copier of the second batch on knows the output's schema


def _numbers(env: StreamExecutionEnvironment):
    return env.from_source(NumberSequenceSource(1, N, batch_size=BATCH), "numbers")


def _env() -> StreamExecutionEnvironment:
    return StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)


# --- take_records --------------------------------------------------------------------------


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="reference counts of CPython")
def test_reference_counts_are_read_under_cpython():
    assert record_copy._ALONE is not None


def test_an_unshared_dict_of_a_flat_output_is_kept_not_copied():
    returned: list[int] = []

    def fresh(i: int) -> dict:
        record = {"k": i, "v": i}
        returned.append(id(record))  # an id holds no reference
        return record

    out = take_records(map(fresh, range(5)), record_copier(FLAT))
    assert out == [{"k": i, "v": i} for i in range(5)]
    if record_copy._ALONE is not None:
        assert [id(r) for r in out] == returned


def test_a_dict_held_elsewhere_is_copied_as_it_is_taken():
    kept = {"k": 0, "v": 0}
    history: list[dict] = []

    def shared(i: int) -> dict:
        kept["v"] = i  # the same dict, changed for every call
        history.append({"k": i, "v": i})
        return kept if i % 2 else history[-1]

    out = take_records(map(shared, range(6)), record_copier(FLAT))
    for record in history:
        record["v"] = -1  # changed after it was taken
    assert [r["v"] for r in out] == list(range(6))
    assert all(r is not kept and r not in history for r in out)


def test_a_dict_a_suspended_generator_still_holds_is_copied():
    def generator():
        for i in range(4):
            record = {"k": i, "v": i}
            yield record
            record["v"] = -1  # changed once the next one is asked for

    assert [r["v"] for r in take_records(generator(), record_copier(FLAT))] == [0, 1, 2, 3]


def test_a_dict_subclass_becomes_a_plain_dict():
    class Row(dict):
        pass

    out = take_records((Row(k=i, v=i) for i in range(3)), record_copier(FLAT))
    assert [type(r) for r in out] == [dict] * 3 and out[2] == {"k": 2, "v": 2}


def test_without_a_flat_schema_every_record_is_copied_deeply():
    items = [1]
    out = take_records(({"k": 0, "items": items} for _ in range(2)), record_copier(None))
    items.append(2)
    assert [r["items"] for r in out] == [[1], [1]]


def test_with_object_reuse_nothing_is_copied():
    kept = {"k": 0, "v": 0}
    assert all(r is kept for r in take_records(iter([kept, kept]), None))
    assert record_copier(None) is copy_record


@pytest.mark.parametrize("container", [list, tuple, iter])
def test_the_extender_copies_what_a_list_or_tuple_holds_and_keeps_a_fresh_yielded_dict(
    container,
):
    kept = {"k": 0, "v": 0}
    out: list[dict] = []
    extend = records_extender(out, record_copier(FLAT))
    for i in range(3):
        kept["v"] = i
        extend(container([kept, {"k": 1, "v": i}]))
    extend({"k": 2, "v": i} for i in range(2))  # nothing else holds these
    kept["v"] = -1
    assert [r["v"] for r in out] == [0, 0, 1, 1, 2, 2, 0, 1]
    assert all(r is not kept for r in out)
    assert records_extender(out, None) == out.extend  # object reuse: nothing copied


def test_the_extender_names_no_record_for_what_is_not_iterable():
    with pytest.raises(TypeError, match="not iterable"):
        records_extender([], record_copier(FLAT))(5)


# --- operators over several batches ----------------------------------------------------------


class _KeepsOneRecord(MapFunction):
    def open(self, runtime_context):
        self.out = {}

    def map(self, value):
        self.out["k"] = value["value"] % 3
        self.out["v"] = value["value"]
        return self.out


class _KeepsEveryRecord(MapFunction):
    """Keeps what it returned and changes it on the next call."""

    def open(self, runtime_context):
        self.last = None

    def map(self, value):
        if self.last is not None:
            self.last["v"] = -1
        self.last = {"k": 0, "v": value["value"]}
        return self.last


@pytest.mark.parametrize("function", [_KeepsOneRecord, _KeepsEveryRecord])
def test_a_map_changing_what_it_returned_emits_the_values_returned_in_every_batch(function):
    env = _env()
    _numbers(env).map(function())
    assert sorted(r["v"] for r in run_in_process(env).records) == list(range(1, N + 1))


class _ChangesAfterYield(FlatMapFunction):
    def flat_map(self, value):
        record = {"k": 0, "v": value["value"]}
        yield record
        record["v"] = -1


def test_a_flat_map_changing_a_yielded_dict_on_resume_emits_the_values_yielded():
    env = _env()
    _numbers(env).flat_map(_ChangesAfterYield())
    assert sorted(r["v"] for r in run_in_process(env).records) == list(range(1, N + 1))


def test_a_reduce_adding_into_its_accumulator_emits_every_running_sum_in_every_batch():
    env = _env()
    _numbers(env).map(lambda r: {"k": r["value"] % 3, "v": r["value"]}).key_by("k").reduce(
        lambda a, b: a.update(v=a["v"] + b["v"]) or a
    )
    records = run_in_process(env).records
    for k in range(3):
        values = [v for v in range(1, N + 1) if v % 3 == k]
        running = [sum(values[: i + 1]) for i in range(len(values))]
        assert [r["v"] for r in records if r["k"] == k] == running


class _YieldsItsState(KeyedProcessFunction):
    def open(self, runtime_context):
        self.state = runtime_context.get_state(ValueStateDescriptor("row"))

    def process_element(self, value, ctx):
        row = self.state.value() or {"k": value["k"], "n": 0}
        row["n"] += 1  # changed in place, kept in the state, yielded
        self.state.update(row)
        yield row


def test_a_process_function_yielding_its_state_emits_every_count_in_every_batch():
    env = _env()
    _numbers(env).map(lambda r: {"k": r["value"] % 2, "v": r["value"]}).key_by("k").process(
        _YieldsItsState()
    )
    records = run_in_process(env).records
    for k in range(2):
        assert [r["n"] for r in records if r["k"] == k] == list(range(1, N // 2 + 1))


# --- references that do not show at first sight ----------------------------------------------

_GLOBAL_ROW: dict = {}


def _closure_holder():
    last: dict | None = None

    def give(i: int) -> dict:
        nonlocal last
        last = {"k": i, "v": i}  # the function's closure cell holds it
        return last

    return give, lambda: [last]


def _default_holder():
    def give(i: int, _row: dict = {"k": 0, "v": 0}) -> dict:  # noqa: B006 - the point
        _row["v"] = i
        return _row

    return give, lambda: [give.__defaults__[0]]


def _global_holder():
    def give(i: int) -> dict:
        global _GLOBAL_ROW
        _GLOBAL_ROW = {"k": i, "v": i}
        return _GLOBAL_ROW

    return give, lambda: [_GLOBAL_ROW]


def _nested_holder():
    rows: dict[int, tuple[dict, int]] = {}

    def give(i: int) -> dict:
        rows[i] = ({"k": i, "v": i}, i)  # a value inside a tuple inside a dict it keeps
        return rows[i][0]

    return give, lambda: [row for row, _ in rows.values()]


def _cache_holder():
    @functools.cache
    def row_of(k: int) -> dict:
        return {"k": k, "v": k}

    def give(i: int) -> dict:
        return row_of(i % 2)  # the same dict given again for every other call

    return give, lambda: [row_of(0), row_of(1)]


@pytest.mark.parametrize(
    "holder",
    [
        _closure_holder,
        _default_holder,
        _global_holder,
        _nested_holder,
        _cache_holder,
    ],
)
def test_a_dict_reachable_only_through_a_closure_default_global_value_or_cache_is_copied(
    holder,
):
    give, reach = holder()
    given: list[dict] = []

    def giving(i: int) -> dict:
        if i:
            for row in reach():  # what was given before, changed through what holds it
                row["v"] = -1
        record = give(i)
        record["v"] = i
        given.append(dict(record))
        return record

    out = take_records(map(giving, range(6)), record_copier(FLAT))
    for row in reach():
        row["v"] = -1  # the last one too, once taken
    assert [r["v"] for r in out] == list(range(6))
    assert out == given


def test_a_map_whose_records_a_kept_traceback_still_reaches_emits_every_value():
    class KeepsTracebacks(MapFunction):
        def open(self, runtime_context):
            self.caught: list[BaseException] = []

        def map(self, value):
            if self.caught:  # the record given before, reached through its frame
                self.caught[-1].__traceback__.tb_frame.f_locals["row"]["v"] = -1
            row = {"k": 0, "v": value["value"]}
            try:
                raise LookupError(row["v"])
            except LookupError as exc:
                self.caught.append(exc)
            return row

    env = _env()
    _numbers(env).map(KeepsTracebacks())
    assert sorted(r["v"] for r in run_in_process(env).records) == list(range(1, N + 1))


def _reads_locals(frame, event, arg):  # a profiler or debugger that looks at the locals
    assert isinstance(frame.f_locals, dict)
    return _reads_locals


@pytest.mark.parametrize("hook", ["profile", "trace"])
def test_a_count_calibrated_while_a_hook_reads_the_locals_is_never_above_the_plain_one(hook):
    """A hook that reads a frame's locals makes them hold the record too: a count taken
    under it and used without it would keep a dict that one reference more holds."""
    plain = record_copy._alone_count()
    set_hook = sys.setprofile if hook == "profile" else sys.settrace
    set_hook(_reads_locals)
    try:
        hooked = record_copy._alone_count()
    finally:
        set_hook(None)
    assert hooked is None or hooked == plain


def _stops_in_the_second_batch(value):
    if value["value"] == N - 1:
        raise StopIteration("user code")
    return {"k": 0, "v": value["value"]}


@pytest.mark.parametrize(
    "operator", ["map", "flat_map (list)", "flat_map (generator)", "process (generator)"]
)
def test_stop_iteration_in_a_later_batch_fails_it_naming_the_function(operator):
    """From the second batch the shallow copier, and so the taking loop, is in force."""

    class Process(KeyedProcessFunction):
        def process_element(self, value, ctx):
            yield _stops_in_the_second_batch(value)

    def gen(value):
        yield _stops_in_the_second_batch(value)

    env = _env()
    numbers = _numbers(env)
    if operator == "map":
        numbers.map(_stops_in_the_second_batch)
    elif operator == "flat_map (list)":
        numbers.flat_map(lambda value: [_stops_in_the_second_batch(value)])
    elif operator == "flat_map (generator)":
        numbers.flat_map(gen)
    else:
        numbers.key_by("value").process(Process())
    with pytest.raises(Exception, match="StopIteration") as caught:
        run_in_process(env)
    assert not isinstance(caught.value, StopIteration)
