"""``rayflow jobs list | status | cancel | checkpoints | remove``: detached jobs on a cluster.

Every command joins the cluster of ``--address`` (default ``$RAY_ADDRESS``) and talks to
the job hosts of :mod:`rayflow.detached`. ``status`` exits 0 while the job runs or once
it finished, 1 when it failed or was cancelled; ``cancel`` returns once the job is
cleaned up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

__all__ = ["add_subcommand", "describe_status", "describe_list", "describe_checkpoints"]


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "jobs",
        help="list, inspect, cancel and remove detached jobs on a cluster",
        description="Detached jobs (started with 'rayflow run --detach') on the Ray cluster "
        "of --address (default: $RAY_ADDRESS). An ended job stays listed, with its outcome, "
        "until it is removed.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, help_text, needs_name in (
        ("list", "every detached job: name, state, run, restarts, last checkpoint", False),
        ("status", "one job: state, ids, times, restarts, failure, records, checkpoint", True),
        ("cancel", "cancel a job and wait until it is cleaned up", True),
        ("checkpoints", "statistics of a job's most recent checkpoints", True),
        ("remove", "forget an ended job (frees its name for the next --detach)", True),
    ):
        sub = actions.add_parser(action, help=help_text, description=help_text)
        if needs_name:
            sub.add_argument("name", metavar="NAME", help="the job name")
        sub.add_argument("--address", metavar="ADDR", help="Ray cluster (default: $RAY_ADDRESS)")
        if action == "cancel":
            sub.add_argument(
                "--timeout", type=float, default=120.0, metavar="S", help="default 120"
            )
        sub.set_defaults(handler=_main)


def _fail(message: str) -> int:
    print(f"rayflow jobs: error: {message}", file=sys.stderr)
    return 2


def _connect(address: str | None) -> str | None:
    """Join the cluster; an error message when there is none to join."""
    from rayflow.environment import ensure_ray
    from rayflow.ray_connect import NoRayClusterError

    address = address or os.environ.get("RAY_ADDRESS")
    if not address or address == "local":
        return "give the cluster's --address (or set RAY_ADDRESS): detached jobs run on a cluster"
    try:
        ensure_ray(address, log_to_driver=False)
    except NoRayClusterError as exc:
        return str(exc)
    return None


def _main(args: argparse.Namespace) -> int:
    from rayflow import detached

    problem = _connect(args.address)
    if problem is not None:
        return _fail(problem)
    if args.action == "list":
        print(describe_list(detached.list_jobs()))
        return 0
    try:
        job = detached.find(args.name)
    except detached.NoSuchDetachedJob as exc:
        return _fail(str(exc))
    if args.action == "status":
        status = job.status()
        print(describe_status(status))
        return 1 if status["state"] in ("FAILED", "CANCELED") else 0
    if args.action == "checkpoints":
        print(describe_checkpoints(job.checkpoints()))
        return 0
    if args.action == "cancel":
        try:
            state = job.cancel(args.timeout)
        except Exception as exc:  # noqa: BLE001 - a timeout, said in the job's words
            return _fail(str(getattr(exc, "cause", None) or exc).strip().splitlines()[0])
        print(f"job {args.name!r}: {state.value}")
        return 0
    try:
        job.remove()
    except detached.DetachedJobRunning as exc:
        return _fail(str(exc))
    print(f"job {args.name!r} removed")
    return 0


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    return f"{max(0.0, time.time() - ts):.0f}s ago"


def _last_checkpoint(status: dict[str, Any]) -> str:
    last = status.get("last_checkpoint")
    if not last:
        return "-"
    return f"{last['checkpoint_id']} ({_ago(last.get('trigger_time'))})"


def describe_list(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no detached jobs"
    table = [("NAME", "STATE", "RUN", "SUBMITTED", "RESTARTS", "LAST CHECKPOINT")]
    for r in rows:
        table.append(
            (
                r["name"],
                r["state"],
                r.get("run_id") or "-",
                _when(r.get("submitted_at")),
                str(r.get("restarts", "-")),
                _last_checkpoint(r),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table
    )


def describe_status(s: dict[str, Any]) -> str:
    lines = [
        f"job {s['name']!r}: {s['state']}",
        f"  job id {s['job_id']}, run {s['run_id']}",
        f"  submitted {_when(s.get('submitted_at'))}, started {_when(s.get('started_at'))}, "
        f"finished {_when(s.get('finished_at'))}",
        f"  attempt {s.get('attempt')}, restarts {s.get('restarts', 0)}",
        f"  last checkpoint {_last_checkpoint(s)}",
    ]
    for vertex, r in (s.get("records") or {}).items():
        lines.append(f"  {vertex}: {r['records_in']:,} records in, {r['records_out']:,} out")
    if s.get("failure"):
        lines.append(f"  last failure: {s['failure']}")
    if s.get("error"):
        lines.append(f"  outcome: {s['error']}")
    return "\n".join(lines)


def describe_checkpoints(checkpoints: list[dict[str, Any]]) -> str:
    if not checkpoints:
        return "no checkpoints yet"
    table = [("ID", "STATUS", "TRIGGERED", "DURATION", "SIZE", "FAILURE")]
    for c in checkpoints:
        status = c["status"]
        table.append(
            (
                str(c["checkpoint_id"]),
                getattr(status, "value", str(status)),
                _when(c.get("trigger_time")),
                f"{c.get('duration_s', 0.0) * 1000:.0f} ms",
                f"{c.get('size', 0):,} B",
                c.get("failure") or "",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table
    )
