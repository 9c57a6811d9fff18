"""Job configuration: checkpointing (CheckpointConfig, CheckpointingMode) and
restart strategies, shaped like PyFlink's."""

from __future__ import annotations

import enum
import math
import os
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DataTransport",
    "CheckpointAlignment",
    "CheckpointingMode",
    "CheckpointConfig",
    "ExecutionConfig",
    "RestartStrategies",
    "RestartStrategy",
]


class CheckpointingMode(enum.Enum):
    """EXACTLY_ONCE aligns barriers (a channel that delivered barrier n waits for the
    others); AT_LEAST_ONCE does not block, so records after a barrier may be in the state
    of checkpoint n and be replayed after a restore."""

    EXACTLY_ONCE = "exactly-once"
    AT_LEAST_ONCE = "at-least-once"


class DataTransport(enum.Enum):
    """How subtasks send batches and events to each other
    (:meth:`~rayflow.StreamExecutionEnvironment.set_data_transport`)."""

    #: TCP connections between the subtask processes, one per sending and receiving
    #: subtask (the default): a message costs tens of microseconds
    SOCKET = "socket"
    #: one Ray actor call per message: about a millisecond or two of CPU on each side
    RAY = "ray"


class CheckpointAlignment(enum.Enum):
    """How EXACTLY_ONCE barriers meet at a subtask with several input channels.

    ALIGNED: a channel that delivered barrier n waits for the others, so a checkpoint
    under backpressure takes as long as the backlog before the barrier takes to drain.
    UNALIGNED: the barrier overtakes the queued data; the subtask snapshots at the first
    barrier and saves the overtaken data as channel state. ALIGNED_WITH_TIMEOUT:
    aligned, switching to unaligned at a subtask where the barrier is later than the
    timeout after the checkpoint started."""

    ALIGNED = "aligned"
    UNALIGNED = "unaligned"
    ALIGNED_WITH_TIMEOUT = "aligned with timeout"


def _default_storage() -> str:
    return os.path.join(tempfile.gettempdir(), "rayflow-checkpoints")


