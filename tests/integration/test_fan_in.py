"""An aligned checkpoint completes at high fan-in with small buffers.

One real ``SubtaskActor`` (a keyed sum) with 130 input channels is driven directly by
the test, which plays every upstream sender. Barrier 1 arrives on channels 0..128,
each followed by a dozen batches: at capacity 1 those channels are blocked (aligned
checkpoint) and full, so more than 1000 ``push`` calls wait inside the actor. With
Ray's default 1000 concurrency slots of an async actor they would take every slot and
the barrier on channel 129 would never run (deadlock, no acknowledgement). With the
job master's ``max_concurrency`` the last barrier gets in, the checkpoint is
acknowledged and the waiting batches then flow.
"""

from __future__ import annotations

import dataclasses
import time

import pyarrow as pa
import ray

from rayflow import StreamExecutionEnvironment
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.config import CheckpointingMode
from rayflow.runtime.events import CheckpointBarrier
from rayflow.runtime.job_master import subtask_max_concurrency
from rayflow.runtime.subtask import SubtaskDeployment
from rayflow.runtime.subtask_actor import RemoteSubtaskActor

CHANNELS = 130
CAPACITY = 1
SEND_WINDOW = 64
BATCHES_PER_CHANNEL = 12  # behind the barrier: (12 - 1) * 129 = 1419 pushes wait (> 1000)
CHECKPOINT_ID = 1
ACK_TIMEOUT_S = 60.0
RUN_ID = "run-20260101T000000-abcd"


@ray.remote(num_cpus=0, max_restarts=0)
class _RecordingMaster:
    """Stands in for the JobMaster: records what the subtask reports (same signatures)."""

    def __init__(self) -> None:
        self.acks: list[tuple[int, int, tuple[int, int], dict]] = []
        self.declines: list[tuple[int, int, tuple[int, int], str]] = []
        self.running: list[tuple[int, tuple[int, int]]] = []
        self.exhausted: list[tuple[int, tuple[int, int]]] = []

    def acknowledge_checkpoint(
        self, attempt: int, cid: int, key: tuple, info: dict, blob: bytes | None = None
    ) -> None:
        self.acks.append((attempt, cid, key, info))

    def decline_checkpoint(self, attempt: int, cid: int, key: tuple, reason: str) -> None:
        self.declines.append((attempt, cid, key, reason))

    def subtask_running(self, attempt: int, key: tuple) -> None:
        self.running.append((attempt, key))

    def source_exhausted(self, attempt: int, key: tuple) -> None:
        self.exhausted.append((attempt, key))

    def report(self) -> dict:
        return {
            "acks": self.acks,
            "declines": self.declines,
            "running": self.running,
            "exhausted": self.exhausted,
        }


def _keyed_sum_vertex():
    """The ``Sum -> Print`` vertex of source -> key_by -> sum -> print, with 130 inputs
    played by the test. Only the keyed sum is kept (no stdout from the print sink)."""
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.from_collection([{"key": 0, "value": 0}], "src").key_by("key").sum("value").print()
    graph = env.get_job_graph()
    (vertex,) = [v for v in graph.vertices.values() if not v.is_source]
    assert [op.name for op in vertex.operators] == ["Sum", "Print"]
    return dataclasses.replace(
        vertex, operators=vertex.operators[:1], sinks=[], out_edges=[], in_edges=[]
    )


def _batch(channel: int, i: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"key": pa.array([channel % 7], pa.int64()), "value": pa.array([i + 1], pa.int64())}
    )


def _wait_for(predicate, timeout_s: float, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def test_aligned_checkpoint_completes_at_fan_in_130_with_capacity_1(tmp_path):
    vertex = _keyed_sum_vertex()
    master = _RecordingMaster.remote()
    deployment = SubtaskDeployment(
        job_name="fan-in",
        vertex=vertex,
        index=0,
        attempt=0,
        num_input_channels=CHANNELS,
        outputs=[],
        channel_capacity=CAPACITY,
        send_window=SEND_WINDOW,
        checkpointing=CheckpointingMode.EXACTLY_ONCE,
        storage=CheckpointStorage(str(tmp_path), "fan-in", run_id=RUN_ID),
        master=master,
        run_id=RUN_ID,
    )
    max_concurrency = subtask_max_concurrency(CHANNELS, SEND_WINDOW)
    actor = RemoteSubtaskActor.options(max_concurrency=max_concurrency).remote(deployment)
    try:
        assert ray.get(actor.ready.remote(), timeout=60)
        run_ref = actor.run.remote()
        assert _wait_for(lambda: ray.get(master.report.remote())["running"], 30)

        early = list(range(CHANNELS - 1))  # channels that deliver the barrier first
        barrier = CheckpointBarrier(CHECKPOINT_ID, time.time())
        barrier_refs = [actor.push.remote(ch, 0, 0, barrier) for ch in early]
        # Senders run side by side: the pushes are interleaved across channels.
        first_refs = [actor.push.remote(ch, 1, 0, _batch(ch, 0)) for ch in early]
        waiting_refs = [
            actor.push.remote(ch, i + 1, 0, _batch(ch, i))
            for i in range(1, BATCHES_PER_CHANNEL)
            for ch in early
        ]

        # Every early channel delivered its barrier (so it is blocked) and its buffer
        # holds one batch: the remaining pushes wait inside the actor for space.
        ray.get(barrier_refs + first_refs, timeout=60)
        assert len(waiting_refs) > 1000
        ready, _ = ray.wait(waiting_refs, num_returns=len(waiting_refs), timeout=1.0)
        assert not ready, "pushes behind a barrier were admitted before alignment ended"

        # A control call answers while the pushes wait.
        metrics = ray.get(actor.metrics.remote(), timeout=10)
        assert metrics["buffered"] == len(early)
        assert metrics["records_in"] == 0
        assert ray.get(master.report.remote())["acks"] == []

        # Only now the barrier on the last channel: the alignment completes.
        last_ref = actor.push.remote(CHANNELS - 1, 0, 0, barrier)
        report = _wait_for(lambda: ray.get(master.report.remote())["acks"], ACK_TIMEOUT_S)
        assert report, (
            f"checkpoint {CHECKPOINT_ID} not acknowledged within {ACK_TIMEOUT_S:.0f} s at "
            f"fan-in {CHANNELS} (max_concurrency={max_concurrency}): deadlock"
        )
        ((attempt, cid, key, info),) = report
        assert (attempt, cid, key) == (0, CHECKPOINT_ID, (vertex.vertex_id, 0))
        assert info["size"] > 0 and info["path"].endswith(".state")
        assert ray.get(master.report.remote())["declines"] == []

        # After the snapshot the channels are unblocked: every waiting batch gets in.
        ray.get([last_ref] + waiting_refs, timeout=60)
        expected = len(early) * BATCHES_PER_CHANNEL
        assert _wait_for(
            lambda: ray.get(actor.metrics.remote(), timeout=10)["records_in"] == expected, 30
        ), ray.get(actor.metrics.remote(), timeout=10)
        metrics = ray.get(actor.metrics.remote(), timeout=10)
        assert metrics["checkpoints"] == 1
        assert metrics["max_buffered"] <= CHANNELS * CAPACITY
        ready, _ = ray.wait([run_ref], timeout=0)
        assert not ready  # still running: it ends only after a final checkpoint
    finally:
        ray.kill(actor, no_restart=True)
        ray.kill(master, no_restart=True)
