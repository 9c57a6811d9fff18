"""The durable tier of checkpoint storage, on any ``pyarrow.fs`` filesystem.

Every execution of a job is a *run* with its own id and its own directory::

    <root>/<job name>/<run id>/
        _checkpoint_ids                    high-water mark of reserved checkpoint ids
        _job_state                         the run's supervisor state (restarts, attempt)
        _source_splits_<source uid>        the splits a source was first cut into (once a run)
        chk-<n>/a<attempt>-v<vertex>-s<subtask>.state   one blob per subtask and attempt
        chk-<n>/_metadata                  the commit point, written last and atomically

A checkpoint exists exactly when its ``_metadata`` exists: on a local filesystem it
is written to a temporary name, fsynced, renamed and the directory fsynced; on an
object store a single PUT is atomic. Blobs of a checkpoint without metadata are
garbage, collected by :meth:`CheckpointStorage.collect_garbage`.

Runs never share a directory, so two runs of one job name (a rerun, or two at once)
never share checkpoint ids, blobs or retention. Within a run, ids come from a durable
counter (:meth:`CheckpointStorage.reserve_ids`) and are never reused, not even after
the job master dies; a new run starts its ids above every id in the job's storage.
Run ids sort by start time.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import re
import uuid
from typing import Any

import pyarrow.fs as pafs

from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.durability import fsync_dir

__all__ = [
    "CheckpointStorage",
    "JobStorage",
    "new_run_id",
    "open_checkpoint_path",
    "METADATA",
]

METADATA = "_metadata"
ID_COUNTER = "_checkpoint_ids"
JOB_STATE = "_job_state"
#: ``_source_splits_<source uid>``: the splits a source was first cut into in a run
SOURCE_SPLITS = "_source_splits_"
_CHK = re.compile(r"^chk-(\d+)$")
_RUN = re.compile(r"^run-\d{8}T\d{6}-[0-9a-f]+$")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "job"


def new_run_id() -> str:
    """``run-<UTC start time>-<random>``: unique, and sorted by start time."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"run-{now}-{uuid.uuid4().hex[:8]}"


def _resolve_root(root: str, options: dict[str, Any]) -> tuple[pafs.FileSystem, str]:
    if root.startswith("s3://"):
        return pafs.S3FileSystem(**options), root[len("s3://") :].rstrip("/")
    if "://" in root:
        fs, path = pafs.FileSystem.from_uri(root)
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(root)


