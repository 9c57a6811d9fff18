"""Copies of the records an operator emits, so that what user code does to an object after
it was emitted does not change the record (Flink's object reuse, off by default).

A per-record operator gathers a batch's records before it turns them into Arrow. Without
a copy, a reduce function that adds into its accumulator (``a["n"] += b["n"]; return a``)
or a process function that updates the dict its ``ValueState`` holds and yields it would
change records emitted earlier in the same batch: every one of them would show the last
value. With object reuse on (``env.get_config().enable_object_reuse()``) nothing is
copied, and such functions must not change what they emitted or were given.

A record whose values are all immutable scalars is copied shallowly (``dict.copy``);
one holding a list, dict, bytearray or other mutable value is copied deeply. A record of
a dict subclass or another mapping (the output takes any mapping) becomes a plain dict.
Something that is not a mapping is left alone: it is not a record, and the operator's
output rejects it by name; so is a value that cannot be copied (a lock, a generator): it
is no Arrow value either, and the output names the operator, the key and the record. A
memoryview, which ``copy.deepcopy`` cannot copy either but Arrow takes as text or binary,
is copied as the bytes it shows.

What a function gives one by one (a map's results, a generator's records) is taken with
:func:`take_records`, each record copied before the next is asked for. Under CPython a
dict of an output of number and time columns that nothing but the taking loop holds when
it is taken is not copied at all: no code can reach it any more to change it (its
reference count says so), and its values cannot change in place. A dict the function
keeps (in its state, an attribute, a list it returned) is held elsewhere and is copied.
"""

from __future__ import annotations

import copy
import datetime
import decimal
import sys
import sysconfig
import uuid
from collections.abc import Callable, Iterable, Mapping
from sys import getrefcount
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "record_copier",
    "copy_record",
    "copies_shallowly",
    "is_flat",
    "take_records",
    "records_extender",
]

#: values a record may hold that no code can change in place (numpy's scalars too: a
#: function computing with numpy returns them)
_IMMUTABLE = frozenset(
    {
        *(
            t
            for t in set(np.sctypeDict.values())
            if issubclass(
                t, (np.number, np.bool_, np.str_, np.bytes_, np.datetime64, np.timedelta64)
            )
        ),
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
        uuid.UUID,  # its attributes cannot be set
    }
)


def copy_record(record: Any) -> Any:
    """A copy of ``record`` that later changes to ``record`` (or to what it holds) do not
    reach; ``record`` itself when it is not a mapping."""
    if type(record) is not dict:
        if not isinstance(record, Mapping):
            return record
        try:
            record = dict(record)
        except Exception:  # noqa: BLE001 - the output names the operator and the record
            return record
    for value in record.values():
        if type(value) not in _IMMUTABLE:
            try:
                return copy.deepcopy(record)
            except Exception:  # noqa: BLE001 - a memoryview, or no Arrow value
                return _copy_with_views(record)
    return record.copy()


def _copy_with_views(record: dict[Any, Any]) -> dict[Any, Any]:
    """A deep copy of ``record``, whose values ``copy.deepcopy`` could not copy: each
    memoryview it holds (which Arrow takes into a text or binary column, as it does a
    bytearray) becomes the bytes it shows now. Where something else still cannot be copied
    (a lock, a generator: no Arrow value) a plain dict of ``record``: the output rejects it
    by name."""
    memo: dict[int, Any] = {}
    _views_as_bytes(record, memo, set())
    try:
        return copy.deepcopy(record, memo)
    except Exception:  # noqa: BLE001 - no Arrow value: the output rejects it by name
        return dict(record)


