"""Sequence parallel under tensor parallel (parallelism.sequence_parallel; torchtitan's
SequenceParallel on the norms): each TP rank holds the residual stream and the norms for its
block of the batch's rows, all-gathers them before the column-parallel projections and
reduce-scatters the row-parallel outputs instead of all-reducing them.

Every layout must train like one process with the same global batch: the losses, validation
losses and gradient norms of 10 steps to 1e-5 relative and the final weights to 1e-5
norm-wise (test_dist.py's helpers and tolerances). One process is the oracle, as in
test_dist_tp.py: its runs are checked against PyTorch by test_train_loop.py and the family
tests."""
import dataclasses
import re
import subprocess

import numpy as np
import pytest

import oracle
import oracle_families as fam
from test_dist import (ENV, STEPS, assert_same_norms, assert_same_run, grad_norms, losses, mpirun, run, train_args,
                       val_losses, weights)
from conftest import BIN, crashed
from test_families_dist import assert_same as assert_same_family

SP = "--parallelism.sequence_parallel=true"
TP2 = "--parallelism.tensor_parallel_degree=2"
LORA = ["--lora.rank=4", "--lora.alpha=8",
        "--lora.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
# the embedding and all of layer 0 (nothing below wants its d(input)), a norm and a row-parallel weight
FREEZE = ("model.embed_tokens.weight,model.layers.0.*,model.layers.1.post_attention_layernorm.weight,"
          "model.layers.1.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def sp_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_sp")
    # heads 4, kv heads 4 (TP 4 divides them), intermediate 48, vocabulary 256 (vocabulary-
    # parallel) and a tied 251 (whole on every rank); hidden 30: no rank's block of a row is
    # a power of two
    for name, vocab, tied, kv in (("model", 256, False, 4), ("model_tied", 251, True, 4),
                                  ("model_kv2", 256, False, 2)):
        oracle.tiny_config(vocab=vocab, hidden=30, inter=48, layers=3, heads=4, kv_heads=kv, head_dim=8,
                           tied=tied).save_pretrained(d / name)
    # TP 3: heads 6, kv heads 3, intermediate 48 and an untied vocabulary 255 (85 rows a rank)
    oracle.tiny_config(vocab=255, hidden=30, inter=48, layers=3, heads=6, kv_heads=3, head_dim=8,
                       tied=False).save_pretrained(d / "model_h6")
    from transformers import Qwen3MoeConfig
    Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=20, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=False,
                   ).save_pretrained(d / "model_moe")
    # HF's load-balancing loss in the gradient: under TP (no data parallel) every layout's
    # micro-batches are one process's
    Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=20, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=True,
                   router_aux_loss_coef=0.05).save_pretrained(d / "model_moe_aux")
    # Gemma3: four norms per layer (pre and post of attention and MLP), 1 + w weights, a
    # scaled embedding; vocabulary 128 (tokens < 128)
    # other families (test_families_dist.py's TP 2 cases): OLMo2's norms after attention and
    # MLP with none before (the projections read the residual stream itself) and its q/k norm
    # over the whole projection; Phi3's fused qkv_proj and gate_up_proj; Llama's o_proj and
    # down_proj biases, added once after the reduce-scatter, and a tied vocabulary-parallel head
    for case in ("gemma3_text", "olmo2", "phi3_partial075_longrope", "llama_rope3_attnbias_hd16",
                 "llama_mlpbias_tied"):
        fam.make_config(fam.CASE[case]).save_pretrained(d / case)
    # o_proj's bias added under a norm that follows it (proj_reduced): transformers' Olmo2 and
    # Gemma3 give o_proj bias=config.attention_bias, then post_attention_layernorm; their
    # down_proj has none (bias=False) and no family ctitan loads has an MLP bias under a norm
    for case in ("olmo2", "gemma3_text"):
        c = fam.CASE[case]
        fam.make_config(dataclasses.replace(c, kw={**c.kw, "attention_bias": True})).save_pretrained(
            d / f"{case}_attnbias")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    oracle.write_bin(d / "tokens128.bin", oracle.learnable_stream(600 * 17, 128, seed=7))
    refs = {}

    def single(model, *extra):
        key = (model, extra)
        if key not in refs:
            out = d / f"single_{model}_{len(refs)}"
            run(1, train_args(d / model, data_of(d, model), out, "--checkpoint.last_save_model_only=false", *extra))
            refs[key] = out
        return refs[key]
    return d, data, single


