"""Every family under the parallel layouts, checkpoints and resume (issue 15, item 3).

For each family a tiny config (oracle_families' case, random init by ctitan from
training.seed) trains 10 steps on one process; the same run under FSDP, under TP and under expert parallelism for Mixtral must give the same loss curve and final
weights (test_dist's helpers and tolerances), and a run stopped at step 4 and resumed on
another layout must continue it. The one-process math is checked against transformers by
test_families.py."""
from __future__ import annotations

import numpy as np
import pytest

import oracle
import oracle_families as fam
from test_dist import STEPS, assert_same_run, run, train_args, weights

# case, layouts: name -> (ranks, extra args, data-parallel ranks)
FSDP2 = (2, ["--parallelism.data_parallel_shard_degree=2"], 2)
TP2 = (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2"], 1)
TP2_NOSP = (2, TP2[1] + ["--parallelism.sequence_parallel=false"], 1)
HSDP_AC = (4, ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2",
               "--activation_checkpoint.mode=full"], 4)
EP2 = (2, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.expert_parallel_degree=2"], 2)
CASES = {
    "llama_rope3_attnbias_hd16": {"fsdp2": FSDP2, "tp2": TP2},
    "llama_mlpbias_tied": {"tp2": TP2},
    "mistral_swa5": {"fsdp2": FSDP2},
    "qwen2_swa6_layers": {"tp2": TP2, "hsdp_ac": HSDP_AC},
    # TP: the q/k norms over the whole projection sum their row's squares (and the backward's
    # dot) over the ranks' heads
    "olmo2": {"fsdp2": FSDP2, "tp2": TP2},
    "phi3_longrope_short_swa7": {"fsdp2": FSDP2},
    # TP slices the fused qkv_proj / gate_up_proj block by block (q, k, v / gate, up rows of
    # each rank's heads and intermediate slice); partial RoPE on top
    "phi3_partial075_longrope": {"tp2": TP2},
    "gemma3_text": {"fsdp2": FSDP2, "tp2": TP2},
    # the attention soft-cap on each rank's heads under TP; alternating sliding layers
    "gemma2": {"tp2": TP2, "hsdp_ac": HSDP_AC},
    "gemma_gelu_attnbias": {"fsdp2": FSDP2, "tp2": TP2},
    "mixtral_e4k2": {"ep2": EP2, "tp2": TP2},
    # the shared expert and its gate: sharded by FSDP, held whole by every EP rank (their
    # gradients summed as the dense tensors'), column / row split under TP with the gate
    # replicated (its logit's gradient summed over the ranks' slices). The aux loss is not
    # linear in the batch (HF computes it over the rows a forward sees), so the case with it
    # on runs the layouts without data parallelism only: TP, with and without SP
    "qwen2_moe_mlponly_norm_nobias": {"fsdp2": FSDP2, "ep2": EP2, "tp2": TP2},
    "qwen2_moe_step2_aux": {"tp2": TP2, "tp2_nosp": TP2_NOSP},
    # residual_multiplier on each branch: added once after the TP sum, with sequence parallel
    # (this rank's rows) and without; scaled embeddings and logits under the vocabulary-parallel loss
    "granite": {"fsdp2": FSDP2, "tp2": TP2, "tp2_nosp": TP2_NOSP},
    # NoPE layers (their own sliding windows) under TP with sequence parallel
    "smollm3_nope_swa5": {"fsdp2": FSDP2, "tp2": TP2},
    # the whole-projection q/k norms under TP, per-type RoPE and windows
    "olmo3_swa5_yarn": {"fsdp2": FSDP2, "tp2": TP2},
    # olmoe: every layer sparse with whole-projection q/k norms (summed over the TP ranks' heads)
    "olmoe_norm_topk_tied": {"ep2": EP2, "tp2": TP2},
    # flex_olmo: the sparse branch's post-norm (post_feedforward_layernorm) on the branch summed
    # over the TP ranks' expert slices (this rank's rows under SP), over each EP rank's
    # returned rows, and on FSDP's shards; the aux case (not linear in the batch) under TP only
    "flex_olmo_norm_topk_tied": {"fsdp2": FSDP2, "ep2": EP2, "tp2": TP2},
    "flex_olmo_aux_hd16": {"tp2": TP2, "tp2_nosp": TP2_NOSP},
    # granitemoe: the files' fused experts split per expert (TP cuts each expert's gate and up
    # rows as qwen3_moe's); residual_multiplier on the sparse branch after the TP sum, with the
    # aux loss (not linear in the batch: TP only)
    "granitemoe_aux": {"tp2": TP2},
    # the ungated shared MLP: whole on every EP rank, split as the dense MLP under TP (its
    # input_linear's gate and up rows each cut by the ranks)
    "granitemoeshared_narrow_tied": {"ep2": EP2, "tp2": TP2},
    # glm: the interleaved partial RoPE on each rank's whole heads, q/k/v biases and the fused
    # gate_up_proj cut into each rank's gate and up rows; glm4's post-branch norms after the TP sum
    "glm_bias_partial05": {"fsdp2": FSDP2, "tp2": TP2},
    "glm4_partial075_tied": {"tp2": TP2},
    # ernie4_5: the interleaved whole-head RoPE on each rank's heads, the seven projections'
    # biases (column-split q/k/v/gate/up, o_proj's and down_proj's added once after the TP sum)
    "ernie4_5_bias_tied": {"fsdp2": FSDP2, "tp2": TP2},
    # ernie4_5_moe: the ungated shared experts (mlp.shared_experts) whole on every EP rank, split
    # as the dense MLP under TP; dense layers between sparse ones with the aux loss (TP only)
    "ernie4_5_moe_shared3_untied": {"fsdp2": FSDP2, "ep2": EP2, "tp2": TP2},
    "ernie4_5_moe_interval2_aux": {"tp2": TP2},
    # seed_oss: q/k/v biases split with their heads, o_proj's (attention_out_bias) and
    # down_proj's after the TP sum
    "seed_oss_outbias_mlpbias": {"tp2": TP2},
    # ministral: each layer's own window (layer_types) on each TP rank's heads
    "ministral_types_swa5": {"tp2": TP2},
    # exaone4: per-head q/k norms on each rank's heads, with and without RoPE; the post-norms
    # after the TP sum
    "exaone4_swa5_nope_tied": {"fsdp2": FSDP2, "tp2": TP2},
    # ministral3: q's position scale on each TP rank's heads
    "ministral3_yarn_qscale": {"tp2": TP2},
    # helium: the interleaved whole-head RoPE and q/k/v biases on each rank's heads, down_proj's
    # bias after the TP sum
    "helium_bias_interleaved": {"fsdp2": FSDP2, "tp2": TP2},
    # vaultgemma: both soft-caps and the alternating windows on each rank's heads, o_proj's bias
    # after the TP sum; its two norms a layer sharded by FSDP
    "vaultgemma_caps_bias": {"fsdp2": FSDP2, "tp2": TP2},
    # hunyuan_v1_dense: the per-head q/k norms after RoPE on each rank's whole heads
    "hunyuan_qknorm_after_rope_bias": {"fsdp2": FSDP2, "tp2": TP2},
    # glm4_moe: the sigmoid group-limited router on every rank (EP: whole, each rank routing its
    # tokens), the ungated shared experts whole on every EP rank and split under TP, the per-head
    # q/k norms with the partial RoPE on each rank's heads, a dense first layer (the biased
    # router's layouts: test_families_glm4_moe.py)
    "glm4_moe_groups_bias_qknorm": {"ep2": EP2, "fsdp2": FSDP2, "tp2": TP2},
    # dots1: the same router with o_proj biases (whole on every TP rank: rowwise), the per-head
    # q/k norms before whole-head RoPE and a sliding layer on a sparse layer
    "dots1_groups_bias_swa5": {"ep2": EP2, "fsdp2": FSDP2, "tp2": TP2},
}
# AdamW's eps per case where 1e-8 lets rounding noise decide the test (test_dist_debugmodel.py
# says why): llama_mlpbias_tied's mlp biases have gradients near zero, so a last-bit
# difference d moves a weight by up to lr * d / eps. Under TP 2 its tied head runs the
# vocabulary-parallel loss, summed in another order: gate_proj.bias ended 1.46e-5 off
# (norm-wise) where the first step's moments agree to 4.9e-7 and one process with another
# micro-batch split is already 6.5e-6 off.
#
# The Gemma cases under TP 2 with eps 1e-8 (measured): the first step's gradient norm equals one
# process's to 9e-9 (gemma2) and 0 (gemma), yet the final weights end up to 1.3e-4 (gemma2: every
# tensor, the zero-initialised (1 + w) norm weights most, the gap growing from 3e-7 at step 2 to
# 3e-5 at step 7 with or without the attention cap) and 2e-5 (gemma: one gate_proj element)
# apart; with eps 1e-5 (gemma2) and 1e-6 (gemma) the largest is 2.5e-6. olmo3_swa5_yarn (4 layers,
# yarn on the full layer) under TP 2 and CP 2 with eps 1e-8: step 1's gradient norm equal to 2e-8,
# then the gap grows step by step (TP 2: final embeddings 1.1e-4 apart; CP 2 ring: gradient norms
# 2e-5 apart by step 9 with eps 1e-6 and 1e-5); with eps 1e-4 the largest gradient-norm gap is
# 8.5e-6 (step 6).
# smollm3_nope_swa5 under CP 2 (ring, no load balancing) with eps 1e-8: the losses equal, one
# up_proj 1.02e-5 apart.
# smollm3_kinds (untied embeddings) under TP 2, with and without SP, eps 1e-6: step 1 losses equal
# and gradient norms 1e-8 apart, final embed_tokens 1.2e-5 apart; with eps 1e-4 within 1e-5.
# glm_bias_partial05 with eps 1e-8: losses and gradient norms equal, yet FSDP 2's final
# v_proj.weight 1.8e-5 and CP 2's (all-to-all) embed_tokens 1.5e-5 apart; with eps 1e-6 within 1e-5.
# ministral_types_swa5 with eps 1e-8: TP 2's final embed_tokens 1.2e-4 and CP 2's (all-to-all)
# 5.0e-5 apart; with eps 1e-6 within 1e-5.
# exaone4_swa5_nope_tied under TP 2 (losses equal every step) with eps 1e-8: layer 1's gate_proj
# 1.01e-5 apart; with eps 1e-6 layer 0's q_proj 1.2e-5 (the per-head q norm leaves q_proj no
# gradient along each head's scale, only rounding noise there); with eps 1e-4 within 1e-5.
# vaultgemma_caps_bias (Gemma 2's caps and zero-centred (1 + w) norms) under FSDP 2 with eps 1e-8:
# losses and gradient norms equal, final layer 0 q_proj.bias 1.18e-5 apart; with eps 1e-5 (as gemma2)
# within 1e-5.
# flex_olmo_norm_topk_tied under TP 2 with eps 1e-8: losses equal to 1e-6 every step, step 1's
# gradient norm to 6e-8, yet the final layer 2 q_proj 1.3e-4 apart (the post-norms on both
# branches and the whole-projection q/k norms leave directions with no gradient, only rounding
# noise, as exaone4's); eps 1e-6: 8.2e-6 (k_proj); eps 1e-4: 8.8e-7.
# glm4_moe_groups_bias_qknorm under TP 2 (losses and gradient norms equal every step) with eps 1e-8:
# layer 2's expert 5 down_proj (an expert few tokens reach) 2.0e-5 apart; with eps 1e-6 layer 0's
# q_proj.bias 3.3e-5 (the per-head q norm, as EXAONE 4's); with eps 1e-4 within 1e-5.
# dots1_groups_bias_swa5 under TP 2 (losses and validation equal every step) with eps 1e-8: layer 1's
# k_proj.weight 1.1e-5 apart (through the per-head k norm, as glm4_moe's); with eps 1e-6 within 1e-5.
EPS = {"llama_mlpbias_tied": ["--optimizer.eps=1e-6"], "gemma2": ["--optimizer.eps=1e-5"],
       "gemma_gelu_attnbias": ["--optimizer.eps=1e-6"], "olmo3_swa5_yarn": ["--optimizer.eps=1e-4"],
       "smollm3_nope_swa5": ["--optimizer.eps=1e-6"], "smollm3_kinds": ["--optimizer.eps=1e-4"],
       "glm_bias_partial05": ["--optimizer.eps=1e-6"], "ministral_types_swa5": ["--optimizer.eps=1e-6"],
       "exaone4_swa5_nope_tied": ["--optimizer.eps=1e-4"], "vaultgemma_caps_bias": ["--optimizer.eps=1e-5"],
       "flex_olmo_norm_topk_tied": ["--optimizer.eps=1e-4"], "flex_olmo_aux_hd16": ["--optimizer.eps=1e-4"],
       "glm4_moe_groups_bias_qknorm": ["--optimizer.eps=1e-4"], "dots1_groups_bias_swa5": ["--optimizer.eps=1e-6"]}


def assert_same(out, ref, what, steps=range(1, STEPS + 1)):
    """test_dist's loss, validation and weight checks, except for k_proj.bias: a key bias
    adds q.b to every score of a query row, which the softmax cancels, so its gradient is
    zero in exact arithmetic and only rounding noise in fp32, which AdamW normalises into
    steps of size lr; where that noise lands depends on the micro-batch split. Its
    gradient is checked against transformers in test_families.py."""
    assert_same_run(out, ref, what, steps=steps, weights_too=False)
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys(), f"{what}: tensor names differ"
    for k in b:
        if k.endswith("k_proj.bias"):
            continue
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= 1e-5, f"{what}: final {k} differs from one rank by {err:.3g} norm-wise"


PP2 = (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.pipeline_parallel_degree=2",
             "--parallelism.pipeline_parallel_microbatch_size=1"], 1)


