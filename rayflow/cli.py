"""The ``rayflow`` command.

    rayflow run JOB.py [--address ADDR] [JOB ARGS...]   run a job script
    rayflow run --example NAME [JOB ARGS...]             run an example that ships with rayflow
    rayflow run --detach --address ADDR JOB.py           submit a job that outlives this process
    rayflow jobs list|status|cancel|checkpoints|remove   detached jobs on a cluster
    rayflow demo [--sink s3|files|postgres ...]          the guarantees, side by side
    rayflow checkpoints PATH [--endpoint-url URL ...]    list and inspect retained checkpoints
    rayflow savepoint JOB_ID DIR [--stop]                take a savepoint of a running job
    rayflow bench alignment [--quick] [--out DIR]        run a benchmark
    rayflow --version

Each subcommand is one ``_add_<name>(subparsers)`` function listed in
``_SUBCOMMANDS``; it registers its parser and sets ``handler`` to a function
``(args) -> exit code``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shlex
import sys
from collections.abc import Callable, Sequence

import rayflow
from rayflow import cluster_local, jobs_cli, savepoint_cli

__all__ = ["main", "build_parser"]

_DESCRIPTION = """\
rayflow: Flink-style exactly-once stream processing on Ray.

A job is a Python script that builds a pipeline on a StreamExecutionEnvironment
and calls execute(). It joins the Ray cluster named by --address or
$RAY_ADDRESS, and otherwise starts a local Ray in-process."""

_EPILOG = """\
examples:
  rayflow demo                                   3 guarantees, seeded kills, one table
  rayflow demo --sink files --records 1000000 --failures 5 --plot runs.png
  rayflow run --example wordcount                the smallest job that ships with rayflow
  rayflow run --example orders --orders 50000    an example job with its own args
  rayflow run --address auto my_job.py           join a running cluster (ray start --head)
  rayflow run my_job.py -- --address x           '--' passes the rest to the job unchanged
  rayflow run --detach --address HOST:6379 my_job.py   run it on the cluster, detached
  rayflow jobs status my-job --address HOST:6379       how that detached job is doing
  rayflow bench alignment --quick                checkpoint alignment benchmark (~2 min)

run 'rayflow COMMAND --help' for the options of one command."""


# --- rayflow run -------------------------------------------------------------------------


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    from rayflow import examples

    parser = subparsers.add_parser(
        "run",
        help="run a job script (python file) on Ray",
        description="Run a Python job script as __main__ with sys.argv = [JOB, *ARGS]. "
        "rayflow's own --address may come before JOB or right after it; every other "
        "argument, and everything after '--', goes to the job. While the job runs, rayflow "
        "prints its job id, where its checkpoints go and its restart strategy, and on a "
        "terminal a live status line. A job with checkpoints restarts forever by default "
        "(Flink's default: fixed delay, 1 s); bound it in the job with "
        "env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 10_000)). "
        "Failures no restart can fix (a read-only directory, a missing bucket or input "
        "file, rejected credentials) fail the job at once.",
    )
    parser.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster to join (sets RAY_ADDRESS for the job; "
        "default: $RAY_ADDRESS, else a local Ray)",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="submit the job to the cluster of --address and return once it started: it "
        "runs on after this process exits (see 'rayflow jobs'); the script stops at its "
        "execute() call",
    )
    parser.add_argument(
        "--example",
        metavar="NAME",
        choices=examples.names(),
        help=f"run an example that ships with rayflow instead of JOB: "
        f"{', '.join(examples.names())}",
    )
    parser.add_argument("job", metavar="JOB", nargs="?", help="path to the job's .py file")
    parser.add_argument(
        "job_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the job"
    )
    parser.set_defaults(handler=_run)


def _split_run_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Cut ``run ... JOB ARGS...`` after JOB: argparse parses the head, ARGS stay verbatim.

    (argparse would drop a ``--`` from ARGS, which must reach ``_split_job_args``.)
    """
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--address":
            i += 2
        elif token == "--example":
            return argv[: i + 2], argv[i + 2 :]
        elif token.startswith("--example="):
            return argv[: i + 1], argv[i + 1 :]
        elif token.startswith("-"):
            i += 1  # --address=ADDR, -h, '--' or a mistake: argparse decides
        else:
            return argv[: i + 1], argv[i + 1 :]
    return argv, []


