"""Ministral 3 (ministral3: mistralai/Ministral-3-3B/8B/14B): what sets it apart from Mistral,
shown to matter in transformers itself, and the config keys ctitan must read as
Ministral3Config and Ministral3Attention do.

- Ministral3Attention multiplies q, after RoPE, by get_llama_4_attn_scale:
  1 + beta * log(1 + floor(pos / L)), beta = rope_parameters["llama_4_scaling_beta"],
  L = rope_parameters["original_max_position_embeddings"]; k is not scaled. Both keys are read
  from the rope_parameters dict (a missing one fails in transformers' forward).
- The scale is 1 below L: tests need positions past it (the case's L = 4 under T = 16).

ctitan folds the scale into q's own cos/sin tables (RoPE is linear), so the backward's rope_bwd
by the same tables gives d(q). The logits, gradients, AdamW steps, export, AC, generate (KV
cache), LoRA, bf16, TP 2, CP 2 and PP 2 are tested with every family (oracle_families'
ministral3_yarn_qscale case); here, that transformers' model depends on what the tables carry,
that each planted mistake in them moves the logits by more than the tolerance, the q scale
with default RoPE (independent of yarn), refusals and resume."""
import json

import pytest
import torch

import oracle
import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families import B, TOL

M3 = of.CASE["ministral3_yarn_qscale"]
# default RoPE: the q scale alone (original_max_position_embeddings is then read by nothing else)
DEFAULT = of.Case("ministral3_default_qscale", "ministral3", dict(
    num_hidden_layers=2, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "original_max_position_embeddings": 3,
        "llama_4_scaling_beta": 0.5}))


def _rp(case, **kw):
    return of.Case(case.id, case.family, dict(case.kw, rope_parameters=dict(case.kw["rope_parameters"], **kw)),
                   T=case.T, seed=case.seed)


def _logits(case, patch=None):
    m = of.build(case)
    tokens, _ = of.batch(m, B, case.T, seed=5)
    import transformers.models.ministral3.modeling_ministral3 as mm
    saved = mm.get_llama_4_attn_scale, mm.apply_rotary_pos_emb
    try:
        if patch:
            patch(mm)
        with torch.no_grad():
            return of.logits(m, case.family, tokens)
    finally:
        mm.get_llama_4_attn_scale, mm.apply_rotary_pos_emb = saved


def _no_floor(mm):
    mm.get_llama_4_attn_scale = lambda p, beta, L: (1 + beta * torch.log(1 + p / L))[:, None, :, None]


def _k_too(mm):
    """k scaled as q is: apply_rotary_pos_emb's k by the same scale (positions 0 .. T-1)"""
    rot, scale = mm.apply_rotary_pos_emb, mm.get_llama_4_attn_scale
    rp = M3.kw["rope_parameters"]

    def both(q, k, cos, sin, *a, **kw):
        q, k = rot(q, k, cos, sin, *a, **kw)
        pos = torch.arange(k.shape[2])[None]
        return q, k * scale(pos, rp["llama_4_scaling_beta"], rp["original_max_position_embeddings"]).to(k.dtype)
    mm.apply_rotary_pos_emb = both


def _off(mm):
    mm.get_llama_4_attn_scale = lambda p, beta, L: torch.ones(p.shape)[:, None, :, None]


def _assert_like_torch(s, tokens, labels, ref):
    """ctitan's session s gives transformers' logits, loss and every gradient (ref:
    oracle_families.loss_and_grads) to TOL."""
    err = oracle.rel_err(s.logits(tokens), ref["logits"])
    assert err <= TOL, f"logits rel err {err:.3g}"
    s.zero_grad()
    nv = oracle.n_valid(labels)
    ce = s.forward_backward(tokens, labels, nv) / nv
    assert abs(ce - ref["ce"]) <= TOL * abs(ref["ce"]), (ce, ref["ce"])
    bad = [f"{n}: {oracle.rel_err(s.get_grad(n), g):.3g}" for n, g in sorted(ref["grads"].items())
           if not oracle.rel_err(s.get_grad(n), g) <= TOL]
    assert not bad, "gradients differ from torch autograd:\n" + "\n".join(bad)


