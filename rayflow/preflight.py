"""Checks of a job's outside world on the driver, before Ray starts or anything deploys.

Where it is cheap, ``execute()`` checks what would otherwise fail every attempt of the
job a few seconds later, in a subtask:

- a ``FileSource`` path that does not exist;
- a ``FileSink`` directory that cannot be created or written (a probe file is written
  and deleted);
- an ``S3FileSink`` bucket that does not exist, or credentials S3 rejects (one
  ``ListObjectsV2`` of at most one key under the sink's prefix);
- checkpoint storage that cannot be written (``<storage>/<job name>/`` is created and a
  probe file written and deleted there).

Only definite answers fail the job: on a local filesystem any error, elsewhere the
errors :mod:`rayflow.recoverability` deems not recoverable (a missing bucket, rejected
credentials, a read-only path). An unreachable endpoint, a timeout (each check gets
``CHECK_TIMEOUT_S``) or anything else unclear lets the job start, as it would without
the check. Every problem found is listed in one :class:`PreflightError`.
``env.set_preflight_checks(False)`` skips the checks (say, for paths only the cluster's
nodes see).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from rayflow.config import CheckpointConfig
from rayflow.plan.physical import JobGraph
from rayflow.recoverability import NonRecoverableError, classify

__all__ = ["PreflightError", "check_job", "CHECK_TIMEOUT_S"]

#: the longest one check may take before it is given up (and the job starts anyway)
CHECK_TIMEOUT_S = 15.0


class PreflightError(NonRecoverableError):
    """The job cannot run: what it reads, writes or checkpoints to is missing or refused.
    ``problems`` lists each in words."""

    def __init__(self, job_name: str, problems: list[str]) -> None:
        self.job_name = job_name
        self.problems = list(problems)
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"job {job_name!r} cannot start (checked before it deployed):\n{listed}")

    def __reduce__(self):
        return (PreflightError, (self.job_name, self.problems))


def check_job(job_name: str, graph: JobGraph, config: CheckpointConfig) -> None:
    """Raise :class:`PreflightError` listing every problem found, else return."""
    problems: list[str] = []
    for vertex in graph.vertices.values():
        if vertex.source is not None:
            name = vertex.name.split(" -> ")[0]
            problems.extend(_run(_source_check(name, vertex.source)))
        for name, sink in _named_sinks(vertex):
            problems.extend(_run(_sink_check(name, sink)))
    if config.is_checkpointing_enabled():
        problems.extend(_run(_storage_check(job_name, config)))
    if problems:
        raise PreflightError(job_name, problems)


Check = Callable[[], "str | None"]


def _run(check: Check | None) -> list[str]:
    """Run ``check`` in a thread for at most ``CHECK_TIMEOUT_S``; its problem, if any."""
    if check is None:
        return []
    found: list[str | None] = []

    def target() -> None:
        try:
            found.append(check())
        except Exception:  # noqa: BLE001 - an unclear answer lets the job start
            found.append(None)

    thread = threading.Thread(target=target, name="rayflow-preflight", daemon=True)
    thread.start()
    thread.join(CHECK_TIMEOUT_S)
    return [p for p in found if p]


def _why(exc: BaseException, definite: bool) -> str | None:
    """Words for an error of a check: always on a local filesystem (``definite``),
    elsewhere only when no restart could fix it."""
    reason = classify(exc)
    if reason is None and not definite:
        return None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    detail = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return f"{reason} ({detail})" if reason else detail


# --- sources ----------------------------------------------------------------------------


def _source_check(name: str, source: Any) -> Check | None:
    from rayflow.sources import FileSource

    if not isinstance(source, FileSource):
        return None

    def check() -> str | None:
        import pyarrow.fs as pafs

        fs, path = source._resolve()
        try:
            info = fs.get_file_info(path)
        except Exception as exc:  # noqa: BLE001
            why = _why(exc, _is_local(fs))
            return f"FileSource {name!r}: cannot read {source.path!r}: {why}" if why else None
        if info.type == pafs.FileType.NotFound:
            return f"FileSource {name!r}: no such file or directory: {source.path!r}"
        return None

    return check


# --- sinks ------------------------------------------------------------------------------


def _named_sinks(vertex: Any) -> list[tuple[str, Any]]:
    """Each sink of ``vertex`` with its operator's name."""
    named: list[tuple[str, Any]] = []
    for spec in vertex.operators:
        sink = getattr(spec, "sink", None)
        if sink is None:
            args = getattr(spec.factory, "args", ())
            sink = next((a for a in args if any(a is s for s in vertex.sinks)), None)
        if sink is not None:
            named.append((spec.name, sink))
    seen = {id(s) for _, s in named}
    named += [(type(s).__name__, s) for s in vertex.sinks if id(s) not in seen]
    return named


def _sink_check(name: str, sink: Any) -> Check | None:
    label = f"sink {name!r} ({type(sink).__name__})"
    kind = _sink_kind(sink)
    if kind == "files":
        return lambda: _writable(label, sink.filesystem, sink.directory)
    if kind == "s3":
        return lambda: _bucket_readable(label, sink)
    return None


def _sink_kind(sink: Any) -> str | None:
    try:
        from sinks.files import FileSink
        from sinks.s3 import S3FileSink
    except ImportError:  # the connectors package is not installed
        return None
    if isinstance(sink, FileSink):
        return "files"
    if isinstance(sink, S3FileSink):
        return "s3"
    return None


def _bucket_readable(label: str, sink: Any) -> str | None:
    import boto3
    from botocore.config import Config

    options = dict(sink.client_options)
    config = Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1})
    if options.get("config") is not None:
        config = options["config"].merge(config)
    options["config"] = config
    client = boto3.session.Session().client("s3", endpoint_url=sink.endpoint_url, **options)
    try:
        client.list_objects_v2(Bucket=sink.bucket, Prefix=sink.prefix, MaxKeys=1)
    except Exception as exc:  # noqa: BLE001
        why = _why(exc, definite=False)
        return f"{label}: cannot use s3://{sink.bucket}/: {why}" if why else None
    return None


# --- checkpoint storage -----------------------------------------------------------------


def _storage_check(job_name: str, config: CheckpointConfig) -> Check:
    def check() -> str | None:
        from rayflow.checkpoint.storage import JobStorage

        label = f"checkpoint storage {config.checkpoint_storage!r}"
        try:
            jobs = JobStorage(config.checkpoint_storage, job_name, config.storage_options)
        except Exception as exc:  # noqa: BLE001
            why = _why(exc, definite=False)
            return f"{label}: {why}" if why else None
        return _writable(label, jobs.fs, jobs.location())

    return check


# --- filesystems ------------------------------------------------------------------------


def _is_local(fs: Any) -> bool:
    import pyarrow.fs as pafs

    return isinstance(fs, pafs.LocalFileSystem)


def _writable(label: str, fs: Any, directory: str) -> str | None:
    """Create ``directory`` and write and delete a probe file in it; the problem, if any."""
    local = _is_local(fs)
    probe = f"{directory.rstrip('/')}/.rayflow-write-check-{uuid.uuid4().hex[:12]}"
    try:
        fs.create_dir(directory, recursive=True)
        if local:
            with open(probe, "wb") as out:
                out.write(b"rayflow")
            os.remove(probe)
        else:
            with fs.open_output_stream(probe) as out:
                out.write(b"rayflow")
            fs.delete_file(probe)
    except Exception as exc:  # noqa: BLE001
        why = _why(exc, local)
        return f"{label}: cannot write to {directory!r}: {why}" if why else None
    return None
