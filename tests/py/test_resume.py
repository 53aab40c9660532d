"""Checkpoints that always restore (issue 4): exact resume, double resume, crash safety
under SIGKILL, damage detection through the CLI, SIGTERM, and HF export.

Every comparison but the export's is between ctitan runs: an interrupted run must
reproduce the uninterrupted one bit for bit (the uninterrupted run itself is checked
against PyTorch by test_train_loop.py). The export is checked against PyTorch directly."""
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import oracle
from conftest import BIN, CHILD_ENV, ROOT

STEPS = 20


@pytest.fixture
def setup(tmp_path):
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    model_dir = tmp_path / "model"
    cfg.save_pretrained(model_dir)  # config.json only: ctitan initialises from training.seed
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    return tmp_path, model_dir, data


def args_for(model_dir, data, out, *extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}",
            f"--training.dataset_path={data}", "--training.seq_len=16", "--training.local_batch_size=2",
            "--training.global_batch_size=4", f"--training.steps={STEPS}", "--training.shuffle",
            "--training.seed=11", "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=3",
            "--lr_scheduler.decay_type=cosine", "--lr_scheduler.decay_ratio=0.5", "--metrics.log_freq=1",
            "--metrics.peak_tflops=1", f"--job.dump_folder={out}", "--checkpoint.enable",
            "--checkpoint.last_save_model_only=false", "--checkpoint.keep_latest_k=0", *extra]


def losses(out):
    rows = [r for r in oracle.read_metrics(Path(out) / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in rows]
    # a resumed run drops the lines of steps it redoes: every step appears once, in order
    assert steps == sorted(set(steps)), f"metrics steps repeat or go back: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def final_tensors(out, step=STEPS):
    d = Path(out) / "checkpoint" / f"step-{step}"
    res = {}
    for f in ("model.safetensors", "optim.safetensors"):
        hdr, data = oracle.read_safetensors_raw(d / f)
        for k, v in hdr.items():
            if k != "__metadata__":
                a, b = v["data_offsets"]
                res[f + ":" + k] = data[a:b]
    return res


def assert_same_run(ref_out, out):
    ref, got = losses(ref_out), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), f"steps logged: {sorted(got)}"
    diff = [(s, ref[s], got[s]) for s in ref if ref[s] != got[s]]
    assert not diff, f"losses differ (step, uninterrupted, resumed): {diff[:5]}"
    a, b = final_tensors(ref_out), final_tensors(out)
    assert a.keys() == b.keys()
    bad = [k for k in a if a[k] != b[k]]
    assert not bad, f"final weights / optimizer state not bit-identical: {bad[:5]}"


@pytest.fixture
def reference(setup, run_ctitan):
    tmp, model_dir, data = setup
    ref = tmp / "ref"
    run_ctitan(args_for(model_dir, data, ref))
    return ref


def test_resume_once_is_exact(setup, reference, run_ctitan):
    tmp, model_dir, data = setup
    out = tmp / "run"
    rc, _, err = run_ctitan(args_for(model_dir, data, out, "--training.stop_at_step=10"), check=False)
    assert rc == 75, f"stop_at_step must exit 75 after saving, got {rc}\n{err}"
    assert (out / "checkpoint" / "step-10" / "manifest.json").exists()
    _, _, err = run_ctitan(args_for(model_dir, data, out))
    assert "resuming from" in err and "step-10" in err, err
    assert_same_run(reference, out)


def test_resume_twice_is_exact(setup, reference, run_ctitan):
    tmp, model_dir, data = setup
    out = tmp / "run"
    for stop in (10, 15):
        rc, _, err = run_ctitan(args_for(model_dir, data, out, f"--training.stop_at_step={stop}"), check=False)
        assert rc == 75, err
    _, _, err = run_ctitan(args_for(model_dir, data, out))
    assert "step-15" in err, err
    assert_same_run(reference, out)


