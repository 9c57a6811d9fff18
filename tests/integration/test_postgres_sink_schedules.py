"""The PostgreSQL sinks under adversarial schedules, against a real server
(tests/pg_server.py).

Each test drives the sink operator the way the runtime does, and puts a fault at one
line: a cancel that arrives while a restored checkpoint is being committed, a PREPARE
that lands at the server after its client was killed, a rerun at a lower parallelism
after a crash, a password that a DSN spells with escapes.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from urllib.parse import quote, quote_plus

import pyarrow as pa
import pytest

from rayflow import DeliveryGuarantee
from rayflow.runtime.fence import AttemptFence, StaleAttemptError
from rayflow.runtime.operators import OperatorContext
from rayflow.runtime.sink_operator import TwoPhaseCommitSinkOperator
from rayflow.sink import CommitOutcome
from sinks import postgres
from sinks.postgres import PostgresSink, PostgresUpsertSink

pytest.importorskip("psycopg")

EO = DeliveryGuarantee.EXACTLY_ONCE
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def operator(
    sink,
    attempt: int = 0,
    subtask: int = 0,
    parallelism: int = 1,
    run_id: str = "run-1-ab",
    fence: AttemptFence | None = None,
) -> TwoPhaseCommitSinkOperator:
    op = TwoPhaseCommitSinkOperator(sink)
    op.open(
        OperatorContext(
            "job",
            "pg",
            "pg",
            subtask,
            parallelism,
            128,
            attempt,
            checkpointing=True,
            fence=fence,
            run_id=run_id,
        )
    )
    return op


def rows(keys) -> pa.RecordBatch:
    return pa.record_batch(
        {"k": pa.array(keys, pa.int64()), "v": pa.array([k * 10 for k in keys], pa.int64())}
    )


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
    return postgres_db


def completed_checkpoint_not_committed(db, keys) -> dict:
    """Attempt 0 pre-commits ``keys`` at checkpoint 1, which completes; attempt 0 dies
    before it is told (the transaction stays prepared). Returns checkpoint 1's state."""
    first = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO))
    first.recover(None)
    for key in keys:  # one transaction per size roll: several committables
        first.process(rows([key]))
        first._roll(None)
    state = pickle.loads(pickle.dumps(first.snapshot_state(1)))
    first.close()  # killed: the prepared transactions stay
    assert len(prepared(db)) == len(keys)
    return state


# --- a cancel while a restored checkpoint is being committed --------------------------------


def test_a_cancel_while_recovery_commits_keeps_what_the_completed_checkpoint_holds(db):
    """Attempt 1 restores checkpoint 1 (completed, not yet committed) and its recover
    thread is in the middle of COMMIT PREPARED when the job is cancelled. The subtask's
    ``close_for_cancel`` revokes the fence and runs ``on_cancel`` while that thread still
    runs (only ``run()`` was cancelled, not its thread). ``on_cancel`` must still commit
    what the completed checkpoint holds; it must never roll it back as lingering."""
    state = completed_checkpoint_not_committed(db, [1, 2])
    fence = AttemptFence("run-1-ab", 1)
    second = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), attempt=1, fence=fence)
    second.restore_state([state])
    real_commit = second.committer.commit
    cancelled = []

    def commit(committable):
        if not cancelled:  # the cancel arrives while this COMMIT PREPARED is on its way
            cancelled.append(True)
            fence.revoke()  # close_for_cancel
            second.on_cancel(1)  # ... in its own thread, now
        return real_commit(committable)

    second.committer.commit = commit
    try:
        second.recover(1)
    except Exception:  # noqa: BLE001 - the stale recover thread may stop or fail
        pass
    second.close()
    assert table_rows(db) == [(1, 10), (2, 20)]
    assert prepared(db) == []


