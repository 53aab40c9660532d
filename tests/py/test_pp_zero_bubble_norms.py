"""Zero-bubble W takes the RMSNorms' weight gradients (model/lm.c wdefer_norm, norm_bwd_w), as
torch.distributed.pipelining's stage_backward_weight defers every parameter's gradient, not
only the linears': I computes each norm's d(input) alone and copies its input, d(output) and
rstd; W adds dw with the rmsnorm op's bwd_w (or the rope op's qknorm_bwd_w for the per-head
q/k norm fused with RoPE), the sum the fused backward's kernel takes its dw from.

InterleavedZeroBubble runs the stages, ranks and micro-batch order of Interleaved1F1B with
the backward split, so its losses, gradient norms and final weights must equal
Interleaved1F1B's bit for bit, on the norm layouts ctitan has:

- OLMo2: post-norms on the attention and MLP outputs, q/k norms over the whole projection
  (and under tensor parallel 2, with and without sequence parallel, split over the ranks:
  op_rmsnorm_bwd_given's d(input) in I, its dw op_rmsnorm_bwd_w in W; under sequence parallel
  the post-norms' partial dw are summed over the group by the layer's post_backward, in W);
- Gemma 3: four norms a layer scaling by (1 + w), per-head q/k norms fused with RoPE, the final
  norm (W replays it before the last layer's hooks: under FSDP the head's piece is reduced
  there);
- Qwen3: pre-norms and per-head q/k norms fused with RoPE, with full activation checkpointing
  (the norms' inputs live in the recomputation's scratch, so I copies them);
- GLM-4.5 MoE: per-head q/k norms before a partial RoPE (the norm, then RoPE in place), and
  FlexOlmo: the post-norm on a sparse block's summed output;
- HunYuan dense: per-head q/k norms after RoPE (W's rmsnorm bwd_w on I's copy of R x) and
  biases on q, k, v and o, which W sums from the d(output) copies their projections' records
  already hold (model/lm.c mm_bwd_b).
(tests/c/model/test_lm_wsplit.c checks the same per stage with and without checkpointing, in
fp32 and bf16, and that I alone leaves every norm's gradient untouched.)"""
import pytest

import oracle
import oracle_families as of
from test_dist import run, train_args, weights
from test_pp import MB, PP, SCHED

TP2 = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
STEPS = 3  # 8 micro-batches a step: every stage's I and W run 24 times
CASES = {  # name: (model, ranks, data-parallel degree, extra)
    "olmo2": ("olmo2", 2, 1, []),
    "olmo2_tp2_sp": ("olmo2", 4, 1, TP2 + ["--parallelism.sequence_parallel=true"]),
    "olmo2_tp2": ("olmo2", 4, 1, TP2 + ["--parallelism.sequence_parallel=false"]),
    "gemma3_fsdp2": ("gemma3_text", 4, 2, ["--parallelism.data_parallel_shard_degree=2"]),
    "qwen3_ac_full": ("qwen3", 2, 1, ["--activation_checkpoint.mode=full"]),
    "hunyuan_bias": ("hunyuan_qknorm_after_rope_bias", 2, 1, []),
    # GLM-4.5: per-head q/k norms then partial RoPE (not the fused op: norm, then RoPE in place),
    # a dense layer 0 and sparse ones behind the sigmoid router
    "glm4_moe": ("glm4_moe_groups_bias_qknorm", 2, 1, []),
    # FlexOlmo: the sparse block's post-norm (post_feedforward_layernorm on the summed branch)
    "flex_olmo": ("flex_olmo_norm_topk_tied", 2, 1, []),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("zb_norms")
    # 4 layers: PP 2 x 2 local stages, one layer a stage
    for cid in ("olmo2", "gemma3_text", "hunyuan_qknorm_after_rope_bias", "glm4_moe_groups_bias_qknorm",
                "flex_olmo_norm_topk_tied"):
        case = of.CASE[cid]
        kw = {**case.kw, "num_hidden_layers": 4}
        if cid == "gemma3_text":
            kw["layer_types"] = ["sliding_attention", "full_attention"] * 2
        of.save(of.build(of.Case(cid, case.family, kw, seed=case.seed, score_bias=case.score_bias)), d / cid)
    oracle.save_model(oracle.build_model(oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=4, heads=4,
                                                            kv_heads=2, head_dim=8), seed=3), d / "qwen3")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 128, seed=7))
    return d, data


@pytest.mark.parametrize("name", list(CASES))
def test_zero_bubble_norms_bit_for_bit(models, name):
    d, data = models
    model, n, dp, extra = CASES[name]
    runs = {}
    for sched in ("InterleavedZeroBubble", "Interleaved1F1B"):
        out = d / f"{name}_{sched}"
        run(n, train_args(d / model, data, out, f"{PP}=2", f"{SCHED}={sched}", f"{MB}=1", *extra,
                          f"--training.steps={STEPS}", dp=dp), timeout=300)
        runs[sched] = out
    split, fused = runs["InterleavedZeroBubble"], runs["Interleaved1F1B"]
    keys = ("loss", "grad_norm")
    got = [{k: r[k] for k in keys} for r in oracle.read_metrics(split / "metrics.jsonl") if "loss" in r]
    want = [{k: r[k] for k in keys} for r in oracle.read_metrics(fused / "metrics.jsonl") if "loss" in r]
    assert len(got) == STEPS and got == want, (name, got, want)
    a, b = weights(split, STEPS), weights(fused, STEPS)
    assert a.keys() == b.keys()
    norms = [k for k in b if k.endswith("norm.weight")]
    assert len(norms) > 8, sorted(b)
    assert name != "hunyuan_bias" or sum(k.endswith("_proj.bias") for k in b) == 16, sorted(b)
    bad = [k for k in b if a[k].tobytes() != b[k].tobytes()]
    assert not bad, f"{name}: final weights differ from the non-split backward's: {bad[:6]}"
