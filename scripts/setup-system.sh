#!/usr/bin/env bash
# System-level set-up that pip cannot do: Debian packages the local fleet and its e2e tests use.
# Idempotent and quiet when everything is present. Runs as root on the dev/CI machines; elsewhere it
# prints what is missing instead of failing (the unit tests need none of it).
set -euo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v unzip >/dev/null 2>&1 || need+=(unzip)
# g++ builds the worker's native paged-decode attention kernel at first use (without it: slower torch fallback).
command -v g++ >/dev/null 2>&1 || need+=(g++)
if ((${#need[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup-system: installing ${need[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    # The Debian package starts a system Prometheus on :9090 via systemd/init where one exists; we never use it.
    (service prometheus stop || true) >/dev/null 2>&1
  else
    echo "setup-system: missing ${need[*]}; install them to run the local fleet and e2e tests" >&2
  fi
fi
