"""Job start on a real Ray: the run lock is held from the moment its actor is created
(before its process runs), and warm workers (never-used Ray worker processes kept idle
after a job) fill up to the job's actors, go to the next job's actors, and go away
after their keep-alive."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pyarrow as pa
import pytest
import ray

from rayflow import (
    ConcurrentRunError,
    NumberSequenceSource,
    Sink,
    SinkContext,
    SinkWriter,
    StreamExecutionEnvironment,
)
from rayflow.runtime.run_lock import acquire_run_lock, release_run_lock
from rayflow.runtime.warm_workers import _Raylet, warm_workers


def _job_name(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def test_the_run_lock_is_held_before_its_process_has_started():
    job = _job_name("lock")
    first = acquire_run_lock(job, "run-first")  # returns without waiting for its process
    try:
        with pytest.raises(ConcurrentRunError, match="already running.*run-first"):
            acquire_run_lock(job, "run-second")
    finally:
        release_run_lock(first)
    second = acquire_run_lock(job, "run-second")  # released: taken again
    release_run_lock(second)


def _fresh_idle() -> int:
    with _Raylet().calls() as calls:
        return calls.fresh_idle()


def _wait_for(condition, timeout_s: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.25)
    return condition()


class _Values(SinkWriter):
    def __init__(self) -> None:
        self.values: list[int] = []

    def write(self, batch: pa.RecordBatch) -> None:
        self.values += batch.column("value").to_pylist()

    def finish(self) -> Any:
        return self.values


class ValuesSink(Sink):
    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _Values()

    def merge_results(self, results: list[Any]) -> Any:
        return sorted(v for r in results for v in r)


def _job(keep_alive_s: float, max_workers: int = 16) -> tuple[StreamExecutionEnvironment, Sink]:
    env = StreamExecutionEnvironment().set_parallelism(2)
    env.set_warm_workers(max_workers=max_workers, keep_alive_s=keep_alive_s)
    sink = ValuesSink()
    env.from_source(NumberSequenceSource(0, 999, batch_size=100)).map_batches(lambda b: b).sink_to(
        sink
    )
    return env, sink


def test_warm_workers_fill_up_after_a_job_serve_the_next_and_expire():
    env, sink = _job(keep_alive_s=8)
    env.execute(_job_name("warm"))
    actors = 2 + 1  # two subtasks (one chained vertex at parallelism 2) and the master
    assert _wait_for(lambda: _fresh_idle() >= actors)

    env, sink = _job(keep_alive_s=8)
    result = env.execute(_job_name("warm"))
    assert result.sink_result(sink) == list(range(1000))  # the job ran on them as usual

    # no job for longer than the keep-alive: Ray takes back idle workers beyond its own
    # limit (the node's available CPUs)
    limit = int(ray.available_resources().get("CPU", 0))
    if limit < actors:
        assert _wait_for(lambda: _fresh_idle() <= limit, timeout_s=60)


def test_warm_workers_can_be_turned_off():
    warm_workers.stop()
    before = _fresh_idle()
    env, _ = _job(keep_alive_s=60, max_workers=0)
    env.execute(_job_name("cold"))
    time.sleep(3)
    assert _fresh_idle() <= max(before, 2)  # none asked for (Ray keeps its own few)


_PRELOADED = """
import sys, time
import ray
from rayflow.environment import ensure_ray

ensure_ray("local")

@ray.remote
class Probe:  # imports nothing of rayflow itself
    def __init__(self):
        # before this actor's first call has serialized or deserialized anything
        self.contexts = len(ray._private.worker.global_worker.serialization_context_map)

    def modules(self):
        return sorted(m for m in sys.modules if m.startswith("rayflow.runtime."))

    def serialization_contexts(self):
        return self.contexts

probe = Probe.remote()
print("preloaded:", "rayflow.runtime.subtask" in ray.get(probe.modules.remote()))
print("serialization context built:", ray.get(probe.serialization_contexts.remote()) > 0)
ray.shutdown()
"""


def test_the_workers_of_a_local_ray_rayflow_starts_import_its_runtime_before_any_work(tmp_path):
    """A local Ray that rayflow starts (no Ray running, no address) has its workers import
    rayflow's runtime, and build Ray's serialization context, while they start, so an
    actor placed on one waits for neither (the context's add-ons cost each new actor
    about 0.2 s before its first reply)."""
    from tests.integration.drivers import run_driver

    done = run_driver(tmp_path, "probe.py", _PRELOADED)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "preloaded: True" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "serialization context built: True" in done.stdout, done.stdout


_WHICH_RAYFLOW = """
import ray
import rayflow
from rayflow.environment import ensure_ray

ensure_ray("local")

@ray.remote
class Probe:  # imports nothing of rayflow until asked
    def rayflow_file(self):
        import rayflow
        return rayflow.__file__

