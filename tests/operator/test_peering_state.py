"""Following kopf's peering log lines: which messages flip a replica between working and standing by."""

from __future__ import annotations

import logging

import pytest
from fleet_operator.peering_state import PEERING_LOGGER, PeeringState, active_after


@pytest.mark.parametrize(
    ("message", "before", "after"),
    [
        ("Resuming operations after the pause. Conflicting operators with the same priority are gone.", False, True),
        ("Pausing operations in favour of [Peer(...)].", True, False),
        ("Pausing all operators, including self: [Peer(...)]", True, False),
        ("Possibly conflicting operators with the same priority: [...]", True, True),  # a warning, not a change
        ("Keep-alive in 'llmfleet' in 'ns' succeeded.", False, False),
    ],
)
def test_active_after(message: str, before: bool, after: bool) -> None:
    assert active_after(message, before) is after


def test_the_handler_follows_kopf_and_reports_each_change_once() -> None:
    seen: list[bool] = []
    state = PeeringState(peering=True, on_change=seen.append).attach()
    log = logging.getLogger(PEERING_LOGGER)
    try:
        assert seen == [False]  # kopf starts paused with peering
        log.info("Resuming operations after the pause.")
        log.info("Resuming operations after the pause.")
        log.info("Pausing operations in favour of %s.", ["peer"])
        assert seen == [False, True, False] and state.active is False
    finally:
        state.detach()
    log.info("Resuming operations after the pause.")
    assert seen == [False, True, False]  # detached: no longer follows


def test_a_standalone_operator_is_active() -> None:
    seen: list[bool] = []
    PeeringState(peering=False, on_change=seen.append).attach().detach()
    assert seen == [True]
