#!/usr/bin/env bash
# timed.sh LABEL CMD...: run CMD, then say how long it took (wall and the CPU of everything it
# ran) and add that line to build/test-times.txt, so a CI log shows where `make test`'s time goes.
# The exit status is CMD's.
label=$1
shift
# `times`' second line is the children's user and system time, as "XmY.YYYs XmY.YYYs"; read
# through a file because `times` in a $(...) subshell would report the subshell's children.
# Read before and after CMD, and the difference kept: this shell may not start from zero. A
# lane's `bash -c "timed.sh A ... && timed.sh B ..."` execs its last command, so B's timed.sh
# is the lane's shell itself and inherits, through exec, the children's time it had already
# waited for (all of A): fuzz-short once said 605 s CPU in 65 s wall on 2 cores, sanitize's
# 512 s with its own 93.
tf=$(mktemp)
children_cpu() { # of the `times` in $tf
  sed -n 2p "$tf" | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); s += p[1] * 60 + p[2] } printf "%.3f", s }'
}
times > "$tf"
cpu0=$(children_cpu)
t0=$(date +%s.%N)
"$@"
rc=$?
t1=$(date +%s.%N)
times > "$tf"
cpu=$(awk -v a="$cpu0" -v b="$(children_cpu)" 'BEGIN { printf "%.0f", b - a }')
rm -f "$tf"
line=$(awk -v a="$t0" -v b="$t1" -v l="$label" -v c="$cpu" -v r="$rc" \
    'BEGIN { printf "make test: %-12s %6.0f s wall %6d s CPU%s", l, b - a, c, (r ? "  (failed, exit " r ")" : "") }')
echo "$line"
mkdir -p build && echo "$line" >> build/test-times.txt
exit $rc
