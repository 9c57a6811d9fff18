"""A worker node of a multi-node Ray cluster is lost mid-run: the job restarts from its
latest checkpoint on the remaining nodes and still commits every result exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.chaos
def test_job_survives_the_loss_of_a_worker_node():
    script = Path(__file__).with_name("multinode_job.py")
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["removed"] and report["nodes_alive"] == 2
    assert report["restarts"] >= 1, "losing a node with subtasks on it forces a restart"
    assert report["sums_exact"]
    assert report["rows"] == report["expected_rows"]
