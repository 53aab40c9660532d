"""GraniteMoeShared's lora.modules_to_save over its fused tensors (experts.gate_up_proj /
down_proj, shared_mlp.input_linear) in the layouts test_lora_granitemoe_modules_to_save_fused
leaves out (review9): the adapter file is put together from every piece of a fused tensor
(lora_save_peft), the pieces gathered from the stages or FSDP shards that hold them, and read
back piece by piece (lora_load_peft_each) on whichever rank holds each.

1. Training (LoRA rank 4 on q_proj / v_proj, residual_multiplier 0.4) under PP 2 (1F1B and
   ZBVZeroBubble) and FSDP 2: losses, validation losses and the final adapter (its fused
   tensors under PEFT's names included) equal one process's.
2. That adapter as lora.adapter_path: training on from it under PP 2 and FSDP 2 equals one
   process doing the same, so each rank read its pieces of the fused tensors."""
import pytest

import oracle
import oracle_families as of
from test_dist import STEPS, assert_same_run, run, train_args
from test_pp import MB, PP, assert_same_tensors

MTS = "experts,input_linear"
FUSED = ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj",
         "shared_mlp.input_linear.weight")
LAYOUTS = {"pp2": (2, 1, [f"{PP}=2", f"{MB}=1"]),
           "pp2_zbv": (2, 1, [f"{PP}=2", f"{MB}=1", "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble"]),
           "fsdp2": (2, 2, ["--parallelism.data_parallel_shard_degree=2"])}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    d = tmp_path_factory.mktemp("granite_mts")
    case = of.CASE["granitemoeshared_aux"]
    kw = {**case.kw, "num_hidden_layers": 4, "output_router_logits": False}  # 4 stages for ZBV on PP 2
    of.save(of.build(of.Case(case.id, case.family, kw, seed=case.seed)), d / "hf")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 160, seed=7))
    return d, data


def lora(d, *extra):
    return ["--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=q_proj,v_proj", f"--lora.modules_to_save={MTS}",
            f"--checkpoint.initial_load_path={d / 'hf'}", "--checkpoint.initial_load_in_hf", "--optimizer.lr=1e-2",
            "--checkpoint.last_save_in_hf", *extra]


def one(granite, name, *extra):
    d, data = granite
    out = d / name
    if not out.exists():
        run(1, train_args(d / "hf", data, out, *lora(d, *extra)))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_modules_to_save_fused_layouts(granite, layout):
    d, data = granite
    ref = one(granite, "one")
    n, dp, extra = LAYOUTS[layout]
    out = d / layout
    run(n, train_args(d / "hf", data, out, *lora(d), *extra, dp=dp), timeout=300)
    assert_same_run(out, ref, f"GraniteMoeShared modules_to_save {layout}", weights_too=False)
    a = assert_same_tensors(out, ref, layout, "adapter_model.safetensors")
    for f in FUSED:
        assert any(k.endswith(f) for k in a), (f, sorted(a)[:12])


@pytest.mark.parametrize("layout", ["pp2", "fsdp2"])
def test_modules_to_save_fused_adapter_path(granite, layout):
    d, data = granite
    adapter = one(granite, "one") / "checkpoint" / f"step-{STEPS}"
    ref = one(granite, "one_on", f"--lora.adapter_path={adapter}")
    n, dp, extra = LAYOUTS[layout]
    out = d / f"{layout}_on"
    run(n, train_args(d / "hf", data, out, *lora(d, f"--lora.adapter_path={adapter}"), *extra, dp=dp), timeout=300)
    assert_same_run(out, ref, f"GraniteMoeShared adapter_path {layout}", weights_too=False)
    assert_same_tensors(out, ref, layout, "adapter_model.safetensors")
    # the adapter read back, not a fresh one: the first step's loss is not the base model's
    first = [[r["loss"] for r in oracle.read_metrics(o / "metrics.jsonl") if "loss" in r][0]
             for o in (one(granite, "one"), ref)]
    assert abs(first[0] - first[1]) > 1e-3 * abs(first[0]), first
