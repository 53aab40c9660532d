"""validation.seq_len (torchtitan's [validation] seq_len): held-out loss over windows of
their own length, shorter or longer than training.seq_len, equal to transformers' loss
on the same windows (built here from the token file as the dataset cuts it: disjoint
windows of seq_len + 1 tokens); training's own losses unchanged by it; bad values
refused naming the key. The layouts (FSDP, TP, CP, PP, LoRA) are in
test_validation_seq_len_layouts.py."""
import numpy as np
import pytest

import oracle

VOCAB = 200


def _setup(tmp_path):
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    cfg.max_position_embeddings = 64
    model = oracle.save_random_hf(tmp_path / "model", cfg, seed=4)
    train = oracle.write_bin(tmp_path / "train.bin", oracle.random_tokens(30 * 17, VOCAB, seed=1))
    val_tokens = oracle.learnable_stream(12 * 33 + 5, VOCAB, seed=2)
    val = oracle.write_bin(tmp_path / "val.bin", val_tokens)
    return model, train, val, val_tokens


def _hf_val_loss(model, val_tokens, n_windows, seq_len):
    w = oracle.windows(val_tokens, seq_len)[:n_windows]
    return oracle.hf_loss(model, w[:, :-1], w[:, 1:])


def _sections(tmp_path, name, train, options):
    # lr 0 keeps the weights: every evaluation sees the saved model
    return oracle.train_sections(tmp_path / name, train, tmp_path / "model", steps=2, lr=0.0, options={
        "validation.enable": True, "validation.freq": 2, "validation.steps": 2, "validation.local_batch_size": 3,
        "validation.dataset_path": str(tmp_path / "val.bin"), **options})


@pytest.mark.parametrize("val_len", [8, 32])
def test_val_loss_at_its_own_length_matches_hf(tmp_path, run_ctitan, val_len):
    """training.seq_len 16, validation.seq_len 8 (the model's buffers: training's) and 32 (the
    buffers grow to 3 x 32 rows): 2 batches of 3 windows of val_len + 1 tokens."""
    model, train, _, val_tokens = _setup(tmp_path)
    sec = _sections(tmp_path, "out", train, {"validation.seq_len": val_len})
    _, stdout, _ = run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "c.toml", sec)])
    rows = [r for r in oracle.read_metrics(tmp_path / "out" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in rows] == [2], rows
    ref = _hf_val_loss(model, val_tokens, 6, val_len)
    assert rows[0]["val_targets"] == 6 * val_len, rows
    assert abs(rows[0]["val_loss"] - ref) <= 1e-4 * ref, f"val_loss {rows[0]['val_loss']} vs HF {ref}"
    # another length's windows give another loss: the test tells the lengths apart
    other = _hf_val_loss(model, val_tokens, 6, 16)
    assert abs(other - ref) > 1e-3 * ref, (other, ref)
    assert "validate step: 2" in stdout


def test_training_losses_unchanged(tmp_path, run_ctitan):
    """The same run with validation.seq_len 32 and without it: the same training losses, bit
    for bit (the model's larger buffers and validation's windows change nothing of a step),
    at lr > 0 so that the steps depend on each other."""
    _, train, _, _ = _setup(tmp_path)
    got = {}
    for name, opts in (("plain", {}), ("long", {"validation.seq_len": 32}), ("short", {"validation.seq_len": 8})):
        sec = _sections(tmp_path, name, train, {"optimizer.lr": 1e-2, "training.steps": 4, **opts})
        run_ctitan(["train", "--config", oracle.write_toml(tmp_path / f"{name}.toml", sec)])
        got[name] = {r["step"]: r["loss"] for r in oracle.read_metrics(tmp_path / name / "metrics.jsonl")
                     if "loss" in r}
    assert sorted(got["plain"]) == [1, 2, 3, 4], got
    assert got["long"] == got["plain"] and got["short"] == got["plain"], got


def test_dry_run_plans_the_longer_forward(tmp_path, run_ctitan):
    """--dry-run's activations grow with a validation forward of more rows than training's
    (3 x 32 against 2 x 16) and not with a shorter one (3 x 8 < 2 x 16)."""
    _, train, _, _ = _setup(tmp_path)
    acts = {}
    for name, opts in (("plain", {}), ("long", {"validation.seq_len": 32}), ("short", {"validation.seq_len": 8})):
        sec = _sections(tmp_path, name, train, {"validation.local_batch_size": 2, **opts})
        _, out, err = run_ctitan(["train", "--dry-run", "--config", oracle.write_toml(tmp_path / f"{name}.toml", sec)])
        line = [l for l in (out + err).splitlines() if "activations + workspace" in l]
        assert line, out + err
        acts[name] = float(line[0].split()[-2])
    assert acts["short"] == acts["plain"] < acts["long"], acts


@pytest.mark.parametrize("opts,words", [
    ({"validation.seq_len": 0}, ["validation.seq_len"]),
    ({"validation.seq_len": 1000}, ["validation.seq_len", "too short"]),
])
def test_bad_values_refused(tmp_path, run_ctitan, opts, words):
    _, train, _, _ = _setup(tmp_path)
    sec = _sections(tmp_path, "out", train, opts)
    rc, _, err = run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "c.toml", sec)], check=False)
    assert rc != 0 and all(w in err for w in words), err


def test_past_max_positions_warns_naming_the_key(tmp_path, run_ctitan):
    """As training.seq_len: a validation length past max_position_embeddings (64) is
    evaluated (RoPE extrapolates, as transformers runs it) with a warning naming the key."""
    model, train, _, val_tokens = _setup(tmp_path)
    sec = _sections(tmp_path, "out", train, {"validation.seq_len": 80, "validation.local_batch_size": 2})
    _, _, err = run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "c.toml", sec)])
    assert "validation.seq_len (80) exceeds the 64 positions" in err, err
    assert "training.seq_len (16) exceeds" not in err, err
    rows = [r for r in oracle.read_metrics(tmp_path / "out" / "metrics.jsonl") if "val_loss" in r]
    ref = _hf_val_loss(model, val_tokens, 4, 80)
    assert abs(rows[0]["val_loss"] - ref) <= 1e-4 * ref, (rows, ref)
