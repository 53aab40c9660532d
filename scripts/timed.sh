#!/usr/bin/env bash
# timed.sh LABEL CMD...: run CMD, then say how long it took (wall and the CPU of everything it
# ran) and add that line to build/test-times.txt, so a CI log shows where `make test`'s time goes.
# The exit status is CMD's.
label=$1
shift
t0=$(date +%s.%N)
"$@"
rc=$?
t1=$(date +%s.%N)
# `times`' second line is the children's user and system time, as "XmY.YYYs XmY.YYYs"; read
# through a file because `times` in a $(...) subshell would report the subshell's children.
tf=$(mktemp)
times > "$tf"
cpu=$(sed -n 2p "$tf" | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); s += p[1] * 60 + p[2] } printf "%.0f", s }')
line=$(awk -v a="$t0" -v b="$t1" -v l="$label" -v c="$cpu" -v r="$rc" \
    'BEGIN { printf "make test: %-12s %6.0f s wall %6d s CPU%s", l, b - a, c, (r ? "  (failed, exit " r ")" : "") }')
echo "$line"
mkdir -p build && echo "$line" >> build/test-times.txt
exit $rc
