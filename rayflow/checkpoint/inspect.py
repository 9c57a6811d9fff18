"""Listing and inspecting retained checkpoints (behind ``rayflow checkpoints PATH``)."""

from __future__ import annotations

import datetime as dt
import pickle
from dataclasses import dataclass
from typing import Any

from rayflow.checkpoint.storage import CheckpointStorage, JobStorage, open_checkpoint_path


@dataclass
class CheckpointSummary:
    checkpoint_id: int
    completed_at: float
    size: int
    final: bool
    attempt: int
    operator_sizes: dict[str, int]
    subtasks: int
    run_id: str | None = None


def summarize(
    storage: CheckpointStorage, checkpoint_id: int, per_operator: bool = True
) -> CheckpointSummary:
    meta = storage.load_metadata(checkpoint_id)
    operator_sizes: dict[str, int] = {}
    if per_operator:
        for entry in meta.subtasks.values():
            state = pickle.loads(storage.read_blob(entry.path))
            for uid, value in state.items():
                operator_sizes[uid] = operator_sizes.get(uid, 0) + len(
                    pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                )
        for uid, splits in meta.source_splits.items():
            operator_sizes[uid] = len(pickle.dumps(splits, protocol=pickle.HIGHEST_PROTOCOL))
    return CheckpointSummary(
        checkpoint_id=checkpoint_id,
        completed_at=meta.completed_at,
        size=meta.size,
        final=meta.final,
        attempt=meta.attempt,
        operator_sizes=operator_sizes,
        subtasks=len(meta.subtasks),
        run_id=meta.run_id,
    )


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def describe(path: str, options: dict[str, Any] | None = None) -> str:
    """A human-readable listing of the checkpoints at ``path``: a job directory (every
    run in it), a run directory, or one ``chk-<n>``."""
    storage, only = open_checkpoint_path(path, options)
    runs = storage.runs() if isinstance(storage, JobStorage) else [storage]
    lines: list[str] = []
    for run in runs:
        ids = run.completed_ids()
        if only is not None:
            if only not in ids:
                raise FileNotFoundError(
                    f"{path}: checkpoint {only} has no metadata (not completed)"
                )
            ids = [only]
        if ids:
            lines.extend(_describe_run(run, ids))
    if not lines:
        raise FileNotFoundError(f"{path}: no completed checkpoint found")
    return "\n".join(lines)


def _describe_run(storage: CheckpointStorage, ids: list[int]) -> list[str]:
    run = f" run {storage.run_id}" if storage.run_id else ""
    lines = [f"checkpoints of job {storage.job_name!r}{run} in {storage.location()}"]
    lines.append(f"{'id':>6}  {'completed (UTC)':<19}  {'size':>10}  {'subtasks':>8}  final")
    summaries = [summarize(storage, cid) for cid in ids]
    for s in summaries:
        when = dt.datetime.fromtimestamp(s.completed_at, dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S"
        )
        lines.append(
            f"{s.checkpoint_id:>6}  {when:<19}  {_human(s.size):>10}  {s.subtasks:>8}  "
            f"{'yes' if s.final else 'no'}"
        )
        for uid, size in sorted(s.operator_sizes.items()):
            lines.append(f"{'':>8}{uid:<30} {_human(size):>10}")
    return lines
