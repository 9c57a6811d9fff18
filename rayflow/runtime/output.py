"""What user functions print, taken from a subtask's process to the driver.

A subtask actor replaces its process's ``sys.stdout`` with a :class:`CapturedOutput`:
each complete line printed there is kept with a prefix naming the operator that was
running and the subtask (``[Parse 2/4] ...``); the job master reads it into a log of its
own, and the driver prints what it reads from there while it waits for the job, and the
rest before ``execute()`` returns. Ray's own markers (``:actor_name:`` and the like,
which its log monitor reads from the process's output) still go to the real stdout.

Reading never loses a line to a reply that comes back too late: every log
(:class:`LineLog`) numbers its lines and forgets them only once its reader acknowledges
them in its next read (:class:`OutputAck`); a reader (:class:`OutputReader`) takes each
line once, however many reads of the same lines it gets back, so a read given up
on, or two reads at once, neither lose nor repeat a line.

Bounded: beyond ``max_lines`` unacknowledged lines a log drops the oldest; the reader
sees the gap in the numbers and reports the count as a line of its own.
"""

from __future__ import annotations

import asyncio
import io
import sys
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CapturedOutput",
    "LineLog",
    "MAX_LINES",
    "OutputCollector",
    "OutputAck",
    "OutputChunk",
    "OutputReader",
    "capture_stdout",
]

#: unacknowledged lines a log keeps (a job that prints much more than it is read loses
#: the oldest, counted)
MAX_LINES = 10_000

#: lines Ray's log monitor reads from a worker's output; never captured
_RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")


@dataclass(frozen=True)
class OutputAck:
    """A reader has taken every line of log ``source`` numbered below ``upto``."""

    source: str
    upto: int


@dataclass(frozen=True)
class OutputChunk:
    """The lines of log ``source`` a read returned: ``lines[i]`` is numbered
    ``first + i``. ``label`` names the log in a notice of dropped lines."""

    source: str
    first: int
    lines: tuple[str, ...]
    label: str = ""


class LineLog:
    """A bounded log of numbered lines, forgotten only once acknowledged. Thread-safe."""

    def __init__(self, max_lines: int = MAX_LINES) -> None:
        #: names this log (and only it): an acknowledgement of another log is ignored
        self.source = uuid.uuid4().hex
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._next = 0  # the number the next line gets
        self._lock = threading.Lock()

    def append(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)  # the oldest goes when full: a gap the reader sees
            self._next += 1

    def extend(self, lines: list[str]) -> None:
        with self._lock:
            self._lines.extend(lines)
            self._next += len(lines)

    def read(self, ack: OutputAck | None = None, label: str = "") -> OutputChunk:
        """Forget the lines ``ack`` covers (if it is this log's); the rest, kept until a
        later read acknowledges them."""
        with self._lock:
            if ack is not None and ack.source == self.source:
                first = self._next - len(self._lines)
                for _ in range(min(len(self._lines), ack.upto - first)):
                    self._lines.popleft()
            return OutputChunk(
                self.source, self._next - len(self._lines), tuple(self._lines), label
            )


class OutputReader:
    """The reading side of one or more logs: which lines of each it has taken, keyed by
    whoever it reads them from (a subtask, the job master). Not thread-safe; call it
    from one thread or event loop."""

    #: logs no longer read remembered at most (the oldest forgotten first): a reader of
    #: a subtask replaced again and again over a long run stays bounded
    MAX_LOGS = 4096

    def __init__(self) -> None:
        #: log -> the number of the next line to take
        self._taken: dict[str, int] = {}
        self._log_of: dict[Hashable, str] = {}
        self._readers: dict[str, int] = {}  # log -> how many in ``_log_of`` read it
        #: logs none reads any more, the longest unread first (a late chunk of one is
        #: still taken right while it is remembered)
        self._retired: OrderedDict[str, None] = OrderedDict()

    def ack(self, who: Hashable) -> OutputAck | None:
        """What to send with the next read from ``who``."""
        source = self._log_of.get(who)
        if source is None or source not in self._taken:
            return None
        return OutputAck(source, self._taken[source])

    def take(self, who: Hashable, chunk: OutputChunk) -> list[str]:
        """The lines of ``chunk`` not taken before (a notice first where lines were
        dropped unread)."""
        self._read_by(who, chunk.source)
        taken = self._taken.setdefault(chunk.source, 0)
        end = chunk.first + len(chunk.lines)
        if end <= taken:
            return []
        out = []
        if chunk.first > taken:
            out.append(f"{chunk.label}({chunk.first - taken} lines of output dropped)")
        out.extend(chunk.lines[max(0, taken - chunk.first) :])
        self._taken[chunk.source] = end
        return out

    def _read_by(self, who: Hashable, source: str) -> None:
        before = self._log_of.get(who)
        if before == source:
            return
        self._log_of[who] = source
        self._readers[source] = self._readers.get(source, 0) + 1
        self._retired.pop(source, None)
        if before is None:
            return
        self._readers[before] -= 1
        if self._readers[before] == 0:
            del self._readers[before]
            self._retired[before] = None
            while len(self._retired) > self.MAX_LOGS:
                gone, _ = self._retired.popitem(last=False)
                self._taken.pop(gone, None)


