"""DualPipeV in the layouts test_pp_zero_bubble's one-process runs leave out (review9):

1. A full checkpoint written at step 4 under DualPipeV (the V: rank 0 holds stages 0 and 3, the
   lm_head) resumed under 1F1B (rank 1 holds the lm_head), and one written under 1F1B resumed
   under DualPipeV: each rank loads its new stages' units; steps 5-10 and the final weights
   equal one process's.
2. Qwen3-MoE under expert parallel 2 x FSDP 2 x PP 2 (4 ranks), and with HF's aux loss in the
   gradient under context parallel 2 x PP 2 (the expert counts summed over the chunks on the
   last stage and sent back with whole backwards and I's alike): like one process.
3. LoRA (dropout 0.1) over a bf16-stored frozen base (training.frozen_dtype): I has everything
   to do, W nothing; the adapter equals one process's."""
import pytest

from test_dist import STEPS, assert_same_run, run, train_args
from test_pp import (MB, PP, SCHED, assert_same_tensors, aux_single, lora_args, lora_model, setup,  # noqa: F401
                     single)

DPV = f"{SCHED}=DualPipeV"
FULL = "--checkpoint.last_save_model_only=false"


@pytest.mark.parametrize("first,then", [("DualPipeV", "1F1B"), ("1F1B", "DualPipeV")])
def test_resume_across_dualpipev(setup, single, first, then):
    d, data = setup
    ref = single("model", FULL)
    out = d / f"r9_{first}_to_{then}"
    p = run(2, train_args(d / "model", data, out, f"{PP}=2", f"{SCHED}={first}", f"{MB}=1", FULL,
                          "--training.stop_at_step=4"), check=False)
    assert p.returncode == 75, p.stderr[-3000:]
    p = run(2, train_args(d / "model", data, out, f"{PP}=2", f"{SCHED}={then}", f"{MB}=1", FULL))
    assert "resuming from" in p.stderr and "step-4" in p.stderr, p.stderr[-3000:]
    assert_same_run(out, ref, f"{first} -> {then}", steps=range(5, STEPS + 1))


def test_dualpipev_ep2_fsdp2(setup, single):
    d, data = setup
    ref = single("model_moe")
    out = d / "r9_dpv_ep2"
    run(4, train_args(d / "model_moe", data, out, f"{PP}=2", DPV, f"{MB}=1", "--parallelism.expert_parallel_degree=2",
                      "--parallelism.data_parallel_shard_degree=2", dp=2), timeout=300)
    assert_same_run(out, ref, "DualPipeV EP 2 x FSDP 2")


def test_dualpipev_cp2_moe_aux(setup, single):
    d, data = setup
    ref = aux_single(single, "model_moe_aux", 1)
    out = d / "r9_dpv_cp2_aux"
    run(4, train_args(d / "model_moe_aux", data, out, f"{PP}=2", DPV, f"{MB}=1",
                      "--parallelism.context_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"),
        timeout=300)
    assert_same_run(out, ref, "DualPipeV CP 2 aux loss")


def test_dualpipev_lora_bf16_frozen_base(setup):
    d, data = setup
    model = lora_model(setup)
    lora = lora_args(model, 0.1) + ["--checkpoint.last_save_in_hf", "--training.frozen_dtype=bfloat16"]
    ref, out = d / "r9_lora_bf16_one", d / "r9_lora_bf16_dpv"
    run(1, train_args(model, data, ref, *lora))
    run(2, train_args(model, data, out, *lora, f"{PP}=2", DPV, f"{MB}=2"))
    assert_same_run(out, ref, "DualPipeV LoRA, bf16 frozen base", weights_too=False)
    assert_same_tensors(out, ref, "DualPipeV LoRA, bf16 frozen base", "adapter_model.safetensors")