@pytest.mark.parametrize("what", ["beta0", "length64", "no_floor", "k_too", "scale_off"])
def test_oracle_q_scale_matters(what):
    """transformers' own logits move by far more than the tolerance when beta is 0, the
    original length covers the sequence, the floor is dropped, k is scaled as well, or the
    scale is skipped: a ctitan that did any of these fails the family tests. (A scale skipped
    only in the backward or the KV cache is test_families' gradients and
    test_families_generate's cached logits; on CP's positions, test_families_cp.)"""
    base = _logits(M3)
    if what == "beta0":
        other = _logits(_rp(M3, llama_4_scaling_beta=0.0))
    elif what == "length64":  # for the default-RoPE case, whose RoPE does not read the length
        base = _logits(DEFAULT)
        other = _logits(_rp(DEFAULT, original_max_position_embeddings=64))
    else:
        other = _logits(M3, {"no_floor": _no_floor, "k_too": _k_too, "scale_off": _off}[what])
    err = oracle.rel_err(other, base)
    assert err > 100 * TOL, f"{what}: moves the logits by only {err:.3g}"


def test_default_rope_q_scale(tmp_path, open_session):
    """The q scale without yarn: logits, loss and every gradient against torch autograd."""
    model = of.build(DEFAULT)
    d = of.save(model, tmp_path / "hf")
    tokens, labels = of.batch(model, B, DEFAULT.T, seed=5)
    ref = of.loss_and_grads(model, DEFAULT.family, tokens, labels)
    _assert_like_torch(open_session(hf_session_args(d, batch=B, seq_len=DEFAULT.T)), tokens, labels, ref)


@pytest.mark.parametrize("drop", ["llama_4_scaling_beta", "original_max_position_embeddings"])
def test_missing_key_refused(drop, tmp_path, open_session):
    """transformers fails without either key in rope_parameters (Ministral3Attention reads
    both there); ctitan refuses both naming the key."""
    d = of.save(of.build(DEFAULT), tmp_path / "hf")
    conf = of.config_json(d)
    conf["rope_parameters"].pop(drop)
    (d / "config.json").write_text(json.dumps(conf))
    from transformers import AutoConfig, AutoModelForCausalLM
    with pytest.raises(Exception):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    msg = str(ei.value)
    assert drop in msg and "config.json" in msg, msg


def test_describe_and_import_help(tmp_path, run_ctitan):
    d = of.save(of.build(M3), tmp_path / "hf")
    _, out, _ = run_ctitan(["describe", d])
    assert "q scale: q times 1 + 0.3 log(1 + floor(pos / 4))" in out, out
    _, out, _ = run_ctitan(["import", "--help"])
    assert "ministral3" in out, out


@pytest.mark.parametrize("edit", [{"llama_4_scaling_beta": 0.2}, {"original_max_position_embeddings": 5}],
                         ids=["beta", "length"])
def test_resume_refuses_other_q_scale(edit, tmp_path):
    """A checkpoint whose config.json has another beta or original length (the same tensors:
    another model) is refused on resume naming the key; the unedited one resumes."""
    from test_ckpt_rope_params_check import _refused_after, _train
    cfg = of.make_config(DEFAULT)
    cfg.vocab_size = 256
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c["rope_parameters"].update(edit), next(iter(edit)))


@pytest.mark.parametrize("how", ["absent", "null", "absent_top_theta"])
def test_no_rope_parameters_is_transformers_default(how, tmp_path, open_session):
    """Ministral3Config fills its own dict where config.json has no rope_parameters (absent or
    null): yarn (rope_theta 1e6, factor 16, original_max_position_embeddings 16384, beta_fast 32,
    beta_slow 1, mscale and mscale_all_dim 1) with llama_4_scaling_beta 0.1, and a top-level
    rope_theta is then ignored. ctitan takes such a config as transformers does: logits, loss
    and every gradient against transformers' model loaded from the same directory, at
    positions past max_position_embeddings' small value (yarn's dict reads it too)."""
    T = 24
    d = of.save(of.build(DEFAULT), tmp_path / "hf")
    conf = of.config_json(d)
    conf.pop("rope_parameters")
    if how == "null":
        conf["rope_parameters"] = None
    if how == "absent_top_theta":
        conf["rope_theta"] = 5000.0
    conf["max_position_embeddings"] = 20
    (d / "config.json").write_text(json.dumps(conf))
    model = of.load(d, "ministral3")
    rp = model.config.rope_parameters
    assert rp["rope_type"] == "yarn" and rp["rope_theta"] == 1e6 and rp["llama_4_scaling_beta"] == 0.1, rp
    tokens, labels = of.batch(model, B, T, seed=5)
    ref = of.loss_and_grads(model, "ministral3", tokens, labels)
    # the dict matters: the same weights under default RoPE at its rope_theta give other logits
    plain = of.build(_rp(DEFAULT, rope_type="default", rope_theta=1e6))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        err = oracle.rel_err(of.logits(plain, "ministral3", tokens), ref["logits"])
    assert err > 100 * TOL, f"yarn's default dict moves the logits by only {err:.3g}"
    _assert_like_torch(open_session(hf_session_args(d, batch=B, seq_len=T)), tokens, labels, ref)
