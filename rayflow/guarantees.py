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
