"""The compiled per-record loop of a keyed ``reduce`` whose records leave as columns.

Once the output's schema is settled, a reduce's loop takes each value it emits apart at
once into one list per column (:class:`~rayflow.runtime.records.Columns`) instead of
copying the dict and taking the copies apart after the loop: a value the state keeps
and a later call changes has left already, as it was. A loop is compiled per tuple of
column names, per tuple of the checks below and per whether it sets the current key
(column names enter its source only as ``repr()`` literals; at most 256 loops are kept),
so each value costs one ``append`` per column and no dict copy.

What goes this way: a plain dict whose keys look up as exactly the schema's names (a
key object equal to a name, with its hash, counts as that name, as it does in any dict
lookup), with a ``str`` (``bytes``) or None in each text (binary) column, whose values
could otherwise be a ``bytearray`` that changes later. Values of number and time columns
are not looked at: one that is not a number or a time (a list, a str) cannot be
converted into its column, and the batch's records are then rebuilt from the columns
(in the schema's key order, holding that value itself) and take the record path, which
names the operator, the key and a record. The first value that is not such a record
stops the loop and is handed back; the caller emits it, and the records after it, as
records (copied, converted and checked as every record is). With object reuse on, too,
what left through the columns shows the values as they were when emitted. A schema with
a column whose values may be mutable (lists, structs, maps, dictionary-encoded or
interval columns) or with a repeated name has no compiled loop (:func:`reduce_loop`
gives None).

Where the optional C module was built (:mod:`rayflow.runtime.speedups`), the loop runs
there instead: the same steps in the same order, with the same results, errors and value
handed back, without the interpreter's cost per step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from rayflow.runtime import speedups as _speedups
from rayflow.runtime.record_copy import is_flat

__all__ = ["END", "ReduceLoop", "check_types", "column_checks", "interned", "reduce_loop"]

#: What a loop hands back when every pair was reduced and emitted into the columns.
END = object()

#: ``loop(tables, table_of_key, state_name, call, set_key, lists, where, *columns)`` ->
#: ``(last key, END or the value it stopped at)``: it builds each record from the input
#: ``columns`` (one list of values per column) and reduces it; ``where`` is a list of
#: two that holds the last key and the state's value before the last call when the loop
#: ends or raises. The values it emitted are in ``lists``: as many as records it reduced
#: before the one it stopped at.
ReduceLoop = Callable[..., tuple[Any, Any]]

_LOOPS: dict[tuple[Any, ...], ReduceLoop] = {}
_MAX_LOOPS = 256


_CHECK_TYPES = {"str": str, "bytes": bytes}

#: column types whose values the output takes only from an immutable type, by its name
_CHECKED = (
    (("is_string", "is_large_string"), "str"),
    (("is_binary", "is_large_binary"), "bytes"),
)


def _check_of(type_: pa.DataType) -> str | None | bool:
    """The type a value of a column of ``type_`` must be (a name), None for no check,
    False where the loop cannot take the column."""
    if is_flat(pa.schema([("c", type_)])):
        return None
    for tests, name in _CHECKED:
        if any(getattr(pa.types, test)(type_) for test in tests):
            return name
    return False


def column_checks(schema: pa.Schema) -> tuple[str | None, ...] | None:
    """Per column of ``schema``, the name of the type its values must be (``"str"``,
    ``"bytes"``), None for no check; None where a loop cannot emit into its columns (no
    column, a repeated name, a column whose values may be mutable)."""
    names = schema.names
    if not names or len(set(names)) != len(names):
        return None
    checks = tuple(_check_of(t) for t in schema.types)
    if any(check is False for check in checks):
        return None
    return checks  # type: ignore[return-value]


def check_types(checks: tuple[str | None, ...]) -> tuple[type | None, ...]:
    """:func:`column_checks`' names as the types the C loops take."""
    return tuple(None if check is None else _CHECK_TYPES[check] for check in checks)


