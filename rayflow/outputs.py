"""Side outputs: records an operator emits beside its main stream (PyFlink's
``OutputTag``), e.g. the late records of a window.

An operator returns a :class:`SideOutput` among its output batches; the subtask sends it
only on the out-edges that read that tag (``DataStream.get_side_output(tag)``), and
drops it when nothing reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

__all__ = ["OutputTag", "SideOutput"]


@dataclass(frozen=True)
class OutputTag:
    """Names a side output. ``type_info`` is accepted for PyFlink's shape and unused
    (records are Arrow rows)."""

    tag_id: str
    type_info: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.tag_id, str) or not self.tag_id:
            raise ValueError(f"OutputTag: tag_id must be a non-empty str, got {self.tag_id!r}")


@dataclass(frozen=True, slots=True)
class SideOutput:
    """A batch for the side output ``tag`` (a tag id)."""

    tag: str
    batch: pa.RecordBatch

    @property
    def num_rows(self) -> int:
        return self.batch.num_rows
