"""Running a job as a user meets it, without Ray: checks before deploy, a Ray address
where nothing answers, bad command-line values, ``rayflow checkpoints``, what user
functions print, and the progress line."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import time

import pytest

from rayflow import (
    FileSource,
    NumberSequenceSource,
    RestartStrategies,
    StreamExecutionEnvironment,
    cli,
)
from rayflow.checkpoint.metadata import CheckpointMetadata, SubtaskStateMeta
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.failures import Failure, FailureEntry
from rayflow.preflight import PreflightError
from rayflow.progress import ProgressReporter
from rayflow.ray_connect import NoRayClusterError, check_address
from rayflow.runtime.output import CapturedOutput, LineLog, OutputCollector, OutputReader
from rayflow.status import FailureKind
from sinks.basic import CollectSink
from sinks.files import FileSink
from tests.s3_server import s3_bucket, s3_server  # noqa: F401 - fixtures


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything tries to start or join Ray."""

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started: the check must come before")

    monkeypatch.setattr("rayflow.environment.ensure_ray", refuse)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


# --- checks before deploy ---------------------------------------------------------------


def _file_job(tmp_path, source_path: str, sink) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_source(FileSource(source_path, "jsonl"), "Orders").sink_to(sink, "Out")
    return env


def test_missing_source_file_fails_before_ray_starts(tmp_path, no_ray):
    env = _file_job(tmp_path, str(tmp_path / "nope.jsonl"), CollectSink())
    with pytest.raises(PreflightError) as info:
        env.execute("missing-input")
    text = str(info.value)
    assert "FileSource 'Orders': no such file or directory" in text and "nope.jsonl" in text
    assert "'missing-input' cannot start" in text


def test_unwritable_sink_dir_and_checkpoint_storage_fail_before_ray_starts(tmp_path, no_ray):
    (tmp_path / "in.jsonl").write_text('{"a": 1}\n')
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = _file_job(tmp_path, str(tmp_path / "in.jsonl"), FileSink(str(blocker / "out")))
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(blocker / "checkpoints"))
    with pytest.raises(PreflightError) as info:
        env.execute("unwritable")
    problems = info.value.problems
    assert len(problems) == 2, problems
    assert problems[0].startswith("sink 'Out' (FileSink): cannot write to ")
    assert problems[1].startswith(f"checkpoint storage {str(blocker / 'checkpoints')!r}")
    assert all("NotADirectoryError" in p or "FileExistsError" in p for p in problems)


def test_a_readonly_path_is_named_as_such(tmp_path, no_ray):
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("needs a read-only path (/sys)")
    (tmp_path / "in.jsonl").write_text('{"a": 1}\n')
    env = _file_job(tmp_path, str(tmp_path / "in.jsonl"), FileSink("/sys/kernel/rayflow-out"))
    with pytest.raises(PreflightError, match=r"permission denied|read-only"):
        env.execute("readonly")


def test_missing_bucket_fails_before_ray_starts(s3_server, no_ray):  # noqa: F811
    from sinks.s3 import S3FileSink

    env = StreamExecutionEnvironment.get_execution_environment()
    sink = S3FileSink("no-such-bucket-here", "out", **s3_server.sink_options())
    env.from_source(NumberSequenceSource(0, 9), "Numbers").sink_to(sink, "ToS3")
    env.enable_checkpointing(100)
    with pytest.raises(PreflightError) as info:
        env.execute("no-bucket")
    (problem,) = info.value.problems
    assert "sink 'ToS3' (S3FileSink): cannot use s3://no-such-bucket-here/" in problem
    assert "bucket does not exist (NoSuchBucket)" in problem


