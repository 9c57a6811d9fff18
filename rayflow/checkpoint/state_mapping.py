"""Which operator of a job takes which state of a checkpoint or savepoint it restores.

State is matched by operator uid (``.uid(...)`` on a stream or a sink), never by
position: a job whose code changed (an operator added or removed) restores the state of
every operator whose uid it still has. An operator without an explicit uid gets one from
its place in the plan (``operator-3``), which changes when operators are added before it:
restoring such a job warns (:class:`MissingUidWarning`). State of the restore point that
no operator of the job takes is refused, unless ``allow_non_restored_state`` (Flink's
``--allowNonRestoredState``) says to drop it. New operators start without state.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.plan.logical import LogicalPlan
from rayflow.plan.partitioners import PartitionKind
from rayflow.plan.physical import JobGraph

__all__ = [
    "MissingUidWarning",
    "operators_without_uid",
    "unmatched_state",
    "check_state_mapping",
    "max_parallelism_changes",
]


class MissingUidWarning(UserWarning):
    """A restored job has operators without an explicit uid."""


def operators_without_uid(plan: LogicalPlan, holding: set[str] | None = None) -> list[str]:
    """Names of the sources, operators and sinks of ``plan`` without an explicit uid; with
    ``holding`` (the uids that hold state in a restore point), only those that may have
    state: sources, sinks, keyed operators, and those whose uid from their place in the
    plan holds state there (a stateless ``map`` needs no uid)."""
    return [
        t.name
        for t in sorted(plan.transformations.values(), key=lambda t: t.id)
        if t.kind != "union"
        and t.uid is None
        and (holding is None or _may_hold_state(t) or f"{t.kind}-{t.id}" in holding)
    ]


def _may_hold_state(t: Any) -> bool:
    return t.kind in ("source", "sink") or any(
        e.partitioner.kind is PartitionKind.HASH for e in t.inputs
    )


def _graph_uids(graph: JobGraph) -> list[str]:
    uids = []
    for vertex in graph.vertices.values():
        if vertex.source_uid is not None:
            uids.append(vertex.source_uid)
        uids.extend(op.uid for op in vertex.operators)
    return uids


def _holding_state(restore: CheckpointMetadata) -> set[str]:
    held: set[str] = set(restore.source_splits)
    for entry in restore.subtasks.values():
        held.update(entry.uids_with_state)
    return held


def unmatched_state(graph: JobGraph, restore: CheckpointMetadata) -> dict[str, str]:
    """uid -> operator name of every operator of ``restore`` that held state and that no
    operator of ``graph`` takes."""
    missing = _holding_state(restore) - set(_graph_uids(graph))
    return {uid: restore.operator_names.get(uid, uid) for uid in sorted(missing)}


def max_parallelism_changes(
    graph: JobGraph, restore: CheckpointMetadata
) -> dict[str, tuple[str, int, int]]:
    """uid -> (operator name, max parallelism then, now) of every operator with keyed
    state in ``restore`` that ``graph`` runs under another max parallelism."""
    now = {op.uid: v.max_parallelism for v in graph.vertices.values() for op in v.operators}
    changed: dict[str, tuple[str, int, int]] = {}
    for entry in restore.subtasks.values():
        if entry.max_parallelism is None:
            continue
        for uid in entry.keyed_uids:
            if uid in now and now[uid] != entry.max_parallelism:
                name = restore.operator_names.get(uid, uid)
                changed[uid] = (name, entry.max_parallelism, now[uid])
    return changed


def check_state_mapping(
    plan: LogicalPlan | None,
    graph: JobGraph,
    restore: CheckpointMetadata,
    allow_non_restored_state: bool,
    where: str,
) -> None:
    """Warn about operators without a uid; refuse duplicate uids and (unless allowed)
    state that no operator of the job takes."""
    repeated = sorted(uid for uid, n in Counter(_graph_uids(graph)).items() if n > 1)
    if repeated:
        raise ValueError(
            f"{where}: uids {repeated} are given to more than one operator; each operator's "
            "uid must be unique (state is matched by uid)"
        )
    anonymous = operators_without_uid(plan, _holding_state(restore)) if plan is not None else []
    if anonymous:
        warnings.warn(
            f"{where}: operators {anonymous} have no explicit uid; their state is matched by "
            "a uid derived from their place in the job, which changes when operators are "
            "added or removed before them. Give every stateful operator a uid with "
            ".uid('...') to restore across code changes",
            MissingUidWarning,
            stacklevel=5,
        )
    changed = max_parallelism_changes(graph, restore)
    if changed:
        listed = ", ".join(
            f"{name!r} (uid {uid!r}): max parallelism {was} in the checkpoint, {now} in the job"
            for uid, (name, was, now) in changed.items()
        )
        raise ValueError(
            f"{where}: checkpoint {restore.checkpoint_id} holds keyed state of {listed}. Keyed "
            "state is cut into key groups by the max parallelism, which cannot change across "
            "a restore (keys would land in other key groups): give the job the max "
            "parallelism it had (env.set_max_parallelism(...))"
        )
    missing = unmatched_state(graph, restore)
    if missing and not allow_non_restored_state:
        listed = ", ".join(f"{name!r} (uid {uid!r})" for uid, name in missing.items())
        raise ValueError(
            f"{where}: checkpoint {restore.checkpoint_id} holds state of operators this job "
            f"does not have: {listed}. Give the operators that should take it the same uid "
            "as before, or pass allow_non_restored_state=True to drop that state"
        )
