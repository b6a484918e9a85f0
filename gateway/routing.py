"""Pure routing decisions: model -> deployment -> variant -> revision -> pod.

Everything here is a function of an immutable `RoutingTable` snapshot, the current per-pod outstanding counts and
an injected `random.Random`, so every decision is table-tested and reproducible with a seed. Discovery builds
the table; the proxy calls these functions and does the I/O.

Order of decisions for one request:
1. `resolve_model`: the `model` field names a deployment's served model, optionally with a `:variant` suffix
   (`smollm2:int4`) or a `:adapter` suffix (`smollm2:sql`, a LoRA adapter of `spec.adapters`); or it is an
   adapter's own name (`sql`) when exactly one deployment declares it. A name that exists as-is wins over splitting
   at the last colon, and a model name wins over an adapter name; an adapter name two deployments declare is a 404
   that asks for `MODEL:ADAPTER`.
2. `choose_variant`: an explicit suffix picks that variant. Otherwise the variants that list the request's tier
   serve it; if none lists it, the variants that list no tiers do. Among those, a variant of weight zero gets no
   traffic (unless all are zero: then uniform), and the choice is weighted by the variant weights among the
   variants that have a ready pod; only when none has one is a variant with no ready pod chosen (the caller then
   holds the request until that variant scales up from zero, which the autoscaler sees as queued demand).
3. `choose_revision`: within the variant, revisions (stable/canary) with ready pods are chosen by weight.
4. `choose_endpoint`: rendezvous (highest-random-weight) hashing of the prompt's leading characters ranks the
   pods; the first pod in that order whose outstanding count is <= load_factor * mean outstanding takes the
   request (consistent hashing with bounded loads), so a hot prefix spills to its second-ranked pod instead of
   piling onto one. Without a prefix the least-outstanding pod wins, ties broken at random.

A request for a LoRA adapter (`MODEL:ADAPTER` or `ADAPTER`) goes only to pods that `status.adapters` lists as
having it `Loaded` (`AdapterRoute.pods`). It chooses its variant and revision by the same weights and tiers, then
`adapter_endpoints` keeps to the pods with the adapter: the chosen revision's, else the chosen variant's, else those
of any variant that serves the request's tier (the variants `choose_variant` chose among); step 4's bounded-load
choice runs among them. While the adapter is loaded everywhere (what the operator does) canary and variant weights
hold as for the base model; while it is loaded on some pods only, requests fall back to those rather than fail.
When none of those pods has it, `adapter_not_ready` is the 503 (loading, or failed on every pod with the reason).

Imports nothing of ours: the table's shapes are defined here, `gateway.discovery` fills them.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One routable worker pod."""

    url: str  # base URL, e.g. http://10.0.0.7:8000
    name: str  # stable identity for hashing and metrics: the pod name (static mode: the URL)
    variant: str
    revision: str


@dataclass(frozen=True, slots=True)
class RevisionRoute:
    """A revision (stable or canary) of a variant: its traffic weight and its ready pods."""

    name: str
    weight: float
    endpoints: tuple[Endpoint, ...] = ()


@dataclass(frozen=True, slots=True)
class VariantRoute:
    """A variant of a deployment (e.g. full precision vs int4): its weight, the tiers it serves, its revisions."""

    name: str
    weight: float
    tiers: frozenset[str] = frozenset()  # empty: serves requests of any tier not claimed by another variant
    revisions: tuple[RevisionRoute, ...] = ()

    @property
    def ready(self) -> bool:
        return any(r.endpoints for r in self.revisions)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(e for r in self.revisions for e in r.endpoints)


@dataclass(frozen=True, slots=True)
class AdapterRoute:
    """A LoRA adapter a deployment declares (`spec.adapters`): its shared token limit and the ready pods (by pod
    name, `Endpoint.name`) that have it loaded (`status.adapters[].pods[].state == Loaded`)."""

    name: str
    source: str = ""  # spec.adapters[].source (`/v1/models` lists it as `root`, as vLLM lists the adapter's path)
    tokens_per_minute: int | None = None  # shared by every API key (`ratelimit`); None: no adapter limit
    pods: frozenset[str] = frozenset()
    failed: str | None = None  # every pod entry of the status says Failed: their message(s); None otherwise


