"""FlexOlmo (FlexOlmoForCausalLM) beyond oracle_families' shared checks: what each of its
features does in transformers itself (so a ctitan that drops one fails the parity tests),
FlexOlmoConfig's defaults read from a file that leaves the keys out, clip_qkv (a key
FlexOlmoConfig does not have) left inert as there, a resume with another norm_topk_prob refused
by name, mistakes a port could make caught by the parity check, and bf16 against the emulation
of ctitan's semantics. Expected values come from transformers' FlexOlmoConfig /
FlexOlmoForCausalLM only.

FlexOlmoDecoderLayer is OLMo2's post-norm layer around OLMoE's sparse block:
  h   = x + post_attention_layernorm(attn(x))       (q_norm / k_norm over the whole projections)
  out = h + post_feedforward_layernorm(moe(h))       (softmax top-k router, experts, no pre-norm)
and its aux loss is OLMoE's load_balancing_loss_func (the same code in both modules)."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import torch

import oracle
import oracle_families as of
from conftest import hf_session_args

FAMILY = "flex_olmo"
TOL = 1e-4
B = 2
AUX, TIED = "flex_olmo_aux_hd16", "flex_olmo_norm_topk_tied"


def _identity(x):
    return x


def _logits_with(case, edit=None, kw=None, tokens=None):
    """transformers' logits of the case's model after edit(model) (and with config kwargs kw
    on top of the case's), on tokens (default: the case's batch, seed 5)."""
    m = of.build(dataclasses.replace(case, kw={**case.kw, **(kw or {})}))
    if edit:
        edit(m)
    if tokens is None:
        tokens, _ = of.batch(m, B, case.T, seed=5)
    return of.logits(m, FAMILY, tokens)


def _no_norm(which):
    """A model edit: layer norm `which` (post_attention_layernorm, post_feedforward_layernorm,
    self_attn.q_norm / k_norm) replaced by the identity in every layer."""
    def edit(m):
        for layer in m.model.layers:
            mod = layer
            for part in which.split("."):
                mod = getattr(mod, part)
            mod.forward = _identity
    return edit


def _moe_pre_norm(m):
    """OLMoE's order around the sparse block: the norm before it (mlp(norm(h))), the same
    weights, instead of FlexOlmo's norm on its output."""
    for layer in m.model.layers:
        mlp, norm = layer.mlp, layer.post_feedforward_layernorm
        layer.mlp.forward = lambda x, f=mlp.forward, n=norm.__class__.forward, nm=norm: f(n(nm, x))
        norm.forward = _identity


def _per_head_qk(m):
    """q_norm / k_norm applied over each head_dim slice (Qwen3's per-head norm) with the same
    weights, instead of over the whole projection."""
    hd = m.model.layers[0].self_attn.head_dim  # head_dim's default: hidden_size / heads
    for layer in m.model.layers:
        att = layer.self_attn
        for norm in (att.q_norm, att.k_norm):
            def fwd(x, w=norm.weight, eps=norm.variance_epsilon):
                xs = x.float().reshape(*x.shape[:-1], -1, hd)
                xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
                return w * xs.reshape(x.shape)
            norm.forward = fwd


