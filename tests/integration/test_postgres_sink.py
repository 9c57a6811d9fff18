"""The PostgreSQL sinks against a real server (tests/pg_server.py).

Transaction-level tests drive the sink operator directly (no job): prepared transactions
invisible until the checkpoint completes, a repeated commit told apart for sure, lingering
ones rolled back by prefix, bad input named with the sink, the table and the row's
position, the password never shown. A few job tests run real Ray jobs.
"""

from __future__ import annotations

import logging
import pickle

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rayflow import DeliveryGuarantee, NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode, RestartStrategies
from rayflow.errors import JobFailedError
from rayflow.runtime.operators import OperatorContext, SinkOperator
from rayflow.runtime.sink_operator import TwoPhaseCommitSinkOperator
from rayflow.sink import CommitStatus, SinkContext, UnsupportedGuaranteeError
from sinks.postgres import PostgresSink, PostgresSinkError, PostgresUpsertSink, UpsertMode
from tests.chaos.harness import unique_job

pytest.importorskip("psycopg")

EO = DeliveryGuarantee.EXACTLY_ONCE
ALO = DeliveryGuarantee.AT_LEAST_ONCE


def operator(sink, attempt: int = 0, subtask: int = 0, name: str = "pg"):
    cls = TwoPhaseCommitSinkOperator if isinstance(sink, PostgresSink) else SinkOperator
    op = cls(sink)
    op.open(
        OperatorContext(
            "job", name, "pg", subtask, 2, 128, attempt, checkpointing=True, run_id="run-1-ab"
        )
    )
    return op


def rows(keys, values=None) -> pa.RecordBatch:
    values = values if values is not None else [k * 10 for k in keys]
    return pa.record_batch({"k": pa.array(keys, pa.int64()), "v": pa.array(values, pa.int64())})


def table_rows(db, table: str = "t") -> list[tuple]:
    with db.connect() as conn:
        return conn.execute(f'SELECT * FROM "{table}" ORDER BY 1, 2').fetchall()


def prepared(db) -> list[str]:
    with db.connect() as conn:
        return [
            r[0]
            for r in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY gid"
            )
        ]


@pytest.fixture
def db(postgres_db):
    with postgres_db.connect() as conn:
        conn.execute("CREATE TABLE t (k bigint NOT NULL, v bigint)")
        conn.execute("CREATE TABLE u (k bigint PRIMARY KEY, v bigint)")
    return postgres_db


# --- PostgresSink: two-phase commit --------------------------------------------------------


def test_rows_are_invisible_until_the_checkpoint_completes(db):
    op = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO))
    op.recover(None)
    op.process(rows([1, 2]))
    op.process(rows([3]))
    op.snapshot_state(4)
    [gid] = prepared(db)
    # sink prefix + subtask, then run, attempt and checkpoint
    assert gid == "rayflow_job_pg_0000_1-ab-a0-c4"
    assert table_rows(db) == []
    op.notify_checkpoint_complete(4)
    assert table_rows(db) == [(1, 10), (2, 20), (3, 30)] and prepared(db) == []
    op.close()


def test_a_repeated_commit_is_recognised_and_lingering_ones_are_rolled_back(db):
    first = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO))
    first.process(rows([1]))
    state = pickle.loads(pickle.dumps(first.snapshot_state(1)))
    first.notify_checkpoint_complete(1)
    first.process(rows([2]))
    first.snapshot_state(2)  # prepared; checkpoint 2 never completes
    first.process(rows([3]))  # open: dies with the connection
    first.close()
    assert len(prepared(db)) == 1
    # The next attempt restores checkpoint 1: its transaction was committed before (told
    # for sure by its transaction id), the prepared one of checkpoint 2 is rolled back.
    second = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), attempt=1)
    second.restore_state([state])
    second.recover(1)
    assert second.committed == 1 and prepared(db) == []
    assert table_rows(db) == [(1, 10)]
    second.process(rows([2, 3]))  # the replay
    second.snapshot_state(3)
    second.notify_checkpoint_complete(3)
    assert table_rows(db) == [(1, 10), (2, 20), (3, 30)]
    second.close()


