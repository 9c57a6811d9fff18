"""The checkpoint coordinator with 1,000 simulated subtasks (``benchmarks/coordinator_scale.py``
without its timings): a checkpoint completes with every subtask's state, late acks are
dropped, a decline aborts and notifies every subtask, and every subtask is called a
fixed number of times per round."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "coordinator_scale.py"


def _load():
    spec = importlib.util.spec_from_file_location("coordinator_scale", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_thousand_simulated_subtasks_checkpoint_decline_and_late_acks(caplog):
    scale = _load()
    caplog.set_level(logging.ERROR, logger="rayflow")
    rounds = 2
    row = asyncio.run(scale.measure(1000, rounds))
    n = row["subtasks"]
    assert n == 1000
    calls = row["calls"]
    # per round: one completed checkpoint (notified) and one declined one (aborted)
    assert calls["notify_checkpoint_complete"] == rounds * n
    assert calls["notify_checkpoint_aborted"] == rounds * n
    assert calls["trigger_checkpoint"] == 2 * rounds * (n // 2)  # sources only
    # a blob fetched per ack that counted: all of a completed round, half of a declined one
    assert calls["snapshot_blob"] == rounds * (n + n // 2)
