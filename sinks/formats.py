"""Record encoders: JSON lines, CSV and Parquet, writing Arrow batches into a
binary stream (a local file, a pyarrow.fs stream, or an S3 part buffer).

``open_encoder(format, stream)`` returns an :class:`Encoder`; ``write`` appends a
batch, ``close`` writes any footer (Parquet) and flushes. The stream is not
closed: its owner decides when the bytes become visible.
"""

from __future__ import annotations

import abc
import io
import json
from typing import Any, BinaryIO

import pyarrow as pa

__all__ = ["Encoder", "open_encoder", "FORMATS", "extension_of"]

FORMATS = ("jsonl", "csv", "parquet")
_EXTENSIONS = {"jsonl": "jsonl", "csv": "csv", "parquet": "parquet"}


def extension_of(fmt: str) -> str:
    check_format(fmt)
    return _EXTENSIONS[fmt]


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


class Encoder(abc.ABC):
    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None: ...

    def close(self) -> None:
        self.stream.flush()


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return str(value)


class JsonLinesEncoder(Encoder):
    def write(self, batch: pa.RecordBatch) -> None:
        lines = [
            json.dumps(r, default=_json_default, separators=(",", ":")) for r in batch.to_pylist()
        ]
        if lines:
            self.stream.write(("\n".join(lines) + "\n").encode("utf-8"))


class CsvEncoder(Encoder):
    def __init__(self, stream: BinaryIO) -> None:
        super().__init__(stream)
        self._header_written = False

    def write(self, batch: pa.RecordBatch) -> None:
        import pyarrow.csv as pcsv

        buffer = io.BytesIO()
        pcsv.write_csv(batch, buffer, pcsv.WriteOptions(include_header=not self._header_written))
        self._header_written = True
        self.stream.write(buffer.getvalue())


class ParquetEncoder(Encoder):
    def __init__(self, stream: BinaryIO) -> None:
        super().__init__(stream)
        self._writer = None

    def write(self, batch: pa.RecordBatch) -> None:
        import pyarrow.parquet as pq

        if self._writer is None:
            self._writer = pq.ParquetWriter(self.stream, batch.schema)
        self._writer.write_batch(batch)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.stream.flush()


def open_encoder(fmt: str, stream: BinaryIO) -> Encoder:
    check_format(fmt)
    if fmt == "jsonl":
        return JsonLinesEncoder(stream)
    if fmt == "csv":
        return CsvEncoder(stream)
    return ParquetEncoder(stream)
