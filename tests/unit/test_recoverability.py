"""Which failures a restart can fix (rayflow.recoverability), the folded failure history
(rayflow.failures) and what the restart supervisor does with both; no Ray."""

from __future__ import annotations

import errno
import math
import pickle

import pytest

from rayflow.config import RestartStrategies
from rayflow.failures import Failure, FailureHistory, worth_logging
from rayflow.recoverability import (
    MissingInputError,
    NonRecoverableError,
    classify,
    default_reason,
)
from rayflow.runtime.supervisor import RestartSupervisor
from rayflow.status import FailureKind, JobState


class _ClientError(Exception):
    """Shaped like botocore's ClientError: the code is in ``response``."""

    def __init__(self, code: str) -> None:
        super().__init__(f"An error occurred ({code}) when calling the PutObject operation")
        self.response = {"Error": {"Code": code, "Message": "..."}}


class NoCredentialsError(Exception):
    """Named like botocore's."""


@pytest.mark.parametrize(
    "exc, words",
    [
        (PermissionError(errno.EACCES, "Permission denied", "/out"), "permission denied"),
        (OSError(errno.EROFS, "Read-only file system"), "read-only"),
        (OSError(errno.EPERM, "Operation not permitted"), "permission denied"),
        (MissingInputError("FileSource: no such file or directory: '/in.csv'"), "input does not"),
        (_ClientError("NoSuchBucket"), "bucket does not exist (NoSuchBucket)"),
        (_ClientError("AccessDenied"), "denied access (AccessDenied)"),
        (_ClientError("InvalidAccessKeyId"), "rejected the credentials (InvalidAccessKeyId)"),
        (_ClientError("SignatureDoesNotMatch"), "rejected the credentials"),
        (NoCredentialsError("Unable to locate credentials"), "no S3 credentials"),
        (
            OSError(
                "When initiating multiple part upload for key 'a' in bucket 'b': AWS Error "
                "NO_SUCH_BUCKET during CreateMultipartUpload operation: The specified bucket"
            ),
            "NoSuchBucket",
        ),
        (OSError("AWS Error ACCESS_DENIED during PutObject operation"), "AccessDenied"),
        (OSError("Bucket 'nope' not found. To create buckets, enable ..."), "NoSuchBucket"),
        (NonRecoverableError("the schema registry says no"), "the schema registry says no"),
    ],
)
def test_default_rules_name_what_no_restart_can_fix(exc, words):
    reason = default_reason(exc)
    assert reason is not None and words in reason


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad record 5"),
        KeyError("amount"),
        ZeroDivisionError("division by zero"),
        ConnectionError("lost a downstream subtask"),
        TimeoutError("checkpoint timed out"),
        OSError(errno.ENOSPC, "No space left on device"),
        # a directory deleted under a running job: the next attempt makes it again
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/ckpt/run-1/_job_state"),
        OSError("AWS Error NETWORK_CONNECTION during GetObject operation"),
        _ClientError("SlowDown"),
        _ClientError("ExpiredToken"),  # a restart makes a new client: it may refresh
        _ClientError("404"),
    ],
)
def test_everything_else_is_recoverable(exc):
    assert default_reason(exc) is None
    assert classify(exc) is None


def test_a_cause_deep_in_the_chain_counts():
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "/data/out")
        except PermissionError as inner:
            raise ValueError("FileSink: cannot write part file") from inner
    except ValueError as outer:
        assert "permission denied" in default_reason(outer)
    try:
        try:
            raise PermissionError("read-only")
        except PermissionError:
            raise RuntimeError("while writing") from None  # suppressed: not the cause
    except RuntimeError as outer:
        assert default_reason(outer) is None


def test_a_user_classifier_overrides_and_none_falls_back():
    def mine(exc):
        if isinstance(exc, ValueError):
            return False  # never fixed by a restart
        if isinstance(exc, PermissionError):
            return True  # our mounts come back
        return None

    assert "failure classifier" in classify(ValueError("bad"), mine)
    assert classify(PermissionError("ro"), mine) is None
    assert "input does not exist" in classify(MissingInputError("x"), mine)  # the defaults
    assert classify(KeyError("k"), mine) is None


