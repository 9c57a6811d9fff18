"""A worker node of a multi-node Ray cluster is lost mid-run: the job restarts from its
latest checkpoint on the remaining nodes and still commits every result exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.chaos
def test_job_survives_the_loss_of_a_worker_node(tmp_path):
    script = Path(__file__).with_name("multinode_job.py")
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    # Output goes to files, not pipes: processes of a removed node that outlive the script
    # would keep a pipe open, and reading it would never end. The script gets its own
    # process group, killed whole if it overruns.
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=stdout,
            stderr=stderr,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=280)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    stdout_text, stderr_text = out.read_text(), err.read_text()
    lines = [line for line in stdout_text.splitlines() if line.startswith("{")]
    assert returncode == 0 and lines, stdout_text[-3000:] + stderr_text[-3000:]
    report = json.loads(lines[-1])
    assert report["removed"] and report["nodes_alive"] == 2
    assert report["restarts"] >= 1, "losing a node with subtasks on it forces a restart"
    assert report["sums_exact"]
    assert report["rows"] == report["expected_rows"]
