"""How GitOps tools judge an InferenceDeployment, for tests: a port of kstatus' rules and the Argo CD Lua check.

- `kstatus(obj)`: the generic rules of sigs.k8s.io/cli-utils pkg/kstatus/status (`checkGenericProperties`, then
  `Compute`'s fallback for kinds without special rules; what Flux's `wait: true`, kpt and Config Sync use):
  deletionTimestamp -> Terminating; status.observedGeneration present and != metadata.generation -> InProgress;
  Reconciling=True -> InProgress; Stalled=True -> Failed; else Current. With `ready_rule` (the default) one more
  rule, as tools that also read `Ready` do: Ready present and not True -> InProgress. The operator's conditions
  are built so that both give the same verdict (a test checks it on every captured object).
  `kubectl_wait_ready(obj)`: what `kubectl wait --for=condition=Ready` waits for.
- `argocd_health(obj)`: runs charts/llmfleet/files/argocd-health.lua with Lua 5.1 (Argo CD's gopher-lua speaks
  5.1) through lupa, the way Argo CD does: the object as the global `obj`, the script's return value as the
  health `{status, message}`.
- `load_fixtures()`: the status objects captured from the real operator on localkube (tests/gitops/fixtures/,
  written by tests/operator/test_op_gitops.py with LLMFLEET_CAPTURE_GITOPS=1), each with the verdicts expected.

Test modules reach it through the `gitops` fixture (tests/gitops/conftest.py) or `load_by_path` (pytest runs with
--import-mode=importlib: test files cannot import each other by name). Imports only the standard library, yaml
and lupa.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
LUA_SCRIPT = REPO / "charts" / "llmfleet" / "files" / "argocd-health.lua"
FIXTURES = Path(__file__).resolve().parent / "fixtures"

CURRENT, IN_PROGRESS, FAILED, TERMINATING = "Current", "InProgress", "Failed", "Terminating"


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for entry in ((obj.get("status") or {}).get("conditions")) or []:
        if entry.get("type") == kind:
            return entry
    return None


def kstatus(obj: Mapping[str, Any], *, ready_rule: bool = True) -> str:
    """kstatus' generic status of a custom resource (see the module docstring)."""
    meta = obj.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return TERMINATING
    status = obj.get("status") or {}
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    if generation is not None and observed is not None and observed != generation:
        return IN_PROGRESS
    reconciling = _condition(obj, "Reconciling")
    if reconciling is not None and reconciling.get("status") == "True":
        return IN_PROGRESS
    stalled = _condition(obj, "Stalled")
    if stalled is not None and stalled.get("status") == "True":
        return FAILED
    ready = _condition(obj, "Ready")
    if ready_rule and ready is not None and ready.get("status") != "True":
        return IN_PROGRESS
    return CURRENT


def kubectl_wait_ready(obj: Mapping[str, Any]) -> bool:
    """Whether `kubectl wait --for=condition=Ready` would return for this object."""
    ready = _condition(obj, "Ready")
    return ready is not None and ready.get("status") == "True"


def argocd_health(obj: Mapping[str, Any], script: Path = LUA_SCRIPT) -> dict[str, str]:
    """The Argo CD health of `obj` by the Lua check (a fresh Lua 5.1 state per call, like Argo CD)."""
    from lupa.lua51 import LuaRuntime  # the dev extra `lupa`

    lua = LuaRuntime(unpack_returned_tuples=True)
    # JSON -> Lua tables as Argo CD builds them (objects and arrays become tables, arrays 1-based).
    lua.globals().obj = lua.table_from(json.loads(json.dumps(obj)), recursive=True)
    result = lua.execute(script.read_text())
    return {"status": str(result["status"]), "message": str(result["message"] or "")}


def load_fixtures() -> list[dict[str, Any]]:
    """The captured objects, sorted by file name: each `{name, captured, expected: {kstatus, argocd, ready},
    object}`."""
    return [dict(yaml.safe_load(path.read_text()), name=path.stem) for path in sorted(FIXTURES.glob("*.yaml"))]


def fixture_document(name: str, note: str, expected: Mapping[str, Any], obj: Mapping[str, Any]) -> str:
    """A fixture file's text: a note on how it was captured, the expected verdicts and the object (identity and
    status only: what the health rules read)."""
    meta = obj.get("metadata") or {}
    kept = {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {key: meta[key] for key in ("name", "generation") if key in meta},
        "status": obj.get("status") or {},
    }
    header = (
        f"# {name}: {note}\n# Captured from the real operator on localkube by tests/operator/test_op_gitops.py"
        f" (LLMFLEET_CAPTURE_GITOPS=1); regenerate with that test, never edit by hand.\n"
    )
    return header + yaml.safe_dump({"captured": note, "expected": dict(expected), "object": kept}, sort_keys=False)


def load_by_path() -> ModuleType:
    """This module, loaded by file path (for test modules outside tests/gitops)."""
    spec = importlib.util.spec_from_file_location("gitops_health", Path(__file__))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
