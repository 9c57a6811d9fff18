"""Ray-free tests of the runtime environment that carries rayflow's setup hook to its
actors on a Ray it did not start: which processes started with it, when a driver's
actors get it (never over the driver's own runtime environment or setup hook, never on a
Ray whose raylet runs the hook already), and when the next job's job master is created
with it (only while the workers kept warm with it may still be there)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from rayflow.runtime import hook_env, preload
from rayflow.runtime.hook_env import (
    actor_runtime_env,
    mark_hooked_raylet,
    runs_the_hook,
    started_by_a_raylet,
)
from rayflow.runtime.preload import SETUP_HOOK
from rayflow.runtime.warm_workers import PLAIN_KEEP_ALIVE_S, WarmWorkerConfig, WarmWorkers
from tests.unit.test_warm_workers import FakeNode, FakeRaylet

VARIABLE = preload.hook_variable()

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/environ")


HOOK = {"env_vars": {VARIABLE: "ray_runtime_env_func::job-01000000-hook"}}


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
    value = HOOK["env_vars"][VARIABLE]
    hooked = _sleeper({**base, VARIABLE: value})
    other_job = _sleeper({**base, VARIABLE: value.replace("01", "02")})
    other = _sleeper({**base, VARIABLE: SETUP_HOOK})
    plain = _sleeper(base)
    try:
        time.sleep(0.3)
        assert runs_the_hook(hooked.pid, HOOK)
        assert not runs_the_hook(other_job.pid, HOOK)
        assert not runs_the_hook(other.pid, HOOK)
        assert not runs_the_hook(plain.pid, HOOK)
    finally:
        for p in (hooked, other_job, other, plain):
            p.kill()
            p.wait()
    assert not runs_the_hook(hooked.pid, HOOK)  # gone: cannot be read


_LOAD_HOOK = """
import os, pickle, sys
hook = pickle.loads(bytes.fromhex(sys.argv[1]))
os.environ[sys.argv[2]] = "set"
hook()
print("variable left:", sys.argv[2] in os.environ)
print("runtime imported:", "rayflow.runtime.subtask_actor" in sys.modules)
print("rayflow imported:", "rayflow" in sys.modules)
"""


def _run_hook(expected: list[str], pythonpath: str | None) -> str:
    """Load the hook pickled as Ray pickles it into a fresh interpreter (the way a worker
    does, before anything of rayflow is imported) and run it."""
    from ray import cloudpickle

    hook = hook_env.hook_function(expected, VARIABLE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", VARIABLE)}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_HOOK, cloudpickle.dumps(hook).hex(), VARIABLE],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(hook_env.__file__))))


def test_the_hook_imports_the_runtime_where_the_worker_finds_the_drivers_rayflow():
    import rayflow

    out = _run_hook(list(rayflow.__path__), ROOT)
    assert "variable left: False" in out
    assert "runtime imported: True" in out, out


def test_the_hook_imports_nothing_where_the_worker_finds_another_rayflow(tmp_path):
    other = tmp_path / "site" / "rayflow"
    (other / "runtime").mkdir(parents=True)
    (other / "__init__.py").write_text("raise RuntimeError('another rayflow imported')\n")
    (other / "runtime" / "__init__.py").write_text("")
    import rayflow

    out = _run_hook(list(rayflow.__path__), str(tmp_path / "site"))
    assert "variable left: False" in out
    assert "rayflow imported: False" in out, out


def test_the_hook_loads_and_runs_in_a_worker_without_rayflow(tmp_path):
    """Pickled by value: an interpreter that cannot import rayflow (a task with an
    environment of its own that inherits the variable) loads and runs it."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    # a path entry that makes ``import rayflow`` fail, as where it is not installed
    (blocked / "rayflow.py").write_text("raise ImportError('no rayflow here')\n")
    out = _run_hook(["/nowhere/rayflow"], str(blocked))
    assert "variable left: False" in out
    assert "rayflow imported: False" in out, out


class _Context:
    def __init__(self, gcs: str = "127.0.0.1:1", job: str = "01000000", runtime_env=None):
        self.gcs_address = gcs
        self._job = job
        self.runtime_env = runtime_env or {}
        self._node = "node-1"

    def get_job_id(self) -> str:
        return self._job

    def get_node_id(self) -> str:
        return self._node


