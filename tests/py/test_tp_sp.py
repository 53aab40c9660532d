"""Sequence parallel under tensor parallel (parallelism.sequence_parallel; torchtitan's
SequenceParallel on the norms): each TP rank holds the residual stream and the norms for its
block of the batch's rows, all-gathers them before the column-parallel projections and
reduce-scatters the row-parallel outputs instead of all-reducing them.

Every layout must train like one process with the same global batch: the losses, validation
losses and gradient norms of 10 steps to 1e-5 relative and the final weights to 1e-5
norm-wise (test_dist.py's helpers and tolerances). One process is the oracle, as in
test_dist_tp.py: its runs are checked against PyTorch by test_train_loop.py and the family
tests."""
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
# near-tie expert choices (TP 2: 1.67e-5 on the embedding). SP must then equal TP without
# it to 1e-5 as well (test_sp_equals_tp_without_it).
LOOSE = {"tp2_bf16": (1e-4, 1e-2, 1e-3), "tp2_moe_aux": (1e-5, 1e-4, 1e-5)}


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


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry_run"])
@pytest.mark.parametrize("ranks, extra, words", [
    (2, ["--training.local_batch_size=1", "--training.seq_len=15", "--validation.local_batch_size=2"],
     "training.local_batch_size 1 x 15 positions per sequence (training.seq_len / context_parallel_degree) "
     "= 15 rows are not a multiple of parallelism.tensor_parallel_degree = 2"),
    (2, ["--training.seq_len=15", "--validation.local_batch_size=1"],
     "the validation batch (validation.local_batch_size) 1 x 15 positions"),
    (4, ["--training.seq_len=15", "--parallelism.pipeline_parallel_degree=2",
         "--parallelism.pipeline_parallel_microbatch_size=1"],
     "parallelism.pipeline_parallel_microbatch_size 1 x 15 positions"),
    (4, ["--training.local_batch_size=1", "--training.seq_len=18", "--validation.local_batch_size=2",
         "--parallelism.context_parallel_degree=2", "--parallelism.context_parallel_load_balancer=none"],
     "training.local_batch_size 1 x 9 positions per sequence"),
], ids=["batch", "validation", "pipeline", "context_parallel"])
def test_sp_refuses_rows_the_degree_does_not_divide(sp_setup, ranks, extra, words, dry):
    """B x T rows of a forward (T: a context-parallel rank's positions) that TP 2 does not cut
    into equal blocks: exit 2 naming the keys and values, before anything runs (and from
    --dry-run)."""
    d, data, _ = sp_setup
    args = train_args(d / "model", data, d / "refused", SP, TP2, "--parallelism.data_parallel_shard_degree=1",
                      *extra) + (["--dry-run"] if dry else [])
    cmd = (([str(BIN)] if dry else mpirun() + ["-np", str(ranks), str(BIN)]) + [str(a) for a in args])
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "parallelism.sequence_parallel = true" in p.stderr and words in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry_run"])
def test_sp_without_validation_ignores_the_validation_batch(sp_setup, dry):
    """validation.local_batch_size x T that TP 2 does not divide is no reason to refuse a run
    that does not validate (validation.enable = false): it trains (and --dry-run plans) as
    the same run did before sequence parallel became the default."""
    d, data, _ = sp_setup
    args = [a for a in train_args(d / "model", data, d / "noval", SP, TP2, "--parallelism.data_parallel_shard_degree=1",
                                  "--training.seq_len=16", "--training.steps=2", "--validation.local_batch_size=1")
            if not str(a).startswith("--validation.enable")] + (["--dry-run"] if dry else [])
    args = [str(a).replace("--training.seq_len=16", "--training.seq_len=15") for a in args]
    cmd = ([str(BIN)] if dry else mpirun() + ["-np", "2", str(BIN)]) + args
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "validation batch" not in p.stderr, p.stderr[-2000:]


def field(out, label):
    return int(re.search(re.escape(label) + r"\s+[0-9.]+ GiB\s+(\d+) bytes", out).group(1))


def test_sp_dry_run_counts_the_smaller_activations(sp_setup, tmp_path):
    """--dry-run's per-rank activations under SP (TP 2, batch 2 x 32, a 4-layer model of
    hidden 256) fall by what the architecture says a rank no longer holds, counted here from
    the HF config: per layer the residual stream at the layer's input and after attention
    and the two pre-norms' outputs ([BT, H] each) and their rstd ([BT]), the final norm's
    input and output and its rstd, and d(residual) [BT, H], each now for BT/2 rows; less the
    two [BT, H] buffers the gathered rows and gradients use and an [H] norm-weight partial
    sum. Every buffer is carved in 64-byte units. The run itself logs the same plan."""
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
    added = 2 * r16(BT * H) + r16(H)
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
