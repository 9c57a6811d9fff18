"""What a completed checkpoint says about itself: the versioned ``CheckpointMetadata``.

The metadata file is a checkpoint's commit point (see :mod:`rayflow.checkpoint.storage`).
It names the job, the run and the attempt that wrote it, so a restart can tell its own
run's checkpoints from another run's, and it lists every subtask's state blob by its
exact path (paths carry the attempt: a late write of an older attempt never lands on a
blob this metadata refers to).

The file holds a pickled dict of plain values plus the sources' split objects, with a
``format_version``; :meth:`CheckpointMetadata.from_dict` reads every version this code
knows and refuses the rest with a clear error instead of a pickle traceback.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "CheckpointMetadata",
    "SubtaskStateMeta",
    "UnsupportedMetadataVersion",
]

#: Version 1 had no version field, no run id and blobs without the attempt in their name;
#: version 2 no savepoints (blob paths relative to the savepoint) and no stateful uids.
FORMAT_VERSION = 3

SubtaskKey = tuple[int, int]


class UnsupportedMetadataVersion(ValueError):
    """A checkpoint written by a newer (or unknown) format."""


@dataclass(frozen=True)
class SubtaskStateMeta:
    """One subtask's snapshot in a checkpoint."""

    path: str
    size: int
    uids: tuple[str, ...]
    parallelism: int
    vertex: str
    #: bytes of in-flight data saved with an unaligned snapshot (0: aligned)
    channel_state_size: int = 0
    #: record batches of in-flight data (a batch may have 0 bytes: null columns)
    channel_state_batches: int = 0
    #: the uids whose operators had state (None: not recorded, count every uid)
    stateful_uids: tuple[str, ...] | None = None
    #: the uids whose operators had keyed state (cut into key groups by max parallelism)
    keyed_uids: tuple[str, ...] = ()
    #: the vertex's max parallelism when it was taken (None: not recorded)
    max_parallelism: int | None = None

    @property
    def uids_with_state(self) -> tuple[str, ...]:
        return self.uids if self.stateful_uids is None else self.stateful_uids


@dataclass(frozen=True)
class CheckpointMetadata:
    checkpoint_id: int
    job_name: str
    run_id: str | None
    attempt: int
    trigger_time: float
    completed_at: float
    final: bool
    subtasks: dict[SubtaskKey, SubtaskStateMeta] = field(default_factory=dict)
    source_splits: dict[str, list[Any]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: operator uid -> the operator's name (for people; absent in older checkpoints)
    operator_names: dict[str, str] = field(default_factory=dict)
    #: a savepoint: self-contained, its blob paths relative to its own directory
    savepoint: bool = False
    #: where the blobs are read from when not from the restoring run's storage (a
    #: savepoint's directory); set when loaded, never written
    blob_storage: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return sum(s.size for s in self.subtasks.values())

    @property
    def has_channel_state(self) -> bool:
        return any(s.channel_state_size or s.channel_state_batches for s in self.subtasks.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "checkpoint_id": self.checkpoint_id,
            "job_name": self.job_name,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "trigger_time": self.trigger_time,
            "completed_at": self.completed_at,
            "final": self.final,
            "subtasks": {
                key: {
                    "path": s.path,
                    "size": s.size,
                    "uids": list(s.uids),
                    "parallelism": s.parallelism,
                    "vertex": s.vertex,
                    "channel_state_size": s.channel_state_size,
                    "channel_state_batches": s.channel_state_batches,
                    "stateful_uids": (
                        list(s.stateful_uids) if s.stateful_uids is not None else None
                    ),
                    "keyed_uids": list(s.keyed_uids),
                    "max_parallelism": s.max_parallelism,
                }
                for key, s in self.subtasks.items()
            },
            "source_splits": self.source_splits,
            "operator_names": self.operator_names,
            "savepoint": self.savepoint,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "checkpoint") -> CheckpointMetadata:
        if not isinstance(raw, dict):
            raise UnsupportedMetadataVersion(f"{where}: metadata is not a rayflow checkpoint")
        version = raw.get("format_version", 1)
        if version not in range(1, FORMAT_VERSION + 1):
            raise UnsupportedMetadataVersion(
                f"{where}: metadata format version {version} is not supported by this rayflow "
                f"(it reads versions 1..{FORMAT_VERSION}); restore it with the rayflow that "
                "wrote it"
            )
        try:
            return cls(
                checkpoint_id=int(raw["checkpoint_id"]),
                job_name=raw.get("job_name", ""),
                run_id=raw.get("run_id"),
                attempt=int(raw.get("attempt", 0)),
                trigger_time=float(raw.get("trigger_time", 0.0)),
                completed_at=float(raw.get("completed_at", 0.0)),
                final=bool(raw.get("final", False)),
                subtasks={
                    tuple(key): SubtaskStateMeta(
                        path=e["path"],
                        size=int(e["size"]),
                        uids=tuple(e["uids"]),
                        parallelism=int(e["parallelism"]),
                        vertex=e.get("vertex", ""),
                        channel_state_size=int(e.get("channel_state_size", 0)),
                        channel_state_batches=int(e.get("channel_state_batches", 0)),
                        stateful_uids=(
                            tuple(e["stateful_uids"])
                            if e.get("stateful_uids") is not None
                            else None
                        ),
                        keyed_uids=tuple(e.get("keyed_uids") or ()),
                        max_parallelism=(
                            int(e["max_parallelism"])
                            if e.get("max_parallelism") is not None
                            else None
                        ),
                    )
                    for key, e in raw.get("subtasks", {}).items()
                },
                source_splits=dict(raw.get("source_splits", {})),
                format_version=FORMAT_VERSION,
                operator_names=dict(raw.get("operator_names") or {}),
                savepoint=bool(raw.get("savepoint", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedMetadataVersion(
                f"{where}: metadata is incomplete or malformed ({type(exc).__name__}: {exc})"
            ) from None

    def to_bytes(self) -> bytes:
        return pickle.dumps(self.to_dict(), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "checkpoint") -> CheckpointMetadata:
        try:
            raw = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
            raise UnsupportedMetadataVersion(
                f"{where}: metadata cannot be read ({type(exc).__name__}: {exc})"
            ) from None
        return cls.from_dict(raw, where)
