"""The status of an InferenceDeployment, written only by the operator: sizes, conditions, rollout and analysis,
autoscaler state, drains and the gateway's routing groups. All durable state lives here, so an operator restart
resumes any rollout or drain.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import AwareDatetime, Field

from crds.base import FreeForm, StatusModel, list_map
from crds.spec import Quantization


class Phase(StrEnum):
    """Summary of the deployment's state (the `Phase` printer column)."""

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    AVAILABLE = "Available"
    DEGRADED = "Degraded"
    INVALID_SPEC = "InvalidSpec"
    SCALED_TO_ZERO = "ScaledToZero"
    TERMINATING = "Terminating"


class ConditionType(StrEnum):
    """Condition types the operator sets."""

    AVAILABLE = "Available"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    INVALID_SPEC = "InvalidSpec"
    READY = "Ready"  # kstatus: the spec's revision serves all its replicas and nothing is pending
    RECONCILING = "Reconciling"  # kstatus, abnormal-true: a rollout, drain or scale is under way
    STALLED = "Stalled"  # kstatus, abnormal-true: no progress without a fix (invalid spec, rollback, stuck pods)
    ADAPTERS_READY = "AdaptersReady"  # every adapter of the spec is loaded in every pod that serves adapters


class ConditionStatus(StrEnum):
    """Status of a condition."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: str = Field(
        min_length=1,
        max_length=316,
        description="Condition type: " + ", ".join(f"`{t.value}`" for t in ConditionType) + ".",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field("", max_length=1024, description="CamelCase reason of the last transition.")
    message: str = Field("", max_length=32_768, description="Human-readable details.")
    last_transition_time: AwareDatetime = Field(description="When the status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="Generation the condition was computed from.")


class RevisionReplicas(StatusModel):
    """Pods of one revision of a variant."""

    revision: str = Field(description="Revision hash of the pod-relevant spec.")
    replicas: int = Field(0, ge=0, description="Pods of this revision (not counting draining ones).")
    ready_replicas: int = Field(0, ge=0, description="Ready pods of this revision.")
    desired_replicas: int = Field(0, ge=0, description="Pods this revision should have.")


class VariantStatus(StatusModel):
    """Observed size of one variant."""

    name: str = Field(description="Variant name.")
    replicas: int = Field(0, ge=0, description="Pods of the variant (not counting draining ones).")
    ready_replicas: int = Field(0, ge=0, description="Ready pods.")
    desired_replicas: int = Field(
        0, ge=0, description="Pods wanted (fixed size, share of spec.replicas, or the autoscaler's choice)."
    )
    draining_replicas: int = Field(0, ge=0, description="Pods being drained.")
    revisions: list[RevisionReplicas] = Field(
        default_factory=list,
        max_length=8,
        description="Pods per revision (stable and canary during a rollout).",
        json_schema_extra=list_map("revision"),
    )


class RolloutPhase(StrEnum):
    """Where a canary rollout stands."""

    STABLE = "Stable"
    PROGRESSING = "Progressing"
    PROMOTING = "Promoting"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"


class Verdict(StrEnum):
    """Outcome of one analysis check."""

    PASS = "Pass"
    FAIL = "Fail"
    INCONCLUSIVE = "Inconclusive"


class AnalysisResult(StatusModel):
    """One canary analysis check: the measured values and the verdict."""

    time: AwareDatetime = Field(description="When the check ran.")
    step: int = Field(ge=0, description="Step index during the check.")
    verdict: Verdict = Field(description="Pass, Fail or Inconclusive (missing data is never a pass).")
    ttft_p95_ratio: float | None = Field(None, ge=0, description="Canary / stable TTFT p95.")
    itl_p95_ratio: float | None = Field(None, ge=0, description="Canary / stable inter-token latency p95.")
    error_rate: float | None = Field(None, ge=0, le=1, description="Canary error rate.")
    quality_agreement: float | None = Field(None, ge=0, le=1, description="Greedy token agreement with stable.")
    canary_requests: int | None = Field(None, ge=0, description="Canary requests seen in the interval.")
    message: str = Field("", max_length=4096, description="Why this verdict.")


class RolloutStatus(StatusModel):
    """Revisions and canary progress. All durable rollout state: an operator restart resumes from here."""

    phase: RolloutPhase = Field(
        RolloutPhase.STABLE, description="Stable, Progressing, Promoting, RollingBack or RolledBack."
    )
    stable_revision: str | None = Field(None, description="Revision hash serving as stable.")
    canary_revision: str | None = Field(None, description="Revision hash under test, if any.")
    rejected_revision: str | None = Field(
        None, description="Revision last rolled back; not tried again until the spec changes."
    )
    step: int = Field(0, ge=0, description="Index of the current canary step.")
    canary_weight: int = Field(0, ge=0, le=100, description="Percent of traffic on the canary now.")
    started_at: AwareDatetime | None = Field(None, description="When the rollout began.")
    step_started_at: AwareDatetime | None = Field(None, description="When the current step began.")
    canary_metrics_since: AwareDatetime | None = Field(
        None,
        description="When the running canary's metrics series first appeared: its analysis clock starts then "
        "(unset while the operator waits for them; no check runs on no data).",
    )
    consecutive_failures: int = Field(0, ge=0, description="Failed analysis checks in a row.")
    analysis: list[AnalysisResult] = Field(
        default_factory=list, max_length=20, description="Latest analysis checks, oldest first (bounded)."
    )
    reason: str = Field("", max_length=1024, description="CamelCase reason of the last phase change.")
    message: str = Field("", max_length=32_768, description="Why the rollout is where it is.")
    stable_spec: FreeForm | None = Field(
        None,
        description="Snapshot of the stable revision's pod-relevant spec, so its pods can be recreated while a "
        "canary runs.",
    )


class MetricInputs(StatusModel):
    """Signal values a scaling decision was computed from (unset = not available)."""

    queue_depth_per_replica: float | None = Field(None, ge=0, description="Mean waiting requests per ready pod.")
    kv_cache_utilization: float | None = Field(None, ge=0, description="Mean KV-cache usage fraction.")
    ttft_p95_seconds: float | None = Field(None, ge=0, description="TTFT p95, seconds.")
    gateway_queued: int | None = Field(None, ge=0, description="Requests held at the gateway while at zero.")


class DecisionTrigger(StrEnum):
    """What caused a scaling decision."""

    TIMER = "Timer"
    ALERT = "Alert"
    WAKE = "Wake"


class ScaleDecision(StatusModel):
    """One autoscaling decision, kept so `kubectl describe` explains the fleet's size."""

    time: AwareDatetime = Field(description="When it was decided.")
    trigger: DecisionTrigger = Field(DecisionTrigger.TIMER, description="Timer, Alert or Wake.")
    current_replicas: int = Field(ge=0, description="Pods before the decision.")
    ready_replicas: int = Field(0, ge=0, description="Ready pods before the decision.")
    starting_replicas: int = Field(0, ge=0, description="Pods starting (counted as capacity on its way).")
    desired_replicas: int = Field(ge=0, description="Pods decided.")
    inputs: MetricInputs = Field(default_factory=MetricInputs, description="Signal values used.")
    reason: str = Field("", max_length=4096, description="Why this size.")


