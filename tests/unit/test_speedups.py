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


class _Finder:
    """When released, keeps every object the collector lists whose id is ``of``'s."""

    def __init__(self, seen: list, of: object) -> None:
        self.seen, self.of = seen, id(of)

    def __del__(self) -> None:
        self.seen.extend(o for o in gc.get_objects() if id(o) == self.of)


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
        # what the function does to the record it was given: each row's is a new one
        if kind == "keeps-record" and n % 2:
            seen.append(b)  # held: shows its values as they were given, at the end
        if kind == "changes-record":
            b["v"] = n  # and the next row's record has that row's values
        if kind == "grows-record" and n % 2:
            b["x"] = n
        if kind == "shrinks-record" and n % 3 == 1:
            del b["s"]
        if kind == "reorders-record" and n % 2:
            b["k"] = b.pop("k")
        if kind == "reinserts-record" and n % 2:
            b["s"] = b.pop("s")  # the same keys in the same order, a deleted entry left
        if kind == "holds-a-container" and n % 2:
            b["v"] = [n]
        if kind == "returns-record" and n % 3 == 1:
            return b  # kept as the state
        if kind == "holds-a-view" and n % 2:
            seen.append(b.items())
        if kind == "finds-record" and n % 2:
            # the record reached again, through the collector, as it is released
            result = {"k": a["k"], "v": (a["v"] or 0) + (b["v"] or 0), "s": None}
            b["v"] = _Finder(seen, b)
            return result
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
    "keeps-record",
    "changes-record",
    "grows-record",
    "shrinks-record",
    "reorders-record",
    "reinserts-record",
    "holds-a-container",
    "returns-record",
    "holds-a-view",
    "finds-record",
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
        "keys set": repr(keys_set),  # an unhashable key equals only itself
        "lists": repr(lists),
        "where": repr(where),
        "state": repr(groups),
    }


@pytest.mark.parametrize("seed", range(88))
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
        if any(type(key) is not str for key in value):  # as the record path: no column name
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


@pytest.mark.parametrize("seed", range(66))
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


# --- review schedules -------------------------------------------------------------------


_REFILLED = ("k", "l", "v", "w")
_REFILLED_COLUMNS = [[1, 1, 1], [None, None, [7]], [10, 20, 30], [100, 200, 300]]


def _finding_function(seen: list, reduce: bool):
    """A function that, on its second call, puts into the record an object the collector
    does not track (a numpy array) whose release looks for the record in
    ``gc.get_objects()``: the next row's list (a tracked item) makes a record refilled in
    place tracked before the array is released."""
    import weakref

    import numpy as np

    calls = [0]

    def function(*args):
        b = args[-1]
        calls[0] += 1
        seen.append(("call", dict(b)))
        if calls[0] == 2:
            target = id(b)
            array = np.zeros(1)

            def released(_ref):
                seen.extend(("found", dict(o)) for o in gc.get_objects() if id(o) == target)

            seen.append(weakref.ref(array, released))  # held until the loop ends
            b["v"] = array
        return {"k": b["k"], "v": 0, "s": None}

    return function


@pytest.mark.parametrize("loop_kind", ["reduce", "map"])
def test_a_record_is_never_seen_half_refilled(loop_kind, speedups, monkeypatch):
    outcomes = []
    for module in (None, speedups):
        monkeypatch.setattr(speedups_switch, "module", module)
        seen: list = []
        columns = [list(c) for c in _REFILLED_COLUMNS]
        if loop_kind == "reduce":
            loop = reduce_loop(_REFILLED, 0, SCHEMA, False)
            tables: dict = {1: {1: {"k": 1, "v": 0, "s": None}}}  # the key's state is there
            loop(
                tables,
                None,
                "r",
                _finding_function(seen, True),
                None,
                [[], [], []],
                [None, None],
                *columns,
            )
        elif module is None:  # the record path: one new record per row
            function = _finding_function(seen, False)
            for row in zip(*columns):
                function(dict(zip(_REFILLED, row)))
        else:
            loop = map_loop(_REFILLED, SCHEMA)
            loop(_finding_function(seen, False), [[], [], []], *columns)
        outcomes.append([s for s in seen if isinstance(s, tuple)])
    assert outcomes[1] == outcomes[0]


