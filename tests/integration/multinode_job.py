"""A keyed running sum on a three-node Ray cluster (``ray.cluster_utils.Cluster`` on one
machine) that loses a worker node mid-run. Run as a script by test_multinode.py, in its
own process, so its Ray cluster never meets the test session's Ray.

Prints one JSON line: restarts, whether the sums were exact, rows committed vs expected.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rayflow.testing import wait_for_checkpoints  # noqa: E402
from tests.chaos.harness import (  # noqa: E402
    build_keyed_sum,
    expected_rows,
    expected_sums,
    outcome,
    unique_job,
)

N = 600_000


def main() -> int:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    workers = [cluster.add_node(num_cpus=4), cluster.add_node(num_cpus=4)]
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            env, sink = build_keyed_sum(N, 2, 5000, rate=60_000, checkpoint_ms=200, storage=storage)
            env.set_subtask_options(scheduling_strategy="SPREAD")
            client = env.execute_async(unique_job("multinode"))
            removed = threading.Event()

            def remove_after_checkpoints() -> None:
                if not wait_for_checkpoints(client, 2):
                    return
                hosting = {m["node_id"] for m in client.metrics()}
                # a worker node that runs at least one subtask
                victim = next((w for w in workers if w.node_id in hosting), None)
                if victim is not None:
                    cluster.remove_node(victim, allow_graceful=False)
                    removed.set()

            remover = threading.Thread(target=remove_after_checkpoints)
            remover.start()
            result = client.wait(timeout=180)
            remover.join()
            got = outcome(result, sink)
            deadline = time.time() + 60  # a node removed without notice is declared dead late
            while time.time() < deadline and len([n for n in ray.nodes() if n["Alive"]]) > 2:
                time.sleep(0.5)
            print(
                json.dumps(
                    {
                        "restarts": result.restarts + result.job_master_restarts,
                        "sums_exact": got.sums == expected_sums(N),
                        "rows": got.rows,
                        "expected_rows": expected_rows(N, 2, 5000),
                        "removed": removed.is_set(),
                        "nodes_alive": len([n for n in ray.nodes() if n["Alive"]]),
                    }
                )
            )
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
