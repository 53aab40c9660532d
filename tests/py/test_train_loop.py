"""Whole optimizer steps (packing, accumulation, clipping, AdamW, LR schedule, metrics,
HF export) of `ctitan train` and of the session API against a PyTorch loop."""
import re

import numpy as np
import pytest

import oracle
from conftest import hf_session_args

L = 16            # seq_len
LOCAL_BS = 2
GLOBAL_BS = 4     # 2 micro-batches per step
# eps 1e-4 (not 1e-8): with eps far below the smallest gradients, Adam divides fp32
# rounding noise by ~eps, and a correct fp32 implementation differs from an fp64 one by
# ~3e-4 of a weight's max after 10 steps (measured); at 1e-4 the same comparison gives
# < 1e-5, so the 1e-4 tolerance below has a 10x margin and eps still shapes every update.
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1, max_norm=1.5,
          warmup_steps=2, decay_ratio=None, decay_type="cosine", min_lr_factor=0.1)
TOL = 1e-4
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "elapsed_s"}


def model_cfg(tied):
    return oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                              rope_theta=1e4, tied=tied)


def train_sections(hf_dir, data, out, steps, log_freq=1, export_dtype="float32"):
    return {
        "job": {"dump_folder": str(out)},
        "model": {"spec": "hf", "hf_assets_path": str(hf_dir)},
        "optimizer": {"name": "AdamW", "lr": HP["lr"], "eps": HP["eps"], "weight_decay": HP["weight_decay"],
                      "beta1": HP["betas"][0], "beta2": HP["betas"][1]},
        "lr_scheduler": {"warmup_steps": HP["warmup_steps"], "decay_type": HP["decay_type"],
                         "min_lr_factor": HP["min_lr_factor"]},
        "training": {"local_batch_size": LOCAL_BS, "global_batch_size": GLOBAL_BS, "seq_len": L,
                     "max_norm": HP["max_norm"], "steps": steps, "dataset_path": str(data), "seed": 0},
        "checkpoint": {"enable": True, "folder": "checkpoint", "interval": 1000,
                       "initial_load_path": str(hf_dir), "initial_load_in_hf": True,
                       "last_save_in_hf": True, "export_dtype": export_dtype},
        "metrics": {"log_freq": log_freq, "file": "metrics.jsonl"},
    }


def close(a, b, tol):
    return abs(a - b) <= tol * max(abs(b), 1e-30)


