#!/usr/bin/env python3
"""Training throughput of ctitan beside PyTorch eager on the same model.

Both train the same Qwen3 (HF config -> random weights saved once, loaded by
both) with the same batch, sequence length, AdamW and clipping, on the same
thread count, in one invocation. Reports tokens/s (steady state: the first
`--warmup` steps are excluded), model TFLOP/s and MFU against the measured
fp32 peak, and the ratio. Run: .venv/bin/python bench/bench_train.py
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    # torchtitan's debugmodel flavor
    "debugmodel": dict(vocab_size=2048, hidden_size=256, intermediate_size=3072, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # a small Qwen3-shaped model with the real vocabulary
    "small-151k": dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
}


def flops_per_token(cfg, n_params, T):
    matmul = n_params - cfg.vocab_size * cfg.hidden_size
    if cfg.tie_word_embeddings:
        matmul += cfg.vocab_size * cfg.hidden_size
    return 6 * matmul + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T


def bench_torch(model_dir, tokens, B, T, steps, warmup, threads):
    torch.set_num_threads(threads)
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    W = T + 1
    t0 = None
    for step in range(steps):
        if step == warmup:
            t0 = time.perf_counter()
        i = step * B
        win = np.stack([tokens[(i + b) * W:(i + b + 1) * W] for b in range(B)]).astype(np.int64)
        x, y = torch.from_numpy(win[:, :-1]), torch.from_numpy(win[:, 1:])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    return B * T * (steps - warmup) / dt


def bench_ctitan(model_dir, data, out, B, T, steps, warmup, threads):
    cmd = [os.path.join(ROOT, "build/ctitan"), "train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}",
           f"--checkpoint.initial_load_path={model_dir}", "--checkpoint.initial_load_in_hf",
           f"--training.dataset_path={data}", f"--training.local_batch_size={B}", f"--training.seq_len={T}",
           f"--training.steps={steps}", "--metrics.log_freq=1", f"--job.dump_folder={out}",
           f"--training.threads={threads}", "--optimizer.lr=1e-4", "--lr_scheduler.warmup_steps=0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    t_a = rows[warmup - 1]["elapsed_s"]
    t_b = rows[-1]["elapsed_s"]
    return B * T * (steps - warmup) / (t_b - t_a)


def peak_flops(threads):
    cache = os.path.expanduser("~/.cache/ctitan")
    for f in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        if f.endswith(f"-t{threads}.txt"):
            return float(open(os.path.join(cache, f)).read().split()[0])
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="debugmodel", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    cfg = Qwen3Config(**SHAPES[a.shape], rope_theta=1e6, max_position_embeddings=4096)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = Qwen3ForCausalLM(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp + "/model")
        del model
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.vocab_size, size=(a.steps * a.batch + 1) * (a.seq + 1), dtype=np.uint32)
        tokens.tofile(tmp + "/tokens.bin")
        tps_c = bench_ctitan(tmp + "/model", tmp + "/tokens.bin", tmp + "/out", a.batch, a.seq, a.steps, a.warmup,
                             a.threads)
        tps_t = bench_torch(tmp + "/model", tokens, a.batch, a.seq, a.steps, a.warmup, a.threads)
    fpt = flops_per_token(cfg, n_params, a.seq)
    peak = peak_flops(a.threads)
    print(f"model {a.shape}: {n_params/1e6:.1f} M params, batch {a.batch} x {a.seq}, {a.threads} threads, "
          f"fp32, peak {peak/1e9:.0f} GFLOP/s")
    print(f"{'':10s} {'tokens/s':>10s} {'GFLOP/s':>9s} {'MFU':>7s}")
    for name, tps in (("ctitan", tps_c), ("pytorch", tps_t)):
        print(f"{name:10s} {tps:10.0f} {fpt*tps/1e9:9.1f} {100*fpt*tps/peak:6.1f}%")
    print(f"ratio ctitan/pytorch: {tps_c/tps_t:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
