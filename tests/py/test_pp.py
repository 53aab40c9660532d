"""Pipeline parallelism (parallelism.pipeline_parallel_*): ctitan under mpirun on this
2-core machine, oversubscribed, in test_dist.py's way and with its helpers.

Every pipeline layout must train like one process with the same recipe and global batch
(8 sequences a step, 2 per micro-batch on one process: gradient accumulation 4): the same
loss for 10 steps to 1e-5 relative, the same validation losses at steps 5 and 10, and the
same final weights norm-wise per tensor to 1e-5 (test_dist.assert_same_weights says why not
element-wise). The one-process run is checked against PyTorch by test_train_loop.py, so
agreeing with it ties every pipeline layout to PyTorch.

Covered: 1F1B, GPipe and Interleaved1F1B (2 stages a rank) over 2 and 4 ranks, split by
cost and at explicit split points, with data-parallel replicas (PP 2 x DP 2), micro-batches
of 1 and 2 sequences, tied and untied embeddings, the gradient norm; a Qwen3-MoE model (its
aux_loss metric too, and the load-balancing bias), and with HF's load-balancing loss in the
gradient under every schedule, PP x DP, FSDP, TP and FSDP x EP; checkpoints moving between pipeline, FSDP
and one-process layouts, and a resume under the same pipeline bit for bit; activation
checkpointing, bf16 and LoRA (dropout 0 and 0.1) under PP 2; each stage holding its layers
only (memory); the config errors (exit 2, naming the key); the dry run with the pipeline
keys; PP x FSDP and PP x TP against one process.

The bugs this file found when it was written (split-point errors swallowed, the dry run
without mpirun ignoring the pipeline degree, the MoE load metrics listing rank 0's layers
only, LoRA's training-format checkpoint under PP, the start-up parallelism line without
the pipeline degree) are fixed; their tests are plain tests now.

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import json
import os
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest

import oracle
from conftest import BIN
from test_dist import ENV, STEPS, assert_same_run, losses, mpirun, run, train_args, val_losses, weights

PP = "--parallelism.pipeline_parallel_degree"
SCHED = "--parallelism.pipeline_parallel_schedule"
MB = "--parallelism.pipeline_parallel_microbatch_size"
SPLIT = "--parallelism.pipeline_parallel_split_points"
LAYERS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """4-layer tiny models (PP 4 needs 4 layers, Interleaved1F1B over 2 ranks 4 stages):
    Qwen3 untied and tied, sizes no degree divides (hidden 30, intermediate 49, vocab 251);
    a Qwen3-MoE (layer 0 dense, layers 1-3 sparse), without and with the aux loss in the
    gradient (output_router_logits), and the latter TP-able; a TP-able Qwen3 (intermediate
    48, vocab 256) for PP x TP; a 3-layer one for too many stages."""
    d = tmp_path_factory.mktemp("pp")
    for tied in (False, True):
        oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=LAYERS, heads=4, kv_heads=2, head_dim=8,
                           tied=tied).save_pretrained(d / ("model_tied" if tied else "model"))
    oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=LAYERS, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(d / "model_tp")
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=3, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(d / "model_l3")
    from transformers import Qwen3MoeConfig
    for name, aux in (("model_moe", False), ("model_moe_aux", True), ("model_moe_aux_tp", True)):
        tp = name.endswith("_tp")  # sizes tensor parallel 2 divides
        Qwen3MoeConfig(vocab_size=256 if tp else 251, hidden_size=32 if tp else 30, intermediate_size=48 if tp else 49,
                       moe_intermediate_size=20, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=aux,
                       router_aux_loss_coef=0.01).save_pretrained(d / name)
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    return d, data


@pytest.fixture(scope="module")
def single(setup):
    """One-process runs of each model and recipe, made on first use: {key: out}."""
    d, data = setup
    cache = {}

    def get(model="model", *extra):
        key = (model, *extra)
        if key not in cache:
            out = d / ("single_" + "_".join(re.sub(r"[^A-Za-z0-9]+", "", str(k)) for k in key))
            run(1, train_args(d / model, data, out, *extra))
            cache[key] = out
        return cache[key]
    return get


def pp_run(setup, name, n, *extra, model="model", dp=1, check=True):
    d, data = setup
    out = d / name
    p = run(n, train_args(d / model, data, out, *extra, dp=dp), check=check)
    return out, p


# --------------------------------------------------------------------------- 1. layouts

LAYOUTS = {  # name: (ranks, data-parallel degree, pipeline args)
    "pp2_1f1b": (2, 1, [f"{PP}=2", f"{SCHED}=1F1B"]),
    "pp2_gpipe": (2, 1, [f"{PP}=2", f"{SCHED}=GPipe"]),
    "pp4_1f1b": (4, 1, [f"{PP}=4", f"{SCHED}=1F1B"]),
    "pp4_gpipe": (4, 1, [f"{PP}=4", f"{SCHED}=GPipe"]),
    "pp2_interleaved": (2, 1, [f"{PP}=2", f"{SCHED}=Interleaved1F1B"]),
    # uneven on purpose: stage 0 one layer (and the embedding), stage 1 three and the head
    "pp2_split": (2, 1, [f"{PP}=2", f"{SPLIT}=layers.1"]),
    "pp2_interleaved_split": (2, 1, [f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{SPLIT}=layers.1,layers.2,3"]),
    "pp2_dp2": (4, 2, [f"{PP}=2", "--parallelism.data_parallel_replicate_degree=2"]),
    # torchtitan's even split (test_pp_layers_per_stage.py checks where it puts the layers):
    # the head counted as 3 layers of 4 + 1 + 3, so stage 0 takes layers 0-2, stage 1 layer 3
    "pp2_last_less": (2, 1, [f"{PP}=2", "--parallelism.pipeline_parallel_last_stage_less_layers=3"]),
}


# every layout with micro-batches of 1 and of 2 and both embeddings, all four pairs for PP 2
# 1F1B, two for the others (the suite's time)
CASES = [(name, mb, tied) for name in LAYOUTS for mb in (1, 2) for tied in (False, True)
         if name == "pp2_1f1b" or (mb == 2) == (tied == (list(LAYOUTS).index(name) % 2 == 0))]


@pytest.mark.parametrize("name,mb,tied", CASES,
                         ids=[f"{n}-mb{mb}-{'tied' if t else 'untied'}" for n, mb, t in CASES])
def test_pipeline_matches_one_process(setup, single, name, mb, tied):
    """8 or 4 micro-batches a step (PP 2 x DP 2: 4 or 2 per replica) through the stages; the
    losses, validation losses and the final checkpoint's weights equal one process's."""
    n, dp, args = LAYOUTS[name]
    model = "model_tied" if tied else "model"
    out, p = pp_run(setup, f"{name}_mb{mb}_{'tied' if tied else 'untied'}", n, *args, f"{MB}={mb}", model=model,
                    dp=dp)
    # only rank 0 prints the metrics lines
    assert len([l for l in p.stdout.splitlines() if l.startswith("step: 1 ")]) == 1, p.stdout
    rows = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert rows and all(r["world"] == n for r in rows), rows[:1]
    what = f"{name} mb {mb} {'tied' if tied else 'untied'}"
    assert_same_run(out, single(model), what)
    # the gradient norm (clipping's) sums every stage's part, a tied embedding's once
    want = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(single(model) / "metrics.jsonl") if "loss" in r}
    for r in rows:
        assert abs(r["grad_norm"] - want[r["step"]]) <= 1e-5 * want[r["step"]], \
            f"{what}: step {r['step']} grad_norm {r['grad_norm']!r} vs one process {want[r['step']]!r}"
    if tied:
        assert not any("lm_head" in k for k in weights(out)), "a tied model's checkpoint holds an lm_head"


def test_startup_line_names_the_pipeline(setup):
    """The parallelism line of the start-up log multiplies to the world size: under PP 2 x
    DP 2 it must name the pipeline degree."""
    _, p = pp_run(setup, "pp2_dp2_log", 4, f"{PP}=2", "--parallelism.data_parallel_replicate_degree=2",
                  "--training.steps=1", dp=2)
    line = [l for l in p.stderr.splitlines() if l.startswith("ctitan: parallelism: world 4")]
    assert len(line) == 1, p.stderr[-2000:]
    assert re.search(r"pipeline\w* 2\b", line[0]), line[0]


def test_whole_validation_set_with_a_partial_batch(setup):
    """validation.steps = -1 (the whole set, 60 windows) in batches of 7 under PP 2 with
    micro-batches of 1: the last stage scores the same windows as one process (its whole
    batches), with the same loss."""
    d, data = setup
    val = oracle.write_bin(d / "val.bin", oracle.learnable_stream(60 * 17, 251, seed=9))
    v = [f"--validation.dataset_path={val}", "--validation.steps=-1", "--validation.local_batch_size=7",
         "--training.steps=5"]
    ref, out = d / "val_single", d / "val_pp2"
    r = run(1, train_args(d / "model", data, ref, *v))
    p = run(2, train_args(d / "model", data, out, f"{PP}=2", f"{MB}=1", *v))
    want = [l for l in r.stdout.splitlines() if l.startswith("validate step: 5")]
    got = [l for l in p.stdout.splitlines() if l.startswith("validate step: 5")]
    assert len(want) == 1 and len(got) == 1, (want, got)
    counts = re.search(r"\((\d+ batches, \d+ targets)", want[0]).group(1)
    assert counts.startswith("8 batches"), want[0]  # the whole batches (the ctitan rule; 60 = 8 x 7 + 4)
    assert f"({counts}" in got[0], f"PP 2: {got[0]}; one process: {want[0]}"
    a, b = val_losses(out)[5], val_losses(ref)[5]
    assert abs(a - b) <= 1e-5 * abs(b), f"val_loss {a!r} vs one process {b!r}"


def test_stages_hold_their_layers_only(tmp_path):
    """The point of PP: each rank builds and trains only its stage's layers, so with the
    model state dominant (8 layers of 0.85 M parameters, 16 bytes each with AdamW: 0.10 GiB;
    embedding and head 0.5 M each) the largest of 4 ranks (2 layers and the head, or the
    embedding) peaks well under half of one process. memory_gib is the largest rank's."""
    cfg = oracle.tiny_config(vocab=2048, hidden=256, inter=768, layers=8, heads=4, kv_heads=2, head_dim=64)
    cfg.save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(4000, 2048, seed=1))
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'model'}",
            f"--training.dataset_path={data}", "--training.seq_len=16", "--training.local_batch_size=2",
            "--training.steps=1", "--metrics.peak_tflops=1", f"{MB}=1"]
    peak = {}
    for n in (1, 4):
        run(n, args + [f"--job.dump_folder={tmp_path / str(n)}", f"{PP}={n}"])
        peak[n] = oracle.read_metrics(tmp_path / str(n) / "metrics.jsonl")[0]["memory_gib"]
    assert peak[4] < 0.55 * peak[1], f"PP 4: {peak[4]:.3f} GiB on the largest rank vs {peak[1]:.3f} GiB alone"


