"""Jobs on a three-node Ray cluster (``ray.cluster_utils.Cluster`` on one machine) with
checkpoints and output on S3 (moto's server): run as a script by test_cluster.py, in a
process of its own, so its Ray cluster never meets the test session's Ray.

1. **Node loss**: the keyed running sum, its keyed subtasks on the worker nodes (they
   ask for a ``worker`` resource only those have), checkpoints to ``s3://``, output to
   an exactly-once S3FileSink. After two checkpoints the worker node that runs keyed
   subtasks (and, when it can be told apart, not the job master) is removed without
   notice. Ray declares it dead, moves its placement bundles to the other worker, and
   the job restarts from its latest checkpoint there.
2. **Failure**: a job whose operator raises, without restarts.
3. **Cancel**: a job cancelled after its first checkpoint.

After each, no actor of the job is alive, no detached actor is left, and no placement
group of the job is held (``ray.util.state.list_actors``, ``placement_group_table``).
Prints one JSON line with what it saw.

    python tests/integration/cluster_job.py [--rows N] [--detection default|fast]

``--detection fast`` (the test's) makes Ray declare a lost node dead after ~3 s instead
of its default ~15 s (``health_check_period_ms`` 1000 x ``health_check_failure_threshold``
3 instead of 3000 x 5); recovery takes that much less.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from rayflow import JobCancelledError, JobFailedError, StreamExecutionEnvironment  # noqa: E402
from rayflow.config import RestartStrategies  # noqa: E402
from rayflow.runtime.run_lock import run_lock_holder  # noqa: E402
from rayflow.sources import NumberSequenceSource  # noqa: E402
from rayflow.testing import wait_for_checkpoints  # noqa: E402
from sinks.s3 import S3FileSink  # noqa: E402
from tests.chaos.harness import (  # noqa: E402
    KEYS,
    expected_rows,
    expected_sums,
    unique_job,
    with_key,
)
from tests.s3_server import S3Server, start_server  # noqa: E402

P = 2
BATCH = 5000

#: the cluster's GCS address, for Ray's state API: without one it looks for "the latest"
#: cluster on this machine, which may be another test's or another user's
STATE_ADDRESS: str | None = None


def actors(**kwargs):
    return list_actors(address=STATE_ADDRESS, detail=True, limit=10_000, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def keyed_sum(
    rows: int, s3: S3Server, bucket: str, rate: float | None
) -> tuple[StreamExecutionEnvironment, str]:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(P)
    env.enable_checkpointing(300)
    env.get_checkpoint_config().set_checkpoint_storage(
        f"s3://{bucket}/checkpoints", **s3.storage_options()
    )
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(5, 100))
    env.set_placement(ready_timeout_s=60)
    prefix = "out/"
    (
        env.from_source(
            NumberSequenceSource(0, rows - 1, batch_size=BATCH, records_per_second=rate),
            "numbers",
        )
        .uid("numbers")
        .map_batches(with_key, name="with-key")
        .key_by("key")
        .sum("value")
        .uid("running-sum")
        .set_resources(resources={"worker": 0.01})  # keyed state on the worker nodes
        .sink_to(S3FileSink(bucket, prefix, format="parquet", **s3.sink_options()), "s3")
        .uid("s3")
    )
    return env, prefix


def leftovers(job_id: str, job_name: str) -> dict[str, list]:
    """What of the job Ray still holds: live actors, detached actors, placement groups."""
    alive = actors(filters=[("state", "=", "ALIVE")])
    ours = [a.name for a in alive if a.name.startswith(f"rayflow:{job_id}:")]
    holder = run_lock_holder(job_name)
    if holder is not None:
        ours.append(f"the run lock of {job_name!r} (run {holder})")
    detached = [a.name for a in alive if a.is_detached]
    groups = [
        info["name"]
        for info in placement_group_table().values()
        if info["name"].startswith(f"rayflow:{job_id}:") and info["state"] != "REMOVED"
    ]
    return {"actors": ours, "detached": detached, "placement_groups": groups}


def settled_leftovers(job_id: str, job_name: str, timeout_s: float = 30.0) -> dict[str, list]:
    deadline = time.time() + timeout_s
    while True:
        found = leftovers(job_id, job_name)
        if not any(found.values()) or time.time() > deadline:
            return found
        time.sleep(0.5)


def subtask_actors(job_id: str) -> list:
    """Every subtask actor the job had, dead or alive (name, node, placement group)."""
    return [a for a in actors() if a.name.startswith(f"rayflow:{job_id}:v")]


def node_loss(cluster: Cluster, workers: list, s3: S3Server, rows: int) -> dict:
    bucket = s3.create_bucket()
    env, prefix = keyed_sum(rows, s3, bucket, rate=40_000)
    job = unique_job("node-loss")
    client = env.execute_async(job)
    seen: dict = {}

    def remove_after_checkpoints() -> None:
        if wait_for_checkpoints(client, 2) < 2:
            return
        metrics = client.metrics()
        seen["nodes_before"] = sorted({m["node_id"] for m in metrics})
        keyed = {m["node_id"] for m in metrics if m["vertex"].startswith("Sum")}
        masters = {
            a.node_id
            for a in actors(filters=[("state", "=", "ALIVE")])
            if a.name.startswith(f"rayflow:{client.job_id}:master")
        }
        hosts = [w for w in workers if w.node_id in keyed]
        victim = next((w for w in hosts if w.node_id not in masters), hosts[0] if hosts else None)
        if victim is None:
            return
        seen["keyed_nodes"] = sorted(keyed)
        seen["master_on_victim"] = victim.node_id in masters
        completed = {c["checkpoint_id"] for c in client.checkpoints() if c["status"] == "COMPLETED"}
        seen["removed_at"] = time.time()
        cluster.remove_node(victim, allow_graceful=False)
        seen["victim"] = victim.node_id
        # the first checkpoint completed after the loss: the job runs again from S3
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                for c in client.checkpoints():
                    if c["status"] == "COMPLETED" and c["checkpoint_id"] not in completed:
                        if c["attempt"] >= 1 or seen.get("master_on_victim"):
                            seen["checkpoint_after_s"] = time.time() - seen["removed_at"]
                            return
            except Exception:  # noqa: BLE001 - a job master taking over
                pass
            time.sleep(0.1)

    remover = threading.Thread(target=remove_after_checkpoints)
    remover.start()
    result = client.wait(timeout=300)
    remover.join()
    table = s3.read_table(bucket, prefix, "parquet")
    sums: dict[int, int] = {}
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist()):
        sums[key] = value
    subtasks = subtask_actors(client.job_id)
    by_generation: dict[str, set] = {}
    for a in subtasks:
        generation = a.name.rsplit(":", 1)[1].split("-")[0]
        by_generation.setdefault(generation, set()).add(a.placement_group_id)
    deadline = time.time() + 60  # a node removed without notice is declared dead late
    while time.time() < deadline and len([n for n in ray.nodes() if n["Alive"]]) > 2:
        time.sleep(0.5)
    return {
        "job": job,
        "removed": "victim" in seen,
        "master_on_victim": seen.get("master_on_victim"),
        "nodes_before": len(seen.get("nodes_before", [])),
        "keyed_on_workers": all(
            n in {w.node_id for w in workers} for n in seen.get("keyed_nodes", [])
        ),
        "restarts": result.restarts,
        "job_master_restarts": result.job_master_restarts,
        "recovery_times_s": result.recovery_times_s,
        "failures": [f[:300] for f in result.failures],
        "checkpoint_after_loss_s": seen.get("checkpoint_after_s"),
        "sums_exact": sums == expected_sums(rows),
        "rows": table.num_rows,
        "expected_rows": expected_rows(rows, P, BATCH),
        "keys": len(sums) == min(KEYS, rows),
        "checkpoints_on_s3": result.checkpoint_location.startswith(f"{bucket}/"),
        "placement_groups_per_master": {g: len(ids) for g, ids in by_generation.items()},
        "nodes_alive": len([n for n in ray.nodes() if n["Alive"]]),
        "leftovers": settled_leftovers(client.job_id, job),
    }


def failure(s3: S3Server) -> dict:
    def explode(batch):
        if batch.num_rows and batch.column("value")[0].as_py() >= 20_000:
            raise ZeroDivisionError("boom")
        return batch

    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(P)
    env.set_restart_strategy(RestartStrategies.no_restart())
    bucket = s3.create_bucket()
    env.enable_checkpointing(300)
    env.get_checkpoint_config().set_checkpoint_storage(
        f"s3://{bucket}/checkpoints", **s3.storage_options()
    )
    (
        env.from_source(
            NumberSequenceSource(0, 99_999, batch_size=1000, records_per_second=40_000), "numbers"
        )
        .map_batches(explode, name="explode")
        .key_by("value")
        .sum("value")
        .sink_to(S3FileSink(bucket, "out/", **s3.sink_options()), "s3")
    )
    job = unique_job("failure")
    client = env.execute_async(job)
    try:
        client.wait(timeout=120)
        failed = False
    except JobFailedError as exc:
        failed = "boom" in str(exc)
    return {"failed": failed, "leftovers": settled_leftovers(client.job_id, job)}


def cancel(s3: S3Server) -> dict:
    bucket = s3.create_bucket()
    env, _ = keyed_sum(10_000_000, s3, bucket, rate=20_000)
    job = unique_job("cancel")
    client = env.execute_async(job)
    checkpoints = wait_for_checkpoints(client, 1)
    cancelled = client.cancel(timeout=120)
    try:
        client.wait()
    except JobCancelledError:
        pass
    return {
        "checkpoints": checkpoints,
        "cancelled": cancelled,
        "leftovers": settled_leftovers(client.job_id, job),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--detection", choices=("default", "fast"), default="fast")
    args = parser.parse_args()
    s3 = start_server()
    system_config = (
        {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
        if args.detection == "fast"
        else {}
    )
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,  # ray.util.state needs it
            "dashboard_port": _free_port(),
            "_system_config": system_config,
        },
    )
    workers = [
        cluster.add_node(num_cpus=2, resources={"worker": 100}),
        cluster.add_node(num_cpus=2, resources={"worker": 100}),
    ]
    global STATE_ADDRESS
    STATE_ADDRESS = cluster.address
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        report = {"node_loss": node_loss(cluster, workers, s3, args.rows)}
        report["failure"] = failure(s3)
        report["cancel"] = cancel(s3)
        print(json.dumps(report))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