def test_a_cancel_after_recovery_was_told_retry_later_keeps_that_committable(db):
    """The recover thread's first COMMIT PREPARED answers RETRY_LATER (the server was
    unreachable for a moment), then the job is cancelled: the thread stops at its next
    fence check. The committable it was told to retry must not be lost with the thread:
    ``on_cancel`` commits it (before it rolls back everything else as lingering)."""
    state = completed_checkpoint_not_committed(db, [1, 2])
    fence = AttemptFence("run-1-ab", 1)
    second = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), attempt=1, fence=fence)
    second.restore_state([state])
    real_commit = second.committer.commit
    answered = []

    def commit(committable):
        if not answered:
            answered.append(True)
            fence.revoke()  # the cancel arrives right after this answer
            return CommitOutcome.retry_later("server unreachable for a moment")
        return real_commit(committable)

    second.committer.commit = commit
    with pytest.raises(StaleAttemptError):
        second.recover(1)
    second.on_cancel(1)  # close_for_cancel, after the thread stopped
    second.close()
    assert table_rows(db) == [(1, 10), (2, 20)]
    assert prepared(db) == []


# --- the password, however the DSN spells it ------------------------------------------------


def _spellings(password: str) -> set[str]:
    """Every way a DSN may spell ``password``: as it is, percent-encoded, libpq-quoted."""
    escaped = password.replace("\\", "\\\\").replace("'", "\\'")
    return {password, quote(password, safe=""), quote(password), quote_plus(password), escaped}


@pytest.mark.parametrize("password", ["p@ss:w/rd%1", "it's\\x", "h#sh?q=1&a b"])
def test_the_password_never_shows_however_the_dsn_spells_it(password):
    """A password with characters a URI must percent-encode (or a key/value DSN must
    escape) is spelled differently in the DSN than libpq's parsed value: repr, str and
    explain() show the DSN, and must hide every spelling of it."""
    encoded = quote(password, safe="")
    escaped = password.replace("\\", "\\\\").replace("'", "\\'")
    dsns = [
        f"postgresql://someone:{encoded}@127.0.0.1:1/db",
        f"postgresql://someone@127.0.0.1:1/db?password={encoded}",
        f"host=127.0.0.1 port=1 user=someone dbname=db password='{escaped}'",
    ]
    for dsn in dsns:
        for sink in (PostgresSink(dsn, "t"), PostgresUpsertSink(dsn, "t", ["k"])):
            for text in (repr(sink), str(sink)):
                shown = [s for s in _spellings(password) if s in text]
                assert not shown, f"{text} shows the password as {shown}"


# --- a PREPARE that lands after its client was killed -----------------------------------------

STALE_ATTEMPT = """
import sys
import pyarrow as pa
from rayflow import DeliveryGuarantee
from rayflow.runtime.operators import OperatorContext
from rayflow.runtime.sink_operator import TwoPhaseCommitSinkOperator
from sinks.postgres import PostgresSink

op = TwoPhaseCommitSinkOperator(
    PostgresSink(sys.argv[1], "t", delivery_guarantee=DeliveryGuarantee.EXACTLY_ONCE)
)
op.open(OperatorContext("job", "pg", "pg", 0, 1, 128, 0, checkpointing=True, run_id="run-1-ab"))
op.process(pa.record_batch({"k": pa.array([666]), "v": pa.array([6660])}))
op.snapshot_state(2)  # PREPARE TRANSACTION: the server is slow to finish it
"""


def _stale_backends(db) -> int:
    with db.connect() as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'PREPARE TRANSACTION%%' AND state = 'active'"
        ).fetchone()[0]


def test_a_prepare_that_lands_after_its_client_was_killed_is_not_left_behind(db):
    """Attempt 0's sink subtask sends PREPARE TRANSACTION for checkpoint 2; the server is
    slow to finish it (a deferred constraint trigger, here one that sleeps), and the
    subtask's process is killed meanwhile. Attempt 1 recovers, lists the prepared
    transactions (attempt 0's is not there yet), writes, commits and, at the end of
    input, sweeps again: the job has ended. Then the server finishes attempt 0's PREPARE
    for a client that is gone. A finished job must leave no prepared transaction behind:
    the server must not finish a PREPARE whose client is gone."""
    with db.connect() as conn:
        conn.execute(
            "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.k = 666 THEN PERFORM pg_sleep(6); END IF; RETURN NULL; END $$"
        )
        conn.execute(
            "CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED "
            "FOR EACH ROW EXECUTE FUNCTION slow()"
        )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    stale = subprocess.Popen([sys.executable, "-c", STALE_ATTEMPT, db.dsn], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while _stale_backends(db) == 0:
            assert stale.poll() is None, "attempt 0 ended before its PREPARE"
            assert time.monotonic() < deadline, "attempt 0 never sent its PREPARE"
            time.sleep(0.05)
    finally:
        stale.send_signal(signal.SIGKILL)  # attempt 0's process dies mid-PREPARE
        stale.wait()
    second = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), attempt=1)
    second.recover(None)
    second.process(rows([1, 2]))
    second.snapshot_state(3)
    second.notify_checkpoint_complete(3)
    second.end_input()
    second.snapshot_state(4)  # the final checkpoint
    second.notify_checkpoint_complete(4)  # commits, then sweeps: the job has ended
    second.close()
    assert table_rows(db) == [(1, 10), (2, 20)]
    deadline = time.monotonic() + 30
    while _stale_backends(db) and time.monotonic() < deadline:
        time.sleep(0.1)  # the server finishes (or drops) attempt 0's PREPARE
    assert prepared(db) == []