@dataclass
class CheckpointConfig:
    """How and where checkpoints are taken.

    ``checkpoint_storage`` is a local directory or any ``pyarrow.fs`` URI
    (``s3://bucket/prefix``); ``storage_options`` go to the filesystem
    (for S3: ``endpoint_override``, ``access_key``, ``secret_key``, ``region``, ``scheme``).
    Each run of a job writes under ``<storage>/<job name>/<run id>/chk-<n>/``.
    """

    interval_ms: int | None = None
    mode: CheckpointingMode = CheckpointingMode.EXACTLY_ONCE
    timeout_ms: int = 60_000
    min_pause_between_checkpoints_ms: int = 0
    max_concurrent_checkpoints: int = 1
    tolerable_failed_checkpoints: int = 0
    checkpoint_storage: str = field(default_factory=_default_storage)
    storage_options: dict[str, Any] = field(default_factory=dict)
    num_retained_checkpoints: int = 1
    #: run directories of a job kept in storage (the newest; older ones are deleted when
    #: a new run starts)
    num_retained_runs: int = 10
    unaligned_checkpoints: bool = False
    aligned_checkpoint_timeout_ms: int = 0
    #: statistics of this many recent checkpoints are kept (Flink's ``web.checkpoints.history``)
    checkpoint_history_size: int = 10

    @property
    def alignment(self) -> CheckpointAlignment:
        if not self.unaligned_checkpoints:
            return CheckpointAlignment.ALIGNED
        if self.aligned_checkpoint_timeout_ms > 0:
            return CheckpointAlignment.ALIGNED_WITH_TIMEOUT
        return CheckpointAlignment.UNALIGNED

    def is_checkpointing_enabled(self) -> bool:
        return self.interval_ms is not None

    # PyFlink-style accessors ----------------------------------------------------------

    def set_checkpoint_interval(self, interval_ms: int) -> CheckpointConfig:
        if interval_ms < 10:
            raise ValueError(f"checkpoint interval must be >= 10 ms, got {interval_ms}")
        self.interval_ms = interval_ms
        return self

    def get_checkpoint_interval(self) -> int | None:
        return self.interval_ms

    def set_checkpointing_mode(self, mode: CheckpointingMode) -> CheckpointConfig:
        self.mode = mode
        return self

    def get_checkpointing_mode(self) -> CheckpointingMode:
        return self.mode

    def set_checkpoint_timeout(self, timeout_ms: int) -> CheckpointConfig:
        if timeout_ms <= 0:
            raise ValueError(f"checkpoint timeout must be positive, got {timeout_ms}")
        self.timeout_ms = timeout_ms
        return self

    def set_min_pause_between_checkpoints(self, pause_ms: int) -> CheckpointConfig:
        if pause_ms < 0:
            raise ValueError(f"min pause must be >= 0, got {pause_ms}")
        self.min_pause_between_checkpoints_ms = pause_ms
        return self

    def set_max_concurrent_checkpoints(self, count: int) -> CheckpointConfig:
        if count != 1:
            raise ValueError(
                "max concurrent checkpoints: only 1 is supported (a checkpoint is triggered "
                "after the previous one completes or aborts)"
            )
        self.max_concurrent_checkpoints = count
        return self

    def set_tolerable_checkpoint_failure_number(self, count: int) -> CheckpointConfig:
        if count < 0:
            raise ValueError(f"tolerable checkpoint failures must be >= 0, got {count}")
        self.tolerable_failed_checkpoints = count
        return self

    def set_checkpoint_storage(self, uri: str, **storage_options: Any) -> CheckpointConfig:
        self.checkpoint_storage = uri
        self.storage_options = dict(storage_options)
        return self

    def set_checkpoint_storage_dir(self, uri: str, **storage_options: Any) -> CheckpointConfig:
        return self.set_checkpoint_storage(uri, **storage_options)

    def set_num_retained_checkpoints(self, count: int) -> CheckpointConfig:
        if count < 1:
            raise ValueError(f"retained checkpoints must be >= 1, got {count}")
        self.num_retained_checkpoints = count
        return self

    def enable_unaligned_checkpoints(self, enabled: bool = True) -> CheckpointConfig:
        """Unaligned checkpoints (EXACTLY_ONCE only): barriers overtake the data queued
        before them, which is saved as channel state, so a checkpoint under
        backpressure completes in about the time barriers take to travel instead of the
        time the backlog takes to drain. Costs: bigger checkpoints (the in-flight data),
        and a restore from one needs the same parallelism. ``enabled=False`` also clears
        the aligned checkpoint timeout."""
        self.unaligned_checkpoints = bool(enabled)
        if not enabled:
            self.aligned_checkpoint_timeout_ms = 0
        return self

    def is_unaligned_checkpoints_enabled(self) -> bool:
        return self.unaligned_checkpoints

    def set_aligned_checkpoint_timeout(self, timeout_ms: int) -> CheckpointConfig:
        """Start every checkpoint aligned and switch a subtask to unaligned when its
        barrier comes later than ``timeout_ms`` after the checkpoint started (Flink's
        ``execution.checkpointing.aligned-checkpoint-timeout``). A positive timeout
        enables unaligned checkpoints; 0 makes them unaligned from the start."""
        if timeout_ms < 0:
            raise ValueError(f"aligned checkpoint timeout must be >= 0 ms, got {timeout_ms}")
        self.aligned_checkpoint_timeout_ms = int(timeout_ms)
        if timeout_ms > 0:
            self.unaligned_checkpoints = True
        return self

    def get_aligned_checkpoint_timeout(self) -> int:
        return self.aligned_checkpoint_timeout_ms

    def set_checkpoint_history_size(self, count: int) -> CheckpointConfig:
        """How many recent checkpoints keep their statistics in ``JobResult.checkpoints``
        and ``JobClient.checkpoints()`` (default 10, Flink's ``web.checkpoints.history``).
        Counts, the latest completed and the latest failed checkpoint are kept whatever
        the size."""
        if count < 1:
            raise ValueError(f"checkpoint history size must be >= 1, got {count}")
        self.checkpoint_history_size = count
        return self

    def set_num_retained_runs(self, count: int) -> CheckpointConfig:
        """How many runs of a job keep their checkpoint directory (default 10): when a run
        starts, the oldest beyond that are deleted."""
        if count < 1:
            raise ValueError(f"retained runs must be >= 1, got {count}")
        self.num_retained_runs = count
        return self