def test_oracle_flex_olmo_features_move_the_model():
    """Each feature moves transformers' logits by far more than the tests' tolerance: the
    norm on the attention output, the norm on the sparse block's output (and where it sits:
    OLMoE's pre-norm order), the whole-projection q/k norms (and computing them per head),
    the attention biases; router_aux_loss_coef moves the loss. clip_qkv, which FlexOlmoConfig
    does not declare, moves nothing (ctitan accepts it so).
    norm_topk_prob divides each token's branch by the sum of its top-k weights, one number
    that post_feedforward_layernorm cancels up to its eps: at FlexOlmoConfig's eps 1e-6 (the
    aux case) flipping it moves the logits by under 1e-3 only, at the tied case's 1e-3 by far
    more; ctitan computes it either way (the parity tests run both cases)."""
    for cid in (AUX, TIED):
        case = of.CASE[cid]
        want = _logits_with(case)
        edits = {"no post_attention_layernorm": _no_norm("post_attention_layernorm"),
                 "no post_feedforward_layernorm": _no_norm("post_feedforward_layernorm"),
                 "the MoE's norm before it (OLMoE's order)": _moe_pre_norm,
                 "no q_norm": _no_norm("self_attn.q_norm"), "no k_norm": _no_norm("self_attn.k_norm"),
                 "per-head q/k norms": _per_head_qk}
        for name, edit in edits.items():
            err = oracle.rel_err(_logits_with(case, edit), want)
            assert err > 100 * TOL, f"{cid}: {name} moves the logits by only {err:.3g}"
        assert oracle.rel_err(_logits_with(case, kw=dict(clip_qkv=0.05)), want) == 0.0, "clip_qkv is read"
    flip = {}
    for cid in (AUX, TIED):
        case = of.CASE[cid]
        flip[cid] = oracle.rel_err(_logits_with(case, kw=dict(norm_topk_prob=not case.kw["norm_topk_prob"])),
                                   _logits_with(case))
    assert of.CASE[AUX].kw.get("rms_norm_eps") is None and flip[AUX] < 1e-3, flip  # the default eps: inert
    assert of.CASE[TIED].kw["rms_norm_eps"] == 1e-3 and flip[TIED] > 1000 * TOL, flip
    case = of.CASE[AUX]
    err = oracle.rel_err(_logits_with(case, of.zero_biases("q_proj", "k_proj", "v_proj", "o_proj")),
                         _logits_with(case))
    assert err > 100 * TOL, f"attention biases move the logits by only {err:.3g}"
    m = of.build(case)
    tokens, labels = of.batch(m, B, case.T, seed=5)
    ref = of.loss_and_grads(m, FAMILY, tokens, labels)
    assert ref["aux"] is not None and ref["loss"] - ref["ce"] > 100 * TOL * ref["loss"]


def test_oracle_flex_olmo_shapes():
    """q_norm spans heads x head_dim (64 with head_dim 16, not hidden_size 32 as OLMoE's),
    k_norm kv heads x head_dim; no input_layernorm; the experts intermediate_size wide."""
    m = of.build(of.CASE[AUX])
    c, layer = m.config, m.model.layers[0]
    assert tuple(layer.self_attn.q_norm.weight.shape) == (c.num_attention_heads * c.head_dim,) == (64,)
    assert tuple(layer.self_attn.k_norm.weight.shape) == (c.num_key_value_heads * c.head_dim,)
    assert not hasattr(layer, "input_layernorm")
    assert tuple(layer.mlp.experts.down_proj.shape) == (c.num_experts, c.hidden_size, c.intermediate_size)


def test_flex_olmo_defaults(tmp_path, open_session, run_ctitan):
    """A file with only the sizes (and a pad token inside the tiny vocabulary):
    FlexOlmoConfig's 7 experts, 5 per token, no renormalisation, router_aux_loss_coef 0.01,
    rms_norm_eps 1e-6, theta 5e5, kv heads = heads. ctitan's logits equal transformers' on
    the model loaded from it, describe reads the same experts and parameter count, and its
    export writes back what transformers read. Without pad_token_id the default 100277 is
    outside the vocabulary: refused, naming it (nn.Embedding refuses it in transformers)."""
    from transformers import AutoConfig, FlexOlmoForCausalLM
    case = of.CASE[AUX]
    conf = {"model_type": FAMILY, "architectures": ["FlexOlmoForCausalLM"], "vocab_size": 160, "hidden_size": 32,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 128, "pad_token_id": 1}
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    assert (hf.num_experts, hf.num_experts_per_tok, hf.norm_topk_prob) == (7, 5, False)
    assert (hf.router_aux_loss_coef, hf.rms_norm_eps, hf.num_key_value_heads) == (0.01, 1e-6, 4)
    assert hf.rope_parameters["rope_theta"] == 5e5
    hf._attn_implementation = "eager"
    model = FlexOlmoForCausalLM(hf).float()
    of.init_weights(model, FAMILY, 3)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(conf))  # save_pretrained wrote every key
    ref = of.load(d, FAMILY)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, FAMILY, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    _, out, _ = run_ctitan(["describe", d, "--config-out", d / "out.json"])
    assert "experts: 5 of 7 per token, 8 wide" in out, out
    n = sum(p.numel() for p in ref.parameters())
    assert re.search(rf"parameters: {n} ", out), f"HF has {n} parameters:\n{out}"
    back = json.loads((d / "out.json").read_text())
    for k in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef", "pad_token_id",
              "rms_norm_eps", "num_key_value_heads", "intermediate_size", "output_router_logits"):
        assert back.get(k, "<absent>") == getattr(hf, k), f"{k} = {back.get(k)!r}, transformers {getattr(hf, k)!r}"
    assert back["rope_parameters"]["rope_theta"] == hf.rope_parameters["rope_theta"]
    for k in ("moe_intermediate_size", "mlp_only_layers", "clip_qkv"):  # FlexOlmoConfig has none of them
        assert k not in back, k

    del conf["pad_token_id"]
    (d / "config.json").write_text(json.dumps(conf))
    rc, _, err = run_ctitan(["describe", d], check=False)
    assert rc != 0 and "pad_token_id" in err and "100277" in err, err


