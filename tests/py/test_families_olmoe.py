"""OLMoE (OlmoeForCausalLM) beyond oracle_families' shared checks: what each of its options
does in transformers itself (so a ctitan that drops one fails the parity tests), OlmoeConfig's
defaults read from a file that leaves the keys out, the parameter count against the model
transformers builds, and a resume with another norm_topk_prob refused by name. Expected
values come from transformers' OlmoeConfig / OlmoeForCausalLM only."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import torch

import oracle
import oracle_families as of
from conftest import hf_session_args

TOL = 1e-4
B = 2


def _moved(case, kw, seed=5):
    a = of.build(case)
    tokens, labels = of.batch(a, B, case.T, seed=seed)
    b = of.build(dataclasses.replace(case, kw={**case.kw, **kw}))
    return oracle.rel_err(of.logits(b, case.family, tokens), of.logits(a, case.family, tokens))


def test_oracle_olmoe_options_change_the_model():
    """norm_topk_prob flipped, and clip_qkv (which ctitan refuses) set, each move transformers'
    logits by far more than the tests' tolerance; router_aux_loss_coef moves its loss."""
    for cid in ("olmoe_aux_bias", "olmoe_norm_topk_tied"):
        case = of.CASE[cid]
        err = _moved(case, dict(norm_topk_prob=not case.kw["norm_topk_prob"]))
        assert err > 100 * TOL, f"{cid}: norm_topk_prob flipped moves the logits by only {err:.3g}"
        err = _moved(case, dict(clip_qkv=0.05))
        assert err > 100 * TOL, f"{cid}: clip_qkv 0.05 moves the logits by only {err:.3g}"
    case = of.CASE["olmoe_aux_bias"]
    m = of.build(case)
    tokens, labels = of.batch(m, B, case.T, seed=5)
    ref = of.loss_and_grads(m, case.family, tokens, labels)
    assert ref["aux"] is not None and ref["loss"] - ref["ce"] > 100 * TOL * ref["loss"]


def test_oracle_olmoe_qk_norm_spans_the_projection():
    """OlmoeAttention's q_norm / k_norm are one RMSNorm over all heads of a token (hidden_size
    and kv heads x head_dim wide), not per head: the saved weights have those shapes."""
    m = of.build(of.CASE["olmoe_aux_bias"])
    c = m.config
    hd = c.hidden_size // c.num_attention_heads
    att = m.model.layers[0].self_attn
    assert tuple(att.q_norm.weight.shape) == (c.hidden_size,)
    assert tuple(att.k_norm.weight.shape) == (c.num_key_value_heads * hd,)


def test_olmoe_defaults(tmp_path, open_session, run_ctitan):
    """A file with only the sizes: OlmoeConfig's 64 experts, 8 per token, no renormalisation,
    router_aux_loss_coef 0.01, pad_token_id 1, rms_norm_eps 1e-5, theta 1e4. ctitan's logits
    equal transformers' on the model loaded from it, describe reads the same experts, and its
    export writes back what transformers read."""
    from transformers import AutoConfig
    case = of.CASE["olmoe_aux_bias"]
    conf = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": 160, "hidden_size": 32,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 128}
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    assert (hf.num_experts, hf.num_experts_per_tok, hf.norm_topk_prob, hf.pad_token_id) == (64, 8, False, 1)
    from transformers import OlmoeForCausalLM
    hf._attn_implementation = "eager"
    model = OlmoeForCausalLM(hf).float()
    of.init_weights(model, "olmoe", 3)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(conf))  # save_pretrained wrote every key
    ref = of.load(d, "olmoe")
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, "olmoe", tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    _, out, _ = run_ctitan(["describe", d, "--config-out", d / "out.json"])
    assert "experts: 8 of 64 per token, 8 wide" in out, out
    n = sum(p.numel() for p in ref.parameters())
    assert re.search(rf"parameters: {n} ", out), f"HF has {n} parameters:\n{out}"
    back = json.loads((d / "out.json").read_text())
    for k in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef", "pad_token_id",
              "rms_norm_eps", "num_key_value_heads", "intermediate_size", "clip_qkv", "output_router_logits"):
        assert back.get(k, "<absent>") == getattr(hf, k), f"{k} = {back.get(k)!r}, transformers {getattr(hf, k)!r}"
    assert back["rope_parameters"]["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert "moe_intermediate_size" not in back and "mlp_only_layers" not in back  # OlmoeConfig has neither


def test_olmoe_resume_with_other_norm_topk_prob_names_it(tmp_path, run_ctitan):
    err = of.resume_with_other_config(tmp_path, run_ctitan, "olmoe", of.CASE["olmoe_norm_topk_tied"].kw,
                                      norm_topk_prob=False)
    assert "config.json: norm_topk_prob is" in err, err


def test_olmoe_planted_mistakes_are_caught(tmp_path, open_session):
    """The parity check catches what a slip would compute: ctitan's logits on the olmoe case
    against transformers with norm_topk_prob flipped, and with q_norm / k_norm computed per
    head (OLMo3's weights reshaped), differ by far more than the tolerance."""
    case = of.CASE["olmoe_aux_bias"]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    tokens, _ = of.batch(model, B, case.T, seed=5)
    got = open_session(hf_session_args(d, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got, of.logits(model, "olmoe", tokens)) <= TOL
    flipped = of.build(dataclasses.replace(case, kw={**case.kw, "norm_topk_prob": True}))
    assert oracle.rel_err(got, of.logits(flipped, "olmoe", tokens)) > 100 * TOL

    # per-head q/k norms: the same weights applied over each head_dim slice
    per_head = of.build(case)
    c = per_head.config
    hd = c.hidden_size // c.num_attention_heads
    for layer in per_head.model.layers:
        att = layer.self_attn
        for norm in (att.q_norm, att.k_norm):
            w, eps = norm.weight, norm.variance_epsilon

            def fwd(x, w=w, eps=eps):
                xs = x.float().reshape(*x.shape[:-1], -1, hd)
                xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
                return w * xs.reshape(x.shape)
            norm.forward = fwd
    err = oracle.rel_err(got, of.logits(per_head, "olmoe", tokens))
    assert err > 100 * TOL, f"per-head q/k norms move the logits by only {err:.3g}"
    assert np.isfinite(got).all()
