"""The sink contract without Ray: builders that hold configuration only, versioned
committables in checkpoints, commit outcomes and how the sink operator handles them
(retry later on a mailbox timer, never a sleep), required lingering aborts, and
guarantee resolution that leaves the user's sink untouched."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pytest

import rayflow.runtime.sink_operator as sink_operator
from rayflow import DeliveryGuarantee, NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode
from rayflow.runtime.operators import OperatorContext
from rayflow.runtime.sink_operator import CommitRetryPolicy, TwoPhaseCommitSinkOperator
from rayflow.sink import (
    CommitFailedError,
    CommitOutcome,
    CommitStatus,
    CommittableSerializer,
    Committer,
    RunHold,
    SinkContext,
    TransactionWriter,
    TwoPhaseCommittingSink,
    UnknownCommittableVersionError,
    UnsupportedGuaranteeError,
)
from sinks.basic import CollectSink, _CollectSerializer
from sinks.files import FileCommittable, FileCommittableSerializer, FileSink
from sinks.s3 import S3Committable, S3CommittableSerializer, S3FileSink

EO = DeliveryGuarantee.EXACTLY_ONCE

# --- a scripted in-memory sink ------------------------------------------------------------

#: what the "outside world" of MemorySink holds: committed transaction ids, in order
COMMITTED: list[str] = []
#: the answers its committer gives, one per commit call (then COMMITTED)
ANSWERS: list[CommitOutcome | Exception] = []


class _Writer(TransactionWriter[list, str]):
    def __init__(self, context: SinkContext) -> None:
        self.context = context

    def begin_transaction(self, sequence: int) -> list:
        return [f"s{self.context.subtask_index}-t{sequence}"]

    def write(self, transaction: list, batch: pa.RecordBatch) -> None:
        transaction.append(batch.num_rows)

    def is_empty(self, transaction: list) -> bool:
        return len(transaction) == 1

    def pre_commit(self, transaction: list, checkpoint_id: int | None = None) -> str:
        return f"{transaction[0]}-c{checkpoint_id}"

    def abort_transaction(self, transaction: list) -> None:
        pass


class _Committer(Committer[str]):
    def commit(self, committable: str) -> CommitOutcome:
        if ANSWERS:
            answer = ANSWERS.pop(0)
            if isinstance(answer, Exception):
                raise answer
            if not answer.done:
                return answer
        if committable in COMMITTED:
            return CommitOutcome.already_committed()
        COMMITTED.append(committable)
        return CommitOutcome.committed()

    def abort(self, committable: str) -> None:
        pass

    def abort_lingering(self, context: SinkContext, keep: Sequence[str]) -> int:
        return 0


class _Serializer(CommittableSerializer[str]):
    version = 2
    readable_versions = frozenset({1, 2})

    def serialize(self, committable: str) -> bytes:
        return committable.encode()

    def deserialize(self, version: int, data: bytes) -> str:
        text = data.decode()
        return text if version == 2 else f"{text}-from-v1"


class MemorySink(TwoPhaseCommittingSink[list, str]):
    def create_transaction_writer(self, context: SinkContext) -> _Writer:
        return _Writer(context)

    def create_committer(self, context: SinkContext | None) -> _Committer:
        return _Committer()

    def committable_serializer(self) -> _Serializer:
        return _Serializer()


class FakeTimers:
    def __init__(self) -> None:
        self.scheduled: list[tuple[float, Any]] = []

    def schedule(self, delay_s: float, token: Any) -> None:
        self.scheduled.append((delay_s, token))


@pytest.fixture(autouse=True)
def _clean_world(monkeypatch):
    COMMITTED.clear()
    ANSWERS.clear()

    def no_sleep(seconds):
        raise AssertionError(f"time.sleep({seconds}) on the mailbox")

    monkeypatch.setattr(sink_operator.time, "sleep", no_sleep)
    yield


def operator(sink, timers=None, retry=None, attempt=0, guarantee=None):
    op = TwoPhaseCommitSinkOperator(sink, guarantee, retry)
    op.open(
        OperatorContext("job", "out", "out", 0, 1, 128, attempt, checkpointing=True, timers=timers)
    )
    return op


def rows(n: int = 3) -> pa.RecordBatch:
    return pa.record_batch({"value": pa.array(range(n), pa.int64())})


# --- commit outcomes ----------------------------------------------------------------------


def test_retry_later_waits_for_a_mailbox_timer_then_commits():
    timers = FakeTimers()
    op = operator(MemorySink(EO), timers)
    op.process(rows())
    op.snapshot_state(1)
    ANSWERS.extend([CommitOutcome.retry_later("throttled"), CommitOutcome.retry_later("again")])
    op.notify_checkpoint_complete(1)
    assert COMMITTED == [] and op.commits_outstanding()
    assert timers.scheduled == [(pytest.approx(0.1, abs=0.05), sink_operator.RETRY_COMMITS)]
    # Still due in the next checkpoint's state: a failure now loses nothing.
    state = op.snapshot_state(2)
    assert state["due"] == [(2, b"s0-t0-c1")]
    op.notify_checkpoint_complete(2)  # too early for its next try: nothing happens
    assert COMMITTED == []
    op.due[0].next_try_at = 0.0  # the timer fires once the backoff has passed
    op.on_timer(sink_operator.RETRY_COMMITS)
    assert COMMITTED == [] and len(timers.scheduled) == 2  # answered "again"
    assert timers.scheduled[1][0] == pytest.approx(0.2, abs=0.05)
    op.due[0].next_try_at = 0.0
    op.on_timer(sink_operator.RETRY_COMMITS)
    assert COMMITTED == ["s0-t0-c1"] and not op.commits_outstanding()
    assert op.metrics()["commit_retries"] == 2 and op.result() == 1


def test_retry_later_past_the_bound_fails_with_the_reason():
    op = operator(MemorySink(EO), FakeTimers(), CommitRetryPolicy(max_retries=2))
    op.process(rows())
    op.snapshot_state(1)
    ANSWERS.extend([CommitOutcome.retry_later("bucket throttled")] * 3)
    op.notify_checkpoint_complete(1)
    op.due[0].next_try_at = 0.0
    op.on_timer(sink_operator.RETRY_COMMITS)
    op.due[0].next_try_at = 0.0
    with pytest.raises(CommitFailedError) as info:
        op.on_timer(sink_operator.RETRY_COMMITS)
    text = str(info.value)
    assert "sink 'out' (MemorySink)" in text and "s0-t0-c1" in text
    assert "after 3 tries" in text and "bucket throttled" in text


def test_failed_fails_at_once_naming_sink_and_reason():
    op = operator(MemorySink(EO), FakeTimers())
    op.process(rows())
    op.snapshot_state(1)
    cause = RuntimeError("the part was deleted")
    ANSWERS.append(CommitOutcome.failed("pre-committed data lost", cause))
    with pytest.raises(
        CommitFailedError, match="MemorySink.*failed: pre-committed data lost"
    ) as info:
        op.notify_checkpoint_complete(1)
    assert info.value.__cause__ is cause


def test_a_committer_that_raises_is_retried_and_already_committed_is_success():
    timers = FakeTimers()
    op = operator(MemorySink(EO), timers)
    op.process(rows())
    op.snapshot_state(1)
    ANSWERS.append(ConnectionError("reset by peer"))
    op.notify_checkpoint_complete(1)
    assert op.due[0].reason == "ConnectionError: reset by peer"
    COMMITTED.append("s0-t0-c1")  # it went through after all
    op.due[0].next_try_at = 0.0
    op.on_timer(sink_operator.RETRY_COMMITS)
    assert COMMITTED == ["s0-t0-c1"] and not op.commits_outstanding()


def test_commit_must_answer_with_an_outcome():
    class Silent(_Committer):
        def commit(self, committable):
            return None

    class SilentSink(MemorySink):
        def create_committer(self, context):
            return Silent()

    op = operator(SilentSink(EO))
    op.process(rows())
    op.snapshot_state(1)
    with pytest.raises(TypeError, match="not a CommitOutcome"):
        op.notify_checkpoint_complete(1)


def test_without_timers_a_retry_waits_for_the_next_notification():
    op = operator(MemorySink(EO), timers=None)
    op.process(rows())
    op.snapshot_state(1)
    ANSWERS.append(CommitOutcome.retry_later("busy"))
    op.notify_checkpoint_complete(1)
    assert COMMITTED == []
    op.due[0].next_try_at = 0.0
    op.notify_checkpoint_complete(1)  # a repeated notification tries again
    assert COMMITTED == ["s0-t0-c1"]


def test_retry_later_during_recovery_keeps_it_due_and_from_the_lingering_abort():
    kept: list[Sequence[str]] = []

    class Keeping(_Committer):
        def abort_lingering(self, context, keep):
            kept.append(list(keep))
            return 0

    class KeepingSink(MemorySink):
        def create_committer(self, context):
            return Keeping()

    first = operator(KeepingSink(EO))
    first.process(rows())
    state = pickle.loads(pickle.dumps(first.snapshot_state(1)))
    timers = FakeTimers()
    second = operator(KeepingSink(EO), timers, attempt=1)
    second.restore_state([state])
    ANSWERS.append(CommitOutcome.retry_later("locked"))
    second.recover(1)
    assert kept == [["s0-t0-c1"]] and second.commits_outstanding() and timers.scheduled
    second.due[0].next_try_at = 0.0
    second.on_timer(sink_operator.RETRY_COMMITS)
    assert COMMITTED == ["s0-t0-c1"]


def test_at_least_once_keeps_an_unfinished_commit_in_the_checkpoint():
    op = operator(MemorySink(DeliveryGuarantee.AT_LEAST_ONCE), FakeTimers())
    op.process(rows())
    ANSWERS.append(CommitOutcome.retry_later("busy"))
    state = op.snapshot_state(1)  # committed at the barrier: not yet
    assert state["due"] == [(2, b"s0-t0-c1")] and state["pending"] == {}
    restored = operator(MemorySink(DeliveryGuarantee.AT_LEAST_ONCE), attempt=1)
    restored.restore_state([state])
    restored.recover(1)
    assert COMMITTED == ["s0-t0-c1"]


# --- committables in checkpoints ----------------------------------------------------------


def test_checkpoint_state_holds_versioned_bytes_and_older_versions_are_read():
    op = operator(MemorySink(EO))
    op.process(rows())
    state = op.snapshot_state(7)
    assert state["format"] == sink_operator.STATE_FORMAT
    assert state["pending"] == {7: [(2, b"s0-t0-c7")]}
    older = dict(state, pending={7: [(1, b"s0-t0-c7")]})
    restored = operator(MemorySink(EO), attempt=1)
    restored.restore_state([older])
    assert restored.restored == ["s0-t0-c7-from-v1"]


def test_an_unknown_committable_version_is_a_clear_error():
    op = operator(MemorySink(EO))
    op.process(rows())
    state = op.snapshot_state(1)
    state["pending"][1] = [(9, b"s0-t0-c1")]
    restored = operator(MemorySink(EO), attempt=1)
    with pytest.raises(UnknownCommittableVersionError) as info:
        restored.restore_state([state])
    text = str(info.value)
    assert "sink 'out' (MemorySink)" in text and "version 9" in text and "[1, 2]" in text


def test_state_of_older_versions_holds_committable_objects():
    legacy = {"pending": {3: ["s0-t0-c3"]}, "next_sequence": 1, "subtask": 0}
    op = operator(MemorySink(EO), attempt=1)
    op.restore_state([legacy])
    op.recover(3)
    assert COMMITTED == ["s0-t0-c3"]


@pytest.mark.parametrize(
    "serializer, committable",
    [
        (
            FileCommittableSerializer(),
            FileCommittable("/d/.p.inprogress", "/d/p", 12, "tok", (1, 2, 3), "boot"),
        ),
        (FileCommittableSerializer(), FileCommittable("/d/.p.inprogress", "/d/p", 12)),
        (
            S3CommittableSerializer(),
            S3Committable(
                "b", "k", "u", ((1, '"e1"'), (2, '"e2"')), 99, 5, "CRC32", ("x", "y"), "t"
            ),
        ),
        (_CollectSerializer(), ("job_out_0000_3", 0, 3, b"\x00arrow")),
    ],
)
def test_every_sink_serializer_round_trips(serializer, committable):
    version, data = serializer.encode(committable)
    assert version == 1 and isinstance(data, bytes)
    assert serializer.decode(version, data) == committable
    with pytest.raises(UnknownCommittableVersionError):
        serializer.decode(version + 1, data)


# --- the contract's shape -----------------------------------------------------------------


def test_abort_lingering_is_required_of_every_committer():
    class Forgetful(Committer[str]):
        def commit(self, committable):
            return CommitOutcome.committed()

        def abort(self, committable):
            pass

    with pytest.raises(TypeError, match="abort_lingering"):
        Forgetful()

    class ForgetfulSink(MemorySink):
        def create_committer(self, context):
            return Forgetful()

    with pytest.raises(TypeError, match="abort_lingering"):
        operator(ForgetfulSink(EO))


def test_commit_outcomes():
    assert CommitOutcome.committed().done and CommitOutcome.already_committed().done
    assert not CommitOutcome.retry_later("x").done and not CommitOutcome.failed("x").done
    assert CommitOutcome.failed("x").status is CommitStatus.FAILED
    assert [s.name for s in CommitStatus] == [
        "COMMITTED",
        "ALREADY_COMMITTED",
        "RETRY_LATER",
        "FAILED",
    ]


def test_max_transaction_lifetime_is_declared_by_the_contract(tmp_path):
    assert TwoPhaseCommittingSink.max_transaction_lifetime_s is None
    assert FileSink(tmp_path).max_transaction_lifetime_s is None
    assert S3FileSink("b", max_transaction_lifetime_s=60).max_transaction_lifetime_s == 60


def test_builders_pickle_as_configuration(tmp_path):
    sink = S3FileSink("bucket", endpoint_url="http://127.0.0.1:1", aws_secret_access_key="s")
    assert sink._client is None
    clone = pickle.loads(pickle.dumps(sink))
    assert vars(clone) == vars(sink)


# --- guarantee resolution -----------------------------------------------------------------


def job(sink, interval=None, mode=CheckpointingMode.EXACTLY_ONCE):
    env = StreamExecutionEnvironment.get_execution_environment()
    if interval is not None:
        env.enable_checkpointing(interval, mode)
    env.from_source(NumberSequenceSource(0, 9)).sink_to(sink, name="out")
    return env


def sinks_of_every_kind(tmp_path):
    return [CollectSink(), FileSink(tmp_path / "out"), S3FileSink("bucket")]


@pytest.mark.parametrize(
    "interval, mode, given",
    [
        (None, CheckpointingMode.EXACTLY_ONCE, DeliveryGuarantee.NONE),
        (100, CheckpointingMode.AT_LEAST_ONCE, DeliveryGuarantee.AT_LEAST_ONCE),
        (100, CheckpointingMode.EXACTLY_ONCE, DeliveryGuarantee.EXACTLY_ONCE),
    ],
)
def test_one_default_rule_for_every_sink_and_the_sink_is_left_as_it_was(
    tmp_path, interval, mode, given
):
    for sink in sinks_of_every_kind(tmp_path):
        before = copy.deepcopy(vars(sink))
        env = job(sink, interval, mode)
        graph = env.get_job_graph()
        resolution = graph.sink_guarantees()["out"]
        assert resolution.delivery_guarantee is given and resolution.requested is None
        assert resolution.sink_type == type(sink).__name__
        assert env.explain() and env.guarantees()["out"] == resolution.end_to_end
        assert vars(sink) == before, type(sink).__name__
        assert not sink.guarantee_requested and sink.delivery_guarantee is EO


def test_the_operator_gets_the_resolved_guarantee(tmp_path):
    sink = FileSink(tmp_path / "out")
    graph = job(sink, 100, CheckpointingMode.AT_LEAST_ONCE).get_job_graph()
    [spec] = graph.sink_specs()
    op = spec.factory()
    assert op.mode is DeliveryGuarantee.AT_LEAST_ONCE
    assert sink.delivery_guarantee is EO


def test_asking_for_more_than_the_job_gives_fails_naming_the_sink(tmp_path):
    for sink in (
        CollectSink(EO),
        FileSink(tmp_path, delivery_guarantee=EO),
        S3FileSink("b", delivery_guarantee=EO),
    ):
        with pytest.raises(UnsupportedGuaranteeError) as info:
            job(sink).get_job_graph()
        assert f"sink 'out' ({type(sink).__name__})" in str(info.value)
        with pytest.raises(UnsupportedGuaranteeError, match=type(sink).__name__):
            job(sink, 100, CheckpointingMode.AT_LEAST_ONCE).explain()


def test_sink_result_finds_a_sink_by_object_without_marking_it():
    from rayflow.environment import JobResult

    sink, other = CollectSink(), CollectSink()
    result = JobResult(
        "j", 0.0, 1.0, sink_results={"out": 1, "b": 2}, sink_names=[(sink, "out"), (other, "b")]
    )
    assert result.sink_result(sink) == 1 and result.sink_result(other) == 2
    with pytest.raises(KeyError):
        result.sink_result(CollectSink())


def test_cancel_clean_up_runs_after_the_fence_is_revoked():
    from rayflow.runtime.fence import AttemptFence

    swept: list[int] = []

    class Sweeping(_Committer):
        def abort_lingering(self, context, keep):
            context.check_fence("sweep")  # a committer that checks the fence, as it should
            swept.append(context.subtask_index)
            return 0

    class SweepingSink(MemorySink):
        def create_committer(self, context):
            return Sweeping()

    fence = AttemptFence("run-1", 0)
    op = TwoPhaseCommitSinkOperator(SweepingSink(EO))
    op.open(OperatorContext("job", "out", "out", 0, 1, 128, 0, checkpointing=True, fence=fence))
    op.process(rows())
    op.snapshot_state(1)
    op.process(rows())
    op.snapshot_state(2)
    fence.revoke()  # the job is cancelled: its subtasks clean up as its last word
    op.on_cancel(latest_completed=1)
    assert COMMITTED == ["s0-t0-c1"] and swept == [0]


class _InOrder(_Committer):
    """Commits one writer's committables only in order (as Kafka's marker needs): a later
    one answers RETRY_LATER until the earlier one is committed. ``script``: per sequence,
    RETRY_LATER reasons it answers first, when its turn has come."""

    def __init__(self, script: dict[int, list[str]]) -> None:
        self.script = script

    def commit(self, committable: str) -> CommitOutcome:
        sequence = int(committable.split("-t")[1].split("-")[0])
        if sequence > len(COMMITTED):
            return CommitOutcome.retry_later(f"sequence {len(COMMITTED)} first")
        if sequence < len(COMMITTED):
            return CommitOutcome.already_committed()
        if self.script.get(sequence):
            return CommitOutcome.retry_later(self.script[sequence].pop(0))
        COMMITTED.append(committable)
        return CommitOutcome.committed()


class _InOrderSink(MemorySink):
    def __init__(self, script: dict[int, list[str]] | None = None) -> None:
        super().__init__(EO)
        self.script = script or {}

    def create_committer(self, context):
        return _InOrder(self.script)


def _two_committables_in_order(monkeypatch, script=None):
    """An operator of an in-order sink with two checkpoints' committables pending (the
    first checkpoint's notification never came), its clean-up allowed to sleep; and the
    state of the second checkpoint."""
    monkeypatch.setattr(sink_operator.time, "sleep", lambda seconds: None)  # a clean-up thread
    op = operator(_InOrderSink(script), FakeTimers(), CommitRetryPolicy(max_retries=2))
    op.process(rows())
    op.snapshot_state(1)
    op.process(rows())
    return op, op.snapshot_state(2)


def test_cancel_clean_up_commits_in_the_order_the_committer_needs(monkeypatch):
    """The restore's first committable answered RETRY_LATER and is due; the recovery
    thread had not reached the second when the job was cancelled. The clean-up commits
    both, in either order of its lists, within its retries."""
    _, state = _two_committables_in_order(monkeypatch)
    restored = operator(_InOrderSink(), FakeTimers(), CommitRetryPolicy(max_retries=2))
    restored.restore_state([state])
    first, second = restored.restored
    # the recovery thread: the first answered RETRY_LATER (now due); cancelled before the second
    restored.due = [sink_operator._Due(first, tries=1)]
    restored.restored = [second]
    restored.on_cancel(latest_completed=2)
    assert COMMITTED == [first, second]


def test_cancel_clean_up_gives_a_committable_its_retries_after_the_one_it_waited_on(
    monkeypatch,
):
    """In the clean-up, the second committable answers RETRY_LATER while the first is not
    committed (which needs two retries of its own), then needs two retries of its own:
    the retries spent waiting on the first do not count against it."""
    op, _ = _two_committables_in_order(monkeypatch, {0: ["busy", "busy"], 1: ["busy", "busy"]})
    op.on_cancel(latest_completed=2)
    assert [c.split("-c")[0] for c in COMMITTED] == ["s0-t0", "s0-t1"]


def test_direct_use_keeps_its_writers_in_a_slot_that_never_travels(tmp_path):
    import gc
    import weakref

    from rayflow import process_local

    sink = FileSink(tmp_path)
    txn = sink.begin_transaction(SinkContext("job", "out", 0, 1, 0), 0)
    sink.write(txn, rows())
    clone = pickle.loads(pickle.dumps(sink))
    assert process_local.local(clone, "direct-use") is None
    assert copy.deepcopy(sink).__dict__ == clone.__dict__
    sink.abort_transaction(txn)
    gone = weakref.ref(sink)
    del sink, txn
    gc.collect()
    assert gone() is None  # nothing outside the sink keeps it (or its writers) alive


# --- hold_run: a mark a run holds while it lives ---------------------------------------------


class _Hold(RunHold):
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def close(self) -> None:
        self.log.append(("closed", self.name))


class HoldingSink(MemorySink):
    def __init__(self, log: list, refuse: bool = False) -> None:
        super().__init__()
        self.log, self.refuse = log, refuse

    def hold_run(self, context: SinkContext) -> _Hold:
        if self.refuse:
            raise RuntimeError("another run lives")
        self.log.append(("held", context))
        return _Hold(self.log, context.operator_uid)


def test_the_job_master_holds_each_sinks_mark_for_the_run_and_lets_go_if_one_refuses():
    from rayflow.runtime.run_holds import hold_sinks, release_holds
    from rayflow.runtime.settings import JobSettings

    log: list = []
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100, CheckpointingMode.EXACTLY_ONCE)
    numbers = env.from_source(NumberSequenceSource(0, 9))
    numbers.sink_to(HoldingSink(log), name="first").uid("first")
    graph = env.get_job_graph()
    settings = JobSettings(job_name="nightly", run_id="run-1-ab")
    holds = hold_sinks(graph, settings)
    [(what, context)] = log
    assert (context.job_name, context.operator_uid, context.run_id) == (
        "nightly",
        "first",
        "run-1-ab",
    )
    assert (context.subtask_index, context.attempt, context.parallelism) == (0, -1, 2)
    assert context.delivery_guarantee is DeliveryGuarantee.EXACTLY_ONCE
    release_holds(holds)
    assert log[-1] == ("closed", "first")

    log.clear()
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.enable_checkpointing(100, CheckpointingMode.EXACTLY_ONCE)
    numbers = env.from_source(NumberSequenceSource(0, 9))
    numbers.sink_to(HoldingSink(log), name="a").uid("a")
    numbers.sink_to(HoldingSink(log, refuse=True), name="b").uid("b")
    with pytest.raises(RuntimeError, match="another run"):
        hold_sinks(env.get_job_graph(), settings)
    assert [entry[0] for entry in log] == ["held", "closed"]  # the mark taken is let go


def test_a_sink_holds_nothing_by_default():
    context = SinkContext("job", "out", 0, 1, -1, run_id="run-1-ab")
    assert MemorySink().hold_run(context) is None
