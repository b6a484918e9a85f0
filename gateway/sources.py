"""The I/O side of discovery: health-checked static backends, or list+watch of the Kubernetes API.

Both run as asyncio tasks on the gateway's loop and publish whole routing tables (built by the pure functions
of `gateway.discovery`) through `GatewayState.set_table`. Kubernetes mode talks to the API server with httpx
(list, then `?watch=1` streams resumed from the last resourceVersion, relisting on 410 Gone), using the
kubernetes client only to load credentials (kubeconfig or in-cluster), so stopping the gateway just cancels
tasks: no threads to unblock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from crds.pods import LABEL_DEPLOYMENT
from gateway.auth import KeyFileError, KeyStore, keys_from_secret
from gateway.discovery import StaticBackend, kube_table, static_table
from gateway.state import GatewayState

log = logging.getLogger("llmfleet.gateway.discovery")

CRD_GROUP = "llmfleet.io"
CRD_VERSION = "v1alpha1"
CRD_PLURAL = "inferencedeployments"


class Source(Protocol):
    """A discovery source: `start` publishes a first table before returning, `stop` ends its tasks."""

    async def start(self, state: GatewayState) -> None: ...

    async def stop(self) -> None: ...


# ------------------------------------------------------------------------------------------------- static mode


@dataclass
class StaticSource:
    """Fixed backend URLs, each checked with `GET /ready` every health_interval_seconds."""

    backends: Sequence[StaticBackend]
    healthy: dict[str, bool] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def start(self, state: GatewayState) -> None:
        await self._check_all(state)
        self._task = asyncio.create_task(self._loop(state), name="gateway-health-check")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self, state: GatewayState) -> None:
        while True:
            await asyncio.sleep(state.settings.health_interval_seconds)
            await self._check_all(state)

    async def _check_all(self, state: GatewayState) -> None:
        urls = sorted({u for b in self.backends for u in b.urls})
        results = await asyncio.gather(*(self._check(state, u) for u in urls))
        for url, ok in zip(urls, results, strict=True):
            if self.healthy.get(url) != ok:
                log.info("backend %s is %s", url, "ready" if ok else "not ready")
            self.healthy[url] = ok
        state.set_table(static_table(self.backends, self.healthy))

    @staticmethod
    async def _check(state: GatewayState, url: str) -> bool:
        assert state.client is not None
        try:
            r = await state.client.get(url + "/ready", timeout=state.settings.health_timeout_seconds)
            await r.aclose()
            return r.status_code == 200
        except httpx.HTTPError:
            return False


# --------------------------------------------------------------------------------------------- Kubernetes mode


@dataclass(frozen=True)
class KubeConnection:
    """How to reach the API server: base URL, TLS and a callable giving the current auth headers."""

    host: str
    verify: ssl.SSLContext | bool
    headers: Callable[[], dict[str, str]]

    @classmethod
    def load(cls, kubeconfig: str | None, context: str | None = None) -> KubeConnection:
        """From a kubeconfig file (or $KUBECONFIG / ~/.kube/config), else the in-cluster service account."""
        from kubernetes import config as kconfig
        from kubernetes.client import Configuration

        cfg = Configuration()
        try:
            kconfig.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
        except (kconfig.ConfigException, FileNotFoundError, TypeError) as e:
            if kubeconfig:
                raise ValueError(f"cannot load kubeconfig {kubeconfig}: {e}") from e
            try:
                kconfig.load_incluster_config(client_configuration=cfg)
            except kconfig.ConfigException as e2:
                raise ValueError(
                    "no Kubernetes credentials: pass --kubeconfig, set KUBECONFIG, or run in a pod "
                    f"with a service account ({e2})"
                ) from e2
        verify: ssl.SSLContext | bool = bool(cfg.verify_ssl)
        if cfg.verify_ssl and (cfg.ssl_ca_cert or cfg.cert_file):
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
            verify = ctx

        def headers() -> dict[str, str]:
            auth = cfg.auth_settings().get("BearerToken")
            value = auth.get("value") if auth else None
            return {"authorization": str(value)} if value else {}

        return cls(host=cfg.host.rstrip("/"), verify=verify, headers=headers)


def missing_secret_message(namespace: str, name: str) -> str:
    return f"API keys not loaded yet: the Secret {namespace}/{name} is missing or holds no keys"


def malformed_secret_message(namespace: str, name: str) -> str:
    return f"API keys not loaded: the Secret {namespace}/{name} is malformed (the gateway's log names the line)"


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


@dataclass
class _Collection:
    """List+watch of one collection into a dict of objects by (namespace, name)."""

    path: str
    params: dict[str, str]
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    resource_version: str = ""

    @staticmethod
    def key(obj: Mapping[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return str(meta.get("namespace", "")), str(meta.get("name", ""))

    async def relist(self, client: httpx.AsyncClient, headers: dict[str, str]) -> None:
        r = await client.get(self.path, params=self.params, headers=headers)
        r.raise_for_status()
        body = r.json()
        self.objects = {self.key(o): o for o in body.get("items") or []}
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion", ""))

    async def watch(
        self, client: httpx.AsyncClient, headers: dict[str, str], timeout_s: int, changed: Callable[[], None]
    ) -> None:
        params = {
            **self.params,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
            "resourceVersion": self.resource_version,
        }
        timeout = httpx.Timeout(10.0, read=timeout_s + 30.0)
        async with client.stream("GET", self.path, params=params, headers=headers, timeout=timeout) as r:
            if r.status_code == 410:
                raise _Gone
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone
                    raise httpx.HTTPError(f"watch error: {obj.get('message', obj)}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = str(rv)
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[self.key(obj)] = obj
                elif kind == "DELETED":
                    self.objects.pop(self.key(obj), None)
                else:
                    continue  # BOOKMARK: only the resourceVersion moves
                changed()


@dataclass
class KubeSource:
    """Watches InferenceDeployments and their pods (and optionally the API-key Secret) in one or all namespaces."""

    connection: KubeConnection
    namespace: str | None = None
    keys_secret: tuple[str, str] | None = None  # (namespace, name) of the API-key Secret
    keys_item: str = "api-keys"
    watch_timeout_s: int = 240
    retry_delay_s: float = 1.0
    _client: httpx.AsyncClient | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def _path(self, api: str, plural: str) -> str:
        ns = f"/namespaces/{self.namespace}" if self.namespace else ""
        return f"{api}{ns}/{plural}"

    async def start(self, state: GatewayState) -> None:
        conn = self.connection
        self._client = httpx.AsyncClient(base_url=conn.host, verify=conn.verify, trust_env=False)
        crs = _Collection(self._path(f"/apis/{CRD_GROUP}/{CRD_VERSION}", CRD_PLURAL), {})
        pods = _Collection(self._path("/api/v1", "pods"), {"labelSelector": LABEL_DEPLOYMENT})

        def publish() -> None:
            state.set_table(kube_table(crs.objects.values(), pods.objects.values()))

        headers = conn.headers()
        await crs.relist(self._client, headers)
        await pods.relist(self._client, headers)
        publish()
        collections: list[tuple[_Collection, Callable[[], None]]] = [(crs, publish), (pods, publish)]
        if self.keys_secret is not None:
            ns, name = self.keys_secret
            secret = _Collection(f"/api/v1/namespaces/{ns}/secrets", {"fieldSelector": f"metadata.name={name}"})

            def publish_keys() -> None:
                self._apply_keys(state, secret.objects.get((ns, name)))

            await secret.relist(self._client, headers)
            publish_keys()
            collections.append((secret, publish_keys))
        for coll, on_change in collections:
            self._tasks.append(asyncio.create_task(self._run(coll, on_change), name=f"gateway-watch:{coll.path}"))

    def _apply_keys(self, state: GatewayState, secret: Mapping[str, Any] | None) -> None:
        """Replace the key store with the Secret's keys. Fails closed: a missing Secret, one without keys or a
        malformed one leaves no key loaded (every request refused with 503 and this reason) until it is fixed."""
        s = state.settings
        ns, name = self.keys_secret or ("", "")
        keys: dict[str, str] = {}
        if secret is None:
            log.error("API-key Secret %s/%s not found: refusing every request until it exists", ns, name)
        else:
            try:
                keys = keys_from_secret(secret, self.keys_item, [t.name for t in s.tiers], s.default_tier)
            except KeyFileError as e:
                log.error("API-key Secret unusable, refusing every request until it is fixed: %s", e)
                state.set_keys(KeyStore({}, s.default_tier, unavailable=malformed_secret_message(ns, name)))
                return
            if not keys:
                log.error("API-key Secret %s/%s holds no key: refusing every request until it does", ns, name)
        state.set_keys(KeyStore(keys, s.default_tier, unavailable=missing_secret_message(ns, name)))
        if keys:
            log.info("loaded %d API keys from Secret %s/%s", len(keys), ns, name)

    async def _run(self, coll: _Collection, on_change: Callable[[], None]) -> None:
        assert self._client is not None
        while True:
            headers = self.connection.headers()
            try:
                await coll.watch(self._client, headers, self.watch_timeout_s, on_change)
            except _Gone:
                await self._retry(coll.relist(self._client, headers), on_change)
            except (httpx.HTTPError, ValueError) as e:
                log.warning("watch of %s failed (%s); relisting", coll.path, e)
                await asyncio.sleep(self.retry_delay_s)
                await self._retry(coll.relist(self._client, headers), on_change)
            except Exception:  # a bug or an unexpected object must not end discovery silently
                log.exception("watch of %s failed unexpectedly; relisting", coll.path)
                await asyncio.sleep(self.retry_delay_s)
                await self._retry(coll.relist(self._client, headers), on_change)

    async def _retry(self, relist: Awaitable[None], on_change: Callable[[], None]) -> None:
        try:
            await relist
            on_change()
        except Exception as e:  # noqa: BLE001 - logged; the watch loop tries again
            log.warning("relist failed (%s); retrying", e)
            await asyncio.sleep(self.retry_delay_s)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