def data_of(d, model):
    return d / ("tokens.bin" if model.startswith("model") else "tokens128.bin")


# name: (model, ranks, dp degree, args beside SP, args of both runs)
LAYOUTS = {
    "tp2": ("model", 2, 1, ["--parallelism.tensor_parallel_degree=2"], []),
    "tp4": ("model", 4, 1, ["--parallelism.tensor_parallel_degree=4"], []),
    "tp2_tied": ("model_tied", 2, 1, ["--parallelism.tensor_parallel_degree=2"], []),
    "tp2_fsdp2": ("model", 4, 2, ["--parallelism.tensor_parallel_degree=2",
                                  "--parallelism.data_parallel_shard_degree=2"], []),
    "tp2_dp2_ac_full": ("model", 4, 2, [TP2, "--parallelism.data_parallel_replicate_degree=2",
                                        "--parallelism.data_parallel_shard_degree=1",
                                        "--activation_checkpoint.mode=full"], []),
    # the embedding frozen and stored in bf16: looked up from the store (every row's partial
    # lookup, vocabulary-parallel; this rank's rows, whole)
    "tp2_frozen_bf16_embed": ("model", 2, 1, [TP2], ["--training.freeze=model.embed_tokens.weight",
                                                     "--training.frozen_dtype=bfloat16"]),
    "tp2_tied_frozen_bf16_embed": ("model_tied", 2, 1, [TP2], ["--training.freeze=model.embed_tokens.weight",
                                                               "--training.frozen_dtype=bfloat16"]),
    "tp2_ac_full": ("model", 2, 1, ["--parallelism.tensor_parallel_degree=2",
                                    "--activation_checkpoint.mode=full"], []),
    "tp2_ac_op": ("model", 2, 1, ["--parallelism.tensor_parallel_degree=2", "--activation_checkpoint.mode=selective",
                                  "--activation_checkpoint.selective_ac_option=op"], []),
    "tp2_moe": ("model_moe", 2, 1, ["--parallelism.tensor_parallel_degree=2"], []),
    "tp2_moe_aux": ("model_moe_aux", 2, 1, ["--parallelism.tensor_parallel_degree=2"], []),
    "tp2_pp2": ("model", 4, 1, [TP2, "--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.pipeline_parallel_microbatch_size=1"], []),
    "tp2_ep2": ("model_moe", 4, 2, [TP2, "--parallelism.data_parallel_shard_degree=2",
                                    "--parallelism.expert_parallel_degree=2"], []),
    "tp2_cp2": ("model_kv2", 4, 1, [TP2, "--parallelism.context_parallel_degree=2",
                                "--parallelism.data_parallel_shard_degree=1"], []),
    "tp2_lora_dropout": ("model", 2, 1, [TP2], LORA + ["--lora.dropout=0.1"]),
    "tp2_freeze": ("model", 2, 1, [TP2], [f"--training.freeze={FREEZE}"]),
    "tp2_gemma3": ("gemma3_text", 2, 1, [TP2], []),
    "tp2_olmo2": ("olmo2", 2, 1, [TP2], []),
    "tp2_phi3": ("phi3_partial075_longrope", 2, 1, [TP2], []),
    "tp2_llama_attnbias": ("llama_rope3_attnbias_hd16", 2, 1, [TP2], []),
    "tp2_olmo2_attnbias": ("olmo2_attnbias", 2, 1, [TP2], []),
    "tp2_gemma3_attnbias": ("gemma3_text_attnbias", 2, 1, [TP2], []),
    # eps 1e-6: its mlp biases' gradients are near zero (test_families_dist.py's EPS)
    "tp2_llama_mlpbias_tied": ("llama_mlpbias_tied", 2, 1, [TP2], ["--optimizer.eps=1e-6"]),
    "tp2_bf16": ("model", 2, 1, [TP2], ["--training.mixed_precision_param=bfloat16"]),
}


