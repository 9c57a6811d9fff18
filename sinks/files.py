"""A file sink on ``pyarrow.fs``: hidden in-progress files, published by an atomic rename.

``FileSink(path, format)`` writes each subtask's records into part files under the
directory ``path`` (a local path, or any URI ``pyarrow.fs`` understands such as
``s3://bucket/prefix``; or pass a ``filesystem`` and a path inside it).

One transaction is one part file. It is written as a hidden file (leading dot, so
``pyarrow.dataset`` and most readers skip it) and renamed to its final name when
the transaction commits::

    .part-<job>_<uid>_<subtask:04d>-<run>-<sequence:08d>.<ext>.a<attempt>-<random>.inprogress
        -> part-<job>_<uid>_<subtask:04d>-<run>-<sequence:08d>.<ext>

Final names are deterministic: within one job, listing a directory in name order
gives the committed output in subtask order, then run by run (``<run>`` is the run id,
which sorts by start time), then in the order each subtask wrote it. The job name and
operator uid in the name keep two jobs (or two sinks) writing into one directory apart
(a short hash is added where a name had to be shortened or had characters other than
``[A-Za-z0-9-]``). The run in the name keeps runs apart: a job run again under the same
name into the same directory writes new part files next to the earlier run's, never
over some of them; a run restored from an earlier one continues with its own names.

* The file is opened at the first write, so an empty transaction leaves no file.
* ``pre_commit`` closes the encoder (the Parquet footer), closes the file and, on a
  local filesystem, fsyncs it and its directory: a pre-committed part survives a
  killed process and a crashed machine. The committable is a
  :class:`FileCommittable`: paths, size, a random token of the transaction and, on a
  local filesystem, the file's identity (see below).
* ``commit`` renames the in-progress file to its final name (atomic on a local
  filesystem) and answers COMMITTED. It is idempotent: when the in-progress file is
  gone and the final file is the one this transaction wrote, it answers
  ALREADY_COMMITTED. When the final file is another one (of any size: the same job
  run again under its name, a replay) it answers FAILED, and so it does when neither
  exists (the pre-committed data is gone); an I/O error answers RETRY_LATER. Used
  directly (``sink.commit``), FAILED and RETRY_LATER raise.

How a repeated commit knows the final file is its own (a size alone cannot tell: a
job run again writes the same names, often with the same sizes):

* Local filesystem (also a ``SubTreeFileSystem`` over one): ``pre_commit`` records the
  in-progress file's ``st_dev``, ``st_ino`` and ``st_mtime_ns``; a rename keeps all
  three. The final file is ours when it has that inode, modification time and size,
  and that device where device numbers compare (on the machine, and in the boot, that
  pre-committed it; a directory shared over NFS, or a remount after a reboot, may show
  the same file under another device number).
* Other filesystems (``s3://``, ``gs://``, HDFS, ...): just before the move,
  ``commit`` writes the transaction's token into a hidden marker file
  ``.<final name>.committed`` next to the final file; the next transaction to commit
  that name overwrites it. The final file is ours when the marker holds our token and
  the size is the expected one. (It tells runs apart that commit one after another;
  two runs committing one name at the same moment can still race.) The markers stay,
  one per final name; readers skip them (leading dot).
* Committables of older versions (``(tmp_path, final_path, size)``) are still
  recognised by size only, with a warning. In checkpoints, committables are stored
  as JSON (:class:`FileCommittableSerializer`, version 1).
* After a restore, ``abort_lingering`` deletes this subtask's in-progress files that
  the restored checkpoint does not hold. In NONE mode (where the runtime may run
  without checkpoints and so never calls it) the first transaction of a subtask
  attempt's writer does the same: no checkpoint can refer to an uncommitted part there.

The sink object is configuration (path, format, filesystem); each subtask makes its
writer (the open part files) and committer from it.

Guarantees: EXACTLY_ONCE (parts are published only when the checkpoint that
pre-committed them completes), AT_LEAST_ONCE (published at every checkpoint barrier
and whenever a part rolls; a part rewritten on replay replaces the file of the same
name), NONE (published whenever a part rolls and at the end of input).

On an object store (``s3://``) ``pyarrow.fs``'s move is a copy and a delete, not an
atomic rename; for S3 prefer ``sinks.s3``, which publishes with a multipart upload.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs

from rayflow.durability import fsync_dir, fsync_file
from rayflow.guarantees import DeliveryGuarantee
from rayflow.sink import (
    CommitOutcome,
    CommittableSerializer,
    Committer,
    RollingPolicy,
    SinkContext,
    TransactionWriter,
    TwoPhaseCommittingSink,
)
from sinks.formats import FORMATS, Encoder, extension_of, open_encoder

__all__ = ["FileSink", "FileCommittable", "FileCommittableSerializer"]

log = logging.getLogger("rayflow.sinks.files")

IN_PROGRESS_SUFFIX = ".inprogress"
COMMITTED_MARKER_SUFFIX = ".committed"


class FileCommittable(NamedTuple):
    """A pre-committed part file: where it is, where it goes, how big it is, and what
    identifies it once committed (fields with defaults: committables pickled by older
    versions, 3-tuples, still load; they are recognised by size only)."""

    tmp_path: str
    final_path: str
    size: int
    #: A random id of this transaction (written into the commit marker off a local disk).
    token: str | None = None
    #: Local filesystem: ``(st_dev, st_ino, st_mtime_ns)`` of the pre-committed file.
    file_id: tuple[int, int, int] | None = None
    #: Local filesystem: the boot of the machine that took ``file_id`` (None: unknown).
    boot_id: str | None = None


@dataclass
class _PartFile:
    """An open transaction: one in-progress part file, opened at the first write."""

    tmp_path: str
    final_path: str
    stream: Any = None
    encoder: Encoder | None = None
    rows: int = 0
    size: int = 0
    closed: bool = False


class FileCommittableSerializer(CommittableSerializer[FileCommittable]):
    """Version 1: the committable's fields as JSON (no class names in checkpoints)."""

    version = 1

    def serialize(self, committable: FileCommittable) -> bytes:
        c = FileCommittable(*committable)
        return json.dumps(
            {
                "tmp_path": c.tmp_path,
                "final_path": c.final_path,
                "size": c.size,
                "token": c.token,
                "file_id": list(c.file_id) if c.file_id is not None else None,
                "boot_id": c.boot_id,
            },
            separators=(",", ":"),
        ).encode("utf-8")

    def deserialize(self, version: int, data: bytes) -> FileCommittable:
        d = json.loads(data)
        file_id = d.get("file_id")
        return FileCommittable(
            d["tmp_path"],
            d["final_path"],
            d["size"],
            token=d.get("token"),
            file_id=tuple(file_id) if file_id is not None else None,
            boot_id=d.get("boot_id"),
        )


