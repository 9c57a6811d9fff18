"""Savepoints on a real Ray with real files: a job on an unbounded source is stopped with
a savepoint, its code changed (an operator added, uids kept), resumed from the moved
savepoint and stopped again: every generated record reaches the exactly-once file sink
once, and keyed state carries across. Also: a savepoint of a running job, state that no
operator takes, and a failed savepoint that leaves the job and its checkpoint ids alone."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rayflow import Sink, SinkContext, SinkWriter, StreamExecutionEnvironment
from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.checkpoint.state_mapping import MissingUidWarning
from rayflow.cli import main as cli_main
from rayflow.datagen import DataGeneratorSource
from rayflow.errors import JobFailedError, SavepointError
from rayflow.functions import KeyedProcessFunction
from rayflow.runtime.hooks import HookPoint, MasterHooks, RuntimeHooks, SubtaskHooks
from rayflow.status import JobState
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults, wait_for_checkpoints
from sinks.files import FileSink

P = 2
KEYS = 7


def with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pc.remainder(batch.column("value"), KEYS))


def tagged(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("tag", pa.array(np.full(batch.num_rows, 2, dtype=np.int64)))


def build(tmp_path, version: int, rate: float = 4000):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(P)
    env.enable_checkpointing(200)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    keyed = (
        env.from_source(DataGeneratorSource(records_per_second=rate, batch_size=100), "gen")
        .uid("gen")
        .map_batches(with_key, name="with-key")
        .uid("with-key")
    )
    raw = keyed
    if version == 2:  # the code change: one operator added before the raw sink
        raw = keyed.map_batches(tagged, name="tag").uid("tag")
    raw.sink_to(FileSink(str(tmp_path / "raw"), "parquet"), name="raw").uid("raw")
    (
        keyed.key_by("key")
        .sum("value")
        .uid("sum")
        .sink_to(FileSink(str(tmp_path / "sums"), "parquet"), name="sums")
        .uid("sums")
    )
    return env


def committed(directory) -> pa.Table:
    names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    return pa.concat_tables(
        [pq.read_table(os.path.join(directory, n)) for n in names], promote_options="default"
    )


def wait_for_records(tmp_path, at_least: int, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if os.path.isdir(tmp_path / "raw") and any(
            not n.startswith(".") for n in os.listdir(tmp_path / "raw")
        ):
            if committed(tmp_path / "raw").num_rows >= at_least:
                return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {at_least} records committed in {timeout_s} s")


def check_exactly_once(tmp_path) -> np.ndarray:
    """Every generated index once: each split (index mod P) made a prefix of its indices."""
    values = np.sort(committed(tmp_path / "raw").column("value").to_numpy())
    assert len(np.unique(values)) == len(values), "a record was written twice"
    for split in range(P):
        mine = values[values % P == split]
        assert np.array_equal(mine, np.arange(split, split + P * len(mine), P)), (
            f"split {split}: a record is missing"
        )
    return values


def test_stop_change_code_resume_from_a_moved_savepoint_exactly_once(tmp_path):
    job = f"savepoint-{time.time_ns()}"
    client = build(tmp_path, 1).execute_async(job)
    wait_for_records(tmp_path, 500)
    first = client.stop_with_savepoint(str(tmp_path / "savepoints"))
    assert client.get_job_status() is JobState.FINISHED
    assert os.path.exists(os.path.join(first, "_metadata"))
    stopped = check_exactly_once(tmp_path)
    assert not os.listdir(tmp_path / "raw") or all(
        not n.startswith(".") for n in os.listdir(tmp_path / "raw")
    ), "a transaction was left open at the stop"

    # moved: no reference into the first run's checkpoint directory
    moved = str(tmp_path / "moved" / "sp")
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    shutil.rmtree(tmp_path / "chk")
    meta = CheckpointMetadata.from_bytes(open(os.path.join(moved, "_metadata"), "rb").read())
    assert meta.savepoint and all("/" not in e.path for e in meta.subtasks.values())

    client2 = build(tmp_path, 2).execute_async(job, restore_from=moved)
    assert client2.run_id != client.run_id
    wait_for_records(tmp_path, len(stopped) + 500)
    client2.stop_with_savepoint(str(tmp_path / "savepoints"))
    result = client2.wait()
    assert result.restored_from == meta.checkpoint_id
    # checkpoint ids of the new run start above the savepoint's
    assert min(c["checkpoint_id"] for c in result.checkpoints) > meta.checkpoint_id

    values = check_exactly_once(tmp_path)
    assert len(values) > len(stopped)
    table = committed(tmp_path / "raw")
    tags = table.column("tag").to_pylist()
    assert tags.count(None) == len(stopped)  # written before the change: no tag column
    assert tags.count(2) == len(values) - len(stopped)
    # keyed state carried across the stop: the last running sum of every key is the sum
    # of every value of that key
    sums = committed(tmp_path / "sums")
    for key in range(KEYS):
        mine = values[values % KEYS == key]
        got = pc.max(sums.filter(pc.equal(sums.column("key"), key)).column("value")).as_py()
        assert got == int(mine.sum())


def test_savepoint_of_a_running_job_restores_and_warns_about_missing_uids(tmp_path):
    job = f"running-{time.time_ns()}"
    client = build(tmp_path, 1).execute_async(job)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    path = client.trigger_savepoint(str(tmp_path / "sp"))
    assert client.get_job_status() is JobState.RUNNING
    assert os.path.exists(os.path.join(path, "_metadata"))
    marked = [c for c in client.checkpoints() if c.get("savepoint") == path]
    assert marked and marked[0]["status"] == "COMPLETED"
    # the run's checkpoints go on after it, with higher ids
    count = len(client.checkpoints())
    deadline = time.time() + 30
    while len(client.checkpoints()) == count and time.time() < deadline:
        time.sleep(0.05)
    assert client.checkpoints()[-1]["checkpoint_id"] > marked[0]["checkpoint_id"]
    client.cancel()

    # a job whose sum has another uid: its state is refused unless dropped
    env = build(tmp_path, 1)
    sum_transformation = next(t for t in env._plan.transformations.values() if t.uid == "sum")
    sum_transformation.uid = "sum-v2"
    with pytest.raises(ValueError, match="does not have.*'sum'.*allow_non_restored_state"):
        env.execute_async(job, restore_from=path)
    # dropped on request: the job restores everything else and runs
    client = env.execute_async(job, restore_from=path, allow_non_restored_state=True)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    assert client.cancel()

    # a stateless operator without a uid: nothing to match, no warning; the job restores
    env = build(tmp_path, 1)
    for t in env._plan.transformations.values():
        if t.uid == "with-key":
            t.uid = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingUidWarning)
        client = env.execute_async(job, restore_from=path)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    assert client.cancel()
    # the keyed sum without a uid (its state dropped on request): a warning naming it
    env = build(tmp_path, 1)
    for t in env._plan.transformations.values():
        if t.uid == "sum":
            t.uid = None
    with pytest.warns(MissingUidWarning, match=r"\['[^']*'\] have no explicit uid"):
        client = env.execute_async(job, restore_from=path, allow_non_restored_state=True)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    assert client.cancel()


def test_a_failed_savepoint_leaves_the_job_running_and_ids_increasing(tmp_path, capsys):
    job = f"failing-{time.time_ns()}"
    client = build(tmp_path, 1).execute_async(job)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the savepoint directory would go")
    with pytest.raises(SavepointError, match="could not be written"):
        client.trigger_savepoint(str(blocker))
    assert client.get_job_status() is JobState.RUNNING
    # from the command line, by job id (as another process would)
    assert cli_main(["savepoint", client.job_id, str(tmp_path / "sp")]) == 0
    path = capsys.readouterr().out.strip()
    assert os.path.exists(os.path.join(path, "_metadata"))
    ids = [c["checkpoint_id"] for c in client.checkpoints()]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert cli_main(["savepoint", "--stop", client.job_id, str(tmp_path / "sp")]) == 0
    client.wait(60)
    assert client.get_job_status() is JobState.FINISHED
    check_exactly_once(tmp_path)
    assert cli_main(["savepoint", client.job_id, str(tmp_path / "sp")]) == 2
    assert "no running job" in capsys.readouterr().err


def test_a_stop_with_savepoint_that_fails_lets_the_job_go_on(tmp_path):
    """The sources stop at the savepoint's barrier; the savepoint times out (a subtask
    stalls after its snapshot): the sources read again, the next checkpoint does not
    finish the job, and a second stop is exactly once."""
    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    # A savepoint times out after 4 s (the second one has that long on a loaded machine);
    # the first one's stalled subtask sleeps past it.
    env.get_checkpoint_config().set_checkpoint_timeout(4000)
    stall_s = 8.0
    inject_faults(
        env,
        FaultPlan(
            [Fault(FaultPoint.AFTER_SNAPSHOT, vertex="Sum", action="sleep", seconds=stall_s)]
        ),
    )
    client = env.execute_async(f"stop-fails-{time.time_ns()}")

    def generated() -> int:
        return sum(m["records_out"] for m in client.metrics() if m["vertex"].startswith("gen"))

    deadline = time.time() + 60
    while generated() < 200 and time.time() < deadline:
        time.sleep(0.1)
    with pytest.raises(SavepointError, match="failed.*the job goes on"):
        client.stop_with_savepoint(str(tmp_path / "sp"))
    assert client.get_job_status() is JobState.RUNNING
    before = generated()
    deadline = time.time() + 30
    while generated() < before + 200 and time.time() < deadline:
        time.sleep(0.1)
    assert generated() >= before + 200, "the sources did not read again"
    statuses = [c["status"] for c in client.checkpoints()]
    assert statuses == ["FAILED"]
    time.sleep(stall_s)  # the stalled subtask wakes up
    path = client.stop_with_savepoint(str(tmp_path / "sp"))
    assert client.get_job_status() is JobState.FINISHED
    assert os.path.exists(os.path.join(path, "_metadata"))
    check_exactly_once(tmp_path)


def test_a_failure_after_the_stop_savepoint_completed_still_stops_the_job(tmp_path):
    """A sink subtask dies after the stop's savepoint completed, before it finished:
    the restarted attempt restores the savepoint's checkpoint, reads nothing more, commits
    what the savepoint holds and finishes at a final checkpoint."""
    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    # the raw sink's process dies in its first commit: the savepoint's, after it completed
    inject_faults(env, FaultPlan([Fault(FaultPoint.SINK_DURING_COMMIT, vertex="raw")]))
    client = env.execute_async(f"stop-then-fail-{time.time_ns()}")
    deadline = time.time() + 60
    while time.time() < deadline:
        generated = sum(m["records_out"] for m in client.metrics() if m["vertex"].startswith("gen"))
        if generated >= 300:
            break
        time.sleep(0.1)
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    result = client.wait()
    assert result.restarts == 1
    saved = CheckpointMetadata.from_bytes(open(os.path.join(path, "_metadata"), "rb").read())
    assert result.restored_from == saved.checkpoint_id
    final = result.completed_checkpoints[-1]
    assert final["final"] and final["checkpoint_id"] > saved.checkpoint_id
    values = check_exactly_once(tmp_path)
    # nothing was read after the savepoint: its source positions are where the output ends
    made = sum(s.made for splits in saved.source_splits.values() for s in splits)
    assert len(values) == made


def test_a_job_master_lost_after_the_stop_savepoint_completed_still_stops_the_job(tmp_path):
    """The job master dies after the stop's savepoint completed (recorded in the run's
    state, its directory written) and before any subtask heard of it: the job master that
    takes over stops the job too, instead of reading on, and stop_with_savepoint returns
    the savepoint."""
    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    inject_faults(env, FaultPlan([Fault(FaultPoint.JOB_MASTER_BEFORE_NOTIFY)]))
    client = env.execute_async(f"stop-master-lost-{time.time_ns()}")
    deadline = time.time() + 60
    while time.time() < deadline:
        generated = sum(m["records_out"] for m in client.metrics() if m["vertex"].startswith("gen"))
        if generated >= 300:
            break
        time.sleep(0.1)
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    result = client.wait(90)
    assert result.job_master_restarts == 1
    (name,) = os.listdir(tmp_path / "sp")
    assert path == str(tmp_path / "sp" / name)
    saved = saved_metadata(path)
    assert result.restored_from == saved.checkpoint_id
    values = check_exactly_once(tmp_path)
    made = sum(s.made for splits in saved.source_splits.values() for s in splits)
    assert len(values) == made


def test_a_trigger_that_arrives_after_its_abort_does_not_stop_a_source(tmp_path):
    """A source hears of a stop savepoint's abort before its trigger (calls overtaking
    each other): the late trigger is stale, the source reads on and the job stops later."""
    import ray

    client = build(tmp_path, 1).execute_async(f"late-trigger-{time.time_ns()}")
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    (actor,) = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"rayflow:{client.job_id}:v0:s0:")
    ]
    source = ray.get_actor(actor["name"], namespace=actor["namespace"])
    attempt = ray.get(source.metrics.remote())["attempt"]
    stale = client.checkpoints()[-1]["checkpoint_id"]  # the coordinator is past it
    ray.get(source.notify_checkpoint_aborted.remote(attempt, stale))
    ray.get(source.trigger_checkpoint.remote(attempt, stale, time.time(), True, True))

    def produced() -> int:
        return ray.get(source.metrics.remote())["records_out"]

    before = produced()
    deadline = time.time() + 30
    while produced() < before + 200 and time.time() < deadline:
        time.sleep(0.1)
    assert produced() >= before + 200, "the source stopped at a stale trigger"
    client.stop_with_savepoint(str(tmp_path / "sp"), timeout=60)
    check_exactly_once(tmp_path)


def generated_records(client) -> int:
    try:
        return sum(m["records_out"] for m in client.metrics() if m["vertex"].startswith("gen"))
    except Exception:  # noqa: BLE001 - the job master is being replaced
        return 0


def wait_generated(client, at_least: int, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    seen = generated_records(client)
    while seen < at_least and time.time() < deadline:
        time.sleep(0.1)
        seen = generated_records(client)
    assert seen >= at_least, f"the sources read {seen} records, not {at_least}"


def saved_metadata(path: str) -> CheckpointMetadata:
    with open(os.path.join(path, "_metadata"), "rb") as f:
        return CheckpointMetadata.from_bytes(f.read())


def test_a_job_master_lost_before_the_stop_savepoint_is_written_still_writes_it(tmp_path):
    """The job master dies after the stop's commit point, with the stop recorded, before
    the savepoint's directory is written: the job master that takes over writes it from
    the checkpoint, the job stops, and stop_with_savepoint returns a savepoint that
    restores exactly once."""
    job = f"stop-before-write-{time.time_ns()}"
    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    inject_faults(env, FaultPlan([Fault(FaultPoint.JOB_MASTER_BEFORE_SAVEPOINT_WRITE)]))
    client = env.execute_async(job)
    wait_generated(client, 300)
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    result = client.wait(90)
    assert result.job_master_restarts == 1
    saved = saved_metadata(path)
    assert saved.savepoint and all("/" not in e.path for e in saved.subtasks.values())
    assert result.restored_from == saved.checkpoint_id
    values = check_exactly_once(tmp_path)
    made = sum(s.made for splits in saved.source_splits.values() for s in splits)
    assert len(values) == made

    # self-contained: it restores with the run's checkpoints gone, exactly once across
    shutil.rmtree(tmp_path / "chk")
    client2 = build(tmp_path, 1).execute_async(job, restore_from=path)
    wait_for_records(tmp_path, made + 300)
    client2.stop_with_savepoint(str(tmp_path / "sp2"), timeout=90)
    assert client2.wait(90).restored_from == saved.checkpoint_id
    assert len(check_exactly_once(tmp_path)) > made


def test_a_job_master_lost_before_the_stop_is_recorded_says_the_job_goes_on(tmp_path):
    """The job master dies after the stop's commit point, before the stop is recorded in
    the run's state: the job master that takes over resumes the job from that checkpoint
    (its transactions committed once), the stop fails saying the job goes on, and no
    savepoint is reported; a second stop is exactly once."""
    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    inject_faults(env, FaultPlan([Fault(FaultPoint.JOB_MASTER_BEFORE_STOP_RECORD)]))
    client = env.execute_async(f"stop-before-record-{time.time_ns()}")
    wait_generated(client, 300)
    with pytest.raises(SavepointError, match="the job goes on"):
        client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    assert client.get_job_status() in (JobState.RUNNING, JobState.RESTARTING)
    assert not any(
        os.path.exists(os.path.join(tmp_path / "sp", n, "_metadata"))
        for n in (os.listdir(tmp_path / "sp") if os.path.isdir(tmp_path / "sp") else [])
    ), "a savepoint was written for a stop that did not happen"
    wait_read_on_after_a_restart(client)
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    result = client.wait(90)
    assert result.job_master_restarts == 1
    saved = saved_metadata(path)
    values = check_exactly_once(tmp_path)
    made = sum(s.made for splits in saved.source_splits.values() for s in splits)
    assert len(values) == made


def test_a_savepoint_with_unreadable_state_fails_the_restore_at_once_naming_it(tmp_path):
    """A blob of the savepoint is of a state format this rayflow does not know (written by
    a newer one, or damaged): no restart can read it, so the restored job fails at once
    with an error naming the blob's operators, instead of restarting forever."""
    job = f"unreadable-{time.time_ns()}"
    client = build(tmp_path, 1).execute_async(job)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    path = client.trigger_savepoint(str(tmp_path / "sp"))
    assert client.cancel()
    saved = saved_metadata(path)
    (entry,) = [e for k, e in saved.subtasks.items() if "Sum" in e.vertex and k[1] == 0]
    blob = bytearray(open(os.path.join(path, entry.path), "rb").read())
    header = b"RAYFLOW-STATE\n"
    at = blob.find(header)
    assert at >= 0
    blob[at + len(header)] = 9  # a format version from the future
    with open(os.path.join(path, entry.path), "wb") as f:
        f.write(bytes(blob))
    client = build(tmp_path, 1).execute_async(job, restore_from=path)
    with pytest.raises(JobFailedError, match=r"(?s)state format version 9.*Sum") as failed:
        client.wait(120)
    (entry,) = client.failure_history()
    assert entry.count == 1, "it restarted on state it cannot read"
    # The sink's open transactions are in the same unreadable blob: its clean-up fails the
    # same way every time, so it is tried once (each try starts new subtask processes),
    # and the error says why they are left for the next run.
    message = str(failed.value)
    assert "could not be cleaned up (" in message, message
    left = message.split("could not be cleaned up", 1)[1]
    assert "state format version 9" in left and "not tried again" in left, left
    assert "\x1b[" not in left and 'File "' not in left, f"a traceback in the reason: {left}"