class Recommendation(StatusModel):
    """A recommendation inside the scale-down stabilisation window."""

    time: AwareDatetime = Field(description="When it was recommended.")
    replicas: int = Field(ge=0, description="Recommended pods.")


class AlertIntent(StatusModel):
    """A bounded scale-up floor requested by an Alertmanager alert; it expires."""

    alert: str = Field(min_length=1, max_length=256, description="Alert name.")
    fingerprint: str | None = Field(None, max_length=256, description="Alertmanager fingerprint.")
    replicas: int = Field(ge=0, description="Pods to keep at least while the intent lives.")
    received_at: AwareDatetime = Field(description="When the alert arrived.")
    expires_at: AwareDatetime = Field(description="When the intent lapses.")
    reason: str = Field("", max_length=4096, description="Summary from the alert.")


class VariantAutoscalingStatus(StatusModel):
    """Durable autoscaler state of one variant (restarts keep windows and intents)."""

    name: str = Field(description="Variant name.")
    desired_replicas: int | None = Field(None, ge=0, description="Latest size the autoscaler chose.")
    last_scale_time: AwareDatetime | None = Field(None, description="When the size last changed.")
    idle_since: AwareDatetime | None = Field(None, description="Since when no requests arrived (scale to zero).")
    last_decisions: list[ScaleDecision] = Field(
        default_factory=list, max_length=10, description="Latest decisions, oldest first (bounded)."
    )
    recommendations: list[Recommendation] = Field(
        default_factory=list,
        max_length=1024,
        description="Scale-down stabilisation window, oldest first; a record can be dropped once a later one "
        "is at least as high.",
    )
    alert_intents: list[AlertIntent] = Field(
        default_factory=list, max_length=16, description="Live alert-driven scale-up intents."
    )


class AutoscalingStatus(StatusModel):
    """Autoscaler state per variant."""

    variants: list[VariantAutoscalingStatus] = Field(
        default_factory=list,
        max_length=16,
        description="One entry per autoscaled variant.",
        json_schema_extra=list_map("name"),
    )


class DrainReason(StrEnum):
    """Why a pod is drained."""

    SCALE_DOWN = "ScaleDown"
    ROLLOUT = "Rollout"
    REPLACE = "Replace"
    DELETION = "Deletion"


