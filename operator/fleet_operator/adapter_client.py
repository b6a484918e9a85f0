"""The operator's side of the workers' LoRA adapter API, over httpx: what a worker serves, and load/unload calls.

Why it exists: `controllers.adapters` plans adapter loads from `AdapterProbe`s and `AdapterResult`s and stays
pure; this is the one place that talks to workers about adapters and turns the wire into those values:

    GET /v1/models answered 200 with JSON       ANSWERED (the entries with a `parent` are the adapters)
    connection refused / no route               UNREACHABLE
    timeout, other status, bad JSON             FAILED (nothing is sent to that pod this pass)

Loads are `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (vLLM's API; the worker takes an adapter
source as the path: a folder, `file://` or `hf://`), unloads `POST /v1/unload_lora_adapter {"lora_name"}`, both
with the deployment's drain token as bearer token (the worker guards them with the same secret as `POST /drain`;
`tokens` derives it, the key stays in `WorkerDrains`). Nothing here raises: each load's answer (accepted, or the
worker's reason for refusing it) is kept per deployment until the next pass takes it (`take_results`); that is
how a bad adapter reaches `status.adapters` and a Warning Event. An unload the worker no longer knows (404) is
done. The results live in this object, which the operator's `Fleet` owns (no module state).

May import controllers (observed, actions, adapters' pod rule), fleet_operator.drain_client (its GET helper) and httpx.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx

from controllers import LoadAdapter, UnloadAdapter
from controllers.adapters import may_serve_adapters
from controllers.draining import address
from controllers.observed import AdapterProbe, AdapterResult, PodInfo, ProbeState
from fleet_operator.drain_client import get_json

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, name) of an InferenceDeployment
MAX_ERROR = 1000  # characters of a worker's refusal kept for the status


def serves_adapters(spec: Any) -> bool:
    """Whether a raw CR spec turns LoRA on or lists adapters (only then are workers asked what they serve)."""
    if not isinstance(spec, Mapping):
        return False
    engine = spec.get("engine")
    return bool(spec.get("adapters")) or (isinstance(engine, Mapping) and engine.get("lora") is not None)


def error_text(response: httpx.Response) -> str:
    """The reason in a worker's refusal: the OpenAI-style `error.message`, else the body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        message = body["error"].get("message")
        if isinstance(message, str) and message:
            return message[:MAX_ERROR]
    return f"HTTP {response.status_code}: {response.text[:MAX_ERROR]}"


class WorkerAdapters:
    """Adapter calls to worker pods, with one connection pool, and the answers to the loads of the last pass."""

    def __init__(
        self,
        tokens: Callable[[Mapping[str, Any]], str | None],
        *,
        probe_timeout_s: float = 3.0,
        load_timeout_s: float = 120.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._tokens = tokens
        self._client = client or httpx.AsyncClient(timeout=probe_timeout_s)
        self._owns_client = client is None
        self._load_timeout = load_timeout_s
        self._results: dict[Key, list[AdapterResult]] = {}

    def __repr__(self) -> str:
        return f"WorkerAdapters(pending={sum(map(len, self._results.values()))})"

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def probe(self, worker: str | None) -> AdapterProbe:
        """`GET /v1/models` of the worker at host:port (None: the pod has no IP)."""
        if worker is None:
            return AdapterProbe(ProbeState.UNREACHABLE, detail="the pod has no IP")
        url = f"http://{worker}/v1/models"
        state, body, detail = await get_json(self._client, url)
        if state != ProbeState.ANSWERED:
            return AdapterProbe(state, detail=detail)
        try:
            names = frozenset(str(e["id"]) for e in body["data"] if isinstance(e, Mapping) and e.get("parent"))
        except (KeyError, TypeError) as error:
            return AdapterProbe(ProbeState.FAILED, detail=f"GET {url}: unexpected answer ({error})")
        return AdapterProbe(ProbeState.ANSWERED, adapters=names)

    async def probe_all(self, pods: Iterable[PodInfo], port: int) -> Mapping[str, AdapterProbe]:
        """Probes of the pods that may serve adapters (live, ready, with an IP), by pod name."""
        serving = [p for p in pods if may_serve_adapters(p)]
        probes = await asyncio.gather(*(self.probe(address(p, port)) for p in serving))
        return {pod.name: probe for pod, probe in zip(serving, probes, strict=True)}

    def take_results(self, key: Key) -> tuple[AdapterResult, ...]:
        """The answers to the loads sent for this deployment since the last call (each is read once)."""
        return tuple(self._results.pop(key, ()))

    def forget(self, key: Key) -> None:
        self._results.pop(key, None)

    async def run(
        self, key: Key, meta: Mapping[str, Any], loads: Iterable[LoadAdapter], unloads: Iterable[UnloadAdapter]
    ) -> None:
        """Send the unloads and loads (concurrently; one pod's replace is unload-then-load) and keep the loads'
        answers for `take_results`."""
        token = self._tokens(meta)
        results = await asyncio.gather(
            *(self._unload(u.address, u.adapter, token) for u in unloads),
            *(self._load(a, token) for a in loads),
        )
        answers = [r for r in results if isinstance(r, AdapterResult)]
        if answers:
            self._results.setdefault(key, []).extend(answers)

    async def _load(self, action: LoadAdapter, token: str | None) -> AdapterResult:
        if action.replace:
            problem = await self._unload(action.address, action.adapter, token)
            if problem is not None:
                return AdapterResult(action.pod, action.adapter, action.source, error=problem)
        url = f"http://{action.address}/v1/load_lora_adapter"
        body = {"lora_name": action.adapter, "lora_path": action.source}
        try:
            response = await self._client.post(url, json=body, headers=_auth(token), timeout=self._load_timeout)
        except httpx.HTTPError as error:
            problem = f"POST {url}: {type(error).__name__}: {error}"[:MAX_ERROR]
            return AdapterResult(action.pod, action.adapter, action.source, error=problem)
        if response.status_code >= 300:
            return AdapterResult(action.pod, action.adapter, action.source, error=error_text(response))
        log.info("pod %s: loaded adapter %s from %s", action.pod, action.adapter, action.source)
        return AdapterResult(action.pod, action.adapter, action.source)

    async def _unload(self, worker: str, adapter: str, token: str | None) -> str | None:
        """None when the adapter is gone from the worker (404: it was not there), else why not."""
        url = f"http://{worker}/v1/unload_lora_adapter"
        try:
            response = await self._client.post(url, json={"lora_name": adapter}, headers=_auth(token))
        except httpx.HTTPError as error:
            problem = f"POST {url}: {type(error).__name__}: {error}"
            log.info("%s (the next probe decides what follows)", problem)
            return problem
        if response.status_code >= 300 and response.status_code != 404:
            problem = f"unloading the old copy: {error_text(response)}"
            log.info("POST %s: %s", url, problem)
            return problem
        return None


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