@pytest.fixture
def connected(monkeypatch):
    """A driver connected to a Ray (its runtime context); counts the hook's exports."""
    import ray

    context = _Context()
    exports = []

    def export(hook) -> str:
        exports.append(hook)
        return f"ray_runtime_env_func::{context.get_job_id()}"

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(hook_env, "shadowed_modules", lambda: [])
    monkeypatch.setattr(hook_env, "_export", export)
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.setattr(hook_env, "_decided", {})
    monkeypatch.setattr(hook_env, "_hooked_raylets", set())
    return SimpleNamespace(context=context, exports=exports)


def test_a_ray_the_user_started_gives_the_actors_the_hook_exported_once(connected):
    expected = {"env_vars": {VARIABLE: "ray_runtime_env_func::01000000"}}
    assert actor_runtime_env() == expected
    env = actor_runtime_env()
    env["env_vars"]["X"] = "changed by a caller"
    assert actor_runtime_env() == expected
    assert len(connected.exports) == 1
    connected.context._job = "02000000"  # the driver joined again: a new job
    assert actor_runtime_env() == {"env_vars": {VARIABLE: "ray_runtime_env_func::02000000"}}
    assert len(connected.exports) == 2
    # the cluster was restarted at the same address: job 02000000 again, a new node
    connected.context._node = "node-2"
    actor_runtime_env()
    assert len(connected.exports) == 3  # exported again: the old cluster's copy is gone


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


def test_no_hook_where_a_module_is_shadowed_or_the_export_fails(connected, monkeypatch):
    monkeypatch.setattr(hook_env, "shadowed_modules", lambda: ["colorsys"])
    assert actor_runtime_env() is None
    monkeypatch.setattr(hook_env, "shadowed_modules", lambda: [])

    def fails(hook) -> str:
        raise TimeoutError("GCS")

    monkeypatch.setattr(hook_env, "_export", fails)
    connected.context._job = "02000000"  # decided again for another job
    assert actor_runtime_env() is None


def test_no_hook_off_linux_or_without_ray(connected, monkeypatch):
    import ray

    monkeypatch.setattr(sys, "platform", "darwin")
    assert actor_runtime_env() is None
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert actor_runtime_env() is None


def _warm(
    plain: FakeNode, hooked: FakeNode, runtime_env: list, connection: list[str]
) -> tuple[WarmWorkers, list[FakeRaylet]]:
    """Warm workers over a node's workers without the hook's environment (``plain``) and
    with it (``hooked``); the raylet's runtime environment is ``runtime_env[0]`` when it
    is made, the driver's connection ``connection[0]`` when asked."""
    made: list[FakeRaylet] = []

    def raylet() -> FakeRaylet:
        r = FakeRaylet(plain, hooked)
        r.runtime_env = runtime_env[0]
        r.connection = connection[0]  # the connection it was made for
        made.append(r)
        return r

    warm = WarmWorkers(raylet, node_id=lambda: "n1", connection=lambda: connection[0])
    warm._hooked_after_s = 0.0  # tests that need the pause set it
    return warm, made


def _nodes(**kw) -> tuple[FakeNode, FakeNode]:
    return FakeNode(**kw), FakeNode(**kw)


def test_a_top_up_starts_workers_without_the_hook_first_then_as_many_with_it():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    warm, made = _warm(plain, hooked, [HOOK], ["ray-a/01000000"])
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    warm.keep_warm(3, config).join(30)
    assert plain.idle_now == 3 and hooked.idle_now == 3
    keep_alive = made[0].c.keep_alive
    # the plain ones go soon (the hooked ones serve the jobs after a pause)
    assert keep_alive[0] == PLAIN_KEEP_ALIVE_S and keep_alive[-1] == 60


def test_a_job_right_after_a_job_finds_the_plain_workers_and_no_hook():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    warm, _ = _warm(plain, hooked, [HOOK], ["ray-a/01000000"])
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    first_hooked = threading.Event()
    real_start = hooked.start

    def start(n: int) -> None:
        first_hooked.set()
        real_start(n)

    hooked.start = start
    thread = warm.keep_warm(5, config)
    assert first_hooked.wait(30)
    warm.job_starting()  # a job starts while the hooked ones are being asked for
    thread.join(30)
    assert plain.idle_now == 5
    assert warm.runtime_env_for_job(config, 5) is None  # 2 hooked asked for at most


def _clocked():
    """Warm workers over empty pools, on a clock the test sets."""
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    connection = ["ray-a/01000000"]
    warm, _ = _warm(plain, hooked, [HOOK], connection)
    now = [0.0]
    warm._clock = lambda: now[0]
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    return plain, hooked, connection, warm, now, config