class _UnwritableStopRecord(MasterHooks):
    def __init__(self, storage: str) -> None:
        self.storage = storage
        self.broken = False

    def at(self, point, checkpoint, subtasks) -> bool:
        import glob
        import signal
        import threading

        if point is HookPoint.JOB_MASTER_BEFORE_STOP_RECORD:
            (state,) = glob.glob(os.path.join(self.storage, "**", "_job_state"), recursive=True)
            os.replace(state, state + ".kept")
            os.mkdir(state)  # the run's state cannot be written over a directory
            open(os.path.join(state, "x"), "w").close()

            def mend() -> None:
                shutil.rmtree(state)
                os.replace(state + ".kept", state)

            threading.Timer(3.0, mend).start()
            self.broken = True
        if point is HookPoint.JOB_MASTER_BEFORE_NOTIFY and self.broken:
            os.kill(os.getpid(), signal.SIGKILL)  # whatever went on, it is lost now
        return True


class UnwritableStopRecord(RuntimeHooks):
    """Attempt 0: the run's state cannot be written when the stop is to be recorded (for
    3 s); if the job master goes on to notify the subtasks anyway, it dies there."""

    def __init__(self, storage: str) -> None:
        self.storage = storage

    def for_job_master(self, attempt: int) -> MasterHooks | None:
        return _UnwritableStopRecord(self.storage) if attempt == 0 else None


