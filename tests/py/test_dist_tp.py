"""Tensor parallelism (issue 7) for the dense model: column-parallel q/k/v and gate/up,
row-parallel o and down, per-head q/k norms local, vocabulary-parallel embedding, lm_head and
loss (tied or not; a vocabulary the degree does not divide is cut in DTensor Shard(0)'s ceil
chunks: tests/py/test_tp_vocab_uneven.py).

Every layout must train like one process with the same global batch: the same loss for
10 steps to 1e-5 relative and the same final weights (test_dist.py's helpers and
tolerances). The one-process run is checked against PyTorch by test_train_loop.py.
Checkpoints hold whole tensors, so they move between TP and one process."""
import re
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
    for name, vocab, tied in (("model", 256, False), ("model_tied", 251, True)):
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


@pytest.mark.parametrize("model,tp,words", [("model", 4, "kv heads"), ("model", 3, "attention heads")])
def test_tp_degree_must_divide_the_model(tp_setup, model, tp, words):
    d, data, _ = tp_setup
    cmd = mpirun() + ["-np", str(tp), str(BIN)] + train_args(
        d / model, data, d / f"bad_tp{tp}_{model}", f"--parallelism.tensor_parallel_degree={tp}")
    p = subprocess.run([str(c) for c in cmd], env=ENV, capture_output=True, text=True, timeout=60)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "tensor_parallel_degree = %d does not divide the model's %s" % (tp, words) in p.stderr, p.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# The vocabulary-parallel embedding: rank r holds rows [r V/t, (r+1) V/t) of the embedding, and
# of lm_head (the same tensor when tied). The lookup gives the other ranks' tokens zeros and is
# summed over the group; the backward adds to the local rows only; a tied head runs the
# vocabulary-parallel loss. Every layout trains like one process (losses, validation, gradient
# norms, final weights or the HF export), and each rank holds V/t x H of the embedding.

@pytest.fixture(scope="module")
def vp_setup(tp_setup):
    d, data, _ = tp_setup
    # tied Qwen3 with a vocabulary TP 2 divides (model_tied's 251 keeps its embedding whole)
    oracle.save_random_hf(d / "model_tied256", oracle.tiny_config(vocab=256, hidden=30, inter=48, layers=3, heads=4,
                                                                  kv_heads=2, head_dim=8, tied=True), seed=23)
    # Gemma3: tied, embeddings scaled by sqrt(hidden), pad token 0 (no gradient to its row), final softcap
    import oracle_families as fam
    fam.make_config(fam.CASE["gemma3_text"]).save_pretrained(d / "gemma3")
    # tokens < 128, as test_families_dist's (with all 160, one process against TP 2 drifts to 3e-5 norm-wise
    # after 10 steps with the embedding replicated as well: the report of this change)
    data160 = oracle.write_bin(d / "tokens160.bin", oracle.learnable_stream(600 * 17, 128, seed=7))
    done = {}

    def single(case):
        if case not in done:
            model, tokens, _ = VP_CASES[case]
            done[case] = d / f"vp_one_{case}"
            run(1, train_args(d / model, data160 if tokens == "160" else data, done[case], *case_args(d, case)))
        return done[case]
    return d, data, data160, single


VP_LORA = ["--lora.rank=4", "--lora.alpha=8", "--lora.dropout=0", "--lora.target_modules=q_proj,v_proj,down_proj",
           "--lora.modules_to_save=embed_tokens"]
VP_CASES = {  # case: (model, data, args of both runs)
    "tied": ("model_tied256", "251", []),
    "gemma3": ("gemma3", "160", []),
    # the embedding (the tied head too) frozen and stored in bf16: looked up and multiplied from the store
    # (the final save is the HF export, the frozen embedding included)
    "tied_frozen_bf16": ("model_tied256", "251", ["--training.freeze=model.embed_tokens.weight",
                                                  "--training.frozen_dtype=bfloat16", "--checkpoint.last_save_in_hf=true",
                                                  "--checkpoint.last_save_model_only=true"]),
    # LoRA with the tied embedding trained in full beside the adapters (PEFT's modules_to_save)
    "tied_lora_mts": ("model_tied256", "251", VP_LORA + ["--checkpoint.initial_load_path={model}",
                                                         "--checkpoint.initial_load_in_hf"]),
}
TP2 = ["--parallelism.tensor_parallel_degree=2"]
VP_LAYOUTS = {  # name: (ranks, data-parallel degree, args)
    "tp2": (2, 1, TP2),
    "tp2_fsdp2": (4, 2, TP2 + ["--parallelism.data_parallel_shard_degree=2"]),
    # stage 0 holds the embedding's slice, stage 1 the tied copy's (one gradient, counted once in the norm)
    "pp2_tp2": (4, 1, TP2 + ["--parallelism.pipeline_parallel_degree=2",
                             "--parallelism.pipeline_parallel_microbatch_size=1"]),
}
VP_RUNS = [("tied", "tp2"), ("tied", "tp2_fsdp2"), ("tied", "pp2_tp2"), ("gemma3", "tp2"), ("gemma3", "tp2_fsdp2"),
           ("tied_frozen_bf16", "tp2"), ("tied_frozen_bf16", "tp2_fsdp2"), ("tied_lora_mts", "tp2")]


