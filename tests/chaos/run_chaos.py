"""One chaos runner for the three exactly-once sinks: faults the code does not expect.

    python tests/chaos/run_chaos.py --sink collect|files|s3|all --seeds 100 [--first 0]
        [--records 300000] [--parallelism 2] [--kills 4] [--rate 100000]
        [--rerun coin|always|never] [--cancel coin|always|never] [--timeout 300] [--verbose]
        [--alignment aligned|unaligned|timeout|coin] [--hot-delay SECONDS]
        [--alignment-timeout MS]

Each seed runs the keyed running sum (tests/chaos/harness.py) into CollectSink, FileSink
or S3FileSink (EXACTLY_ONCE) under ``FaultPlan.random(seed, kills=K, ...)`` drawn from
every fault point (``ALL_RANDOM_POINTS``, in an order shuffled by the seed: the first K
points of the list are always drawn, so an unshuffled list would only ever draw the same
four), and then, with seeded coins:

* rerun: a short job of the same name and the same checkpoint storage runs to completion
  first (smaller input, its own output location), so an earlier run's checkpoints sit in
  storage; only the faulted run's output is checked;
* cancel: the faulted run is cancelled after its first completed checkpoint; then no open
  transaction (in-progress file, open multipart upload) and no actor
  ``rayflow:<job id>:*`` may remain, and a run with ``restore_from="latest"`` (the same
  faults again) resumes it.

Alignment (``--alignment``): aligned checkpoints (the default), unaligned ones
(``enable_unaligned_checkpoints``), aligned ones that switch to unaligned after
``--alignment-timeout`` ms (``set_aligned_checkpoint_timeout``), or ``coin``: unaligned
or with timeout, a seeded choice per seed. Under unaligned or timeout the sum subtask
that owns key 0 sleeps ``--hot-delay`` seconds per batch (default 0.05; 0 for aligned),
so its input channels back up and checkpoints hold channel state; the plan then also
draws ``DURING_CHANNEL_STATE_WRITE`` (a kill in the blob-writing thread, before a blob
that holds channel state is written; aimed at that hot subtask, and it fires only in an
attempt that writes such a blob). The seed line gives ``cs=C/K``: of the last (at most
10) completed checkpoints of the run checked, K, how many held channel state, C; and
``restore_cs=yes|no|?``: whether the checkpoint its last restore came from held channel
state (``?``: not among those). At the default rate, 0.01 s gives channel state in about
one completed checkpoint in ten; ``--hot-delay 0.05`` in about two in three.

Checks: every running total the job emits is committed exactly once (each key's
committed totals rise strictly and end at the exact sum; the row count is the exact one:
0 lost, 0 duplicated), no open transaction and no actor of the job is left. After a
cancel, FileSink and S3FileSink output is all committed output of the job name (the
cancelled run's commits and the resumed run's); CollectSink's resumed run holds only its
own commits (its final sums must be exact, its transaction ids unique), and the union of
both runs' commits by transaction id must be exactly once as above.

Prints one line per seed and sink, then ``N passed, M failed``; exits 1 on any failure
(printing the seed's plan and the runs' failures). Starts its own local Ray (and a moto
S3 server for ``s3``); never joins or stops another one.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # before ray.init: workers import tests.* by reference

import pyarrow as pa  # noqa: E402
import ray  # noqa: E402

from rayflow import DeliveryGuarantee, JobCancelledError, JobFailedError  # noqa: E402
from rayflow.checkpoint.storage import CheckpointStorage, JobStorage  # noqa: E402
from rayflow.config import CheckpointAlignment  # noqa: E402
from rayflow.keygroups import (  # noqa: E402
    DEFAULT_MAX_PARALLELISM,
    key_group_of,
    subtask_of_key_group,
)
from rayflow.testing import (  # noqa: E402
    ALL_RANDOM_POINTS,
    Fault,
    FaultPlan,
    FaultPoint,
    wait_for_checkpoints,
)
from sinks.basic import CollectSink  # noqa: E402
from sinks.files import FileSink  # noqa: E402
from sinks.s3 import S3FileSink  # noqa: E402
from tests.chaos.harness import (  # noqa: E402
    build_keyed_sum,
    expected_rows,
    expected_sums,
    outcome,
    unique_job,
)
from tests.chaos.test_file_sink_chaos import in_progress, read_committed, rows_per_key  # noqa: E402

SINKS = ("collect", "files", "s3")
BATCH = 5000
RATE = 100_000  # records per second per source subtask
CHECKPOINT_MS = 300
_CHECKPOINT_BOUND = {
    getattr(FaultPoint, name)
    for name in (
        "DURING_ALIGNMENT",
        "AFTER_SNAPSHOT",
        "BEFORE_NOTIFY",
        "JOB_MASTER_BEFORE_NOTIFY",
        "DURING_BLOB_WRITE",
        "DURING_COMMIT_POINT",
        "DURING_CHANNEL_STATE_WRITE",
    )
    if hasattr(FaultPoint, name)
}
ALIGNMENTS = {
    "aligned": CheckpointAlignment.ALIGNED,
    "unaligned": CheckpointAlignment.UNALIGNED,
    "timeout": CheckpointAlignment.ALIGNED_WITH_TIMEOUT,
}
HOT_DELAY_S = 0.05  # seconds per batch of the hot subtask: channel state in most checkpoints
ALIGNMENT_TIMEOUT_MS = 20
HOT_VERTEX = "Sum"  # the chained vertex of the running sum (and the sink)


def hot_subtask(parallelism: int) -> int:
    """The sum subtask that owns key 0: the one slowed down by ``hot_delay_s``."""
    mp = DEFAULT_MAX_PARALLELISM  # the harness sets none
    return subtask_of_key_group(key_group_of(0, mp), parallelism, mp)


def choose_alignment(seed: int, alignment: str) -> str:
    """``alignment`` itself, or for ``coin`` the seed's choice of unaligned or timeout
    (its own random stream: the plan and the other coins do not change with it)."""
    if alignment == "coin":
        return random.Random(f"rayflow-chaos-alignment:{seed}").choice(["unaligned", "timeout"])
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {[*ALIGNMENTS, 'coin']}, got {alignment!r}")
    return alignment


# --- where each sink's output goes and how it is read back -----------------------------


class _Target:
    """One seed's output location of one sink kind."""

    kind = ""

    def sink(self, job: str, pre: bool = False) -> Any:
        raise NotImplementedError

    def committed(self, job: str) -> pa.Table:
        """All committed output of ``job`` (key and value columns, in commit order)."""
        raise NotImplementedError

    def open_transactions(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class _CollectTarget(_Target):
    kind = "collect"

    def __init__(self) -> None:
        self.sinks: list[CollectSink] = []  # the faulted (and resumed) runs' sinks
        self.all: list[CollectSink] = []

    def sink(self, job: str, pre: bool = False) -> CollectSink:
        sink = CollectSink(DeliveryGuarantee.EXACTLY_ONCE)
        self.all.append(sink)
        if not pre:
            self.sinks.append(sink)
        return sink

    def transactions(self, sink: CollectSink) -> list[tuple[str, bytes]]:
        return ray.get(sink._collector.contents.remote(sink._sink_id))["transactions"]

    def union(self, problems: list[str]) -> pa.Table:
        """Every run's commits, one per transaction id, in (subtask, sequence) order."""
        merged: dict[str, bytes] = {}
        for sink in self.sinks:
            for txn, data in self.transactions(sink):
                if txn in merged and merged[txn] != data:
                    problems.append(f"transaction {txn} committed twice with different rows")
                merged.setdefault(txn, data)

        def order(txn: str) -> tuple[int, int, str, str]:
            # <job>_<uid>_<subtask>_<run>-<sequence>: a restored run goes on with the
            # sequences of the checkpoint it restored (runs are time-sorted names)
            head, subtask, last = txn.rsplit("_", 2)
            run, _, sequence = last.rpartition("-")
            return int(subtask), int(sequence), run, head

        tables = [
            pa.ipc.open_stream(pa.py_buffer(merged[t])).read_all()
            for t in sorted(merged, key=order)
        ]
        return _key_value(tables)

    def close(self) -> None:
        for sink in self.all:  # their rows would outlive the seed otherwise
            if sink._collector is not None:
                sink._collector.release.remote(sink._sink_id)
                sink._collector = None


class _FilesTarget(_Target):
    kind = "files"

    def __init__(self, workdir: str, fmt: str) -> None:
        self.out = os.path.join(workdir, "out")
        self.pre_out = os.path.join(workdir, "pre-out")
        self.fmt = fmt

    def sink(self, job: str, pre: bool = False) -> FileSink:
        return FileSink(self.pre_out if pre else self.out, self.fmt, DeliveryGuarantee.EXACTLY_ONCE)

    def committed(self, job: str) -> pa.Table:
        if not os.path.isdir(self.out) or not any(
            not n.startswith(".") for n in os.listdir(self.out)
        ):
            return _key_value([])
        return read_committed(self.out, self.fmt)

    def open_transactions(self) -> list[str]:
        return [
            name
            for directory in (self.out, self.pre_out)
            if os.path.isdir(directory)
            for name in in_progress(directory)
        ]


class _S3Target(_Target):
    kind = "s3"

    def __init__(self, server: Any) -> None:
        self.server = server
        self.bucket = server.create_bucket()
        self.pre_bucket: str | None = None

    def sink(self, job: str, pre: bool = False) -> S3FileSink:
        if pre and self.pre_bucket is None:
            self.pre_bucket = self.server.create_bucket()
        return S3FileSink(
            self.pre_bucket if pre else self.bucket,
            job,
            format="jsonl",
            delivery_guarantee=DeliveryGuarantee.EXACTLY_ONCE,
            **self.server.sink_options(),
        )

    def committed(self, job: str) -> pa.Table:
        objects = self.server.read_objects(self.bucket, f"{job}/", "jsonl")  # key order
        return _key_value([t for _, t in objects if t.num_rows])

    def open_transactions(self) -> list[str]:
        return [
            upload["Key"]
            for bucket in filter(None, (self.bucket, self.pre_bucket))
            for upload in self.server.open_uploads(bucket)
        ]

    def close(self) -> None:
        client = self.server.client()
        for bucket in filter(None, (self.bucket, self.pre_bucket)):
            try:  # keep the server's memory flat over many seeds
                for obj in self.server.objects(bucket):
                    client.delete_object(Bucket=bucket, Key=obj["Key"])
                for upload in self.server.open_uploads(bucket):
                    client.abort_multipart_upload(
                        Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
            except Exception:  # noqa: BLE001 - cleanup only
                pass


def _key_value(tables: list[pa.Table]) -> pa.Table:
    if not tables:
        return pa.table({"key": pa.array([], pa.int64()), "value": pa.array([], pa.int64())})
    return pa.concat_tables([t.select(["key", "value"]) for t in tables], promote_options="default")


# --- one seed --------------------------------------------------------------------------


@dataclass
class SeedResult:
    seed: int
    sink: str
    plan: FaultPlan
    rerun: bool
    cancel: bool
    fmt: str = "jsonl"
    alignment: str = "aligned"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)  # per run checked (cancelled, final)
    master_restarts: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the runs' failure causes
    rows: int = 0
    expected_rows: int = 0
    seconds: float = 0.0
    #: of the run checked: completed checkpoints (of the last 10) holding channel state,
    #: completed ones, and whether its last restore's checkpoint held channel state
    channel_state: tuple[int, int] = (0, 0)
    restored_channel_state: bool | None = None
    restored: bool = False
    #: (storage, job, run id) of the run being waited for: its failures when it fails
    current_run: tuple[str, str, str] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def faults(self) -> str:
        return " ".join(describe(f) for f in self.plan.faults)

    def line(self) -> str:
        modes = "".join(("+rerun" if self.rerun else "", "+cancel" if self.cancel else ""))
        if not self.restored:
            restore = "-"
        else:
            restore = {True: "yes", False: "no", None: "?"}[self.restored_channel_state]
        unaligned = (
            f"cs={self.channel_state[0]}/{self.channel_state[1]} restore_cs={restore} "
            if self.alignment != "aligned"
            else ""
        )
        return (
            f"seed={self.seed:<4} sink={self.sink:<7} align={self.alignment:<9} "
            f"{modes or '-':<13} "
            f"faults=[{self.faults()}] "
            f"restarts={'+'.join(map(str, self.restarts)) or '-'} "
            f"jm_restarts={'+'.join(map(str, self.master_restarts)) or '-'} "
            f"rows={self.rows}/{self.expected_rows} "
            f"{unaligned}"
            f"{'PASS' if self.ok else 'FAIL'} {self.seconds:.1f}s"
            + (f" ({'; '.join(self.notes)})" if self.notes else "")
        )

    def report(self) -> str:
        """What to look at when the seed failed: problems, the plan, the runs' failures."""
        lines = [
            f"  seed {self.seed} ({self.sink}, format {self.fmt}, alignment "
            f"{self.alignment}) problems:"
        ]
        lines += [f"    - {p}" for p in self.problems]
        lines.append("  plan:")
        lines += [f"    {f}" for f in self.plan.faults]
        lines.append("  JobResult.failures:")
        lines += [f"    {f}" for f in self.failures] or ["    (none)"]
        return "\n".join(lines)


def describe(fault: Any) -> str:
    text = f"{fault.attempt}:{fault.point.value}/s{fault.subtask}"
    if fault.point is FaultPoint.AFTER_RECORDS:
        text += f"@{fault.records}"
    elif fault.point in _CHECKPOINT_BOUND:
        text += f"#cp{fault.checkpoint}"
    if fault.action != "sigkill":
        text += f"({fault.action})"
    return text


def draw(
    seed: int, parallelism: int, kills: int, n: int, alignment: str = "aligned"
) -> tuple[FaultPlan, bool, bool, str]:
    """The seed's plan and coins: rerun first, cancel mid-run, the file format. Unless
    ``alignment`` is aligned (whose plans stay as they were), the points include
    DURING_CHANNEL_STATE_WRITE."""
    coins = random.Random(f"rayflow-chaos:{seed}")
    points = list(ALL_RANDOM_POINTS)
    if alignment != "aligned":
        points.append(FaultPoint.DURING_CHANNEL_STATE_WRITE)
    # FaultPlan.random takes points[0..kills-1] in list order before it draws at random:
    # shuffled, every point gets its turn across seeds.
    coins.shuffle(points)
    max_records = max(n // 10, 2)
    plan = FaultPlan.random(
        seed, kills=kills, parallelism=parallelism, max_records=max_records, points=points
    )
    plan = make_effective(plan, coins, parallelism, max_records)
    rerun = coins.random() < 0.5
    cancel = coins.random() < 0.5
    fmt = coins.choice(["jsonl", "parquet"])
    return plan, rerun, cancel, fmt


def make_effective(
    plan: FaultPlan, rng: random.Random, parallelism: int, max_records: int
) -> FaultPlan:
    """Every fault of a random plan gets its chance to fire.

    ``FaultPlan.random`` puts one fault in each attempt and counts on each to end its
    attempt, but two do not: a lost final notification (FINAL_NOTIFY) ends the *job*, so
    no later attempt ever starts, and DURING_RESTART_DELAY fires only in the restart
    delay after its attempt failed of something else. So the attempts holding a
    FINAL_NOTIFY go last, and each DURING_RESTART_DELAY gets a kill of another subtask
    in its attempt. DURING_CHANNEL_STATE_WRITE fires only at a subtask whose blob holds
    channel state: it is aimed at the running sum's hot subtask (see ``hot_subtask``).
    DURING_CONNECT fires at the first sender's ask (a subtask with one input channel is
    asked once per attempt).
    """
    attempts = sorted({f.attempt for f in plan.faults})
    groups = [[f for f in plan.faults if f.attempt == a] for a in attempts]
    final = [g for g in groups if any(f.point is FaultPoint.FINAL_NOTIFY for f in g)]
    groups = [g for g in groups if g not in final] + final
    faults = []
    for attempt, group in enumerate(groups):
        for fault in group:
            if fault.point is FaultPoint.DURING_CHANNEL_STATE_WRITE:
                fault = replace(fault, vertex=HOT_VERTEX, subtask=hot_subtask(parallelism))
            if fault.point is FaultPoint.DURING_CONNECT:
                # the first sender to ask: a receiver with one input channel has no second
                fault = replace(fault, checkpoint=1)
            faults.append(replace(fault, attempt=attempt))
            if fault.point is FaultPoint.DURING_RESTART_DELAY:
                faults.append(
                    Fault(
                        FaultPoint.AFTER_RECORDS,
                        attempt,
                        None,
                        (fault.subtask + 1) % parallelism,
                        rng.randrange(1, max_records // 4 + 2),
                    )
                )
    return FaultPlan(faults)


class _Waiter(threading.Thread):
    """``client.wait()`` in a thread (it also takes over when the job master dies), so
    the caller can watch checkpoints and cancel meanwhile."""

    def __init__(self, client: Any, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.client, self.timeout_s = client, timeout_s
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.client.wait(timeout=self.timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc


def job_actors(job_id: str, settle_s: float = 10.0) -> list[str]:
    """Named actors of the job still alive (waiting up to ``settle_s`` for them to go)."""
    deadline = time.time() + settle_s
    while True:
        left = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"rayflow:{job_id}:")
        ]
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.2)


def _wait(client: Any, timeout_s: float) -> Any:
    try:
        return client.wait(timeout=timeout_s)
    except TimeoutError:
        client.cancel(timeout=60)
        raise TimeoutError(f"the run did not end within {timeout_s:.0f} s") from None


def check_exactly_once(table: pa.Table, n: int, parallelism: int, what: str) -> list[str]:
    """Each key's committed totals rise strictly and end at its exact sum; every total
    the job emits is there once (row count)."""
    problems = []
    per_key = rows_per_key(table) if table.num_rows else {}
    exact = expected_sums(n)
    last = {k: v[-1] for k, v in per_key.items()}
    wrong = sorted(k for k in set(exact) | set(last) if last.get(k) != exact.get(k))
    if wrong:
        k = wrong[0]
        problems.append(
            f"{what}: {len(wrong)} keys end on a wrong total "
            f"(key {k}: {last.get(k)} committed, {exact.get(k)} exact)"
        )
    repeated = sorted(
        k for k, v in per_key.items() if any(a >= b for a, b in itertools.pairwise(v))
    )
    if repeated:
        k = repeated[0]
        values = per_key[k]
        at = next(i for i, (a, b) in enumerate(itertools.pairwise(values)) if a >= b)
        problems.append(
            f"{what}: {len(repeated)} keys repeat or lower a committed total (key {k}: "
            f"... {values[max(at - 1, 0) : at + 3]} ...)"
        )
    want = expected_rows(n, parallelism, BATCH)
    if table.num_rows != want:
        diff = table.num_rows - want
        problems.append(
            f"{what}: {table.num_rows} rows committed, {want} exactly once "
            f"({diff:+d}: {'duplicated' if diff > 0 else 'lost'})"
        )
    return problems


def run_seed(
    seed: int,
    sink: str,
    n: int = 300_000,
    parallelism: int = 2,
    kills: int = 4,
    rate: float | None = RATE,
    workdir: str | os.PathLike[str] | None = None,
    server: Any = None,
    rerun: bool | None = None,
    cancel: bool | None = None,
    timeout_s: float = 300.0,
    alignment: str = "aligned",
    hot_delay_s: float | None = None,
    alignment_timeout_ms: int = ALIGNMENT_TIMEOUT_MS,
) -> SeedResult:
    """Run one seed into one sink kind and check it; never raises for a failed job.

    ``rerun`` and ``cancel`` default to the seed's coins. ``server``: the moto server
    (``tests.s3_server.start_server()``), needed for ``s3``. ``workdir``: where the
    checkpoint storage and file output go (a temporary directory when None).
    ``alignment``: aligned, unaligned, timeout (aligned with ``alignment_timeout_ms``)
    or coin (the seed picks unaligned or timeout); ``hot_delay_s`` defaults to
    ``HOT_DELAY_S`` unless aligned.
    """
    if sink not in SINKS:
        raise ValueError(f"sink must be one of {SINKS}, got {sink!r}")
    alignment = choose_alignment(seed, alignment)
    if hot_delay_s is None:
        hot_delay_s = 0.0 if alignment == "aligned" else HOT_DELAY_S
    plan, coin_rerun, coin_cancel, fmt = draw(seed, parallelism, kills, n, alignment)
    rerun = coin_rerun if rerun is None else rerun
    cancel = coin_cancel if cancel is None else cancel
    result = SeedResult(
        seed, sink, plan, rerun, cancel, fmt if sink == "files" else "jsonl", alignment
    )
    job_options = {
        "alignment": ALIGNMENTS[alignment],
        "alignment_timeout_ms": alignment_timeout_ms,
        "hot_delay_s": hot_delay_s,
    }
    result.expected_rows = expected_rows(n, parallelism, BATCH)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix=f"rayflow-chaos-{seed}-") as scratch:
        base = str(workdir) if workdir is not None else scratch
        target: _Target
        if sink == "collect":
            target = _CollectTarget()
        elif sink == "files":
            target = _FilesTarget(base, fmt)
        else:
            if server is None:
                raise ValueError("sink 's3' needs the moto server (server=start_server())")
            target = _S3Target(server)
        try:
            _seed_body(
                result,
                target,
                n,
                parallelism,
                rate,
                os.path.join(base, "chk"),
                timeout_s,
                job_options,
            )
        except JobFailedError as exc:
            result.problems.append(f"job failed: {type(exc).__name__}: {exc}")
            if result.current_run is not None:
                state = _job_state(*result.current_run)
                result.failures += [f.cause for f in state.failures] if state else []
        except Exception as exc:  # noqa: BLE001 - a failed seed, not a crashed runner
            result.problems.append(
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc().rstrip()}"
            )
        finally:
            try:
                target.close()
            except Exception:  # noqa: BLE001 - cleanup only
                pass
    result.seconds = time.time() - started
    return result


