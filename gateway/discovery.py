"""Pure construction of the routing table from what discovery observed.

Two sources feed the gateway (their I/O lives in `gateway.sources`):

- Static mode: `--backend MODEL[:VARIANT]=URL[,URL...]` (repeatable) plus the latest `GET /ready` result of each
  URL. Each model is one deployment; each named variant one variant of weight 1 (unnamed: variant `default`).
- Kubernetes mode: InferenceDeployment objects (llmfleet.io/v1alpha1) and the pods labelled
  `llmfleet.io/deployment`. The CR's `status.endpoints` (written by the operator) gives the routing groups: one
  per (variant, revision), each with a weight (canary split included) and the tiers it serves. Until the
  operator has written them, groups come from `spec.variants` (weight, tiers) with the revisions seen on ready
  pods sharing the variant equally. A pod is routable when it is Ready, has an IP, is not being deleted and
  is not marked draining; its URL is `http://{podIP}:{port}` with the container port named `http` (default
  8000). The labels, the draining marker and the port are the fleet's worker-pod facts (`crds.pods`). When two deployments serve the same model name, the first by
  (namespace, name) wins.
  LoRA adapters: each of `spec.adapters` (name, source, `tokensPerMinute`) of a CR with `spec.engine.lora` becomes
  an `AdapterRoute` whose pods are the routable pods that `status.adapters[].pods` (written by the operator) lists
  as `Loaded`. When every entry of the routable pods (of all pods, when none is routable) says `Failed`, their
  messages say why no pod serves it. An adapter only in the status (being removed) is not routed, nor are the
  adapters of a CR without `engine.lora` (an invalid spec: no pod serves them). Static mode has no adapters.

Imports `crds.pods` (the worker-pod facts) and `gateway.routing` (the table's shapes), nothing else of ours.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from crds.pods import (
    LABEL_DEPLOYMENT,
    LABEL_REVISION,
    LABEL_VARIANT,
    WORKER_PORT,
    host_port,
    is_draining,
    is_ready,
    named_port,
)
from gateway.routing import (
    AdapterRoute,
    DeploymentRoute,
    Endpoint,
    RevisionRoute,
    RoutingTable,
    VariantRoute,
)

STATIC_REVISION = "static"
DEFAULT_VARIANT = "default"
ADAPTER_LOADED = "Loaded"  # crds.status.AdapterPodState.LOADED
ADAPTER_FAILED = "Failed"  # crds.status.AdapterPodState.FAILED
_MAX_FAILED_MESSAGE = 500  # characters of the pods' failure messages an adapter's 503 carries


# ------------------------------------------------------------------------------------------------- static mode


@dataclass(frozen=True, slots=True)
class StaticBackend:
    """One `--backend` argument: a model (optionally one variant of it) and its worker URLs."""

    model: str
    variant: str
    urls: tuple[str, ...]


def _check_url(url: str, arg: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--backend {arg!r}: {url!r} is not an http(s)://HOST[:PORT] URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"--backend {arg!r}: give the worker's base URL without a path ({url!r})")
    return f"{parts.scheme}://{parts.netloc}"


def parse_backend(arg: str) -> StaticBackend:
    """`MODEL[:VARIANT]=URL[,URL...]` -> StaticBackend, with an error that shows the expected form."""
    name, sep, urls = arg.partition("=")
    name = name.strip()
    if not sep or not name or not urls.strip():
        raise ValueError(
            f"--backend {arg!r}: expected MODEL[:VARIANT]=URL[,URL...], e.g. smollm2=http://127.0.0.1:8000"
        )
    model, _, variant = name.partition(":")
    if not model or (":" in variant):
        raise ValueError(f"--backend {arg!r}: expected MODEL or MODEL:VARIANT before '='")
    checked = tuple(_check_url(u.strip(), arg) for u in urls.split(",") if u.strip())
    return StaticBackend(model=model, variant=variant or DEFAULT_VARIANT, urls=checked)


def static_table(backends: Sequence[StaticBackend], healthy: Mapping[str, bool]) -> RoutingTable:
    """Routing table of static mode: every backend URL whose last health check passed is routable."""
    variants: dict[str, dict[str, list[str]]] = {}
    for b in backends:
        urls = variants.setdefault(b.model, {}).setdefault(b.variant, [])
        urls.extend(u for u in b.urls if u not in urls)
    deployments = {}
    for model, by_variant in variants.items():
        vroutes = tuple(
            VariantRoute(
                name=variant,
                weight=1,
                revisions=(
                    RevisionRoute(
                        name=STATIC_REVISION,
                        weight=1,
                        endpoints=tuple(
                            Endpoint(url=u, name=u, variant=variant, revision=STATIC_REVISION)
                            for u in urls
                            if healthy.get(u, False)
                        ),
                    ),
                ),
            )
            for variant, urls in by_variant.items()
        )
        deployments[model] = DeploymentRoute(model=model, name=model, variants=vroutes)
    return RoutingTable(deployments=deployments)


# --------------------------------------------------------------------------------------------- Kubernetes mode


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, Mapping) else {}


def pod_is_routable(pod: Mapping[str, Any]) -> bool:
    """Ready, has an IP, not being deleted, not marked draining."""
    meta = _meta(pod)
    if meta.get("deletionTimestamp"):
        return False
    if is_draining(pod):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP") or status.get("phase") not in (None, "Running"):
        return False
    return is_ready(pod)


def pod_url(pod: Mapping[str, Any]) -> str:
    """`http://{podIP}:{port}`, the port being the container port named `http` (default 8000)."""
    port = named_port(pod) or WORKER_PORT
    return f"http://{host_port((pod.get('status') or {})['podIP'], port)}"


@dataclass(frozen=True, slots=True)
class _Group:
    variant: str
    revision: str | None  # None: every revision seen on pods (spec fallback)
    weight: float
    tiers: frozenset[str]


def _groups(cr: Mapping[str, Any]) -> list[_Group]:
    status = cr.get("status") or {}
    endpoints = status.get("endpoints") if isinstance(status, Mapping) else None
    if endpoints:
        return [
            _Group(
                variant=str(e["variant"]),
                revision=str(e["revision"]),
                weight=float(e.get("weight") or 0),
                tiers=frozenset(str(t) for t in e.get("tiers") or []),
            )
            for e in endpoints
            if isinstance(e, Mapping) and e.get("variant") and e.get("revision")
        ]
    variants = (cr.get("spec") or {}).get("variants") or []
    return [
        _Group(
            variant=str(v["name"]),
            revision=None,
            weight=float(v.get("weight", 1) or 0),
            tiers=frozenset(str(t) for t in v.get("tiers") or []),
        )
        for v in variants
        if isinstance(v, Mapping) and v.get("name")
    ]


def deployment_route(cr: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> DeploymentRoute | None:
    """The route of one InferenceDeployment given its pods (None when the CR names no served model)."""
    meta = _meta(cr)
    model = ((cr.get("spec") or {}).get("model") or {}).get("name")
    if not isinstance(model, str) or not model:
        return None
    ready: dict[tuple[str, str], list[Endpoint]] = {}
    for pod in pods:
        labels = _meta(pod).get("labels") or {}
        if not pod_is_routable(pod):
            continue
        variant, revision = labels.get(LABEL_VARIANT), labels.get(LABEL_REVISION)
        if not variant or not revision:
            continue
        ready.setdefault((variant, revision), []).append(
            Endpoint(url=pod_url(pod), name=str(_meta(pod).get("name", "")), variant=variant, revision=revision)
        )
    order: list[str] = []
    revisions: dict[str, list[RevisionRoute]] = {}
    tiers: dict[str, set[str]] = {}
    for g in _groups(cr):
        if g.variant not in revisions:
            order.append(g.variant)
            revisions[g.variant] = []
            tiers[g.variant] = set()
        tiers[g.variant] |= g.tiers
        if g.revision is not None:
            eps = sorted(ready.get((g.variant, g.revision), []), key=lambda e: e.name)
            revisions[g.variant].append(RevisionRoute(name=g.revision, weight=g.weight, endpoints=tuple(eps)))
        else:
            seen = sorted(r for (v, r) in ready if v == g.variant)
            revisions[g.variant].extend(
                RevisionRoute(
                    name=r, weight=g.weight, endpoints=tuple(sorted(ready[(g.variant, r)], key=lambda e: e.name))
                )
                for r in seen
            )
    variants = tuple(
        VariantRoute(
            name=v,
            weight=sum(r.weight for r in revisions[v]) if revisions[v] else _spec_weight(cr, v),
            tiers=frozenset(tiers[v]),
            revisions=tuple(revisions[v]),
        )
        for v in order
    )
    max_len = ((cr.get("spec") or {}).get("model") or {}).get("maxModelLen")
    routable = {e.name for eps in ready.values() for e in eps}
    return DeploymentRoute(
        model=model,
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        variants=variants,
        max_model_len=_positive(max_len),
        adapters=adapter_routes(cr, routable),
    )


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def adapter_routes(cr: Mapping[str, Any], routable: Collection[str]) -> dict[str, AdapterRoute]:
    """The adapters of `spec.adapters`, each with the routable pods (names in `routable`) that `status.adapters`
    lists as Loaded (see the module docstring)."""
    spec = cr.get("spec") or {}
    if not isinstance((spec.get("engine") or {}).get("lora"), Mapping):
        return {}
    status = cr.get("status") or {}
    statuses = (status.get("adapters") if isinstance(status, Mapping) else None) or []
    entries: dict[str, list[Mapping[str, Any]]] = {}
    for a in statuses:
        if isinstance(a, Mapping) and isinstance(a.get("name"), str):
            entries[a["name"]] = [
                p for p in a.get("pods") or [] if isinstance(p, Mapping) and isinstance(p.get("pod"), str)
            ]
    routes: dict[str, AdapterRoute] = {}
    for a in spec.get("adapters") or []:
        name = a.get("name") if isinstance(a, Mapping) else None
        if not isinstance(name, str) or not name or name in routes:
            continue
        pods = entries.get(name, [])
        loaded = frozenset(p["pod"] for p in pods if p.get("state") == ADAPTER_LOADED and p.get("pod") in routable)
        relevant = [p for p in pods if p.get("pod") in routable] or pods
        failed = None
        if relevant and all(p.get("state") == ADAPTER_FAILED for p in relevant):
            reasons = dict.fromkeys(str(p.get("message") or "no reason given") for p in relevant)
            failed = "; ".join(reasons)[:_MAX_FAILED_MESSAGE]
        routes[name] = AdapterRoute(
            name=name,
            source=str(a.get("source") or ""),
            tokens_per_minute=_positive(a.get("tokensPerMinute")),
            pods=loaded,
            failed=failed,
        )
    return routes


def _spec_weight(cr: Mapping[str, Any], variant: str) -> float:
    """Weight of a variant without revisions (no pods yet): from status endpoints or spec, so scale-from-zero
    demand still reaches it by weight."""
    for g in _groups(cr):
        if g.variant == variant:
            return g.weight
    return 0.0


def kube_table(crs: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> RoutingTable:
    """The routing table of a cluster: every InferenceDeployment with its routable pods."""
    by_owner: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for pod in pods:
        meta = _meta(pod)
        owner = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT)
        if owner:
            by_owner.setdefault((str(meta.get("namespace", "")), str(owner)), []).append(pod)
    deployments: dict[str, DeploymentRoute] = {}
    for cr in sorted(crs, key=lambda c: (str(_meta(c).get("namespace", "")), str(_meta(c).get("name", "")))):
        if _meta(cr).get("deletionTimestamp"):
            continue
        key = (str(_meta(cr).get("namespace", "")), str(_meta(cr).get("name", "")))
        route = deployment_route(cr, by_owner.get(key, []))
        if route is not None and route.model not in deployments:
            deployments[route.model] = route
    return RoutingTable(deployments=deployments)
