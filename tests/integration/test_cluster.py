"""A three-node Ray cluster with checkpoints and output on S3 (``cluster_job.py``, run in
a process of its own): subtasks spread over the nodes, the node running keyed subtasks
is removed mid-run and the S3 output is still exactly once; after success, failure and
cancel no actor, detached actor or placement group of the job is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.chaos
def test_node_loss_with_s3_checkpoints_and_nothing_left_behind(tmp_path):
    script = Path(__file__).with_name("cluster_job.py")
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    # Output goes to files, not pipes: processes of a removed node that outlive the script
    # would keep a pipe open, and reading it would never end. The script gets its own
    # process group, killed whole if it overruns.
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), "--detection", "fast"],
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
    nothing = {"actors": [], "detached": [], "placement_groups": []}

    loss = report["node_loss"]
    print(
        f"node loss: recovery {loss['recovery_times_s']} s after the last failure, first "
        f"checkpoint {loss['checkpoint_after_loss_s']} s after the node was removed, "
        f"restarts {loss['restarts']} (+{loss['job_master_restarts']} job master)"
    )
    assert loss["nodes_before"] >= 2, "subtasks spread over the nodes"
    assert loss["keyed_on_workers"]
    assert loss["removed"] and loss["nodes_alive"] == 2
    assert loss["restarts"] + loss["job_master_restarts"] >= 1
    if not loss["master_on_victim"]:
        # the restart waited for Ray to move the lost node's bundles instead of deploying
        # into them and failing once more
        assert loss["restarts"] == 1, loss["failures"]
    assert loss["checkpoints_on_s3"]
    assert loss["sums_exact"] and loss["keys"]
    assert loss["rows"] == loss["expected_rows"], "S3 output exactly once"
    assert loss["checkpoint_after_loss_s"] is not None
    # every attempt of a job master used that job master's one placement group
    assert set(loss["placement_groups_per_master"].values()) == {1}
    assert loss["leftovers"] == nothing

    assert report["failure"]["failed"]
    assert report["failure"]["leftovers"] == nothing
    assert report["cancel"]["cancelled"] and report["cancel"]["checkpoints"] >= 1
    assert report["cancel"]["leftovers"] == nothing