# --- a rerun at a lower parallelism ------------------------------------------------------------


def test_a_rerun_at_a_lower_parallelism_leaves_nothing_of_a_crashed_run_behind(db):
    """A run at parallelism 3 crashes (its driver dies) with subtask 2's transaction of
    checkpoint 1 prepared: nothing of that run cleans up. The job is run again under the
    same name with default settings (a fresh run, no restore) at parallelism 2: its
    subtasks roll back what earlier runs left for subtasks 0 and 1, and must not leave
    subtask 2's behind when it finishes; no subtask has index 2 any more."""
    for subtask in range(3):
        crashed = operator(
            PostgresSink(db.dsn, "t", delivery_guarantee=EO),
            subtask=subtask,
            parallelism=3,
            run_id="run-1-aa",
        )
        crashed.process(rows([100 + subtask]))
        crashed.snapshot_state(1)
        crashed.close()  # the run is gone: its prepared transactions stay
    assert len(prepared(db)) == 3
    for subtask in range(2):
        rerun = operator(
            PostgresSink(db.dsn, "t", delivery_guarantee=EO),
            subtask=subtask,
            parallelism=2,
            run_id="run-2-bb",
        )
        rerun.recover(None)
        rerun.process(rows([subtask]))
        rerun.end_input()
        rerun.snapshot_state(7)  # the final checkpoint
        rerun.notify_checkpoint_complete(7)  # commits, then sweeps
        rerun.close()
    assert table_rows(db) == [(0, 0), (1, 10)]
    assert prepared(db) == []


# --- two runs of one job name at once ----------------------------------------------------------


def test_a_fresh_run_never_rolls_back_what_a_live_run_of_the_same_name_prepared(db, monkeypatch):
    """Two runs of one job name against one database, from two Ray clusters (yesterday's
    nightly run still going on the old cluster when today's starts on a new one): run B
    starts fresh and recovers; run A's checkpoint 5 has completed and its commit is on
    its way. B must not roll back what A prepared (A's rows would be lost, and A fails
    for good on every restore of checkpoint 5); it should refuse to run instead."""
    monkeypatch.setattr(postgres, "LIVE_RUN_WAIT_S", 0.5)
    a = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), run_id="run-1-aa")
    a.recover(None)
    a.process(rows([1]))
    a.snapshot_state(5)
    b = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), run_id="run-2-bb")
    with pytest.raises(postgres.PostgresRunConflictError, match="another run"):
        b.recover(None)
    a.notify_checkpoint_complete(5)
    a.close()
    b.close()
    assert table_rows(db) == [(1, 10)]


def _slow_newer_run(db, sink: PostgresSink, hold_s: float) -> None:
    """A session of a newer run ("run-2-bb") of the job that holds its run's lock for
    ``hold_s`` seconds, as that run's sessions do while it waits to refuse (slowly, on a
    loaded machine) after seeing an older run."""
    import threading

    newer = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), run_id="run-2-bb")
    keys = sink.run_lock_keys(newer.sink_context)
    session = db.connect()
    session.execute("SELECT pg_advisory_lock_shared(%s, %s)", keys)
    session.commit()
    threading.Timer(hold_s, session.close).start()


