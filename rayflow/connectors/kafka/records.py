"""Kafka records and Arrow: consumed messages into record batches (the source), and
record batches into keys, values, partitions, timestamps and headers (the sink).

Formats of a key or value (:class:`RecordFormat`): ``bytes`` as they are, ``utf-8``
text, or ``json`` (the source parses each value into a struct column, with a given
Arrow type or one inferred per batch; the sink writes a column's values, or whole rows,
as JSON).
"""

from __future__ import annotations

import enum
import io
import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from rayflow.connectors.kafka.client import KafkaConnectorError

__all__ = [
    "RecordFormat",
    "HEADERS_TYPE",
    "KAFKA_RECORDS",
    "source_schema",
    "decode_column",
    "RecordEncoder",
]


class RecordFormat(str, enum.Enum):
    BYTES = "bytes"
    UTF8 = "utf-8"
    JSON = "json"

    @classmethod
    def of(cls, value: RecordFormat | str, what: str) -> RecordFormat:
        try:
            return cls(value.value if isinstance(value, RecordFormat) else str(value).lower())
        except ValueError:
            raise ValueError(
                f"{what}: format must be one of {[f.value for f in cls]}, got {value!r}"
            ) from None


#: A record's headers: (key, value) pairs in order; a value may be null.
HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))

#: What the sink keeps of each record until it is produced.
KAFKA_RECORDS = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("partition", pa.int32()),
        ("timestamp", pa.int64()),
        ("headers", HEADERS_TYPE),
    ]
)


def _format_type(fmt: RecordFormat, json_type: pa.DataType | None) -> pa.DataType | None:
    if fmt is RecordFormat.BYTES:
        return pa.binary()
    if fmt is RecordFormat.UTF8:
        return pa.string()
    return json_type  # None: inferred per batch


def source_schema(
    key_format: RecordFormat,
    value_format: RecordFormat,
    key_type: pa.DataType | None = None,
    value_type: pa.DataType | None = None,
) -> pa.Schema | None:
    """The source's batch schema (None while a JSON type is inferred per batch)."""
    key = _format_type(key_format, key_type)
    value = _format_type(value_format, value_type)
    if key is None or value is None:
        return None
    return pa.schema(
        [
            ("key", key),
            ("value", value),
            ("topic", pa.string()),
            ("partition", pa.int32()),
            ("offset", pa.int64()),
            ("timestamp", pa.timestamp("ms")),
            ("headers", HEADERS_TYPE),
        ]
    )


def decode_column(
    raw: Sequence[bytes | None],
    fmt: RecordFormat,
    json_type: pa.DataType | None,
    where: Callable[[int], str],
) -> pa.Array:
    """``raw`` keys or values as one Arrow column; ``where(i)`` names record ``i`` in
    errors (topic, partition, offset)."""
    binary = pa.array(raw, pa.binary())
    if fmt is RecordFormat.BYTES:
        return binary
    if fmt is RecordFormat.UTF8:
        try:
            return binary.cast(pa.string())
        except pa.ArrowInvalid:
            for i, value in enumerate(raw):
                if value is not None:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise KafkaConnectorError(f"{where(i)}: not UTF-8 text: {exc}") from None
            raise
    return _decode_json(raw, json_type, where)


