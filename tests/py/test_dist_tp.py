"""Tensor parallelism (issue 7) for the dense model: column-parallel q/k/v and gate/up,
row-parallel o and down, per-head q/k norms local, vocabulary-parallel lm_head and loss
(replicated with the embedding when tied).

Every layout must train like one process with the same global batch: the same loss for
10 steps to 1e-5 relative and the same final weights (test_dist.py's helpers and
tolerances). The one-process run is checked against PyTorch by test_train_loop.py.
Checkpoints hold whole tensors, so they move between TP and one process."""
import subprocess

import numpy as np
import pytest
import torch

import oracle
from test_dist import ENV, STEPS, assert_same_run, mpirun, run, train_args, weights
from conftest import BIN, crashed


@pytest.fixture(scope="module")
def tp_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_tp")
    # heads 4, kv heads 2, intermediate 48, vocabulary 256: TP 2 divides all four; TP 4 not
    # the kv heads. The data's tokens are < 251.
    for name, vocab, tied in (("model", 256, False), ("model_tied", 251, True), ("model_v251", 251, False)):
        oracle.tiny_config(vocab=vocab, hidden=30, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8,
                           tied=tied).save_pretrained(d / name)
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    ref = d / "single"
    run(1, train_args(d / "model", data, ref, "--checkpoint.last_save_model_only=false"))
    return d, data, ref


TP_LAYOUTS = {  # name: (ranks, replicate, shard, tp, extra)
    "tp2": (2, 1, 1, 2, []),
    "tp2_fsdp2": (4, 1, 2, 2, []),
    "tp2_dp2_ac_full": (4, 2, 1, 2, ["--activation_checkpoint.mode=full"]),
    # the vocabulary-parallel loss over blocks of 7 logits rows (each with its own max, sum
    # of exponentials and target logit combined over the ranks), against one whole block
    "tp2_logits_chunk_rows_7": (2, 1, 1, 2, ["--training.logits_chunk_rows=7"]),
}