def test_a_classifier_that_raises_counts_as_no_verdict():
    def broken(exc):
        raise RuntimeError("oops")

    assert classify(KeyError("k"), broken) is None
    assert classify(PermissionError("ro"), broken) is not None


def test_non_recoverable_error_is_public():
    import rayflow

    assert rayflow.NonRecoverableError is NonRecoverableError
    assert issubclass(NonRecoverableError, RuntimeError)
    # code that caught FileNotFoundError from a FileSource still does
    assert issubclass(MissingInputError, FileNotFoundError)
    assert issubclass(MissingInputError, NonRecoverableError)


# --- the folded history ---------------------------------------------------------------


def _bad(n: int = 500, subtask: int = 0) -> Failure:
    return Failure(FailureKind.ATTEMPT, "ValueError", f"bad record {n}", "Parse", subtask, 2)


def test_the_same_failure_folds_into_one_entry_with_a_count():
    history = FailureHistory()
    for t in range(49):
        history.add(_bad(), float(t))
    history.add(_bad(subtask=1), 50.0)  # another subtask: another entry
    history.add(_bad(), 51.0)
    entries = history.entries
    assert [e.count for e in entries] == [1, 50]  # most recent last
    entry = entries[-1]
    assert (entry.operator, entry.subtask, entry.exception, entry.message) == (
        "Parse",
        0,
        "ValueError",
        "bad record 500",
    )
    assert (entry.first_time, entry.time) == (0.0, 51.0)
    assert (
        entry.describe() == "operator 'Parse' (subtask 1/2): ValueError: bad record 500 (50 times)"
    )
    assert history.total == 51


def test_the_history_is_bounded_and_pickles():
    history = FailureHistory()
    for n in range(100):
        history.add(_bad(n), float(n))
    assert len(history.entries) == 20 and history.total == 100
    assert history.entries[-1].message == "bad record 99"
    assert pickle.loads(pickle.dumps(history)) == history


def test_repeats_are_logged_at_1_2_4_8_and_so_on():
    assert [n for n in range(1, 70) if worth_logging(n)] == [1, 2, 4, 8, 16, 32, 64]


def test_failure_of_text_keeps_type_and_message():
    f = Failure.of_text(FailureKind.RESTART_SETUP, "OSError: disk gone\n  traceback...")
    assert (f.exception, f.message) == ("OSError", "disk gone")
    assert Failure.of_text(FailureKind.ATTEMPT, "subtask 1/2 of 'x' died").exception == ""


# --- the supervisor -------------------------------------------------------------------


def _unbounded() -> RestartSupervisor:
    """Flink's default with checkpoints: fixed delay, unlimited attempts."""
    return RestartSupervisor.new("run-x", RestartStrategies.fixed_delay_restart(math.inf, 1000))


def test_a_job_restarting_stays_restarting_until_its_next_attempt_runs():
    sup = _unbounded()
    sup.start_attempt()
    sup.attempt_running()
    assert sup.job_state is JobState.RUNNING
    assert sup.on_failure("ValueError: bad", FailureKind.ATTEMPT, when=1.0) == 1.0
    assert sup.job_state is JobState.RESTARTING
    assert sup.start_attempt() == 1
    assert sup.job_state is JobState.RESTARTING  # deploying and restoring: still restarting
    assert sup.on_failure("ValueError: bad", FailureKind.ATTEMPT, when=2.0) == 1.0
    sup.start_attempt()
    sup.attempt_running()  # every subtask of attempt 2 runs
    assert sup.job_state is JobState.RUNNING
    sup.cancel()
    sup.attempt_running()  # late: a cancel is never undone
    assert sup.job_state is JobState.CANCELLING


