"""rayflow.testing's fault plans against real jobs."""

from __future__ import annotations

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