def _views_as_bytes(value: Any, memo: dict[int, Any], seen: set[int]) -> None:
    """Enters in ``memo`` (``copy.deepcopy``'s) the bytes of each memoryview that ``value``
    is or holds in lists, tuples, sets and mappings, so that the deep copy takes them."""
    if type(value) is memoryview:
        try:
            memo[id(value)] = value.tobytes()
        except ValueError:  # released: no Arrow value
            pass
        return
    if id(value) in seen:
        return
    if isinstance(value, Mapping):
        seen.add(id(value))
        for item in value.values():
            _views_as_bytes(item, memo, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        seen.add(id(value))
        for item in value:
            _views_as_bytes(item, memo, seen)


def _copy_flat(record: Any) -> Any:
    return record.copy() if type(record) is dict else copy_record(record)


#: column types that take a mutable value too (a bytearray or memoryview); the view
#: types are in pyarrow 16 and later
_TAKES_BUFFERS = tuple(
    getattr(pa.types, test)
    for test in (
        "is_string",
        "is_large_string",
        "is_string_view",
        "is_binary",
        "is_large_binary",
        "is_binary_view",
        "is_fixed_size_binary",
    )
    if hasattr(pa.types, test)
)


def _storage(type_: pa.DataType) -> pa.DataType:
    """What values of ``type_`` are built as: an extension type's storage type."""
    while isinstance(type_, pa.BaseExtensionType):
        type_ = type_.storage_type
    return type_


def is_flat(schema: pa.Schema) -> bool:
    """Every column takes only values of an immutable Python type (numbers, times; no
    lists, structs or maps, no text or binary, which take a bytearray, and no intervals,
    which take a dateutil ``relativedelta``, whose fields can be set). An extension type
    takes what its storage type takes."""
    return not any(
        pa.types.is_nested(type_)
        or pa.types.is_dictionary(type_)
        or pa.types.is_interval(type_)
        or any(test(type_) for test in _TAKES_BUFFERS)
        for type_ in map(_storage, schema.types)
    )


def record_copier(schema: pa.Schema | None) -> Callable[[Any], Any]:
    """How to copy the records of an output of ``schema`` (None: not known yet).

    With a schema of number and time columns a shallow copy is a full one: a record whose
    value does not fit its column is rejected when the batch is built, so only such
    records skip the check of every value."""
    if schema is not None and is_flat(schema):
        return _copy_flat
    return copy_record


def copies_shallowly(copy: Callable[[Any], Any] | None) -> bool:
    """Whether ``copy`` (from :func:`record_copier`) copies a plain dict as ``dict.copy``
    does, so a loop may call that at once for a plain dict."""
    return copy is _copy_flat


def take_records(records: Iterable[Any], copy: Callable[[Any], Any] | None) -> list[Any]:
    """The records ``records`` gives, in a list, each copied with ``copy`` (from
    :func:`record_copier`; None: object reuse, nothing copied) as it is taken, before the
    next is asked for, so a function that changes a dict after giving it (a generator
    updating and yielding one dict again) gives each record as it was. With the shallow
    copier of a flat schema, a plain dict nothing else holds when it is taken is kept
    as it is (see the module's docstring)."""
    if copy is None:
        return list(records)
    if copy is _copy_flat and _ALONE is not None and type(records) not in _HOLDERS:
        return _take_flat(records)
    return list(map(copy, records))


def records_extender(out: list[Any], copy: Callable[[Any], Any] | None) -> Callable[[Any], None]:
    """``out.extend``, taking what each call is given as :func:`take_records` does (each
    record copied with ``copy`` before the next is asked for; None: object reuse). A list
    or tuple goes into ``out`` as it is copied, with no list of its own first: a function
    called per record that returns ``[record]`` pays as little as before per call."""
    extend = out.extend
    if copy is None:
        return extend
    if copy is not _copy_flat or _ALONE is None:
        return lambda records: extend(map(copy, records))

    def taking(records: Iterable[Any]) -> None:
        if type(records) in _HOLDERS:
            extend(map(_copy_flat, records))
        else:
            extend(_take_flat(records))

    return taking


#: containers that hold every record they give: none of those records is alone, so
#: each is copied without reading its count
_HOLDERS = (list, tuple)


def _take_flat(records: Iterable[Any]) -> list[Any]:
    # a record's count is read as in _counts_taken's loop: _ALONE when only this loop
    # holds it; a plain dict is copied here, not through a call of _copy_flat, so that
    # records all held elsewhere cost no more than list(map(_copy_flat, records))
    return [
        (r if getrefcount(r) == _ALONE else r.copy()) if type(r) is dict else copy_record(r)
        for r in records
    ]


def _counts_taken(records: Iterable[Any]) -> list[int]:
    return [getrefcount(r) for r in records]


def _alone_count() -> int | None:
    """The reference count :func:`_take_flat` sees of a record only its loop holds; None
    where counts do not tell that (another interpreter, a free-threaded build, or counts
    that do not add up as expected), so every record is copied."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    alone = _counts_taken({} for _ in range(2))
    kept = {}
    held = _counts_taken(iter([kept, kept]))  # the list twice, and the name
    if alone[0] != alone[1] or held != [alone[0] + 3] * 2:
        return None
    return alone[0]


#: see :func:`_alone_count`
_ALONE = _alone_count()
