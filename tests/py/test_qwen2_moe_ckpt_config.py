"""Resuming a qwen2_moe checkpoint with another config.json: the refusal names the config
key that differs, as it does for intermediate_size (ckpt_check_config): qwen2_moe's q/k/v
biases are "qkv_bias" (Qwen2MoeConfig has no attention_bias), and the shared expert's width is
"shared_expert_intermediate_size" (where the tensor-shape check named a tensor instead)."""
from __future__ import annotations

import pytest

import oracle_families as fam

KW = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
          shared_expert_intermediate_size=96, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


@pytest.mark.parametrize("change,key", [(dict(shared_expert_intermediate_size=48), "shared_expert_intermediate_size"),
                                        (dict(qkv_bias=False), "qkv_bias")])
def test_resume_with_another_config_names_the_key(change, key, tmp_path, run_ctitan):
    err = fam.resume_with_other_config(tmp_path, run_ctitan, "qwen2_moe", KW, **change)
    assert f"config.json: {key} is" in err, err
