"""GitOps health of InferenceDeployments: the kstatus port and the Argo CD Lua check (run with Lua 5.1 through
lupa) agree with each other and with what each captured phase should mean; the Lua script in docs/gitops.md is
the chart's file, verbatim."""

from __future__ import annotations

import re

import pytest

PHASES = [
    "01-first-rollout",
    "02-ready",
    "03-canary-progressing",
    "04-promoted",
    "05-rolled-back",
    "06-invalid-spec",
    "07-scaled-to-zero",
]


def _fixture(gitops, name):
    return next(f for f in gitops.load_fixtures() if f["name"] == name)


def test_every_phase_was_captured(gitops):
    assert [f["name"] for f in gitops.load_fixtures()] == PHASES


@pytest.mark.parametrize("name", PHASES)
def test_captured_objects_get_the_expected_verdicts(gitops, name):
    fixture = _fixture(gitops, name)
    obj, expected = fixture["object"], fixture["expected"]
    assert gitops.kstatus(obj) == expected["kstatus"]
    assert gitops.argocd_health(obj)["status"] == expected["argocd"]
    assert gitops.kubectl_wait_ready(obj) is expected["kubectlWaitReady"]
    # kstatus without the Ready rule (plain cli-utils) agrees: Reconciling/Stalled alone carry the verdict.
    assert gitops.kstatus(obj, ready_rule=False) == expected["kstatus"]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("03-canary-progressing", "CanaryProgressing"),
        ("05-rolled-back", "CanaryRolledBack"),
        ("06-invalid-spec", "InvalidSpec"),
        ("07-scaled-to-zero", "ScaledToZero"),
    ],
)
def test_argocd_message_says_why(gitops, name, reason):
    assert gitops.argocd_health(_fixture(gitops, name)["object"])["message"].startswith(reason)


def _obj(generation=1, observed=1, conditions=(), **meta):
    status = {
        "observedGeneration": observed,
        "conditions": [{"type": t, "status": s, "reason": r, "message": ""} for t, s, r in conditions],
    }
    return {"metadata": {"name": "x", "generation": generation, **meta}, "status": status}


READY = ("Ready", "True", "Current")
NOT_READY = ("Ready", "False", "PodsStarting")
RECONCILING = ("Reconciling", "True", "PodsStarting")
STALLED = ("Stalled", "True", "InvalidSpec")


@pytest.mark.parametrize(
    ("obj", "kstatus", "argocd"),
    [
        # No status yet: kstatus has nothing to go on and calls it Current (its known limit); Argo CD waits.
        ({"metadata": {"name": "x", "generation": 1}}, "Current", "Progressing"),
        (_obj(2, 1, [READY]), "InProgress", "Progressing"),  # the new generation not observed yet
        (_obj(1, 1, [READY]), "Current", "Healthy"),
        (_obj(1, 1, [NOT_READY]), "InProgress", "Progressing"),
        (_obj(1, 1, [NOT_READY, RECONCILING]), "InProgress", "Progressing"),
        (_obj(1, 1, [NOT_READY, STALLED]), "Failed", "Degraded"),
        (_obj(1, 1, [READY], deletionTimestamp="2025-01-01T00:00:00Z"), "Terminating", "Healthy"),
        (_obj(1, 1, []), "Current", "Progressing"),  # a status with no conditions: Argo CD does not guess
    ],
)
def test_rules_on_synthetic_objects(gitops, obj, kstatus, argocd):
    assert gitops.kstatus(obj) == kstatus
    assert gitops.argocd_health(obj)["status"] == argocd


def test_lua_tolerates_conditions_without_reason_or_message(gitops):
    obj = {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "conditions": [{"type": "Stalled", "status": "True"}]},
    }
    assert gitops.argocd_health(obj) == {"status": "Degraded", "message": "Stalled"}


def test_docs_embed_the_chart_script_verbatim(gitops):
    docs = (gitops.REPO / "docs" / "gitops.md").read_text()
    match = re.search(
        r"resource\.customizations\.health\.llmfleet\.io_InferenceDeployment: \|\n(.*?)\n```", docs, re.DOTALL
    )
    assert match, "docs/gitops.md lacks the argocd-cm snippet"
    embedded = "\n".join(line.removeprefix("    ") for line in match.group(1).splitlines())
    assert embedded.strip() == gitops.LUA_SCRIPT.read_text().strip()