def _empty_lists_holding(value, length) -> None:
    """What a function can do with gc.get_referrers: empty every list of ``length`` or
    more items that holds ``value``, and every list of two holding such a list."""
    for holder in gc.get_referrers(value):
        if type(holder) is list and len(holder) >= length:
            for outer in gc.get_referrers(holder):
                if type(outer) is list and len(outer) == 2:
                    outer.clear()
            holder.clear()


@pytest.mark.parametrize("impl", ["python", "c"])
def test_a_reduce_emptying_the_operator_s_lists_fails_naming_it(impl, speedups, monkeypatch):
    """Review schedule: the function reaches the operator's input column and output lists
    (through gc.get_referrers on what it was given) and empties them. In C the loop read
    past the lists' ends and the process died (SIGSEGV); now both loops end as zip() does
    and the operator fails naming itself, never emitting fewer records than it read."""
    from rayflow.runtime.operators import KeyedReduceOperator
    from tests.unit.test_reduce_loop import _columns_after

    monkeypatch.setattr(speedups_switch, "module", speedups if impl == "c" else None)
    mark = "m" * 50

    def reduce(a, b):
        if b["s"] == mark:
            _empty_lists_holding(b["s"], 3)
        return {"k": a["k"], "s": b["s"]}

    rows = [{"k": 0, "s": "a"}] + [{"k": 0, "s": mark if i == 3 else "b"} for i in range(10)]
    with pytest.raises(RuntimeError, match="reduce 'R': 4 of its batch's 10 records"):
        _columns_after(rows[:1], rows[1:], reduce)
    assert KeyedReduceOperator is not None


@pytest.mark.parametrize("impl", ["records", "c"])
def test_a_map_emptying_the_operator_s_lists_fails_as_on_the_record_path(
    impl, speedups, monkeypatch
):
    """Review schedule: as above, for a map: the C loop stops where the lists end and the
    map fails as the record path does, instead of reading past their ends."""
    from tests.unit.test_map_loop import _op

    monkeypatch.setattr(speedups_switch, "module", speedups if impl == "c" else None)
    mark = "m" * 50

    def fn(r):
        if r["s"] == mark:
            _empty_lists_holding(r["s"], 3)
        return {"k": r["k"], "s": r["s"]}

    op = _op(fn)
    op.process(pa.RecordBatch.from_pylist([{"k": 0, "s": "a"}]))
    rows = [{"k": 0, "s": mark if i == 3 else "b"} for i in range(10)]
    with pytest.raises(RuntimeError, match="map 'M'"):
        op.process(pa.RecordBatch.from_pylist(rows))


def test_the_map_loop_holds_its_output_lists_as_the_python_loop_does(speedups):
    """Review schedule: the function empties the outer list of output lists; the loop
    appends on into the lists it was given, as bound appends do."""
    lists: list[list] = [[]]
    inner = lists[0]

    def fn(r):
        lists.clear()
        return {"v": r["v"]}

    assert speedups.map_columns(fn, lists, ("v",), ("v",), (None,), ([1, 2, 3],), END) == (3, END)
    assert inner == [1, 2, 3]


class _LooksLikeV:
    def __init__(self, raises: type[Exception] | None = None) -> None:
        self.raises = raises

    def __hash__(self) -> int:
        return hash("v")

    def __eq__(self, other: object) -> bool:
        if self.raises is not None:
            raise self.raises("eq")
        return other == "v"

    def __repr__(self) -> str:
        return "_LooksLikeV()"