def test_sigkill_at_random_moments(setup, reference, run_ctitan):
    """20+ SIGKILLs at random moments (checkpoint every step, so many land inside a
    write); every restart must resume from a complete checkpoint and the final
    weights must equal the uninterrupted run's."""
    tmp, model_dir, data = setup
    out = tmp / "crash"
    args = [str(BIN)] + args_for(model_dir, data, out, "--checkpoint.interval=1")
    rng = random.Random(1)
    kills, starts = 0, 0
    while kills < 20 and starts < 200:
        starts += 1
        p = subprocess.Popen(args, cwd=ROOT, env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.0, 0.4))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        _, err = p.communicate(timeout=60)
        assert p.returncode in (0, -signal.SIGKILL), err.decode()[-2000:]
        if p.returncode == 0:  # finished before the kill: start over to keep killing
            assert_same_run(reference, out)
            import shutil
            shutil.rmtree(out)
    assert kills >= 20, f"only {kills} kills in {starts} starts"
    _, _, err = run_ctitan(args_for(model_dir, data, out, "--checkpoint.interval=1"))
    assert_same_run(reference, out)


def test_damaged_checkpoints_are_named(setup, run_ctitan):
    tmp, model_dir, data = setup
    out = tmp / "dmg"
    rc, _, _ = run_ctitan(args_for(model_dir, data, out, "--checkpoint.interval=5",
                                   "--training.stop_at_step=10"), check=False)
    assert rc == 75
    step10 = out / "checkpoint" / "step-10" / "model.safetensors"
    raw = bytearray(step10.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one flipped bit
    step10.write_bytes(bytes(raw))
    # explicit load_step of the damaged one: an error naming the file, no fallback
    rc, _, err = run_ctitan(args_for(model_dir, data, out, "--checkpoint.load_step=10"), check=False)
    assert rc != 0 and "step-10/model.safetensors" in err, err
    # newest damaged: warn by name, resume from step 5
    opt5 = out / "checkpoint" / "step-5" / "optim.safetensors"
    _, _, err = run_ctitan(args_for(model_dir, data, out, "--training.stop_at_step=6"), check=False)
    assert "step-10/model.safetensors" in err and "step-5" in err, err
    # truncation is caught too
    opt5.write_bytes(opt5.read_bytes()[:-7])
    rc, _, err = run_ctitan(args_for(model_dir, data, out, "--checkpoint.load_step=5"), check=False)
    assert rc != 0 and "step-5/optim.safetensors" in err, err


def test_sigterm_writes_checkpoint(setup, run_ctitan):
    tmp, model_dir, data = setup
    out = tmp / "term"
    slow = args_for(model_dir, data, out, "--training.steps=100000", "--lr_scheduler.decay_ratio=0.001")
    slow = [a for a in slow if not a.startswith(f"--training.steps={STEPS}")]
    p = subprocess.Popen([str(BIN)] + slow, cwd=ROOT, env=CHILD_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 75, f"exit {p.returncode}\n{err[-2000:]}"
    steps = sorted(int(d.name[5:]) for d in (out / "checkpoint").iterdir() if d.name.startswith("step-"))
    assert steps, "no checkpoint after SIGTERM"
    last = out / "checkpoint" / f"step-{steps[-1]}"
    assert (last / "manifest.json").exists()
    # it loads: export it and read it back with transformers
    hf = tmp / "hf"
    run_ctitan(["export", "--checkpoint", last, "--out", hf])
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert sum(p.numel() for p in m.parameters()) > 0


def test_export_loss_equals_ctitan(setup, open_session, run_ctitan):
    """An exported training checkpoint, loaded by transformers, gives the loss of the same
    training done in PyTorch (oracle.reference_train from the same initial weights), and
    holds its weights; ctitan reading the export gives that loss too. Against ctitan alone
    (ctitan and transformers both reading the export) a wrong tensor written by the export
    would pass, since both would read the same wrong tensor."""
    tmp, model_dir, data = setup
    from transformers import AutoConfig
    init = tmp / "init"
    oracle.save_random_hf(init, AutoConfig.from_pretrained(model_dir), seed=23)
    out = tmp / "exp"
    # no shuffling: the reference takes the windows in file order
    args = [a for a in args_for(init, data, out, "--training.stop_at_step=4", f"--checkpoint.initial_load_path={init}",
                                "--checkpoint.initial_load_in_hf") if a != "--training.shuffle"]
    rc, _, _ = run_ctitan(args, check=False)
    assert rc == 75
    hf = tmp / "hf"
    run_ctitan(["export", "--checkpoint", out / "checkpoint" / "step-4", "--out", hf])

    tokens = np.fromfile(data, dtype="<u4").astype(np.int64)
    ref_model = oracle.load_hf(init)
    ref = oracle.reference_train(ref_model, tokens, seq_len=16, local_bs=2, global_bs=4, steps=STEPS, lr=3e-3,
                                 warmup_steps=3, decay_type="cosine", decay_ratio=0.5, run_steps=4)
    got = oracle.read_hf_tensors(hf)
    assert set(got) == set(ref["params"]), f"exported tensors {sorted(got)} vs {sorted(ref['params'])}"
    for n, want in ref["params"].items():
        assert oracle.rel_err(got[n], want) <= 1e-4, f"exported {n} differs from PyTorch's step-4 weights"

    toks = oracle.random_tokens(2 * 17, 256, seed=9).reshape(2, 17)
    x, y = toks[:, :-1].astype(np.int32), toks[:, 1:].astype(np.int32)
    want = oracle.hf_loss(ref_model, x, y)
    loss_hf = oracle.hf_loss(oracle.load_hf(hf), x, y)
    assert abs(loss_hf - want) <= 1e-5 * want, f"transformers on the export {loss_hf} vs the PyTorch run {want}"
    s = open_session(["--model.spec=hf", f"--model.hf_assets_path={hf}", f"--checkpoint.initial_load_path={hf}",
                      "--checkpoint.initial_load_in_hf", "--training.local_batch_size=2", "--training.seq_len=16"])
    loss = s.forward_backward(x, y, int(y.size)) / y.size
    assert abs(loss - want) <= 1e-5 * want, f"ctitan on the export {loss} vs the PyTorch run {want}"


def test_rerunning_a_finished_run_does_nothing(setup, run_ctitan):
    """The final save (model-only by default) marks the run complete: the same command
    again must not retrain from step 0 (it would redo and overwrite everything)."""
    tmp, model_dir, data = setup
    out = tmp / "fin"
    base = [a for a in args_for(model_dir, data, out, "--checkpoint.interval=5")
            if a != "--checkpoint.last_save_model_only=false"]
    run_ctitan(base)
    before = (out / "metrics.jsonl").read_text()
    _, stdout, err = run_ctitan(base)
    assert "nothing to do" in err and "step:" not in stdout, err
    assert (out / "metrics.jsonl").read_text() == before
    # the full checkpoints before the final model-only save are still there (k counts full ones)
    assert (out / "checkpoint" / "step-15" / "optim.safetensors").exists()


def test_final_hf_save_never_breaks_a_checkpoint(setup, run_ctitan):
    """Resumed at its last step with last_save_in_hf, the HF export must not be merged into
    the training checkpoint of that step."""
    tmp, model_dir, data = setup
    out = tmp / "hfc"
    rc, _, _ = run_ctitan(args_for(model_dir, data, out, "--training.stop_at_step=4"), check=False)
    assert rc == 75
    short = [a for a in args_for(model_dir, data, out, "--checkpoint.last_save_in_hf",
                                 "--checkpoint.export_dtype=bfloat16") if not a.startswith("--training.steps=")]
    run_ctitan(short + ["--training.steps=4"])
    ck = out / "checkpoint"
    run_ctitan(["export", "--checkpoint", ck / "step-4", "--out", tmp / "e4"])  # still verifies
    assert oracle.hf_dtypes(ck / "hf-step-4") == {"BF16"}


def test_resume_refuses_a_different_data_stream(setup, run_ctitan):
    tmp, model_dir, data = setup
    out = tmp / "chg"
    rc, _, _ = run_ctitan(args_for(model_dir, data, out, "--training.stop_at_step=5"), check=False)
    assert rc == 75
    rc, _, err = run_ctitan(args_for(model_dir, data, out, "--training.seq_len=8"), check=False)
    assert rc == 2 and "training.seq_len" in err and "step-5" in err, err
    rc, _, err = run_ctitan(args_for(model_dir, data, out, "--training.seed=12"), check=False)
    assert rc == 2 and "training.seed" in err, err
