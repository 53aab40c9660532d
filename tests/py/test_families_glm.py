"""GLM (glm-4-9b-chat-hf) and GLM-4-0414 (glm4): what sets them apart from Llama, each shown to
matter in transformers itself, and the config keys ctitan must read as GlmConfig / Glm4Config do.

- RoPE on the interleaved pairs (2i, 2i+1) of the rotary part (modeling_glm's rotate_half and
  the repeat_interleave of cos / sin), not Llama's halves (i, i + rd/2);
- partial_rotary_factor, which GlmConfig defaults to 0.5 and its default RoPE reads;
- glm4's post_self_attn_layernorm / post_mlp_layernorm on each branch's output before its
  residual add, with post_attention_layernorm the MLP's pre-norm (not Gemma's names).

The logits, gradients, AdamW steps, export, generate, LoRA and layouts of the two families are
tested with every family (oracle_families' glm cases); the planted mistakes of the family
(half-rotation, the post norms skipped or misnamed, the factor's default) each move
transformers' logits far past those tests' tolerance (the tests here)."""
import json

import pytest
import torch

import oracle
import oracle_families as of
from conftest import hf_session_args
from test_families import B, TOL, _changed_moved as _moved, _logits_moved, _rewrite

GLM, GLM4 = of.CASE["glm_bias_partial05"], of.CASE["glm4_partial075_tied"]


@pytest.mark.parametrize("case", [GLM, GLM4], ids=["glm", "glm4"])
def test_oracle_glm_rope_interleaved_and_partial(case, monkeypatch):
    """Llama's rotate_half on the halves of the rotary part (Phi3's partial apply), or the whole
    head rotated, moves transformers' logits by far more than the tests' tolerance."""
    from transformers.models.glm import modeling_glm
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as halves
    mod = modeling_glm if case.family == "glm" else modeling_glm4
    a = of.build(case)
    tokens, _ = of.batch(a, B, case.T, seed=5)
    with torch.no_grad():
        want = of.logits(a, case.family, tokens)
        monkeypatch.setattr(mod, "apply_rotary_pos_emb", halves)
        err = oracle.rel_err(of.logits(a, case.family, tokens), want)
    assert err > 100 * TOL, f"halves instead of pairs: moves the logits by only {err:.3g}"
    monkeypatch.undo()
    rp = dict(case.kw["rope_parameters"], partial_rotary_factor=1.0)
    err = _logits_moved(case, dict(rope_parameters=rp))
    assert err > 100 * TOL, f"the whole head rotated: moves the logits by only {err:.3g}"


def test_oracle_glm4_post_norms_matter():
    """glm4's two post-branch norms, each left out, and Gemma3's reading of the names
    (post_attention_layernorm on the attention's output, post_self_attn_layernorm before the
    MLP: the two weights swapped) each move transformers' logits by far more than the tolerance."""
    def skip(name):
        def f(m):
            for layer in m.model.layers:
                setattr(layer, name, torch.nn.Identity())
        return f

    def swap(m):
        with torch.no_grad():
            for layer in m.model.layers:
                a, b = layer.post_attention_layernorm.weight, layer.post_self_attn_layernorm.weight
                t = a.clone()
                a.copy_(b)
                b.copy_(t)

    for what, change in [("post_self_attn_layernorm skipped", skip("post_self_attn_layernorm")),
                         ("post_mlp_layernorm skipped", skip("post_mlp_layernorm")),
                         ("Gemma3's names", swap)]:
        err = _moved(GLM4, change)
        assert err > 100 * TOL, f"{what}: moves the logits by only {err:.3g}"


def _glm_rotary(d):
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(d)
    return hf.rope_parameters["partial_rotary_factor"], hf.head_dim


