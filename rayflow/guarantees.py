"""Delivery guarantees: what a sink promises the outside world, and what a job
promises end to end once checkpointing is taken into account.
"""

from __future__ import annotations

import enum

__all__ = ["DeliveryGuarantee"]


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
