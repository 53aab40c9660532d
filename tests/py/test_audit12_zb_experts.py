"""Twelfth mutation audit (docs/reliability.md): the reference MoE kernel's bf16 split
backward. A zero-bubble W on the experts calls the op's bwd_w entry; with bf16 products and
kernels.moe_experts_bf16 = "ref" that is op_moe_experts_bf16_bwd_w, which no test ran:
`kernels check` holds each implementation's I then W to its own fused backward (ref is the
yardstick there, never checked itself), and the pipeline tests run the chosen grouped
kernel. Planted: the entry rounding nothing (fp32 W after a bf16 I) passed. InterleavedZero-
Bubble must train Interleaved1F1B's losses and weights bit for bit on the reference kernel
too (its W and its fused backward share experts_bwd_w: the same terms in the same order).

Expert adapters keep the experts' weight gradients in I (their dA, dB come from d(W + s B A)
right after the kernel); deferring them to W there anyway passed the suite, whose zero-bubble
runs train no expert adapter. With lora.target_parameters on the experts, InterleavedZero-
Bubble trains Interleaved1F1B's losses and gradient norms bit for bit."""
import oracle
from test_dist import weights
from test_pp import MB, PP, SCHED, pp_run, setup  # noqa: F401 (fixture)

EXPERT_LORA = ["--lora.rank=4", "--lora.target_parameters=mlp.experts.gate_up_proj,mlp.experts.down_proj"]
REF_BF16 = ["--training.mixed_precision_param=bfloat16", "--kernels.moe_experts_bf16=ref"]


def _runs(setup, name, extra):
    runs = {}
    for sched in ("InterleavedZeroBubble", "Interleaved1F1B"):
        runs[sched], _ = pp_run(setup, f"a12_{name}_{sched}", 2, f"{PP}=2", f"{SCHED}={sched}", f"{MB}=1",
                                *extra, model="model_moe_aux")
    return runs["InterleavedZeroBubble"], runs["Interleaved1F1B"]


def test_zero_bubble_expert_lora_bit_for_bit(setup):
    split, fused = _runs(setup, "explora", EXPERT_LORA)
    keys = ("loss", "grad_norm", "aux_loss")
    got = [{k: r[k] for k in keys} for r in oracle.read_metrics(split / "metrics.jsonl") if "loss" in r]
    want = [{k: r[k] for k in keys} for r in oracle.read_metrics(fused / "metrics.jsonl") if "loss" in r]
    assert got and got == want, (got, want)


def test_zero_bubble_reference_bf16_experts_bit_for_bit(setup):
    split, fused = _runs(setup, "refbf16", REF_BF16)
    keys = ("loss", "grad_norm", "aux_loss")
    got = [{k: r[k] for k in keys} for r in oracle.read_metrics(split / "metrics.jsonl") if "loss" in r]
    want = [{k: r[k] for k in keys} for r in oracle.read_metrics(fused / "metrics.jsonl") if "loss" in r]
    assert got and got == want, (got, want)
    a, b = weights(split), weights(fused)
    assert any(".mlp.experts." in k for k in b) and a.keys() == b.keys()
    bad = [k for k in b if a[k].tobytes() != b[k].tobytes()]
    assert not bad, f"final weights differ from the non-split backward's: {bad[:6]}"