def _map_outcome(fn, batches) -> object:
    """The records a map of ``fn`` emits for ``batches`` (the first settles its schema),
    or the type and message of its error."""
    from tests.unit.test_map_loop import _op

    op = _op(fn)
    try:
        out = [b for rows in batches for b in op.process(pa.RecordBatch.from_pylist(rows))]
    except Exception as exc:  # noqa: BLE001 - compared as an outcome
        return type(exc), str(exc)
    return pa.Table.from_batches(out).to_pylist()


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("raises", [None, ArithmeticError, StopIteration])
def test_a_map_returning_a_key_that_is_no_str_does_what_the_record_path_does(
    raises, first, speedups, monkeypatch
):
    """Review schedule: a map returns a key equal to ``"v"`` that is not a str. The C
    loop took it as ``v`` (or raised its ``__eq__``'s error) where the record path named
    the operator: outcomes differed with and without the C module. Now such a value goes
    the record path, whatever that makes of it."""

    def fn(r):
        if r["k"] == 0:
            return {"k": r["k"], "v": r["v"]}
        return {"k": r["k"], _LooksLikeV(raises): r["v"]}

    rows = [{"k": 1, "v": 3}, {"k": 0, "v": 2}] if first else [{"k": 0, "v": 2}, {"k": 1, "v": 3}]
    batches = [[{"k": 0, "v": 1}], rows]
    outcomes = []
    for module in (None, speedups):
        monkeypatch.setattr(speedups_switch, "module", module)
        outcomes.append(_map_outcome(fn, batches))
    assert outcomes[0] == outcomes[1]


class _GetDict(dict):
    """A table that is a dict of another type: the loops read it with ``get``."""


def test_a_tuple_key_reaches_a_table_s_get_as_one_argument(speedups, monkeypatch):
    """Review schedule: a table that is not exactly a dict and a tuple key. C called
    ``table.get(*key)``; now ``table.get(key)``, as the Python loop."""
    outcomes = []
    for module in (None, speedups):
        monkeypatch.setattr(speedups_switch, "module", module)
        loop = reduce_loop(("k", "v"), 0, pa.schema([("k", pa.int64()), ("v", pa.int64())]), False)
        key = ("a", "b")
        table = _GetDict({key: {"k": 0, "v": 1}})
        lists: list[list] = [[], []]
        result = loop(
            {key: table},
            None,
            "reduce",
            lambda a, b: {"k": 0, "v": a["v"] + b["v"]},
            None,
            lists,
            [None, None],
            [key],
            [5],
        )
        outcomes.append((result[1] is END, lists, dict(table)))
    assert outcomes[0] == outcomes[1] == (True, [[0], [6]], {("a", "b"): {"k": 0, "v": 6}})


def test_a_c_module_of_another_version_is_not_used(monkeypatch, caplog):
    """Review schedule: an editable install keeps a build of an older source in place
    after the source changed. It was used, and every map failed on a function it lacks;
    now it is not used (a warning says so) and the loops run in Python."""
    import types

    old = types.ModuleType("rayflow.runtime._speedups")
    old.reduce_columns = lambda *args: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rayflow.runtime._speedups", old)
    import rayflow.runtime

    monkeypatch.setattr(rayflow.runtime, "_speedups", old, raising=False)
    monkeypatch.delenv(speedups_switch.DISABLE_ENV, raising=False)
    with caplog.at_level("WARNING", logger="rayflow.runtime.speedups"):
        assert speedups_switch._load() is None
    assert "built from another version" in caplog.text
    old.ABI = speedups_switch.ABI  # type: ignore[attr-defined]
    assert speedups_switch._load() is None  # lacks functions
    for name in speedups_switch._FUNCTIONS:
        setattr(old, name, lambda *args: None)
    assert speedups_switch._load() is old
    monkeypatch.setenv(speedups_switch.DISABLE_ENV, "1")
    assert speedups_switch._load() is None


class _Int(int):
    """An int of another type: pyarrow converts it; the C packer leaves it to pyarrow."""


