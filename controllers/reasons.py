"""Every reason a user of the fleet reads, as one `StrEnum`.

Why it exists: the reasons written into status conditions (`kubectl describe infd`, `kubectl get infd -o yaml`),
into Kubernetes Events (`kubectl get events`), into `status.rollout.reason` and into a pod's drain annotation
are an API: alerts, dashboards, runbooks and GitOps health checks match on them. Spelled inline across the
planner and the operator, a typo or a rename slips through unnoticed; here each one is a named member, the
type checker sees every place that writes one, and docs/reasons.md explains each (what it means, what to do),
with a test keeping the two in step. The same idea as Argo Rollouts' reason constants
(`utils/conditions/conditions.go`).

Members are `str` (a `StrEnum`), so they serialise to exactly their value in JSON, status and Events. Values are
unique and UpperCamelCase; one value may serve several places (`CanaryRolledBack` is a Progressing and a Stalled
reason and a Warning Event), which docs/reasons.md lists. This module imports nothing of ours: anything may use it.
`crds.status.DrainReason` (the schema type of `status.drains[].reason`, a layer below) repeats four of these values;
a test checks that it stays a subset.
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class Reason(StrEnum):
    """The reason of a condition, an Event, a rollout phase change or a pod action (see docs/reasons.md)."""

    # ---- conditions: Available
    MINIMUM_REPLICAS_AVAILABLE = "MinimumReplicasAvailable"
    MINIMUM_REPLICAS_UNAVAILABLE = "MinimumReplicasUnavailable"
    SCALED_TO_ZERO = "ScaledToZero"  # also Ready=True
    # ---- conditions: Progressing (the rollout ones also name Reconciling/Ready while they hold)
    CANARY_PROGRESSING = "CanaryProgressing"
    PROMOTING = "Promoting"
    CANARY_ROLLING_BACK = "CanaryRollingBack"
    REPLICAS_UPDATING = "ReplicasUpdating"
    REPLICAS_UP_TO_DATE = "ReplicasUpToDate"
    CANARY_ROLLED_BACK = "CanaryRolledBack"  # also Stalled=True and a Warning Event
    TERMINATING = "Terminating"  # also Reconciling=True and a Normal Event
    # ---- conditions: Degraded
    HEALTHY = "Healthy"
    API_ERROR = "ApiError"  # also Ready=False and a Warning Event
    PODS_STUCK = "PodsStuck"
    PODS_FAILED = "PodsFailed"
    # ---- conditions: InvalidSpec
    VALIDATION_FAILED = "ValidationFailed"
    SPEC_VALID = "SpecValid"  # also a Normal Event when an invalid spec is fixed
    # ---- conditions: Ready (kstatus)
    CURRENT = "Current"
    REPLICAS_UNAVAILABLE = "ReplicasUnavailable"
    # ---- conditions: Reconciling (kstatus): the step under way
    ROLLING_BACK = "RollingBack"
    ROLLING_UPDATE = "RollingUpdate"
    SCALING_UP = "ScalingUp"
    SCALING_DOWN = "ScalingDown"
    PODS_STARTING = "PodsStarting"
    DRAINING = "Draining"
    REMOVING_VARIANT = "RemovingVariant"
    RECONCILED = "Reconciled"
    STALLED = "Stalled"
    # ---- conditions: Stalled (kstatus): what a human must fix
    INVALID_SPEC = "InvalidSpec"  # also Ready=False and a Warning Event
    PODS_CANNOT_START = "PodsCannotStart"
    NOT_STALLED = "NotStalled"
    # ---- conditions: AdaptersReady (LoRA adapters in the running pods)
    ADAPTERS_LOADED = "AdaptersLoaded"
    ADAPTERS_LOADING = "AdaptersLoading"
    ADAPTER_LOAD_FAILED = "AdapterLoadFailed"  # also a Warning Event
    # ---- status.rollout.reason: why the rollout phase is what it is
    STABLE = "Stable"
    SPEC_REVERTED = "SpecReverted"
    REVISION_REJECTED = "RevisionRejected"
    ROLLOUT_SPEC_REMOVED = "RolloutSpecRemoved"
    MANUAL_PROMOTE = "ManualPromote"  # also a Normal Event
    MANUAL_ABORT = "ManualAbort"
    ROLLING_REPLACE = "RollingReplace"  # also a Normal Event
    ANALYSIS_FAILED = "AnalysisFailed"
    ALL_STEPS_PASSED = "AllStepsPassed"
    STEP_ADVANCED = "StepAdvanced"
    CANARY_STARTED = "CanaryStarted"  # also a Normal Event
    CANARY_SUPERSEDED = "CanarySuperseded"  # also a Normal Event
    # ---- Events on the InferenceDeployment
    SCALED = "Scaled"
    AUTOSCALED = "Autoscaled"
    REPLICAS_IGNORED = "ReplicasIgnored"
    ABORT_IGNORED = "AbortIgnored"
    PROMOTE_IGNORED = "PromoteIgnored"
    CANARY_ABORTED = "CanaryAborted"
    CANARY_STEP = "CanaryStep"
    CANARY_PROMOTED = "CanaryPromoted"
    ANALYSIS_PASS = "AnalysisPass"
    ANALYSIS_FAIL = "AnalysisFail"
    ANALYSIS_INCONCLUSIVE = "AnalysisInconclusive"
    CREATED_POD = "CreatedPod"
    DRAINING_POD = "DrainingPod"
    DELETED_POD = "DeletedPod"
    # ---- pod actions: why a pod is created, drained or deleted (in the pod Events' messages, the pod's
    # `llmfleet.io/drain-reason` annotation and `status.drains[].reason`)
    SCALE_UP = "ScaleUp"
    SCALE_DOWN = "ScaleDown"
    CANARY = "Canary"
    ROLLOUT = "Rollout"
    REPLACE = "Replace"
    DELETION = "Deletion"
    FAILED = "Failed"
