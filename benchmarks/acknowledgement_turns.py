"""What the turns a subtask gives the loop before processing a message cost, in process.

A real subtask (the actor class, no Ray) with one input channel and one operator that
passes every batch on to an output channel at a buffer timeout of 0 (eager) is fed N
one-row batches by an eager output channel whose pushes are tasks on the same loop (a
push returns once the gate admitted the message, as an acknowledgement would). Timed:
the first push to the end of ``run()``; reported per message, with the turns
(``_acknowledgements_out`` as on main) and without them (replaced by a no-op: the loop
before the change), the two taking turns, ``--rounds`` times each. Without Ray there
is no Ray reply to hurry, so this is the cost of the turns alone (and of what the loop
runs in them), not their gain.

    flock /tmp/bench.lock python benchmarks/acknowledgement_turns.py [--messages N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))

import rayflow.runtime.subtask as subtask_module  # noqa: E402
from rayflow.plan.partitioners import PartitionerSpec, PartitionKind  # noqa: E402
from rayflow.plan.physical import OperatorSpec, VertexSpec  # noqa: E402
from rayflow.runtime.channels import OutputChannel  # noqa: E402
from rayflow.runtime.events import EndOfInput  # noqa: E402
from rayflow.runtime.operators import Operator, factory  # noqa: E402
from rayflow.runtime.subtask import OutputDeployment, Subtask, SubtaskDeployment  # noqa: E402

__all__ = ["main"]

ORIGINAL = subtask_module._acknowledgements_out


class Passthrough(Operator):
    def process(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        return [batch]


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Task:
        return asyncio.ensure_future(self.fn(*args))


class _Sink:
    """The downstream end: admits every push at once."""

    def __init__(self) -> None:
        self.messages = 0
        self.push = _Remote(self._push)

    async def _push(self, channel: int, seq: int, attempt: int, message: Any) -> None:
        self.messages += 1


class _Handle:
    def __init__(self, sub: Any) -> None:
        self.push = _Remote(sub.push)


async def _no_turns() -> None:
    return None


async def _round(messages: int, window: int, turns: bool) -> float:
    subtask_module._acknowledgements_out = ORIGINAL if turns else _no_turns
    vertex = VertexSpec(
        1, "pass", 1, 128, operators=[OperatorSpec("pass", "pass", factory(Passthrough))]
    )
    sink = _Sink()
    sub = Subtask(
        SubtaskDeployment(
            job_name="bench",
            vertex=vertex,
            index=0,
            attempt=0,
            num_input_channels=1,
            outputs=[OutputDeployment(PartitionerSpec(PartitionKind.FORWARD), [(sink, 0)])],
            channel_capacity=window,
            send_window=window,
            buffer_timeout_s=0.0,
            latency_tracking_interval_ms=0,
        )
    )
    sub.metrics = _metrics
    sender = OutputChannel(_Handle(sub), 0, 0, window, False, 1 << 20, 1 << 20, True)
    batch = pa.record_batch([pa.array([1], pa.int64())], ["value"])
    started = time.perf_counter()
    running = asyncio.ensure_future(sub.run())
    for _ in range(messages):
        await sender.write(batch)
    await sender.send(EndOfInput())
    await sender.flush()
    await running
    return time.perf_counter() - started


async def _metrics() -> dict:
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(args.rounds):
            for turns in (False, True):
                loop = asyncio.new_event_loop()
                try:
                    times[turns].append(
                        loop.run_until_complete(_round(args.messages, args.window, turns))
                    )
                finally:
                    loop.close()
    finally:
        subtask_module._acknowledgements_out = ORIGINAL
    out = sys.__stdout__  # a subtask captures ``sys.stdout`` (rayflow.runtime.output)
    print(
        f"{args.messages} one-row batches, window {args.window}, {args.rounds} rounds each",
        file=out,
    )
    for turns in (False, True):
        per = [t / args.messages * 1e6 for t in times[turns]]
        label = "with the turns" if turns else "without"
        print(
            f"  {label:>15}: median {statistics.median(per):.2f} us/message "
            f"(min {min(per):.2f}, max {max(per):.2f})",
            file=out,
        )


if __name__ == "__main__":
    main()