def sp_run(d, data, name, model, n, dp, args, both, *more, sp=True):
    out = d / name
    run(n, train_args(d / model, data_of(d, model), out, f"--parallelism.sequence_parallel={str(sp).lower()}", "--checkpoint.last_save_model_only=false", *args, *both, *more,
                      dp=dp))
    return out


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sp_layout_matches_one_rank(sp_setup, name, sp):
    d, data, single = sp_setup
    model, n, dp, args, both = LAYOUTS[name]
    out = sp_run(d, data, f"{name}_{sp}", model, n, dp, args, both, sp=sp)
    ref = single(model, *both)
    if name in LOOSE:
        assert_close(out, ref, name, *LOOSE[name])
    elif not model.startswith("model"):  # k_proj.bias: rounding noise only (test_families_dist.assert_same)
        assert_same_family(out, ref, name)
        assert_same_norms(out, ref, name)
    else:
        assert_same_run(out, ref, name)
        assert_same_norms(out, ref, name)


# Where TP itself (without SP, the no_sp runs) is further from one process than 1e-5, with
# (losses, final weights norm-wise, gradient norms) tolerances that hold it, measured here:
# bf16: one fp32 last-bit difference flips a value to its neighbouring bf16 one (TP 2 is
# 1.2e-5 off the loss at step 9, 3.4e-3 off on the embedding after 10 steps); the aux loss:
# near-tie expert choices (TP 2: 1.67e-5 on the embedding); OLMo2 with attention biases, its
# q/k norms' row sums over the whole projection split between the ranks (TP 2: 1.56e-5 on
# layers.1.self_attn.q_proj.weight, losses 1.4e-8 and gradient norms 3.8e-7 from one
# process). SP must then equal TP without it to 1e-5 as well (test_sp_equals_tp_without_it).
LOOSE = {"tp2_bf16": (1e-4, 1e-2, 1e-3), "tp2_moe_aux": (1e-5, 1e-4, 1e-5),
         "tp2_olmo2_attnbias": (1e-5, 1e-4, 1e-5)}


@pytest.mark.parametrize("name", list(LOOSE))
def test_sp_equals_tp_without_it(sp_setup, name):
    d, data, _ = sp_setup
    model, n, dp, args, both = LAYOUTS[name]
    a = sp_run(d, data, f"{name}_cmp_sp", model, n, dp, args, both, sp=True)
    b = sp_run(d, data, f"{name}_cmp_tp", model, n, dp, args, both, sp=False)
    assert_same_run(a, b, f"{name}: SP vs TP")
    assert_same_norms(a, b, f"{name}: SP vs TP")


def assert_close(out, ref, what, ltol, wtol, gtol):
    for get in (losses, val_losses, grad_norms):
        got, want = get(out), get(ref)
        assert set(got) == set(want) and want, f"{what}: {get.__name__} steps {sorted(got)} vs {sorted(want)}"
        tol = gtol if get is grad_norms else ltol
        for s in want:
            assert abs(got[s] - want[s]) <= tol * abs(want[s]), f"{what}: step {s} {get.__name__} {got[s]} vs {want[s]}"
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys()
    for k in b:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= wtol, f"{what}: final {k} differs from one rank by {err:.3g} norm-wise"


def test_sp_checkpoint_moves_between_layouts(sp_setup):
    """Written under SP (TP 2), resumed on one process, and the reverse: the steps after the
    checkpoint, the final weights and the AdamW moments equal the uninterrupted one-process
    run's (checkpoints hold whole tensors, whatever slice of the rows a rank ran)."""
    d, data, single = sp_setup
    ref = single("model")
    stop = ["--training.stop_at_step=4", "--checkpoint.last_save_model_only=false"]
    layouts = {"sp": (2, [SP, TP2]), "one": (1, [])}
    for first, then in (("sp", "one"), ("one", "sp")):
        (n1, a1), (n2, a2) = layouts[first], layouts[then]
        out = d / f"move_{first}_to_{then}"
        p = run(n1, train_args(d / "model", data, out, *stop, *a1), check=False)
        assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
        p = run(n2, train_args(d / "model", data, out, "--checkpoint.last_save_model_only=false", *a2))
        assert "resuming from" in p.stderr, p.stderr[-2000:]
        assert_same_run(out, ref, f"{first} -> {then}", steps=range(5, STEPS + 1))
        a, b = weights(out, file="optim.safetensors"), weights(ref, file="optim.safetensors")
        for k in b:
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)
            assert err <= 1e-4, f"{first} -> {then}: {k} differs by {err:.3g}"


