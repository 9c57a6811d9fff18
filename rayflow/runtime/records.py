"""Conversions between Arrow record batches and the per-record dicts user functions see.

:func:`batch_to_rows` gives exactly ``batch.to_pylist()`` and :func:`rows_to_batch`
exactly ``pa.RecordBatch.from_pylist(rows)`` (columns named by the first row's keys,
a key missing from a later row is None, types inferred per column), only faster:
``to_pylist`` looks up every column once per row, while here each column is
converted once and the dicts are built by a comprehension compiled per tuple of
column names. :func:`batch_to_columns` also hands back the column lists, so that a
keyed operator can take its keys without a lookup per record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

__all__ = ["batch_to_rows", "batch_to_columns", "rows_to_batch", "rows_to_batches"]

_BUILDERS: dict[tuple[str, ...], Callable[..., list[dict[str, Any]]]] = {}
_MAX_BUILDERS = 256


def _compile_builder(names: tuple[str, ...]) -> Callable[..., list[dict[str, Any]]]:
    # Names only ever enter the source as repr() literals of str, so any column name
    # is safe here; arguments and loop variables are positional (c0.., v0..).
    columns = ", ".join(f"c{i}" for i in range(len(names)))
    items = ", ".join(f"{name!r}: v{i}" for i, name in enumerate(names))
    if len(names) == 1:
        body = f"[{{{items}}} for v0 in c0]"
    else:
        values = ", ".join(f"v{i}" for i in range(len(names)))
        body = f"[{{{items}}} for {values} in zip({columns})]"
    namespace: dict[str, Any] = {}
    exec(f"def build_rows({columns}):\n    return {body}\n", namespace)  # noqa: S102
    return namespace["build_rows"]


def _builder(names: tuple[str, ...]) -> Callable[..., list[dict[str, Any]]]:
    builder = _BUILDERS.get(names)
    if builder is None:
        if len(_BUILDERS) >= _MAX_BUILDERS:
            _BUILDERS.clear()
        builder = _BUILDERS[names] = _compile_builder(names)
    return builder


def batch_to_columns(batch: pa.RecordBatch) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """``(batch.to_pylist(), [column.to_pylist() for every column])``."""
    columns = [column.to_pylist() for column in batch.columns]
    if not columns:
        return [{} for _ in range(batch.num_rows)], columns
    return _builder(tuple(batch.schema.names))(*columns), columns


def batch_to_rows(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """The records of ``batch`` as dicts, equal to ``batch.to_pylist()``."""
    return batch_to_columns(batch)[0]


def rows_to_batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    """``pa.RecordBatch.from_pylist(rows)``: Arrow's own builder already goes column by
    column; measured, a Python column-wise builder is no faster."""
    return pa.RecordBatch.from_pylist(rows)


def rows_to_batches(rows: list[dict[str, Any]]) -> list[pa.RecordBatch]:
    """``[rows_to_batch(rows)]``, or no batch at all for no rows."""
    return [pa.RecordBatch.from_pylist(rows)] if rows else []
