"""The in-process runner gives what a Ray run gives, for a few jobs: the same records
(everything before a keyed operator at parallelism 1, so that each key sees its records
in one order in both), or for a union of two sources the same final result per key."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from rayflow import (
    KeyedProcessFunction,
    NumberSequenceSource,
    RuntimeContext,
    StreamExecutionEnvironment,
    ValueStateDescriptor,
)
from rayflow.testing import run_in_process


def env() -> StreamExecutionEnvironment:
    return StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)


def numbers(e: StreamExecutionEnvironment, n: int):
    return e.from_source(NumberSequenceSource(0, n - 1, batch_size=16))


def every_record(records: list[dict]) -> Counter:
    return Counter(map(repr, records))


def last_per_key(records: list[dict]) -> dict:
    """Each key's last record: its final result (a key's records come in order)."""
    return {r["k"]: r for r in records}


def reduce_job(e: StreamExecutionEnvironment) -> None:
    numbers(e, 300).filter(lambda r: r["value"] % 7).map(
        lambda r: {"k": r["value"] % 11, "v": r["value"]}
    ).key_by("k").reduce(lambda a, b: {"k": a["k"], "v": a["v"] + b["v"]}).set_parallelism(2)


def sum_job(e: StreamExecutionEnvironment) -> None:
    a = numbers(e, 200).map(
        lambda r: {"k": r["value"] % 3, **({"v": r["value"]} if r["value"] % 4 else {})}
    )
    b = e.from_collection([{"k": 0, "v": 1000}, {"k": 5, "v": None}])
    a.union(b).key_by("k").sum("v").set_parallelism(2)


class Running(KeyedProcessFunction):
    def open(self, runtime_context: RuntimeContext) -> None:
        self.total = runtime_context.get_state(ValueStateDescriptor("total", 0))

    def process_element(self, value, ctx):
        self.total.update(self.total.value() + value["n"])
        yield {"key": ctx.get_current_key(), "total": self.total.value()}


def process_job(e: StreamExecutionEnvironment) -> None:
    numbers(e, 150).flat_map(
        lambda r: [{"w": w, "n": 1} for w in ("a", "bb", "a")[: r["value"] % 4]]
    ).key_by(lambda r: r["w"]).process(Running()).set_parallelism(2)


def add_into(a: dict, b: dict) -> dict:
    a["v"] += b["v"]  # changes the accumulator, which was emitted before
    return a


def mutating_reduce_job(e: StreamExecutionEnvironment) -> None:
    numbers(e, 300).map(lambda r: {"k": r["value"] % 11, "v": r["value"]}).key_by("k").reduce(
        add_into
    ).set_parallelism(2)


class CountInPlace(KeyedProcessFunction):
    """Changes the dict its state holds and yields it."""

    def open(self, runtime_context: RuntimeContext) -> None:
        self.acc = runtime_context.get_state(ValueStateDescriptor("acc"))

    def process_element(self, value, ctx):
        acc = self.acc.value() or {"key": ctx.get_current_key(), "n": 0}
        acc["n"] += value["n"]
        self.acc.update(acc)
        yield acc


def mutating_process_job(e: StreamExecutionEnvironment) -> None:
    numbers(e, 150).map(lambda r: {"w": r["value"] % 5, "n": 1}).key_by("w").process(
        CountInPlace()
    ).set_parallelism(2)


JOBS: dict[str, tuple[Callable[[StreamExecutionEnvironment], None], Callable]] = {
    "filter-map-reduce": (reduce_job, every_record),
    "union-sum-with-nulls": (sum_job, last_per_key),
    "flat_map-process": (process_job, every_record),
    "reduce-into-its-accumulator": (mutating_reduce_job, every_record),
    "process-changing-its-state-value": (mutating_process_job, every_record),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_in_process_matches_ray(name):
    build, view = JOBS[name]
    local, remote = env(), env()
    build(local)
    build(remote)
    expected = remote.execute_and_collect(f"matches-{name}")
    got = run_in_process(local).records
    assert expected
    assert view(got) == view(expected)


def test_object_reuse_reaches_the_subtasks():
    """With object reuse on, a Ray run copies nothing either: a reduce that adds into its
    accumulator shows each key's last value in the records of one batch (Flink's
    contract: such a function must not run with object reuse)."""
    e = env()
    e.get_config().enable_object_reuse()
    e.from_collection([{"k": 0, "v": v} for v in (1, 2, 3)]).key_by("k").reduce(add_into)
    assert [r["v"] for r in e.execute_and_collect("object-reuse-on")] == [6, 6, 6]
    e = env()
    e.from_collection([{"k": 0, "v": v} for v in (1, 2, 3)]).key_by("k").reduce(add_into)
    assert [r["v"] for r in e.execute_and_collect("object-reuse-off")] == [1, 3, 6]
