"""``rayflow cluster up | status | down`` for real: a head and one worker node on this
machine; ``down`` stops every process of it and nothing else (not another process
group, not the test session's own Ray)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

import ray

from rayflow.cluster_local import ClusterSpec, LocalCluster


def test_cluster_up_status_down_stops_exactly_what_it_started():
    # Ray's socket paths must stay short: a directory right under the temp dir
    base = tempfile.mkdtemp(prefix="rfc-")
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "ray"], start_new_session=True
    )
    spec = ClusterSpec(
        name="t", workers=1, worker_cpus=1, object_store_mb=100, dashboard=False, base_dir=base
    )
    cluster = LocalCluster(spec)
    state = None
    try:
        state = cluster.up(timeout_s=180, progress=lambda _: None)
        assert [n.name for n in state.nodes] == ["head", "w1"]
        assert all(n.node_id for n in state.nodes)
        status = cluster.status()
        assert status["up"] and all(n["in_cluster"] for n in status["nodes"])
        assert len(cluster.leftovers(state)) >= 4  # GCS, raylets, the two ray start
    finally:
        cluster.down(grace_s=5, progress=lambda _: None)
        try:
            assert state is None or cluster.leftovers(state) == []
            assert cluster.state() is None
            assert bystander.poll() is None, "a process of another group was stopped"
            assert ray.get(ray.remote(lambda: 1).remote()) == 1, "the session's Ray stopped"
        finally:
            bystander.kill()
            bystander.wait()
            shutil.rmtree(base, ignore_errors=True)