# --------------------------------------------------------------------------- 2. MoE

BIAS = "--model.load_balance_coeff=1e-3"


@pytest.mark.parametrize("n,mb,extra", [
    (2, 2, []),
    (2, 1, []),
    (4, 2, [BIAS]),
    (2, 1, [f"{SCHED}=Interleaved1F1B", BIAS]),
], ids=["pp2_mb2", "pp2_mb1", "pp4_mb2_bias", "pp2_interleaved_mb1_bias"])
def test_moe_pipeline_matches_one_process(setup, single, n, mb, extra):
    """Qwen3-MoE under PP (layer 0 dense, 1-3 routed; under PP 4 stage 0 holds no routed
    layer). The aux_loss metric is the mean over micro-batches of HF's load-balancing loss of
    each micro-batch's tokens, so it equals one process's only with the same micro-batches:
    with micro-batches of 1 it is compared with a one-process run of local_batch_size 1 (the
    same training otherwise). load_balance_coeff: torchtitan's bias update from the step's
    expert counts, of every stage's layers."""
    train_extra = [a for a in extra if a == BIAS]
    ref = single("model_moe", *train_extra)
    out, _ = pp_run(setup, f"moe_pp{n}_mb{mb}_{len(extra)}", n, f"{PP}={n}", f"{MB}={mb}", *extra,
                    model="model_moe")
    assert any(".mlp.experts." in k for k in weights(out)), "the MoE model has no expert tensors"
    assert_same_run(out, ref, f"MoE PP {n} mb {mb} {extra}")
    aux_ref = ref if mb == 2 else single("model_moe", *train_extra, "--training.local_batch_size=1")
    got = {r["step"]: r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want = {r["step"]: r for r in oracle.read_metrics(aux_ref / "metrics.jsonl") if "loss" in r}
    assert sorted(want) == list(range(1, STEPS + 1))
    for s in want:
        assert "aux_loss" in got[s], f"step {s}: no aux_loss in the PP run's metrics: {got[s]}"
        assert abs(got[s]["aux_loss"] - want[s]["aux_loss"]) <= 1e-5 * abs(want[s]["aux_loss"]), \
            f"step {s}: aux_loss {got[s]['aux_loss']!r} vs one process's with the same micro-batches " \
            f"{want[s]['aux_loss']!r}"


# HF's load-balancing loss in the gradient (output_router_logits): its unit is the pipeline
# micro-batch, so each layout is compared with one process whose local_batch_size is it
AUX_LAYOUTS = {  # name: (ranks, data-parallel degree, micro-batch, pipeline args)
    "pp2_1f1b_mb1": (2, 1, 1, [f"{PP}=2", f"{SCHED}=1F1B"]),
    "pp4_gpipe_mb2": (4, 1, 2, [f"{PP}=4", f"{SCHED}=GPipe"]),
    "pp2_interleaved_mb1": (2, 1, 1, [f"{PP}=2", f"{SCHED}=Interleaved1F1B"]),
    # micro-batches of 1: which replica a sequence lands on cannot change its own aux loss
    "pp2_dp2_mb1": (4, 2, 1, [f"{PP}=2", "--parallelism.data_parallel_replicate_degree=2"]),
    "pp2_fsdp2_mb1": (4, 2, 1, [f"{PP}=2", "--parallelism.data_parallel_shard_degree=2"]),
    "pp2_tp2_mb1": (4, 1, 1, [f"{PP}=2", "--parallelism.tensor_parallel_degree=2",
                              "--parallelism.data_parallel_shard_degree=1"]),
    "pp2_fsdp2_ep2_mb1": (4, 2, 1, [f"{PP}=2", "--parallelism.data_parallel_shard_degree=2",
                                    "--parallelism.expert_parallel_degree=2"]),
}


def aux_single(single, model, mb):
    return single(model) if mb == 2 else single(model, f"--training.local_batch_size={mb}")


@pytest.mark.parametrize("name", list(AUX_LAYOUTS))
def test_moe_aux_loss_in_the_gradient_under_pp(setup, single, name):
    """Qwen3-MoE with output_router_logits (router_aux_loss_coef 0.01): every stage's
    routers get the load-balancing gradient of the micro-batch's expert counts over ALL the
    model's MoE layers (the counts travel with the activations and back with the
    gradients). The losses, validation losses, gradient norms, aux_loss and final weights
    equal one process's with local_batch_size = the pipeline micro-batch and the same global
    batch (test_moe.py ties that run's aux gradient to transformers)."""
    n, dp, mb, args = AUX_LAYOUTS[name]
    model = "model_moe_aux_tp" if "tp2" in name else "model_moe_aux"
    ref = aux_single(single, model, mb)
    out, _ = pp_run(setup, f"moe_aux_{name}", n, *args, f"{MB}={mb}", model=model, dp=dp)
    what = f"MoE aux loss {name}"
    assert_same_run(out, ref, what)
    got = {r["step"]: r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want = {r["step"]: r for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), sorted(got)
    for s in want:
        for k in ("grad_norm", "aux_loss"):
            assert abs(got[s][k] - want[s][k]) <= 1e-5 * abs(want[s][k]), \
                f"{what}: step {s} {k} {got[s][k]!r} vs one process {want[s][k]!r}"


@pytest.mark.parametrize("mb", [1, 2])
def test_moe_aux_loss_changes_the_training(setup, single, mb):
    """What makes the test above bite: model_moe and model_moe_aux differ only in
    output_router_logits, and start from the same weights (the same step-1 loss, which is
    the cross-entropy alone), yet their one-process runs end with final weights far apart
    (the routers most): a pipeline that dropped the aux gradient anywhere would fail there."""
    d, _ = setup
    import json
    a, b = (json.loads((d / m / "config.json").read_text()) for m in ("model_moe", "model_moe_aux"))
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"output_router_logits"}, (a, b)
    off, on = aux_single(single, "model_moe", mb), aux_single(single, "model_moe_aux", mb)
    assert losses(off)[1] == losses(on)[1], f"not the same initial weights: {losses(off)[1]} vs {losses(on)[1]}"
    wa, wb = weights(off), weights(on)
    router = max(np.linalg.norm(wa[k] - wb[k]) / np.linalg.norm(wb[k]) for k in wb if k.endswith("mlp.gate.weight"))
    assert router > 1e-3, f"the aux loss moved the routers by {router:.3g} only (norm-wise), too close to 1e-5"


def test_moe_bias_saved_twice_under_pp(setup, single):
    """torchtitan's load-balancing bias (load_balance_coeff) saved at steps 5 and 10 under
    PP 2: each save gathers the stages' bias rows (plan_gather_bias) into state.json, and both
    equal one process's. The mutation audit found a gather that kept the previous save's rows
    of the other stage's layers (only the second save was wrong, and no test read the bias)."""
    ref = single("model_moe", BIAS, "--checkpoint.interval=5")
    out, _ = pp_run(setup, "moe_bias_twice", 2, f"{PP}=2", f"{MB}=2", BIAS, "--checkpoint.interval=5",
                    model="model_moe")
    assert_same_run(out, ref, "MoE PP 2, bias, saved at steps 5 and 10")
    for step in (5, 10):
        a, b = (np.array(json.loads((o / "checkpoint" / f"step-{step}" / "state.json").read_text())["moe_expert_bias"])
                for o in (out, ref))
        assert np.abs(b).max() > 0, b
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), f"step {step}: bias {a} vs one process {b}"