# Rows t does not divide, cut as DTensor's Shard cuts them (torch.chunk: ceil(rows / t) rows a
# rank, the last ranks' shorter or none, padded for the collectives): name: (model, ranks, args
# beside SP, args of both runs). ONE_ROW: one sequence a micro-batch (global 8: 8 micro-batches
# a step), validating one sequence at a time too.
ONE_ROW = ["--training.local_batch_size=1", "--validation.local_batch_size=1"]
UNEVEN = {
    # 15 rows of training and of validation: 8 and 7
    "tp2_odd": ("model", 2, [TP2], ONE_ROW + ["--training.seq_len=15"]),
    # 2 x 15 = 30 rows (4k + 2): 8, 8, 8, 6; validation 4 x 15 = 60: 15 each, so after step 5
    # the last rank's two padding rows hold validation rows (what a padded row must not reach)
    "tp4_4k_plus_2": ("model", 4, ["--parallelism.tensor_parallel_degree=4"], ["--training.seq_len=15"]),
    # 3 rows: 1, 1, 1 and a rank with none
    "tp4_fewer_rows_than_ranks": ("model", 4, ["--parallelism.tensor_parallel_degree=4"],
                                  ONE_ROW + ["--training.seq_len=3"]),
    # 2 x 16 = 32 rows: 11, 11, 10; validation 4 x 16 = 64: 22, 22, 20
    "tp3": ("model_h6", 3, ["--parallelism.tensor_parallel_degree=3"], []),
    # a context-parallel rank's 9 positions of 18 (no load balancing): 5 and 4
    "tp2_cp2": ("model_kv2", 4, [TP2, "--parallelism.context_parallel_degree=2",
                                 "--parallelism.context_parallel_load_balancer=none"],
                ONE_ROW + ["--training.seq_len=18"]),
    # micro-batches of 1 x 15, validated one at a time
    "tp2_pp2": ("model", 4, [TP2, "--parallelism.pipeline_parallel_degree=2",
                             "--parallelism.pipeline_parallel_microbatch_size=1"], ["--training.seq_len=15"]),
    "tp2_moe_aux": ("model_moe_aux", 2, [TP2], ONE_ROW + ["--training.seq_len=15"]),
    "tp2_lora_dropout": ("model", 2, [TP2], ONE_ROW + ["--training.seq_len=15"] + LORA + ["--lora.dropout=0.1"]),
    # four norms a layer (their partial gradients summed together) and a scaled embedding
    "tp2_gemma3": ("gemma3_text", 2, [TP2], ONE_ROW + ["--training.seq_len=15"]),
}


@pytest.mark.parametrize("name", list(UNEVEN))
def test_sp_uneven_rows_match_one_rank(sp_setup, name):
    """Where the TP degree does not divide a forward's rows (training, validation, a context-
    parallel rank's chunk, a pipeline's micro-batch), every rank runs its DTensor chunk and the
    run still trains like one process: losses, validation losses and gradient norms of 10
    steps to 1e-5 relative, final weights to 1e-5 norm-wise (the aux loss: LOOSE's)."""
    d, data, single = sp_setup
    model, n, args, both = UNEVEN[name]
    out = sp_run(d, data, f"uneven_{name}", model, n, 1, args + ["--parallelism.data_parallel_shard_degree=1"], both)
    ref = single(model, *both)
    if name in UNEVEN_LOOSE:  # and SP equals TP without it to 1e-5
        assert_close(out, ref, name, *UNEVEN_LOOSE[name])
        tp = sp_run(d, data, f"uneven_{name}_no_sp", model, n, 1,
                    args + ["--parallelism.data_parallel_shard_degree=1"], both, sp=False)
        assert_same_run(out, tp, f"{name}: SP vs TP")
        assert_same_norms(out, tp, f"{name}: SP vs TP")
    elif name in LOOSE:
        assert_close(out, ref, name, *LOOSE[name])
    elif not model.startswith("model"):
        assert_same_family(out, ref, name)
        assert_same_norms(out, ref, name)
    else:
        assert_same_run(out, ref, name)
        assert_same_norms(out, ref, name)


