"""Typed settings of the operator, from `LLMFLEET_OPERATOR_*` environment variables and `llmfleet operator` flags.

One validated object decides what the operator watches, how it reaches the cluster, how fast it re-checks, how
worker pods look by default, how far a rollout may go at once, which pods may reach the workers (the
NetworkPolicy peers) and where the drain-token key comes from. Flags win over the environment; a bad value
fails at start-up with a message that names the variable and says how to fix it.

The drain key (`LLMFLEET_OPERATOR_DRAIN_KEY_FILE`, a file the chart mounts from its Secret, or
`LLMFLEET_OPERATOR_DRAIN_KEY`) is read once by `load_drain_key` when the operator starts; the operator derives
every deployment's drain token from it (`controllers.drain_token`) and needs no Secret rights. Without a key it
refuses to start unless `LLMFLEET_OPERATOR_INSECURE_EPHEMERAL_DRAIN_KEY=true` (development only: a random key per
process, so a restarted operator cannot `POST /drain` to the pods its predecessor created; they still drain on
SIGTERM).
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from controllers import PodDefaults, Policy
from controllers.drain_token import MIN_KEY_BYTES
from controllers.network import (
    GATEWAY_POD_LABELS,
    OPERATOR_POD_LABELS,
    SCRAPER_POD_LABELS,
    NetworkPolicySettings,
    Peer,
)

ENV_PREFIX = "LLMFLEET_OPERATOR_"
# Settings holding lists: the environment gives them comma-separated (namespaces) or shell-quoted (arguments).
_LIST_FIELDS = {"namespaces": "comma", "worker_command": "shell", "worker_extra_args": "shell", "worker_env": "shell"}
# Settings holding objects: the environment gives them as JSON.
_JSON_FIELDS = {"network_policy_gateway", "network_policy_operator", "network_policy_scraper"}
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


class SettingsError(ValueError):
    """The settings are invalid; the message lists every problem with its fix."""


class PeerSelector(BaseModel):
    """Pods admitted to the workers by their NetworkPolicy: `podSelector` labels in the namespaces matching
    `namespaceSelector` (absent = the workers' own namespace; `{}` = every namespace). JSON in the environment,
    e.g. `{"namespaceSelector": {"kubernetes.io/metadata.name": "llm"}, "podSelector": {"app": "gateway"}}`."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)

    namespace_selector: dict[str, str] | None = None
    pod_selector: dict[str, str]

    @field_validator("namespace_selector", "pod_selector")
    @classmethod
    def _labels(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        wrong = [f"{k}={v}" for k, v in (value or {}).items() if not (_LABEL_KEY.match(k) and _LABEL_VALUE.match(v))]
        if wrong:
            raise ValueError(
                f"not valid label selectors: {', '.join(wrong)} (use label keys and values, e.g. "
                "app.kubernetes.io/name=prometheus)"
            )
        return value

    def peer(self) -> Peer:
        return Peer(pod_labels=dict(self.pod_selector), namespace_labels=self.namespace_selector)


class OperatorSettings(BaseModel):
    """Everything `llmfleet operator` runs with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch; empty = the whole cluster (needs cluster-wide RBAC)."
    )
    kubeconfig: str | None = Field(
        None, description="kubeconfig file; unset = in-cluster service account, else $KUBECONFIG or ~/.kube/config."
    )
    context: str | None = Field(None, description="kubeconfig context; unset = the current one.")
    prometheus_url: str | None = Field(
        None, description="Prometheus base URL for autoscaling and canary analysis; unset = scrape pods directly."
    )
    resync_seconds: float = Field(
        30.0, gt=0, le=3600, description="Re-check every InferenceDeployment at least this often, events or not."
    )
    error_backoff_seconds: float = Field(
        5.0, gt=0, le=600, description="Wait after a pass that hit API errors before the next one."
    )
    deletion_retry_seconds: float = Field(
        2.0, gt=0, le=600, description="Re-check interval while a deleted InferenceDeployment's pods go away."
    )
    api_timeout_seconds: float = Field(30.0, gt=0, le=600, description="Timeout of one API call.")
    peering: str | None = Field(
        None, description="kopf peering object name for active/standby HA (several replicas); unset = standalone."
    )
    priority: int | None = Field(
        None,
        description="Peering priority of this replica (highest wins); unset = random per process with peering "
        "(kopf pauses replicas of equal priority), else 0.",
    )
    peering_lifetime_seconds: int = Field(
        60,
        ge=5,
        le=3600,
        description="With peering: how long a replica's keep-alive counts; a standby takes over this long after "
        "the active replica died (kopf renews it 5-10 s before it runs out).",
    )
    liveness_endpoint: str | None = Field(
        None, description="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz (unset = none)."
    )
    worker_image: str = Field(PodDefaults().image, min_length=1, description="Worker image unless the CR sets one.")
    worker_command: list[str] = Field(
        default_factory=lambda: list(PodDefaults().command),
        min_length=1,
        description="The worker entrypoint (engine flags follow it), e.g. a wrapper script of a custom image.",
    )
    worker_extra_args: list[str] = Field(
        default_factory=list,
        description="Arguments appended to every worker command (later flags win), e.g. `--engine fake` for "
        "control-plane tests or `--log-level debug`. Changing them rolls every pod.",
    )
    worker_env: list[str] = Field(
        default_factory=list,
        description="Extra NAME=value environment of worker pods (space-separated, shell quoting). Reaches new pods "
        "only: running pods keep theirs until replaced, or until worker_render_epoch is raised.",
    )
    worker_render_epoch: int = Field(
        0, ge=0, le=1_000_000, description="Raise it to roll every worker pod (drained) onto the current rendering."
    )
    worker_cache_dir: str | None = Field(
        PodDefaults().cache_dir,
        description="Writable emptyDir for converted/downloaded models in worker pods; empty = none.",
    )
    startup_timeout_seconds: int = Field(
        PodDefaults().startup_timeout_seconds, ge=10, le=86_400, description="Longest model load (startup probe)."
    )
    max_surge: int = Field(1, ge=0, le=100, description="Extra pods per variant while a revision change rolls.")
    max_unavailable: int = Field(
        0, ge=0, le=100, description="Ready pods a variant may lose at once while it rolls (0 = never below size)."
    )
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="Operator log level.")
    http_host: str = Field(
        "127.0.0.1", min_length=1, description="Bind address of the operator's public HTTP server (/alerts, /healthz)."
    )
    http_port: int = Field(8081, ge=0, le=65_535, description="Port of the operator's HTTP server; 0 = any free port.")
    metrics_host: str = Field(
        "127.0.0.1", min_length=1, description="Bind address of the operator's internal /metrics server."
    )
    metrics_port: int = Field(
        8082, ge=0, le=65_535, description="Port of the internal /metrics server (not the public one); 0 = any free."
    )
    alerts_token: SecretStr | None = Field(
        None, description="Bearer token Alertmanager sends to POST /alerts; unset = alert-driven scaling is off."
    )
    alert_step: int = Field(1, ge=1, le=100, description="Pods a firing alert adds unless it names a step.")
    alert_max_step: int = Field(4, ge=1, le=100, description="Most pods one alert may add (caps its step label).")
    alert_ttl_seconds: float = Field(
        300.0, gt=0, le=86_400, description="An alert's scale-up intent expires this long after it was last received."
    )
    autoscale_interval_seconds: float = Field(
        10.0, gt=0, le=3600, description="How often every InferenceDeployment's autoscaled variants are evaluated."
    )
    wake_interval_seconds: float = Field(
        2.0,
        gt=0,
        le=600,
        description="How often a deployment with a variant at zero checks the gateway for held requests (one cheap "
        "query; a held request wakes the variant at once instead of at the next autoscaling tick).",
    )
    expected_startup_seconds: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="How long a starting worker pod counts as capacity on its way (a bit above a real start-up).",
    )
    gateway_api_key: SecretStr | None = Field(
        None, description="API key sent to the gateway's GET /internal/queued (any key the gateway accepts)."
    )
    gateway_url: str | None = Field(
        None,
        description="Gateway base URL whose GET /internal/queued wakes variants at zero; unset = Prometheus's "
        "llmfleet_gateway_queued_at_zero when configured, else none.",
    )

    drain_key_file: str | None = Field(
        None,
        description="File holding the key drain tokens are derived from (at least 32 bytes; the chart mounts its "
        "Secret here). Read once at start.",
    )
    drain_key: SecretStr | None = Field(
        None, description="The drain-token key itself, when it is not given as a file (at least 32 bytes)."
    )
    insecure_ephemeral_drain_key: bool = Field(
        False,
        description="Development only: start without a drain key, using a random one per process (a restarted "
        "operator then cannot POST /drain to older pods; they still drain on SIGTERM).",
    )
    network_policy: bool = Field(
        True,
        description="Keep a NetworkPolicy per deployment admitting only the gateway, operator and scraper pods to "
        "the workers; false for clusters whose CNI lacks NetworkPolicy (the operator then leaves them alone).",
    )
    network_policy_gateway: PeerSelector = Field(
        PeerSelector(pod_selector=dict(GATEWAY_POD_LABELS)),
        description="The gateway pods (JSON: namespaceSelector, podSelector); default: the chart's gateway labels "
        "in the workers' namespace.",
    )
    network_policy_operator: PeerSelector = Field(
        PeerSelector(pod_selector=dict(OPERATOR_POD_LABELS)),
        description="The operator pods (drain probes, pod scraping); default: the chart's operator labels in the "
        "workers' namespace.",
    )
    network_policy_scraper: PeerSelector = Field(
        PeerSelector(pod_selector=dict(SCRAPER_POD_LABELS), namespace_selector={}),
        description="The metrics scraper's pods; default: app.kubernetes.io/name=prometheus in any namespace.",
    )

    @field_validator("namespaces")
    @classmethod
    def _clean_namespaces(cls, value: list[str]) -> list[str]:
        return sorted({item.strip() for item in value if item.strip()})

    @field_validator("worker_env")
    @classmethod
    def _env_pairs(cls, value: list[str]) -> list[str]:
        wrong = [item for item in value if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", item, flags=re.DOTALL)]
        if wrong:
            raise ValueError(f"expected NAME=value items, e.g. OTEL_SERVICE_NAME=worker; got {', '.join(wrong)}")
        return value

    @field_validator("worker_cache_dir", "gateway_url", "drain_key_file")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None

    def network_policy_settings(self) -> NetworkPolicySettings:
        peers = (self.network_policy_gateway, self.network_policy_operator, self.network_policy_scraper)
        return NetworkPolicySettings(enabled=self.network_policy, peers=tuple(p.peer() for p in peers))

    def load_drain_key(self) -> bytes:
        """The drain-token key: read the file (or take the variable) now. Call once per process: without a key and
        with `insecure_ephemeral_drain_key`, every call makes a new random key. Raises SettingsError saying how to
        provide one."""
        fix = (
            "put at least 32 random bytes in a file and set LLMFLEET_OPERATOR_DRAIN_KEY_FILE to it (the chart "
            "does this from its Secret; e.g. `head -c 48 /dev/urandom | base64 > drain.key`)"
        )
        if self.drain_key_file and self.drain_key is not None:
            raise SettingsError(
                "both LLMFLEET_OPERATOR_DRAIN_KEY_FILE and LLMFLEET_OPERATOR_DRAIN_KEY are set: keep one"
            )
        if self.drain_key_file:
            try:
                key = Path(self.drain_key_file).read_bytes().strip()
            except OSError as error:
                raise SettingsError(
                    f"cannot read LLMFLEET_OPERATOR_DRAIN_KEY_FILE {self.drain_key_file}: {error.strerror}; {fix}"
                ) from None
            where = f"LLMFLEET_OPERATOR_DRAIN_KEY_FILE {self.drain_key_file}"
        elif self.drain_key is not None:
            key, where = self.drain_key.get_secret_value().strip().encode(), "LLMFLEET_OPERATOR_DRAIN_KEY"
        elif self.insecure_ephemeral_drain_key:
            return secrets.token_bytes(MIN_KEY_BYTES)
        else:
            raise SettingsError(
                f"no drain key: {fix}; for development only, "
                "LLMFLEET_OPERATOR_INSECURE_EPHEMERAL_DRAIN_KEY=true uses a random key per process"
            )
        if len(key) < MIN_KEY_BYTES:
            raise SettingsError(f"{where} holds {len(key)} bytes, fewer than {MIN_KEY_BYTES}; {fix}")
        return key

    def pod_defaults(self) -> PodDefaults:
        return PodDefaults(
            image=self.worker_image,
            command=tuple(self.worker_command),
            startup_timeout_seconds=self.startup_timeout_seconds,
            cache_dir=self.worker_cache_dir,
            extra_args=tuple(self.worker_extra_args),
            extra_env=tuple((name, value) for name, _, value in (item.partition("=") for item in self.worker_env)),
            render_epoch=self.worker_render_epoch,
        )

    def policy(self) -> Policy:
        if self.metrics_port and self.metrics_port == self.http_port:
            raise SettingsError(
                f"LLMFLEET_OPERATOR_METRICS_PORT equals LLMFLEET_OPERATOR_HTTP_PORT "
                f"({self.http_port}): /metrics needs its own internal port; choose another, e.g. 8082"
            )
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise SettingsError(
                "max_surge and max_unavailable are both 0, so no pod could ever be replaced: "
                "set LLMFLEET_OPERATOR_MAX_SURGE=1"
            )
        return Policy(
            max_surge=self.max_surge,
            max_unavailable=self.max_unavailable,
            defaults=self.pod_defaults(),
            network=self.network_policy_settings(),
        )

    @classmethod
    def load(cls, env: Mapping[str, str], **flags: Any) -> OperatorSettings:
        """Settings from `LLMFLEET_OPERATOR_*` variables, overridden by `flags` that are not None."""
        values: dict[str, Any] = {}
        known = {name.upper(): name for name in cls.model_fields}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = known.get(key.removeprefix(ENV_PREFIX))
            if name is None:
                expected = ", ".join(ENV_PREFIX + k for k in sorted(known))
                raise SettingsError(f"unknown setting {key}; expected one of {expected}")
            values[name] = _from_env(name, raw)
        values.update({name: value for name, value in flags.items() if value is not None})
        try:
            settings = cls.model_validate(values)
        except ValidationError as error:
            lines = [
                f"{ENV_PREFIX}{'.'.join(str(p) for p in e['loc']).upper()} (or its flag): "
                f"{str(e['msg']).removeprefix('Value error, ')}"
                for e in error.errors()
            ]
            raise SettingsError("invalid operator settings:\n  " + "\n  ".join(lines)) from None
        settings.policy()  # cross-field checks
        return settings


def _from_env(name: str, raw: str) -> Any:
    if name in _JSON_FIELDS:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as error:
            raise SettingsError(
                f"{ENV_PREFIX}{name.upper()} is not JSON ({error}); expected e.g. "
                '{"namespaceSelector": {}, "podSelector": {"app.kubernetes.io/name": "prometheus"}}'
            ) from None
    kind = _LIST_FIELDS.get(name)
    if kind == "comma":
        return [part for part in raw.split(",") if part.strip()]
    if kind == "shell":
        stripped = raw.strip()
        return json.loads(stripped) if stripped.startswith("[") else shlex.split(stripped)
    return raw
