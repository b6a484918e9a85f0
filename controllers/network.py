"""The NetworkPolicy of an InferenceDeployment's workers: who may connect to them.

Why it exists: a worker serves `/v1/*` without API keys, limits or tiers (the gateway applies those) and answers
`GET /drain`; without a policy every pod of the cluster can reach it and bypass the gateway. The operator keeps
one NetworkPolicy per deployment (owner-referenced to it, like its Service and budgets) that selects the
deployment's worker pods and admits ingress on the worker port only from the peers the operator's
administrator configured: the gateway pods, the operator pods (drain probes, pod scraping, quality probes) and
the metrics scraper (Prometheus). Everything else, including other ports, is denied once the policy exists; a
CNI without NetworkPolicy support ignores it (the chart's `networkPolicy.enabled` turns it off).

Pure: builds manifests from data (`NetworkPolicySettings`), imports only `controllers.pods` for the shared
worker-pod facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from controllers.pods import MANAGED_BY, owner_reference, selector

API_VERSION = "networking.k8s.io/v1"
KIND = "NetworkPolicy"
# The chart's labels of its gateway and operator pods, and the usual label of Prometheus pods.
GATEWAY_POD_LABELS = MappingProxyType({"app.kubernetes.io/name": "llmfleet", "app.kubernetes.io/component": "gateway"})
OPERATOR_POD_LABELS = MappingProxyType(
    {"app.kubernetes.io/name": "llmfleet", "app.kubernetes.io/component": "operator"}
)
SCRAPER_POD_LABELS = MappingProxyType({"app.kubernetes.io/name": "prometheus"})


@dataclass(frozen=True)
class Peer:
    """Pods admitted to the workers: those matching `pod_labels` in the namespaces matching `namespace_labels`.

    `namespace_labels=None` means the workers' own namespace only; `{}` means every namespace (Kubernetes'
    semantics of an absent vs. an empty `namespaceSelector`)."""

    pod_labels: Mapping[str, str]
    namespace_labels: Mapping[str, str] | None = None

    def rule(self) -> dict[str, Any]:
        """This peer as a NetworkPolicy `from` entry."""
        peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(self.pod_labels)}}
        if self.namespace_labels is not None:
            peer["namespaceSelector"] = {"matchLabels": dict(self.namespace_labels)}
        return peer


@dataclass(frozen=True)
class NetworkPolicySettings:
    """Whether the operator keeps a NetworkPolicy per deployment, and which peers it admits."""

    enabled: bool = True
    peers: tuple[Peer, ...] = field(
        default_factory=lambda: (
            Peer(GATEWAY_POD_LABELS),
            Peer(OPERATOR_POD_LABELS),
            Peer(SCRAPER_POD_LABELS, namespace_labels={}),
        )
    )


def network_policy_name(deployment: str) -> str:
    return f"{deployment}-workers"


def network_policy_manifest(meta: Mapping[str, Any], settings: NetworkPolicySettings, port: int) -> dict[str, Any]:
    """The NetworkPolicy selecting a deployment's worker pods: ingress on `port` from `settings.peers` only."""
    name = meta["name"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": network_policy_name(name),
            "namespace": meta.get("namespace", "default"),
            "labels": {**selector(name), "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner_reference(meta)],
        },
        "spec": {
            "podSelector": {"matchLabels": selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [peer.rule() for peer in settings.peers],
                    "ports": [{"protocol": "TCP", "port": port}],
                }
            ],
        },
    }


def network_policy_matches(observed: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether an existing NetworkPolicy already has the spec fields we want (other fields are left alone, and the
    executor's merge patch sets exactly these, so a changed one is put back and the next pass is quiet)."""
    have = observed.get("spec") or {}
    return all(have.get(key) == value for key, value in wanted["spec"].items())
