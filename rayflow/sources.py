"""Replayable sources: each knows its position, so a checkpoint can resume it.

A :class:`Source` is cut into :class:`SourceSplit` s once per job (the splits
do not depend on which subtask reads them); splits are spread over the source's
subtasks, and each subtask reads its splits through a :class:`SourceReader`.
A split carries its own read position: ``SourceReader.snapshot_splits()``
returns the splits as they stand now, which is exactly what a checkpoint
stores and what a restored reader (at any parallelism) starts from.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "Source",
    "SourceSplit",
    "SourceReader",
    "NumberSequenceSource",
    "CollectionSource",
    "FileSource",
]

DEFAULT_BATCH_SIZE = 8192


@dataclasses.dataclass
class SourceSplit:
    """A piece of a source that one subtask reads start to end, with its position."""

    split_id: str


class SourceReader(abc.ABC):
    """Reads the splits assigned to one subtask."""

    @abc.abstractmethod
    def read_batch(self) -> pa.RecordBatch | None:
        """The next batch, or ``None`` once every assigned split is exhausted."""

    @abc.abstractmethod
    def snapshot_splits(self) -> list[SourceSplit]:
        """The assigned splits with their current positions (copies)."""

    def close(self) -> None:  # noqa: B027
        """Release files or connections."""


class Source(abc.ABC):
    """A bounded or unbounded, replayable input."""

    #: Upper bound on the rate a subtask emits, in records per second (None: as fast as possible).
    records_per_second: float | None = None

    @abc.abstractmethod
    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        """Cut the input into splits; called once when a job first starts."""

    @abc.abstractmethod
    def create_reader(self, splits: list[SourceSplit]) -> SourceReader:
        """A reader over ``splits`` (fresh ones, or positions restored from a checkpoint)."""


class _SequentialReader(SourceReader):
    """Reads splits one after the other through ``_read_from(split)``."""

    def __init__(self, splits: list[SourceSplit]) -> None:
        self._splits = [dataclasses.replace(s) for s in splits]
        self._current = 0

    def read_batch(self) -> pa.RecordBatch | None:
        while self._current < len(self._splits):
            batch = self._read_from(self._splits[self._current])
            if batch is not None:
                return batch
            self._current += 1
        return None

    @abc.abstractmethod
    def _read_from(self, split: SourceSplit) -> pa.RecordBatch | None:
        """Read the next batch of ``split`` and advance its position; None when done."""

    def snapshot_splits(self) -> list[SourceSplit]:
        return [dataclasses.replace(s) for s in self._splits]


# --- number sequence ------------------------------------------------------------------


@dataclasses.dataclass
class NumberSplit(SourceSplit):
    next_value: int = 0
    end: int = 0  # inclusive


class _NumberReader(_SequentialReader):
    def __init__(self, splits: list[SourceSplit], batch_size: int) -> None:
        super().__init__(splits)
        self._batch_size = batch_size

    def _read_from(self, split: NumberSplit) -> pa.RecordBatch | None:
        if split.next_value > split.end:
            return None
        stop = min(split.end + 1, split.next_value + self._batch_size)
        values = pa.array(np.arange(split.next_value, stop, dtype=np.int64))
        split.next_value = stop
        return pa.RecordBatch.from_arrays([values], names=["value"])


class NumberSequenceSource(Source):
    """The integers ``start..end`` (both inclusive, as in Flink) in column ``value``."""

    def __init__(
        self,
        start: int,
        end: int,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        records_per_second: float | None = None,
    ) -> None:
        if end < start:
            raise ValueError(f"NumberSequenceSource: end ({end}) is before start ({start})")
        if batch_size <= 0:
            raise ValueError(f"NumberSequenceSource: batch_size must be positive, got {batch_size}")
        self.start = start
        self.end = end
        self.batch_size = batch_size
        self.records_per_second = records_per_second

    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        total = self.end - self.start + 1
        count = max(1, min(parallelism, total))
        splits: list[SourceSplit] = []
        for i in range(count):
            lo = self.start + total * i // count
            hi = self.start + total * (i + 1) // count - 1
            splits.append(NumberSplit(split_id=f"numbers-{i}", next_value=lo, end=hi))
        return splits

    def create_reader(self, splits: list[SourceSplit]) -> SourceReader:
        return _NumberReader(splits, self.batch_size)


# --- collection -----------------------------------------------------------------------


@dataclasses.dataclass
class CollectionSplit(SourceSplit):
    offset: int = 0
    end: int = 0  # exclusive


class _TableReader(_SequentialReader):
    def __init__(self, splits: list[SourceSplit], table: pa.Table, batch_size: int) -> None:
        super().__init__(splits)
        self._table = table
        self._batch_size = batch_size

    def _read_from(self, split: CollectionSplit) -> pa.RecordBatch | None:
        if split.offset >= split.end:
            return None
        length = min(self._batch_size, split.end - split.offset)
        chunk = self._table.slice(split.offset, length).combine_chunks()
        split.offset += length
        return chunk.to_batches()[0] if chunk.num_rows else None


class CollectionSource(Source):
    """Records from an in-memory list of dicts or an Arrow table."""

    def __init__(
        self,
        records: Sequence[dict[str, Any]] | pa.Table | pa.RecordBatch,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        schema: pa.Schema | None = None,
    ) -> None:
        if isinstance(records, pa.RecordBatch):
            table = pa.Table.from_batches([records])
        elif isinstance(records, pa.Table):
            table = records
        else:
            records = list(records)
            if not records and schema is None:
                raise ValueError("CollectionSource: an empty collection needs a schema")
            table = pa.Table.from_pylist(records, schema=schema)
        self.table = table
        self.batch_size = batch_size

    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        total = self.table.num_rows
        count = max(1, min(parallelism, total))
        return [
            CollectionSplit(
                split_id=f"collection-{i}", offset=total * i // count, end=total * (i + 1) // count
            )
            for i in range(count)
        ]

    def create_reader(self, splits: list[SourceSplit]) -> SourceReader:
        return _TableReader(splits, self.table, self.batch_size)


# --- files ----------------------------------------------------------------------------

_FORMATS = ("jsonl", "csv", "parquet")


@dataclasses.dataclass
class FileSplit(SourceSplit):
    path: str = ""
    rows_read: int = 0
    done: bool = False


def _read_table(fs: Any, path: str, fmt: str) -> pa.Table:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, filesystem=fs)
    with fs.open_input_stream(path) as stream:
        if fmt == "csv":
            import pyarrow.csv as pcsv

            return pcsv.read_csv(stream)
        import pyarrow.json as pjson

        return pjson.read_json(stream)


class _FileReader(_SequentialReader):
    def __init__(self, splits: list[SourceSplit], source: FileSource) -> None:
        super().__init__(splits)
        self._source = source
        self._open: tuple[str, pa.Table] | None = None

    def _read_from(self, split: FileSplit) -> pa.RecordBatch | None:
        if split.done:
            return None
        if self._open is None or self._open[0] != split.path:
            fs = self._source.filesystem()
            try:
                table = _read_table(fs, split.path, self._source.format)
            except Exception as exc:
                raise ValueError(
                    f"FileSource: cannot read {split.path!r} as {self._source.format}: {exc}"
                ) from exc
            self._open = (split.path, table)
        table = self._open[1]
        if split.rows_read >= table.num_rows:
            split.done = True
            self._open = None
            return None
        chunk = table.slice(split.rows_read, self._source.batch_size).combine_chunks()
        split.rows_read += chunk.num_rows
        return chunk.to_batches()[0]


class FileSource(Source):
    """Files of one format (JSON lines, CSV or Parquet) under a path, one split per file.

    ``path`` is a local path or any URI ``pyarrow.fs`` understands (``s3://...``);
    a directory is listed recursively, hidden files (``.`` or ``_`` prefix) skipped.
    """

    def __init__(
        self,
        path: str,
        format: str,
        *,
        filesystem: Any = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        if format not in _FORMATS:
            raise ValueError(f"FileSource: format must be one of {_FORMATS}, got {format!r}")
        self.path = path
        self.format = format
        self.batch_size = batch_size
        self._filesystem = filesystem

    def filesystem(self) -> Any:
        return self._resolve()[0]

    def _resolve(self) -> tuple[Any, str]:
        import pyarrow.fs as pafs

        if self._filesystem is not None:
            return self._filesystem, self.path
        return (
            pafs.FileSystem.from_uri(self.path)
            if "://" in self.path
            else (
                pafs.LocalFileSystem(),
                self.path,
            )
        )

    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        import pyarrow.fs as pafs

        fs, root = self._resolve()
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"FileSource: no such file or directory: {self.path!r}")
        if info.type == pafs.FileType.File:
            paths = [root]
        else:
            selector = pafs.FileSelector(root, recursive=True)
            paths = sorted(
                f.path
                for f in fs.get_file_info(selector)
                if f.type == pafs.FileType.File and not f.base_name.startswith((".", "_"))
            )
        return [FileSplit(split_id=f"file-{i}", path=p) for i, p in enumerate(paths)]

    def create_reader(self, splits: list[SourceSplit]) -> SourceReader:
        return _FileReader(splits, self)
