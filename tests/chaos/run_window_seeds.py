"""Run the event-time window chaos job over many seeds and report each outcome.

    python tests/chaos/run_window_seeds.py --seeds 100 [--records 12000]

Each seed runs the tumbling event-time window sum (tests/chaos/window_harness.py) at
parallelism 1 (odd seeds) or 2 (even seeds), with a FaultPlan of kills drawn from the
seed (after N records, right after a snapshot, between a checkpoint's commit point and its
notification, and at parallelism 2 during alignment), and compares the committed window
sums and late side output with the direct computation. Exits 1 if any seed is wrong.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402

from rayflow.testing import FaultPlan, FaultPoint  # noqa: E402
from tests.chaos.window_harness import (  # noqa: E402
    build,
    expected,
    make_records,
    outcome,
    unique_job,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--records", type=int, default=12_000)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--rate", type=float, default=20_000)
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    bad = 0
    killed_enough = 0
    print(
        f"{'seed':>4}  {'p':>1}  {'restarts':>8}  {'windows':>7}  {'late':>4}  {'time':>6}  verdict"
    )
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        parallelism = 1 if seed % 2 else 2
        table = make_records(args.records, seed)
        sums, late = expected(table)
        points = [FaultPoint.AFTER_RECORDS, FaultPoint.AFTER_SNAPSHOT, FaultPoint.BEFORE_NOTIFY]
        if parallelism > 1:  # at parallelism 1 no subtask has two inputs to align
            points.append(FaultPoint.DURING_ALIGNMENT)
        plan = FaultPlan.random(
            seed,
            kills=args.kills,
            parallelism=parallelism,
            max_records=args.records // (parallelism * (args.kills + 1)),
            points=points,
        )
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as storage:
            env, sums_sink, late_sink = build(
                table, parallelism, storage, plan=plan, rate=args.rate
            )
            try:
                result = env.execute(unique_job(f"window-seed-{seed}"))
            except Exception as exc:  # noqa: BLE001 - a failed seed is reported, not raised
                bad += 1
                print(f"{seed:>4}  {parallelism:>1}  job failed: {type(exc).__name__}: {exc}")
                continue
            got = outcome(result, sums_sink, late_sink)
        twice = sum(1 for n in got.windows_emitted.values() if n > 1)
        ok = got.sums == sums and twice == 0 and got.late == late
        bad += not ok
        killed_enough += result.restarts >= args.kills
        verdict = (
            "ok"
            if ok
            else (
                f"WRONG: {len(set(sums) ^ set(got.sums))} windows differ, {twice} fired twice, "
                f"late {sum(got.late.values())} vs {sum(late.values())}"
            )
        )
        print(
            f"{seed:>4}  {parallelism:>1}  {result.restarts:>8}  {len(got.sums):>7}  "
            f"{sum(got.late.values()):>4}  {time.monotonic() - started:>5.1f}s  {verdict}",
            flush=True,
        )
    print(
        f"{args.seeds - bad} of {args.seeds} seeds exactly once; {killed_enough} restarted "
        f">= {args.kills} times"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
