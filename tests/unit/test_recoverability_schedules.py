"""Which failures a restart can fix, at the edges of the default rules: a sink's commit
that can never succeed, and one that ran out of its retries."""

from __future__ import annotations

import errno

from rayflow.recoverability import classify
from rayflow.sink import CommitFailedError, CommitImpossibleError


def test_a_commit_the_sink_answered_failed_is_not_recoverable():
    """Every restart restores the same committable and gets FAILED again."""
    assert classify(CommitImpossibleError("commit of x failed: data lost")) == (
        "the sink says this commit can never succeed"
    )
    assert isinstance(CommitImpossibleError("x"), CommitFailedError)


def test_a_commit_still_retried_out_is_recoverable_whatever_its_cause():
    """RETRY_LATER until the retries ran out: the committable is of a completed checkpoint;
    a restart tries it again (the restart strategy bounds it), also when a PermissionError
    refused it (a policy or credentials being rotated)."""
    for cause in (
        TimeoutError("slow down"),
        PermissionError(errno.EACCES, "Access Denied", "s3://bucket/out/part-0"),
    ):
        error = CommitFailedError("still not possible after 7 tries")
        error.__cause__ = cause
        assert classify(error) is None, cause
    # the same PermissionError from a writer (the directory is read-only) is not
    assert classify(PermissionError(errno.EACCES, "Permission denied")) is not None


def test_the_classifier_may_still_say_otherwise():
    assert classify(CommitImpossibleError("x"), lambda exc: True) is None


def _permissions_come_back(exc: BaseException):
    return True if isinstance(exc, PermissionError) else None


def test_the_job_classifier_sees_the_cause_the_default_rules_see():
    """A job's classifier says a PermissionError is recoverable (its storage's credentials
    are rotated now and then). The same PermissionError arrives wrapped: a checkpoint's
    metadata write that failed (CheckpointFailureLimit from it), or a FileSource's
    ValueError raised from it. Before: the classifier was asked about the wrapper only,
    said nothing, and the default rules, which look down the chain, failed the job at
    once: the job's own verdict on that error did not count."""
    from rayflow.checkpoint.failures import CheckpointFailureLimit

    denied = PermissionError(errno.EACCES, "Permission denied", "/ckpt/chk-7/_metadata")
    limit = CheckpointFailureLimit("checkpoint 7 failed (metadata write failed)")
    limit.__cause__ = denied
    assert classify(limit, _permissions_come_back) is None
    assert classify(limit) is not None  # without the classifier: not recoverable
    try:
        try:
            raise denied
        except PermissionError as inner:
            raise ValueError("FileSource: cannot read '/in/a.jsonl' as jsonl") from inner
    except ValueError as wrapped:
        assert classify(wrapped, _permissions_come_back) is None
    # the verdict nearest the top wins: a wrapper the classifier rules on decides
    outer = RuntimeError("give up")
    outer.__cause__ = denied
    assert classify(outer, lambda e: False if isinstance(e, RuntimeError) else None) == (
        "the job's failure classifier says no restart can fix it"
    )
