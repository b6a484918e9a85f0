"""bench/scheduler.py: its phases on the byte tokenizer, and `--base`, which steps a commit's engine and this tree's in
turn, each in its own process importing its own `worker_image` (here HEAD's, from a temporary worktree)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench" / "scheduler.py")


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_phases_of_a_step_are_timed() -> None:
    got = _run("--requests", "4", "--steps", "5", "--w-prompts")
    assert got["requests_running"] == 4 and got["steps"] == 5
    for phase in ("schedule", "update", "scheduler", "engine_core"):
        stats = got["wall"][phase]
        assert 0 < stats["p50_us"] <= stats["p99_us"]


def test_base_steps_both_engines_in_turn_and_removes_its_worktree() -> None:
    got = _run("--base", "HEAD", "--requests", "4", "--steps", "6", "--cold", "1", "--w-prompts")
    assert got["base"] == "HEAD" and got["steps"] == 6 and got["w_prompts"]
    for side in ("engine_core_base", "engine_core_new"):
        assert 0 < got[side]["p50_us"] <= got[side]["p99_us"]
    assert got["x_base_p50"] > 0 and got["x_base_of_p99"] > 0
    trees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True)
    assert "bench_base_" not in trees.stdout
