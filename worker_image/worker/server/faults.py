"""Fault injection, for tests only: make a worker slow or failing on purpose so canary rollback can be tested
with real pods. Off by default; switched on by `LLMFLEET_FAULT_*` variables (see worker_image/README.md).

The RNG is seeded and owned by the injector (one per app), so a run with the same seed and the same request order
fails the same requests.
"""

from __future__ import annotations

import random

from worker.server.errors import ApiError
from worker.server.settings import FaultSettings


class FaultInjector:
    def __init__(self, settings: FaultSettings) -> None:
        self.settings = settings
        self._rng = random.Random(settings.seed)

    @property
    def ttft_delay_s(self) -> float:
        return self.settings.ttft_delay_ms / 1000.0

    @property
    def itl_delay_s(self) -> float:
        return self.settings.itl_delay_ms / 1000.0

    def maybe_fail(self) -> None:
        """Raise an injected 500 for a share `error_rate` of calls."""
        rate = self.settings.error_rate
        if rate > 0 and self._rng.random() < rate:
            raise ApiError(
                500,
                "injected fault (LLMFLEET_FAULT_ERROR_RATE): this worker is failing on purpose",
                code="injected_fault",
            )
