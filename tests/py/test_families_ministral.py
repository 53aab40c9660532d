"""Ministral (ministral: mistralai/Ministral-8B-Instruct-2410): what sets it apart from Mistral,
shown to matter in transformers itself, and the config keys ctitan must read as MinistralConfig
(and AutoConfig) do.

- layer_types: each layer is sliding_attention (Mistral's window over sliding_window keys) or
  full_attention; absent, every layer slides when sliding_window is set (default 4096) and none
  when it is null (MinistralConfig.__post_init__).
- head_dim: MinistralConfig derives none (its __post_init__ skips MistralConfig's), so a file
  without it fails in transformers; ctitan refuses it instead of computing hidden / heads.
- AutoConfig reads a model_type "mistral" file that has the key layer_types as a ministral one
  (configuration_auto's heuristic): ctitan does too, so that it trains the model transformers
  builds from that folder.

The logits, gradients, AdamW steps, export, generate, LoRA, bf16 and layouts are tested with
every family (oracle_families' ministral_types_swa5 case)."""
import json

import pytest
import torch

import oracle
import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families import B, TOL

MIN = of.CASE["ministral_types_swa5"]
SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
         "num_attention_heads": 8, "head_dim": 4}


def _logits_with(case, **kw):
    m = of.build(of.Case(case.id, case.family, dict(case.kw, **kw), T=case.T, seed=case.seed))
    tokens, _ = of.batch(m, B, case.T, seed=5)
    with torch.no_grad():
        return of.logits(m, case.family, tokens)


@pytest.mark.parametrize("kw", [dict(layer_types=["sliding_attention"] * 3),
                                dict(layer_types=["full_attention"] * 3)], ids=["all_sliding", "all_full"])
def test_oracle_layer_types_matter(kw):
    """The case's full layer among sliding ones (16 tokens, a window of 5) computes another
    model in transformers than every layer sliding (Mistral's rule) or none: a layer_types
    ctitan ignored or read wrongly fails the family tests."""
    err = oracle.rel_err(_logits_with(MIN, **kw), _logits_with(MIN))
    assert err > 100 * TOL, f"{kw}: moves the logits by only {err:.3g}"


def _config_out(d, run_ctitan):
    """describe's export of the config, after checking its parameter count is transformers'."""
    from transformers import AutoConfig, AutoModelForCausalLM
    _, out, _ = run_ctitan(["describe", d, "--json", "--config-out", d / "out.json"])
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).parameters())
    assert json.loads(out)["num_parameters"] == n, out
    return json.loads((d / "out.json").read_text())


# absent layer_types: MinistralConfig's rule; a mistral file with layer_types: AutoConfig's
# MinistralConfig (the layer_types given, or its rule where the key is null)
@pytest.mark.parametrize("model_type,extra", [
    ("ministral", {}),
    ("ministral", {"sliding_window": 6}),
    ("ministral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("mistral", {"sliding_window": 6, "layer_types": None}),
], ids=["absent", "window6", "window_null", "mistral_types", "mistral_types_null"])
def test_layer_types_as_transformers_reads_them(model_type, extra, tmp_path, run_ctitan):
    from transformers import AutoConfig
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **SIZES, **extra}))
    hf = AutoConfig.from_pretrained(d)
    assert hf.model_type == "ministral", "test setup: AutoConfig reads another family"
    out = _config_out(d, run_ctitan)
    assert out["model_type"] == "ministral" and out["architectures"] == ["MinistralForCausalLM"], out
    assert out["layer_types"] == hf.layer_types, (out["layer_types"], hf.layer_types)
    if "sliding_attention" in hf.layer_types:
        assert out["sliding_window"] == hf.sliding_window, out
    for k in ("num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "pad_token_id", "head_dim"):
        assert out[k] == getattr(hf, k), (k, out[k], getattr(hf, k))


def test_mistral_without_layer_types_stays_mistral(tmp_path, run_ctitan):
    """The heuristic needs the key: a mistral file without it is MistralConfig's (every layer
    sliding over its window), as before."""
    from transformers import AutoConfig
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mistral", **SIZES, "sliding_window": 6}))
    assert AutoConfig.from_pretrained(d).model_type == "mistral"
    out = _config_out(d, run_ctitan)
    assert out["model_type"] == "mistral" and "layer_types" not in out and out["sliding_window"] == 6, out


@pytest.mark.parametrize("null", [False, True], ids=["absent", "null"])
def test_head_dim_required(null, tmp_path, open_session):
    """MinistralConfig keeps head_dim None where the file gives none, and transformers fails
    building the model; ctitan refuses the file naming the key instead of training
    hidden_size / num_attention_heads wide heads."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = of.save(of.build(MIN), tmp_path / "hf")
    conf = of.config_json(d)
    conf.pop("head_dim")
    if null:
        conf["head_dim"] = None
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(Exception):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    msg = str(ei.value)
    assert "head_dim" in msg and "ministral" in msg and "config.json" in msg, msg


def test_resume_refuses_other_layer_types(tmp_path):
    """A checkpoint whose config.json makes the full layer slide (the same tensors: another
    model) is refused on resume naming layer_types; the unedited one resumes."""
    from test_ckpt_rope_params_check import _refused_after, _train
    cfg = of.make_config(MIN)
    cfg.vocab_size = 256
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c.update(layer_types=["sliding_attention"] * 3), "layer_types")
