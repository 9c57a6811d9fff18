"""Killing subtask actors and knowing they are gone: :func:`kill_and_wait`.

Ray answers calls to a killed actor with ``RayActorError`` as soon as its control plane
marks the actor dead, which is before the actor's process has exited: a thread of it can
still run (and write to the outside world) for milliseconds after, longer on a loaded
machine. So an actor counts as gone only once its process is seen to have exited: on this
node by its pid, on another node by a task pinned to that node (a node that is gone took
the process with it). Each actor is asked where it runs (node and pid) right before it is
killed; one that cannot say (dead already, or no such method) is taken as gone once Ray
says so, as before.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

__all__ = ["ActorsStillAlive", "ActorProcess", "UNREACHABLE_IS_GONE_S", "kill_and_wait"]

#: A killed actor that cannot be reached for this long counts as gone (its node is lost
#: and not yet declared dead; Ray offers no surer proof across a partition).
UNREACHABLE_IS_GONE_S = 10.0
#: How long an actor may take to say where it runs before it is killed.
_WHEREABOUTS_TIMEOUT_S = 1.0
#: How often the exit of a process on this node is looked for.
_POLL_S = 0.005


class ActorsStillAlive(RuntimeError):
    """Killed actors did not die in time: the next attempt must not start beside them."""


@dataclass(frozen=True)
class ActorProcess:
    """Where an actor runs: its node and its process there."""

    node_id: str
    pid: int


async def _process_of(actor: Any) -> ActorProcess | None:
    try:
        node_id, pid = await asyncio.wait_for(
            actor.whereabouts.remote(), timeout=_WHEREABOUTS_TIMEOUT_S
        )
    except BaseException:  # noqa: BLE001 - dead, hung, or not a subtask actor: unknown
        return None
    return ActorProcess(str(node_id), int(pid))


def _running(pid: int) -> bool:
    """Whether any thread of process ``pid`` of this node still runs. (A killed process's
    main thread can show as exited while its other threads still run.)"""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state not in ("Z", "X"):
            return True
    return False


async def _gone_here(pid: int, deadline: float) -> bool:
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


@ray.remote(num_cpus=0, max_retries=0)
def _gone_there(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


async def _exited(process: ActorProcess, deadline: float) -> bool:
    if process.node_id == ray.get_runtime_context().get_node_id():
        return await _gone_here(process.pid, deadline)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    left = max(0.0, deadline - time.monotonic())
    pinned = NodeAffinitySchedulingStrategy(process.node_id, soft=False)
    try:
        return await asyncio.wait_for(
            _gone_there.options(scheduling_strategy=pinned).remote(process.pid, left),
            timeout=left + 5.0,
        )
    except asyncio.TimeoutError:
        return False
    except Exception:  # noqa: BLE001 - nothing runs there any more: the node is gone
        return True


async def _dead(actor: Any, deadline: float) -> bool:
    unreachable_since: float | None = None
    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(actor.ready.remote(), timeout=1.0)
            unreachable_since = None
        except ActorUnavailableError:
            # Unreachable: maybe alive behind a network fault, maybe on a node that is
            # gone and not yet declared dead. Killed, and unreachable for a while: gone.
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since >= UNREACHABLE_IS_GONE_S:
                return True
        except RayActorError:
            return True
        except Exception:  # noqa: BLE001 - still going away
            pass
        await asyncio.sleep(0.05)
    return False


async def kill_and_wait(actors: Any, timeout_s: float = 30.0) -> None:
    """Kill actors and return once each is dead and its process has exited: after this
    no thread of theirs writes anything. Raises :class:`ActorsStillAlive` when one still
    answers, or its process still runs, after ``timeout_s``."""
    actors = list(actors)
    if not actors:
        return
    processes = await asyncio.gather(*map(_process_of, actors))
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    deadline = time.monotonic() + timeout_s

    async def gone(actor: Any, process: ActorProcess | None) -> bool:
        if not await _dead(actor, deadline):
            return False
        return process is None or await _exited(process, deadline)

    answers = await asyncio.gather(*map(gone, actors, processes))
    alive = sum(1 for ok in answers if not ok)
    if alive:
        raise ActorsStillAlive(
            f"{alive} killed subtask actor(s) still answer or their process still runs"
        )
