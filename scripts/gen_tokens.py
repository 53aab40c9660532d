#!/usr/bin/env python3
"""Writes a token file with learnable structure for `make run` (stdlib only).

The stream is a random sequence of a few hundred fixed "phrases" of random
tokens: within a phrase every next token is predictable, across phrases
not. A model that learns shows its loss fall from ln(vocab) towards
ln(phrases) / phrase_len. Usage: gen_tokens.py OUT.bin [n_tokens] [vocab]."""
import os
import random
import struct
import sys

out = sys.argv[1]
n_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 400_000
vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 512
rng = random.Random(1234)
phrases = [[rng.randrange(vocab) for _ in range(16)] for _ in range(64)]
toks = []
while len(toks) < n_tokens:
    toks.extend(phrases[rng.randrange(len(phrases))])
# README runs it on a fresh clone, where data/ does not exist yet
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
with open(out, "wb") as f:
    f.write(struct.pack("<%dI" % n_tokens, *toks[:n_tokens]))
print(f"wrote {n_tokens} tokens (vocab {vocab}) to {out}")
