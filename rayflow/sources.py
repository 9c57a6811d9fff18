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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from rayflow.recoverability import MissingInputError

__all__ = [
    "Source",
    "SourceSplit",
    "SourceReader",
    "NumberSequenceSource",
    "CollectionSource",
    "FileSource",
]

#: Sources read batches of about this many bytes unless given a ``batch_size`` in rows.
DEFAULT_BATCH_BYTES = 1 << 20
#: A rate-limited source reads at most this many seconds' worth of records per batch.
_RATE_LIMITED_BATCH_S = 0.01


def batch_rows(
    row_bytes: float,
    batch_size: int | None,
    records_per_second: float | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> int:
    """Rows per batch: ``batch_size`` when given, else as many rows of ``row_bytes`` as
    fill ``batch_bytes`` (at most 10 ms worth of a rate-limited source), at least 1."""
    if batch_size is not None:
        return batch_size
    rows = int(batch_bytes // max(row_bytes, 1.0))
    if records_per_second:
        rows = min(rows, int(records_per_second * _RATE_LIMITED_BATCH_S))
    return max(1, rows)


def _copy_rows(table: pa.Table, offset: int, length: int) -> pa.RecordBatch:
    """Rows ``offset..offset+length`` of ``table`` as a batch of their own: copied, not a
    slice (a slice serializes with its parent's whole buffers, so a batch would carry
    the whole table through channels, channel state and sinks)."""
    length = max(0, min(length, table.num_rows - offset))
    indices = pa.array(np.arange(offset, offset + length, dtype=np.int64))
    taken = table.take(indices).combine_chunks()
    batches = taken.to_batches()
    if batches:
        return batches[0]
    return pa.RecordBatch.from_pylist([], schema=table.schema)


def _check_batch_size(source: str, batch_size: int | None) -> None:
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0
    ):
        raise ValueError(
            f"{source}: batch_size must be a positive int (rows) or None (sized by bytes), "
            f"got {batch_size!r}"
        )


@dataclasses.dataclass
class SourceSplit:
    """A piece of a source that one subtask reads start to end, with its position."""

    split_id: str
    #: the split's watermark generator state (its largest event timestamp so far), set
    #: in the splits a checkpoint stores; None without event time
    event_time_state: Any = dataclasses.field(default=None, kw_only=True, compare=False)


class SourceReader(abc.ABC):
    """Reads the splits assigned to one subtask."""

    @abc.abstractmethod
    def read_batch(self) -> pa.RecordBatch | None:
        """The next batch, or ``None`` once every assigned split is exhausted. An empty
        batch (no rows) means nothing to read now (an unbounded source waiting for
        input): the subtask serves checkpoints and timers for a moment, then asks again."""

    @abc.abstractmethod
    def snapshot_splits(self) -> list[SourceSplit]:
        """The assigned splits with their current positions (copies)."""

    def snapshot_state(self, checkpoint_id: int) -> list[SourceSplit]:
        """What checkpoint ``checkpoint_id`` stores: :meth:`snapshot_splits` unless a
        reader also wants to know which checkpoint took them."""
        return self.snapshot_splits()

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:  # noqa: B027
        """Checkpoint ``checkpoint_id`` (and every one before it) completed. Best effort:
        may come late, or not at all. Only a reader whose class overrides this method
        is told (the job master leaves the others out)."""

    def last_split_id(self) -> str | None:
        """The split the last batch came from, for watermarks per split; None when the
        reader does not say (its splits then share one watermark generator)."""
        return None

    def finished_split_ids(self) -> list[str]:
        """The splits read to their end (they no longer hold the watermark back)."""
        return []

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

    def last_split_id(self) -> str | None:
        if self._current < len(self._splits):
            return self._splits[self._current].split_id
        return None

    def finished_split_ids(self) -> list[str]:
        return [s.split_id for s in self._splits[: self._current]]

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
        batch_size: int | None = None,
        records_per_second: float | None = None,
    ) -> None:
        if end < start:
            raise ValueError(f"NumberSequenceSource: end ({end}) is before start ({start})")
        _check_batch_size("NumberSequenceSource", batch_size)
        self.start = start
        self.end = end
        #: rows per batch: as given, else about ``DEFAULT_BATCH_BYTES`` of int64 values
        self.batch_size = batch_rows(8, batch_size, records_per_second)
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
        chunk = _copy_rows(self._table, split.offset, length)
        split.offset += length
        return chunk if chunk.num_rows else None


