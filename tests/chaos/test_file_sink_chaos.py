"""FileSink under seeded kills: the keyed running sum (tests/chaos/harness.py) written to
real part files, then read back from disk.

EXACTLY_ONCE: each run injects five kills: a sink subtask killed between a checkpoint's
commit point and its notification (BEFORE_NOTIFY), one in the sink's own protocol
(right after pre-commit, or in the middle of committing), and three drawn from the seed
(after N records, during alignment, right after a snapshot). The committed files must
hold every emitted running total exactly once, and no in-progress file may remain.
AT_LEAST_ONCE: nothing is lost; duplicates are reported.
"""

from __future__ import annotations

import itertools
import os
import random

import pyarrow as pa
import pyarrow.json as pjson
import pyarrow.parquet as pq
import pytest

from rayflow import DeliveryGuarantee
from rayflow.config import CheckpointingMode
from rayflow.sink import RollingPolicy
from rayflow.testing import Fault, FaultPlan, FaultPoint
from sinks.files import FileSink
from tests.chaos.harness import build_keyed_sum, expected_rows, expected_sums, unique_job

N = 400_000
P = 2
BATCH = 5000
# records per second per source subtask: about 2 s of input per attempt, so a first
# checkpoint that load delays by a second still leaves input for the next attempt's kill
RATE = 100_000
SINK = "committed"  # the harness's sink operator name (chained after the sum)


def plan_for(seed: int, sink_point: FaultPoint) -> FaultPlan:
    """The sink-side kills first (they fire early and for sure), then three seeded ones."""
    rng = random.Random(seed)
    targeted = [
        Fault(
            FaultPoint.BEFORE_NOTIFY,
            vertex=SINK,
            subtask=rng.randrange(P),
            checkpoint=rng.randint(1, 2),
        ),
        Fault(sink_point, vertex=SINK, subtask=rng.randrange(P), checkpoint=rng.randint(1, 2)),
    ]
    drawn = FaultPlan.random(seed, kills=3, parallelism=P, max_records=N // 10).faults
    faults = targeted + sorted(drawn, key=lambda f: f.attempt)
    return FaultPlan(
        [
            Fault(f.point, attempt, f.vertex, f.subtask, f.records, f.checkpoint, f.action)
            for attempt, f in enumerate(faults)
        ]
    )


def read_committed(directory, fmt: str) -> pa.Table:
    names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    read = pq.read_table if fmt == "parquet" else pjson.read_json
    tables = [read(os.path.join(directory, n)) for n in names]
    return pa.concat_tables(tables).select(["key", "value"])


def rows_per_key(table: pa.Table) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    keys, values = table.column("key").to_pylist(), table.column("value").to_pylist()
    for key, value in zip(keys, values, strict=True):
        out.setdefault(key, []).append(value)
    return out


def in_progress(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".")]


@pytest.mark.chaos
@pytest.mark.parametrize(
    "seed, sink_point, fmt",
    [
        (11, FaultPoint.SINK_DURING_COMMIT, "parquet"),
        (23, FaultPoint.SINK_AFTER_PRE_COMMIT, "jsonl"),
    ],
)
def test_exactly_once_files_survive_seeded_kills(tmp_path, seed, sink_point, fmt):
    out = tmp_path / "out"
    sink = FileSink(out, fmt, DeliveryGuarantee.EXACTLY_ONCE)
    plan = plan_for(seed, sink_point)
    env, _ = build_keyed_sum(
        N, P, BATCH, rate=RATE, storage=str(tmp_path / "chk"), sink=sink, plan=plan
    )
    result = env.execute(unique_job(f"files-eo-{seed}"))

    assert in_progress(out) == []
    table = read_committed(out, fmt)
    per_key = rows_per_key(table)
    exact = expected_sums(N)
    print(
        f"seed {seed}: {result.restarts} restarts, {len(os.listdir(out))} part files, "
        f"{table.num_rows} rows; recoveries {[round(t, 1) for t in result.recovery_times_s]} s; "
        f"{len(result.completed_checkpoints)} checkpoints completed"
    )
    assert result.restarts >= 3, result.failures
    # The two kills aimed at the sink fired first (attempts 0 and 1).
    assert all(SINK in failure for failure in result.failures[:2]), result.failures
    # Read in name order (subtask, then sequence), each key's running totals rise
    # strictly (a part committed twice would repeat them) and end at the exact sum...
    assert {k: v[-1] for k, v in per_key.items()} == exact
    assert all(a < b for v in per_key.values() for a, b in itertools.pairwise(v))
    # ...and every total the job emitted is there exactly once: none lost, none twice.
    assert table.num_rows == expected_rows(N, P, BATCH)


@pytest.mark.chaos
def test_at_least_once_files_lose_nothing(tmp_path):
    out = tmp_path / "out"
    sink = FileSink(out, "jsonl", DeliveryGuarantee.AT_LEAST_ONCE)
    plan = FaultPlan.random(5, kills=3, parallelism=P, max_records=N // 10)
    env, _ = build_keyed_sum(
        N,
        P,
        BATCH,
        rate=RATE,
        storage=str(tmp_path / "chk"),
        mode=CheckpointingMode.AT_LEAST_ONCE,
        sink=sink,
        plan=plan,
    )
    result = env.execute(unique_job("files-alo"))

    assert in_progress(out) == []
    table = read_committed(out, "jsonl")
    per_key = rows_per_key(table)
    exact = expected_sums(N)
    # Nothing is lost: every key reached at least its exact total (replayed records may
    # be counted twice in state), and at least every emitted total was committed.
    assert result.restarts >= 3, result.failures
    assert all(max(per_key[k]) >= exact[k] for k in exact)
    over = sum(1 for k in exact if max(per_key[k]) > exact[k])
    want = expected_rows(N, P, BATCH)
    print(
        f"AT_LEAST_ONCE files: {result.restarts} restarts; {over} of {len(exact)} keys "
        f"counted some records twice; {table.num_rows} rows committed vs {want} "
        f"exactly-once ({table.num_rows - want} duplicates)"
    )
    assert table.num_rows >= want


@pytest.mark.chaos
def test_none_without_checkpoints_restarts_from_scratch_and_cleans_up(tmp_path):
    """No checkpoints, NONE delivery: a restart replays everything into empty state. The
    final totals are right and nothing is lost; parts the killed attempt published stay
    (or are replaced by the same names), and its open parts do not linger."""
    n = 200_000
    out = tmp_path / "out"
    sink = FileSink(out, "jsonl", DeliveryGuarantee.NONE, RollingPolicy(max_part_size=8192))
    plan = FaultPlan(
        [Fault(FaultPoint.AFTER_RECORDS, attempt=0, subtask=1, records=60_000, vertex=SINK)]
    )
    env, _ = build_keyed_sum(n, P, BATCH, rate=RATE, checkpoint_ms=None, sink=sink, plan=plan)
    result = env.execute(unique_job("files-none"))

    assert result.restarts == 1
    assert in_progress(out) == []
    table = read_committed(out, "jsonl")
    per_key = rows_per_key(table)
    assert {k: max(v) for k, v in per_key.items()} == expected_sums(n)
    want = expected_rows(n, P, BATCH)
    print(f"NONE without checkpoints: {table.num_rows} rows committed vs {want} exactly-once")
    assert table.num_rows >= want
