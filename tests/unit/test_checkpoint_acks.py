"""What a checkpoint costs in calls: a small snapshot blob comes to the job master with
the subtask's acknowledgement (a larger one is fetched, so that the job master owns its
object either way), and a completed checkpoint is announced only to the subtasks that
act on it (a sink commits, a reader commits offsets), a final one to every subtask.
Without Ray: the coordinator with recording handles, the subtask class in one loop.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest

import rayflow.runtime.subtask as subtask_module
from rayflow.checkpoint.coordinator import (
    CheckpointCoordinator,
    CheckpointHistory,
    CheckpointIdCounter,
)
from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.config import CheckpointConfig
from rayflow.plan.physical import JobGraph, OperatorSpec, VertexSpec
from rayflow.runtime.operators import factory
from tests.unit.inprocess_job import Config, Cut, Job


class _Recorded:
    def __init__(self, calls: list, key: tuple[int, int], name: str) -> None:
        self.calls, self.key, self.name = calls, key, name

    def remote(self, *args: Any) -> str:
        self.calls.append((self.name, self.key, args))
        return f"{self.name} of {self.key}"  # stands in for the object ref


class _Task:
    def __init__(self, calls: list, key: tuple[int, int]) -> None:
        for name in (
            "trigger_checkpoint",
            "snapshot_blob",
            "notify_checkpoint_complete",
            "notify_checkpoint_aborted",
        ):
            setattr(self, name, _Recorded(calls, key, name))


class _Storage:
    def __init__(self) -> None:
        self.metadata: dict[int, bytes] = {}

    def reserve_ids(self, up_to: int) -> None:
        pass

    def commit_metadata(self, cid: int, metadata: CheckpointMetadata) -> None:
        self.metadata[cid] = metadata.to_bytes()

    def load_metadata(self, cid: int) -> CheckpointMetadata:
        return CheckpointMetadata.from_bytes(self.metadata[cid])

    def completed_ids(self) -> list[int]:
        return sorted(self.metadata)

    def collect_garbage(self, keep: list[int], in_flight: int | None = None) -> None:
        pass

    def discard(self, cid: int) -> None:
        self.metadata.pop(cid, None)


def _coordinator() -> tuple[CheckpointCoordinator, list]:
    vertices = {
        0: VertexSpec(0, "numbers", 2, 128, source=object(), source_uid="numbers"),
        1: VertexSpec(1, "sum -> sink", 2, 128),
    }
    graph = JobGraph(vertices=vertices, edges={})
    calls: list = []
    tasks = {(v, i): _Task(calls, (v, i)) for v in (0, 1) for i in range(2)}
    config = CheckpointConfig()
    config.set_checkpoint_interval(3_600_000)  # triggered here only
    storage = _Storage()
    coordinator = CheckpointCoordinator(
        "acks",
        config,
        storage,  # type: ignore[arg-type]
        graph,
        tasks,
        0,
        CheckpointIdCounter(storage, 1),  # type: ignore[arg-type]
        lambda exc: None,
        None,
        CheckpointHistory(10),
        None,
        run_id="run-acks",
    )
    return coordinator, calls


def _info(key: tuple[int, int], cid: int, notify: bool | None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "size": 10,
        "uids": ["sum", "sink"] if key[0] == 1 else [],
        "source_splits": [] if key[0] == 0 else None,
        "path": f"/ckpt/chk-{cid}/{key}",
    }
    if notify is not None:
        info["notify"] = notify
    return info


async def _round(
    coordinator: CheckpointCoordinator, acks: dict[tuple[int, int], tuple[Any, bool | None]]
) -> int:
    cid = await coordinator.trigger()
    assert cid is not None
    for key, (blob, notify) in acks.items():
        await coordinator.acknowledge(cid, key, _info(key, cid, notify), blob)
    while coordinator._background:
        await asyncio.wait(list(coordinator._background))
    assert coordinator.latest is not None and coordinator.latest.checkpoint_id == cid
    return cid


def test_a_blob_that_came_with_the_acknowledgement_is_kept_and_not_fetched():
    async def go():
        coordinator, calls = _coordinator()
        acks = {
            (0, 0): (b"source 0", False),
            (0, 1): (b"source 1", False),
            (1, 0): (b"sum 0", True),
            (1, 1): (None, True),  # too large to come along: fetched
        }
        await _round(coordinator, acks)
        refs = dict(coordinator.latest.refs)
        await coordinator.shutdown()
        return calls, refs

    calls, refs = asyncio.run(go())
    fetched = [key for name, key, _ in calls if name == "snapshot_blob"]
    assert fetched == [(1, 1)]
    assert refs == {
        (0, 0): b"source 0",
        (0, 1): b"source 1",
        (1, 0): b"sum 0",
        (1, 1): "snapshot_blob of (1, 1)",
    }


def test_only_the_subtasks_that_act_on_a_completion_hear_of_it():
    """A subtask that said it does not act on completions is left out; one that did not
    say (a subtask of an older version) is told, as is every subtask of a final one."""

    async def go():
        coordinator, calls = _coordinator()
        acks = {
            (0, 0): (b"s0", False),
            (0, 1): (b"s1", None),
            (1, 0): (b"k0", True),
            (1, 1): (b"k1", False),
        }
        first = await _round(coordinator, acks)
        told_first = [k for n, k, a in calls if n == "notify_checkpoint_complete" and a[1] == first]
        coordinator.request_final()
        cid = await coordinator.trigger(final=True)
        for key, (blob, _) in acks.items():
            await coordinator.acknowledge(cid, key, _info(key, cid, False), blob)
        while coordinator._background:
            await asyncio.wait(list(coordinator._background))
        told_final = [k for n, k, a in calls if n == "notify_checkpoint_complete" and a[1] == cid]
        await coordinator.shutdown()
        return told_first, told_final

    told_first, told_final = asyncio.run(go())
    assert sorted(told_first) == [(0, 1), (1, 0)]
    assert sorted(told_final) == [(0, 0), (0, 1), (1, 0), (1, 1)]


class _Listening(Cut):
    """Acts on completed checkpoints (as a sink does)."""

    def __init__(self) -> None:
        self.completed: list[int] = []

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        self.completed.append(checkpoint_id)


def _acks_of_a_run(listening_middle: bool) -> tuple[Job, int]:
    async def go() -> tuple[Job, int]:
        job = Job(Config(n=600, batch_size=20), seed=3)
        if listening_middle:
            job.middle_vertex = VertexSpec(
                1,
                "listen",
                2,
                128,
                operators=[OperatorSpec("listen", "listen", factory(_Listening))],
            )
        await job.deploy()
        job.start()
        assert await job.checkpoint(1)
        return job, await job.finish(2)

    return asyncio.run(go())


def test_a_subtask_says_whether_it_acts_on_completions_and_sends_a_small_blob_along():
    job, _ = _acks_of_a_run(listening_middle=False)
    acks, blobs = job.acks[1], job.blobs[1]
    assert {key: info["notify"] for key, info in acks.items()} == {key: False for key in acks}
    # each blob came along, the same bytes as the durable copy
    for key, info in acks.items():
        assert blobs[key] is not None and blobs[key] == job.storage.blobs[info["path"]], key
        assert 1 not in job.subtasks[key]._blobs  # nothing left to fetch
    assert sorted(job.kept()) == list(range(600))

    job, _ = _acks_of_a_run(listening_middle=True)
    notify = {key: info["notify"] for key, info in job.acks[1].items()}
    assert notify == {key: key[0] == 1 for key in notify}
    for index in range(2):
        assert 1 in job.subtasks[(1, index)].operators[0].completed


def test_a_blob_too_large_to_come_along_stays_for_the_fetch_and_asks_for_the_completion(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(subtask_module, "INLINE_BLOB_BYTES", 0)
    job, _ = _acks_of_a_run(listening_middle=False)
    counts = collections.Counter()
    for key, info in job.acks[1].items():
        assert job.blobs[1][key] is None, key
        assert info["notify"] is True, key  # its blob is dropped on the completion
        counts[key[0]] += 1
    assert counts == {0: 2, 1: 2, 2: 1}
