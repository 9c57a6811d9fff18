"""An S3 API inside the demo's own process: moto's threaded server on 127.0.0.1.

Ray actors reach it over HTTP like any S3 endpoint, so the demo writes through the
same ``S3FileSink`` a job would use against AWS, with no outside service. moto is an
optional dependency (``pip install "rayflow[demo]"``).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EmbeddedS3", "MotoMissingError", "start_embedded_s3"]

#: Dummy credentials: moto accepts any; given explicitly, so no AWS configuration is read.
CREDENTIALS = {
    "aws_access_key_id": "rayflow-demo",
    "aws_secret_access_key": "rayflow-demo-secret",
    "region_name": "us-east-1",
}


class MotoMissingError(RuntimeError):
    """moto's server is not installed."""


@dataclass
class EmbeddedS3:
    """A running embedded S3 server: its endpoint, credentials and a client."""

    endpoint_url: str
    credentials: dict[str, str] = field(default_factory=lambda: dict(CREDENTIALS))
    _server: Any = None
    _client: Any = None

    def client(self) -> Any:
        if self._client is None:
            import boto3

            self._client = boto3.session.Session().client(
                "s3", endpoint_url=self.endpoint_url, **self.credentials
            )
        return self._client

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_embedded_s3() -> EmbeddedS3:
    """Start moto's S3 server on a free port of 127.0.0.1 (stop it with ``stop()``)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise MotoMissingError(
            "--sink s3 runs an embedded S3 server, which needs moto's server "
            f'({exc}); install it with: pip install "rayflow[demo]" '
            '(or pip install "moto[server]"), or use --sink files'
        ) from None
    for name in ("werkzeug", "moto", "flask.app"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return EmbeddedS3(f"http://127.0.0.1:{port}", _server=server)