def _split_job_args(args: list[str]) -> tuple[str | None, list[str], bool]:
    """Take rayflow's ``--address`` and ``--detach`` off the front of the job's arguments
    (stop at ``--``)."""
    address = None
    detach = False
    rest = list(args)
    while rest:
        head = rest[0]
        if head == "--":
            rest.pop(0)
            break
        if head == "--detach":
            detach = True
            rest.pop(0)
        elif head == "--address" and len(rest) >= 2:
            address = rest[1]
            del rest[:2]
        elif head.startswith("--address="):
            address = head.split("=", 1)[1]
            rest.pop(0)
        else:
            break
    return address, rest, detach


def _run(args: argparse.Namespace) -> int:
    from rayflow import detached, examples, progress
    from rayflow.errors import ConcurrentRunError, JobFailedError, JobResultLostError
    from rayflow.preflight import PreflightError
    from rayflow.ray_connect import NoRayClusterError, check_address

    job_args = list(args.job_args)
    if args.example is not None:
        if args.job is not None:
            job_args.insert(0, args.job)  # with --example, what follows goes to the job
        path = examples.path_of(args.example)
    elif args.job is None:
        return _fail("run", f"give a JOB file, or --example NAME ({', '.join(examples.names())})")
    else:
        path = args.job
    address, job_args, detach = _split_job_args(job_args)
    address = address or args.address
    detach = detach or args.detach
    if detach and (address or os.environ.get("RAY_ADDRESS") or "local") == "local":
        return _fail(
            "run",
            "--detach needs a running Ray cluster to outlive this process: give its --address "
            "(or set RAY_ADDRESS); start one with 'rayflow cluster up' or 'ray start --head'",
        )
    if not os.path.exists(path):
        hint = ""
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem in examples.names():
            hint = f"; to run the example that ships with rayflow: rayflow run --example {stem}"
        return _fail("run", f"no such job file: {path!r}{hint}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "__main__.py")):
        return _fail("run", f"{path!r} is a directory without a __main__.py")
    try:
        check_address(address or os.environ.get("RAY_ADDRESS") or "local")
    except NoRayClusterError as exc:
        return _fail("run", str(exc))
    if address:
        os.environ["RAY_ADDRESS"] = address
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *job_args]
    # like `python JOB.py`: the script's directory comes first on sys.path
    if os.path.isfile(path):
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    progress.enable(not detach)
    detached.request(detach)
    try:
        runpy.run_path(path, run_name="__main__")
    except detached.JobDetached as submitted:
        print(_detached_lines(submitted.job, address or os.environ["RAY_ADDRESS"]))
        return 0
    except (
        JobFailedError,
        JobResultLostError,
        PreflightError,
        NoRayClusterError,
        ConcurrentRunError,
    ) as exc:
        # rayflow's own verdict on the job says everything: no traceback into rayflow
        print(f"rayflow run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.enable(False)
        detached.request(False)
        sys.argv, sys.path[:] = saved_argv, saved_path
    if detach:
        return _fail("run", f"{path} ended without starting a job (no execute() call)")
    return 0


def _detached_lines(job, address: str) -> str:
    hint = f"--address {shlex.quote(address)}"
    name = shlex.quote(job.name)
    lines = [
        f"job {job.name!r} submitted detached (job id {job.job_id}, run {job.run_id})",
        f"  status:      rayflow jobs status {name} {hint}",
        f"  cancel:      rayflow jobs cancel {name} {hint}",
        f"  checkpoints: rayflow jobs checkpoints {name} {hint}",
    ]
    lines += [f"  sink {sink!r}: {words}" for sink, words in job.guarantees.items()]
    if job.replaced is not None:
        lines.append(
            f"  replaces the ended job of that name (run {job.replaced.get('run_id')}, "
            f"{job.replaced.get('state')})"
        )
    return "\n".join(lines)


# --- rayflow demo ------------------------------------------------------------------------


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    from rayflow import demo

    parser = subparsers.add_parser(
        "demo",
        help="the three delivery guarantees on one seeded run of the orders job",
        description="Run the orders pipeline (synthetic orders -> enrich -> running total "
        "per customer, one row per order) three times on a local Ray with the same seeded "
        "kills of its subtasks: checkpointing off with a NONE sink, AT_LEAST_ONCE and "
        "EXACTLY_ONCE. Then count each run's committed output by order id: one table of "
        "records expected, committed, lost and duplicated, checkpoints and throughput. "
        "Exits 1 if a run broke its guarantee (EXACTLY_ONCE lost or duplicated anything).",
    )
    demo.add_arguments(parser)
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from rayflow import demo
    from rayflow.ray_connect import NoRayClusterError

    try:
        return demo.run(args)
    except NoRayClusterError as exc:
        return _fail("demo", str(exc))


# --- rayflow checkpoints -----------------------------------------------------------------


def _add_checkpoints(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "checkpoints",
        help="list and inspect retained checkpoints",
        description="List the completed checkpoints of every run of a job (PATH is the job's "
        "checkpoint directory, e.g. /tmp/rayflow-checkpoints/<job>), of one run (PATH is a "
        "run-<...> directory in it) or inspect one (PATH ends in chk-<n>, or is a savepoint's "
        "directory): id, completion "
        "time, size, and the state size of every operator. PATH may also be the storage "
        "root (the jobs in it are listed), and an s3://bucket/prefix/... URI: credentials "
        "come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...).",
    )
    parser.add_argument(
        "path",
        help="a job's checkpoint directory, one of its run directories, one chk-<n>, or the "
        "storage root (default storage: /tmp/rayflow-checkpoints)",
    )
    parser.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="S3 endpoint for s3:// paths (default: $AWS_ENDPOINT_URL, else AWS)",
    )
    parser.add_argument(
        "--region",
        metavar="REGION",
        help="S3 region for s3:// paths (default: $AWS_REGION / $AWS_DEFAULT_REGION)",
    )
    parser.set_defaults(handler=_checkpoints)