def _seed_body(
    result: SeedResult,
    target: _Target,
    n: int,
    parallelism: int,
    rate: float | None,
    storage: str,
    timeout_s: float,
    job_options: dict[str, Any] | None = None,
) -> None:
    """``job_options``: more keyword arguments of ``build_keyed_sum`` (alignment, ...)."""
    job_options = job_options or {}
    job = unique_job(f"chaos-{result.sink}-{result.seed}")
    problems = result.problems

    if result.rerun:
        # An earlier, shorter run of the same job name into the same checkpoint storage.
        pre_n = max(n // 5, 2 * BATCH)
        pre_sink = target.sink(job, pre=True)
        env, _ = build_keyed_sum(
            pre_n,
            parallelism,
            BATCH,
            rate=None,
            checkpoint_ms=CHECKPOINT_MS,
            sink=pre_sink,
            storage=storage,
            **job_options,
        )
        pre_client = env.execute_async(job)
        result.current_run = (storage, job, pre_client.run_id)
        pre = _wait(pre_client, timeout_s)
        if isinstance(pre_sink, CollectSink) and outcome(pre, pre_sink).sums != expected_sums(
            pre_n
        ):
            problems.append("the earlier run of the job name (no faults) has wrong sums")
        if JobStorage(storage, job).latest() is None:
            result.notes.append("the earlier run left no completed checkpoint")

    first_sink = target.sink(job)
    env, _ = build_keyed_sum(
        n,
        parallelism,
        BATCH,
        rate=rate,
        checkpoint_ms=CHECKPOINT_MS,
        sink=first_sink,
        storage=storage,
        plan=result.plan,
        **job_options,
    )
    client = env.execute_async(job)
    result.current_run = (storage, job, client.run_id)
    final_sink = first_sink
    first_finished = False  # the run to cancel ended on its own: nothing left to resume

    if not result.cancel:
        final = _wait(client, timeout_s)
        final_client = client
    else:
        waiter = _Waiter(client, timeout_s)
        waiter.start()
        completed = 0
        while waiter.is_alive() and completed < 1:
            completed = wait_for_checkpoints(client, 1, timeout_s=1.0)
        if waiter.is_alive():
            cancelled = client.cancel()
            waiter.join(timeout_s)
            if waiter.is_alive():
                problems.append(f"cancel: the run did not end within {timeout_s:.0f} s")
                return
            if isinstance(waiter.error, JobCancelledError):
                pass
            elif waiter.error is not None:
                if not isinstance(waiter.error, JobFailedError):
                    raise waiter.error
                problems.append(
                    f"cancelled run failed instead: {type(waiter.error).__name__}: {waiter.error}"
                )
            elif cancelled:
                first_finished = True
                problems.append(
                    "cancel() said cancelled, but the run went on and finished (cancel lost)"
                )
            else:
                # it finished before the cancel took effect (cancel() says so): no resume
                first_finished = True
                result.notes.append("the run finished before the cancel took effect")
        else:
            result.notes.append("the run ended before its first checkpoint was seen")
            if waiter.error is not None:
                raise waiter.error
            first_finished = True
        _record_cancelled_run(result, storage, job, client.run_id)
        left = target.open_transactions()
        if left:
            problems.append(
                f"after cancel: {len(left)} open transaction(s) left: {', '.join(left[:4])}"
            )
        actors = job_actors(client.job_id)
        if actors:
            problems.append(f"after cancel: actors of the job left: {', '.join(actors[:4])}")

        # Resume from the newest completed checkpoint of the job name, with the same faults.
        final_sink = target.sink(job)
        env, _ = build_keyed_sum(
            n,
            parallelism,
            BATCH,
            rate=rate,
            checkpoint_ms=CHECKPOINT_MS,
            sink=final_sink,
            storage=storage,
            plan=result.plan,
            **job_options,
        )
        final_client = env.execute_async(job, restore_from="latest")
        result.current_run = (storage, job, final_client.run_id)
        final = _wait(final_client, timeout_s)
        if final.restored_from is None:
            problems.append("the resumed run reports no checkpoint it was restored from")

    result.restarts.append(final.restarts)
    result.master_restarts.append(final.job_master_restarts)
    result.failures += final.failures
    _record_channel_state(result, final)

    left = target.open_transactions()
    if left:
        problems.append(f"{len(left)} open transaction(s) left: {', '.join(left[:4])}")
    actors = job_actors(final_client.job_id)
    if actors:
        problems.append(f"actors of the job left: {', '.join(actors[:4])}")

    if isinstance(target, _CollectTarget):
        if result.cancel:
            # The resumed run's own commits: no transaction id twice, and (when there was
            # something left to resume) the exact final sums.
            own = target.transactions(final_sink)
            ids = [t for t, _ in own]
            if len(ids) != len(set(ids)):
                problems.append(f"resumed run: {len(ids) - len(set(ids))} duplicated txn ids")
            sums = outcome(final, final_sink).sums
            wrong = [k for k, v in expected_sums(n).items() if sums.get(k) != v]
            if wrong and not first_finished:
                problems.append(f"resumed run: {len(wrong)} keys end on a wrong final sum")
        table = target.union(problems)
        what = "commits of both runs" if result.cancel else "committed"
    else:
        table = target.committed(job)
        what = "all committed output" if result.cancel else "committed"
    result.rows = table.num_rows
    problems += check_exactly_once(table, n, parallelism, what)


def _record_channel_state(result: SeedResult, final: Any) -> None:
    """How many of the run's last completed checkpoints held channel state, and whether
    the one its last restore came from did (when it is among them)."""
    completed = [c for c in final.checkpoints if c["status"] == "COMPLETED"]
    result.channel_state = (
        sum(1 for c in completed if c.get("channel_state_size")),
        len(completed),
    )
    result.restored = final.restored_from is not None
    for c in completed:
        if c["checkpoint_id"] == final.restored_from:
            result.restored_channel_state = bool(c.get("channel_state_size"))


def _job_state(storage: str, job: str, run_id: str) -> Any:
    """A run's supervisor state (restarts, failures) from its checkpoint storage."""
    try:
        return CheckpointStorage(storage, job, run_id=run_id).read_job_state()
    except Exception:  # noqa: BLE001 - not written (yet): nothing to add
        return None


def _record_cancelled_run(result: SeedResult, storage: str, job: str, run_id: str) -> None:
    """The cancelled run's restarts and failures, from its supervisor state in storage."""
    state = _job_state(storage, job, run_id)
    if state is None:
        result.restarts.append(0)
        result.master_restarts.append(0)
        return
    result.restarts.append(state.restarts)
    result.master_restarts.append(state.master_restarts)
    result.failures += [f"(cancelled run) {f.cause}" for f in state.failures]


# --- the runner ------------------------------------------------------------------------


def _hide_expected_worker_deaths() -> None:
    """The raylet reports every killed worker on the driver's stdout; here the kills are
    the point, so those reports are dropped (--verbose keeps them)."""
    import ray._private.worker as ray_worker

    show = getattr(ray_worker, "print_to_stdstream", None)
    if show is None:
        return

    def filtered(data: dict, ignore_prefix: bool) -> None:
        lines = data.get("lines") or []
        if data.get("pid") == "raylet" and any("worker died or was killed" in x for x in lines):
            return
        show(data, ignore_prefix)

    ray_worker.print_to_stdstream = filtered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--sink", choices=[*SINKS, "all"], default="all")
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--records", type=int, default=300_000, help="input records per run")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--kills", type=int, default=4, help="faults per plan (one per attempt)")
    parser.add_argument(
        "--rate", type=float, default=RATE, help="records/s per source subtask (0: unlimited)"
    )
    parser.add_argument("--rerun", choices=["coin", "always", "never"], default="coin")
    parser.add_argument("--cancel", choices=["coin", "always", "never"], default="coin")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--verbose", action="store_true", help="show Ray worker logs")
    parser.add_argument(
        "--alignment",
        choices=[*ALIGNMENTS, "coin"],
        default="aligned",
        help="checkpoint alignment (coin: unaligned or timeout, seeded per seed)",
    )
    parser.add_argument(
        "--hot-delay",
        type=float,
        default=None,
        help=f"seconds per batch at the hot sum subtask (default {HOT_DELAY_S} unless aligned)",
    )
    parser.add_argument(
        "--alignment-timeout",
        type=int,
        default=ALIGNMENT_TIMEOUT_MS,
        help=f"ms, for --alignment timeout (default {ALIGNMENT_TIMEOUT_MS})",
    )
    args = parser.parse_args(argv)
    sinks = list(SINKS) if args.sink == "all" else [args.sink]
    force = {"coin": None, "always": True, "never": False}

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Workers import the test helpers (tests.*) by reference: the local Ray started below
    # inherits this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    server = None
    if "s3" in sinks:
        from tests.s3_server import start_server

        server = start_server()
    ray.init(
        address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=args.verbose
    )
    if not args.verbose:
        _hide_expected_worker_deaths()
    passed = failed = 0
    failed_runs: list[str] = []
    try:
        for seed in range(args.first, args.first + args.seeds):
            for sink in sinks:
                outcome_ = run_seed(
                    seed,
                    sink,
                    n=args.records,
                    parallelism=args.parallelism,
                    kills=args.kills,
                    rate=args.rate or None,
                    server=server,
                    rerun=force[args.rerun],
                    cancel=force[args.cancel],
                    timeout_s=args.timeout,
                    alignment=args.alignment,
                    hot_delay_s=args.hot_delay,
                    alignment_timeout_ms=args.alignment_timeout,
                )
                print(outcome_.line(), flush=True)
                if outcome_.ok:
                    passed += 1
                else:
                    failed += 1
                    failed_runs.append(f"{seed}/{sink}")
                    print(outcome_.report(), flush=True)
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
    if failed_runs:
        print(f"failed: {' '.join(failed_runs)}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
