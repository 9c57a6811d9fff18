"""PostgreSQL sinks (psycopg 3): exactly once through prepared transactions, and an
upsert sink whose replays are idempotent by key.

``PostgresSink(dsn, table, columns=None)``: each subtask writes the rows of one
checkpoint into one database transaction, with ``COPY ... FROM STDIN`` (CSV made by
Arrow; values never become SQL text). EXACTLY_ONCE:

* at the checkpoint barrier, ``PREPARE TRANSACTION '<gid>'``: the rows survive any
  failure but nobody sees them. The transaction id is
  ``rayflow_<job>_<operator uid>_<subtask:04d>_<run>-a<attempt>-c<checkpoint>``: the
  sink's prefix, the subtask, and the run, attempt and checkpoint it belongs to
  (checkpoint ids never repeat in a job), so the work of a stale attempt never shares an
  id with its successor's and is found by the prefix;
* when the checkpoint completes, ``COMMIT PREPARED``. A transaction that is already gone
  is recognised for sure, not guessed: the committable carries the transaction's id
  (``txid_current()`` before the prepare), and ``txid_status`` says ``committed``
  (ALREADY_COMMITTED), ``aborted`` (FAILED: its rows are lost, said loudly) or that it
  cannot tell any more (FAILED, with the reason);
* after a restore, the runtime commits the prepared transactions the restored checkpoint
  holds, and ``abort_lingering`` rolls back every other one of the subtask, found in
  ``pg_prepared_xacts`` by the prefix (in this database only). When input has ended and
  everything is committed, and when the job is cancelled, the same sweep runs: a
  finished or cancelled job leaves no prepared transaction behind.
* PREPARE TRANSACTION needs ``max_prepared_transactions > 0`` on the server; with 0 the
  job fails when it starts, naming the setting.
* one live run per job name and sink in a database, whichever Ray cluster it runs on:
  every session of a run holds the run's advisory lock (shared), the job master's too
  (``hold_run``: from before the first attempt until the run is cleaned up, so a run
  waiting between two attempts is found), and a session that finds another run's lock
  held refuses to run (:class:`PostgresRunConflictError`, not recoverable) before it
  commits or rolls back anything: a fresh run never rolls back what a live run of the
  same name prepared. Left: while a run's job master is being replaced, none of its
  processes holds the lock.

AT_LEAST_ONCE and NONE commit at the barrier (and when a transaction rolls), with a plain
COMMIT.

``PostgresUpsertSink(dsn, table, key_columns)``: write-through, AT_LEAST_ONCE. Rows are
buffered and, at every checkpoint barrier (and every ``max_buffered_rows``), copied into
a temporary table and merged with one ``INSERT ... ON CONFLICT (key) DO UPDATE`` in one
transaction. Its end-to-end guarantee is "exactly-once effect through idempotent upsert"
when the upsert is idempotent (``UpsertMode.OVERWRITE`` or ``KEEP_FIRST``) and the job's
state is exact (exactly-once checkpoints): a replay then writes the same rows under the
same keys again (the seed's Elasticsearch-by-document-id pattern). ``UpsertMode.ADD``
adds each write to the row, so a replay adds again: at-least-once, and the job says so.

Both check their target on the driver when the job starts (the DSN connects, the table
and columns exist; the upsert's key has a unique index) and fail there with a
:class:`PostgresSinkError` naming the sink and the table. A row the server refuses (a
type that does not fit, a unique violation) fails the job with the sink, the table and
the row's position in the batch (from the server's ``COPY ..., line N``); what was
committed stays committed. Identifiers are quoted (``psycopg.sql.Identifier``), values
are always data or parameters, and the DSN's password never appears in ``repr``, logs,
errors or ``explain()``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote, quote_plus

import pyarrow as pa
import pyarrow.csv as pcsv

from rayflow.guarantees import CheckpointingFacts, DeliveryGuarantee, GuaranteeResolution
from rayflow.recoverability import NonRecoverableError
from rayflow.sink import (
    CommitOutcome,
    CommittableSerializer,
    Committer,
    RollingPolicy,
    RunHold,
    Sink,
    SinkContext,
    SinkWriter,
    TransactionWriter,
    TwoPhaseCommittingSink,
    _id_part,
)

__all__ = [
    "PostgresSink",
    "PostgresUpsertSink",
    "PostgresCommittable",
    "PostgresCommittableSerializer",
    "PostgresSinkError",
    "PostgresRunConflictError",
    "UpsertMode",
]

log = logging.getLogger("rayflow.sinks.postgres")

#: PostgreSQL's limit for a prepared transaction's id (GIDSIZE - 1)
MAX_GID = 199
#: how often the server checks that a writer's client is still there while it works
CLIENT_CHECK_MS = 1000
#: how long a session waits for another run's sessions of the same sink to go before it
#: refuses to run next to that run (a run that has just ended leaves its sessions at the
#: server for a moment, until the server sees their clients gone)
LIVE_RUN_WAIT_S = 5.0
#: how long a session of the run that was there first (a session of it found no other run
#: and went on: :func:`_first_there`) waits for a newer run's sessions to go: the newer run
#: saw this run's sessions, so it refuses within its own LIVE_RUN_WAIT_S, however slowly
OLDER_RUN_WAIT_S = 3 * LIVE_RUN_WAIT_S
#: how long a writer waits for a lock before it fails (``lock_timeout``), unless the sink
#: says otherwise: a row that repeats a unique key of a transaction this subtask prepared
#: and has not committed yet waits for that transaction, which only this subtask's mailbox
#: (the one waiting) commits
WRITER_LOCK_TIMEOUT_S = 30.0
#: server-side TCP keepalives of a session holding a run's lock: the lock of a client
#: whose machine vanished without closing its connection goes within about 25 s
_KEEPALIVE = {"tcp_keepalives_idle": 10, "tcp_keepalives_interval": 5, "tcp_keepalives_count": 3}
_LINE = re.compile(r"\bline (\d+)")


class PostgresSinkError(RuntimeError):
    """A PostgreSQL sink could not do its work; the message names the sink, the table
    and, for a refused row, its position. Never holds the DSN's password."""

    def __init__(self, message: str, sqlstate: str | None = None, row: int | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        #: 1-based position of the refused row in the batch being written (None: unknown)
        self.row = row


class PostgresRunConflictError(PostgresSinkError, NonRecoverableError):
    """Another run of the same job name writes through the same PostgresSink into the same
    database right now (from another Ray cluster, say): this run refuses to run next to
    it. No restart can fix that while the other run lives."""


def _lock_key(text: str) -> int:
    """A 31-bit advisory lock key for ``text``."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def _went_on_key(keys: tuple[int, int]) -> int:
    """The advisory lock (one bigint key) a session of a run takes once it found no
    other run's session and went on: at the server it is the pair of ``keys`` (``classid``
    the sink, ``objid`` the run) with ``objsubid`` 1, next to the run's lock (2)."""
    return (keys[0] << 32) | keys[1]


