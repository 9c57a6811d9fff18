"""rayflow/runtime/actor_exit.py without Ray: when a killed actor counts as gone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError, WorkerCrashedError

from rayflow.runtime import actor_exit
from rayflow.runtime.actor_exit import ActorProcess, ActorsStillAlive, kill_and_wait

HERE = "node-here"


class _Call:
    def __init__(self, error: BaseException | None = None, hang: bool = False) -> None:
        self.error, self.hang = error, hang

    def __await__(self):
        if self.hang:
            yield from asyncio.sleep(3600).__await__()
        if self.error is not None:
            raise self.error
        return None


class _Dead:
    """A killed actor Ray already calls dead, which cannot say where it ran (its control
    calls are all taken, say)."""

    ready = SimpleNamespace(remote=lambda: _Call(RayActorError()))
    whereabouts = SimpleNamespace(remote=lambda: _Call(hang=True))


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setattr(actor_exit.ray, "kill", lambda actor, no_restart=True: None)
    context = SimpleNamespace(get_node_id=lambda: HERE)
    monkeypatch.setattr(actor_exit.ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(actor_exit, "_WHEREABOUTS_TIMEOUT_S", 0.05)
    monkeypatch.setattr(actor_exit, "_sees_worker_pids", lambda: True)


def test_running_tells_a_live_process_from_one_that_is_gone():
    assert actor_exit._running(os.getpid())
    assert not actor_exit._running(2**22 + 12345)  # above the largest pid Linux gives


def test_a_process_learnt_at_deploy_is_waited_for_though_the_actor_cannot_say(no_ray):
    actor = _Dead()
    still_running = ActorProcess(HERE, os.getpid())  # this process: it never exits here
    with pytest.raises(ActorsStillAlive) as info:
        asyncio.run(kill_and_wait([actor], timeout_s=0.3, known={id(actor): still_running}))
    assert info.value.actors == [actor]


def test_an_actor_that_cannot_say_and_was_not_learnt_counts_as_gone_once_dead(no_ray):
    asyncio.run(kill_and_wait([_Dead()], timeout_s=0.3))


def _failing_probe(monkeypatch, error: BaseException) -> list[int]:
    tries: list[int] = []

    def remote(pids, left):
        tries.append(len(pids))
        return _Call(error)

    probe = SimpleNamespace(remote=remote)
    monkeypatch.setattr(actor_exit, "_gone_there", SimpleNamespace(options=lambda **kw: probe))
    return tries


def test_a_probe_that_died_on_a_live_node_proves_nothing(no_ray, monkeypatch):
    """The probe's worker was killed (memory pressure on that node): the node and the
    process may well live. Tried again until the deadline, then not gone."""
    tries = _failing_probe(monkeypatch, WorkerCrashedError())
    monkeypatch.setattr(actor_exit, "_node_alive", lambda node_id: True)
    deadline = time.monotonic() + 1.5  # several tries, also on a loaded machine
    pids = [(123, None), (456, None)]
    assert asyncio.run(actor_exit._exited("ab" * 28, pids, deadline)) is False
    assert len(tries) >= 2 and set(tries) == {2}  # one probe for both processes, each time


def test_a_probe_that_cannot_run_on_a_node_that_is_gone_proves_the_process_gone(
    no_ray, monkeypatch
):
    _failing_probe(monkeypatch, WorkerCrashedError())
    monkeypatch.setattr(actor_exit, "_node_alive", lambda node_id: False)
    deadline = time.monotonic() + 5.0
    assert asyncio.run(actor_exit._exited("ab" * 28, [(123, None)], deadline)) is True


def _master(**attributes):
    from rayflow.runtime import job_master

    master = object.__new__(job_master.JobMaster)
    master.settings = SimpleNamespace(job_name="j", hooks=None, checkpointing=True)
    master._survivors, master._processes, master._spare, master.actors = [], {}, {}, {}
    master.clean_up_failure = None

    async def nothing(*args, **kwargs):
        return None

    master._output = SimpleNamespace(last_read=nothing)
    for name, value in attributes.items():
        setattr(master, name, value)
    return master


def test_a_survivor_whose_process_runs_is_not_taken_for_gone_on_the_next_look(no_ray, monkeypatch):
    """Ray calls the killed actor dead, its process still runs, and the actor cannot say
    where it runs any more: what the job master learnt at deploy keeps it a survivor on
    every later look, not only the first."""
    monkeypatch.setattr(actor_exit, "KILL_TIMEOUT_S", 0.3)
    actor = _Dead()
    master = _master()
    master._processes = {id(actor): (actor, ActorProcess(HERE, os.getpid()))}
    with pytest.raises(ActorsStillAlive):
        asyncio.run(master._read_then_kill({(1, 0): actor}))
    assert master._survivors == [actor]
    assert asyncio.run(master._survivors_gone()) is False
    assert master._survivors == [actor]


def test_a_clean_up_from_the_checkpoint_is_not_tried_again_beside_its_survivors(no_ray):
    """The first clean-up from the checkpoint left an actor whose process still runs (it
    hung, was killed, and did not exit): no second set of fresh actors commits and aborts
    beside it; the failure says why."""
    actor = _Dead()
    calls = []

    async def clean_up_from_checkpoint(missing, latest):
        calls.append(list(missing))
        master._survivors.append(actor)  # as _kill_everything_in leaves it
        master._processes[id(actor)] = (actor, ActorProcess(HERE, os.getpid()))
        return missing, None

    async def nothing(*args, **kwargs):
        return None

    async def restore_point():
        return SimpleNamespace(checkpoint_id=3)

    master = _master(
        _take_holds=nothing,
        _restore_point=restore_point,
        _kill_everything_in=nothing,
        _two_phase_sink_subtasks=lambda: [(1, 0)],
        _clean_up_from_checkpoint=clean_up_from_checkpoint,
    )
    actor_exit.KILL_TIMEOUT_S, before = 0.3, actor_exit.KILL_TIMEOUT_S
    try:
        asyncio.run(master._clean_up_outside_world())
    finally:
        actor_exit.KILL_TIMEOUT_S = before
    assert calls == [[(1, 0)]]
    assert "still run" in master.clean_up_failure


def test_a_pid_used_again_by_a_later_process_is_not_taken_for_the_actors(no_ray):
    """Ray's actor table keeps a dead actor's pid; the kernel may give it to a new
    process since. Only a process that started by the time the actor did is its."""
    assert actor_exit._running(os.getpid(), started_by=time.time() + 5)
    assert not actor_exit._running(os.getpid(), started_by=time.time() - 10 * 365 * 86400)
    assert actor_exit.wait_exited([ActorProcess(HERE, os.getpid(), time.time() - 86400)], 5)


def test_waiting_for_exits_works_where_an_event_loop_already_runs(no_ray):
    """A notebook's cell runs inside an event loop: waiting there must not fail."""

    async def in_a_loop() -> bool:
        return actor_exit.wait_exited([ActorProcess(HERE, 2**22 + 12345)], 5)

    assert asyncio.run(in_a_loop())


