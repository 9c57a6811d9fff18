"""What a driver shows while its job runs: a start line, a live status line, and what
the job's functions print.

``rayflow run`` and ``rayflow demo`` turn the reporter on (``enable()``; a script run
with ``python`` turns it on with ``RAYFLOW_PROGRESS=1``). When on, a job prints at start
its job id, run id, where its checkpoints go and its restart strategy, and while it runs
one status line, rewritten about once a second from the job master's metrics (here cut
in two)::

    RUNNING 12s | Numbers -> Parse 48,210 rec/s | Totals 48,190 rec/s (inputs 91% full)
        | checkpoint 7 (1s ago) | restarts 0

(records per second per operator, how full each operator's input buffers are when they
hold back its upstream, the last completed checkpoint, restarts and the last failure).
The live line is drawn only on a terminal: when stdout or stderr is not a tty, only the
start line and a final line are printed. Lines printed by user functions always reach
the driver's stdout (see :mod:`rayflow.runtime.output`); with a live line they are
printed above it.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["ProgressReporter", "enable", "is_enabled", "reporter"]

_enabled: bool | None = None

#: an operator's inputs at least this full are shown (its upstream is held back)
SHOWN_FILL = 0.5


def enable(on: bool = True) -> None:
    """Turn the progress reporter on (or off) for every job this process runs."""
    global _enabled
    _enabled = on


def is_enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get("RAYFLOW_PROGRESS", "").lower() in ("1", "true", "yes", "on")


def reporter() -> ProgressReporter | None:
    """A reporter for a job that starts now, None when reporting is off."""
    return ProgressReporter() if is_enabled() else None


@dataclass
class _Count:
    attempt: int
    records: int
    at: float


def _ago(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


class ProgressReporter:
    """Prints a job's progress; ``err`` gets the status lines, ``out`` the job's output
    (both default to the process's streams at the time of writing)."""

    def __init__(
        self,
        err: TextIO | None = None,
        out: TextIO | None = None,
        live: bool | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self._err = err
        self._out = out
        self._live = live
        self.interval_s = interval_s
        self._shown = ""  # the live line on screen ("" when none)
        self._last_tick = 0.0
        self._counts: dict[str, _Count] = {}
        self._rates: dict[str, float] = {}
        self.started_at = time.time()

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def live(self) -> bool:
        if self._live is not None:
            return self._live
        return _isatty(self.err) and _isatty(self.out)

    # --- the job's life -----------------------------------------------------------------

    def job_started(self, client: Any) -> None:
        settings = client._settings
        config = settings.checkpoint_config
        lines = [
            f"rayflow: job {client.job_name!r} started: job id {client.job_id}, {client.run_id}"
        ]
        if settings.checkpointing:
            where = settings.storage().location()
            lines.append(f"  checkpoints: every {config.interval_ms} ms to {where}")
        else:
            lines.append("  checkpoints: off (a failure fails the job; nothing to restart from)")
        strategy = settings.restart_strategy
        if strategy is None:
            default = settings.new_supervisor().state.strategy
            if settings.checkpointing:
                lines.append(
                    f"  restarts: {default.description}, Flink's default with checkpoints; "
                    "bound it with env.set_restart_strategy("
                    "RestartStrategies.fixed_delay_restart(3, 10_000))"
                )
            else:
                lines.append(f"  restarts: {default.description} (checkpointing is off)")
        else:
            lines.append(f"  restarts: {strategy.description}")
        self._print(self.err, lines)

    def tick(self, client: Any) -> None:
        """Redraw the live line if it is due (about once per ``interval_s``)."""
        now = time.time()
        if not self.live or now - self._last_tick < self.interval_s:
            return
        self._last_tick = now
        snapshot = client._progress_snapshot()
        if snapshot is None:
            return
        self._draw(self.status_line(snapshot, client._graph, now))

    def write_output(self, lines: list[str]) -> None:
        """Lines the job's functions printed, above the live line."""
        if lines:
            self._print(self.out, lines)

    def job_ended(self, client: Any, state: str, detail: str = "") -> None:
        seconds = time.time() - self.started_at
        self._clear()
        tail = f": {detail}" if detail else ""
        self.err.write(f"rayflow: job {client.job_name!r} {state} after {seconds:.1f} s{tail}\n")
        self.err.flush()

    # --- the status line ----------------------------------------------------------------

    def status_line(self, snapshot: dict[str, Any], graph: Any, now: float) -> str:
        """``STATE 12s | <operator> N rec/s ... | checkpoint n (Ts ago) | restarts k``."""
        head = f"{snapshot['state']} {_ago(now - self.started_at)}"
        return " | ".join([head, *self.details(snapshot, graph, now)])

    def details(self, snapshot: dict[str, Any], graph: Any, now: float) -> list[str]:
        """The status line without its state: rates per operator, the last checkpoint,
        restarts and the last failure (``snapshot`` is ``JobMaster.progress()``)."""
        parts = self._operators(snapshot.get("metrics") or [], graph, now)
        last = snapshot.get("last_checkpoint")
        if last is not None:
            done_at = last["trigger_time"] + last["duration_s"]
            parts.append(f"checkpoint {last['checkpoint_id']} ({_ago(now - done_at)} ago)")
        restarts = snapshot.get("restarts", 0)
        history = snapshot.get("failure_history") or []
        if history:
            parts.append(f"restarts {restarts}, last failure: {history[-1].describe()}")
        else:
            parts.append(f"restarts {restarts}")
        return parts

    def _operators(self, metrics: list[dict[str, Any]], graph: Any, now: float) -> list[str]:
        emits = {v.name: bool(v.out_edges) for v in graph.vertices.values()}
        by_vertex: dict[str, list[dict[str, Any]]] = {}
        for m in metrics:
            by_vertex.setdefault(m["vertex"], []).append(m)
        shown = []
        for vertex in (v.name for v in graph.vertices.values()):
            subtasks = by_vertex.get(vertex)
            if not subtasks:
                continue
            key = "records_out" if emits.get(vertex) else "records_in"
            records = sum(m.get(key, 0) for m in subtasks)
            attempt = max(m.get("attempt", 0) for m in subtasks)
            rate = self._rate(vertex, attempt, records, now)
            text = f"{vertex} {rate:,.0f} rec/s" if rate is not None else vertex
            capacity = sum(m.get("input_capacity") or 0 for m in subtasks)
            if capacity:
                fill = sum(m.get("buffered", 0) for m in subtasks) / capacity
                if fill >= SHOWN_FILL:
                    text += f" (inputs {fill:.0%} full)"
            shown.append(text)
        return shown

    def _rate(self, vertex: str, attempt: int, records: int, now: float) -> float | None:
        before = self._counts.get(vertex)
        self._counts[vertex] = _Count(attempt, records, now)
        if before is None or before.attempt != attempt or records < before.records:
            return self._rates.get(vertex) if before is not None else None
        elapsed = now - before.at
        if elapsed <= 0:
            return self._rates.get(vertex)
        self._rates[vertex] = (records - before.records) / elapsed
        return self._rates[vertex]

    # --- the terminal -------------------------------------------------------------------

    def _draw(self, line: str) -> None:
        width = max(20, shutil.get_terminal_size((120, 20)).columns - 1)
        if len(line) > width:
            line = line[: width - 1] + "…"
        self._shown = line
        self.err.write("\r" + line + "\x1b[K")
        self.err.flush()

    def _clear(self, forget: bool = True) -> None:
        if self._shown:
            self.err.write("\r\x1b[K")
            self.err.flush()
            if forget:
                self._shown = ""

    def _print(self, stream: TextIO, lines: list[str]) -> None:
        self._clear(forget=False)
        stream.write("".join(line + "\n" for line in lines))
        stream.flush()
        if self._shown:
            self.err.write(self._shown + "\x1b[K")
            self.err.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # noqa: BLE001 - a closed or odd stream
        return False
