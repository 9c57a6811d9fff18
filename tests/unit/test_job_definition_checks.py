"""Mistakes in a job's definition found where they are made, on the driver: parallelism
values, collections that are not lists of records, functions that cannot be pickled, and
aggregations over fields they cannot aggregate."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from rayflow import (
    CollectionSource,
    MapFunction,
    NumberSequenceSource,
    StreamExecutionEnvironment,
)
from rayflow.errors import NotPicklableError
from rayflow.plan.checks import check_picklable
from sinks.basic import CollectSink


def env() -> StreamExecutionEnvironment:
    return StreamExecutionEnvironment.get_execution_environment()


# --- parallelism --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,error", [(0, ValueError), (-1, ValueError), ("2", TypeError), (2.0, TypeError)]
)
def test_stream_parallelism_is_checked_where_it_is_set(value, error):
    stream = env().from_collection([{"a": 1}]).map(lambda r: r, name="Double")
    with pytest.raises(error) as info:
        stream.set_parallelism(value)
    assert "'Double'" in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize(
    "value,error", [(0, ValueError), ("2", TypeError), (True, TypeError), (None, TypeError)]
)
def test_sink_parallelism_is_checked_where_it_is_set(value, error):
    sink = env().from_collection([{"a": 1}]).sink_to(CollectSink(), name="Out")
    with pytest.raises(error) as info:
        sink.set_parallelism(value)
    assert "'Out'" in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize(
    "value,error", [(0, ValueError), (32769, ValueError), ("128", TypeError), (1.5, TypeError)]
)
def test_max_parallelism_is_checked_on_streams_sinks_and_the_environment(value, error):
    e = env()
    stream = e.from_collection([{"a": 1}]).map(lambda r: r, name="M")
    with pytest.raises(error, match="'M'"):
        stream.set_max_parallelism(value)
    with pytest.raises(error, match="'Out'"):
        stream.sink_to(CollectSink(), name="Out").set_max_parallelism(value)
    with pytest.raises(error, match="set_max_parallelism"):
        e.set_max_parallelism(value)


def test_valid_values_are_kept():
    e = env().set_parallelism(3).set_max_parallelism(64)
    stream = e.from_collection([{"a": 1}]).map(lambda r: r).set_parallelism(2)
    stream.set_max_parallelism(16)
    sink = stream.sink_to(CollectSink()).set_parallelism(1).set_max_parallelism(8)
    assert sink._transformation.parallelism == 1
    assert sink._transformation.max_parallelism == 8
    with pytest.raises(TypeError, match="set_parallelism"):
        e.set_parallelism("2")


# --- from_collection ----------------------------------------------------------------------


def collected(records) -> list[dict]:
    return CollectionSource(records).table.to_pylist()


def test_scalars_become_a_value_column():
    assert collected([1, 2, 3]) == [{"value": 1}, {"value": 2}, {"value": 3}]
    assert collected(["a", None]) == [{"value": "a"}, {"value": None}]


def test_tuples_become_f0_f1_columns():
    assert collected([(1, "a"), (2, "b")]) == [{"f0": 1, "f1": "a"}, {"f0": 2, "f1": "b"}]


def test_dicts_with_differing_keys_keep_every_key():
    assert collected([{"a": 1}, {"a": 2, "b": "x"}]) == [
        {"a": 1, "b": None},
        {"a": 2, "b": "x"},
    ]


@pytest.mark.parametrize(
    "records,position,what",
    [
        ([{"a": 1}, 2], 1, "int"),
        ([1, {"a": 1}], 1, "dict"),
        ([(1, 2), (1, 2, 3)], 1, "3 fields"),
        ([(1, 2), 3], 1, "int"),
        ([[1, 2]], 0, "list"),
        ([{1: "a"}], 0, "key 1"),
    ],
)
def test_mixed_or_unsupported_elements_name_the_position(records, position, what):
    with pytest.raises(TypeError) as info:
        CollectionSource(records)
    message = str(info.value)
    assert f"element {position}" in message and what in message
    assert "dict" in message  # says what records are


def test_a_collection_that_is_not_a_list_of_records():
    with pytest.raises(TypeError, match="from_collection.*int"):
        env().from_collection(5)
    with pytest.raises(TypeError, match="dict of columns"):
        env().from_collection({"a": [1, 2]})


# --- functions that cannot be pickled -----------------------------------------------------


def test_a_lambda_closing_over_a_lock_is_named_with_the_variable():
    lock = threading.Lock()

    def locked(record):
        with lock:
            return record

    e = env()
    e.from_collection([{"a": 1}]).map(locked, name="Locked").sink_to(CollectSink())
    with pytest.raises(NotPicklableError) as info:
        check_picklable(e.get_job_graph())
    message = str(info.value)
    assert "'Locked'" in message and "'lock'" in message and "open()" in message


class WithFile(MapFunction):
    def __init__(self, path: str) -> None:
        self.path = path
        self.out = open(path, "w")  # noqa: SIM115 - the mistake under test

    def map(self, value):
        return value


def test_a_function_object_holding_an_open_file_is_named_with_the_attribute(tmp_path):
    e = env()
    function = WithFile(str(tmp_path / "x"))
    e.from_collection([{"a": 1}]).map(function, name="Writer").sink_to(CollectSink())
    with pytest.raises(NotPicklableError) as info:
        check_picklable(e.get_job_graph())
    function.out.close()
    message = str(info.value)
    assert "'Writer'" in message and "self.out" in message


def test_a_global_of_a_script_the_function_uses_is_named():
    # A function of a script (``__main__``) is pickled by value, with the globals it uses.
    namespace = {"__name__": "__main__", "lock": threading.Lock()}
    exec("def guarded(record):\n    with lock:\n        return record\n", namespace)
    e = env()
    e.from_collection([{"a": 1}]).map(namespace["guarded"], name="G").sink_to(CollectSink())
    with pytest.raises(NotPicklableError) as info:
        check_picklable(e.get_job_graph())
    assert "'G'" in str(info.value) and "global 'lock'" in str(info.value)


def test_functions_of_importable_modules_are_pickled_by_reference():
    e = env()
    e.from_collection([{"a": 1}]).map(_uses_global_lock, name="G").sink_to(CollectSink())
    check_picklable(e.get_job_graph())


_GLOBAL_LOCK = threading.Lock()


def _uses_global_lock(record):
    with _GLOBAL_LOCK:
        return record


def test_picklable_jobs_pass():
    e = env()
    e.from_source(NumberSequenceSource(0, 9)).map(lambda r: r).key_by("value").sum("value").sink_to(
        CollectSink()
    )
    check_picklable(e.get_job_graph())


# --- aggregations at plan time ------------------------------------------------------------


def test_sum_of_a_string_field_fails_when_the_job_is_built():
    e = env()
    e.from_collection([{"k": 1, "name": "a"}]).key_by("k").sum("name").sink_to(CollectSink())
    with pytest.raises(TypeError, match=r"sum\('name'\): field 'name' is string; sum needs a"):
        e.get_job_graph()


def test_sum_of_a_missing_field_fails_when_the_job_is_built():
    e = env()
    e.from_collection(pa.table({"k": [1], "v": [2]})).key_by("k").sum("vv").sink_to(CollectSink())
    with pytest.raises(KeyError, match=r"sum\('vv'\).*'v'"):
        e.get_job_graph()
