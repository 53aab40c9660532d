"""lora.target_modules = ["router"] on GraniteMoE says where the router's adapter goes (journey3).

transformers' GraniteMoE router (`block_sparse_moe.router`, GraniteMoeTopKRouter) is a
module but no Linear: PEFT refuses it as a target module by its class, and adapts it through
`target_parameters = ["block_sparse_moe.router.weight"]` (docs/lora.md). At df73325 ctitan
said only "is not a projection ctitan adapts" with a list that does not mention the router;
c31ae20 refuses it with PEFT's reason. This pins the message's content, which
test_lora_granitemoe_unmatched_targets (exit status only) does not: exit 2, the key, the
value, and the target_parameters name PEFT accepts for the router (checked here).
"""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import oracle

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("name", ["router", "block_sparse_moe.router"])
def test_router_as_target_module_points_at_target_parameters(name, run_ctitan, tmp_path):
    cfg = AutoConfig.for_model("granitemoe", vocab_size=160, hidden_size=32, intermediate_size=16,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="not supported"):
        peft.get_peft_model(AutoModelForCausalLM.from_config(cfg), peft.LoraConfig(r=2, target_modules=[name]))
    hint = "block_sparse_moe.router.weight"
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=[], target_parameters=[hint]))  # PEFT takes it

    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    rc, out, err = run_ctitan(["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'hf'}",
                               f"--training.dataset_path={data}", "--training.seq_len=16",
                               "--training.local_batch_size=2", "--lora.rank=2", f"--lora.target_modules={name}"],
                              check=False)
    assert rc == 2, out + err
    assert "lora.target_modules" in err and f'"{name}"' in err, err
    assert "target_parameters" in err and "router.weight" in err, err