class DrainStatus(StatusModel):
    """A drain in progress (resumed after an operator restart)."""

    pod: str = Field(min_length=1, max_length=253, description="Pod being drained.")
    variant: str | None = Field(None, description="Its variant.")
    revision: str | None = Field(None, description="Its revision.")
    reason: DrainReason = Field(DrainReason.SCALE_DOWN, description="ScaleDown, Rollout, Replace or Deletion.")
    started_at: AwareDatetime = Field(description="When draining began.")
    deadline: AwareDatetime = Field(description="When the pod is deleted even with requests in flight.")
    in_flight: int | None = Field(None, ge=0, description="Requests in flight at the last poll.")


class Endpoint(StatusModel):
    """A routing group for the gateway: the pods of one (revision, variant) and their traffic weight."""

    variant: str = Field(description="Variant name (label `llmfleet.io/variant`).")
    revision: str = Field(description="Revision hash (label `llmfleet.io/revision`).")
    weight: int = Field(0, ge=0, description="Relative share of untiered requests (share = weight / sum).")
    tiers: list[str] = Field(default_factory=list, description="Request tiers served first.")
    quantization: Quantization = Field(Quantization.NONE, description="Quantization of these pods.")
    canary: bool = Field(False, description="Whether this is the canary revision.")


class AdapterPodState(StrEnum):
    """Where one adapter stands in one pod."""

    LOADED = "Loaded"  # the worker serves it
    LOADING = "Loading"  # a load was sent; the worker has not shown it yet
    FAILED = "Failed"  # the worker refused it (see message); retried with back-off, or at once when the source changes


class AdapterPodStatus(StatusModel):
    """One adapter in one pod."""

    pod: str = Field(min_length=1, max_length=253, description="Pod name.")
    state: AdapterPodState = Field(description="Loaded, Loading or Failed.")
    source: str = Field("", max_length=512, description="The source loaded (or tried) in this pod.")
    message: str = Field("", max_length=4096, description="Why the last load failed.")
    attempts: int = Field(0, ge=0, description="Loads tried for this source since the last success.")
    last_attempt_time: AwareDatetime | None = Field(None, description="When the last load was sent.")


class AdapterStatus(StatusModel):
    """Readiness of one adapter of `spec.adapters`, per pod. The gateway routes `MODEL:ADAPTER` to the pods listed
    here as Loaded."""

    name: str = Field(description="Adapter name.")
    source: str = Field("", description="Its source in the spec.")
    ready_replicas: int = Field(0, ge=0, description="Pods that serve it from this source.")
    pods: list[AdapterPodStatus] = Field(
        default_factory=list,
        max_length=1000,
        description="One entry per pod that serves adapters.",
        json_schema_extra=list_map("pod"),
    )


class InferenceDeploymentStatus(StatusModel):
    """Observed state, written only by the operator. Autoscaled sizes live here, so GitOps never fights them."""

    observed_generation: int | None = Field(None, ge=0, description="Generation last reconciled.")
    phase: Phase = Field(Phase.PENDING, description="Summary state.")
    replicas: int = Field(0, ge=0, description="All pods (not counting draining ones); the scale subresource's count.")
    ready_replicas: int = Field(0, ge=0, description="Ready pods.")
    desired_replicas: int = Field(0, ge=0, description="Pods wanted over all variants.")
    label_selector: str | None = Field(None, description="Selector of the pods (for the scale subresource).")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Available, Progressing, Degraded, InvalidSpec.",
        json_schema_extra=list_map("type"),
    )
    variants: list[VariantStatus] = Field(
        default_factory=list, max_length=16, description="Per-variant sizes.", json_schema_extra=list_map("name")
    )
    rollout: RolloutStatus = Field(default_factory=RolloutStatus, description="Revisions and canary progress.")
    autoscaling: AutoscalingStatus = Field(default_factory=AutoscalingStatus, description="Autoscaler state.")
    drains: list[DrainStatus] = Field(
        default_factory=list, max_length=256, description="Drains in progress.", json_schema_extra=list_map("pod")
    )
    endpoints: list[Endpoint] = Field(
        default_factory=list, max_length=64, description="Routing groups and weights for the gateway."
    )
    adapters: list[AdapterStatus] = Field(
        default_factory=list,
        max_length=256,
        description="Per adapter of `spec.adapters`: the pods that serve it.",
        json_schema_extra=list_map("name"),
    )
    last_valid_spec: FreeForm | None = Field(
        None,
        description="The last spec that passed validation. While a later edit is invalid (see the InvalidSpec "
        "condition), the fleet keeps running this one: failed pods are replaced, autoscaling and rollouts go on.",
    )
