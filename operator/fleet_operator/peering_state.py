"""Whether this operator replica works or stands by, as kopf's peering decided: for `llmfleet_operator_active`.

Why: with peering (several replicas, `LLMFLEET_OPERATOR_PEERING`) kopf pauses every replica but the one of highest
priority, yet each keeps serving `/metrics`. A paused replica's CR gauges stop updating, so a dashboard or alert
that read them from every replica would see stale or doubled fleets. kopf has no public "paused" flag, but it logs
every change on its peering logger ("Resuming operations ..." when a replica may work, "Pausing operations ..."
or "Pausing all operators ..." when it must not), and it starts paused until peering has been evaluated. This
handler follows those lines (kopf is pinned in pyproject.toml; tests/operator/test_op_peering.py checks the
wording against the real kopf). A standalone operator never pauses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

PEERING_LOGGER = "kopf._core.engines.peering"
RESUMING = "Resuming operations"
PAUSING = ("Pausing operations", "Pausing all operators")


def active_after(message: str, active: bool) -> bool:
    """The state after one kopf peering log message (unchanged by any other message)."""
    if message.startswith(RESUMING):
        return True
    if message.startswith(PAUSING):
        return False
    return active


class PeeringState(logging.Handler):
    """Follows kopf's peering log lines; calls `on_change(active)` on each change (and once at `attach`)."""

    def __init__(self, peering: bool, on_change: Callable[[bool], None]) -> None:
        super().__init__(level=logging.INFO)
        self.active = not peering  # kopf starts paused when peering is on
        self._on_change = on_change

    def attach(self) -> PeeringState:
        logger = logging.getLogger(PEERING_LOGGER)
        if logger.getEffectiveLevel() > logging.INFO:  # the lines it follows are INFO (shown then, they are rare)
            logger.setLevel(logging.INFO)
        logger.addHandler(self)
        self._on_change(self.active)
        return self

    def detach(self) -> None:
        logging.getLogger(PEERING_LOGGER).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        now = active_after(record.getMessage(), self.active)
        if now != self.active:
            self.active = now
            self._on_change(now)
