"""Label and field selectors, in both their query-string form and the ``LabelSelector`` object form.

The grammar follows ``k8s.io/apimachinery/pkg/labels`` (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``,
``>``, ``<``) and ``fields`` (``=``, ``==``, ``!=``). Field selectors read dotted paths into the object, with the set
of allowed paths decided by the resource (see ``registry``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from localkube.errors import ApiError, bad_request


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("gt", "lt"):
            if not present:
                return False
            try:
                have, want = int(str(value)), int(self.values[0])
            except (TypeError, ValueError):
                return False
            return have > want if self.op == "gt" else have < want
        raise AssertionError(self.op)


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: dict | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


_SET_RE = re.compile(r"^([^\s!=<>(),]+)\s+(in|notin)\s*\((.*)\)$")
_CMP_RE = re.compile(r"^([^\s!=<>(),]+)\s*(==|=|!=|>|<)\s*([^\s!=<>(),]*)$")
_KEY_RE = re.compile(r"^(!?)\s*([^\s!=<>(),]+)$")


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse ``labelSelector=`` text; a malformed selector is a 400 like the real server's."""
    if not text:
        return LabelSelector()
    reqs: list[Requirement] = []
    for part in _split_top_level(text):
        if m := _SET_RE.match(part):
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(Requirement(m.group(1), m.group(2), values))
        elif m := _CMP_RE.match(part):
            op = {"==": "=", "=": "=", "!=": "!=", ">": "gt", "<": "lt"}[m.group(2)]
            if op in ("gt", "lt") and not re.fullmatch(r"-?\d+", m.group(3)):
                raise bad_request(
                    f"unable to parse requirement: for 'gt', 'lt' operators, the value must be an integer: {part}"
                )
            reqs.append(Requirement(m.group(1), op, (m.group(3),)))
        elif m := _KEY_RE.match(part):
            reqs.append(Requirement(m.group(2), "!" if m.group(1) else "exists"))
        else:
            raise bad_request(f"unable to parse requirement: found '{part}', expected: identifier")
    return LabelSelector(tuple(reqs))


def selector_from_object(selector: dict | None) -> LabelSelector | None:
    """A ``metav1.LabelSelector`` object (``matchLabels`` + ``matchExpressions``); None selects nothing."""
    if selector is None:
        return None
    reqs = [Requirement(k, "=", (str(v),)) for k, v in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        op = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}.get(expr.get("operator", ""))
        if op is None:
            raise ApiError(422, "Invalid", f"invalid label selector operator {expr.get('operator')!r}")
        reqs.append(Requirement(expr.get("key", ""), op, tuple(expr.get("values") or ())))
    return LabelSelector(tuple(reqs))


def selector_from_map(labels: dict | None) -> LabelSelector | None:
    """A Service-style ``selector`` map; an empty or missing one selects nothing."""
    if not labels:
        return None
    return LabelSelector(tuple(Requirement(k, "=", (str(v),)) for k, v in labels.items()))


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    negate: bool
    value: str


@dataclass(frozen=True)
class FieldSelector:
    requirements: tuple[FieldRequirement, ...] = ()

    def matches(self, obj: dict) -> bool:
        return all((field_value(obj, r.path) == r.value) != r.negate for r in self.requirements)

    def value_of(self, path: str) -> str | None:
        """The value an ``=`` requirement pins ``path`` to, if any (used to narrow list scans)."""
        for r in self.requirements:
            if r.path == path and not r.negate:
                return r.value
        return None


def parse_field_selector(text: str | None, allowed: frozenset[str] | None) -> FieldSelector:
    if not text:
        return FieldSelector()
    reqs = []
    for part in _split_top_level(text):
        m = re.match(r"^([^=!]+?)\s*(==|=|!=)\s*(.*)$", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        path = m.group(1).strip()
        if allowed is not None and path not in allowed:
            raise bad_request(f"field label not supported: {path}")
        reqs.append(FieldRequirement(path, m.group(2) == "!=", m.group(3).strip()))
    return FieldSelector(tuple(reqs))


def field_value(obj: dict, path: str) -> str:
    """The string a field selector compares against: missing fields read as ``""``, booleans as ``true``/``false``."""
    node: object = obj
    for part in path.split("."):
        if not isinstance(node, dict):
            return ""
        node = node.get(part)
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    if isinstance(node, list):
        return ",".join(str(item.get("ip", item)) if isinstance(item, dict) else str(item) for item in node)
    return str(node)
