"""Per-operator resources, slot sharing groups and the placement plan (no Ray)."""

from __future__ import annotations

import pytest

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.runtime.placement import PlacementConfig, PlacementPlan, PlacementStrategy
from sinks.basic import CollectSink


def env(p=2):
    return StreamExecutionEnvironment.get_execution_environment().set_parallelism(p)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_cpus": True}, TypeError),
        ({"num_cpus": "1"}, TypeError),
        ({"num_cpus": -1}, ValueError),
        ({"num_gpus": float("inf")}, ValueError),
        ({"num_cpus": 0.00001}, ValueError),
        ({"resources": {"CPU": 1}}, ValueError),
        ({"resources": {"memory": 1}}, ValueError),
        ({"resources": {"": 1}}, TypeError),
        ({"resources": {"x": -0.5}}, ValueError),
        ({"resources": [("x", 1)]}, TypeError),
    ],
)
def test_set_resources_is_checked_where_it_is_called(kwargs, error):
    stream = env().from_source(NumberSequenceSource(0, 9)).map(lambda r: r, name="m")
    with pytest.raises(error, match="operator 'm': set_resources"):
        stream.set_resources(**kwargs)


def test_slot_sharing_group_name_is_checked():
    stream = env().from_source(NumberSequenceSource(0, 9))
    with pytest.raises(ValueError, match="slot sharing group"):
        stream.slot_sharing_group("")


def test_subtask_options_resources_are_checked():
    with pytest.raises(ValueError, match="set_subtask_options"):
        env().set_subtask_options(num_cpus=-2)


def test_chained_operators_add_up_their_requests():
    e = env()
    (
        e.from_source(NumberSequenceSource(0, 9))
        .set_resources(num_cpus=0.5)
        .map(lambda r: r)
        .set_resources(num_cpus=0.25, resources={"ssd": 1})
        .sink_to(CollectSink())
        .set_resources(memory=1000, resources={"ssd": 0.5})
    )
    graph = e.get_job_graph()
    assert len(graph.vertices) == 1
    spec = graph.vertices[0].resources
    assert (spec.num_cpus, spec.num_gpus, spec.memory) == (0.75, None, 1000)
    assert dict(spec.resources) == {"ssd": 1.5}


def test_default_placement_gives_every_subtask_a_bundle_of_its_own():
    e = env(2)
    s = e.from_source(NumberSequenceSource(0, 9))
    s.key_by("value").sum("value").set_resources(num_cpus=1).sink_to(CollectSink())
    graph = e.get_job_graph()
    plan = PlacementPlan.of(graph)
    assert plan.strategy is PlacementStrategy.SPREAD
    assert plan.bundles == [{"CPU": 0.001}, {"CPU": 0.001}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert sorted(plan.bundle_of.values()) == [0, 1, 2, 3]
    assert plan.requests[0] == {"num_cpus": 0.001}
    assert plan.requests[1] == {"num_cpus": 1.0}


def test_slot_sharing_group_packs_subtask_i_of_each_vertex_into_bundle_i():
    e = env(2)
    (
        e.from_source(NumberSequenceSource(0, 9))
        .slot_sharing_group("pipeline")
        .key_by("value")
        .sum("value")  # inherits the group of its only input
        .set_resources(num_cpus=0.5, resources={"disk": 1})
        .sink_to(CollectSink())
    )
    graph = e.get_job_graph()
    assert [v.slot_sharing_group for v in graph.vertices.values()] == ["pipeline", "pipeline"]
    plan = PlacementPlan.of(graph)
    assert plan.bundles == [{"CPU": 0.501, "disk": 1.0}, {"CPU": 0.501, "disk": 1.0}]
    assert plan.bundle_of == {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 1}


def test_a_different_slot_sharing_group_breaks_the_chain():
    e = env(2)
    (
        e.from_source(NumberSequenceSource(0, 9))
        .map(lambda r: r)
        .slot_sharing_group("other")
        .sink_to(CollectSink())
    )
    graph = e.get_job_graph()
    assert [v.slot_sharing_group for v in graph.vertices.values()] == [None, "other"]


def test_union_of_different_groups_inherits_no_group():
    e = env(1)
    a = e.from_source(NumberSequenceSource(0, 9)).slot_sharing_group("a")
    b = e.from_source(NumberSequenceSource(0, 9)).slot_sharing_group("b")
    a.union(b).map(lambda r: r).sink_to(CollectSink())
    graph = e.get_job_graph()
    assert graph.vertices[2].slot_sharing_group is None


def test_own_scheduling_strategy_or_none_turns_the_placement_group_off():
    e = env(2)
    e.from_source(NumberSequenceSource(0, 9)).sink_to(CollectSink())
    graph = e.get_job_graph()
    own = PlacementPlan.of(graph, {"scheduling_strategy": "SPREAD"})
    assert not own.enabled and own.requests == {0: {}}
    none = PlacementPlan.of(graph, {}, PlacementConfig(PlacementStrategy.NONE))
    assert not none.enabled and none.requests == {0: {}}


def test_job_wide_subtask_options_are_the_default_request():
    e = env(1)
    s = e.from_source(NumberSequenceSource(0, 9))
    s.map(lambda r: r).disable_chaining().set_resources(num_gpus=1).sink_to(CollectSink())
    plan = PlacementPlan.of(e.get_job_graph(), {"num_cpus": 2, "runtime_env": {}})
    assert plan.requests[0] == {"num_cpus": 2.0}
    assert plan.requests[1] == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert plan.bundles[1] == {"CPU": 2.0, "GPU": 1.0}


def test_set_placement_is_checked():
    e = env()
    assert e.set_placement("pack").get_placement().strategy is PlacementStrategy.PACK
    with pytest.raises(ValueError, match="strategy must be one of"):
        e.set_placement("everywhere")
    with pytest.raises(ValueError, match="ready_timeout_s"):
        e.set_placement(ready_timeout_s=0)


@pytest.mark.parametrize(
    "option",
    [
        "max_restarts",
        "max_task_retries",
        "lifetime",
        "name",
        "namespace",
        "get_if_exists",
        "max_concurrency",
        "concurrency_groups",
    ],
)
def test_options_that_decide_a_subtasks_life_are_refused_by_name(option):
    """A Ray-restarted subtask (``max_restarts``) or a detached one would start a process
    after a look for a gone run's processes had seen none: these are rayflow's own."""
    env = StreamExecutionEnvironment.get_execution_environment()
    with pytest.raises(ValueError, match=f"set_subtask_options: '{option}' is rayflow's own"):
        env.set_subtask_options(**{option: 1})


def test_a_subtask_is_never_detached_whatever_the_drivers_default(monkeypatch):
    """A driver started with ``JobConfig(default_actor_lifetime="detached")`` made every
    subtask detached: alive after its job master and driver were gone, holding the job
    name for ever. Its options say ``non_detached``."""
    from types import SimpleNamespace

    from rayflow.runtime import job_master

    given: dict = {}

    class _Actor:
        def options(self, **options):
            given.update(options)
            return SimpleNamespace(remote=lambda deployment: None)

    monkeypatch.setattr(job_master, "RemoteSubtaskActor", _Actor())
    master = object.__new__(job_master.JobMaster)
    master._incarnations, master.generation = 0, 0
    master.settings = SimpleNamespace(job_id="0123456789ab", send_window=8, subtask_options={})
    master.placement = SimpleNamespace(actor_options=lambda key, in_group: {})
    master._new_actor((1, 0), SimpleNamespace(num_input_channels=1))
    assert given["lifetime"] == "non_detached"
