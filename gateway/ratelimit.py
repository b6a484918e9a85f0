"""Per-key limits: requests/minute and tokens/minute token buckets and a cap on requests at a time, with time
passed in; and what one request may cost, bounded before it is trusted.

A request is admitted only if its whole possible cost fits: one request, and a token reservation of the prompt's
estimate (`estimate_prompt_tokens`: characters / 4, the usual rule of thumb for English BPE tokenizers; token-id
prompts count their ids) plus every output token it may generate (`max_tokens`, or when absent the rest of the
model's context, times the choices asked for: `request_cost`). A key's concurrent requests are capped too. When
the answer is done the reservation is settled (`settle`) from the worker's `usage` and the unused part refunded;
when no usage arrives (the client left, the stream broke) the reservation stands: fail safe, never a free ride.

A bucket holds at most one minute of its limit, refills continuously and may go into debt when usage exceeds the
reservation; a debt simply delays the key's next request. A reservation larger than a full bucket is admitted
when the bucket is full (then it is in debt), so an oversized request is slow rather than impossible, and the
key's other requests wait until the debt is paid.

The 429 answer carries `Retry-After` (whole seconds) and OpenAI's `x-ratelimit-*` headers; admitted answers carry
the same headers (after the reservation) so clients can pace themselves.

A LoRA adapter's `tokensPerMinute` is one more token bucket, shared by every key that calls that adapter of that
deployment (`RateLimiter.adapters`, by (namespace, deployment, adapter)): the same reservation is taken from it at
admission and settled with the key's, so one busy fine-tune cannot crowd out the base model and the other adapters.
`sync_adapters` follows the routing table: a new limit gets a full bucket, a changed one applies to the bucket in
place (its level capped at the new size), an unchanged one keeps its level, a removed one goes.

Every limit is shared by the gateway's `replicas` (settings `limit_replicas`; the chart passes its replica count):
each process keeps its own buckets and counts, so each enforces 1/N of every rate (`replica_share`) and of the cap
on requests at a time (`replica_cap`, at least 1). Together the replicas then never admit more than the limit,
whichever replica kube-proxy hands each connection; the price is that a client whose requests all reach one
replica gets 1/N of its limit. Sharing live counts between replicas would lift that and is not built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.settings import TierSettings

CONCURRENCY = "concurrent requests"  # Verdict.limit when the key's cap on requests at a time is reached
ADAPTER_TOKENS = "adapter tokens"  # Verdict.limit when the adapter's shared token bucket is short

AdapterKey = tuple[str, str, str]  # (namespace, deployment, adapter)


def replica_share(limit: float, replicas: int) -> float:
    """One replica's part of a per-minute limit that `replicas` gateway processes enforce together."""
    return limit / replicas


