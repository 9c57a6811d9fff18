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
