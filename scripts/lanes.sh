#!/usr/bin/env bash
# lanes.sh NAME=CMD...: runs each CMD (a shell command line) at the same time, each into its own
# log (build/lanes/NAME.log), and prints a lane's whole log, with its wall time and exit status,
# as soon as it ends. Exits non-zero if any lane failed, after all have ended.
#
# Why: `make test`'s parts after the first build are independent (the C tests, the aarch64 build
# under qemu, the sanitized build, the fuzzers, the pytest passes) and none keeps two cores busy
# on its own: the C tests, qemu and the sanitized tests run mostly one thread, and the pytest
# passes wait on process start-up and on mpirun. One after the other they took ~44 min on the 2-core CI machine; side
# by side their CPU time fits in about half of that (build/test-times.txt has both figures).
# Whole logs, one lane at a time, keep the CI log readable.
set -u
mkdir -p build/lanes
declare -A name_of start_of
for spec in "$@"; do
  name=${spec%%=*}
  cmd=${spec#*=}
  bash -c "$cmd" > "build/lanes/$name.log" 2>&1 &
  name_of[$!]=$name
  start_of[$!]=$SECONDS
  echo "lane $name: started ($cmd)"
done
failed=()
while [ ${#name_of[@]} -gt 0 ]; do
  wait -n -p pid
  rc=$?
  [ -n "${pid:-}" ] || break
  name=${name_of[$pid]}
  echo "================ lane $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") after $((SECONDS - ${start_of[$pid]})) s ================"
  cat "build/lanes/$name.log"
  [ $rc -eq 0 ] || failed+=("$name")
  unset "name_of[$pid]"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "lanes FAILED: ${failed[*]}"
  exit 1
fi
