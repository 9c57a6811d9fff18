"""Review tests of the run lock (a generation record in Ray's key-value store, live while
its owner's lock host is registered): a lock whose host's process dies while starting,
or is killed while its run goes on, still refuses a second run of the job name (Ray
keeps a dead owned actor's name while its owner holds the handle); a lock whose owner
process died is free; of takers racing for a free name exactly one wins; a taker that
read an old listing backs off; a process reconnected to a cluster restarted at the same
address still holds its locks; a name held under the earlier lock (a named actor per
run) is refused; once released, the name is free again at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import ray
from ray.experimental import internal_kv

import rayflow.runtime.run_lock as run_lock
from rayflow.errors import ConcurrentRunError
from rayflow.runtime.run_lock import acquire_run_lock, release_run_lock, run_lock_holder


def _job_name(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@ray.remote(num_cpus=0, max_restarts=0)
class _DiesWhileStarting:
    """A lock host whose process goes away before it ever answers."""

    def __init__(self) -> None:
        os._exit(1)


@pytest.fixture
def fresh_host(monkeypatch):
    """The next lock taken in this process makes a new lock host (the old one stays)."""
    monkeypatch.setattr(run_lock, "_hosts", {})


def test_a_lock_whose_host_dies_while_starting_still_refuses_a_second_run(monkeypatch, fresh_host):
    job = _job_name("dies-starting")
    monkeypatch.setattr(run_lock, "_RemoteLockHost", _DiesWhileStarting)
    first = acquire_run_lock(job, "run-first")  # returns before its host's process ran
    time.sleep(2)  # its process is gone by now
    try:
        with pytest.raises(ConcurrentRunError, match="run-first"):
            acquire_run_lock(job, "run-second")
        assert run_lock_holder(job) == "run-first"
    finally:
        release_run_lock(first)
    second = acquire_run_lock(job, "run-second")  # released: taken again
    release_run_lock(second)


def test_a_lock_whose_host_is_killed_while_its_run_goes_on_still_refuses_a_second_run(
    fresh_host,
):
    job = _job_name("killed")
    first = acquire_run_lock(job, "run-first")
    ((_name, host),) = run_lock._hosts.values()
    pid = ray.get(host.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    try:
        with pytest.raises(ConcurrentRunError, match="run-first"):
            acquire_run_lock(job, "run-second")
    finally:
        release_run_lock(first)
    second = acquire_run_lock(job, "run-second")
    release_run_lock(second)


def test_the_same_driver_takes_the_lock_again_right_after_releasing_it():
    job = _job_name("rerun")
    for i in range(10):
        lock = acquire_run_lock(job, f"run-{i}")
        assert run_lock_holder(job) == f"run-{i}"
        release_run_lock(lock)
        release_run_lock(lock)  # a second release (the job master's, the driver's) is harmless
        assert run_lock_holder(job) is None
    # generations below the highest go at each take: the store keeps one key per name
    assert len(internal_kv._internal_kv_list(run_lock._prefix(job), namespace="rayflow")) == 1


def test_a_late_release_of_an_old_run_does_not_release_the_next_one():
    job = _job_name("late-release")
    first = acquire_run_lock(job, "run-first")
    release_run_lock(first)
    second = acquire_run_lock(job, "run-second")
    try:
        release_run_lock(first)  # the first run's other releaser, late
        run_lock.release_run_lock_held_by(job, "run-first")
        assert run_lock_holder(job) == "run-second"
        with pytest.raises(ConcurrentRunError, match="run-second"):
            acquire_run_lock(job, "run-third")
    finally:
        release_run_lock(second)


_HOLD_AND_DIE = """
import os, signal, sys
import ray
job_config = None
if len(sys.argv) > 3:  # a driver whose actors outlive it unless told otherwise
    job_config = ray.job_config.JobConfig(default_actor_lifetime=sys.argv[3])
