"""RBAC is least privilege: each component can do exactly what it needs, where it needs it, and nothing more.

Rules are evaluated the way the API server's RBAC authorizer does (group, resource, verb, optional resourceName),
so the tests state permissions as requests ("may the operator create pods in team-a?") rather than as YAML.
"""

from __future__ import annotations

from typing import Any

import pytest

OPERATOR_SA = ("llm", "fleet-llmfleet-operator")
GATEWAY_SA = ("llm", "fleet-llmfleet-gateway")

# What the operator does (kopf + reconcile + executor): (group, resource, verb).
OPERATOR_NEEDS = [
    *[("llmfleet.io", "inferencedeployments", v) for v in ("get", "list", "watch", "patch", "update")],
    *[("llmfleet.io", "inferencedeployments/status", v) for v in ("get", "patch", "update")],
    *[("llmfleet.io", "inferencedeployments/scale", v) for v in ("get", "patch", "update")],
    *[("", "pods", v) for v in ("get", "list", "watch", "create", "delete", "patch")],
    *[("", "services", v) for v in ("get", "list", "watch", "create", "patch")],
    *[("", "events", v) for v in ("create", "patch")],
    *[("events.k8s.io", "events", v) for v in ("create", "patch")],
    *[("policy", "poddisruptionbudgets", v) for v in ("get", "list", "watch", "create", "delete", "patch")],
    *[("networking.k8s.io", "networkpolicies", v) for v in ("get", "create", "patch")],
]
# What the operator must never be able to do.
OPERATOR_MUST_NOT = [
    # No Secret rights at all: drain tokens are derived from the operator's mounted key.
    *[("", "secrets", v) for v in ("get", "list", "watch", "create", "patch", "update", "delete")],
    # NetworkPolicies: only its own, by name; the garbage collector deletes them.
    *[("networking.k8s.io", "networkpolicies", v) for v in ("list", "watch", "delete", "update")],
    ("", "pods/exec", "create"),
    ("", "configmaps", "get"),
    ("apps", "deployments", "create"),
    ("llmfleet.io", "inferencedeployments", "create"),
    ("llmfleet.io", "inferencedeployments", "delete"),
    ("rbac.authorization.k8s.io", "roles", "create"),
]
GATEWAY_NEEDS = [
    *[("llmfleet.io", "inferencedeployments", v) for v in ("get", "list", "watch")],
    *[("", "pods", v) for v in ("get", "list", "watch")],
]


def _binds(binding: dict[str, Any], sa: tuple[str, str]) -> bool:
    return any(
        s["kind"] == "ServiceAccount" and (s["namespace"], s["name"]) == sa for s in binding.get("subjects") or []
    )


def rules_for(rendered, sa: tuple[str, str], namespace: str | None) -> list[dict[str, Any]]:
    """Every rule granted to `sa` in `namespace` (None: cluster-wide requests) by the rendered bindings."""
    rules: list[dict[str, Any]] = []
    for binding in rendered.of_kind("ClusterRoleBinding"):
        if _binds(binding, sa):
            rules += rendered.get("ClusterRole", binding["roleRef"]["name"])["rules"]
    if namespace is not None:
        for binding in rendered.of_kind("RoleBinding"):
            if binding["metadata"]["namespace"] == namespace and _binds(binding, sa):
                assert binding["roleRef"]["kind"] == "Role"
                rules += rendered.get("Role", binding["roleRef"]["name"], namespace)["rules"]
    return rules


def allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str, name: str | None = None) -> bool:
    for rule in rules:
        if group not in rule.get("apiGroups", []) or resource not in rule.get("resources", []):
            continue
        if verb not in rule.get("verbs", []):
            continue
        names = rule.get("resourceNames")
        if names and (name is None or name not in names):
            continue
        return True
    return False


def test_no_wildcards_anywhere(value_set, rendered_sets):
    rendered = rendered_sets[value_set]
    for role in rendered.of_kind("Role") + rendered.of_kind("ClusterRole"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), f"{role['metadata']['name']}: wildcard in {field}"


@pytest.mark.parametrize(
    ("set_name", "namespaces"),
    [
        ("defaults", ["llm"]),
        ("watch-namespaces", ["team-a", "team-b"]),
        ("two-operators", ["llm"]),
    ],
)
def test_namespaced_operator_has_what_it_needs_only_in_its_namespaces(rendered_sets, set_name, namespaces):
    rendered = rendered_sets[set_name]
    assert rendered.of_kind("ClusterRole") == [] and rendered.of_kind("ClusterRoleBinding") == []
    for ns in namespaces:
        rules = rules_for(rendered, OPERATOR_SA, ns)
        missing = [need for need in OPERATOR_NEEDS if not allows(rules, *need)]
        assert not missing, f"operator lacks in {ns}: {missing}"
        extra = [deny for deny in OPERATOR_MUST_NOT if allows(rules, *deny)]
        assert not extra, f"operator may in {ns}: {extra}"
    assert rules_for(rendered, OPERATOR_SA, "kube-system") == []
    assert rules_for(rendered, OPERATOR_SA, None) == []


