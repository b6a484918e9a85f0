"""Priority tiers: which tier a request runs at, and whether it is admitted, queued or shed.

Pure decisions; `admission.py` is the async shell that keeps the counts and the waiting queue.

- A request runs at its API key's tier unless the `x-llmfleet-tier` header names another one. A key may lower its
  tier by header (e.g. send batch work as `batch`) but never raise it; in open mode (no keys configured) the header
  is taken as given.
- Under saturation (in-flight >= max_in_flight) tiers with `bypass_queue` are admitted at once and the others wait in
  a priority queue (highest priority first, FIFO within a priority). A tier with `shed_above_in_flight` is rejected
  at once (503) when the in-flight count reaches that threshold, so the lowest tiers go first and the highest never.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from gateway.settings import TierSettings


class TierError(Exception):
    """The requested tier is unknown (400) or above the key's tier (403)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def resolve_tier(tiers: Sequence[TierSettings], key_tier: str, header: str | None, may_raise: bool) -> TierSettings:
    """The tier a request runs at (see the module docstring)."""
    by_name = {t.name: t for t in tiers}
    own = by_name[key_tier]
    if not header:
        return own
    wanted = by_name.get(header.strip().lower())
    if wanted is None:
        raise TierError(400, f"unknown tier {header!r} in x-llmfleet-tier (known: {', '.join(by_name)})")
    if wanted.priority > own.priority and not may_raise:
        raise TierError(403, f"this API key's tier is {own.name!r}; it may not request the higher tier {wanted.name!r}")
    return wanted


class Admit(enum.Enum):
    """What to do with a request arriving at the gateway."""

    ADMIT = "admit"
    QUEUE = "queue"
    SHED = "shed"  # the tier's shed threshold is reached
    QUEUE_FULL = "queue_full"


def admission_decision(tier: TierSettings, in_flight: int, max_in_flight: int, queued: int, queue_size: int) -> Admit:
    """Admit, queue or shed one request given the gateway's current load."""
    if tier.shed_above_in_flight is not None and in_flight >= tier.shed_above_in_flight:
        return Admit.SHED
    if in_flight < max_in_flight and queued == 0:
        return Admit.ADMIT
    if tier.bypass_queue:
        return Admit.ADMIT
    if queued >= queue_size:
        return Admit.QUEUE_FULL
    return Admit.QUEUE
