"""``DataGeneratorSource``: records made by a function of their index, bounded or not,
optionally rate-limited (after Flink's ``DataGeneratorSource``), for demos and benchmarks.

Record ``i`` is a pure function of ``i``, so the source is replayable: split ``s`` of
``n`` makes the indices ``s, s + n, s + 2n, ...`` (below ``count`` when bounded) and
its position is how many it has made. A checkpoint stores the positions; a restore (at
any parallelism: splits are dealt to subtasks) goes on from them, each index exactly once.
Without a ``count`` the source never ends: the job runs until it is cancelled or stopped
(``JobClient.stop_with_savepoint``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from rayflow.sources import Source, SourceReader, SourceSplit, _check_batch_size, batch_rows

__all__ = ["DataGeneratorSource", "GeneratorSplit"]

#: A generator: the int64 indices of a batch -> its records (a batch, a table, or a dict
#: of column name -> array-like).
Generator = Callable[[np.ndarray], Any]


@dataclasses.dataclass
class GeneratorSplit(SourceSplit):
    """Indices ``first + k * stride`` for ``k = made, made + 1, ...`` (below ``count``)."""

    first: int = 0
    stride: int = 1
    made: int = 0
    count: int | None = None

    def remaining(self) -> int | None:
        if self.count is None:
            return None
        if self.first >= self.count:
            return 0
        return max(0, (self.count - 1 - self.first) // self.stride + 1 - self.made)


def index_values(indices: np.ndarray) -> pa.RecordBatch:
    """The default generator: one int64 column ``value`` holding the index."""
    return pa.RecordBatch.from_arrays([pa.array(indices)], names=["value"])


def _as_batch(made: Any) -> pa.RecordBatch:
    if isinstance(made, pa.RecordBatch):
        return made
    if isinstance(made, pa.Table):
        return made.combine_chunks().to_batches()[0]
    if isinstance(made, Mapping):
        return pa.RecordBatch.from_pydict(dict(made))
    raise TypeError(
        "DataGeneratorSource: the generator must return a pyarrow RecordBatch, a Table or "
        f"a dict of columns, got {type(made).__name__}"
    )


class _GeneratorReader(SourceReader):
    def __init__(self, splits: list[SourceSplit], source: DataGeneratorSource) -> None:
        self._splits = [dataclasses.replace(s) for s in splits]
        self._source = source
        self._next = 0  # round robin over the splits: all advance alike

    def read_batch(self) -> pa.RecordBatch | None:
        live = [s for s in self._splits if s.remaining() != 0]
        if not live:
            return None if self._splits or self._source.count is not None else _empty()
        split = live[self._next % len(live)]
        self._next += 1
        rows = self._source.batch_size
        left = split.remaining()
        if left is not None:
            rows = min(rows, left)
        k = np.arange(split.made, split.made + rows, dtype=np.int64)
        batch = _as_batch(self._source.generator(split.first + k * split.stride))
        if batch.num_rows != rows:
            raise ValueError(
                f"DataGeneratorSource: the generator made {batch.num_rows} records for "
                f"{rows} indices (one record per index)"
            )
        split.made += rows
        return batch

    def snapshot_splits(self) -> list[SourceSplit]:
        return [dataclasses.replace(s) for s in self._splits]


def _empty() -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], pa.int64())], names=["value"])


class DataGeneratorSource(Source):
    """Records ``generator(indices)`` for the indices ``0, 1, 2, ...`` (below ``count``;
    ``count=None``: unbounded), at most ``records_per_second`` per subtask.

    ``generator`` is vectorized: it gets the int64 indices of a batch as a numpy array and
    returns that many records (a RecordBatch, a Table or a dict of columns); it must be
    deterministic (a restore makes the same indices again). The default makes one column
    ``value`` with the index."""

    def __init__(
        self,
        generator: Generator | None = None,
        count: int | None = None,
        *,
        records_per_second: float | None = None,
        batch_size: int | None = None,
        row_bytes: int = 64,
    ) -> None:
        _check_batch_size("DataGeneratorSource", batch_size)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            raise TypeError(f"DataGeneratorSource: count must be an int or None, got {count!r}")
        if count is not None and count < 0:
            raise ValueError(f"DataGeneratorSource: count must be >= 0, got {count}")
        if records_per_second is not None and not records_per_second > 0:
            raise ValueError(
                "DataGeneratorSource: records_per_second must be > 0 or None, got "
                f"{records_per_second!r}"
            )
        self.generator = generator or index_values
        self.count = count
        self.records_per_second = records_per_second
        self.batch_size = batch_rows(row_bytes, batch_size, records_per_second)

    @property
    def bounded(self) -> bool:
        return self.count is not None

    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        n = max(1, parallelism if self.count is None else min(parallelism, max(self.count, 1)))
        return [
            GeneratorSplit(split_id=f"generator-{s}", first=s, stride=n, count=self.count)
            for s in range(n)
        ]

    def create_reader(self, splits: list[SourceSplit]) -> SourceReader:
        return _GeneratorReader(splits, self)
