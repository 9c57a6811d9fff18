"""Run the PostgreSQL sinks' chaos checks over many seeds and print a line per seed.

    python tests/chaos/run_pg_seeds.py --seeds 100 [--first 0] [--sink both|exactly-once|upsert]

Each seed runs the keyed running sum (parallelism 2) into a fresh table of a throwaway
PostgreSQL server started here (tests/pg_server.py; as root it runs as the ``postgres``
OS user), with four kills drawn from the seed (``chaos_plan`` in
tests/chaos/test_postgres_sink_chaos.py: one of them between a checkpoint's completion
and its notification, one during recovery), and checks what was committed: PostgresSink
(EXACTLY_ONCE) holds every running total once and each key's exact sum; the upsert sink
holds one row per key with its exact sum; no prepared transaction is left. Exits 1 if
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
    parser.add_argument(
        "--sink",
        choices=["both", "exactly-once", "upsert"],
        default="both",
        help="which sink each seed runs (default both, one after the other)",
    )
    parser.add_argument("--records", type=int, default=None, help="input records per run")
    parser.add_argument("--verbose", action="store_true", help="show Ray worker logs")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    from tests.chaos.test_postgres_sink_chaos import (
        N,
        chaos_plan,
        check_exactly_once,
        check_upsert,
        run_keyed_sum_to_postgres,
    )
    from tests.pg_server import start_server

    n = args.records or N
    kinds = {"both": [False, True], "exactly-once": [False], "upsert": [True]}[args.sink]
    server = start_server()
    # Workers import the test helpers (tests.*) by reference, wherever this runs from: the
    # local Ray started below inherits this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    ray.init(
        address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=args.verbose
    )
    failed: list[tuple[int, str]] = []
    runs = restarts = 0
    started = time.time()
    try:
        for seed in range(args.first, args.first + args.seeds):
            db = server.create_database()
            try:
                for upsert in kinds:
                    kind = "upsert" if upsert else "exactly-once"
                    runs += 1
                    with tempfile.TemporaryDirectory(prefix="rayflow-pg-chaos-") as storage:
                        try:
                            run = run_keyed_sum_to_postgres(
                                db,
                                storage,
                                upsert=upsert,
                                plan=chaos_plan(seed, n, upsert=upsert),
                                seed=seed,
                                n=n,
                            )
                        except Exception as exc:  # noqa: BLE001 - a failed job fails the seed
                            failed.append((seed, kind))
                            print(
                                f"FAIL seed={seed} sink={kind} job: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}",
                                flush=True,
                            )
                            if args.verbose:
                                traceback.print_exc()
                            continue
                    restarts += run.restarts
                    try:
                        (check_upsert if upsert else check_exactly_once)(run)
                        verdict = "OK"
                    except AssertionError as exc:
                        failed.append((seed, kind))
                        verdict = f"FAIL {str(exc).splitlines()[0] if str(exc) else 'assertion'}"
                    print(f"{verdict:4} {run.line()}", flush=True)
            finally:
                server.drop_database(db.name)
    finally:
        ray.shutdown()
        server.stop()
    total = time.time() - started
    print(
        f"summary: {runs - len(failed)}/{runs} runs right ({args.seeds} seeds, "
        f"{'+'.join('upsert' if u else 'exactly-once' for u in kinds)}), {restarts} "
        f"restarts in all, {total:.0f} s ({total / max(runs, 1):.1f} s/run)"
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
