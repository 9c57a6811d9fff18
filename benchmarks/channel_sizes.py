"""Channel and message sizes: the peer workload's vectorized keyed sum under each.

One process starts a local Ray as rayflow does when none runs (``ensure_ray``), runs a
200k-record warm-up job, then every variant in turn, ``--rounds`` times, ``--gap-s``
apart (so each job finds Ray's idle workers up), and prints records/s of each job's
``JobResult.duration_s`` and their medians. A variant is ``MESSAGE/CHANNEL`` in MiB:
``env.set_output_buffer_size(MESSAGE)`` and ``env.set_buffer_limits(channel_bytes=
CHANNEL)``; ``auto`` leaves both to rayflow (``channels.channel_bytes_for``).

Benchmarks are never timed assertions. Run from the repository's root, holding the
machine-wide benchmark lock::

    flock /tmp/bench.lock python benchmarks/channel_sizes.py --variants 1/1,4/16,auto
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import peers  # noqa: E402
import ray.cloudpickle as cloudpickle  # noqa: E402

from rayflow.environment import ensure_ray  # noqa: E402

__all__ = ["main", "parse_variant"]

MIB = 1 << 20


def parse_variant(text: str) -> tuple[int, int] | None:
    """``"4/16"`` -> (4 MiB, 16 MiB); ``"auto"`` -> None (rayflow's own sizes)."""
    if text == "auto":
        return None
    try:
        message, channel = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a variant is MESSAGE/CHANNEL in MiB or 'auto', got {text!r}"
        ) from None
    if message < 1 or channel < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1 MiB, got {text!r}")
    return message * MIB, channel * MIB


def _label(variant: tuple[int, int] | None) -> str:
    return "auto" if variant is None else f"{variant[0] // MIB}/{variant[1] // MIB}"


def _run(variant: tuple[int, int] | None, records: int, mode: peers.Mode, storage: str) -> float:
    config = peers.Config(peers.Engine.RAYFLOW_VECTORIZED, mode, 1, records)
    env = peers._rayflow_env(config, storage, None if variant is None else variant[1])
    if variant is not None:
        env.set_output_buffer_size(variant[0])
    result = env.execute(f"channel-sizes-{time.time_ns()}")
    return records / result.duration_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=40_000_000)
    parser.add_argument(
        "--variants",
        type=lambda s: [parse_variant(v) for v in s.split(",")],
        default=[(MIB, MIB), None],
        help="comma-separated MESSAGE/CHANNEL in MiB, or auto (default: 1/1,auto)",
    )
    parser.add_argument("--mode", choices=[m.value for m in peers.Mode], default="exactly-once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=6.0)
    args = parser.parse_args(argv)
    cloudpickle.register_pickle_by_value(peers)  # the job's functions travel with it
    ensure_ray("local")
    storage = tempfile.mkdtemp(prefix="rayflow-channel-sizes-")
    mode = peers.Mode(args.mode)
    _run(None, 200_000, mode, storage)  # warm-up
    rates: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for variant in args.variants:
            time.sleep(args.gap_s)
            rate = _run(variant, args.records, mode, storage)
            rates.setdefault(_label(variant), []).append(rate)
            print(f"round {round_ + 1} {_label(variant)}: {rate / 1e6:.2f} M records/s", flush=True)
    print(f"\nvectorized keyed sum, {args.mode}, p=1, {args.records:,} records")
    print("| message / channel MiB | runs (M records/s of duration_s) | median |")
    print("|---|---|---:|")
    for label, values in rates.items():
        runs = ", ".join(f"{v / 1e6:.2f}" for v in values)
        print(f"| {label} | {runs} | {statistics.median(values) / 1e6:.2f} M |")


if __name__ == "__main__":
    main()
