#!/usr/bin/env bash
# Idempotent set-up for `make run` and `make test` on Debian 12 as root:
# Debian packages for the build, then the test-only Python venv in .venv.
# Fast when everything is already there (a dpkg query and a stamp compare).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(gcc make libc6-dev libcjson-dev libopenblas-openmp-dev libpcre2-dev libutf8proc-dev libxxhash-dev
          openmpi-bin libopenmpi-dev
          bible-kjv bible-kjv-text python3-pip
          python3 python3-venv)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: error: need root to apt-get install ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# `make run` needs only the build; the venv is for the tests.
[ "${1:-}" = "--no-venv" ] && exit 0

REQ=tests/requirements.txt
STAMP=.venv/.ctitan-setup
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "setup: creating the test venv in .venv (torch, transformers, ... from PyPI)"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r "$REQ"
echo "$want" > "$STAMP"
