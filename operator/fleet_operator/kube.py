"""A small async JSON client for the handful of Kubernetes API calls the operator makes, plus cluster login.

Why not the `kubernetes` client's typed API: every call would validate and convert whole pod lists into model
objects and back, while the planner wants plain dicts exactly as the API sends them; and its calls block, so
they would need threads. Here `kubernetes.config` only finds the cluster the standard way (in-cluster service
account, else `KUBECONFIG` / `~/.kube/config`, or an explicit file) and aiohttp does the requests, asynchronously.
Errors come back as `ApiError` with the HTTP status and the API's reason, so callers can tolerate AlreadyExists
and NotFound, retry conflicts, and report the rest.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
RETRYABLE_STATUS = frozenset({409, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Credentials:
    """How to reach and authenticate to the API server."""

    server: str
    ca_path: str | None = None
    insecure: bool = False
    authorization: str | None = None  # the whole header value, e.g. "Bearer abc"
    token_file: str | None = None  # re-read on every request (rotating service-account tokens)
    cert_path: str | None = None
    key_path: str | None = None
    username: str | None = None
    password: str | None = None


def load_credentials(kubeconfig: str | None = None, context: str | None = None) -> Credentials:
    """In-cluster service account when running in a pod (and no kubeconfig is given), else the kubeconfig file
    (`kubeconfig`, else $KUBECONFIG, else ~/.kube/config). Raises `kubernetes.config.ConfigException`."""
    import kubernetes.config
    from kubernetes.client import Configuration

    config = Configuration()
    token_file = None
    if kubeconfig is None:
        try:
            loader = kubernetes.config.incluster_config.InClusterConfigLoader(
                token_filename=kubernetes.config.incluster_config.SERVICE_TOKEN_FILENAME,
                cert_filename=kubernetes.config.incluster_config.SERVICE_CERT_FILENAME,
            )
            loader.load_and_set(config)
            token_file = kubernetes.config.incluster_config.SERVICE_TOKEN_FILENAME
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config, context=context)
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config, context=context)
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    return Credentials(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        authorization=header,
        token_file=token_file,
        cert_path=config.cert_file,
        key_path=config.key_file,
        username=config.username or None,
        password=config.password or None,
    )


class ApiError(Exception):
    """A failed API call: HTTP status, the Status object's reason and message."""

    def __init__(self, status: int, reason: str, message: str, what: str) -> None:
        super().__init__(f"{what}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def retryable(self) -> bool:
        """Worth another try: a conflict (not AlreadyExists), throttling, or a server-side failure."""
        return self.status in RETRYABLE_STATUS and not self.already_exists


class KubeApi:
    """Async JSON calls against one API server. Paths are API paths (`/api/v1/namespaces/x/pods`).

    aiohttp (kopf's own HTTP client) rather than httpx: with a few hundred concurrent requests, httpx's pool
    bookkeeping cost more CPU than the requests themselves (measured with 50 deployments reconciling at once).
    """

    def __init__(self, credentials: Credentials, *, timeout: float = 30.0, max_connections: int = 32) -> None:
        self._credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        ssl_context: ssl.SSLContext | bool
        if credentials.insecure:
            ssl_context = False
        else:
            ssl_context = ssl.create_default_context(cafile=credentials.ca_path)
            if credentials.cert_path and credentials.key_path:
                ssl_context.load_cert_chain(credentials.cert_path, credentials.key_path)
        self._ssl = ssl_context
        self._auth = (
            aiohttp.BasicAuth(credentials.username, credentials.password)
            if credentials.username and credentials.password
            else None
        )

    def _client(self) -> aiohttp.ClientSession:
        """The session, made on first use (it must be created inside the event loop that uses it)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, ssl=self._ssl),
                timeout=self._timeout,
                auth=self._auth,
                headers={"Accept": "application/json", "User-Agent": "llmfleet-operator"},
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self._credentials.token_file:
            headers["Authorization"] = "Bearer " + Path(self._credentials.token_file).read_text().strip()
        elif self._credentials.authorization:
            headers["Authorization"] = self._credentials.authorization
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call; the decoded JSON answer, or `ApiError`."""
        async with self._client().request(
            method,
            self._credentials.server.rstrip("/") + path,
            data=json.dumps(body) if body is not None else None,
            params=params,
            headers=self._headers(content_type if body is not None else None),
        ) as response:
            raw = await response.read()
            try:
                data = json.loads(raw) if raw else {}
            except ValueError:
                data = {"message": raw[:500].decode(errors="replace")}
            if response.status >= 400:
                raise ApiError(
                    response.status,
                    str(data.get("reason") or response.reason),
                    str(data.get("message") or ""),
                    f"{method} {path}",
                )
            return data

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as error:
            if error.not_found:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return list((await self.request("GET", path, params=params)).get("items") or [])

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body=body)

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    async def delete(self, path: str, uid: str | None = None) -> dict[str, Any]:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}} if uid else None
        return await self.request("DELETE", path, body=body)


async def with_retries(call: Callable[[], Awaitable[T]], *, attempts: int = 4, backoff: float = 0.2) -> T:
    """Run `call`, retrying conflicts, throttling, server errors and transport errors with exponential backoff."""
    for attempt in range(attempts - 1):
        try:
            return await call()
        except ApiError as error:
            if not error.retryable:
                raise
        except (TimeoutError, aiohttp.ClientError):
            pass
        await asyncio.sleep(backoff * 2**attempt)
    return await call()


def namespaced(namespace: str, plural: str, name: str | None = None, *, group: str = "", version: str = "v1") -> str:
    """The API path of a namespaced collection or object (core group when `group` is empty)."""
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path
