"""S3 multipart file sink: exactly-once part files on S3 (or any S3 API).

A transaction is one part file in progress, and a part file in progress is an
open multipart upload. Records are encoded (JSON lines, CSV or Parquet, see
:mod:`sinks.formats`) into an in-memory buffer; every full ``part_size`` bytes
(>= 5 MiB, the S3 minimum for every part but the last) go up as the next part.
At the checkpoint barrier, ``pre_commit`` closes the encoder (the Parquet footer),
uploads what is left as the last part and returns an :class:`S3Committable`:
bucket, key, upload id, the parts' numbers and ETags, and the object's size.
When the checkpoint completes, ``commit`` sends CompleteMultipartUpload: only
then does the object appear, whole, so readers never see partial output.

``commit`` is idempotent. A repeated CompleteMultipartUpload either succeeds or
fails because the upload is gone (S3 answers NoSuchUpload, moto a 500); then a
HEAD of the key decides whether this transaction was committed before. Sizes and
ETags cannot decide that: another transaction (the same job run again under its
name, a replay) writes the same key, often with the same size, and with parts
uploaded with checksums the ETag may not be an MD5 that can be checked. So every
transaction gets a random token at ``begin_transaction``; it is set as the
object's user metadata ``x-amz-meta-rayflow-transaction`` at CreateMultipartUpload
(the completed object carries it) and kept in the committable. The object counts
as committed before only when its token is this transaction's (and its size, and
where ETags allow the check its multipart ETag, are the expected ones). A
committable of an older version (no token) falls back to the size and ETag check,
with a warning. ``abort``
is AbortMultipartUpload ("already gone" is success), and ``abort_lingering``
lists the open uploads under this subtask's key prefix and aborts those the
restored checkpoint does not hold.

Keys are ``<prefix>/<job>-<operator uid>-<subtask>-<run>-<sequence:08d>.<ext>``: unique
per job, operator and run, deterministic per subtask and sequence, so listing the
prefix gives the committed output in subtask, run (run ids sort by start time) and
sequence order; a rerun never writes over an earlier run's objects.

Transient errors (5xx, SlowDown throttling, connection errors) are retried by
botocore (standard retry mode, ``max_attempts`` 4 unless ``config`` says
otherwise). A commit that still fails answers RETRY_LATER (the runtime tries again
later) unless it is decided: an object at the key that is not this transaction's, or
an error after which no retry can help (NoSuchUpload with no object: the output is
lost), answers FAILED.

Mind the bucket's lifecycle rules: an ``AbortIncompleteMultipartUpload`` rule
drops open uploads after some days; pass ``max_transaction_lifetime_s`` so a
checkpoint interval longer than that is refused when the job is built.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rayflow import process_local
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
from sinks.formats import Encoder, check_format, extension_of, open_encoder

__all__ = [
    "S3FileSink",
    "S3Committable",
    "S3CommittableSerializer",
    "S3CommitError",
    "MIN_PART_SIZE",
    "MAX_PART_SIZE",
]

log = logging.getLogger("rayflow.sinks.s3")

MIN_PART_SIZE = 5 * 1024 * 1024  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * 1024 * 1024  # S3's maximum part size
MAX_PARTS = 10_000  # S3's maximum number of parts per upload
DEFAULT_MAX_ATTEMPTS = 4

_SECRET_OPTION = re.compile(r"secret|token|password|access_key|credential", re.I)
_MD5_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')
_MULTIPART_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})-(\d+)"?$')

#: The user metadata key (``x-amz-meta-rayflow-transaction``) that names the transaction
#: that wrote an object. S3 returns user metadata keys in lower case.
TRANSACTION_METADATA = "rayflow-transaction"


class S3CommitError(RuntimeError):
    """A committable could not be made visible (and is not visible already)."""


@dataclass(frozen=True)
class S3Committable:
    """Everything needed to complete (or abort) one part file from any process."""

    bucket: str
    key: str
    upload_id: str
    parts: tuple[tuple[int, str], ...]  # (PartNumber, ETag)
    size: int
    records: int = 0
    checksum_algorithm: str | None = None
    checksums: tuple[str, ...] = ()  # per part, when the upload declared an algorithm
    #: This transaction's token, also the object's ``rayflow-transaction`` metadata.
    #: None in committables of older versions (pickled in older checkpoints).
    transaction_token: str | None = None

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def expected_etag(self) -> str | None:
        """The multipart ETag S3 gives the object (MD5 of the parts' MD5s, ``-<n>``), when
        every part ETag is a plain MD5; ``None`` when that cannot be known."""
        digests = []
        for _, etag in self.parts:
            match = _MD5_ETAG.match(etag)
            if match is None:
                return None
            digests.append(bytes.fromhex(match.group(1)))
        return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(self.parts)}"


class _PartBuffer:
    """A write-only binary stream the encoders write into; full parts are taken out of
    it and uploaded. ``tell`` counts every byte ever written (pyarrow asks for it)."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self.buffered = 0
        self.position = 0
        self.closed = False

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        if chunk:
            self._chunks.append(chunk)
            self.buffered += len(chunk)
            self.position += len(chunk)
        return len(chunk)

    def take(self, size: int | None = None) -> bytes:
        """Remove and return the first ``size`` buffered bytes (all of them for ``None``)."""
        data = b"".join(self._chunks)
        if size is None or size >= len(data):
            self._chunks, self.buffered = [], 0
            return data
        rest = data[size:]
        self._chunks, self.buffered = [rest], len(rest)
        return data[:size]

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


@dataclass
class _Transaction:
    """One part file in progress (lives only in its subtask)."""

    bucket: str
    key: str
    sequence: int
    buffer: _PartBuffer
    encoder: Encoder
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    upload_id: str | None = None
    parts: list[tuple[int, str]] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)
    uploaded: int = 0
    records: int = 0
    done: bool = False


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


