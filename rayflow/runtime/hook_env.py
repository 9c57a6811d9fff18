"""The runtime environment that gives rayflow's actors worker processes which imported
rayflow's runtime before they took work, on a Ray that rayflow did not start.

A local Ray that rayflow starts sets Ray's worker setup hook in its raylet's environment
(:mod:`rayflow.runtime.preload`), so every worker it starts imports rayflow's runtime
while it waits idle. A Ray the user started (``ray.init(address="local")``, ``ray
start``) has no such hook, and there each new subtask process imported the runtime
(pyarrow among it) and built Ray's serialization context while its job started: about a
second at parallelism 2 on two cores.

Ray's setup hook is an environment variable of the worker process, and a runtime
environment can carry it: an actor created with ``runtime_env={"env_vars": {<hook
variable>: <hook>}}`` runs in a worker started for that runtime environment, which ran
the hook before it took the actor. Ray keeps the idle workers of each runtime
environment apart, and its ``PrestartWorkers`` call starts workers for a given one:
:mod:`rayflow.runtime.warm_workers` keeps such workers idle between jobs, and a job's
job master is created with this environment when they are there (its subtasks inherit
it, as every actor and task inherits its creator's).

The hook is a function this driver exports to Ray for its job (Ray's own mechanism for
``runtime_env={"worker_process_setup_hook": <function>}``), pickled by value so that a
worker without rayflow can load it too. It never fails a worker, and imports rayflow's
runtime only where the worker's own path finds the rayflow this driver runs: a worker
runs its hook before Ray puts the driver's directories on its path, and another rayflow
(an older install, say) imported there would be the one the actor runs. So what Ray
tasks and actors that a job's functions create inherit (Ray merges the variable into
their runtime environment) costs them at most that import, in a process of their own.

:func:`actor_runtime_env` gives that environment only where it is safe and useful:

- on Linux, where the warm workers that run the hook are told apart from the others by
  the environment they started with (``/proc/<pid>/environ``);
- where the driver has no runtime environment of its own (an actor's environment would
  be merged into it) and names no setup hook in its environment;
- not on a local Ray that rayflow started with the hook in its raylet (every worker runs
  it already, and Ray's own idle workers could then serve the actors too);
- where the driver's directories shadow no installed module (the hook would import the
  installed one first, see :func:`rayflow.runtime.preload.shadowed_modules`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from rayflow.runtime.preload import hook_variable, shadowed_modules

__all__ = [
    "actor_runtime_env",
    "hook_function",
    "mark_hooked_raylet",
    "runs_the_hook",
    "started_by_a_raylet",
]

_lock = threading.Lock()
#: GCS addresses of the local Rays this process started with the hook in the raylet
_hooked_raylets: set[str] = set()
#: (GCS address, Ray job id and node id, working directory, script) -> the environment,
#: None for none
_decided: dict[tuple[str, str, str, str], dict[str, Any] | None] = {}

#: How long exporting the hook to Ray may take.
_EXPORT_TIMEOUT_S = 30

#: The hook, defined outside any module so that it is pickled by value: a worker loads it
#: without importing rayflow. ``VARIABLE`` and ``EXPECTED`` (the driver's rayflow package
#: directories) travel with it.
_HOOK_SOURCE = """
def rayflow_setup_hook():
    import importlib.util
    import os

    os.environ.pop(VARIABLE, None)
    try:
        spec = importlib.util.find_spec("rayflow")
        where = list(spec.submodule_search_locations or []) if spec else []
        if sorted(os.path.realpath(path) for path in where) != EXPECTED:
            return
        from rayflow.runtime.preload import import_runtime

        import_runtime()
    except Exception:
        pass
"""


def mark_hooked_raylet(gcs_address: str) -> None:
    """This process started the local Ray at ``gcs_address`` with the setup hook in its
    raylet's environment: its actors need no runtime environment for it."""
    with _lock:
        _hooked_raylets.add(str(gcs_address))


def hook_function(expected: list[str], variable: str) -> Callable[[], None]:
    """The setup hook: takes ``variable`` out of the worker's ``os.environ`` and imports
    rayflow's runtime where the worker's path finds the rayflow in ``expected`` (its
    package directories, resolved), and nothing otherwise; it never raises."""
    namespace: dict[str, Any] = {
        "__name__": "rayflow_setup_hook_by_value",  # no module: pickled by value
        "VARIABLE": variable,
        "EXPECTED": sorted(os.path.realpath(path) for path in expected),
    }
    exec(_HOOK_SOURCE, namespace)  # noqa: S102 - the constant source above
    return namespace["rayflow_setup_hook"]


def _export(hook: Callable[[], None]) -> str:
    """Export ``hook`` to Ray for this driver's job; the value of the hook variable that
    names it."""
    import ray
    from ray._private.runtime_env.setup_hook import decode_function_key

    manager = ray._private.worker.global_worker.function_actor_manager
    return decode_function_key(manager.export_setup_func(hook, timeout=_EXPORT_TIMEOUT_S))


def actor_runtime_env() -> dict[str, Any] | None:
    """The runtime environment with rayflow's setup hook for the actors of a job on the
    connected Ray, None where they should have none (see the module's docstring)."""
    if sys.platform != "linux":
        return None
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    variable = hook_variable()
    gcs = str(context.gcs_address)
    with _lock:
        if gcs in _hooked_raylets:
            return None
    if context.runtime_env or variable in os.environ:
        return None
    script = sys.argv[0] if sys.argv else ""
    # the node's id too: a cluster restarted at the same address numbers its jobs from
    # the start again, and the hook exported to the old one is gone with it
    job = f"{context.get_job_id()}@{context.get_node_id()}"
    key = (gcs, job, os.path.abspath(os.curdir), script)
    with _lock:
        if key in _decided:
            return _copy(_decided[key])
    env = None
    if not shadowed_modules():
        import rayflow

        try:
            value = _export(hook_function(list(rayflow.__path__), variable))
        except Exception:  # noqa: BLE001 - Ray internals: no hook, nothing else changes
            value = None
        if value is not None:
            env = {"env_vars": {variable: value}}
    with _lock:
        _decided[key] = env
    return _copy(env)


def _copy(env: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if env is None else {"env_vars": dict(env["env_vars"])}


def _started_with(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def started_by_a_raylet(pid: int) -> bool:
    """Whether this process can read the environment process ``pid`` started with, and
    it is that of a Ray worker (a raylet started it)."""
    started_with = _started_with(pid)
    return started_with is not None and any(
        entry.startswith(b"RAY_RAYLET_PID=") for entry in started_with
    )


def runs_the_hook(pid: int, runtime_env: dict[str, Any]) -> bool:
    """Whether the process ``pid`` was started with the setup hook of ``runtime_env``
    (from :func:`actor_runtime_env`) in its environment. The hook takes the variable
    out of ``os.environ``, not out of the environment the process started with; the
    variable's value names this driver's job, so no process of another job or another
    process namespace matches. False where that cannot be read."""
    started_with = _started_with(pid)
    if started_with is None:
        return False
    variable = hook_variable()
    value = runtime_env.get("env_vars", {}).get(variable)
    return value is not None and f"{variable}={value}".encode() in started_with