def test_a_transaction_rolled_back_behind_the_sinks_back_is_lost_and_said_so(db):
    sink = PostgresSink(db.dsn, "t", delivery_guarantee=EO)
    context = SinkContext("job", "pg", 0, 1, 0, "run-1-ab")
    txn = sink.begin_transaction(context, 0)
    sink.write(txn, rows([1]))
    committable = sink.pre_commit(txn, 9)
    with db.connect() as conn:
        conn.execute(f"ROLLBACK PREPARED '{committable.gid}'")
    outcome = sink.create_committer(context).commit(committable)
    assert outcome.status is CommitStatus.FAILED
    assert "rolled back: its rows are lost" in outcome.reason
    with pytest.raises(PostgresSinkError, match="rolled back"):
        sink.commit(committable)
    sink.close()


def test_only_this_subtasks_prepared_transactions_are_rolled_back(db):
    sink = PostgresSink(db.dsn, "t", delivery_guarantee=EO)

    def prepare(subtask: int, uid: str = "pg", cid: int = 1):
        context = SinkContext("job", uid, subtask, 12, 0, "run-1-ab")
        txn = sink.begin_transaction(context, 0)
        sink.write(txn, rows([subtask]))
        return sink.pre_commit(txn, cid)

    mine = [prepare(1, cid=1), prepare(1, cid=2)]
    others = [prepare(11), prepare(10), prepare(1, uid="other")]
    context = SinkContext("job", "pg", 1, 12, 1, "run-1-ab")
    assert sink.abort_lingering(context, [mine[1]]) == 1
    assert prepared(db) == sorted(c.gid for c in [mine[1], *others])
    sink.close()
    with db.connect() as conn:
        for gid in prepared(db):
            conn.execute(f"ROLLBACK PREPARED '{gid}'")


def test_at_least_once_commits_at_the_barrier(db):
    op = operator(PostgresSink(db.dsn, "t", delivery_guarantee=ALO))
    op.process(rows([1, 2]))
    assert table_rows(db) == []
    op.snapshot_state(1)
    assert table_rows(db) == [(1, 10), (2, 20)] and prepared(db) == []
    op.close()


def test_max_prepared_transactions_zero_is_named_when_the_job_starts(db):
    sink = PostgresSink(db.dsn, "t")

    class NoPrepared:
        def execute(self, query, *args):
            class Row:
                def fetchone(self):
                    return ("0",)

            assert query == "SHOW max_prepared_transactions"
            return Row()

    with pytest.raises(PostgresSinkError, match="max_prepared_transactions = 0"):
        sink._check_prepared_transactions(NoPrepared(), "out")


def test_identifiers_are_quoted(postgres_db):
    schema, name = 'odd "schema"', "Totals; DROP TABLE t --"
    with postgres_db.connect() as conn:
        conn.execute('CREATE SCHEMA "odd ""schema"""')
        conn.execute(
            'CREATE TABLE "odd ""schema"""."Totals; DROP TABLE t --" '
            '("the key" bigint PRIMARY KEY, "v\'s" bigint)'
        )
    columns = ["the key", "v's"]
    batch = pa.record_batch({"the key": pa.array([1, 2]), "v's": pa.array([3, 4])})
    eo = PostgresSink(postgres_db.dsn, (schema, name), columns=columns, delivery_guarantee=EO)
    eo.setup("job")
    op = operator(eo)
    op.process(batch)
    op.snapshot_state(1)
    op.notify_checkpoint_complete(1)
    op.close()
    upsert = PostgresUpsertSink(postgres_db.dsn, (schema, name), ["the key"], columns=columns)
    upsert.setup("job")
    op = operator(upsert)
    op.process(pa.record_batch({"the key": pa.array([2]), "v's": pa.array([5])}))
    op.end_input()
    with postgres_db.connect() as conn:
        got = conn.execute(
            'SELECT * FROM "odd ""schema"""."Totals; DROP TABLE t --" ORDER BY 1'
        ).fetchall()
    assert got == [(1, 3), (2, 5)]


# --- bad input ---------------------------------------------------------------------------


def test_wrong_dsn_and_missing_table_fail_when_the_job_starts(db, postgres, caplog):
    wrong = db.dsn.replace(postgres.password, "not-the-password")
    with pytest.raises(PostgresSinkError) as info:
        PostgresSink(wrong, "t").setup("job")
    assert "PostgresSink" in str(info.value) and "table t" in str(info.value)
    assert "password authentication failed" in str(info.value)
    assert "not-the-password" not in str(info.value)
    with pytest.raises(PostgresSinkError, match="table nosuch does not exist"):
        PostgresSink(db.dsn, "nosuch").setup("job")
    with pytest.raises(PostgresSinkError, match=r"no column\(s\) \['w'\]"):
        PostgresSink(db.dsn, "t", columns=["k", "w"]).setup("job")
    with pytest.raises(ValueError, match="dsn is not a libpq") as info:
        PostgresSink("host=h password=secret nonsense", "t")
    assert "secret" not in str(info.value)


