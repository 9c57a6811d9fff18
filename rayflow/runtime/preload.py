"""What a worker process of a local Ray that rayflow started imports before it takes any
work: rayflow's runtime (the modules of the job master and of a subtask, with pyarrow),
so that an actor placed on an idle worker (a warm worker, see
:mod:`rayflow.runtime.warm_workers`) does not import them while its job starts; and Ray's
serialization context, which Ray otherwise builds (importing its add-ons) when the actor
first replies.

Ray runs a *worker process setup hook* in every worker it starts, named by an
environment variable the worker inherits from the raylet (the mechanism behind
``runtime_env={"worker_process_setup_hook": ...}``, without a runtime environment: a
driver with one could not use warm workers). :func:`worker_setup_hook` sets that
variable while ``ray.init`` starts the local raylet, and only then; joining a running
cluster changes nothing. The hook never fails a worker: an import that fails is left
for the actor's own import to report.

A worker runs its hook before Ray puts the driver's script directory and working
directory first on its ``sys.path`` (that happens when its first task runs), so the hook
finds rayflow by the worker's own path only (``PYTHONPATH``, site-packages). Where that
finds no rayflow, or another one than the driver's (a driver run from a checkout while
another rayflow is installed), the hook is not set: it would make every worker exit (Ray
ends a worker whose hook cannot be loaded), or have the actors run the other rayflow,
the one the worker imported first. Nor is it set where the driver's directories (its
script's and its working directory, which Ray puts first on a worker's path) hold a
module that shadows a standard or installed one: the hook would have imported the
installed one first, and the job's functions would get another module than the driver.
Ray reads its serialization settings (``RAY_DISABLE_CUSTOM_ARROW_DATA_SERIALIZATION``,
``RAY_DISABLE_CUSTOM_ARROW_JSON_OPTIONS_SERIALIZATION``) when it builds the context: with
the hook they must be in the environment that starts Ray, as Ray's other settings are; one
that code sets later in a worker no longer applies there.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = [
    "SETUP_HOOK",
    "hook_variable",
    "import_runtime",
    "shadowed_modules",
    "worker_setup_hook",
    "workers_import_this_rayflow",
]

#: The hook, as Ray loads it (``module.function``).
SETUP_HOOK = "rayflow.runtime.preload.import_runtime"

#: How long the look at which rayflow a worker would import may take.
_CHECK_TIMEOUT_S = 30.0

#: Run as ``python -c`` the way a worker starts (no script directory or working directory
#: on its path): the package directory of the rayflow it would import, without importing it.
_WHICH_RAYFLOW = (
    "import sys, importlib.util\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "spec = importlib.util.find_spec('rayflow')\n"
    "print(list(spec.submodule_search_locations or []) if spec else [])\n"
)

#: Ray's variable for it (``ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``).
_FALLBACK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def hook_variable() -> str:
    """The environment variable by which Ray names a worker's setup hook."""
    try:
        from ray._private import ray_constants

        return str(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR)
    except (ImportError, AttributeError):  # another Ray: its name as of Ray 2.x
        return _FALLBACK_VARIABLE


def _runs_tasks() -> bool:
    """Whether this process is a worker that runs tasks and actors (not one of the
    workers that spill and restore objects); True where that cannot be told."""
    try:
        import ray

        mode = ray._private.worker.global_worker.mode
        return mode not in (ray.SPILL_WORKER_MODE, ray.RESTORE_WORKER_MODE)
    except Exception:  # noqa: BLE001 - another Ray: import as before
        return True


def import_runtime() -> None:
    """Import what the job master and a subtask import when they start. The hook's
    variable leaves this worker's environment: what the worker starts (a subprocess
    calling ``ray.init``, say) does not inherit it."""
    os.environ.pop(hook_variable(), None)
    if not _runs_tasks():
        return  # a worker that spills or restores objects runs no actor
    try:
        import rayflow.runtime.job_master  # noqa: F401
        import rayflow.runtime.subtask_actor  # noqa: F401
    except Exception:  # noqa: BLE001 - never fail a worker; the actor's import reports it
        pass
    _build_serialization_context()


def _build_serialization_context() -> None:
    """Have Ray build this worker's serialization context now. Ray builds it when the
    process first serializes or deserializes an object, importing its serializers' add-ons
    (pydantic among them, about 0.2 s here): without this, each new actor paid that before
    its first reply, on the path of every job start."""
    try:
        import ray

        ray._private.worker.global_worker.get_serialization_context()
    except Exception:  # noqa: BLE001 - never fail a worker; Ray builds it when first needed
        pass