def _first_there(sessions: list[tuple[int, int, str]], run_key: int) -> bool:
    """Whether the run of ``run_key`` was there first: one of its sessions found no other
    run and went on (``sessions``: ``(run key, lock kind, application name)`` of every
    lock of one sink's runs; kind 1 is the lock a session takes once it went on, kind 2
    the run's lock every session takes first). When the sessions connected says nothing:
    a session can connect, stall, and take its run's lock after another run went on."""
    return any(run == run_key and kind == 1 for run, kind, _ in sessions)


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - psycopg is a dependency of the tests
        raise ImportError(
            f'sinks.postgres needs psycopg 3: pip install "psycopg[binary]" ({exc})'
        ) from None
    return psycopg


def _sql() -> Any:
    from psycopg import sql

    return sql


# --- the target: DSN, table, columns --------------------------------------------------------


class _Target:
    """What both PostgreSQL sinks share: where they write, and how they say so safely."""

    def _init_target(
        self,
        kind: str,
        dsn: str,
        table: str | Sequence[str],
        columns: Sequence[str] | None,
        connect_timeout: float,
    ) -> None:
        self._kind = kind
        if not isinstance(dsn, str) or not dsn:
            raise ValueError(f"{kind}: dsn must be a non-empty libpq connection string or URI")
        try:
            info = _psycopg().conninfo.conninfo_to_dict(dsn)
        except Exception:  # noqa: BLE001 - its message may quote the DSN, password and all
            raise ValueError(
                f"{kind}: dsn is not a libpq connection string or URI "
                "(postgresql://user:password@host:port/dbname or 'host=... dbname=...')"
            ) from None
        #: the connection string (configuration: it travels to every subtask; never shown)
        self.dsn = dsn
        self._password = str(info.get("password") or "")
        #: every spelling of the password this DSN may hold or a message may quote
        self._secrets = _spellings(self._password, dsn)
        #: the DSN as it may be shown: parsed, with the password replaced
        self._shown_dsn = _psycopg().conninfo.make_conninfo(
            "", **{k: ("***" if k == "password" else v) for k, v in info.items()}
        )
        self._where = (
            f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/"
            f"{info.get('dbname') or ''}" + (f" as {info['user']}" if info.get("user") else "")
        )
        if isinstance(table, str):
            parts = tuple(table.split(".")) if table.count(".") == 1 else (table,)
        else:
            parts = tuple(table)
        if not parts or not all(isinstance(p, str) and p for p in parts) or len(parts) > 2:
            raise ValueError(
                f"{kind}: table must be 'name', 'schema.name' or a (schema, name) tuple, "
                f"got {table!r}"
            )
        self.table = parts
        if columns is not None:
            columns = tuple(columns)
            if not columns or not all(isinstance(c, str) and c for c in columns):
                raise ValueError(f"{kind}: columns must be non-empty column names")
            if len(set(columns)) != len(columns):
                raise ValueError(f"{kind}: columns name a column twice: {list(columns)}")
        self.columns: tuple[str, ...] | None = columns
        self.connect_timeout = connect_timeout

    # --- names, safely -----------------------------------------------------------------

    @property
    def table_name(self) -> str:
        return ".".join(self.table)

    def _label(self, name: str = "") -> str:
        who = f"{self._kind} {name!r}" if name else self._kind
        return f"{who} (table {self.table_name} at {self._where})"

    def _scrub(self, text: str) -> str:
        """``text`` without the DSN's password, however spelled (in case a message
        quotes it)."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _safe_dsn(self) -> str:
        return self._shown_dsn

    def _describe_error(self, exc: BaseException) -> str:
        sqlstate = getattr(exc, "sqlstate", None)
        diag = getattr(exc, "diag", None)
        detail = getattr(diag, "message_detail", None) if diag is not None else None
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if detail:
            text += f" ({detail})"
        if sqlstate:
            text += f" [SQLSTATE {sqlstate}]"
        return self._scrub(text)

    # --- SQL -----------------------------------------------------------------------------

    def _table_sql(self) -> Any:
        return _sql().Identifier(*self.table)

    def _columns_sql(self, columns: Sequence[str]) -> Any:
        sql = _sql()
        return sql.SQL(", ").join(sql.Identifier(c) for c in columns)

    def _connect(self, name: str, application_name: str, autocommit: bool) -> Any:
        psycopg = _psycopg()
        try:
            return psycopg.connect(
                self.dsn,
                autocommit=autocommit,
                connect_timeout=max(1, int(self.connect_timeout)),
                application_name=application_name[:63],
            )
        except psycopg.Error as exc:
            raise PostgresSinkError(
                f"{self._label(name)}: cannot connect: {self._describe_error(exc)}",
                getattr(exc, "sqlstate", None),
            ) from None

    def _watch_client(self, conn: Any) -> None:
        """Make the server drop this session's work when its client is gone (PostgreSQL
        14 and later; earlier servers notice only when they answer).

        A writer's process can be killed while its PREPARE TRANSACTION (or a merge) is
        still running at the server, held up by a deferred trigger or a lock: without
        this, the server finishes it for nobody after the next attempt has listed and
        swept this subtask's prepared transactions, and it stays behind. With it, the
        server aborts it within ``CLIENT_CHECK_MS`` of the client's death."""
        if conn.info.server_version < 140000:
            return
        try:
            conn.execute(f"SET client_connection_check_interval = {CLIENT_CHECK_MS}")
            if not conn.autocommit:
                conn.commit()  # a SET rolled back with its transaction would be undone
        except _psycopg().Error as exc:  # a safeguard, not a requirement
            log.warning("%s: %s", self._label(), self._describe_error(exc))
            if not conn.autocommit:
                conn.rollback()

    def _table_columns(self, conn: Any, name: str) -> dict[str, str]:
        """The table's columns and their types; raises when the table does not exist."""
        sql = _sql()
        found = conn.execute(
            "SELECT to_regclass(%s)", (self._table_sql().as_string(conn),)
        ).fetchone()[0]
        if found is None:
            raise PostgresSinkError(
                f"{self._label(name)}: the table {self.table_name} does not exist "
                "(create it before the job starts)",
                "42P01",
            )
        rows = conn.execute(
            sql.SQL(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = {}::regclass AND attnum > 0 AND NOT attisdropped "
                "ORDER BY attnum"
            ).format(sql.Literal(self._table_sql().as_string(conn)))
        ).fetchall()
        return {column: kind for column, kind in rows}

    def _check_columns(self, table_columns: dict[str, str], wanted: Sequence[str], name: str):
        missing = [c for c in wanted if c not in table_columns]
        if missing:
            raise PostgresSinkError(
                f"{self._label(name)}: the table has no column(s) {missing} "
                f"(it has {list(table_columns)})",
                "42703",
            )

    def _row_error(
        self, exc: BaseException, name: str, batch_rows: int, what: str
    ) -> PostgresSinkError:
        """The server refused a row of a COPY: say which, from its ``line N`` context."""
        diag = getattr(exc, "diag", None)
        context = (getattr(diag, "context", None) or "") if diag is not None else ""
        match = _LINE.search(context)
        row = int(match.group(1)) if match else None
        where = (
            f"row {row} of a batch of {batch_rows}"
            if row is not None
            else f"a batch of {batch_rows} rows (the server did not say which row)"
        )
        return PostgresSinkError(
            f"{self._label(name)}: {what}: the server refused {where}: {self._describe_error(exc)}",
            getattr(exc, "sqlstate", None),
            row,
        )

    def _repr_fields(self) -> str:
        columns = f", columns={list(self.columns)!r}" if self.columns else ""
        return f"dsn={self._safe_dsn()!r}, table={self.table_name!r}{columns}"


