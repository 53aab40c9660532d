#!/usr/bin/env bash
# The libFuzzer targets of tests/fuzz (docs/reliability.md, "Fuzzing"); `make fuzz` builds them.
#   scripts/fuzz.sh seeds           seed corpora into build/fuzz/corpus/<target>/ (scripts/fuzz_seeds.py)
#   scripts/fuzz.sh short           every target FUZZ_SHORT_RUNS executions (default 15000) over its seeds;
#                                   exit 1 on the first crash, leak or UB report (make fuzz-short, make test)
#   scripts/fuzz.sh long [T...]     FUZZ_LONG_RUNS executions (default 1000000) per target, one at a time,
#                                   at nice 15; inputs it finds kept in build/fuzz/work/<target>/, the log in
#                                   build/fuzz/logs/<target>.log, one figures line per target on stdout
# FUZZ_BIN=DIR runs the binaries copied there (a long run goes on while build/fuzz is rebuilt).
# A crashing input is written to build/fuzz/crashes/<target>-...; rerun it with build/fuzz/<target> FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${FUZZ_BUILD:-build/fuzz} # FUZZ_BUILD: another tree (tests run stub targets in a temp dir)
mode=${1:-short}
shift || true

# UB aborts (the objects are built with -fno-sanitize-recover=undefined); leaks fail the run.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

targets=()
for f in tests/fuzz/fuzz_*.c; do targets+=("$(basename "$f" .c)"); done
[ $# -gt 0 ] && targets=("$@")

dict_of() {
    case $1 in
        fuzz_toml) echo tests/fuzz/dict/toml.dict ;;
        fuzz_chat_template) echo tests/fuzz/dict/jinja.dict ;;
        fuzz_npy | fuzz_bpe) echo "" ;;
        *) echo tests/fuzz/dict/json.dict ;;
    esac
}

seeds() {
    rm -rf "$B/corpus"
    python3 scripts/fuzz_seeds.py "$B/corpus"
}

# libFuzzer's closing lines, as "execs exec/s seconds cov ft"
figures() {
    local log=$1
    local execs secs cov ft eps
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    echo "${execs:-?} ${eps:-?} ${secs:-?} ${cov:-?} ${ft:-?}"
}

# 12s, 3m04s, 1h02m: the ETA form of core/progress.h
fmt_s() {
    local t=$1
    if [ "$t" -ge 3600 ]; then printf '%dh%02dm' $((t / 3600)) $((t / 60 % 60))
    elif [ "$t" -ge 60 ]; then printf '%dm%02ds' $((t / 60)) $((t % 60))
    else printf '%ds' "$t"; fi
}

# One line per finished target on stderr (stdout of `long` is its figures table):
# "[3/13] fuzz_x: N execs in 4s; elapsed 30s, ETA 1m40s", the ETA the mean time per
# target so far times the targets left (targets differ, so it is a rough guide).
progress() { # index count target log start
    local i=$1 n=$2 t=$3 log=$4 start=$5 now el execs
    now=$(date +%s); el=$((now - start))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    echo "fuzz: [$i/$n] $t: ${execs:-?} execs; elapsed $(fmt_s "$el"), ETA $(fmt_s $((el * (n - i) / i)))" >&2
}

run_one() { # target runs workdir log
    local t=$1 runs=$2 work=$3 log=$4 d
    d=$(dict_of "$t")
    mkdir -p "$work" "$B/crashes"
    local args=(-runs="$runs" -seed=1 -timeout=20 -rss_limit_mb=2048 -print_final_stats=1
                -artifact_prefix="$B/crashes/$t-")
    [ -n "$d" ] && args+=(-dict="$d")
    "${FUZZ_BIN:-$B}/$t" "${args[@]}" "$work" "$B/corpus/$t" > "$log" 2>&1
}

case $mode in
seeds) seeds ;;
short)
    seeds
    runs=${FUZZ_SHORT_RUNS:-15000}
    mkdir -p "$B/logs"
    start=$(date +%s)
    i=0
    for t in "${targets[@]}"; do
        i=$((i + 1))
        work=$(mktemp -d "${TMPDIR:-/tmp}/ctitan-fuzz-short.XXXXXX")
        if ! run_one "$t" "$runs" "$work" "$B/logs/$t-short.log"; then
            rm -rf "$work"
            tail -n 40 "$B/logs/$t-short.log"
            echo "fuzz-short: $t FAILED (log: $B/logs/$t-short.log, input: $B/crashes/$t-*)" >&2
            exit 1
        fi
        rm -rf "$work"
        progress "$i" "${#targets[@]}" "$t" "$B/logs/$t-short.log" "$start"
    done
    echo "fuzz-short: ${#targets[@]} targets x $runs executions, 0 crashes, 0 leaks, 0 UB reports ($(( $(date +%s) - start )) s)"
    ;;
long)
    [ -d "$B/corpus" ] || seeds
    runs=${FUZZ_LONG_RUNS:-1000000}
    mkdir -p "$B/logs"
    echo "target executions exec/s seconds cov ft result"
    start=$(date +%s)
    i=0
    for t in "${targets[@]}"; do
        i=$((i + 1))
        res=ok
        nice -n 15 bash -c "$(declare -f run_one dict_of); B=$B; FUZZ_BIN=${FUZZ_BIN:-}; run_one $t $runs $B/work/$t $B/logs/$t.log" || res=FAILED
        echo "$t $(figures "$B/logs/$t.log") $res"
        progress "$i" "${#targets[@]}" "$t" "$B/logs/$t.log" "$start"
    done
    ;;
*) echo "usage: scripts/fuzz.sh seeds | short | long [target...]" >&2; exit 2 ;;
esac