class CollectionSource(Source):
    """Records from an in-memory collection or an Arrow table.

    The elements are records (dicts of column -> value; a key some records lack is None
    in the others), tuples (columns ``f0, f1, ...``, PyFlink's names; a named tuple's
    fields keep their names) or scalars (one column ``value``), all of one kind."""

    def __init__(
        self,
        records: Sequence[dict[str, Any]] | Sequence[Any] | pa.Table | pa.RecordBatch,
        *,
        batch_size: int | None = None,
        schema: pa.Schema | None = None,
    ) -> None:
        _check_batch_size("CollectionSource", batch_size)
        if isinstance(records, pa.RecordBatch):
            table = pa.Table.from_batches([records])
        elif isinstance(records, pa.Table):
            table = records
        else:
            table = _collection_table(records, schema)
        self.table = table
        row_bytes = table.nbytes / table.num_rows if table.num_rows else 1.0
        #: rows per batch: as given, else about ``DEFAULT_BATCH_BYTES`` of the table's rows
        self.batch_size = batch_rows(row_bytes, batch_size)

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


_KINDS = "Give all elements as dicts, tuples (columns f0, f1, ...) or scalars (one column 'value')."


def _element_kind(element: Any) -> str:
    if isinstance(element, Mapping):
        return "dict"
    if isinstance(element, tuple):
        return "tuple"
    if isinstance(element, (list, set, frozenset, bytearray)):
        return type(element).__name__
    return "scalar"


def _describe(element: Any) -> str:
    from rayflow.runtime.records import sample

    return f"{'None' if element is None else type(element).__name__} ({sample(element)})"


def _collection_table(records: Any, schema: pa.Schema | None) -> pa.Table:
    """The table of a collection's elements; a TypeError says which element is wrong."""
    from rayflow.runtime.records import OutputRecords

    if isinstance(records, (Mapping, str, bytes)):
        hint = "; for a dict of columns use pa.table(...)" if isinstance(records, Mapping) else ""
        raise TypeError(
            f"from_collection: expected a list of records, got a {type(records).__name__}{hint}"
        )
    try:
        elements = list(records)
    except TypeError:
        raise TypeError(
            "from_collection: expected a list (or another iterable) of records (dicts), got "
            f"{type(records).__name__}"
        ) from None
    if not elements:
        if schema is None:
            raise ValueError("CollectionSource: an empty collection needs a schema")
        return schema.empty_table()
    kind = _element_kind(elements[0])
    if kind not in ("dict", "tuple", "scalar"):
        raise TypeError(
            f"from_collection: records are dicts (column -> value); element 0 is a {kind}. "
            + _KINDS
        )
    width = len(elements[0]) if kind == "tuple" else 0
    for position, element in enumerate(elements):
        if _element_kind(element) != kind:
            raise TypeError(
                f"from_collection: records are dicts (column -> value); element {position} is "
                f"{_describe(element)} where element 0 is a {kind}. " + _KINDS
            )
        if kind == "tuple" and len(element) != width:
            raise TypeError(
                f"from_collection: element {position} is a tuple of {len(element)} fields where "
                f"element 0 has {width}; records are dicts (column -> value) or tuples of one "
                "length"
            )
        if kind == "dict":
            for key in element:
                if not isinstance(key, str):
                    raise TypeError(
                        f"from_collection: element {position} has key {key!r} "
                        f"({type(key).__name__}); records are dicts whose keys (column names) "
                        "are str"
                    )
    if kind == "scalar":
        rows = [{"value": element} for element in elements]
    elif kind == "tuple":
        fields = getattr(elements[0], "_fields", None) or [f"f{i}" for i in range(width)]
        rows = [dict(zip(fields, element)) for element in elements]
    else:
        rows = elements
    if schema is not None:
        extra = {key for row in rows for key in row} - set(schema.names)
        if extra:
            raise ValueError(
                f"from_collection: the records have keys the schema does not: {sorted(extra)}"
            )
        return pa.Table.from_pylist(rows, schema=schema)
    return pa.Table.from_batches(OutputRecords("from_collection").build(rows))


# --- files ----------------------------------------------------------------------------

_FORMATS = ("jsonl", "csv", "parquet")


@dataclasses.dataclass
class FileSplit(SourceSplit):
    path: str = ""
    rows_read: int = 0
    done: bool = False