def check_run(out, ref, steps, logged, model, stdout):
    rows = oracle.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == logged, f"logged steps {[r['step'] for r in rows]}, want {logged}"
    for r in rows:
        assert METRIC_KEYS <= set(r), f"metrics row lacks {METRIC_KEYS - set(r)}"
        i = r["step"] - 1
        assert close(r["loss"], ref["losses"][i], TOL), f"step {r['step']} loss {r['loss']} vs {ref['losses'][i]}"
        assert close(r["grad_norm"], ref["grad_norms"][i], TOL), \
            f"step {r['step']} grad_norm {r['grad_norm']} vs {ref['grad_norms'][i]}"
        assert close(r["lr"], ref["lrs"][i], 1e-5), f"step {r['step']} lr {r['lr']} vs {ref['lrs'][i]}"
        assert r["tps"] > 0 and r["elapsed_s"] >= 0
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)

    # torchtitan's console line (colour codes allowed), loss as in the metrics.
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stdout)
    m = re.search(r"step:\s*1\s+loss:\s*([-+0-9.eE]+)\s+grad_norm:\s*([-+0-9.eE]+)\s+memory:\s*[-+0-9.eE]+\s*GiB"
                  r"(?:\([^)]*\))?\s+tps:\s*[-+0-9.eE,]+\s+tflops:\s*[-+0-9.eE,]+\s+mfu:\s*[-+0-9.eE]+%", plain)
    assert m, f"no console line for step 1 in stdout:\n{stdout[-2000:]}"
    assert abs(float(m.group(1)) - ref["losses"][0]) < 1e-3
    assert abs(float(m.group(2)) - ref["grad_norms"][0]) < 1e-3 * max(1.0, ref["grad_norms"][0])

    # The HF export of the last step.
    exp_dir = out / "checkpoint" / f"step-{steps}"
    assert (exp_dir / "config.json").exists(), f"{exp_dir}/config.json missing"
    got = oracle.read_hf_tensors(exp_dir)
    assert oracle.hf_dtypes(exp_dir) == {"F32"}
    assert set(got) == set(oracle.param_dict(model)), \
        f"exported tensors: extra {set(got) - set(oracle.param_dict(model))}, missing {set(oracle.param_dict(model)) - set(got)}"
    bad = []
    for n, want in ref["params"].items():
        e = oracle.rel_err(got[n], want)
        if not e <= TOL:
            bad.append(f"{n}: rel err {e:.3g}")
    assert not bad, "final weights differ from the PyTorch loop:\n" + "\n".join(bad)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ten_steps_bin(tied, tmp_path, run_ctitan):
    steps = 10
    cfg = model_cfg(tied)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=21)
    # 20 whole windows (a multiple of the batch sizes, so the 40 windows of 10 steps wrap
    # twice) plus 7 trailing tokens that do not make a window.
    tokens = oracle.random_tokens(20 * (L + 1) + 7, cfg.vocab_size, seed=9)
    data = oracle.write_bin(tmp_path / "tokens.bin", tokens)
    out = tmp_path / "out"
    conf = oracle.write_toml(tmp_path / "train.toml", train_sections(hf_dir, data, out, steps))

    ref = oracle.reference_train(oracle.load_hf(hf_dir), tokens, seq_len=L, local_bs=LOCAL_BS,
                                 global_bs=GLOBAL_BS, steps=steps, **HP)
    # The run exercises both sides of clipping and the whole schedule.
    assert any(g > HP["max_norm"] for g in ref["grad_norms"])
    assert any(g < HP["max_norm"] for g in ref["grad_norms"])

    _, stdout, _ = run_ctitan(["train", "--config", conf])
    check_run(out, ref, steps, list(range(1, steps + 1)), oracle.load_hf(hf_dir), stdout)


@pytest.mark.parametrize("dtype", [np.int64, np.int32], ids=["int64", "int32"])
def test_three_steps_npy(dtype, tmp_path, run_ctitan):
    """.npy tokens; log_freq 2 logs steps 1 and 2 only; the LR schedule is laid out for
    training.steps = 3."""
    steps = 3
    cfg = model_cfg(False)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=22)
    tokens = oracle.random_tokens(12 * (L + 1), cfg.vocab_size, seed=10)
    data = oracle.write_npy(tmp_path / "tokens.npy", tokens, dtype=dtype)
    out = tmp_path / "out"
    conf = oracle.write_toml(tmp_path / "train.toml", train_sections(hf_dir, data, out, steps, log_freq=2))
    ref = oracle.reference_train(oracle.load_hf(hf_dir), tokens, seq_len=L, local_bs=LOCAL_BS,
                                 global_bs=GLOBAL_BS, steps=steps, **HP)
    _, stdout, _ = run_ctitan(["train", "--config", conf])
    check_run(out, ref, steps, [1, 2], oracle.load_hf(hf_dir), stdout)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_session_loop(tied, tmp_path, open_session):
    """The same loop through ctitan_forward_backward / ctitan_optimizer_step: 4 of the 10
    scheduled steps, 2 micro-batches each."""
    steps, run = 10, 4
    cfg = model_cfg(tied)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=23)
    tokens = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=11)
    ref = oracle.reference_train(oracle.load_hf(hf_dir), tokens, seq_len=L, local_bs=LOCAL_BS,
                                 global_bs=GLOBAL_BS, steps=steps, run_steps=run, **HP)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=[
        f"--training.global_batch_size={GLOBAL_BS}", f"--training.steps={steps}",
        f"--training.max_norm={HP['max_norm']}", f"--optimizer.lr={HP['lr']}", f"--optimizer.eps={HP['eps']}",
        f"--optimizer.weight_decay={HP['weight_decay']}", f"--optimizer.beta1={HP['betas'][0]}",
        f"--optimizer.beta2={HP['betas'][1]}", f"--lr_scheduler.warmup_steps={HP['warmup_steps']}",
        f"--lr_scheduler.decay_type={HP['decay_type']}", f"--lr_scheduler.min_lr_factor={HP['min_lr_factor']}"]))
    mbs = oracle.micro_batches(tokens, L, LOCAL_BS, run * 2)
    for step in range(run):
        pair = mbs[2 * step:2 * step + 2]
        total = sum(oracle.n_valid(lab) for _, lab in pair)
        s.zero_grad()
        loss = sum(s.forward_backward(inp, lab, total) for inp, lab in pair) / total
        gn, lr = s.optimizer_step()
        assert close(loss, ref["losses"][step], TOL), f"step {step + 1}: loss {loss} vs {ref['losses'][step]}"
        assert close(gn, ref["grad_norms"][step], TOL), f"step {step + 1}: grad norm {gn} vs {ref['grad_norms'][step]}"
        assert close(lr, ref["lrs"][step], 1e-9), f"step {step + 1}: lr {lr} vs {ref['lrs'][step]}"
    bad = []
    for n in oracle.expected_tensor_names(oracle.load_hf(hf_dir)):
        e = oracle.rel_err(s.get_param(n), ref["params"][n])
        if not e <= TOL:
            bad.append(f"{n}: rel err {e:.3g}")
    assert not bad, "weights after 4 steps differ from the PyTorch loop:\n" + "\n".join(bad)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("decay_ratio", [None, 0.3], ids=["decay_all", "decay_0.3"])