def _spellings(password: str, dsn: str) -> list[str]:
    """The ways ``dsn`` may spell ``password`` (as it is, percent-encoded in a URI,
    escaped in a key/value string, and what the DSN itself holds there), longest first."""
    if not password:
        return []
    found = {
        password,
        quote(password, safe=""),
        quote(password),
        quote_plus(password),
        password.replace("\\", "\\\\").replace("'", "\\'"),
    }
    for pattern in (r"^[a-z]+://[^/?#@:]*:([^/?#@]+)@", r"[?&]password=([^&#]+)"):
        match = re.search(pattern, dsn, re.IGNORECASE)
        if match:
            found.add(match.group(1))
    return sorted((s for s in found if s), key=len, reverse=True)


def _application_name(context: SinkContext | None, role: str) -> str:
    if context is None:
        return f"rayflow {role}"
    run = context.run_tag()[-12:]
    return (
        f"rayflow {context.operator_name or context.operator_uid} s{context.subtask_index} "
        f"a{context.attempt} {run} {role}"
    )


def _csv(batch: pa.RecordBatch) -> bytes:
    """``batch`` as CSV rows for ``COPY ... (FORMAT csv)``: nulls are empty, strings quoted."""
    columns = []
    for column in batch.columns:
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            values = column.to_pylist()
            column = pa.array([None if v is None else "\\x" + v.hex() for v in values])
        elif pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        columns.append(column)
    batch = pa.RecordBatch.from_arrays(columns, names=batch.schema.names)
    out = pa.BufferOutputStream()
    pcsv.write_csv(batch, out, pcsv.WriteOptions(include_header=False))
    return out.getvalue().to_pybytes()


def _select(batch: pa.RecordBatch, columns: Sequence[str], label: str) -> pa.RecordBatch:
    missing = [c for c in columns if c not in batch.schema.names]
    if missing:
        raise PostgresSinkError(
            f"{label}: the stream has no column(s) {missing} (it has {batch.schema.names})"
        )
    return batch.select(list(columns))


# --- PostgresSink: two-phase commit ----------------------------------------------------------


