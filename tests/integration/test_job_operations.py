"""Running a job on a real local Ray as a user meets it: a restart loop is RESTARTING with
a folded failure history; failures no restart can fix fail the job at once; wait() runs
out with a TimeoutError naming the job; a cancelled job is CANCELED; what user functions
print reaches the driver, prefixed, before execute() returns; ``rayflow run --example``;
the Ray address check lets a real cluster through."""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import time

import pytest
import ray

from rayflow import (
    FileSource,
    JobFailedError,
    MapFunction,
    NumberSequenceSource,
    RestartStrategies,
    StreamExecutionEnvironment,
)
from rayflow.environment import JobWaitTimeout
from rayflow.runtime.hooks import HookPoint, RuntimeHooks, SubtaskHooks
from rayflow.status import JobState
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink


def _fail_at(value: int, exc: BaseException):
    def check(record: dict) -> dict:
        if record["value"] == value:
            raise exc
        return record

    return check


def _until(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _status(client) -> dict:
    return ray.get(client._master.status.remote())


def test_a_restart_loop_is_restarting_with_one_folded_failure(tmp_path):
    """A user error at the same record in every attempt, checkpoints on, the default
    (unbounded) restart strategy: the job is RESTARTING from the failure until the next
    attempt runs (through the restart delay, the deployment and the restore), and its
    failure history holds one entry whose count grows."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    # attempt 1 restores slowly: 3 s in which the job is restarting, not running
    inject_faults(
        env,
        FaultPlan([Fault(FaultPoint.DURING_STATE_LOAD, 1, "Bad", 0, action="sleep", seconds=3)]),
    )
    (
        env.from_source(
            NumberSequenceSource(0, 10_000, batch_size=20, records_per_second=400), "Numbers"
        )
        .map(_fail_at(200, ValueError("bad record 200")), "Bad")
        .sink_to(CollectSink(), "Out")
    )
    client = env.execute_async("restart-loop")
    try:
        _until(lambda: _status(client)["attempt"] >= 1, what="the first restart")
        time.sleep(0.7)  # deployed by now, restoring for another ~2 s
        states = set()
        for _ in range(8):
            states.add(client.get_job_status())
            time.sleep(0.15)
        assert states == {JobState.RESTARTING}
        _until(lambda: _status(client)["failure_count"] >= 3, what="three failures")
        (entry,) = client.failure_history()
        assert entry.count >= 3 and entry.recoverable
        assert (entry.operator, entry.subtask, entry.exception, entry.message) == (
            "Bad",
            0,
            "ValueError",
            "bad record 200",
        )
        assert entry.time > entry.first_time
    finally:
        assert client.cancel() is True
    assert client.get_job_status() is JobState.CANCELED
    assert client.failure_history()[0].count >= 3  # kept after the run


def _run_to_failure(env, name: str, timeout_s: float = 90.0) -> JobFailedError:
    client = env.execute_async(name)
    try:
        with pytest.raises(JobFailedError) as info:
            client.wait(timeout=timeout_s)
    except BaseException:
        client.cancel()
        raise
    return info.value


def _numbers_job(tmp_path, udf, classifier=None, strategy=None):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    if classifier is not None:
        env.set_failure_classifier(classifier)
    if strategy is not None:
        env.set_restart_strategy(strategy)
    (
        env.from_source(NumberSequenceSource(0, 999, batch_size=50), "Numbers")
        .map(udf, "Write")
        .sink_to(CollectSink(), "Out")
    )
    return env


def test_a_read_only_target_fails_the_job_at_once(tmp_path):
    """With checkpoints and the default unbounded restart strategy, a PermissionError is
    no reason to restart: the job fails at its first failure, saying why."""
    denied = PermissionError(errno.EACCES, "Permission denied", "/data/out/part-0")
    error = _run_to_failure(_numbers_job(tmp_path, _fail_at(300, denied)), "read-only")
    text = str(error)
    assert "failed after 0 restart(s), without another: no restart can fix it" in text
    assert "permission denied" in text and "operator 'Write'" in text
    (entry,) = error.failure_history
    assert entry.count == 1 and not entry.recoverable
    assert error.non_recoverable.startswith("permission denied")


def _values_are_fatal(exc: BaseException):
    return False if isinstance(exc, ValueError) else None


def _permissions_come_back(exc: BaseException):
    return True if isinstance(exc, PermissionError) else None


def test_the_failure_classifier_overrides_the_defaults(tmp_path):
    error = _run_to_failure(
        _numbers_job(tmp_path / "a", _fail_at(300, ValueError("bad")), _values_are_fatal),
        "classified-fatal",
    )
    assert "the job's failure classifier says no restart can fix it" in str(error)
    assert error.failure_history[0].count == 1

    denied = PermissionError(errno.EACCES, "Permission denied")
    error = _run_to_failure(
        _numbers_job(
            tmp_path / "b",
            _fail_at(300, denied),
            _permissions_come_back,
            RestartStrategies.fixed_delay_restart(1, 10),
        ),
        "classified-recoverable",
    )
    assert "failed after 1 restart(s) (restart strategy: fixed delay (1 attempts" in str(error)
    assert error.failure_history[0].count == 2 and error.failure_history[0].recoverable


class _ReadOnlyStorage(SubtaskHooks):
    def at(self, point: HookPoint) -> None:
        if point is HookPoint.DURING_BLOB_WRITE:
            raise OSError(errno.EROFS, "Read-only file system")


class _ReadOnlyCheckpoints(RuntimeHooks):
    """Checkpoint storage that turned read-only: every blob write of every attempt fails."""

    def for_subtask(self, vertex_name: str, index: int, attempt: int) -> SubtaskHooks:
        return _ReadOnlyStorage()


def test_checkpoint_storage_turning_read_only_fails_the_job_at_once(tmp_path):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env._fault_plan = _ReadOnlyCheckpoints()  # what inject_faults sets
    (
        env.from_source(
            NumberSequenceSource(0, 100_000, batch_size=50, records_per_second=2_000), "Numbers"
        ).sink_to(CollectSink(), "Out")
    )
    error = _run_to_failure(env, "read-only-checkpoints")
    assert "no restart can fix it (read-only file system)" in str(error)
    assert "CheckpointFailureLimit" in str(error)


def test_a_missing_input_fails_the_job_at_once_without_preflight(tmp_path):
    """The same verdict when the check before deploy is off (or the file went away
    after it): the job master cannot create the source's splits."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "ckpt"))
    env.set_preflight_checks(False)
    missing = str(tmp_path / "orders.jsonl")
    env.from_source(FileSource(missing, "jsonl"), "Orders").sink_to(CollectSink(), "Out")
    error = _run_to_failure(env, "missing-input")
    assert "no restart can fix it (the input does not exist)" in str(error)
    assert "MissingInputError: FileSource: no such file or directory" in str(error)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_wait_runs_out_naming_the_job_and_cancel_is_canceled(tmp_path, checkpointing):
    env = StreamExecutionEnvironment.get_execution_environment()
    if checkpointing:
        env.enable_checkpointing(100)
        env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.from_source(
        NumberSequenceSource(0, 10**9, batch_size=10, records_per_second=200), "Numbers"
    ).sink_to(CollectSink(), "Out")
    client = env.execute_async("slow-job")
    try:
        with pytest.raises(TimeoutError) as info:
            client.wait(timeout=0.5)
        assert f"job 'slow-job' (job id {client.job_id}) is still" in str(info.value)
        assert "it keeps running" in str(info.value)
        assert isinstance(info.value, ray.exceptions.GetTimeoutError)  # as before
        _until(lambda: client.get_job_status() is JobState.RUNNING, what="RUNNING")
    finally:
        assert client.cancel() is True
    assert client.get_job_status() is JobState.CANCELED
    with pytest.raises(JobFailedError, match="cancelled"):
        client.wait()


def _shout(record: dict) -> dict:
    print(f"saw {record['value']}")
    return record


def _whisper(record: dict) -> dict:
    print(f"kept {record['value']}", end="")  # no newline: flushed at the end anyway
    return record


def test_user_prints_reach_the_driver_prefixed_before_execute_returns(capsys):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    (
        env.from_collection([{"value": v} for v in range(6)], "Values")
        .map(_shout, "Shout")
        .key_by("value")
        .map(_whisper, "Whisper")
        .sink_to(CollectSink(), "Out")
    )
    env.execute("prints")
    out = capsys.readouterr().out.splitlines()
    shouted = sorted(line for line in out if "] saw " in line)
    assert len(shouted) == 6, out
    assert all(line.startswith(("[Shout 1/2] saw ", "[Shout 2/2] saw ")) for line in shouted)
    assert sorted(int(line.rsplit(" ", 1)[1]) for line in shouted) == list(range(6))
    whispered = [line for line in out if line.startswith("[Whisper ")]
    assert len(whispered) == 2  # one unfinished line per subtask that printed
    assert sorted(whispered)[0].startswith("[Whisper 1/2] kept ")


def _shout_then_wait_for(flag_dir: str):
    def shout(record: dict) -> dict:
        print(f"saw {record['value']}")
        if record["value"] == 0:
            (pathlib.Path(flag_dir) / "pid").write_text(str(os.getpid()))
            while not (pathlib.Path(flag_dir) / "go").exists():
                time.sleep(0.05)
        return record

    return shout


def test_prints_survive_a_subtask_too_slow_to_answer_the_drain_in_time(capsys, tmp_path):
    """The subtask's process is stopped right after a user function printed, longer than
    the job master waits for its output: the drain that answers late loses nothing."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    (
        env.from_collection([{"value": v} for v in range(4)], "Values")
        .map(_shout_then_wait_for(str(tmp_path)), "Shout")
        .sink_to(CollectSink(), "Out")
    )
    client = env.execute_async("prints-slow-drain")
    try:
        pid = int(
            _until(
                lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(),
                what="the subtask printed",
            )
        )
        os.kill(pid, signal.SIGSTOP)
        try:
            client.wait(timeout=4.5)  # polls for output meanwhile: every poll times out
        except JobWaitTimeout:
            pass
        finally:
            os.kill(pid, signal.SIGCONT)
        (tmp_path / "go").write_text("")
        client.wait(timeout=120)
    finally:
        (tmp_path / "go").write_text("")
    out = capsys.readouterr().out.splitlines()
    assert sorted(line for line in out if "] saw " in line) == [
        f"[Shout 1/1] saw {v}" for v in range(4)
    ], out


class _LoudClose(MapFunction):
    """Prints each record it sees (slowly, if asked), and an unfinished line when it is
    closed. With ``fail_once``, raises at the first record after that file exists; with
    ``mark``, creates that file at its first record."""

    def __init__(
        self,
        word: str,
        pause_s: float = 0.0,
        fail_once: str | None = None,
        mark: str | None = None,
    ) -> None:
        self.word, self.pause_s, self.fail_once, self.mark = word, pause_s, fail_once, mark

    def map(self, value: dict) -> dict:
        if self.fail_once is not None and os.path.exists(self.fail_once):
            raise ValueError(f"bad record {value['value']}")
        print(f"{self.word} saw {value['value']}")
        if self.mark is not None:
            pathlib.Path(self.mark).touch()
        time.sleep(self.pause_s)
        return value

    def close(self) -> None:
        print(f"{self.word} closing", end="")  # unfinished: still a line of its own


def _saw(out: list[str], prefix: str) -> list[int]:
    return [int(line.rsplit(" ", 1)[1]) for line in out if line.startswith(prefix)]


def test_what_close_prints_reaches_the_driver_of_a_finished_job(capsys):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    (
        env.from_collection([{"value": v} for v in range(3)], "Values")
        .map(_LoudClose("loud"), "Loud")
        .sink_to(CollectSink(), "Out")
    )
    env.execute("prints-close")
    out = capsys.readouterr().out.splitlines()
    assert _saw(out, "[Loud 1/1] loud saw ") == [0, 1, 2], out
    assert "[Loud 1/1] loud closing" in out, out


def test_what_a_cancelled_job_printed_up_to_its_close_reaches_the_driver(capsys, tmp_path):
    """The map keeps printing in its thread after the cancel: every line up to close()
    is printed once, in order, before cancel() returns."""
    mark = tmp_path / "printing"
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    (
        env.from_source(NumberSequenceSource(0, 10**9, batch_size=200), "Numbers")
        .map(_LoudClose("slow", pause_s=0.002, mark=str(mark)), "Slow")
        .sink_to(CollectSink(), "Out")
    )
    client = env.execute_async("prints-cancel")
    try:
        _until(mark.exists, timeout_s=120, what="the map to print")
        time.sleep(1.0)
    finally:
        assert client.cancel() is True
    out = capsys.readouterr().out.splitlines()
    seen = _saw(out, "[Slow 1/1] slow saw ")
    assert seen and seen == list(range(len(seen))), out[:5]
    assert out[-1] == "[Slow 1/1] slow closing", out[-5:]


def test_what_a_healthy_subtask_prints_in_close_reaches_the_driver_of_a_failed_job(
    capsys, tmp_path
):
    """One subtask fails for good (no restart) once another has printed; the other,
    healthy, is stopped by the job master: what it prints while it closes still reaches
    the driver."""
    mark = str(tmp_path / "second-ran")
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.set_restart_strategy(RestartStrategies.no_restart())
    (
        env.from_source(
            NumberSequenceSource(0, 10**6, batch_size=1, records_per_second=100), "Numbers"
        )
        .map(_LoudClose("first", fail_once=mark), "First")
        .key_by("value")
        .map(_LoudClose("second", mark=mark), "Second")
        .sink_to(CollectSink(), "Out")
    )
    with pytest.raises(JobFailedError, match="bad record"):
        env.execute("prints-failed")
    out = capsys.readouterr().out.splitlines()
    assert _saw(out, "[Second 1/1] second saw "), out
    assert "[Second 1/1] second closing" in out, out
    assert "[First 1/1] first closing" in out, out


@ray.remote
class _PrintingMaster:
    """Answers the driver's reads of printed lines from a log of its own."""

    def __init__(self) -> None:
        from rayflow.runtime.output import LineLog

        self.log = LineLog()

    def print_lines(self, lines: list[str]) -> None:
        self.log.extend(lines)

    def drain_output(self, ack):
        return self.log.read(ack)


def test_two_threads_waiting_for_a_job_print_each_line_once_and_in_order():
    """Thread A takes lines 0-9 and is slow to print them; thread B takes 10-19 meanwhile
    and must not print them before A's."""
    import threading

    from rayflow.environment import JobClient
    from rayflow.runtime.output import OutputReader

    master = _PrintingMaster.remote()
    client = JobClient.__new__(JobClient)
    client._master = master
    client._output_read, client._output_lock = OutputReader(), threading.Lock()
    printed: list[str] = []
    taking = threading.Event()

    def write(lines: list[str]) -> None:
        if not printed and lines and lines[0] == "line 0":
            taking.set()
            time.sleep(1.0)
        printed.extend(lines)

    client._write_output = write
    ray.get(master.print_lines.remote([f"line {n}" for n in range(10)]))
    a = threading.Thread(target=client._print_output)
    a.start()
    assert taking.wait(30)
    ray.get(master.print_lines.remote([f"line {n}" for n in range(10, 20)]))
    client._print_output()  # thread B: this one
    a.join(30)
    assert printed == [f"line {n}" for n in range(20)]


def test_rayflow_run_example_prints_the_job_and_its_restart_default(capsys, monkeypatch):
    from rayflow import cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["run", "--example", "wordcount"]) == 0  # joins this session's Ray
    captured = capsys.readouterr()
    assert "the 3" in " ".join(captured.out.split())
    assert "rayflow: job 'wordcount' started: job id " in captured.err
    assert "checkpoints: off" in captured.err
    assert "rayflow: job 'wordcount' FINISHED after" in captured.err


def test_the_address_of_a_running_cluster_passes_the_check():
    from rayflow.ray_connect import check_address

    check_address(ray.get_runtime_context().gcs_address)
