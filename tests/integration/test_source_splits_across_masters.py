"""A source is cut into splits once per run: a job master started after the first one
died (before any checkpoint held positions) deploys the splits the run started from, not
a new cut. A source whose cut depends on when it is made (KafkaSource starting at
``latest()`` or at a group's committed offsets, a directory listing) would otherwise skip
what arrived between the two cuts."""

from __future__ import annotations

import os

from rayflow import DeliveryGuarantee, StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.sources import NumberSequenceSource, SourceSplit
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink

N = 100


class MovingStartSource(NumberSequenceSource):
    """The numbers ``1000 * k .. 1000 * k + N - 1``, where ``k`` counts the cuts made
    before this one (like "latest" offsets that moved on meanwhile)."""

    def __init__(self, counter: str) -> None:
        super().__init__(0, N - 1, batch_size=10, records_per_second=200)
        self.counter = counter

    def create_splits(self, parallelism: int) -> list[SourceSplit]:
        cuts = len(open(self.counter).read()) if os.path.exists(self.counter) else 0
        with open(self.counter, "a") as f:
            f.write("x")
        splits = super().create_splits(parallelism)
        for split in splits:
            split.next_value += 1000 * cuts
            split.end += 1000 * cuts
        return splits


def test_a_master_started_before_the_first_checkpoint_reads_the_first_cut(tmp_path):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(60_000)  # no periodic checkpoint before the end
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "checkpoints"))
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(3, 50))
    inject_faults(env, FaultPlan([Fault(FaultPoint.JOB_MASTER_BEFORE_FIRST_CHECKPOINT, attempt=0)]))
    collect = CollectSink(DeliveryGuarantee.EXACTLY_ONCE)
    source = MovingStartSource(str(tmp_path / "cuts"))
    env.from_source(source, "numbers").sink_to(collect, name="out")
    result = env.execute(f"first-cut-{os.getpid()}-{tmp_path.name}")
    assert result.job_master_restarts == 1
    values = sorted(result.sink_result(collect).column("value").to_pylist())
    assert values == list(range(N))
