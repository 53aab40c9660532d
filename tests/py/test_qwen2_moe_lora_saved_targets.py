"""The target_modules a qwen2_moe adapter is saved with (the ninth mutation audit). PEFT's
save_pretrained writes all-linear as the module names it expanded to, shared_expert_gate
among them, though the dense layers have no such module; ctitan must write the same names,
not every adapted module's full path. Its per-layer test (some layer lacks a target) counted
the dense layers' missing shared_expert_gate as a missing target when it ignored which
modules a layer has: the adapter still loaded in PEFT, so every test passed."""
import json

import oracle_families as fam
import oracle_lora as OL
from conftest import hf_session_args
from test_families_lora import lora_args, qwen2_moe_case, qwen2_moe_peft, session_matches_peft


def test_all_linear_saved_as_peft_saves_it(tmp_path, open_session):
    case, base, hf_dir, loaded = qwen2_moe_case("qwen2_moe_mlponly_norm_nobias", tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm, params = qwen2_moe_peft(loaded, "all-linear", ad, seed=5)
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args("all-linear", ad)))
    session_matches_peft(s, params, tokens, labels, ref, loaded, out)
    want = json.loads((ad / "adapter_config.json").read_text())["target_modules"]
    got = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert "shared_expert_gate" in want, want
    assert sorted(got) == sorted(want), (got, want)