def test_a_type_mismatch_names_the_sink_the_table_and_the_row(db):
    op = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), name="totals")
    op.process(rows([1]))
    op.snapshot_state(1)
    op.notify_checkpoint_complete(1)
    bad = pa.record_batch({"k": pa.array(["2", "3", "three"]), "v": pa.array([1, 2, 3])})
    with pytest.raises(PostgresSinkError) as info:
        op.process(bad)
    text = str(info.value)
    assert "PostgresSink 'totals' (table t at" in text
    assert "row 3 of a batch of 3" in text and "22P02" in text and info.value.row == 3
    op.close()
    assert table_rows(db) == [(1, 10)]  # what was committed stays


def test_a_unique_violation_inside_a_transaction_names_the_row(db):
    with db.connect() as conn:
        conn.execute("CREATE UNIQUE INDEX t_k ON t (k)")
    op = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO))
    op.process(rows([1, 2]))
    with pytest.raises(PostgresSinkError) as info:
        op.process(rows([3, 4, 1]))  # 1 again, in the same transaction
    assert "row 3 of a batch of 3" in str(info.value) and "Key (k)=(1)" in str(info.value)
    assert info.value.sqlstate == "23505"
    op.close()
    assert table_rows(db) == [] and prepared(db) == []


def test_the_password_never_shows(db, postgres, caplog):
    sink = PostgresSink(db.dsn, "t")
    upsert = PostgresUpsertSink(db.dsn, "u", ["k"])
    env = StreamExecutionEnvironment.get_execution_environment().enable_checkpointing(100)
    env.from_source(NumberSequenceSource(0, 9)).map_batches(
        lambda b: rows(b.column("value").to_pylist())
    ).sink_to(sink)
    with caplog.at_level(logging.DEBUG):
        shown = [repr(sink), str(sink), repr(upsert), env.explain()]
        op = operator(sink)
        op.process(rows([1]))
        op.snapshot_state(1)
        op.notify_checkpoint_complete(1)
        op.close()
    assert "***" in repr(sink)
    for text in [*shown, caplog.text]:
        assert postgres.password not in text


# --- PostgresUpsertSink ------------------------------------------------------------------


def test_upsert_overwrites_by_key_and_a_replay_changes_nothing(db):
    op = operator(PostgresUpsertSink(db.dsn, "u", ["k"]))
    op.process(rows([1, 2, 1], [5, 6, 7]))  # the last row of a key wins
    op.snapshot_state(1)
    assert table_rows(db, "u") == [(1, 7), (2, 6)]
    op.process(rows([2, 3], [8, 9]))
    op.snapshot_state(2)
    op.process(rows([2, 3], [8, 9]))  # a replay writes the same rows again
    op.end_input()
    assert table_rows(db, "u") == [(1, 7), (2, 8), (3, 9)]
    assert op.result() == 7
    op.close()


def test_upsert_modes(db):
    first = operator(PostgresUpsertSink(db.dsn, "u", ["k"], mode=UpsertMode.KEEP_FIRST))
    first.process(rows([1, 1], [5, 6]))
    first.end_input()
    assert table_rows(db, "u") == [(1, 5)]
    add = operator(PostgresUpsertSink(db.dsn, "u", ["k"], mode=UpsertMode.ADD))
    add.process(rows([1, 1, 2], [1, 2, 3]))
    add.end_input()
    assert table_rows(db, "u") == [(1, 8), (2, 3)]


def test_upsert_needs_a_unique_key_and_names_a_refused_row(db):
    with pytest.raises(PostgresSinkError, match=r"no unique index or primary key on exactly \(k\)"):
        PostgresUpsertSink(db.dsn, "t", ["k"]).setup("job")
    with pytest.raises(ValueError, match="not among columns"):
        PostgresUpsertSink(db.dsn, "u", ["k"], columns=["v"])
    op = operator(PostgresUpsertSink(db.dsn, "u", ["k"]), name="latest")
    with pytest.raises(PostgresSinkError) as info:
        op.process(pa.record_batch({"k": pa.array([1, None]), "v": pa.array([1, 2])}))
        op.end_input()
    assert "PostgresUpsertSink 'latest' (table u" in str(info.value)
    assert info.value.row == 2 and "23502" in str(info.value)
    assert table_rows(db, "u") == []