def test_a_run_whose_actors_processes_still_run_keeps_its_job_names_lock(monkeypatch):
    """At a run's end its actors are killed, then its job name's lock is released; while
    their processes still run (not seen to exit), the lock is kept: no next run of the
    name starts beside them."""
    from rayflow import environment
    from rayflow.errors import JobFailedError

    released = []

    def still_running(job_id, timeout_s=30.0):
        raise JobFailedError(f"job {job_id}: processes of its actors still run")

    monkeypatch.setattr(environment, "_kill_job_actors", still_running)
    monkeypatch.setattr(environment, "release_run_lock", released.append)
    monkeypatch.setattr(environment.ray, "kill", lambda actor, no_restart=True: None)
    client = object.__new__(environment.JobClient)
    client._master, client.job_id, client.job_name = None, "abc", "nightly"
    client._lock, client._warm = "the lock", None
    client._release_lock, client._released = environment.threading.Lock(), False
    client._retrying = True  # no thread of its own trying again here
    client._release()
    assert released == [] and client.holds_job_name
    monkeypatch.setattr(environment, "_kill_job_actors", lambda job_id, timeout_s=30.0: None)
    assert client.release_stopped()
    assert released == ["the lock"]


def test_an_unreadable_actor_table_is_not_taken_as_no_processes(monkeypatch):
    """Schedule: the GCS does not answer while a lost job master's actors are looked up.
    Before: no processes were found, so none was waited for and the next run could
    start beside them. Now reading the table is tried again, and then it raises."""
    from ray._private import state

    reads: list[int] = []

    def unreadable():
        reads.append(1)
        raise ConnectionError("the GCS does not answer")

    monkeypatch.setattr(state, "actors", unreadable)
    monkeypatch.setattr(actor_exit, "_TABLE_RETRY_S", 0.01)
    with pytest.raises(actor_exit.ActorTableUnavailable, match="'rayflow:job:'"):
        actor_exit.processes_named("rayflow:job:")
    assert len(reads) == actor_exit._TABLE_TRIES > 1


