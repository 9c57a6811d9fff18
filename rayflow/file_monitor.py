"""Continuous file monitoring for ``FileSource.monitor_continuously(interval)``: an
unbounded source that reads the files under a directory or prefix (local or any
``pyarrow.fs`` store, ``s3://`` included) and then every file that appears there later.

Files are shared among the source's *watch splits* by a stable hash of their path: split
``b`` of ``n`` reads the files whose hash is ``b`` mod ``n`` (``n`` is fixed when the job
first starts, so a file belongs to one split forever, whatever the parallelism after a
restore). Each split lists the directory every ``interval`` and reads the new files it
owns in path order. Its checkpointed state is the set of files it has read to the end and
the file it is reading with the rows read so far: a file is read exactly once across
failures and restarts, and a file read in part resumes at its row.

Files should appear whole: written elsewhere (or under a hidden ``.``/``_`` name) and
then moved or renamed in, as Flink expects too; an object store's PUT is whole already.
A file written in place is read once it has settled: only a file whose size and
modification time are the same in two listings in a row is read (a file still being
written when it is listed would otherwise be read in part, its rest never). A writer
that pauses longer than the interval still needs the rename. A file is known by its
path: one changed after it was read is not read again. The set of read paths grows with
the files seen (as in Flink's enumerator state).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import TYPE_CHECKING

import pyarrow as pa

from rayflow.sources import SourceReader, SourceSplit, _copy_rows, _open_table, batch_rows

if TYPE_CHECKING:
    from rayflow.sources import FileSource

__all__ = ["WatchSplit", "MonitoringFileReader", "watch_splits", "owner_of"]


def owner_of(path: str, buckets: int) -> int:
    """The watch split (of ``buckets``) that reads ``path``: the same in every process."""
    return zlib.crc32(path.encode("utf-8")) % buckets


@dataclasses.dataclass
class WatchSplit(SourceSplit):
    """The files of one hash bucket of a monitored directory, with the reading position."""

    bucket: int = 0
    buckets: int = 1
    #: files read to the end
    done: frozenset[str] = frozenset()
    #: the file being read (None: none) and its rows read so far
    path: str | None = None
    rows_read: int = 0


def watch_splits(parallelism: int) -> list[WatchSplit]:
    n = max(1, parallelism)
    return [WatchSplit(split_id=f"watch-{b}", bucket=b, buckets=n) for b in range(n)]


class MonitoringFileReader(SourceReader):
    """Reads the watch splits of one subtask: never ends (an empty batch while idle)."""

    def __init__(self, splits: list[SourceSplit], source: FileSource, interval_s: float) -> None:
        self._splits: list[WatchSplit] = [dataclasses.replace(s) for s in splits]  # type: ignore[misc]
        self._source = source
        self._interval_s = interval_s
        self._next_listing = 0.0
        self._queue: dict[str, list[str]] = {s.split_id: [] for s in self._splits}
        self._open: tuple[str, pa.Table] | None = None
        #: path -> (size, mtime) at the last listing: a file is read once it settled
        self._listed: dict[str, tuple[int, int]] = {}

    def read_batch(self) -> pa.RecordBatch | None:
        for split in self._splits:
            queue = self._queue[split.split_id]
            while split.path is not None or queue:
                if split.path is None:
                    split.path, split.rows_read = queue.pop(0), 0
                batch = self._read_from(split)
                if batch is not None:
                    return batch
        if time.monotonic() >= self._next_listing:
            self._next_listing = time.monotonic() + self._interval_s
            if self._discover():
                return self.read_batch()
        return pa.RecordBatch.from_pylist([])  # idle: nothing new yet

    def _discover(self) -> bool:
        """List the directory; queue each split's new files. True when any was found."""
        if not self._splits:
            return False
        found = False
        listed = dict(self._source.list_files(missing_ok=True))
        paths = [p for p, stamp in listed.items() if self._listed.get(p) == stamp]
        self._listed = listed  # the files there now: as many as the directory holds
        for split in self._splits:
            queued = set(self._queue[split.split_id])
            new = [
                p
                for p in paths
                if owner_of(p, split.buckets) == split.bucket
                and p not in split.done
                and p != split.path
                and p not in queued
            ]
            self._queue[split.split_id].extend(new)
            found = found or bool(new)
        return found

    def _read_from(self, split: WatchSplit) -> pa.RecordBatch | None:
        """The next batch of ``split``'s current file; None (and the file done) at its end."""
        assert split.path is not None
        if self._open is None or self._open[0] != split.path:
            table = _open_table(self._source, split.path, "it was found while monitoring")
            self._open = (split.path, table)
        table = self._open[1]
        if split.rows_read >= table.num_rows:
            split.done = split.done | {split.path}
            split.path, split.rows_read = None, 0
            self._open = None
            return None
        rows = self._source.batch_size or batch_rows(table.nbytes / table.num_rows, None)
        chunk = _copy_rows(table, split.rows_read, rows)
        split.rows_read += chunk.num_rows
        if split.rows_read >= table.num_rows:  # read to the end: done from this batch on
            split.done = split.done | {split.path}
            split.path, split.rows_read = None, 0
            self._open = None
        return chunk

    def snapshot_splits(self) -> list[SourceSplit]:
        return [dataclasses.replace(s) for s in self._splits]
