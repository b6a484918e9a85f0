"""Pure planning for the operator: (resource, observed, now) -> Plan of typed actions. No I/O, no clocks, no kopf."""

from controllers.actions import (
    Action,
    CreatePod,
    DeletePod,
    EmitEvent,
    EnsureSecret,
    EnsureService,
    EventType,
    PatchStatus,
    Plan,
)
from controllers.observed import Observed, PodInfo
from controllers.pods import PodDefaults
from controllers.reconcile import Policy, reconcile

__all__ = [
    "Action",
    "CreatePod",
    "DeletePod",
    "EmitEvent",
    "EnsureSecret",
    "EnsureService",
    "EventType",
    "Observed",
    "PatchStatus",
    "Plan",
    "PodDefaults",
    "PodInfo",
    "Policy",
    "reconcile",
]
