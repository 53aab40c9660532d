#!/usr/bin/env bash
# Runs each C unit test binary given as an argument; prints one summary line.
set -u
pass=0; fail=0
for t in "$@"; do
  if "$t"; then pass=$((pass+1)); else echo "FAILED: $t"; fail=$((fail+1)); fi
done
echo "c-tests: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
