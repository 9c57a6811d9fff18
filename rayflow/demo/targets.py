"""Where ``rayflow demo`` writes, and how it reads back what was committed there.

A :class:`Target` makes the sink of one demo run (one table, directory or key prefix per
run, so the three runs never mix) and reads the run's *committed* output back: only what
a reader of that system would see (published part files, completed S3 objects, rows of
committed transactions), never in-progress files, open uploads or prepared transactions.
Each committed row is counted by its ``order_id``.

- ``files``: ``sinks.files.FileSink`` into a local directory, Parquet part files.
- ``s3``: ``sinks.s3.S3FileSink`` into a bucket of an embedded S3 server
  (:mod:`rayflow.demo.s3server`), Parquet objects.
- ``postgres``: ``sinks.postgres.PostgresSink`` into a table of the database at
  ``--dsn`` (created per run, dropped at the end).
- ``kafka``: ``connectors.kafka.KafkaSink`` into a topic per run, counted as a
  ``read_committed`` consumer reads it (:mod:`rayflow.demo.kafka`).
"""

from __future__ import annotations

import abc
import enum
import inspect
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayflow.guarantees import DeliveryGuarantee
from rayflow.jobs.orders import ORDER_STREAM_COLUMNS
from rayflow.sink import RollingPolicy, Sink

__all__ = ["SinkKind", "Target", "TargetError", "open_target"]

_EMPTY = np.zeros(0, dtype=np.int64)


class SinkKind(str, enum.Enum):
    S3 = "s3"
    FILES = "files"
    POSTGRES = "postgres"
    KAFKA = "kafka"

    def __str__(self) -> str:
        return self.value


class TargetError(RuntimeError):
    """The demo cannot write to the chosen target (a missing dependency, a bad DSN)."""


class Target(abc.ABC):
    """One place the demo writes to; ``run`` names one run's share of it."""

    kind: SinkKind

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the output goes, in words (never a password)."""

    @abc.abstractmethod
    def sink(self, run: str, guarantee: DeliveryGuarantee, rolling: RollingPolicy) -> Sink:
        """The sink of run ``run``, asked for ``guarantee`` explicitly."""

    @abc.abstractmethod
    def order_ids(self, run: str) -> np.ndarray:
        """The ``order_id`` of every committed row of run ``run`` (repeats included)."""

    def committed(self, run: str) -> int:
        """How many rows run ``run`` has committed so far (for progress)."""
        return int(self.order_ids(run).size)

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the target holds (servers, connections, tables)."""


def _parquet_ids(source: Any) -> np.ndarray:
    table = pq.read_table(source, columns=["order_id"])
    return table.column("order_id").to_numpy().astype(np.int64, copy=False)


class FilesTarget(Target):
    kind = SinkKind.FILES

    def __init__(self, root: Path) -> None:
        self.root = root
        # name -> ((size, mtime_ns, inode), ids): a part file replaced on replay is read again
        self._cache: dict[str, tuple[tuple[int, int, int], np.ndarray]] = {}

    def describe(self) -> str:
        return f"Parquet part files under {self.root} (sinks.files.FileSink)"

    def _dir(self, run: str) -> Path:
        return self.root / run

    def sink(self, run: str, guarantee: DeliveryGuarantee, rolling: RollingPolicy) -> Sink:
        from sinks.files import FileSink

        return FileSink(
            self._dir(run), "parquet", delivery_guarantee=guarantee, rolling_policy=rolling
        )

    def order_ids(self, run: str) -> np.ndarray:
        directory = self._dir(run)
        if not directory.is_dir():
            return _EMPTY
        parts = []
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if entry.name.startswith(".") or not entry.is_file():
                continue  # in-progress files and commit markers are hidden: not visible output
            try:
                st = entry.stat()
                key = f"{run}/{entry.name}"
                stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
                cached = self._cache.get(key)
                if cached is None or cached[0] != stamp:
                    cached = (stamp, _parquet_ids(entry.path))
                    self._cache[key] = cached
            except FileNotFoundError:
                continue  # replaced while listing; the next read sees the new one
            parts.append(cached[1])
        return np.concatenate(parts) if parts else _EMPTY


class S3Target(Target):
    kind = SinkKind.S3

    def __init__(self) -> None:
        from rayflow.demo.s3server import start_embedded_s3

        self.server = start_embedded_s3()
        self.bucket = self.server.create_bucket(f"rayflow-demo-{uuid.uuid4().hex[:8]}")
        # key -> (ETag, ids): an object replaced on replay (same key) is read again
        self._cache: dict[str, tuple[str, np.ndarray]] = {}

    def describe(self) -> str:
        return (
            f"Parquet objects in s3://{self.bucket}/ on an embedded S3 server "
            f"({self.server.endpoint_url}, moto; sinks.s3.S3FileSink)"
        )

    def sink(self, run: str, guarantee: DeliveryGuarantee, rolling: RollingPolicy) -> Sink:
        from sinks.s3 import S3FileSink

        return S3FileSink(
            self.bucket,
            run,
            format="parquet",
            delivery_guarantee=guarantee,
            rolling_policy=rolling,
            endpoint_url=self.server.endpoint_url,
            **self.server.credentials,
        )

    def order_ids(self, run: str) -> np.ndarray:
        client = self.server.client()
        parts = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{run}/"
        ):
            for obj in page.get("Contents", []):
                key, etag = obj["Key"], obj["ETag"]
                cached = self._cache.get(key)
                if cached is None or cached[0] != etag:
                    body = client.get_object(Bucket=self.bucket, Key=key)
                    cached = (body["ETag"], _parquet_ids(pa.BufferReader(body["Body"].read())))
                    self._cache[key] = cached
                parts.append(cached[1])
        return np.concatenate(parts) if parts else _EMPTY

    def close(self) -> None:
        self.server.stop()


