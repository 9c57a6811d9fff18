"""What the rayflow-side benchmark scripts share: starting a local Ray, holding the
machine-wide benchmark lock, the load average, waiting for the CPUs to go quiet between
runs, and the revision being measured.

Imports Ray (unlike ``peers_common.py``, which the peer engines' venvs import too).
"""

from __future__ import annotations

import fcntl
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import ray

__all__ = ["cpu_busy", "holding", "load1", "load_text", "rayflow_revision", "settle", "start_ray"]


def start_ray(attempts: int = 2, rayflow_starts: bool = False) -> None:
    """``ray.init`` on a fresh local Ray, once more if a loaded machine made it time out.
    ``rayflow_starts``: start it as a job that finds no Ray does (``ensure_ray``: a 1 MiB
    inline-argument limit, workers that import rayflow's runtime while idle)."""
    for attempt in range(attempts):
        try:
            if rayflow_starts:
                from rayflow.environment import ensure_ray

                ensure_ray("local")
            else:
                ray.init(address="local", include_dashboard=False, logging_level="WARNING")
            return
        except Exception:
            if attempt + 1 == attempts:
                raise
            ray.shutdown()
            time.sleep(5)


@contextmanager
def holding(path: str | None, progress: Callable[[str], None]) -> Iterator[None]:
    """Hold the lock file ``path`` (if any) while the block runs. A blocking ``flock``,
    queued like ``flock(1)`` callers (a poller would lose every hand-over to blocking
    waiters); says so after a minute of waiting."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        timer = threading.Timer(
            60.0,
            progress,
            [
                f"  waiting for {path} (held by another benchmark; if this run is itself "
                "wrapped in flock on the same file, drop one of the two)"
            ],
        )
        timer.daemon = True
        timer.start()
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        finally:
            timer.cancel()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load1() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from ``/proc/stat`` (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    fields = fields[:8]  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy(window_s: float = 0.5) -> float:
    """The busy share of all CPUs over ``window_s`` (0..1; NaN where unknown)."""
    before = _cpu_times()
    time.sleep(window_s)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return math.nan
    return (after[0] - before[0]) / (after[1] - before[1])


def settle(
    threshold: float = 0.25, quiet_windows: int = 2, window_s: float = 0.5, timeout_s: float = 30.0
) -> tuple[float, float, bool]:
    """Wait until the CPUs are quiet: ``quiet_windows`` windows in a row under ``threshold``.

    Run before every timed run, whatever the engine: what the previous job left running
    (a JVM shutting down, processes a Ray starts after a job) must not be billed to the
    next one. Gives up after ``timeout_s`` (a machine busy with other work never goes
    quiet). Returns (seconds waited, the last window's busy share, whether it went quiet).
    """
    started = time.monotonic()
    quiet = 0
    busy = math.nan
    while time.monotonic() - started < timeout_s:
        busy = cpu_busy(window_s)
        if math.isnan(busy):
            break
        quiet = quiet + 1 if busy < threshold else 0
        if quiet >= quiet_windows:
            break
    return time.monotonic() - started, busy, quiet >= quiet_windows


def load_text() -> str:
    """The 1, 5 and 15 minute load averages as ``a/b/c``."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _git(where: Path, *args: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def rayflow_revision(package_dir: Path, short: bool = False) -> str:
    """The commit of the rayflow at ``package_dir`` (``+uncommitted changes`` if dirty)."""
    commit = _git(package_dir, "rev-parse", *(["--short"] if short else []), "HEAD")
    dirty = " +uncommitted changes" if _git(package_dir, "status", "--porcelain", "--", ".") else ""
    return f"{commit or 'unknown commit'}{dirty}"