class OutputCollector:
    """A job master's side: what its subtasks printed, read into one log of its own.

    A subtask is any object whose ``drain_output.remote(ack, final)`` is awaitable and
    answers an :class:`OutputChunk` (a subtask actor). A read that answers after its
    caller stopped waiting is still taken when it does; one read per subtask is in flight
    at a time, so a subtask too busy to answer gets no pile of reads. Runs on one event
    loop.
    """

    def __init__(self, max_lines: int = MAX_LINES) -> None:
        self.log = LineLog(max_lines)
        self._reader = OutputReader()
        #: the read in flight, by subtask: (its actor, the read)
        self._reads: dict[Hashable, tuple[Any, asyncio.Future]] = {}

    async def read(self, subtasks: Iterable[tuple[Hashable, Any]], timeout_s: float) -> None:
        """Read what the ``(key, actor)`` subtasks printed, waiting up to ``timeout_s``."""
        reads = [self._read_of(key, actor) for key, actor in subtasks]
        if reads:
            await asyncio.wait(reads, timeout=timeout_s)

    async def last_read(self, subtasks: Iterable[tuple[Hashable, Any]], timeout_s: float) -> None:
        """Read the ``(key, actor)`` subtasks once more before they go, an unfinished last
        line too: a fresh read each (one in flight may have been answered before their
        last print), waiting up to ``timeout_s``."""
        reads = [
            asyncio.ensure_future(self._take(key, actor, final=True)) for key, actor in subtasks
        ]
        if reads:
            await asyncio.wait(reads, timeout=timeout_s)

    def keep(self, key: Hashable, chunk: OutputChunk) -> None:
        """Take the lines of ``chunk``, which subtask ``key`` sent on its own (its run's
        last lines); those read from it before are not taken again."""
        self.log.extend(self._reader.take(key, chunk))

    def _read_of(self, key: Hashable, actor: Any) -> asyncio.Future:
        pending = self._reads.get(key)
        if pending is not None and pending[0] is actor and not pending[1].done():
            return pending[1]
        read = asyncio.ensure_future(self._take(key, actor))
        self._reads[key] = (actor, read)
        read.add_done_callback(lambda done: self._forget(key, done))
        return read

    def _forget(self, key: Hashable, read: asyncio.Future) -> None:
        if key in self._reads and self._reads[key][1] is read:
            del self._reads[key]

    async def _take(self, key: Hashable, actor: Any, final: bool = False) -> None:
        try:
            ack = self._reader.ack(key)
            chunk = await actor.drain_output.remote(ack, final)
        except Exception:  # noqa: BLE001 - dead or ending: its unread lines go with it
            return
        if isinstance(chunk, OutputChunk):
            self.keep(key, chunk)


class CapturedOutput(io.TextIOBase):
    """A text stream that keeps complete lines, each prefixed by ``prefix()``."""

    def __init__(
        self,
        prefix: Callable[[], str],
        real: Any,
        max_lines: int = MAX_LINES,
        log: LineLog | None = None,
    ) -> None:
        super().__init__()
        self._prefix = prefix
        self._real = real
        self.log = log if log is not None else LineLog(max_lines)
        self._partial = ""
        self._partial_prefix = ""
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
        self.log.append(prefix + line)

    def flush(self) -> None:
        pass

    def end_line(self) -> None:
        """Keep an unfinished line as it is (its writer is done with it)."""
        with self._lock:
            if self._partial:
                self._keep(self._partial_prefix, self._partial)
                self._partial = ""

    def read(self, ack: OutputAck | None = None, final: bool = False) -> OutputChunk:
        """The lines kept and not yet acknowledged (see :meth:`LineLog.read`); with
        ``final`` also an unfinished line."""
        if final:
            self.end_line()
        with self._lock:
            return self.log.read(ack, label=self._prefix())


#: the log of this process's captured lines, whichever ``CapturedOutput`` writes it
_process_log: LineLog | None = None


def capture_stdout(prefix: Callable[[], str]) -> CapturedOutput:
    """Replace this process's ``sys.stdout`` with a :class:`CapturedOutput` (once: a
    second call returns the one in place, with the new ``prefix``, its unfinished line
    ended). Every ``CapturedOutput`` of the process writes one log, so lines not read yet
    stay readable where user code replaced ``sys.stdout`` meanwhile."""
    global _process_log
    current = sys.stdout
    if isinstance(current, CapturedOutput):
        current.end_line()  # begun under the earlier prefix (an earlier attempt's)
        current._prefix = prefix
        return current
    if _process_log is None:
        _process_log = LineLog()
    captured = CapturedOutput(prefix, current, log=_process_log)
    sys.stdout = captured
    return captured
