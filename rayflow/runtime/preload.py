"""What a worker process of a local Ray that rayflow started imports before it takes any
work: rayflow's runtime (the modules of the job master and of a subtask, with pyarrow),
so that an actor placed on an idle worker (a warm worker, see
:mod:`rayflow.runtime.warm_workers`) does not import them while its job starts.

Ray runs a *worker process setup hook* in every worker it starts, named by an
environment variable the worker inherits from the raylet (the mechanism behind
``runtime_env={"worker_process_setup_hook": ...}``, without a runtime environment: a
driver with one could not use warm workers). :func:`worker_setup_hook` sets that
variable while ``ray.init`` starts the local raylet, and only then; joining a running
cluster changes nothing. The hook never fails a worker: an import that fails is left
for the actor's own import to report.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["SETUP_HOOK", "import_runtime", "worker_setup_hook"]

#: The hook, as Ray loads it (``module.function``).
SETUP_HOOK = "rayflow.runtime.preload.import_runtime"

#: Ray's variable for it (``ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``).
_FALLBACK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def _variable() -> str:
    try:
        from ray._private import ray_constants

        return str(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR)
    except (ImportError, AttributeError):  # another Ray: its name as of Ray 2.x
        return _FALLBACK_VARIABLE


def import_runtime() -> None:
    """Import what the job master and a subtask import when they start."""
    try:
        import rayflow.runtime.job_master  # noqa: F401
        import rayflow.runtime.subtask  # noqa: F401
    except Exception:  # noqa: BLE001 - never fail a worker; the actor's import reports it
        pass


@contextlib.contextmanager
def worker_setup_hook() -> Iterator[None]:
    """While in the block, processes started from this one (the local raylet that
    ``ray.init`` starts, and so every worker it starts) run :func:`import_runtime` before
    they take work; a hook the environment already names is left as it is."""
    variable = _variable()
    if variable in os.environ:
        yield
        return
    os.environ[variable] = SETUP_HOOK
    try:
        yield
    finally:
        os.environ.pop(variable, None)
