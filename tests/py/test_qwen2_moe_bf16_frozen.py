"""qwen2_moe with its base in bf16 already: training.frozen_dtype = bfloat16 (the frozen shared
expert and its [1, hidden] gate read from the bf16 store, as the dense MLP and the router are)
gives the same bits as float32 storage, with attention LoRA and with the MLPs frozen under
full recomputation, with and without mixed_precision_param = bfloat16 (test_lora_frozen's
bit-identity claim, on the family with shared experts)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import oracle_families as fam
from conftest import hf_session_args

ATTN = "--lora.target_modules=q_proj,k_proj,v_proj,o_proj"
KW = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
          shared_expert_intermediate_size=96, decoder_sparse_step=2, output_router_logits=True,
          router_aux_loss_coef=0.05, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
RUNS = {
    "attn_lora": (["--lora.rank=4", "--lora.alpha=8", ATTN, "--lora.modules_to_save=norm"],
                  "model.layers.1.self_attn.o_proj.lora_A.weight"),
    "mlp_frozen_ac_full": (["--training.freeze=model.layers.*.mlp.*", "--activation_checkpoint.mode=full"],
                           "model.layers.1.self_attn.o_proj.weight"),
    "mlp_frozen_ac_op": (["--training.freeze=model.layers.*.mlp.*", "--activation_checkpoint.mode=selective",
                          "--activation_checkpoint.selective_ac_option=op"], "model.layers.1.self_attn.o_proj.weight"),
}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "mixed_bf16"])
@pytest.mark.parametrize("run", list(RUNS))
def test_bf16_frozen_storage_is_bit_identical(run, mixed, tmp_path, open_session):
    extra, grad = RUNS[run]
    model = fam.build(fam.Case("q2m_bf16_frozen", "qwen2_moe", KW, seed=13))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    tok = rng.integers(0, V, (2, 16)).astype(np.int32)
    lab = rng.integers(0, V, (2, 16)).astype(np.int32)
    runs = []
    for fd in ("float32", "bfloat16"):
        s = open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=16,
                                         extra=extra + [f"--training.frozen_dtype={fd}"]
                                         + (["--training.mixed_precision_param=bfloat16"] if mixed else [])))
        out = []
        for _ in range(3):
            out.append(s.forward_backward(tok, lab, 32))
            out.append(s.get_grad(grad))
            out.append(s.get_grad("model.norm.weight"))
            s.optimizer_step()
        out.append(s.logits(tok))
        out += [s.get_param(n) for n in s.names()]
        runs.append(out)
        s.close()
    for i, (a, b) in enumerate(zip(*runs)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"item {i} differs between fp32 and bf16 storage"
