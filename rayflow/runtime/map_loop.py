"""The per-record loop of a ``map`` whose records leave as columns, in C.

Once a map's output schema is settled, and where the C module is loaded
(:mod:`rayflow.runtime.speedups`), a map calls its function on each record in
:func:`map_loop`'s loop and takes each value it returns apart at once into one list per
column (:class:`~rayflow.runtime.records.Columns`), as a keyed reduce's loop does
(:mod:`rayflow.runtime.reduce_loop`, whose rules for what goes this way it shares): no copy
of the value (it has left before the function is called again), no pass over the records
per column. The first value that is not a plain dict of exactly the schema's keys, all of
them ``str`` (a ``str`` or None in a text column, ``bytes`` or None in a binary one), stops
the loop and is handed back; the map emits it, and the records after it, as records.
Without the C module a map takes the record path only.
With object reuse on (nothing copied) a map takes the record path only: a function that
returns one dict it keeps changing emits there that dict as it is when the batch is built
(as Flink's object reuse does), where the columns would take each value as returned, and a
map must emit the same with and without the C module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from rayflow.runtime import speedups as _speedups
from rayflow.runtime.reduce_loop import END, check_types, column_checks, interned

__all__ = ["END", "MapLoop", "map_loop"]

#: ``loop(call, lists, *columns)`` -> ``(rows, END)`` when every record's value went into
#: ``lists``, else ``(row, value)``: the row whose value did not (its value, nothing of it
#: appended). ``columns`` are the input's columns as lists of values.
MapLoop = Callable[..., tuple[int, Any]]


def map_loop(inputs: tuple[str, ...], schema: pa.Schema) -> MapLoop | None:
    """The loop for records with the column names ``inputs`` and an output of ``schema``,
    or None (no C module, no input column, or an output it cannot take)."""
    speedups = _speedups.module
    checks = column_checks(schema)
    if speedups is None or not inputs or checks is None:
        return None
    if max(len(inputs), len(checks)) > _speedups.MAX_COLUMNS:
        return None
    map_columns = speedups.map_columns
    inputs, names = interned(inputs), interned(tuple(schema.names))
    types = check_types(checks)

    def loop(call: Any, lists: list[list[Any]], *columns: list[Any]) -> tuple[int, Any]:
        return map_columns(call, lists, inputs, names, types, columns, END)

    return loop
