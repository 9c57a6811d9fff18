"""Run the S3 exactly-once chaos check over many seeds and print a line per seed.

    python tests/chaos/run_s3_seeds.py --seeds 20

Each seed runs the keyed running sum into the S3 multipart sink (EXACTLY_ONCE,
parallelism 2) with four kills (three drawn from the seed, then a kill between a
checkpoint's completion and its notification), reads back what was committed from a
moto server started here, and checks it against the exact output: every running
total once, every key's last total exact, no multipart upload left open. Exits 1 if
any seed fails. Starts its own local Ray (never joins or stops another one).
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
    parser.add_argument("--records", type=int, default=None, help="input records per run")
    parser.add_argument("--verbose", action="store_true", help="show Ray worker logs")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    from tests.chaos.test_s3_sink_chaos import (
        N,
        chaos_plan,
        check_exactly_once,
        run_keyed_sum_to_s3,
    )
    from tests.s3_server import start_server

    n = args.records or N
    server = start_server()
    # Workers import the test helpers (tests.*) by reference, wherever this runs from: the
    # local Ray started below inherits this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    ray.init(
        address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=args.verbose
    )
    failed: list[int] = []
    restarts = 0
    started = time.time()
    try:
        for seed in range(args.first, args.first + args.seeds):
            bucket = server.create_bucket()
            with tempfile.TemporaryDirectory(prefix="rayflow-s3-chaos-") as storage:
                try:
                    run = run_keyed_sum_to_s3(
                        server, bucket, storage, plan=chaos_plan(seed, n), seed=seed, n=n
                    )
                except Exception as exc:  # noqa: BLE001 - a failed job is a failed seed
                    failed.append(seed)
                    print(f"seed={seed} FAIL job: {type(exc).__name__}: {exc}", flush=True)
                    if args.verbose:
                        traceback.print_exc()
                    continue
            restarts += run.restarts
            try:
                check_exactly_once(run)
                verdict = "OK"
            except AssertionError as exc:
                failed.append(seed)
                verdict = f"FAIL {str(exc).splitlines()[0] if str(exc) else 'assertion'}"
            print(f"{verdict:4} {run.line()}", flush=True)
    finally:
        ray.shutdown()
        server.stop()
    total = time.time() - started
    print(
        f"summary: {args.seeds - len(failed)}/{args.seeds} seeds exactly once, "
        f"{restarts} restarts in all, {total:.0f} s ({total / max(args.seeds, 1):.1f} s/seed)"
        + (f"; FAILED seeds: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
