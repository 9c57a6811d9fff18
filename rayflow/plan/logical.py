"""The logical plan: one :class:`Transformation` per DataStream call.

Each transformation names its inputs together with the partitioner on that
input edge; unions are kept as nodes here and dissolved when the physical plan
is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayflow.plan.partitioners import PartitionerSpec
from rayflow.plan.resources import ResourceSpec

#: The largest max parallelism (Flink's limit: key groups are numbered in 15 bits).
UPPER_MAX_PARALLELISM = 1 << 15


def check_parallelism(owner: str, value: Any, what: str = "parallelism") -> int:
    """``value`` if it is a valid ``what`` (``parallelism`` or ``max parallelism``): an
    int in 1.. (and at most :data:`UPPER_MAX_PARALLELISM` for max parallelism); else a
    TypeError or ValueError that starts with ``owner`` and shows the value."""
    upper = UPPER_MAX_PARALLELISM if what == "max parallelism" else None
    bounds = f"in 1..{upper}" if upper else ">= 1"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}: {what} must be an int {bounds}, got {value!r} ({type(value).__name__})"
        )
    if value < 1 or (upper is not None and value > upper):
        raise ValueError(f"{owner}: {what} must be an int {bounds}, got {value!r}")
    return value


@dataclass
class InputEdge:
    upstream: int
    partitioner: PartitionerSpec
    #: the upstream's side output (an ``OutputTag`` id) this edge reads; None: its main
    #: output
    side_output: str | None = None


@dataclass
class Transformation:
    """One node of the logical plan.

    ``kind`` is ``source``, ``operator``, ``union`` or ``sink``. ``operator_factory``
    builds the runtime operator inside the subtask (for operators and sinks).
    """

    id: int
    name: str
    kind: str
    inputs: list[InputEdge] = field(default_factory=list)
    parallelism: int | None = None
    max_parallelism: int | None = None
    uid: str | None = None
    source: Any = None
    #: a source's ``WatermarkStrategy`` (``rayflow.eventtime``), None: no event time
    watermark_strategy: Any = None
    sink: Any = None
    operator_factory: Callable[[], Any] | None = None
    chainable: bool = True
    #: begins a chain: never chained into its input's vertex, though what follows it may
    #: chain into its own (``start_new_chain``)
    starts_chain: bool = False
    #: what the operator asks of the cluster (``set_resources``); None: nothing
    resources: ResourceSpec | None = None
    #: subtasks of one group and index share a placement bundle (one node); None:
    #: inherited from the inputs when they all have the same group
    slot_sharing_group: str | None = None

    @property
    def display_name(self) -> str:
        return self.name


class LogicalPlan:
    """The growing graph of transformations of one environment."""

    def __init__(self) -> None:
        self.transformations: dict[int, Transformation] = {}
        self._next_id = 0

    def add(self, **kwargs: Any) -> Transformation:
        transformation = Transformation(id=self._next_id, **kwargs)
        self._next_id += 1
        self.transformations[transformation.id] = transformation
        return transformation

    def open_ends(self) -> list[Transformation]:
        """The transformations (not sinks, not unions) that nothing consumes: streams that
        end without a sink."""
        consumed = {edge.upstream for t in self.transformations.values() for edge in t.inputs}
        return [
            t
            for t in self.transformations.values()
            if t.id not in consumed and t.kind not in ("sink", "union")
        ]

    def remove(self, transformation_id: int) -> None:
        """Drop a transformation nothing consumes (a sink added for one run)."""
        if self.consumers(transformation_id):
            raise ValueError(f"transformation {transformation_id} has consumers")
        del self.transformations[transformation_id]

    def consumers(self, transformation_id: int) -> list[Transformation]:
        return [
            t
            for t in self.transformations.values()
            if any(edge.upstream == transformation_id for edge in t.inputs)
        ]
