"""The durable tier of checkpoint storage, on any ``pyarrow.fs`` filesystem.

Layout under ``<root>/<job name>/``::

    chk-<n>/<vertex>-<subtask>.state   one snapshot blob per subtask (written by the subtask)
    chk-<n>/_metadata                  the commit point, written last and atomically

A checkpoint exists exactly when its ``_metadata`` exists: on a local
filesystem it is written to a temporary name and renamed; on an object store a
single PUT is atomic. Blobs of a checkpoint without metadata are garbage.
"""

from __future__ import annotations

import pickle
import re
import uuid
from typing import Any

import pyarrow.fs as pafs

METADATA = "_metadata"
_CHK = re.compile(r"^chk-(\d+)$")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "job"


class CheckpointStorage:
    """Reads and writes one job's checkpoints. Picklable: it travels to every subtask."""

    def __init__(self, root: str, job_name: str, options: dict[str, Any] | None = None) -> None:
        self.root = root
        self.job_name = job_name
        self.options = dict(options or {})
        self._fs: pafs.FileSystem | None = None
        self._base: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "job_name": self.job_name, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], state["job_name"], state["options"])

    # --- filesystem -----------------------------------------------------------------------

    def _resolve(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            root = self.root
            if root.startswith("s3://"):
                path = root[len("s3://") :]
                fs: pafs.FileSystem = pafs.S3FileSystem(**self.options)
            elif "://" in root:
                fs, path = pafs.FileSystem.from_uri(root)
            else:
                import os

                fs, path = pafs.LocalFileSystem(), os.path.abspath(root)
            self._fs = fs
            self._base = f"{path.rstrip('/')}/{_safe(self.job_name)}"
        return self._fs, self._base  # type: ignore[return-value]

    @property
    def is_local(self) -> bool:
        return isinstance(self._resolve()[0], pafs.LocalFileSystem)

    def checkpoint_dir(self, checkpoint_id: int) -> str:
        return f"{self._resolve()[1]}/chk-{checkpoint_id}"

    def location(self) -> str:
        return self._resolve()[1]

    # --- blobs ----------------------------------------------------------------------------

    def write_blob(self, checkpoint_id: int, name: str, data: bytes) -> str:
        fs, _ = self._resolve()
        directory = self.checkpoint_dir(checkpoint_id)
        fs.create_dir(directory, recursive=True)
        path = f"{directory}/{name}"
        with fs.open_output_stream(path) as out:
            out.write(data)
        return path

    def read_blob(self, path: str) -> bytes:
        fs, _ = self._resolve()
        with fs.open_input_stream(path) as stream:
            return stream.read()

    # --- metadata: the commit point --------------------------------------------------------

    def commit_metadata(self, checkpoint_id: int, metadata: dict[str, Any]) -> str:
        """Write the metadata of ``checkpoint_id`` atomically; after this it exists."""
        fs, _ = self._resolve()
        directory = self.checkpoint_dir(checkpoint_id)
        fs.create_dir(directory, recursive=True)
        final = f"{directory}/{METADATA}"
        data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        if self.is_local:
            temp = f"{directory}/.{METADATA}.{uuid.uuid4().hex}.tmp"
            with fs.open_output_stream(temp) as out:
                out.write(data)
            fs.move(temp, final)
        else:
            with fs.open_output_stream(final) as out:
                out.write(data)
        return final

    def load_metadata(self, checkpoint_id: int) -> dict[str, Any]:
        return pickle.loads(self.read_blob(f"{self.checkpoint_dir(checkpoint_id)}/{METADATA}"))

    def completed_ids(self) -> list[int]:
        """Ids of the checkpoints whose metadata exists, ascending."""
        fs, base = self._resolve()
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        except FileNotFoundError:
            return []
        ids = []
        for info in infos:
            match = _CHK.match(info.base_name)
            if match and info.type == pafs.FileType.Directory:
                meta = fs.get_file_info(f"{info.path}/{METADATA}")
                if meta.type == pafs.FileType.File:
                    ids.append(int(match.group(1)))
        return sorted(ids)

    def latest(self) -> dict[str, Any] | None:
        ids = self.completed_ids()
        return self.load_metadata(ids[-1]) if ids else None

    def discard(self, checkpoint_id: int) -> None:
        """Delete a checkpoint: its metadata first, so a discard cut short never leaves a
        'completed' checkpoint whose blobs are gone."""
        fs, _ = self._resolve()
        directory = self.checkpoint_dir(checkpoint_id)
        for delete, path in (
            (fs.delete_file, f"{directory}/{METADATA}"),
            (fs.delete_dir, directory),
        ):
            try:
                delete(path)
            except (FileNotFoundError, OSError):
                pass


def open_checkpoint_path(
    path: str, options: dict[str, Any] | None = None
) -> tuple[CheckpointStorage, int | None]:
    """A storage for a path given by a user: a job directory or one ``chk-<n>`` in it."""
    path = path.rstrip("/")
    tail = path.rsplit("/", 1)
    if len(tail) == 2 and _CHK.match(tail[1]):
        job_dir, checkpoint = tail[0], int(_CHK.match(tail[1]).group(1))
    else:
        job_dir, checkpoint = path, None
    root, _, job = job_dir.rpartition("/")
    storage = CheckpointStorage(root or ".", job, options)
    return storage, checkpoint
