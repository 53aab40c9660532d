#!/usr/bin/env bash
# Launches `ctitan train` on NPROC ranks, as torchtitan's run_train.sh does with torchrun:
#
#   NPROC=8 CONFIG_FILE=configs/debug.toml ./scripts/run_train.sh --training.steps=10
#
# NPROC        ranks (default 1: no mpirun at all, one plain process)
# CONFIG_FILE  the TOML config (default configs/debug.toml)
# LOG_RANK     ranks whose output is shown: "0" (default), "0,3" or "all"
# HOSTFILE     an OpenMPI hostfile to spread the ranks over several machines
#              (docs/distributed.md); without it every rank runs here, oversubscribed
#              when NPROC exceeds the cores
# CTITAN       the binary (default build/ctitan next to this script)
# MPIRUN_ARGS  anything else for mpirun
# Further arguments are config overrides (--section.key=value).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
NPROC=${NPROC:-1}
CONFIG_FILE=${CONFIG_FILE:-configs/debug.toml}
export CTITAN_LOG_RANKS=${LOG_RANK:-0}
CTITAN=${CTITAN:-$here/build/ctitan}

if [ "$NPROC" = 1 ] && [ -z "${HOSTFILE:-}" ]; then
  exec "$CTITAN" train --config "$CONFIG_FILE" "$@"
fi
command -v mpirun >/dev/null || { echo "run_train.sh: mpirun not found (scripts/setup.sh installs openmpi-bin)" >&2; exit 1; }
# OpenMPI refuses to run as root unless told twice
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# No core binding: ctitan runs OpenMP threads in each rank (cores / local ranks of them,
# at least 1, unless OMP_NUM_THREADS or training.threads says otherwise).
args=(-np "$NPROC" --bind-to none -x CTITAN_LOG_RANKS)
[ -n "${OMP_NUM_THREADS:-}" ] && args+=(-x OMP_NUM_THREADS)
if [ -n "${HOSTFILE:-}" ]; then
  args+=(--hostfile "$HOSTFILE")
else
  args+=(--oversubscribe)
fi
# shellcheck disable=SC2086
exec mpirun "${args[@]}" ${MPIRUN_ARGS:-} "$CTITAN" train --config "$CONFIG_FILE" "$@"
