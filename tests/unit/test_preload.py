"""The worker setup hook of a local Ray that rayflow starts: set only while ``ray.init``
starts the raylet, never over one the environment names, and a hook that cannot fail a
worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rayflow.runtime import preload
from rayflow.runtime.preload import SETUP_HOOK, import_runtime, worker_setup_hook

VARIABLE = preload.hook_variable()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(preload.__file__))))


def assert_runs_ok(code: str) -> None:
    """``code`` runs in a fresh interpreter (nothing of rayflow imported) and prints ok."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_variable_is_rays_own():
    from ray._private import ray_constants

    assert VARIABLE == ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR


def test_the_hook_is_set_only_inside_the_block(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the workers find this rayflow too
    monkeypatch.delenv(VARIABLE, raising=False)
    with worker_setup_hook():
        assert os.environ[VARIABLE] == SETUP_HOOK
    assert VARIABLE not in os.environ
    with pytest.raises(RuntimeError), worker_setup_hook():
        raise RuntimeError("ray.init failed")
    assert VARIABLE not in os.environ


def test_modules_that_shadow_a_standard_or_installed_one_are_named(monkeypatch, tmp_path):
    (tmp_path / "xdrlib.py").write_text("")  # the standard library's
    (tmp_path / "tabnanny").mkdir()  # a regular package: the standard library's
    (tmp_path / "tabnanny" / "__init__.py").write_text("")
    (tmp_path / "pip.cpython-311-x86_64-linux-gnu.so").write_text("")  # installed
    (tmp_path / "pyarrow").mkdir()  # no __init__: a namespace package shadows nothing
    (tmp_path / "my_job_helpers.py").write_text("")  # the project's own
    (tmp_path / "notes.txt").write_text("")
    # a driver that does not have the directory on its path takes the installed ones
    assert preload.shadowed_modules([str(tmp_path)]) == []
    monkeypatch.syspath_prepend(str(tmp_path))  # the script's directory, first
    assert preload.shadowed_modules([str(tmp_path)]) == ["pip", "tabnanny", "xdrlib"]
    assert preload.shadowed_modules([str(tmp_path / "missing")]) == []


def test_a_module_whose_lookup_fails_counts_as_shadowing(monkeypatch, tmp_path):
    import importlib.machinery

    def broken(*args, **kwargs):
        raise ValueError("a path entry that cannot be read")

    (tmp_path / "my_job_helpers.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preload.shadowed_modules([str(tmp_path)]) == []
    monkeypatch.setattr(importlib.machinery.PathFinder, "find_spec", broken)
    assert preload.shadowed_modules([str(tmp_path)]) == ["my_job_helpers"]


def test_no_hook_where_the_drivers_directory_shadows_an_installed_module(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the workers find this rayflow
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)  # the working directory is one of the driver's
    monkeypatch.syspath_prepend(str(tmp_path))  # and on its path, as a script's is
    with worker_setup_hook():
        assert os.environ.get(VARIABLE) == SETUP_HOOK
    (tmp_path / "xdrlib.py").write_text("")  # the driver would take this one
    with worker_setup_hook():
        assert VARIABLE not in os.environ
    assert VARIABLE not in os.environ


def test_a_hook_the_environment_names_is_left_alone(monkeypatch):
    monkeypatch.setenv(VARIABLE, "theirs.module.hook")
    with worker_setup_hook():
        assert os.environ[VARIABLE] == "theirs.module.hook"
    assert os.environ[VARIABLE] == "theirs.module.hook"


def test_the_hook_imports_the_runtime_and_never_raises(tmp_path):
    # In a fresh interpreter: the runtime is not imported before, it is after; and a
    # runtime that cannot be imported does not make the hook raise.
    code = (
        "import os, sys\n"
        "from rayflow.runtime.preload import import_runtime\n"
        "assert 'rayflow.runtime.subtask' not in sys.modules\n"
        f"os.environ[{VARIABLE!r}] = {SETUP_HOOK!r}\n"
        "import_runtime()\n"
        f"assert {VARIABLE!r} not in os.environ  # not inherited further\n"
        "assert 'rayflow.runtime.subtask' in sys.modules\n"
        "assert 'rayflow.runtime.job_master' in sys.modules\n"
        "import ray\n"
        "assert ray._private.worker.global_worker.serialization_context_map\n"
        "sys.modules['rayflow.runtime.subtask'] = None  # an import that fails\n"
        "del sys.modules['rayflow.runtime.job_master']\n"
        "import_runtime()\n"
        "print('ok')\n"
    )
    assert_runs_ok(code)
    import_runtime()  # here, where it is imported already


def test_the_hook_never_raises_when_ray_cannot_build_its_serialization_context(monkeypatch):
    import ray

    def refuse() -> None:
        raise RuntimeError("no context here")

    worker = ray._private.worker.global_worker
    monkeypatch.setattr(worker, "get_serialization_context", refuse)
    import_runtime()  # the hook of a worker: never raises


def test_the_hook_is_what_ray_loads():
    from ray._common.utils import load_class  # what the worker loads the hook with

    assert load_class(SETUP_HOOK) is import_runtime


def test_no_hook_when_the_workers_would_import_another_rayflow(monkeypatch, tmp_path):
    # A worker starts without the driver's script directory or working directory on its
    # path (Ray adds them when its first task runs, after the hook): here its PYTHONPATH
    # finds another rayflow first, so the hook would import (or fail to load) that one.
    other = tmp_path / "rayflow"
    (other / "runtime").mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "runtime" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv(VARIABLE, raising=False)
    with worker_setup_hook():
        assert VARIABLE not in os.environ
    assert VARIABLE not in os.environ


def test_workers_that_spill_or_restore_objects_import_nothing():
    code = (
        "import sys, ray\n"
        "from rayflow.runtime.preload import import_runtime\n"
        "ray._private.worker.global_worker.mode = ray.SPILL_WORKER_MODE\n"
        "import_runtime()\n"
        "assert 'rayflow.runtime.subtask' not in sys.modules\n"
        "ray._private.worker.global_worker.mode = ray.WORKER_MODE\n"
        "import_runtime()\n"
        "assert 'rayflow.runtime.subtask' in sys.modules\n"
        "print('ok')\n"
    )
    assert_runs_ok(code)
