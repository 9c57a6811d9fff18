"""The sink contract: how a sink's writers receive batches and finish.

A :class:`Sink` is a serializable description shipped to every sink subtask,
where ``create_writer`` makes one :class:`SinkWriter` per subtask. The writer
receives batches in channel order, is told when input ends, and returns a
(small, serializable) result that the driver finds in ``JobResult``.

Each sink declares the :class:`~rayflow.guarantees.DeliveryGuarantee` s it can
really give; asking for more fails when the job is built.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rayflow.guarantees import DeliveryGuarantee

__all__ = ["Sink", "SinkWriter", "SinkContext"]


@dataclass(frozen=True)
class SinkContext:
    """Where a writer runs."""

    job_name: str
    operator_uid: str
    subtask_index: int
    parallelism: int
    attempt: int


class SinkWriter(abc.ABC):
    """Writes the batches of one sink subtask."""

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Write one batch."""

    def finish(self) -> Any:
        """Input has ended: flush everything; the return value reaches ``JobResult``."""
        return None

    def close(self) -> None:  # noqa: B027
        """Release resources; called on success and on failure."""


class Sink(abc.ABC):
    """Where a stream ends."""

    #: The guarantees this sink can really give.
    supported_guarantees: frozenset[DeliveryGuarantee] = frozenset({DeliveryGuarantee.NONE})

    def __init__(self, delivery_guarantee: DeliveryGuarantee | None = None) -> None:
        self.delivery_guarantee = delivery_guarantee or max(
            self.supported_guarantees, key=lambda g: g.rank
        )

    @abc.abstractmethod
    def create_writer(self, context: SinkContext) -> SinkWriter:
        """A writer for one subtask."""

    def merge_results(self, results: list[Any]) -> Any:
        """Combine the ``finish()`` results of every subtask (in subtask order)."""
        return results