@dataclass
class ExecutionConfig:
    """How a job's operators treat the records user functions give them
    (``env.get_config()``, as Flink's ``ExecutionConfig``).

    With object reuse off (the default) a per-record operator copies each record it
    emits, so a function may change its accumulator, the value its state holds or any
    object it emitted, and records emitted before keep their values. With it on nothing
    is copied: faster, and correct only for functions that never change an object after
    emitting it or one they were given (Flink's rule for ``enableObjectReuse``).
    """

    object_reuse: bool = False

    def enable_object_reuse(self) -> ExecutionConfig:
        self.object_reuse = True
        return self

    def disable_object_reuse(self) -> ExecutionConfig:
        self.object_reuse = False
        return self

    def is_object_reuse_enabled(self) -> bool:
        return self.object_reuse


class RestartStrategy:
    """Decides whether and after what delay a failed job restarts."""

    description = "no restart"

    def next_delay_s(self, failure_time: float) -> float | None:
        """Seconds to wait before the next attempt, or None to give up."""
        return None


class _NoRestart(RestartStrategy):
    pass


def _attempts(count: float) -> str:
    return "unlimited attempts" if math.isinf(count) else f"{count:g} attempts"


@dataclass
class _FixedDelay(RestartStrategy):
    attempts: float
    delay_s: float
    _used: int = 0

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"fixed delay ({_attempts(self.attempts)}, {self.delay_s:g} s apart)"

    def next_delay_s(self, failure_time: float) -> float | None:
        if self._used >= self.attempts:
            return None
        self._used += 1
        return self.delay_s


@dataclass
class _ExponentialDelay(RestartStrategy):
    initial_s: float
    max_s: float
    multiplier: float
    attempts: float
    reset_after_s: float
    _used: int = 0
    _current: float = 0.0
    _last_failure: float = 0.0

    @property
    def description(self) -> str:  # type: ignore[override]
        return (
            f"exponential delay ({self.initial_s:g} s x{self.multiplier:g} up to "
            f"{self.max_s:g} s, {_attempts(self.attempts)})"
        )

    def next_delay_s(self, failure_time: float) -> float | None:
        if self._last_failure and failure_time - self._last_failure > self.reset_after_s:
            self._current = 0.0
        self._last_failure = failure_time
        if self._used >= self.attempts:
            return None
        self._used += 1
        self._current = (
            self.initial_s
            if not self._current
            else min(self.max_s, self._current * self.multiplier)
        )
        return self._current


@dataclass
class _FailureRate(RestartStrategy):
    max_failures: int
    interval_s: float
    delay_s: float
    _failures: deque = field(default_factory=deque)

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"failure rate (at most {self.max_failures} in {self.interval_s:g} s)"

    def next_delay_s(self, failure_time: float) -> float | None:
        self._failures.append(failure_time)
        while self._failures and failure_time - self._failures[0] > self.interval_s:
            self._failures.popleft()
        if len(self._failures) > self.max_failures:
            return None
        return self.delay_s


class RestartStrategies:
    """Factories for restart strategies (PyFlink's names; delays in milliseconds)."""

    @staticmethod
    def no_restart() -> RestartStrategy:
        return _NoRestart()

    @staticmethod
    def fixed_delay_restart(
        restart_attempts: int, delay_between_attempts_ms: int
    ) -> RestartStrategy:
        return _FixedDelay(restart_attempts, delay_between_attempts_ms / 1000.0)

    @staticmethod
    def exponential_delay_restart(
        initial_backoff_ms: int = 1000,
        max_backoff_ms: int = 60_000,
        backoff_multiplier: float = 2.0,
        max_attempts: int | None = None,
        reset_backoff_threshold_ms: int = 3_600_000,
    ) -> RestartStrategy:
        return _ExponentialDelay(
            initial_backoff_ms / 1000.0,
            max_backoff_ms / 1000.0,
            backoff_multiplier,
            math.inf if max_attempts is None else max_attempts,
            reset_backoff_threshold_ms / 1000.0,
        )

    @staticmethod
    def failure_rate_restart(
        failure_rate: int, failure_interval_ms: int, delay_interval_ms: int
    ) -> RestartStrategy:
        return _FailureRate(failure_rate, failure_interval_ms / 1000.0, delay_interval_ms / 1000.0)


def default_restart_strategy(checkpointing: bool) -> RestartStrategy:
    """Flink's defaults: restart (practically) forever with checkpoints, never without."""
    if checkpointing:
        return _FixedDelay(math.inf, 1.0)
    return _NoRestart()
