"""Exactly-once *effect* on S3 under seeded kills: the keyed running sum written by the S3
multipart sink, read back from moto's server and compared with the exact output.

Each EXACTLY_ONCE run injects four faults, one per attempt: three drawn from the seed
among the data-plane and sink points (after N records, during alignment, right after a
snapshot, before / after pre-commit, during commit) and a kill of a sink subtask between
a checkpoint's completion and its notification (BEFORE_NOTIFY), where the only record of
the pre-committed uploads is the checkpoint. The committed objects must hold every running
total exactly once, the last total of every key must be its exact sum, and no multipart
upload may be left open. AT_LEAST_ONCE loses nothing; NONE without checkpoints promises
nothing but whole objects (their counts are printed).

``tests/chaos/run_s3_seeds.py`` runs the same check over many seeds.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import pytest

import tests.s3_server as _s3_fixtures
from rayflow import DeliveryGuarantee
from rayflow.config import CheckpointingMode
from rayflow.sink import RollingPolicy
from rayflow.testing import Fault, FaultPlan, FaultPoint
from sinks.s3 import S3FileSink
from tests.chaos.harness import build_keyed_sum, expected_rows, expected_sums, unique_job
from tests.s3_server import S3Server

# The shared moto server fixtures (see tests/s3_server.py).
s3_server = _s3_fixtures.s3_server
s3_bucket = _s3_fixtures.s3_bucket

N = 300_000
P = 2
BATCH = 5000
RATE = 100_000  # records per second per source subtask: a few checkpoints per attempt
SINK_VERTEX = "committed"

DRAWN_POINTS = [
    FaultPoint.AFTER_RECORDS,
    FaultPoint.DURING_ALIGNMENT,
    FaultPoint.AFTER_SNAPSHOT,
    FaultPoint.SINK_BEFORE_PRE_COMMIT,
    FaultPoint.SINK_AFTER_PRE_COMMIT,
    FaultPoint.SINK_DURING_COMMIT,
]
_SINK_POINTS = {
    FaultPoint.SINK_BEFORE_PRE_COMMIT,
    FaultPoint.SINK_AFTER_PRE_COMMIT,
    FaultPoint.SINK_DURING_COMMIT,
}


def chaos_plan(seed: int, n: int = N) -> FaultPlan:
    """Four kills, one per attempt 0..3, drawn from ``seed``; the last one BEFORE_NOTIFY.

    Three points are drawn (``FaultPlan.random`` over a seeded choice of points); a
    records-bound fault goes to attempt 0 (later attempts resume near the end and might
    never reach the count), and faults of later attempts fire at their first checkpoint
    (every attempt takes at least its final one), so each planned kill happens.
    """
    rng = random.Random(seed)
    points = rng.sample(DRAWN_POINTS, 3)
    drawn = FaultPlan.random(
        seed, kills=3, parallelism=P, max_records=n // (3 * P), points=points
    ).faults
    drawn.sort(key=lambda f: (f.point is not FaultPoint.AFTER_RECORDS, f.attempt))
    faults = []
    for attempt, fault in enumerate(drawn):
        fault = replace(
            fault,
            attempt=attempt,
            checkpoint=fault.checkpoint if attempt == 0 else 1,
            vertex=SINK_VERTEX if fault.point in _SINK_POINTS else None,
        )
        if fault.point is FaultPoint.AFTER_RECORDS:
            fault = replace(fault, records=max(fault.records, BATCH))
        faults.append(fault)
    faults.append(
        Fault(
            FaultPoint.BEFORE_NOTIFY,
            attempt=3,
            vertex=SINK_VERTEX,
            subtask=rng.randrange(P),
            checkpoint=1,
        )
    )
    return FaultPlan(faults)


@dataclass
class ChaosRun:
    seed: int | None
    mode: DeliveryGuarantee
    restarts: int
    failures: list[str]
    rows: int
    expected_rows: int
    last: dict[int, int]
    highest: dict[int, int]
    objects: int
    parts: int
    open_uploads: int
    seconds: float
    commits: int = 0
    n: int = N
    plan: list[str] = field(default_factory=list)

    @property
    def exact(self) -> dict[int, int]:
        return expected_sums(self.n)

    def line(self) -> str:
        exact = self.exact
        wrong = sum(1 for k in exact if self.last.get(k) != exact[k])
        return (
            f"seed={self.seed} mode={self.mode.name} restarts={self.restarts} "
            f"rows={self.rows}/{self.expected_rows} wrong_keys={wrong} objects={self.objects} "
            f"parts={self.parts} commits={self.commits} open_uploads={self.open_uploads} "
            f"{self.seconds:.1f}s "
            f"faults=[{', '.join(self.plan)}]"
        )


def run_keyed_sum_to_s3(
    server: S3Server,
    bucket: str,
    storage: str | None,
    mode: DeliveryGuarantee = DeliveryGuarantee.EXACTLY_ONCE,
    plan: FaultPlan | None = None,
    seed: int | None = None,
    n: int = N,
    rolling_policy: RollingPolicy | None = None,
) -> ChaosRun:
    """Run the keyed running sum into S3 with ``plan`` and read back what was committed."""
    from tests.s3_server import parts_of

    job = unique_job(f"s3-{mode.name.lower()}-{seed}")
    sink = S3FileSink(
        bucket,
        job,
        format="jsonl",
        delivery_guarantee=mode,
        rolling_policy=rolling_policy,
        **server.sink_options(),
    )
    env, _ = build_keyed_sum(
        n,
        P,
        BATCH,
        rate=RATE,
        storage=storage,
        sink=sink,
        plan=plan,
        checkpoint_ms=None if storage is None else 300,
        mode=CheckpointingMode.AT_LEAST_ONCE
        if mode is DeliveryGuarantee.AT_LEAST_ONCE
        else CheckpointingMode.EXACTLY_ONCE,
    )
    started = time.time()
    result = env.execute(job)
    seconds = time.time() - started
    objects = server.read_objects(bucket, f"{job}/", "jsonl")
    last: dict[int, int] = {}
    highest: dict[int, int] = {}
    rows = 0
    for _, table in objects:  # key order: subtask, then sequence (time) order
        rows += table.num_rows
        keys, values = table.column("key").to_pylist(), table.column("value").to_pylist()
        for key, value in zip(keys, values, strict=True):
            last[key] = value
            highest[key] = max(value, highest.get(key, value))
    return ChaosRun(
        seed=seed,
        mode=mode,
        restarts=result.restarts,
        failures=result.failures,
        rows=rows,
        expected_rows=expected_rows(n, P, BATCH),
        last=last,
        highest=highest,
        objects=len(objects),
        parts=sum(parts_of(obj) for obj, _ in objects),
        open_uploads=len(server.open_uploads(bucket, f"{job}/")),
        seconds=seconds,
        commits=result.sink_result(sink),
        n=n,
        plan=[
            f"{f.attempt}:{f.point.value}@{f.vertex or '*'}/{f.subtask}"
            for f in (plan.faults if plan else [])
        ],
    )


def check_exactly_once(run: ChaosRun) -> None:
    assert run.restarts >= 3, run.failures
    assert run.open_uploads == 0, "multipart uploads left open"
    assert run.last == run.exact, "a key's last committed total is not its exact sum"
    # Every emitted running total was committed exactly once: none lost, none twice.
    assert run.rows == run.expected_rows


@pytest.mark.chaos
@pytest.mark.parametrize("seed", [3, 17])
def test_s3_exactly_once_survives_seeded_kills(seed, s3_server, s3_bucket, tmp_path):
    run = run_keyed_sum_to_s3(s3_server, s3_bucket, str(tmp_path), plan=chaos_plan(seed), seed=seed)
    print(run.line())
    check_exactly_once(run)


@pytest.mark.chaos
def test_s3_at_least_once_loses_nothing(s3_server, s3_bucket, tmp_path):
    plan = FaultPlan.random(5, kills=3, parallelism=P, max_records=N // (3 * P))
    run = run_keyed_sum_to_s3(
        s3_server, s3_bucket, str(tmp_path), DeliveryGuarantee.AT_LEAST_ONCE, plan=plan, seed=5
    )
    exact = run.exact
    print(run.line())
    over = sum(1 for k in exact if run.highest[k] > exact[k])
    print(
        f"AT_LEAST_ONCE: {run.rows - run.expected_rows} rows more than exactly-once, "
        f"{over} of {len(exact)} keys counted some records twice"
    )
    assert run.restarts >= 1
    # Nothing lost: every key reached at least its exact sum, every total was committed.
    assert all(run.highest[k] >= exact[k] for k in exact)
    assert run.rows >= run.expected_rows
    assert run.open_uploads == 0


@pytest.mark.chaos
def test_s3_none_without_checkpoints_promises_only_whole_objects(s3_server, s3_bucket):
    n = 200_000
    plan = FaultPlan(
        [Fault(FaultPoint.AFTER_RECORDS, attempt=0, subtask=1, records=60_000, vertex=SINK_VERTEX)]
    )
    run = run_keyed_sum_to_s3(
        s3_server,
        s3_bucket,
        None,
        DeliveryGuarantee.NONE,
        plan=plan,
        n=n,
        rolling_policy=RollingPolicy(max_part_size=256 * 1024),
    )
    exact = run.exact
    wrong = sum(1 for k in exact if run.last.get(k) != exact[k])
    print(
        f"NONE, checkpointing off: {run.rows} rows committed vs {run.expected_rows} "
        f"exactly-once ({run.rows - run.expected_rows:+d}), {wrong} keys end on a wrong "
        f"total, {run.objects} objects, restarts={run.restarts}"
    )
    assert run.restarts == 1
    # NONE promises neither completeness nor uniqueness; what it does promise is that a
    # reader only ever sees whole objects (every one decoded above) and, here, that the
    # failed attempt's open uploads were cleaned up.
    assert run.objects > 0 and run.rows > 0
    assert run.open_uploads == 0