def test_a_ray_client_driver_waits_for_processes_in_a_task_on_the_cluster(monkeypatch):
    """Schedule: the driver is a Ray Client (``ray://``): its machine is no node of the
    cluster and cannot read Ray's actor table. Before: the table read failed, nothing
    was waited for. Now the wait runs in a task on the cluster."""
    sent: list[tuple] = []

    class Task:
        def options(self, **options):
            sent.append(("options", options))
            return self

        def remote(self, *args):
            sent.append(("remote", args))
            return "ref"

    monkeypatch.setattr(actor_exit, "_client_mode", lambda: True)
    monkeypatch.setattr(actor_exit, "_wait_named_there", Task())
    waits: list = []
    monkeypatch.setattr(
        actor_exit.ray, "get", lambda ref, timeout=None: waits.append(timeout) or ref == "ref"
    )
    monkeypatch.setattr(
        actor_exit, "processes_named", lambda prefix: pytest.fail("read the table here")
    )
    assert actor_exit.wait_named_exited("rayflow:job:", 7.0)
    start_s = actor_exit.PROBE_START_S  # the probes it starts there get as long
    assert ("remote", ("rayflow:job:", 7.0, [], start_s)) in sent
    # review schedule: the task starts late, and so do the tasks it starts on other
    # nodes; the driver's wait allows for both (before: for one)
    assert waits == [7.0 + 2 * start_s]
    assert sent[0][1]["num_cpus"] == 0


def test_a_process_recorded_with_its_start_is_another_once_that_pid_started_again():
    """A record names a process by its pid and its start in clock ticks since boot: a
    later process with the same pid (pid reuse) is another, whatever the clocks."""
    ticks = actor_exit._start_ticks(os.getpid())
    assert ticks is not None
    assert actor_exit._running(os.getpid(), None, ticks)
    assert not actor_exit._running(os.getpid(), None, ticks - 1)
    # the start ticks decide over a started-by that the clocks got wrong
    assert actor_exit._running(os.getpid(), time.time() - 10 * 365 * 86400, ticks)


def test_a_process_listed_twice_is_waited_for_by_each_listing():
    """Ray's table and a record can list one process, told apart differently: the table
    by its start time (a node's clock ahead of the GCS's by more than the slack makes a
    live process look like another), the record by its start ticks. Before: the record
    was dropped as a duplicate and the live process taken as exited."""
    pid = os.getpid()
    skewed = actor_exit.ActorProcess("n", pid, time.time() - 31)
    recorded = actor_exit.ActorProcess("n", pid, None, actor_exit._start_ticks(pid))
    both = actor_exit._together([skewed], [recorded])
    assert any(actor_exit._running(p.pid, p.started_by, p.start_ticks) for p in both)


