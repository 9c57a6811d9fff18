"""Savepoints: a completed checkpoint written out as a self-contained directory.

A savepoint is taken like any checkpoint of its run (an id from the run's counter, an
aligned barrier, the run's commit point first: the run's own restarts and sink commits
treat it as a checkpoint), and then copied into its own directory::

    <target>/savepoint-<checkpoint id>-<random>/
        a<attempt>-v<vertex>-s<subtask>.state   every subtask's state blob
        _metadata                               written last and atomically: the savepoint
                                                exists exactly when it does

The metadata names its blobs by file name only, so the directory can be moved or copied
anywhere (another disk, another bucket) and still restores: :func:`load_savepoint`
resolves the names against wherever the directory is now. It also names the job, the run
and the checkpoint id it was taken from (a savepoint belongs to one run); a job restored
from it is a new run with ids above it, never confused with the original.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.checkpoint.storage import METADATA, CheckpointStorage, _Files, _resolve_root
from rayflow.errors import SavepointError

__all__ = [
    "SavepointError",
    "savepoint_directory",
    "write_savepoint",
    "export_checkpoint",
    "load_savepoint",
    "is_savepoint",
]

SubtaskKey = tuple[int, int]


class _Directory(_Files):
    def __init__(self, path: str, options: dict[str, Any] | None) -> None:
        self.path = path.rstrip("/")
        self.fs, self.base = _resolve_root(self.path, dict(options or {}))


def savepoint_directory(target: str, checkpoint_id: int) -> str:
    """A new savepoint's directory under ``target`` (Flink's ``savepoint-...`` names)."""
    return f"{target.rstrip('/')}/savepoint-{checkpoint_id}-{uuid.uuid4().hex[:8]}"


def _blob_file(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2]


def write_savepoint(
    directory: str,
    metadata: CheckpointMetadata,
    blobs: Mapping[SubtaskKey, bytes] | Callable[[SubtaskKey], bytes],
    options: dict[str, Any] | None = None,
) -> str:
    """Write the savepoint of ``metadata`` (a completed checkpoint) with the blobs of its
    subtasks into ``directory``: blobs first, the metadata last. Returns ``directory``.
    ``blobs`` maps a subtask to its blob, or is a function asked for one blob at a time
    (then one blob at a time is in memory, however large the state).

    Idempotent: a write into a directory that holds a part of this savepoint (a writer
    died in it) writes it whole, and one that holds this savepoint already (a writer died
    after its last step) leaves it. Another savepoint there is refused."""
    target = _Directory(directory, options)
    if target._exists(f"{target.base}/{METADATA}"):
        try:
            there = CheckpointMetadata.from_bytes(target._read(f"{target.base}/{METADATA}"))
        except Exception:  # noqa: BLE001 - unreadable: not this savepoint
            there = None
        if (
            there is not None
            and there.savepoint
            and there.run_id == metadata.run_id
            and there.checkpoint_id == metadata.checkpoint_id
            and there.job_name == metadata.job_name
        ):
            return directory
        raise SavepointError(f"{directory}: another savepoint is there already")
    target.fs.create_dir(target.base, recursive=True)
    subtasks = {}
    for key, entry in metadata.subtasks.items():
        name = _blob_file(entry.path)
        data = blobs(key) if callable(blobs) else blobs[key]
        with target.fs.open_output_stream(f"{target.base}/{name}") as out:
            out.write(data)
        del data
        subtasks[key] = dataclasses.replace(entry, path=name)
    saved = dataclasses.replace(metadata, subtasks=subtasks, savepoint=True, blob_storage=None)
    target._write_atomic(target.base, METADATA, saved.to_bytes())
    return directory


def export_checkpoint(
    storage: CheckpointStorage,
    metadata: CheckpointMetadata,
    directory: str,
    options: dict[str, Any] | None = None,
) -> str:
    """Write the savepoint of completed checkpoint ``metadata`` of ``storage`` (its blobs
    read back from there) into ``directory``; returns ``directory``."""
    source = metadata.blob_storage or storage
    return write_savepoint(
        directory, metadata, lambda key: source.read_blob(metadata.subtasks[key].path), options
    )


def is_savepoint(path: str, options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` is a directory with a savepoint's (or a checkpoint's) metadata in it."""
    target = _Directory(path, options)
    return target._exists(f"{target.base}/{METADATA}")


def load_savepoint(path: str, options: dict[str, Any] | None = None) -> CheckpointMetadata:
    """The metadata of the savepoint in ``path``, its blobs resolved against ``path`` (where
    the savepoint is now) and read through its own storage."""
    target = _Directory(path, options)
    where = f"savepoint {path}"
    if not target._exists(f"{target.base}/{METADATA}"):
        raise FileNotFoundError(f"{path}: no savepoint here (no {METADATA} in it)")
    data = target._read(f"{target.base}/{METADATA}")
    meta = CheckpointMetadata.from_bytes(data, where)
    subtasks = {
        key: dataclasses.replace(entry, path=f"{target.base}/{entry.path}")
        if "/" not in entry.path
        else entry
        for key, entry in meta.subtasks.items()
    }
    storage = CheckpointStorage(target.path, meta.job_name, options, base=target.path)
    return dataclasses.replace(meta, subtasks=subtasks, blob_storage=storage)