@pytest.mark.parametrize("name", list(TP_LAYOUTS))
def test_tp_layout_matches_one_rank(tp_setup, name):
    d, data, ref = tp_setup
    n, rep, shard, tp, extra = TP_LAYOUTS[name]
    out = d / name
    p = run(n, train_args(d / "model", data, out, f"--parallelism.data_parallel_replicate_degree={rep}",
                          f"--parallelism.data_parallel_shard_degree={shard}",
                          f"--parallelism.tensor_parallel_degree={tp}", *extra, dp=n // tp))
    assert len([l for l in p.stdout.splitlines() if l.startswith("step: 1 ")]) == 1, p.stdout
    assert_same_run(out, ref, name)
    # the gradient norm counts the replicated tensors once and the sliced ones whole
    got, want = grad_norms(out), grad_norms(ref)
    assert set(got) == set(want) == set(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{name}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"


def grad_norms(out):
    return {r["step"]: r["grad_norm"] for r in oracle.read_metrics(out / "metrics.jsonl") if "grad_norm" in r}


@pytest.mark.parametrize("model", ["model", "model_tied"])
def test_tp_first_step_gradients(tp_setup, model):
    """After one AdamW step exp_avg is (1 - beta1) x the gradient: every tensor's gradient
    under TP 2 x FSDP 2 (sliced, replicated, vocabulary-parallel or tied lm_head, and the
    q/k norms summed over heads) equals one process's."""
    d, data, _ = tp_setup
    outs = {}
    for n, tp in ((1, 1), (4, 2)):
        outs[n] = d / f"grad_{model}_{n}"
        p = run(n, train_args(d / model, data, outs[n], "--training.stop_at_step=1",
                              "--checkpoint.last_save_model_only=false",
                              f"--parallelism.tensor_parallel_degree={tp}", dp=n // tp), check=False)
        assert p.returncode == 75, p.stderr[-3000:]
    a = weights(outs[4], step=1, file="optim.safetensors")
    b = weights(outs[1], step=1, file="optim.safetensors")
    assert a.keys() == b.keys()
    for k in b:
        if k.endswith("exp_avg"):
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-30)
            assert err <= 1e-5, f"{k}: gradient differs from one process by {err:.3g} (relative to its max)"


def test_tp_checkpoint_moves_between_layouts(tp_setup):
    """Written under TP 2 x FSDP 2, resumed on 1 process and on FSDP 2, and 1 process -> TP 2: the steps
    after the checkpoint, the final weights and the AdamW moments equal the uninterrupted
    one-process run's."""
    d, data, ref = tp_setup
    stop = ["--training.stop_at_step=4", "--checkpoint.last_save_model_only=false"]
    layouts = {  # name: (ranks, data-parallel degree, args)
        "tp2": (2, 1, ["--parallelism.tensor_parallel_degree=2"]),
        "tp2_fsdp2": (4, 2, ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
        "fsdp2": (2, 2, ["--parallelism.data_parallel_shard_degree=2"]),
        "one": (1, 1, [])}
    for first, then in (("tp2_fsdp2", "one"), ("one", "tp2"), ("tp2_fsdp2", "fsdp2")):
        (n1, dp1, a1), (n2, dp2, a2) = layouts[first], layouts[then]
        out = d / f"move_{first}_to_{then}"
        p = run(n1, train_args(d / "model", data, out, *stop, *a1, dp=dp1), check=False)
        assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
        assert (out / "checkpoint" / "step-4" / "optim.safetensors").exists()
        p = run(n2, train_args(d / "model", data, out, "--checkpoint.last_save_model_only=false", *a2, dp=dp2))
        assert "resuming from" in p.stderr, p.stderr[-2000:]
        assert_same_run(out, ref, f"{first} -> {then}", steps=range(5, STEPS + 1))
        a, b = weights(out, file="optim.safetensors"), weights(ref, file="optim.safetensors")
        for k in b:
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)
            assert err <= 1e-4, f"{first} -> {then}: {k} differs by {err:.3g}"


def test_tp_loss_with_large_logits(tp_setup, tmp_path):
    """The vocabulary-parallel loss shifts each row by its max before the exponentials, the
    max over every rank's columns. Logits of a few hundred (final norm weights 200: a row's
    max is near 300 on each rank) are where that matters: shifted by more than about 100 past
    the row's max (the two ranks' maxima added, say) every exponential underflows to 0. The
    losses and gradient norms of 3 steps under TP 2 equal one process's."""
    d, data, _ = tp_setup
    cfg = oracle.tiny_config(vocab=256, hidden=30, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8)
    model = oracle.build_model(cfg, seed=4)
    with torch.no_grad():
        model.model.norm.weight.fill_(200.0)
    oracle.save_model(model, tmp_path / "model")
    outs = {}
    for n in (1, 2):
        outs[n] = tmp_path / f"tp{n}"
        args = train_args(tmp_path / "model", data, outs[n], f"--checkpoint.initial_load_path={tmp_path / 'model'}",
                          "--checkpoint.initial_load_in_hf", "--training.steps=3",
                          f"--parallelism.tensor_parallel_degree={n}")
        run(n, [a for a in args if not a.startswith("--validation.")])
    got, want = oracle.read_metrics(outs[2] / "metrics.jsonl"), oracle.read_metrics(outs[1] / "metrics.jsonl")
    want = {r["step"]: r for r in want if "loss" in r}
    assert set(want) == {1, 2, 3} and want[1]["loss"] > 50, want
    got = [r for r in got if "loss" in r]
    assert [r["step"] for r in got] == [1, 2, 3], got
    for r in got:
        for k in ("loss", "grad_norm"):
            assert abs(r[k] - want[r["step"]][k]) <= 1e-5 * abs(want[r["step"]][k]), \
                f"step {r['step']} {k} {r[k]!r} under TP 2 vs one process {want[r['step']][k]!r}"


@pytest.mark.parametrize("model,tp,words", [("model", 4, "kv heads"), ("model", 3, "attention heads"),
                                            ("model_v251", 2, "vocabulary size")])
def test_tp_degree_must_divide_the_model(tp_setup, model, tp, words):
    d, data, _ = tp_setup
    cmd = mpirun() + ["-np", str(tp), str(BIN)] + train_args(
        d / model, data, d / f"bad_tp{tp}_{model}", f"--parallelism.tensor_parallel_degree={tp}")
    p = subprocess.run([str(c) for c in cmd], env=ENV, capture_output=True, text=True, timeout=60)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "tensor_parallel_degree = %d does not divide the model's %s" % (tp, words) in p.stderr, p.stderr[-2000:]
