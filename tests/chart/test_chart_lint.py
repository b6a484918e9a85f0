"""`helm lint` (plain and --strict) passes for every value set; values.yaml and Chart.yaml pass yamllint.

Lint catches what rendering alone does not: Chart.yaml metadata, values.schema.json applied to the defaults,
template warnings that --strict turns into failures.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "llmfleet"
YAMLLINT_CONFIG = "{extends: default, rules: {line-length: {max: 120}, comments: {min-spaces-from-content: 1}}}"


@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint_passes(run_helm, strict):
    result = run_helm("lint", str(CHART), *(["--strict"] if strict else []))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_helm_lint_strict_passes_with_each_value_set(run_helm, value_set, value_sets, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(value_sets[value_set]))
    result = run_helm("lint", str(CHART), "--strict", "--namespace", "llm", "-f", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["values.yaml", "Chart.yaml"])
def test_plain_yaml_files_pass_yamllint(name):
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-d", YAMLLINT_CONFIG, str(CHART / name)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