def test_the_run_that_was_there_first_outwaits_a_newer_run_slow_to_refuse(db, monkeypatch):
    """Run A restarts (a session of its own holds its lock meanwhile); run B of the same
    job name starts, sees A and waits to refuse; A's next attempt opens a session while
    B's is still there. Each waits holding its own lock, so each sees the other for its
    whole wait: with B slow to give up, A refused too and failed for good ("no restart can
    fix it"), though it was there first. A, whose session is the oldest, outwaits B."""
    monkeypatch.setattr(postgres, "LIVE_RUN_WAIT_S", 1.0)
    monkeypatch.setattr(postgres, "OLDER_RUN_WAIT_S", 8.0, raising=False)
    sink = PostgresSink(db.dsn, "t", delivery_guarantee=EO)
    first = operator(sink, run_id="run-1-aa")
    first.recover(None)  # run A's oldest session, held while A restarts
    time.sleep(0.05)  # the server's clock tells the sessions apart
    _slow_newer_run(db, sink, hold_s=3.0)
    again = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), attempt=1, run_id="run-1-aa")
    started = time.monotonic()
    again.recover(None)  # refused after LIVE_RUN_WAIT_S before
    assert time.monotonic() - started > 2.0  # it waited for the newer run's session to go
    again.process(rows([1]))
    again.snapshot_state(1)
    again.notify_checkpoint_complete(1)
    first.close()
    again.close()
    assert table_rows(db) == [(1, 10)]


def test_the_run_that_was_there_first_waits_for_a_newer_run_only_so_long(db, monkeypatch):
    monkeypatch.setattr(postgres, "LIVE_RUN_WAIT_S", 0.5)
    monkeypatch.setattr(postgres, "OLDER_RUN_WAIT_S", 1.5, raising=False)
    sink = PostgresSink(db.dsn, "t", delivery_guarantee=EO)
    first = operator(sink, run_id="run-1-aa")
    first.recover(None)
    time.sleep(0.05)
    _slow_newer_run(db, sink, hold_s=6.0)
    again = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), attempt=1, run_id="run-1-aa")
    started = time.monotonic()
    with pytest.raises(postgres.PostgresRunConflictError, match="another run"):
        again.recover(None)
    assert 1.4 < time.monotonic() - started < 5.0
    first.close()
    again.close()


def test_a_newer_run_that_connected_before_the_live_run_took_its_lock_does_not_outwait_it(
    db, monkeypatch
):
    """Run B's writer connects (its backend starts) and stalls, on a loaded machine,
    before it takes its run's lock; meanwhile run A starts, takes its lock, finds no
    other run and goes on. B's session then takes its lock and sees A. B's session is
    the oldest by backend start, though A was there first: B must not count as the run
    that was there first, outwait A's restart and make A's next attempt refuse and fail
    for good. A goes on; B refuses."""
    import threading

    monkeypatch.setattr(postgres, "LIVE_RUN_WAIT_S", 1.0)
    monkeypatch.setattr(postgres, "OLDER_RUN_WAIT_S", 8.0)
    sink = PostgresSink(db.dsn, "t", delivery_guarantee=EO)
    newer = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), run_id="run-2-bb")
    stalled = sink._connect("pg", "rayflow job pg writer run-2-bb", autocommit=False)
    time.sleep(0.05)  # the server's clock tells the sessions apart
    first = operator(sink, run_id="run-1-aa")
    first.recover(None)  # run A goes on: no other run holds a lock yet
    refused: list[BaseException] = []

    def newer_takes_its_lock() -> None:
        try:
            sink._hold_run(stalled, newer.sink_context, "pg")
        except postgres.PostgresRunConflictError as exc:
            refused.append(exc)

    thread = threading.Thread(target=newer_takes_its_lock)
    thread.start()
    time.sleep(0.3)  # B's session holds its lock and waits
    again = operator(PostgresSink(db.dsn, "t", delivery_guarantee=EO), attempt=1, run_id="run-1-aa")
    try:
        again.recover(None)  # A restarts while B waits: A goes on
        again.process(rows([1]))
        again.snapshot_state(1)
        again.notify_checkpoint_complete(1)
    finally:
        thread.join(20.0)
        first.close()
        again.close()
        stalled.close()
    assert len(refused) == 1 and "run run-2-bb refuses" in str(refused[0])
    assert table_rows(db) == [(1, 10)]