# partial_rotary_factor as the file gives it: absent (GlmConfig's 0.5), at the top level only
# (GlmConfig moves it into rope_parameters), in rope_parameters
@pytest.mark.parametrize("case", [GLM, GLM4], ids=["glm", "glm4"])
@pytest.mark.parametrize("where,factor", [("absent", 0.5), ("top", 0.75), ("dict", 0.25)])
def test_glm_partial_rotary_factor_as_the_config_class_reads_it(case, where, factor, tmp_path, open_session,
                                                                run_ctitan):
    d = of.save(of.build(case), tmp_path / "hf")
    rp = {k: v for k, v in of.config_json(d)["rope_parameters"].items() if k != "partial_rotary_factor"}
    if where == "dict":
        rp["partial_rotary_factor"] = factor
    if where == "top":
        _rewrite(d, rope_parameters=rp, partial_rotary_factor=factor)
    else:
        _rewrite(d, rope_parameters=rp)
    assert _glm_rotary(d) == (factor, 16), "test setup: transformers reads another factor"
    ref = of.load(d, case.family)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, case.family, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    out_cfg = tmp_path / "out" / "config.json"
    out_cfg.parent.mkdir()
    _, out, _ = run_ctitan(["describe", d, "--json", "--config-out", out_cfg])
    desc = json.loads(out)
    assert desc["rotary_dim"] == int(16 * factor) and desc["rope_interleaved"] is True, desc
    _, text, _ = run_ctitan(["describe", d])
    assert f"rotates {int(16 * factor)} of 16 features in interleaved pairs" in text, text
    # the config ctitan writes (export, the final HF save) reads back with the same factor
    assert _glm_rotary(out_cfg.parent) == (factor, 16)


@pytest.mark.parametrize("case", [GLM, GLM4], ids=["glm", "glm4"])
def test_glm_attention_bias_is_qkv_only(case, tmp_path, run_ctitan):
    """GlmConfig's attention_bias (default true) gives q, k and v biases and never o_proj one:
    ctitan's parameter count (describe's, the dry run's) is transformers' with the key absent,
    true and false (glm4's: with its two post norms a layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = of.save(of.build(case), tmp_path / "hf")
    for value in (None, True, False):
        conf = of.config_json(d)
        conf.pop("attention_bias", None)
        if value is not None:
            conf["attention_bias"] = value
        (d / "config.json").write_text(json.dumps(conf))
        want = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).parameters())
        _, out, _ = run_ctitan(["describe", d, "--json"])
        assert json.loads(out)["num_parameters"] == want, (value, out)


def test_glm_resume_refuses_another_partial_rotary_factor(tmp_path):
    """A glm checkpoint whose config.json names another partial_rotary_factor (the same tensor
    shapes, another RoPE: transformers' default RoPE init gives other frequencies) is refused on
    resume naming rope_parameters; the unedited one resumes."""
    from test_ckpt_rope_params_check import _refused_after, _train
    from transformers import GlmConfig
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding
    kw = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=3, eos_token_id=2,
              bos_token_id=1)
    # each its own rope_parameters: GlmConfig writes the default factor into the dict it is given
    cfg = GlmConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    other = GlmConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.75})
    f0, _ = GlmRotaryEmbedding.compute_default_rope_parameters(cfg)
    f1, _ = GlmRotaryEmbedding.compute_default_rope_parameters(other)
    assert f0.shape != f1.shape  # 4 frequencies against 6
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c["rope_parameters"].update(partial_rotary_factor=0.75))


def test_glm4_checkpoint_is_not_resumed_as_glm(tmp_path):
    """glm and glm4 share every tensor but the two post norms; a glm4 checkpoint edited to
    model_type glm is another model (its norms would be dropped) and is refused by name."""
    from test_ckpt_rope_params_check import _refused_after, _train
    from transformers import Glm4Config
    cfg = Glm4Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                     pad_token_id=3, eos_token_id=2, bos_token_id=1)
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c.update(model_type="glm", architectures=["GlmForCausalLM"]),
                   "model_type", "glm4")
