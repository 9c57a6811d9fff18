"""What one run of a job is deployed with: ``JobSettings``, handed from the driver to
every job master of the run (a job master that takes over gets the same settings, with
the supervisor's state it continues from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayflow.checkpoint.metadata import CheckpointMetadata
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.config import (
    CheckpointConfig,
    DataTransport,
    RestartStrategy,
    default_restart_strategy,
)
from rayflow.runtime.channels import DEFAULT_BUFFER_TIMEOUT_MS
from rayflow.runtime.hooks import RuntimeHooks
from rayflow.runtime.latency import DEFAULT_LATENCY_TRACKING_INTERVAL_MS
from rayflow.runtime.placement import PlacementConfig
from rayflow.runtime.supervisor import RestartSupervisor, SupervisorState

__all__ = ["JobSettings"]


@dataclass
class JobSettings:
    job_name: str
    job_id: str = ""
    run_id: str = ""
    channel_capacity: int = 8
    send_window: int = 8
    #: sources send a latency marker this often (0: never)
    latency_tracking_interval_ms: int = DEFAULT_LATENCY_TRACKING_INTERVAL_MS
    #: output buffering: how long written data may wait in an output channel (0: sent at
    #: once), and the bytes at which a channel sends what it holds (None: sized by its
    #: channel's bytes, ``channels.buffer_bytes_for``)
    buffer_timeout_ms: int = DEFAULT_BUFFER_TIMEOUT_MS
    buffer_bytes: int | None = None
    #: how subtasks send channel messages to each other
    data_transport: DataTransport = DataTransport.SOCKET
    #: per-record operators do not copy what they emit (``ExecutionConfig``)
    object_reuse: bool = False
    #: per channel, the most bytes of batches buffered at the receiver / in flight (None:
    #: sized by each subtask's count of channels, ``channels.channel_bytes_for``)
    channel_bytes: int | None = None
    #: buffer debloating's target (ms): the time in which a subtask drains its in-flight
    #: input; None when debloating is off
    debloat_target_ms: int | None = None
    subtask_options: dict[str, Any] = field(default_factory=dict)
    #: the job's placement group: strategy and how long to wait for its bundles
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    restart_strategy: RestartStrategy | None = None
    hooks: RuntimeHooks | None = None
    #: the point this run started from (``restore_from``), never replaced
    initial_restore: CheckpointMetadata | None = None
    #: ids of this run's checkpoints start here (above every id of earlier runs)
    first_checkpoint_id: int = 1
    #: the supervisor's state a (new) job master starts from
    supervisor: SupervisorState | None = None
    #: a job master taking over a cancel: it only cleans up (commits what completed
    #: checkpoints hold, aborts every other transaction)
    cancel_requested: bool = False
    #: the job's failure classifier (``rayflow.recoverability``), None: the default rules
    failure_classifier: Any = None

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint_config.is_checkpointing_enabled()

    def storage(self) -> CheckpointStorage:
        c = self.checkpoint_config
        return CheckpointStorage(
            c.checkpoint_storage, self.job_name, c.storage_options, run_id=self.run_id or None
        )

    def new_supervisor(self) -> RestartSupervisor:
        strategy = self.restart_strategy or default_restart_strategy(self.checkpointing)
        return RestartSupervisor.new(self.run_id, strategy)
