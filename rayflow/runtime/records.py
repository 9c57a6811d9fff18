"""Conversions between Arrow record batches and the per-record dicts user functions see,
and the schema of what a per-record operator emits.

:func:`batch_to_rows` gives exactly ``batch.to_pylist()``, only faster: ``to_pylist``
looks up every column once per row, while here each column is converted once and the
dicts are built by a comprehension compiled per tuple of column names.
:func:`batch_to_columns` also hands back the column lists, so that a keyed operator can
take its keys without a lookup per record.

:class:`OutputRecords` turns the records one operator returns into batches:

* records whose keys differ are unified: the columns are every key in order of first
  appearance, None where a record lacks a key (nothing is dropped);
* the operator's output keeps one schema, the first one it emitted (or the declared
  ``output_type``): a later batch that lacks a key gets nulls there, and a value that
  converts safely (an int into a float column) is cast; a key that schema does not have,
  or a value of another type, raises :class:`~rayflow.errors.SchemaChangeError` naming the
  operator, the key and a sample record (rather than a schema mismatch in a sink later);
* anything that is not a dict with str keys raises :class:`~rayflow.errors.RecordError`.

The schema is each subtask's own, not part of checkpoints: parallel subtasks of one
operator, or an attempt after a restart, take it from their own first batch; a declared
``output_type`` is the same everywhere.

Records that all have the first record's keys (the common case) cost one C-level pass per
column (an ``itemgetter`` mapped over the records) and one over the records' lengths;
only when a key is missing or a count differs is the batch unified record by record.

An operator that takes its records' values apart as it emits them (the keyed reduce's
compiled loop, :mod:`rayflow.runtime.reduce_loop`) hands over :class:`Columns`: one list
per key of the settled schema. They are converted as records with those keys would be;
where they do not convert, the records are rebuilt from them (with the schema's key
order) and take the record path, whose error names the operator, a key and a record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import pyarrow as pa

from rayflow.errors import RecordError, SchemaChangeError
from rayflow.runtime import speedups as _speedups

__all__ = [
    "batch_to_rows",
    "batch_to_columns",
    "column_values",
    "iter_columns",
    "rows_to_batch",
    "rows_to_batches",
    "Columns",
    "OutputRecords",
    "RETURNS_RECORD",
    "RETURNS_RECORDS",
    "YIELDS_RECORDS",
]

_BUILDERS: dict[tuple[tuple[str, ...], bool], Callable[..., Any]] = {}
_MAX_BUILDERS = 256


def _compile_builder(names: tuple[str, ...], lazy: bool) -> Callable[..., Any]:
    # Names only ever enter the source as repr() literals of str, so any column name
    # is safe here; arguments and loop variables are positional (c0.., v0..).
    columns = ", ".join(f"c{i}" for i in range(len(names)))
    items = ", ".join(f"{name!r}: v{i}" for i, name in enumerate(names))
    if len(names) == 1:
        body = f"{{{items}}} for v0 in c0"
    else:
        values = ", ".join(f"v{i}" for i in range(len(names)))
        body = f"{{{items}}} for {values} in zip({columns})"
    body = f"({body})" if lazy else f"[{body}]"
    namespace: dict[str, Any] = {}
    exec(f"def build_rows({columns}):\n    return {body}\n", namespace)  # noqa: S102
    return namespace["build_rows"]


def _builder(names: tuple[str, ...], lazy: bool = False) -> Callable[..., Any]:
    builder = _BUILDERS.get((names, lazy))
    if builder is None:
        if len(_BUILDERS) >= _MAX_BUILDERS:
            _BUILDERS.clear()
        builder = _BUILDERS[names, lazy] = _compile_builder(names, lazy)
    return builder


def batch_to_columns(batch: pa.RecordBatch) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """``(batch.to_pylist(), [column.to_pylist() for every column])``."""
    columns = [column.to_pylist() for column in batch.columns]
    if not columns:
        return [{} for _ in range(batch.num_rows)], columns
    return _builder(tuple(batch.schema.names))(*columns), columns


def iter_columns(batch: pa.RecordBatch) -> tuple[Iterator[dict[str, Any]], list[list[Any]]]:
    """``(iter(batch.to_pylist()), [column.to_pylist() for every column])``, the dicts
    built one at a time as the iterator is read: a record the reader does not keep is
    freed before the next is built, so its memory is reused while it is still in cache
    (a batch's worth of dicts alive at once is megabytes)."""
    columns = [column.to_pylist() for column in batch.columns]
    if not columns:
        return ({} for _ in range(batch.num_rows)), columns
    return _builder(tuple(batch.schema.names), True)(*columns), columns


def batch_to_rows(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """The records of ``batch`` as dicts, equal to ``batch.to_pylist()``."""
    return batch_to_columns(batch)[0]


@dataclass(frozen=True)
class Columns:
    """Records of one batch out, kept as one list of values per key, in ``names``' order:
    record ``i`` is ``{name: values[i] for name, values in zip(names, lists)}``."""

    names: tuple[str, ...]
    lists: list[list[Any]]

    def __len__(self) -> int:
        return len(self.lists[0]) if self.lists else 0

    def rows(self) -> list[dict[str, Any]]:
        """The records as dicts."""
        if not self.lists:
            return []
        return _builder(self.names)(*self.lists)


#: What a function must return, in the words of :class:`OutputRecords`' errors.
RETURNS_RECORD = "must return a dict (a record)"
RETURNS_RECORDS = "must return an iterable of dicts (records) or None"
YIELDS_RECORDS = "must yield dicts (records), or return an iterable of them or None"

#: error messages show at most this many characters of a record
SAMPLE_CHARS = 200


def sample(value: Any) -> str:
    """A short repr of ``value`` for an error message."""
    text = repr(value)
    return text if len(text) <= SAMPLE_CHARS else text[: SAMPLE_CHARS - 3] + "..."


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


class OutputRecords:
    """Builds the output batches of one per-record operator and keeps its output's schema.

    ``what`` names the operator in errors (``"map 'Double'"``); ``returns`` says what its
    function must give (:data:`RETURNS_RECORD` when each call gives one record, else the
    records are the items of what each call returned); ``schema`` is a declared output
    type, None to take the first batch's.
    """

    def __init__(
        self, what: str, schema: pa.Schema | None = None, returns: str = RETURNS_RECORD
    ) -> None:
        self.what = what
        self.returns = returns
        self.declared = schema is not None
        #: the schema every batch this operator emits has (None until the first one)
        self.schema: pa.Schema | None = schema
        #: the schema is declared, or was taken from a batch and holds no null type: a
        #: batch's records may then be built in parts with the same result
        self.settled = self.declared
        #: a declared schema with metadata: a batch whose columns fit it takes it too
        self._metadata = schema is not None and (
            bool(schema.metadata) or any(field.metadata for field in schema)
        )
        self._names: tuple[Any, ...] = ()
        self._getters: list[Callable[[Any], Any]] = []
        self._types: list[pa.DataType | None] = []
        self._packs: list[str | None] = []

    # --- batches --------------------------------------------------------------------------

    def build(self, rows: list[Any] | Columns) -> list[pa.RecordBatch]:
        """The records ``rows`` as batches of the output's schema (none for no rows)."""
        if not rows:
            return []
        if isinstance(rows, Columns):
            batch = self._from_columns(rows)
            if batch is not None:
                return self._in_schema(batch, rows.rows)
            rows = rows.rows()
        try:
            batch = self._same_keys(rows)
        except Exception:  # noqa: BLE001 - not all records with the first one's keys
            batch = None
        if batch is None:
            batch = self._unified(rows)
        if batch.num_rows != len(rows):  # no record had a key: a batch without columns
            raise RecordError(
                f"{self.what}: got records with no keys ({sample(rows[0])}); a record needs "
                "at least one key (its column). To emit nothing for a record use filter or "
                "flat_map"
            )
        schema = self.schema
        if schema is None:
            self.schema = batch.schema
            self.settled = not any(_holds_null_type(t) for t in batch.schema.types)
            self._names = ()  # convert to its types from now on
            return [batch]
        return self._in_schema(batch, lambda: rows)

    def _in_schema(
        self, batch: pa.RecordBatch, rows: Callable[[], list[Any]]
    ) -> list[pa.RecordBatch]:
        """``batch`` (of records ``rows()``, asked for only to name one in an error) in the
        output's schema, which is known."""
        schema = self.schema
        assert schema is not None
        if batch.schema.equals(schema):  # metadata aside
            if self._metadata:
                batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
            return [batch]
        return [self._conform(batch, rows())]

    def _from_columns(self, columns: Columns) -> pa.RecordBatch | None:
        """The batch of ``columns``, converted as :meth:`_same_keys` converts records with
        those keys; None where a value does not convert (the records then say why)."""
        names = columns.names
        if names != self._names:
            self._getters = [itemgetter(name) for name in names]
            self._types = self._direct_types(names)
            self._packs = self._packed(names)
            self._names = names
        try:
            return pa.RecordBatch.from_arrays(
                list(map(_array, columns.lists, self._types, self._packs)), names=list(names)
            )
        except Exception:  # noqa: BLE001 - the record path gives the result or the error
            return None

    def _same_keys(self, rows: list[Any]) -> pa.RecordBatch | None:
        """The batch when every record has exactly the first record's keys, else None
        (or an error, which sends the records the slow way too)."""
        names = tuple(rows[0])
        if names != self._names:
            self._getters = [itemgetter(name) for name in names]
            self._types = self._direct_types(names)
            self._packs = self._packed(names)
            self._names = names
        columns = [list(map(getter, rows)) for getter in self._getters]  # KeyError: missing
        if sum(map(len, rows)) != len(names) * len(rows):  # a record has another key
            return None
        return pa.RecordBatch.from_arrays(
            list(map(_array, columns, self._types, self._packs)), names=list(names)
        )

    def _direct_types(self, names: tuple[Any, ...]) -> list[pa.DataType | None]:
        """Per key, the output schema's type when values convert to it directly (faster
        than inferring it, and a value that does not fit raises), else None."""
        schema = self.schema
        types: list[pa.DataType | None] = []
        for name in names:
            index = schema.get_field_index(name) if schema is not None else -1
            t = schema.field(index).type if index >= 0 else None
            types.append(t if t is not None and _converts_directly(t) else None)
        return types

    def _packed(self, names: tuple[Any, ...]) -> list[str | None]:
        """Per key, the kind letter of :func:`_array` where the output schema's column is
        one the C module packs, else None."""
        schema = self.schema
        packs: list[str | None] = []
        for name in names:
            index = schema.get_field_index(name) if schema is not None else -1
            packs.append(_packed_kind(schema.field(index).type) if index >= 0 else None)
        return packs

    def _unified(self, rows: list[Any]) -> pa.RecordBatch:
        """Every key of every record as a column (in order of first appearance), None
        where a record lacks it; errors name what is not a record."""
        names: dict[str, None] = {}
        for row in rows:
            if not isinstance(row, Mapping):
                raise RecordError(self.not_a_record(row))
            for key in row:
                if key not in names:
                    if not isinstance(key, str):
                        raise RecordError(
                            f"{self.what}: a record's keys are its column names and must be "
                            f"str; got key {key!r} ({type(key).__name__}) in {sample(row)}"
                        )
                    names[key] = None
        arrays = []
        for name in names:
            column = [row.get(name) for row in rows]
            try:
                arrays.append(pa.array(column))
            except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
                raise self._unconvertible(name, rows, exc) from None
        return pa.RecordBatch.from_arrays(arrays, names=list(names))

    def _conform(self, batch: pa.RecordBatch, rows: list[Any]) -> pa.RecordBatch:
        """``batch`` in the output's schema: missing keys as nulls, values cast safely."""
        schema = self.schema
        assert schema is not None
        known = set(schema.names)
        for name in batch.schema.names:
            if name not in known:
                raise self._new_key(name, rows)
        columns = []
        for field in schema:
            index = batch.schema.get_field_index(field.name)
            if index < 0:
                columns.append(pa.nulls(batch.num_rows, field.type))
                continue
            column = batch.column(index)
            if column.type != field.type:
                column = self._converted(column, field, rows)
            columns.append(column)
        return pa.RecordBatch.from_arrays(columns, schema=schema)

    def _converted(self, column: pa.Array, field: pa.Field, rows: list[Any]) -> pa.Array:
        """``column`` as ``field``'s type, cast safely where :func:`_widens` allows it. An
        extension type's values are inferred as what its storage type takes (a user's
        type over binary gets bytes): they are cast to the storage type and wrapped. Plain
        values for a dictionary-encoded column are cast to its value type and encoded."""
        target = field.type
        extension = isinstance(target, pa.BaseExtensionType) and not isinstance(
            column.type, pa.BaseExtensionType
        )
        to = target.storage_type if extension else target
        encoding = None
        if pa.types.is_dictionary(to) and not pa.types.is_dictionary(column.type):
            encoding, to = to, to.value_type
        if column.type != to:
            if not _widens(column.type, to):
                raise self._type_change(field, column.type, rows)
            try:
                column = column.cast(to, safe=True)
            except pa.ArrowException:
                raise self._type_change(field, column.type, rows) from None
        if encoding is not None:
            try:
                column = column.dictionary_encode().cast(encoding, safe=True)
            except pa.ArrowException:  # more distinct values than the index type holds
                raise self._too_many_values(field, encoding, column, rows) from None
        return pa.ExtensionArray.from_storage(target, column) if extension else column

    # --- what went wrong, in words --------------------------------------------------------

    def not_a_record(self, value: Any) -> str:
        """The message for ``value`` given where a record was due."""
        if self.returns == RETURNS_RECORD:
            text = f"{self.what} {self.returns}, got {_type_name(value)}"
            return text if value is None else f"{text}: {sample(value)}"
        text = f"{self.what} {self.returns}; got an item of type {_type_name(value)}"
        if value is not None:
            text += f": {sample(value)}"
        if isinstance(value, str):
            text += " (if it returned a dict, its keys became the items: return [record])"
        return text

    def not_iterable(self, value: Any) -> str:
        """The message for a call that returned ``value`` where an iterable was due."""
        text = f"{self.what} {self.returns}, got {_type_name(value)}"
        return text if value is None else f"{text}: {sample(value)}"

    def _remedy(self, name: str) -> str:
        if self.declared:
            return "add it to the output_type, or return only the keys the output_type has"
        return (
            "return every key from the first record on (None where there is no value), "
            f"or declare the output's schema: output_type=pa.schema([({name!r}, <type>), ...])"
        )

    def _before(self) -> str:
        return "its declared output_type" if self.declared else "the records it emitted before"

    def _new_key(self, name: str, rows: list[Any]) -> SchemaChangeError:
        record = next((r for r in rows if name in r), rows[0])
        assert self.schema is not None
        return SchemaChangeError(
            f"{self.what} returned a record with key {name!r}, which {self._before()} did "
            f"not have (keys: {', '.join(self.schema.names)}): {sample(record)}. An "
            f"operator's output keeps one schema: {self._remedy(name)}"
        )

    def _type_change(self, field: pa.Field, got: pa.DataType, rows: list[Any]) -> SchemaChangeError:
        name = field.name
        record = next((r for r in rows if r.get(name) is not None), rows[0])
        if not self.declared and _holds_null_type(field.type):
            return SchemaChangeError(
                f"{self.what}: key {name!r} held only None in the records it emitted before "
                f"(Arrow type {field.type}: its type was not known), and now holds {got}: "
                f"{sample(record)}. Declare the output's schema so that the type is known "
                f"from the first record: output_type=pa.schema([({name!r}, <type>), ...])"
            )
        return SchemaChangeError(
            f"{self.what}: key {name!r} is {field.type} in {self._before()}, but a record "
            f"holds {got}: {sample(record)}. A key keeps one type in an operator's output: "
            "convert the value in the function, or declare the wider type with output_type"
        )

    def _too_many_values(
        self, field: pa.Field, encoding: pa.DataType, column: pa.Array, rows: list[Any]
    ) -> SchemaChangeError:
        name = field.name
        record = next((r for r in rows if r.get(name) is not None), rows[0])
        count = len(column.drop_null().unique())
        return SchemaChangeError(
            f"{self.what}: key {name!r} is {field.type} in {self._before()}, but the records "
            f"of one batch hold {count} distinct values of it, more than {encoding.index_type} "
            f"indices count, e.g. {sample(record)}. Declare a wider index type with "
            f"output_type: pa.dictionary(pa.int32(), {encoding.value_type})"
        )

    def _unconvertible(self, name: str, rows: list[Any], exc: BaseException) -> SchemaChangeError:
        first: dict[type, Any] = {}
        for row in rows:
            value = row.get(name)
            if value is not None and type(value) not in first:
                first[type(value)] = row
                if len(first) == 2:
                    break
        if len(first) == 2:
            (a, row_a), (b, row_b) = first.items()
            return SchemaChangeError(
                f"{self.what}: key {name!r} holds values of different types ({a.__name__} and "
                f"{b.__name__}) among the records of one batch, e.g. {sample(row_a)} and "
                f"{sample(row_b)}; a key keeps one type in an operator's output ({exc})"
            )
        record = next(iter(first.values()), rows[0])
        return SchemaChangeError(
            f"{self.what}: the values of key {name!r} cannot be made an Arrow column "
            f"({type(exc).__name__}: {exc}), e.g. {sample(record)}"
        )


def _holds_null_type(t: pa.DataType) -> bool:
    """True when ``t`` is, or nests, Arrow's null type (a key seen only as None or [])."""
    if pa.types.is_null(t):
        return True
    if pa.types.is_struct(t):
        return any(_holds_null_type(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _holds_null_type(t.value_type)
    if pa.types.is_map(t):
        return _holds_null_type(t.key_type) or _holds_null_type(t.item_type)
    return False


#: Types whose values convert from Python objects strictly enough to skip inference:
#: an int column is not among them (Arrow converts a float into an int64 column by
#: dropping its fraction), nor float32 (it rounds doubles).
_DIRECT = (pa.float64(), pa.bool_(), pa.string(), pa.large_string())


def _packed_kind(t: pa.DataType) -> str | None:
    """The kind letter of the C module's packing for a column of type ``t``: ``"q"`` for
    int64, ``"d"`` for float64, None for any other type (an extension type over either
    included: such a type may not even hash)."""
    if pa.types.is_int64(t):
        return "q"
    if pa.types.is_float64(t):
        return "d"
    return None


def _array(values: list[Any], t: pa.DataType | None, pack: str | None = None) -> pa.Array:
    """``pa.array(values)``, or ``pa.array(values, type=t)`` where ``t`` is given. Where
    the C module is loaded and the output's column is int64 (``pack`` ``"q"``) or float64
    (``"d"``), values that are all ints that fit (all floats) are packed into the column at
    once: the array pyarrow would build (inferring int64 for such ints, or converting to
    the float64 given), without its checks per value. Anything else, with its result or
    error, goes to pyarrow."""
    if pack is not None and values:  # (pyarrow types no values as null)
        module = _speedups.module
        if module is not None:
            packed = module.pack_column(values, pack)
            if packed is not None:
                column_type = pa.int64() if pack == "q" else pa.float64()
                return pa.Array.from_buffers(column_type, len(values), [None, pa.py_buffer(packed)])
    if t is None:
        return pa.array(values)
    return pa.array(values, type=t)


def column_values(array: pa.Array) -> list[Any]:
    """``array.to_pylist()``: an int64 or float64 column without a validity bitmap read by
    the C module where it is loaded (the same values, without pyarrow's conversion per
    value)."""
    module = _speedups.module
    if module is not None and len(array) and not array.null_count:
        kind = _packed_kind(array.type)
        if kind is not None:
            validity, data = array.buffers()
            # no validity bitmap at all: an array whose bitmap and null count disagree
            # (one a faulty producer made) reads as pyarrow reads it
            if validity is None and data is not None:
                return module.unpack_column(data, array.offset, len(array), kind)
    return array.to_pylist()


def _converts_directly(t: pa.DataType) -> bool:
    return t in _DIRECT


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


#: text types, and binary types: values may be cast within one group (not to the view
#: types: Arrow has no take or filter for them, which a shuffle and a filter use)
_TEXT_KINDS = (
    (pa.types.is_string, pa.types.is_large_string),
    (pa.types.is_binary, pa.types.is_large_binary),
)


def _widens(source: pa.DataType, target: pa.DataType) -> bool:
    """True when values of ``source`` may be cast to ``target`` (a safe cast then checks
    each value): from null to anything, between integers, from integers to floats,
    between floats, between decimals, between text types, between binary types, and so
    within lists, maps and structs, whose fields holding values must all be in ``target``
    (Arrow's cast would drop them)."""
    if source == target or pa.types.is_null(source):
        return True
    if pa.types.is_integer(source):
        return pa.types.is_integer(target) or pa.types.is_floating(target)
    if pa.types.is_floating(source):
        return pa.types.is_floating(target)
    if pa.types.is_decimal(source):  # inferred per batch with the digits it needs
        return pa.types.is_decimal(target)
    for kinds in _TEXT_KINDS:
        if any(f(source) for f in kinds):
            return any(f(target) for f in kinds)
    if pa.types.is_struct(source) and pa.types.is_struct(target):
        fields = {target.field(i).name: target.field(i).type for i in range(target.num_fields)}
        for i in range(source.num_fields):
            field = source.field(i)
            if field.name in fields:
                if not _widens(field.type, fields[field.name]):
                    return False
            elif not pa.types.is_null(field.type):
                return False
        return True
    if _is_list(source) and _is_list(target):
        return _widens(source.value_type, target.value_type)
    if pa.types.is_map(source) and pa.types.is_map(target):
        return _widens(source.key_type, target.key_type) and _widens(
            source.item_type, target.item_type
        )
    return False


def rows_to_batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    """The records ``rows`` as one batch: ``pa.RecordBatch.from_pylist(rows)`` when they all
    have the same keys, else with every key of every record as a column (None where a
    record lacks it), where ``from_pylist`` would take the first record's keys only."""
    return OutputRecords("rows_to_batch").build(rows)[0]


def rows_to_batches(rows: list[dict[str, Any]]) -> list[pa.RecordBatch]:
    """``[rows_to_batch(rows)]``, or no batch at all for no rows."""
    return OutputRecords("rows_to_batches").build(rows)