class _Files:
    """Small filesystem helpers shared by a job's and a run's storage."""

    fs: pafs.FileSystem

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def _list_dirs(self, base: str, pattern: re.Pattern[str]) -> list[pafs.FileInfo]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        except FileNotFoundError:
            return []
        return [
            i for i in infos if i.type == pafs.FileType.Directory and pattern.match(i.base_name)
        ]

    def _write_atomic(self, directory: str, name: str, data: bytes) -> str:
        """Write ``directory/name`` so that readers see all of it or none of it, durably."""
        self.fs.create_dir(directory, recursive=True)
        final = f"{directory}/{name}"
        if self.is_local:
            temp = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, final)
            fsync_dir(directory)
        else:
            with self.fs.open_output_stream(final) as out:
                out.write(data)
        return final

    def _read(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as stream:
            return stream.read()

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.File


class CheckpointStorage(_Files):
    """Reads and writes the checkpoints of one run. Picklable: it travels to every subtask.

    ``run_id=None`` addresses a directory of checkpoints directly under the job
    (checkpoints written before runs had directories), for reading and restoring.
    """

    def __init__(
        self,
        root: str,
        job_name: str,
        options: dict[str, Any] | None = None,
        run_id: str | None = None,
        base: str | None = None,
    ) -> None:
        self.root = root
        self.job_name = job_name
        self.run_id = run_id
        self.options = dict(options or {})
        self._explicit_base = base
        self._fs: pafs.FileSystem | None = None
        self._base: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "job_name": self.job_name,
            "options": self.options,
            "run_id": self.run_id,
            "base": self._explicit_base,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(
            state["root"], state["job_name"], state["options"], state["run_id"], state["base"]
        )

    # --- filesystem -----------------------------------------------------------------------

    def _resolve(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            fs, path = _resolve_root(self.root, self.options)
            self._fs = fs
            if self._explicit_base is not None:
                self._base = _resolve_root(self._explicit_base, self.options)[1]
            else:
                self._base = f"{path}/{_safe(self.job_name)}"
                if self.run_id is not None:
                    self._base = f"{self._base}/{self.run_id}"
        return self._fs, self._base  # type: ignore[return-value]

    @property
    def fs(self) -> pafs.FileSystem:  # type: ignore[override]
        return self._resolve()[0]

    def checkpoint_dir(self, checkpoint_id: int) -> str:
        return f"{self._resolve()[1]}/chk-{checkpoint_id}"

    def location(self) -> str:
        """The run's directory."""
        return self._resolve()[1]

    # --- blobs ----------------------------------------------------------------------------

    @staticmethod
    def blob_name(attempt: int, vertex_id: int, subtask: int) -> str:
        """Blob names carry the attempt: a slow write of an older attempt never replaces a
        blob that a newer attempt's checkpoint refers to."""
        return f"a{attempt}-v{vertex_id}-s{subtask}.state"

    def write_blob(self, checkpoint_id: int, name: str, data: bytes) -> str:
        fs = self.fs
        directory = self.checkpoint_dir(checkpoint_id)
        fs.create_dir(directory, recursive=True)
        path = f"{directory}/{name}"
        if self.is_local:
            with open(path, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        else:
            with fs.open_output_stream(path) as out:
                out.write(data)
        return path

    def read_blob(self, path: str) -> bytes:
        return self._read(path)

    # --- metadata: the commit point --------------------------------------------------------

    def commit_metadata(self, checkpoint_id: int, metadata: CheckpointMetadata) -> str:
        """Write the metadata of ``checkpoint_id`` atomically and durably; after this it
        exists."""
        return self._write_atomic(self.checkpoint_dir(checkpoint_id), METADATA, metadata.to_bytes())

    def load_metadata(self, checkpoint_id: int) -> CheckpointMetadata:
        where = self.checkpoint_dir(checkpoint_id)
        return CheckpointMetadata.from_bytes(self._read(f"{where}/{METADATA}"), where)

    def checkpoint_ids(self) -> list[int]:
        """Ids of every checkpoint directory (completed or not), ascending."""
        _, base = self._resolve()
        return sorted(int(_CHK.match(i.base_name).group(1)) for i in self._list_dirs(base, _CHK))

    def completed_ids(self) -> list[int]:
        """Ids of the checkpoints whose metadata exists, ascending."""
        return [
            c for c in self.checkpoint_ids() if self._exists(f"{self.checkpoint_dir(c)}/{METADATA}")
        ]

    def latest(self) -> CheckpointMetadata | None:
        ids = self.completed_ids()
        return self.load_metadata(ids[-1]) if ids else None

    def discard(self, checkpoint_id: int) -> None:
        """Delete a checkpoint: its metadata first, so a discard cut short never leaves a
        'completed' checkpoint whose blobs are gone."""
        fs = self.fs
        directory = self.checkpoint_dir(checkpoint_id)
        for delete, path in (
            (fs.delete_file, f"{directory}/{METADATA}"),
            (fs.delete_dir, directory),
        ):
            try:
                delete(path)
            except (FileNotFoundError, OSError):
                pass

    def collect_garbage(self, retained: list[int], in_flight: int | None = None) -> list[int]:
        """Delete every checkpoint directory below the newest retained one that is not
        retained: subsumed checkpoints, and directories of aborted checkpoints that late
        blob writes created again. Returns the ids deleted."""
        if not retained:
            return []
        newest, keep = max(retained), set(retained)
        dropped = [
            c for c in self.checkpoint_ids() if c < newest and c not in keep and c != in_flight
        ]
        for c in dropped:
            self.discard(c)
        return dropped

    # --- checkpoint ids: never reused --------------------------------------------------------

    def id_mark(self) -> int:
        """The highest checkpoint id reserved in this run so far (0 when none)."""
        path = f"{self.location()}/{ID_COUNTER}"
        try:
            return int(self._read(path).decode().strip() or 0)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            if "not found" in str(exc).lower() or "no such" in str(exc).lower():
                return 0
            raise

    def reserve_ids(self, up_to: int) -> None:
        """Durably record that ids up to ``up_to`` are taken: a job master started later
        in this run begins above them."""
        self._write_atomic(self.location(), ID_COUNTER, str(int(up_to)).encode())

    # --- the run's supervisor state ----------------------------------------------------------

    def write_job_state(self, state: Any) -> None:
        self._write_atomic(
            self.location(), JOB_STATE, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        )

    def read_job_state(self) -> Any | None:
        path = f"{self.location()}/{JOB_STATE}"
        if not self._exists(path):
            return None
        return pickle.loads(self._read(path))

    # --- the run's source splits as first cut ------------------------------------------------

    def write_source_splits(self, source_uid: str, splits: list[Any]) -> None:
        """Record the splits a source was first cut into in this run (before anything read
        them): a job master started later in the run deploys these, not a new cut."""
        self._write_atomic(
            self.location(),
            f"{SOURCE_SPLITS}{_safe(source_uid)}",
            pickle.dumps(splits, protocol=pickle.HIGHEST_PROTOCOL),
        )

    def read_source_splits(self, source_uid: str) -> list[Any] | None:
        path = f"{self.location()}/{SOURCE_SPLITS}{_safe(source_uid)}"
        if not self._exists(path):
            return None
        return pickle.loads(self._read(path))


class JobStorage(_Files):
    """Every run of one job name under a checkpoint root."""

    def __init__(self, root: str, job_name: str, options: dict[str, Any] | None = None) -> None:
        self.root = root
        self.job_name = job_name
        self.options = dict(options or {})
        self.fs, path = _resolve_root(root, self.options)
        self.base = f"{path}/{_safe(job_name)}"

    def run(self, run_id: str) -> CheckpointStorage:
        return CheckpointStorage(self.root, self.job_name, self.options, run_id)

    def runs(self) -> list[CheckpointStorage]:
        """Every run directory of the job, oldest first, plus the job directory itself
        when it holds checkpoints of the format before runs had directories."""
        names = sorted(i.base_name for i in self._list_dirs(self.base, _RUN))
        runs = [self.run(name) for name in names]
        if self._list_dirs(self.base, _CHK):
            runs.insert(0, CheckpointStorage(self.root, self.job_name, self.options))
        return runs

    def location(self) -> str:
        return self.base

    def prune_runs(self, keep: int, protected: set[str | None]) -> list[str]:
        """Delete the oldest run directories so that ``keep`` remain besides the
        ``protected`` ones (the starting run, the one it restores from) and the run
        holding the job's newest completed checkpoint; returns the run ids deleted."""
        newest = self.latest()
        protected = set(protected) | ({newest[0].run_id} if newest else set())
        runs = [r for r in self.runs() if r.run_id and r.run_id not in protected]
        doomed = runs[: max(0, len(runs) - keep)]
        for run in doomed:
            try:
                self.fs.delete_dir(run.location())
            except (FileNotFoundError, OSError):
                pass
        return [r.run_id for r in doomed]

    def max_checkpoint_id(self) -> int:
        """The highest checkpoint id any run of this job reserved or wrote."""
        best = 0
        for run in self.runs():
            ids = run.checkpoint_ids()
            best = max(best, ids[-1] if ids else 0, run.id_mark() if run.run_id else 0)
        return best

    def latest(self) -> tuple[CheckpointStorage, CheckpointMetadata] | None:
        """The newest completed checkpoint of this job across all runs (by completion time)."""
        best: tuple[CheckpointStorage, CheckpointMetadata] | None = None
        for run in self.runs():
            meta = run.latest()
            if meta is not None and (best is None or meta.completed_at > best[1].completed_at):
                best = (run, meta)
        return best


def open_checkpoint_path(
    path: str, options: dict[str, Any] | None = None
) -> tuple[CheckpointStorage | JobStorage, int | None]:
    """Storage for a path a user gave: one ``chk-<n>``, a run directory, or a job directory
    (whose runs are searched for the newest completed checkpoint)."""
    path = path.rstrip("/")
    parent, _, tail = path.rpartition("/")
    match = _CHK.match(tail)
    if match:
        return _storage_at(parent, options), int(match.group(1))
    if _RUN.match(tail):
        return _storage_at(path, options), None
    root, _, job = path.rpartition("/")
    jobs = JobStorage(root or ".", job, options)
    if jobs.fs.get_file_info(jobs.base).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{path}: no completed checkpoint found (no such directory)")
    return jobs, None


def _storage_at(directory: str, options: dict[str, Any] | None) -> CheckpointStorage:
    """A run's storage at an exact directory (a run directory, or an old job directory)."""
    root, _, name = directory.rpartition("/")
    if _RUN.match(name):
        job_root, _, job = root.rpartition("/")
        return CheckpointStorage(job_root or ".", job, options, run_id=name)
    return CheckpointStorage(root or ".", name, options, base=directory)