def _column_values(rng: random.Random, pack: str) -> list:
    import numpy as np

    if pack == "q":
        pool = [0, 1, -1, 2**63 - 1, -(2**63), 7, 123456789012]
        odd = [2**63, -(2**63) - 1, True, None, 1.5, _Int(3), np.int64(4), "1"]
    else:
        pool = [0.0, -0.0, 1.5, float("nan"), float("inf"), -1e308, 5e-324]
        odd = [1, True, None, np.float64(2.5), "x", _Int(2)]
    values = [rng.choice(pool) for _ in range(rng.randrange(0, 20))]
    if values and rng.random() < 0.5:
        values[rng.randrange(len(values))] = rng.choice(odd)
    return values


def _array_outcome(build) -> object:
    try:
        array = build()
    except Exception as exc:  # noqa: BLE001 - compared as an outcome
        return type(exc), str(exc)
    return array.type, array.null_count, array.to_pylist().__repr__(), array.buffers()[0]


@pytest.mark.parametrize("seed", range(80))
def test_a_packed_column_is_the_array_pyarrow_builds(seed, speedups, monkeypatch):
    """Every list the C packer takes gives the array ``pa.array`` gives (inferred for an
    int64 column, converted to float64 for a float64 one); every other list goes to
    pyarrow, with its result or error."""
    from rayflow.runtime.records import _array

    rng = random.Random(seed)
    pack = "q" if seed % 2 else "d"
    t = None if pack == "q" else pa.float64()
    values = _column_values(rng, pack)
    monkeypatch.setattr(speedups_switch, "module", speedups)
    packed = _array_outcome(lambda: _array(list(values), t, pack))
    expected = _array_outcome(lambda: pa.array(list(values), type=t))
    assert packed == expected
    packs = speedups.pack_column(list(values), pack)
    if packs is not None:  # only lists of exact ints (floats)
        assert all(type(v) is (int if pack == "q" else float) for v in values)


@pytest.mark.parametrize("seed", range(40))
def test_an_unpacked_column_is_what_to_pylist_gives(seed, speedups, monkeypatch):
    """The C module reads int64 and float64 columns with no nulls (of any offset and
    length, a batch's slice); every other column goes to ``to_pylist``."""
    from rayflow.runtime.records import column_values

    rng = random.Random(seed)
    kind = rng.choice(["int64", "float64", "int32", "string", "nulls"])
    n = rng.randrange(0, 30)
    if kind == "int64":
        array = pa.array(
            [rng.choice([0, -1, 2**63 - 1, -(2**63), 7]) for _ in range(n)], pa.int64()
        )
    elif kind == "float64":
        pool = [0.0, -0.0, float("nan"), float("-inf"), 1e-310, 2.5]
        array = pa.array([rng.choice(pool) for _ in range(n)], pa.float64())
    elif kind == "int32":
        array = pa.array(range(n), pa.int32())
    elif kind == "string":
        array = pa.array([str(i) for i in range(n)])
    else:
        array = pa.array([None if i % 3 == 0 else i for i in range(n)], pa.int64())
    start = rng.randrange(0, n + 1)
    array = array.slice(start, rng.randrange(0, n - start + 1))
    monkeypatch.setattr(speedups_switch, "module", speedups)
    got = column_values(array)
    assert repr(got) == repr(array.to_pylist())
    assert [type(v) for v in got] == [type(v) for v in array.to_pylist()]


def test_unpacking_refuses_values_beyond_the_buffer(speedups):
    data = pa.array([1, 2, 3], pa.int64()).buffers()[1]
    assert speedups.unpack_column(data, 1, 2, "q") == [2, 3]
    for offset, length in [(2, 2), (-1, 1), (0, -1), (4, 0), (2**60, 1)]:
        with pytest.raises(ValueError, match="beyond the buffer"):
            speedups.unpack_column(data, offset, length, "q")
    with pytest.raises(ValueError, match="kind"):
        speedups.unpack_column(data, 0, 1, "x")