def test_a_stop_that_cannot_be_recorded_does_not_stop_the_job(tmp_path):
    """The stop's checkpoint completed but the run's state cannot be written: the stop is
    not recorded, so it must not happen (a job master taking over later would read on past
    a savepoint whose output was committed). The attempt fails, the job goes on from that
    checkpoint, no savepoint is reported, and a second stop is exactly once."""
    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    inject_faults(env, UnwritableStopRecord(str(tmp_path / "chk")))
    client = env.execute_async(f"stop-unrecorded-{time.time_ns()}")
    wait_generated(client, 300)
    with pytest.raises(SavepointError, match="could not be recorded.*the job goes on"):
        client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    assert not any(
        os.path.exists(os.path.join(tmp_path / "sp", n, "_metadata"))
        for n in (os.listdir(tmp_path / "sp") if os.path.isdir(tmp_path / "sp") else [])
    ), "a savepoint was written for a stop that did not happen"
    wait_read_on_after_a_restart(client)
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    result = client.wait(90)
    assert result.restarts >= 1
    saved = saved_metadata(path)
    values = check_exactly_once(tmp_path)
    made = sum(s.made for splits in saved.source_splits.values() for s in splits)
    assert len(values) == made


def wait_read_on_after_a_restart(client, timeout_s: float = 90) -> None:
    """Wait until an attempt after the first runs and its sources read 300 records (the
    failed attempt's subtasks report their counts until they are gone: not counted)."""
    deadline = time.time() + timeout_s
    first: tuple[int, int] | None = None  # (attempt, records when first seen running)
    while time.time() < deadline:
        status = client._master_status()
        if status["state"] is JobState.RUNNING and status["restarts"] >= 1:
            seen = generated_records(client)
            if first is None or first[0] != status["attempt"]:
                first = (status["attempt"], seen)
            elif seen >= first[1] + 300:
                return
        time.sleep(0.1)
    raise AssertionError(f"the job did not read on after its restart: {first}")


