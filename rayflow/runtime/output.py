"""What user functions print, taken from a subtask's process to the driver.

A subtask actor replaces its process's ``sys.stdout`` with a :class:`CapturedOutput`:
each complete line printed there is kept with a prefix naming the operator that was
running and the subtask (``[Parse 2/4] ...``) until the job master drains it; the
driver prints what it drains while it waits for the job, and the rest before
``execute()`` returns. Ray's own markers (``:actor_name:`` and the like, which its log
monitor reads from the process's output) still go to the real stdout.

Bounded: beyond ``max_lines`` undrained lines the oldest are dropped and counted, and
the count is reported as a line of its own at the next drain.
"""

from __future__ import annotations

import io
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["CapturedOutput", "capture_stdout", "MAX_LINES"]

#: undrained lines a subtask keeps (a job that prints much more than it is polled loses
#: the oldest, counted)
MAX_LINES = 10_000

#: lines Ray's log monitor reads from a worker's output; never captured
_RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")


class CapturedOutput(io.TextIOBase):
    """A text stream that keeps complete lines, each prefixed by ``prefix()``."""

    def __init__(self, prefix: Callable[[], str], real: Any, max_lines: int = MAX_LINES) -> None:
        super().__init__()
        self._prefix = prefix
        self._real = real
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._partial = ""
        self._partial_prefix = ""
        self._dropped = 0
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._real.fileno()  # for code that asks; writes through it bypass capture

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        with self._lock:
            # a line is named after the operator that began it
            prefix = self._partial_prefix if self._partial else self._prefix()
            *complete, rest = text.split("\n")
            for piece in complete:
                self._keep(prefix, self._partial + piece)
                self._partial = ""
                prefix = self._prefix()
            if rest:
                if not self._partial:
                    self._partial_prefix = prefix
                self._partial += rest
        return len(text)

    def _keep(self, prefix: str, line: str) -> None:
        if line.startswith(_RAY_MARKERS):
            self._real.write(line + "\n")
            self._real.flush()
            return
        if len(self._lines) == self._lines.maxlen:
            self._dropped += 1
        self._lines.append(prefix + line)

    def flush(self) -> None:
        pass

    def drain(self, final: bool = False) -> list[str]:
        """The lines kept since the last drain; with ``final`` also an unfinished line."""
        with self._lock:
            if final and self._partial:
                self._keep(self._partial_prefix, self._partial)
                self._partial = ""
            lines = list(self._lines)
            self._lines.clear()
            if self._dropped:
                lines.insert(0, f"{self._prefix()}({self._dropped} lines of output dropped)")
                self._dropped = 0
        return lines


def capture_stdout(prefix: Callable[[], str]) -> CapturedOutput:
    """Replace this process's ``sys.stdout`` with a :class:`CapturedOutput` (once: a
    second call returns the one in place, with the new ``prefix``)."""
    current = sys.stdout
    if isinstance(current, CapturedOutput):
        current._prefix = prefix
        return current
    captured = CapturedOutput(prefix, current)
    sys.stdout = captured
    return captured