def replica_cap(cap: int, replicas: int) -> int:
    """One replica's part of a cap on requests at a time: the floor of an even share, but at least 1 (a replica
    that admitted nothing would refuse the key outright), so a cap below `replicas` holds only to `replicas`."""
    return max(1, cap // replicas)


def estimate_prompt_tokens(prompt: str) -> int:
    """Up-front token estimate of a request: ceil(chars / 4) of the prompt, at least 1 (output is charged later)."""
    return max(1, math.ceil(len(prompt) / 4))


class CostError(ValueError):
    """A number in the request that bounds its cost is not a positive integer (400, naming the field)."""

    def __init__(self, param: str, value: object) -> None:
        super().__init__(f"`{param}` must be a positive integer, got {value!r}")
        self.param = param


@dataclass(frozen=True, slots=True)
class Cost:
    """The most one request may cost in tokens: prompt estimate plus every output token it may generate."""

    prompt_tokens: int
    output_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.output_tokens


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CostError(name, value)
    return value


def _prompts(body: Mapping[str, Any], prompt_text: str) -> list[int]:
    """Token estimate of each prompt the request carries (a completions batch has several)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [estimate_prompt_tokens(p) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [max(1, len(prompt))]
        if all(isinstance(p, list) for p in prompt):
            return [max(1, len(p)) for p in prompt]
    return [estimate_prompt_tokens(prompt_text)]


def request_cost(body: Mapping[str, Any], prompt_text: str, max_model_len: int) -> Cost:
    """The reservation of one request: each prompt's estimate, plus for each prompt and choice its output bound
    (`max_completion_tokens` or `max_tokens`, else the context left after the prompt; never above the model's
    context). Raises CostError for a bound that is not a positive integer."""
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    choices = max(_positive_int(body, "n") or 1, _positive_int(body, "best_of") or 1)
    prompts = _prompts(body, prompt_text)
    output = 0
    for p in prompts:
        bound = max_tokens if max_tokens is not None else max(1, max_model_len - p)
        output += min(bound, max_model_len) * choices
    return Cost(prompt_tokens=sum(prompts), output_tokens=output)


def format_reset(seconds: float) -> str:
    """Duration in OpenAI's header style: `120ms`, `1.5s`, `6m0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs}s"


@dataclass(slots=True)
class TokenBucket:
    """A continuously refilling bucket: `capacity` units, `rate` units per second, possibly negative (debt)."""

    capacity: float
    rate: float
    level: float
    updated: float

    @classmethod
    def per_minute(cls, limit: float, now: float) -> TokenBucket:
        return cls(capacity=limit, rate=limit / 60.0, level=limit, updated=now)

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` (capped at capacity) is available; 0 when it is now."""
        self.refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        """Debit unconditionally (the level may go negative); a negative amount credits, up to the capacity."""
        self.refill(now)
        self.level = min(self.capacity, self.level - amount)

    def remaining(self, now: float) -> int:
        self.refill(now)
        return max(0, math.floor(self.level))

    def reset_seconds(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self.refill(now)
        return max(0.0, (self.capacity - self.level) / self.rate)

    def resize(self, limit: float, now: float) -> None:
        """A new per-minute limit, in place (reservations hold the bucket): the level is kept, capped at it."""
        self.refill(now)
        self.capacity, self.rate = limit, limit / 60.0
        self.level = min(self.level, limit)


@dataclass(slots=True)
class KeyBuckets:
    """The buckets of one API key (None where its tier sets no limit) and its requests in progress."""

    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


@dataclass(slots=True)
class Reservation:
    """What an admitted request holds until `RateLimiter.settle`: a slot of its key, `tokens` of its bucket and
    `shared_tokens` of its adapter's shared bucket (None: no adapter limit)."""

    buckets: KeyBuckets
    tokens: int
    shared: TokenBucket | None = None
    shared_tokens: int = 0
    settled: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of admission: allowed (with the reservation to settle) or not, what ran out, when to retry, headers."""

    allowed: bool
    limit: str | None  # "requests", "tokens", ADAPTER_TOKENS or CONCURRENCY when rejected
    retry_after: float
    headers: dict[str, str]
    reservation: Reservation | None = None


def _headers(b: KeyBuckets, now: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, bucket in (("requests", b.requests), ("tokens", b.tokens)):
        if bucket is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(math.floor(bucket.capacity))
            headers[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining(now))
            headers[f"x-ratelimit-reset-{name}"] = format_reset(bucket.reset_seconds(now))
    return headers


@dataclass
class RateLimiter:
    """All keys' buckets and the adapters' shared ones. One instance per gateway app (no module state); keys are
    bounded by the key store, adapters by the routing table (`sync_adapters`)."""

    buckets: dict[str, KeyBuckets] = field(default_factory=dict)
    adapters: dict[AdapterKey, TokenBucket] = field(default_factory=dict)
    replicas: int = 1  # gateway processes that enforce every limit together (see the module docstring)

    def _per_minute(self, limit: float | None, now: float) -> TokenBucket | None:
        return TokenBucket.per_minute(replica_share(limit, self.replicas), now) if limit else None

    def _buckets(self, key_id: str, tier: TierSettings, now: float) -> KeyBuckets:
        b = self.buckets.get(key_id)
        if b is None:
            b = KeyBuckets(
                requests=self._per_minute(tier.requests_per_minute, now),
                tokens=self._per_minute(tier.tokens_per_minute, now),
            )
            self.buckets[key_id] = b
        return b

    def admit(
        self, key_id: str, tier: TierSettings, tokens: int, now: float, shared: TokenBucket | None = None
    ) -> Verdict:
        """Take a slot, one request and a reservation of `tokens` (from the key's bucket and from `shared`, the
        request's adapter bucket, when given) if all fit; otherwise reject and take nothing."""
        b = self._buckets(key_id, tier, now)
        cap = tier.max_concurrent_requests
        if cap is not None and b.in_flight >= replica_cap(cap, self.replicas):
            headers = _headers(b, now)
            headers["retry-after"] = "1"
            return Verdict(False, CONCURRENCY, 1.0, headers)
        wait_req = b.requests.wait_for(1, now) if b.requests else 0.0
        wait_tok = b.tokens.wait_for(tokens, now) if b.tokens else 0.0
        wait_shared = shared.wait_for(tokens, now) if shared is not None else 0.0
        if wait_req > 0 or wait_tok > 0 or wait_shared > 0:
            retry = max(wait_req, wait_tok, wait_shared)  # the longest wait names the limit (ties: in this order)
            limit = "requests" if wait_req == retry else "tokens" if wait_tok == retry else ADAPTER_TOKENS
            headers = _headers(b, now)
            headers["retry-after"] = str(max(1, math.ceil(retry)))
            return Verdict(False, limit, retry, headers)
        if b.requests:
            b.requests.take(1, now)
        if b.tokens:
            b.tokens.take(tokens, now)
        if shared is not None:
            shared.take(tokens, now)
        b.in_flight += 1
        reservation = Reservation(b, tokens if b.tokens else 0, shared, tokens if shared is not None else 0)
        return Verdict(True, None, 0.0, _headers(b, now), reservation)

    def settle(self, reservation: Reservation, used: int | None, now: float) -> None:
        """End a request: free its slot and charge `used` tokens instead of the reservation (refunding the rest, or
        charging the excess); `used=None` (no usage arrived) keeps the whole reservation. Idempotent."""
        if reservation.settled:
            return
        reservation.settled = True
        b = reservation.buckets
        b.in_flight -= 1
        if used is None:
            return
        if b.tokens is not None:
            b.tokens.take(used - reservation.tokens, now)
        if reservation.shared is not None:
            reservation.shared.take(used - reservation.shared_tokens, now)

    def sync_adapters(self, limits: Mapping[AdapterKey, int], now: float) -> None:
        """Adapter buckets for exactly `limits` (tokens per minute by adapter; see the module docstring)."""
        for key in [k for k in self.adapters if k not in limits]:
            del self.adapters[key]
        for key, full in limits.items():
            limit = replica_share(full, self.replicas)
            bucket = self.adapters.get(key)
            if bucket is None:
                self.adapters[key] = TokenBucket.per_minute(limit, now)
            elif bucket.capacity != limit:
                bucket.resize(limit, now)

    def forget_except(self, key_ids: set[str]) -> None:
        """Drop buckets of keys no longer configured (after a key-store reload)."""
        for k in [k for k in self.buckets if k not in key_ids]:
            del self.buckets[k]
