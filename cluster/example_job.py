"""A keyed running sum that reports where its subtasks ran: the job of cluster/README.md.

    python example_job.py [--rows 400000] [--parallelism 4] [--checkpoints DIR]

Joins the cluster named by ``RAY_ADDRESS`` (``ray job submit`` sets it for the job), or
starts a local Ray. Prints the nodes its subtasks ran on, the checkpoints it took and
whether every key's total is exact; exits 1 when one is not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np
import pyarrow as pa

import rayflow
from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from sinks.basic import CollectSink

KEYS = 100


def with_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("key", pa.array(batch.column("value").to_numpy() % KEYS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument(
        "--checkpoints",
        default=f"{tempfile.gettempdir()}/rayflow-checkpoints",
        help="checkpoint storage: a directory every node sees, or s3://bucket/prefix",
    )
    args = parser.parse_args()

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(args.parallelism)
    env.enable_checkpointing(500)
    env.get_checkpoint_config().set_checkpoint_storage(args.checkpoints)
    sink = CollectSink()
    (
        env.from_source(
            NumberSequenceSource(0, args.rows - 1, batch_size=5000, records_per_second=100_000),
            "numbers",
        )
        .map_batches(with_key, name="with-key")
        .key_by("key")
        .sum("value")
        .name("running-sum")
        .sink_to(sink, name="totals")
    )
    result = env.execute("cluster-example")

    totals: dict[int, int] = {}
    table = result.sink_result(sink)
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist()):
        totals[key] = value  # running sums only grow: the last one is the total
    values = np.arange(args.rows, dtype=np.int64)
    expected = np.bincount(values % KEYS, weights=values, minlength=KEYS).astype(np.int64)
    exact = totals == {k: int(expected[k]) for k in range(KEYS)}

    nodes: dict[str, list[str]] = {}
    for m in result.metrics:
        nodes.setdefault(m["node_id"][:8], []).append(f"{m['vertex']}#{m['subtask']}")
    print(f"rayflow {rayflow.__version__} from {rayflow.__file__}")
    print(f"{args.rows:,} rows in {result.duration_s:.1f} s, parallelism {args.parallelism}")
    print(f"subtasks ran on {len(nodes)} node(s):")
    for node, subtasks in sorted(nodes.items()):
        print(f"  node {node}: {', '.join(sorted(subtasks))}")
    print(f"checkpoints completed: {len(result.completed_checkpoints)}")
    print(f"totals exact: {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
