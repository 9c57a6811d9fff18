"""The physical plan: chains of operators (vertices) joined by partitioned edges.

Translation from the logical plan:

* unions are dissolved: their consumers read every union input directly;
* a DEFAULT edge becomes FORWARD when both ends have the same parallelism and
  REBALANCE otherwise; an explicit FORWARD between different parallelisms is an
  error;
* a transformation is chained into its input's vertex when it has exactly one
  input, that edge is FORWARD and carries the input's main output, both have the same
  parallelism, nothing was chained after the input yet, both are in the same slot
  sharing group, chaining is enabled for both and the transformation does not start a
  chain of its own. An input with several consumers (a stream written to a sink and
  also keyed, say) so keeps its first chainable one in its chain, and the others get
  edges of their own (Flink would chain every chainable one into a tree; a vertex here
  is one line of operators): an edge leaves the vertex at the operator whose output it
  carries (:attr:`EdgeSpec.source_position`), not only at the chain's end;
* a transformation without a slot sharing group takes its inputs' group when they
  all have the same one (as in Flink); a vertex's resource request is the sum of
  its operators' (``set_resources``).

Each subtask of a vertex numbers its input channels (see :meth:`JobGraph.input_channels`);
the sender of a message names the channel index at the receiver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayflow.plan.logical import InputEdge, LogicalPlan, Transformation
from rayflow.plan.partitioners import PartitionerSpec, PartitionKind
from rayflow.plan.resources import ResourceSpec


class PlanError(ValueError):
    """The job graph cannot be built as written."""


@dataclass
class OperatorSpec:
    name: str
    uid: str
    factory: Callable[[], Any]
    #: the user's sink (a builder), for the operator that ends a stream
    sink: Any = None
    #: what that sink gives in this job (``rayflow.guarantees.GuaranteeResolution``); set
    #: when the environment builds the job graph
    guarantee: Any = None


@dataclass
class EdgeSpec:
    edge_id: int
    source_vertex: int
    target_vertex: int
    partitioner: PartitionerSpec
    #: the side output (tag id) of the sending vertex this edge carries; None: its main
    side_output: str | None = None
    #: the operator of the sending vertex whose output this edge carries: its index in
    #: the vertex's ``operators``, -1 for the vertex's source; None: the chain's last
    source_position: int | None = None


@dataclass
class VertexSpec:
    vertex_id: int
    name: str
    parallelism: int
    max_parallelism: int
    operators: list[OperatorSpec] = field(default_factory=list)
    source: Any = None
    source_uid: str | None = None
    #: the source's ``WatermarkStrategy``, None: it generates no watermarks
    watermark_strategy: Any = None
    sinks: list[Any] = field(default_factory=list)
    in_edges: list[int] = field(default_factory=list)
    out_edges: list[int] = field(default_factory=list)
    #: what each subtask asks of the cluster: its chained operators' requests added up
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    #: subtask i of every vertex of one group shares placement bundle i (one node)
    slot_sharing_group: str | None = None

    @property
    def is_source(self) -> bool:
        return self.source is not None


@dataclass
class JobGraph:
    vertices: dict[int, VertexSpec]
    edges: dict[int, EdgeSpec]

    def topological_order(self) -> list[int]:
        return sorted(self.vertices)

    def input_channels(self, vertex_id: int, subtask: int) -> list[tuple[int, int]]:
        """The ``(edge id, sending subtask)`` of each input channel of a subtask, by index."""
        channels: list[tuple[int, int]] = []
        for edge_id in self.vertices[vertex_id].in_edges:
            edge = self.edges[edge_id]
            if edge.partitioner.kind is PartitionKind.FORWARD:
                channels.append((edge_id, subtask))
            else:
                parallelism = self.vertices[edge.source_vertex].parallelism
                channels.extend((edge_id, j) for j in range(parallelism))
        return channels

    def channel_index(self, edge_id: int, sender: int, receiver: int) -> int:
        return self.input_channels(self.edges[edge_id].target_vertex, receiver).index(
            (edge_id, sender)
        )

    def sink_specs(self) -> list[OperatorSpec]:
        """The operators that end a stream, in vertex order."""
        return [
            spec
            for vid in self.topological_order()
            for spec in self.vertices[vid].operators
            if spec.sink is not None
        ]

    def sink_guarantees(self) -> dict[str, Any]:
        """Each sink's ``GuaranteeResolution`` by operator name (None before resolution)."""
        return {spec.name: spec.guarantee for spec in self.sink_specs()}

    def output_position(self, edge_id: int) -> int:
        """The operator of the sending vertex whose output edge ``edge_id`` carries: its
        index in the vertex's ``operators``, -1 for the vertex's source."""
        edge = self.edges[edge_id]
        if edge.source_position is not None:
            return edge.source_position
        return len(self.vertices[edge.source_vertex].operators) - 1

    def explain(self) -> str:
        lines = []
        for vid in self.topological_order():
            v = self.vertices[vid]
            chain = " -> ".join(op.name for op in v.operators)
            head = f"[{vid}] {v.name} (parallelism {v.parallelism})"
            lines.append(head + (f": {chain}" if chain else ""))
            last = len(v.operators) - 1
            for eid in v.out_edges:
                e = self.edges[eid]
                target = self.vertices[e.target_vertex]
                position = self.output_position(eid)
                origin = ""
                if position != last:
                    origin = (
                        " (from "
                        + (v.name.split(" -> ")[0] if position < 0 else v.operators[position].name)
                        + ")"
                    )
                lines.append(
                    f"    --{e.partitioner.describe()}--> [{target.vertex_id}] {target.name}"
                    f"{origin}"
                )
        return "\n".join(lines)