def test_cluster_wide_operator_reads_namespaces_and_crds_and_works_everywhere(rendered_sets):
    rendered = rendered_sets["cluster-wide"]
    assert rendered.of_kind("Role") == [r for r in rendered.of_kind("Role") if "api-keys" in r["metadata"]["name"]]
    rules = rules_for(rendered, OPERATOR_SA, None)
    for need in OPERATOR_NEEDS:
        assert allows(rules, *need), need
    for deny in OPERATOR_MUST_NOT:
        assert not allows(rules, *deny), deny
    assert allows(rules, "", "namespaces", "watch")
    assert allows(rules, "apiextensions.k8s.io", "customresourcedefinitions", "watch")
    assert not allows(rules, "apiextensions.k8s.io", "customresourcedefinitions", "create")


@pytest.mark.parametrize(
    ("set_name", "namespace", "plural"),
    [
        ("two-operators", "llm", "kopfpeerings"),
        ("two-operators-cluster-wide", None, "clusterkopfpeerings"),
    ],
)
def test_peering_operators_may_touch_their_peering_objects(rendered_sets, set_name, namespace, plural):
    rules = rules_for(rendered_sets[set_name], OPERATOR_SA, namespace)
    for verb in ("get", "list", "watch", "patch"):
        assert allows(rules, "kopf.dev", plural, verb)
    assert not allows(rules, "kopf.dev", plural, "delete")


def test_standalone_operator_has_no_peering_access(rendered_sets):
    rules = rules_for(rendered_sets["defaults"], OPERATOR_SA, "llm")
    assert not allows(rules, "kopf.dev", "kopfpeerings", "get")


@pytest.mark.parametrize(("set_name", "namespace"), [("defaults", "llm"), ("cluster-wide", None)])
def test_gateway_reads_routes_and_only_its_key_secret(rendered_sets, set_name, namespace):
    rendered = rendered_sets[set_name]
    route_rules = rules_for(rendered, GATEWAY_SA, namespace)
    for need in GATEWAY_NEEDS:
        assert allows(route_rules, *need), need
    release_rules = rules_for(rendered, GATEWAY_SA, "llm")
    for verb in ("get", "list", "watch"):
        assert allows(release_rules, "", "secrets", verb, name="llmfleet-api-keys")
        assert not allows(release_rules, "", "secrets", verb, name="someone-elses-secret")
        assert not allows(release_rules, "", "secrets", verb)  # an unnamed list of every Secret
    for role in rendered.of_kind("Role") + rendered.of_kind("ClusterRole"):
        if "gateway" in role["metadata"]["name"]:
            for rule in role["rules"]:
                assert set(rule["verbs"]) <= {"get", "list", "watch"}, f"gateway may write: {rule}"


def test_gateway_secret_access_follows_existing_secret(rendered_sets):
    rules = rules_for(rendered_sets["custom-gateway"], GATEWAY_SA, "llm")
    assert allows(rules, "", "secrets", "watch", name="team-keys")
    assert not allows(rules, "", "secrets", "get", name="llmfleet-api-keys")


def test_rbac_create_false_renders_no_rbac(render):
    rendered = render({"rbac": {"create": False}})
    for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert rendered.of_kind(kind) == [], kind
    assert len(rendered.of_kind("ServiceAccount")) == 2


@pytest.mark.parametrize(("set_name", "namespace"), [("defaults", "llm"), ("cluster-wide", None)])
def test_operator_has_no_secret_rule_at_all(rendered_sets, set_name, namespace):
    rules = rules_for(rendered_sets[set_name], OPERATOR_SA, namespace)
    assert rules and not [r for r in rules if "secrets" in r.get("resources", [])]


@pytest.mark.parametrize("cluster_wide", [False, True])
def test_network_policy_rights_follow_network_policy_enabled(render, cluster_wide):
    rendered = render({"networkPolicy": {"enabled": False}, "rbac": {"clusterWide": cluster_wide}})
    rules = rules_for(rendered, OPERATOR_SA, None if cluster_wide else "llm")
    assert rules and not any(
        allows(rules, "networking.k8s.io", "networkpolicies", v) for v in ("get", "create", "patch")
    )