print("driver:", rayflow.__file__)
print("actor:", ray.get(Probe.remote().rayflow_file.remote(), timeout=90))
ray.shutdown()
"""


def _another_rayflow(where, with_preload: bool) -> str:
    """Another rayflow (an older install) the workers find before the driver's own."""
    package = where / "rayflow"
    (package / "runtime").mkdir(parents=True)
    (package / "__init__.py").write_text("OTHER = True\n")
    (package / "runtime" / "__init__.py").write_text("")
    if with_preload:
        (package / "runtime" / "preload.py").write_text("def import_runtime():\n    pass\n")
    return str(where)


@pytest.mark.parametrize("with_preload", [True, False], ids=["with-hook", "without-hook"])
def test_the_actors_run_the_drivers_rayflow_when_the_workers_would_find_another(
    tmp_path, with_preload
):
    """The driver imports rayflow from its working directory, which Ray puts first on a
    worker's path only when its first task runs; the workers' own path (PYTHONPATH here,
    an installed rayflow elsewhere) finds another. The actors must run the driver's
    rayflow, and no worker may fail for the other one (one without the hook's module)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = _another_rayflow(tmp_path / "site", with_preload)
    child_env = dict(os.environ, PYTHONPATH=other)
    child_env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", _WHICH_RAYFLOW],
        cwd=root,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["driver"].startswith(os.path.join(root, "rayflow")), done.stdout
    assert lines["actor"] == lines["driver"], done.stdout


_SHADOWING_MODULE = """
# this project's colorsys: the standard one, with hues in degrees
import importlib.util, os, sysconfig

_spec = importlib.util.spec_from_file_location(
    "_standard_colorsys", os.path.join(sysconfig.get_paths()["stdlib"], "colorsys.py")
)
_standard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_standard)
globals().update({k: v for k, v in vars(_standard).items() if not k.startswith("__")})


def rgb_to_hls(r, g, b):
    h, l, s = _standard.rgb_to_hls(r, g, b)
    return h * 360.0, l, s
"""

_SHADOWED = """
import colorsys
from rayflow import StreamExecutionEnvironment

env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
env.from_collection([1, 2]).map(
    lambda r: {"value": r["value"], "hue": colorsys.rgb_to_hls(0.0, 1.0, 0.0)[0]}
)
print("actors:", sorted({row["hue"] for row in env.execute_and_collect()}))
print("driver:", [colorsys.rgb_to_hls(0.0, 1.0, 0.0)[0]])
"""


def test_a_module_of_the_drivers_directory_that_shadows_an_installed_one_reaches_the_actors(
    tmp_path,
):
    """The driver's directory holds its own ``colorsys``: the job's functions get that one,
    as the driver does (a worker's hook would import the standard one, which Ray's
    serialization add-ons import, before the driver's directory is on the worker's path)."""
    from tests.integration.drivers import run_driver

    (tmp_path / "colorsys.py").write_text(_SHADOWING_MODULE)
    done = run_driver(tmp_path, "shadowed.py", _SHADOWED)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "driver: [120.0]" in done.stdout, done.stdout
    assert "actors: [120.0]" in done.stdout, done.stdout + done.stderr[-3000:]


def _started_with_a_hook() -> bool:
    """Whether this process started with a setup hook exported by a driver in its
    environment (the hook itself takes it out of ``os.environ``)."""
    from rayflow.runtime.preload import hook_variable

    with open("/proc/self/environ", "rb") as f:
        started_with = f.read().split(b"\0")
    mark = f"{hook_variable()}=ray_runtime_env_func::".encode()
    return any(entry.startswith(mark) for entry in started_with)


class _Pids(SinkWriter):
    """What the sink subtask's process is: its pid and whether it started with rayflow's
    setup hook in its environment."""

    def __init__(self) -> None:
        import os

        self.pid = os.getpid()
        self.hooked = _started_with_a_hook()

    def write(self, batch: pa.RecordBatch) -> None:
        pass

    def finish(self) -> Any:
        return [(self.pid, self.hooked)]


class PidsSink(Sink):
    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _Pids()

    def merge_results(self, results: list[Any]) -> Any:
        return [p for r in results for p in r]


def _hooked_idle_pids() -> set[int]:
    """Never-used idle workers on this node started with rayflow's setup hook."""
    from rayflow.runtime.hook_env import runs_the_hook

    raylet = _Raylet()
    assert raylet.runtime_env is not None
    request = raylet.pb.GetNodeStatsRequest(include_memory_info=False)
    with raylet.calls() as calls:
        reply = calls.stub.GetNodeStats(request, timeout=5)
    return {
        w.pid
        for w in reply.core_workers_stats
        if w.pid > 0 and w.num_executed_tasks == 0 and runs_the_hook(w.pid, raylet.runtime_env)
    }


