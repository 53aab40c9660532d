"""HF's load-balancing loss in the gradient under context parallel (docs/moe.md,
docs/distributed.md): a Qwen3-MoE or Mixtral config.json with output_router_logits and
router_aux_loss_coef > 0 makes transformers add coef x load_balancing_loss_func to the loss,
a function of the expert counts and mean router probabilities over ALL tokens of the
forward. A context-parallel forward sees a chunk of each sequence, so the per-expert sums
of every MoE layer are summed over the cp group before the aux gradient is set: each
rank's router gets the gradient of the whole sequences' loss for its own tokens, and the
loss is counted once.

Every layout trains like one process with the same micro-batches (test_dist_cp's checks:
losses, validation losses and gradient norms to 1e-5 relative, final weights norm-wise per
tensor to 1e-5), and logs the same aux_loss (1e-5) and the same per-layer least / most
loaded expert counts: the whole sequences' loads of the step's last micro-batch, not a
chunk's, under a pipeline for every stage's layers (Interleaved1F1B: a rank's two stages),
with the aux loss in the gradient or not. The one-process runs with
the aux loss are tied to transformers by test_moe.py, test_families.py and
test_lora_experts.py. With data parallel the aux loss is per micro-batch of each replica,
so those layouts take micro-batches of one sequence (test_pp.py does the same), and their
loads are compared with those replicas alone (LOADS_REF)."""
import json

import numpy as np
import pytest

import oracle
from test_dist import STEPS, run, train_args, weights
from test_dist_cp import assert_same_cp, aux_losses

CP = "--parallelism.context_parallel_degree"
TPD = "--parallelism.tensor_parallel_degree"
EPD = "--parallelism.expert_parallel_degree"
REP = "--parallelism.data_parallel_replicate_degree"
SHARD = "--parallelism.data_parallel_shard_degree"
PPD = "--parallelism.pipeline_parallel_degree"
PPMB = "--parallelism.pipeline_parallel_microbatch_size"
LB1 = "--training.local_batch_size=1"
NONE = "--parallelism.context_parallel_load_balancer=none"
COEF = 0.1  # large enough that the aux gradient moves the routers well past 1e-5 (test below)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpaux")
    from transformers import MixtralConfig, Qwen3MoeConfig
    # layer 0 dense, layers 1-2 sparse; vocabulary 256, intermediate 48, experts' 20: TP 2 divides them
    for name, aux in (("qwen_aux", True), ("qwen_noaux", False)):
        Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=20,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                       norm_topk_prob=True, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
                       output_router_logits=aux, router_aux_loss_coef=COEF).save_pretrained(d / name)
    # 4 layers (0 dense): Interleaved1F1B over 2 pipeline ranks runs 4 stages of a layer each
    Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=20,
                   num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                   norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
                   output_router_logits=True, router_aux_loss_coef=COEF).save_pretrained(d / "qwen_aux_4l")
    # Mixtral: every layer sparse, no top-k renormalisation choice (always normalised)
    MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_local_experts=4,
                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256, tie_word_embeddings=False, sliding_window=None,
                  output_router_logits=True, router_aux_loss_coef=COEF).save_pretrained(d / "mixtral_aux")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    return d, data


_refs = {}


def single(setup, model, *extra, ranks=1):
    """The run a layout is compared with: one process unless ranks > 1 (made once per module)."""
    d, data = setup
    key = (d, model, extra, ranks)
    if key not in _refs:
        out = d / f"single_{model}_{len(_refs)}"
        run(ranks, train_args(d / model, data, out, *extra), timeout=300)
        _refs[key] = out
    return _refs[key]


def loads(out):
    """step: (moe_load_min, moe_load_max) as logged."""
    return {r["step"]: (r["moe_load_min"], r["moe_load_max"]) for r in oracle.read_metrics(out / "metrics.jsonl")
            if "moe_load_min" in r}


