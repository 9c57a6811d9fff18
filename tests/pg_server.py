"""A real PostgreSQL for tests: a throwaway server on 127.0.0.1, started with initdb/pg_ctl.

One server runs per test session (the ``postgres`` fixture, registered in
tests/conftest.py); ``postgres_db`` gives each test a fresh database of its own and drops
it after. The server:

- listens on 127.0.0.1 only, on a free port, with its socket and data in a temporary
  directory that is removed when it stops;
- has ``max_prepared_transactions = 20`` (two-phase commit) and fsync off (a throwaway);
- asks for a password over TCP (scram-sha-256), so a DSN that lost its password fails,
  and tests can check that the password (``PgServer.password``) never shows up in logs,
  errors or plans.

PostgreSQL refuses to run as root: as root, initdb and pg_ctl run as the ``postgres``
OS user (``runuser -u postgres --``) and the temporary directory is chowned to it.

Where no server binary exists, tests that need one are skipped with the reason, unless
``RAYFLOW_REQUIRE_POSTGRES=1`` (CI sets it): then they fail, so a CI machine without
PostgreSQL is never mistaken for a green run. ``start_server()`` serves scripts (chaos
runners) outside pytest.
"""

from __future__ import annotations

import atexit
import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest

__all__ = [
    "PgServer",
    "PgDatabase",
    "PostgresUnavailable",
    "REQUIRE_ENV",
    "find_binaries",
    "start_server",
    "postgres",
    "postgres_db",
]

#: Set to 1 to make a missing PostgreSQL a test failure instead of a skip (CI does).
REQUIRE_ENV = "RAYFLOW_REQUIRE_POSTGRES"

_SUPERUSER = "rayflow"
_OS_USER = "postgres"
_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "max_prepared_transactions": "20",
    "max_connections": "200",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
    "log_min_messages": "warning",
}


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine (initdb, pg_ctl, postgres)."""


def find_binaries() -> str:
    """The directory holding initdb, pg_ctl and postgres: on PATH, else the newest
    /usr/lib/postgresql/<version>/bin. Raises PostgresUnavailable when there is none."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl") and shutil.which("postgres"):
        return os.path.dirname(os.path.realpath(initdb))
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0,
    )
    for path in reversed(candidates):
        bindir = os.path.dirname(path)
        if all(os.path.exists(os.path.join(bindir, b)) for b in ("pg_ctl", "postgres")):
            return bindir
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH or in "
        "/usr/lib/postgresql/*/bin; install PostgreSQL (e.g. apt-get install postgresql)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgDatabase:
    """One database on the test server."""

    server: PgServer
    name: str

    @property
    def dsn(self) -> str:
        """A libpq URI with user and password (``PgServer.password``)."""
        return self.server.dsn(self.name)

    def connect(self, **kwargs: Any) -> Any:
        """A psycopg 3 connection to this database (autocommit unless told otherwise)."""
        import psycopg

        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.dsn, **kwargs)


