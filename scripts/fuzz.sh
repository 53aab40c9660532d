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
B=build/fuzz
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
    for t in "${targets[@]}"; do
        work=$(mktemp -d "${TMPDIR:-/tmp}/ctitan-fuzz-short.XXXXXX")
        if ! run_one "$t" "$runs" "$work" "$B/logs/$t-short.log"; then
            rm -rf "$work"
            tail -n 40 "$B/logs/$t-short.log"
            echo "fuzz-short: $t FAILED (log: $B/logs/$t-short.log, input: $B/crashes/$t-*)" >&2
            exit 1
        fi
        rm -rf "$work"
    done
    echo "fuzz-short: ${#targets[@]} targets x $runs executions, 0 crashes, 0 leaks, 0 UB reports ($(( $(date +%s) - start )) s)"
    ;;
long)
    [ -d "$B/corpus" ] || seeds
    runs=${FUZZ_LONG_RUNS:-1000000}
    mkdir -p "$B/logs"
    echo "target executions exec/s seconds cov ft result"
    for t in "${targets[@]}"; do
        res=ok
        nice -n 15 bash -c "$(declare -f run_one dict_of); B=$B; FUZZ_BIN=${FUZZ_BIN:-}; run_one $t $runs $B/work/$t $B/logs/$t.log" || res=FAILED
        echo "$t $(figures "$B/logs/$t.log") $res"
    done
    ;;
*) echo "usage: scripts/fuzz.sh seeds | short | long [target...]" >&2; exit 2 ;;
esac