class Reminders(KeyedProcessFunction):
    """Each key gets a processing-time timer a second or so after its records; a timer
    that fires emits (key, its time) once."""

    def process_element(self, value, ctx):
        timers = ctx.timer_service()
        timers.register_processing_time_timer((timers.current_processing_time() // 500 + 3) * 500)
        return None

    def on_timer(self, timestamp, ctx):
        yield {"key": ctx.get_current_key(), "fired": timestamp}


def build_reminders(tmp_path, plan=None, sink=None):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(P)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    if plan is not None:
        inject_faults(env, plan)
    (
        env.from_source(DataGeneratorSource(records_per_second=2000, batch_size=100), "gen")
        .uid("gen")
        .map_batches(with_key, name="with-key")
        .uid("with-key")
        .key_by("key")
        .process(Reminders(), "reminders")
        .uid("reminders")
        .sink_to(sink or FileSink(str(tmp_path / "fired"), "parquet"), name="fired")
        .uid("fired")
    )
    return env


def test_timers_do_not_fire_after_a_stop_into_output_the_savepoint_makes_again(tmp_path):
    """The sink dies committing the stop's savepoint: the restarted attempt restores it
    with its timers pending and only finishes. A timer that fired there would commit
    output at the final checkpoint that a restore from the savepoint makes again."""
    job = f"stop-timers-{time.time_ns()}"
    plan = FaultPlan([Fault(FaultPoint.SINK_DURING_COMMIT, vertex="fired")])
    client = build_reminders(tmp_path, plan).execute_async(job)
    wait_generated(client, 400)
    time.sleep(2.0)  # timers fired: the savepoint's transaction has output to commit
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    assert client.wait(90).restarts == 1
    client2 = build_reminders(tmp_path).execute_async(job, restore_from=path)
    wait_generated(client2, 400)
    time.sleep(2.0)  # the savepoint's timers are due by now
    client2.stop_with_savepoint(str(tmp_path / "sp2"), timeout=90)
    fired = committed(tmp_path / "fired")
    pairs = list(zip(fired.column("key").to_pylist(), fired.column("fired").to_pylist()))
    assert len(pairs) > 0
    assert len(set(pairs)) == len(pairs), "a timer's output was committed twice"


class _SlowSavepointWrite(MasterHooks):
    def at(self, point, checkpoint, subtasks) -> bool:
        if point is HookPoint.JOB_MASTER_BEFORE_SAVEPOINT_WRITE:
            time.sleep(3.0)  # every subtask has passed the barrier; timers come due
        return True


class SlowSavepointWrite(RuntimeHooks):
    """Attempt 0: the job master writes the savepoint 3 s after every subtask acknowledged
    it."""

    def for_job_master(self, attempt: int) -> MasterHooks | None:
        return _SlowSavepointWrite() if attempt == 0 else None


class _AppendLines(SinkWriter):
    def __init__(self, path: str) -> None:
        self.file = open(path, "a")  # noqa: SIM115 - closed in finish()

    def write(self, batch: pa.RecordBatch) -> None:
        for record in batch.to_pylist():
            self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # out at once: nothing to commit, nothing taken back

    def finish(self) -> None:
        self.file.close()


class AppendLinesSink(Sink):
    """Writes each record as a line to a file per subtask as it comes (no transactions:
    at least once)."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def create_writer(self, context: SinkContext) -> SinkWriter:
        os.makedirs(self.directory, exist_ok=True)
        name = f"{context.subtask_index}-{time.time_ns()}.jsonl"
        return _AppendLines(os.path.join(self.directory, name))


def lines(directory) -> list[dict]:
    out = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as f:
            out += [json.loads(line) for line in f]
    return out


@pytest.mark.parametrize("sink", ["transactions", "at once"])
def test_timers_due_while_a_stop_completes_fire_after_the_restore_only(tmp_path, sink):
    """Timers come due after the process function took the stop's barrier, while the
    savepoint is written: they are in the savepoint, so they fire after the restore and
    not also before (Flink's synchronous savepoint holds them): a sink that writes at
    once would get their records twice."""
    job = f"stop-held-timers-{time.time_ns()}"

    def build():
        if sink == "transactions":
            return build_reminders(tmp_path), lambda: committed(tmp_path / "fired").to_pylist()
        out = str(tmp_path / "lines")
        return build_reminders(tmp_path, sink=AppendLinesSink(out)), lambda: lines(out)

    env, _ = build()
    inject_faults(env, SlowSavepointWrite())
    client = env.execute_async(job)
    wait_generated(client, 400)
    time.sleep(1.0)
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    assert client.wait(90).restarts == 0
    env2, written = build()
    client2 = env2.execute_async(job, restore_from=path)
    wait_generated(client2, 400)
    time.sleep(2.0)  # the savepoint's timers are due by now
    client2.stop_with_savepoint(str(tmp_path / "sp2"), timeout=90)
    pairs = [(r["key"], r["fired"]) for r in written()]
    assert len(pairs) > 0
    assert len(set(pairs)) == len(pairs), "a timer's output was written twice"


def test_timers_held_by_a_withdrawn_stop_fire_once_and_timers_go_on_firing(tmp_path):
    """The stop's checkpoint stalls (the first process subtask sleeps after its snapshot)
    while the other one, past the barrier, holds the timers that come due; the caller
    gives up and the stop is withdrawn (aborted): the held timers fire, once, and every
    key's timers go on firing afterwards (a held wake-up lost would leave its subtask's
    timers unarmed for good)."""
    from rayflow.environment import JobWaitTimeout

    out = str(tmp_path / "lines")
    env = build_reminders(tmp_path, sink=AppendLinesSink(out))
    env.get_checkpoint_config().set_checkpoint_timeout(120_000)
    stall = Fault(FaultPoint.AFTER_SNAPSHOT, vertex="reminders", action="sleep", seconds=3)
    inject_faults(env, FaultPlan([stall]))
    client = env.execute_async(f"stop-withdrawn-timers-{time.time_ns()}")
    wait_generated(client, 400)
    time.sleep(1.0)
    with pytest.raises(JobWaitTimeout, match="withdrawn"):
        client.stop_with_savepoint(str(tmp_path / "sp"), timeout=1.5)
    withdrawn_ms = time.time() * 1000
    time.sleep(3.0)  # the stalled subtask wakes up; the held timers fire
    assert client.get_job_status() is JobState.RUNNING
    before = generated_records(client)
    wait_generated(client, before + 2000)  # the sources read again, for a second
    time.sleep(2.0)  # the timers of what was read come due
    client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    pairs = [(r["key"], r["fired"]) for r in lines(out)]
    assert len(set(pairs)) == len(pairs), "a timer's output was written twice"
    late = {key for key, fired in pairs if fired > withdrawn_ms + 1000}
    assert late == set(range(KEYS)), f"keys whose timers stopped firing: {set(range(KEYS)) - late}"


def assert_withdrawn_and_the_job_goes_on(client, tmp_path, stall_s: float) -> None:
    """After a stop with savepoint was withdrawn while its checkpoint stalled for
    ``stall_s``: the job runs and reads on, no savepoint was written, the checkpoint
    failed, and a second stop is exactly once."""
    time.sleep(stall_s)  # the stalled subtask wakes up and acknowledges
    assert client.get_job_status() is JobState.RUNNING
    before = generated_records(client)
    wait_generated(client, before + 200)  # the sources read again
    assert not any(
        os.path.exists(os.path.join(tmp_path / "sp", n, "_metadata"))
        for n in (os.listdir(tmp_path / "sp") if os.path.isdir(tmp_path / "sp") else [])
    ), "a withdrawn stop wrote a savepoint"
    assert [c["status"] for c in client.checkpoints()] == ["FAILED"]
    path = client.stop_with_savepoint(str(tmp_path / "sp"), timeout=90)
    assert client.get_job_status() is JobState.FINISHED
    saved = saved_metadata(path)
    values = check_exactly_once(tmp_path)
    assert len(values) == sum(s.made for splits in saved.source_splits.values() for s in splits)


@pytest.mark.parametrize("caller", ["client", "command line"])
def test_a_stop_with_savepoint_that_times_out_is_withdrawn_and_the_job_goes_on(
    tmp_path, caller, capsys
):
    """The stop's checkpoint is slow (a subtask stalls after its snapshot) and the caller
    (a JobClient, or ``rayflow savepoint --stop`` by job id) gives up waiting: the stop is
    withdrawn (its checkpoint aborted), so the job does not stop later with a savepoint
    nobody was told of; the job reads on, and a second stop is exactly once."""
    from rayflow.environment import JobWaitTimeout

    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    env.get_checkpoint_config().set_checkpoint_timeout(120_000)
    inject_faults(
        env,
        FaultPlan([Fault(FaultPoint.AFTER_SNAPSHOT, vertex="Sum", action="sleep", seconds=4)]),
    )
    client = env.execute_async(f"stop-slow-{time.time_ns()}")
    wait_generated(client, 200)
    if caller == "client":
        with pytest.raises(JobWaitTimeout, match="withdrawn"):
            client.stop_with_savepoint(str(tmp_path / "sp"), timeout=1.5)
    else:
        capsys.readouterr()
        argv = ["savepoint", "--stop", "--timeout", "1.5", client.job_id, str(tmp_path / "sp")]
        assert cli_main(argv) == 2
        assert "withdrawn" in capsys.readouterr().err
    assert_withdrawn_and_the_job_goes_on(client, tmp_path, 4.0)


class _StallAfterSnapshot(SubtaskHooks):
    def __init__(self, flag: str, seconds: float) -> None:
        self.flag, self.seconds, self.fired = flag, seconds, False

    def at(self, point: HookPoint) -> None:
        if point is HookPoint.AFTER_SNAPSHOT and not self.fired:
            self.fired = True
            with open(self.flag, "w"):
                pass
            time.sleep(self.seconds)


class StallFirstSnapshot(RuntimeHooks):
    """The Sum subtask of the first attempt, after its first snapshot: writes ``flag``
    (the checkpoint is under way: its trigger was received) and sleeps ``seconds``."""

    def __init__(self, flag: str, seconds: float) -> None:
        self.flag, self.seconds = flag, seconds

    def for_subtask(self, vertex_name: str, index: int, attempt: int) -> SubtaskHooks | None:
        if "Sum" in vertex_name and attempt == 0:
            return _StallAfterSnapshot(self.flag, self.seconds)
        return None


def test_ctrl_c_during_a_stop_with_savepoint_on_the_command_line_withdraws_it(tmp_path):
    """``rayflow savepoint --stop`` is interrupted (SIGINT, as Ctrl-C) while the stop's
    checkpoint is slow: the request is withdrawn before the command exits (130, saying
    so), so the job does not stop later with a savepoint nobody was told of; the job
    reads on, and a second stop is exactly once."""
    import signal
    import subprocess
    import sys

    import ray

    flag = tmp_path / "snapshot-taken"
    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    env.get_checkpoint_config().set_checkpoint_timeout(120_000)
    inject_faults(env, StallFirstSnapshot(str(flag), seconds=8))
    client = env.execute_async(f"stop-interrupted-{time.time_ns()}")
    wait_generated(client, 200)
    child_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # As from a terminal: SIGINT handled by default (a shell's background job, such as a
    # test run started with `&`, ignores it, and Python then raises no KeyboardInterrupt).
    as_in_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, '-m', 'rayflow.cli', *sys.argv[1:]])"
    )
    command = [sys.executable, "-c", as_in_a_terminal, "savepoint", "--stop", "--timeout", "120"]
    command += ["--address", ray.get_runtime_context().gcs_address]
    command += [client.job_id, str(tmp_path / "sp")]
    child = subprocess.Popen(
        command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():  # the stop's checkpoint is under way, and stalls
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the stop's checkpoint never started"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)  # Ctrl-C while it waits for the savepoint
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, (out, err)
    assert "withdrawn" in err and "the job goes on" in err, err
    assert_withdrawn_and_the_job_goes_on(client, tmp_path, 8.0)


def test_a_stop_whose_job_finishes_slowly_still_names_its_savepoint(tmp_path):
    """The stop's savepoint is complete but the job does not finish within the caller's
    timeout (a sink's final commit is slow): the timeout names the savepoint, which is
    complete and restores, and the job finishes exactly once."""
    from rayflow.environment import JobWaitTimeout

    env = build(tmp_path, 1)
    env.enable_checkpointing(600_000)  # only savepoints take checkpoints
    plan = FaultPlan(
        [Fault(FaultPoint.SINK_DURING_COMMIT, vertex="raw", action="sleep", seconds=12)]
    )
    inject_faults(env, plan)
    client = env.execute_async(f"stop-slow-finish-{time.time_ns()}")
    wait_generated(client, 300)
    with pytest.raises(JobWaitTimeout, match="stopped with savepoint") as slow:
        client.stop_with_savepoint(str(tmp_path / "sp"), timeout=6)
    path = slow.value.savepoint
    saved = saved_metadata(path)
    assert saved.savepoint
    client.wait(60)
    assert client.get_job_status() is JobState.FINISHED
    values = check_exactly_once(tmp_path)
    assert len(values) == sum(s.made for splits in saved.source_splits.values() for s in splits)


def test_a_restore_with_another_max_parallelism_is_refused_naming_the_operator(tmp_path):
    """Keyed state is cut into key groups by the max parallelism: restored under another
    one, keys would land in other groups (state dropped or given to the wrong subtask).
    The start is refused naming the keyed operator; the same max parallelism restores."""
    job = f"max-parallelism-{time.time_ns()}"
    client = build(tmp_path, 1).execute_async(job)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    path = client.trigger_savepoint(str(tmp_path / "sp"))
    assert client.cancel()
    env = build(tmp_path, 1)
    env.set_max_parallelism(64)
    with pytest.raises(ValueError, match=r"(?s)'sum'.*max parallelism 128.*64"):
        env.execute_async(job, restore_from=path)
    client = build(tmp_path, 1).execute_async(job, restore_from=path)
    assert wait_for_checkpoints(client, 1, timeout_s=60) >= 1
    assert client.cancel()