def biased_moe_layouts_and_resume(tmp_path, m, m0, family, layouts, zero_moves=False):
    """A MoE model m whose selection biases (ERNIE 4.5 MoE's, GLM-4.5's, dots1's
    e_score_correction_bias) come from its files (the generic layout tests start from ctitan's
    own init, whose biases are zero): loaded from them, it trains 10 steps on one process and
    under each of layouts (name: (ranks, args, dp)) with the same losses and weights; stopped at
    step 4 under EP 2 and resumed on one process (the biases from the checkpoint's state.json),
    it continues the same run. zero_moves: the same weights with the biases zeroed (the planted
    "bias ignored") move the first loss, and the step-N checkpoint exports m0's biases (m0: a
    second build of m's weights, kept as built)."""
    import subprocess

    import torch

    from test_dist import BIN, ENV, losses
    hf = fam.save(m, tmp_path / "hf")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(600 * 17, 128, seed=7))
    load = [f"--checkpoint.initial_load_path={hf}", "--checkpoint.initial_load_in_hf"]
    ref = tmp_path / "single"
    run(1, train_args(hf, data, ref, *load), timeout=300)
    assert len(losses(ref)) >= 10
    if zero_moves:
        zero = tmp_path / "hf0"
        with torch.no_grad():
            for n, p in [*m.named_parameters(), *m.named_buffers()]:
                if n.endswith(fam.BIAS_MEM):
                    p.zero_()
        fam.save(m, zero)
        run(1, train_args(zero, data, tmp_path / "zero", f"--checkpoint.initial_load_path={zero}",
                          "--checkpoint.initial_load_in_hf", "--training.steps=2"), timeout=300)
        a, b = losses(tmp_path / "zero"), losses(ref)
        assert abs(a[1] - b[1]) > 1e-4 * abs(b[1]), f"the bias leaves the first loss as it was: {a[1]} vs {b[1]}"
    for name, (n, extra, dp) in layouts.items():
        out = tmp_path / name
        run(n, train_args(hf, data, out, *load, *extra, dp=dp), timeout=300)
        assert_same(out, ref, name)
    n, extra, dp = EP2
    out = tmp_path / "resume"
    p = run(n, train_args(hf, data, out, *load, *extra, "--training.stop_at_step=4",
                          "--checkpoint.last_save_model_only=false", dp=dp), check=False, timeout=300)
    assert p.returncode == 75, p.stderr[-3000:]
    run(1, train_args(hf, data, out, *load, "--checkpoint.last_save_model_only=false"), timeout=300)
    assert_same(out, ref, "ep2 -> 1 rank", steps=range(5, 11))
    if zero_moves:
        step = ref / "checkpoint" / f"step-{STEPS}"
        p = subprocess.run([str(BIN), "export", "--checkpoint", str(step), "--out", str(tmp_path / "exported"),
                            "--tokenizer", str(hf)], env=ENV, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        back = fam.load(tmp_path / "exported", family)
        assert all(torch.equal(a, b) for a, b in zip(fam.router_biases(back), fam.router_biases(m0)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("fam_dist")
    return d, oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 128, seed=7))


def model_dir(d, cid):
    out = d / f"cfg_{cid}"
    if not out.exists():
        fam.make_config(fam.CASE[cid]).save_pretrained(out)
    return out


@pytest.mark.parametrize("cid", list(CASES))
def test_layouts_and_resume_match_one_rank(cid, data):
    d, tokens = data
    m = model_dir(d, cid)
    ref = d / f"{cid}_single"
    eps = EPS.get(cid, [])
    run(1, train_args(m, tokens, ref, *eps), timeout=300)
    for name, (n, extra, dp) in CASES[cid].items():
        out = d / f"{cid}_{name}"
        run(n, train_args(m, tokens, out, *extra, *eps, dp=dp), timeout=300)
        assert_same(out, ref, f"{cid} {name}")
    # stopped at step 4 on the first layout, resumed on one process
    name, (n, extra, dp) = next(iter(CASES[cid].items()))
    out = d / f"{cid}_resume"
    p = run(n, train_args(m, tokens, out, *extra, *eps, "--training.stop_at_step=4",
                          "--checkpoint.last_save_model_only=false", dp=dp), check=False, timeout=300)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    run(1, train_args(m, tokens, out, *eps, "--checkpoint.last_save_model_only=false"), timeout=300)
    assert_same(out, ref, f"{cid}: {name} -> 1 rank", steps=range(5, STEPS + 1))
