#!/usr/bin/env python3
"""Qwen3-MoE training throughput and peak memory: ctitan's grouped experts kernel, its
reference experts kernel ([kernels] moe_experts = "ref"; every other op at its default),
and transformers' Qwen3MoeForCausalLM in PyTorch (fp32, its default "grouped_mm" experts,
sdpa attention), same model, data, batch, AdamW and thread count. --precision bf16: ctitan
with training.mixed_precision_param = "bfloat16" (the experts on moe_experts_bf16: AMX tiles
where the CPU has them), PyTorch under torch.autocast("cpu", bfloat16).

--lora R: ctitan only (no reference kernel, no PyTorch), LoRA of rank R on the attention
projections, so the routers and experts are frozen, stored as --frozen-dtype says (default
bfloat16: read from the bf16 store by the products) and only their input gradients run.

Each side runs in its own child process (bench_train.py's harness: peak RSS is the
child's ru_maxrss; tokens/s over the steps after the first `--warmup`).

Shapes:
  debugmodel_moe  ctitan's flavor: vocab 2048, hidden 256, 8 layers, 16/8 heads x 128,
                  8 experts of 768, top-2, norm_topk_prob
  30b-a3b-2l      Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads x 128, experts of 768,
                  top-8, norm_topk_prob) cut to 2 layers, vocab 8192 and 32 of its 128
                  experts so parameters + grads + AdamW fit beside other work in 24 GiB
Run:  .venv/bin/python bench/bench_moe.py --shape debugmodel_moe [--precision bf16]
      .venv/bin/python bench/bench_moe.py --shape 30b-a3b-2l
CTITAN_BUILD=build/x selects the build directory (default build).
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train as bt  # noqa: E402  (the child-process harness)

SHAPES = {
    "debugmodel_moe": dict(vocab_size=2048, hidden_size=256, intermediate_size=3072, num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=768),
    "30b-a3b-2l": dict(vocab_size=8192, hidden_size=2048, intermediate_size=6144, num_hidden_layers=2,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=32,
                       num_experts_per_tok=8, moe_intermediate_size=768),
}
# name -> (batch, seq, steps, warmup); the reference kernel gets fewer steps
RUNS = {"debugmodel_moe": (2, 256, 4, 1), "30b-a3b-2l": (1, 256, 3, 1)}


def measured(cmd, threads):
    """bench_train's child harness: (rc, stdout, stderr, peak RSS bytes or None)."""
    rc, out, err, r = bt.measured_child(cmd, bt.thread_env(threads))
    return rc, out, err, (r[0] if isinstance(r, tuple) else r)  # newer harness: (rss, cpu seconds)


