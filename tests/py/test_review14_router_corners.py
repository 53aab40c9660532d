"""review14: GLM-4.5's sigmoid, group-limited router (Glm4MoeTopkRouter, dots1's Dots1TopkRouter)
at the corners oracle_families' cases leave out, against transformers' logits, CE and every
gradient: all groups kept (topk_group == n_group > 1), k equal to the kept groups' experts (every
kept expert chosen), one group under a selection bias, and the group limit with the bias but no
renormalisation (routed_scaling_factor alone scales the weights). And a dots1 file with
output_router_logits true and router_aux_loss_coef 0.5: Dots1ForCausalLM adds no load-balancing
term, so every gradient (the routers' too) is the CE's alone."""
import dataclasses

import pytest
import torch

import oracle
import oracle_families as of
from conftest import hf_session_args
from test_families import _bad

TOL = 1e-4
B = 2
MIN_GAP = 1e-4

BASE = of.CASE["glm4_moe_groups_bias_qknorm"]  # 8 experts in 4 groups, bias std 0.1, x 2.5
CORNERS = {
    "all_groups": dict(n_group=4, topk_group=4),
    "k_fills_kept": dict(n_group=4, topk_group=2, num_experts_per_tok=4),
    "one_group_bias": dict(n_group=1, topk_group=1, num_experts_per_tok=3),
    "groups_bias_nonorm": dict(n_group=2, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False),
}


def _case(name, kw, score_bias=0.3):
    return dataclasses.replace(BASE, id=f"review14_{name}", kw={**BASE.kw, **kw}, score_bias=score_bias)


def _matches(case, family, tmp_path, open_session, seed=5):
    m = of.build(case)
    d = of.save(m, tmp_path / "hf")
    tokens, labels = of.batch(m, B, case.T, seed=seed)
    ref = of.loss_and_grads(m, family, tokens, labels)
    assert ref["min_gap"] > MIN_GAP, f"near-tie in a router's choice ({ref['min_gap']:.2g}): change the seed"
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), ref["logits"])
    assert err <= TOL, f"logits rel err {err:.3g}"
    s.zero_grad()
    nv = oracle.n_valid(labels)
    ce = s.forward_backward(tokens, labels, nv) / nv
    assert abs(ce - ref["loss"]) <= TOL * abs(ref["loss"]), (ce, ref["loss"])
    bad = _bad({n: s.get_grad(n) for n in s.names()}, ref["grads"])
    assert not bad, "gradients differ from torch autograd:\n" + "\n".join(bad)
    return m, s


@pytest.mark.parametrize("name", list(CORNERS))
def test_glm4_moe_router_corner_matches_transformers(name, tmp_path, open_session):
    case = _case(name, CORNERS[name])
    m, _ = _matches(case, "glm4_moe", tmp_path, open_session)
    # the corner is live: the setting moves transformers' own logits (else a ctitan ignoring it passes)
    tokens, _ = of.batch(m, B, case.T, seed=5)
    # all groups kept is no group limit by design: there, a router keeping one group fewer must differ
    plain = dict(topk_group=3) if name == "all_groups" else dict(n_group=1, topk_group=1, norm_topk_prob=True)
    if name == "one_group_bias":
        other = of.build(_case(name, CORNERS[name], score_bias=0.0))
    else:
        other = of.build(_case(name, {**CORNERS[name], **plain}))
        with torch.no_grad():  # the same weights and bias, the default router settings
            other.load_state_dict(m.state_dict())
    assert oracle.rel_err(of.logits(other, "glm4_moe", tokens), of.logits(m, "glm4_moe", tokens)) > 100 * TOL


def test_dots1_output_router_logits_adds_no_aux_gradient(tmp_path, open_session):
    case = dataclasses.replace(of.CASE["dots1_groups_bias_swa5"], id="review14_dots1_orl",
                               kw={**of.CASE["dots1_groups_bias_swa5"].kw, "output_router_logits": True,
                                   "router_aux_loss_coef": 0.5})
    m = of.build(case)
    assert m.config.output_router_logits is True
    _, s = _matches(case, "dots1", tmp_path, open_session)
    # (ctitan_aux_loss still reports load_balancing_loss_func as a statistic: the gradients above
    # are what says no router_aux_loss_coef * aux term was added)
