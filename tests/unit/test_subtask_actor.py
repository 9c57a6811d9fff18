"""The subtask's Ray actor is its remote surface only, over a plain ``Subtask``."""

from __future__ import annotations

import inspect

import ray.cloudpickle as cloudpickle

from rayflow.runtime.subtask import CONTROL_GROUP, Subtask
from rayflow.runtime.subtask_actor import RemoteSubtaskActor, SubtaskActor

#: the class the actor is made of
Endpoint = SubtaskActor

#: the calls other actors make on a subtask
REMOTE_CALLS = {
    "push",
    "data_address",
    "run",
    "clean_up",
    "trigger_checkpoint",
    "announce_barrier",
    "notify_checkpoint_complete",
    "notify_checkpoint_aborted",
    "snapshot_blob",
    "metrics",
    "ready",
    "whereabouts",
    "drain_output",
    "quiesce",
    "redeploy",
    "close_for_cancel",
}
#: those served from the mailbox's own group: data, and the loop itself (the data
#: plane's server lives on the mailbox's loop, where its address is asked for)
DATA_CALLS = {"push", "data_address", "run", "clean_up"}
#: calls not handed to the subtask: the actor answers them itself
OWN_CALLS = {"ready", "whereabouts", "data_address"}


def _public_methods(cls: type) -> set[str]:
    return {
        name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")
    }


def _parameters(method) -> list[tuple[str, object]]:
    """Names and defaults, without the one Ray's tracing adds to an actor's methods."""
    return [
        (p.name, p.default)
        for p in inspect.signature(method).parameters.values()
        if p.name != "_ray_trace_ctx"
    ]


def test_the_actor_holds_the_remote_calls_and_nothing_else():
    assert _public_methods(Endpoint) == REMOTE_CALLS


def test_every_call_is_handed_to_the_subtask_method_of_the_same_signature():
    for name in REMOTE_CALLS - OWN_CALLS:
        endpoint, subtask = (_parameters(getattr(cls, name)) for cls in (Endpoint, Subtask))
        assert endpoint == subtask, name
        assert inspect.iscoroutinefunction(getattr(Endpoint, name)), name


def test_control_calls_run_in_the_control_group_and_data_calls_do_not():
    for name in REMOTE_CALLS:
        group = getattr(getattr(Endpoint, name), "__ray_concurrency_group__", None)
        assert group == (None if name in DATA_CALLS else CONTROL_GROUP), name


def test_the_class_ray_exports_takes_the_subtask_by_reference():
    """What a job master pickles (and Ray disassembles) when it starts its first subtask:
    the endpoint's calls; the subtask's own code is imported by each worker."""
    exported = RemoteSubtaskActor.__ray_metadata__.modified_class
    payload = cloudpickle.dumps(exported)
    assert len(payload) < 40_000, len(payload)
    assert len(cloudpickle.dumps(Subtask)) < 200  # a name to import, not the class's code
    assert b"_run_inputs" not in payload  # no internal of the subtask travels with it
