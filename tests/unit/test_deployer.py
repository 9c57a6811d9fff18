"""The deployer's wiring, without Ray: receivers, channels, key routing, restore."""

from __future__ import annotations

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.checkpoint.coordinator import CompletedCheckpoint
from rayflow.checkpoint.metadata import CheckpointMetadata, SubtaskStateMeta
from rayflow.plan.partitioners import PartitionKind
from rayflow.runtime.deployer import Deployer
from rayflow.runtime.settings import JobSettings
from rayflow.testing import Fault, FaultPlan, FaultPoint
from sinks.basic import CollectSink


def _graph():
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    (
        env.from_source(NumberSequenceSource(0, 99), "numbers")
        .uid("numbers")
        .key_by("value")
        .sum("value", name="sum")
        .uid("sum")
        .set_max_parallelism(256)
        .set_parallelism(3)
        .sink_to(CollectSink(), name="out")
        .uid("out")
        .set_parallelism(3)  # chained after the sum
    )
    graph = env.get_job_graph()
    source = next(v for v in graph.vertices.values() if v.is_source)
    summing = next(v for v in graph.vertices.values() if not v.is_source)
    return graph, source, summing


def test_a_sender_gets_every_receiver_and_routes_by_the_receivers_key_groups():
    graph, source, summing = _graph()
    deployer = Deployer(graph, JobSettings("job", run_id="run-x"), None)
    actors = {(summing.vertex_id, r): f"handle-{r}" for r in range(summing.parallelism)}
    (output,) = deployer.outputs(source, 1, actors)
    assert output.partitioner.kind is PartitionKind.HASH
    assert [h for h, _ in output.receivers] == ["handle-0", "handle-1", "handle-2"]
    # the channel index is this sender's input channel at each receiver
    assert [c for _, c in output.receivers] == [1, 1, 1]
    (first,) = deployer.outputs(source, 0, actors)
    assert [c for _, c in first.receivers] == [0, 0, 0]
    # the keyed operator's own max parallelism, not the sender's (128 by default)
    assert output.max_parallelism == summing.max_parallelism == 256
    assert deployer.outputs(summing, 0, actors) == []  # the sink ends the chain


def test_a_deployment_carries_its_run_attempt_splits_state_and_hooks():
    graph, source, summing = _graph()
    plan = FaultPlan([Fault(FaultPoint.AFTER_RECORDS, attempt=4, vertex="sum", subtask=2)])
    settings = JobSettings("job", run_id="run-x", hooks=plan)
    deployer = Deployer(graph, settings, None)
    meta = CheckpointMetadata(
        7,
        "job",
        "run-x",
        3,
        0.0,
        1.0,
        False,
        {
            (summing.vertex_id, i): SubtaskStateMeta(
                f"p/a3-v{summing.vertex_id}-s{i}.state",
                1,
                tuple(op.uid for op in summing.operators),
                2,
                "sum",
            )
            for i in range(2)
        },
    )
    restore = CompletedCheckpoint(7, meta)
    d = deployer.deployment(summing, 2, 4, restore, outputs=[], master="m")
    assert (d.run_id, d.attempt, d.index, d.restored_checkpoint, d.master) == (
        "run-x",
        4,
        2,
        7,
        "m",
    )
    assert d.num_input_channels == source.parallelism
    assert [h.path for h in d.restore] == [s.path for s in meta.subtasks.values()]  # rescaled
    assert d.hooks is not None and d.hooks.record_threshold == 0
    assert deployer.deployment(summing, 1, 4, restore, outputs=[]).hooks is None
    fresh = deployer.deployment(source, 0, 0, None, outputs=[])
    assert [s.split_id for s in fresh.source_splits] == ["numbers-0"] and fresh.restore == []


def _wide_graph(senders: int, receivers: int):
    env = StreamExecutionEnvironment.get_execution_environment()
    (
        env.from_source(NumberSequenceSource(0, 99), "numbers")
        .set_parallelism(senders)
        .key_by("value")
        .sum("value", name="sum")
        .set_parallelism(receivers)
        .sink_to(CollectSink(), name="out")
        .set_parallelism(receivers)
    )
    graph = env.get_job_graph()
    source = next(v for v in graph.vertices.values() if v.is_source)
    summing = next(v for v in graph.vertices.values() if not v.is_source)
    return graph, source, summing


def _sizes(senders: int, receivers: int, settings: JobSettings):
    """(send bytes, message bytes) of a source subtask, gate bytes of a summing one."""
    graph, source, summing = _wide_graph(senders, receivers)
    deployer = Deployer(graph, settings, None)
    actors = {(summing.vertex_id, r): f"handle-{r}" for r in range(receivers)}
    sending = deployer.deployment(source, 0, 0, None, deployer.outputs(source, 0, actors))
    receiving = deployer.deployment(summing, 0, 0, None, outputs=[])
    return sending.send_bytes, sending.buffer_bytes, receiving.channel_bytes


def test_channels_share_a_subtasks_network_bytes_by_default():
    """A subtask's output channels share 32 MiB, and so do its input channels: up to 16
    MiB each for few channels (several 4 MiB messages in flight), never under 1 MiB."""
    MiB = 1 << 20
    settings = JobSettings("job", run_id="run-x")
    assert _sizes(1, 1, settings) == (16 * MiB, 4 * MiB, 16 * MiB)
    assert _sizes(2, 2, settings) == (16 * MiB, 4 * MiB, 16 * MiB)
    assert _sizes(4, 8, settings) == (4 * MiB, 1 * MiB, 8 * MiB)  # 8 out, 4 in
    assert _sizes(64, 64, settings) == (1 * MiB, 1 * MiB, 1 * MiB)


def test_a_buffer_timeout_under_the_default_keeps_1_mib_channels_and_messages():
    """A job that asks for latency (a buffer timeout under 100 ms) keeps what waits in
    flight in front of each record as small as before: bigger channels raised the p99
    of latency markers at timeouts 0 and 10 ms (benchmarks/RESULTS.md)."""
    MiB = 1 << 20
    for timeout in (0, 10, 99):
        settings = JobSettings("job", run_id="run-x", buffer_timeout_ms=timeout)
        assert _sizes(1, 1, settings) == (MiB, MiB, MiB), timeout
    settings = JobSettings("job", run_id="run-x", buffer_timeout_ms=10, channel_bytes=8 * MiB)
    assert _sizes(1, 1, settings) == (8 * MiB, 2 * MiB, 8 * MiB)  # set by the job: as it is


def test_sizes_a_job_sets_are_taken_as_they_are():
    settings = JobSettings("job", run_id="run-x", channel_bytes=300, buffer_bytes=5000)
    assert _sizes(1, 1, settings) == (300, 5000, 300)
    assert _sizes(64, 64, settings) == (300, 5000, 300)
    # a channel size alone: messages of a quarter of it, at least 1 MiB
    settings = JobSettings("job", run_id="run-x", channel_bytes=8 << 20)
    assert _sizes(1, 1, settings) == (8 << 20, 2 << 20, 8 << 20)
