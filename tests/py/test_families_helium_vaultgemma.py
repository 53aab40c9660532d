"""Helium (helium: kyutai/helium-1-preview-2b, helium-1-2b) and VaultGemma (vaultgemma:
google/vaultgemma-1b): what sets them apart, each shown to matter in transformers itself, and the
config keys ctitan must read as HeliumConfig / VaultGemmaConfig do.

- helium: Llama's layer with RoPE on the interleaved pairs (2i, 2i+1) of the whole head
  (modeling_helium's rotate_half and repeat_interleave, as ERNIE 4.5); attention_bias gives q, k
  and v biases, o_proj never has one (nn.Linear(hidden_size, hidden_size, bias=False), so heads x
  head_dim must be hidden_size); mlp_bias; HeliumConfig's defaults (20 kv heads, head_dim 128,
  eps 1e-8, theta 1e5, pad 3).
- vaultgemma: Gemma 2's layer without its post-norms: input_layernorm before attention,
  pre_feedforward_layernorm before the MLP, (1 + w) RMSNorm, sqrt(H) embeddings, GELU-tanh,
  query_pre_attn_scalar, attn_logit_softcapping on the scores, final_logit_softcapping on the
  logits, alternating sliding layers; attention_bias gives q, k, v and o_proj biases.

The logits, gradients, AdamW steps, export, generate (KV cache and greedy), LoRA, bf16 and the
layouts (FSDP 2, TP 2, resume; CP 2 for helium, PP 2 for vaultgemma) run with every family
(oracle_families' helium_bias_interleaved / vaultgemma_caps_bias cases)."""
import json

import pytest
import torch

import oracle
import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families import B, TOL, _changed_moved as _moved, _rewrite

HEL, VG = of.CASE["helium_bias_interleaved"], of.CASE["vaultgemma_caps_bias"]


def _written_as_read(d, tmp_path, run_ctitan, keys):
    """describe --config-out's config.json (an export's) read by AutoConfig gives the bare file's
    values of `keys` as the config class derives them (defaults included); returns describe's JSON."""
    from transformers import AutoConfig
    out_dir = tmp_path / "written"
    out_dir.mkdir()
    _, out, _ = run_ctitan(["describe", d, "--json", "--config-out", out_dir / "config.json"])
    want, got = AutoConfig.from_pretrained(d), AutoConfig.from_pretrained(out_dir)
    for k in keys:
        assert getattr(got, k) == getattr(want, k), (k, getattr(got, k), getattr(want, k))
    return json.loads(out)


def _count(d):
    from transformers import AutoConfig, AutoModelForCausalLM
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).parameters())


# --------------------------------------------------------------------------- helium

def test_oracle_helium_rope_interleaved(monkeypatch):
    """Llama's rotate_half on the halves of the head instead of Helium's pairs moves
    transformers' logits by far more than the tests' tolerance."""
    from transformers.models.helium import modeling_helium
    err = of.halves_rope_err(monkeypatch, HEL, "helium", modeling_helium, B)
    assert err > 100 * TOL, f"halves instead of pairs: moves the logits by only {err:.3g}"


_zero = of.zero_biases


@pytest.mark.parametrize("case,names", [
    (HEL, ("q_proj", "k_proj", "v_proj")), (HEL, ("gate_proj", "up_proj", "down_proj")),
    (VG, ("q_proj", "k_proj", "v_proj")), (VG, ("o_proj",))],
    ids=["helium_qkv", "helium_mlp", "vaultgemma_qkv", "vaultgemma_o"])
def test_oracle_each_bias_matters(case, names):
    """Each group of biases the cases switch on, dropped, moves transformers' logits."""
    err = _moved(case, _zero(*names))
    assert err > 100 * TOL, f"{names} biases dropped: moves the logits by only {err:.3g}"