# --- two sessions finishing one prepared transaction --------------------------------------------


def test_a_commit_that_finds_another_session_finishing_it_is_retried_not_failed(db):
    """Two sessions COMMIT PREPARED the same transaction at once: a stale attempt's
    committer and the next attempt's recovery, or a cancel's clean-up and the recover
    thread it overlaps. The server answers the second "prepared transaction ... is busy"
    (SQLSTATE 55000) while the first is finishing, which takes as long as synchronous
    replication makes it wait. That is "another session is finishing it": RETRY_LATER,
    then ALREADY_COMMITTED; never FAILED (which fails the attempt, or a cancel's
    clean-up, for a transaction that is being committed). (psycopg files SQLSTATE 55000
    under OperationalError, which the committer retries.)"""
    import threading

    sink = PostgresSink(db.dsn, "t", delivery_guarantee=EO)
    op = operator(sink)
    op.process(rows([1]))
    op.snapshot_state(1)
    [committable] = op.pending[1]
    other = db.connect()
    admin = db.connect()
    try:
        admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'nosuch'")
        admin.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        other.execute("SET synchronous_commit = on")  # this session waits for a standby
        pid = other.info.backend_pid
        finishing = threading.Thread(
            target=other.execute, args=(f"COMMIT PREPARED '{committable.gid}'",), daemon=True
        )
        finishing.start()
        deadline = time.monotonic() + 30
        while (
            admin.execute(
                "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()[0]
            != "SyncRep"
        ):
            assert time.monotonic() < deadline, "the other session never waited"
            time.sleep(0.05)
        outcome = op.committer.commit(committable)
        assert outcome.status.name == "RETRY_LATER", outcome
    finally:
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")
        admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
        finishing.join(10)
        other.close()
        admin.close()
    assert op.committer.commit(committable).status.name == "ALREADY_COMMITTED"
    op.close()
    assert table_rows(db) == [(1, 10)]


# --- the same schedule in a real job ---------------------------------------------------------


def test_a_job_cancelled_while_its_sink_recovers_commits_the_restored_checkpoint(db, tmp_path):
    """A real run of the cancel-during-recovery schedule: the sink (one subtask, a
    transaction every two batches, so a checkpoint holds several) is killed between
    checkpoint 2's completion and its notification; attempt 1's recover thread commits
    the first restored transaction and stalls (a slow thread); the job is cancelled
    meanwhile. Every transaction the latest completed checkpoint holds must end
    committed, none rolled back."""
    from rayflow.errors import JobCancelledError
    from rayflow.sink import RollingPolicy
    from rayflow.testing import Fault, FaultPlan, FaultPoint
    from tests.chaos.harness import build_keyed_sum, unique_job

    with db.connect() as conn:
        conn.execute("CREATE TABLE sums (key bigint NOT NULL, value bigint NOT NULL)")
    sink = PostgresSink(
        db.dsn,
        "sums",
        columns=["key", "value"],
        delivery_guarantee=EO,
        rolling_policy=RollingPolicy(max_part_size=20_000),  # a transaction per 2 batches
    )
    plan = FaultPlan(
        [
            Fault(FaultPoint.BEFORE_NOTIFY, attempt=0, vertex="committed", checkpoint=2),
            Fault(
                FaultPoint.SINK_DURING_COMMIT,
                attempt=1,
                vertex="committed",
                action="sleep",
                seconds=60,
            ),
        ]
    )
    env, _ = build_keyed_sum(
        5_000_000,
        1,
        5000,
        rate=50_000,
        checkpoint_ms=1000,
        storage=str(tmp_path),
        sink=sink,
        plan=plan,
    )
    job = unique_job("pg-cancel-in-recovery")
    client = env.execute_async(job)
    try:
        held = _cancel_once_recovery_stalls(client, db, sink, str(tmp_path), job)
    except BaseException:
        client.cancel(timeout=120)  # never leave the job running past the test
        raise
    with pytest.raises(JobCancelledError):
        client.wait()
    assert len(held) >= 2, held  # the schedule needs a checkpoint of several transactions
    with db.connect() as conn:
        status = {
            c.gid: conn.execute("SELECT txid_status(%s)", (c.txid,)).fetchone()[0] for c in held
        }
    assert prepared(db) == []
    assert set(status.values()) == {"committed"}, status


def _held_by_latest_checkpoint(sink, root: str, job: str) -> list:
    """The committables the sink's state holds in the job's latest completed checkpoint."""
    from rayflow.checkpoint.storage import JobStorage
    from rayflow.runtime.channel_state import decode_snapshot

    latest = JobStorage(root, job).latest()
    if latest is None:
        return []
    storage, meta = latest
    serializer = sink.committable_serializer()
    held = []
    for entry in meta.subtasks.values():
        state = decode_snapshot(storage.read_blob(entry.path))[0].get("committed")
        if state:
            encoded = [e for cs in state["pending"].values() for e in cs] + state["due"]
            held += [serializer.decode(version, data) for version, data in encoded]
    return held


def _cancel_once_recovery_stalls(client, db, sink, root: str, job: str) -> list:
    """Cancel the job once attempt 1's recovery has committed some, not all, of the
    transactions the restored checkpoint holds (its recover thread stalls after a
    commit); returns those committables. The restored checkpoint is read from the job's
    storage once attempt 1 runs: attempt 1 completes no checkpoint while it recovers."""
    held: list = []
    stalled: set[str] | None = None
    deadline = time.monotonic() + 120
    with db.connect() as conn:
        while True:
            status = client._master_status()
            if status["attempt"] >= 1:
                held = held or _held_by_latest_checkpoint(sink, root, job)
                gids = {c.gid for c in held}
                current = {
                    row[0]
                    for row in conn.execute(
                        "SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", (list(gids),)
                    )
                }
                if current and (gids - current):
                    if current == stalled:
                        break  # unchanged for half a second: the recover thread stalls
                    stalled = current
                    time.sleep(0.5)
                    continue
                if held and not current:
                    pytest.fail(
                        f"attempt 1 committed all {len(held)} restored transactions "
                        "without stalling"
                    )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the schedule never came: job {status['state']} attempt "
                    f"{status['attempt']}; restored: {[c.gid for c in held]}"
                )
            time.sleep(0.02)
    client.cancel(timeout=None)
    return held


