"""Ray-free tests of the runtime environment that carries rayflow's setup hook to its
actors on a Ray it did not start: which processes started with it, when a driver's
actors get it (never over the driver's own runtime environment or setup hook, never on a
Ray whose raylet runs the hook already), and when the next job's job master is created
with it (only while the workers kept warm with it may still be there)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from rayflow.runtime import hook_env, preload
from rayflow.runtime.hook_env import actor_runtime_env, mark_hooked_raylet, runs_the_hook
from rayflow.runtime.preload import SETUP_HOOK
from rayflow.runtime.warm_workers import WarmWorkerConfig, WarmWorkers
from tests.unit.test_warm_workers import FakeNode, FakeRaylet

VARIABLE = preload.hook_variable()

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/environ")


def _sleeper(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; os.environ.pop({VARIABLE!r}, None); time.sleep(30)",
        ],
        env=env,
    )


@linux_only
def test_a_process_started_with_the_hook_is_told_apart_even_after_it_dropped_the_variable():
    base = {k: v for k, v in os.environ.items() if k != VARIABLE}
    hooked = _sleeper({**base, VARIABLE: SETUP_HOOK})
    other = _sleeper({**base, VARIABLE: "someone.elses.hook"})
    plain = _sleeper(base)
    try:
        time.sleep(0.3)
        assert runs_the_hook(hooked.pid)
        assert not runs_the_hook(other.pid)
        assert not runs_the_hook(plain.pid)
    finally:
        for p in (hooked, other, plain):
            p.kill()
            p.wait()
    assert not runs_the_hook(hooked.pid)  # gone: cannot be read


class _Context:
    def __init__(self, gcs: str = "127.0.0.1:1", job: str = "01000000", runtime_env=None):
        self.gcs_address = gcs
        self._job = job
        self.runtime_env = runtime_env or {}

    def get_job_id(self) -> str:
        return self._job


@pytest.fixture
def connected(monkeypatch):
    """A driver connected to a Ray (its runtime context), whose workers import this
    rayflow; counts the checks that start a process."""
    import ray

    context = _Context()
    checks = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(hook_env, "shadowed_modules", lambda: [])
    monkeypatch.setattr(hook_env, "workers_import_this_rayflow", lambda: checks.append(1) or True)
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.setattr(hook_env, "_decided", {})
    monkeypatch.setattr(hook_env, "_hooked_raylets", set())
    return SimpleNamespace(context=context, checks=checks)


def test_a_ray_the_user_started_gives_the_actors_the_hook_and_the_check_runs_once(connected):
    assert actor_runtime_env() == {"env_vars": {VARIABLE: SETUP_HOOK}}
    env = actor_runtime_env()
    env["env_vars"]["X"] = "changed by a caller"
    assert actor_runtime_env() == {"env_vars": {VARIABLE: SETUP_HOOK}}
    assert len(connected.checks) == 1


def test_no_hook_where_the_raylet_runs_it_already(connected):
    mark_hooked_raylet(connected.context.gcs_address)
    assert actor_runtime_env() is None
    connected.context.gcs_address = "127.0.0.1:2"  # another Ray
    assert actor_runtime_env() is not None


def test_no_hook_over_the_drivers_runtime_environment_or_its_own_hook(connected, monkeypatch):
    connected.context.runtime_env = {"env_vars": {"A": "1"}}
    assert actor_runtime_env() is None
    connected.context.runtime_env = {}
    monkeypatch.setenv(VARIABLE, "someone.elses.hook")
    assert actor_runtime_env() is None


def test_no_hook_where_the_workers_would_import_another_rayflow_or_a_module_is_shadowed(
    connected, monkeypatch
):
    monkeypatch.setattr(hook_env, "workers_import_this_rayflow", lambda: False)
    assert actor_runtime_env() is None
    monkeypatch.setattr(hook_env, "workers_import_this_rayflow", lambda: True)
    monkeypatch.setattr(hook_env, "shadowed_modules", lambda: ["colorsys"])
    connected.context._job = "02000000"  # decided again for another job
    assert actor_runtime_env() is None


def test_no_hook_off_linux_or_without_ray(connected, monkeypatch):
    import ray

    monkeypatch.setattr(sys, "platform", "darwin")
    assert actor_runtime_env() is None
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert actor_runtime_env() is None


HOOK = {"env_vars": {VARIABLE: SETUP_HOOK}}


def _warm(node: FakeNode, runtime_env: list, connection: list[str]) -> WarmWorkers:
    """Warm workers over ``node``; the raylet's runtime environment is ``runtime_env[0]``
    when it is made, the driver's connection ``connection[0]`` when asked."""

    def raylet() -> FakeRaylet:
        r = FakeRaylet(node)
        r.runtime_env = runtime_env[0]
        return r

    return WarmWorkers(raylet, node_id=lambda: "n1", connection=lambda: connection[0])


def test_the_next_job_gets_the_environment_of_the_workers_kept_warm_while_they_may_be_there():
    node = FakeNode(idle=0, concurrency=2, ticks=1)
    connection = ["ray-a/01000000"]
    warm = _warm(node, [HOOK], connection)
    now = [0.0]
    warm._clock = lambda: now[0]
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    assert warm.runtime_env_for_job(config) is None  # nothing kept warm yet
    warm.keep_warm(3, config).join(30)
    assert warm.runtime_env_for_job(config) == HOOK
    warm.runtime_env_for_job(config)["env_vars"]["X"] = "1"  # a copy
    assert warm.runtime_env_for_job(config) == HOOK
    assert warm.runtime_env_for_job(None) is None  # a job without warm workers
    assert warm.runtime_env_for_job(WarmWorkerConfig(max_workers=0)) is None
    now[0] = 59.0
    assert warm.runtime_env_for_job(config) == HOOK
    now[0] = 60.0  # Ray may have taken them back
    assert warm.runtime_env_for_job(config) is None
    now[0] = 0.0
    connection[0] = "ray-a/02000000"  # the driver joined again: its workers are gone
    assert warm.runtime_env_for_job(config) is None


def test_workers_kept_warm_without_the_hook_take_the_environment_back():
    node = FakeNode(idle=0, concurrency=2, ticks=1)
    connection = ["ray-a/01000000"]
    runtime_env = [HOOK]
    warm = _warm(node, runtime_env, connection)
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    warm.keep_warm(3, config).join(30)
    assert warm.runtime_env_for_job(config) == HOOK
    runtime_env[0] = None  # say the driver now has a runtime environment of its own
    node.idle_now = 0
    warm.keep_warm(3, config).join(30)
    assert node.idle_now == 3  # kept warm, without the hook
    assert warm.runtime_env_for_job(config) is None