class FileSink(TwoPhaseCommittingSink[_PartFile, FileCommittable]):
    """Writes part files into the directory ``path``; see the module docstring.

    ``format``: ``"jsonl"``, ``"csv"`` or ``"parquet"``. ``delivery_guarantee``: left
    open (None), each job gives the strongest its checkpointing allows (EXACTLY_ONCE
    with exactly-once checkpointing). ``rolling_policy``: when a part file is closed
    and the next begun (always at a checkpoint; also on size or age).
    ``filesystem``: a ``pyarrow.fs.FileSystem``; ``path`` is then a path inside it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        format: str = "jsonl",
        delivery_guarantee: DeliveryGuarantee | None = None,
        rolling_policy: RollingPolicy | None = None,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        super().__init__(delivery_guarantee, rolling_policy)
        if format not in FORMATS:
            raise ValueError(f"FileSink: format must be one of {FORMATS}, got {format!r}")
        self.format = format
        self.extension = extension_of(format)
        self.filesystem, self.directory = _resolve(path, filesystem)
        self._local = _local_root(self.filesystem)
        self._job_name: str | None = None
        if self._local is not None and os.path.isfile(self._local_path(self.directory)):
            raise ValueError(
                f"FileSink: path {path!r} is a file; it must be a directory (created when missing)"
            )

    # --- names ----------------------------------------------------------------------------

    def transaction_prefix(self, context: SinkContext) -> str:
        """``part-<job>_<uid>_<subtask:04d>-``.

        Job name and uid are reduced to ``[A-Za-z0-9-]`` as in the contract's prefix;
        where that loses something (other characters, a job name longer than 40) a short
        hash of the original is added, so that "job a" and "job-a", or two long names
        that share their first 40 characters, never share (and never abort) each other's
        files. ``_`` separates the parts, so no job/uid/subtask can be read as another
        (the contract's ``-`` joins "a" + "b-c" and "a-b" + "c" alike). The zero-padded
        subtask keeps name order = subtask order, and the trailing dash keeps subtask 1
        apart from subtask 11.
        """
        job = _name_part(context.job_name, 40) or "job"
        uid = _name_part(context.operator_uid, 80) or "sink"
        return f"part-{job}_{uid}_{context.subtask_index:04d}-"

    def _names(self, context: SinkContext, sequence: int) -> tuple[str, str]:
        run = f"{context.run_tag()}-" if context.run_id else ""
        name = f"{self.transaction_prefix(context)}{run}{sequence:08d}.{self.extension}"
        # The in-progress name is unique per opening (as in Flink): a subtask of a failed
        # attempt that is not dead yet can never write into its successor's file, even
        # when both open the same sequence number.
        token = f"a{context.attempt}-{uuid.uuid4().hex[:8]}"
        return (
            posixpath.join(self.directory, f".{name}.{token}{IN_PROGRESS_SUFFIX}"),
            posixpath.join(self.directory, name),
        )

    def _job_prefix(self, job_name: str) -> str:
        """The part of every file name that is the same for all sinks of one job."""
        return f"part-{_name_part(job_name, 40) or 'job'}_"

    # --- the driver ------------------------------------------------------------------------

    def setup(self, job_name: str, guarantee: Any = None) -> None:
        self._job_name = job_name
        self._make_dir()

    def merge_results(self, results: list[Any]) -> list[str]:
        """The committed part files of this job in ``path``, in name (= output) order."""
        prefix = self._job_prefix(self._job_name) if self._job_name is not None else "part-"
        return self.committed_files(prefix)

    def committed_files(self, prefix: str = "part-") -> list[str]:
        """Committed (visible) part files in ``path`` whose name starts with ``prefix``."""
        return sorted(
            info.path
            for info in self._list()
            if info.type is pafs.FileType.File
            and info.base_name.startswith(prefix)
            and info.base_name.endswith(f".{self.extension}")
        )

    def in_progress_files(self) -> list[str]:
        """Hidden in-progress part files in ``path`` (of any job)."""
        return sorted(
            info.path
            for info in self._list()
            if info.type is pafs.FileType.File
            and info.base_name.startswith(".part-")
            and info.base_name.endswith(IN_PROGRESS_SUFFIX)
        )

    # --- the subtask's parts ---------------------------------------------------------------

    def create_transaction_writer(self, context: SinkContext) -> _FileWriter:
        return _FileWriter(self, context)

    def create_committer(self, context: SinkContext | None) -> _FileCommitter:
        return _FileCommitter(self)

    def committable_serializer(self) -> FileCommittableSerializer:
        return FileCommittableSerializer()

    # --- helpers ---------------------------------------------------------------------------

    def _make_dir(self) -> None:
        self.filesystem.create_dir(self.directory, recursive=True)

    def _list(self) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.directory, allow_not_found=True, recursive=False)
        return self.filesystem.get_file_info(selector)

    def _delete(self, path: str) -> None:
        try:
            self.filesystem.delete_file(path)
        except FileNotFoundError:
            pass

    def _local_path(self, path: str) -> str:
        return os.path.join(self._local, path.lstrip("/")) if self._local else path

    def _abort_lingering(self, context: SinkContext, keep: Sequence[Any]) -> int:
        """Delete the in-progress files of subtask ``context`` not in ``keep``
        (committables, plain tuples of older versions, or open parts)."""
        prefix = f".{self.transaction_prefix(context)}"
        kept = {c.tmp_path if isinstance(c, _PartFile) else c[0] for c in keep}
        aborted = 0
        for info in self._list():
            name = info.base_name
            if (
                info.type is pafs.FileType.File
                and name.startswith(prefix)
                and name.endswith(IN_PROGRESS_SUFFIX)
                and info.path not in kept
            ):
                context.check_fence(f"FileSink: delete of {name}")
                self._delete(info.path)
                aborted += 1
        return aborted

    def __repr__(self) -> str:
        return (
            f"FileSink({self.directory!r}, format={self.format!r}, "
            f"delivery_guarantee={self.delivery_guarantee.name})"
        )


class _FileWriter(TransactionWriter[_PartFile, FileCommittable]):
    """One subtask's part files: opened at the first write, pre-committed by closing and
    syncing them."""

    def __init__(self, sink: FileSink, context: SinkContext) -> None:
        self.sink = sink
        self.context = context
        self.guarantee = sink.guarantee_in(context)
        self._open: dict[str, _PartFile] = {}
        self._swept = False
        self._dir_ready = False

    def begin_transaction(self, sequence: int) -> _PartFile:
        if self.guarantee is DeliveryGuarantee.NONE and not self._swept:
            # Without checkpoints the runtime never calls abort_lingering, so parts left
            # open by a failed attempt would stay forever. In NONE mode no checkpoint can
            # refer to an uncommitted part: every in-progress file of this subtask that
            # this writer did not open is garbage.
            self._swept = True
            dropped = self.sink._abort_lingering(self.context, list(self._open.values()))
            if dropped:
                log.info("FileSink: dropped %d in-progress part(s) of an earlier attempt", dropped)
        tmp_path, final_path = self.sink._names(self.context, sequence)
        return _PartFile(tmp_path, final_path)

    def write(self, transaction: _PartFile, batch: pa.RecordBatch) -> None:
        if transaction.closed:
            raise RuntimeError(f"FileSink: part {transaction.tmp_path} is already closed")
        if batch.num_rows == 0:
            return
        if transaction.stream is None:
            if not self._dir_ready:
                self.sink._make_dir()
                self._dir_ready = True
            self.context.check_fence(f"FileSink: open of {transaction.tmp_path}")
            # compression=None: never guess a codec from the file name.
            transaction.stream = self.sink.filesystem.open_output_stream(
                transaction.tmp_path, compression=None
            )
            self._open[transaction.tmp_path] = transaction
            transaction.encoder = open_encoder(self.sink.format, transaction.stream)
        transaction.encoder.write(batch)
        transaction.rows += batch.num_rows
        transaction.size = transaction.stream.tell()

    def transaction_size(self, transaction: _PartFile) -> int:
        return transaction.size

    def is_empty(self, transaction: _PartFile) -> bool:
        return transaction.rows == 0

    def pre_commit(
        self, transaction: _PartFile, checkpoint_id: int | None = None
    ) -> FileCommittable:
        if transaction.stream is None:
            raise RuntimeError(
                f"FileSink: nothing was written into {transaction.tmp_path}; an empty "
                "transaction is aborted, not pre-committed"
            )
        transaction.encoder.close()  # the Parquet footer; flushes the stream
        size = transaction.stream.tell()
        transaction.stream.close()
        transaction.closed = True
        self._open.pop(transaction.tmp_path, None)
        file_id = boot_id = None
        sink = self.sink
        if sink._local is not None:
            local_tmp = sink._local_path(transaction.tmp_path)
            fsync_file(local_tmp)
            fsync_dir(sink._local_path(sink.directory))
            st = os.stat(local_tmp)  # a rename keeps device, inode and mtime
            file_id, boot_id = (st.st_dev, st.st_ino, st.st_mtime_ns), _boot_id()
        return FileCommittable(
            transaction.tmp_path,
            transaction.final_path,
            size,
            token=uuid.uuid4().hex,
            file_id=file_id,
            boot_id=boot_id,
        )

    def abort_transaction(self, transaction: _PartFile) -> None:
        self._open.pop(transaction.tmp_path, None)
        if transaction.stream is not None and not transaction.closed:
            try:
                # Close the encoder too, or a Parquet writer complains when collected.
                transaction.encoder.close()
                transaction.stream.close()
            except Exception:  # noqa: BLE001 - the file is deleted next
                pass
        transaction.closed = True
        if transaction.stream is not None:
            self.sink._delete(transaction.tmp_path)

    def close(self) -> None:
        """Drops the parts still open in this subtask: they were never pre-committed, so no
        checkpoint can refer to them."""
        for transaction in list(self._open.values()):
            try:
                self.abort_transaction(transaction)
            except Exception as exc:  # noqa: BLE001 - abort_lingering removes it later
                log.warning("FileSink: could not drop %s: %s", transaction.tmp_path, exc)
        self._open.clear()


class _FileCommitter(Committer[FileCommittable]):
    """Publishes part files by renaming them; recognises its own committed parts by
    inode (local) or commit marker (elsewhere)."""

    def __init__(self, sink: FileSink) -> None:
        self.sink = sink
        self.filesystem = sink.filesystem

    def commit(self, committable: FileCommittable) -> CommitOutcome:
        committable = FileCommittable(*committable)  # a plain tuple of an older version too
        tmp_path, final_path, size = committable[:3]
        try:
            tmp, final = self.filesystem.get_file_info([tmp_path, final_path])
            if tmp.type is pafs.FileType.File:
                if final.type is pafs.FileType.File:
                    # A sequence number used again: a restore from an older checkpoint, or
                    # an at-least-once replay. The newer part replaces the older one.
                    log.warning("FileSink: %s exists; replacing it with %s", final_path, tmp_path)
                if self._uses_marker(committable):
                    # Before the move: a commit that dies after the move is still recognised.
                    self._write_marker(final_path, committable.token)
                self.filesystem.move(tmp_path, final_path)
                if self.sink._local is not None:
                    fsync_dir(self.sink._local_path(self.sink.directory))
                return CommitOutcome.committed()
            if final.type is pafs.FileType.File:
                problem = self._not_ours(committable, final)
                if problem is None:
                    return CommitOutcome.already_committed(f"{final_path} is this part")
                message = (
                    f"FileSink: cannot commit {final_path}: its in-progress file {tmp_path} is "
                    f"gone and {problem}; something else wrote that name (another job, or "
                    "another run of this job, with the same name into the same directory?), "
                    "so this transaction's output is not what is visible"
                )
                return CommitOutcome.failed(message, RuntimeError(message))
        except OSError as exc:  # storage unreachable or full for now: not decided
            return CommitOutcome.retry_later(f"{type(exc).__name__}: {exc}", exc)
        message = (
            f"FileSink: cannot commit {final_path}: neither it nor its in-progress file "
            f"{tmp_path} exists, so the pre-committed data ({size} bytes) was lost. Was the "
            "directory cleaned, or is it not shared by every node?"
        )
        return CommitOutcome.failed(message, RuntimeError(message))

    def _uses_marker(self, committable: FileCommittable) -> bool:
        """Whether ``committable`` is recognised by a commit marker (not by its inode)."""
        return committable.token is not None and committable.file_id is None

    def _marker_path(self, final_path: str) -> str:
        directory, name = posixpath.split(final_path)
        return posixpath.join(directory, f".{name}{COMMITTED_MARKER_SUFFIX}")

    def _write_marker(self, final_path: str, token: str) -> None:
        with self.filesystem.open_output_stream(
            self._marker_path(final_path), compression=None
        ) as out:
            out.write(token.encode("ascii"))

    def _read_marker(self, final_path: str) -> str | None:
        try:
            with self.filesystem.open_input_stream(
                self._marker_path(final_path), compression=None
            ) as stream:
                return stream.read().decode("ascii", errors="replace").strip()
        except FileNotFoundError:
            return None

    def _not_ours(self, committable: FileCommittable, final: pafs.FileInfo) -> str | None:
        """None when the final file is the one ``committable`` committed; else why not."""
        size = committable.size
        if final.size != size:
            return f"the final file has {final.size} bytes, not the {size} pre-committed"
        sink = self.sink
        if committable.file_id is not None and sink._local is not None:
            try:
                st = os.stat(sink._local_path(committable.final_path))
            except FileNotFoundError:
                return "the final file vanished while it was checked"
            dev, ino, mtime_ns = committable.file_id
            # Device numbers compare only on the machine, and in the boot, that took them.
            same_boot = committable.boot_id is not None and committable.boot_id == _boot_id()
            if st.st_ino != ino or st.st_mtime_ns != mtime_ns or (same_boot and st.st_dev != dev):
                return (
                    "the final file (of the same size) is another file than the one this "
                    f"transaction pre-committed (device {st.st_dev}, inode {st.st_ino}, "
                    f"mtime {st.st_mtime_ns} ns; expected device {dev}, inode {ino}, "
                    f"mtime {mtime_ns} ns)"
                )
            return None
        if self._uses_marker(committable):
            found = self._read_marker(committable.final_path)
            if found != committable.token:
                marker = self._marker_path(committable.final_path)
                holder = "does not exist" if found is None else f"holds transaction {found!r}"
                return (
                    f"its commit marker {marker} {holder}, not this transaction "
                    f"({committable.token}): the final file (of the same size) is another "
                    "transaction's"
                )
            return None
        log.warning(
            "FileSink: %s: %s; the final file is taken as committed before because its "
            "size matches, which cannot tell it from another transaction's file of the "
            "same size",
            committable.final_path,
            "the committable carries no identity of the file (it was pre-committed by an "
            "older version)"
            if committable.token is None
            else "the committable's file identity cannot be checked on this filesystem",
        )
        return None

    def abort(self, committable: FileCommittable) -> None:
        self.sink._delete(committable[0])

    def abort_lingering(self, context: SinkContext, keep: Sequence[FileCommittable]) -> int:
        return self.sink._abort_lingering(context, keep)

    def committable_id(self, committable: FileCommittable) -> str:
        return posixpath.basename(committable[1])


def _name_part(text: str, limit: int) -> str:
    """``text`` reduced to ``[A-Za-z0-9-]`` (at most ``limit`` characters), plus a hash of
    ``text`` when that reduction lost anything."""
    clean = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")
    if clean == text and len(clean) <= limit:
        return clean
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=4).hexdigest()
    return f"{clean[:limit]}-{digest}".lstrip("-")


def _resolve(
    path: str | os.PathLike[str], filesystem: pafs.FileSystem | None
) -> tuple[pafs.FileSystem, str]:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ValueError(f"FileSink: path must be a non-empty directory path or URI, got {path!r}")
    if filesystem is not None:
        if not isinstance(filesystem, pafs.FileSystem):
            raise TypeError(
                f"FileSink: filesystem must be a pyarrow.fs.FileSystem, got "
                f"{type(filesystem).__name__}"
            )
        if isinstance(filesystem, pafs.LocalFileSystem):
            path = os.path.abspath(path)
        return filesystem, path.rstrip("/") or "/"
    if "://" not in path:
        # A local path, made absolute here on the driver: subtasks may run elsewhere.
        return pafs.LocalFileSystem(), os.path.abspath(path)
    try:
        fs, inner = pafs.FileSystem.from_uri(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError) as exc:
        raise ValueError(
            f"FileSink: path {path!r} is not a URI pyarrow.fs understands ({exc}); pass a "
            "local path, a URI such as s3://bucket/prefix, or filesystem=..."
        ) from None
    return fs, inner.rstrip("/") or "/"


def _local_root(fs: pafs.FileSystem) -> str | None:
    """The local directory that paths of ``fs`` are relative to, or None if not local."""
    if isinstance(fs, pafs.LocalFileSystem):
        return "/"
    if isinstance(fs, pafs.SubTreeFileSystem):
        base = _local_root(fs.base_fs)
        if base is not None:
            return os.path.join(base, fs.base_path.lstrip("/"))
    return None


_BOOT_ID: list[str | None] = []


def _boot_id() -> str | None:
    """An id of this machine's current boot (Linux), or None where there is none."""
    if not _BOOT_ID:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT_ID.append(f.read().strip() or None)
        except OSError:
            _BOOT_ID.append(None)
    return _BOOT_ID[0]
