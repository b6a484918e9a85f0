"""Paths named in the docs exist in the repository.

The README, docs/*.md and the chart's values.yaml name files and folders (`controllers/rollout.py`,
`worker_image/Dockerfile`, `docs/security.md`); when code moves, those names go stale silently. This test finds
every token that looks like a repository path (it starts with one of the repository's top-level folders) and fails
listing each one that does not exist.

What counts as a path, kept simple on purpose:
- a token starting with a top-level folder name and a '/', not glued to a word, dot, slash or dash before it
  (`fleet_operator/x.py` and `https://host/docs/x` are not repository paths);
- trailing punctuation (`.`, `,`, `:`, `;`, `)`) is not part of it;
- `...` is a placeholder for "something below": only the part before it must exist (`templates/...`);
- `*`, `?` and `[...]` are globs, `<name>` and `{name}` placeholders: at least one file must match;
- an ALL-CAPS file stem is a placeholder (`bench/NAME.py`) when no file of that literal name exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")),
    "charts/llmfleet/values.yaml",
]
_PATH_CHARS = r"[\w.*?/<>{}\[\]-]"
_CAPS_STEM = re.compile(r"(?<![^/])[A-Z][A-Z0-9_]+(?=\.\w+$|$)")
_PLACEHOLDER = re.compile(r"<[^/>]*>|\{[^/}]*\}")


def top_level_folders(root: Path) -> list[str]:
    """The repository's own top-level folders (not hidden ones, virtual environments or build metadata)."""
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith((".", "_")) and not p.name.endswith(".egg-info")
    )


def candidate_paths(text: str, tops: list[str]) -> list[str]:
    """Tokens of `text` that look like repository paths, as written (placeholders and globs kept)."""
    names = "|".join(re.escape(t) for t in sorted(tops, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./-])(?:{names})/{_PATH_CHARS}*")
    found = []
    for match in pattern.finditer(text):
        token = match.group(0)
        if "..." not in token:
            token = token.rstrip(".,:;")
        found.append(token)
    return found


def exists(token: str, root: Path) -> bool:
    """Whether the path `token` (with its placeholders and globs) names something in `root`."""
    path = token.split("...")[0] if "..." in token else token
    path = path.rstrip("/") or "."
    if (root / path).exists():
        return True
    pattern = _PLACEHOLDER.sub("*", path)
    pattern = _CAPS_STEM.sub("*", pattern)
    if pattern == path and not any(c in path for c in "*?["):
        return False
    return any(root.glob(pattern))


def missing_paths(text: str, root: Path) -> list[str]:
    return [t for t in candidate_paths(text, top_level_folders(root)) if not exists(t, root)]


@pytest.fixture
def fake_repo(tmp_path: Path) -> Path:
    for name in (
        "controllers/rollout.py",
        "bench/engine.py",
        "docs/security.md",
        "worker_image/Dockerfile",
        "charts/llmfleet/templates/gateway.yaml",
        "operator/fleet_operator/handlers.py",
        "README.md",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / ".venv").mkdir()
    (tmp_path / "llmfleet.egg-info").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("see `controllers/rollout.py`.", ["controllers/rollout.py"]),
        ("controllers/rollout.py, bench/engine.py: both", ["controllers/rollout.py", "bench/engine.py"]),
        ("(docs/security.md)", ["docs/security.md"]),
        ("`operator/fleet_operator/handlers.py`", ["operator/fleet_operator/handlers.py"]),
        ("fleet_operator/handlers.py and my-bench/x.py and a.bench/x", []),  # glued to a word: not ours
        ("https://example.com/docs/security.md", []),  # inside a URL
        ("charts/llmfleet/templates/...", ["charts/llmfleet/templates/..."]),
        ("docs/*.md", ["docs/*.md"]),
        ("controllers/ and bench/", ["controllers/", "bench/"]),
        ("crd/x.py and .venv/bin/python", []),  # not top-level folders of the repository
    ],
)
def test_candidate_paths(fake_repo: Path, text: str, found: list[str]) -> None:
    assert candidate_paths(text, top_level_folders(fake_repo)) == found


@pytest.mark.parametrize(
    ("token", "present"),
    [
        ("controllers/rollout.py", True),
        ("controllers/", True),
        ("controllers/autoscaling_sim.py", False),
        ("operator/Dockerfile", False),
        ("docs/*.md", True),
        ("docs/*.rst", False),
        ("charts/llmfleet/templates/...", True),
        ("charts/llmfleet/nowhere/...", False),
        ("bench/NAME.py", True),  # an ALL-CAPS placeholder
        ("bench/NAME.sh", False),
        ("charts/llmfleet/templates/<component>.yaml", True),
        ("worker_image/Dockerfile", True),
        ("worker_image/Dockerfile.gpu", False),
    ],
)
def test_exists(fake_repo: Path, token: str, present: bool) -> None:
    assert exists(token, fake_repo) is present


def test_missing_paths_lists_each_stale_path(fake_repo: Path) -> None:
    text = "Build `operator/Dockerfile`; see docs/security.md and localkube/apiserver/, bench/engine.py."
    assert missing_paths(text, fake_repo) == ["operator/Dockerfile"]  # localkube is no folder of the fake repo
    (fake_repo / "localkube").mkdir()
    assert missing_paths(text, fake_repo) == ["operator/Dockerfile", "localkube/apiserver/"]


@pytest.mark.parametrize("doc", DOCS)
def test_paths_in_docs_exist(doc: str) -> None:
    stale = missing_paths((REPO / doc).read_text(encoding="utf-8"), REPO)
    assert not stale, f"{doc} names paths that do not exist in the repository: {stale}"