def _open_table(source: Any, path: str, known: str) -> pa.Table:
    """``path`` of a ``FileSource`` read whole; a file gone since it was found (``known``
    says when) or one that does not parse as the source's format is a clear error."""
    try:
        return _read_table(source.filesystem(), path, source.format)
    except FileNotFoundError as exc:
        raise MissingInputError(f"FileSource: {path!r} is gone ({known})") from exc
    except Exception as exc:
        raise ValueError(f"FileSource: cannot read {path!r} as {source.format}: {exc}") from exc


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
            table = _open_table(self._source, split.path, "it was there when the job started")
            self._open = (split.path, table)
        table = self._open[1]
        if split.rows_read >= table.num_rows:
            split.done = True
            self._open = None
            return None
        if self._source.batch_size is None:
            row_bytes = table.nbytes / table.num_rows
            rows = batch_rows(row_bytes, None)
        else:
            rows = self._source.batch_size
        chunk = _copy_rows(table, split.rows_read, rows)
        split.rows_read += chunk.num_rows
        return chunk


class FileSource(Source):
    """Files of one format (JSON lines, CSV or Parquet) under a path, one split per file.

    ``path`` is a local path or any URI ``pyarrow.fs`` understands (``s3://...``);
    a directory is listed recursively, hidden files (``.`` or ``_`` prefix) skipped.
    Bounded: the files there when the job starts. ``monitor_continuously(interval)``
    makes it unbounded: it also reads every file that appears later (see
    :mod:`rayflow.file_monitor`).
    """

    def __init__(
        self,
        path: str,
        format: str,
        *,
        filesystem: Any = None,
        batch_size: int | None = None,
    ) -> None:
        _check_batch_size("FileSource", batch_size)
        if format not in _FORMATS:
            raise ValueError(f"FileSource: format must be one of {_FORMATS}, got {format!r}")
        self.path = path
        self.format = format
        self.batch_size = batch_size
        self._filesystem = filesystem
        #: seconds between two listings of the path; None: bounded (listed once)
        self.monitor_interval_s: float | None = None

    def monitor_continuously(self, interval: float | Any) -> FileSource:
        """Keep watching ``path`` for new files, listing it every ``interval`` (seconds, or
        a ``datetime.timedelta``): the source never ends (Flink's name). Which files were
        read, and how far into the current one, is checkpointed: each file is read
        exactly once across restarts."""
        seconds = interval.total_seconds() if hasattr(interval, "total_seconds") else interval
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(
                f"FileSource.monitor_continuously: interval must be > 0 seconds, got {interval!r}"
            )
        self.monitor_interval_s = float(seconds)
        return self

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

    def list_paths(self, missing_ok: bool = False) -> list[str]:
        """The files under ``path`` now, sorted (hidden ones skipped)."""
        return [path for path, _ in self.list_files(missing_ok)]

    def list_files(self, missing_ok: bool = False) -> list[tuple[str, tuple[int, int]]]:
        """The files under ``path`` now with their (size, modification time in ns),
        sorted by path (hidden ones skipped)."""
        import pyarrow.fs as pafs

        fs, root = self._resolve()
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            if missing_ok:
                return []
            raise MissingInputError(f"FileSource: no such file or directory: {self.path!r}")

        def stamp(f: Any) -> tuple[int, int]:
            return (f.size if f.size is not None else -1, f.mtime_ns or 0)

        if info.type == pafs.FileType.File:
            return [(root, stamp(info))]
        selector = pafs.FileSelector(root, recursive=True, allow_not_found=missing_ok)
        return sorted(
            (f.path, stamp(f))
            for f in fs.get_file_info(selector)
            if f.type == pafs.FileType.File
            and not any(part.startswith((".", "_")) for part in f.path[len(root) :].split("/"))
        )

    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        if self.monitor_interval_s is not None:
            from rayflow.file_monitor import watch_splits

            return watch_splits(parallelism)
        paths = self.list_paths()
        return [FileSplit(split_id=f"file-{i}", path=p) for i, p in enumerate(paths)]

    def create_reader(self, splits: list[SourceSplit]) -> SourceReader:
        if self.monitor_interval_s is not None:
            from rayflow.file_monitor import MonitoringFileReader

            return MonitoringFileReader(splits, self, self.monitor_interval_s)
        return _FileReader(splits, self)