@dataclass
class PgServer:
    """A running throwaway server: where it is, how to reach it, and how to stop it."""

    host: str
    port: int
    user: str
    password: str
    bindir: str
    base_dir: str
    as_postgres_user: bool

    @property
    def data_dir(self) -> str:
        return os.path.join(self.base_dir, "data")

    @property
    def log_file(self) -> str:
        return os.path.join(self.base_dir, "server.log")

    def dsn(self, dbname: str = "postgres") -> str:
        return (
            f"postgresql://{quote(self.user, safe='')}:{quote(self.password, safe='')}"
            f"@{self.host}:{self.port}/{quote(dbname, safe='')}"
        )

    def connect(self, dbname: str = "postgres", **kwargs: Any) -> Any:
        import psycopg

        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.dsn(dbname), **kwargs)

    def create_database(self, name: str | None = None) -> PgDatabase:
        """A new, empty database (named ``t_<random>`` unless given a name)."""
        name = name or f"t_{uuid.uuid4().hex[:16]}"
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return PgDatabase(self, name)

    def drop_database(self, name: str) -> None:
        """Drop ``name``, rolling back its prepared transactions first (they block a drop)."""
        from psycopg import sql

        with self.connect(name) as conn:
            gids = [
                row[0]
                for row in conn.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                )
            ]
            for gid in gids:
                # a gid is not a parameter here: the statement takes a literal only
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        with self.connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _command(self, program: str, *args: str) -> list[str]:
        command = [os.path.join(self.bindir, program), *args]
        if self.as_postgres_user:
            command = ["runuser", "-u", _OS_USER, "--", *command]
        return command

    def _run(self, program: str, *args: str, timeout: float = 120) -> None:
        done = subprocess.run(
            self._command(program, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.base_dir,
        )
        if done.returncode != 0:
            log = ""
            if os.path.exists(self.log_file):
                with open(self.log_file, errors="replace") as f:
                    log = f.read()[-4000:]
            raise RuntimeError(
                f"{program} {' '.join(args)} failed ({done.returncode}):\n"
                f"{done.stdout}\n{done.stderr}\n{log}"
            )

    def start(self) -> None:
        pwfile = os.path.join(self.base_dir, "pwfile")
        with open(pwfile, "w") as f:
            f.write(self.password + "\n")
        self._chown(pwfile)
        self._run(
            "initdb",
            "-D",
            self.data_dir,
            "-U",
            self.user,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        os.remove(pwfile)
        settings = dict(
            _SETTINGS, port=str(self.port), unix_socket_directories=f"'{self.base_dir}'"
        )
        with open(os.path.join(self.data_dir, "postgresql.conf"), "a") as f:
            f.write("\n# throwaway test server (tests/pg_server.py)\n")
            for key, value in settings.items():
                f.write(f"{key} = {value}\n")
        self._run("pg_ctl", "-D", self.data_dir, "-l", self.log_file, "-w", "-t", "60", "start")

    def stop(self) -> None:
        """Stop the server (immediately: it is a throwaway) and remove its directory."""
        if not os.path.isdir(self.base_dir):
            return
        try:
            if os.path.exists(os.path.join(self.data_dir, "postmaster.pid")):
                self._run(
                    "pg_ctl", "-D", self.data_dir, "-m", "immediate", "-w", "stop", timeout=60
                )
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def _chown(self, path: str) -> None:
        if self.as_postgres_user:
            shutil.chown(path, user=_OS_USER, group=_OS_USER)


def _launch() -> PgServer:
    bindir = find_binaries()
    as_postgres_user = os.geteuid() == 0
    if as_postgres_user:
        import pwd

        try:
            pwd.getpwnam(_OS_USER)
        except KeyError:
            raise RuntimeError(
                "PostgreSQL refuses to run as root, and there is no 'postgres' OS user to run "
                "it as; create one (useradd --system postgres) or run the tests as another user"
            ) from None
        if shutil.which("runuser") is None:
            raise RuntimeError("running as root needs 'runuser' to start PostgreSQL as 'postgres'")
    last_error: Exception | None = None
    for _ in range(3):  # a free port can be taken between the probe and the bind
        base_dir = tempfile.mkdtemp(prefix="rayflow-pg-")
        server = PgServer(
            host="127.0.0.1",
            port=_free_port(),
            user=_SUPERUSER,
            password=f"pw-{secrets.token_hex(12)}",
            bindir=bindir,
            base_dir=base_dir,
            as_postgres_user=as_postgres_user,
        )
        server._chown(base_dir)
        try:
            server.start()
            return server
        except Exception as exc:  # noqa: BLE001 - retried, then raised
            last_error = exc
            server.stop()
    raise RuntimeError(f"could not start a test PostgreSQL server: {last_error}")


_lock = threading.Lock()
_running: PgServer | None = None


def start_server() -> PgServer:
    """The PostgreSQL server of this process (started once, stopped at exit)."""
    global _running
    with _lock:
        if _running is None:
            _running = _launch()
            atexit.register(_running.stop)
        return _running


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"PostgreSQL is required here ({REQUIRE_ENV}=1): {reason}", pytrace=False)
    pytest.skip(f"no PostgreSQL server: {reason}")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    """A throwaway PostgreSQL server on 127.0.0.1 (see the module docstring)."""
    global _running
    try:
        server = start_server()
    except PostgresUnavailable as exc:
        _unavailable(str(exc))
    yield server
    with _lock:
        if _running is server:
            server.stop()
            _running = None


@pytest.fixture
def postgres_db(postgres: PgServer) -> Iterator[PgDatabase]:
    """A fresh database on the test server, dropped after the test."""
    db = postgres.create_database()
    yield db
    postgres.drop_database(db.name)
