#!/usr/bin/env python3
"""Training throughput and peak memory of ctitan beside PyTorch eager on the same model.

Both sides train the same Qwen3 (HF config -> random weights saved once, loaded by
both) on the same token windows with the same batch, sequence length, AdamW
(lr 1e-4, betas 0.9/0.95, eps 1e-8, wd 0.1), clipping at 1.0 and thread count,
in one invocation. Each side runs in its own child process, so the peak RSS
reported (ru_maxrss of a helper's only child) is that side's alone, and so is its
CPU time (user + system, whole process incl. loading; useful when other processes
load the machine); the parent only builds and saves the model.

Reports per side: tokens/s over the steady-state steps (the first `--warmup`
steps excluded), model GFLOP/s (6 x matmul parameters incl. the lm_head +
12 x layers x heads x head_dim x T per token, PaLM's convention, which counts
attention as non-causal), MFU against ctitan's FMA peak of the run's precision
(`ctitan kernels peak`, as the trainer reads it), peak RSS, and the ctitan/PyTorch ratios.

Workloads (issue 5):
  W1  Qwen3-0.6B shapes cut to 4 layers, seq 512, batch 1          (--precision fp32 | bf16)
  W2  Qwen3-0.6B (28 layers), seq 2048, batch 1, a few steps: memory and speed;
      ctitan with activation_checkpoint full; PyTorch with HF gradient checkpointing
      (--no-torch to skip it). RSS target: params x 16 B + 2 GiB.
  W3  torchtitan's debugmodel, batch 4 x 256
LoRA (--lora R): both sides train rank-R adapters (alpha 2R, dropout 0) on q,k,v,o,gate,
up,down_proj with the base frozen: ctitan with --lora.rank/--lora.alpha, PyTorch with
peft.get_peft_model(LoraConfig(...)) and AdamW over the trainable tensors only. With
--frozen-bf16 ctitan stores the frozen base in bf16 (training.frozen_dtype=bfloat16)
and PyTorch loads its base in bf16 (adapters in fp32: PEFT's autocast_adapter_dtype).
A bf16 base makes PyTorch's frozen products bf16 ones whatever --precision says, so the
like-for-like pairing is --frozen-bf16 --precision bf16 (what `make bench` runs); with
fp32 precision ctitan widens the stored weights and multiplies in fp32.
FLOPs per token with LoRA: 4 x frozen matmul params (no weight gradient) + 6 x adapter
params + the attention term.
Run:  .venv/bin/python bench/bench_train.py --workload W1 [--precision bf16]
      .venv/bin/python bench/bench_train.py --workload W1 --lora 16 [--precision bf16] [--frozen-bf16]
      .venv/bin/python bench/bench_train.py --shape debugmodel --batch 4 --seq 256 --steps 8
CTITAN_BUILD=build/x selects the build directory (default build).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scorecard  # noqa: E402  (the --record lines)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
SHAPES = {
    # torchtitan's debugmodel flavor
    "debugmodel": dict(vocab_size=2048, hidden_size=256, intermediate_size=3072, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # a small Qwen3-shaped model with the real vocabulary
    "small-151k": dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen3-0.6b-4l": dict(QWEN3_06B, num_hidden_layers=4),
    "qwen3-0.6b": QWEN3_06B,
    # issue 15: one published model of each family at its real widths, cut to 4 layers (the
    # 7B-wide Mistral to 2 and Mixtral to 1 layer of 8 experts of 14336 cut to 4 experts of
    # 3584, so that both sides' fp32 AdamW state fits the machine's 24 GiB)
    "llama-3.2-1b-4l": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                            num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                            tie_word_embeddings=True, max_position_embeddings=131072,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}),
    "mistral-7b-2l": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=False, sliding_window=None,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2.5-0.5b-4l": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                            num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mixtral-1l-e4": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=3584,
                          num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "olmo2-1b-4l": dict(model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "phi3-mini-4l": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=32, head_dim=96,
                         tie_word_embeddings=False, sliding_window=2047, pad_token_id=32000,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gemma3-1b-4l": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         tie_word_embeddings=True, sliding_window=512, query_pre_attn_scalar=256,
                         layer_types=["sliding_attention"] * 3 + ["full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
FAMILY_SHAPES = [k for k, v in SHAPES.items() if "model_type" in v]

# name -> (shape, batch, seq, steps, warmup, activation checkpointing)
WORKLOADS = {
    "W1": ("qwen3-0.6b-4l", 1, 512, 6, 2, "none"),
    "W2": ("qwen3-0.6b", 1, 2048, 3, 1, "full"),
    "W3": ("debugmodel", 4, 256, 8, 2, "none"),
}


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_params(cfg, r):
    """Adapter parameters of rank r on the seven projections: r x (in + out) each."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = (H + q) + 2 * (H + kv) + (q + H) + 2 * (H + I) + (I + H)
    return cfg["num_hidden_layers"] * r * per_layer