def case_args(d, case):
    model, _, a = VP_CASES[case]
    return [x.replace("{model}", str(d / model)) for x in a]


def tp_local_params(model_dir, t):
    """A Qwen3 rank's parameters under TP t from transformers' own tensors: every matrix
    (embedding and lm_head by rows, q/k/v/gate/up by rows, o/down by columns) 1/t, every
    vector (the norms) whole."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() // t if p.ndim == 2 else p.numel() for p in m.parameters())


@pytest.mark.parametrize("case,layout", VP_RUNS, ids=[f"{c}-{l}" for c, l in VP_RUNS])
def test_vocab_parallel_embedding_matches_one_rank(vp_setup, case, layout):
    d, data, data160, single = vp_setup
    ref = single(case)
    model, tokens, _ = VP_CASES[case]
    n, dp, a = VP_LAYOUTS[layout]
    out = d / f"vp_{case}_{layout}"
    data_ = data160 if tokens == "160" else data
    p = run(n, train_args(d / model, data_, out, *case_args(d, case), *a, dp=dp), timeout=240)
    what = f"{case} under {layout}"
    assert_same_run(out, ref, what, weights_too=case != "tied_frozen_bf16")
    got, want = grad_norms(out), grad_norms(ref)
    assert set(got) == set(want) == set(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{what}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"
    if case == "tied_lora_mts":  # the trained embedding copy in the adapter file
        from safetensors.numpy import load_file
        ka = load_file(str(out / "checkpoint" / f"step-{STEPS}" / "adapter_model.safetensors"))
        kb = load_file(str(ref / "checkpoint" / f"step-{STEPS}" / "adapter_model.safetensors"))
        assert ka.keys() == kb.keys() and any("embed_tokens" in k for k in kb), sorted(kb)
        for k in kb:
            err = np.linalg.norm(ka[k] - kb[k]) / max(np.linalg.norm(kb[k]), 1e-30)
            assert err <= 1e-5, f"{what}: adapter {k} differs from one process's by {err:.3g} norm-wise"
    if case == "tied_frozen_bf16":  # the HF export; the frozen embedding the same bits as one process's
        a = oracle.read_hf_tensors(out / "checkpoint" / f"step-{STEPS}")
        b = oracle.read_hf_tensors(ref / "checkpoint" / f"step-{STEPS}")
        assert a.keys() == b.keys() and "model.embed_tokens.weight" in b, sorted(b)
        assert np.array_equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"]), what
        for k in b:
            err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
            assert err <= 1e-5, f"{what}: {k} differs from one process's by {err:.3g} norm-wise"
    if layout == "tp2" and case == "tied":  # rank 0 holds 1/2 of the embedding (and of every matrix)
        m = re.search(r"ctitan: model \S+: (\d+) parameters on rank 0 of 2", p.stderr)
        assert m, p.stderr[-2000:]
        assert int(m.group(1)) == tp_local_params(d / model, 2), p.stderr[-2000:]


def test_vocab_parallel_checkpoint_moves_both_ways(vp_setup):
    """A tied model's sliced embedding is gathered into whole rows for the checkpoint and cut
    again on load: TP 2 x FSDP 2 -> one process and one process -> TP 2, stopped at step 4,
    continue the uninterrupted one-process run (steps, final weights, AdamW moments)."""
    d, data, _, single = vp_setup
    ref_dir = d / "vp_one_tied_full"
    run(1, train_args(d / "model_tied256", data, ref_dir, "--checkpoint.last_save_model_only=false"))
    stop = ["--training.stop_at_step=4", "--checkpoint.last_save_model_only=false"]
    layouts = {"tp2_fsdp2": (4, 2, TP2 + ["--parallelism.data_parallel_shard_degree=2"]),
               "tp2": (2, 1, TP2), "one": (1, 1, [])}
    for first, then in (("tp2_fsdp2", "one"), ("one", "tp2")):
        (n1, dp1, a1), (n2, dp2, a2) = layouts[first], layouts[then]
        out = d / f"vp_move_{first}_to_{then}"
        p = run(n1, train_args(d / "model_tied256", data, out, *stop, *a1, dp=dp1), check=False)
        assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
        p = run(n2, train_args(d / "model_tied256", data, out, "--checkpoint.last_save_model_only=false", *a2, dp=dp2))
        assert "resuming from" in p.stderr, p.stderr[-2000:]
        assert_same_run(out, ref_dir, f"{first} -> {then}", steps=range(5, STEPS + 1))
        a, b = weights(out, file="optim.safetensors"), weights(ref_dir, file="optim.safetensors")
        assert a.keys() == b.keys()
        for k in b:  # as test_tp_checkpoint_moves_between_layouts
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)
            assert err <= 1e-4, f"{first} -> {then}: {k} differs by {err:.3g}"