class _Cents(pa.ExtensionType):
    """A Python extension type over int64 (such a type may not hash)."""

    def __init__(self) -> None:
        super().__init__(pa.int64(), "test.cents")

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type, serialized):  # noqa: ANN001, ANN206
        return cls()

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("operator", ["map", "reduce"])
def test_a_declared_extension_type_over_int64_converts_as_before(operator, speedups, monkeypatch):
    """Review schedule: a declared ``output_type`` with an extension type over int64 that
    does not hash. Looking its packing up by type raised ``TypeError: unhashable type``,
    unnamed, from every batch after the first (a reduce failed without the C module too)."""
    from rayflow import CollectionSource, StreamExecutionEnvironment
    from rayflow.testing import run_in_process

    schema = pa.schema([("k", pa.int64()), ("cents", _Cents())])
    rows = [{"k": i % 2, "cents": i * 100} for i in range(6)]
    outcomes = []
    for module in (None, speedups):
        monkeypatch.setattr(speedups_switch, "module", module)
        env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
        stream = env.from_source(CollectionSource(rows, batch_size=2))
        if operator == "map":
            stream.map(lambda r: dict(r), output_type=schema)
        else:
            add = lambda a, b: {"k": a["k"], "cents": a["cents"] + b["cents"]}  # noqa: E731
            stream.key_by("k").reduce(add, output_type=schema)
        outcomes.append(run_in_process(env).records)
    assert outcomes[0] == outcomes[1]
    assert [r["cents"] for r in outcomes[0]] == (
        [r["cents"] for r in rows] if operator == "map" else [0, 100, 200, 400, 600, 900]
    )


def test_rayflow_loads_the_built_module(speedups, monkeypatch):
    """The loader rayflow's processes use takes the module the tests were given (CI
    requires it to be built: RAYFLOW_REQUIRE_SPEEDUPS)."""
    monkeypatch.delenv(speedups_switch.DISABLE_ENV, raising=False)
    assert speedups_switch._load() is speedups
    monkeypatch.setenv(speedups_switch.DISABLE_ENV, "0")
    assert speedups_switch._load() is speedups


def test_kinds_are_one_letter(speedups):
    data = pa.array([1], pa.int64()).buffers()[1]
    for bad in ("q\x00junk", "qq", ""):
        with pytest.raises(ValueError, match="kind"):
            speedups.unpack_column(data, 0, 1, bad)
        with pytest.raises(ValueError, match="kind"):
            speedups.pack_column([1], bad)


def test_an_empty_column_or_one_with_a_validity_bitmap_reads_as_to_pylist_reads_it(
    speedups, monkeypatch
):
    """Review schedules: an empty array whose offset lies past its buffer (the module
    refused it), and an array with a validity bitmap: read by pyarrow."""
    from rayflow.runtime.records import column_values

    monkeypatch.setattr(speedups_switch, "module", speedups)
    empty = pa.Array.from_buffers(pa.int64(), 0, [None, pa.py_buffer(b"")], offset=5)
    assert column_values(empty) == []
    sliced = pa.array([None, 1, 2], pa.int64()).slice(1)  # a bitmap, no nulls
    assert sliced.null_count == 0 and sliced.buffers()[0] is not None
    assert column_values(sliced) == [1, 2]


# --- records, each a new one, held as the Python loop holds them ---------------------

_ROW_INPUTS = ("k", "v", "s")


def _rows_columns():
    return [[1, 1, 1], [10, 20, 30], ["a", "b", "c"]]


def _run_rows(loop_kind, module, function, monkeypatch):
    monkeypatch.setattr(speedups_switch, "module", module)
    columns = _rows_columns()
    if loop_kind == "reduce":
        loop = reduce_loop(_ROW_INPUTS, 0, SCHEMA, False)
        tables = {1: {1: {"k": 1, "v": 0, "s": None}}}  # a previous value: every row calls
        loop(tables, None, "r", function, None, [[], [], []], [None, None], *columns)
    elif module is None:  # the map's record path: a new record per row
        for row in zip(*columns):
            function(None, dict(zip(_ROW_INPUTS, row)))
    else:
        loop = map_loop(_ROW_INPUTS, SCHEMA)
        loop(lambda b: function(None, b), [[], [], []], *columns)


