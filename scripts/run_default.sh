#!/usr/bin/env bash
# `make run`: train the debug flavor from scratch on a generated token file
# with learnable structure, and show the loss falling.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p data
[ -f data/debug_tokens.bin ] || python3 scripts/gen_tokens.py data/debug_tokens.bin
./build/ctitan train --config configs/debug.toml "$@"
echo
python3 - <<'PY'
import json
rows = [json.loads(l) for l in open("outputs/debug/metrics.jsonl")]
first, last = rows[0], rows[-1]
print(f"make run: loss {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']}"
      f" ({last['elapsed_s']:.0f} s)")
PY