def test_moe_load_lists_every_layer(setup, single):
    """metrics.jsonl's moe_load_min / moe_load_max: one entry per MoE layer (3 here), as one
    process writes them, whichever stage holds the layer."""
    ref = single("model_moe")
    out, _ = pp_run(setup, "moe_pp2_load", 2, f"{PP}=2", f"{MB}=2", f"{SPLIT}=layers.2", model="model_moe")
    got = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r]
    want = [r for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r]
    assert len(want[0]["moe_load_min"]) == LAYERS - 1, want[0]
    assert len(got[0]["moe_load_min"]) == len(want[0]["moe_load_min"]), \
        f"moe_load_min {got[0]['moe_load_min']} vs one process {want[0]['moe_load_min']}"
    assert len(got[0]["moe_load_max"]) == len(want[0]["moe_load_max"])


# --------------------------------------------------------------------------- 3. checkpoints across layouts

def test_checkpoint_moves_between_pipeline_and_other_layouts(setup, single):
    """A full checkpoint (model and AdamW moments) written at step 4 by PP 4 and resumed on
    FSDP 2 and on one process, and one written by one process resumed under PP 2: steps 5-10
    equal the uninterrupted one-process run's, as do the final weights and AdamW moments.
    Also PP 4 -> PP 2 Interleaved1F1B (other stages), and PP 4's step-4 checkpoint itself
    equals one process's."""
    d, data = setup
    full = "--checkpoint.last_save_model_only=false"
    stop = ["--training.stop_at_step=4", full]
    ref = single("model", full)
    first = {4: [f"{PP}=4"], 1: []}
    then = {"fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"], 2), "single": (1, [], 1),
            "pp2": (2, [f"{PP}=2", f"{MB}=1"], 1),
            "pp2_interleaved": (2, [f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=1"], 1)}
    cases = [(4, "fsdp2"), (4, "single"), (1, "pp2"), (4, "pp2_interleaved")]
    written = {}
    for src in sorted({c[0] for c in cases}):
        out = d / f"move_from_{src}"
        p = run(src, train_args(d / "model", data, out, *first[src], *stop), check=False)
        assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
        assert (out / "checkpoint" / "step-4" / "optim.safetensors").exists()
        written[src] = out
    # what PP 4 saved at step 4 is what one process saved there
    for f, tol in (("model.safetensors", 1e-5), ("optim.safetensors", 1e-4)):
        a, b = weights(written[4], step=4, file=f), weights(written[1], step=4, file=f)
        assert a.keys() == b.keys(), f"PP 4's step-4 {f} holds other tensors than one process's"
        for k in b:
            err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
            assert err <= tol, f"PP 4's step-4 {f}: {k} differs from one process's by {err:.3g} norm-wise"
    for src, dst in cases:
        out = d / f"move_{src}_to_{dst}"
        shutil.copytree(written[src], out)
        n, args, dp = then[dst]
        p = run(n, train_args(d / "model", data, out, *args, full, dp=dp))
        assert "resuming from" in p.stderr and "step-4" in p.stderr, p.stderr[-3000:]
        what = f"{'PP 4' if src == 4 else '1 process'} -> {dst}"
        assert_same_run(out, ref, what, steps=range(5, STEPS + 1))
        a, b = weights(out, file="optim.safetensors"), weights(ref, file="optim.safetensors")
        assert a.keys() == b.keys(), f"{what}: AdamW moment names differ"
        for k in b:
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)
            assert err <= 1e-4, f"{what}: {k} differs by {err:.3g}"


def test_resume_under_the_same_pipeline_is_bit_identical(setup):
    """PP 2 Interleaved1F1B (2 stages a rank), tied embeddings, micro-batches of 1: stopped at
    step 4 and resumed to 10, every loss, the final weights and the AdamW moments equal the
    uninterrupted PP run's bit for bit."""
    d, data = setup
    args = [f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=1", "--checkpoint.last_save_model_only=false"]
    ref, out = d / "pp2_straight", d / "pp2_resumed"
    run(2, train_args(d / "model_tied", data, ref, *args))
    p = run(2, train_args(d / "model_tied", data, out, *args, "--training.stop_at_step=4"), check=False)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    run(2, train_args(d / "model_tied", data, out, *args))
    want, got = losses(ref), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    assert got == want, f"losses differ: {[(s, got[s], want[s]) for s in want if got[s] != want[s]]}"
    for f in ("model.safetensors", "optim.safetensors"):
        a, b = weights(out, file=f), weights(ref, file=f)
        assert a.keys() == b.keys()
        bad = [k for k in b if not np.array_equal(a[k], b[k])]
        assert not bad, f"{f}: the resumed run's {bad[:4]} differ from the uninterrupted run's"


# --------------------------------------------------------------------------- 4. activation checkpointing, bf16

@pytest.mark.parametrize("extra", [
    ["--activation_checkpoint.mode=full"],
    ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"],
], ids=["ac_full", "ac_selective_op"])
def test_activation_checkpointing_under_pp(setup, single, extra):
    out, _ = pp_run(setup, f"pp2_{extra[0].split('=')[1]}", 2, f"{PP}=2", f"{MB}=1", *extra)
    assert_same_run(out, single("model"), f"PP 2 {extra}")


@pytest.mark.parametrize("sched", ["1F1B", "Interleaved1F1B"])
def test_bf16_under_pp(setup, single, sched):
    """bf16 mixed precision: the same micro-batches (2 sequences) as the one-process bf16
    run, so the same bf16 roundings; compared with it to 1e-5."""
    bf16 = "--training.mixed_precision_param=bfloat16"
    out, p = pp_run(setup, f"pp2_bf16_{sched}", 2, f"{PP}=2", f"{SCHED}={sched}", f"{MB}=2", bf16)
    assert "precision: bfloat16" in p.stderr, p.stderr[-2000:]
    assert_same_run(out, single("model", bf16), f"PP 2 {sched} bf16")


# --------------------------------------------------------------------------- 5. LoRA

def lora_model(setup):
    d, _ = setup
    model = d / "model_hf"
    if not model.exists():
        oracle.save_random_hf(model, oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=LAYERS, heads=4,
                                                        kv_heads=2, head_dim=8), seed=21)
    return model


def lora_args(model, dropout):
    return ["--lora.rank=4", "--lora.alpha=8", f"--lora.dropout={dropout}", f"--checkpoint.initial_load_path={model}",
            "--checkpoint.initial_load_in_hf", "--optimizer.lr=1e-2"]


def assert_same_tensors(out, ref, what, file, names=None):
    a, b = weights(out, file=file), weights(ref, file=file)
    assert a.keys() == b.keys(), f"{what}: {file} tensors differ: {sorted(a.keys() ^ b.keys())[:6]}"
    assert len(b) == (names if names is not None else len(b)), sorted(b)[:8]
    for k in b:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= 1e-5, f"{what}: final {k} differs from one process by {err:.3g} norm-wise"
    return a


@pytest.mark.parametrize("dropout,mb", [(0, 1), (0.1, 2)], ids=["dropout0_mb1", "dropout0.1_mb2"])
def test_lora_under_pp(setup, dropout, mb):
    """LoRA (rank 4) on HF weights under PP 2 against one process: the same losses and
    validation losses, and the final PEFT adapter (last_save_in_hf) equal to 1e-5 norm-wise
    per tensor. Dropout 0.1 with the one process's micro-batches (2 sequences): each
    micro-batch draws the same masks whichever stage holds the layer."""
    d, data = setup
    model = lora_model(setup)
    lora = lora_args(model, dropout) + ["--checkpoint.last_save_in_hf"]
    ref, out = d / f"lora_single_{dropout}", d / f"lora_pp2_{dropout}"
    run(1, train_args(model, data, ref, *lora))
    run(2, train_args(model, data, out, *lora, f"{PP}=2", f"{MB}={mb}"))
    assert_same_run(out, ref, f"LoRA PP 2 dropout {dropout}", weights_too=False)
    final = out / "checkpoint" / f"step-{STEPS}"
    assert sorted(q.name for q in final.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"], \
        sorted(q.name for q in final.iterdir())
    # lora_A and lora_B of 7 projections per layer
    a = assert_same_tensors(out, ref, "LoRA PP 2", "adapter_model.safetensors", 2 * 7 * LAYERS)
    assert any(np.any(v) for k, v in a.items() if ".lora_B." in k), "lora_B all zero: nothing trained"


def test_lora_training_checkpoint_under_pp(setup):
    """The same with the training checkpoint (last_save_in_hf false, model and AdamW
    moments): its adapters and moments equal one process's."""
    d, data = setup
    model = lora_model(setup)
    lora = lora_args(model, 0) + ["--checkpoint.last_save_model_only=false"]
    ref, out = d / "lora_single_ckpt", d / "lora_pp2_ckpt"
    run(1, train_args(model, data, ref, *lora))
    run(2, train_args(model, data, out, *lora, f"{PP}=2", f"{MB}=1"))
    assert_same_run(out, ref, "LoRA PP 2", weights_too=False)
    for f in ("model.safetensors", "adapter_model.safetensors"):
        assert_same_tensors(out, ref, "LoRA PP 2", f)
    a, b = weights(out, file="optim.safetensors"), weights(ref, file="optim.safetensors")
    assert a.keys() == b.keys() and b, f"AdamW moments differ: {sorted(a.keys() ^ b.keys())[:6]}"
    for k in b:  # test_dist's bound for the moments
        err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)
        assert err <= 1e-4, f"LoRA PP 2: {k} differs by {err:.3g}"


# --------------------------------------------------------------------------- 6. errors

def assert_config_error(p, *words):
    assert p.returncode == 2, f"exit {p.returncode}, want 2 (config error)\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once (rank 0):\n{p.stderr[-3000:]}"
    missing = [w for w in words if w not in err[0]]
    assert not missing, f"the error does not name {missing}: {err[0]}"
    return err[0]


def run_bounded(n, args, timeout):
    """run(n, args) that may hang: on timeout mpirun gets SIGTERM (which ends its ranks), then
    its process group SIGKILL, and the test fails saying so."""
    cmd = ([str(BIN)] if n == 1 else mpirun() + ["-np", str(n), str(BIN)]) + [str(a) for a in args]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        pytest.fail(f"no exit within {timeout} s (hung) where a config error was expected: {' '.join(cmd)}\n"
                    f"{out[-1500:]}\n{err[-1500:]}", pytrace=False)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.mark.parametrize("ranks,model,args,words", [
    (2, "model", [f"{PP}=2", f"{MB}=3"], ["pipeline_parallel_microbatch_size", "local_batch_size"]),
    (2, "model", [f"{PP}=2", f"{MB}=2", "--validation.local_batch_size=3"],
     ["pipeline_parallel_microbatch_size", "validation"]),
    (3, "model", [f"{PP}=2"], ["pipeline_parallel_degree", "world size 3"]),
    (4, "model_l3", [f"{PP}=4"], ["pipeline_parallel_degree", "3 layers"]),
    (4, "model", [f"{PP}=4", f"{SCHED}=Interleaved1F1B"], ["pipeline_parallel_schedule", "Interleaved1F1B"]),
    pytest.param(2, "model", [f"{PP}=2", f"{SPLIT}=layers.3,layers.1"], ["pipeline_parallel_split_points", "layers.1"]),
    pytest.param(2, "model", [f"{PP}=2", f"{SPLIT}=layers.2,layers.2"], ["pipeline_parallel_split_points", "layers.2"]),
    # points out of range or not layers ("layers.4" of a 4-layer model, "mlp.2")
    pytest.param(4, "model", [f"{PP}=4", f"{SPLIT}=layers.1,layers.2,layers.4"],
                 ["pipeline_parallel_split_points", "layers.4"]),
    pytest.param(2, "model", [f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{SPLIT}=layers.1,mlp.2,layers.3"],
                 ["pipeline_parallel_split_points", "mlp.2"]),
    (2, "model", [f"{PP}=2", f"{SPLIT}=layers.1,layers.2"], ["pipeline_parallel_split_points", "1F1B"]),
    (2, "model", [f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{SPLIT}=layers.2"],
     ["pipeline_parallel_split_points", "Interleaved1F1B"]),
    # a step of 5 micro-batches (global batch 10, micro-batches of 2): torch's max(1, 5 // 2) = 2
    # rounds do not divide them
    (2, "model", [f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=2", "--training.global_batch_size=10"],
     ["Interleaved1F1B", "2 rounds", "has 5"]),
    (2, "model", [f"{PP}=2", f"{SCHED}=ZeroBubble"], ["pipeline_parallel_schedule", "ZeroBubble"]),
], ids=["mb_not_dividing_local", "mb_not_dividing_validation", "degree_not_dividing_world", "more_stages_than_layers",
        "interleaved_too_few_layers", "split_out_of_order", "split_repeated", "split_out_of_range",
        "split_not_a_layer", "split_too_many_stages", "interleaved_split_one_stage_a_rank",
        "interleaved_microbatches_not_multiple", "unknown_schedule"])
def test_pipeline_config_errors_exit_2(setup, tmp_path, ranks, model, args, words):
    d, data = setup
    p = run_bounded(ranks, train_args(d / model, data, tmp_path / "bad", *args), timeout=8)
    assert_config_error(p, *words)
    assert "step:" not in p.stdout, f"a config error must stop before training:\n{p.stdout[-2000:]}"


# --------------------------------------------------------------------------- PP x FSDP, PP x TP

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pp2_x_fsdp2(setup, single, tied):
    d, data = setup
    model = "model_tied" if tied else "model"
    out = d / f"pp2_fsdp2_{model}"
    run(4, train_args(d / model, data, out, f"{PP}=2", f"{MB}=1", "--parallelism.data_parallel_shard_degree=2", dp=2))
    assert_same_run(out, single(model), f"PP 2 x FSDP 2 {model}")


def test_pp2_x_tp2(setup, single):
    d, data = setup
    out = d / "pp2_tp2"
    run(4, train_args(d / "model_tp", data, out, f"{PP}=2", f"{MB}=1", "--parallelism.tensor_parallel_degree=2",
                      "--parallelism.data_parallel_shard_degree=1"))
    assert_same_run(out, single("model_tp"), "PP 2 x TP 2")


def test_pp2_x_tp2_x_fsdp2(setup, single):
    """3-D: 8 ranks, each pipeline stage's 4 ranks two FSDP groups of a TP pair; Interleaved
    so that every rank holds two stages."""
    d, data = setup
    out = d / "pp2_tp2_fsdp2"
    run(8, train_args(d / "model_tp", data, out, f"{PP}=2", f"{MB}=1", f"{SCHED}=Interleaved1F1B",
                      "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2", dp=2),
        timeout=240)
    assert_same_run(out, single("model_tp"), "PP 2 x TP 2 x FSDP 2")


# --------------------------------------------------------------------------- 7. dry run

@pytest.mark.parametrize("ranks,args", [
    (0, [f"{PP}=2", f"{MB}=1"]),
    (0, [f"{PP}=2", f"{MB}=1", "model_moe_aux"]),
    (0, [f"{PP}=2", f"{SPLIT}=layers.1", "--parallelism.data_parallel_replicate_degree=2",
         "--parallelism.data_parallel_shard_degree=1"]),
    (2, [f"{PP}=2", f"{MB}=1"]),
    (4, [f"{PP}=4", f"{SCHED}=GPipe", f"{MB}=2"]),
    (2, [f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=1"]),
    (4, [f"{PP}=2", f"{SPLIT}=layers.1", "--parallelism.data_parallel_replicate_degree=2"]),
], ids=["pp2", "pp2_moe_aux", "pp2_split_dp2", "mpirun_pp2", "mpirun_pp4_gpipe", "mpirun_pp2_interleaved", "mpirun_pp2_split_dp2"])
def test_dry_run_with_pipeline_keys(setup, tmp_path, ranks, args):
    """`ctitan train --dry-run` with the pipeline keys, without mpirun (the degrees fixed)
    and under mpirun -np 2, exits 0 and plans (a MoE model with the aux loss in the gradient
    too: a run no longer refuses it). (Per-stage figures are coming; only that it
    runs is checked here.)"""
    d, data = setup
    model = args[-1] if args[-1].startswith("model") else "model"
    args = [a for a in args if a != model]
    cmd = ([str(BIN)] if ranks == 0 else mpirun() + ["-np", str(ranks), str(BIN)]) + \
        [str(a) for a in train_args(d / model, data, tmp_path / "dry", *args, "--dry-run")]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    assert p.stdout.count("dry run: model") == 1, p.stdout[-2000:]
    assert not (tmp_path / "dry" / "metrics.jsonl").exists(), "the dry run trained"


# --------------------------------------------------------------------------- 8. the logged bubble

@pytest.mark.parametrize("P,sched", [(4, "GPipe"), (2, "1F1B")])
def test_logged_bubble_is_the_stages_mean(setup, tmp_path, P, sched):
    """The logged bubble (the console's `bubble`, metrics.jsonl's pp_bubble) is the mean over
    the pipeline ranks of the share of its step each spent waiting for an input; each rank
    prints its own share of the run at its end. A 1-step run: the logged figure is the mean
    of the printed ones (to their printed precision), a share between 0 and 1. The stages'
    sum, logged instead of their mean (the fourth mutation audit), trained the same numbers
    and logged P times the mean; timings on a shared machine vary too much for a bound alone
    to tell the two apart."""
    d, data = setup
    out = tmp_path / "out"
    cmd = mpirun() + ["-np", str(P), str(BIN)] + [str(a) for a in train_args(
        d / "model", data, out, f"{PP}={P}", f"{SCHED}={sched}", "--training.steps=1")]
    p = subprocess.run(cmd, env=dict(ENV, CTITAN_LOG_RANKS="all"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    share = {int(r): (float(w), float(s), float(x)) for r, w, s, x in re.findall(
        rf"ctitan: pipeline rank (\d) of {P} waited for its inputs ([0-9.]+) s of the ([0-9.]+) s its steps took "
        r"\(([0-9.]+)\)", p.stderr)}
    assert sorted(share) == list(range(P)), p.stderr[-3000:]
    for r, (w, s, x) in share.items():
        assert 0 <= w <= s and x == pytest.approx(w / s, abs=2e-6 / s + 1e-6), (r, w, s, x)
    rows = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1], rows
    mean = sum(x for _, _, x in share.values()) / P
    logged = rows[0]["pp_bubble"]
    assert logged == pytest.approx(mean, abs=6e-5), f"logged {logged}, the ranks' shares {share} (mean {mean:.6f})"
    shown = float(re.search(r"^step: 1 .*  bubble: ([0-9.]+)%", p.stdout, re.M).group(1))
    assert shown == pytest.approx(100 * logged, abs=0.051), (shown, logged)
    assert 0 < logged <= 1