def test_lr_schedule_every_step(decay_type, decay_ratio, tmp_path, run_ctitan):
    """The learning rate of every step, for each decay shape and a stable phase, against
    torch's LambdaLR driving torchtitan's linear_warmup_stable_decay factor
    (oracle.make_lr_lambda). Only cosine ran in the loops above, so a sqrt decay that was
    linear went unnoticed (a mutation audit)."""
    import torch

    from conftest import tiny_run
    steps, warmup, lr, floor = 12, 3, 1e-2, 0.1
    flags = [f"--optimizer.lr={lr}", f"--lr_scheduler.warmup_steps={warmup}",
             f"--lr_scheduler.decay_type={decay_type}", f"--lr_scheduler.min_lr_factor={floor}"]
    if decay_ratio is not None:
        flags.append(f"--lr_scheduler.decay_ratio={decay_ratio}")
    _, out, args = tiny_run(tmp_path, *flags, steps=steps)
    run_ctitan(args)
    got = [r["lr"] for r in oracle.read_metrics(out / "metrics.jsonl")]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, oracle.make_lr_lambda(steps, warmup, decay_ratio, decay_type, floor))
    want = []
    for _ in range(steps):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert len(got) == steps, got
    bad = [(s + 1, g, w) for s, (g, w) in enumerate(zip(got, want)) if not close(g, w, 1e-6)]
    assert not bad, f"(step, ctitan lr, torch lr): {bad}"
    if decay_ratio is not None:  # the schedule has a stable phase at the peak
        assert want.count(lr) >= 2, want


