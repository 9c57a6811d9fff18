"""Which failures a restart can fix, at the edges of the default rules: a sink's commit
that can never succeed, and errors raised while another was being handled."""

from __future__ import annotations


from rayflow.recoverability import classify
from rayflow.sink import CommitFailedError, CommitImpossibleError


def test_a_commit_the_sink_answered_failed_is_not_recoverable():
    """Every restart restores the same committable and gets FAILED again."""
    assert classify(CommitImpossibleError("commit of x failed: data lost")) == (
        "the sink says this commit can never succeed"
    )
    assert isinstance(CommitImpossibleError("x"), CommitFailedError)


def test_a_commit_still_retried_out_is_recoverable():
    """RETRY_LATER until the retries ran out (throttled, unreachable): a restart may fix it."""
    error = CommitFailedError("still not possible after 7 tries")
    error.__cause__ = TimeoutError("slow down")
    assert classify(error) is None


def test_the_classifier_may_still_say_otherwise():
    assert classify(CommitImpossibleError("x"), lambda exc: True) is None
