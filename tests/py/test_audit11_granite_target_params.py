"""Eleventh mutation audit (stop 53): a GraniteMoE target_parameters item that names a real
parameter ctitan does not adapt is refused, not skipped.

PEFT skips an item that names no parameter of the model; one that names a parameter (here
self_attn.q_proj.weight, or the norm's weight) it wraps and trains. ctitan adapts the experts
and the router only, so it must refuse such an item: skipping it (the mutant that dropped the
`!other_param` test before the skip) trained without an adapter PEFT's run has, with a
warning only. The oracle: PEFT adapts the named parameter."""
import warnings

import pytest
from peft import LoraConfig, get_peft_model

import oracle_families as fam
from test_lora_granitemoe_unmatched_targets import ctitan_modules


@pytest.mark.parametrize("item", ["self_attn.q_proj.weight", "input_layernorm.weight"])
def test_named_parameter_not_adapted_is_refused(item, tmp_path, open_session):
    case = fam.CASE["granitemoe_aux"]
    fam.build(case).save_pretrained(tmp_path / "a")
    params = ["block_sparse_moe.experts.gate_up_proj", item]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pm = get_peft_model(fam.build(case), LoraConfig(r=2, target_modules=["v_proj"],
                                                            target_parameters=params))
            wrapped = any(item.split(".weight")[0] in n for n, _ in pm.named_modules() if "layers.0." in n
                          and "lora" in n)
        except Exception:  # PEFT refusing it (a 1-D parameter) is as good: it is no skip
            wrapped = True
    assert wrapped, f"test setup: PEFT skips {item}"
    assert ctitan_modules(open_session, tmp_path / "a", ["v_proj"], params) is None, f"{item} was skipped"
