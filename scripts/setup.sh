#!/usr/bin/env bash
# Idempotent set-up for `make run` and `make test` on Debian 12 as root:
# Debian packages for the build, then the test-only Python venv in .venv.
# Fast when everything is already there (a dpkg query and a stamp compare).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(gcc make libc6-dev libcjson-dev libopenblas-openmp-dev libpcre2-dev libutf8proc-dev libxxhash-dev
          libcurl4-openssl-dev openmpi-bin libopenmpi-dev iproute2
          bible-kjv bible-kjv-text python3-pip
          python3 python3-venv
          clang libclang-rt-14-dev libomp-14-dev
          libcairo2-dev fonts-dejavu-core strace)
# cairo renders `ctitan report --png` (src/report/png.c), its text in DejaVu Sans.
# strace counts a checkpoint load's preads in tests/py/test_ckpt_pread_count.py.
# clang 14 builds the fuzz targets (make fuzz, tests/fuzz): libclang-rt-14-dev holds libFuzzer and
# the sanitizer runtimes, libomp-14-dev the omp.h clang's -fopenmp needs.
# Installs those of the named packages that are missing (root only); $1 names them in messages.
apt_ensure() {
  local what="$1"; shift
  local p missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "setup: installing Debian packages$what: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: error: need root to apt-get install ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
apt_ensure "" "${APT_PKGS[@]}"

# `make run` needs only the build; the cross toolchain and the venv are for the tests.
[ "${1:-}" = "--no-venv" ] && exit 0

# Headless Chromium opens `ctitan report`'s page in tests/py/test_report.py (the browser is
# the oracle that the page draws; the test fails without it). Tests only: not for `make run`.
apt_ensure " for the tests" chromium

# The aarch64 cross build and qemu-user for `make test-aarch64` (part of `make test`): the
# arm64 libraries are Debian's multiarch packages beside the amd64 ones (OpenMPI is not
# co-installable, so the cross build has none: CT_NO_MPI). Best effort: a failure here
# is a warning, and test-aarch64 then says "aarch64: skipped". CTITAN_NO_CROSS=1 skips it.
ARM_PKGS=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user libc6:arm64 libgomp1:arm64
          libopenblas-openmp-dev:arm64 libcjson-dev:arm64 libpcre2-dev:arm64 libutf8proc-dev:arm64
          libcurl4-openssl-dev:arm64)
if [ -z "${CTITAN_NO_CROSS:-}" ] && [ "$(dpkg --print-architecture 2>/dev/null)" = amd64 ]; then
  arm_missing=()
  for p in "${ARM_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || arm_missing+=("$p")
  done
  if [ ${#arm_missing[@]} -gt 0 ]; then
    echo "setup: installing the aarch64 cross toolchain and qemu-user: ${arm_missing[*]}"
    if [ "$(id -u)" -ne 0 ]; then
      echo "setup: warning: need root for the aarch64 packages; make test-aarch64 will be skipped" >&2
    elif ! ( export DEBIAN_FRONTEND=noninteractive
             dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
             apt-get update -qq && apt-get install -y -qq --no-install-recommends "${arm_missing[@]}" >/dev/null ); then
      echo "setup: warning: the aarch64 cross packages did not install; make test-aarch64 will be skipped" >&2
    fi
  fi
fi

REQ=tests/requirements.txt
# read as source only (the tests take torchtitan's own functions from it), so none of its
# dependencies are installed
REQ_NODEPS=tests/requirements-nodeps.txt
STAMP=.venv/.ctitan-setup
want=$(cat "$REQ" "$REQ_NODEPS" | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "setup: creating the test venv in .venv (torch, transformers, ... from PyPI)"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r "$REQ"
.venv/bin/pip install -q --disable-pip-version-check --no-deps -r "$REQ_NODEPS"
echo "$want" > "$STAMP"
