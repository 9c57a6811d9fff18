"""Ray-free tests of warm workers: the top-up policy (asks for what is missing, never
twice for a process still starting, bounded) and the driver-side wrapper (background
top-up after a job's end, ended by the next job's start or at exit, off switch, a
raylet that is unavailable or fails)."""

from __future__ import annotations

import threading

import pytest

from rayflow import StreamExecutionEnvironment
from rayflow.environment import job_actor_count
from rayflow.runtime.warm_workers import MAX_PER_CALL, WarmWorkerConfig, WarmWorkers, top_up


class FakeNode:
    """Idle workers of a node: ``start(n)`` begins at most ``concurrency`` processes
    (the rest are dropped, as the raylet does), each idle ``ticks`` polls later."""

    def __init__(self, idle: int = 0, concurrency: int = 2, ticks: int = 3) -> None:
        self.idle_now = idle
        self.concurrency = concurrency
        self.ticks = ticks
        self.starting: list[int] = []  # polls left per starting process
        self.asked: list[int] = []
        self.started = 0

    def idle(self) -> int:
        return self.idle_now

    def start(self, n: int) -> None:
        self.asked.append(n)
        room = max(0, self.concurrency - len(self.starting))
        for _ in range(min(n, room)):
            self.starting.append(self.ticks)
            self.started += 1

    def tick(self, _seconds: float = 0.0) -> None:
        self.starting = [t - 1 for t in self.starting]
        self.idle_now += sum(1 for t in self.starting if t <= 0)
        self.starting = [t for t in self.starting if t > 0]


class FakeClock:
    def __init__(self, node: FakeNode) -> None:
        self.now = 0.0
        self.node = node

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.node.tick()

    def __call__(self) -> float:
        return self.now