def torch_worker(a):
    import numpy as np
    import torch
    from transformers import Qwen3MoeForCausalLM
    torch.set_num_threads(a.threads)
    model = Qwen3MoeForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = np.fromfile(a.data, dtype=np.uint32)
    B, T, W = a.batch, a.seq, a.seq + 1
    t0 = time.perf_counter()
    for step in range(a.steps):
        win = np.stack([tokens[(step * B + b) * W:(step * B + b + 1) * W] for b in range(B)]).astype(np.int64)
        x, y = torch.from_numpy(win[:, :-1]), torch.from_numpy(win[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(json.dumps({"step": step + 1, "loss": float(loss), "elapsed_s": time.perf_counter() - t0}), flush=True)


def bench_ctitan(a, model_dir, data, out, impl, steps):
    build = os.environ.get("CTITAN_BUILD", "build")
    cmd = [os.path.join(bt.ROOT, build, "ctitan"), "train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}",
           f"--checkpoint.initial_load_path={model_dir}", "--checkpoint.initial_load_in_hf",
           f"--training.dataset_path={data}", f"--training.local_batch_size={a.batch}", f"--training.seq_len={a.seq}",
           f"--training.steps={steps}", "--metrics.log_freq=1", f"--job.dump_folder={out}",
           f"--training.threads={a.threads}", "--optimizer.lr=1e-4", "--optimizer.eps=1e-8",
           "--optimizer.weight_decay=0.1", "--training.max_norm=1.0", "--lr_scheduler.warmup_steps=0",
           f"--kernels.moe_experts{'_bf16' if a.precision == 'bf16' else ''}={impl}"]
    if a.precision == "bf16":
        cmd.append("--training.mixed_precision_param=bfloat16")
    if a.lora:
        cmd += [f"--lora.rank={a.lora}", f"--lora.alpha={2 * a.lora}", "--lora.target_modules=q_proj,k_proj,v_proj,o_proj",
                f"--training.frozen_dtype={a.frozen_dtype}"]
    rc, _, err, rss = measured(cmd, a.threads)
    mpath = os.path.join(out, "metrics.jsonl")
    if rc != 0 or not os.path.exists(mpath):
        lines = [l for l in err.strip().splitlines() if not l.startswith("BENCH_RSS_KIB")]
        return None, rss, f"ctitan failed (exit {rc}): {lines[-1] if lines else ''}"
    return [json.loads(l) for l in open(mpath)], rss, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="debugmodel_moe", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--ref-steps", type=int, default=2, help="steps of the (slow) reference kernel")
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="ctitan alone: rank-R attention adapters on a frozen MoE base")
    ap.add_argument("--frozen-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="with --lora: training.frozen_dtype")
    ap.add_argument("--run-steps", type=int, help="steps of the ctitan and PyTorch runs (default: the shape's)")
    ap.add_argument("--record", metavar="FILE",
                    help="append this run's figures as a JSON line to FILE (bench/scorecard.py judges them)")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        return torch_worker(a)
    a.batch, a.seq, a.steps, warmup = RUNS[a.shape]
    if a.run_steps:
        a.steps = a.run_steps
    if a.lora:
        a.no_ref = a.no_torch = True

    import numpy as np
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**SHAPES[a.shape], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        model = Qwen3MoeForCausalLM(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp + "/model")
        del model
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.vocab_size, size=(a.steps * a.batch + 1) * (a.seq + 1), dtype=np.uint32)
        tokens.tofile(tmp + "/tokens.bin")
        res = {"ctitan grouped": (bench_ctitan(a, tmp + "/model", tmp + "/tokens.bin", tmp + "/g", "auto", a.steps),
                                  warmup)}
        if not a.no_ref:
            res["ctitan ref"] = (bench_ctitan(a, tmp + "/model", tmp + "/tokens.bin", tmp + "/r", "ref",
                                              a.ref_steps), 1)
        if not a.no_torch:
            cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--model-dir", tmp + "/model",
                   "--data", tmp + "/tokens.bin", "--batch", str(a.batch), "--seq", str(a.seq), "--steps",
                   str(a.steps), "--threads", str(a.threads), "--precision", a.precision]
            rc, out, err, rss = measured(cmd, a.threads)
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            msg = None if rc == 0 and len(rows) == a.steps else f"PyTorch failed (exit {rc}): {err[-300:]}"
            res["pytorch (HF)"] = ((rows if not msg else None, rss, msg), warmup)
    lora = f", LoRA r{a.lora} on attention, frozen base {a.frozen_dtype}" if a.lora else ""
    print(f"model {a.shape}: {n_params / 1e6:.1f} M params, batch {a.batch} x {a.seq}, {a.threads} threads, {a.precision}, "
          f"{a.steps} steps ({warmup} warm-up; reference kernel {a.ref_steps}){lora}")
    print(f"{'':16s} {'tokens/s':>10s} {'peak RSS GiB':>13s}  first loss")
    tps = {}
    for side, ((rows, rss, msg), w) in res.items():
        if msg:
            print(f"{side:16s} {msg}")
            continue
        tps[side] = bt.steady_tps(rows, a.batch, a.seq, w)
        print(f"{side:16s} {tps[side]:10.1f} {bt.gib(rss):>13s}  {rows[0]['loss']:.4f}")
    g = tps.get("ctitan grouped")
    for other in ("ctitan ref", "pytorch (HF)"):
        if g and tps.get(other):
            print(f"grouped / {other}: {g / tps[other]:.2f}x")
    if a.record:
        peak = bt.peak_info(a.threads)
        bt.scorecard.append_record(a.record, {
            "label": f"MoE {a.shape} {a.precision}" + (f" LoRA r{a.lora}" if a.lora else ""), "bench": "moe",
            "workload": f"MoE {a.shape}", "precision": a.precision, "lora": a.lora, "threads": a.threads,
            "ctitan_tps": g, "pytorch_tps": tps.get("pytorch (HF)"), "ctitan_mfu": None,
            "isa": peak["isa"], "bf16_isa": peak["bf16_isa"], "peak_fp32": peak["fp32_flops"]})


if __name__ == "__main__":
    sys.exit(main())
