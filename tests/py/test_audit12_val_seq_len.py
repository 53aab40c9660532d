"""Twelfth mutation audit (docs/reliability.md): validation.seq_len's shapes.

- The model's buffers hold the larger forward, ceil(rows / T) sequences of the longer T
  (plan_model_shape). Rounded down the suite passed: its shapes all divide (2 x 16 against
  3 x 8 or 3 x 32). Training 2 x 16 = 32 rows with validation 1 x 24: the buffers need 2 x 24
  (1 x 24 is short of training's rows); training's losses stay the run's without
  validation.seq_len, bit for bit, and the held-out loss is transformers' on the same windows.
- validation.local_batch_size x validation.seq_len past INT_MAX is refused naming both (the
  model counts a forward's rows in an int); checked against training.seq_len instead, the
  suite passed."""
import oracle
from test_validation_seq_len import _hf_val_loss, _sections, _setup


def test_longer_window_fewer_rows(tmp_path, run_ctitan):
    model, train, _, val_tokens = _setup(tmp_path)
    got = {}
    for name, opts in (("plain", {}), ("v24", {"validation.seq_len": 24})):
        sec = _sections(tmp_path, name, train, {"optimizer.lr": 1e-2, "training.steps": 4,
                                                "validation.local_batch_size": 1, **opts})
        run_ctitan(["train", "--config", oracle.write_toml(tmp_path / f"{name}.toml", sec)])
        got[name] = oracle.read_metrics(tmp_path / name / "metrics.jsonl")
    loss = {k: {r["step"]: r["loss"] for r in v if "loss" in r} for k, v in got.items()}
    assert sorted(loss["plain"]) == [1, 2, 3, 4] and loss["v24"] == loss["plain"], loss
    # lr 0: every evaluation sees the saved model
    sec = _sections(tmp_path, "lr0", train, {"validation.seq_len": 24, "validation.local_batch_size": 1})
    run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "lr0.toml", sec)])
    rows = [r for r in oracle.read_metrics(tmp_path / "lr0" / "metrics.jsonl") if "val_loss" in r]
    ref = _hf_val_loss(model, val_tokens, 2, 24)
    assert rows and rows[0]["val_targets"] == 2 * 24, rows
    assert abs(rows[0]["val_loss"] - ref) <= 1e-4 * ref, f"val_loss {rows[0]['val_loss']} vs HF {ref}"


def test_validation_rows_past_int_refused(tmp_path, run_ctitan):
    _, train, _, _ = _setup(tmp_path)
    sec = _sections(tmp_path, "big", train, {"validation.seq_len": 65536, "validation.local_batch_size": 65536})
    rc, out, err = run_ctitan(["train", "--dry-run", "--config", oracle.write_toml(tmp_path / "big.toml", sec)],
                              check=False)
    assert rc == 2, out + err
    assert "validation.local_batch_size (65536) x validation.seq_len (65536)" in err and "out of range" in err, err


def test_validation_seq_len_inert_while_validation_is_off(tmp_path, run_ctitan):
    """validation.seq_len with validation.enable = false plans nothing: the dry run's
    activations are the run's without the key and the plan has no validation.seq_len line (a
warning says the key does nothing). Planted:
    cfg_val_seq_len ignoring validation.enable passed."""
    _, train, _, _ = _setup(tmp_path)
    got = {}
    for name, opts in (("plain", {}), ("off", {"validation.seq_len": 48})):
        sec = _sections(tmp_path, name, train, {"validation.enable": False, **opts})
        _, out, err = run_ctitan(["train", "--dry-run", "--config", oracle.write_toml(tmp_path / f"{name}.toml", sec)])
        got[name] = [ln for ln in (out + err).splitlines()
                     if "activations + workspace" in ln or ln.startswith("  validation.seq_len")]
    assert got["off"] == got["plain"] and len(got["plain"]) == 1, got
