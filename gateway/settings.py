"""Typed gateway configuration.

One pydantic model holds every knob of the gateway (timeouts, connection pool, routing, tiers, rate limits,
scale-to-zero hold), so the CLI, a config file and tests all build the same validated object and a bad value
fails at start-up with a message that says how to fix it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierSettings(_Strict):
    """A priority tier: its per-key rate limits and how it is treated when the gateway is saturated."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$", description="Tier name, e.g. premium, standard, batch.")
    priority: int = Field(description="Higher serves first; a key may lower its tier by header, never raise it.")
    requests_per_minute: float | None = Field(
        default=None, gt=0, description="Per-key request rate limit; unset means unlimited."
    )
    tokens_per_minute: float | None = Field(
        default=None,
        gt=0,
        description="Per-key token rate limit: a request reserves its prompt estimate plus max_tokens (or the rest of "
        "the context) at admission and is settled from the worker's usage; unset = none.",
    )
    max_concurrent_requests: int | None = Field(
        default=64, ge=1, description="Requests one API key may have in progress at once (429 above); unset = no cap."
    )
    bypass_queue: bool = Field(
        default=False, description="Admitted at once even when the gateway is saturated (max_in_flight reached)."
    )
    shed_above_in_flight: int | None = Field(
        default=None,
        ge=0,
        description="Reject (503) at once when the gateway's in-flight count is at or above this; unset = never shed.",
    )


def _default_tiers() -> tuple[TierSettings, ...]:
    return (
        TierSettings(
            name="premium",
            priority=20,
            bypass_queue=True,
            requests_per_minute=10_000,
            tokens_per_minute=5_000_000,
            max_concurrent_requests=256,
        ),
        TierSettings(
            name="standard",
            priority=10,
            requests_per_minute=3_000,
            tokens_per_minute=1_000_000,
            max_concurrent_requests=64,
        ),
        TierSettings(
            name="batch",
            priority=0,
            shed_above_in_flight=3072,
            requests_per_minute=3_000,
            tokens_per_minute=2_000_000,
            max_concurrent_requests=128,
        ),
    )


class TimeoutSettings(_Strict):
    """Upstream timeouts in seconds (httpx semantics)."""

    connect: float = Field(default=5.0, gt=0, description="TCP connect to a worker.")
    first_byte: float = Field(
        default=300.0, gt=0, description="From sending the request to the worker's first response byte (queue+TTFT)."
    )
    read: float = Field(default=60.0, gt=0, description="Between two chunks of a streamed response.")
    write: float = Field(default=30.0, gt=0, description="Sending the request body to the worker.")
    pool: float = Field(default=30.0, gt=0, description="Waiting for a free connection in the pool.")


class PoolSettings(_Strict):
    """The shared upstream httpx connection pool."""

    max_connections: int = Field(
        default=4096,
        ge=1,
        description="Upstream connections in use at once (all pods); more requests wait (pool timeout).",
    )
    max_keepalive_connections: int = Field(default=512, ge=0, description="Idle connections kept for reuse.")
    keepalive_expiry: float = Field(default=30.0, gt=0, description="Seconds an idle upstream connection is kept.")


