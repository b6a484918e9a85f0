"""The live state of one gateway app: routing table, per-pod outstanding counts, keys, limits, queues, metrics.

One instance per app (created by `app.create_app`), never module-level, so several gateways can run in one
process (tests do). Discovery replaces the routing table and key store through `set_table`/`set_keys`; a new
table also resizes the LoRA adapters' shared token buckets to its `tokensPerMinute` (`RateLimiter.sync_adapters`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from gateway.admission import Admission, ZeroHold
from gateway.auth import KeyStore
from gateway.metrics import GatewayMetrics, LiveGauges
from gateway.ratelimit import RateLimiter
from gateway.routing import RoutingTable
from gateway.settings import GatewaySettings
from gateway.transport import PooledTransport, Timeouts


def make_client(settings: GatewaySettings) -> tuple[httpx.AsyncClient, PooledTransport]:
    """The one pooled upstream client of an app, and its transport (which counts its connections)."""
    t, p = settings.timeouts, settings.pool
    transport = PooledTransport(
        max_connections=p.max_connections,
        max_keepalive_connections=p.max_keepalive_connections,
        keepalive_expiry=p.keepalive_expiry,
    )
    client = httpx.AsyncClient(
        transport=transport,
        timeout=httpx.Timeout(connect=t.connect, read=t.first_byte, write=t.write, pool=t.pool),
        follow_redirects=False,
        trust_env=False,
    )
    return client, transport


@dataclass
class GatewayState:
    settings: GatewaySettings
    keys: KeyStore
    rng: random.Random
    clock: Callable[[], float] = time.monotonic
    table: RoutingTable = field(default_factory=RoutingTable)
    outstanding: dict[str, int] = field(default_factory=dict)
    limiter: RateLimiter = field(default_factory=RateLimiter)
    client: httpx.AsyncClient | None = None
    transport: PooledTransport | None = None
    ready: bool = False  # discovery has produced a first table
    admission: Admission = field(init=False)
    hold: ZeroHold = field(init=False)
    metrics: GatewayMetrics = field(init=False)
    upstream_timeouts: Timeouts = field(init=False)  # the proxy's, from `settings.timeouts`

    def __post_init__(self) -> None:
        t = self.settings.timeouts
        self.upstream_timeouts = Timeouts(connect=t.connect, read=t.first_byte, write=t.write, pool=t.pool)
        self.admission = Admission(self.settings)
        self.limiter.replicas = self.settings.limit_replicas
        self.hold = ZeroHold(self.settings)
        self.metrics = GatewayMetrics(
            LiveGauges(
                outstanding=self._outstanding_rows,
                queued_at_zero=lambda: [(*k, n) for k, n in sorted(self.hold.counts.items())],
                in_flight=lambda: self.admission.in_flight,
                admission_queued=lambda: self.admission.queued,
                asyncio_tasks=_task_count,
                upstream_connections=lambda: self.transport.connections if self.transport else 0,
                ready_backends=lambda: len(self.table.endpoints()),
            )
        )

    def set_table(self, table: RoutingTable) -> None:
        if table != self.table:
            self.table = table
            self.limiter.sync_adapters(table.adapter_limits(), self.clock())
            self.hold.table_changed()
        self.ready = True

    def set_keys(self, keys: KeyStore) -> None:
        self.keys = keys
        self.limiter.forget_except(keys.key_ids())

    def acquire_pod(self, url: str) -> None:
        self.outstanding[url] = self.outstanding.get(url, 0) + 1

    def release_pod(self, url: str) -> None:
        left = self.outstanding[url] - 1
        if left:
            self.outstanding[url] = left
        else:
            del self.outstanding[url]

    def _outstanding_rows(self) -> Iterable[tuple[str, str, str, int]]:
        known: dict[str, tuple[str, str]] = {}
        for dep in self.table.deployments.values():
            for v in dep.variants:
                for e in v.endpoints:
                    known[e.url] = (dep.name, v.name)
        for url in sorted(set(known) | set(self.outstanding)):
            dep_name, variant = known.get(url, ("", ""))
            yield url, dep_name, variant, self.outstanding.get(url, 0)


def _task_count() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # scraped outside the loop
        return 0