def test_the_next_job_gets_the_environment_of_the_workers_kept_warm_while_they_are_there():
    plain, hooked, connection, warm, now, config = _clocked()
    assert warm.runtime_env_for_job(config, 3) is None  # nothing kept warm yet
    warm.keep_warm(3, config).join(30)
    assert hooked.idle_now == 3
    assert warm.runtime_env_for_job(None, 3) is None  # a job without warm workers
    assert warm.runtime_env_for_job(WarmWorkerConfig(max_workers=0), 3) is None
    assert warm.runtime_env_for_job(config, 4) is None  # more actors than are there
    env = warm.runtime_env_for_job(config, 3)
    assert env == HOOK
    env["env_vars"]["X"] = "1"  # a copy
    # the three are taken: a job starting right after gets none
    assert warm.runtime_env_for_job(config, 1) is None


def test_workers_kept_warm_count_only_while_they_may_be_there_and_for_their_connection():
    plain, hooked, connection, warm, now, config = _clocked()
    warm.keep_warm(2, config).join(30)
    now[0] = 60.0  # Ray may have taken them back
    assert warm.runtime_env_for_job(config, 1) is None
    now[0] = 59.0
    connection[0] = "ray-a/02000000"  # the driver joined again: its workers are gone
    assert warm.runtime_env_for_job(config, 1) is None
    connection[0] = "ray-a/01000000"
    assert warm.runtime_env_for_job(config, 2) == HOOK


def _ended_while_asking_for_hooked(hooked_concurrency: int):
    """Warm workers whose top-up, over five plain workers idle, a job start ended right
    after it asked for hooked ones (none of which comes up meanwhile)."""
    plain, _ = _nodes(idle=5, concurrency=1, ticks=1)
    hooked = FakeNode(idle=0, concurrency=hooked_concurrency, ticks=10_000)
    warm, _ = _warm(plain, hooked, [HOOK], ["ray-a/01000000"])
    now = [0.0]
    warm._clock = lambda: now[0]
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    started = threading.Event()
    real_start = hooked.start

    def start(n: int) -> None:
        real_start(n)
        started.set()

    hooked.start = start
    thread = warm.keep_warm(5, config)
    assert started.wait(30)
    warm.job_starting()
    thread.join(30)
    return warm, hooked, now, config


def test_a_top_up_that_a_job_start_ended_counts_what_it_saw_and_asked_for_until_then():
    warm, hooked, now, config = _ended_while_asking_for_hooked(1)  # one starts at a time
    hooked.idle_now = 6  # what the ended top-up never saw does not count
    assert hooked.asked == [1]
    now[0] = PLAIN_KEEP_ALIVE_S  # the plain ones may be gone
    assert warm.runtime_env_for_job(config, 3) is None
    assert warm.runtime_env_for_job(config, 2) == HOOK  # the one starting serves half
    assert warm.runtime_env_for_job(config, 1) is None  # taken


def test_workers_kept_warm_without_the_hook_take_the_environment_back():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    runtime_env = [HOOK]
    warm, made = _warm(plain, hooked, runtime_env, ["ray-a/01000000"])
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    warm.keep_warm(3, config).join(30)
    runtime_env[0] = None  # say the driver now has a runtime environment of its own
    plain.idle_now = 0
    warm.keep_warm(3, config).join(30)
    assert plain.idle_now == 3  # kept warm, without the hook, for the keep-alive
    assert made[-1].c.keep_alive[-1] == 60
    assert warm.runtime_env_for_job(config, 3) is None


def test_after_the_plain_workers_may_be_gone_half_of_a_job_on_hooked_ones_is_enough():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    warm, _ = _warm(plain, hooked, [HOOK], ["ray-a/01000000"])
    now = [0.0]
    warm._clock = lambda: now[0]
    config = WarmWorkerConfig(max_workers=3, keep_alive_s=60)
    warm.keep_warm(5, config).join(30)  # capped: three of each
    assert hooked.idle_now == 3
    assert warm.runtime_env_for_job(config, 5) is None  # the plain ones serve it better
    now[0] = PLAIN_KEEP_ALIVE_S
    assert warm.runtime_env_for_job(config, 5) == HOOK  # three of five on hooked ones


def test_a_hooked_worker_still_starting_is_not_taken_over_an_idle_plain_one():
    warm, _, now, config = _ended_while_asking_for_hooked(5)
    assert warm.runtime_env_for_job(config, 1) is None  # five plain ones idle
    now[0] = PLAIN_KEEP_ALIVE_S  # the plain ones may be gone: the starting ones serve
    assert warm.runtime_env_for_job(config, 2) == HOOK


