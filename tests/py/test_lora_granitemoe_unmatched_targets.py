"""GraniteMoE(Shared): a target_modules entry that selects no module beside one that matches is
skipped, as PEFT skips it; one that selects a module that is no Linear (the MoE block, its router
or experts, the shared MLP as a whole) is refused, as PEFT refuses it; the same for
target_parameters items that name no parameter. Expected outcomes come from PEFT's
get_peft_model on transformers' model of the same config."""
import warnings

import pytest
from peft import LoraConfig, get_peft_model

import oracle_families as fam
from conftest import CtitanError, hf_session_args

TARGETS = [["q_proj", "foo"], ["q_proj", "gate_proj"], ["q_proj", "router"], ["q_proj", "experts"],
           ["q_proj", "input_linear"], ["q_proj", "output_linear"], ["q_proj", "block_sparse_moe"],
           ["q_proj", "shared_mlp"], ["q_proj", "mlp"], ["v_proj", "model"], ["foo"], ["gate_proj"],
           ["q_proj", "layers.0.self_attn.x_proj"], ["q_proj", "model.layers.9.self_attn.q_proj"]]
PARAMS = [["block_sparse_moe.experts.gate_up_proj", "foo.weight"], ["block_sparse_moe.input_linear.weight"],
          ["foo.weight"], ["block_sparse_moe.router.layer.weight", "nothing"]]


def peft_modules(case, targets, params):
    """The module names PEFT adapts in layer 0, or None where get_peft_model raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = get_peft_model(fam.build(case), LoraConfig(r=2, target_modules=targets, target_parameters=params))
    except ValueError:  # NoMatchingPeftModuleError is one
        return None
    return {n.split("layers.0.")[1].split(".lora_")[0] for n, _ in pm.named_parameters()
            if "lora_A" in n and "layers.0." in n}


def ctitan_modules(open_session, hf, targets, params):
    extra = ["--lora.rank=2", "--lora.target_modules=" + ",".join(targets)]
    if params:
        extra.append("--lora.target_parameters=" + ",".join(params))
    try:
        s = open_session(hf_session_args(hf, extra=extra))
    except CtitanError:
        return None
    return {n.split("layers.0.")[1].split(".lora_")[0] for n in s.names() if "lora_A" in n and "layers.0." in n}


@pytest.mark.parametrize("name", ["granitemoe_aux", "granitemoeshared_aux"])
def test_unmatched_targets_as_peft(name, tmp_path, open_session):
    case = fam.CASE[name]
    fam.build(case).save_pretrained(tmp_path / "a")
    cases = [(t, None) for t in TARGETS] + [(["q_proj"], p) for p in PARAMS]
    for targets, params in cases:
        want = peft_modules(case, targets, params)
        got = ctitan_modules(open_session, tmp_path / "a", targets, params)
        if want is None or got is None:
            assert (want is None) == (got is None), f"{targets} {params}: PEFT {want}, ctitan {got}"
        else:
            # ctitan names the experts' adapters per parameter (experts.gate_up_proj.lora_A)
            got = {g.split(".gate_up_proj")[0].split(".down_proj")[0] for g in got}
            assert got == want, f"{targets} {params}: PEFT adapts {want}, ctitan {got}"


def test_peft_adapter_with_unmatched_names_reads_in_ctitan(tmp_path, open_session):
    """PEFT saves target_modules / target_parameters as given, unmatched names included: ctitan
    reads such an adapter (the names skipped as PEFT skips them) and gives PEFT's logits."""
    import torch
    import oracle
    import oracle_lora as OL
    case = fam.CASE["granitemoeshared_aux"]
    hf = tmp_path / "a"
    fam.build(case).save_pretrained(hf)
    pm = OL.make_peft(fam.prepare_loaded(fam.load(hf, case.family), case.family), r=2, alpha=4.0,
                      targets=["q_proj", "foo", "input_linear"],
                      target_parameters=["block_sparse_moe.experts.down_proj", "mlp.gate.weight"], seed=5)
    pm.save_pretrained(str(tmp_path / "ad"))
    tokens, _ = fam.batch(fam.build(case), 2, case.T, seed=5)
    with torch.no_grad():
        want = pm(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    s = open_session(hf_session_args(hf, batch=2, seq_len=case.T, extra=[
        "--lora.rank=2", "--lora.alpha=4", "--lora.target_modules=q_proj,input_linear",
        "--lora.target_parameters=block_sparse_moe.experts.down_proj", f"--lora.adapter_path={tmp_path / 'ad'}"]))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= 1e-4, f"logits rel err {err:.3g}"