#: SQL types of ``ORDER_STREAM_COLUMNS``.
_SQL_TYPES = {
    "order_id": "bigint",
    "customer_id": "bigint",
    "product": "text",
    "amount_cents": "bigint",
    "customer_total_cents": "bigint",
    "region": "text",
    "amount_usd": "double precision",
}


def _safe_dsn(dsn: str) -> str:
    """``host:port/dbname`` of ``dsn``, without user or password."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        info = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001 - never echo a DSN that could not be parsed
        return "the database at --dsn"
    host = info.get("host") or "localhost"
    port = info.get("port") or "5432"
    return f"{host}:{port}/{info.get('dbname') or ''}"


class PostgresTarget(Target):
    kind = SinkKind.POSTGRES

    def __init__(self, dsn: str) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise TargetError(
                f'--sink postgres needs psycopg 3 ({exc}): pip install "psycopg[binary]"'
            ) from None
        from sinks.postgres import PostgresSink

        self._sink_class = PostgresSink
        self.dsn = dsn
        try:
            self._conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            # psycopg's message names host, port and user, never the password
            raise TargetError(f"cannot connect to {_safe_dsn(dsn)}: {exc}") from None
        self._tables: dict[str, str] = {}

    def describe(self) -> str:
        return f"rows of a table per run in {_safe_dsn(self.dsn)} (sinks.postgres.PostgresSink)"

    def _table(self, run: str) -> str:
        from psycopg import sql

        if run not in self._tables:
            name = f"rayflow_demo_{run.replace('-', '_')}"
            columns = sql.SQL(", ").join(
                sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(_SQL_TYPES[c]))
                for c in ORDER_STREAM_COLUMNS
            )
            # no key: duplicates must stay countable
            self._conn.execute(
                sql.SQL("CREATE TABLE {} ({})").format(sql.Identifier(name), columns)
            )
            self._tables[run] = name
        return self._tables[run]

    def sink(self, run: str, guarantee: DeliveryGuarantee, rolling: RollingPolicy) -> Sink:
        options: dict[str, Any] = {
            "columns": list(ORDER_STREAM_COLUMNS),
            "delivery_guarantee": guarantee,
        }
        if "rolling_policy" in inspect.signature(self._sink_class).parameters:
            options["rolling_policy"] = rolling
        return self._sink_class(self.dsn, self._table(run), **options)

    def _query(self, run: str, what: str) -> Any:
        from psycopg import sql

        if run not in self._tables:
            return None
        return self._conn.execute(
            sql.SQL(what).format(sql.Identifier(self._tables[run]))
        ).fetchall()

    def order_ids(self, run: str) -> np.ndarray:
        rows = self._query(run, "SELECT order_id FROM {}")
        if not rows:
            return _EMPTY
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def committed(self, run: str) -> int:
        rows = self._query(run, "SELECT count(*) FROM {}")
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        from psycopg import sql

        try:
            for name in self._tables.values():
                self._conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
        finally:
            self._conn.close()


def open_target(
    kind: SinkKind,
    workdir: Path,
    dsn: str | None = None,
    kafka: Any = None,
    partitions: int = 2,
) -> Target:
    """The target for ``--sink kind`` (``workdir`` holds local output; ``kafka``, a
    ``rayflow.demo.kafka.DemoKafka``, is the broker of ``--sink kafka``, whose topics get
    ``partitions`` partitions)."""
    if kind is SinkKind.FILES:
        return FilesTarget(workdir / "out")
    if kind is SinkKind.S3:
        from rayflow.demo.s3server import MotoMissingError

        try:
            return S3Target()
        except MotoMissingError as exc:
            raise TargetError(str(exc)) from None
    if kind is SinkKind.POSTGRES:
        if not dsn:
            raise TargetError("--sink postgres needs --dsn (e.g. postgresql://user@host/db)")
        return PostgresTarget(dsn)
    if kind is SinkKind.KAFKA:
        from rayflow.demo.kafka import KafkaTarget

        if kafka is None:
            raise TargetError("--sink kafka needs a Kafka broker")
        return KafkaTarget(kafka, partitions)
    raise TargetError(f"unknown sink {kind!r}")
