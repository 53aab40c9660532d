"""lora.modules_to_save over GraniteMoE's fused tensors (review8), as PEFT saves them: its
ModulesToSaveWrapper copies transformers' modules, so the adapter file holds
block_sparse_moe.experts.gate_up_proj [E, 2 I, H] / down_proj, block_sparse_moe.router.weight and
shared_mlp.input_linear.weight [2 S, H], where ctitan's table holds per-expert, per-projection
tensors (and the files' router.layer.weight). PEFT's adapter read by ctitan gives PEFT's logits;
ctitan's, after an AdamW step, loads strictly in PEFT with ctitan's logits; generate --adapter and
export --merge follow PEFT. Before, ctitan refused these (or wrote names PEFT could not load)."""
import pytest
import torch
from peft import PeftModel

import oracle
import oracle_families as fam
import oracle_lora as OL
from conftest import hf_session_args
from test_families_lora import check_generate_and_merge

R, ALPHA, TOL = 4, 8.0, 1e-4
CASES = {"shared_all": ("granitemoeshared_narrow_tied", ["block_sparse_moe", "shared_mlp"]),
         "shared_parts": ("granitemoeshared_aux", ["experts", "input_linear"]),
         "router": ("granitemoe_aux", ["router"])}


@pytest.mark.parametrize("cid", list(CASES))
def test_modules_to_save_fused_as_peft(cid, tmp_path, open_session, run_ctitan):
    cname, mts = CASES[cid]
    case = fam.CASE[cname]
    hf_dir, ad, out = tmp_path / "hf", tmp_path / "ad", tmp_path / "saved"
    base = fam.build(case)
    fam.save(base, hf_dir)

    def loaded():
        return fam.prepare_loaded(fam.load(hf_dir, case.family), case.family)
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=["q_proj"], modules_to_save=mts, seed=5, std=0.5)
    assert any(".modules_to_save." in n for n, _ in pm.named_parameters()), "test setup: nothing to save"
    pm.save_pretrained(str(ad))
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    with torch.no_grad():
        ref = pm(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    extra = [f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.target_modules=q_proj",
             f"--lora.modules_to_save={','.join(mts)}", f"--lora.adapter_path={ad}", "--optimizer.lr=0.05"]
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=extra))
    err = oracle.rel_err(s.logits(tokens), ref)
    assert err <= TOL, f"ctitan with PEFT's adapter: logits rel err {err:.3g}"
    # a step moves every saved tensor; ctitan's file then loads in PEFT, every key used, with its logits
    s.zero_grad()
    s.forward_backward(tokens, labels, oracle.n_valid(labels))
    s.optimizer_step()
    s.save_adapter(out)
    back = OL.load_adapter_strict(loaded(), out)
    with torch.no_grad():
        want = back(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    got = s.logits(tokens)
    assert oracle.rel_err(got, ref) > 5 * TOL, "test setup: the step changed nothing"
    err = oracle.rel_err(got, want)
    assert err <= TOL, f"PEFT with ctitan's adapter: logits rel err {err:.3g}"
    if cid == "shared_all":
        check_generate_and_merge(run_ctitan, tmp_path, case, base, loaded(), pm, hf_dir, ad)
