"""A scripted stand-in for `KubeApi`, for testing the executor and the drain steps without an API server.

Used by tests/operator; nothing here runs in production.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleet_operator.kube import ApiError

# The InferenceDeployment the scripted calls are made for.
DEPLOYMENT: Mapping[str, Any] = {
    "apiVersion": "llmfleet.io/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
}


class ScriptedApi:
    """Records calls; `failures[(verb, path)]` is a list of ApiErrors raised by the next such calls, in order;
    GET answers from `objects` (path -> object)."""

    def __init__(
        self,
        failures: dict[tuple[str, str], list[ApiError]] | None = None,
        objects: dict[str, Any] | None = None,
    ) -> None:
        self.failures = failures or {}
        self.objects = objects or {}
        self.calls: list[tuple[str, str, Any]] = []

    def _call(self, verb: str, path: str, body: Any) -> dict[str, Any]:
        self.calls.append((verb, path, body))
        queue = self.failures.get((verb, path)) or []
        if queue:
            raise queue.pop(0)
        return {}

    async def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(("get", path, None))
        return self.objects.get(path)

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        return self._call("create", path, body)

    async def delete(self, path: str, uid: str | None = None) -> dict[str, Any]:
        return self._call("delete", path, uid)

    async def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        return self._call("patch", path, body)

    def events(self) -> list[dict[str, Any]]:
        return [body for verb, path, body in self.calls if verb == "create" and path.endswith("/events")]