class GatewaySettings(_Strict):
    """Everything the gateway needs besides its backends and keys."""

    host: str = Field(default="127.0.0.1", description="Listen address.")
    port: int = Field(default=8080, ge=0, le=65535, description="Listen port (0 picks a free one).")
    metrics_host: str = Field(
        default="127.0.0.1", min_length=1, description="Listen address of the internal /metrics server."
    )
    metrics_port: int | None = Field(
        default=9090,
        ge=0,
        le=65535,
        description="Internal port of /metrics (never the public port: its series name pods and namespaces); "
        "0 picks a free one, null serves no metrics.",
    )
    allow_open_mode: bool = Field(
        default=False,
        description="Accept every request without an API key (one shared identity at the default tier). Only for "
        "a development gateway on a trusted machine; with it, no key source may be given.",
    )
    limit_replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Gateway replicas that share each key's limits (its tier's requests and tokens per minute and "
        "requests at a time, and adapters' tokensPerMinute). Each replica enforces 1/N of every limit, so together "
        "they hold it whatever replica a connection lands on; a client on one keep-alive connection then reaches "
        "1/N of its limit, and a cap on requests at a time below N is 1 per replica. The chart sets it to "
        "gateway.replicaCount.",
    )
    timeouts: TimeoutSettings = TimeoutSettings()
    pool: PoolSettings = PoolSettings()
    max_attempts: int = Field(
        default=3, ge=1, le=16, description="Upstream attempts per request; retries happen only before the first byte."
    )
    default_max_model_len: int = Field(
        default=32_768,
        ge=16,
        le=1_048_576,
        description="Context length assumed for a model whose InferenceDeployment sets no spec.model.maxModelLen "
        "(static mode: every model): a request without max_tokens reserves this minus its prompt.",
    )
    affinity_prefix_chars: int = Field(
        default=256, ge=0, description="Leading characters of the rendered prompt hashed for prefix affinity (0=off)."
    )
    load_factor: float = Field(
        default=1.25, ge=1.0, description="Bounded-load cap c: a pod takes a request while outstanding <= c * mean."
    )
    tiers: tuple[TierSettings, ...] = Field(default_factory=_default_tiers, min_length=1)
    default_tier: str = Field(default="standard", description="Tier of keys (and open mode) that name none.")
    max_in_flight: int = Field(
        default=4096, ge=1, description="Gateway saturation point: above it non-bypass tiers wait in a priority queue."
    )
    admission_queue_size: int = Field(default=4096, ge=0, description="Requests allowed to wait for admission.")
    admission_wait_seconds: float = Field(default=30.0, gt=0, description="Longest wait for admission, then 503.")
    zero_hold_queue_size: int = Field(
        default=256, ge=0, description="Requests held per (deployment, variant) while it has no ready pod."
    )
    zero_hold_seconds: float = Field(
        default=120.0, gt=0, description="Longest hold for a variant scaled to zero to get a ready pod, then 503."
    )
    health_interval_seconds: float = Field(default=2.0, gt=0, description="Static mode: GET /ready period.")
    health_timeout_seconds: float = Field(default=2.0, gt=0, description="Static mode: timeout of one GET /ready.")
    retry_after_seconds: int = Field(default=1, ge=1, description="Retry-After sent with the gateway's own 503s.")
    shutdown_grace_seconds: float = Field(
        default=30.0, ge=0, description="On SIGTERM, how long streams in progress may finish before they are cut."
    )
    seed: int | None = Field(default=None, description="Seed of the routing randomness (tests); unset = random.")

    @field_validator("tiers")
    @classmethod
    def _unique_tiers(cls, tiers: tuple[TierSettings, ...]) -> tuple[TierSettings, ...]:
        names = [t.name for t in tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique; repeated: {', '.join(dupes)}")
        return tiers

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.default_tier not in {t.name for t in self.tiers}:
            known = ", ".join(t.name for t in self.tiers)
            raise ValueError(f"default_tier {self.default_tier!r} is not a configured tier (known: {known})")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(
                f"metrics_port equals port ({self.port}): /metrics needs its own internal port; choose another, "
                "e.g. 9090"
            )
        if self.pool.max_keepalive_connections > self.pool.max_connections:
            raise ValueError("pool.max_keepalive_connections must be <= pool.max_connections")
        return self

    def tier(self, name: str) -> TierSettings:
        """The tier called `name` (KeyError if unknown)."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @classmethod
    def from_file(cls, path: Path, **overrides: object) -> GatewaySettings:
        """Load YAML/JSON settings, then apply non-None overrides (CLI options win over the file)."""
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ValueError(f"cannot read gateway config {path}: {e.strerror}") from e
        if not isinstance(data, dict):
            raise ValueError(f"gateway config {path} must be a mapping of settings, got {type(data).__name__}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
