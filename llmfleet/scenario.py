"""The `llmfleet up --scenario` tour: scripted steps that show autoscaling, a canary promotion and a rollback.

Why it exists: the demo should show what the operator does under load and during rollouts, on the same local
fleet, narrating each change it sees (pods, canary steps, analysis verdicts, decisions). Steps are data: each names
the features it needs, found by module (`FEATURES`), so a step whose feature has not landed yet is listed as
skipped with the reason, and lights up by itself once the module exists. `plan_steps` (pure) decides what runs.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from llmfleet.kube import INFD, Kube, load_manifests
from llmfleet.progress import pod_ready, rollout_changes
from llmfleet.traffic import StreamLoad


@dataclass(frozen=True)
class Feature:
    """A capability of the fleet, present when all its modules can be imported."""

    name: str
    modules: tuple[str, ...]
    missing_hint: str


FEATURES: dict[str, Feature] = {
    "autoscaling": Feature(
        "autoscaling",
        ("fleet_operator.autoscaler", "controllers.autoscaling"),
        "the operator's autoscaling timer (operator/fleet_operator/autoscaler.py) is not there yet",
    ),
    "canary": Feature(
        "canary rollout",
        ("controllers.rollout", "fleet_operator.analysis_runner"),
        "canary rollouts (controllers/rollout.py, operator analysis runner) are not there yet",
    ),
    "faults": Feature(
        "fault injection",
        ("worker.server.faults",),
        "worker fault injection (worker/server/faults.py) is not there yet",
    ),
}


def module_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def missing_features(needs: Sequence[str], present: Callable[[str], bool] = module_present) -> list[Feature]:
    return [FEATURES[n] for n in needs if not all(present(m) for m in FEATURES[n].modules)]


@dataclass
class TourContext:
    """What a step works with."""

    console: Console
    kube: Kube
    gateway_url: str
    api_key: str
    namespace: str
    name: str  # the deployment
    model: str  # its served model name
    examples: Path
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Step:
    title: str
    needs: tuple[str, ...]
    run: Callable[[TourContext], str]  # returns what came of it, in a few words
    explain: str


def plan_steps(steps: Sequence[Step], present: Callable[[str], bool] = module_present) -> list[tuple[Step, str | None]]:
    """Each step with None (runs) or the reason it is skipped."""
    planned = []
    for step in steps:
        missing = missing_features(step.needs, present)
        planned.append((step, "; ".join(f.missing_hint for f in missing) if missing else None))
    return planned


# ------------------------------------------------------------------------------------------------ narration


class Narrator:
    """Prints what changed in the deployment since the last look."""

    def __init__(self, ctx: TourContext) -> None:
        self.ctx = ctx
        self.last = ctx.kube.infd(ctx.name, ctx.namespace)
        self.started = time.monotonic()

    def look(self) -> Mapping[str, Any] | None:
        current = self.ctx.kube.infd(self.ctx.name, self.ctx.namespace)
        for line in rollout_changes(self.last, current):
            self.ctx.console.print(f"  [dim]{time.monotonic() - self.started:5.0f} s[/]  {line}")
        self.last = current
        return current


def _follow(
    ctx: TourContext,
    narrator: Narrator,
    done: Callable[[Mapping[str, Any] | None], bool],
    timeout_s: float,
    load: StreamLoad | None = None,
) -> bool:
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s) + 2):
        resource = narrator.look()
        if done(resource):
            return True
        if time.monotonic() > deadline:
            break
        time.sleep(1.0)
    ctx.console.print(
        f"  [yellow]not reached within {timeout_s:.0f} s[/]"
        + (f"; traffic: {load.summary()}" if load is not None else "")
    )
    return False


def _rollout(resource: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return ((resource or {}).get("status") or {}).get("rollout") or {}


def rollout_settled(resource: Mapping[str, Any] | None, generation: int, phases: Sequence[str]) -> bool:
    """The operator has seen `generation` (the change just made) and the rollout rests in one of `phases`
    (a read taken before the operator reacted still shows the previous rollout's outcome)."""
    status = (resource or {}).get("status") or {}
    return int(status.get("observedGeneration") or 0) >= generation and _rollout(resource).get("phase") in phases


def _ready_pods(ctx: TourContext) -> int:
    return sum(1 for p in ctx.kube.pods(ctx.name, ctx.namespace) if pod_ready(p))


# ---------------------------------------------------------------------------------------------------- steps


def load_burst(ctx: TourContext) -> str:
    before = _ready_pods(ctx)
    ctx.console.print(f"  {before} ready pod(s); sending 24 concurrent streams for up to 90 s")
    narrator = Narrator(ctx)
    with StreamLoad(ctx.gateway_url, ctx.api_key, ctx.model, workers=24, deadline_s=90, max_tokens=64) as load:
        _follow(ctx, narrator, lambda _r: _ready_pods(ctx) > before, 90, load)
    ctx.console.print(f"  traffic: {load.summary()}")
    peak = _ready_pods(ctx)
    ctx.console.print("  load stopped; waiting (up to 120 s) for the scale-down after the stabilisation window")
    _follow(ctx, narrator, lambda _r: _ready_pods(ctx) <= before, 120)
    return f"{before} -> {peak} -> {_ready_pods(ctx)} ready pods; {load.summary()}"


def int4_canary(ctx: TourContext) -> str:
    manifest = ctx.examples / "smollm2-int4-canary.yaml"
    ctx.console.print(f"  applying {manifest.name}: the same model with int4 weights, rolled out as a canary")
    narrator = Narrator(ctx)
    with StreamLoad(ctx.gateway_url, ctx.api_key, ctx.model, workers=3, deadline_s=ctx.timeout_s) as load:
        (applied,) = ctx.kube.apply_all(load_manifests(manifest), ctx.namespace)
        generation = applied["metadata"]["generation"]
        _follow(ctx, narrator, lambda r: rollout_settled(r, generation, ("Stable", "RolledBack")), ctx.timeout_s, load)
    rollout = _rollout(narrator.look())
    ctx.console.print(f"  rollout: {rollout.get('phase')} ({rollout.get('reason')}); traffic: {load.summary()}")
    return _outcome(rollout)


def faulty_canary(ctx: TourContext) -> str:
    env = [{"name": "LLMFLEET_FAULT_ERROR_RATE", "value": "0.5"}, {"name": "LLMFLEET_FAULT_SEED", "value": "1"}]
    ctx.console.print(
        "  patching the pod template with LLMFLEET_FAULT_ERROR_RATE=0.5: a canary that fails half of its requests"
    )
    narrator = Narrator(ctx)
    with StreamLoad(ctx.gateway_url, ctx.api_key, ctx.model, workers=3, deadline_s=ctx.timeout_s) as load:
        patched = ctx.kube.merge_patch(*INFD, ctx.name, {"spec": {"template": {"env": env}}}, ctx.namespace)
        generation = patched["metadata"]["generation"]
        _follow(ctx, narrator, lambda r: rollout_settled(r, generation, ("RolledBack", "Stable")), ctx.timeout_s, load)
    rollout = _rollout(narrator.look())
    ctx.console.print(f"  rollout: {rollout.get('phase')} - {rollout.get('message', '')[:300]}")
    ctx.console.print(f"  traffic: {load.summary()}")
    return _outcome(rollout)


def _outcome(rollout: Mapping[str, Any]) -> str:
    return f"{rollout.get('phase')} ({rollout.get('reason') or 'no reason'}: {rollout.get('message', '')[:160]})"


TOUR: tuple[Step, ...] = (
    Step(
        "A load burst that autoscales",
        ("autoscaling",),
        load_burst,
        "24 concurrent streams (more than maxNumSeqs) raise the queue depth; the autoscaler adds pods, then removes them once idle.",
    ),
    Step(
        "A canary to the int4 variant, analysed and promoted",
        ("canary",),
        int4_canary,
        "examples/smollm2-int4-canary.yaml: 20% -> 50% -> 100% with TTFT/ITL/error/quality analysis.",
    ),
    Step(
        "A faulty canary, rolled back",
        ("canary", "faults"),
        faulty_canary,
        "Fault injection makes the canary fail half its requests; analysis fails and the operator rolls back.",
    ),
)


def run_tour(
    ctx: TourContext, steps: Sequence[Step] = TOUR, present: Callable[[str], bool] = module_present
) -> list[tuple[str, str]]:
    """Run the steps that can run; returns (title, outcome) for each ("ran: what came of it", "skipped: why" or
    "failed: why")."""
    results = []
    for index, (step, skip) in enumerate(plan_steps(steps, present), 1):
        ctx.console.rule(f"scenario {index}/{len(steps)}: {step.title}")
        ctx.console.print(f"  [dim]{step.explain}[/]")
        if skip:
            ctx.console.print(f"  [yellow]skipped[/]: {skip}")
            results.append((step.title, f"skipped: {skip}"))
            continue
        try:
            results.append((step.title, f"ran: {step.run(ctx)}"))
        except Exception as error:  # noqa: BLE001 - one failing step must not end the tour or the fleet
            ctx.console.print(f"  [red]failed[/]: {error}")
            results.append((step.title, f"failed: {error}"))
    return results
