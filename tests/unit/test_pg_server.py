"""The throwaway PostgreSQL of the tests (tests/pg_server.py) works as the sinks need it:
two-phase commit is on, a prepared transaction survives its session and commits later,
the DSN's password is required, and each test's database starts empty."""

from __future__ import annotations

import pytest

psycopg = pytest.importorskip("psycopg")


def test_server_allows_prepared_transactions(postgres):
    with postgres.connect() as conn:
        (value,) = conn.execute("SHOW max_prepared_transactions").fetchone()
        (host,) = conn.execute("SELECT inet_server_addr()::text").fetchone()
    assert int(value) > 0
    assert host.startswith("127.0.0.1")


def test_prepare_then_commit_prepared_from_another_session(postgres_db):
    with postgres_db.connect() as conn:
        conn.execute("CREATE TABLE t (id bigint PRIMARY KEY)")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (1), (2)")
        conn.execute("PREPARE TRANSACTION 'rayflow-test-1'")
    # the writing session is gone; the prepared transaction is not, and is not yet visible
    with postgres_db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
        gids = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
        ).fetchall()
        assert gids == [("rayflow-test-1",)]
        conn.execute("COMMIT PREPARED 'rayflow-test-1'")
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (2,)
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        # a second commit of the same id fails: it is no longer prepared
        with pytest.raises(psycopg.errors.UndefinedObject):
            conn.execute("COMMIT PREPARED 'rayflow-test-1'")


def test_rollback_prepared_discards_the_rows(postgres_db):
    with postgres_db.connect() as conn:
        conn.execute("CREATE TABLE t (id bigint)")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute("PREPARE TRANSACTION 'rayflow-test-2'")
        conn.execute("ROLLBACK PREPARED 'rayflow-test-2'")
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)


def test_dsn_needs_its_password(postgres, postgres_db):
    assert postgres.password in postgres_db.dsn
    wrong = postgres_db.dsn.replace(postgres.password, "not-the-password")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(wrong).close()


def test_each_test_gets_an_empty_database(postgres_db):
    with postgres_db.connect() as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()
    assert tables == (0,)