class S3CommittableSerializer(CommittableSerializer[S3Committable]):
    """Version 1: the committable's fields as JSON (no class names in checkpoints)."""

    version = 1

    def serialize(self, committable: S3Committable) -> bytes:
        c = committable
        return json.dumps(
            {
                "bucket": c.bucket,
                "key": c.key,
                "upload_id": c.upload_id,
                "parts": [list(p) for p in c.parts],
                "size": c.size,
                "records": c.records,
                "checksum_algorithm": c.checksum_algorithm,
                "checksums": list(c.checksums),
                "transaction_token": c.transaction_token,
            },
            separators=(",", ":"),
        ).encode("utf-8")

    def deserialize(self, version: int, data: bytes) -> S3Committable:
        d = json.loads(data)
        return S3Committable(
            bucket=d["bucket"],
            key=d["key"],
            upload_id=d["upload_id"],
            parts=tuple((int(n), str(etag)) for n, etag in d["parts"]),
            size=d["size"],
            records=d.get("records", 0),
            checksum_algorithm=d.get("checksum_algorithm"),
            checksums=tuple(d.get("checksums") or ()),
            transaction_token=d.get("transaction_token"),
        )


class S3FileSink(TwoPhaseCommittingSink[_Transaction, S3Committable]):
    """Writes part files to ``s3://bucket/prefix/`` through multipart uploads.

    ``format``: ``"jsonl"``, ``"csv"`` or ``"parquet"``. ``part_size``: bytes per
    uploaded part (5 MiB .. 5 GiB); memory per subtask is about one part.
    ``delivery_guarantee``: left open (None), each job gives the strongest its
    checkpointing allows (EXACTLY_ONCE with exactly-once checkpointing).
    ``endpoint_url`` and ``**client_options`` (``region_name``, ``aws_access_key_id``,
    ``aws_secret_access_key``, ``config``, ...) go to ``boto3.client("s3", ...)``;
    without credentials boto3's usual chain applies. The sink is configuration only:
    each process makes its own client on first use (``client``), never pickled;
    ``repr`` never shows secrets.
    """

    #: Checksum declared on CreateMultipartUpload and sent with every part (None: none).
    checksum_algorithm: str | None = "CRC32"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        format: str = "jsonl",
        delivery_guarantee: DeliveryGuarantee | None = None,
        rolling_policy: RollingPolicy | None = None,
        endpoint_url: str | None = None,
        part_size: int = MIN_PART_SIZE,
        max_transaction_lifetime_s: float | None = None,
        **client_options: Any,
    ) -> None:
        super().__init__(delivery_guarantee, rolling_policy)
        if not bucket or not isinstance(bucket, str):
            raise ValueError(f"S3FileSink: bucket must be a non-empty string, got {bucket!r}")
        check_format(format)
        if not isinstance(part_size, int) or not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(
                f"S3FileSink: part_size must be between {MIN_PART_SIZE} bytes (5 MiB, S3's "
                f"minimum part size) and {MAX_PART_SIZE} bytes (5 GiB), got {part_size!r}"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.format = format
        self.extension = extension_of(format)
        self.endpoint_url = endpoint_url
        self.part_size = part_size
        #: the bucket's lifecycle rule for open uploads (AbortIncompleteMultipartUpload)
        self.max_transaction_lifetime_s = max_transaction_lifetime_s
        self.client_options = dict(client_options)

    # --- plumbing -----------------------------------------------------------------------

    def __repr__(self) -> str:
        options = {
            k: ("***" if _SECRET_OPTION.search(k) else v)
            for k, v in sorted(self.client_options.items())
            if k != "config"
        }
        return (
            f"S3FileSink(bucket={self.bucket!r}, prefix={self.prefix!r}, "
            f"format={self.format!r}, delivery_guarantee={self.delivery_guarantee.name}, "
            f"endpoint_url={self.endpoint_url!r}, part_size={self.part_size}, "
            f"client_options={options!r})"
        )

    __str__ = __repr__

    @property
    def client(self) -> Any:
        """This process's boto3 S3 client for this sink (made on first use; a copy of the
        sink in another process makes its own)."""
        return process_local.local(self, "client", self._make_client)

    @property
    def _client(self) -> Any:
        """The client this process made for this sink, None before the first use."""
        return process_local.local(self, "client")

    def _make_client(self) -> Any:
        import boto3
        from botocore.config import Config

        options = dict(self.client_options)
        config = Config(
            retries={"mode": "standard", "max_attempts": DEFAULT_MAX_ATTEMPTS},
            connect_timeout=10,
            read_timeout=60,
        )
        if options.get("config") is not None:
            config = config.merge(options["config"])
        options["config"] = config
        return boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, **options)

    def key_prefix(self, context: SinkContext) -> str:
        """The key prefix of every part file of one subtask."""
        name = self.transaction_prefix(context)
        return f"{self.prefix}/{name}" if self.prefix else name

    def key_for(self, context: SinkContext, sequence: int) -> str:
        run = f"{context.run_tag()}-" if context.run_id else ""
        return f"{self.key_prefix(context)}{run}{sequence:08d}.{self.extension}"

    def create_transaction_writer(self, context: SinkContext) -> _S3Writer:
        return _S3Writer(self, context)

    def create_committer(self, context: SinkContext | None) -> _S3Committer:
        return _S3Committer(self)

    def committable_serializer(self) -> S3CommittableSerializer:
        return S3CommittableSerializer()

    def close(self) -> None:
        """Direct use: close this process's writers and committer, then drop the client."""
        super().close()
        process_local.drop(self, "client")

    def merge_results(self, results: list[Any]) -> int:
        """The number of commits (repeated ones included) of all subtasks."""
        return sum(r for r in results if isinstance(r, int))


