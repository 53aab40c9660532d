"""qwen2_moe with a shared expert wider and narrower than the dense MLP and the experts'
k x moe_intermediate rows, all-sparse and mixed, under every activation-checkpointing mode
(full, op, and every-2nd-layer): logits, loss and every gradient against transformers
(the commit's cases all have shared_expert_intermediate_size 40 < intermediate_size 48)."""
from __future__ import annotations

import numpy as np
import pytest

import oracle
import oracle_families as of
from conftest import hf_session_args
from test_families import TOL, _aux, _bad, _close

B = 2
BASE = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
            output_router_logits=True, router_aux_loss_coef=0.05,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4})
CASES = {
    # Is 96 > intermediate 48 > k * Im 32; layer 1 sparse, 0 and 2 dense
    "wide_mixed": dict(BASE, moe_intermediate_size=16, shared_expert_intermediate_size=96, decoder_sparse_step=2),
    # Is 96, every layer sparse (no dense layer sets the dense backward's scratch)
    "wide_all_sparse": dict(BASE, moe_intermediate_size=16, shared_expert_intermediate_size=96),
    # Is 8 < Im 16 < intermediate 48, all sparse
    "narrow_all_sparse": dict(BASE, moe_intermediate_size=16, shared_expert_intermediate_size=8),
}
AC = {
    "none": [],
    "full": ["--activation_checkpoint.mode=full"],
    "op": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"],
    "every2": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(cid):
        if cid not in cache:
            case = of.Case(f"qwen2_moe_{cid}", "qwen2_moe", CASES[cid], seed=13)
            model = of.build(case)
            cache[cid] = (case, model, of.save(model, tmp_path_factory.mktemp(cid) / "hf"))
        return cache[cid]
    return get


@pytest.mark.parametrize("ac", list(AC))
@pytest.mark.parametrize("cid", list(CASES))
def test_shared_expert_widths_match_hf(cid, ac, saved, open_session):
    case, model, d = saved(cid)
    tokens, labels = of.batch(model, B, case.T, seed=5)
    ref = of.loss_and_grads(model, case.family, tokens, labels)
    assert ref["min_gap"] > 1e-4, f"near-tie in a router's top-k ({ref['min_gap']:.2g})"
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T, extra=AC[ac]))
    err = oracle.rel_err(s.logits(tokens), ref["logits"])
    assert err <= TOL, f"logits rel err {err:.3g}"
    s.zero_grad()
    nv = oracle.n_valid(labels)
    ce = s.forward_backward(tokens, labels, nv) / nv
    assert _close(ce, ref["ce"]), f"CE {ce} vs HF {ref['ce']}"
    a = _aux(s)
    assert _close(a, ref["aux"]), f"aux {a} vs HF {ref['aux']}"
    bad = _bad({n: s.get_grad(n) for n in s.names()}, ref["grads"])
    assert not bad, "gradients differ from torch autograd:\n" + "\n".join(bad)
