"""``rayflow savepoint JOB_ID DIRECTORY [--stop]``: take a savepoint of a running job
from any process that can join its Ray cluster (Flink's ``flink savepoint`` and
``flink stop --savepointPath``).

The job is found by the job id ``rayflow run`` prints (``job id 1a2b3c...``; also
``JobClient.job_id``): its job master is a named Ray actor. The savepoint goes into a new
directory under DIRECTORY (local, or ``s3://...`` with the job's checkpoint storage
options), whose path is printed; ``execute(restore_from=<it>)`` resumes from it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

__all__ = ["add_subcommand", "add_arguments", "find_job_master", "savepoint"]

_MASTER = re.compile(r"^rayflow:(?P<job>[^:]+):master:(?P<generation>\d+)$")


def find_job_master(job_id: str) -> Any:
    """The current job master of job ``job_id`` on the Ray this process is connected to
    (the newest generation: a master that took over from a lost one)."""
    import ray

    found = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        match = _MASTER.match(actor["name"])
        if match and match.group("job") == job_id:
            found.append((int(match.group("generation")), actor))
    if not found:
        raise LookupError(
            f"no running job with job id {job_id!r} on this Ray cluster (the job id is "
            "printed when the job starts: 'job id ...')"
        )
    _, actor = max(found, key=lambda item: item[0])
    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def savepoint(job_id: str, directory: str, stop: bool = False, timeout: float = 300.0) -> str:
    """Take a savepoint of running job ``job_id`` under ``directory`` (with ``stop``: and
    stop it there); returns the savepoint's directory."""
    import ray

    from rayflow.environment import JobWaitTimeout, request_savepoint
    from rayflow.runtime.job_master import _unwrap

    if "://" not in directory:
        directory = os.path.abspath(directory)
    master = find_job_master(job_id)
    try:
        return request_savepoint(master, directory, stop, timeout, f"job {job_id}")
    except JobWaitTimeout:
        raise
    except ray.exceptions.RayActorError as exc:
        raise LookupError(f"job {job_id}: its job master is gone ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the cause, not Ray's wrapper
        raise _unwrap(exc) from None


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``rayflow savepoint`` (a command group can register the same command
    under itself with :func:`add_arguments`)."""
    add_arguments(
        subparsers.add_parser(
            "savepoint",
            help="take a savepoint of a running job (--stop: and stop it)",
            description=__doc__.split("\n\n")[0].split(": ", 1)[1]
            + " "
            + __doc__.split("\n\n")[1].replace("\n", " "),
        )
    )


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments and handler of the savepoint command, on ``parser``."""
    parser.add_argument("job_id", metavar="JOB_ID", help="the job id printed when the job started")
    parser.add_argument("directory", metavar="DIRECTORY", help="where the savepoint goes")
    parser.add_argument(
        "--stop",
        action="store_true",
        help="stop the job with the savepoint: sources stop at its barrier, sinks commit, "
        "the job FINISHES",
    )
    parser.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster of the job (default: $RAY_ADDRESS, else 'auto')",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    parser.set_defaults(handler=_savepoint)
    return parser


def _savepoint(args: argparse.Namespace) -> int:
    import ray

    from rayflow.errors import SavepointError

    try:
        if not ray.is_initialized():
            address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        path = savepoint(args.job_id, args.directory, args.stop, args.timeout)
    except (LookupError, SavepointError, TimeoutError, ConnectionError) as exc:
        print(f"rayflow savepoint: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # what became of the request (withdrawn, or perhaps still taken), in its note
        notes = getattr(exc, "__notes__", None) or [
            "interrupted (a savepoint already requested may still be taken)"
        ]
        print(f"rayflow savepoint: {' '.join(notes)}", file=sys.stderr)
        return 130
    print(path)
    return 0
