"""Partitioners: how the batches of one vertex are spread over the subtasks of
the next (forward, rebalance, hash by key group, broadcast).

A :class:`PartitionerSpec` is the plan-time description; ``route`` is the
runtime step that splits a batch into ``(target subtask, sub-batch)`` pairs.
Hash partitioning is vectorized over key columns (numpy/Arrow) and falls back
to a per-record key function only when the key is not a column.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from rayflow.keygroups import key_group_of, key_groups_of_array


class PartitionKind(enum.Enum):
    DEFAULT = "default"  # forward when parallelism matches, else rebalance
    FORWARD = "forward"
    REBALANCE = "rebalance"
    HASH = "hash"
    BROADCAST = "broadcast"


class KeySelector:
    """A record's key: a column name, a tuple of column names, or a function of the record."""

    def __init__(self, key: str | tuple[str, ...] | list[str] | Callable[[dict], Hashable]):
        if isinstance(key, list):
            key = tuple(key)
        if not (isinstance(key, str) or callable(key) or isinstance(key, tuple)):
            raise TypeError(f"key_by: expected a column name or a function, got {key!r}")
        self.key = key

    @property
    def column(self) -> str | None:
        return self.key if isinstance(self.key, str) else None

    @property
    def description(self) -> str:
        if isinstance(self.key, (str, tuple)):
            return repr(self.key)
        return getattr(self.key, "__name__", "<function>")

    def key_of(self, record: dict[str, Any]) -> Hashable:
        key = self.key
        if isinstance(key, str):
            return record[key]
        if isinstance(key, tuple):
            return tuple(record[c] for c in key)
        return key(record)

    def keys_of_batch(self, batch: pa.RecordBatch) -> list[Hashable]:
        key = self.key
        if isinstance(key, str):
            return self._column(batch, key).to_pylist()
        if isinstance(key, tuple):
            columns = [self._column(batch, c).to_pylist() for c in key]
            return list(zip(*columns))
        return [key(record) for record in batch.to_pylist()]

    def key_groups(self, batch: pa.RecordBatch, max_parallelism: int) -> np.ndarray:
        if isinstance(self.key, str):
            return key_groups_of_array(self._column(batch, self.key), max_parallelism)
        keys = self.keys_of_batch(batch)
        return np.fromiter(
            (key_group_of(k, max_parallelism) for k in keys), dtype=np.int64, count=len(keys)
        )

    @staticmethod
    def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
        index = batch.schema.get_field_index(name)
        if index < 0:
            raise KeyError(
                f"key column {name!r} is not in the record (columns: {batch.schema.names})"
            )
        return batch.column(index)


@dataclass
class PartitionerSpec:
    kind: PartitionKind = PartitionKind.DEFAULT
    key: KeySelector | None = None

    def describe(self) -> str:
        if self.kind is PartitionKind.HASH and self.key is not None:
            return f"HASH({self.key.description})"
        return self.kind.name


#: Up to this many targets a hash partitioner finds each target's rows with a pass over
#: the batch's targets; above it, with one stable sort.
_MASKED_TARGETS = 4
#: Targets held as uint16, which numpy's stable sort sorts by radix (O(n)), up to this many.
_SORTED_BY_RADIX = 1 << 16


class Partitioner:
    """Routes batches from one sending subtask to ``num_targets`` receivers."""

    def __init__(
        self, spec: PartitionerSpec, sender_index: int, num_targets: int, max_parallelism: int
    ):
        self.kind = spec.kind
        self.key = spec.key
        self.num_targets = num_targets
        self.max_parallelism = max_parallelism
        self._next = sender_index % max(num_targets, 1)
        #: the target of each key group (Flink's ranges), looked up for a whole column
        self._target_of_group = (
            np.arange(max_parallelism, dtype=np.int64) * num_targets // max_parallelism
        ).astype(np.uint16 if num_targets <= _SORTED_BY_RADIX else np.intp)

    def route(self, batch: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        """Split ``batch`` into ``(target index, batch)`` pairs; targets index the channels."""
        kind = self.kind
        if kind is PartitionKind.FORWARD:
            return [(0, batch)]
        if kind is PartitionKind.BROADCAST:
            return [(t, batch) for t in range(self.num_targets)]
        if kind is PartitionKind.REBALANCE:
            target = self._next
            self._next = (target + 1) % self.num_targets
            return [(target, batch)]
        if self.num_targets == 1:
            return [(0, batch)]
        targets = self._target_of_group[self.key.key_groups(batch, self.max_parallelism)]
        counts = np.bincount(targets, minlength=self.num_targets)
        # One take per target, not one take and slices: a slice serializes (pickle, Ray,
        # checkpoints) with its parent's whole buffers. Each take keeps the rows' order.
        routed = []
        if self.num_targets <= _MASKED_TARGETS:  # a pass over the column per target
            for t in np.flatnonzero(counts).tolist():
                routed.append((t, batch.take(pa.array(np.flatnonzero(targets == t)))))
            return routed
        order = np.argsort(targets, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(counts)))
        for t in np.flatnonzero(counts).tolist():
            routed.append((t, batch.take(pa.array(order[bounds[t] : bounds[t + 1]]))))
        return routed
