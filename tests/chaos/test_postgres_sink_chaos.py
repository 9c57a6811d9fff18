"""PostgreSQL sinks under seeded kills, against a real server (tests/pg_server.py): the
keyed running sum (tests/chaos/harness.py) written by PostgresSink (EXACTLY_ONCE) and by
PostgresUpsertSink, then read back from the table.

Each run kills four times, one kill per attempt (``chaos_plan``): attempt 0 draws a
data-plane or sink point from the seed (after N records, during alignment, right after a
snapshot, before / after the prepare or the upsert's flush, during commit); attempt 1
kills a sink subtask between a checkpoint's completion and its notification
(BEFORE_NOTIFY: the prepared transactions exist only in the checkpoint); attempt 2 kills
a sink subtask during recovery (PostgresSink: after it committed the restored
transactions and before it rolled back the lingering ones, DURING_RECOVER; the upsert
sink: while its state loads); attempt 3 draws again. Subtasks and checkpoints are drawn
from the seed.

PostgresSink: every running total the job emitted is a row, exactly once (none lost,
none twice), each key's highest total is its exact sum, and no prepared transaction is
left. PostgresUpsertSink (key = the key): one row per key holding its exact sum. A
cancelled job leaves no prepared transaction either.

``tests/chaos/run_pg_seeds.py`` runs the same checks over many seeds.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import pytest

from rayflow import DeliveryGuarantee
from rayflow.errors import JobCancelledError
from rayflow.testing import Fault, FaultPlan, FaultPoint, wait_for_checkpoints
from sinks.postgres import PostgresSink, PostgresUpsertSink
from tests.chaos.harness import build_keyed_sum, expected_rows, expected_sums, unique_job
from tests.pg_server import PgDatabase

N = 200_000
P = 2
BATCH = 5000
RATE = 100_000  # records per second per source subtask: a few checkpoints per attempt
SINK = "committed"  # the harness's sink operator (chained after the sum)

DRAWN_POINTS = [
    FaultPoint.AFTER_RECORDS,
    FaultPoint.DURING_ALIGNMENT,
    FaultPoint.AFTER_SNAPSHOT,
    FaultPoint.SINK_BEFORE_PRE_COMMIT,
    FaultPoint.SINK_AFTER_PRE_COMMIT,
    FaultPoint.SINK_DURING_COMMIT,
]
_SINK_POINTS = {
    FaultPoint.SINK_BEFORE_PRE_COMMIT,
    FaultPoint.SINK_AFTER_PRE_COMMIT,
    FaultPoint.SINK_DURING_COMMIT,
    FaultPoint.DURING_RECOVER,
    FaultPoint.DURING_STATE_LOAD,
    FaultPoint.BEFORE_NOTIFY,
}

TABLE_SQL = "CREATE TABLE {name} (key bigint NOT NULL, value bigint NOT NULL)"
UPSERT_TABLE_SQL = "CREATE TABLE {name} (key bigint PRIMARY KEY, value bigint NOT NULL)"


def chaos_plan(seed: int, n: int = N, upsert: bool = False) -> FaultPlan:
    """Four kills, one per attempt 0..3 (see the module docstring). The upsert sink has no
    commit step of its own: its kill during recovery comes while the restored state
    loads (DURING_STATE_LOAD), and the points it draws are those it passes."""
    rng = random.Random(seed)
    drawn = DRAWN_POINTS[:5] if upsert else DRAWN_POINTS
    first, last = rng.sample(drawn, 2)
    recovery = FaultPoint.DURING_STATE_LOAD if upsert else FaultPoint.DURING_RECOVER
    faults = []
    for attempt, point in enumerate([first, FaultPoint.BEFORE_NOTIFY, recovery, last]):
        fault = Fault(
            point,
            attempt=attempt,
            vertex=SINK if point in _SINK_POINTS else None,
            subtask=rng.randrange(P),
            # later attempts resume near the end: their faults fire at the first checkpoint
            checkpoint=rng.randint(1, 2) if attempt == 0 else 1,
        )
        if point is FaultPoint.AFTER_RECORDS:
            if attempt == 0:
                fault = replace(fault, records=rng.randrange(BATCH, n // (3 * P)))
            else:  # a restarted attempt may never reach a record count
                fault = replace(fault, point=FaultPoint.AFTER_SNAPSHOT)
        faults.append(fault)
    return FaultPlan(faults)


@dataclass
class PgChaosRun:
    seed: int | None
    upsert: bool
    restarts: int
    failures: list[str]
    rows: int
    distinct_rows: int
    expected_rows: int
    highest: dict[int, int]
    prepared_left: list[str]
    seconds: float
    n: int = N
    plan: list[str] = field(default_factory=list)

    @property
    def exact(self) -> dict[int, int]:
        return expected_sums(self.n)

    def line(self) -> str:
        wrong = sum(1 for k, v in self.exact.items() if self.highest.get(k) != v)
        return (
            f"seed={self.seed} sink={'upsert' if self.upsert else 'exactly-once'} "
            f"restarts={self.restarts} "
            f"rows={self.rows}/{len(self.exact) if self.upsert else self.expected_rows} "
            f"distinct={self.distinct_rows} wrong_keys={wrong} "
            f"prepared_left={len(self.prepared_left)} {self.seconds:.1f}s "
            f"faults=[{', '.join(self.plan)}]"
        )


def prepared_transactions(db: PgDatabase) -> list[str]:
    with db.connect() as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            )
        ]


def run_keyed_sum_to_postgres(
    db: PgDatabase,
    storage: str,
    upsert: bool = False,
    plan: FaultPlan | None = None,
    seed: int | None = None,
    n: int = N,
) -> PgChaosRun:
    """Run the keyed running sum into a new table of ``db`` with ``plan``; read back what
    was committed."""
    job = unique_job(f"pg-{'upsert' if upsert else 'eo'}-{seed}")
    table = f"sums_{time.time_ns()}"
    with db.connect() as conn:
        conn.execute((UPSERT_TABLE_SQL if upsert else TABLE_SQL).format(name=table))
    if upsert:
        sink = PostgresUpsertSink(db.dsn, table, key_columns=["key"], columns=["key", "value"])
    else:
        sink = PostgresSink(
            db.dsn,
            table,
            columns=["key", "value"],
            delivery_guarantee=DeliveryGuarantee.EXACTLY_ONCE,
        )
    env, _ = build_keyed_sum(n, P, BATCH, rate=RATE, storage=storage, sink=sink, plan=plan)
    started = time.time()
    result = env.execute(job)
    seconds = time.time() - started
    with db.connect() as conn:
        rows, distinct = conn.execute(
            f"SELECT count(*), count(DISTINCT (key, value)) FROM {table}"
        ).fetchone()
        highest = dict(conn.execute(f"SELECT key, max(value) FROM {table} GROUP BY key"))
    return PgChaosRun(
        seed=seed,
        upsert=upsert,
        restarts=result.restarts,
        failures=result.failures,
        rows=rows,
        distinct_rows=distinct,
        expected_rows=expected_rows(n, P, BATCH),
        highest=highest,
        prepared_left=prepared_transactions(db),
        seconds=seconds,
        n=n,
        plan=[
            f"{f.attempt}:{f.point.value}@{f.vertex or '*'}/{f.subtask}"
            for f in (plan.faults if plan else [])
        ],
    )


def check_exactly_once(run: PgChaosRun) -> None:
    assert run.restarts >= 3, run.failures
    assert run.prepared_left == [], "prepared transactions left"
    assert run.highest == run.exact, "a key's highest committed total is not its exact sum"
    # Every emitted running total was committed exactly once: none lost, none twice.
    assert run.distinct_rows == run.rows == run.expected_rows


def check_upsert(run: PgChaosRun) -> None:
    assert run.restarts >= 3, run.failures
    assert run.prepared_left == []
    assert run.rows == len(run.exact), "one row per key"
    assert run.highest == run.exact, "a key's row does not hold its exact sum"


@pytest.mark.chaos
def test_postgres_exactly_once_survives_seeded_kills(postgres_db, tmp_path):
    run = run_keyed_sum_to_postgres(postgres_db, str(tmp_path), plan=chaos_plan(7), seed=7)
    print(run.line())
    check_exactly_once(run)


@pytest.mark.chaos
def test_postgres_upsert_survives_seeded_kills(postgres_db, tmp_path):
    run = run_keyed_sum_to_postgres(
        postgres_db, str(tmp_path), upsert=True, plan=chaos_plan(8, upsert=True), seed=8
    )
    print(run.line())
    check_upsert(run)


@pytest.mark.chaos
def test_a_cancelled_job_leaves_no_prepared_transaction(postgres_db, tmp_path):
    table = "cancelled"
    with postgres_db.connect() as conn:
        conn.execute(TABLE_SQL.format(name=table))
    sink = PostgresSink(postgres_db.dsn, table, columns=["key", "value"])
    # A kill first, so the cancel also meets a restored attempt's transactions.
    plan = FaultPlan([Fault(FaultPoint.BEFORE_NOTIFY, attempt=0, vertex=SINK, subtask=1)])
    env, _ = build_keyed_sum(
        2_000_000, P, BATCH, rate=100_000, storage=str(tmp_path), sink=sink, plan=plan
    )
    client = env.execute_async(unique_job("pg-cancel"))
    assert wait_for_checkpoints(client, 3, timeout_s=90) >= 3
    assert client.cancel() is True
    with pytest.raises(JobCancelledError):
        client.wait()
    assert prepared_transactions(postgres_db) == []
    with postgres_db.connect() as conn:
        rows, distinct = conn.execute(
            f"SELECT count(*), count(DISTINCT (key, value)) FROM {table}"
        ).fetchone()
    assert rows == distinct and rows > 0  # what completed checkpoints held, once