def test_rejected_credentials_fail_before_ray_starts(monkeypatch, no_ray):
    from botocore.exceptions import ClientError

    from sinks.s3 import S3FileSink

    class Rejecting:
        def list_objects_v2(self, **kwargs):
            raise ClientError(
                {"Error": {"Code": "InvalidAccessKeyId", "Message": "not in our records"}},
                "ListObjectsV2",
            )

    class Session:
        def client(self, *args, **kwargs):
            return Rejecting()

    monkeypatch.setattr("boto3.session.Session", Session)
    env = StreamExecutionEnvironment.get_execution_environment().enable_checkpointing(100)
    env.from_source(NumberSequenceSource(0, 9), "Numbers").sink_to(
        S3FileSink("bucket", endpoint_url="http://127.0.0.1:1"), "ToS3"
    )
    with pytest.raises(PreflightError, match=r"rejected the credentials \(InvalidAccessKeyId\)"):
        env.execute("bad-credentials")


def test_an_unreachable_endpoint_is_no_verdict(monkeypatch, tmp_path):
    """Only definite answers stop a job: an S3 endpoint that does not answer (yet) may
    answer its subtasks; the job starts as it would have without the check."""
    from rayflow import preflight
    from sinks.s3 import S3FileSink

    env = StreamExecutionEnvironment.get_execution_environment().enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    sink = S3FileSink(
        "bucket",
        endpoint_url=f"http://127.0.0.1:{_closed_port()}",
        aws_access_key_id="a",
        aws_secret_access_key="b",
        region_name="us-east-1",
    )
    env.from_source(NumberSequenceSource(0, 9), "Numbers").sink_to(sink, "ToS3")
    graph = env.get_job_graph()
    preflight.check_job("unreachable", graph, env.get_checkpoint_config())  # no error


