"""optimizer.name = "Adam" (torchtitan's other optimizer): torch.optim.Adam, whose weight decay
is added to the (clipped) gradient before the moments, where AdamW's scales the weights.

1. Ten whole steps (accumulation, clipping on both sides, the warmup and cosine schedule)
   against a PyTorch loop with torch.optim.Adam: losses, gradient norms, final weights; the
   same loop with AdamW ends far from it, so the test tells the two apart.
2. With a frozen tensor (training.freeze): AdamW's trained-runs path, the frozen weight kept.
3. FSDP 2 (the sharded step) against one process."""
import numpy as np

import oracle
from test_dist import assert_same_run, run, train_args
from test_train_loop import GLOBAL_BS, HP, L, LOCAL_BS, TOL, check_run, model_cfg, train_sections


def adam_sections(hf_dir, data, out, steps, freeze=None):
    sec = train_sections(hf_dir, data, out, steps)
    sec["optimizer"]["name"] = "Adam"
    if freeze:
        sec["training"]["freeze"] = freeze
    return sec


def setup_run(tmp_path, seed):
    cfg = model_cfg(False)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=seed)
    tokens = oracle.random_tokens(20 * (L + 1), cfg.vocab_size, seed=seed + 1)
    return hf_dir, tokens, oracle.write_bin(tmp_path / "tokens.bin", tokens)


def test_adam_ten_steps_match_torch(tmp_path, run_ctitan):
    steps = 10
    hf_dir, tokens, data = setup_run(tmp_path, 31)
    out = tmp_path / "out"
    conf = oracle.write_toml(tmp_path / "train.toml", adam_sections(hf_dir, data, out, steps))
    ref = oracle.reference_train(oracle.load_hf(hf_dir), tokens, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS,
                                 steps=steps, optimizer="Adam", **HP)
    assert any(g > HP["max_norm"] for g in ref["grad_norms"]) and any(g < HP["max_norm"] for g in ref["grad_norms"])
    # torch's AdamW on the same run ends far beyond the tolerance: the check tells them apart
    other = oracle.reference_train(oracle.load_hf(hf_dir), tokens, seq_len=L, local_bs=LOCAL_BS,
                                   global_bs=GLOBAL_BS, steps=steps, **HP)
    assert max(oracle.rel_err(other["params"][n], ref["params"][n]) for n in ref["params"]) > 100 * TOL
    _, stdout, _ = run_ctitan(["train", "--config", conf])
    check_run(out, ref, steps, list(range(1, steps + 1)), oracle.load_hf(hf_dir), stdout)


def test_adam_with_a_frozen_tensor(tmp_path, run_ctitan):
    steps = 4
    hf_dir, tokens, data = setup_run(tmp_path, 33)
    out = tmp_path / "out"
    frozen = "model.layers.0.mlp.up_proj.weight"
    conf = oracle.write_toml(tmp_path / "train.toml", adam_sections(hf_dir, data, out, steps, freeze=frozen))
    model = oracle.load_hf(hf_dir)
    base = dict(model.named_parameters())[frozen].detach().clone().numpy()
    dict(model.named_parameters())[frozen].requires_grad_(False)
    ref = oracle.reference_train(model, tokens, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=steps,
                                 optimizer="Adam", **HP)
    _, stdout, _ = run_ctitan(["train", "--config", conf])
    check_run(out, ref, steps, list(range(1, steps + 1)), oracle.load_hf(hf_dir), stdout)
    got = oracle.read_hf_tensors(out / "checkpoint" / f"step-{steps}")[frozen]
    assert np.array_equal(got, base), "the frozen tensor moved (Adam's decay reached it)"


def test_adam_fsdp2_matches_one_process(tmp_path):
    hf_dir, tokens, data = setup_run(tmp_path, 35)
    # eps 1e-4 as test_train_loop's HP (its note says why): at 1e-8 rounding noise divided by
    # eps moved one q_proj 1.06e-5 from one process, for AdamW as well
    adam = ["--optimizer.name=Adam", "--optimizer.weight_decay=0.1", "--optimizer.eps=1e-4"]
    ref, out = tmp_path / "one", tmp_path / "fsdp2"
    run(1, train_args(hf_dir, data, ref, *adam))
    run(2, train_args(hf_dir, data, out, *adam, "--parallelism.data_parallel_shard_degree=2", dp=2))
    assert_same_run(out, ref, "Adam FSDP 2")


def test_resume_refuses_another_optimizer(tmp_path):
    """A checkpoint's moments belong to its update rule: resuming AdamW's under Adam is refused
    naming optimizer.name (torch's Adam loading AdamW's state would keep its decoupled decay,
    so it would not run Adam either); the same optimizer resumes."""
    hf_dir, tokens, data = setup_run(tmp_path, 37)
    out = tmp_path / "run"
    full = ["--checkpoint.last_save_model_only=false", "--checkpoint.interval=2", "--training.steps=4",
            "--validation.enable=false"]
    p = run(1, train_args(hf_dir, data, out, *full, "--training.stop_at_step=2"), check=False)
    assert p.returncode == 75, p.stderr[-2000:]
    p = run(1, train_args(hf_dir, data, out, *full, "--optimizer.name=Adam"), check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "optimizer.name" in p.stderr and "\"AdamW\"" in p.stderr and "\"Adam\"" in p.stderr, p.stderr[-2000:]
    p = run(1, train_args(hf_dir, data, out, *full))
    assert "resuming from" in p.stderr, p.stderr[-2000:]
