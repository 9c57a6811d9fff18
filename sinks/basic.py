"""Simple sinks: print to stdout and collect rows back to the driver.

Both write straight through, with no transaction: they give at-most-once
effect on their own (``DeliveryGuarantee.NONE``).
"""

from __future__ import annotations

import sys
from typing import Any

import pyarrow as pa

from rayflow.guarantees import DeliveryGuarantee
from rayflow.sink import Sink, SinkContext, SinkWriter

__all__ = ["PrintSink", "CollectSink"]


class _PrintWriter(SinkWriter):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def write(self, batch: pa.RecordBatch) -> None:
        out = sys.stdout
        for record in batch.to_pylist():
            out.write(f"{self.prefix}{record}\n")
        out.flush()


class PrintSink(Sink):
    """Prints every record, prefixed with the subtask number when parallel."""

    def create_writer(self, context: SinkContext) -> SinkWriter:
        prefix = f"{context.subtask_index + 1}> " if context.parallelism > 1 else ""
        return _PrintWriter(prefix)


class _CollectWriter(SinkWriter):
    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []

    def write(self, batch: pa.RecordBatch) -> None:
        self.batches.append(batch)

    def finish(self) -> Any:
        return self.batches


class CollectSink(Sink):
    """Brings every row back to the driver as one ``pyarrow.Table`` in the JobResult.

    Rows of one subtask keep their arrival order; subtasks follow in index order.
    """

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _CollectWriter()

    def merge_results(self, results: list[Any]) -> pa.Table:
        batches = [b for subtask in results if subtask for b in subtask]
        if not batches:
            return pa.table({})
        return pa.Table.from_batches(batches).combine_chunks() if _same_schema(batches) else (
            pa.concat_tables([pa.Table.from_batches([b]) for b in batches], promote_options="default")
        )


def _same_schema(batches: list[pa.RecordBatch]) -> bool:
    first = batches[0].schema
    return all(b.schema.equals(first) for b in batches[1:])
