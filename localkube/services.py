"""The narrow views of one ``LocalKube`` that its parts are given, so that none of them imports ``server.py``.

``LocalKube`` (server.py) owns the store, the registry, the API semantics (``ApiCore``) and the options, and builds
its parts: the HTTP layer (apiserver.py), the controllers, the event recorder and the kubelet. Each part is handed
the ``LocalKube`` typed as the Protocol below that lists only what it uses; ``LocalKube`` satisfies them all
structurally. The layering that follows: server -> {apiserver, controllers, kubelet} -> services -> {api,
registry, store, options}, with no way back up.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from localkube.api import ApiCore
from localkube.options import Options
from localkube.registry import Registry
from localkube.store import Store


class Apis(Protocol):
    """The API machinery: the object store, the served resource types and the API semantics over them."""

    @property
    def store(self) -> Store: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def core(self) -> ApiCore: ...


class ClusterContext(Apis, Protocol):
    """The API machinery plus the instance's settings (what the controllers and the pod workers read)."""

    @property
    def options(self) -> Options: ...


class PodSubresources(Apis, Protocol):
    """What the HTTP layer needs beyond plain CRUD: the pod subresources that need policy or the kubelet."""

    def bind_pod(self, namespace: str, name: str, binding: object) -> dict: ...

    def evict_pod(self, namespace: str, name: str, eviction: object, query: Any) -> dict: ...

    async def stream_log(self, pod: dict, request: web.Request) -> web.StreamResponse: ...


class KubeletHost(ClusterContext, Protocol):
    """What the kubelet needs of its cluster: the API machinery, the settings, the API port and pod binding."""

    @property
    def port(self) -> int: ...

    def assign_node(self, pod: dict, node: str) -> dict: ...