def run_top_up(node: FakeNode, target: int, **kw):
    clock = FakeClock(node)
    kw.setdefault("per_round", 2)
    kw.setdefault("max_rounds", 2 * (target // kw["per_round"] + 1))
    asked = top_up(node.idle, node.start, target, sleep=clock.sleep, clock=clock, **kw)
    return asked, clock


def test_top_up_starts_what_is_missing_within_the_startup_limit_without_starting_extra():
    node = FakeNode(idle=2, concurrency=2, ticks=3)
    asked, _ = run_top_up(node, 6)
    assert node.idle_now == 6
    assert node.started == asked == 4  # never one too many; two at a time
    assert max(node.asked) == 2


def test_top_up_asks_again_for_what_the_raylet_dropped():
    node = FakeNode(idle=0, concurrency=1, ticks=2)  # fewer start at once than asked
    asked, _ = run_top_up(node, 3, per_round=2, max_rounds=10)
    assert node.idle_now == 3
    assert node.started == 3
    assert asked >= 3


def test_slow_workers_are_waited_for_not_asked_twice():
    node = FakeNode(idle=0, concurrency=2, ticks=60)  # 6 s each at 0.1 s polls
    run_top_up(node, 4, per_round=2, round_s=10.0)
    assert node.idle_now == 4
    assert node.started == 4


def test_top_up_does_nothing_when_enough_are_idle():
    node = FakeNode(idle=5)
    assert run_top_up(node, 4)[0] == 0
    assert node.asked == []


def test_top_up_ends_after_a_round_in_which_no_worker_showed_up():
    node = FakeNode(idle=0, concurrency=0)  # the raylet starts nothing (or none counts)
    asked, clock = run_top_up(node, 3, per_round=2, max_rounds=4, round_s=2.0)
    assert asked == 2  # one round: asking again would only start more processes
    assert clock.now <= 2.0 + 1


def test_top_up_stops_when_asked_to():
    node = FakeNode(idle=0, concurrency=1, ticks=2)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 3

    run_top_up(node, 8, stop=stop)
    assert node.started <= 2


def test_top_up_never_asks_more_than_one_call_allows():
    node = FakeNode(idle=0, concurrency=100, ticks=1)
    run_top_up(node, 30, per_round=50, max_rounds=10)
    assert max(node.asked) <= MAX_PER_CALL
    assert node.idle_now == 30


class FakeCalls:
    def __init__(self, node: FakeNode, hooked: FakeNode | None = None) -> None:
        self.node = node
        self.hooked = hooked or FakeNode(concurrency=node.concurrency, ticks=node.ticks)
        self.keep_alive: list[float] = []
        self.tellable = True  # the workers' environments can be read

    def __enter__(self) -> FakeCalls:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def fresh_idle(self, hooked: bool = False) -> int:
        node = self.hooked if hooked else self.node
        node.tick()
        return node.idle()

    def can_tell_hooked(self) -> bool:
        return self.tellable

    def prestart(self, n: int, keep_alive_s: float, hooked: bool = False) -> None:
        self.keep_alive.append(keep_alive_s)
        (self.hooked if hooked else self.node).start(n)


class FakeRaylet:
    """A raylet over ``node`` (workers without the hook's environment) and ``hooked``
    (with it; used where ``runtime_env`` is set)."""

    def __init__(self, node: FakeNode, hooked: FakeNode | None = None) -> None:
        self.startup_concurrency = node.concurrency or 1
        self.c = FakeCalls(node, hooked)
        self.c.r = self

    def calls(self) -> FakeCalls:
        return self.c


def test_keep_warm_tops_up_in_the_background_up_to_the_cap():
    node = FakeNode(idle=0, concurrency=2, ticks=1)
    warm = WarmWorkers(lambda: FakeRaylet(node), node_id=lambda: "n1")
    thread = warm.keep_warm(9, WarmWorkerConfig(max_workers=4, keep_alive_s=10))
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert node.idle_now == 4


def test_the_pool_is_sized_for_the_largest_recent_job():
    node = FakeNode(idle=0, concurrency=2, ticks=1)
    warm = WarmWorkers(lambda: FakeRaylet(node), node_id=lambda: "n1")
    now = [0.0]
    warm._clock = lambda: now[0]
    config = WarmWorkerConfig(max_workers=16, keep_alive_s=60)
    warm.keep_warm(6, config).join(30)
    assert node.idle_now == 6
    node.idle_now = 0  # the next job took them
    now[0] = 30.0
    warm.keep_warm(4, config).join(30)  # a smaller job: still ready for the larger one
    assert node.idle_now == 6
    node.idle_now = 0
    now[0] = 100.0  # the larger job ended longer ago than the keep-alive
    warm.keep_warm(4, config).join(30)
    assert node.idle_now == 4


def test_a_job_start_ends_a_running_top_up():
    node = FakeNode(idle=0, concurrency=1, ticks=10**9)  # never show up: the top-up waits
    release = threading.Event()

    class Slow(FakeCalls):
        def fresh_idle(self) -> int:
            release.wait(5)
            return super().fresh_idle()

    raylet = FakeRaylet(node)
    raylet.c = Slow(node)
    raylet.c.r = raylet
    warm = WarmWorkers(lambda: raylet, node_id=lambda: "n1")
    thread = warm.keep_warm(8, WarmWorkerConfig(max_workers=8, keep_alive_s=10))
    warm.job_starting()
    release.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_off_or_unavailable_means_no_calls():
    node = FakeNode()
    off = WarmWorkerConfig(max_workers=0)
    warm = WarmWorkers(lambda: FakeRaylet(node), node_id=lambda: "n1")
    assert warm.keep_warm(6, off) is None
    assert node.asked == []

    def broken():
        raise RuntimeError("no raylet")

    warm = WarmWorkers(broken, node_id=lambda: "n1")
    warm.keep_warm(6, WarmWorkerConfig()).join(10)

    def not_connected() -> str:
        raise RuntimeError("Ray is not initialized")

    warm = WarmWorkers(lambda: FakeRaylet(node), node_id=not_connected)
    warm.keep_warm(6, WarmWorkerConfig()).join(10)
    assert node.asked == []


def test_a_failing_raylet_call_only_means_no_warm_workers():
    class Failing(FakeCalls):
        def fresh_idle(self) -> int:
            raise ConnectionError("raylet gone")

    raylet = FakeRaylet(FakeNode())
    raylet.c = Failing(raylet.c.node)
    raylet.c.r = raylet
    warm = WarmWorkers(lambda: raylet, node_id=lambda: "n1")
    thread = warm.keep_warm(6, WarmWorkerConfig())
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_stop_ends_a_top_up_that_waits_for_workers():
    node = FakeNode(idle=0, concurrency=2, ticks=10**9)  # never show up
    warm = WarmWorkers(lambda: FakeRaylet(node), node_id=lambda: "n1")
    thread = warm.keep_warm(6, WarmWorkerConfig())
    warm.stop(timeout_s=5)
    assert not thread.is_alive()
    assert node.started <= 2  # at most one round asked for, then stopped while waiting


def test_config_bounds():
    with pytest.raises(ValueError):
        WarmWorkerConfig(max_workers=-1)
    with pytest.raises(ValueError):
        WarmWorkerConfig(keep_alive_s=-1)
    assert WarmWorkerConfig(max_workers=3).target(10) == 3
    assert not WarmWorkerConfig(keep_alive_s=0).enabled


def test_a_job_counts_its_subtasks_and_master():
    env = StreamExecutionEnvironment().set_parallelism(2)
    from rayflow import NumberSequenceSource

    (
        env.from_source(NumberSequenceSource(0, 9))
        .map(lambda r: {"key": r["value"] % 3, "value": r["value"]})
        .key_by("key")
        .sum("value")
        .print()
    )
    graph = env.get_job_graph()
    assert job_actor_count(graph) == sum(v.parallelism for v in graph.vertices.values()) + 1
    assert job_actor_count(graph) == 5
