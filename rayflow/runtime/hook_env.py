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
job master is created with this environment while they are there (its subtasks inherit
it, as every actor inherits its creator's). Nothing else of the actors changes: the
hook leaves the variable out of the worker's ``os.environ`` once it ran.

:func:`actor_runtime_env` gives that environment only where it is safe and useful:

- on Linux, where the warm workers that run the hook are told apart from the others by
  their environment (``/proc/<pid>/environ``);
- where the driver has no runtime environment of its own (an actor's environment would
  be merged into it) and names no setup hook (``RAY_...SETUP_HOOK`` in its environment);
- not on a local Ray that rayflow started with the hook in its raylet (every worker runs
  it already, and Ray's own idle workers could then serve the actors too);
- where a worker started from this process would import the rayflow this process runs,
  and the driver's directories shadow no installed module (the same checks as for the
  raylet's hook, :mod:`rayflow.runtime.preload`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from rayflow.runtime.preload import (
    SETUP_HOOK,
    hook_variable,
    shadowed_modules,
    workers_import_this_rayflow,
)

__all__ = ["actor_runtime_env", "mark_hooked_raylet", "runs_the_hook"]

_lock = threading.Lock()
#: GCS addresses of the local Rays this process started with the hook in the raylet
_hooked_raylets: set[str] = set()
#: (GCS address, Ray job id, working directory, script) -> the environment, None for none
_decided: dict[tuple[str, str, str, str], dict[str, Any] | None] = {}


def mark_hooked_raylet(gcs_address: str) -> None:
    """This process started the local Ray at ``gcs_address`` with the setup hook in its
    raylet's environment: its actors need no runtime environment for it."""
    with _lock:
        _hooked_raylets.add(str(gcs_address))


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
    key = (gcs, str(context.get_job_id()), os.path.abspath(os.curdir), script)
    with _lock:
        if key in _decided:
            return _copy(_decided[key])
    safe = not shadowed_modules() and workers_import_this_rayflow()
    env = {"env_vars": {variable: SETUP_HOOK}} if safe else None
    with _lock:
        _decided[key] = env
    return _copy(env)


def _copy(env: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if env is None else {"env_vars": dict(env["env_vars"])}


def runs_the_hook(pid: int) -> bool:
    """Whether the process ``pid`` was started with rayflow's setup hook in its
    environment (the hook takes the variable out of ``os.environ``, not out of the
    environment the process started with); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            started_with = f.read().split(b"\0")
    except OSError:
        return False
    return f"{hook_variable()}={SETUP_HOOK}".encode() in started_with
