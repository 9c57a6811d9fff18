"""The threads a subtask counts (``_in_thread``), without Ray: an actor is reused for the
next attempt only once no thread of the last one runs there (``quiesce``), so the count
must fall back to 0 once they are all done, including work that never started.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from rayflow.plan.physical import VertexSpec
from rayflow.runtime.subtask import SubtaskDeployment
from rayflow.sources import NumberSequenceSource
from tests.unit.inprocess_job import Storage, Subtask


class _Master:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.acknowledge_checkpoint = self
        self.decline_checkpoint = self

    def remote(self, *args) -> None:
        self.calls.append(args)


def _subtask(storage: Storage, master: _Master):
    source = NumberSequenceSource(0, 9)
    vertex = VertexSpec(0, "src", 1, 128, source=source, source_uid="src")
    return Subtask(
        SubtaskDeployment(
            job_name="j",
            vertex=vertex,
            index=0,
            attempt=0,
            num_input_channels=0,
            outputs=[],
            storage=storage,
            master=master,
        )
    )


def test_a_blob_write_the_attempt_ended_before_a_thread_took_it_up_leaves_the_actor_reusable():
    """Schedule: every worker thread of the loop is busy (here its only one: other blob
    writes, a slow commit); the subtask's asynchronous part queues its blob write; the
    attempt ends and ``quiesce`` cancels the asynchronous part before a thread took the
    write up. The write never runs (nothing of the ended attempt is written), and no
    thread of the attempt is running: the actor is clean, and stays so (it was counted
    as running forever: every later ``quiesce`` said no and ``redeploy`` refused)."""

    async def go():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        storage, master = Storage(), _Master()
        sub = _subtask(storage, master)
        sub._loop = loop
        busy = threading.Event()
        blocker = loop.run_in_executor(None, busy.wait)
        sub._start_async_part(1, b"blob", {})
        await asyncio.sleep(0.01)  # the write waits for the busy thread
        clean = await sub.quiesce(0, wait_s=0.5)
        busy.set()
        await blocker
        await asyncio.sleep(0.05)
        return clean, sub._threads, await sub.quiesce(0, wait_s=0.2), storage.blobs, master.calls

    clean, threads, clean_after, blobs, calls = asyncio.run(go())
    out = (clean, threads, clean_after)
    assert blobs == {} and calls == [], (blobs, calls)
    assert out == (True, 0, True), f"quiesce, threads counted, quiesce again: {out}"


def test_a_thread_still_running_when_its_caller_is_cancelled_is_counted_until_it_ends():
    """The other side: a thread that runs when its coroutine is cancelled goes on (Python
    threads cannot be stopped), and the actor is not clean until it has ended."""

    async def go():
        loop = asyncio.get_running_loop()
        sub = _subtask(Storage(), _Master())
        sub._loop = loop
        release, entered = threading.Event(), threading.Event()

        def work() -> None:
            entered.set()
            release.wait()

        task = asyncio.ensure_future(sub._in_thread(work))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while_running = (sub._threads, await sub.quiesce(0, wait_s=0.1))
        release.set()
        return while_running, await sub.quiesce(0, wait_s=1.0), sub._threads

    while_running, clean_after, threads = asyncio.run(go())
    assert while_running == (1, False), while_running
    assert (clean_after, threads) == (True, 0)
