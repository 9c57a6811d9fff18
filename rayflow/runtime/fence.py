"""The attempt fence: lets work that outlives its attempt find out, and stop.

Each subtask attempt has one :class:`AttemptFence`. It is revoked when the attempt
ends (failed, cancelled, or the actor redeployed for the next attempt). Code that
writes to the outside world off the mailbox (a recover thread, a commit, a lingering
abort) calls :meth:`AttemptFence.check` right before each side effect, so work of
an earlier attempt raises :class:`StaleAttemptError` instead of touching what the
next attempt owns. Threads cannot be stopped from outside: the subtask also counts
them, and an actor with a thread of an old attempt still running is replaced, not
reused.
"""

from __future__ import annotations

import threading

__all__ = ["AttemptFence", "StaleAttemptError"]


class StaleAttemptError(RuntimeError):
    """Work of an attempt that has ended tried to touch the outside world."""


class AttemptFence:
    def __init__(self, run_id: str, attempt: int) -> None:
        self.run_id = run_id
        self.attempt = attempt
        self._revoked = threading.Event()

    def revoke(self) -> None:
        self._revoked.set()

    @property
    def revoked(self) -> bool:
        return self._revoked.is_set()

    def check(self, what: str = "work") -> None:
        """Raise :class:`StaleAttemptError` if this attempt has ended."""
        if self._revoked.is_set():
            raise StaleAttemptError(
                f"{what} of attempt {self.attempt} of run {self.run_id or '?'} stopped: "
                "the attempt has ended"
            )

    def __reduce__(self):  # a fence never travels: a copy would not see the revocation
        raise TypeError("AttemptFence cannot be pickled")
