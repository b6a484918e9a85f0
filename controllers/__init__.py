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
    PatchStatus,
    Plan,
    RemoveAnnotations,
    StartDrain,
)
from controllers.observed import DrainProbe, Observed, PodInfo, ProbeState
from controllers.pods import PodDefaults
from controllers.reasons import Reason
from controllers.reconcile import Policy, reconcile

__all__ = [
    "Action",
    "CreatePod",
    "DeletePdb",
    "DeletePod",
    "DrainProbe",
    "EmitEvent",
    "EnsureNetworkPolicy",
    "EnsurePdb",
    "EnsureService",
    "EventType",
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
    "reconcile",
]
