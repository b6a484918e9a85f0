"""`controllers.reasons.Reason` is the one list of reasons users see: well formed, used by every writer of a reason
(no string literal slips in beside it), and documented in docs/reasons.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from controllers.reasons import Reason
from crds.models import DrainReason

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_DIRS = (ROOT / "controllers", ROOT / "operator" / "fleet_operator")
DOC = ROOT / "docs" / "reasons.md"
UPPER_CAMEL = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)*")

# Constructors that take the reason positionally: callee name -> index of the reason argument.
POSITIONAL_REASON = {"EmitEvent": 1, "WantedCondition": 2, "CreatePod": 3, "DeletePod": 4, "StartDrain": 5}


def _product_files() -> list[Path]:
    return sorted(path for folder in PRODUCT_DIRS for path in folder.rglob("*.py"))


def _is_text(node: ast.AST | None) -> bool:
    """A reason spelled as text: a string constant or an f-string."""
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _callee(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def literal_reasons(source: str, filename: str = "<snippet>") -> list[str]:
    """Where `source` passes a reason as text: `reason="..."`, `{"reason": "..."}` and the reason argument of the
    constructors in POSITIONAL_REASON. Each finding is `file:line: what`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            found += [
                f"{filename}:{kw.lineno}: reason={ast.unparse(kw.value)}"
                for kw in node.keywords
                if kw.arg == "reason" and _is_text(kw.value)
            ]
            index = POSITIONAL_REASON.get(_callee(node) or "")
            if index is not None and index < len(node.args) and _is_text(node.args[index]):
                found.append(f"{filename}:{node.lineno}: {_callee(node)}(..., {ast.unparse(node.args[index])}, ...)")
        elif isinstance(node, ast.Dict):
            found += [
                f'{filename}:{value.lineno}: "reason": {ast.unparse(value)}'
                for key, value in zip(node.keys, node.values, strict=True)
                if isinstance(key, ast.Constant) and key.value == "reason" and _is_text(value)
            ]
    return found


# ------------------------------------------------------------------------------------------------ (a) the enum


def test_values_are_upper_camel_case_and_unique():
    values = [member.value for member in Reason]
    assert [v for v in values if not UPPER_CAMEL.fullmatch(v)] == []
    assert len(values) == len(set(values))


def test_member_names_spell_their_values():
    """ScaledToZero is SCALED_TO_ZERO: a member is found from the string a user reports, and back."""
    assert [m.name for m in Reason if m.name != re.sub(r"(?<!^)(?=[A-Z])", "_", m.value).upper()] == []


def test_members_are_plain_strings_on_the_wire():
    assert isinstance(Reason.CANARY_ROLLED_BACK, str)
    assert Reason.CANARY_ROLLED_BACK == "CanaryRolledBack"
    assert f"{Reason.SCALED_TO_ZERO}" == str(Reason.SCALED_TO_ZERO) == "ScaledToZero"


def test_drain_reasons_of_the_schema_are_reasons():
    """`status.drains[].reason` (crds, a layer below) takes a subset of the same strings."""
    assert {r.value for r in DrainReason} <= {r.value for r in Reason}


def test_reasons_module_imports_nothing_of_ours():
    tree = ast.parse((ROOT / "controllers" / "reasons.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "enum"}


def test_every_member_is_written_somewhere():
    """No dead reasons: each member is named in product code (`Reason.NAME`)."""
    used = {
        node.attr
        for path in _product_files()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Reason"
    }
    assert [m.name for m in Reason if m.name not in used] == []


# --------------------------------------------------------------------------------- (b) no reason spelled as text


@pytest.mark.parametrize(
    ("snippet", "count"),
    [
        ('EmitEvent(EventType.NORMAL, "Scaled", "m")', 1),
        ("EmitEvent(EventType.NORMAL, Reason.SCALED, 'm')", 0),
        ('EmitEvent(kind, f"Analysis{verdict}", "m")', 1),
        ('EmitEvent(type=EventType.WARNING, reason="ApiError", message="m")', 1),
        ('WantedCondition(ConditionType.DEGRADED, ConditionStatus.FALSE, "Healthy", "")', 1),
        ("WantedCondition(ConditionType.DEGRADED, ConditionStatus.FALSE, Reason.HEALTHY, '')", 0),
        ('Condition(type="Ready", status="True", reason="Current")', 1),
        ('CreatePod(manifest, "a", "r1", "ScaleUp", "m")', 1),
        ('DeletePod(n, u, v, r, "Failed", "m")', 1),
        ('StartDrain(n, u, a, v, r, "ScaleDown", "m", t, d)', 1),
        ('status.model_copy(update={"reason": "StepAdvanced", "message": why})', 1),
        ('status.model_copy(update={"reason": Reason.STEP_ADVANCED, "message": "m"})', 0),
        ('{"reason": reason, "message": "free text"}', 0),
        ("f(reason=reason)", 0),
        ('log.info("could not post %s", "reason")', 0),
        ('x = {"type": "Normal", "reason": "A", **{"reason": "B"}}', 2),
    ],
)
def test_scanner_finds_reasons_spelled_as_text(snippet, count):
    assert len(literal_reasons(snippet)) == count


def test_no_product_file_spells_a_reason_as_text():
    files = _product_files()
    assert (
        ROOT / "controllers" / "reconcile.py" in files and ROOT / "operator" / "fleet_operator" / "execute.py" in files
    )
    found = [hit for path in files for hit in literal_reasons(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "use controllers.reasons.Reason:\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------- (c) the docs


def _documented() -> set[str]:
    """The reasons in the first column of docs/reasons.md's tables."""
    rows = (line.split("|")[1].strip() for line in DOC.read_text().splitlines() if line.startswith("| `"))
    return {match.group(1) for cell in rows if (match := re.fullmatch(r"`([A-Za-z]+)`", cell))}


def test_docs_list_every_reason():
    assert sorted(m.value for m in Reason if m.value not in _documented()) == []


def test_docs_list_no_other_reason():
    assert sorted(_documented() - {m.value for m in Reason}) == []