def test_the_plain_workers_stay_for_the_keep_alive_where_hooked_ones_cannot_serve_the_job():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    warm, made = _warm(plain, hooked, [HOOK], ["ray-a/01000000"])
    config = WarmWorkerConfig(max_workers=4, keep_alive_s=120)
    warm.keep_warm(9, config).join(60)  # more actors than max_workers
    assert made[0].c.keep_alive[0] == 120


def test_no_hooked_workers_where_the_workers_environments_cannot_be_read():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    runtime_env = [HOOK]
    warm = WarmWorkers(
        lambda: _untellable(FakeRaylet(plain, hooked)),
        node_id=lambda: "n1",
        connection=lambda: "ray-a/01000000",
    )
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    warm.keep_warm(3, config).join(30)
    assert plain.idle_now == 3 and plain.asked
    assert hooked.asked == []  # none started: they could not be counted
    assert warm.runtime_env_for_job(config, 1) is None
    assert runtime_env == [HOOK]


def _untellable(raylet: FakeRaylet) -> FakeRaylet:
    raylet.runtime_env = HOOK
    raylet.c.tellable = False
    return raylet


@linux_only
def test_a_process_a_raylet_started_is_told_by_its_environment():
    base = {k: v for k, v in os.environ.items() if k != "RAY_RAYLET_PID"}
    worker = _sleeper({**base, "RAY_RAYLET_PID": "1"})
    other = _sleeper(base)
    try:
        time.sleep(0.3)
        assert started_by_a_raylet(worker.pid)
        assert not started_by_a_raylet(other.pid)
    finally:
        for p in (worker, other):
            p.kill()
            p.wait()
    assert not started_by_a_raylet(worker.pid)


def test_hooked_workers_start_only_once_no_job_followed_for_a_while():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    warm, _ = _warm(plain, hooked, [HOOK], ["ray-a/01000000"])
    warm._hooked_after_s = 60.0
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    thread = warm.keep_warm(3, config)
    deadline = time.monotonic() + 30
    while plain.idle_now < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    warm.job_starting()  # the next job came before the pause was over
    thread.join(30)
    assert not thread.is_alive()
    assert plain.idle_now == 3 and hooked.asked == []


def _slow_to_tell(raylet: FakeRaylet, before) -> FakeRaylet:
    """``raylet`` whose check that it can tell its workers apart first runs ``before``
    (the driver reconnects meanwhile, say, or a job starts)."""
    real = raylet.c.can_tell_hooked

    def can_tell() -> bool:
        before()
        return real()

    raylet.c.can_tell_hooked = can_tell
    return raylet


def test_a_top_up_records_its_workers_for_the_connection_it_started_them_for():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    connection = ["ray-a/01000000/n1"]
    warm, made = _warm(plain, hooked, [HOOK], connection)
    factory = warm._factory

    def reconnect() -> None:
        connection[0] = "ray-a/02000000/n1"  # the driver joined again meanwhile

    warm._factory = lambda: _slow_to_tell(factory(), reconnect)
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    warm.keep_warm(3, config).join(30)
    # the hook of the Ray job it was exported for is no use to the new one
    assert warm.runtime_env_for_job(config, 3) is None


def test_a_top_up_a_newer_one_replaced_records_nothing():
    plain, hooked = _nodes(idle=0, concurrency=2, ticks=1)
    warm, _ = _warm(plain, hooked, [HOOK], ["ray-a/01000000/n1"])
    factory = warm._factory
    entered, go = threading.Event(), threading.Event()
    first = [True]

    def slow() -> None:
        entered.set()
        assert go.wait(30)

    def make() -> FakeRaylet:
        raylet = factory()
        if first[0]:
            first[0] = False
            return _slow_to_tell(raylet, slow)
        return raylet

    warm._factory = make
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    old = warm.keep_warm(3, config)
    assert entered.wait(30)
    warm.job_starting()  # a job starts and ends: a newer top-up
    warm.keep_warm(3, config).join(30)
    go.set()
    old.join(30)
    assert warm.runtime_env_for_job(config, 3) == HOOK  # the newer one's count stands


def test_workers_a_finished_top_up_gave_up_on_do_not_count_as_starting():
    plain, _ = _nodes(idle=0, concurrency=2, ticks=1)
    hooked = FakeNode(idle=0, concurrency=0)  # none of them ever starts
    warm, _ = _warm(plain, hooked, [HOOK], ["ray-a/01000000/n1"])
    warm._round_s = 0.5
    now = [0.0]
    warm._clock = lambda: now[0]
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    warm.keep_warm(4, config).join(30)
    assert hooked.asked  # asked for, never came
    now[0] = PLAIN_KEEP_ALIVE_S
    assert warm.runtime_env_for_job(config, 2) is None