def _decode_json(
    raw: Sequence[bytes | None], json_type: pa.DataType | None, where: Callable[[int], str]
) -> pa.Array:
    import pyarrow.json as pajson

    present = [i for i, v in enumerate(raw) if v is not None]
    if json_type is not None and not pa.types.is_struct(json_type):
        raise TypeError(f"a JSON value type must be a struct type, got {json_type}")
    if not present:
        return pa.nulls(len(raw), json_type or pa.struct([]))
    # One JSON document per line: a raw newline can only be whitespace between tokens
    # in valid JSON (newlines in strings are escaped), so it becomes a space.
    text = b"\n".join(raw[i].replace(b"\n", b" ").replace(b"\r", b" ") for i in present)
    parse = (
        pajson.ParseOptions(
            explicit_schema=pa.schema(list(json_type)), unexpected_field_behavior="ignore"
        )
        if json_type is not None
        else None
    )
    try:
        table = pajson.read_json(
            io.BytesIO(text),
            read_options=pajson.ReadOptions(block_size=max(len(text) + 1, 1 << 20)),
            parse_options=parse,
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        for i in present:
            try:
                document = json.loads(raw[i])
            except ValueError as bad:
                raise KafkaConnectorError(f"{where(i)}: not JSON: {bad}") from None
            if not isinstance(document, dict):
                raise KafkaConnectorError(
                    f"{where(i)}: a JSON value must be an object, got {type(document).__name__}"
                ) from None
        raise KafkaConnectorError(
            f"JSON values of records {where(present[0])} .. {where(present[-1])} do not "
            f"fit one type ({exc}); give the value type (json_type=pa.struct(...))"
        ) from None
    values = table.combine_chunks().to_struct_array()
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if len(present) == len(raw):
        return values
    positions = [None] * len(raw)
    for n, i in enumerate(present):
        positions[i] = n
    return values.take(pa.array(positions, pa.int64()))


def headers_column(headers: Sequence[Any]) -> pa.Array:
    if not any(headers):
        return pa.nulls(len(headers), HEADERS_TYPE)
    rows = [
        None if not h else [{"key": k, "value": v if v is None else bytes(v)} for k, v in h]
        for h in headers
    ]
    return pa.array(rows, HEADERS_TYPE)


# --- the sink: record batches into Kafka records ------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, default=_json_default, separators=(",", ":")).encode("utf-8")


class RecordEncoder:
    """Turns a sink's input batches into :data:`KAFKA_RECORDS` batches.

    ``value_column``: the column holding each value (None: the whole row, as a JSON
    object); ``value_format``: ``bytes`` (a binary column), ``utf-8`` (a string column)
    or ``json`` (any column's values, or the whole row); None picks bytes for a binary
    column, utf-8 for a string column and JSON otherwise. The same for keys
    (``key_column`` None: no key). ``partition_column`` (ints), ``timestamp_column``
    (a timestamp, or ints in ms) and ``headers_column`` (a list of key/value structs,
    or a map) are optional.
    """

    def __init__(
        self,
        value_column: str | None = None,
        value_format: RecordFormat | str | None = None,
        key_column: str | None = None,
        key_format: RecordFormat | str | None = None,
        partition_column: str | None = None,
        timestamp_column: str | None = None,
        headers_column: str | None = None,
    ) -> None:
        self.value_column = value_column
        self.value_format = None if value_format is None else RecordFormat.of(value_format, "value")
        self.key_column = key_column
        self.key_format = None if key_format is None else RecordFormat.of(key_format, "key")
        self.partition_column = partition_column
        self.timestamp_column = timestamp_column
        self.headers_column = headers_column
        if value_column is None and self.value_format not in (None, RecordFormat.JSON):
            raise ValueError(
                "KafkaSink: without a value column each row is written as JSON; "
                f"value_format {self.value_format.value!r} needs a value column"
            )

    def columns(self) -> list[str]:
        return [
            c
            for c in (
                self.value_column,
                self.key_column,
                self.partition_column,
                self.timestamp_column,
                self.headers_column,
            )
            if c is not None
        ]

    def check_schema(self, schema: pa.Schema, what: str) -> None:
        missing = [c for c in self.columns() if schema.get_field_index(c) < 0]
        if missing:
            raise KafkaConnectorError(
                f"{what}: the input has no column {', '.join(map(repr, missing))} "
                f"(it has {', '.join(schema.names)})"
            )

    def encode(self, batch: pa.RecordBatch, what: str) -> pa.RecordBatch:
        self.check_schema(batch.schema, what)
        n = batch.num_rows
        if self.value_column is None:
            value = pa.array([_dumps(row) for row in batch.to_pylist()], pa.binary())
        else:
            value = _bytes_column(batch.column(self.value_column), self.value_format)
        key = (
            pa.nulls(n, pa.binary())
            if self.key_column is None
            else _bytes_column(batch.column(self.key_column), self.key_format)
        )
        partition = (
            pa.nulls(n, pa.int32())
            if self.partition_column is None
            else batch.column(self.partition_column).cast(pa.int32())
        )
        timestamp = pa.nulls(n, pa.int64())
        if self.timestamp_column is not None:
            column = batch.column(self.timestamp_column)
            if pa.types.is_timestamp(column.type):
                column = column.cast(pa.timestamp("ms")).cast(pa.int64())
            timestamp = column.cast(pa.int64())
        headers = pa.nulls(n, HEADERS_TYPE)
        if self.headers_column is not None:
            column = batch.column(self.headers_column)
            if pa.types.is_map(column.type):
                column = pa.array(
                    [
                        None if h is None else [{"key": k, "value": v} for k, v in h]
                        for h in column.to_pylist()
                    ],
                    HEADERS_TYPE,
                )
            headers = column.cast(HEADERS_TYPE)
        return pa.RecordBatch.from_arrays(
            [key, value, partition, timestamp, headers], schema=KAFKA_RECORDS
        )


def _bytes_column(column: pa.Array, fmt: RecordFormat | None) -> pa.Array:
    kind = column.type
    if fmt is None:
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            fmt = RecordFormat.BYTES
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            fmt = RecordFormat.UTF8
        else:
            fmt = RecordFormat.JSON
    if fmt is RecordFormat.JSON:
        return pa.array([None if v is None else _dumps(v) for v in column.to_pylist()], pa.binary())
    if fmt is RecordFormat.UTF8 and not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind)
    ):
        column = column.cast(pa.string())
    return column.cast(pa.binary())