def test_a_non_recoverable_failure_fails_at_once_whatever_the_strategy():
    sup = _unbounded()
    sup.start_attempt()
    failure = Failure(
        FailureKind.ATTEMPT,
        "PermissionError",
        "[Errno 13] Permission denied: '/out'",
        "Out",
        0,
        1,
        non_recoverable="permission denied (a read-only or protected path)",
    )
    assert sup.on_failure("PermissionError: ...", FailureKind.ATTEMPT, 1.0, failure) is None
    assert sup.job_state is JobState.FAILING
    assert sup.state.restarts == 0
    msg = sup.failure_message("nightly")
    assert "no restart can fix it" in msg and "permission denied" in msg
    assert sup.state.history.entries[-1].recoverable is False


def test_supervisor_folds_its_failures():
    sup = _unbounded()
    sup.start_attempt()
    for t in range(5):
        sup.on_failure("operator 'Parse' ...", FailureKind.ATTEMPT, float(t), _bad())
        sup.start_attempt()
    (entry,) = sup.state.history.entries
    assert entry.count == 5 and sup.state.failure_count == 5
    snap = pickle.loads(pickle.dumps(sup.snapshot()))
    assert snap.history.entries[0].count == 5


def test_a_restart_loop_logs_its_traceback_once_then_a_line_at_2_4_8():
    """49 restarts at the same record: one full failure (with its traceback), then one line
    each at the 2nd, 4th, 8th, 16th and 32nd time; the rest at DEBUG."""
    import logging

    from rayflow.runtime.job_master import failure_log

    sup = _unbounded()
    sup.start_attempt()
    cause = "operator 'Parse' (subtask 1/2) failed: ValueError: bad record 500\n--- tb ---\n..."
    lines = []
    for attempt in range(49):
        delay = sup.on_failure(cause, FailureKind.ATTEMPT, float(attempt), _bad())
        lines.append(failure_log("loop", attempt, cause, delay, sup.state))
        sup.start_attempt()
    shown = [text for level, text in lines if level >= logging.WARNING]
    assert len(shown) == 6
    assert sum("--- tb ---" in text for _, text in lines) == 1  # the traceback once
    assert "failed again the same way (32 times so far)" in shown[-1]
    assert "ValueError: bad record 500" in shown[-1] and "restarting in 1 s" in shown[-1]


def test_a_job_master_taking_over_a_failing_run_keeps_the_reason():
    """The job master dies after it classified a failure as not recoverable and recorded
    FAILING: the client's takeover only cleans up, and fails with the same reason."""
    sup = _unbounded()
    sup.start_attempt()
    failure = Failure(FailureKind.ATTEMPT, "PermissionError", "denied", "Out", 0, 1, "read-only")
    assert sup.on_failure("PermissionError: denied", FailureKind.ATTEMPT, 1.0, failure) is None
    # what JobClient._restart_master reads back from the run's storage
    taken_over = RestartSupervisor(pickle.loads(pickle.dumps(sup.snapshot())))
    assert taken_over.job_state is JobState.FAILING  # so it only cleans up
    message = taken_over.failure_message("job")
    assert "no restart can fix it (read-only)" in message
    assert "cause: PermissionError: denied" in message
    taken_over.begin_clean_up()
    assert taken_over.state.restarts == 0
    assert taken_over.state.history.entries[0].exception == "PermissionError"


def test_a_classifier_that_cannot_be_pickled_is_refused_where_it_is_set():
    import threading

    from rayflow import StreamExecutionEnvironment

    lock = threading.Lock()

    def holds_a_lock(exc):
        with lock:
            return None

    env = StreamExecutionEnvironment.get_execution_environment()
    with pytest.raises(TypeError, match="cannot be pickled"):
        env.set_failure_classifier(holds_a_lock)
    with pytest.raises(TypeError, match="expected a function"):
        env.set_failure_classifier("PermissionError")
    env.set_failure_classifier(lambda exc: None)  # a lambda pickles (by value)
