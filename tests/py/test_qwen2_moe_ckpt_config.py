"""Resuming a qwen2_moe checkpoint with another config.json: the refusal names the config
key that differs, as it does for intermediate_size (ckpt_check_config): qwen2_moe's q/k/v
biases are "qkv_bias" (Qwen2MoeConfig has no attention_bias), and the shared expert's width is
"shared_expert_intermediate_size" (where the tensor-shape check named a tensor instead)."""
from __future__ import annotations

import pytest

import oracle
import oracle_families as fam

KW = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
          shared_expert_intermediate_size=96, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


@pytest.mark.parametrize("change,key", [(dict(shared_expert_intermediate_size=48), "shared_expert_intermediate_size"),
                                        (dict(qkv_bias=False), "qkv_bias")])
def test_resume_with_another_config_names_the_key(change, key, tmp_path, run_ctitan):
    fam.make_config(fam.Case("a", "qwen2_moe", KW)).save_pretrained(tmp_path / "a")
    fam.make_config(fam.Case("b", "qwen2_moe", dict(KW, **change))).save_pretrained(tmp_path / "b")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    args = ["train", "--model.spec=hf", f"--training.dataset_path={data}", "--training.seq_len=16",
            "--training.local_batch_size=2", "--training.steps=4", "--checkpoint.enable", "--checkpoint.interval=2",
            "--checkpoint.last_save_model_only=false", f"--job.dump_folder={tmp_path / 'o'}"]
    rc, _, err = run_ctitan(args + [f"--model.hf_assets_path={tmp_path / 'a'}", "--training.stop_at_step=2"],
                            check=False)
    assert rc == 75, err
    rc, _, err = run_ctitan(args + [f"--model.hf_assets_path={tmp_path / 'b'}"], check=False)
    assert rc != 0
    assert f"config.json: {key} is" in err, err
