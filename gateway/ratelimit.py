"""Per-key token-bucket rate limits (requests/minute and tokens/minute), with time passed in.

Each API key gets two buckets sized by its tier: one request per call, and tokens charged twice: the prompt's
estimate up front (`estimate_prompt_tokens`: characters / 4, the usual rule of thumb for English BPE tokenizers)
and the output tokens as they stream (each SSE `data:` event counts one token, as workers emit one event per
token). A bucket holds at most one minute of its limit, refills continuously and may go into debt when streamed
output exceeds what was left; a debt simply delays the key's next request. A request whose prompt estimate alone
exceeds a full bucket is admitted when the bucket is full, so an oversized prompt is slow rather than impossible.

The 429 answer carries `Retry-After` (whole seconds) and OpenAI's `x-ratelimit-*` headers; admitted answers carry
the same headers so clients can pace themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.settings import TierSettings


def estimate_prompt_tokens(prompt: str) -> int:
    """Up-front token estimate of a request: ceil(chars / 4) of the prompt, at least 1 (output is charged later)."""
    return max(1, math.ceil(len(prompt) / 4))


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
        """Debit unconditionally (the level may go negative)."""
        self.refill(now)
        self.level -= amount

    def remaining(self, now: float) -> int:
        self.refill(now)
        return max(0, math.floor(self.level))

    def reset_seconds(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self.refill(now)
        return max(0.0, (self.capacity - self.level) / self.rate)


@dataclass(slots=True)
class KeyBuckets:
    """The buckets of one API key (None where its tier sets no limit)."""

    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of a rate-limit check: allowed or not, what ran out, when to retry, headers to send."""

    allowed: bool
    limit: str | None  # "requests" or "tokens" when rejected
    retry_after: float
    headers: dict[str, str]


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
    """All keys' buckets. One instance per gateway app (no module state); keys are bounded by the key store."""

    buckets: dict[str, KeyBuckets] = field(default_factory=dict)

    def _buckets(self, key_id: str, tier: TierSettings, now: float) -> KeyBuckets:
        b = self.buckets.get(key_id)
        if b is None:
            b = KeyBuckets(
                requests=TokenBucket.per_minute(tier.requests_per_minute, now) if tier.requests_per_minute else None,
                tokens=TokenBucket.per_minute(tier.tokens_per_minute, now) if tier.tokens_per_minute else None,
            )
            self.buckets[key_id] = b
        return b

    def check(self, key_id: str, tier: TierSettings, prompt_tokens: int, now: float) -> Verdict:
        """Take one request and the prompt estimate if both fit; otherwise reject and take nothing."""
        b = self._buckets(key_id, tier, now)
        wait_req = b.requests.wait_for(1, now) if b.requests else 0.0
        wait_tok = b.tokens.wait_for(prompt_tokens, now) if b.tokens else 0.0
        if wait_req > 0 or wait_tok > 0:
            limit = "requests" if wait_req >= wait_tok else "tokens"
            retry = max(wait_req, wait_tok)
            headers = _headers(b, now)
            headers["retry-after"] = str(max(1, math.ceil(retry)))
            return Verdict(False, limit, retry, headers)
        if b.requests:
            b.requests.take(1, now)
        if b.tokens:
            b.tokens.take(prompt_tokens, now)
        return Verdict(True, None, 0.0, _headers(b, now))

    def charge_tokens(self, key_id: str, tier: TierSettings, tokens: int, now: float) -> None:
        """Charge streamed output tokens (may put the key into debt)."""
        if tokens <= 0:
            return
        b = self._buckets(key_id, tier, now)
        if b.tokens:
            b.tokens.take(tokens, now)

    def forget_except(self, key_ids: set[str]) -> None:
        """Drop buckets of keys no longer configured (after a key-store reload)."""
        for k in [k for k in self.buckets if k not in key_ids]:
            del self.buckets[k]