def _abort_upload(client: Any, bucket: str, key: str, upload_id: str) -> None:
    try:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception as exc:
        if _error_code(exc) in ("NoSuchUpload", "404"):
            return  # already aborted or completed
        raise


class _S3Writer(TransactionWriter[_Transaction, S3Committable]):
    """One subtask's part files in progress (open multipart uploads)."""

    def __init__(self, sink: S3FileSink, context: SinkContext) -> None:
        self.sink = sink
        self.context = context
        self._open: dict[int, _Transaction] = {}

    @property
    def client(self) -> Any:
        return self.sink.client

    def begin_transaction(self, sequence: int) -> _Transaction:
        buffer = _PartBuffer()
        transaction = _Transaction(
            bucket=self.sink.bucket,
            key=self.sink.key_for(self.context, sequence),
            sequence=sequence,
            buffer=buffer,
            encoder=open_encoder(self.sink.format, buffer),
        )
        self._open[id(transaction)] = transaction
        return transaction

    def write(self, transaction: _Transaction, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if transaction.upload_id is None:
            self._create_upload(transaction)
        transaction.encoder.write(batch)
        transaction.records += batch.num_rows
        while transaction.buffer.buffered >= self.sink.part_size:
            self._upload_part(transaction, transaction.buffer.take(self.sink.part_size))

    def transaction_size(self, transaction: _Transaction) -> int:
        return transaction.buffer.position

    def is_empty(self, transaction: _Transaction) -> bool:
        return transaction.records == 0

    def pre_commit(
        self, transaction: _Transaction, checkpoint_id: int | None = None
    ) -> S3Committable:
        transaction.encoder.close()
        if transaction.upload_id is None:
            self._create_upload(transaction)
        rest = transaction.buffer.take()
        if rest or not transaction.parts:
            self._upload_part(transaction, rest)
        transaction.done = True
        self._open.pop(id(transaction), None)
        log.debug(
            "pre-committed s3://%s/%s: %d part(s), %d bytes",
            transaction.bucket,
            transaction.key,
            len(transaction.parts),
            transaction.uploaded,
        )
        return S3Committable(
            bucket=transaction.bucket,
            key=transaction.key,
            upload_id=transaction.upload_id,
            parts=tuple(transaction.parts),
            size=transaction.uploaded,
            records=transaction.records,
            checksum_algorithm=self.sink.checksum_algorithm,
            checksums=tuple(transaction.checksums),
            transaction_token=transaction.token,
        )

    def _create_upload(self, transaction: _Transaction) -> None:
        kwargs: dict[str, Any] = {
            "Bucket": transaction.bucket,
            "Key": transaction.key,
            # The completed object carries it: a repeated commit recognises its own object.
            "Metadata": {TRANSACTION_METADATA: transaction.token},
        }
        if self.sink.checksum_algorithm:
            kwargs["ChecksumAlgorithm"] = self.sink.checksum_algorithm
        self.context.check_fence(f"S3FileSink: upload of {transaction.key}")
        transaction.upload_id = self.client.create_multipart_upload(**kwargs)["UploadId"]

    def _upload_part(self, transaction: _Transaction, data: bytes) -> None:
        number = len(transaction.parts) + 1
        if number > MAX_PARTS:
            raise ValueError(
                f"S3FileSink: s3://{transaction.bucket}/{transaction.key} would need more than "
                f"{MAX_PARTS} parts; raise part_size or roll part files sooner "
                "(RollingPolicy.max_part_size)"
            )
        algorithm = self.sink.checksum_algorithm
        kwargs: dict[str, Any] = {
            "Bucket": transaction.bucket,
            "Key": transaction.key,
            "UploadId": transaction.upload_id,
            "PartNumber": number,
            "Body": data,
        }
        if algorithm:
            kwargs["ChecksumAlgorithm"] = algorithm
        response = self.client.upload_part(**kwargs)
        transaction.parts.append((number, response["ETag"]))
        if algorithm:
            checksum = response.get(f"Checksum{algorithm.upper()}")
            if checksum is None:
                checksum = _local_checksum(algorithm, data)
            transaction.checksums.append(checksum)
        transaction.uploaded += len(data)

    def abort_transaction(self, transaction: _Transaction) -> None:
        self._open.pop(id(transaction), None)
        transaction.done = True
        if transaction.upload_id is not None:
            _abort_upload(self.client, transaction.bucket, transaction.key, transaction.upload_id)

    def close(self) -> None:
        """Abort the uploads of transactions still open here (never pre-committed ones:
        those may belong to a completed checkpoint)."""
        for transaction in list(self._open.values()):
            try:
                self.abort_transaction(transaction)
            except Exception as exc:  # noqa: BLE001 - best effort; abort_lingering catches it
                log.warning(
                    "could not abort open upload of s3://%s/%s: %s",
                    transaction.bucket,
                    transaction.key,
                    exc,
                )
        self._open.clear()


#: Error codes after which a commit cannot succeed by trying again.
_PERMANENT_CODES = frozenset(
    {
        "NoSuchUpload",
        "NoSuchBucket",
        "InvalidPart",
        "InvalidPartOrder",
        "EntityTooSmall",
        "AccessDenied",
        "InvalidAccessKeyId",
        "InvalidRequest",
        "MalformedXML",
        "404",
    }
)


class _S3Committer(Committer[S3Committable]):
    """Completes multipart uploads; a repeated commit is recognised by the object's
    transaction token."""

    def __init__(self, sink: S3FileSink) -> None:
        self.sink = sink

    @property
    def client(self) -> Any:
        return self.sink.client

    def commit(self, committable: S3Committable) -> CommitOutcome:
        parts = []
        for position, (number, etag) in enumerate(committable.parts):
            part: dict[str, Any] = {"PartNumber": number, "ETag": etag}
            if committable.checksum_algorithm and position < len(committable.checksums):
                part[f"Checksum{committable.checksum_algorithm.upper()}"] = committable.checksums[
                    position
                ]
            parts.append(part)
        try:
            self.client.complete_multipart_upload(
                Bucket=committable.bucket,
                Key=committable.key,
                UploadId=committable.upload_id,
                MultipartUpload={"Parts": parts},
            )
            log.debug("committed %s (%d bytes)", committable.url, committable.size)
            return CommitOutcome.committed()
        except Exception as exc:  # noqa: BLE001 - decided by the object's presence below
            error = exc
        # The upload may be gone because it was completed before (a commit repeated after a
        # failure): the object itself says whether this committable is visible.
        problem, decided = self._visible_problem(committable)
        if problem is None:
            log.info(
                "%s was committed before (upload %s is gone): nothing to do",
                committable.url,
                committable.upload_id[:12],
            )
            return CommitOutcome.already_committed(f"{committable.url} carries this transaction")
        code = _error_code(error) or type(error).__name__
        message = (
            f"could not commit {committable.url} (upload id {committable.upload_id}): "
            f"CompleteMultipartUpload failed with {code}: {error}; and {problem}"
        )
        failure = S3CommitError(message)
        failure.__cause__ = error
        if decided or code in _PERMANENT_CODES:
            return CommitOutcome.failed(message, failure)
        # Throttled, a 5xx, a connection error: not decided yet.
        return CommitOutcome.retry_later(message, failure)

    def _visible_problem(self, committable: S3Committable) -> tuple[str | None, bool]:
        """(None, True) when the object at the key is the one ``committable`` committed;
        else what is wrong, and whether that is decided (an object that is not ours) or
        may change (no object yet, or it could not be checked). The object's
        ``rayflow-transaction`` metadata decides; size and ETag are checked too."""
        try:
            head = self.client.head_object(Bucket=committable.bucket, Key=committable.key)
        except Exception as exc:  # noqa: BLE001
            if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return (
                    "no object exists at the key: unless the error is transient, the "
                    "upload was aborted or expired before it was completed (its output "
                    "is lost)",
                    False,
                )
            return f"the object could not be checked ({type(exc).__name__}: {exc})", False
        size = head.get("ContentLength")
        if size != committable.size:
            return (
                f"the object there has {size} bytes, not the {committable.size} this "
                "transaction wrote",
                True,
            )
        token = committable.transaction_token
        if token is not None:
            metadata = {str(k).lower(): v for k, v in (head.get("Metadata") or {}).items()}
            found = metadata.get(TRANSACTION_METADATA)
            if found != token:
                writer = (
                    f"transaction {found}"
                    if found
                    else f"a writer that set no {TRANSACTION_METADATA} metadata"
                )
                return (
                    f"the object there (of the same size) was written by {writer}, not by "
                    f"this transaction ({token}): something else replaced it (the same job "
                    "run again under its name, a replay, another writer), so this "
                    "transaction's output is not what is visible",
                    True,
                )
        expected = committable.expected_etag()
        match = _MULTIPART_ETAG.match(str(head.get("ETag", "")))
        etag_checked = expected is not None and match is not None
        if etag_checked:
            if f"{match.group(1).lower()}-{match.group(2)}" != expected:
                return (
                    f"the object there has ETag {head.get('ETag')}, not the {expected} "
                    "of this transaction's parts",
                    True,
                )
        if token is None:
            log.warning(
                "%s: the committable carries no transaction token (it was pre-committed by "
                "an older version); the object is taken as committed before because its "
                "size%s matches, which cannot tell it from another transaction's object",
                committable.url,
                " and multipart ETag" if etag_checked else "",
            )
        return None, True

    def abort(self, committable: S3Committable) -> None:
        _abort_upload(self.client, committable.bucket, committable.key, committable.upload_id)

    def abort_lingering(self, context: SinkContext, keep: Sequence[S3Committable]) -> int:
        bucket = self.sink.bucket
        prefix = self.sink.key_prefix(context)
        keep_ids = {c.upload_id for c in keep if isinstance(c, S3Committable)}
        aborted = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        lingering = [
            (upload["Key"], upload["UploadId"])
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for upload in page.get("Uploads", [])
            if upload["Key"].startswith(prefix) and upload["UploadId"] not in keep_ids
        ]
        for key, upload_id in lingering:
            context.check_fence(f"S3FileSink: abort of upload {upload_id[:12]}")
            _abort_upload(self.client, bucket, key, upload_id)
            aborted += 1
        if aborted:
            log.info("aborted %d lingering upload(s) under s3://%s/%s", aborted, bucket, prefix)
        return aborted

    def committable_id(self, committable: S3Committable) -> str:
        return f"{committable.url}#{committable.upload_id[:12]}"


def _local_checksum(algorithm: str, data: bytes) -> str:
    """The base64 checksum S3 would compute, for stores that do not echo it back."""
    algorithm = algorithm.upper()
    if algorithm == "CRC32":
        import zlib

        return base64.b64encode((zlib.crc32(data) & 0xFFFFFFFF).to_bytes(4, "big")).decode()
    if algorithm == "SHA1":
        return base64.b64encode(hashlib.sha1(data).digest()).decode()
    if algorithm == "SHA256":
        return base64.b64encode(hashlib.sha256(data).digest()).decode()
    raise ValueError(f"S3FileSink: cannot compute a {algorithm} checksum locally")