def _worker_python() -> list[str]:
    """The interpreter a worker of a local Ray runs (Ray starts them with this one)."""
    return [sys.executable]


def workers_import_this_rayflow() -> bool:
    """Whether a worker process started from this one now (its environment and working
    directory, not its ``sys.path``) would import the rayflow this process runs."""
    import rayflow

    ours = sorted(os.path.realpath(path) for path in rayflow.__path__)
    try:
        done = subprocess.run(
            [*_worker_python(), "-c", _WHICH_RAYFLOW],
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        return False
    try:
        theirs = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    except (ValueError, SyntaxError, IndexError):
        return False
    return sorted(os.path.realpath(path) for path in theirs) == ours


def _driver_directories() -> list[str]:
    """The directories Ray puts first on its workers' ``sys.path`` for this driver when
    their first task runs: the script's directory (where ``sys.path`` has it) and the
    working directory."""
    found = []
    if sys.argv and sys.argv[0]:
        script = os.path.dirname(os.path.realpath(sys.argv[0]))
        if script in sys.path:
            found.append(script)
    found.append(os.path.abspath(os.curdir))
    return list(dict.fromkeys(found))


def _top_level_modules(directory: str) -> set[str]:
    """Names of the modules and regular packages ``directory`` holds."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return set()
    names = set()
    for entry in entries:
        path = os.path.join(directory, entry)
        if entry.endswith((".py", ".so", ".pyd")) and not os.path.isdir(path):
            names.add(entry.split(".", 1)[0])
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            names.add(entry)
    return {name for name in names if name.isidentifier()}


def shadowed_modules(directories: list[str] | None = None) -> list[str]:
    """Modules of the driver's directories that the driver takes from there, shadowing a
    module of the standard library or of the installed packages. A worker's hook imports
    such modules (the runtime's dependencies, the add-ons of Ray's serialization context)
    before those directories are on its path, so its actors would get the installed module
    where the driver's own code, and a worker without the hook, gets the directory's: where
    any exists, no hook is set. A module the driver takes from elsewhere (a console script
    run in a checkout of what it installed) is no such module."""
    directories = _driver_directories() if directories is None else directories
    own = {os.path.realpath(d) for d in directories}
    elsewhere = [p for p in sys.path if p and os.path.realpath(p) not in own]
    shadowed = []
    for name in sorted(set().union(*map(_top_level_modules, directories))):
        if name in sys.builtin_module_names or not _drivers_from(name, own):
            continue  # the driver gets the installed one too (or a built-in: always)
        if name in sys.stdlib_module_names:
            shadowed.append(name)
            continue
        try:
            found = importlib.machinery.PathFinder.find_spec(name, elsewhere) is not None
        except (ImportError, OSError, ValueError):
            found = True  # cannot tell: taken as shadowing (no hook is the safe side)
        if found:
            shadowed.append(name)
    return shadowed


def _drivers_from(name: str, directories: set[str]) -> bool:
    """Whether this driver gets module ``name`` from one of ``directories`` (the one it
    imported, else the one its ``sys.path`` finds first); True where that cannot be told."""
    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None) or next(
            iter(getattr(module, "__path__", None) or []), None
        )
    else:
        path = [os.path.abspath(os.curdir) if p == "" else p for p in sys.path]
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        except (ImportError, OSError, ValueError):
            return True
        if spec is None:
            return False
        origin = spec.origin if spec.has_location else None
        origin = origin or next(iter(spec.submodule_search_locations or []), None)
    if not origin:
        return False
    real = os.path.realpath(origin)
    return any(real.startswith(d + os.sep) for d in directories)


@contextlib.contextmanager
def worker_setup_hook() -> Iterator[bool]:
    """While in the block, processes started from this one (the local raylet that
    ``ray.init`` starts, and so every worker it starts) run :func:`import_runtime` before
    they take work; a hook the environment already names is left as it is, and none is
    set where the workers would not import this process's rayflow, or where the driver's
    directories shadow an installed module (:func:`shadowed_modules`). Yields whether
    the hook is set."""
    variable = hook_variable()
    if variable in os.environ or shadowed_modules() or not workers_import_this_rayflow():
        yield False
        return
    os.environ[variable] = SETUP_HOOK
    try:
        yield True
    finally:
        os.environ.pop(variable, None)
