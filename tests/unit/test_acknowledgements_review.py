"""A message taken from the input gate but not processed yet, without Ray.

Before it processes a data message it took, a subtask lets the loop run
(``_acknowledgements_out``): ``gate.taken`` already counts the message while pushes,
announcements, checkpoint triggers, buffer timeouts, the asynchronous parts of earlier
checkpoints and the callbacks of eager channels run. The in-process job
(``tests/unit/inprocess_job.py``) runs the real subtask class with pushes and
announcements delivered in random order; here those turns are widened (the loop runs
for a while there), or the attempt is stopped exactly there (its ``run()`` cancelled
with the message taken, then restored, into new or the same subtasks): the values kept
at the end must be every input value exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time

import pytest

import rayflow.runtime.subtask as subtask_module
from rayflow.config import CheckpointAlignment, CheckpointingMode
from rayflow.runtime.subtask import _Announcement
from tests.unit.inprocess_job import Config, Job, Subtask
from tests.unit.test_output_buffering_review import _config, run

#: The subtask's own turns, taken at import: each test wraps these, never another test's
#: wrapper (a test's coroutine whose ``finally`` ran late, at collection by the collector,
#: would otherwise leave its wrapper in place, and the wrappers would nest test after test).
_TURNS = subtask_module._acknowledgements_out
_NAME = "_acknowledgements_out"


def _globals_of_the_input_loop() -> list[dict]:
    """Every globals dict ``_run_inputs`` of the in-process subtask class reads the turns
    from: the module's, and those of the functions the class holds now. Ray wraps the
    methods (tracing), and where this process unpickled the class (cloudpickle pickles an
    actor class by value and, unpickling it in the process that defined it, sets the
    copies' methods on the original class) they are copies with globals of their own."""
    found = [vars(subtask_module)]
    stack, seen = [Subtask._run_inputs], set()
    while stack:
        function = stack.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        names = getattr(function, "__globals__", None)
        if names is not None and _NAME in names and not any(names is f for f in found):
            found.append(names)
        stack.extend(
            cell.cell_contents
            for cell in getattr(function, "__closure__", None) or ()
            if callable(cell.cell_contents)
        )
        if getattr(function, "__wrapped__", None) is not None:
            stack.append(function.__wrapped__)
    return found


@contextlib.contextmanager
def _turns_replaced(turns):
    """The subtasks take ``turns`` instead of their own turns while the block runs."""
    replaced = [(names, names[_NAME]) for names in _globals_of_the_input_loop()]
    for names, _ in replaced:
        names[_NAME] = turns
    try:
        yield
    finally:
        for names, before in replaced:
            if names[_NAME] is turns:  # undo only its own
                names[_NAME] = before if before is not turns else _TURNS


def _exactly_once_config(seed: int) -> Config:
    """A random configuration (``_config``), exactly once, half of them at a buffer
    timeout of 0 (eager channels) with small batches."""
    config = dataclasses.replace(_config(seed), mode=CheckpointingMode.EXACTLY_ONCE)
    if seed % 2 == 0:
        config = dataclasses.replace(config, buffer_timeout_s=0.0, batch_size=1, n=400)
    return config


async def _checkpoint(job: Job, cid: int, stuck: asyncio.Event, timeout_s: float = 20.0) -> bool:
    """Trigger ``cid`` at every source; True once every subtask acknowledged it (then
    every subtask is notified). False when declined, or when a subtask got stuck in the
    turns before processing (it cannot acknowledge then: the checkpoint stays pending)."""
    for key, sub in job.subtasks.items():
        if key[0] == 0:
            await sub.trigger_checkpoint(job.attempt, cid, time.time(), False)
    deadline = time.monotonic() + timeout_s
    while len(job.acks.get(cid, {})) < len(job.subtasks) and cid not in job.declined:
        job.check_runs()
        if stuck.is_set():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {cid}: acknowledged by {sorted(job.acks.get(cid, {}))}")
        await asyncio.sleep(0.001)
    if cid in job.declined:
        return False
    for sub in job.subtasks.values():
        await sub.notify_checkpoint_complete(job.attempt, cid)
    return True


async def _crash_with_a_message_taken(seed: int) -> tuple[Config, list[int], bool]:
    """Schedule: checkpoints complete while the job runs; then the ``at``-th data message
    any subtask takes never gets past ``_acknowledgements_out`` (the subtask is slow
    there); meanwhile a checkpoint is triggered (barriers and announcements arrive for
    the stuck subtask, the others snapshot) and the loop runs on; then the attempt
    stops (``run()`` cancelled in those turns) and is restored from the last completed
    checkpoint, into new subtasks or the same ones (redeploy)."""
    config = _exactly_once_config(seed)
    rng = random.Random(seed * 7919 + 3)
    stuck = asyncio.Event()
    calls = {"n": 0}
    at = rng.randint(1, 12)
    original = _TURNS

    async def turns() -> None:
        calls["n"] += 1
        if calls["n"] == at:
            stuck.set()
            await asyncio.get_running_loop().create_future()  # until the attempt stops
        await original()

    with _turns_replaced(turns):
        job = Job(config, seed)
        await job.deploy()
        job.start()
        cid, completed = 1, None
        for _ in range(rng.randint(0, 3)):
            if stuck.is_set():
                break
            await asyncio.sleep(rng.random() * 0.01)
            if await _checkpoint(job, cid, stuck):
                completed = cid
            cid += 1
        try:
            await asyncio.wait_for(stuck.wait(), 20)
        except asyncio.TimeoutError:
            pass
        got_stuck = stuck.is_set()
        if rng.random() < 0.7:
            await _checkpoint(job, cid, stuck)  # pending: the stuck subtask never acks
            cid += 1
        await asyncio.sleep(rng.random() * 0.01)
        reuse = rng.random() < 0.5
        await job.crash(reuse)
        await job.deploy(restore_from=completed, reuse=reuse)
        job.start()
        await job.finish(cid)
        return config, sorted(job.kept()), got_stuck


@pytest.mark.parametrize("seed", range(24))
def test_an_attempt_stopped_while_a_taken_message_waits_keeps_every_value_once(seed):
    config, kept, got_stuck = run(asyncio.wait_for(_crash_with_a_message_taken(seed), 120))
    assert got_stuck, "no subtask reached the turns before processing"
    assert kept == list(range(config.n)), (config, len(kept))


async def _widened_turns(seed: int) -> tuple[Config, list[int]]:
    """Schedule: every data message a subtask takes waits up to ``wait_s`` before it is
    processed (the loop runs meanwhile: pushes, announcements, triggers, asynchronous
    parts, credit callbacks); checkpoints are taken, the attempt stops at a random
    point (most likely in those turns) and is restored from the last completed
    checkpoint."""
    config = _exactly_once_config(seed)
    rng = random.Random(seed * 104729 + 5)
    wait_s = rng.choice([0.0002, 0.001, 0.003])
    waits = random.Random(seed)
    original = _TURNS

    async def turns() -> None:
        await asyncio.sleep(waits.random() * wait_s)
        await original()

    with _turns_replaced(turns):
        job = Job(config, seed)
        await job.deploy()
        job.start()
        cid, completed = 1, None
        for _ in range(rng.randint(1, 4)):
            await asyncio.sleep(rng.random() * 0.02)
            if job.exhausted >= {k for k in job.subtasks if k[0] == 0}:
                break
            if await job.checkpoint(cid):
                completed = cid
            cid += 1
        await asyncio.sleep(rng.random() * 0.01)
        reuse = rng.random() < 0.5
        await job.crash(reuse)
        await job.deploy(restore_from=completed, reuse=reuse)
        job.start()
        for _ in range(rng.randint(0, 2)):
            await asyncio.sleep(rng.random() * 0.01)
            if job.exhausted >= {k for k in job.subtasks if k[0] == 0}:
                break
            await job.checkpoint(cid)
            cid += 1
        await job.finish(cid)
        return config, sorted(job.kept())


@pytest.mark.parametrize("seed", range(24))
def test_long_turns_before_processing_keep_every_value_once_through_a_restore(seed):
    config, kept = run(asyncio.wait_for(_widened_turns(seed), 120))
    assert kept == list(range(config.n)), (config, len(kept))


@pytest.mark.parametrize(
    "alignment", [CheckpointAlignment.UNALIGNED, CheckpointAlignment.ALIGNED_WITH_TIMEOUT]
)
def test_an_announcement_in_the_turns_before_processing_snapshots_after_the_message(alignment):
    """Schedule: the keeping subtask takes data message ``s`` of a channel (``taken`` is
    ``s + 1``) and, in the turns before processing it, the announcement of barrier n
    arrives, with a position of at least ``s + 1`` (the sender had sent ``s`` before
    its snapshot). The snapshot must hold ``s`` in the operator state and not in the
    channel state: the checkpoint then restores to every value exactly once."""
    config = Config(
        n=300,
        sources=1,
        middles=1,
        batch_size=10,
        alignment=alignment,
        aligned_timeout_s=0.0,
        capacity=8,
        window=8,
        buffer_timeout_s=0.0,
        max_delay_s=0.0,
    )

    async def go() -> tuple[list[int], list[int]]:
        original = _TURNS
        job = Job(config, 0)
        taken_in_turns: list[int] = []
        triggered = {"done": False}

        async def turns() -> None:
            keep = job.subtasks.get((2, 0))
            if keep is not None and not triggered["done"] and keep.gate.taken[0] >= 5:
                # The keeping subtask is in its turns (its data is being processed by
                # the loop that runs this): trigger now, at the sources.
                if asyncio.current_task() is job.runs.get((2, 0)):
                    triggered["done"] = True
                    taken = keep.gate.taken[0]
                    for key, sub in job.subtasks.items():
                        if key[0] == 0:
                            await sub.trigger_checkpoint(job.attempt, 1, time.time(), False)
                    for _ in range(200):  # the barrier goes on, announced ahead of data
                        await asyncio.sleep(0)
                        if any(isinstance(c, _Announcement) for c in keep.gate._control):
                            taken_in_turns.append(taken)
                            break
            await original()

        with _turns_replaced(turns):
            await job.deploy()
            job.start()
            deadline = time.monotonic() + 20
            while 1 not in job.acks or len(job.acks[1]) < len(job.subtasks):
                job.check_runs()
                assert time.monotonic() < deadline, "checkpoint 1 never completed"
                assert 1 not in job.declined, job.declined
                await asyncio.sleep(0.001)
            for sub in job.subtasks.values():
                await sub.notify_checkpoint_complete(job.attempt, 1)
            await job.crash(reuse=True)
            await job.deploy(restore_from=1, reuse=True)
            job.start()
            await job.finish(2)
            return taken_in_turns, sorted(job.kept())

    taken_in_turns, kept = run(asyncio.wait_for(go(), 60))
    assert taken_in_turns, "no announcement reached the keeping subtask in its turns"
    assert kept == list(range(config.n)), len(kept)
