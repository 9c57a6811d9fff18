"""Read every node's metrics endpoint of a ``rayflow cluster up`` cluster and print the
rayflow metrics summed over subtasks and nodes, by metric and operator (histograms: their
``_count`` and ``_sum``).

    python cluster/scrape_metrics.py [--name local] [--job NAME]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request

from rayflow.cluster_local import ClusterSpec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="local", help="the cluster's name (default: local)")
    parser.add_argument("--job", help="only this job's metrics")
    args = parser.parse_args()
    state = json.loads((ClusterSpec(name=args.name).directory / "state.json").read_text())
    sums: dict[tuple[str, str, str, str], float] = {}
    for node in state["nodes"]:
        if not node.get("metrics_port"):
            continue
        url = f"http://127.0.0.1:{node['metrics_port']}/metrics"
        try:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError as exc:
            print(f"{node['name']}: {url}: {exc}", file=sys.stderr)
            continue
        for line in text.splitlines():
            m = re.match(r"(ray_rayflow_\w+)\{(.*)\} (\S+)$", line)
            if not m or m.group(1).endswith("_bucket"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if args.job and labels.get("job") != args.job:
                continue
            key = (
                m.group(1),
                labels.get("job", ""),
                labels.get("operator", ""),
                labels.get("status", ""),
            )
            sums[key] = sums.get(key, 0.0) + float(m.group(3))
    for (name, job, operator, status), value in sorted(sums.items()):
        tags = [f'job="{job}"']
        if operator:
            tags.append(f'operator="{operator}"')
        if status:
            tags.append(f'status="{status}"')
        print(f"{name}{{{','.join(tags)}}} {value:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
