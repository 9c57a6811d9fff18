"""Run the Kafka chaos checks over many seeds and print a line per seed.

    python tests/chaos/run_kafka_seeds.py --seeds 100 [--first 0] [--pipeline kafka|sum|both]
        [--records 60000] [--verbose]

Each seed fills a fresh input topic (3 partitions) of a Tansu broker started here
(tests/kafka_broker.py) with the values 0..n-1, runs the pipeline at parallelism 2 with
four kills drawn from the seed (``chaos_plan`` in tests/chaos/kafka_harness.py: one
between a checkpoint's completion and its commit; for the Kafka sink one inside a commit
after its records reached the broker), and checks what was committed: ``kafka`` (the
default: Kafka source -> Kafka sink, EXACTLY_ONCE) reads the output topic back with a
read_committed ``assign()`` consumer and wants every value once, nothing lost, nothing
duplicated, nothing left open; ``sum`` (Kafka source -> keyed running sum ->
CollectSink) wants each key's totals rising strictly to its exact sum. A seed whose job
and job master together restarted fewer than 3 times fails too (its kills did not all
happen). Exits 1 if any seed fails. Starts its own local Ray (never joins or stops another
one); about 20 s per seed on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # before ray.init: workers import tests.* by reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--pipeline", choices=["kafka", "sum", "both"], default="kafka")
    parser.add_argument("--records", type=int, default=None, help="input records per run")
    parser.add_argument("--verbose", action="store_true", help="show Ray worker logs")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    from tests.chaos.kafka_harness import N, chaos_plan, run_pipeline
    from tests.kafka_broker import start_broker

    n = args.records or N
    pipelines = ["kafka", "sum"] if args.pipeline == "both" else [args.pipeline]
    broker = start_broker()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    ray.init(
        address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=args.verbose
    )
    failed: list[str] = []
    runs = restarts = 0
    started = time.time()
    try:
        for seed in range(args.first, args.first + args.seeds):
            for pipeline in pipelines:
                runs += 1
                with tempfile.TemporaryDirectory(prefix="rayflow-kafka-chaos-") as storage:
                    try:
                        run = run_pipeline(
                            broker,
                            pipeline,
                            storage,
                            plan=chaos_plan(seed, pipeline, n),
                            seed=seed,
                            n=n,
                        )
                    except Exception:  # noqa: BLE001 - a failed seed, not a crashed runner
                        print(f"seed={seed} pipeline={pipeline} ERROR", flush=True)
                        traceback.print_exc()
                        failed.append(f"{seed}/{pipeline}")
                        continue
                if run.kills < 3:
                    run.problems.append(f"only {run.kills} kills happened (4 planned)")
                restarts += run.kills
                print(run.line(), flush=True)
                if not run.ok:
                    failed.append(f"{seed}/{pipeline}")
                    for failure in run.failures:
                        print(f"    failure: {failure}", flush=True)
    finally:
        ray.shutdown()
        broker.stop()
    print(
        f"{runs - len(failed)} passed, {len(failed)} failed ({restarts} kills, "
        f"{time.time() - started:.0f} s)" + (f": {' '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