def test_the_job_master_forgets_only_processes_its_kill_waited_for(no_ray, monkeypatch):
    """Schedule: the job master kills an actor it had not yet learnt the process of (a
    busy actor, its answer pending); the kill asks it, gets no answer, and counts it gone
    once Ray calls it dead; the pending answer then lands. Before: the job master forgot
    the record of that process, whose exit nobody had seen."""
    from rayflow.runtime import job_master

    actor = _Dead()
    late = ActorProcess(HERE, os.getpid(), None, 4242)
    master = _master()
    master.settings.job_id = "0123456789ab"
    forgotten: list = []

    async def kill(actors, known=None):
        assert id(actor) not in known
        master._processes[id(actor)] = (actor, late)  # the answer lands meanwhile

    monkeypatch.setattr(job_master, "kill_and_wait", kill)
    monkeypatch.setattr(job_master, "forget_processes", lambda job, ps: forgotten.extend(ps))
    asyncio.run(master._read_then_kill({(1, 0): actor}))
    assert late not in forgotten
    # a process the kill did wait for is forgotten
    known = ActorProcess(HERE, os.getpid(), None, 4343)
    master._processes[id(actor)] = (actor, known)

    async def waited(actors, known=None):
        assert id(actor) in known

    monkeypatch.setattr(job_master, "kill_and_wait", waited)
    asyncio.run(master._read_then_kill({(1, 0): actor}))
    assert forgotten == [known]


def test_an_actor_being_created_counts_as_running_until_it_is_dead_or_placed(monkeypatch):
    """Schedule: a gone run's job master had asked for a subtask; Ray's table lists it
    PENDING_CREATION with no process yet (its worker may be starting it). Before: the
    look skipped entries without a pid and took the run's processes for exited."""
    from ray._private import state

    entry = {"Name": "rayflow:j1:v1:s0:g0-0", "State": "PENDING_CREATION", "Pid": 0}
    monkeypatch.setattr(state, "actors", lambda: {"a": entry})
    monkeypatch.setattr(actor_exit, "_client_mode", lambda: False)
    monkeypatch.setattr(actor_exit, "_UNPLACED_POLL_S", 0.01)
    assert actor_exit.wait_named_exited("rayflow:j1:", 0.2) is False
    entry["State"] = "DEAD"  # never placed, and dead now
    assert actor_exit.wait_named_exited("rayflow:j1:", 0.2) is True


def test_a_survivor_seen_to_exit_on_a_later_look_is_forgotten(no_ray, monkeypatch):
    from rayflow.runtime import job_master

    actor = _Dead()
    process = ActorProcess(HERE, os.getpid(), None, 4242)
    master = _master(_survivors=[actor])
    master.settings.job_id = "0123456789ab"
    master._processes = {id(actor): (actor, process)}
    forgotten: list = []

    async def exits(actors, known=None):
        assert known[id(actor)] == process

    monkeypatch.setattr(job_master, "kill_and_wait", exits)
    monkeypatch.setattr(job_master, "forget_processes", lambda job, ps: forgotten.extend(ps))
    assert asyncio.run(master._survivors_gone()) is True
    assert forgotten == [process]


@pytest.mark.parametrize("state_name", ["PENDING_CREATION", "DEAD"])
def test_a_process_given_to_an_actor_not_yet_created_is_waited_for(no_ray, monkeypatch, state_name):
    """Ray sets an actor's pid once a worker is given to it, its start time only once it
    is created. Schedule: the job master dies while a subtask's worker unpickles its
    arguments; the table lists it DEAD (or still PENDING_CREATION) with that pid and no
    start time. Before: an entry without a start time was skipped, its process taken as
    exited while it ran."""
    from ray._private import state

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        entry = {
            "Name": "rayflow:j1:v1:s0:g0-0",
            "State": state_name,
            "Pid": sleeper.pid,
            "Address": {"NodeID": HERE},
            "StartTime": 0,
            "EndTime": int(time.time() * 1000) if state_name == "DEAD" else 0,
            "Timestamp": int(time.time() * 1000),
        }
        monkeypatch.setattr(state, "actors", lambda: {"a": entry})
        monkeypatch.setattr(actor_exit, "_client_mode", lambda: False)
        assert actor_exit.wait_named_exited("rayflow:j1:", 0.3) is False
    finally:
        sleeper.kill()
        sleeper.wait()
    assert actor_exit.wait_named_exited("rayflow:j1:", 0.3) is True


