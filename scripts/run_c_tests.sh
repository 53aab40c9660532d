#!/usr/bin/env bash
# Runs each C unit test binary given as an argument; prints one summary line.
# CT_TEST_RUNNER: a command that runs each binary (qemu-aarch64 for the cross build,
# scripts/test_aarch64.sh); CT_TEST_LABEL: a prefix for the summary line.
set -u
RUNNER=${CT_TEST_RUNNER:-}
pass=0; fail=0
for t in "$@"; do
  if $RUNNER "$t"; then pass=$((pass+1)); else echo "FAILED: $t"; fail=$((fail+1)); fi
done
echo "${CT_TEST_LABEL:-}c-tests: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
