"""kill_and_wait (rayflow/runtime/actor_exit.py) on a real local Ray: once it returns, no
thread of a killed actor writes anything, though Ray answers RayActorError a few
milliseconds before the actor's process has exited."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import ray

from rayflow.runtime.actor_exit import kill_and_wait

TRIES = 6


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class _Writing:
    """Writes the time to a file every half millisecond from a thread of its own, as a
    commit thread of an ended attempt would write to the outside world. Answers calls
    while its main work runs (as a subtask actor's control calls are)."""

    def __init__(self, path: str) -> None:
        def tick() -> None:
            with open(path, "w") as out:
                while True:
                    out.write(f"{time.time()}\n")
                    out.flush()
                    time.sleep(0.0005)

        threading.Thread(target=tick, daemon=True).start()

    def ready(self) -> bool:
        return True

    def whereabouts(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def spin(self, seconds: float) -> int:
        """Holds the main thread (and mostly the GIL) busy."""
        end, count = time.time() + seconds, 0
        while time.time() < end:
            count += 1
        return count


def _last_write(path: str) -> float:
    with open(path) as written:
        return float(written.read().split()[-1])


def test_no_thread_of_a_killed_actor_writes_after_kill_and_wait_returns(tmp_path):
    late = []
    for i in range(TRIES):
        path = str(tmp_path / f"ticks-{i}")
        actor = _Writing.remote(path)
        ray.get(actor.ready.remote())
        if i % 2:
            actor.spin.remote(5.0)  # a busy actor is killed too
        time.sleep(0.2)
        asyncio.run(kill_and_wait([actor], timeout_s=30))
        returned = time.time()
        time.sleep(0.1)  # a write after the return would be in the file by now
        last = _last_write(path)
        if last > returned:
            late.append(round(last - returned, 4))
    assert late == [], f"killed actors wrote {late} s after kill_and_wait returned"


def test_processes_of_named_actors_come_from_rays_table_also_once_they_are_dead():
    """What a new job master waits for when the old one was lost: the processes of every
    actor named after the job, dead ones included (their owner died with them)."""
    import uuid

    from rayflow.runtime.actor_exit import processes_named, wait_exited

    prefix = f"rayflow:{uuid.uuid4().hex[:12]}:"
    actor = _Writing.options(name=prefix + "v0:s0:0").remote(os.devnull)
    node, pid = ray.get(actor.whereabouts.remote())
    found = processes_named(prefix)
    assert [(p.node_id, p.pid) for p in found] == [(node, pid)]
    ray.kill(actor, no_restart=True)
    assert wait_exited(processes_named(prefix), 30)
    assert [p.pid for p in processes_named(prefix)] == [pid]  # dead, still listed


def test_a_job_records_where_its_actors_run_and_forgets_it_once_they_exited():
    """Every actor of a job (its job master, each subtask) records its own process under
    the job's id as it starts (for a look once nobody can ask them, whatever Ray's table
    of dead actors kept); a run whose actors were seen to exit drops the records."""
    from rayflow import NumberSequenceSource, StreamExecutionEnvironment
    from rayflow.runtime.actor_exit import processes_named
    from rayflow.runtime.job_processes import recorded_processes
    from sinks.basic import CollectSink

    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.from_source(NumberSequenceSource(0, 10**6, batch_size=10, records_per_second=2000)).map(
        lambda r: r
    ).sink_to(CollectSink())
    client = env.execute_async("records-where-actors-run")
    try:
        deadline, recorded = time.time() + 60, []
        while len(recorded) < 3 and time.time() < deadline:  # the job master, 2 subtasks
            recorded = recorded_processes(client.job_id)
            time.sleep(0.1)
        listed = {p.pid for p in processes_named(f"rayflow:{client.job_id}:")}
        assert len(listed) >= 3 and listed <= {p.pid for p in recorded}, (listed, recorded)
        node = ray.get_runtime_context().get_node_id()
        assert all(p.node_id == node and p.start_ticks for p in recorded), recorded
    finally:
        client.cancel(60)
    assert recorded_processes(client.job_id) == []