def test_a_listed_pid_without_a_start_is_bounded_by_the_read(no_ray, monkeypatch):
    """An entry Ray left not dead with a pid and no start time (a GCS restarted with its
    state kept does not finish such entries): a process that started with that pid after
    the table was read is another, not the actor's. Before: any process with the pid
    held the name for as long as it lived."""
    from ray._private import state

    entry = {
        "Name": "rayflow:j1:v1:s0:g0-0",
        "State": "PENDING_CREATION",
        "Pid": 0,
        "Address": {"NodeID": HERE},
        "StartTime": 0,
    }
    monkeypatch.setattr(state, "actors", lambda: {"a": entry})
    later = subprocess.Popen(["sleep", "30"])
    try:
        entry["Pid"] = later.pid
        (process,) = actor_exit.processes_named("rayflow:j1:", placed=True)
        assert process.started_by is not None
        assert process.started_by <= time.time() + actor_exit.STARTED_SLACK_S + 1
    finally:
        later.kill()
        later.wait()


def test_the_job_master_and_subtasks_are_never_restarted_by_ray():
    """A Ray-restarted actor keeps its first start time in Ray's table, so its new
    process would look like another process with the same pid: the look for a gone run's
    processes relies on them never being restarted."""
    from rayflow.runtime.job_master import RemoteJobMaster
    from rayflow.runtime.subtask_actor import RemoteSubtaskActor

    for actor in (RemoteJobMaster, RemoteSubtaskActor):
        assert actor._default_options["max_restarts"] == 0
        assert actor._default_options["max_task_retries"] == 0