def test_shuffled_order_follows_training_seed(tmp_path, run_ctitan):
    """docs/data.md: with training.shuffle, epoch e's window order is a permutation drawn
    from a generator seeded with training.seed + e. With lr = 0 the loaded model never
    changes, so step k's loss is transformers' loss on the window the loader gave step k,
    and the order is read off the metrics: each one-epoch run takes every window once; the
    same seed takes the same order; two runs that differ only in training.seed take
    different orders (the weights come from initial_load_path, so the seed changes nothing
    else)."""
    n = 6
    cfg = model_cfg(False)
    hf_dir = tmp_path / "hf"
    model = oracle.save_random_hf(hf_dir, cfg, seed=25)
    tokens = oracle.random_tokens(n * (L + 1), cfg.vocab_size, seed=16)
    data = oracle.write_bin(tmp_path / "tokens.bin", tokens)
    w = oracle.windows(tokens, L)
    per_window = [oracle.hf_loss(model, w[i:i + 1, :-1], w[i:i + 1, 1:]) for i in range(n)]
    gap = min(abs(a - b) for i, a in enumerate(per_window) for b in per_window[i + 1:])
    assert gap > 10 * TOL * max(per_window), per_window  # each loss names its window

    def order(seed, tag):
        out = tmp_path / f"out_{tag}"
        sec = train_sections(hf_dir, data, out, n)
        sec["optimizer"]["lr"] = 0.0
        sec["training"].update(local_batch_size=1, global_batch_size=1, seed=seed, shuffle=True)
        sec["checkpoint"] = {"initial_load_path": str(hf_dir), "initial_load_in_hf": True}
        run_ctitan(["train", "--config", oracle.write_toml(tmp_path / f"{tag}.toml", sec)])
        got = []
        for r in oracle.read_metrics(out / "metrics.jsonl"):
            k = min(range(n), key=lambda i: abs(per_window[i] - r["loss"]))
            assert close(r["loss"], per_window[k], TOL), (r["step"], r["loss"], per_window)
            got.append(k)
        assert sorted(got) == list(range(n)), got  # one epoch: a permutation of the windows
        return got

    a, b, a2 = order(1, "a"), order(2, "b"), order(1, "a2")
    assert a == a2, (a, a2)
    assert a != b, f"training.seed 1 and 2 gave the same shuffled order {a}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_throughput_and_flops_figures(tied, tmp_path, run_ctitan):
    """tps, step_time_s, tflops and the banner's FLOPs/token of a run with 2 micro-batches per
    step, logged every 2 steps (steps 1, 2 and 4: intervals of 1 and 2 steps). torchtitan's tps
    is the tokens this rank ran since the last line over the time since it, every micro-batch's
    (ntokens_since_last_log), so tps x the mean step time is one step's tokens, GLOBAL_BS x L
    here. FLOPs/token is torchtitan's 6 x (parameters - embedding) + 12 x layers x heads x
    head_dim x seq_len, with the lm_head counted where it is the tied embedding (it still runs:
    docs and the banner say "6 x matmul params incl. lm_head + attention"); the parameter
    count is torch's. A tps without the accumulation factor, a step time not divided by the
    steps of the interval, a 6 for the attention's 12, or a tied lm_head left out passed every
    other test (a mutation audit)."""
    steps = 4
    cfg = model_cfg(tied)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=24)
    tokens = oracle.random_tokens(16 * (L + 1), cfg.vocab_size, seed=12)
    data = oracle.write_bin(tmp_path / "tokens.bin", tokens)
    out = tmp_path / "out"
    conf = oracle.write_toml(tmp_path / "train.toml", train_sections(hf_dir, data, out, steps, log_freq=2))
    _, _, err = run_ctitan(["train", "--config", conf])
    rows = oracle.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 4], rows
    for r in rows:
        assert close(r["tps"] * r["step_time_s"], GLOBAL_BS * L, 2e-2), (r["step"], r["tps"], r["step_time_s"])

    model = oracle.load_hf(hf_dir)
    n_params = sum(p.numel() for p in model.parameters())  # a tied pair once
    embed = cfg.vocab_size * cfg.hidden_size
    matmul = n_params - embed + (embed if tied else 0)
    want = 6 * matmul + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * L
    m = re.search(r"ctitan: (\S+) FLOPs/token", err)
    assert m, err
    assert close(float(m.group(1)), want, 5e-3), (m.group(1), want)  # printed to 3 significant digits
    for r in rows:
        assert close(r["tflops"], want * r["tps"] / 1e12, 2e-2), (r, want)


def test_warmup_longer_than_the_run(tmp_path, run_ctitan):
    """lr_scheduler.warmup_steps above training.steps is cut to training.steps with a warning,
    as torchtitan's build_lr_schedulers cuts it: every step's lr is LambdaLR's on torchtitan's
    factor with warmup = steps (oracle.make_lr_lambda), so the last step reaches the peak."""
    import torch

    from conftest import tiny_run
    steps, lr = 4, 1e-2
    _, out, args = tiny_run(tmp_path, f"--optimizer.lr={lr}", "--lr_scheduler.warmup_steps=10", steps=steps)
    _, _, err = run_ctitan(args)
    assert "lr_scheduler.warmup_steps (10) exceeds training.steps (4)" in err, err
    got = [r["lr"] for r in oracle.read_metrics(out / "metrics.jsonl")]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, oracle.make_lr_lambda(steps, steps, None, "linear", 0.0))
    want = []
    for _ in range(steps):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert len(got) == steps and all(close(g, w, 1e-6) for g, w in zip(got, want)), (got, want)
    assert close(got[-1], lr, 1e-6), got
