"""The peer workload (keyed running sum) on PyFlink; run inside PyFlink's own venv.

``benchmarks/peers.py`` starts this script with the venv's python::

    /tmp/peers/pyflink/bin/python benchmarks/peers_pyflink.py \
        --api sql --records 2000000 --parallelism 1 --mode exactly-once

Two forms of the job, both on a local MiniCluster (``parallelism.default``):

* ``--api sql``: Java's ``NumberSequenceSource`` turned into a table with
  ``from_data_stream`` (no Python at run time), then
  ``INSERT INTO snk SELECT k, SUM(v) FROM src GROUP BY k`` in streaming mode with
  mini-batch off (one update per input record) into a ``blackhole`` sink. Nothing
  reaches Python, so the sums are not checked (reported as ``unchecked``).
* ``--api sql-mini-batch``: the same query with Flink's own batching of updates, one
  setting not tuned further: mini-batch on (a bundle closes after
  ``MINI_BATCH_LATENCY`` or ``MINI_BATCH_SIZE`` records, like rayflow's buffer timeout
  and source batch) and two-phase (local-global) aggregation. One update per key per
  bundle, as rayflow's vectorized ``sum`` gives one per key per batch.
* ``--api datastream``: ``NumberSequenceSource`` -> ``map`` to ``(i % 1000, i)`` ->
  ``key_by(lambda x: x[0]).reduce(lambda a, b: (a[0], a[1] + b[1]))`` -> a Python
  function that counts updates and keeps the largest sum per key, writing them at
  ``close()`` to a file named by pid and uuid (in thread mode a subtask cannot learn its
  index). Python UDFs run in ``thread`` mode (the default ``process`` mode does keyed
  state through gRPC round trips, at about 1k records/s).

Checkpointing: mode ``none``, ``at-least-once``, ``exactly-once`` (aligned) or
``unaligned``, every 1 s to a fresh local directory. The job time runs from after the
JVM has started (planning and deployment included) to the end of ``.wait()`` /
``execute()``. Completed checkpoints are counted in PyFlink's log right after the job
(each run rewrites it). Prints one result line (``peers_common.RESULT_PREFIX`` + JSON).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from typing import Any

from peers_common import MODES, check_sums, emit, merge_max

__all__ = ["main"]

INTERVAL_MS = 1000
APIS = ("sql", "sql-mini-batch", "datastream")
#: Mini-batch settings of ``--api sql-mini-batch``: rayflow's default buffer timeout, and
#: the rows of rayflow's default source batch of int64 values (1 MiB).
MINI_BATCH_LATENCY = "100 ms"
MINI_BATCH_SIZE = 131_072


def _environment(args: argparse.Namespace, checkpoint_dir: str | None):
    """The StreamExecutionEnvironment (this starts the JVM)."""
    # The thread mode embeds the base interpreter, which does not see this venv; the
    # JVM and its Python workers inherit this PYTHONPATH.
    site = sysconfig.get_paths()["purelib"]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (site, os.environ.get("PYTHONPATH", "")) if p
    )
    from pyflink.common import Configuration
    from pyflink.datastream import CheckpointingMode, StreamExecutionEnvironment

    config = Configuration()
    config.set_string("python.executable", sys.executable)
    config.set_string("python.client.executable", sys.executable)
    config.set_string("python.execution-mode", "thread")
    config.set_string("parallelism.default", str(args.parallelism))
    if checkpoint_dir:
        config.set_string("execution.checkpointing.storage", "filesystem")
        config.set_string("execution.checkpointing.dir", "file://" + checkpoint_dir)
    env = StreamExecutionEnvironment.get_execution_environment(config)
    env.set_parallelism(args.parallelism)
    if args.mode != "none":
        mode = (
            CheckpointingMode.AT_LEAST_ONCE
            if args.mode == "at-least-once"
            else CheckpointingMode.EXACTLY_ONCE
        )
        env.enable_checkpointing(INTERVAL_MS, mode)
        if args.mode == "unaligned":
            env.get_checkpoint_config().enable_unaligned_checkpoints()
    return env


def _sql(env, args: argparse.Namespace) -> tuple[float, float, dict[str, Any]]:
    from pyflink.common import WatermarkStrategy
    from pyflink.datastream.connectors.number_seq import NumberSequenceSource
    from pyflink.table import EnvironmentSettings, StreamTableEnvironment
    from pyflink.table.expressions import col

    t_env = StreamTableEnvironment.create(
        env, environment_settings=EnvironmentSettings.in_streaming_mode()
    )
    table_config = t_env.get_config()
    if args.api == "sql-mini-batch":
        table_config.set("table.exec.mini-batch.enabled", "true")
        table_config.set("table.exec.mini-batch.allow-latency", MINI_BATCH_LATENCY)
        table_config.set("table.exec.mini-batch.size", str(MINI_BATCH_SIZE))
        table_config.set("table.optimizer.agg-phase-strategy", "TWO_PHASE")
    else:
        table_config.set("table.exec.mini-batch.enabled", "false")
    started = time.time()
    numbers = env.from_source(
        NumberSequenceSource(0, args.records - 1), WatermarkStrategy.no_watermarks(), "numbers"
    )
    table = t_env.from_data_stream(numbers)
    value = table.get_schema().get_field_names()[0]
    t_env.create_temporary_view(
        "src", table.select((col(value) % 1000).alias("k"), col(value).alias("v"))
    )
    t_env.execute_sql("CREATE TABLE snk (k BIGINT, s BIGINT) WITH ('connector' = 'blackhole')")
    result = t_env.execute_sql("INSERT INTO snk SELECT k, SUM(v) FROM src GROUP BY k")
    result.wait()
    finished = time.time()
    job_id = str(result.get_job_client().get_job_id())
    return started, finished, {"check": "unchecked (blackhole sink)", "job_id": job_id}


def _datastream(env, args: argparse.Namespace, out_dir: str) -> tuple[float, float, dict]:
    from pyflink.common import Types, WatermarkStrategy
    from pyflink.datastream.connectors.number_seq import NumberSequenceSource
    from pyflink.datastream.functions import FlatMapFunction

    class CountMax(FlatMapFunction):
        def open(self, runtime_context) -> None:
            self.count = 0
            self.sums: dict[int, int] = {}

        def flat_map(self, value):
            self.count += 1
            key, total = value
            if total > self.sums.get(key, -1):
                self.sums[key] = total
            return iter(())

        def close(self) -> None:
            import json as _json
            import os as _os
            import uuid as _uuid

            name = _os.path.join(out_dir, f"part-{_os.getpid()}-{_uuid.uuid4().hex}.json")
            with open(name, "w") as f:
                _json.dump({"count": self.count, "sums": self.sums}, f)

    pair = Types.TUPLE([Types.LONG(), Types.LONG()])
    started = time.time()
    (
        env.from_source(
            NumberSequenceSource(0, args.records - 1), WatermarkStrategy.no_watermarks(), "numbers"
        )
        .map(lambda i: (i % 1000, i), output_type=pair)
        .key_by(lambda x: x[0], key_type=Types.LONG())
        .reduce(lambda a, b: (a[0], a[1] + b[1]))
        .flat_map(CountMax(), output_type=pair)
        .print()
    )
    job_id = str(env.execute("peers-keyed-sum").get_job_id())
    finished = time.time()
    parts = []
    for name in glob.glob(os.path.join(out_dir, "part-*.json")):
        with open(name) as f:
            parts.append(json.load(f))
    count = sum(p["count"] for p in parts)
    sums = merge_max([p["sums"] for p in parts])
    outcome = {"check": check_sums(args.records, sums, count), "count": count, "job_id": job_id}
    return started, finished, outcome


def completed_checkpoints(job_id: str) -> int | None:
    """Checkpoints of job ``job_id`` completed, by PyFlink's log (None without a log)."""
    import pyflink

    logs = glob.glob(os.path.join(os.path.dirname(pyflink.__file__), "log", "*.log"))
    if not logs:
        return None
    found = 0
    for name in logs:
        with open(name, errors="replace") as f:
            found += sum("Completed checkpoint" in line and job_id in line for line in f)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=APIS, default="sql")
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--parallelism", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, default="none")
    args = parser.parse_args(argv)

    base: dict[str, Any] = {
        "engine": f"pyflink-{args.api}",
        "mode": args.mode,
        "parallelism": args.parallelism,
        "records": args.records,
    }
    scratch = tempfile.mkdtemp(prefix="peers-pyflink-")
    checkpoint_dir = os.path.join(scratch, "checkpoints") if args.mode != "none" else None
    out_dir = os.path.join(scratch, "out")
    os.makedirs(out_dir)
    try:
        env = _environment(args, checkpoint_dir)
        if args.api in ("sql", "sql-mini-batch"):
            started, finished, outcome = _sql(env, args)
        else:
            started, finished, outcome = _datastream(env, args, out_dir)
        job_id = outcome["job_id"]
        checkpoints = completed_checkpoints(job_id) if args.mode != "none" else 0
        emit(
            {
                **base,
                **outcome,
                "job_s": finished - started,
                "job_end": finished,
                "checkpoints": checkpoints,
            }
        )
    except Exception as exc:  # reported, never silently lost
        emit({**base, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]})
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
