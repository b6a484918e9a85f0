"""The small JSONPath dialect CRDs use in ``additionalPrinterColumns`` and the scale subresource paths.

Supported: ``.a.b``, ``['key.with.dots']``, ``[0]``, ``[-1]``, ``[*]``, ``.*`` and filters
``[?(@.type=="Ready")]`` (``==``, ``!=``, existence ``[?(@.x)]``). ``{...}`` braces around an expression are allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z0-9_$\-]+")
_FILTER = re.compile(
    r"""^\?\(\s*@((?:\.[A-Za-z0-9_\-]+|\['[^']*'\])+)\s*(?:(==|!=)\s*(?:"([^"]*)"|'([^']*)'|(-?[0-9.]+)|(true|false)))?\s*\)$"""
)


class JSONPathError(ValueError):
    pass


@dataclass(frozen=True)
class Step:
    kind: str  # "key", "index", "all", "filter"
    key: str = ""
    index: int = 0
    filter_path: tuple[str, ...] = ()
    filter_op: str = ""
    filter_value: object = None


def _split_path(text: str) -> list[str]:
    keys = []
    for m in re.finditer(r"\.([A-Za-z0-9_\-]+)|\['([^']*)'\]", text):
        keys.append(m.group(1) if m.group(1) is not None else m.group(2))
    return keys


def compile_path(text: str) -> list[Step]:
    expr = text.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1].strip()
    if expr.startswith("$"):
        expr = expr[1:]
    steps: list[Step] = []
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == ".":
            i += 1
            if i < len(expr) and expr[i] == "*":
                steps.append(Step("all"))
                i += 1
                continue
            m = _NAME.match(expr, i)
            if not m:
                if i >= len(expr):
                    break
                raise JSONPathError(f"unrecognized identifier in {text!r} at {i}")
            steps.append(Step("key", key=m.group(0)))
            i = m.end()
        elif ch == "[":
            end = _find_bracket_end(expr, i)
            inner = expr[i + 1 : end].strip()
            i = end + 1
            if inner == "*":
                steps.append(Step("all"))
            elif inner.startswith(("'", '"')):
                steps.append(Step("key", key=inner[1:-1]))
            elif re.fullmatch(r"-?\d+", inner):
                steps.append(Step("index", index=int(inner)))
            elif inner.startswith("?"):
                m = _FILTER.match(inner)
                if not m:
                    raise JSONPathError(f"unsupported filter {inner!r} in {text!r}")
                if m.group(3) is not None:
                    value: object = m.group(3)
                elif m.group(4) is not None:
                    value = m.group(4)
                elif m.group(5) is not None:
                    value = float(m.group(5))
                elif m.group(6) is not None:
                    value = m.group(6) == "true"
                else:
                    value = None
                steps.append(
                    Step(
                        "filter",
                        filter_path=tuple(_split_path(m.group(1))),
                        filter_op=m.group(2) or "exists",
                        filter_value=value,
                    )
                )
            else:
                raise JSONPathError(f"unsupported subscript [{inner}] in {text!r}")
        elif ch.isspace():
            i += 1
        else:
            raise JSONPathError(f"unexpected {ch!r} in {text!r} at {i}")
    return steps


def _find_bracket_end(expr: str, start: int) -> int:
    depth, quote = 0, ""
    for j in range(start, len(expr)):
        c = expr[j]
        if quote:
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return j
    raise JSONPathError(f"unterminated [ in {expr!r}")


def _lookup(node: object, keys: tuple[str, ...]) -> tuple[bool, object]:
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _filter_match(item: object, step: Step) -> bool:
    found, value = _lookup(item, step.filter_path)
    if step.filter_op == "exists":
        return found and value is not None
    if not found:
        return False
    want = step.filter_value
    if isinstance(want, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        equal = float(value) == want
    else:
        equal = value == want
    return equal if step.filter_op == "==" else not equal


def find(obj: object, steps: list[Step]) -> list:
    """All values the path selects (empty when nothing matches)."""
    current = [obj]
    for step in steps:
        nxt: list = []
        for node in current:
            if step.kind == "key":
                if isinstance(node, dict) and step.key in node:
                    nxt.append(node[step.key])
            elif step.kind == "index":
                if isinstance(node, list) and -len(node) <= step.index < len(node):
                    nxt.append(node[step.index])
            elif step.kind == "all":
                if isinstance(node, dict):
                    nxt.extend(node.values())
                elif isinstance(node, list):
                    nxt.extend(node)
            elif step.kind == "filter":
                if isinstance(node, list):
                    nxt.extend(item for item in node if _filter_match(item, step))
                elif isinstance(node, dict) and _filter_match(node, step):
                    nxt.append(node)
        current = nxt
    return current


def simple_path(text: str) -> list[str]:
    """A plain ``.a.b.c`` path as keys (scale subresource paths must be of this form)."""
    steps = compile_path(text)
    if not steps or any(s.kind != "key" for s in steps):
        raise JSONPathError(f"{text!r} is not a simple .a.b path")
    return [s.key for s in steps]
