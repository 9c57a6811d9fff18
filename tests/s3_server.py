"""A real S3 API for tests: moto's server on 127.0.0.1, reached by every Ray actor.

moto's in-process mock patches botocore in one process only, so it
cannot serve subtask actors; its threaded HTTP server can. One server runs per test
process (started on first use, stopped at exit). Test modules get the fixtures by
importing them::

    from tests.s3_server import s3_bucket, s3_server  # noqa: F401

Credentials are dummies passed explicitly to every client (Ray workers do not see
environment variables set after Ray started).
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import re
import socket
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pytest

CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing-secret",
    "region_name": "us-east-1",
}

_MULTIPART_ETAG = re.compile(r'^"?[0-9a-fA-F]{32}-(\d+)"?$')


def _quiet() -> None:
    for name in ("werkzeug", "moto", "flask.app", "botocore", "urllib3"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto server: its endpoint, credentials and read-back helpers."""

    endpoint_url: str
    credentials: dict[str, str] = field(default_factory=lambda: dict(CREDENTIALS))
    _server: Any = None
    _client: Any = None

    def client(self) -> Any:
        """A boto3 client of this server (one, shared: boto3 clients are thread-safe)."""
        if self._client is None:
            import boto3

            self._client = boto3.session.Session().client(
                "s3", endpoint_url=self.endpoint_url, **self.credentials
            )
        return self._client

    def sink_options(self) -> dict[str, Any]:
        """Keyword arguments that point an S3FileSink at this server."""
        return {"endpoint_url": self.endpoint_url, **self.credentials}

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments that point S3 checkpoint storage (``pyarrow.fs.S3FileSystem``)
        at this server: ``set_checkpoint_storage("s3://bucket/prefix", **these)``."""
        return {
            "endpoint_override": self.endpoint_url.split("://", 1)[1],
            "scheme": "http",
            "access_key": self.credentials["aws_access_key_id"],
            "secret_key": self.credentials["aws_secret_access_key"],
            "region": self.credentials["region_name"],
        }

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"rayflow-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        """Every object under ``prefix``, in key order (Key, Size, ETag)."""
        paginator = self.client().get_paginator("list_objects_v2")
        return [
            obj
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
        ]

    def open_uploads(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        paginator = self.client().get_paginator("list_multipart_uploads")
        return [
            upload
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for upload in page.get("Uploads", [])
        ]

    def get(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def read_objects(self, bucket: str, prefix: str, fmt: str) -> list[tuple[dict, pa.Table]]:
        """Each committed object under ``prefix`` decoded, in key order."""
        return [
            (obj, decode(self.get(bucket, obj["Key"]), fmt)) for obj in self.objects(bucket, prefix)
        ]

    def read_table(self, bucket: str, prefix: str, fmt: str) -> pa.Table:
        tables = [t for _, t in self.read_objects(bucket, prefix, fmt) if t.num_rows]
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="default")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def parts_of(obj: dict[str, Any]) -> int:
    """How many parts an object was completed from (from its multipart ETag; 1 otherwise)."""
    match = _MULTIPART_ETAG.match(str(obj.get("ETag", "")))
    return int(match.group(1)) if match else 1


def decode(data: bytes, fmt: str) -> pa.Table:
    if fmt == "jsonl":
        rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line]
        return pa.Table.from_pylist(rows)
    if fmt == "csv":
        import pyarrow.csv as pcsv

        return pcsv.read_csv(io.BytesIO(data))
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(data))
    raise ValueError(f"unknown format {fmt!r}")


class _ResultRootTag:
    """WSGI middleware: the answer to CompleteMultipartUpload has the root element AWS
    documents, ``CompleteMultipartUploadResult``. Some moto versions name it
    ``...Response``; boto3 does not mind, but Arrow's S3 client (``pyarrow.fs``, used by
    S3 checkpoint storage) then reports the upload as failed."""

    WRONG, RIGHT = b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult"

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, environ: dict, start_response: Any) -> Any:
        query = environ.get("QUERY_STRING", "")
        if environ.get("REQUEST_METHOD") != "POST" or "uploadId=" not in query:
            return self.app(environ, start_response)
        answer: list[Any] = []

        def capture(status: str, headers: list, exc_info: Any = None) -> Any:
            answer[:] = [status, headers, exc_info]
            return lambda data: None

        body = b"".join(self.app(environ, capture))
        body = body.replace(b"<" + self.WRONG, b"<" + self.RIGHT)
        body = body.replace(b"</" + self.WRONG + b">", b"</" + self.RIGHT + b">")
        status, headers, exc_info = answer
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in headers]
        start_response(status, headers, exc_info)
        return [body]


def _moto_server(port: int) -> Any:
    from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    class Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = _ResultRootTag(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server(ip_address="127.0.0.1", port=port, verbose=False)


_lock = threading.Lock()
_running: S3Server | None = None


def start_server() -> S3Server:
    """The moto server of this process (started once)."""
    global _running
    with _lock:
        if _running is None:
            _quiet()
            port = _free_port()
            server = _moto_server(port)
            server.start()
            _running = S3Server(f"http://127.0.0.1:{port}", _server=server)
            atexit.register(_running.stop)
        return _running


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    """moto's S3 server on 127.0.0.1 (endpoint_url, credentials, read-back helpers)."""
    return start_server()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the test server."""
    return s3_server.create_bucket()
