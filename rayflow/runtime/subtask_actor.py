"""The Ray actor of a subtask: the calls other actors make, and nothing else.

Every call is handed to the actor's :class:`~rayflow.runtime.subtask.Subtask`, a plain
object that owns the mailbox loop, the operators and the channels. The actor class is
kept to its remote surface on purpose: when a job master creates its first subtask,
Ray exports the actor class (pickling it and disassembling every method it holds, its
own and those Ray adds around each), and a subtask's process loads it back before its
first call. With the whole subtask as the actor class that was some hundred methods,
about 0.15 s of every job start; here it is the dozen calls below, while ``Subtask``
travels by reference (each worker imports it).

Control calls (checkpoint triggers, notifications, metrics, quiesce, redeploy, the
cancel's clean-up) run in their own concurrency group, so a busy mailbox never delays
them; ``Subtask`` hops them over to the mailbox's event loop where they touch its state.
"""

from __future__ import annotations

from typing import Any

import ray

from rayflow.recoverability import classify
from rayflow.runtime.actor_exit import ActorProcess, this_process
from rayflow.runtime.data_plane import DataAddress, DataServer
from rayflow.runtime.events import CheckpointBarrier
from rayflow.runtime.job_processes import record_this_process
from rayflow.runtime.output import OutputAck, OutputChunk
from rayflow.runtime.subtask import CONTROL_GROUP, Subtask, SubtaskDeployment

__all__ = ["RemoteSubtaskActor", "SubtaskActor"]


class SubtaskActor:
    """The remote surface of one subtask (see the module's docstring); each method
    hands the call to the :class:`Subtask` it holds. Never restarted by Ray, its calls
    never retried: a failed subtask fails its attempt, and the job master deploys the
    next one."""

    def __init__(self, deployment: SubtaskDeployment) -> None:
        # before anything of it can write: whoever looks for the job's processes once
        # nobody can ask (a next run of its name) finds this one
        record_this_process()
        self._subtask = Subtask(deployment)
        # The input channels' connections (rayflow.runtime.data_plane); served from the
        # mailbox's loop once a sender asks where to connect.
        self._data = DataServer(
            self._push,
            self._attempt,
            senders=self._senders,
            classify=self._classify,
            receiver=self._whoami,
        )

    def _push(self, channel: int, seq: int, attempt: int, message: Any) -> Any:
        return self._subtask.push(channel, seq, attempt, message)

    def _attempt(self) -> int:
        return self._subtask.attempt

    def _senders(self) -> int:
        return self._subtask.d.num_input_channels

    def _classify(self, exc: BaseException) -> str | None:
        return classify(exc, self._subtask.d.failure_classifier)

    def _whoami(self) -> tuple[str, int, int]:
        subtask = self._subtask
        return subtask.name, subtask.index, subtask.parallelism

    def __repr__(self) -> str:
        # Ray names the actor by this in the log lines it forwards to the driver
        subtask = getattr(self, "_subtask", None)
        return repr(subtask) if subtask is not None else "subtask (not started)"

    # --- data and the run ---------------------------------------------------------------

    async def push(self, channel: int, seq: int, attempt: int, message: Any) -> int | None:
        """Data from upstream; returns the channel's credit with buffer debloating."""
        return await self._subtask.push(channel, seq, attempt, message)

    async def data_address(self, attempt: int) -> DataAddress:
        """Where a sender of ``attempt`` connects to push data (on the mailbox's loop)."""
        self._subtask.asked_to_connect(attempt)
        return await self._data.address(attempt)

    async def run(self) -> dict[str, Any]:
        """The mailbox loop of the deployed attempt, to its end."""
        return await self._subtask.run()

    async def clean_up(self, attempt: int, latest_completed: int | None) -> bool:
        """A clean-up subtask: restore, recover, close (see ``Subtask.clean_up``)."""
        return await self._subtask.clean_up(attempt, latest_completed)

    # --- control ------------------------------------------------------------------------

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def trigger_checkpoint(
        self,
        attempt: int,
        checkpoint_id: int,
        timestamp: float,
        final: bool,
        savepoint: bool = False,
    ) -> None:
        await self._subtask.trigger_checkpoint(attempt, checkpoint_id, timestamp, final, savepoint)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def announce_barrier(
        self, attempt: int, channel: int, barrier: CheckpointBarrier, position: int
    ) -> None:
        await self._subtask.announce_barrier(attempt, channel, barrier, position)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def notify_checkpoint_complete(self, attempt: int, checkpoint_id: int) -> None:
        await self._subtask.notify_checkpoint_complete(attempt, checkpoint_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def notify_checkpoint_aborted(self, attempt: int, checkpoint_id: int) -> None:
        await self._subtask.notify_checkpoint_aborted(attempt, checkpoint_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def snapshot_blob(self, attempt: int, checkpoint_id: int) -> bytes:
        """The blob of a checkpoint; the caller (the job master) owns the returned object."""
        return await self._subtask.snapshot_blob(attempt, checkpoint_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def metrics(self) -> dict[str, Any]:
        return await self._subtask.metrics()

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def ready(self) -> bool:
        return True

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def whereabouts(self) -> ActorProcess:
        """This actor's node and process (to see it has exited once killed), as it
        recorded them."""
        return this_process()

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def drain_output(self, ack: OutputAck | None = None, final: bool = False) -> OutputChunk:
        """Lines user functions printed here and not yet acknowledged, prefixed."""
        return await self._subtask.drain_output(ack, final)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def quiesce(self, attempt: int, wait_s: float = 2.0) -> bool:
        return await self._subtask.quiesce(attempt, wait_s)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def redeploy(self, deployment: SubtaskDeployment) -> bool:
        return await self._subtask.redeploy(deployment)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def close_for_cancel(self, attempt: int, latest_completed: int | None) -> bool:
        return await self._subtask.close_for_cancel(attempt, latest_completed)


#: A subtask as Ray's actor class. ``SubtaskActor`` itself stays a plain class of this module,
#: under its own name: Ray pickles it by reference (a name to import), and a process that
#: unpickles it (making a handle) never writes copies over its methods.
RemoteSubtaskActor = ray.remote(
    max_restarts=0, max_task_retries=0, concurrency_groups={CONTROL_GROUP: 64}
)(SubtaskActor)
