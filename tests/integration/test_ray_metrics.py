"""A job's metrics reach Ray's Prometheus endpoint: a local Ray of its own (in a
subprocess: the metrics export port is set when Ray starts) runs a checkpointed job with a
keyed sum over values with nulls into a two-phase-commit sink; the endpoint is scraped
(polled: Ray exports on its own schedule) until every rayflow metric is there, with the
tags job, operator and subtask."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rayflow.runtime.ray_metrics import METRICS, MetricKind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, re, socket, sys, time, urllib.request
import ray

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port

port = free_port()
ray.init(
    address="local",
    include_dashboard=False,
    logging_level="WARNING",
    _metrics_export_port=port,
    _system_config={"metrics_report_interval_ms": 500},
)
from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from sinks.basic import CollectSink

wanted = set(json.loads(sys.argv[2]))
env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
env.enable_checkpointing(200)
env.get_checkpoint_config().set_checkpoint_storage(sys.argv[1])
(
    env.from_source(
        NumberSequenceSource(0, 10**9, batch_size=200, records_per_second=5000), "numbers"
    )
    .map(lambda r: {"k": r["value"] % 4, "v": None if r["value"] % 10 == 0 else r["value"]})
    .key_by("k")
    .sum("v")
    .name("total")
    .sink_to(CollectSink(), name="out")
)
client = env.execute_async("metrics-job")
found = {}
deadline = time.time() + 180


def complete(found):
    # every metric, and records from every subtask of both vertices
    subtasks = {
        (s["labels"]["operator"], s["labels"]["subtask"])
        for name in ("ray_rayflow_records_out", "ray_rayflow_records_in")
        for s in found.get(name, [])
        if s["value"] > 0
    }
    return set(found) >= wanted and len(subtasks) >= 4


try:
    while time.time() < deadline and not complete(found):
        time.sleep(1)
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        except OSError:
            continue
        found = {}
        for line in text.decode().splitlines():
            m = re.match(r"(ray_rayflow_\w+?)(_total|_bucket|_count|_sum)?\{(.*)\} (\S+)$", line)
            if m and m.group(2) != "_bucket":
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3)))
                found.setdefault(m.group(1), []).append(
                    {"suffix": m.group(2) or "", "labels": labels, "value": float(m.group(4))}
                )
finally:
    client.cancel()
print("FOUND " + json.dumps(found))
"""


def test_every_metric_reaches_rays_prometheus_endpoint(tmp_path):
    wanted = [f"ray_{spec.name}" for spec in METRICS]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT  # the workers import this checkout's rayflow
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "chk"), json.dumps(wanted)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.split("FOUND ", 1)[1])
    assert sorted(set(wanted) - set(found)) == []
    for spec in METRICS:
        samples = found[f"ray_{spec.name}"]
        for sample in samples:
            assert sample["labels"]["job"] == "metrics-job"
            for tag in spec.tags:
                assert tag in sample["labels"], (spec.name, tag, sample)
        if spec.kind is MetricKind.COUNTER:
            assert all(s["suffix"] == "_total" for s in samples)
    records_out = {
        (s["labels"]["operator"], s["labels"]["subtask"])
        for s in found["ray_rayflow_records_out"]
        if s["value"] > 0
    }
    assert records_out >= {("numbers -> Map", "0"), ("numbers -> Map", "1")}
    records_in = {
        (s["labels"]["operator"], s["labels"]["subtask"])
        for s in found["ray_rayflow_records_in"]
        if s["value"] > 0
    }
    assert records_in >= {("total -> out", "0"), ("total -> out", "1")}
    nulls = found["ray_rayflow_nulls_skipped"]
    assert {s["labels"]["operator"] for s in nulls} == {"total"}
    assert sum(s["value"] for s in nulls) > 0
    commits = found["ray_rayflow_commit_latency_seconds"]
    assert {s["labels"]["operator"] for s in commits} == {"out"}
    statuses = {s["labels"]["status"] for s in found["ray_rayflow_checkpoints"]}
    assert "COMPLETED" in statuses