@dataclass(frozen=True, slots=True)
class DeploymentRoute:
    """An InferenceDeployment as the gateway sees it."""

    model: str  # served model name clients put in `model`
    name: str  # the deployment's name (static mode: the model name)
    namespace: str = ""
    variants: tuple[VariantRoute, ...] = ()
    max_model_len: int | None = None  # spec.model.maxModelLen (None: unknown, the gateway's default applies)
    adapters: Mapping[str, AdapterRoute] = field(default_factory=dict)  # by adapter name (kube mode only)

    def variant(self, name: str) -> VariantRoute | None:
        for v in self.variants:
            if v.name == name:
                return v
        return None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(e for v in self.variants for e in v.endpoints)


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Immutable snapshot of everything routable; replaced as a whole when discovery sees a change."""

    deployments: Mapping[str, DeploymentRoute] = field(default_factory=dict)  # by served model name
    # adapter name -> the served models declaring it (sorted), for `model: ADAPTER`; derived from `deployments`
    adapter_models: Mapping[str, tuple[str, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        owners: dict[str, list[str]] = {}
        for model, dep in sorted(self.deployments.items()):
            for name in dep.adapters:
                owners.setdefault(name, []).append(model)
        object.__setattr__(self, "adapter_models", {name: tuple(models) for name, models in owners.items()})

    def adapter_entries(self) -> list[tuple[str, DeploymentRoute, AdapterRoute]]:
        """(id, deployment, adapter) of every declared adapter, as `/v1/models` lists them: the adapter's own name
        where that name selects it (`resolve_model`), else `MODEL:ADAPTER` (several models declare the name, or a
        served model has it as its name)."""
        out: list[tuple[str, DeploymentRoute, AdapterRoute]] = []
        for model, dep in sorted(self.deployments.items()):
            for name, adapter in sorted(dep.adapters.items()):
                bare = len(self.adapter_models[name]) == 1 and name not in self.deployments
                out.append((name if bare else f"{model}:{name}", dep, adapter))
        return out

    def adapter_limits(self) -> dict[tuple[str, str, str], int]:
        """`tokensPerMinute` of every adapter that sets one, by (namespace, deployment, adapter)."""
        return {
            (dep.namespace, dep.name, a.name): a.tokens_per_minute
            for dep in self.deployments.values()
            for a in dep.adapters.values()
            if a.tokens_per_minute is not None
        }

    def model_names(self) -> list[str]:
        """Every served model, and `model:variant` where it has several (adapters: `adapter_entries`)."""
        names: list[str] = []
        for model, dep in sorted(self.deployments.items()):
            names.append(model)
            if len(dep.variants) > 1:
                names.extend(f"{model}:{v.name}" for v in dep.variants)
        return names

    def endpoints(self) -> list[Endpoint]:
        return [e for d in self.deployments.values() for v in d.variants for e in v.endpoints]


class RoutingError(Exception):
    """A request cannot be routed; carries the HTTP status and an OpenAI-style error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class Resolved(NamedTuple):
    """What a request's `model` names: a deployment, and the variant or the adapter its suffix or name selects."""

    dep: DeploymentRoute
    variant: str | None = None  # `MODEL:VARIANT`: pinned to that variant
    adapter: AdapterRoute | None = None  # `MODEL:ADAPTER` or `ADAPTER`: that LoRA adapter of the model


def resolve_model(table: RoutingTable, model: str) -> Resolved:
    """The deployment serving `model` and the variant or adapter it selects (see the module docstring)."""
    dep = table.deployments.get(model)
    if dep is not None:
        return Resolved(dep)
    base, sep, suffix = model.rpartition(":")
    if sep and base and suffix:
        dep = table.deployments.get(base)
        if dep is not None:
            if dep.variant(suffix) is not None:
                return Resolved(dep, variant=suffix)
            adapter = dep.adapters.get(suffix)
            if adapter is not None:
                return Resolved(dep, adapter=adapter)
            variants = ", ".join(v.name for v in dep.variants) or "none"
            adapters = ", ".join(sorted(dep.adapters)) or "none"
            raise RoutingError(
                404,
                "model_not_found",
                f"model {base!r} has no variant or adapter {suffix!r} (variants: {variants}; adapters: {adapters})",
            )
    owners = table.adapter_models.get(model)
    if owners:
        if len(owners) > 1:
            choices = ", ".join(f"{m}:{model}" for m in owners)
            raise RoutingError(
                404,
                "model_not_found",
                f"the adapter name {model!r} is ambiguous: models {', '.join(owners)} each declare it; "
                f"send model MODEL:ADAPTER ({choices})",
            )
        dep = table.deployments[owners[0]]
        return Resolved(dep, adapter=dep.adapters[model])
    raise RoutingError(404, "model_not_found", f"the model {model!r} does not exist")


_T = TypeVar("_T")


def weighted_choice(items: Sequence[_T], weights: Sequence[float], rng: random.Random) -> _T:
    """Pick one item with probability proportional to its weight; uniform when all weights are zero."""
    if not items:
        raise ValueError("weighted_choice needs at least one item")
    total = sum(weights)
    if total <= 0:
        return items[rng.randrange(len(items))]
    x = rng.random() * total
    acc = 0.0
    for item, w in zip(items, weights, strict=True):
        acc += w
        if x < acc and w > 0:
            return item
    return next(item for item, w in zip(reversed(items), reversed(weights), strict=True) if w > 0)


def eligible_variants(dep: DeploymentRoute, tier: str) -> list[VariantRoute]:
    """Variants that may serve a request of `tier` (those listing it, else those listing no tier)."""
    claimed = [v for v in dep.variants if tier in v.tiers]
    if claimed:
        return claimed
    return [v for v in dep.variants if not v.tiers]


def serving_variants(dep: DeploymentRoute, tier: str) -> list[VariantRoute]:
    """The variants a request of `tier` without a suffix may go to: the eligible ones of non-zero weight (all
    eligible ones when their weights are all zero). Empty when no variant serves the tier."""
    candidates = eligible_variants(dep, tier)
    return [v for v in candidates if v.weight > 0] or candidates


