"""Delivery guarantees: what a sink promises the outside world, what a job promises end
to end once checkpointing is taken into account, and how a job settles which guarantee
each of its sinks gives (:func:`resolve_guarantee`, a result kept in the job graph).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DeliveryGuarantee",
    "CheckpointingFacts",
    "GuaranteeResolution",
    "UnsupportedGuaranteeError",
    "end_to_end",
    "resolve_guarantee",
    "strongest",
]


class UnsupportedGuaranteeError(ValueError):
    """A sink was asked for a delivery guarantee it, or the job, cannot give."""


class DeliveryGuarantee(enum.Enum):
    """What a sink promises about the records it makes visible.

    NONE: fire and forget; after a failure records may be lost (at-most-once).
    AT_LEAST_ONCE: nothing is lost; replay after a failure may write some twice.
    EXACTLY_ONCE: every record becomes visible once (two-phase commit).
    """

    NONE = "none"
    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def describe(self) -> str:
        return _WORDS[self]


_RANK = {
    DeliveryGuarantee.NONE: 0,
    DeliveryGuarantee.AT_LEAST_ONCE: 1,
    DeliveryGuarantee.EXACTLY_ONCE: 2,
}

_WORDS = {
    DeliveryGuarantee.NONE: "at-most-once (records may be lost after a failure)",
    DeliveryGuarantee.AT_LEAST_ONCE: "at-least-once (nothing lost; replay may duplicate)",
    DeliveryGuarantee.EXACTLY_ONCE: "exactly-once effect (two-phase commit)",
}


def strongest(guarantees: Iterable[DeliveryGuarantee]) -> DeliveryGuarantee:
    """The strongest of ``guarantees`` (NONE when there is none)."""
    return max(guarantees, key=lambda g: g.rank, default=DeliveryGuarantee.NONE)


@dataclass(frozen=True)
class CheckpointingFacts:
    """What a job's checkpointing gives, as far as its sinks' guarantees depend on it.

    ``mode`` and ``alignment`` are the values of ``CheckpointingMode`` and
    ``CheckpointAlignment``; ``longest_transaction_s`` is how long a transaction may stay
    open (checkpoint interval + timeout), None without checkpoints.
    """

    enabled: bool
    mode: str | None = None
    alignment: str = "aligned"
    longest_transaction_s: float | None = None

    @property
    def best(self) -> DeliveryGuarantee:
        """The strongest delivery guarantee this checkpointing can back."""
        if not self.enabled:
            return DeliveryGuarantee.NONE
        if self.mode == "exactly-once":
            return DeliveryGuarantee.EXACTLY_ONCE
        return DeliveryGuarantee.AT_LEAST_ONCE


@dataclass(frozen=True)
class GuaranteeResolution:
    """Which guarantee one sink gives in one job, and what the job promises through it.

    Built when the job graph is built and kept there (``OperatorSpec.guarantee``); the
    sink object itself is never changed. ``requested`` is None when the sink was left
    open (then ``delivery_guarantee`` is the strongest the sink and the checkpointing
    both give).
    """

    sink_name: str
    sink_type: str
    requested: DeliveryGuarantee | None
    delivery_guarantee: DeliveryGuarantee
    end_to_end: str

    @property
    def negotiated(self) -> bool:
        return self.requested is None


def end_to_end(
    sink_guarantee: DeliveryGuarantee,
    checkpointing: bool,
    mode: str | None,
    alignment: str = "aligned",
) -> str:
    """What a job promises, in words, for one sink: never more than holds."""
    if (
        sink_guarantee is DeliveryGuarantee.EXACTLY_ONCE
        and checkpointing
        and (mode == "exactly-once")
    ):
        how = {
            "unaligned": "unaligned checkpoints: in-flight data saved as channel state",
            "aligned with timeout": "checkpoints aligned, unaligned after the alignment timeout",
        }.get(alignment, "aligned checkpoints")
        return f"exactly-once effect: exactly-once state ({how}) + two-phase commit"
    if sink_guarantee is DeliveryGuarantee.AT_LEAST_ONCE and checkpointing:
        return "at-least-once: replay from the last checkpoint may write records again"
    if sink_guarantee is DeliveryGuarantee.EXACTLY_ONCE and checkpointing:
        return "at-least-once: checkpoints do not align barriers, so state may count twice"
    if not checkpointing:
        return "at-most-once: no checkpoint to replay from; records may be lost after a failure"
    return "at-most-once: the sink takes no part in checkpoints; records may be lost"


def resolve_guarantee(
    sink_name: str,
    sink_type: str,
    supported: frozenset[DeliveryGuarantee],
    requested: DeliveryGuarantee | None,
    checkpointing: CheckpointingFacts,
    max_transaction_lifetime_s: float | None = None,
) -> DeliveryGuarantee:
    """The guarantee a sink gives in a job, by the one rule every sink follows:

    * left open (``requested`` None), it is the strongest guarantee the sink supports
      that the job's checkpointing can back: EXACTLY_ONCE with exactly-once
      checkpointing, AT_LEAST_ONCE with at-least-once checkpointing, NONE without;
    * asked for, it is exactly that, or :class:`UnsupportedGuaranteeError` naming the
      sink when the sink or the checkpointing cannot give it (never a silent downgrade);
    * EXACTLY_ONCE also needs every transaction to fit in the target's transaction
      lifetime (checkpoint interval + timeout <= ``max_transaction_lifetime_s``).
    """
    label = f"sink {sink_name!r} ({sink_type})"
    if requested is None:
        given = strongest(g for g in supported if g.rank <= checkpointing.best.rank)
    else:
        if requested not in supported:
            raise UnsupportedGuaranteeError(unsupported_message(label, requested, supported))
        given = requested
    if given is not DeliveryGuarantee.NONE and not checkpointing.enabled:
        raise UnsupportedGuaranteeError(
            f"{label} asks for {given.name} but checkpointing is off: without "
            "checkpoints nothing can be replayed after a failure. Call "
            "env.enable_checkpointing(interval_ms), or ask the sink for "
            "DeliveryGuarantee.NONE."
        )
    if given is DeliveryGuarantee.EXACTLY_ONCE and checkpointing.mode != "exactly-once":
        raise UnsupportedGuaranteeError(
            f"{label} asks for EXACTLY_ONCE but the checkpointing mode is AT_LEAST_ONCE: "
            "unaligned barriers may count records twice in state. "
            "Use CheckpointingMode.EXACTLY_ONCE or ask the sink for AT_LEAST_ONCE."
        )
    lifetime = max_transaction_lifetime_s
    longest = checkpointing.longest_transaction_s
    if (
        given is DeliveryGuarantee.EXACTLY_ONCE
        and lifetime is not None
        and longest is not None
        and longest > lifetime
    ):
        raise UnsupportedGuaranteeError(
            f"{label}: a transaction may stay open {longest:g} s (checkpoint "
            f"interval + timeout) but the target drops transactions after "
            f"{lifetime:g} s; shorten the interval or timeout"
        )
    return given


def unsupported_message(
    label: str, asked: DeliveryGuarantee, supported: Iterable[DeliveryGuarantee]
) -> str:
    supported = list(supported)
    best = strongest(supported)
    return (
        f"{label} cannot give {asked.name} delivery: it supports "
        f"{', '.join(sorted(g.name for g in supported))}. Ask for {best.name} or use a sink "
        "that commits through transactions (EXACTLY_ONCE needs two-phase commit)."
    )
