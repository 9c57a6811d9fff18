"""rayflow's Ray actor classes travel by reference: Ray pickles an actor class when the
first actor of it is created, and a process unpickles it whenever it makes a handle of
such an actor (``ray.get_actor``, a handle passed to it). A class that cloudpickle
cannot find under its own name in its module travels by value, and unpickling it in the
process that pickled it writes the copies over the class's own methods: their globals
are then a copy taken at pickling, so the module's later values (and a test's patches)
no longer reach them."""

from __future__ import annotations

import pytest
import ray.cloudpickle as cloudpickle

from rayflow import detached
from rayflow.runtime import job_master, run_lock, subtask_actor

REMOTE_CLASSES = {
    "job master": job_master.RemoteJobMaster,
    "subtask": subtask_actor.RemoteSubtaskActor,
    "detached job host": detached.RemoteJobHost,
    "run lock host": run_lock._RemoteLockHost,
}


@pytest.mark.parametrize("what", sorted(REMOTE_CLASSES))
def test_unpickling_an_actor_class_here_leaves_the_class_as_it_was(what):
    modified = REMOTE_CLASSES[what].__ray_metadata__.modified_class
    plain = modified.__ray_actor_class__
    before = dict(vars(plain))
    cloudpickle.loads(cloudpickle.dumps(modified))
    assert set(vars(plain)) == set(before), what
    replaced = [name for name, value in vars(plain).items() if value is not before[name]]
    assert replaced == [], what


@pytest.mark.parametrize("what", sorted(REMOTE_CLASSES))
def test_an_actor_class_is_exported_as_a_name_to_import(what):
    modified = REMOTE_CLASSES[what].__ray_metadata__.modified_class
    plain = modified.__ray_actor_class__
    assert len(cloudpickle.dumps(plain)) < 200, what  # a name, not the class's code
    assert len(cloudpickle.dumps(modified)) < 40_000, what  # Ray's own additions


def test_a_patch_of_the_job_masters_module_reaches_its_methods_after_a_handle_was_made(
    monkeypatch,
):
    """What a driver goes through: it created a job master (Ray pickled the class), then
    made a handle of it by name (Ray unpickled the class). The job master's methods
    still read the module's names."""
    modified = job_master.RemoteJobMaster.__ray_metadata__.modified_class
    cloudpickle.loads(cloudpickle.dumps(modified))
    marker = object()
    monkeypatch.setattr(job_master, "forget_processes", marker)
    method = job_master.JobMaster._read_then_kill
    assert method.__globals__ is vars(job_master)
    assert method.__globals__["forget_processes"] is marker