def choose_variant(dep: DeploymentRoute, suffix: str | None, tier: str, rng: random.Random) -> VariantRoute:
    """The variant for one request (see the module docstring for the rules)."""
    if suffix is not None:
        variant = dep.variant(suffix)
        if variant is None:
            raise RoutingError(404, "model_not_found", f"model {dep.model!r} has no variant {suffix!r}")
        return variant
    weighted = serving_variants(dep, tier)
    if not weighted:
        raise RoutingError(404, "model_not_found", f"no variant of model {dep.model!r} serves tier {tier!r}")
    pool = [v for v in weighted if v.ready] or weighted
    return weighted_choice(pool, [v.weight for v in pool], rng)


def choose_revision(variant: VariantRoute, rng: random.Random) -> RevisionRoute | None:
    """A revision with ready pods, by weight (uniform if their weights are all zero); None when none is ready."""
    ready = [r for r in variant.revisions if r.endpoints]
    if not ready:
        return None
    return weighted_choice(ready, [r.weight for r in ready], rng)


def adapter_endpoints(
    dep: DeploymentRoute,
    variant: VariantRoute,
    revision: RevisionRoute | None,
    adapter: AdapterRoute,
    tier: str,
    exclude: Collection[str] = (),
) -> list[Endpoint]:
    """The pods an adapter request may go to, leaving out URLs in `exclude` (pods already tried): those of the
    chosen revision (None: none chosen, as on a retry) that have the adapter loaded; when none does, those of the
    chosen variant; when none does, those of every variant serving `tier` (`serving_variants`). Empty when none
    of them has it."""
    pods = adapter.pods
    if not pods:
        return []
    groups: list[Iterable[Endpoint]] = [variant.endpoints]
    if revision is not None:
        groups.insert(0, revision.endpoints)
    groups.append(e for v in serving_variants(dep, tier) for e in v.endpoints)
    for group in groups:
        found = [e for e in group if e.name in pods and e.url not in exclude]
        if found:
            return found
    return []


def adapter_not_ready(dep: DeploymentRoute, adapter: AdapterRoute) -> RoutingError:
    """The 503 of an adapter that no pod a request may go to has loaded: it failed on every pod (the message
    carries the pods' reasons), or it is (still) loading."""
    if adapter.failed is not None:
        message = (
            f"LoRA adapter {adapter.name!r} of model {dep.model!r} failed to load on every pod: {adapter.failed} "
            "(the operator retries with back-off; fix the adapter or its source in spec.adapters if this persists)"
        )
    else:
        message = (
            f"LoRA adapter {adapter.name!r} of model {dep.model!r} is not loaded on a ready pod yet (loading); "
            "retry shortly"
        )
    return RoutingError(503, "adapter_not_ready", message)


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def rendezvous_order(key: str, endpoints: Iterable[Endpoint]) -> list[Endpoint]:
    """Endpoints ranked by highest-random-weight hashing of (key, pod name): stable as pods come and go."""
    k = hashlib.blake2b(key.encode(), digest_size=16).digest()
    return sorted(endpoints, key=lambda e: (_digest(k + e.name.encode()), e.name), reverse=True)


def load_cap(outstanding: Mapping[str, int], endpoints: Sequence[Endpoint], load_factor: float) -> float:
    """Largest outstanding count a pod may have and still take one more request (c * mean)."""
    total = sum(outstanding.get(e.url, 0) for e in endpoints)
    return load_factor * total / len(endpoints)


def choose_endpoint(
    endpoints: Sequence[Endpoint],
    outstanding: Mapping[str, int],
    affinity_key: str | None,
    load_factor: float,
    rng: random.Random,
    exclude: Collection[str] = (),
) -> Endpoint | None:
    """The pod for one attempt, skipping URLs in `exclude` (pods already tried); None when none is left."""
    candidates = [e for e in endpoints if e.url not in exclude]
    if not candidates:
        return None
    if affinity_key:
        cap = load_cap(outstanding, candidates, load_factor)
        for e in rendezvous_order(affinity_key, candidates):
            if outstanding.get(e.url, 0) <= cap:
                return e
    least = min(outstanding.get(e.url, 0) for e in candidates)
    tied = [e for e in candidates if outstanding.get(e.url, 0) == least]
    return tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text(body: Mapping[str, Any]) -> str:
    """The request's prompt as one string: chat messages rendered as `role\\n content\\n`, or the completion prompt.

    This is what prefix affinity hashes (its leading characters) and what the prompt-token estimate counts.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\n{_text_of(m.get('content'))}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return "".join(p for p in prompt if isinstance(p, str))
        if isinstance(first, int):  # token ids
            return " ".join(str(t) for t in prompt)
        if isinstance(first, list):  # batch of token-id lists: the first decides affinity
            return " ".join(str(t) for t in first)
    return ""


def affinity_key(prompt: str, prefix_chars: int) -> str | None:
    """The prefix-affinity key: the prompt's first `prefix_chars` characters (None when off or empty)."""
    if prefix_chars <= 0 or not prompt:
        return None
    return prompt[:prefix_chars]
