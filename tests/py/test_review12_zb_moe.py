"""Zero-bubble W on the MoE experts (op_moe_experts_bwd_w, model/lm.c wdefer_experts) in the
corners test_pp_zero_bubble.py's bit-for-bit test leaves (review12): one projection of the
experts frozen (training.freeze on down_proj: I defers gate / up only, W has no d down), bf16
products (training.mixed_precision_param: W must run the bf16 grouped GEMMs I's fused form
runs), full and selective-op activation checkpointing (h and the routing live in the
recomputation's scratch, so I must copy them), and expert parallel with FSDP (the experts stay
whole in I there). InterleavedZeroBubble runs the stages, ranks and micro-batch order of
Interleaved1F1B with the backward split, so its losses, gradient norms, aux losses and final
weights must equal Interleaved1F1B's bit for bit (test_lm_wsplit.c: I then W is the fused
backward's bits)."""
import pytest

import oracle
from test_dist import weights
from test_pp import MB, PP, SCHED, pp_run, setup  # noqa: F401 (fixture)

FREEZE_DOWN = "--training.freeze=model.layers.*.mlp.experts.*.down_proj.weight"
CASES = {  # name: (ranks, data-parallel degree, extra)
    "freeze_down": (2, 1, [FREEZE_DOWN]),
    "bf16": (2, 1, ["--training.mixed_precision_param=bfloat16"]),
    "ac_full": (2, 1, ["--activation_checkpoint.mode=full"]),
    "ac_sel_op": (2, 1, ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]),
    "fsdp2_ep2": (4, 2, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.expert_parallel_degree=2"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_bubble_experts_bit_for_bit(setup, name):
    n, dp, extra = CASES[name]
    runs = {}
    for sched in ("InterleavedZeroBubble", "Interleaved1F1B"):
        out, _ = pp_run(setup, f"r12_{name}_{sched}", n, f"{PP}=2", f"{SCHED}={sched}", f"{MB}=1", *extra,
                        model="model_moe_aux", dp=dp)
        runs[sched] = out
    split, fused = runs["InterleavedZeroBubble"], runs["Interleaved1F1B"]
    keys = ("loss", "grad_norm", "aux_loss")
    got = [{k: r[k] for k in keys} for r in oracle.read_metrics(split / "metrics.jsonl") if "loss" in r]
    want = [{k: r[k] for k in keys} for r in oracle.read_metrics(fused / "metrics.jsonl") if "loss" in r]
    assert got and got == want, (name, got, want)
    a, b = weights(split), weights(fused)
    assert any(".mlp.experts." in k for k in b), sorted(b)[:8]
    assert a.keys() == b.keys()
    bad = [k for k in b if a[k].tobytes() != b[k].tobytes()]
    assert not bad, f"{name}: final weights differ from the non-split backward's: {bad[:6]}"
