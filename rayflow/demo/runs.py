"""One run of the demo: the orders pipeline under one delivery guarantee, with the seeded
kills, watched while it goes, and what it committed counted by order id.

The three configurations (:class:`Guarantee`):

- ``NONE``: checkpointing off, the sink asked for ``DeliveryGuarantee.NONE``. Without a
  checkpoint there is nothing to restart from, so as in Flink the job does not restart:
  the first kill fails it, and what the sink had published stays. At most once.
- ``AT_LEAST_ONCE``: ``CheckpointingMode.AT_LEAST_ONCE`` (barriers are not aligned) and
  an ``AT_LEAST_ONCE`` sink, which publishes at every barrier; each kill restarts the job
  from the last completed checkpoint, and what was published after it is written again.
- ``EXACTLY_ONCE``: ``CheckpointingMode.EXACTLY_ONCE`` and an ``EXACTLY_ONCE`` sink: output
  is published by two-phase commit when the checkpoint that covers it completes.

Every run gets the same :meth:`rayflow.testing.FaultPlan.seeded_kills` plan: in attempt
``a``, one ``RunningTotal`` subtask is SIGKILLed after a seeded number of input records.
"""

from __future__ import annotations

import enum
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from rayflow.config import CheckpointingMode, RestartStrategies
from rayflow.demo.targets import Target
from rayflow.environment import JobResult, StreamExecutionEnvironment
from rayflow.errors import JobFailedError
from rayflow.guarantees import DeliveryGuarantee
from rayflow.jobs.orders import build_kafka_order_stream, build_order_stream
from rayflow.progress import ProgressReporter
from rayflow.sink import RollingPolicy
from rayflow.testing import FaultPlan, inject_faults

__all__ = ["Guarantee", "DemoSettings", "OrderCount", "RunReport", "count_orders", "run_guarantee"]

#: The keyed step of the orders pipeline, where the kills land.
KILLED_VERTEX = "RunningTotal"


class Guarantee(enum.Enum):
    """One demo configuration: a sink delivery guarantee and the checkpointing it needs."""

    NONE = "NONE"
    AT_LEAST_ONCE = "AT_LEAST_ONCE"
    EXACTLY_ONCE = "EXACTLY_ONCE"

    @property
    def delivery(self) -> DeliveryGuarantee:
        return DeliveryGuarantee[self.value]

    @property
    def checkpointing(self) -> CheckpointingMode | None:
        """The checkpointing mode of the run (None: checkpointing off)."""
        if self is Guarantee.NONE:
            return None
        return CheckpointingMode[self.value]

    @property
    def label(self) -> str:
        return "NONE (checkpoints off)" if self is Guarantee.NONE else self.value