class _RunHold(RunHold):
    """A session that holds a run's lock; closing it lets the lock go."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - a broken session lets the lock go too
            pass


@dataclass(frozen=True)
class PostgresCommittable:
    """One database transaction of a subtask: its prepared id (None when it was committed
    at pre-commit, without EXACTLY_ONCE), its transaction id and how many rows it holds."""

    gid: str | None
    txid: int
    rows: int


class PostgresCommittableSerializer(CommittableSerializer[PostgresCommittable]):
    """Version 1: the fields as JSON."""

    version = 1

    def serialize(self, committable: PostgresCommittable) -> bytes:
        c = committable
        return json.dumps({"gid": c.gid, "txid": c.txid, "rows": c.rows}).encode("utf-8")

    def deserialize(self, version: int, data: bytes) -> PostgresCommittable:
        d = json.loads(data)
        return PostgresCommittable(d["gid"], int(d["txid"]), int(d["rows"]))


@dataclass
class _PgTransaction:
    sequence: int
    rows: int = 0
    size: int = 0


class PostgresSink(_Target, TwoPhaseCommittingSink[_PgTransaction, PostgresCommittable]):
    """Writes a stream's rows into ``table`` (see the module docstring).

    ``dsn``: a libpq connection string or URI. ``table``: ``"name"``,
    ``"schema.name"`` or a ``(schema, name)`` tuple. ``columns``: the stream's columns
    to write, into the table's columns of the same names (None: every column of the
    stream). ``delivery_guarantee``: left open (None), each job gives the strongest its
    checkpointing allows (EXACTLY_ONCE with exactly-once checkpointing).
    ``rolling_policy``: by default one transaction per checkpoint (no size or age
    rolling). ``max_transaction_lifetime_s``: how long the server lets a transaction stay
    open (``idle_in_transaction_session_timeout``), if it limits that.
    ``lock_timeout_s``: how long a write waits for a lock before the attempt fails
    (None: ``WRITER_LOCK_TIMEOUT_S``; 0: no limit). A row that repeats a unique key of
    a transaction this subtask prepared for a checkpoint whose notification it has not
    handled yet waits for it, and only this subtask commits it: without the limit the
    subtask would wait on itself until the checkpoint timeout.
    """

    def __init__(
        self,
        dsn: str,
        table: str | Sequence[str],
        columns: Sequence[str] | None = None,
        delivery_guarantee: DeliveryGuarantee | None = None,
        rolling_policy: RollingPolicy | None = None,
        connect_timeout: float = 10.0,
        max_transaction_lifetime_s: float | None = None,
        lock_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            delivery_guarantee,
            rolling_policy or RollingPolicy(max_part_size=None, rollover_interval_s=None),
        )
        self._init_target("PostgresSink", dsn, table, columns, connect_timeout)
        self.max_transaction_lifetime_s = max_transaction_lifetime_s
        if lock_timeout_s is not None and lock_timeout_s < 0:
            raise ValueError(f"PostgresSink: lock_timeout_s must be >= 0, got {lock_timeout_s}")
        #: how long a write waits for a lock (None: ``WRITER_LOCK_TIMEOUT_S``; 0: forever)
        self.lock_timeout_s = lock_timeout_s

    def __repr__(self) -> str:
        return (
            f"PostgresSink({self._repr_fields()}, "
            f"delivery_guarantee={self.delivery_guarantee.name})"
        )

    __str__ = __repr__

    # --- transaction ids ------------------------------------------------------------------

    def gid_prefix(self, context: SinkContext) -> str:
        """The prefix of every prepared transaction id of subtask ``context``."""
        return f"rayflow_{self.transaction_prefix(context)}"

    def gid(self, context: SinkContext, checkpoint_id: int | None, sequence: int) -> str:
        run = _id_part(context.run_tag(), 40) if context.run_id else "norun"
        closed_by = f"c{checkpoint_id}" if checkpoint_id is not None else f"s{sequence}"
        gid = f"{self.gid_prefix(context)}{run}-a{context.attempt}-{closed_by}"
        if len(gid) > MAX_GID:  # cannot happen with the parts' limits; never cut silently
            raise ValueError(f"PostgresSink: transaction id {gid!r} is longer than {MAX_GID}")
        return gid

    # --- one live run per job name and sink: the run lock in the database -----------------

    def run_lock_keys(self, context: SinkContext) -> tuple[int, int]:
        """The advisory lock (two int4 keys) every session of ``context`` 's run holds,
        shared: this sink of this job (every subtask), and the run."""
        operator = self.gid_prefix(replace(context, subtask_index=0))[: -len("0000_")]
        return _lock_key(operator), _lock_key(context.run_id)

    def hold_run(self, context: SinkContext) -> _RunHold | None:
        """The job master's session holding the run's lock for the whole run, so that a
        run waiting between two attempts (no subtask connected) is found too; raises
        :class:`PostgresRunConflictError` when another run lives."""
        if not context.run_id or self.guarantee_in(context) is not DeliveryGuarantee.EXACTLY_ONCE:
            return None
        name = context.operator_name
        conn = self._connect(name, _application_name(context, "run"), autocommit=True)
        self._hold_run(conn, context, name)
        return _RunHold(conn)

    def _hold_run(self, conn: Any, context: SinkContext | None, name: str) -> None:
        """Take this run's lock on session ``conn`` (for the session's life) and refuse to
        run while a session of another run of this job's sink holds its own.

        Every session a run opens to write, commit or roll back holds the run's lock, so
        a run with a live session is found for sure. A run that finds another waits up
        to ``LIVE_RUN_WAIT_S`` (an ended run's sessions go a moment after its
        processes), then drops its session and raises :class:`PostgresRunConflictError`
        before it touched anything: it never rolls back what a live run prepared. (Between
        two attempts the job master's session holds it: :meth:`hold_run`.)

        Both runs wait while holding their own lock, so each sees the other for the whole
        wait: the run that was there first (one of its sessions went on before the other
        run took its lock) waits up to ``OLDER_RUN_WAIT_S`` instead, long enough for the
        newer run, which saw it and refuses, to be gone. Otherwise a newer run slow to
        give up would make the first run fail too. "First" is not the oldest session: a
        session that found no other run takes a second lock (:func:`_went_on_key`, one
        bigint key), and a run holding it was there first, whenever its sessions or the
        other run's connected. Which run goes on is decided only by what each sees while
        it holds its lock, as before: never both."""
        if context is None or not context.run_id:
            return
        if self.guarantee_in(context) is not DeliveryGuarantee.EXACTLY_ONCE:
            return
        keys = self.run_lock_keys(context)
        psycopg = _psycopg()
        started = time.monotonic()
        try:
            for setting, value in _KEEPALIVE.items():  # a vanished client's lock goes soon
                conn.execute(f"SET {setting} = {value}")
            conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", keys)
            while True:
                sessions = conn.execute(
                    "SELECT l.objid::bigint, l.objsubid::int, "
                    "coalesce(a.application_name, '') FROM pg_locks l "
                    "LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.objsubid IN (1, 2) AND l.granted "
                    "AND l.database = (SELECT oid FROM pg_database "
                    "WHERE datname = current_database()) "
                    "AND l.classid::bigint = %s",
                    keys[:1],
                ).fetchall()
                if not conn.autocommit:
                    conn.commit()  # the lock is the session's; no transaction stays open
                others = sorted(
                    {(name,) for run, kind, name in sessions if kind == 2 and run != keys[1]}
                )
                wait_s = OLDER_RUN_WAIT_S if _first_there(sessions, keys[1]) else LIVE_RUN_WAIT_S
                if not others or time.monotonic() > started + wait_s:
                    break
                time.sleep(0.2)
            if not others:  # this run went on: a run that comes now sees it was first (only
                # tried: a foreign lock on the key makes this run wait as a newer one would)
                conn.execute("SELECT pg_try_advisory_lock_shared(%s)", (_went_on_key(keys),))
                if not conn.autocommit:
                    conn.commit()
        except psycopg.Error as exc:
            conn.close()
            raise PostgresSinkError(
                f"{self._label(name)}: taking the run's lock: {self._describe_error(exc)}",
                getattr(exc, "sqlstate", None),
            ) from None
        if others:
            conn.close()  # gives up this run's lock at once: the live run goes on
            sessions = ", ".join(sorted(repr(row[0]) for row in others))
            raise PostgresRunConflictError(
                f"{self._label(name)}: another run of job {context.job_name!r} writes "
                f"through this sink into the same database right now (its sessions: "
                f"{sessions}); run {context.run_id} refuses to run next to it: it would "
                "roll back what that run prepared and write every row a second time. "
                "Wait for that run to end, cancel it, or run this one under another "
                "job name."
            )

    # --- the driver -----------------------------------------------------------------------

    def setup(self, job_name: str, guarantee: GuaranteeResolution | None = None) -> None:
        """Checks the target before the job starts (connects, table, columns, and
        prepared transactions for EXACTLY_ONCE)."""
        name = guarantee.sink_name if guarantee is not None else ""
        given = guarantee.delivery_guarantee if guarantee is not None else None
        conn = self._connect(name, f"rayflow {job_name} setup", autocommit=True)
        try:
            table_columns = self._table_columns(conn, name)
            if self.columns is not None:
                self._check_columns(table_columns, self.columns, name)
            if given is DeliveryGuarantee.EXACTLY_ONCE:
                self._check_prepared_transactions(conn, name)
        finally:
            conn.close()

    def _check_prepared_transactions(self, conn: Any, name: str) -> None:
        value = conn.execute("SHOW max_prepared_transactions").fetchone()[0]
        if int(value) <= 0:
            raise PostgresSinkError(
                f"{self._label(name)}: EXACTLY_ONCE needs prepared transactions, but the "
                "server has max_prepared_transactions = 0. Set max_prepared_transactions "
                "in postgresql.conf to at least twice the sink's parallelism and restart "
                "the server, or ask the sink for DeliveryGuarantee.AT_LEAST_ONCE.",
                "55000",
            )

    def merge_results(self, results: list[Any]) -> int:
        """The number of transactions committed (repeated commits included)."""
        return sum(r for r in results if isinstance(r, int))

    # --- the subtask's parts ----------------------------------------------------------------

    def create_transaction_writer(self, context: SinkContext) -> _PgWriter:
        return _PgWriter(self, context)

    def create_committer(self, context: SinkContext | None) -> _PgCommitter:
        return _PgCommitter(self, context)

    def committable_serializer(self) -> PostgresCommittableSerializer:
        return PostgresCommittableSerializer()


class _PgWriter(TransactionWriter[_PgTransaction, PostgresCommittable]):
    """One subtask's database transactions, on one connection of its own."""

    def __init__(self, sink: PostgresSink, context: SinkContext) -> None:
        self.sink = sink
        self.context = context
        self.name = context.operator_name
        self.label = sink._label(self.name)
        self.guarantee = sink.guarantee_in(context)
        self.conn: Any = None

    def _connection(self) -> Any:
        if self.conn is None or self.conn.closed:
            conn = self.sink._connect(
                self.name, _application_name(self.context, "writer"), autocommit=False
            )
            self.sink._watch_client(conn)
            self._limit_lock_waits(conn)
            self.sink._hold_run(conn, self.context, self.name)
            self.conn = conn
            if self.guarantee is DeliveryGuarantee.EXACTLY_ONCE:
                try:
                    self.sink._check_prepared_transactions(self.conn, self.name)
                finally:
                    self.conn.rollback()
        return self.conn

    def _lock_timeout_s(self) -> float:
        given = self.sink.lock_timeout_s
        return WRITER_LOCK_TIMEOUT_S if given is None else given

    def _limit_lock_waits(self, conn: Any) -> None:
        try:
            conn.execute(f"SET lock_timeout = {int(self._lock_timeout_s() * 1000)}")
            conn.commit()
        except _psycopg().Error as exc:  # a safeguard, not a requirement
            log.warning("%s: %s", self.label, self.sink._describe_error(exc))
            conn.rollback()

    def begin_transaction(self, sequence: int) -> _PgTransaction:
        return _PgTransaction(sequence)

    def write(self, transaction: _PgTransaction, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        columns = self.sink.columns or tuple(batch.schema.names)
        data = _csv(_select(batch, columns, self.label))
        sql = _sql()
        statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            self.sink._table_sql(), self.sink._columns_sql(columns)
        )
        conn = self._connection()
        self.context.check_fence(f"{self.label}: COPY")
        psycopg = _psycopg()
        try:
            with conn.cursor() as cursor, cursor.copy(statement) as copy:
                copy.write(data)
        except psycopg.Error as exc:
            self._rollback()
            what = (
                f"writing into transaction {transaction.sequence} of subtask "
                f"{self.context.subtask_index} (after its first {transaction.rows} rows)"
            )
            if getattr(exc, "sqlstate", None) == "55P03":  # lock_not_available
                raise PostgresSinkError(
                    f"{self.label}: {what}: waited more than {self._lock_timeout_s():g} s "
                    "for a lock. Most likely a row of this batch repeats a unique key that "
                    "a transaction of this subtask holds, prepared for a checkpoint and not "
                    "committed yet (a key written in two checkpoints: write updates with "
                    "PostgresUpsertSink); else another session locks the table "
                    f"({self.sink._describe_error(exc)})",
                    "55P03",
                ) from None
            raise self.sink._row_error(exc, self.name, batch.num_rows, what) from None
        transaction.rows += batch.num_rows
        transaction.size += len(data)

    def transaction_size(self, transaction: _PgTransaction) -> int:
        return transaction.size

    def is_empty(self, transaction: _PgTransaction) -> bool:
        return transaction.rows == 0

    def pre_commit(
        self, transaction: _PgTransaction, checkpoint_id: int | None = None
    ) -> PostgresCommittable:
        conn = self._connection()
        psycopg = _psycopg()
        sql = _sql()
        gid = None
        try:
            txid = conn.execute("SELECT txid_current()").fetchone()[0]
            if self.guarantee is DeliveryGuarantee.EXACTLY_ONCE:
                gid = self.sink.gid(self.context, checkpoint_id, transaction.sequence)
                self.context.check_fence(f"{self.label}: PREPARE TRANSACTION {gid}")
                conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
            else:
                self.context.check_fence(f"{self.label}: COMMIT")
                conn.commit()
        except psycopg.Error as exc:
            self._rollback()
            what = "prepare" if gid else "commit"
            hint = ""
            if getattr(exc, "sqlstate", None) == "55000" and gid:
                hint = " (is max_prepared_transactions 0 on the server?)"
            raise PostgresSinkError(
                f"{self.label}: could not {what} transaction {transaction.sequence} of "
                f"subtask {self.context.subtask_index} ({transaction.rows} rows){hint}: "
                f"{self.sink._describe_error(exc)} (a deferred constraint names no row)",
                getattr(exc, "sqlstate", None),
            ) from None
        return PostgresCommittable(gid, int(txid), transaction.rows)

    def abort_transaction(self, transaction: _PgTransaction) -> None:
        self._rollback()

    def _rollback(self) -> None:
        if self.conn is not None and not self.conn.closed:
            try:
                self.conn.rollback()
            except Exception as exc:  # noqa: BLE001 - a broken connection rolls back by itself
                log.debug("%s: rollback failed: %s", self.label, self.sink._scrub(str(exc)))
                self._drop()

    def _drop(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        """Rolls back the open transaction (prepared ones stay) and disconnects."""
        self._rollback()
        self._drop()


class _PgCommitter(Committer[PostgresCommittable]):
    """Commits and rolls back prepared transactions, on a connection of its own."""

    def __init__(self, sink: PostgresSink, context: SinkContext | None) -> None:
        self.sink = sink
        self.context = context
        self.name = context.operator_name if context is not None else ""
        self.label = sink._label(self.name)
        self.conn: Any = None

    def _connection(self) -> Any:
        if self.conn is None or self.conn.closed:
            conn = self.sink._connect(
                self.name, _application_name(self.context, "committer"), autocommit=True
            )
            self.sink._hold_run(conn, self.context, self.name)
            self.conn = conn
        return self.conn

    def _drop(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def commit(self, committable: PostgresCommittable) -> CommitOutcome:
        if committable.gid is None:
            return CommitOutcome.already_committed("committed at pre-commit")
        psycopg = _psycopg()
        sql = _sql()
        gid = committable.gid
        try:
            conn = self._connection()
            conn.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
            return CommitOutcome.committed()
        except PostgresRunConflictError as exc:  # another run lives: no retry helps
            return CommitOutcome.failed(str(exc), exc)
        except PostgresSinkError as exc:  # cannot connect now
            return CommitOutcome.retry_later(str(exc), exc)
        except psycopg.errors.UndefinedObject:
            return self._gone(committable)
        except psycopg.errors.ObjectInUse as exc:  # another session is finishing it
            return CommitOutcome.retry_later(self.sink._describe_error(exc))
        except psycopg.OperationalError as exc:
            self._drop()
            return CommitOutcome.retry_later(self.sink._describe_error(exc))
        except psycopg.Error as exc:
            message = f"{self.label}: COMMIT PREPARED {gid}: {self.sink._describe_error(exc)}"
            return CommitOutcome.failed(message, PostgresSinkError(message, exc.sqlstate))

    def _gone(self, committable: PostgresCommittable) -> CommitOutcome:
        """The prepared transaction no longer exists: its transaction id's status says
        whether it was committed (before: success) or rolled back (its rows are lost)."""
        psycopg = _psycopg()
        try:
            status = (
                self._connection()
                .execute("SELECT txid_status(%s)", (committable.txid,))
                .fetchone()[0]
            )
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                self._drop()
            return CommitOutcome.retry_later(self.sink._describe_error(exc))
        if status == "committed":
            return CommitOutcome.already_committed(
                f"{committable.gid} was committed before (transaction {committable.txid})"
            )
        if status == "in progress":
            return CommitOutcome.retry_later(
                f"{committable.gid} is gone but its transaction {committable.txid} is still "
                "in progress (another session is finishing it)"
            )
        why = (
            "was rolled back: its rows are lost"
            if status == "aborted"
            else "is gone and the server no longer knows whether transaction "
            f"{committable.txid} committed (too old for its commit log), so it cannot "
            "be told committed or lost"
        )
        message = (
            f"{self.label}: cannot commit prepared transaction {committable.gid} "
            f"({committable.rows} rows): it {why}. Did someone run ROLLBACK PREPARED, or "
            "restore an older checkpoint of this job meanwhile?"
        )
        return CommitOutcome.failed(message, PostgresSinkError(message))

    def abort(self, committable: PostgresCommittable) -> None:
        if committable.gid is not None:
            self._rollback_prepared(committable.gid)

    def _rollback_prepared(self, gid: str) -> bool:
        psycopg = _psycopg()
        sql = _sql()
        try:
            self._connection().execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            return True
        except psycopg.errors.UndefinedObject:
            return False  # already gone (committed or rolled back)
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                self._drop()
            raise PostgresSinkError(
                f"{self.label}: ROLLBACK PREPARED {gid}: {self.sink._describe_error(exc)}",
                exc.sqlstate,
            ) from None

    def abort_lingering(self, context: SinkContext, keep: Sequence[PostgresCommittable]) -> int:
        """Rolls back the prepared transactions of subtask ``context`` not in ``keep``, and
        those of every subtask index at or beyond the job's parallelism that rescaling
        gives it (``index % parallelism``, as a restore hands out old subtasks' state):
        an earlier run at a higher parallelism may have left them, and no subtask has
        that index any more."""
        prefix = self.sink.gid_prefix(context)
        operator_prefix = prefix[: -len(f"{context.subtask_index:04d}_")]
        kept = {c.gid for c in keep if isinstance(c, PostgresCommittable) and c.gid}
        psycopg = _psycopg()
        try:
            listed = (
                self._connection()
                .execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                    "AND left(gid, %s) = %s ORDER BY gid",
                    (len(operator_prefix), operator_prefix),
                )
                .fetchall()
            )
        except psycopg.Error as exc:
            self._drop()
            raise PostgresSinkError(
                f"{self.label}: listing prepared transactions: {self.sink._describe_error(exc)}",
                getattr(exc, "sqlstate", None),
            ) from None
        parallelism = context.parallelism
        rows = []
        for (gid,) in listed:
            index, separator, _ = gid[len(operator_prefix) :].partition("_")
            if not separator or not index.isdigit():
                continue  # not a subtask's transaction of this sink
            index = int(index)
            if index == context.subtask_index or (
                parallelism > 0
                and index >= parallelism
                and index % parallelism == context.subtask_index
            ):
                rows.append((gid,))
        aborted = 0
        for (gid,) in rows:
            if gid in kept:
                continue
            context.check_fence(f"{self.label}: ROLLBACK PREPARED {gid}")
            if self._rollback_prepared(gid):
                aborted += 1
                log.info("%s: rolled back lingering prepared transaction %s", self.label, gid)
        return aborted

    def committable_id(self, committable: PostgresCommittable) -> str:
        return committable.gid or f"transaction {committable.txid}"

    def close(self) -> None:
        self._drop()


# --- PostgresUpsertSink ----------------------------------------------------------------------


class UpsertMode(enum.Enum):
    """What an upsert does with a row whose key is already in the table.

    OVERWRITE: the new values replace the row (the last write wins; idempotent).
    KEEP_FIRST: the row stays as it is (``DO NOTHING``; idempotent).
    ADD: the new values are added to the row's (counters; NOT idempotent: a replay adds
    again).
    """

    OVERWRITE = "overwrite"
    KEEP_FIRST = "keep first"
    ADD = "add"

    @property
    def idempotent(self) -> bool:
        return self is not UpsertMode.ADD


#: the staging table's column that keeps the order rows arrived in
_ORDER = "rayflow_order"
#: the upsert's alias of the target table
_TARGET = "rayflow_target"


class PostgresUpsertSink(_Target, Sink):
    """Upserts a stream's rows into ``table`` by ``key_columns`` (see the module
    docstring).

    ``columns``: the stream's columns to write (None: every column of the stream); they
    must include the key. ``mode``: :class:`UpsertMode`. ``max_buffered_rows``: rows
    held before a flush between barriers. The table needs a unique index (or primary
    key) on exactly ``key_columns``.
    """

    supported_guarantees = frozenset({DeliveryGuarantee.NONE, DeliveryGuarantee.AT_LEAST_ONCE})

    def __init__(
        self,
        dsn: str,
        table: str | Sequence[str],
        key_columns: Sequence[str],
        columns: Sequence[str] | None = None,
        mode: UpsertMode = UpsertMode.OVERWRITE,
        delivery_guarantee: DeliveryGuarantee | None = None,
        max_buffered_rows: int = 50_000,
        connect_timeout: float = 10.0,
    ) -> None:
        super().__init__(delivery_guarantee)
        self._init_target("PostgresUpsertSink", dsn, table, columns, connect_timeout)
        if isinstance(key_columns, str) or not key_columns:
            raise ValueError(
                "PostgresUpsertSink: key_columns must be a non-empty list of column names"
            )
        self.key_columns = tuple(key_columns)
        if self.columns is not None:
            missing = [k for k in self.key_columns if k not in self.columns]
            if missing:
                raise ValueError(
                    f"PostgresUpsertSink: key column(s) {missing} are not among columns "
                    f"{list(self.columns)}"
                )
        if not isinstance(mode, UpsertMode):
            raise TypeError(f"PostgresUpsertSink: mode must be an UpsertMode, got {mode!r}")
        self.mode = mode
        if not isinstance(max_buffered_rows, int) or max_buffered_rows < 1:
            raise ValueError(
                f"PostgresUpsertSink: max_buffered_rows must be an int >= 1, got "
                f"{max_buffered_rows!r}"
            )
        self.max_buffered_rows = max_buffered_rows

    def __repr__(self) -> str:
        return (
            f"PostgresUpsertSink({self._repr_fields()}, key_columns={list(self.key_columns)!r}, "
            f"mode={self.mode.name}, delivery_guarantee={self.delivery_guarantee.name})"
        )

    __str__ = __repr__

    def describe_end_to_end(
        self, guarantee: DeliveryGuarantee, checkpointing: CheckpointingFacts
    ) -> str:
        keys = ", ".join(self.key_columns)
        if guarantee is DeliveryGuarantee.NONE or not checkpointing.enabled:
            return super().describe_end_to_end(guarantee, checkpointing)
        if not self.mode.idempotent:
            return (
                f"at-least-once: UpsertMode.{self.mode.name} adds every write to the row "
                f"with the same ({keys}), so a replay after a failure adds the replayed "
                "records again (the upsert is not idempotent)"
            )
        if checkpointing.mode != "exactly-once":
            return (
                "at-least-once: checkpoints do not align barriers, so state may count "
                f"records twice, and the upsert by ({keys}) writes those counts"
            )
        return (
            f"exactly-once effect through idempotent upsert on ({keys}): a replay after a "
            "failure writes the same rows under the same keys again "
            f"(UpsertMode.{self.mode.name}); until it has caught up a reader may see a "
            "key's earlier value"
        )

    def setup(self, job_name: str, guarantee: GuaranteeResolution | None = None) -> None:
        """Checks the target before the job starts: connects; the table, the columns and
        a unique index on exactly the key exist."""
        name = guarantee.sink_name if guarantee is not None else ""
        conn = self._connect(name, f"rayflow {job_name} setup", autocommit=True)
        try:
            table_columns = self._table_columns(conn, name)
            self._check_columns(table_columns, self.columns or self.key_columns, name)
            self._check_columns(table_columns, self.key_columns, name)
            sql = _sql()
            unique = conn.execute(
                sql.SQL(
                    "SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_index i "
                    "JOIN pg_attribute a ON a.attrelid = i.indrelid "
                    "AND a.attnum = ANY(i.indkey) "
                    "WHERE i.indrelid = {}::regclass AND i.indisunique "
                    "AND i.indpred IS NULL AND i.indexprs IS NULL GROUP BY i.indexrelid"
                ).format(sql.Literal(self._table_sql().as_string(conn)))
            ).fetchall()
            if sorted(self.key_columns) not in [sorted(row[0]) for row in unique]:
                raise PostgresSinkError(
                    f"{self._label(name)}: no unique index or primary key on exactly "
                    f"({', '.join(self.key_columns)}), which INSERT ... ON CONFLICT needs; "
                    "create one (ALTER TABLE ... ADD PRIMARY KEY / CREATE UNIQUE INDEX)",
                    "42P10",
                )
        finally:
            conn.close()

    def create_writer(self, context: SinkContext) -> _UpsertWriter:
        return _UpsertWriter(self, context)

    def merge_results(self, results: list[Any]) -> int:
        """The number of rows upserted (replayed ones included)."""
        return sum(r for r in results if isinstance(r, int))


class _UpsertWriter(SinkWriter):
    """Buffers a subtask's rows; a flush stages them with COPY and merges them."""

    def __init__(self, sink: PostgresUpsertSink, context: SinkContext) -> None:
        self.sink = sink
        self.context = context
        self.name = context.operator_name
        self.label = sink._label(self.name)
        self.conn: Any = None
        self.buffer: list[pa.RecordBatch] = []
        self.buffered = 0
        self.columns: tuple[str, ...] | None = sink.columns
        self.written = 0
        self._staging = None

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self.columns is None:
            self.columns = tuple(batch.schema.names)
            missing = [k for k in self.sink.key_columns if k not in self.columns]
            if missing:
                raise PostgresSinkError(
                    f"{self.label}: the stream has no key column(s) {missing} "
                    f"(it has {list(self.columns)})"
                )
        self.buffer.append(_select(batch, self.columns, self.label))
        self.buffered += batch.num_rows
        if self.buffered >= self.sink.max_buffered_rows:
            self.flush()

    def _connection(self) -> Any:
        if self.conn is None or self.conn.closed:
            self.conn = self.sink._connect(
                self.name, _application_name(self.context, "upsert"), autocommit=False
            )
            self.sink._watch_client(self.conn)
            self._staging = None
        return self.conn

    def _merge_sql(self, columns: Sequence[str]) -> Any:
        sql = _sql()
        keys = self.sink.key_columns
        values = [c for c in columns if c not in keys]
        target, staging = self.sink._table_sql(), sql.Identifier(self._staging)
        ident = sql.Identifier
        cols = self.sink._columns_sql(columns)
        key_list = self.sink._columns_sql(keys)
        mode = self.sink.mode
        if mode is UpsertMode.ADD:
            select = sql.SQL("SELECT {} FROM {} GROUP BY {}").format(
                sql.SQL(", ").join(
                    [ident(c) for c in keys]
                    + [sql.SQL("sum({}) AS {}").format(ident(c), ident(c)) for c in values]
                ),
                staging,
                key_list,
            )
        else:
            order = sql.SQL("DESC" if mode is UpsertMode.OVERWRITE else "ASC")
            select = sql.SQL("SELECT DISTINCT ON ({}) {} FROM {} ORDER BY {}, {} {}").format(
                key_list, cols, staging, key_list, ident(_ORDER), order
            )
        if mode is UpsertMode.KEEP_FIRST or not values:
            action = sql.SQL("DO NOTHING")
        elif mode is UpsertMode.ADD:
            action = sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{} = {}.{} + EXCLUDED.{}").format(
                        ident(c), ident(_TARGET), ident(c), ident(c)
                    )
                    for c in values
                )
            )
        else:
            action = sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{} = EXCLUDED.{}").format(ident(c), ident(c)) for c in values
                )
            )
        return sql.SQL("INSERT INTO {} AS {} ({}) {} ON CONFLICT ({}) {}").format(
            target, ident(_TARGET), cols, select, key_list, action
        )

    def flush(self) -> None:
        """Upsert every buffered row in one transaction (at every checkpoint barrier)."""
        if not self.buffer:
            return
        batches, self.buffer, rows = self.buffer, [], self.buffered
        self.buffered = 0
        table = pa.Table.from_batches(batches).combine_chunks()
        columns = list(table.schema.names)
        psycopg = _psycopg()
        sql = _sql()
        conn = self._connection()
        try:
            if self._staging is None:
                self._staging = "rayflow_upsert_staging"
                conn.execute(
                    sql.SQL(
                        "CREATE TEMP TABLE IF NOT EXISTS {} ON COMMIT DELETE ROWS AS "
                        "SELECT {} FROM {} WITH NO DATA"
                    ).format(
                        sql.Identifier(self._staging),
                        self.sink._columns_sql(columns),
                        self.sink._table_sql(),
                    )
                )
                conn.execute(
                    sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} bigserial").format(
                        sql.Identifier(self._staging), sql.Identifier(_ORDER)
                    )
                )
                conn.commit()
            data = b"".join(_csv(b) for b in table.to_batches())
            copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
                sql.Identifier(self._staging), self.sink._columns_sql(columns)
            )
            with conn.cursor() as cursor, cursor.copy(copy_sql) as copy:
                copy.write(data)
        except psycopg.Error as exc:
            self._rollback()
            raise self.sink._row_error(exc, self.name, rows, "staging rows to upsert") from None
        try:
            conn.execute(self._merge_sql(columns))
            self.context.check_fence(f"{self.label}: COMMIT")
            conn.commit()
        except psycopg.Error as exc:
            self._rollback()
            row = self._locate(table, columns)
            where = f"row {row} of a batch of {rows}" if row else f"a batch of {rows} rows"
            raise PostgresSinkError(
                f"{self.label}: upserting {where}: {self.sink._describe_error(exc)}",
                getattr(exc, "sqlstate", None),
                row,
            ) from None
        self.written += rows

    def _locate(self, table: pa.Table, columns: Sequence[str]) -> int | None:
        """Which row the merge refused: try them one by one (then roll everything back)."""
        psycopg = _psycopg()
        sql = _sql()
        keys = self.sink.key_columns
        values = [c for c in columns if c not in keys]
        action = (
            sql.SQL("DO NOTHING")
            if not values or self.sink.mode is UpsertMode.KEEP_FIRST
            else sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                    for c in values
                )
            )
        )
        statement = sql.SQL("INSERT INTO {} ({}) VALUES ({}) ON CONFLICT ({}) {}").format(
            self.sink._table_sql(),
            self.sink._columns_sql(columns),
            sql.SQL(", ").join(sql.Placeholder() for _ in columns),
            self.sink._columns_sql(keys),
            action,
        )
        conn = self.conn
        if conn is None or conn.closed:
            return None
        try:
            with conn.transaction(force_rollback=True):  # nothing of this stays
                for position, row in enumerate(table.to_pylist(), start=1):
                    try:
                        with conn.transaction():  # a savepoint per row
                            conn.execute(statement, [row[c] for c in columns])
                    except psycopg.Error:
                        return position
            return None
        except psycopg.Error:
            return None
        finally:
            self._rollback()

    def finish(self) -> int:
        self.flush()
        return self.written

    def _rollback(self) -> None:
        if self.conn is not None and not self.conn.closed:
            try:
                self.conn.rollback()
            except Exception:  # noqa: BLE001 - a broken connection rolls back by itself
                self._drop()

    def _drop(self) -> None:
        conn, self.conn = self.conn, None
        self._staging = None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        """Drops what is buffered (an attempt that failed replays it) and disconnects."""
        self.buffer, self.buffered = [], 0
        self._rollback()
        self._drop()
