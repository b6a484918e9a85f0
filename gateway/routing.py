"""Pure routing decisions: model -> deployment -> variant -> revision -> pod.

Everything here is a function of an immutable `RoutingTable` snapshot, the current per-pod outstanding counts and
an injected `random.Random`, so every decision is table-tested and reproducible with a seed. Discovery builds
the table; the proxy calls these functions and does the I/O.

Order of decisions for one request:
1. `resolve_model`: the `model` field names a deployment's served model, optionally with a `:variant` suffix
   (`smollm2:int4`). A name that exists as-is wins over splitting at the last colon.
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
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar


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
class DeploymentRoute:
    """An InferenceDeployment as the gateway sees it."""

    model: str  # served model name clients put in `model`
    name: str  # the deployment's name (static mode: the model name)
    namespace: str = ""
    variants: tuple[VariantRoute, ...] = ()
    max_model_len: int | None = None  # spec.model.maxModelLen (None: unknown, the gateway's default applies)

    def variant(self, name: str) -> VariantRoute | None:
        for v in self.variants:
            if v.name == name:
                return v
        return None


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Immutable snapshot of everything routable; replaced as a whole when discovery sees a change."""

    deployments: Mapping[str, DeploymentRoute] = field(default_factory=dict)  # by served model name

    def model_names(self) -> list[str]:
        """Every name a client may put in `model`: each served model, and `model:variant` where it has several."""
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


def resolve_model(table: RoutingTable, model: str) -> tuple[DeploymentRoute, str | None]:
    """The deployment serving `model` and the variant its suffix names (None when no suffix)."""
    dep = table.deployments.get(model)
    if dep is not None:
        return dep, None
    base, sep, variant = model.rpartition(":")
    if sep and base and variant:
        dep = table.deployments.get(base)
        if dep is not None:
            if dep.variant(variant) is None:
                known = ", ".join(v.name for v in dep.variants) or "none"
                raise RoutingError(
                    404, "model_not_found", f"model {base!r} has no variant {variant!r} (variants: {known})"
                )
            return dep, variant
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


def choose_variant(dep: DeploymentRoute, suffix: str | None, tier: str, rng: random.Random) -> VariantRoute:
    """The variant for one request (see the module docstring for the rules)."""
    if suffix is not None:
        variant = dep.variant(suffix)
        if variant is None:
            raise RoutingError(404, "model_not_found", f"model {dep.model!r} has no variant {suffix!r}")
        return variant
    candidates = eligible_variants(dep, tier)
    if not candidates:
        raise RoutingError(404, "model_not_found", f"no variant of model {dep.model!r} serves tier {tier!r}")
    weighted = [v for v in candidates if v.weight > 0] or candidates  # all weights zero: uniform
    pool = [v for v in weighted if v.ready] or weighted
    return weighted_choice(pool, [v.weight for v in pool], rng)


def choose_revision(variant: VariantRoute, rng: random.Random) -> RevisionRoute | None:
    """A revision with ready pods, by weight (uniform if their weights are all zero); None when none is ready."""
    ready = [r for r in variant.revisions if r.endpoints]
    if not ready:
        return None
    return weighted_choice(ready, [r.weight for r in ready], rng)


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
