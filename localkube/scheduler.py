"""Scheduling decisions for the single localkube node, as pure functions.

A pod fits when its ``nodeSelector`` and required node affinity match the node's labels, it tolerates the node's
taints, and its extended-resource requests (``nvidia.com/gpu`` and any other resource that is not cpu, memory,
ephemeral-storage, pods or hugepages) fit in what the node has left. CPU and memory requests are not enforced:
pods share the developer's machine. The message for a pod that does not fit reads like kube-scheduler's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BASIC_RESOURCES = ("cpu", "memory", "ephemeral-storage", "pods")
_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
}


def parse_quantity(text) -> float:
    """A Kubernetes resource quantity (``500m``, ``2Gi``, ``1``) as a number."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([+-]?[0-9.]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or (m.group(2) and m.group(2) not in _SUFFIXES):
        raise ValueError(f"invalid quantity {text!r}")
    return float(m.group(1)) * _SUFFIXES.get(m.group(2), 1)


def is_extended(resource: str) -> bool:
    return resource not in _BASIC_RESOURCES and not resource.startswith("hugepages-")


def extended_requests(pod: dict) -> dict[str, float]:
    """Extended resources a pod asks for (limits imply requests for them)."""
    totals: dict[str, float] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        wanted = dict(resources.get("limits") or {})
        wanted.update(resources.get("requests") or {})
        for name, quantity in wanted.items():
            if is_extended(name):
                totals[name] = totals.get(name, 0.0) + parse_quantity(quantity)
    return totals


def _expression_matches(expr: dict, labels: dict) -> bool:
    key, op, values = expr.get("key", ""), expr.get("operator", ""), expr.get("values") or []
    present = key in labels
    if op == "In":
        return present and labels[key] in values
    if op == "NotIn":
        return not present or labels[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and values:
        try:
            have, want = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > want if op == "Gt" else have < want
    return False


def _term_matches(term: dict, labels: dict, node_name: str) -> bool:
    if not term.get("matchExpressions") and not term.get("matchFields"):
        return False
    if not all(_expression_matches(e, labels) for e in term.get("matchExpressions") or []):
        return False
    return all(_expression_matches(e, {"metadata.name": node_name}) for e in term.get("matchFields") or [])


def _tolerates(taint: dict, tolerations: list[dict]) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists" and (not tol.get("key") or tol.get("key") == taint.get("key")):
            return True
        if tol.get("key") == taint.get("key") and tol.get("value", "") == taint.get("value", ""):
            return True
    return False


@dataclass(frozen=True)
class Fit:
    ok: bool
    message: str = ""


def fits(pod: dict, node: dict, bound_pods: list[dict]) -> Fit:
    """Whether ``pod`` can run on ``node`` next to the non-terminal ``bound_pods`` already there."""
    spec = pod.get("spec") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    node_name = node["metadata"]["name"]
    selector = spec.get("nodeSelector") or {}
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = affinity.get("nodeSelectorTerms") or []
    if any(labels.get(k) != v for k, v in selector.items()) or (
        terms and not any(_term_matches(t, labels, node_name) for t in terms)
    ):
        return Fit(
            False,
            "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. "
            "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.",
        )
    untolerated = [
        t
        for t in (node.get("spec") or {}).get("taints") or []
        if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(t, spec.get("tolerations") or [])
    ]
    if untolerated:
        taint = untolerated[0]
        return Fit(
            False,
            f"0/1 nodes are available: 1 node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}. "
            "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.",
        )
    capacity = (node.get("status") or {}).get("allocatable") or {}
    wanted = extended_requests(pod)
    if wanted:
        used: dict[str, float] = {}
        for other in bound_pods:
            for name, amount in extended_requests(other).items():
                used[name] = used.get(name, 0.0) + amount
        short = sorted(
            name
            for name, amount in wanted.items()
            if amount + used.get(name, 0.0) > parse_quantity(capacity.get(name, 0))
        )
        if short:
            return Fit(
                False,
                "0/1 nodes are available: "
                + ", ".join(f"1 Insufficient {n}" for n in short)
                + ". preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.",
            )
    return Fit(True)
