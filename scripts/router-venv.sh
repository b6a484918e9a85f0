#!/usr/bin/env bash
# Creates .venv-router: vllm-router (the vLLM project's Rust request router, PyPI `vllm-router`) in a venv of its
# own, used only by bench/gateway_vs_router.py as the reference our gateway is measured against. It never enters
# the project's own venv. Idempotent: does nothing when the router is already installed.
#   scripts/router-venv.sh [VENV_DIR]        (default: .venv-router next to this repository's Makefile)
set -euo pipefail
VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-router}"
if [ -x "$VENV/bin/vllm-router" ] && "$VENV/bin/python" -c "import vllm_router" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-router==$VERSION"
"$VENV/bin/vllm-router" --help >/dev/null
echo "vllm-router $VERSION installed in $VENV"
