"""bench/panel_ab.py: the within-round ratio it reports, and two builds of the extension side by side in one process
(here this tree's build on both sides, and the build of HEAD from a temporary worktree)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import panel_ab
import pytest
from worker.model.kernels import _load_module


@pytest.mark.parametrize(
    ("base_s", "new_s", "flops", "expected"),
    [
        ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 4e9, {"base_gflops": 2.0, "new_gflops": 4.0, "ratio": 2.0}),
        # the host slows in round 2 for both sides: the ratio stays, the medians move
        ([1.0, 3.0, 1.1], [0.5, 1.5, 0.5], 1e9, {"base_gflops": 0.9, "new_gflops": 2.0, "ratio": 2.0}),
        # new is slower in one round of three: the median ignores it, min and max report it
        ([1.0, 1.0, 1.0], [0.8, 1.25, 0.8], 1e9, {"base_gflops": 1.0, "new_gflops": 1.2, "ratio": 1.25}),
    ],
)
def test_the_ratio_is_the_median_of_the_rounds_ratios(base_s, new_s, flops, expected) -> None:
    got = panel_ab.ratio_summary(base_s, new_s, flops)
    assert {k: got[k] for k in expected} == expected
    ratios = [b / n for b, n in zip(base_s, new_s, strict=True)]
    assert got["ratio_min"] == round(min(ratios), 3) and got["ratio_max"] == round(max(ratios), 3)


def test_rounds_must_pair_up() -> None:
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        panel_ab.ratio_summary([1.0, 2.0], [1.0], 1e9)
    with pytest.raises(ValueError):
        panel_ab.ratio_summary([], [], 1e9)


def _built() -> None:
    if _load_module()[0] is None:
        pytest.skip("the extension does not build here")


def test_a_build_compared_with_itself_runs_every_path_and_row_count() -> None:
    _built()
    module = panel_ab.load_module_file(panel_ab.module_file(panel_ab.ROOT / "worker_image"))
    paths = ("f32", "i8", "fp8") + (("bf16",) if module.bf16_panels_ready() else ())
    got = panel_ab.compare(module, module, paths, [1, 5], layers=1, rounds=2)
    assert set(got) == set(paths) and all(set(cells) == {"1", "5"} for cells in got.values())
    for cells in got.values():
        for cell in cells.values():
            assert cell["base_gflops"] > 0 and cell["new_gflops"] > 0
            assert 0 < cell["ratio_min"] <= cell["ratio"] <= cell["ratio_max"]


def test_the_base_is_built_from_a_worktree_that_is_removed_afterwards() -> None:
    _built()
    path = Path(panel_ab.base_module_file("HEAD"))
    assert path.is_file() and path.name.startswith("llmfleet_paged_decode_")
    trees = subprocess.run(
        ["git", "-C", str(panel_ab.ROOT), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert "panel_ab_" not in trees


def test_against_times_one_builds_paths_against_another_path() -> None:
    """`--against f32`: both sides are this tree's build (no base module is touched: None here), the base side on
    f32 and the new side on each path."""
    _built()
    module = panel_ab.load_module_file(panel_ab.module_file(panel_ab.ROOT / "worker_image"))
    got = panel_ab.compare(None, module, ("i8", "fp8"), [1, 5], layers=1, rounds=2, against="f32")
    assert set(got) == {"i8", "fp8"} and all(set(cells) == {"1", "5"} for cells in got.values())
    for cells in got.values():
        for cell in cells.values():
            assert cell["base_gflops"] > 0 and cell["new_gflops"] > 0
            assert 0 < cell["ratio_min"] <= cell["ratio"] <= cell["ratio_max"]
