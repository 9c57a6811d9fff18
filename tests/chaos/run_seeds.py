"""Run the keyed running-sum chaos job over many seeds and report each outcome.

    python tests/chaos/run_seeds.py --seeds 20 [--records 1000000] [--mode exactly-once]

Each seed draws a FaultPlan with one kill per attempt at each of the protocol's points
(after N records, during alignment, right after a snapshot, between a checkpoint's
commit point and its notification), runs the job on a local Ray, and compares the
committed output with the exact expected output. Exits 1 if any seed is wrong.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402

from rayflow.config import CheckpointingMode  # noqa: E402
from rayflow.testing import FaultPlan  # noqa: E402
from tests.chaos.harness import (  # noqa: E402
    build_keyed_sum,
    expected_rows,
    expected_sums,
    outcome,
    unique_job,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument(
        "--mode", choices=[m.value for m in CheckpointingMode], default="exactly-once"
    )
    args = parser.parse_args()
    mode = CheckpointingMode(args.mode)
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    exact = expected_sums(args.records)
    rows = expected_rows(args.records, args.parallelism, 5000)
    bad = 0
    print(
        f"{'seed':>4}  {'restarts':>8}  {'checkpoints':>11}  {'rows':>9}  {'sums':>5}  "
        f"{'time':>6}  verdict"
    )
    with tempfile.TemporaryDirectory() as storage:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            plan = FaultPlan.random(
                seed, kills=args.kills, parallelism=args.parallelism, max_records=args.records // 10
            )
            env, sink = build_keyed_sum(
                args.records, args.parallelism, 5000, mode=mode, storage=storage, plan=plan
            )
            started = time.time()
            result = env.execute(unique_job(f"seed-{seed}"))
            got = outcome(result, sink)
            sums_ok = got.sums == exact
            if mode is CheckpointingMode.EXACTLY_ONCE:
                ok = sums_ok and got.rows == rows
            else:
                ok = all(got.sums[k] >= exact[k] for k in exact) and got.rows >= rows
            bad += not ok
            print(
                f"{seed:>4}  {result.restarts:>8}  {len(result.completed_checkpoints):>11}  "
                f"{got.rows:>9}  {'ok' if sums_ok else 'BAD':>5}  "
                f"{time.time() - started:>5.1f}s  {'PASS' if ok else 'FAIL'}",
                flush=True,
            )
    print(f"{args.seeds - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
