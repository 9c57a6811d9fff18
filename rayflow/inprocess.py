"""Running a job in this process, without Ray: for unit tests of a job's functions (as
Bytewax's ``run_main``).

The job runs with the operator semantics of a Ray run: the job graph the environment
builds (chaining, partitioners, parallelism), every subtask of every vertex with its own
copy of the operators (pickled and unpickled, as Ray would send them), opened with its
own context and key groups; batches routed between subtasks by the real partitioners;
sources cut into the same splits and dealt to subtasks the same way.

What differs: one process and one thread; a batch goes on to the next operator at once
(no channels, buffers or backpressure); rate limits of sources are ignored; event time
has no watermark until the input ends (then every event-time timer and window fires, and
no record is late); and there are
no checkpoints, so nothing here is fault tolerant: the first exception ends the run (it
is raised as it is, with a note naming the operator and subtask). Sources must be
bounded. Two-phase-commit sinks commit what they wrote at the end, as after a job's final
checkpoint (or, with checkpointing off, as a Ray run commits them). A ``CollectSink``
needs Ray, so here it is stood in for by a list, and its result is the same table.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rayflow.eventtime.strategy import MAX_WATERMARK, with_timestamps, without_timestamps
from rayflow.outputs import SideOutput
from rayflow.plan.logical import InputEdge
from rayflow.plan.partitioners import Partitioner, PartitionerSpec, PartitionKind
from rayflow.plan.physical import JobGraph, VertexSpec
from rayflow.runtime.operators import Operator, OperatorContext, factory
from rayflow.runtime.restore import assign_source_splits
from rayflow.sink import Sink

if TYPE_CHECKING:
    from rayflow.environment import StreamExecutionEnvironment

__all__ = ["run_in_process", "InProcessResult"]


@dataclass
class InProcessResult:
    """What a job run in process gave."""

    #: per stream that ended without a sink (by its operator's name), its records
    collected: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: per sink (by its operator's name), the merged result, as in ``JobResult``
    sink_results: dict[str, Any] = field(default_factory=dict)
    #: per operator name, the metrics of each of its subtasks
    metrics: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: each sink object with its operator's name (``sink_result`` by object)
    sink_names: list[tuple[Sink, str]] = field(default_factory=list, repr=False)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The records of the job's one stream that ended without a sink."""
        if len(self.collected) != 1:
            raise ValueError(
                f"{len(self.collected)} streams ended without a sink "
                f"({', '.join(map(repr, self.collected))}): read result.collected[name]"
            )
        return next(iter(self.collected.values()))

    def sink_result(self, sink: str | Sink) -> Any:
        """The merged result of a sink, by operator name or by the sink object itself."""
        key = sink
        if not isinstance(sink, str):
            key = next((name for s, name in self.sink_names if s is sink), None)
        if key not in self.sink_results:
            raise KeyError(f"no sink named {key!r} (sinks: {sorted(self.sink_results)})")
        return self.sink_results[key]


class _Collect(Operator):
    """Keeps the batches it is given: at the end of a stream without sink, or in the
    place of ``stand_in_for`` (a CollectSink)."""

    def __init__(self, stand_in_for: Sink | None = None) -> None:
        self.stand_in_for = stand_in_for
        self.batches: list[pa.RecordBatch] = []

    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        self.batches.append(without_timestamps(batch))
        return []

    def result(self) -> Any:
        return self.batches


def _table(batches: list[pa.RecordBatch]) -> pa.Table:
    tables = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default").combine_chunks()


def _copy(make: Callable[[], Operator]) -> Callable[[], Operator]:
    """A copy of an operator factory, as a subtask gets it from Ray."""
    from ray import cloudpickle

    return cloudpickle.loads(cloudpickle.dumps(make))


class _Subtask:
    """One parallel instance of a vertex: its operators and where its output goes."""

    def __init__(self, vertex: VertexSpec, index: int) -> None:
        self.vertex = vertex
        self.index = index
        self.operators: list[Operator] = [_copy(spec.factory)() for spec in vertex.operators]
        self.outputs: list[tuple[Partitioner, list[_Subtask], str | None, int]] = []
        self.reader: Any = None
        self.current = vertex.name  # what runs now, for errors

    def fail(self, exc: BaseException) -> BaseException:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(
                f"(in operator {self.current!r}, subtask {self.index + 1}/"
                f"{self.vertex.parallelism}, run in process)"
            )
        return exc


