"""The deployer: what each subtask of an attempt is deployed with.

Plain code over the job graph and the run's settings (no Ray calls), so the wiring is
unit-tested on its own: which receivers each out-edge has and through which channel,
that keys are routed by the *receiving* operator's key groups, which source splits and
which state each subtask restores. The job master creates the actors; the deployer only
says what goes into them (receivers are deployed first, so each sender gets their
handles).
"""

from __future__ import annotations

import copy
from typing import Any

from rayflow.checkpoint.coordinator import CompletedCheckpoint
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.plan.partitioners import PartitionKind
from rayflow.plan.physical import JobGraph, VertexSpec
from rayflow.runtime.channels import (
    DEFAULT_BUFFER_TIMEOUT_MS,
    DEFAULT_CHANNEL_BYTES,
    buffer_bytes_for,
    channel_bytes_for,
)
from rayflow.runtime.restore import assign_source_splits, state_handles
from rayflow.runtime.settings import JobSettings
from rayflow.runtime.subtask import OutputDeployment, SubtaskDeployment

__all__ = ["Deployer"]

SubtaskKey = tuple[int, int]


class Deployer:
    def __init__(
        self, graph: JobGraph, settings: JobSettings, storage: CheckpointStorage | None
    ) -> None:
        self.graph = graph
        self.settings = settings
        self.storage = storage
        #: per source vertex, the splits it was cut into when the run first deployed it
        #: without a checkpoint to restore: cut once per run (kept in the run's storage
        #: for the job masters that follow), so every subtask, attempt and job master
        #: until a checkpoint holds positions starts from the same ones (a source that
        #: resolves "latest" offsets resolves them once)
        self._fresh_splits: dict[int, list[Any]] = {}

    def outputs(
        self, vertex: VertexSpec, index: int, actors: dict[SubtaskKey, Any]
    ) -> list[OutputDeployment]:
        """One entry per out-edge of subtask ``index`` of ``vertex``: its partitioner and
        its receivers' handles (taken from ``actors``) with their channel indices."""
        graph = self.graph
        outputs = []
        for edge_id in vertex.out_edges:
            edge = graph.edges[edge_id]
            target = graph.vertices[edge.target_vertex]
            receivers = self._receivers(edge.partitioner.kind, index, target)
            outputs.append(
                OutputDeployment(
                    partitioner=edge.partitioner,
                    receivers=[
                        (actors[(target.vertex_id, r)], graph.channel_index(edge_id, index, r))
                        for r in receivers
                    ],
                    receiver_names=[
                        f"subtask {r + 1}/{target.parallelism} of {target.name!r}"
                        for r in receivers
                    ],
                    # keys are routed by the receiving operator's key groups
                    max_parallelism=target.max_parallelism,
                    side_output=edge.side_output,
                    position=graph.output_position(edge_id),
                )
            )
        return outputs

    def fresh_splits(self, vertex: VertexSpec) -> list[Any]:
        """``vertex``'s source cut into splits, once per run: read back from the run's
        storage when an earlier job master of the run cut it, else cut now and recorded
        there before any subtask reads them."""
        if vertex.vertex_id not in self._fresh_splits:
            storage, uid = self.storage, vertex.source_uid or f"v{vertex.vertex_id}"
            splits = storage.read_source_splits(uid) if storage is not None else None
            if splits is None:
                splits = vertex.source.create_splits(vertex.parallelism)
                if storage is not None:
                    storage.write_source_splits(uid, splits)
            self._fresh_splits[vertex.vertex_id] = splits
        return [copy.copy(s) for s in self._fresh_splits[vertex.vertex_id]]

    def _send_bytes(self, vertex: VertexSpec, index: int) -> int:
        """The automatic window of each output channel of subtask ``index``: its share of
        what its output channels get, and never more than any of its receivers buffers
        per input channel (a sender with one output feeding a receiver with many inputs
        would otherwise keep more in flight there than the receiver was sized for: what
        its gate does not admit waits in the receiver's process all the same)."""
        graph = self.graph
        channels = 0
        windows = []
        for edge_id in vertex.out_edges:
            edge = graph.edges[edge_id]
            target = graph.vertices[edge.target_vertex]
            for r in self._receivers(edge.partitioner.kind, index, target):
                channels += 1
                windows.append(channel_bytes_for(len(graph.input_channels(target.vertex_id, r))))
        return min([channel_bytes_for(channels), *windows])

    @staticmethod
    def _receivers(kind: PartitionKind, index: int, target: VertexSpec) -> list[int]:
        """The subtasks of ``target`` that subtask ``index`` sends to over an edge."""
        return [index] if kind is PartitionKind.FORWARD else list(range(target.parallelism))

    def deployment(
        self,
        vertex: VertexSpec,
        index: int,
        attempt: int,
        restore: CompletedCheckpoint | None,
        outputs: list[OutputDeployment],
        master: Any = None,
    ) -> SubtaskDeployment:
        settings, hooks = self.settings, self.settings.hooks
        meta = restore.metadata if restore else None
        splits = (
            assign_source_splits(vertex, meta, lambda: self.fresh_splits(vertex))
            if vertex.is_source
            else None
        )
        inputs = len(self.graph.input_channels(vertex.vertex_id, index))
        # A buffer timeout under the default asks for latency: what waits in flight in
        # front of each record stays as small as it was (1 MiB channels and messages)
        sized = settings.buffer_timeout_ms >= DEFAULT_BUFFER_TIMEOUT_MS
        gate_bytes = settings.channel_bytes or (
            channel_bytes_for(inputs) if sized else DEFAULT_CHANNEL_BYTES
        )
        send_bytes = settings.channel_bytes or (
            self._send_bytes(vertex, index) if sized else DEFAULT_CHANNEL_BYTES
        )
        return SubtaskDeployment(
            job_name=settings.job_name,
            vertex=vertex,
            index=index,
            attempt=attempt,
            num_input_channels=inputs,
            outputs=outputs,
            source_splits=splits[index] if splits else [],
            channel_capacity=settings.channel_capacity,
            send_window=settings.send_window,
            debloat_target_ms=settings.debloat_target_ms,
            checkpointing=settings.checkpoint_config.mode if settings.checkpointing else None,
            alignment=settings.checkpoint_config.alignment,
            aligned_checkpoint_timeout_s=(
                settings.checkpoint_config.aligned_checkpoint_timeout_ms / 1000.0
            ),
            storage=self.storage,
            master=master,
            restore=state_handles(vertex, meta, restore.refs if restore else None),
            restored_checkpoint=restore.checkpoint_id if restore else None,
            hooks=hooks.for_subtask(vertex.name, index, attempt) if hooks else None,
            run_id=settings.run_id,
            latency_tracking_interval_ms=settings.latency_tracking_interval_ms,
            buffer_timeout_s=settings.buffer_timeout_ms / 1000.0,
            buffer_bytes=settings.buffer_bytes or buffer_bytes_for(send_bytes),
            object_reuse=settings.object_reuse,
            channel_bytes=gate_bytes,
            send_bytes=send_bytes,
            failure_classifier=settings.failure_classifier,
            data_transport=settings.data_transport,
        )
