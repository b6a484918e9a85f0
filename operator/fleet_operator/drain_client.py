"""The operator's side of the worker's drain API: `POST /drain` (bearer token) and `GET /drain`, over httpx.

Why it exists: the drain state machine (`controllers.draining`) is pure and decides from `DrainProbe`s; this is
the one place that talks to workers about draining and turns what happens on the wire into those probes:

    GET /drain answered 200 with JSON        ANSWERED (draining flag, in-flight count)
    connection refused / no route            UNREACHABLE (nothing listens: the worker exited after draining)
    timeout, other status, bad JSON          FAILED (ask again on the next pass)

It never raises: a failed POST is logged and returned as text (the next probe shows whether the worker drains).
It holds the operator's drain key and derives each deployment's token from it (`controllers.drain_token`), the
same token the operator put into that deployment's pods; the key never leaves this object.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from controllers.drain_token import deployment_drain_token
from controllers.draining import address
from controllers.observed import DrainProbe, PodInfo, ProbeState

log = logging.getLogger(__name__)


class WorkerDrains:
    """Drain calls to worker pods, with one shared connection pool."""

    def __init__(
        self, timeout_s: float = 3.0, client: httpx.AsyncClient | None = None, *, key: bytes | None = None
    ) -> None:
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self._key = key

    def __repr__(self) -> str:
        return f"WorkerDrains(key={'set' if self._key else 'none'})"

    def token(self, meta: Mapping[str, Any]) -> str | None:
        """The drain token of the deployment with metadata `meta` (None without a key: no POST can succeed)."""
        return deployment_drain_token(self._key, meta)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def post(self, worker: str, token: str | None) -> str | None:
        """`POST /drain` to the worker at host:port; None when it accepted, else why not."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            response = await self._client.post(f"http://{worker}/drain", headers=headers)
        except httpx.HTTPError as error:
            return f"POST http://{worker}/drain: {type(error).__name__}: {error}"
        if response.status_code >= 300:
            return f"POST http://{worker}/drain: HTTP {response.status_code}: {response.text[:200]}"
        return None

    async def probe(self, worker: str | None) -> DrainProbe:
        """`GET /drain` of the worker at host:port (None: the pod has no IP)."""
        if worker is None:
            return DrainProbe(ProbeState.UNREACHABLE, detail="the pod has no IP")
        url = f"http://{worker}/drain"
        state, body, detail = await get_json(self._client, url)
        if state != ProbeState.ANSWERED:
            return DrainProbe(state, detail=detail)
        try:
            in_flight = int(body["inflight"])
            draining = bool(body.get("draining"))
        except (KeyError, TypeError, ValueError) as error:
            return DrainProbe(ProbeState.FAILED, detail=f"GET {url}: unexpected answer ({error})")
        return DrainProbe(ProbeState.ANSWERED, draining=draining, in_flight=max(0, in_flight))

    async def probe_all(self, pods: Iterable[PodInfo], port: int) -> Mapping[str, DrainProbe]:
        """Probes of the pods marked draining (and not already being deleted), by pod name."""
        marked = [p for p in pods if p.draining and not p.deleting]
        probes = await asyncio.gather(*(self.probe(address(p, port)) for p in marked))
        return {pod.name: probe for pod, probe in zip(marked, probes, strict=True)}


async def get_json(client: httpx.AsyncClient, url: str) -> tuple[ProbeState, Any, str]:
    """GET a worker's JSON: (ANSWERED, body, "") on 200 with JSON; UNREACHABLE when nothing listens; FAILED on a
    timeout, another status or a body that is not JSON (with the reason)."""
    try:
        response = await client.get(url)
    except httpx.ConnectError as error:
        return ProbeState.UNREACHABLE, None, f"GET {url}: {error}"
    except httpx.HTTPError as error:
        return ProbeState.FAILED, None, f"GET {url}: {type(error).__name__}: {error}"
    if response.status_code != 200:
        return ProbeState.FAILED, None, f"GET {url}: HTTP {response.status_code}"
    try:
        return ProbeState.ANSWERED, response.json(), ""
    except ValueError as error:
        return ProbeState.FAILED, None, f"GET {url}: unexpected answer ({error})"
