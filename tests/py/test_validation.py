"""[validation]: held-out loss and perplexity logged beside the training metrics,
equal to transformers' loss on the same held-out windows."""
import math

import numpy as np
import pytest

import oracle


def _setup(tmp_path):
    cfg = oracle.tiny_config(vocab=200, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    model = oracle.save_random_hf(tmp_path / "model", cfg, seed=4)
    train = oracle.write_bin(tmp_path / "train.bin", oracle.random_tokens(30 * 17, 200, seed=1))
    val_tokens = oracle.learnable_stream(11 * 17 + 3, 200, seed=2)
    val = oracle.write_bin(tmp_path / "val.bin", val_tokens)
    return model, train, val, val_tokens


def _hf_val_loss(model, val_tokens, n_windows, seq_len=16):
    w = oracle.windows(val_tokens, seq_len)[:n_windows]
    x, y = w[:, :-1], w[:, 1:]
    return oracle.hf_loss(model, x, y)


@pytest.mark.parametrize("val_steps,batch,n_windows", [(2, 3, 6), (-1, 2, 10)])
def test_validation_loss_matches_hf(tmp_path, run_ctitan, val_steps, batch, n_windows):
    model, train, val, val_tokens = _setup(tmp_path)
    out = tmp_path / "out"
    # lr 0 keeps the weights, so every evaluation sees the saved model
    sec = oracle.train_sections(out, train, tmp_path / "model", steps=4, lr=0.0, options={
        "validation.enable": True, "validation.freq": 2, "validation.steps": val_steps,
        "validation.local_batch_size": batch, "validation.dataset_path": str(val)})
    cfgf = oracle.write_toml(tmp_path / "c.toml", sec)
    _, stdout, _ = run_ctitan(["train", "--config", cfgf])
    rows = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in rows] == [2, 4], rows
    ref = _hf_val_loss(model, val_tokens, n_windows)
    for r in rows:
        assert abs(r["val_loss"] - ref) <= 1e-4 * ref, f"val_loss {r['val_loss']} vs HF {ref}"
        assert abs(r["val_perplexity"] - math.exp(ref)) <= 1e-3 * math.exp(ref)
        assert r["val_targets"] == n_windows * 16
    assert "validate step: 2" in stdout and "perplexity" in stdout


def test_validation_needs_a_path(tmp_path, run_ctitan):
    _, train, _, _ = _setup(tmp_path)
    sec = oracle.train_sections(tmp_path / "o", train, tmp_path / "model", options={"validation.enable": True})
    cfgf = oracle.write_toml(tmp_path / "c.toml", sec)
    rc, _, err = run_ctitan(["train", "--config", cfgf], check=False)
    assert rc == 2 and "validation.dataset_path" in err and "c.toml" in err, err


def test_validation_loss_while_training_matches_pytorch(tmp_path, run_ctitan):
    """lr > 0: each evaluation sees the weights of its step. The reference trains the same
    steps in PyTorch (torch.optim.AdamW, clipping, ctitan's warmup + linear decay) and takes
    transformers' loss on the held-out windows after every validation interval."""
    _, _, val, val_tokens = _setup(tmp_path)
    steps, freq, lr, warmup = 6, 2, 1e-2, 2
    # text of the held-out kind, so that training moves the validation loss
    train_tokens = oracle.learnable_stream(30 * 17, 200, seed=1)
    train = oracle.write_bin(tmp_path / "train_learnable.bin", train_tokens)
    ref = {}

    def validate(step, model):
        if step % freq == 0:
            ref[step] = _hf_val_loss(model, val_tokens, 6)

    oracle.reference_train(oracle.load_hf(tmp_path / "model"), train_tokens, seq_len=16, local_bs=2, global_bs=4,
                           steps=steps, lr=lr, warmup_steps=warmup, after_step=validate)
    out = tmp_path / "out"
    sec = oracle.train_sections(out, train, tmp_path / "model", steps=steps, local_bs=2, global_bs=4, lr=lr,
                                warmup_steps=warmup, options={
                                    "optimizer.weight_decay": 0.1, "optimizer.eps": 1e-8, "optimizer.beta1": 0.9,
                                    "optimizer.beta2": 0.95, "training.max_norm": 1.0,
                                    "validation.enable": True, "validation.freq": freq, "validation.steps": 2,
                                    "validation.local_batch_size": 3, "validation.dataset_path": str(val)})
    run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "c.toml", sec)])
    rows = {r["step"]: r["val_loss"] for r in oracle.read_metrics(out / "metrics.jsonl") if "val_loss" in r}
    assert sorted(rows) == sorted(ref) == [2, 4, 6], (rows, ref)
    # the weights move: an evaluation of stale weights (or of the saved model) would pass at lr 0
    assert abs(ref[6] - ref[2]) > 100 * 1e-4 * ref[2], ref
    for s in ref:
        assert abs(rows[s] - ref[s]) <= 1e-4 * ref[s], f"step {s}: val_loss {rows[s]!r} vs PyTorch {ref[s]!r}"


def test_validation_after_the_last_step(tmp_path, run_ctitan):
    """validation.freq's rule (--help: "optimizer steps between evaluations (and after the last
    step)"): a run of 5 steps at freq 2 evaluates after steps 2, 4 and 5, each equal to
    transformers' loss (lr 0 keeps the saved model). The evaluation of the last step had no test
    where the step count was a multiple of freq (a mutation audit)."""
    model, train, val, val_tokens = _setup(tmp_path)
    out = tmp_path / "out"
    sec = oracle.train_sections(out, train, tmp_path / "model", steps=5, lr=0.0, options={
        "validation.enable": True, "validation.freq": 2, "validation.steps": 2,
        "validation.local_batch_size": 3, "validation.dataset_path": str(val)})
    run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "c.toml", sec)])
    rows = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in rows] == [2, 4, 5], rows
    ref = _hf_val_loss(model, val_tokens, 6)
    assert all(abs(r["val_loss"] - ref) <= 1e-4 * ref for r in rows), (rows, ref)
