"""The C loops of :mod:`rayflow.runtime._speedups` against what they stand for: the reduce
loop :mod:`rayflow.runtime.reduce_loop` compiles in Python, and a map's loop written out in
Python. Random records, functions that stop, fail and change what they were given, keys
whose ``__eq__`` has effects: every call, result, error, emitted value and state is the
same, and no object's reference count is left changed."""

from __future__ import annotations

import copy
import gc
import random
import sys

import pyarrow as pa
import pytest

from rayflow.runtime import reduce_loop as reduce_loop_module
from rayflow.runtime import speedups as speedups_switch
from rayflow.runtime.map_loop import map_loop
from rayflow.runtime.reduce_loop import END, reduce_loop

pytestmark = pytest.mark.timeout(120)

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("s", pa.string())])


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "_Unhashable()"


class _BadKey:
    """A key equal to ``"v"`` (with its hash) whose ``__eq__`` raises ``error``."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error

    def __hash__(self) -> int:
        return hash("v")

    def __eq__(self, other: object) -> bool:
        raise self.error("eq")

    def __repr__(self) -> str:
        return f"_BadKey({self.error.__name__})"


def _function(kind: str, seen: list):
    """A reduce function ``(a, b)`` of the kind named; it records what it was given."""

    def reduce(a, b):
        seen.append((copy.deepcopy(a), copy.deepcopy(b)))
        n = len(seen)
        if kind == "add":
            return {"k": a["k"], "v": a["v"] + b["v"], "s": b["s"]}
        if kind == "into":
            a["v"] += b["v"]
            return a
        if kind == "missing" and n % 4 == 3:
            return {"k": a["k"], "v": 1}
        if kind == "extra" and n % 5 == 4:
            return {"k": a["k"], "v": 1, "s": "x", "e": 1}
        if kind == "other-key" and n % 3 == 2:
            return {"k": a["k"], "v": 1, "t": "x"}
        if kind == "not-dict" and n % 4 == 2:
            return [a["v"]]
        if kind == "none" and n % 4 == 2:
            return None
        if kind == "raises" and n % 6 == 5:
            raise ValueError(f"boom {n}")
        if kind == "stop" and n % 6 == 5:
            raise StopIteration
        if kind == "bad-text" and n % 3 == 1:
            return {"k": a["k"], "v": 1, "s": bytearray(b"x")}
        if kind == "eq-key-error" and n % 3 == 1:
            return {"k": a["k"], _BadKey(KeyError): 1, "s": "x"}
        if kind == "eq-raises" and n % 3 == 1:
            return {"k": a["k"], _BadKey(ArithmeticError): 1, "s": "x"}
        return {"k": a["k"], "v": (a["v"] or 0) + (b["v"] or 0), "s": None}

    return reduce


KINDS = [
    "add",
    "into",
    "missing",
    "extra",
    "other-key",
    "not-dict",
    "none",
    "raises",
    "stop",
    "bad-text",
    "eq-key-error",
    "eq-raises",
]


def _columns(rng: random.Random, rows: int, unhashable_at: int | None):
    keys = [rng.randrange(4) for _ in range(rows)]
    if unhashable_at is not None:
        keys[unhashable_at] = _Unhashable()
    values = [rng.choice([rng.randrange(-5, 100), None, 10**30]) for _ in range(rows)]
    texts = [rng.choice(["a", "bc", None, ""]) for _ in range(rows)]
    return [keys, values, texts]


def _reduce_outcome(loop, kind: str, columns, sets_key: bool, preset: dict) -> dict:
    seen: list = []
    keys_set: list = []
    groups: dict = copy.deepcopy(preset)
    tables: dict = {}

    def table_of_key(key, name):
        table = groups.setdefault((hash(key) % 3, name), {})
        tables[key] = table
        return table

    lists: list[list] = [[], [], []]
    where = [None, None]
    try:
        result = loop(
            tables,
            table_of_key,
            "reduce",
            _function(kind, seen),
            keys_set.append if sets_key else None,
            lists,
            where,
            *copy.deepcopy(columns),
        )
        outcome: object = (result[0], "END" if result[1] is END else repr(result[1]))
    except Exception as exc:  # noqa: BLE001 - compared as an outcome
        outcome = (type(exc), str(exc))
    return {
        "outcome": outcome,
        "calls": repr(seen),
        "keys set": keys_set,
        "lists": repr(lists),
        "where": repr(where),
        "state": repr(groups),
    }


@pytest.mark.parametrize("seed", range(60))
def test_the_reduce_loop_in_c_does_what_the_python_loop_does(seed, speedups, monkeypatch):
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    sets_key = rng.random() < 0.5
    rows = rng.randrange(1, 40)
    unhashable_at = rng.randrange(rows) if rng.random() < 0.15 else None
    columns = _columns(rng, rows, unhashable_at)
    preset = {(1, "reduce"): {1: {"k": 1, "v": 5, "s": "p"}}, (2, "reduce"): {2: None}}
    inputs = ("k", "v", "s")
    outcomes = {}
    for impl, module in (("python", None), ("c", speedups)):
        monkeypatch.setattr(speedups_switch, "module", module)
        loop = reduce_loop(inputs, 0, SCHEMA, sets_key)
        assert loop is not None
        outcomes[impl] = _reduce_outcome(loop, kind, columns, sets_key, preset)
    assert outcomes["c"] == outcomes["python"]


def _map_reference(call, lists, inputs, names, checks, *columns):
    """A map's loop as :func:`rayflow.runtime._speedups.map_columns` stands for it."""
    rows = min(len(c) for c in columns)
    for row in range(rows):
        value = call(dict(zip(inputs, (c[row] for c in columns))))
        if type(value) is not dict or len(value) != len(names):
            return row, value
        try:
            values = [value[name] for name in names]
        except KeyError:
            return row, value
        for v, check in zip(values, checks):
            if check is not None and type(v) is not check and v is not None:
                return row, value
        for out, v in zip(lists, values):
            out.append(v)
    return rows, END


