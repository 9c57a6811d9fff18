"""Which failures a restart can fix: the failure classifier.

A job restarts after a failure as its restart strategy says, but some failures fail
every attempt the same way, however often it restarts: a read-only output directory, a
bucket that does not exist, credentials the store rejects, an input file that is not
there. rayflow classifies every failure; one that no restart can fix fails the job at
once, with the reason, whatever the restart strategy (Flink has the same notion in
``SuppressRestartsException`` and its failure enrichers).

Not recoverable by default (:data:`DEFAULT_RULES`; an exception matches when it, or an
exception it was raised from, does):

- :class:`NonRecoverableError`, raised by user code (or a subclass of it),
  :class:`MissingInputError`, which a ``FileSource`` raises for an input path that does
  not exist, and ``rayflow.sink.CommitImpossibleError``: a sink answered a commit with
  FAILED (its pre-committed data is gone, or another writer's output holds its name), and
  every restart would restore that committable and fail on it again;
- ``PermissionError``, and ``OSError`` with errno ``EACCES``, ``EPERM`` or ``EROFS``
  (a read-only or protected directory or file);
- S3 errors with the codes ``NoSuchBucket``, ``InvalidBucketName``, ``AccessDenied``,
  ``AllAccessDisabled``, ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``,
  ``AccountProblem`` (boto3's ``ClientError``, and pyarrow's S3 errors that name them);
- boto3's ``NoCredentialsError`` and ``PartialCredentialsError``.

A commit that ran out of its retries (``rayflow.sink.CommitFailedError``) is recoverable
whatever its cause (a ``PermissionError`` too): its committable belongs to a completed
checkpoint, whose output must become visible, and a restart tries it again; the restart
strategy bounds how long. (An exception with ``restart_may_fix = True`` stops the search
down its chain.)

Everything else is recoverable: errors in user functions (a bad record may be fixed by
a restart from an older checkpoint, or never; the restart strategy bounds it), lost
actors and nodes, timeouts, and storage errors other than those above; a
``FileNotFoundError`` too (a directory deleted under a running job is made again by the
next attempt), except a missing input.

Override it per job with ``env.set_failure_classifier(fn)``: ``fn(exc)`` returns True
(recoverable: restart as the strategy says), False (fail the job now) or None (no verdict
on this exception). It is asked about the failure and then each exception it was raised
from, as the default rules look at them; the first verdict decides, and with none the
default rules do. It runs in the subtask where the error happened and in the job
master, so it must pickle and must not raise (an exception it raises counts as None).
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "NonRecoverableError",
    "MissingInputError",
    "FailureClassifier",
    "Rule",
    "DEFAULT_RULES",
    "classify",
    "default_reason",
]

log = logging.getLogger("rayflow.job")

#: ``fn(exc) -> True`` (recoverable), ``False`` (not), ``None`` (the default rules decide)
FailureClassifier = Callable[[BaseException], "bool | None"]


class NonRecoverableError(RuntimeError):
    """Raise it (or a subclass) from a function of a job to fail the job at once,
    without restarts: the error is known not to go away."""


class MissingInputError(NonRecoverableError, FileNotFoundError):
    """An input file or directory a job reads does not exist."""


@dataclass(frozen=True)
class Rule:
    """One default rule: ``reason_of(exc)`` says why no restart can fix ``exc``, or None
    when the rule does not apply."""

    name: str
    reason_of: Callable[[BaseException], str | None]


_S3_CODES = {
    "NoSuchBucket": "the S3 bucket does not exist",
    "InvalidBucketName": "the S3 bucket name is invalid",
    "AccessDenied": "S3 denied access",
    "AllAccessDisabled": "S3 denied access",
    "InvalidAccessKeyId": "S3 rejected the credentials",
    "SignatureDoesNotMatch": "S3 rejected the credentials",
    "AccountProblem": "S3 rejected the account",
}

#: pyarrow's S3 filesystem names the AWS error in its OSError's message.
_PYARROW_S3 = {
    "NO_SUCH_BUCKET": "NoSuchBucket",
    "ACCESS_DENIED": "AccessDenied",
    "INVALID_ACCESS_KEY_ID": "InvalidAccessKeyId",
    "SIGNATURE_DOES_NOT_MATCH": "SignatureDoesNotMatch",
}
_PYARROW_S3_ERROR = re.compile(r"AWS Error (" + "|".join(_PYARROW_S3) + r")\b")
_PYARROW_NO_BUCKET = re.compile(r"Bucket '[^']*' not found")


def s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code an exception carries (boto3's ``ClientError`` or pyarrow's
    S3 ``OSError``), None when it carries none."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
    if isinstance(exc, OSError):
        text = str(exc)
        found = _PYARROW_S3_ERROR.search(text)
        if found:
            return _PYARROW_S3[found.group(1)]
        if _PYARROW_NO_BUCKET.search(text):
            return "NoSuchBucket"
    return None


def _type_names(exc: BaseException) -> set[str]:
    return {t.__name__ for t in type(exc).__mro__}


def _s3_reason(exc: BaseException) -> str | None:
    code = s3_error_code(exc)
    if code in _S3_CODES:
        return f"{_S3_CODES[code]} ({code})"
    if _type_names(exc) & {"NoCredentialsError", "PartialCredentialsError"}:
        return "no S3 credentials were found"
    return None


def _os_reason(exc: BaseException) -> str | None:
    if isinstance(exc, PermissionError):
        return "permission denied (a read-only or protected path)"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return "read-only file system"
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (a read-only or protected path)"
    return None


def _marked_reason(exc: BaseException) -> str | None:
    if isinstance(exc, MissingInputError):
        return "the input does not exist"
    if type(exc).__name__ == "CommitImpossibleError":
        return "the sink says this commit can never succeed"
    if isinstance(exc, NonRecoverableError):
        return f"not recoverable: {exc}" if str(exc) else "not recoverable"
    return None


#: The default rules, in the order they are tried (see the module docstring).
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("NonRecoverableError", _marked_reason),
    Rule("S3 errors", _s3_reason),
    Rule("filesystem errors", _os_reason),
)


def _chain(exc: BaseException, limit: int = 10) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (``__cause__``, else an unsuppressed
    ``__context__``), without cycles."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < limit:
        seen.add(id(current))
        yield current
        if current.__cause__ is not None:
            current = current.__cause__
        elif not current.__suppress_context__:
            current = current.__context__
        else:
            current = None


def default_reason(exc: BaseException) -> str | None:
    """Why no restart can fix ``exc`` by the default rules; None when one may."""
    for link in _chain(exc):
        for rule in DEFAULT_RULES:
            reason = rule.reason_of(link)
            if reason is not None:
                return reason
        if getattr(link, "restart_may_fix", None) is True:
            return None  # whatever it was raised from (a commit of a completed checkpoint)
    return None


def classify(exc: BaseException, classifier: FailureClassifier | None = None) -> str | None:
    """Why no restart can fix ``exc`` (None: a restart may). ``classifier`` is the job's
    own (see the module docstring); when it returns None, or raises, the default rules
    decide."""
    if classifier is not None:
        # asked about ``exc`` and what it was raised from, as the default rules are: the
        # first verdict from the top decides
        for link in _chain(exc):
            try:
                verdict = classifier(link)
            except Exception as problem:  # noqa: BLE001 - a broken classifier must not hide exc
                log.warning("the failure classifier raised %r; using the default rules", problem)
                break
            if verdict is True:
                return None
            if verdict is False:
                return "the job's failure classifier says no restart can fix it"
    return default_reason(exc)
