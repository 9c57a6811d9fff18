"""Copies of the records an operator emits, so that what user code does to an object after
it was emitted does not change the record (Flink's object reuse, off by default).

A per-record operator gathers a batch's records before it turns them into Arrow. Without
a copy, a reduce function that adds into its accumulator (``a["n"] += b["n"]; return a``)
or a process function that updates the dict its ``ValueState`` holds and yields it would
change records emitted earlier in the same batch: every one of them would show the last
value. With object reuse on (``env.get_config().enable_object_reuse()``) nothing is
copied, and such functions must not change what they emitted or were given.

A record whose values are all immutable scalars is copied shallowly (``dict.copy``);
one holding a list, dict or other mutable value is copied deeply. Something that is not
a dict is left alone: it is not a record, and the operator's output rejects it by name.
"""

from __future__ import annotations

import copy
import datetime
import decimal
from collections.abc import Callable
from typing import Any

import pyarrow as pa

__all__ = ["record_copier", "copy_record"]

#: values a record may hold that no code can change in place
_IMMUTABLE = frozenset(
    {
        int,
        float,
        bool,
        str,
        bytes,
        type(None),
        decimal.Decimal,
        datetime.datetime,
        datetime.date,
        datetime.time,
        datetime.timedelta,
    }
)


def copy_record(record: Any) -> Any:
    """A copy of ``record`` that later changes to ``record`` (or to what it holds) do not
    reach; ``record`` itself when it is not a dict."""
    if type(record) is not dict:
        return record
    for value in record.values():
        if type(value) not in _IMMUTABLE:
            return copy.deepcopy(record)
    return record.copy()


def _copy_flat(record: Any) -> Any:
    return record.copy() if type(record) is dict else record


def _is_flat(schema: pa.Schema) -> bool:
    """Every column holds values of an immutable Python type (no lists, structs, maps)."""
    return not any(
        pa.types.is_nested(field.type) or pa.types.is_dictionary(field.type) for field in schema
    )


def record_copier(schema: pa.Schema | None) -> Callable[[Any], Any]:
    """How to copy the records of an output of ``schema`` (None: not known yet).

    With a schema of scalar columns a shallow copy is a full one: a record whose value
    does not fit its column is rejected when the batch is built, so only such records
    skip the check of every value."""
    if schema is not None and _is_flat(schema):
        return _copy_flat
    return copy_record
