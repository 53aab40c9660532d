"""HunYuan dense (hunyuan_v1_dense: tencent/Hunyuan-0.5B/1.8B/4B/7B-Instruct): what sets it
apart, each shown to matter in transformers itself, and the config keys ctitan must read as
HunYuanDenseV1Config does.

- Llama's pre-norm layer whose attention normalises each head of q and k with an RMSNorm of
  head_dim weights (query_layernorm, key_layernorm) AFTER RoPE: HunYuanDenseV1Attention
  rotates, then normalises. Qwen3 normalises, then rotates; with norm weights that differ
  within a RoPE pair the two orders are different models.
- attention_bias gives q, k, v and o_proj biases; the MLP has none.
- num_key_value_heads absent (or null): num_attention_heads; eps 1e-5, theta 1e4, pad 0, untied.
  head_dim absent or null fails in transformers (the config keeps None, which the attention
  raises to a power), so ctitan refuses it, as for Ministral.
- a "dynamic" RoPE with "alpha" is HunYuanDenseV1RotaryEmbedding's ntk_alpha: theta times
  alpha^(d / (d - 2)), the same at every length (the published files' rope_scaling).

The logits, gradients, AdamW steps, export, generate (KV cache and greedy), LoRA, bf16 and the
layouts (FSDP 2, TP 2, resume, CP 2) run with every family (oracle_families'
hunyuan_qknorm_after_rope_bias case)."""
import json

import pytest

import oracle
import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families import B, TOL, _changed_moved as _moved, _rewrite

HY = of.CASE["hunyuan_qknorm_after_rope_bias"]


def test_oracle_norm_after_rope_matters():
    """Qwen3's order (norm, then RoPE) on the same weights moves transformers' logits by far
    more than the tolerance: ctitan normalising before rotating fails the family tests."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hy = of.build(HY)
    kw = {**of.BASE, **HY.kw}
    qw = Qwen3ForCausalLM(Qwen3Config(**kw, attn_implementation="eager")).eval()
    sd = {k.replace("query_layernorm", "q_norm").replace("key_layernorm", "k_norm"): v
          for k, v in hy.state_dict().items()}
    missing, unexpected = qw.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    tokens, _ = of.batch(hy, B, HY.T, seed=5)
    err = oracle.rel_err(of.logits(qw, "qwen3", tokens), of.logits(hy, "hunyuan_v1_dense", tokens))
    assert err > 100 * TOL, f"norm before RoPE: moves the logits by only {err:.3g}"


def _no_qk_norm(m):
    for layer in m.model.layers:
        for n in (layer.self_attn.query_layernorm, layer.self_attn.key_layernorm):
            n.forward = lambda x: x


_zero = of.zero_biases


@pytest.mark.parametrize("change", [_no_qk_norm, _zero("q_proj", "k_proj", "v_proj"), _zero("o_proj")],
                         ids=["qk_norms", "qkv_bias", "o_bias"])
def test_oracle_feature_matters(change):
    """The q/k norms and each group of biases, left out, move transformers' logits."""
    err = _moved(HY, change)
    assert err > 100 * TOL, f"moves the logits by only {err:.3g}"


