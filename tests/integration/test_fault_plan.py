"""rayflow.testing's fault plans against real jobs."""

from __future__ import annotations

import contextlib
import threading

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink


def test_a_fault_plan_targets_the_next_run_only(tmp_path):
    """A plan never fires in a later run of the same environment (attempt 0 of every run
    would otherwise match it again)."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path))
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 0))
    inject_faults(env, FaultPlan([Fault(FaultPoint.AFTER_RECORDS, vertex="keyed", records=1)]))
    (
        env.from_source(NumberSequenceSource(0, 9_999, batch_size=500), "numbers")
        .key_by(lambda r: r["value"] % 10)
        .map(lambda r: r, "keyed")
        .sink_to(CollectSink(), "out")
    )
    first = env.execute("fault-plan-run-1")
    second = env.execute("fault-plan-run-2")
    assert first.restarts == 1, first.failures
    assert second.restarts == 0, second.failures


def test_a_subtask_killed_before_notify_is_dead_before_the_notification_is_sent():
    """BEFORE_NOTIFY: a subtask dies after the commit point, before its notification.
    The kill must have taken effect when the hook returns, or the notification the job
    master sends next can reach the subtask first (it then commits what the schedule
    meant to leave for the restored attempt)."""
    import ray

    from rayflow.testing import MasterFaults

    for round_ in range(3):
        actor = _committer()
        assert ray.get(actor.notify.remote(0)) == 0
        hooks = MasterFaults([Fault(FaultPoint.BEFORE_NOTIFY, vertex="committed", checkpoint=2)])
        assert hooks.at(FaultPoint.BEFORE_NOTIFY, 1, {("Sum -> committed", 0): actor})
        assert ray.get(actor.notify.remote(1)) == 1  # not its checkpoint: no kill
        answer = _answer_after_the_hook(hooks, FaultPoint.BEFORE_NOTIFY, 2, actor, 1.0)
        assert answer is None, f"round {round_}: the killed subtask took notification {answer}"


def test_a_subtask_killed_during_the_commit_point_is_dead_before_the_notification_is_sent():
    """DURING_COMMIT_POINT: a subtask dies while the commit point is written, so the
    checkpoint completes without it. The kill must have taken effect when the hook
    returns (the metadata write and the notification come next, the write of a local
    directory in milliseconds), or the subtask takes the notification and commits what
    the schedule leaves for the restored attempt: the BEFORE_NOTIFY race, one step
    earlier. ``seconds`` (the commit point outlives the death) is a sleep, not a wait."""
    import ray

    from rayflow.testing import MasterFaults

    for seconds in (0.0, 1.0):
        actor = _committer()
        assert ray.get(actor.notify.remote(0)) == 0
        fault = Fault(
            FaultPoint.DURING_COMMIT_POINT, vertex="committed", checkpoint=2, seconds=seconds
        )
        hooks = MasterFaults([fault])
        point = FaultPoint.DURING_COMMIT_POINT
        answer = _answer_after_the_hook(hooks, point, 2, actor, seconds + 1.0)
        assert answer is None, f"seconds={seconds}: the killed subtask took notification {answer}"


def test_a_kept_subtask_killed_during_the_restart_delay_is_dead_before_it_is_redeployed():
    """DURING_RESTART_DELAY kills a subtask kept for reuse; after the delay the job master
    redeploys the kept ones. A kill still on its way then is answered by the subtask
    (it takes the redeploy and dies in the next attempt: a second restart the schedule
    did not mean, see tests/chaos/test_fencing.py's restart-delay schedule)."""
    import ray

    from rayflow.testing import MasterFaults

    actor = _committer()
    assert ray.get(actor.notify.remote(0)) == 0
    hooks = MasterFaults([Fault(FaultPoint.DURING_RESTART_DELAY, vertex="running-sum", subtask=1)])
    # the job master's call after the delay (a redeploy), stood in for by a notification
    answer = _answer_after_the_hook(
        hooks, FaultPoint.DURING_RESTART_DELAY, 0, actor, 1.0, name="running-sum", index=1
    )
    assert answer is None, f"the killed kept subtask took the redeploy: {answer}"


def _answer_after_the_hook(
    hooks, point, checkpoint: int, actor, pause_s: float, name="Sum -> committed", index=0
):
    """Run the job master's hook at ``point`` while the GCS is paused for ``pause_s`` (the
    kill travels through it: slow there), call ``actor`` right after it returns, as the job
    master's next step does; the answer, or None when the actor was dead by then."""
    import ray
    from ray.exceptions import RayActorError

    with _gcs_paused(pause_s):
        hooks.at(point, checkpoint, {(name, index): actor})
        called = actor.notify.remote(checkpoint)
    try:
        return ray.get(called, timeout=60)
    except RayActorError:
        return None


def _committer():
    """A subtask stand-in never restarted by Ray (as a subtask's actor is)."""
    import ray

    @ray.remote(max_restarts=0)
    class Committer:
        async def notify(self, checkpoint_id: int) -> int:
            return checkpoint_id

    return Committer.remote()


@contextlib.contextmanager
def _gcs_paused(seconds: float):
    """Stop this session's GCS process for ``seconds`` (SIGSTOP, then SIGCONT): a slow
    GCS, not a dead one."""
    import psutil

    gcs = [  # the local Ray this session started: its processes are our children
        p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server"
    ]
    assert len(gcs) == 1, gcs
    gcs[0].suspend()
    timer = threading.Timer(seconds, gcs[0].resume)
    timer.start()
    try:
        yield
    finally:
        timer.join()
