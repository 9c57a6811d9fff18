"""The run lock of a run whose process went while its actors' processes still ran
(Ray's store and lookups faked, no Ray started): a held lock dies with the process that
took it, so a record left unreleased says which job's actors to look for, and the name is
taken only once their processes have exited."""

from __future__ import annotations

import subprocess

import pytest

from rayflow.errors import ConcurrentRunError
from rayflow.runtime import actor_exit, job_processes, run_lock
from rayflow.runtime.actor_exit import ActorProcess
from rayflow.runtime.job_processes import record_processes, recorded_processes


class _Store:
    """Ray's internal key-value store, in a dict."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.data: dict[bytes, bytes] = {}
        kv = run_lock.internal_kv
        monkeypatch.setattr(kv, "_internal_kv_put", self.put)
        monkeypatch.setattr(kv, "_internal_kv_get", lambda key, namespace=None: self.data.get(key))
        monkeypatch.setattr(kv, "_internal_kv_del", lambda key, namespace=None: self.data.pop(key))
        monkeypatch.setattr(kv, "_internal_kv_list", self.list)
        monkeypatch.setattr(run_lock, "_older_lock_holder", lambda job_name: None)
        monkeypatch.setattr(run_lock, "_host_name", lambda: "host-of-this-process")
        monkeypatch.setattr(run_lock, "_host_alive", lambda name: name == "host-of-this-process")

    def put(self, key, value, overwrite=True, namespace=None):
        if not overwrite and key in self.data:
            return True  # Ray: "the key existed"
        self.data[key] = value
        return False

    def list(self, prefix, namespace=None):
        return [k for k in self.data if k.startswith(prefix)]


def _left_by_a_dead_process(store: _Store, job_id: str | None) -> None:
    record = run_lock._Record("run-a", "host-of-a-dead-driver", job_id=job_id)
    store.data[run_lock._key(run_lock._prefix("nightly"), 1)] = record.encode()


def test_a_lock_left_by_a_dead_process_is_refused_while_its_actors_processes_run(
    monkeypatch,
):
    """Schedule: a driver's run ends with its actors' processes not seen to exit; it
    keeps the lock, and then the driver's process exits (the script ends). Before: the
    lock went with the process and a next run of the name started beside them."""
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, "0123456789ab")
    asked: list[str] = []

    def still_running(prefix, timeout_s, also=(), **options):
        asked.append(prefix)
        return False

    monkeypatch.setattr(run_lock, "wait_named_exited", still_running)
    with pytest.raises(ConcurrentRunError, match="run-a.*still run") as info:
        run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    assert asked == ["rayflow:0123456789ab:"]
    # nobody will release it: the process that took it is gone
    assert "cannot start yet" in str(info.value) and "releases" not in str(info.value)


def test_a_lock_left_by_a_dead_process_is_refused_while_that_is_unknown(monkeypatch):
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, "0123456789ab")

    def unknown(prefix, timeout_s, also=(), **options):
        raise RuntimeError("Ray's actor table could not be read")

    monkeypatch.setattr(run_lock, "wait_named_exited", unknown)
    with pytest.raises(ConcurrentRunError, match="run-a.*not known"):
        run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")


def test_a_lock_left_by_a_dead_process_is_taken_once_its_actors_are_gone(monkeypatch):
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, "0123456789ab")
    monkeypatch.setattr(
        run_lock, "wait_named_exited", lambda prefix, timeout_s, also=(), **options: True
    )
    lock = run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    record = run_lock._read(lock.key)
    assert record.run_id == "run-b" and record.job_id == "fedcba987654"


def test_a_record_without_a_job_id_is_taken_as_before(monkeypatch):
    """A record of an earlier rayflow names no job: nothing to look for."""
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, None)
    monkeypatch.setattr(
        run_lock,
        "wait_named_exited",
        lambda prefix, timeout_s, also=(), **options: pytest.fail("looked"),
    )
    assert run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654").run_id == "run-b"


class _ThisNode:
    def get_node_id(self) -> str:
        return "node-of-this-test"


def test_a_survivor_whose_entry_rays_actor_table_dropped_is_found_by_its_record(monkeypatch):
    """Schedule: a run's process dies while a process of one of its actors still runs;
    then the cluster runs so many actors that Ray's table of dead actors drops that
    actor's entry. Before: the next run of the name found no process to wait for and
    started beside the survivor. Now the job master's record of where its actors run
    names it."""
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, "0123456789ab")
    monkeypatch.setattr(actor_exit, "processes_named", lambda prefix, placed=False: [])  # dropped
    monkeypatch.setattr(actor_exit.ray, "get_runtime_context", lambda: _ThisNode())
    monkeypatch.setattr(run_lock, "SURVIVORS_CHECK_S", 0.3)
    survivor = subprocess.Popen(["sleep", "60"])
    try:
        # recorded as an actor records itself: with its PID namespace (this process's)
        recorded = ActorProcess("node-of-this-test", survivor.pid, pid_ns=actor_exit._PID_NS)
        record_processes("0123456789ab", [recorded])
        with pytest.raises(ConcurrentRunError, match="run-a.*still run"):
            run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    finally:
        survivor.kill()
        survivor.wait()
    lock = run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    assert lock.run_id == "run-b"
    assert recorded_processes("0123456789ab") == [], "records of exited processes stay"


def test_a_ray_client_taker_is_refused_in_seconds_when_the_look_cannot_start(monkeypatch):
    """Schedule: a Ray Client driver takes a name whose last run's process died; the task
    that looks for that run's processes on the cluster does not start (no worker comes
    up). Before: the taker blocked for 125 s before it was refused."""
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, "0123456789ab")
    waited: list[float] = []

    class Task:
        def options(self, **options):
            return self

        def remote(self, *args):
            return "ref"

    def never_starts(ref, timeout=None):
        waited.append(timeout)
        raise actor_exit.ray.exceptions.GetTimeoutError("the task did not start")

    monkeypatch.setattr(actor_exit, "_client_mode", lambda: True)
    monkeypatch.setattr(actor_exit, "_wait_named_there", Task())
    monkeypatch.setattr(actor_exit.ray, "get", never_starts)
    cancelled: list = []
    monkeypatch.setattr(
        actor_exit.ray, "cancel", lambda ref, force=False: cancelled.append((ref, force))
    )
    with pytest.raises(ConcurrentRunError, match="run-a.*not known"):
        run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    assert cancelled == [("ref", True)]  # not left looking in the background
    # 5 s to look, 15 s for its task to start, 15 s for the tasks it starts (before: 125)
    assert waited and waited[0] <= 35.0, waited


def test_a_process_recorded_while_the_taker_waits_is_waited_for_too(monkeypatch):
    """Schedule: a run's driver dies; its job master, which Ray already calls dead, still
    runs and deploys a subtask, which records its process; then the job master's
    process exits. Before: the taker waited only for the processes it had read, saw
    them exit and took the name beside the new subtask (and, earlier still, deleted its
    record unread)."""
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, "0123456789ab")
    master = ActorProcess("node-a", 101)
    record_processes("0123456789ab", [master])
    late = ActorProcess("node-a", 202, 1_800_000_000.0, 4242)
    looks: list[list[int]] = []

    def late_one_still_runs(prefix, timeout_s, also=(), **options):
        looks.append([p.pid for p in also])
        if len(looks) == 1:
            record_processes("0123456789ab", [late])  # deployed while the master died
            return True  # the master's process exited
        return late not in also

    monkeypatch.setattr(run_lock, "wait_named_exited", late_one_still_runs)
    with pytest.raises(ConcurrentRunError, match="run-a.*still run"):
        run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    assert looks == [[101], [101, 202]]
    assert late in recorded_processes("0123456789ab")
    # once it has exited too, the name is taken and both records go
    monkeypatch.setattr(run_lock, "wait_named_exited", lambda *args, **options: True)
    run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    assert recorded_processes("0123456789ab") == []


def test_records_are_read_again_when_the_store_fails_once(monkeypatch):
    store = _Store(monkeypatch)
    record_processes("0123456789ab", [ActorProcess("node-a", 101)])
    failures = [RuntimeError("the GCS is restarting")]

    def flaky(prefix, namespace=None):
        if failures:
            raise failures.pop()
        return store.list(prefix)

    monkeypatch.setattr(run_lock.internal_kv, "_internal_kv_list", flaky)
    monkeypatch.setattr(job_processes, "_RETRY_S", 0.01)
    assert [p.pid for p in recorded_processes("0123456789ab")] == [101]


def test_every_round_of_the_look_gets_time_to_look_on_other_nodes(monkeypatch):
    """A round that starts past the deadline (an earlier round used it all, and a record
    appeared) still looks: a process on another node is looked at by a task, which needs
    a moment to start. Before: it got no time, and a run whose processes had all exited
    was refused."""
    store = _Store(monkeypatch)
    _left_by_a_dead_process(store, "0123456789ab")
    record_processes("0123456789ab", [ActorProcess("node-a", 101)])
    given: list[float] = []

    def exited(prefix, timeout_s, also=(), **options):
        given.append(timeout_s)
        if len(given) == 1:
            record_processes("0123456789ab", [ActorProcess("node-b", 202)])
        return True

    monkeypatch.setattr(run_lock, "SURVIVORS_CHECK_S", 0.0)
    monkeypatch.setattr(run_lock, "wait_named_exited", exited)
    run_lock.acquire_run_lock("nightly", "run-b", job_id="fedcba987654")
    assert len(given) == 2 and min(given) >= 1.0, given


def test_a_record_keeps_the_pid_namespace_and_a_record_without_one_still_reads(monkeypatch):
    """A record names the PID namespace of its process; a record written before it did
    (no namespace) reads as a process of unknown namespace, and is forgotten by its own
    key."""
    _Store(monkeypatch)
    with_ns = ActorProcess("ab" * 28, 101, 1700000000.0, 4242, 4026531836)
    without = ActorProcess("ab" * 28, 102, None, 4343)
    record_processes("0123456789ab", [with_ns, without])
    assert sorted(recorded_processes("0123456789ab"), key=lambda p: p.pid) == [with_ns, without]
    assert job_processes._key("0123456789ab", without).endswith(b":102:4343:")
    job_processes.forget_processes("0123456789ab", [with_ns, without])
    assert recorded_processes("0123456789ab") == []