def test_preflight_checks_can_be_turned_off(tmp_path, monkeypatch):
    env = _file_job(tmp_path, str(tmp_path / "nope.jsonl"), CollectSink())
    env.set_preflight_checks(False)
    started = []
    monkeypatch.setattr("rayflow.environment.ensure_ray", lambda: started.append(1) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        env.execute("unchecked")
    assert started == [1]


# --- where Ray is ------------------------------------------------------------------------


def test_an_address_where_nothing_answers_fails_within_seconds(no_ray):
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(NoRayClusterError, match=f"no Ray cluster at {address}"):
        check_address(address)
    with pytest.raises(NoRayClusterError, match="no Ray cluster at ray://"):
        check_address(f"ray://{address}")
    assert time.monotonic() - started < 10
    check_address("local")  # nothing to probe
    assert issubclass(NoRayClusterError, ConnectionError)


def test_ensure_ray_probes_before_ray_init(monkeypatch):
    import ray

    from rayflow.environment import ensure_ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init must not be reached"))
    with pytest.raises(NoRayClusterError):
        ensure_ray(f"127.0.0.1:{_closed_port()}")


def test_rayflow_run_with_a_dead_address_fails_fast(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    assert cli.main(["run", "--address", address, "--example", "wordcount"]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"rayflow run: error: no Ray cluster at {address}" in err
    assert "RAY_ADDRESS" not in os.environ


def test_the_local_ray_is_quiet_about_token_auth():
    import logging

    from rayflow.ray_connect import quiet_local_start

    quiet_local_start()
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    record = logger.makeRecord(
        logger.name,
        logging.WARNING,
        __file__,
        1,
        "Token authentication is enabled for ...",
        (),
        None,
    )
    assert not logger.filter(record)
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "other", (), None)
    assert logger.filter(other)


# --- command-line values -----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--checkpoint-ms", "-5"],
            "--checkpoint-ms: must be >= 10 (ms) or 0 for checkpointing off",
        ),
        (["--checkpoint-ms", "5"], "must be >= 10"),
        (["--checkpoint-ms", "soon"], "not an integer: 'soon'"),
        (["--orders", "0"], "--orders: must be >= 1"),
        (["--parallelism", "-1"], "--parallelism: must be >= 1"),
    ],
)
def test_orders_job_values_are_argparse_errors(argv, words, capsys, no_ray):
    from rayflow.jobs import orders

    with pytest.raises(SystemExit) as exc:
        orders.main(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--checkpoint-ms", "5"], "--checkpoint-ms: must be >= 10"),
        (["demo", "--records", "-3"], "--records/--orders: must be >= 1"),
        (["bench", "alignment", "--rows", "0"], "--rows: must be >= 1"),
        (["bench", "alignment", "--hot-cost-us", "-1"], "--hot-cost-us: must be >= 0"),
        (["bench", "alignment", "--debloat-target-ms", "5"], "must be >= 10"),
        (["run", "--example", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_cli_values_are_argparse_errors(argv, words, capsys, no_ray):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_run_finds_the_installed_examples(monkeypatch, capsys, tmp_path):
    from rayflow import examples

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert {"wordcount", "orders"} <= set(examples.names())
    assert os.path.isfile(examples.path_of("wordcount"))
    ran = []
    monkeypatch.setattr(
        "runpy.run_path", lambda path, run_name: ran.append((path, run_name, list(os.sys.argv)))
    )
    assert cli.main(["run", "--example", "orders", "--orders", "500"]) == 0
    path, run_name, argv = ran[0]
    assert path == examples.path_of("orders") and run_name == "__main__"
    assert argv[1:] == ["--orders", "500"]
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "examples/wordcount.py"]) == 2
    assert "rayflow run --example wordcount" in capsys.readouterr().err


# --- rayflow checkpoints -----------------------------------------------------------------


def _write_checkpoint(root: str, job: str, run_id: str, cid: int, names: bool = True) -> None:
    import pickle

    storage = CheckpointStorage(root, job, run_id=run_id)
    blob = pickle.dumps({"map-1": {"k": 1}, "sum-2": {"x": list(range(50))}})
    path = storage.write_blob(cid, "a0-v0-s0.state", blob)
    meta = CheckpointMetadata(
        checkpoint_id=cid,
        job_name=job,
        run_id=run_id,
        attempt=0,
        trigger_time=1.0,
        completed_at=1_700_000_000.0,
        final=False,
        subtasks={
            (0, 0): SubtaskStateMeta(
                path, len(blob), ("map-1", "sum-2", "source-0"), 1, "Numbers -> Parse -> Totals"
            )
        },
        source_splits={"source-0": []},
        operator_names={"source-0": "Numbers", "map-1": "Parse", "sum-2": "Totals"}
        if names
        else {},
    )
    storage.commit_metadata(cid, meta)


@pytest.mark.parametrize("recorded", [True, False])
def test_checkpoints_show_operator_names(tmp_path, capsys, recorded):
    _write_checkpoint(str(tmp_path), "nightly", "run-20260101T000000-0000aaaa", 3, recorded)
    assert cli.main(["checkpoints", str(tmp_path / "nightly")]) == 0
    out = capsys.readouterr().out
    for name in ("Numbers", "Parse", "Totals"):
        assert f"        {name} " in out
    assert "map-1" not in out and "sum-2" not in out


def test_checkpoints_of_the_storage_root_lists_its_jobs(tmp_path, capsys):
    _write_checkpoint(str(tmp_path), "nightly", "run-20260101T000000-0000aaaa", 3)
    _write_checkpoint(str(tmp_path), "hourly", "run-20260101T000000-0000bbbb", 7)
    (tmp_path / "unrelated").mkdir()
    assert cli.main(["checkpoints", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "is a checkpoint storage root" in out
    assert "nightly" in out and "hourly" in out and "unrelated" not in out
    assert "newest checkpoint 7" in out
    assert f"rayflow checkpoints {tmp_path}/<job>" in out


def test_checkpoints_of_a_missing_path_says_so(tmp_path, capsys):
    assert cli.main(["checkpoints", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such directory" in capsys.readouterr().err


def test_checkpoints_on_s3_with_endpoint_and_credentials_from_the_environment(
    s3_server,  # noqa: F811
    s3_bucket,  # noqa: F811
    monkeypatch,
    capsys,
    tmp_path,
):
    _write_checkpoint(str(tmp_path), "nightly", "run-20260101T000000-0000aaaa", 3)
    client = s3_server.client()
    for dirpath, _, files in os.walk(tmp_path):
        for name in files:
            full = os.path.join(dirpath, name)
            key = "ckpt/" + os.path.relpath(full, tmp_path)
            data = open(full, "rb").read()
            if name == "_metadata":  # the blob's path inside it points at S3 now
                meta = CheckpointMetadata.from_bytes(data)
                entry = meta.subtasks[(0, 0)]
                moved = f"{s3_bucket}/ckpt/" + os.path.relpath(entry.path, tmp_path)
                meta = CheckpointMetadata(
                    **{
                        **meta.__dict__,
                        "subtasks": {
                            (0, 0): SubtaskStateMeta(moved, entry.size, entry.uids, 1, entry.vertex)
                        },
                    }
                )
                data = meta.to_bytes()
            client.put_object(Bucket=s3_bucket, Key=key, Body=data)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.credentials["aws_secret_access_key"])
    argv = ["checkpoints", f"s3://{s3_bucket}/ckpt/nightly"]
    argv += ["--endpoint-url", s3_server.endpoint_url, "--region", "us-east-1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "checkpoints of job 'nightly'" in out and "Parse" in out
    assert cli.main(["checkpoints", str(tmp_path), "--region", "x"]) == 2  # s3 only


# --- what user functions print ---------------------------------------------------------


def _read(out: CapturedOutput, reader: OutputReader, final: bool = False) -> list[str]:
    return reader.take("subtask", out.read(reader.ack("subtask"), final=final))


def test_captured_output_prefixes_lines_and_passes_ray_markers():
    real = io.StringIO()
    where = {"op": "Parse"}
    out = CapturedOutput(lambda: f"[{where['op']} 2/4] ", real, max_lines=3)
    reader = OutputReader()
    print("hello", "world", file=out)
    out.write("part")
    where["op"] = "Totals"
    out.write("ial\n")
    print(":actor_name:SubtaskActor", file=out)
    assert _read(out, reader) == ["[Parse 2/4] hello world", "[Parse 2/4] partial"]  # who began it
    assert real.getvalue() == ":actor_name:SubtaskActor\n"
    for n in range(5):
        print(n, file=out)
    out.write("unfinished")
    assert _read(out, reader) == [
        "[Totals 2/4] (2 lines of output dropped)",
        *(f"[Totals 2/4] {n}" for n in (2, 3, 4)),
    ]
    assert _read(out, reader, final=True) == ["[Totals 2/4] unfinished"]
    assert _read(out, reader, final=True) == []


def test_a_read_whose_reply_is_lost_loses_no_line_and_none_is_taken_twice():
    log = LineLog()
    reader = OutputReader()
    assert reader.take("s", log.read(reader.ack("s"))) == []  # nothing printed yet
    log.extend(["a", "b"])
    log.read(reader.ack("s"))  # the reply never reaches the reader (it gave up waiting)
    log.append("c")
    first = log.read(reader.ack("s"))
    second = log.read(reader.ack("s"))  # a second read at once, before the first answers
    assert reader.take("s", second) == ["a", "b", "c"]
    assert reader.take("s", first) == []  # the late one repeats nothing
    log.append("d")
    assert reader.take("s", log.read(reader.ack("s"))) == ["d"]
    assert log.read(reader.ack("s")).lines == ()  # acknowledged lines are forgotten


def test_a_reader_starts_over_on_a_new_log_of_the_same_writer():
    reader = OutputReader()
    old, new = LineLog(), LineLog()
    old.extend(["1", "2", "3"])
    assert reader.take("master", old.read(reader.ack("master"))) == ["1", "2", "3"]
    new.append("x")  # e.g. a job master started anew: its acknowledgement is not this log's
    assert reader.take("master", new.read(reader.ack("master"))) == ["x"]
    assert len(old.read(reader.ack("master")).lines) == 3  # another log's ack: nothing dropped


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class _SlowSubtask:
    """A subtask whose reads of its output answer only when the test says so."""

    def __init__(self, log: LineLog) -> None:
        self.log = log
        self.asked: list[asyncio.Future] = []
        self.drain_output = self

    def remote(self, ack, final=False):
        answer = asyncio.get_running_loop().create_future()
        self.asked.append(answer)
        return self._answer(answer, ack)

    async def _answer(self, answer: asyncio.Future, ack):
        await answer
        return self.log.read(ack)


def test_a_collector_takes_a_read_that_answers_after_it_stopped_waiting():
    async def scenario():
        log = LineLog()
        subtask = _SlowSubtask(log)
        collector = OutputCollector()
        log.extend(["[A 1/1] one", "[A 1/1] two"])
        await collector.read([("a", subtask)], timeout_s=0.01)  # no answer in time
        await collector.read([("a", subtask)], timeout_s=0.01)
        assert len(subtask.asked) == 1  # one read in flight: no second one piled up
        subtask.asked[0].set_result(None)
        await _turns()
        assert collector.log.read().lines == ("[A 1/1] one", "[A 1/1] two")
        log.append("[A 1/1] three")
        reading = asyncio.ensure_future(collector.read([("a", subtask)], timeout_s=5))
        await _turns()
        subtask.asked[1].set_result(None)
        await reading
        assert collector.log.read().lines[-1] == "[A 1/1] three"
        assert log.read().lines == ("[A 1/1] three",)  # the first two acknowledged
        collector.keep("a", log.read())  # the run's last chunk repeats what was read
        assert collector.log.read().lines.count("[A 1/1] three") == 1  # not taken twice

    asyncio.run(scenario())


def test_a_collector_reads_a_replaced_subtask_at_once():
    async def scenario():
        old, new = _SlowSubtask(LineLog()), _SlowSubtask(LineLog())
        collector = OutputCollector()
        await collector.read([("a", old)], timeout_s=0.01)
        new.log.append("[A 1/1] from the new process")
        reading = asyncio.ensure_future(collector.read([("a", new)], timeout_s=5))
        await _turns()
        assert len(new.asked) == 1  # not held back by the old process's read
        new.asked[0].set_result(None)
        await reading
        assert collector.log.read().lines == ("[A 1/1] from the new process",)

    asyncio.run(scenario())


class _ServedEarly:
    """A subtask that answers a read at once, with the reply delivered only when the
    test says so."""

    def __init__(self, log: LineLog) -> None:
        self.log, self.replies = log, []
        self.drain_output = self

    def remote(self, ack, final=False):
        chunk = self.log.read(ack)
        gate = asyncio.get_running_loop().create_future()
        self.replies.append(gate)

        async def reply():
            await gate
            return chunk

        return reply()


def test_the_last_read_before_a_kill_is_fresh_not_one_answered_before_the_last_print():
    async def scenario():
        log = LineLog()
        subtask, collector = _ServedEarly(log), OutputCollector()
        log.append("[Sink 1/1] writing")
        await collector.read([("k", subtask)], timeout_s=0.0)  # answered, not delivered
        log.append("[Sink 1/1] aborted a transaction")  # printed while it is cancelled
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: [r.set_result(None) for r in subtask.replies if not r.done()])
        await collector.last_read([("k", subtask)], timeout_s=1.0)
        return collector.log.read().lines

    assert asyncio.run(scenario()) == ("[Sink 1/1] writing", "[Sink 1/1] aborted a transaction")


def test_a_reader_of_ever_new_logs_stays_bounded():
    reader = OutputReader()
    for n in range(OutputReader.MAX_LOGS + 10):
        log = LineLog()  # a subtask replaced again and again
        log.append(f"line {n}")
        assert reader.take("a", log.read(reader.ack("a"))) == [f"line {n}"]
    assert len(reader._taken) == OutputReader.MAX_LOGS + 1  # those retired, and the live one


def test_a_reader_never_forgets_a_log_still_read(monkeypatch):
    """More live subtasks than logs remembered: each line is still taken once."""
    monkeypatch.setattr(OutputReader, "MAX_LOGS", 2)
    reader = OutputReader()
    logs = {who: LineLog() for who in "abc"}
    taken: list[str] = []
    for n in range(3):
        for who, log in logs.items():
            log.append(f"{who}{n}")
            taken += reader.take(who, log.read(reader.ack(who)))
            assert reader.ack(who) is not None
    assert taken == [f"{who}{n}" for n in range(3) for who in "abc"]


# --- the progress line -------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Client:
    job_name = "orders"
    job_id = "abc123"
    run_id = "run-20260101T000000-0000aaaa"

    def __init__(self, env: StreamExecutionEnvironment, snapshots: list[dict]) -> None:
        from rayflow.runtime.settings import JobSettings

        self._graph = env.get_job_graph()
        config = env.get_checkpoint_config()
        self._settings = JobSettings(
            "orders",
            run_id=self.run_id,
            checkpoint_config=config,
            restart_strategy=env._restart_strategy,
        )
        self._snapshots = snapshots

    def _progress_snapshot(self):
        return self._snapshots.pop(0)


def _env() -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_source(NumberSequenceSource(0, 9), "Numbers").key_by("value").sum("value").sink_to(
        CollectSink(), "Totals"
    )
    return env


def _metrics(records: int, buffered: int = 0) -> list[dict]:
    return [
        {"vertex": "Numbers", "attempt": 0, "records_out": records, "records_in": records},
        {
            "vertex": "Sum -> Totals",
            "attempt": 0,
            "records_in": records,
            "records_out": 0,
            "buffered": buffered,
            "input_capacity": 8,
        },
    ]


def test_start_lines_name_the_job_its_checkpoints_and_the_restart_default(tmp_path):
    env = _env().enable_checkpointing(500)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    err = io.StringIO()
    ProgressReporter(err=err, out=io.StringIO()).job_started(_Client(env, []))
    text = err.getvalue()
    assert "job 'orders' started: job id abc123, run-20260101T000000-0000aaaa" in text
    assert f"checkpoints: every 500 ms to {tmp_path}/orders/run-20260101T000000-0000aaaa" in text
    assert "fixed delay (unlimited attempts, 1 s apart), Flink's default" in text
    assert "RestartStrategies.fixed_delay_restart(3, 10_000)" in text
    bounded = _env().set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 100))
    err = io.StringIO()
    ProgressReporter(err=err, out=io.StringIO()).job_started(_Client(bounded, []))
    assert "checkpoints: off" in err.getvalue() and "fixed delay (3 attempts" in err.getvalue()


def test_live_line_shows_rates_backpressure_checkpoint_and_restarts(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the line is cut to the terminal's width
    failure = Failure(FailureKind.ATTEMPT, "ValueError", "bad record 5", "Sum", 0, 1)
    snapshots = [
        {"state": "RUNNING", "metrics": _metrics(1_000), "restarts": 0},
        {
            "state": "RESTARTING",
            "metrics": _metrics(3_000, buffered=7),
            "restarts": 2,
            "last_checkpoint": {
                "checkpoint_id": 4,
                "trigger_time": time.time() - 3,
                "duration_s": 1.0,
            },
            "failure_history": [FailureEntry(failure, 2, 1.0, 2.0)],
        },
    ]
    err, out = _Tty(), _Tty()
    reporter = ProgressReporter(err=err, out=out, interval_s=0.0)
    client = _Client(_env(), snapshots)
    reporter.tick(client)
    time.sleep(0.05)
    reporter.tick(client)
    line = err.getvalue().rsplit("\r", 1)[-1]
    assert line.startswith("RESTARTING ")
    assert "Numbers " in line and " rec/s" in line
    assert "Sum -> Totals" in line and "(inputs 88% full)" in line
    assert "checkpoint 4 (2s ago)" in line
    assert (
        "restarts 2, last failure: operator 'Sum' (subtask 1/1): ValueError: bad record 5" in line
    )
    reporter.write_output(["[Sum 1/1] hello"])  # printed above the live line
    assert out.getvalue() == "[Sum 1/1] hello\n"


def test_no_live_line_when_not_a_terminal():
    err = io.StringIO()
    reporter = ProgressReporter(err=err, out=io.StringIO(), interval_s=0.0)
    assert not reporter.live
    reporter.tick(_Client(_env(), []))  # never asks for a snapshot
    assert err.getvalue() == ""
