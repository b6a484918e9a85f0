"""Pure planning for the operator: (resource, observed, now) -> Plan of typed actions. No I/O, no clocks, no kopf."""

from controllers.actions import (
    Action,
    CreatePod,
    DeletePdb,
    DeletePod,
    EmitEvent,
    EnsureNetworkPolicy,
    EnsurePdb,
    EnsureService,
    EventType,
    LoadAdapter,
    PatchStatus,
    Plan,
    RemoveAnnotations,
    StartDrain,
    UnloadAdapter,
)
from controllers.observed import AdapterProbe, AdapterResult, DrainProbe, Observed, PodInfo, ProbeState
from controllers.pods import PodDefaults
from controllers.reasons import Reason
from controllers.reconcile import Policy, reconcile

__all__ = [
    "Action",
    "AdapterProbe",
    "AdapterResult",
    "CreatePod",
    "DeletePdb",
    "DeletePod",
    "DrainProbe",
    "EmitEvent",
    "EnsureNetworkPolicy",
    "EnsurePdb",
    "EnsureService",
    "EventType",
    "LoadAdapter",
    "Observed",
    "PatchStatus",
    "Plan",
    "PodDefaults",
    "PodInfo",
    "Policy",
    "ProbeState",
    "Reason",
    "RemoveAnnotations",
    "StartDrain",
    "UnloadAdapter",
    "reconcile",
]