def _checkpoints(args: argparse.Namespace) -> int:
    from rayflow.checkpoint.inspect import describe, storage_options_from_environment
    from rayflow.checkpoint.metadata import UnsupportedMetadataVersion

    if (args.endpoint_url or args.region) and not args.path.startswith("s3://"):
        return _fail("checkpoints", "--endpoint-url and --region are for s3:// paths")
    options = storage_options_from_environment(args.path, args.endpoint_url, args.region)
    try:
        print(describe(args.path, options))
    except (FileNotFoundError, UnsupportedMetadataVersion) as exc:
        return _fail("checkpoints", str(exc))
    except OSError as exc:  # the store refused or could not be reached
        return _fail("checkpoints", f"{args.path}: {exc}")
    return 0


# --- rayflow bench ------------------------------------------------------------------------


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from rayflow.bench import alignment

    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark that ships with rayflow",
        description="Run a benchmark on a local Ray (or --address) and write its results.",
    )
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    alignment.add_arguments(
        benchmarks.add_parser(
            "alignment",
            help="checkpoint alignment: every barrier mode, balanced and skewed",
            description=alignment.__doc__.splitlines()[0],
        )
    ).set_defaults(handler=_bench_alignment)


def _bench_alignment(args: argparse.Namespace) -> int:
    from rayflow.bench import alignment

    return alignment.run(args, "rayflow " + " ".join(shlex.quote(a) for a in sys.argv[1:]))


# --- registry ----------------------------------------------------------------------------

#: One registration function per subcommand, in the order ``--help`` lists them.
_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_run,
    _add_demo,
    _add_checkpoints,
    _add_bench,
    cluster_local.add_subcommand,
    jobs_cli.add_subcommand,
    savepoint_cli.add_subcommand,
)


def register_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add every rayflow subcommand to ``subparsers``."""
    for add in _SUBCOMMANDS:
        add(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayflow",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rayflow {rayflow.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    register_subcommands(subparsers)
    return parser


def _fail(command: str, message: str) -> int:
    print(f"rayflow {command}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rayflow`` console script; returns the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    job_args: list[str] | None = None
    if argv and argv[0] == "run":
        argv, job_args = _split_run_argv(argv)
    args = parser.parse_args(argv)
    if job_args is not None:
        args.job_args = job_args
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
