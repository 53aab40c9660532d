#!/usr/bin/env bash
# Runs each C unit test binary given as an argument; prints one summary line.
# CT_TEST_RUNNER: a command that runs each binary (qemu-aarch64 for the cross build,
# scripts/test_aarch64.sh); CT_TEST_LABEL: a prefix for the summary line.
# CT_TEST_TIMEOUT: seconds one binary may run (default 1200, room for the sanitized build on
# a loaded 2-core machine, where test_kernels alone takes minutes): a test that hangs (a
# deadlock, a spin in an emulated pthread_create) must fail the suite with its name,
# not stall CI until the job's own limit kills it without saying which.
set -u
RUNNER=${CT_TEST_RUNNER:-}
LIMIT=${CT_TEST_TIMEOUT:-1200}
pass=0; fail=0; timedout=0
for t in "$@"; do
  # -k: a test that ignores SIGTERM is killed 10 s later
  timeout -k 10 "$LIMIT" $RUNNER "$t"
  rc=$?
  if [ $rc -eq 0 ]; then pass=$((pass+1))
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "TIMEOUT: $t ran over ${LIMIT} s (CT_TEST_TIMEOUT) and was stopped"
    fail=$((fail+1)); timedout=$((timedout+1))
  else echo "FAILED: $t (exit $rc)"; fail=$((fail+1)); fi
done
extra=""; [ $timedout -gt 0 ] && extra=" ($timedout timed out)"
echo "${CT_TEST_LABEL:-}c-tests: $pass passed, $fail failed$extra"
[ "$fail" -eq 0 ]