def flops_per_token(cfg, n_params, T, n_lora=0):
    matmul = n_params - cfg["vocab_size"] * cfg["hidden_size"]
    if cfg["tie_word_embeddings"]:
        matmul += cfg["vocab_size"] * cfg["hidden_size"]
    attn = 12 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * T
    E, k = cfg.get("num_local_experts", 0), cfg.get("num_experts_per_tok", 0)
    if E:  # a token runs k of the E experts
        matmul -= cfg["num_hidden_layers"] * (E - k) * 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    if n_lora:  # frozen base: forward + input gradient only; adapters: all three
        return 4 * matmul + 6 * n_lora + attn
    return 6 * matmul + attn


def run_measured(cmd, env=None, timeout=None):
    """Runs cmd as a child; returns (returncode, stdout, stderr). Past timeout seconds the
    child and everything it started are killed; returncode is then None and the output is
    what it had written. With a timeout the child leads a process group of its own (what
    the kill reaches), which a terminal's Ctrl-C no longer reaches: an interrupt of this
    script kills the group too."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                         start_new_session=timeout is not None)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        return None, out, err
    except BaseException:
        if timeout is not None:
            os.killpg(p.pid, 9)
        raise
    return p.returncode, out, err


def measured_child(cmd, env=None, timeout=None):
    """cmd run under a fresh python helper that reports the child's own peak RSS and CPU seconds.

    The helper forks nothing else, so RUSAGE_CHILDREN's ru_maxrss in it is exactly the
    peak RSS of cmd (and of anything cmd exec()s: ctitan re-execs itself once)."""
    helper = ("import resource,subprocess,sys,json;"
              "r=subprocess.run(sys.argv[1:]);"
              "u=resource.getrusage(resource.RUSAGE_CHILDREN);"
              "sys.stderr.write('\\nBENCH_RSS_KIB %d %.3f\\n' % (u.ru_maxrss, u.ru_utime + u.ru_stime));"
              "sys.exit(r.returncode)")
    rc, out, err = run_measured([sys.executable, "-c", helper] + cmd, env, timeout)
    rss = cpu = None
    for line in err.splitlines():
        if line.startswith("BENCH_RSS_KIB "):
            rss = int(line.split()[1]) * 1024
            cpu = float(line.split()[2])
    return rc, out, err, (rss, cpu)


NOTES = []  # lines of the children's stderr worth printing under the table (LoRA runs)


def thread_env(threads):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


# ------------------------------------------------------------------ PyTorch side (child)

def torch_worker(a):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM as Qwen3ForCausalLM  # any family (issue 15)
    torch.set_num_threads(a.threads)
    # --frozen-bf16: the base is read straight into bf16 (what model.to(torch.bfloat16) after an fp32
    # load gives, without an fp32 copy inflating the peak RSS)
    base_dtype = torch.bfloat16 if a.frozen_bf16 else torch.float32
    model = Qwen3ForCausalLM.from_pretrained(a.model_dir, dtype=base_dtype, attn_implementation="sdpa")
    model.to(base_dtype)
    model.train()
    if a.ac != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if a.lora:
        from peft import LoraConfig, get_peft_model
        # autocast_adapter_dtype=True (PEFT's default): the adapters are fp32 over a bf16 base
        model = get_peft_model(model, LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS, bias="none"))
        model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    sys.stderr.write(f"BENCH_TORCH trainable {sum(p.numel() for p in params)} "
                     f"dtypes {sorted({str(p.dtype) for p in params})} "
                     f"frozen dtypes {sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})}\n")
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = np.fromfile(a.data, dtype=np.uint32)
    B, T, W = a.batch, a.seq, a.seq + 1
    stamps = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        i = step * B
        win = np.stack([tokens[(i + b) * W:(i + b + 1) * W] for b in range(B)]).astype(np.int64)
        x, y = torch.from_numpy(win[:, :-1]), torch.from_numpy(win[:, 1:])
        if a.precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
        else:
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter() - t0)
        print(json.dumps({"step": step + 1, "loss": float(loss), "elapsed_s": stamps[-1]}), flush=True)


def bench_torch(a, model_dir, data):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--model-dir", model_dir, "--data", data,
           "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--threads", str(a.threads),
           "--precision", a.precision, "--ac", a.ac, "--lora", str(a.lora)]
    if a.frozen_bf16:
        cmd.append("--frozen-bf16")
    rc, out, err, rss = measured_child(cmd, thread_env(a.threads), a.torch_timeout)
    if a.lora:
        NOTES.extend("pytorch: " + l[len("BENCH_TORCH "):] for l in err.splitlines() if l.startswith("BENCH_TORCH "))
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    if rc is None:
        return None, rss, f"PyTorch timed out after {a.torch_timeout:g} s ({len(rows)} of {a.steps} steps done)"
    if rc != 0 or len(rows) < a.steps:
        return None, rss, f"PyTorch failed (exit {rc}): {err.strip().splitlines()[-1] if err.strip() else ''}"
    return rows, rss, None


# ------------------------------------------------------------------- ctitan side (child)

def bench_ctitan(a, model_dir, data, out):
    build = os.environ.get("CTITAN_BUILD", "build")
    cmd = [os.path.join(ROOT, build, "ctitan"), "train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}",
           f"--checkpoint.initial_load_path={model_dir}", "--checkpoint.initial_load_in_hf",
           f"--training.dataset_path={data}", f"--training.local_batch_size={a.batch}", f"--training.seq_len={a.seq}",
           f"--training.steps={a.steps}", "--metrics.log_freq=1", f"--job.dump_folder={out}",
           f"--training.threads={a.threads}", "--optimizer.lr=1e-4", "--optimizer.eps=1e-8",
           "--optimizer.weight_decay=0.1", "--training.max_norm=1.0", "--lr_scheduler.warmup_steps=0",
           "--lr_scheduler.decay_ratio=0",  # constant lr, as the PyTorch side
           f"--activation_checkpoint.mode={a.ac}"]
    if a.precision == "bf16":
        cmd.append("--training.mixed_precision_param=bfloat16")
    if a.lora:
        cmd += [f"--lora.rank={a.lora}", f"--lora.alpha={2 * a.lora}", "--lora.dropout=0",
                "--lora.target_modules=" + ",".join(LORA_TARGETS)]
    if a.frozen_bf16:
        cmd.append("--training.frozen_dtype=bfloat16")
    cmd += a.ctitan_arg
    rc, _, err, rss = measured_child(cmd, thread_env(a.threads))
    if a.lora:
        NOTES.extend("ctitan: " + l.strip().removeprefix("ctitan: ") for l in err.splitlines()
                     if "trained:" in l or "frozen weights in" in l)
    # a --ctitan-arg=--job.dump_folder=DIR (a profiling run's trace kept) moves the metrics too
    for arg in a.ctitan_arg:
        if arg.startswith("--job.dump_folder="):
            out = arg.split("=", 1)[1]
    mpath = os.path.join(out, "metrics.jsonl")
    if rc != 0 or not os.path.exists(mpath):
        last = err.strip().splitlines()
        last = [l for l in last if not l.startswith("BENCH_RSS_KIB")]
        return None, rss, f"ctitan failed (exit {rc}): {last[-1] if last else ''}"
    rows = [json.loads(l) for l in open(mpath)]
    return rows, rss, None


def steady_tps(rows, B, T, warmup):
    if not rows:
        return float("nan")
    t_a = rows[warmup - 1]["elapsed_s"] if warmup > 0 else 0.0
    t_b = rows[-1]["elapsed_s"]
    return B * T * (len(rows) - warmup) / (t_b - t_a)


def peak_info(threads):
    """`ctitan kernels peak --json`: the FMA peaks as the trainer reads them (measured and
    checked against clock x FMA width, or cached when that was stable), with the ISA of
    each. Never nan: the command always answers with a figure."""
    build = os.environ.get("CTITAN_BUILD", "build")
    out = subprocess.run([os.path.join(ROOT, build, "ctitan"), "kernels", "peak", "--json", "--threads",
                          str(threads)], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def peak_flops(threads):
    """(fp32 FLOP/s, bf16 FLOP/s, one-line description, peak_info's dict)."""
    p = peak_info(threads)
    desc = (f"{p['fp32_flops']/1e9:.0f} GFLOP/s fp32 ({p['isa']}, {p['clock_hz']/1e9:.2f} GHz x "
            f"{p['fma_per_cycle']} FMA/cycle), {p['bf16_flops']/1e9:.0f} bf16 ({p['bf16_isa']}); {p['source']}"
            + (f": {p['note']}" if p["note"] else ""))
    return p["fp32_flops"], p["bf16_flops"], desc, p


def gib(x):
    return f"{x / 2**30:6.2f}" if x else "   n/a"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), help="preset: sets shape, batch, seq, steps, ac")
    ap.add_argument("--shape", default="debugmodel", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ac", default="none", choices=["none", "full"], help="activation checkpointing, both sides")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="LoRA rank R (alpha 2R, dropout 0, q/k/v/o/gate/up/down_proj) on both sides; 0: full training")
    ap.add_argument("--frozen-bf16", action="store_true",
                    help="with --lora: the frozen base in bf16 (ctitan training.frozen_dtype=bfloat16; PyTorch base in bf16)")
    ap.add_argument("--no-torch", action="store_true", help="ctitan only")
    ap.add_argument("--no-ctitan", action="store_true", help="PyTorch only")
    ap.add_argument("--ctitan-arg", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                    help="extra ctitan train option (repeatable), e.g. --ctitan-arg=--kernels.adamw=ref")
    ap.add_argument("--torch-timeout", type=float, metavar="S",
                    help="stop the PyTorch side after S seconds and report it as timed out")
    ap.add_argument("--record", metavar="FILE",
                    help="append this run's figures as a JSON line to FILE (bench/scorecard.py judges them)")
    # internal: the PyTorch child
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        return torch_worker(a)
    if a.workload:
        a.shape, a.batch, a.seq, a.steps, a.warmup, a.ac = WORKLOADS[a.workload]
    if a.warmup >= a.steps:
        ap.error(f"--warmup {a.warmup} must be below --steps {a.steps}")
    if a.frozen_bf16 and not a.lora:
        ap.error("--frozen-bf16 needs --lora (nothing is frozen otherwise)")

    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    shape = dict(SHAPES[a.shape])
    if "model_type" in shape:
        shape.setdefault("max_position_embeddings", max(4096, a.seq))
        cfg = AutoConfig.for_model(shape.pop("model_type"), **shape)
    else:
        cfg = Qwen3Config(**shape, rope_theta=1e6, max_position_embeddings=max(4096, a.seq))
    torch.manual_seed(0)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        model = AutoModelForCausalLM.from_config(cfg) if "model_type" in SHAPES[a.shape] else Qwen3ForCausalLM(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp + "/model")
        del model
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.vocab_size, size=(a.steps * a.batch + 1) * (a.seq + 1), dtype=np.uint32)
        tokens.tofile(tmp + "/tokens.bin")
        res = {}
        if not a.no_ctitan:
            res["ctitan"] = bench_ctitan(a, tmp + "/model", tmp + "/tokens.bin", tmp + "/out")
        if not a.no_torch:
            res["pytorch"] = bench_torch(a, tmp + "/model", tmp + "/tokens.bin")
    load = os.getloadavg()[0]
    n_lora = lora_params(shape, a.lora) if a.lora else 0
    fpt = flops_per_token(shape, n_params, a.seq, n_lora)
    peak32, peak16, peak_desc, peak_json = peak_flops(a.threads)
    # MFU against the peak of the arithmetic the run's matmuls use, as the trainer does
    peak = peak16 if a.precision == "bf16" else peak32
    name = f"{a.workload} " if a.workload else ""
    print(f"{name}model {a.shape}: {n_params/1e6:.1f} M params, batch {a.batch} x {a.seq}, {a.threads} threads, "
          f"{a.precision}, activation_checkpoint {a.ac}, {a.steps} steps ({a.warmup} warm-up), "
          + (f"LoRA r {a.lora} alpha {2 * a.lora} ({n_lora/1e6:.2f} M trainable), frozen base "
             f"{'bf16' if a.frozen_bf16 else 'fp32'}, " if a.lora else "") +
          f"peak {peak_desc}; MFU vs {a.precision}; load average {load0:.1f} before, {load:.1f} after "
          f"(the run itself adds ~{a.threads}: more means other processes shared the cores)")
    print(f"{'':10s} {'tokens/s':>10s} {'GFLOP/s':>9s} {'MFU':>7s} {'peak RSS GiB':>13s} {'CPU s':>7s}  "
          f"first/last loss")
    tps = {}
    rss = {}
    msgs = {}
    for side, (rows, (r, cpu), msg) in res.items():
        rss[side] = r
        if rows is None:
            print(f"{side:10s} {msg}")
            msgs[side] = msg
            continue
        tps[side] = steady_tps(rows, a.batch, a.seq, a.warmup)
        print(f"{side:10s} {tps[side]:10.1f} {fpt*tps[side]/1e9:9.1f} {100*fpt*tps[side]/peak:6.1f}% "
              f"{gib(r):>13s} {cpu or 0:7.1f}  {rows[0]['loss']:.4f} / {rows[-1]['loss']:.4f}")
    if "ctitan" in tps and "pytorch" in tps:
        print(f"ratio ctitan/pytorch: speed {tps['ctitan']/tps['pytorch']:.2f}x", end="")
        if rss.get("ctitan") and rss.get("pytorch"):
            print(f", peak RSS {rss['ctitan']/rss['pytorch']:.2f}x", end="")
        print()
    for note in NOTES:
        print(note)
    if a.workload == "W2" and rss.get("ctitan") and not a.lora:  # the full-training target
        target = n_params * 16 + 2 * 2**30
        print(f"W2 ctitan peak RSS {rss['ctitan']/2**30:.2f} GiB vs target params x 16 B + 2 GiB = "
              f"{target/2**30:.2f} GiB: {'ok' if rss['ctitan'] <= target else 'OVER'}")
    if a.record:
        for side, flag, opt in (("pytorch", a.no_torch, "--no-torch"), ("ctitan", a.no_ctitan, "--no-ctitan")):
            if flag:
                msgs[side] = f"not run ({opt})"
        label = (f"{a.workload or a.shape} {a.precision}"
                 + (f" LoRA r{a.lora}" + (" (base bf16)" if a.frozen_bf16 else "") if a.lora else ""))
        scorecard.append_record(a.record, {
            "label": label, "bench": "train", "workload": a.workload or a.shape, "precision": a.precision,
            "lora": a.lora, "threads": a.threads, "ctitan_tps": tps.get("ctitan"), "pytorch_tps": tps.get("pytorch"),
            "ctitan_mfu": fpt * tps["ctitan"] / peak if "ctitan" in tps else None,
            "rss": rss, "isa": peak_json["isa"], "bf16_isa": peak_json["bf16_isa"], "peak_fp32": peak32,
            "notes": msgs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
