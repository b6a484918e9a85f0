"""A small synchronous JSON client for the few API calls the local fleet makes, and `apply` for manifests.

Why it exists: `llmfleet up` and the e2e suite create a Namespace, a Secret, the CRD and InferenceDeployments and
read pods, events and status, as plain dicts. The `kubernetes` client finds the cluster (kubeconfig, auth) and
httpx makes the calls; `apply` gives `kubectl apply`'s outcome for the kinds used here (the object ends up with
exactly the file's spec; labels and annotations are merged; status, finalizers and the operator's annotations are
kept), so neither needs the kubectl binary.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

from crds.pods import LABEL_DEPLOYMENT

# (apiVersion, kind) -> (API prefix, plural, namespaced)
KINDS: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "Namespace"): ("/api/v1", "namespaces", False),
    ("v1", "Secret"): ("/api/v1", "secrets", True),
    ("v1", "ConfigMap"): ("/api/v1", "configmaps", True),
    ("v1", "Pod"): ("/api/v1", "pods", True),
    ("v1", "Event"): ("/api/v1", "events", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): (
        "/apis/apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        False,
    ),
    ("llmfleet.io/v1alpha1", "InferenceDeployment"): ("/apis/llmfleet.io/v1alpha1", "inferencedeployments", True),
}
INFD = ("llmfleet.io/v1alpha1", "InferenceDeployment")


class KubeError(RuntimeError):
    """A failed API call, with the HTTP status and the API's message."""

    def __init__(self, status: int, message: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {message}")
        self.status = status
        self.message = message


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    """The API path of the collection holding objects of this kind (in `namespace` when namespaced)."""
    try:
        prefix, plural, namespaced = KINDS[(api_version, kind)]
    except KeyError:
        known = ", ".join(f"{k} ({v})" for v, k in KINDS)
        raise ValueError(f"cannot apply {kind} ({api_version}) here; known kinds: {known}") from None
    if namespaced:
        return f"{prefix}/namespaces/{namespace or 'default'}/{plural}"
    return f"{prefix}/{plural}"


def load_manifests(path: Path | str) -> list[dict[str, Any]]:
    """The YAML documents of a file (empty documents skipped); each must have apiVersion, kind and a name."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    for doc in docs:
        if not isinstance(doc, dict) or not doc.get("apiVersion") or not doc.get("kind"):
            raise ValueError(f"{path}: every document needs apiVersion and kind")
        if not (doc.get("metadata") or {}).get("name"):
            raise ValueError(f"{path}: a {doc['kind']} has no metadata.name")
    return docs


def merged_for_update(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The object to PUT so that it ends up as `desired`: the desired top-level fields (spec, data, ...), labels and
    annotations merged over the existing ones, and the server's metadata (resourceVersion, finalizers, ...) and
    status kept."""
    body = {k: v for k, v in existing.items() if k in ("apiVersion", "kind", "metadata", "status")}
    body.update({k: v for k, v in desired.items() if k not in ("metadata", "status")})
    meta = dict(existing.get("metadata") or {})
    wanted = desired.get("metadata") or {}
    for key in ("labels", "annotations"):
        if wanted.get(key):
            meta[key] = {**(meta.get(key) or {}), **wanted[key]}
    body["metadata"] = meta
    return body


class Kube:
    """JSON calls against the cluster of one kubeconfig."""

    def __init__(self, kubeconfig: Path | str, timeout_s: float = 30.0) -> None:
        from kubernetes import config as kconfig
        from kubernetes.client import Configuration

        cfg = Configuration()
        kconfig.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        headers: dict[str, str] = {}
        auth = cfg.auth_settings().get("BearerToken")
        if auth and auth.get("value"):
            headers["authorization"] = str(auth["value"])
        verify: Any = bool(cfg.verify_ssl)
        if cfg.verify_ssl and cfg.ssl_ca_cert:
            verify = cfg.ssl_ca_cert
        self.url = cfg.host.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, verify=verify, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        response = self._http.request(method, path, json=body, params=params, headers={"content-type": content_type})
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise KubeError(response.status_code, str(message)[:1000], f"{method} {path}")
        return response.json() if response.content else None

    # ----------------------------------------------------------------------------------------------- objects

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.request("GET", f"{collection_path(api_version, kind, namespace)}/{name}")
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        selector: str | None = None,
        all_namespaces: bool = False,
    ) -> list[dict[str, Any]]:
        path = collection_path(api_version, kind, namespace)
        if all_namespaces:
            prefix, plural, _ = KINDS[(api_version, kind)]
            path = f"{prefix}/{plural}"
        params = {"labelSelector": selector} if selector else None
        return list(self.request("GET", path, params=params).get("items") or [])

    def apply(self, doc: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Create the object, or make the existing one match it (see `merged_for_update`); 409s are retried."""
        meta = doc.get("metadata") or {}
        ns = meta.get("namespace") or namespace
        path = collection_path(doc["apiVersion"], doc["kind"], ns)
        name = meta["name"]
        namespaced = KINDS[(doc["apiVersion"], doc["kind"])][2]
        body = {**doc, "metadata": {**meta, "namespace": ns or "default"} if namespaced else dict(meta)}
        last: KubeError | None = None
        for _ in range(10):
            try:
                existing = self.request("GET", f"{path}/{name}")
            except KubeError as error:
                if error.status != 404:
                    raise
                try:
                    return self.request("POST", path, body)
                except KubeError as create_error:
                    if create_error.status != 409:
                        raise
                    last = create_error
                    continue
            try:
                return self.request("PUT", f"{path}/{name}", merged_for_update(existing, body))
            except KubeError as error:
                if error.status != 409:
                    raise
                last = error
                time.sleep(0.1)
        raise last or KubeError(409, "conflicts", f"apply {doc['kind']} {name}")

    def apply_all(
        self, docs: Iterable[Mapping[str, Any]], namespace: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        return [self.apply(doc, namespace) for doc in docs]

    def merge_patch(
        self, api_version: str, kind: str, name: str, patch: Mapping[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        return self.request(
            "PATCH",
            f"{collection_path(api_version, kind, namespace)}/{name}",
            patch,
            content_type="application/merge-patch+json",
        )

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete; False when it was already gone."""
        try:
            self.request("DELETE", f"{collection_path(api_version, kind, namespace)}/{name}")
            return True
        except KubeError as error:
            if error.status == 404:
                return False
            raise

    # ------------------------------------------------------------------------------------ InferenceDeployments

    def infd(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.get(*INFD, name, namespace)

    def pods(self, deployment: str | None = None, namespace: str | None = "default") -> builtins.list[dict[str, Any]]:
        """Worker pods of one deployment (or of all, with `deployment=None`); all namespaces with `namespace=None`."""
        selector = f"{LABEL_DEPLOYMENT}={deployment}" if deployment else LABEL_DEPLOYMENT
        return self.list("v1", "Pod", namespace, selector=selector, all_namespaces=namespace is None)

    def pod_log(self, name: str, namespace: str = "default", tail_lines: int = 40) -> str:
        response = self._http.get(
            f"/api/v1/namespaces/{namespace}/pods/{name}/log", params={"tailLines": str(tail_lines)}
        )
        return response.text if response.status_code == 200 else f"(no log: HTTP {response.status_code})"

    def events(self, deployment: str, namespace: str = "default") -> builtins.list[dict[str, Any]]:
        """Events about one InferenceDeployment, oldest first."""
        events = [
            e
            for e in self.list("v1", "Event", namespace)
            if (e.get("involvedObject") or {}).get("kind") == "InferenceDeployment"
            and e["involvedObject"].get("name") == deployment
        ]
        return sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