ray.init(address=sys.argv[1], log_to_driver=False, job_config=job_config)
from rayflow.runtime.run_lock import acquire_run_lock
acquire_run_lock(sys.argv[2], "run-of-a-dead-driver")
print("held", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("actor_lifetime", [None, "detached"])
def test_a_lock_whose_driver_died_without_releasing_it_is_free(actor_lifetime):
    """Also when the driver made its actors detached by default: the lock host lives
    exactly as long as the process that took the lock, whatever the driver's defaults."""
    job = _job_name("driver-died")
    address = ray.get_runtime_context().gcs_address
    extra = [actor_lifetime] if actor_lifetime else []
    done = subprocess.run(
        [sys.executable, "-c", _HOLD_AND_DIE, address, job, *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "held" in done.stdout, done.stderr[-2000:]
    deadline = time.monotonic() + 60
    while True:  # Ray releases the dead driver's names once it sees the driver gone
        try:
            lock = acquire_run_lock(job, "run-next")
            break
        except ConcurrentRunError as exc:
            assert "run-of-a-dead-driver" in str(exc)
            assert time.monotonic() < deadline, "a dead driver's lock was never freed"
            time.sleep(0.2)
    assert run_lock_holder(job) == "run-next"
    release_run_lock(lock)


def _race(job: str, takers: int) -> tuple[list[run_lock.RunLock], list[str]]:
    won: list[run_lock.RunLock] = []
    refused: list[str] = []
    start = threading.Barrier(takers)

    def take(i: int) -> None:
        start.wait()
        try:
            won.append(acquire_run_lock(job, f"run-{i}"))
        except ConcurrentRunError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(takers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return won, refused


def test_of_takers_racing_for_a_free_name_exactly_one_wins():
    for round_ in range(6):
        job = _job_name("race")
        if round_ % 2:  # also for a name taken and released before
            release_run_lock(acquire_run_lock(job, "run-before"))
        won, refused = _race(job, 8)
        assert len(won) == 1, (won, refused)
        assert len(refused) == 7 and all(won[0].run_id in r for r in refused), refused
        assert run_lock_holder(job) == won[0].run_id
        release_run_lock(won[0])


def test_a_taker_that_read_an_old_listing_backs_off(monkeypatch):
    """Schedule: a taker lists the generations, then stalls while the name is taken
    twice (the first generation released, then deleted by the second take). Its put of
    the generation it computed succeeds, since that key is gone; it must see the higher
    generation and back off, not hold the lock beside the live run."""
    job = _job_name("old-listing")
    first = acquire_run_lock(job, "run-first")
    release_run_lock(first)
    live = acquire_run_lock(job, "run-live")  # generation 2; generation 1 deleted
    real = run_lock._generations
    calls = []

    def old_listing(prefix):
        calls.append(prefix)
        return [] if len(calls) == 1 else real(prefix)

    monkeypatch.setattr(run_lock, "_generations", old_listing)
    try:
        with pytest.raises(ConcurrentRunError, match="run-live"):
            acquire_run_lock(job, "run-stale")
        monkeypatch.undo()
        assert run_lock_holder(job) == "run-live"
        keys = internal_kv._internal_kv_list(run_lock._prefix(job), namespace="rayflow")
        assert keys == [live.key]  # the stale taker's generation 1 is gone again
    finally:
        release_run_lock(live)


_RECONNECT = """
import sys, ray
from ray.cluster_utils import Cluster
from rayflow.runtime.run_lock import acquire_run_lock
from rayflow.errors import ConcurrentRunError
port = int(sys.argv[1])
for i in range(2):  # the cluster is restarted at its address; this process reconnects
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"gcs_server_port": port, "num_cpus": 1, "include_dashboard": False},
    )
    ray.init(address=cluster.address, logging_level="ERROR")
    acquire_run_lock("nightly", f"run-{i}")
    try:
        acquire_run_lock("nightly", f"run-{i}-second")
        print(f"cluster {i}: a second run took the lock beside run-{i}", flush=True)
    except ConcurrentRunError:
        print(f"cluster {i}: refused", flush=True)
    ray.shutdown()
    cluster.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_process_reconnected_to_a_restarted_cluster_still_holds_its_locks():
    """Schedule: a long-lived process takes a lock, the cluster restarts at the same
    address, the process reconnects (its job id is ``01000000`` again) and takes a lock.
    Before: the lock host cached from the first cluster named an actor the new cluster
    never had, so the new lock looked dead at once and a second run took the name."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", _RECONNECT, str(_free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert "cluster 0: refused" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "cluster 1: refused" in done.stdout, done.stdout + done.stderr[-3000:]


@ray.remote(num_cpus=0)
class _EarlierLock:
    """The lock a driver or job host of the earlier rayflow holds: a named actor per run."""

    def holder(self) -> str:
        return "run-of-the-earlier-version"


def test_a_name_held_under_the_earlier_run_lock_is_refused():
    job = _job_name("earlier-version")
    earlier = _EarlierLock.options(name=f"rayflow-run:{job}", namespace="rayflow").remote()
    ray.get(earlier.holder.remote())
    try:
        with pytest.raises(ConcurrentRunError, match="earlier rayflow version"):
            acquire_run_lock(job, "run-new")
    finally:
        ray.kill(earlier)


def test_a_lookup_of_a_live_host_that_fails_once_does_not_free_its_lock(monkeypatch):
    """Schedule: the lookup of the holder's lock host fails once (Ray reads a failed
    lookup as "not found"). Before: the live lock was taken for dead and a second run
    took the name."""
    job = _job_name("failed-lookup")
    first = acquire_run_lock(job, "run-first")
    real = ray.get_actor
    failures = []

    def flaky(name, namespace=None):
        if name.startswith("rayflow-lock-host:") and not failures:
            failures.append(name)
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return real(name, namespace=namespace)

    monkeypatch.setattr(run_lock.ray, "get_actor", flaky)
    try:
        with pytest.raises(ConcurrentRunError, match="run-first"):
            acquire_run_lock(job, "run-second")
        assert failures  # the failed lookup happened
    finally:
        monkeypatch.undo()
        release_run_lock(first)


def test_a_lock_host_that_ray_destroyed_is_made_again_for_the_next_run(fresh_host):
    """Schedule: the process's lock host is destroyed by Ray (``ray.kill``, or its creation
    failed): its name goes. Before: the host stayed cached, every later record named it
    and looked dead at once, and a second run took the name beside the first."""
    job = _job_name("host-destroyed")
    release_run_lock(acquire_run_lock(job, "run-0"))
    ((_name, host),) = run_lock._hosts.values()
    ray.kill(host, no_restart=True)
    time.sleep(1)
    first = acquire_run_lock(job, "run-1")
    try:
        with pytest.raises(ConcurrentRunError, match="run-1"):
            acquire_run_lock(job, "run-2")
    finally:
        release_run_lock(first)


def test_a_take_that_fails_after_its_put_leaves_the_name_free(monkeypatch):
    """Schedule: the put of the next generation lands, then the store fails (a busy GCS,
    or an interrupt) while the taker deletes the generations below. Before: the record
    named this live process, nobody released it, and the name was refused for as long
    as the process lived."""
    job = _job_name("fails-after-put")
    release_run_lock(acquire_run_lock(job, "run-0"))
    real = run_lock.internal_kv._internal_kv_del
    failures = []

    def failing(key, *args, **kwargs):
        if not failures:
            failures.append(key)
            raise KeyboardInterrupt
        return real(key, *args, **kwargs)

    monkeypatch.setattr(run_lock.internal_kv, "_internal_kv_del", failing)
    with pytest.raises(KeyboardInterrupt):
        acquire_run_lock(job, "run-1")
    monkeypatch.undo()
    assert failures
    assert run_lock_holder(job) is None
    release_run_lock(acquire_run_lock(job, "run-2"))


def test_a_release_whose_first_try_fails_still_releases(monkeypatch):
    job = _job_name("release-fails")
    lock = acquire_run_lock(job, "run-0")
    real = run_lock.internal_kv._internal_kv_put
    failures = []

    def failing(key, *args, **kwargs):
        if not failures:
            failures.append(key)
            raise ConnectionError("the GCS is restarting")
        return real(key, *args, **kwargs)

    monkeypatch.setattr(run_lock.internal_kv, "_internal_kv_put", failing)
    release_run_lock(lock)
    monkeypatch.undo()
    assert failures
    assert run_lock_holder(job) is None


def test_a_put_retried_after_it_landed_still_takes_the_lock(monkeypatch):
    """Schedule: the store applies the put but its reply is lost; the retried call finds
    the key and says it exists. Before: the taker looped, read its own live record and
    refused itself, and the record held the name for the process's life."""
    job = _job_name("retried-put")
    real = run_lock.internal_kv._internal_kv_put

    def lost_reply(key, value, overwrite=True, namespace=None):
        real(key, value, overwrite=overwrite, namespace=namespace)
        return True  # "it existed": the retry's answer

    monkeypatch.setattr(run_lock.internal_kv, "_internal_kv_put", lost_reply)
    lock = acquire_run_lock(job, "run-0")
    monkeypatch.undo()
    assert run_lock_holder(job) == "run-0"
    release_run_lock(lock)