@pytest.mark.parametrize(
    "mode, checkpointing, words",
    [
        (UpsertMode.OVERWRITE, CheckpointingMode.EXACTLY_ONCE, "exactly-once effect through"),
        (UpsertMode.KEEP_FIRST, CheckpointingMode.EXACTLY_ONCE, "exactly-once effect through"),
        (UpsertMode.ADD, CheckpointingMode.EXACTLY_ONCE, "at-least-once: UpsertMode.ADD adds"),
        (UpsertMode.OVERWRITE, CheckpointingMode.AT_LEAST_ONCE, "at-least-once: checkpoints"),
        (UpsertMode.OVERWRITE, None, "at-most-once"),
    ],
)
def test_upsert_says_when_replays_are_idempotent(db, mode, checkpointing, words):
    env = StreamExecutionEnvironment.get_execution_environment()
    if checkpointing is not None:
        env.enable_checkpointing(100, checkpointing)
    sink = PostgresUpsertSink(db.dsn, "u", ["k"], mode=mode)
    env.from_source(NumberSequenceSource(0, 9)).sink_to(sink, "latest")
    assert env.guarantees()["latest"].startswith(words)
    with pytest.raises(UnsupportedGuaranteeError, match="cannot give EXACTLY_ONCE"):
        PostgresUpsertSink(db.dsn, "u", ["k"], delivery_guarantee=EO)


# --- jobs ----------------------------------------------------------------------------------


def keyed_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    values = batch.column("value")
    return pa.record_batch({"k": values, "v": pc.multiply(values, 10)})


def job(sink, n: int = 20_000, checkpoint_ms: int | None = 200, tmp_path=None):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    if checkpoint_ms is not None:
        env.enable_checkpointing(checkpoint_ms)
        env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.set_restart_strategy(RestartStrategies.no_restart())
    (
        env.from_source(NumberSequenceSource(0, n - 1, batch_size=1000, records_per_second=20_000))
        .map_batches(keyed_rows, name="rows")
        .sink_to(sink, name="pg")
        .uid("pg")
    )
    return env


def test_exactly_once_job_writes_every_row_once(db, tmp_path):
    sink = PostgresSink(db.dsn, "t", columns=["k", "v"])
    result = job(sink, tmp_path=tmp_path).execute(unique_job("pg-eo"))
    assert result.sink_guarantees["pg"].delivery_guarantee is EO
    with db.connect() as conn:
        count, distinct, top = conn.execute(
            "SELECT count(*), count(DISTINCT k), max(k) FROM t"
        ).fetchone()
    assert (count, distinct, top) == (20_000, 20_000, 19_999)
    assert prepared(db) == [] and result.sink_result(sink) >= 2


def test_a_bad_row_fails_the_job_naming_it_and_keeps_what_was_committed(db, tmp_path):
    with db.connect() as conn:
        conn.execute("ALTER TABLE t ADD CONSTRAINT small CHECK (k < 15000)")
    sink = PostgresSink(db.dsn, "t", columns=["k", "v"])
    with pytest.raises(JobFailedError) as info:
        job(sink, tmp_path=tmp_path).execute(unique_job("pg-bad"))
    text = str(info.value)
    assert "PostgresSink 'pg' (table t" in text and "of a batch of" in text and "23514" in text
    with db.connect() as conn:
        count, distinct = conn.execute("SELECT count(*), count(DISTINCT k) FROM t").fetchone()
    assert count == distinct and count % 1000 == 0  # whole checkpoints, each once
    assert prepared(db) == []


def test_a_wrong_dsn_fails_the_job_before_it_starts(db, postgres, tmp_path):
    sink = PostgresSink(db.dsn.replace(postgres.password, "wrong"), "t")
    with pytest.raises(PostgresSinkError) as info:
        job(sink, tmp_path=tmp_path).execute(unique_job("pg-dsn"))
    assert "cannot connect" in str(info.value) and postgres.password not in str(info.value)
