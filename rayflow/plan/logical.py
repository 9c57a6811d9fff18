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


@dataclass
class InputEdge:
    upstream: int
    partitioner: PartitionerSpec


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
    sink: Any = None
    operator_factory: Callable[[], Any] | None = None
    chainable: bool = True
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

    def consumers(self, transformation_id: int) -> list[Transformation]:
        return [
            t
            for t in self.transformations.values()
            if any(edge.upstream == transformation_id for edge in t.inputs)
        ]
