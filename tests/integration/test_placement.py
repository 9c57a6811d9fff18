"""The job's placement group on the suite's single-node Ray: subtasks run in it, a
restarted subtask goes back into it, and it is gone after success, failure and cancel."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from rayflow import (
    JobCancelledError,
    JobFailedError,
    NumberSequenceSource,
    StreamExecutionEnvironment,
)
from rayflow.config import RestartStrategies
from rayflow.runtime.placement import job_placement_groups
from rayflow.testing import Fault, FaultPlan, FaultPoint
from sinks.basic import CollectSink
from tests.chaos.harness import build_keyed_sum, expected_sums, outcome, unique_job


def _left_behind(job_id: str, timeout_s: float = 20.0) -> tuple[dict, list]:
    """The job's placement groups and named actors still there after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while True:
        groups = job_placement_groups(job_id)
        actors = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"rayflow:{job_id}:")
        ]
        if (not groups and not actors) or time.time() > deadline:
            return groups, actors
        time.sleep(0.2)


class _GroupWatch:
    """Records every placement group of a job seen while it runs."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.seen: set[str] = set()
        self.bundles = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ray.util.placement_group import placement_group_table

        while not self._stop.is_set():
            for pg_id, info in placement_group_table().items():
                if info["name"].startswith(f"rayflow:{self.job_id}:pg:"):
                    self.seen.add(pg_id)
                    self.bundles = len(info["bundles"])
            time.sleep(0.1)

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join()
        return self.seen


def test_a_restarted_subtask_goes_back_into_the_jobs_placement_group(tmp_path):
    n = 60_000
    plan = FaultPlan([Fault(FaultPoint.AFTER_RECORDS, attempt=0, subtask=1, records=20_000)])
    env, sink = build_keyed_sum(n, 2, 2000, rate=60_000, storage=str(tmp_path), plan=plan)
    client = env.execute_async(unique_job("placement-restart"))
    watch = _GroupWatch(client.job_id)
    result = client.wait(timeout=120)
    seen = watch.stop()
    assert result.restarts == 1
    assert outcome(result, sink).sums == expected_sums(n)
    assert len(seen) == 1, "every attempt of one job master uses one placement group"
    assert watch.bundles == 4  # one bundle per subtask: 2 vertices x parallelism 2
    assert _left_behind(client.job_id) == ({}, [])


def test_unplaceable_bundles_fail_the_job_with_what_is_missing():
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.set_restart_strategy(RestartStrategies.no_restart())
    env.set_placement(ready_timeout_s=1)
    (
        env.from_source(NumberSequenceSource(0, 999))
        .key_by("value")
        .sum("value")
        .set_resources(resources={"rayflow_test_missing": 1})  # no node has it
        .sink_to(CollectSink())
    )
    client = env.execute_async(unique_job("placement-missing"))
    with pytest.raises(JobFailedError, match="placement bundles not placed") as info:
        client.wait(timeout=60)
    assert "rayflow_test_missing" in str(info.value)
    assert _left_behind(client.job_id) == ({}, [])


def test_cancel_removes_the_placement_group(tmp_path):
    env, _ = build_keyed_sum(10_000_000, 2, 1000, rate=20_000, storage=str(tmp_path))
    client = env.execute_async(unique_job("placement-cancel"))
    deadline = time.time() + 60
    while not job_placement_groups(client.job_id) and time.time() < deadline:
        time.sleep(0.1)
    assert job_placement_groups(client.job_id)
    assert client.cancel(timeout=120)
    with pytest.raises(JobCancelledError):
        client.wait()
    assert _left_behind(client.job_id) == ({}, [])


def test_cancel_does_not_wait_for_bundles_that_cannot_be_placed():
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.set_placement(ready_timeout_s=3600)
    (
        env.from_source(NumberSequenceSource(0, 999))
        .map(lambda r: r)
        .set_resources(resources={"rayflow_test_missing": 1})
        .sink_to(CollectSink())
    )
    client = env.execute_async(unique_job("placement-cancel-waiting"))
    deadline = time.time() + 60
    while not job_placement_groups(client.job_id) and time.time() < deadline:
        time.sleep(0.1)
    assert client.cancel(timeout=120)  # a TimeoutError here: the cancel waited for bundles
    assert _left_behind(client.job_id) == ({}, [])


def test_placement_none_runs_without_a_placement_group():
    env, sink = build_keyed_sum(5000, 2, 1000, rate=None, checkpoint_ms=None)
    env.set_placement("NONE")
    client = env.execute_async(unique_job("placement-none"))
    watch = _GroupWatch(client.job_id)
    result = client.wait(timeout=60)
    assert watch.stop() == set()
    assert outcome(result, sink).sums == expected_sums(5000)