# Where TP without SP is itself further than 1e-5 from one process on the final weights,
# measured: 3 rows a micro-batch, where AdamW's steps on near-zero gradients magnify TP's own
# rounding (TP 4 without SP: 2.38e-5 on layers.1.mlp.up_proj.weight after 10 steps, SP 2.3e-7
# from it); TP 3's three-way partial sums (without SP: 2.05e-5, SP 4.3e-8 from it); Gemma3 in
# one-sequence micro-batches (without SP: 2.01e-5, SP 4.7e-7 from it). The final weights are
# held to 1e-4 there, and SP to TP without it to 1e-5.
UNEVEN_LOOSE = {"tp4_fewer_rows_than_ranks": (1e-5, 1e-4, 1e-5), "tp3": (1e-5, 1e-4, 1e-5),
                "tp2_gemma3": (1e-5, 1e-4, 1e-5)}


@pytest.mark.parametrize("ranks, seq, batch, pp", [(2, 15, 1, 1), (4, 15, 2, 1), (4, 3, 1, 1), (4, 6, 1, 1),
                                                   (3, 16, 2, 1), (2, 15, 2, 2), (4, 6, 2, 2)])
def test_sp_dry_run_names_the_dtensor_chunks(sp_setup, ranks, seq, batch, pp):
    """--dry-run plans a rank's residual stream for the largest chunk and names every rank's
    rows: torch's own Shard(0)._split_tensor of the batch's rows over the TP degree (the
    plan's batch: the larger of training's and validation's, the same here; under PP a
    stage's forward, one pipeline micro-batch of 1 sequence)."""
    import torch
    from torch.distributed.tensor.placement_types import Shard
    d, data, _ = sp_setup
    model = "model_h6" if ranks == 3 else "model"
    args = train_args(d / model, data, d / "dry", SP, f"--parallelism.tensor_parallel_degree={ranks}",
                      "--parallelism.data_parallel_shard_degree=1", f"--training.seq_len={seq}",
                      f"--training.local_batch_size={batch}", f"--validation.local_batch_size={batch}",
                      f"--parallelism.pipeline_parallel_degree={pp}", "--dry-run")
    p = subprocess.run([str(BIN), *map(str, args)], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    batch = 1 if pp > 1 else batch
    rows = batch * seq
    shards, pads = Shard(0)._split_tensor(torch.empty(rows), ranks, with_padding=True)
    sizes = [int(x.numel()) - pad for x, pad in zip(shards, pads)]
    sizes += [0] * (ranks - len(sizes))
    line = f"sequence parallel: the residual stream and norms of {max(sizes)} of the {rows} rows (batch {batch} x {seq})"
    if rows % ranks:
        line += f"; rows per rank {', '.join(map(str, sizes))}, padded to {int(shards[0].numel())} in the collectives"
    assert line + "\n" in p.stdout, (line, p.stdout[-2000:])


def field(out, label):
    return int(re.search(re.escape(label) + r"\s+[0-9.]+ GiB\s+(\d+) bytes", out).group(1))


def test_sp_dry_run_counts_the_smaller_activations(sp_setup, tmp_path):
    """--dry-run's per-rank activations under SP (TP 2, batch 2 x 32, a 4-layer model of
    hidden 256) fall by what the architecture says a rank no longer holds, counted here from
    the HF config: per layer the residual stream at the layer's input and after attention
    and the two pre-norms' outputs ([BT, H] each) and their rstd ([BT]), the final norm's
    input and output and its rstd, and d(residual) [BT, H], each now for BT/2 rows; less the
    two [BT, H] buffers the gathered rows and gradients use and the two norm weights' [H]
    partial sums of a layer. Every buffer is carved in 64-byte units. The run itself logs the
    same plan."""
    from transformers import AutoConfig
    model = tmp_path / "medium"
    oracle.tiny_config(vocab=2048, hidden=256, inter=768, layers=4, heads=4, kv_heads=2, head_dim=64
                       ).save_pretrained(model)
    cfg = AutoConfig.from_pretrained(model)
    B, T, t = 2, 32, 2
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={sp_setup[1]}",
            f"--training.seq_len={T}", f"--training.local_batch_size={B}", "--training.steps=1",
            "--metrics.peak_tflops=1", f"--job.dump_folder={tmp_path / 'o'}", TP2,
            "--parallelism.data_parallel_shard_degree=1"]
    acts = {}
    for sp in ("false", "true"):
        a = args + [f"--parallelism.sequence_parallel={sp}"]
        p = subprocess.run([str(BIN), *a, "--dry-run"], env=ENV, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        acts[sp] = field(p.stdout.split("per rank: ")[1], "activations + workspace (planned)")
        p = run(2, a)
        mib = float(re.search(r"activations ([0-9.]+) MiB", p.stderr).group(1))
        assert abs(mib - acts[sp] / 2**20) < 0.05, (sp, mib, acts[sp])
    r16 = lambda n: -(-n // 16) * 16
    BT, BS, H, L = B * T, B * T // t, cfg.hidden_size, cfg.num_hidden_layers
    per_layer = 4 * (r16(BT * H) - r16(BS * H)) + 2 * (r16(BT) - r16(BS))
    final = 2 * (r16(BT * H) - r16(BS * H)) + r16(BT) - r16(BS) + r16(BT * H) - r16(BS * H)
    added = 2 * r16(BT * H) + r16(2 * H)
    want = 4 * (L * per_layer + final - added)
    assert acts["false"] - acts["true"] == want, (acts, want)


def test_sp_is_the_default_under_tp(sp_setup, tmp_path):
    """torchtitan's TP plan always shards the norms over the sequence: so does ctitan's TP
    unless parallelism.sequence_parallel = false (the per-rank plan says which)."""
    d, data, _ = sp_setup
    base = train_args(d / "model", data, tmp_path / "o", TP2, "--parallelism.data_parallel_shard_degree=1",
                      "--dry-run")
    said = {}
    for extra in ([], ["--parallelism.sequence_parallel=false"]):
        p = subprocess.run([str(BIN), *base, *extra], env=ENV, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        said[bool(extra)] = "sequence parallel: the residual stream and norms of 32 of the 64 rows" in p.stdout
    assert said == {False: True, True: False}, said


@pytest.mark.parametrize("model, norms", [("model", 2), ("gemma3_text", 4)])
def test_sp_norm_gradients_take_one_all_reduce_a_layer(sp_setup, tmp_path, model, norms):
    """A layer's norm weights' gradients (each rank's rows' partial sums: 2 norms a Qwen3 layer,
    4 a Gemma3 one) go through the group in one all-reduce with the per-head q/k norms' (2 x
    head_dim floats), where each norm took one of its own before; the final norm's takes
    one. Counted in the profiler's trace of a TP 2 step: the float sum all-reduces from a
    layer_bwd span's start to the next layer_bwd span (its post-backward hooks included)."""
    import json
    from transformers import AutoConfig
    d, data, _ = sp_setup
    cfg = AutoConfig.from_pretrained(d / model)
    H, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    out = tmp_path / "o"
    run(2, train_args(d / model, data_of(d, model), out, SP, TP2, "--parallelism.data_parallel_shard_degree=1",
                      "--training.steps=1", "--training.local_batch_size=1", "--training.seq_len=15",
                      "--profiling.enable_profiling", "--profiling.profile_freq=1"))
    for rank in (0, 1):
        ev = json.loads((out / "profile_trace" / "iteration_1" / f"rank{rank}_trace.json").read_text())["traceEvents"]
        ev = sorted((e for e in ev if e.get("ph") == "X"), key=lambda e: e["ts"])
        # head: the sums after the forward's last layer (the loss's, then the final norm's)
        windows, cur, head, finals = [], None, [], []
        for e in ev:
            if e["name"] in ("layer_fwd", "step"):
                cur, head = None, []
            elif e["name"] == "layer_bwd":
                if cur is None:
                    finals.append(head[-1] if head else None)
                cur = [e["args"]["layer"], []]
                windows.append(cur)
            elif (e["name"] == "all_reduce" and e["args"]["dtype"] == "f32" and e["args"]["op"] == "sum"
                  and e["args"]["comm_size"] == 2):
                (cur[1] if cur else head).append(e["args"]["count"])
        assert len(windows) == 8 * L, (rank, len(windows))  # 8 micro-batches of one sequence
        for layer, counts in windows:
            assert counts == [2 * hd + norms * H], (rank, layer, counts)
        assert finals == [H] * 8, (rank, finals)  # the final norm's, last before the layers' backward