def _seen_by_each_loop(loop_kind, make, speedups, monkeypatch) -> tuple[list, list]:
    """What the function ``make(seen)`` records in ``seen`` run by the Python loop (or the
    record path) and by the loop in C."""
    outcomes = []
    for module in (None, speedups):
        seen: list = []
        _run_rows(loop_kind, module, make(seen), monkeypatch)
        outcomes.append(seen)
    return outcomes[0], outcomes[1]


def _iterating_function(seen):
    calls = [0]

    def function(a, b):
        calls[0] += 1
        if calls[0] == 1:
            # leaves the record with its keys, in order, and no free entry
            b["x"] = b["y"] = 0
            del b["x"], b["y"]
        else:
            visited = []
            try:
                for name in b:
                    visited.append(name)
                    if len(visited) == 1:
                        b["k"] = b.pop("k")  # moved to the end while iterating
            except RuntimeError as exc:
                visited.append(str(exc))
            seen.append(visited)
        return {"k": 1, "v": 0, "s": None}

    return function


@pytest.mark.parametrize("loop_kind", ["reduce", "map"])
def test_each_row_s_record_iterates_as_a_new_one(loop_kind, speedups, monkeypatch):
    python, c = _seen_by_each_loop(loop_kind, _iterating_function, speedups, monkeypatch)
    assert c == python


def _sizing_function(seen):
    calls = [0]

    def function(a, b):
        calls[0] += 1
        if calls[0] == 1:
            for i in range(1000):
                b[f"extra{i}"] = i
            for i in range(1000):
                del b[f"extra{i}"]
        seen.append(sys.getsizeof(b))
        return {"k": 1, "v": 0, "s": None}

    return function


@pytest.mark.parametrize("loop_kind", ["reduce", "map"])
def test_each_row_s_record_has_the_size_of_a_new_one(loop_kind, speedups, monkeypatch):
    python, c = _seen_by_each_loop(loop_kind, _sizing_function, speedups, monkeypatch)
    assert c == python


def test_consecutive_records_of_a_reduce_are_distinct_objects(speedups, monkeypatch):
    """In the Python loop a row's record is built while the one before is still held, so
    two consecutive records never share an id()."""
    outcomes = []
    for module in (None, speedups):
        ids = []

        def function(a, b, ids=ids):
            ids.append(id(b))
            return {"k": 1, "v": 0, "s": None}

        _run_rows("reduce", module, function, monkeypatch)
        outcomes.append([ids[i] == ids[i - 1] for i in range(1, len(ids))])
    assert outcomes[1] == outcomes[0]


class _Logged:
    def __init__(self, seen, tables):
        self.seen, self.tables = seen, tables

    def __del__(self):
        self.seen.append(("released; state now", repr(self.tables[1][1]["v"])))


def test_a_record_the_function_changed_is_released_where_the_python_loop_releases_it(
    speedups, monkeypatch
):
    outcomes = []
    for module in (None, speedups):
        monkeypatch.setattr(speedups_switch, "module", module)
        seen = []
        tables = {1: {1: {"k": 1, "v": 0, "s": None}}}
        calls = [0]

        def function(a, b, seen=seen, tables=tables, calls=calls):
            calls[0] += 1
            seen.append(("call", calls[0]))
            b["v"] = _Logged(seen, tables)  # a GC object: the record is tracked
            return {"k": 1, "v": calls[0], "s": None}

        loop = reduce_loop(_ROW_INPUTS, 0, SCHEMA, False)
        loop(
            tables,
            None,
            "r",
            function,
            None,
            [[], [], []],
            [None, None],
            [1, 1, 1],
            [10, 20, 30],
            ["a", "b", "c"],
        )
        outcomes.append(seen)
    assert outcomes[1] == outcomes[0]