def build_job_graph(
    plan: LogicalPlan,
    default_parallelism: int,
    default_max_parallelism: int,
    chaining: bool = True,
) -> JobGraph:
    """Translate ``plan`` into a :class:`JobGraph`."""
    transformations = plan.transformations
    parallelism = {
        t.id: _parallelism_of(t, transformations, default_parallelism)
        for t in transformations.values()
    }
    max_par = {t.id: t.max_parallelism or default_max_parallelism for t in transformations.values()}
    for t in transformations.values():
        if parallelism[t.id] > max_par[t.id]:
            raise PlanError(
                f"operator {t.name!r}: parallelism {parallelism[t.id]} exceeds "
                f"max parallelism {max_par[t.id]}"
            )

    real = [t for t in sorted(transformations.values(), key=lambda t: t.id) if t.kind != "union"]
    resolved_inputs: dict[int, list[InputEdge]] = {
        t.id: _resolve_inputs(t, transformations) for t in real
    }
    consumer_count: dict[int, int] = {t.id: 0 for t in real}
    for edges in resolved_inputs.values():
        for edge in edges:
            consumer_count[edge.upstream] += 1
    for t in real:
        if t.kind != "sink" and consumer_count[t.id] == 0:
            raise PlanError(f"operator {t.name!r} has no consumer: end it with sink_to(...)")

    for t in real:
        for edge in resolved_inputs[t.id]:
            kind = edge.partitioner.kind
            same = parallelism[edge.upstream] == parallelism[t.id]
            if kind is PartitionKind.DEFAULT:
                edge.partitioner = PartitionerSpec(
                    PartitionKind.FORWARD if same else PartitionKind.REBALANCE
                )
            elif kind is PartitionKind.FORWARD and not same:
                raise PlanError(
                    f"forward edge {transformations[edge.upstream].name!r} -> {t.name!r} "
                    f"joins parallelism {parallelism[edge.upstream]} to {parallelism[t.id]}; "
                    "use rebalance() or equal parallelism"
                )

    group: dict[int, str | None] = {}
    for t in real:
        inherited = {group[edge.upstream] for edge in resolved_inputs[t.id]}
        group[t.id] = t.slot_sharing_group or (inherited.pop() if len(inherited) == 1 else None)

    _check_unique_uids(real)
    vertex_of: dict[int, int] = {}
    # where each transformation's output leaves its vertex: its index among the vertex's
    # operators (-1: the source); and the transformation each vertex's chain ends with
    position_of: dict[int, int] = {}
    tail_of: dict[int, int] = {}
    vertices: dict[int, VertexSpec] = {}
    edges: dict[int, EdgeSpec] = {}
    for t in real:
        inputs = resolved_inputs[t.id]
        upstream = transformations[inputs[0].upstream] if len(inputs) == 1 else None
        chain_into = (
            chaining
            and upstream is not None
            and t.chainable
            and not t.starts_chain
            and upstream.chainable
            and inputs[0].partitioner.kind is PartitionKind.FORWARD
            and inputs[0].side_output is None
            and tail_of[vertex_of[upstream.id]] == upstream.id
            and parallelism[upstream.id] == parallelism[t.id]
            and group[upstream.id] == group[t.id]
        )
        if chain_into:
            vertex = vertices[vertex_of[upstream.id]]
            vertex.name = f"{vertex.name} -> {t.name}"
        else:
            vertex = VertexSpec(
                vertex_id=len(vertices),
                name=t.name,
                parallelism=parallelism[t.id],
                max_parallelism=max_par[t.id],
                slot_sharing_group=group[t.id],
            )
            vertices[vertex.vertex_id] = vertex
            for edge in inputs:
                edge_spec = EdgeSpec(
                    edge_id=len(edges),
                    source_vertex=vertex_of[edge.upstream],
                    target_vertex=vertex.vertex_id,
                    partitioner=edge.partitioner,
                    side_output=edge.side_output,
                    source_position=position_of[edge.upstream],
                )
                edges[edge_spec.edge_id] = edge_spec
                vertex.in_edges.append(edge_spec.edge_id)
                vertices[edge_spec.source_vertex].out_edges.append(edge_spec.edge_id)
        vertex_of[t.id] = vertex.vertex_id
        tail_of[vertex.vertex_id] = t.id
        position_of[t.id] = len(vertex.operators) - (1 if t.kind == "source" else 0)
        vertex.resources = vertex.resources.plus(t.resources)
        uid = t.uid or f"{t.kind}-{t.id}"
        if t.kind == "source":
            vertex.source = t.source
            vertex.source_uid = uid
            vertex.watermark_strategy = t.watermark_strategy
        else:
            vertex.operators.append(
                OperatorSpec(
                    name=t.name,
                    uid=uid,
                    factory=t.operator_factory,
                    sink=t.sink if t.kind == "sink" else None,
                )
            )
        if t.kind == "sink":
            vertex.sinks.append(t.sink)
    return JobGraph(vertices=vertices, edges=edges)