def test_flex_olmo_clip_qkv_is_inert(tmp_path, open_session):
    """A FlexOlmo file that carries clip_qkv (an OLMoE key): FlexOlmoAttention clamps nothing,
    so ctitan opens it and gives transformers' logits (OLMoE refuses it: it clamps there)."""
    case = of.CASE[AUX]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    conf = of.config_json(d)
    conf["clip_qkv"] = 0.05
    (d / "config.json").write_text(json.dumps(conf))
    ref = of.load(d, FAMILY)
    assert getattr(ref.config, "clip_qkv", None) == 0.05
    tokens, _ = of.batch(model, B, case.T, seed=5)
    got = open_session(hf_session_args(d, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got, of.logits(ref, FAMILY, tokens)) <= TOL


def test_flex_olmo_resume_with_other_norm_topk_prob_names_it(tmp_path, run_ctitan):
    err = of.resume_with_other_config(tmp_path, run_ctitan, FAMILY, of.CASE[TIED].kw, norm_topk_prob=False)
    assert "config.json: norm_topk_prob is" in err, err


def test_flex_olmo_planted_mistakes_are_caught(tmp_path, open_session):
    """The parity check catches what a slip would compute: ctitan's logits on each case
    equal transformers' within TOL, and lie far (> 100 TOL) from transformers with the MoE's
    norm dropped, moved before the block (OLMoE's order), the attention's norm dropped,
    per-head q/k norms, and (the tied case, where it is not cancelled) norm_topk_prob flipped."""
    for cid in (AUX, TIED):
        case = of.CASE[cid]
        model = of.build(case)
        d = of.save(model, tmp_path / cid)
        tokens, _ = of.batch(model, B, case.T, seed=5)
        got = open_session(hf_session_args(d, batch=B, seq_len=case.T)).logits(tokens)
        assert oracle.rel_err(got, of.logits(model, FAMILY, tokens)) <= TOL
        slips = {"no MoE post-norm": (_no_norm("post_feedforward_layernorm"), None),
                 "MoE pre-norm": (_moe_pre_norm, None),
                 "no attention post-norm": (_no_norm("post_attention_layernorm"), None),
                 "per-head q/k norms": (_per_head_qk, None)}
        if cid == TIED:
            slips["norm_topk_prob flipped"] = (None, dict(norm_topk_prob=False))
        for name, (edit, kw) in slips.items():
            err = oracle.rel_err(got, _logits_with(case, edit, kw, tokens))
            assert err > 100 * TOL, f"{cid}, {name}: ctitan's logits are within {err:.3g} of it"
        assert np.isfinite(got).all()


def test_flex_olmo_bf16_like_emulation(tmp_path, open_session):
    """training.mixed_precision_param = bfloat16 on the post-normed sparse layers: against
    test_moe's emulation of ctitan's bf16 semantics (every linear, the experts' and the
    router's alike, rounds x, w and d(out) to bf16; bf16 attention), with
    test_bf16.assert_like_emulation's bounds."""
    # the aux case without its attention biases (test_moe's emulation rounds bias-free linears);
    # the tied case's layer 2 leaves an expert without tokens in this batch (no gradient to compare)
    case = dataclasses.replace(of.CASE[AUX], kw={**of.CASE[AUX].kw, "attention_bias": False})
    of.assert_moe_bf16_like_emulation(tmp_path, open_session, case, B)
