"""LoRA target_modules naming one sparse layer's shared expert by its full module path (the
ninth mutation audit): PEFT matches "model.layers.1.mlp.shared_expert.down_proj" exactly
(a key ending in the name) and adapts that module alone. The suffix lists of
test_families_lora always matched a dense layer as well, so treating a sparse layer's MLP
names as absent (module_exists without the shared expert) passed every test. ctitan, given
PEFT's adapter and the same list, must have PEFT's tensors, logits, loss and gradients."""
import oracle_families as fam
import oracle_lora as OL
from conftest import hf_session_args
from test_families_lora import ALPHA, R, lora_args, qwen2_moe_case, session_matches_peft

TARGETS = ["model.layers.1.mlp.shared_expert.down_proj", "model.layers.2.mlp.shared_expert.gate_proj"]


def test_shared_expert_by_full_name_matches_peft(tmp_path, open_session):
    case, base, hf_dir, loaded = qwen2_moe_case("qwen2_moe_mlponly_norm_nobias", tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=TARGETS, seed=5)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    # the oracle: PEFT adapts the two named shared-expert modules and nothing else
    assert sorted({n.split(".lora_")[0].split("model.layers.")[1] for n in params}) == \
        ["1.mlp.shared_expert.down_proj", "2.mlp.shared_expert.gate_proj"], sorted(params)
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(TARGETS, ad)))
    assert sorted(n for n in s.shapes if "lora_" in n) == sorted(params)
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    session_matches_peft(s, params, tokens, labels, ref, loaded, out)
