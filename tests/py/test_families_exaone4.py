"""EXAONE 4.0 (exaone4: LGAI-EXAONE/EXAONE-4.0-1.2B, -32B): what sets it apart, each shown to
matter in transformers itself, and the config keys ctitan must read as Exaone4Config does.

- OLMo2's layer: no pre-norms, RMSNorm on the attention and MLP outputs before each residual
  add (post_attention_layernorm, post_feedforward_layernorm).
- Qwen3's q/k norms: one RMSNorm over each head's head_dim (not OLMo2's whole projection).
- sliding layers from layer_types, else every sliding_window_pattern-th layer (default 4) is
  full and the others slide over sliding_window (default 4096).
- while sliding_window is set, the full layers apply no RoPE (Exaone4Attention rotates when
  `sliding_window is None or is_sliding`); with sliding_window null every layer rotates.

The logits, gradients, AdamW steps, export, generate, LoRA, bf16 and layouts are tested with
every family (oracle_families' exaone4_swa5_nope_tied case)."""
import json

import pytest
import torch

import oracle
import oracle_families as of
from test_families import B, TOL

EX = of.CASE["exaone4_swa5_nope_tied"]
SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def _moved(change):
    a = of.build(EX)
    tokens, _ = of.batch(a, B, EX.T, seed=5)
    with torch.no_grad():
        want = of.logits(a, "exaone4", tokens)
        change(a)
        return oracle.rel_err(of.logits(a, "exaone4", tokens), want)


def test_oracle_full_layer_nope_matters():
    """RoPE on the full layer (layer 3) as on the sliding ones moves transformers' logits."""
    def rope_everywhere(m):
        m.model.layers[3].self_attn.sliding_window = None  # `sliding_window is None` rotates
    err = _moved(rope_everywhere)
    assert err > 100 * TOL, f"RoPE on the full layer: moves the logits by only {err:.3g}"


def test_oracle_per_head_qk_norm_matters():
    """OLMo2's whole-projection q/k norm instead of the per-head one moves the logits."""
    def whole(self, x):  # x [B, heads, T, hd]: one norm over all heads of a token
        y = x.transpose(1, 2).float()
        y = y * torch.rsqrt(y.pow(2).mean((-1, -2), keepdim=True) + self.variance_epsilon)
        return self.weight * y.transpose(1, 2).to(x.dtype)

    def change(m):
        for layer in m.model.layers:
            for n in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                n.forward = whole.__get__(n)
    err = _moved(change)
    assert err > 100 * TOL, f"whole-projection q/k norm: moves the logits by only {err:.3g}"


def test_oracle_post_norms_matter():
    """The post-norms at weight 1 (RMS only) instead of the case's weights move the logits,
    so norms read from another key (or applied before the branch) fail the family tests."""
    def unit(m):
        for layer in m.model.layers:
            layer.post_attention_layernorm.weight.fill_(1.0)
            layer.post_feedforward_layernorm.weight.fill_(1.0)
    err = _moved(unit)
    assert err > 100 * TOL, f"post-norm weights: move the logits by only {err:.3g}"


def _count(hf):
    """transformers' parameter count (ctitan's describe and dry run must give it)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())


def _hf_layers(hf):
    """(sliding, rope) per layer as Exaone4Attention decides them."""
    return [(t == "sliding_attention", hf.sliding_window is None or t == "sliding_attention")
            for t in hf.layer_types]


@pytest.mark.parametrize("extra", [
    {}, {"sliding_window_pattern": 2}, {"sliding_window": 16, "sliding_window_pattern": 3},
    {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"] * 3},
    {"sliding_window": None, "layer_types": ["full_attention"] * 6},
    {"sliding_window": 16, "layer_types": ["full_attention"] * 6},
], ids=["defaults", "pattern2", "window16_pattern3", "types", "window_null_types", "window_all_full"])
def test_layers_as_exaone4config_reads_them(extra, tmp_path, run_ctitan):
    """Each layer's window and RoPE, from a file that leaves keys out, as Exaone4Config and
    Exaone4Attention derive them; the export (describe --config-out) reads back the same."""
    from transformers import AutoConfig
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "exaone4", **SIZES, **extra}))
    hf = AutoConfig.from_pretrained(d)
    _, out, _ = run_ctitan(["describe", d, "--json", "--config-out", d / "out.json"])
    layers = json.loads(out)["layers"]
    assert json.loads(out)["num_parameters"] == _count(hf)
    got = [(x["sliding_window"] > 0, x["rope"] != "none") for x in layers]
    assert got == _hf_layers(hf), (got, _hf_layers(hf))
    for x, t in zip(layers, hf.layer_types):
        if t == "sliding_attention":
            assert x["sliding_window"] == hf.sliding_window, layers
    exp = d / "exp"
    exp.mkdir()
    (exp / "config.json").write_text((d / "out.json").read_text())
    back = AutoConfig.from_pretrained(exp)
    assert back.model_type == "exaone4" and _hf_layers(back) == _hf_layers(hf)
    for k in ("num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "pad_token_id"):
        assert getattr(back, k) == getattr(hf, k), (k, getattr(back, k), getattr(hf, k))


@pytest.mark.parametrize("extra,needle", [
    ({"sliding_window": None}, "layer_types"),
    ({"sliding_window_pattern": "LLLG"}, "sliding_window_pattern"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
], ids=["window_null_no_types", "pattern_string", "pattern_zero"])
def test_configs_transformers_fails_on_refused(extra, needle, tmp_path, run_ctitan):
    """Exaone4Config divides by the pattern (0 where sliding_window is null) and takes its
    remainder (a string fails): transformers cannot build these, and ctitan names the key."""
    from transformers import AutoConfig
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "exaone4", **SIZES, **extra}))
    with pytest.raises(Exception):
        AutoConfig.from_pretrained(d)
    rc, _, err = run_ctitan(["describe", d], check=False)
    assert rc == 2 and needle in err and "config.json" in err, err


def test_resume_refuses_window_removed(tmp_path):
    """A checkpoint whose config.json drops the window (every layer rotating, none sliding:
    another model on the same tensors) is refused on resume; the unedited one resumes."""
    from test_ckpt_rope_params_check import _refused_after, _train
    cfg = of.make_config(EX)
    cfg.vocab_size = 256
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c.update(sliding_window=None, layer_types=["full_attention"] * 4), "sliding_window")