@dataclass(frozen=True)
class DemoSettings:
    records: int
    failures: int
    seed: int
    parallelism: int = 2
    customers: int = 1_000
    checkpoint_ms: int = 200
    records_per_second: float | None = None
    rollover_s: float = 0.1
    restart_delay_ms: int = 100
    #: holds the checkpoints (and, for --sink files, the output)
    workdir: Path = Path(tempfile.gettempdir()) / "rayflow-demo"
    #: where the orders come from with --source kafka (a ``rayflow.demo.kafka.KafkaOrders``);
    #: None: the generator
    kafka_orders: Any = None

    @property
    def batch_size(self) -> int:
        """Rows per source batch: about 50 batches per source subtask, 100..1,000 rows."""
        return min(1_000, max(100, self.records // (self.parallelism * 50)))

    def fault_plan(self) -> FaultPlan:
        """The kills every run gets (the same arguments, so the same kills)."""
        # RunningTotal subtasks share the orders by customer: about records/p each; aim
        # inside 80% of that, so an unlucky split still reaches every threshold
        per_subtask = max(1, int(self.records / self.parallelism * 0.8))
        return FaultPlan.seeded_kills(
            self.seed, self.failures, self.parallelism, per_subtask, vertex=KILLED_VERTEX
        )


@dataclass(frozen=True)
class OrderCount:
    """What a run committed, counted by order id against the ids 0..expected-1."""

    expected: int
    committed: int
    lost: int  # expected ids that no committed row carries
    duplicated: int  # committed rows beyond the first of their id
    unexpected: int  # committed rows whose id is no order of the input (never expected)


def count_orders(ids: np.ndarray, expected: int) -> OrderCount:
    ids = np.asarray(ids, dtype=np.int64)
    valid = ids[(ids >= 0) & (ids < expected)]
    distinct = int(np.unique(valid).size)
    return OrderCount(
        expected=expected,
        committed=int(ids.size),
        lost=expected - distinct,
        duplicated=int(valid.size) - distinct,
        unexpected=int(ids.size - valid.size),
    )


@dataclass
class RunReport:
    guarantee: Guarantee
    count: OrderCount
    seconds: float
    kills_planned: int
    restarts: int
    failed: str | None = None  # why the job failed, None when it finished
    checkpoints_completed: int = 0
    mean_checkpoint_s: float | None = None
    #: (seconds since the run started, rows committed) while it ran
    samples: list[tuple[float, int]] = field(default_factory=list)

    @property
    def kills_fired(self) -> int:
        # a job that failed did so at its attempt's kill; every restart followed one
        return self.restarts + (1 if self.failed is not None else 0)

    @property
    def largest_dip(self) -> int:
        """The most committed rows seen to vanish between two samples (a replay that
        rewrote a published part with less in it); 0 when the count only grew."""
        dips = [max(0, a[1] - b[1]) for a, b in zip(self.samples, self.samples[1:])]
        return max(dips, default=0)

    @property
    def throughput(self) -> float:
        """Distinct orders committed per second of the run (start-up and restarts included)."""
        distinct = self.count.expected - self.count.lost
        return distinct / self.seconds if self.seconds > 0 else 0.0

    def broken(self) -> str | None:
        """How this run broke its guarantee, None when it held."""
        c = self.count
        if c.unexpected:
            return f"{c.unexpected:,} committed rows are no order of the input"
        if self.guarantee is Guarantee.EXACTLY_ONCE:
            if self.failed is not None:
                return f"the job failed: {self.failed}"
            if c.lost or c.duplicated:
                return f"{c.lost:,} lost and {c.duplicated:,} duplicated"
            if self.largest_dip:
                return f"{self.largest_dip:,} committed rows vanished while it ran"
        if self.guarantee is Guarantee.AT_LEAST_ONCE:
            if self.failed is not None:
                return f"the job failed: {self.failed}"
            if c.lost:
                return f"{c.lost:,} lost"
        if self.guarantee is Guarantee.NONE and c.duplicated:
            return f"{c.duplicated:,} duplicated"
        return None


class _Progress:
    """One line per run: rewritten in place on a terminal, else printed at the end."""

    def __init__(self, out: TextIO, label: str, expected: int) -> None:
        self.out = out
        self.label = label
        self.expected = expected
        self.live = out.isatty()
        self.last = ""

    def update(self, seconds: float, committed: int, state: str, detail: str = "") -> None:
        self.last = (
            f"  {self.label:<22} {seconds:5.1f} s  {state:<10} "
            f"committed {committed:>10,} of {self.expected:,}"
        )
        if self.live:
            line = self.last + (f" | {detail}" if detail else "")
            width = max(40, shutil.get_terminal_size((120, 20)).columns - 1)
            self.out.write("\r" + line[:width] + "\x1b[K")
            self.out.flush()

    def done(self) -> None:
        self.out.write(("\r" + self.last + "\x1b[K\n") if self.live else self.last + "\n")
        self.out.flush()


def _state(client) -> str:
    try:
        return client.get_job_status().value
    except Exception:  # noqa: BLE001 - the job master is restarting or gone: keep polling
        return "..."


def run_guarantee(
    target: Target,
    guarantee: Guarantee,
    settings: DemoSettings,
    progress: TextIO | None = None,
    poll_s: float = 0.2,
) -> RunReport:
    """Run the orders pipeline once under ``guarantee`` into ``target``; count the result.
    The progress line goes to ``progress`` (default: ``sys.stderr``)."""
    run = f"{guarantee.value.lower().replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    env = StreamExecutionEnvironment.get_execution_environment()
    if settings.kafka_orders is not None:
        source = settings.kafka_orders.source(settings.batch_size, settings.records_per_second)
        stream = build_kafka_order_stream(env, source, settings.parallelism)
    else:
        stream = build_order_stream(
            env,
            settings.records,
            settings.customers,
            settings.parallelism,
            batch_size=settings.batch_size,
            records_per_second=settings.records_per_second,
        )
    mode = guarantee.checkpointing
    if mode is not None:
        env.enable_checkpointing(settings.checkpoint_ms, mode)
        env.get_checkpoint_config().set_checkpoint_storage(str(settings.workdir / "checkpoints"))
        env.set_restart_strategy(
            RestartStrategies.fixed_delay_restart(settings.failures + 3, settings.restart_delay_ms)
        )
    # checkpointing off: the default restart strategy, Flink's, is not to restart
    plan = settings.fault_plan()
    inject_faults(env, plan)
    rolling = RollingPolicy(max_part_size=None, rollover_interval_s=settings.rollover_s)
    sink = target.sink(run, guarantee.delivery, rolling)
    stream.sink_to(sink, "OrdersOut").uid("orders-out")

    line = _Progress(progress or sys.stderr, guarantee.label, settings.records)
    rates = ProgressReporter(live=False)  # the job's own figures for the live line
    detail, detail_at = "", 0.0
    samples: list[tuple[float, int]] = []
    outcome: dict[str, object] = {}
    started = time.perf_counter()
    client = env.execute_async(f"rayflow-demo-{run}")

    def wait() -> None:
        try:
            outcome["result"] = client.wait()
        except JobFailedError as exc:
            outcome["failed"] = str(exc).strip().splitlines()[0]
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller
            outcome["error"] = exc

    waiter = threading.Thread(target=wait, name=f"demo-{run}", daemon=True)
    waiter.start()
    try:
        while waiter.is_alive():
            now = time.perf_counter() - started
            try:
                committed = target.committed(run)
            except Exception:  # noqa: BLE001 - a failed look only skips this sample
                committed = None
            if line.live and now - detail_at >= 1.0:
                detail_at = now
                snapshot = client._progress_snapshot()
                if snapshot is not None:
                    parts = rates.details(snapshot, client._graph, time.time())
                    detail = " | ".join(parts)
            if committed is not None:
                samples.append((now, committed))
                line.update(now, committed, _state(client), detail)
            waiter.join(poll_s)
    except BaseException:  # Ctrl-C: cancel the job (its transactions cleaned up), then stop
        client.cancel(timeout=60)
        raise
    seconds = time.perf_counter() - started
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    count = count_orders(target.order_ids(run), settings.records)
    samples.append((seconds, count.committed))
    result: JobResult | None = outcome.get("result")  # type: ignore[assignment]
    failed: str | None = outcome.get("failed")  # type: ignore[assignment]
    line.update(seconds, count.committed, "FAILED" if failed else "FINISHED")
    line.done()
    report = RunReport(
        guarantee=guarantee,
        count=count,
        seconds=seconds,
        kills_planned=len(plan.faults),
        restarts=result.restarts if result is not None else 0,
        failed=failed,
        samples=samples,
    )
    if result is not None:
        summary = result.checkpoint_summary
        report.checkpoints_completed = int(summary.get("counts", {}).get("COMPLETED", 0))
        report.mean_checkpoint_s = summary.get("mean_duration_s")
    return report