def test_on_a_ray_the_user_started_the_next_jobs_subtasks_take_workers_that_imported_the_runtime():
    """The tests' Ray is one the user started (``ray.init(address="local")``), whose
    raylet has no setup hook. The workers kept warm after a job are started with rayflow's
    hook in their runtime environment, and the next job's subtasks run in them: processes
    that imported rayflow's runtime before the job started."""
    import sys

    from rayflow.runtime.hook_env import actor_runtime_env

    if sys.platform != "linux":
        pytest.skip("warm workers with the hook are told apart by /proc/<pid>/environ")
    assert actor_runtime_env() is not None  # this checkout is what the workers import

    def job() -> tuple[StreamExecutionEnvironment, Sink]:
        env = StreamExecutionEnvironment().set_parallelism(2)
        env.set_warm_workers(max_workers=16, keep_alive_s=60)
        sink = PidsSink()
        env.from_source(NumberSequenceSource(0, 99, batch_size=10)).map_batches(
            lambda b: b
        ).sink_to(sink)
        return env, sink

    env, _ = job()
    env.execute(_job_name("hooked"))
    assert _wait_for(lambda: len(_hooked_idle_pids()) >= 3)  # two subtasks and the master
    warm_workers._thread.join(30)  # the top-up has counted them too
    idle = _hooked_idle_pids()

    env, sink = job()
    result = env.execute(_job_name("hooked"))
    subtasks = result.sink_result(sink)
    assert len(subtasks) == 2
    assert all(hooked for _, hooked in subtasks), subtasks
    assert {pid for pid, _ in subtasks} <= idle, (subtasks, idle)


_COPY_DRIVER = """
import json, os, sys, time
import ray

ray.init(address="local", include_dashboard=False, logging_level="ERROR")
# the driver's environment differs from the one its raylet (and so every worker) got
os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__))
import rayflow
from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.runtime.hook_env import actor_runtime_env

WRAPPER = sys.argv[1]
print("driver:", rayflow.__file__, getattr(rayflow, "COPY", False), flush=True)


def double(x):
    return 2 * x


def probe(batch):
    import rayflow as theirs

    # a task of the job's own, in an interpreter with Ray but without rayflow
    task = ray.remote(max_retries=0)(double).options(runtime_env={"py_executable": WRAPPER})
    doubled = ray.get(task.remote(21), timeout=120)
    print("subtask:", json.dumps([theirs.__file__, getattr(theirs, "COPY", False), doubled]))
    return batch


for job in range(2):
    env = StreamExecutionEnvironment().set_parallelism(1)
    env.set_warm_workers(max_workers=16, keep_alive_s=60)
    env.from_source(NumberSequenceSource(0, 9, batch_size=10)).map_batches(probe).print()
    env.execute(f"copy-{job}")
    print("job done:", job, "hooked next:", actor_runtime_env() is not None, flush=True)
    time.sleep(6)  # the workers kept warm come up
ray.shutdown()
"""


def test_warm_workers_with_the_hook_change_neither_which_rayflow_runs_nor_the_jobs_own_tasks(
    tmp_path,
):
    """The driver runs a copy of rayflow from its own directory (on its ``PYTHONPATH``
    too, which its raylet did not get), where the workers' own path finds the installed
    one (Ray puts the driver's directory on a worker's path only when its first task
    runs, after the hook); a function of the job starts a Ray task in
    an interpreter without rayflow, which inherits the hook's variable. The second job
    runs on the workers kept warm after the first: its subtasks must still run the copy,
    and the task must still run."""
    import os
    import shutil
    import subprocess
    import sys
    import sysconfig

    from tests.integration.drivers import ROOT

    copy = tmp_path / "copy"
    shutil.copytree(
        os.path.join(ROOT, "rayflow"), copy / "rayflow", ignore=shutil.ignore_patterns("*.pyc")
    )
    with open(copy / "rayflow" / "__init__.py", "a") as f:
        f.write("\nCOPY = True\n")
    (copy / "driver.py").write_text(_COPY_DRIVER)
    wrapper = tmp_path / "python-without-rayflow"
    site = sysconfig.get_paths()["purelib"]
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    done = subprocess.run(
        [sys.executable, str(copy / "driver.py"), str(wrapper)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert f"driver: {copy}" in out and "True" in out.splitlines()[0], out
    assert "job done: 0 hooked next: True" in out, out  # the second job has the hook
    assert "job done: 1" in out, out
    subtasks = [
        json.loads(line.split(": ", 1)[1]) for line in out.splitlines() if "subtask: " in line
    ]
    assert len(subtasks) >= 2, out
    for file, is_copy, doubled in subtasks:
        assert file.startswith(str(copy)) and is_copy, subtasks
        assert doubled == 42