# --- two runs of one job name on two Ray clusters, in real jobs ----------------------------------


def test_a_second_run_of_a_job_name_refuses_to_run_while_the_first_restarts(
    db, tmp_path, monkeypatch
):
    """Run A of a job writes into a table; its sink subtask dies between checkpoint 1's
    completion and its notification (checkpoint 1's transaction stays prepared), and A
    waits its restart delay: no process of A has a database session then. Run B of the
    same job name starts meanwhile on another Ray cluster (here: the same one, without
    the cluster's run lock, which a second cluster does not see), with the same storage
    and sink. B must refuse to run: otherwise it rolls back checkpoint 1's transaction
    as lingering (A's restore of checkpoint 1 then fails: its rows are lost), and both
    runs write every row. A ends with every row once and no prepared transaction left."""
    import rayflow.environment as environment
    from rayflow.errors import JobFailedError
    from rayflow.status import JobState
    from rayflow.testing import Fault, FaultPlan, FaultPoint
    from tests.chaos.harness import build_keyed_sum, expected_rows, unique_job

    monkeypatch.setattr(environment, "acquire_run_lock", lambda job_name, run_id, job_id: None)
    with db.connect() as conn:
        conn.execute("CREATE TABLE sums (key bigint NOT NULL, value bigint NOT NULL)")
    n, batch = 100_000, 5000

    def run_of_the_job(plan=None, restart_delay_ms=50):
        sink = PostgresSink(db.dsn, "sums", columns=["key", "value"], delivery_guarantee=EO)
        env, _ = build_keyed_sum(
            n,
            1,
            batch,
            rate=20_000,
            checkpoint_ms=300,
            storage=str(tmp_path),
            sink=sink,
            plan=plan,
            restart_delay_ms=restart_delay_ms,
        )
        return env

    job = unique_job("pg-two-clusters")
    plan = FaultPlan([Fault(FaultPoint.BEFORE_NOTIFY, attempt=0, vertex="committed")])
    first = run_of_the_job(plan, restart_delay_ms=8000).execute_async(job)
    try:
        deadline = time.monotonic() + 60
        while first._master_status()["state"] != JobState.RESTARTING:
            assert time.monotonic() < deadline, "run A never restarted"
            time.sleep(0.05)
        second = run_of_the_job().execute_async(job)
        try:
            with pytest.raises(JobFailedError, match="another run"):
                second.wait()
        finally:
            second.cancel(timeout=120)
        result = first.wait()
    finally:
        first.cancel(timeout=120)
    assert result.restarts == 1
    with db.connect() as conn:
        rows, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT (key, value)) FROM sums"
        ).fetchone()
    assert prepared(db) == []
    assert rows == distinct == expected_rows(n, 1, batch)