def test_a_driver_that_joined_its_node_asks_the_node_about_processes_there(no_ray, monkeypatch):
    """Schedule: a driver in a container of its own beside the raylet's (same network, so
    the same node; its own PID namespace) looks for a gone run's processes on its node.
    Its /proc has no such pids: before, it took those processes for exited and started
    the next run beside them. Now a task on the node looks (here: they still run)."""
    node = "ab" * 28  # this process's node
    context = SimpleNamespace(get_node_id=lambda: node)
    monkeypatch.setattr(actor_exit.ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(actor_exit, "_sees_worker_pids", lambda: False)
    asked: list[tuple[str, list]] = []

    class _Still:
        def __await__(self):
            yield from asyncio.sleep(0).__await__()
            return False

    def options(scheduling_strategy):
        def remote(pids, left):
            asked.append((scheduling_strategy.node_id, list(pids)))
            return _Still()

        return SimpleNamespace(remote=remote)

    monkeypatch.setattr(actor_exit, "_gone_there", SimpleNamespace(options=options))
    gone = (2**22 + 12345, None, None, None)  # no such pid in this process's /proc
    deadline = time.monotonic() + 1.0
    assert asyncio.run(actor_exit._exited(node, [gone], deadline)) is False
    assert asked == [(node, [gone])]


def test_a_process_that_is_neither_a_worker_nor_started_a_raylet_asks_the_node():
    code = (
        "from rayflow.runtime import actor_exit\n"
        "assert actor_exit._sees_worker_pids() is False\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def _probe_answering_after(monkeypatch, delay_s: float, answer: bool) -> list:
    asked: list = []

    class _Later:
        def __await__(self):
            yield from asyncio.sleep(delay_s).__await__()
            return answer

    def options(scheduling_strategy):
        def remote(pids, left):
            asked.append(list(pids))
            return _Later()

        return SimpleNamespace(remote=remote)

    monkeypatch.setattr(actor_exit, "_gone_there", SimpleNamespace(options=options))
    monkeypatch.setattr(actor_exit.ray, "cancel", lambda ref, force=False: None)
    return asked


def test_a_probe_slow_to_start_gets_its_start_allowance(no_ray, monkeypatch):
    """Review schedule: the task that looks at processes on their node needs a worker,
    and that worker takes seconds to start (the job's runtime environment is built, the
    node is loaded). Before: the look waited its own time and 5 s more, then took the
    processes for still running and refused the next run. Now the wait gives the task
    ``start_s`` to start, and the callers pass it down."""
    node = "cd" * 28  # another node
    asked = _probe_answering_after(monkeypatch, 0.5, True)
    gone = ActorProcess(node, 2**22 + 12345)
    assert actor_exit.wait_exited([gone], 0.05, start_s=2.0) is True
    assert actor_exit.wait_exited([gone], 0.05, start_s=0.1) is False
    assert len(asked) == 2
    monkeypatch.setattr(actor_exit, "_client_mode", lambda: False)
    monkeypatch.setattr(actor_exit, "processes_named", lambda prefix, placed=False: [gone])
    assert actor_exit.wait_named_exited("rayflow:j:", 0.05, task_start_s=2.0) is True


def test_a_driver_that_joined_its_node_looks_there_itself_when_its_records_say_it_can(
    no_ray, monkeypatch
):
    """Review schedule: the usual deployment, a driver that joined a node started with
    ``ray start`` (same PID namespace as the node's workers). The records of the actors
    there name this process's PID namespace: it looks in its own /proc, with no task
    that could be slow to start; the entries of Ray's table there with them."""
    monkeypatch.setattr(actor_exit, "_sees_worker_pids", lambda: False)
    monkeypatch.setattr(
        actor_exit, "_gone_there", SimpleNamespace(options=lambda **kw: pytest.fail("asked"))
    )
    recorded = (2**22 + 12345, None, 4242, actor_exit._PID_NS)
    listed = (2**22 + 12346, time.time(), None, None)  # from Ray's table: no namespace
    deadline = time.monotonic() + 1.0
    assert asyncio.run(actor_exit._exited(HERE, [recorded, listed], deadline)) is True


def test_a_pid_of_another_pid_namespace_counts_as_running_here(no_ray, monkeypatch):
    """Review schedule: a subtask runs in a PID namespace of its own (a runtime
    environment whose worker command starts one). Its pid names another process, or
    none, in the job master's /proc. Before: the job master took it for exited once
    killed and deployed the next attempt beside it. Now such a pid cannot be looked at
    from here: it counts as running, and the kill says so."""
    other = (actor_exit._PID_NS or 0) + 1
    assert actor_exit._running(2**22 + 12345, None, None, other) is True
    assert actor_exit._sees([(2**22 + 12345, None, None, other)]) is False
    monkeypatch.setattr(actor_exit, "KILL_TIMEOUT_S", 0.3)
    _probe_answering_after(monkeypatch, 0.0, False)  # the node's look cannot tell either
    node = "ab" * 28  # this process's node
    context = SimpleNamespace(get_node_id=lambda: node)
    monkeypatch.setattr(actor_exit.ray, "get_runtime_context", lambda: context)
    actor = _Dead()
    elsewhere = ActorProcess(node, 2**22 + 12345, None, 4242, other)
    with pytest.raises(ActorsStillAlive):
        asyncio.run(kill_and_wait([actor], known={id(actor): elsewhere}))


def test_this_process_says_its_pid_namespace(no_ray, monkeypatch):
    monkeypatch.setattr(actor_exit, "_this", None)
    found = os.stat("/proc/self/ns/pid")
    assert actor_exit.this_process().pid_ns == (found.st_dev << 32) | found.st_ino


def test_a_proc_of_another_pid_namespace_is_not_read(monkeypatch):
    """Review schedule: a node runs in a PID namespace of its own under the /proc of
    another (``unshare --pid`` without a /proc of its own): there /proc/<pid> is another
    process, or none, and a live actor was taken for exited. Such a /proc is not read:
    the kernel is asked by pid (``kill(pid, 0)``), in this process's own namespace."""
    assert actor_exit._proc_is_ours()
    monkeypatch.setattr(actor_exit.os, "readlink", lambda path: "1")
    assert not actor_exit._proc_is_ours()


def _hidden_from_proc(monkeypatch, pid: int, kernel: BaseException | None) -> None:
    """``/proc/<pid>`` hidden from this process (``hidepid``), the kernel answering
    ``kill(pid, 0)`` with ``kernel`` (None: the signal could be sent)."""
    import builtins

    hidden = f"/proc/{pid}/"
    real_open, real_listdir = builtins.open, os.listdir

    def open_(path, *args, **kwargs):
        if str(path).startswith(hidden):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    def listdir(path):
        if str(path).startswith(hidden):
            raise FileNotFoundError(path)
        return real_listdir(path)

    def kill(target, signal):
        assert target == pid and signal == 0
        if kernel is not None:
            raise kernel

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(actor_exit.os, "listdir", listdir)
    monkeypatch.setattr(actor_exit.os, "kill", kill)


@pytest.mark.parametrize("kernel", [PermissionError(), None])
def test_a_process_proc_hides_is_not_taken_for_exited(monkeypatch, kernel):
    """Review schedule: /proc mounted with ``hidepid`` on a node shared by two users; the
    raylet's user runs the actors, another user's driver looks for a gone run's
    processes. /proc has no entry for them, while the kernel says they run. Before: taken
    for exited, and the next run started beside them."""
    ticks = actor_exit._start_ticks(os.getpid())
    pid = os.getpid()
    _hidden_from_proc(monkeypatch, pid, kernel)
    monkeypatch.setattr(actor_exit, "_sees_worker_pids", lambda: False)  # another user
    assert actor_exit._running(pid, None, ticks, actor_exit._PID_NS) is True
    assert actor_exit._running(pid, time.time() + 1, None, None) is True
    assert actor_exit._running(pid) is True


def test_a_process_gone_for_the_kernel_too_is_exited(monkeypatch):
    pid = 2**22 + 12345
    _hidden_from_proc(monkeypatch, pid, ProcessLookupError())
    assert actor_exit._running(pid, None, 4242, actor_exit._PID_NS) is False
    assert actor_exit._running(pid, time.time(), None, None) is False


def test_a_proc_of_a_parent_pid_namespace_is_not_ours_when_the_pids_match(monkeypatch):
    """Review schedule: a process in a PID namespace of its own under its parent
    namespace's /proc, whose pid happens to be the same number in both: /proc/self reads
    as its pid, yet /proc numbers the parent's processes. Its status names its pid in
    each namespace from /proc's own down to its own: two here."""
    import builtins
    import io

    real_open = builtins.open
    pid = os.getpid()

    def open_(path, *args, **kwargs):
        if path == "/proc/self/status":
            return io.StringIO(f"Name:\tpython\nNSpid:\t{pid}\t{pid}\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    assert not actor_exit._proc_is_ours()


def test_a_pid_used_again_by_another_users_process_is_not_an_actor_to_a_worker(monkeypatch):
    """Review schedule: /proc mounted with ``hidepid``; an actor exited and its pid went
    to a long-lived process of another user. To a worker (the job master, the task that
    looks on a node), which runs as the actors' user, "not permitted" says the pid is
    not an actor's any more. Before: counted as running for as long as that process
    lived, keeping the job name locked."""
    pid = 2**22 + 12345
    _hidden_from_proc(monkeypatch, pid, PermissionError())
    monkeypatch.setattr(actor_exit, "_sees_worker_pids", lambda: True)
    assert actor_exit._running(pid, None, 4242, actor_exit._PID_NS) is False
    assert actor_exit._running(pid, time.time(), None, None) is False