def _parallelism_of(
    t: Transformation, transformations: dict[int, Transformation], default: int
) -> int:
    if t.parallelism is not None:
        return t.parallelism
    if t.kind == "union":
        return max(
            _parallelism_of(transformations[e.upstream], transformations, default) for e in t.inputs
        )
    return default


def _resolve_inputs(
    t: Transformation, transformations: dict[int, Transformation]
) -> list[InputEdge]:
    resolved: list[InputEdge] = []
    for edge in t.inputs:
        upstream = transformations[edge.upstream]
        if upstream.kind != "union":
            resolved.append(
                InputEdge(
                    edge.upstream,
                    PartitionerSpec(edge.partitioner.kind, edge.partitioner.key),
                    edge.side_output,
                )
            )
            continue
        for inner in _resolve_inputs(upstream, transformations):
            spec = (
                edge.partitioner
                if edge.partitioner.kind is not PartitionKind.DEFAULT
                else (inner.partitioner)
            )
            resolved.append(
                InputEdge(inner.upstream, PartitionerSpec(spec.kind, spec.key), inner.side_output)
            )
    return resolved


def _check_unique_uids(transformations: list[Transformation]) -> None:
    """Every operator's uid (given, or ``<kind>-<id>``) names it alone: its state in
    checkpoints, and the transactions a two-phase-commit sink names after it (two sinks
    sharing a uid would roll back each other's prepared transactions as lingering)."""
    owner: dict[str, str] = {}
    for t in transformations:
        uid = t.uid or f"{t.kind}-{t.id}"
        if uid in owner:
            raise PlanError(
                f"uid {uid!r} names two operators, {owner[uid]!r} and {t.name!r}: "
                "give each operator its own uid"
            )
        owner[uid] = t.name