class _Run:
    def __init__(
        self, graph: JobGraph, job_name: str, checkpointing: bool, object_reuse: bool = False
    ) -> None:
        self.graph = graph
        self.subtasks: dict[int, list[_Subtask]] = {
            vid: [_Subtask(v, i) for i in range(v.parallelism)]
            for vid, v in sorted(graph.vertices.items())
        }
        self.job_name = job_name
        self.checkpointing = checkpointing
        self.object_reuse = object_reuse
        self.run_id = f"run-inprocess-{uuid.uuid4().hex[:8]}"

    def open(self) -> None:
        for vid, subtasks in self.subtasks.items():
            vertex = self.graph.vertices[vid]
            for sub in subtasks:
                self.guarded(sub, self._open_subtask)
                sub.outputs = self._outputs(vertex, sub.index)
            if vertex.is_source:
                splits = assign_source_splits(vertex, None)
                for sub in subtasks:
                    sub.current = vertex.name.split(" -> ")[0]
                    sub.reader = self.guarded(sub, _create_reader, splits[sub.index])

    def _open_subtask(self, sub: _Subtask) -> None:
        vertex = sub.vertex
        for spec, op in zip(vertex.operators, sub.operators):
            sub.current = spec.name
            op.open(
                OperatorContext(
                    job_name=self.job_name,
                    operator_name=spec.name,
                    operator_uid=spec.uid,
                    subtask_index=sub.index,
                    parallelism=vertex.parallelism,
                    max_parallelism=vertex.max_parallelism,
                    attempt=0,
                    checkpointing=self.checkpointing,
                    run_id=self.run_id,
                    object_reuse=self.object_reuse,
                )
            )
            recover = getattr(op, "recover", None)
            if recover is not None:
                recover(None)

    def _outputs(
        self, vertex: VertexSpec, index: int
    ) -> list[tuple[Partitioner, list[_Subtask], str | None, int]]:
        outputs = []
        for edge_id in vertex.out_edges:
            edge = self.graph.edges[edge_id]
            targets = self.subtasks[edge.target_vertex]
            receivers = (
                [targets[index]] if edge.partitioner.kind is PartitionKind.FORWARD else targets
            )
            target = self.graph.vertices[edge.target_vertex]
            partitioner = Partitioner(
                edge.partitioner, index, len(receivers), target.max_parallelism
            )
            position = self.graph.output_position(edge_id)
            outputs.append((partitioner, list(receivers), edge.side_output, position))
        return outputs

    def process(self, sub: _Subtask, batch: pa.RecordBatch, start: int = 0) -> None:
        """``batch`` (the output of the operator before ``start``) through the operators
        from ``start`` on; each operator's output goes to the edges that leave there."""
        batches: list[Any] = [batch]
        specs = sub.vertex.operators
        self.emit(sub, batches, start - 1)
        for position in range(start, len(sub.operators)):
            op = sub.operators[position]
            sub.current = specs[position].name
            produced: list[pa.RecordBatch] = []
            for b in batches:
                if not isinstance(b, SideOutput):  # emitted where it was made
                    produced.extend(op.process(b))
            if not produced:
                return
            self.emit(sub, produced, position)
            batches = produced

    def emit(
        self, sub: _Subtask, batches: list[pa.RecordBatch | SideOutput], position: int
    ) -> None:
        for b in batches:
            if b.num_rows == 0:
                continue
            tag, data = (b.tag, b.batch) if isinstance(b, SideOutput) else (None, b)
            for partitioner, receivers, side_output, at in sub.outputs:
                if side_output != tag or at != position:
                    continue
                for target, part in partitioner.route(data):
                    self.guarded(receivers[target], self.process, part)

    def guarded(self, sub: _Subtask, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(sub, *args)
        except _Noted:
            raise
        except Exception as exc:
            raise _Noted(sub.fail(exc)) from None

    def read_sources(self) -> None:
        readers = [sub for subs in self.subtasks.values() for sub in subs if sub.reader]
        while readers:
            for sub in list(readers):
                sub.current = sub.vertex.name.split(" -> ")[0]
                batch = self.guarded(sub, lambda s: s.reader.read_batch())
                if batch is None:
                    sub.reader.close()
                    sub.reader = None
                    readers.remove(sub)
                elif batch.num_rows:
                    strategy = sub.vertex.watermark_strategy
                    if strategy is not None:
                        batch = with_timestamps(batch, strategy.timestamps_of(batch))
                    self.guarded(sub, self.process, batch)

    def end_input(self) -> None:
        for subtasks in self.subtasks.values():  # in topological order
            for sub in subtasks:
                self.guarded(sub, self._end_subtask)

    def _end_subtask(self, sub: _Subtask) -> None:
        # Event time: no watermarks before the end here, then the end-of-input one.
        for position, op in enumerate(sub.operators):
            sub.current = sub.vertex.operators[position].name
            for batch in op.process_watermark(MAX_WATERMARK):
                self.process(sub, batch, position + 1)
        for position, op in enumerate(sub.operators):
            sub.current = sub.vertex.operators[position].name
            for batch in op.end_input():
                self.process(sub, batch, position + 1)

    def final_checkpoint(self, checkpoint_id: int = 1) -> None:
        """What a Ray run does once its input has ended with checkpointing on: a final
        checkpoint, then its completion (two-phase-commit sinks commit then)."""
        everyone = [sub for subs in self.subtasks.values() for sub in subs]
        for sub in everyone:
            self.guarded(sub, lambda s: [op.snapshot_state(checkpoint_id) for op in s.operators])
        for sub in everyone:
            self.guarded(
                sub, lambda s: [op.notify_checkpoint_complete(checkpoint_id) for op in s.operators]
            )

    def close(self) -> None:
        for subs in self.subtasks.values():
            for sub in subs:
                if sub.reader is not None:
                    sub.reader.close()
                for op in sub.operators:
                    try:
                        op.close()
                    except Exception:  # noqa: BLE001 - closing must not hide the first error
                        pass


def _create_reader(sub: _Subtask, splits: list[Any]) -> Any:
    return sub.vertex.source.create_reader(list(splits))


class _Noted(Exception):
    """Carries a user's exception (with its note) out of the nested calls."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc


def _stand_ins(env: StreamExecutionEnvironment) -> tuple[list[int], dict[int, Any]]:
    """Collect operators for the streams without a sink (added to the plan), and the
    CollectSinks to stand in for (transformation id -> the sink)."""
    from sinks.basic import CollectSink

    added = []
    for end in env._plan.open_ends():
        t = env._plan.add(
            name=end.name,
            kind="sink",
            inputs=[InputEdge(end.id, PartitionerSpec())],
            operator_factory=factory(_Collect),
        )
        added.append(t.id)
    replaced = {
        t.id: t.sink
        for t in env._plan.transformations.values()
        if t.kind == "sink" and isinstance(t.sink, CollectSink)
    }
    return added, replaced


def run_in_process(
    env: StreamExecutionEnvironment, job_name: str = "rayflow job"
) -> InProcessResult:
    """Run ``env`` 's job to the end in this process, without Ray (not fault tolerant; see
    the module's description). Every stream that ends without a sink is collected:
    ``result.records`` (the only one) or ``result.collected[name]``; sinks run as they
    would on Ray (a ``CollectSink``'s table is in ``result.sink_result(sink)``)."""
    from sinks.basic import CollectSink

    added, _ = _stand_ins(env)
    plan = env._plan
    try:
        graph = env.get_job_graph()
    finally:
        for tid in added:
            plan.remove(tid)
    if not graph.vertices:
        raise ValueError("run_in_process: the job has no operators; add a source")
    for spec in graph.sink_specs():
        if isinstance(spec.sink, CollectSink):
            # stood in for by an in-process list: needs no setup
            spec.factory = factory(_Collect, spec.sink)
        else:
            spec.sink.setup(job_name, spec.guarantee)
    checkpointing = env.get_checkpoint_config().is_checkpointing_enabled()
    run = _Run(graph, job_name, checkpointing, env.get_config().is_object_reuse_enabled())
    try:
        run.open()
        run.read_sources()
        run.end_input()
        if checkpointing:
            run.final_checkpoint()
    except _Noted as noted:
        raise noted.exc from None
    finally:
        run.close()
    return _result(graph, run)


def _result(graph: JobGraph, run: _Run) -> InProcessResult:
    result = InProcessResult(sink_names=[(spec.sink, spec.name) for spec in graph.sink_specs()])
    for vid, subtasks in run.subtasks.items():
        vertex = graph.vertices[vid]
        for position, spec in enumerate(vertex.operators):
            ops = [sub.operators[position] for sub in subtasks]
            metrics = [op.metrics() for op in ops]
            if any(metrics):
                result.metrics[spec.name] = metrics
            sink = spec.sink
            if isinstance(ops[0], _Collect):
                batches = [b for op in ops for b in op.batches]
                if sink is not None:
                    result.sink_results[spec.name] = _table(batches)
                else:
                    result.collected[spec.name] = _table(batches).to_pylist()
            elif sink is not None:
                result.sink_results[spec.name] = sink.merge_results([op.result() for op in ops])
    return result
