"""Bad input of every kind, end to end on a real local Ray: each case either runs with
nothing dropped or fails with a message that names the operator, the key or element
and what to do, before deploying where the mistake can be seen on the driver. Tiny
inputs and no restarts keep it fast; where a sink committed before the failure, what
it committed stays."""

from __future__ import annotations

import json
import os
import threading
import time

import pyarrow as pa
import pytest
import ray

from rayflow import (
    JobFailedError,
    NumberSequenceSource,
    RestartStrategies,
    StreamExecutionEnvironment,
)
from rayflow.errors import NotPicklableError
from sinks.basic import CollectSink
from sinks.files import FileSink


def env(parallelism: int = 1) -> StreamExecutionEnvironment:
    e = StreamExecutionEnvironment.get_execution_environment().set_parallelism(parallelism)
    return e.set_restart_strategy(RestartStrategies.no_restart())


def numbers(e: StreamExecutionEnvironment, n: int, batch_size: int = 4):
    return e.from_source(NumberSequenceSource(0, n - 1, batch_size=batch_size))


def failure(e: StreamExecutionEnvironment) -> str:
    with pytest.raises(JobFailedError) as info:
        e.execute("bad-input")
    return str(info.value)


# --- schemas ------------------------------------------------------------------------------


def test_keys_that_differ_within_a_batch_are_all_kept():
    e = env()
    numbers(e, 8, batch_size=8).map(
        lambda r: {**r, "odd": True} if r["value"] % 2 else {**r, "even": True}
    )
    records = e.execute_and_collect()
    assert len(records) == 8
    assert all(set(r) == {"value", "odd", "even"} for r in records)
    assert [r["odd"] for r in records] == [None, True] * 4


def test_a_key_that_disappears_in_a_later_batch_is_null_there():
    e = env()
    numbers(e, 8).map(lambda r: {**r, "early": 1} if r["value"] < 4 else r)
    records = sorted(e.execute_and_collect(), key=lambda r: r["value"])
    assert [r["early"] for r in records] == [1, 1, 1, 1, None, None, None, None]


def test_a_key_that_appears_in_a_later_batch_fails_at_the_operator():
    e = env()
    numbers(e, 8).map(
        lambda r: {**r, "late": "x"} if r["value"] >= 4 else r, name="Enrich"
    ).sink_to(CollectSink())
    message = failure(e)
    assert "map 'Enrich'" in message and "'late'" in message
    assert "{'value': 4, 'late': 'x'}" in message  # a sample record
    assert "Schema at index" not in message  # not a sink's schema mismatch


def test_a_sum_over_a_field_later_records_lack_skips_nulls_and_counts_them():
    e = env()
    numbers(e, 8).map(
        lambda r: {"k": r["value"] % 2, **({"v": r["value"]} if r["value"] < 4 else {})}
    ).key_by("k").sum("v", name="Total").sink_to(CollectSink())
    result = e.execute("bad-input")
    skipped = [
        m["operators"]["Total"]["nulls_skipped"]
        for m in result.metrics
        if "Total" in m.get("operators", {})
    ]
    assert sum(skipped) == 4
    table = result.sink_results["CollectSink"]
    last = dict(zip(table.column("k").to_pylist(), table.column("v").to_pylist()))
    assert last == {0: 0 + 2, 1: 1 + 3}


# --- not records --------------------------------------------------------------------------


def test_map_returning_a_non_dict():
    e = env()
    numbers(e, 4).map(lambda r: r["value"] * 2, name="Double").sink_to(CollectSink())
    assert "map 'Double' must return a dict (a record), got int" in failure(e)


def test_flat_map_yielding_non_dicts():
    e = env()
    numbers(e, 4).flat_map(lambda r: [r["value"]], name="Split").sink_to(CollectSink())
    message = failure(e)
    assert "flat_map 'Split' must return an iterable of dicts" in message
    assert "item of type int" in message


def test_reduce_returning_a_non_dict():
    e = env()
    numbers(e, 4).key_by(lambda r: 0).reduce(
        lambda a, b: a["value"] + b["value"], name="Add"
    ).sink_to(CollectSink())
    assert "reduce 'Add' must return a dict (a record), got int" in failure(e)