def test_oracle_bias_places():
    """HeliumConfig's attention_bias gives q, k and v biases, never o_proj's; VaultGemma's all four."""
    from transformers import HeliumForCausalLM, VaultGemmaForCausalLM

    def biased(m):
        return sorted({n.split(".")[-2] for n, _ in m.named_parameters() if n.endswith(".bias")})
    assert biased(HeliumForCausalLM(of.make_config(of.Case("x", "helium", dict(HEL.kw, mlp_bias=False))))) == \
        ["k_proj", "q_proj", "v_proj"]
    assert biased(VaultGemmaForCausalLM(of.make_config(VG))) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_oracle_helium_head_dim_must_span_hidden():
    """The refused config (oracle_families' helium_head_dim_not_hidden) fails in transformers' forward."""
    cfg = of.make_config(of.Case("x", "helium", dict(HEL.kw, head_dim=16)))
    from transformers import HeliumForCausalLM
    with pytest.raises(Exception):
        HeliumForCausalLM(cfg)(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_helium_defaults_from_a_bare_file(tmp_path, open_session, run_ctitan):
    """A Helium config.json without num_key_value_heads, eps, RoPE, pad, biases and tying: ctitan
    reads HeliumConfig's defaults (20 kv heads, not num_attention_heads' 40; eps 1e-8, theta 1e5,
    pad 3, untied): the config it writes reads back the same, describe's parameter count and the
    logits equal transformers' on the model loaded from the file."""
    from transformers import AutoConfig
    d = of.save(of.build(of.Case("x", "helium", dict(
        vocab_size=64, hidden_size=160, num_attention_heads=40, num_key_value_heads=20, head_dim=4,
        rms_norm_eps=1e-8, pad_token_id=3, rope_parameters={"rope_type": "default", "rope_theta": 1e5}))),
        tmp_path / "hf")
    _rewrite(d, drop=("num_key_value_heads", "rms_norm_eps", "rope_parameters", "rope_theta", "pad_token_id",
                      "attention_bias", "mlp_bias", "tie_word_embeddings"))
    hf = AutoConfig.from_pretrained(d)
    assert (hf.num_key_value_heads, hf.rms_norm_eps, hf.rope_parameters["rope_theta"], hf.pad_token_id) == \
        (20, 1e-8, 1e5, 3), "test setup: other HeliumConfig defaults"
    dj = _written_as_read(d, tmp_path, run_ctitan, ("num_key_value_heads", "rms_norm_eps", "rope_parameters",
                                                    "pad_token_id", "attention_bias", "mlp_bias",
                                                    "tie_word_embeddings"))
    assert dj["num_parameters"] == _count(d), dj
    loaded = of.load(d, "helium")
    tokens, _ = of.batch(loaded, B, 16, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=16))
    err = oracle.rel_err(s.logits(tokens), of.logits(loaded, "helium", tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


# --------------------------------------------------------------------------- vaultgemma

def _no_attn_cap(m):
    for layer in m.model.layers:
        layer.self_attn.attn_logit_softcapping = None


def _no_final_cap(m):
    m.config.final_logit_softcapping = None


def _scale_head_dim(m):
    for layer in m.model.layers:
        layer.self_attn.scaling = layer.self_attn.head_dim ** -0.5


def _no_window(m):
    m.config.layer_types = ["full_attention"] * m.config.num_hidden_layers
    for layer in m.model.layers:
        layer.self_attn.sliding_window = None


def _embed_unscaled(m):
    m.model.embed_tokens.embed_scale.fill_(1.0)


def _norm_plain(m):  # w instead of 1 + w: the Llama RMSNorm
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.sub_(1.0)


@pytest.mark.parametrize("change", [_no_attn_cap, _no_final_cap, _scale_head_dim, _no_window, _embed_unscaled,
                                    _norm_plain],
                         ids=["attn_softcap", "final_softcap", "query_pre_attn_scalar", "sliding_window",
                              "embed_scale", "norm_plus_one"])
def test_oracle_vaultgemma_feature_matters(change):
    """Each of VaultGemma's Gemma features, left out, moves transformers' logits by far more
    than the tolerance of the family tests (so ctitan leaving it out fails them)."""
    err = _moved(VG, change)
    assert err > 100 * TOL, f"{change.__name__}: moves the logits by only {err:.3g}"


def test_oracle_vaultgemma_has_no_post_norms():
    """VaultGemmaDecoderLayer holds two norms (input_layernorm, pre_feedforward_layernorm), not
    Gemma 2's four: Gemma 2's post-norms on the same weights move the logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    vg = of.build(VG)
    names = {n.split(".")[3] for n, _ in vg.named_parameters() if n.startswith("model.layers.0.") and "norm" in n}
    assert names == {"input_layernorm", "pre_feedforward_layernorm"}, names
    kw = {k: v for k, v in {**of.BASE, **VG.kw}.items() if k != "attention_bias"}
    g2 = Gemma2ForCausalLM(Gemma2Config(**kw, attn_implementation="eager", attention_bias=True)).eval()
    missing, _ = g2.load_state_dict(vg.state_dict(), strict=False)
    assert all("post_" in k for k in missing), missing  # the post-norms stay at 0: times (1 + 0)
    tokens, _ = of.batch(vg, B, VG.T, seed=5)
    err = oracle.rel_err(of.logits(g2, "gemma2", tokens), of.logits(vg, "vaultgemma", tokens))
    assert err > 100 * TOL, f"Gemma 2's post-norms: move the logits by only {err:.3g}"


def test_vaultgemma_defaults_and_windows(tmp_path, open_session, run_ctitan):
    """A VaultGemma config.json without layer_types, the caps, query_pre_attn_scalar and tying:
    VaultGemmaConfig's defaults (layers 0, 2, ... slide; caps 50 and 30; scalar 256; tied);
    ctitan's describe gives the same windows and parameter count, its logits transformers'."""
    from transformers import AutoConfig
    d = of.save(of.build(VG), tmp_path / "hf")
    _rewrite(d, drop=("layer_types", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                      "tie_word_embeddings"))
    hf = AutoConfig.from_pretrained(d)
    assert hf.layer_types == ["sliding_attention", "full_attention", "sliding_attention"], hf.layer_types
    assert (hf.attn_logit_softcapping, hf.final_logit_softcapping, hf.query_pre_attn_scalar,
            hf.tie_word_embeddings) == (50.0, 30.0, 256, True)
    dj = _written_as_read(d, tmp_path, run_ctitan, ("layer_types", "sliding_window", "attn_logit_softcapping",
                                                    "final_logit_softcapping", "query_pre_attn_scalar",
                                                    "tie_word_embeddings", "attention_bias", "pad_token_id"))
    assert dj["num_parameters"] == _count(d), dj
    assert [x["sliding_window"] for x in dj["layers"]] == [4, 0, 4], dj["layers"]
    assert (dj["attn_logit_softcapping"], dj["final_logit_softcapping"]) == (50.0, 30.0), dj
    loaded = of.load(d, "vaultgemma")
    tokens, _ = of.batch(loaded, B, VG.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=VG.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(loaded, "vaultgemma", tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


def test_vaultgemma_hidden_not_multiple_of_heads_refused(tmp_path, open_session):
    """VaultGemmaConfig refuses hidden_size not a multiple of num_attention_heads (head_dim is
    its own key, so the model would build); ctitan refuses the file too, naming both keys."""
    from transformers import AutoConfig
    d = of.save(of.build(VG), tmp_path / "hf")
    _rewrite(d, hidden_size=50)
    with pytest.raises(Exception):
        AutoConfig.from_pretrained(d)
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    msg = str(ei.value)
    assert "hidden_size" in msg and "num_attention_heads" in msg and "config.json" in msg, msg


# --------------------------------------------------------------------------- resume

@pytest.mark.parametrize("case,edit,key", [
    (HEL, dict(attention_bias=False), "attention_bias"),
    (VG, dict(attn_logit_softcapping=7.0), "attn_logit_softcapping")], ids=["helium_bias", "vaultgemma_cap"])
def test_resume_refuses_another_model(case, edit, key, tmp_path):
    """A checkpoint whose config.json says another model of the same shapes is refused on
    resume naming the key; the unedited one resumes."""
    from test_ckpt_rope_params_check import _refused_after, _train
    cfg = of.make_config(case)
    cfg.vocab_size = 256
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c.update(edit), key)