def interned(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` as the strings Python's own code uses for the same names (``sys.intern``):
    a dict lookup of a name written in a function (``b["value"]``) then finds a record's
    key by identity instead of comparing characters. A schema's names are new strings."""
    return tuple(sys.intern(name) if type(name) is str else name for name in names)


def reduce_loop(
    inputs: tuple[str, ...], key: int, schema: pa.Schema, sets_key: bool
) -> ReduceLoop | None:
    """The compiled loop for records with the column names ``inputs`` (the key is the
    column at index ``key``) and an output of ``schema`` (``sets_key``: it sets the
    current key before each call), or None where that output has none."""
    names = tuple(schema.names)
    checks = column_checks(schema)
    if not inputs or checks is None:
        return None
    fits = max(len(names), len(inputs)) <= _speedups.MAX_COLUMNS
    speedups = _speedups.module if fits else None
    signature = (inputs, key, names, checks, sets_key, speedups)
    loop = _LOOPS.get(signature)
    if loop is None:
        if len(_LOOPS) >= _MAX_LOOPS:
            _LOOPS.clear()
        if speedups is None:
            loop = _compile(inputs, key, names, checks, sets_key)  # type: ignore[arg-type]
        else:
            loop = _in_c(speedups, inputs, key, names, checks, sets_key)  # type: ignore[arg-type]
        _LOOPS[signature] = loop
    return loop


def _in_c(
    speedups: Any,
    inputs: tuple[str, ...],
    key: int,
    names: tuple[str, ...],
    checks: tuple[str | None, ...],
    sets_key: bool,
) -> ReduceLoop:
    """The loop :func:`_compile` builds, run by ``speedups.reduce_columns``."""
    reduce_columns = speedups.reduce_columns
    types = check_types(checks)
    inputs, names = interned(inputs), interned(names)

    def reduce_loop(
        tables: Any,
        table_of_key: Any,
        state_name: str,
        call: Any,
        set_key: Any,
        lists: list[list[Any]],
        where: list[Any],
        *columns: list[Any],
    ) -> tuple[Any, Any]:
        return reduce_columns(
            tables,
            table_of_key,
            state_name,
            call,
            set_key if sets_key else None,
            lists,
            where,
            inputs,
            key,
            names,
            types,
            columns,
            END,
        )

    return reduce_loop


def _compile(
    inputs: tuple[str, ...],
    key: int,
    names: tuple[str, ...],
    checks: tuple[str | None, ...],
    sets_key: bool,
) -> ReduceLoop:
    n = len(names)
    columns = ", ".join(f"c{i}" for i in range(len(inputs)))
    arguments = f"tables, table_of_key, state_name, call, set_key, lists, where, {columns}"
    lines = [f"def reduce_loop({arguments}):"]
    lines += [f"    a{i} = lists[{i}].append" for i in range(n)]
    lines += [
        "    key = previous = None",
        "    try:",
    ]
    if len(inputs) == 1:
        lines.append("        for i0 in c0:")
    else:
        items = ", ".join(f"i{i}" for i in range(len(inputs)))
        lines.append(f"        for {items} in zip({columns}):")
    # the record as ``batch.to_pylist()`` gives it (see records._compile_builder)
    record = ", ".join(f"{name!r}: i{i}" for i, name in enumerate(inputs))
    lines += [
        f"            key = i{key}",
        f"            record = {{{record}}}",
    ]
    if sets_key:
        lines.append("            set_key(key)")
    lines += [
        "            table = tables.get(key)",
        "            if table is None:",
        "                table = table_of_key(key, state_name)",
        "            previous = table.get(key)",
        "            value = record if previous is None else call(previous, record)",
        "            table[key] = value",
        f"            if type(value) is not dict or len(value) != {n}:",
        "                return key, value",
        "            try:",
    ]
    lines += [f"                v{i} = value[{name!r}]" for i, name in enumerate(names)]
    lines += [
        "            except KeyError:",
        "                return key, value",
    ]
    for i, check in enumerate(checks):
        if check is not None:
            lines += [
                f"            if type(v{i}) is not {check} and v{i} is not None:",
                "                return key, value",
            ]
    lines += [f"            a{i}(v{i})" for i in range(n)]
    lines += [
        "    finally:",
        "        where[0] = key",
        "        where[1] = previous",
        "    return key, END",
    ]
    namespace: dict[str, Any] = {"END": END}
    exec("\n".join(lines) + "\n", namespace)  # noqa: S102 - names only as repr() literals
    return namespace["reduce_loop"]