# --- a key repeated across two checkpoints of a unique table ------------------------------------


def test_a_key_repeated_in_the_next_checkpoint_fails_instead_of_waiting_on_itself(db, monkeypatch):
    """The table has a primary key; the stream writes key 1 before checkpoint 1's barrier
    (its transaction is prepared, holding the key) and again after it, before checkpoint
    1's notification is handled. The second COPY waits for the prepared transaction,
    which only this subtask's mailbox commits, and the mailbox is the one waiting: the
    subtask hangs until the checkpoint timeout fails the attempt. It must fail soon
    instead, saying why (a unique key written again while its first write is prepared),
    and leave the prepared transaction for the restored checkpoint to commit."""
    import threading

    with db.connect() as conn:
        conn.execute("CREATE TABLE pk (k bigint PRIMARY KEY, v bigint)")
    monkeypatch.setattr(postgres, "WRITER_LOCK_TIMEOUT_S", 1.0, raising=False)
    sink = PostgresSink(db.dsn, "pk", delivery_guarantee=EO)
    op = operator(sink)
    op.process(rows([1]))
    op.snapshot_state(1)
    outcome: list = []

    def write_again():
        try:
            op.process(rows([1]))
            outcome.append("written")
        except Exception as exc:  # noqa: BLE001 - the error is what the test looks at
            outcome.append(exc)

    writer = threading.Thread(target=write_again, daemon=True)
    writer.start()
    writer.join(20)
    assert not writer.is_alive(), "the subtask waits on its own prepared transaction"
    [error] = outcome
    assert isinstance(error, postgres.PostgresSinkError), error
    assert "unique" in str(error) and "prepared" in str(error), error
    assert len(prepared(db)) == 1  # checkpoint 1's transaction stays for its commit
    op.notify_checkpoint_complete(1)
    op.close()
    assert table_rows(db, "pk") == [(1, 10)]


# --- a restore at a lower parallelism ------------------------------------------------------------


def test_a_restore_at_a_lower_parallelism_commits_every_old_subtasks_checkpoint(db):
    """A run at parallelism 3 completes checkpoint 5 and dies before any subtask is told;
    each old subtask also prepared a transaction for checkpoint 6, which never completed.
    The job is restored from checkpoint 5 at parallelism 2: subtask 0 takes the state of
    old subtasks 0 and 2, subtask 1 that of old subtask 1 (index % parallelism). Every
    transaction of checkpoint 5 must be committed, every one of checkpoint 6 rolled
    back, whichever new subtask sweeps first."""
    states = []
    for subtask in range(3):
        old = operator(
            PostgresSink(db.dsn, "t", delivery_guarantee=EO),
            subtask=subtask,
            parallelism=3,
            run_id="run-1-aa",
        )
        old.process(rows([subtask]))
        states.append(pickle.loads(pickle.dumps(old.snapshot_state(5))))
        old.process(rows([100 + subtask]))
        old.snapshot_state(6)  # never completes
        old.close()
    assert len(prepared(db)) == 6
    restored = []
    for subtask in (1, 0):  # subtask 1 sweeps before subtask 0 has committed old 2's
        new = operator(
            PostgresSink(db.dsn, "t", delivery_guarantee=EO),
            attempt=1,
            subtask=subtask,
            parallelism=2,
            run_id="run-1-aa",
        )
        new.restore_state([s for i, s in enumerate(states) if i % 2 == subtask])
        new.recover(5)
        restored.append(new)
    for new in restored:
        new.close()
    assert table_rows(db) == [(0, 0), (1, 10), (2, 20)]
    assert prepared(db) == []