def test_oracle_bias_places():
    """attention_bias gives q, k, v and o_proj biases; the MLP never has one."""
    from transformers import HunYuanDenseV1ForCausalLM
    m = HunYuanDenseV1ForCausalLM(of.make_config(HY))
    assert sorted({n.split(".")[-2] for n, _ in m.named_parameters() if n.endswith(".bias")}) == \
        ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_defaults_from_a_bare_file(tmp_path, open_session, run_ctitan):
    """A config.json without num_key_value_heads, eps, RoPE, pad, bias and tying:
    HunYuanDenseV1Config derives 4 kv heads (num_attention_heads), eps 1e-5, theta 1e4, pad 0;
    ctitan's written config reads back the same, describe's parameter
    count and the logits equal transformers' on the model loaded from the file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = of.save(of.build(of.Case("x", "hunyuan_v1_dense", dict(
        num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}))), tmp_path / "hf")
    _rewrite(d, drop=("num_key_value_heads", "rms_norm_eps", "rope_parameters", "rope_theta",
                      "pad_token_id", "attention_bias", "tie_word_embeddings"))
    want = AutoConfig.from_pretrained(d)
    assert (want.num_key_value_heads, want.pad_token_id) == (4, 0), "test setup"
    out_dir = tmp_path / "written"
    out_dir.mkdir()
    _, out, _ = run_ctitan(["describe", d, "--json", "--config-out", out_dir / "config.json"])
    got = AutoConfig.from_pretrained(out_dir)
    for k in ("num_key_value_heads", "rms_norm_eps", "rope_parameters", "pad_token_id", "attention_bias",
              "tie_word_embeddings"):
        assert getattr(got, k) == getattr(want, k), (k, getattr(got, k), getattr(want, k))
    count = sum(p.numel() for p in AutoModelForCausalLM.from_config(want).parameters())
    assert json.loads(out)["num_parameters"] == count, out
    loaded = of.load(d, "hunyuan_v1_dense")
    tokens, _ = of.batch(loaded, B, 16, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=16))
    err = oracle.rel_err(s.logits(tokens), of.logits(loaded, "hunyuan_v1_dense", tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling"])
def test_ntk_alpha(where, tmp_path, open_session):
    """A dynamic RoPE with alpha is HunYuan's ntk_alpha in transformers: theta times
    alpha^(d / (d - 2)) whatever the length, another model than dynamic without it (the logits
    move). ctitan reads it from the v5 dict and from the legacy rope_scaling the published files
    carry: its logits equal transformers' on the loaded file (T = 16 < max_position_embeddings 32,
    so plain dynamic would keep theta), and its export, read back by transformers, has the same
    logits (alpha written back)."""
    import dataclasses
    rp = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    kw = {**HY.kw, "max_position_embeddings": 32}
    plain = dataclasses.replace(HY, kw={**kw, "rope_parameters": dict(rp)})
    alpha = dataclasses.replace(HY, kw={**kw, "rope_parameters": dict(rp, alpha=3.0)})
    a, b = of.build(plain), of.build(alpha)
    tokens, _ = of.batch(a, B, HY.T, seed=5)
    want = of.logits(b, "hunyuan_v1_dense", tokens)
    err = oracle.rel_err(want, of.logits(a, "hunyuan_v1_dense", tokens))
    assert err > 100 * TOL, f"alpha moves transformers' logits by only {err:.3g}"
    d = of.save(b, tmp_path / "hf")
    if where == "rope_scaling":  # the published files' legacy spelling
        _rewrite(d, drop=("rope_parameters",), rope_theta=1e4,
                 rope_scaling={"type": "dynamic", "factor": 2.0, "alpha": 3.0})
        loaded = of.load(d, "hunyuan_v1_dense")
        assert oracle.rel_err(of.logits(loaded, "hunyuan_v1_dense", tokens), want) <= TOL, "test setup"
    s = open_session(hf_session_args(d, batch=B, seq_len=HY.T))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"logits rel err {err:.3g}"
    out = tmp_path / "export"
    s.save_hf(out)
    assert of.config_json(out)["rope_parameters"].get("alpha") == 3.0, of.config_json(out)["rope_parameters"]
    back = of.load(out, "hunyuan_v1_dense")
    err = oracle.rel_err(of.logits(back, "hunyuan_v1_dense", tokens), want)
    assert err <= TOL, f"the export read back by transformers: logits rel err {err:.3g}"


@pytest.mark.parametrize("null", [False, True], ids=["absent", "null"])
def test_head_dim_required(null, tmp_path, open_session):
    """head_dim absent or null: HunYuanDenseV1Config keeps None and transformers fails building
    the attention; ctitan refuses the file naming the key."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = of.save(of.build(HY), tmp_path / "hf")
    _rewrite(d, **({"head_dim": None} if null else {}), drop=() if null else ("head_dim",))
    with pytest.raises(Exception):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    msg = str(ei.value)
    assert "head_dim" in msg and "hunyuan_v1_dense" in msg and "config.json" in msg, msg


def test_resume_refuses_another_alpha(tmp_path):
    """A checkpoint whose config.json names another ntk_alpha (another RoPE, the same shapes)
    is refused on resume naming rope_parameters; the unedited one resumes."""
    import dataclasses
    from test_ckpt_rope_params_check import _refused_after, _train
    cfg = of.make_config(dataclasses.replace(HY, kw={**HY.kw, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 1.0, "alpha": 3.0}}))
    cfg.vocab_size = 256
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c["rope_parameters"].update(alpha=5.0))