# --- aggregations over the wrong type -----------------------------------------------------


def test_sum_of_a_string_field_fails_at_the_first_batch():
    e = env()
    numbers(e, 4).map(lambda r: {"k": 1, "name": str(r["value"])}).key_by("k").sum("name").sink_to(
        CollectSink()
    )
    assert "sum('name'): field 'name' is string; sum needs a numeric field" in failure(e)


def test_sum_of_a_string_field_of_a_collection_fails_before_deploying():
    e = env()
    e.from_collection([{"k": 1, "name": "a"}]).key_by("k").sum("name").sink_to(CollectSink())
    with pytest.raises(TypeError, match=r"sum\('name'\): field 'name' is string"):
        e.execute_async("bad-input")


# --- the job's definition -----------------------------------------------------------------


def test_a_function_that_cannot_be_pickled_fails_before_anything_deploys():
    lock = threading.Lock()

    def guarded(record):
        with lock:
            return record

    e = env()
    numbers(e, 4).map(guarded, name="Guarded").sink_to(CollectSink())
    actors_before = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(NotPicklableError) as info:
        e.execute("bad-input")
    message = str(info.value)
    assert "operator 'Guarded'" in message and "'lock'" in message and "open()" in message
    assert len(ray.util.list_named_actors(all_namespaces=True)) == actors_before


@pytest.mark.parametrize("value,error", [(0, ValueError), ("2", TypeError)])
def test_sink_parallelism_is_refused_where_it_is_set(value, error):
    e = env()
    sink = numbers(e, 4).sink_to(CollectSink(), name="Out")
    with pytest.raises(error, match=f"sink 'Out': parallelism must be an int >= 1, got {value!r}"):
        sink.set_parallelism(value)


def test_collections_of_scalars_and_tuples_run_and_mixed_ones_are_refused():
    e = env()
    e.from_collection([1, 2, 3])
    assert sorted(r["value"] for r in e.execute_and_collect()) == [1, 2, 3]
    e = env()
    e.from_collection([(1, "a"), (2, "b")])
    assert sorted(e.execute_and_collect(), key=lambda r: r["f0"]) == [
        {"f0": 1, "f1": "a"},
        {"f0": 2, "f1": "b"},
    ]
    with pytest.raises(TypeError, match="element 1 is int"):
        env().from_collection([{"a": 1}, 2])


# --- what was committed before a failure stays --------------------------------------------


def test_output_committed_before_a_failure_is_kept(tmp_path):
    out, flag = tmp_path / "out", tmp_path / "fail-now"
    e = env()
    e.enable_checkpointing(100)
    e.get_checkpoint_config().set_checkpoint_storage(f"file://{tmp_path / 'chk'}")
    # records get a new key once a checkpoint has committed output: the job then fails
    e.from_source(NumberSequenceSource(0, 10**6, batch_size=10, records_per_second=1000)).map(
        lambda r: {**r, "late": 1} if os.path.exists(flag) else r, name="Enrich"
    ).sink_to(FileSink(str(out), "jsonl"))
    client = e.execute_async("bad-input-committed")
    deadline = time.time() + 60
    while not list(out.glob("part-*")) and time.time() < deadline:
        time.sleep(0.05)
    flag.touch()
    with pytest.raises(JobFailedError) as info:
        client.wait(60)
    message = str(info.value)
    assert "map 'Enrich'" in message and "'late'" in message
    committed = [
        json.loads(line)["value"]
        for part in sorted(out.glob("part-*"))
        for line in part.read_text().splitlines()
    ]
    assert committed, "no checkpoint committed output before the failure"
    assert committed == list(range(len(committed)))  # a prefix, each record once


def test_execute_and_collect_works_as_a_context_manager_like_pyflink():
    e = env()
    stream = e.from_collection(pa.table({"a": [1, 2]}))
    with stream.execute_and_collect() as results:
        assert sorted(r["a"] for r in results) == [1, 2]
