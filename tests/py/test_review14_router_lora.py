"""review14: the sigmoid routers (glm4_moe's biased, group-limited one and dots1's plain one) under a
LoRA adapter on their weight alone by PEFT's target_parameters (mlp.gate.weight, beside q_proj),
not the all-linear rewrite test_families_glm4_moe / _dots1 run: ctitan given PEFT's adapter has its
logits, loss and adapter gradients (the router's lora_A / lora_B through the sigmoid and the
renormalisation), and its saved adapter loads in PEFT (session_matches_peft)."""
import pytest
import oracle_families as of
import oracle_lora as OL
from conftest import hf_session_args
from test_families_lora import ALPHA, R, session_matches_peft


@pytest.mark.parametrize("cid", ["glm4_moe_groups_bias_qknorm", "dots1_plain_tied"])
def test_sigmoid_router_target_parameters_match_peft(cid, tmp_path, open_session):
    case = of.CASE[cid]
    base = of.build(case)
    hf_dir = of.save(base, tmp_path / "hf")

    def loaded():
        return of.prepare_loaded(of.load(hf_dir, case.family), case.family)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=["q_proj"], seed=5,
                      target_parameters=["mlp.gate.weight"])
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert any(".mlp.gate." in n for n in params)
    tokens, labels = of.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    extra = [f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.target_modules=q_proj",
             "--lora.target_parameters=mlp.gate.weight", f"--lora.adapter_path={ad}"]
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=extra))
    session_matches_peft(s, params, tokens, labels, ref, loaded, out)
