"""The layering of DESIGN.md section 4, checked on the source: no import circles, no upward imports.

The import graph is read with `ast` (nothing is imported), over every product package as pyproject.toml maps it
to folders. Every import statement counts wherever it stands: at module level, inside a function (a lazy import
is still a dependency) and under `if TYPE_CHECKING:` (a type-only import still ties the two modules together;
the lower module should own a Protocol instead). Relative imports are resolved against the importing module.
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg` (its `__init__`).
Implicit parent-package imports (`import a.b.c` also runs `a/__init__`) are not counted as edges.

Two checks: no cycle among modules (each strongly connected component is reported with one concrete cycle), and
no edge matching a row of FORBIDDEN. A unit test runs the cycle finder on a synthetic graph so it can fail.
"""

from __future__ import annotations

import ast
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top-level package -> folder, as in pyproject.toml ([tool.setuptools] package-dir and packages.find).
PACKAGES: dict[str, str] = {
    "crds": "crds",
    "controllers": "controllers",
    "fleet_operator": "operator/fleet_operator",
    "gateway": "gateway",
    "localkube": "localkube",
    "llmfleet": "llmfleet",
    "worker": "worker_image/worker",
}

# The worker's engine: it must not reach the HTTP server or the worker's top-level glue.
ENGINE = ("worker.core", "worker.model", "worker.engine")
OURS = tuple(PACKAGES)


@dataclass(frozen=True)
class Rule:
    """Modules under any of `sources` may not import modules under any of `targets`, except under `unless`.

    A prefix matches the module of that name and everything below it (`worker` matches `worker` and
    `worker.server.app`, not `workerx`).
    """

    why: str
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    unless: tuple[str, ...] = ()


FORBIDDEN: list[Rule] = [
    Rule(
        "crds and controllers are the bottom layers: they import no operator, gateway, localkube or worker",
        ("crds", "controllers"),
        ("fleet_operator", "gateway", "localkube", "worker", "llmfleet"),
    ),
    Rule("crds is below controllers", ("crds",), ("controllers",)),
    Rule(
        "the engine (worker.core, worker.model, worker.engine) imports nothing from the HTTP server or the "
        "worker's top-level glue",
        ENGINE,
        ("worker",),
        unless=ENGINE,
    ),
    Rule("localkube stands in for Kubernetes: it imports none of our packages", ("localkube",), OURS, ("localkube",)),
    Rule(
        "the gateway imports neither the operator, localkube nor the CLI",
        ("gateway",),
        ("fleet_operator", "localkube", "llmfleet"),
    ),
    Rule("nothing imports the CLI package", OURS, ("llmfleet",), unless=("llmfleet",)),
]


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _modules() -> dict[str, Path]:
    """Every product module name -> its file."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for imported in targets:
                # `import a.b.c` where only a.b is ours as a module (c an attribute) is an edge to the longest match.
                target = imported
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component: [a, b, ..., a]."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {component}")


def describe_cycles(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{len(c)} modules in one import circle: {', '.join(c)}\n    e.g. {' -> '.join(a_cycle(graph, c))}"
        for c in strongly_connected(graph)
    ]


def forbidden_edges(graph: dict[str, set[str]], rules: list[Rule]) -> list[str]:
    found = []
    for rule in rules:
        for source in sorted(graph):
            if not _under(source, rule.sources):
                continue
            for target in sorted(graph[source]):
                if _under(target, rule.targets) and not _under(target, rule.unless):
                    found.append(f"{source} -> {target}  ({rule.why})")
    return found


# --- the cycle finder on a synthetic graph ---------------------------------------------------------------------


def test_cycle_finder_finds_circles_and_only_circles():
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a -> b -> c -> a
        "d": {"e"},
        "e": {"d"},  # d <-> e
        "f": {"a", "d"},  # into circles, not part of one
        "g": set(),
    }
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert a_cycle(graph, ["d", "e"]) == ["d", "e", "d"]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    messages = describe_cycles(graph)
    assert len(messages) == 2 and "a -> b -> c -> a" in messages[0]


def test_rules_match_on_module_boundaries():
    graph = {"worker.core.x": {"worker.server.app", "worker.core.y", "workerx"}, "gateway.app": {"llmfleet.cli"}}
    rules = [
        Rule("engine", ("worker.core",), ("worker",), unless=("worker.core",)),
        Rule("gw", ("gateway",), ("llmfleet",)),
    ]
    assert forbidden_edges(graph, rules) == [
        "worker.core.x -> worker.server.app  (engine)",
        "gateway.app -> llmfleet.cli  (gw)",
    ]


def test_relative_imports_resolve():
    assert _resolve("a.b.c", False, ast.parse("from . import d").body[0]) == "a.b"
    assert _resolve("a.b.c", False, ast.parse("from ..x import d").body[0]) == "a.x"
    assert _resolve("a.b", True, ast.parse("from .c import d").body[0]) == "a.b.c"


# --- the product ------------------------------------------------------------------------------------------------


def test_packages_match_pyproject():
    """PACKAGES is the packaging's map: a package added to pyproject.toml is walked here too."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]} == set(PACKAGES)
    for package, folder in setuptools["package-dir"].items():
        if package:
            assert PACKAGES[package] == folder, package


def test_every_package_is_found():
    graph = build_graph()
    for package in PACKAGES:
        assert package in graph, package
    assert "worker.server.app" in graph and "fleet_operator.main" in graph


def test_no_import_circles():
    problems = describe_cycles(build_graph())
    assert not problems, "import circles:\n" + "\n".join(problems)


def test_no_forbidden_imports():
    problems = forbidden_edges(build_graph(), FORBIDDEN)
    assert not problems, "forbidden imports:\n" + "\n".join(problems)
