"""Listing and inspecting retained checkpoints (behind ``rayflow checkpoints PATH``).

PATH may be one ``chk-<n>``, a run directory, a job's directory (every run in it), or a
checkpoint storage root (the jobs found in it are listed). Operators are shown by name
(checkpoints written before names were recorded show names taken from the chained
vertex names, else the operator's uid).
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.checkpoint.savepoint import is_savepoint, load_savepoint
from rayflow.checkpoint.storage import (
    CheckpointStorage,
    JobStorage,
    _resolve_root,
    open_checkpoint_path,
)
from rayflow.eventtime.valve import EVENT_TIME_KEY

__all__ = [
    "CheckpointSummary",
    "summarize",
    "summarize_metadata",
    "describe",
    "operator_names",
    "storage_options_from_environment",
]


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


def operator_names(meta: CheckpointMetadata) -> dict[str, str]:
    """Operator uid -> name: as recorded, else from the vertex names (a chained vertex is
    named ``Source -> Op -> ...``, and its blob lists the operators' uids in that order,
    the source's last), else nothing."""
    if meta.operator_names:
        return dict(meta.operator_names)
    names: dict[str, str] = {}
    for entry in meta.subtasks.values():
        parts = entry.vertex.split(" -> ") if entry.vertex else []
        uids = list(entry.uids)
        source = [u for u in uids if u in meta.source_splits]
        ordered = source + [u for u in uids if u not in meta.source_splits]
        if len(parts) == len(ordered):
            names.update(zip(ordered, parts))
    return names


def summarize(
    storage: CheckpointStorage, checkpoint_id: int, per_operator: bool = True
) -> CheckpointSummary:
    """A checkpoint's figures; ``operator_sizes`` is keyed by operator name (its uid when
    the name is unknown)."""
    return summarize_metadata(storage.load_metadata(checkpoint_id), storage, per_operator)


def summarize_metadata(
    meta: CheckpointMetadata, storage: CheckpointStorage, per_operator: bool = True
) -> CheckpointSummary:
    """The figures of a checkpoint's (or a savepoint's) metadata, its blobs read through
    ``storage``."""
    from rayflow.runtime.channel_state import decode_snapshot

    checkpoint_id = meta.checkpoint_id
    names = operator_names(meta)
    operator_sizes: dict[str, int] = {}
    if per_operator:
        for entry in meta.subtasks.values():
            state, _ = decode_snapshot(storage.read_blob(entry.path), entry.path, names)
            for uid, value in state.items():
                if uid == EVENT_TIME_KEY:
                    continue  # the subtask's watermark, not an operator's state
                name = names.get(uid, uid)
                operator_sizes[name] = operator_sizes.get(name, 0) + len(
                    pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                )
        for uid, splits in meta.source_splits.items():
            operator_sizes[names.get(uid, uid)] = len(
                pickle.dumps(splits, protocol=pickle.HIGHEST_PROTOCOL)
            )
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


def storage_options_from_environment(
    path: str, endpoint_url: str | None = None, region: str | None = None
) -> dict[str, Any]:
    """``pyarrow.fs.S3FileSystem`` options for an ``s3://`` path: the endpoint and region
    given, else ``$AWS_ENDPOINT_URL`` and ``$AWS_REGION`` / ``$AWS_DEFAULT_REGION``;
    credentials come from the environment as pyarrow finds them. Empty for other paths."""
    if not path.startswith("s3://"):
        return {}
    options: dict[str, Any] = {}
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_override"] = endpoint
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return options


def _kind_of(path: str, options: dict[str, Any] | None) -> tuple[str, list[str]]:
    """``("missing", [])``, ``("root", [job names])``, or ``("other", [])``."""
    fs, base = _resolve_root(path.rstrip("/") or "/", dict(options or {}))
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        return "missing", []
    if info.type != pafs.FileType.Directory:
        return "other", []
    children = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    names = [c.base_name for c in children if c.type == pafs.FileType.Directory]
    if any(n.startswith(("run-", "chk-")) for n in names):
        return "other", []  # a job's directory (or a run's)
    jobs = []
    for name in sorted(names):
        grand = fs.get_file_info(pafs.FileSelector(f"{base}/{name}", allow_not_found=True))
        if any(
            g.type == pafs.FileType.Directory and g.base_name.startswith(("run-", "chk-"))
            for g in grand
        ):
            jobs.append(name)
    return ("root", jobs) if jobs else ("other", [])


def describe(path: str, options: dict[str, Any] | None = None) -> str:
    """A human-readable listing of the checkpoints at ``path``: a job directory (every
    run in it), a run directory, one ``chk-<n>``, or a storage root (its jobs). Raises
    ``FileNotFoundError`` saying what is missing."""
    base = path.rstrip("/").rpartition("/")[2]
    if not base.startswith(("chk-", "run-")) and is_savepoint(path, options):
        return _describe_savepoint(path, options)
    if not base.startswith(("chk-", "run-")):
        kind, jobs = _kind_of(path, options)
        if kind == "missing":
            raise FileNotFoundError(f"{path}: no such directory")
        if kind == "root":
            return _describe_root(path, jobs, options)
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
        raise FileNotFoundError(
            f"{path}: no completed checkpoint found (give a job's checkpoint directory, "
            "one of its run-... directories, a chk-<n>, or the storage root)"
        )
    return "\n".join(lines)


def _describe_root(path: str, jobs: list[str], options: dict[str, Any] | None) -> str:
    root = path.rstrip("/")
    lines = [f"{root} is a checkpoint storage root; jobs with checkpoints in it:"]
    for job in jobs:
        storage = JobStorage(root, job, options)
        runs = storage.runs()
        newest = storage.latest()
        if newest is None:
            latest = "no completed checkpoint"
        else:
            when = dt.datetime.fromtimestamp(newest[1].completed_at, dt.timezone.utc)
            latest = f"newest checkpoint {newest[1].checkpoint_id} ({when:%Y-%m-%d %H:%M:%S} UTC)"
        lines.append(f"  {job:<30} {len(runs)} run(s), {latest}")
    lines.append(f"list one job's checkpoints with: rayflow checkpoints {root}/<job>")
    return "\n".join(lines)


def _describe_savepoint(path: str, options: dict[str, Any] | None) -> str:
    meta = load_savepoint(path, options)
    lines = [
        f"savepoint of job {meta.job_name!r} run {meta.run_id} (its checkpoint "
        f"{meta.checkpoint_id}) in {path.rstrip('/')}"
    ]
    return "\n".join(lines + _table([summarize_metadata(meta, meta.blob_storage)]))


def _describe_run(storage: CheckpointStorage, ids: list[int]) -> list[str]:
    run = f" run {storage.run_id}" if storage.run_id else ""
    lines = [f"checkpoints of job {storage.job_name!r}{run} in {storage.location()}"]
    return lines + _table([summarize(storage, cid) for cid in ids])


def _table(summaries: list[CheckpointSummary]) -> list[str]:
    lines = [f"{'id':>6}  {'completed (UTC)':<19}  {'size':>10}  {'subtasks':>8}  final"]
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