@pytest.mark.parametrize("seed", range(40))
def test_the_map_loop_in_c_does_what_its_python_reference_does(seed, speedups, monkeypatch):
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    columns = _columns(rng, rng.randrange(1, 40), None)
    monkeypatch.setattr(speedups_switch, "module", speedups)
    loop = map_loop(("k", "v", "s"), SCHEMA)
    assert loop is not None
    outcomes = []
    for run in (
        lambda call, lists, cols: loop(call, lists, *cols),
        lambda call, lists, cols: _map_reference(
            call, lists, ("k", "v", "s"), ("k", "v", "s"), (None, None, str), *cols
        ),
    ):
        seen: list = []
        reduce = _function(kind, seen)
        state = {"k": 0, "v": 0, "s": ""}
        lists: list[list] = [[], [], []]
        try:
            result = run(lambda r, f=reduce, a=state: f(a, r), lists, copy.deepcopy(columns))
            outcome: object = (result[0], "END" if result[1] is END else repr(result[1]))
        except Exception as exc:  # noqa: BLE001 - compared as an outcome
            outcome = (type(exc), str(exc))
        outcomes.append((outcome, repr(seen), repr(lists), repr(state)))
    assert outcomes[0] == outcomes[1]


def _counts(objects: list) -> list[int]:
    gc.collect()
    return [sys.getrefcount(o) for o in objects]


@pytest.mark.parametrize("kind", KINDS)
def test_the_loops_in_c_leave_no_reference_behind(kind, speedups, monkeypatch):
    """Every object the loops are given or make is released as the Python loop releases
    it: after the loop and its results are gone, the counts are what they were."""
    monkeypatch.setattr(speedups_switch, "module", speedups)
    rows = 30
    keys = [int(str(10**20 + i % 4)) for i in range(rows)]  # objects of their own
    values = [int(str(10**20 + i)) for i in range(rows)]
    texts = [str(i) * 3 for i in range(rows)]
    name = "reduce-" + str(rows)
    watched = [*keys, *values, *texts, name]
    before = _counts(watched)
    for _ in range(3):
        reduce = _function(kind, [])
        reduce_loop_module._LOOPS.clear()
        loop = reduce_loop(("k", "v", "s"), 0, SCHEMA, True)
        groups: dict = {}
        tables: dict = {}

        def table_of_key(key, state_name, groups=groups, tables=tables):
            table = groups.setdefault(key, {})
            tables[key] = table
            return table

        lists: list[list] = [[], [], []]
        where = [None, None]
        try:
            result = loop(
                tables,
                table_of_key,
                name,
                reduce,
                lambda key: None,
                lists,
                where,
                list(keys),
                list(values),
                list(texts),
            )
        except Exception:  # noqa: BLE001 - only the counts matter here
            result = None
        del result, lists, where, groups, tables, table_of_key, loop
        mapped = map_loop(("k", "v", "s"), SCHEMA)
        state = {"k": keys[0], "v": values[0], "s": texts[0]}
        lists = [[], [], []]
        try:
            result = mapped(
                lambda r, f=reduce, a=state: f(a, r), lists, list(keys), list(values), list(texts)
            )
        except Exception:  # noqa: BLE001 - only the counts matter here
            result = None
        del result, lists, state, mapped, reduce
    assert _counts(watched) == before


def test_the_end_the_loops_are_given_is_released(speedups):
    end = object()
    before = sys.getrefcount(end)
    args = [{}, lambda k, n: {}, "s", lambda a, b: a, None, [[]], [None, None], ("k",), 0]
    result = speedups.reduce_columns(*args, ("k",), (None,), ([1, 1],), end)
    assert result == (1, end)
    result = speedups.map_columns(dict, [[]], ("k",), ("k",), (None,), ([1, 2],), end)
    assert result == (2, end)
    del result, args
    assert sys.getrefcount(end) == before


def test_bad_arguments_are_refused_not_read(speedups):
    with pytest.raises(TypeError, match="reduce_columns takes 13 arguments"):
        speedups.reduce_columns()
    table = lambda key, name: {}  # noqa: E731
    args = [
        {},
        table,
        "s",
        None,
        None,
        [[]],
        [None, None],
        ("k",),
        0,
        ("k",),
        (None,),
        ([1],),
        END,
    ]
    speedups.reduce_columns(*args)  # well formed: no error
    for index, bad, match in [
        (0, [], "tables must be a dict"),
        (5, [[], []], "one list per output name"),
        (6, [None], "where must be a list of two"),
        (8, 1, "key_index out of range"),
        (10, (int,) * 2, "one check per output name"),
        (10, (1,), "a check is a type or None"),
        (11, ((1,),), "columns must be lists"),
        (11, ([1], [2]), "one column per input name"),
    ]:
        wrong = list(args)
        wrong[index] = bad
        with pytest.raises(TypeError, match=match):
            speedups.reduce_columns(*wrong)
    with pytest.raises(TypeError, match="map_columns takes 7 arguments"):
        speedups.map_columns(None)
