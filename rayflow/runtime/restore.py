"""The restore assigner: which state and which source splits each subtask starts from.

Plain functions over a completed checkpoint's metadata and the job graph (no Ray), so
rescaling rules are unit-tested on their own: source splits are dealt round-robin in
split-id order; a subtask gets a handle on every snapshot that holds one of its
operators (keyed state is then filtered by key group, operator state by old index).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.plan.physical import JobGraph, VertexSpec

__all__ = ["StateHandle", "assign_source_splits", "check_channel_state", "state_handles"]


@dataclass
class StateHandle:
    """Where one subtask's snapshot of a checkpoint lives: object store and durable path."""

    old_index: int
    old_parallelism: int
    path: str
    ref: Any = None  # ObjectRef owned by the job master, while it lives
    #: the storage ``path`` is read from (a savepoint's); None: the run's own
    storage: Any = None


def assign_source_splits(
    vertex: VertexSpec,
    restore: CheckpointMetadata | None,
    fresh: Callable[[], list[Any]] | None = None,
) -> list[list[Any]]:
    """Per subtask of a source vertex, the splits it reads: those saved in ``restore``
    (at their saved positions), else fresh ones: ``fresh()`` when given (the deployer
    cuts a source's splits once per job master, so every subtask and every attempt
    before the first checkpoint gets the same ones), else the source's."""
    per_subtask: list[list[Any]] = [[] for _ in range(vertex.parallelism)]
    saved = restore.source_splits.get(vertex.source_uid) if restore else None
    if saved is not None:
        splits = sorted(saved, key=lambda s: s.split_id)
    elif fresh is not None:
        splits = fresh()
    else:
        splits = vertex.source.create_splits(vertex.parallelism)
    for i, split in enumerate(splits):
        per_subtask[i % vertex.parallelism].append(split)
    return per_subtask


def check_channel_state(graph: JobGraph, restore: CheckpointMetadata, where: str) -> None:
    """Refuse to restore an unaligned checkpoint's channel state into another job graph:
    in-flight data is addressed by input channel, and channels change with the
    parallelism (of the receiver and of every sender)."""
    if not restore.has_channel_state:
        return
    # A vertex is known by its operators' uids (names repeat: two "MapBatches").
    old = {frozenset(s.uids): (s.vertex, s.parallelism) for s in restore.subtasks.values()}
    new = {
        frozenset([op.uid for op in v.operators] + ([v.source_uid] if v.is_source else [])): (
            v.name,
            v.parallelism,
        )
        for v in graph.vertices.values()
    }
    changes = [
        f"{(old.get(uids) or new[uids])[0]!r} "
        f"{old[uids][1] if uids in old else 'absent'} -> "
        f"{new[uids][1] if uids in new else 'absent'}"
        for uids in sorted(set(old) | set(new), key=sorted)
        if old.get(uids, (None, None))[1] != new.get(uids, (None, None))[1]
    ]
    if changes:
        size = sum(s.channel_state_size for s in restore.subtasks.values())
        raise ValueError(
            f"{where}: checkpoint {restore.checkpoint_id} is unaligned (it holds {size:,} "
            "bytes of in-flight data as channel state), and channel state cannot be "
            "redistributed to another job graph or parallelism (changed: "
            f"{', '.join(changes)}). Restore it with the job graph it was taken with (the "
            "same parallelism and the same operators chained together: a chain that changed "
            "without a change of code, e.g. a stream with several consumers that now keeps one "
            "of them in its chain, is built as before with start_new_chain() on that consumer, "
            "or disable_chaining() on a sink), then take an aligned checkpoint (run with "
            "unaligned checkpoints off; the final checkpoint of a job that ends is always "
            "aligned) and change the job from that one."
        )


def state_handles(
    vertex: VertexSpec, restore: CheckpointMetadata | None, refs: dict[Any, Any] | None = None
) -> list[StateHandle]:
    """Every snapshot in ``restore`` that holds state of one of ``vertex``'s operators."""
    if restore is None:
        return []
    uids = {op.uid for op in vertex.operators}
    refs = refs or {}
    return [
        StateHandle(
            old_index=key[1],
            old_parallelism=entry.parallelism,
            path=entry.path,
            ref=refs.get(key),
            storage=restore.blob_storage,
        )
        for key, entry in sorted(restore.subtasks.items())
        if uids & set(entry.uids)
    ]
