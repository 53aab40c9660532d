"""A run stopped at a validation step (training.stop_at_step, or a signal: the same
stop) saves before validating, as preemption needs; the resumed run then evaluates that
step first, so that the interrupted run's validation curve has every point an
uninterrupted one has, each equal to PyTorch's (the reference trains the same steps)."""
import oracle
from test_validation import _hf_val_loss, _setup


def test_validation_of_the_stop_step_is_done_on_resume(tmp_path, run_ctitan):
    _, _, val, val_tokens = _setup(tmp_path)
    steps, freq, lr, warmup, stop = 6, 2, 1e-2, 2, 4
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
                                    "checkpoint.enable": True, "checkpoint.interval": 100,
                                    "validation.enable": True, "validation.freq": freq, "validation.steps": 2,
                                    "validation.local_batch_size": 3, "validation.dataset_path": str(val)})
    cfgf = oracle.write_toml(tmp_path / "c.toml", sec)
    rc, _, err = run_ctitan(["train", "--config", cfgf, f"--training.stop_at_step={stop}"], check=False)
    assert rc == 75, err
    # the stop saved first and left step 4's validation out
    rows = [r["step"] for r in oracle.read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert rows == [2], rows
    _, stdout, _ = run_ctitan(["train", "--config", cfgf])
    assert f"validate step: {stop}" in stdout, stdout
    metrics = oracle.read_metrics(out / "metrics.jsonl")
    rows = {r["step"]: r["val_loss"] for r in metrics if "val_loss" in r}
    assert sorted(rows) == sorted(ref) == [2, 4, 6], (rows, ref)
    for s in ref:
        assert abs(rows[s] - ref[s]) <= 1e-4 * ref[s], f"step {s}: val_loss {rows[s]!r} vs PyTorch {ref[s]!r}"
    # in an uninterrupted run's order: step 4's training line, its validation, then step 5
    order = [(r["step"], "val_loss" in r) for r in metrics]
    assert order.index((4, True)) == order.index((4, False)) + 1 and order.count((4, True)) == 1, order


def test_a_resumed_run_does_not_validate_a_step_already_validated(tmp_path, run_ctitan):
    """A checkpoint of an ordinary interval save was validated before it was saved: the
    resumed run must not log that step's validation twice."""
    _, train, val, _ = _setup(tmp_path)
    out = tmp_path / "out"
    sec = oracle.train_sections(out, train, tmp_path / "model", steps=6, lr=0.0, options={
        "checkpoint.enable": True, "checkpoint.interval": 4, "checkpoint.keep_latest_k": 0,
        "checkpoint.last_save_model_only": False,
        "validation.enable": True, "validation.freq": 2, "validation.steps": 2,
        "validation.local_batch_size": 3, "validation.dataset_path": str(val)})
    cfgf = oracle.write_toml(tmp_path / "c.toml", sec)
    run_ctitan(["train", "--config", cfgf, "--training.steps=4"])
    rc, _, err = run_ctitan(["train", "--config", cfgf], check=False)  # resumes from step 4, steps 6
    assert rc == 0 and "(step 4)" in err and "resuming from" in err, err
    rows = [r["step"] for r in oracle.read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert rows == [2, 4, 6], rows
