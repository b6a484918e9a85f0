"""Revisions hash intent, not rendering: which edits (of the CR, of the operator's settings, of the rendering
version) roll pods and which do not; and an operator upgrade over a running fleet through the planner."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from controllers import CreatePod, DeletePod, StartDrain, revision
from controllers.pods import PodDefaults
from controllers.reconcile import Policy
from controllers.revision import pod_intent, variant_revision
from crds.helpers import parse_spec

BASE = {
    "model": {"name": "m", "source": "bundled://smollm2-135m-instruct"},
    "variants": [{"name": "a", "weight": 3}, {"name": "b"}],
    "replicas": 2,
}


def _rev(spec=BASE, defaults=None, variant="a", render_version=None):
    defaults = defaults if defaults is not None else PodDefaults()
    parsed = parse_spec(copy.deepcopy(spec))
    chosen = next(v for v in parsed.variants if v.name == variant)
    return variant_revision("dep", parsed, chosen, defaults, render_version)


def _edit(path, value):
    spec = copy.deepcopy(BASE)
    *parents, last = path
    node = spec
    for key in parents:
        node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
    node[last] = value
    return spec


@pytest.mark.parametrize(
    ("what", "spec", "defaults"),
    [
        ("model source", _edit(["model", "source"], "hf://org/other"), PodDefaults()),
        ("served name", _edit(["model", "name"], "other"), PodDefaults()),
        ("engine flag", _edit(["engine", "maxNumSeqs"], 8), PodDefaults()),
        ("engine extra args", _edit(["engine", "extraArgs"], {"x": 1}), PodDefaults()),
        ("quantization", _edit(["variants", 0, "quantization"], "int4"), PodDefaults()),
        ("resources", _edit(["variants", 0, "resources"], {"cpu": "2"}), PodDefaults()),
        ("template env", _edit(["template", "env"], [{"name": "X", "value": "1"}]), PodDefaults()),
        ("template image", _edit(["template", "image"], "mine:2"), PodDefaults()),
        ("drain", _edit(["drain", "timeoutSeconds"], 99), PodDefaults()),
        ("default worker image", BASE, PodDefaults(image="ghcr.io/llmfleet/llmfleet-worker:0.2.0")),
        ("worker command", BASE, PodDefaults(command=("python", "-m", "worker"))),
        ("worker extra args", BASE, PodDefaults(extra_args=("--engine", "fake"))),
        ("port", BASE, PodDefaults(port=9000)),
        ("render epoch", BASE, PodDefaults(render_epoch=1)),
    ],
)
def test_deliberate_changes_roll(what, spec, defaults):
    assert _rev(spec, defaults) != _rev(), what


@pytest.mark.parametrize(
    ("what", "spec", "defaults"),
    [
        ("variant weight", _edit(["variants", 0, "weight"], 9), PodDefaults()),
        ("variant tiers", _edit(["variants", 0, "tiers"], ["gold"]), PodDefaults()),
        ("variant replicas", _edit(["variants", 0, "replicas"], 5), PodDefaults()),
        ("autoscaling", _edit(["variants", 0, "autoscaling"], {"minReplicas": 1, "maxReplicas": 4}), PodDefaults()),
        ("fleet replicas", _edit(["replicas"], 7), PodDefaults()),
        ("rollout steps", _edit(["rollout"], {"canary": {"steps": [{"weight": 50}]}}), PodDefaults()),
        ("another variant", _edit(["variants", 1, "quantization"], "int4"), PodDefaults()),
        ("a default written out", _edit(["engine", "maxNumSeqs"], 64), PodDefaults()),
        ("run-as user", BASE, PodDefaults(run_as_user=2000)),
        ("startup budget", BASE, PodDefaults(startup_timeout_seconds=60)),
        ("probe period", BASE, PodDefaults(probe_period_seconds=5)),
        ("cache dir", BASE, PodDefaults(cache_dir=None)),
        ("extra env", BASE, PodDefaults(extra_env=(("OTEL_ENDPOINT", "http://collector:4317"),))),
        # The CR names its image: the operator's default is not what runs.
        ("default image under a CR image", _edit(["template", "image"], "mine:1"), PodDefaults(image="other:9")),
    ],
)
def test_rendering_and_non_pod_fields_do_not_roll(what, spec, defaults):
    base = _edit(["template", "image"], "mine:1") if what == "default image under a CR image" else BASE
    assert _rev(spec, defaults) == _rev(base), what


def test_render_version_rolls_and_defaults_to_the_constant(monkeypatch):
    assert _rev(render_version=revision.RENDER_VERSION) == _rev()
    assert _rev(render_version=revision.RENDER_VERSION + 1) != _rev()
    before = _rev()
    monkeypatch.setattr(revision, "RENDER_VERSION", revision.RENDER_VERSION + 1)
    assert _rev() != before


def test_intent_has_no_rendering_and_revisions_are_label_values():
    parsed = parse_spec(copy.deepcopy(BASE))
    intent = pod_intent("dep", parsed, parsed.variants[0], PodDefaults())
    assert set(intent) == {"model", "variant", "deployment", "worker", "render"}
    assert intent["variant"] == {"name": "a"}
    value = _rev()
    assert len(value) == 10 and value.isalnum() and value == value.lower()


# --------------------------------------------------------------------------------------- upgrade through the planner


def _changes(plan):
    return plan.of_type(CreatePod) + plan.of_type(DeletePod) + plan.of_type(StartDrain)


def _env(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_an_operator_upgrade_that_renders_differently_rolls_no_pod(kit, monkeypatch):
    c = kit.cluster({"replicas": 2})
    c.converge()
    running = copy.deepcopy(c.pods)
    upgraded = PodDefaults(extra_env=(("NEW_RENDERING", "1"),), run_as_user=1001, probe_period_seconds=3)
    c.policy = Policy(defaults=upgraded)
    plan = c.plan()
    assert _changes(plan) == []
    c.apply(plan)
    assert c.pods == running  # same pods, untouched

    c.resource["spec"]["replicas"] = 3  # scale up: the new pod carries the new rendering
    c.converge()
    new = [pod for name, pod in c.pods.items() if name not in running]
    assert len(new) == 1 and _env(new[0])["NEW_RENDERING"] == "1"
    assert all("NEW_RENDERING" not in _env(pod) for name, pod in c.pods.items() if name in running)

    # The project bumps the rendering version: a normal rollout, every old pod drained before it goes.
    monkeypatch.setattr(revision, "RENDER_VERSION", revision.RENDER_VERSION + 1)
    drained = []
    c.converge(check=lambda cluster: drained.extend(cluster.posts))
    assert not set(c.pods) & set(running) and len(c.pods) == 3
    assert set(running) <= set(drained)
    assert all(_env(pod)["NEW_RENDERING"] == "1" for pod in c.pods.values())


def test_a_new_default_worker_image_rolls_the_fleet(kit):
    c = kit.cluster({"replicas": 2})
    c.converge()
    before = set(c.pods)
    c.policy = Policy(defaults=replace(PodDefaults(), image="ghcr.io/llmfleet/llmfleet-worker:0.2.0"))
    c.converge()
    assert not set(c.pods) & before
    assert {p["spec"]["containers"][0]["image"] for p in c.pods.values()} == {"ghcr.io/llmfleet/llmfleet-worker:0.2.0"}