LAYOUTS = {  # name: (ranks, data-parallel ranks, model, reference's extra, extra)
    "qwen_cp2": (2, 1, "qwen_aux", [], [f"{CP}=2"]),
    "qwen_cp4": (4, 1, "qwen_aux", [], [f"{CP}=4"]),
    "qwen_cp2_none": (2, 1, "qwen_aux", [], [f"{CP}=2", NONE]),
    "qwen_cp4_none": (4, 1, "qwen_aux", [], [f"{CP}=4", NONE]),
    "qwen_cp2_ac_full": (2, 1, "qwen_aux", [], [f"{CP}=2", "--activation_checkpoint.mode=full"]),
    "qwen_cp2_dp2": (4, 2, "qwen_aux", [LB1], [f"{CP}=2", f"{REP}=2", f"{SHARD}=1", LB1]),
    "qwen_cp2_fsdp2": (4, 2, "qwen_aux", [LB1], [f"{CP}=2", f"{SHARD}=2", LB1]),
    "qwen_cp2_ep2_fsdp2": (4, 2, "qwen_aux", [LB1], [f"{CP}=2", f"{EPD}=2", f"{SHARD}=2", LB1]),
    "qwen_cp2_tp2": (4, 1, "qwen_aux", [], [f"{CP}=2", f"{TPD}=2", f"{SHARD}=1"]),
    # CP x PP: the last stage sums each micro-batch's expert counts over the chunks before the
    # aux gradient and sends the totals back along the stages; pipeline micro-batches of one
    # sequence, as one process with local batch 1
    "qwen_cp2_pp2_1f1b": (4, 1, "qwen_aux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1"]),
    "qwen_cp2_pp2_gpipe": (4, 1, "qwen_aux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1",
                                                       "--parallelism.pipeline_parallel_schedule=GPipe"]),
    "qwen_cp2_pp2_fsdp2_ep2": (8, 2, "qwen_aux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1", f"{SHARD}=2",
                                                           f"{EPD}=2", LB1]),
    # a rank holds two stages (layers 0 and 2, or 1 and 3), each logging its own layers' loads
    "qwen4_cp2_pp2_interleaved": (4, 1, "qwen_aux_4l", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1",
                                                                "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"]),
    # no aux loss in the gradient: no expert counts travel along the stages, the loads are logged still
    "qwen_noaux_cp2_pp2_1f1b": (4, 1, "qwen_noaux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1"]),
    "mixtral_cp2": (2, 1, "mixtral_aux", [], [f"{CP}=2"]),
    "mixtral_cp4_none": (4, 1, "mixtral_aux", [], [f"{CP}=4", NONE]),
    "mixtral_cp2_tp2": (4, 1, "mixtral_aux", [], [f"{CP}=2", f"{TPD}=2", f"{SHARD}=1"]),
    "mixtral_cp2_ep2_dp2": (4, 2, "mixtral_aux", [LB1], [f"{CP}=2", f"{EPD}=2", f"{REP}=2", f"{SHARD}=1", LB1]),
    # the review's: AC full (a recomputed forward), two pipeline micro-batches per local batch,
    # GPipe without the aux loss, and CP x PP x TP with even and uneven SP rows
    "qwen_cp2_pp2_ac_full": (4, 1, "qwen_aux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1",
                                                       "--activation_checkpoint.mode=full"]),
    "qwen_cp2_pp2_mb2": (4, 1, "qwen_aux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1",
                                                   "--training.local_batch_size=2"]),
    "qwen_noaux_cp2_pp2_gpipe": (4, 1, "qwen_noaux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1",
                                 "--parallelism.pipeline_parallel_schedule=GPipe"]),
    # CP 2 x PP 2 x TP 2: a CP rank's 8 positions of a 1-sequence micro-batch, 4 per TP rank;
    # seq 14 (7 positions a chunk, uneven for TP 2 with SP)
    "qwen_cp2_pp2_tp2": (8, 1, "qwen_aux", [LB1], [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1", f"{TPD}=2", f"{SHARD}=1"]),
    "qwen_cp2_pp2_tp2_uneven": (8, 1, "qwen_aux", [LB1, "--training.seq_len=14"],
                                [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1", f"{TPD}=2", f"{SHARD}=1",
                                 "--training.seq_len=14", "--parallelism.context_parallel_load_balancer=none"]),
}


# Layouts compared with a multi-rank reference instead of one process (ranks, extra): on this
# Mixtral TP 2 alone already ends 1.28e-5 (norm-wise, experts.2.w3 of layer 1; 1.31e-5 without
# the aux loss) from one process, its other order of sums magnified by AdamW near zero
# (docs/distributed.md, Numerics), so CP 2 x TP 2 is held to 1e-5 of TP 2 alone, which
# isolates what CP adds (CP 2 alone is 8.8e-7 from one process).
REF_LAYOUT = {"mixtral_cp2_tp2": (2, [f"{TPD}=2", f"{SHARD}=1"])}
# With data parallel the logged loads are the extremes over the replicas' last micro-batches,
# other sequences than one process's last: those layouts' loads are compared with 2 replicas
# alone (ranks, extra), which take the same sequences
LOADS_REF = {"qwen_aux": (2, [LB1, f"{SHARD}=2"]), "mixtral_aux": (2, [LB1, f"{REP}=2", f"{SHARD}=1"])}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_aux_loss_in_the_gradient_matches_one_rank(setup, name):
    d, data = setup
    n, dp, model, ref_extra, extra = LAYOUTS[name]
    ranks, ref_layout = REF_LAYOUT.get(name, (1, []))
    want = single(setup, model, *ref_extra, *ref_layout, ranks=ranks)
    out = d / name
    run(n, train_args(d / model, data, out, *extra, dp=dp), timeout=300)
    assert_same_cp(out, want, name)
    got, exp = aux_losses(out), aux_losses(want)
    assert got.keys() == exp.keys() == set(range(1, STEPS + 1)), (sorted(got), sorted(exp))
    for s in exp:
        assert abs(got[s] - exp[s]) <= 1e-5 * exp[s], f"{name}: step {s} aux_loss {got[s]!r} vs one rank {exp[s]!r}"
    if dp > 1:
        ranks, ref_extra = LOADS_REF[model]
        want = single(setup, model, *ref_extra, ranks=ranks)
    got, exp = loads(out), loads(want)
    assert got.keys() == exp.keys() == set(range(1, STEPS + 1))
    for s in exp:  # the whole sequences' loads: a chunk's are about 1/cp of them
        assert got[s] == exp[s], (f"{name}: step {s} expert loads (min, max per MoE layer) {got[s]} vs "
                                  f"{'the replicas' if dp > 1 else 'one rank'} {exp[s]}")


def test_the_aux_loss_moves_the_routers(setup):
    """What makes the comparisons above bite: the same model without output_router_logits
    ends with routers more than 1e-5 away (norm-wise), so an aux gradient dropped, taken
    from a chunk's sums, or counted on every cp rank would fail them."""
    on, off = single(setup, "qwen_aux"), single(setup, "qwen_noaux")
    a, b = weights(on), weights(off)
    router = max(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k]) for k in b if k.endswith("mlp.gate.weight"))
    assert router > 1e-3, f"the aux loss moved the routers by {router:.3g} only, too close to 1e-5"
    cfg = json.loads((setup[0] / "qwen_aux" / "config.json").read_text())
    assert cfg["output_router_logits"] is True and cfg["router_aux_loss_coef"] == COEF
