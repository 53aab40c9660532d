"""rednote's dots.llm1 (Dots1ForCausalLM, model_type dots1) beyond the generic family tests
(test_families*.py run oracle_families' dots1_* cases through names, logits, loss, every
gradient, three AdamW steps, export, activation checkpointing, generation, LoRA against PEFT
and FSDP / EP / TP against one process).

dots1 is GLM-4.5's router (test_families_glm4_moe pins its rules) on another attention. Here:
that each dots1 difference from glm4_moe moves transformers' own output (the o_proj bias, the
always-on per-head q/k norms, whole-head RoPE where glm4_moe rotates half, the sliding layers
from max_window_layers) and that ctitan's logits are far from each of them and from the
router's planted mistakes; Dots1Config's defaults (first_k_dense_replace 0, norm_topk_prob
false, max_window_layers 62, no use_sliding_window gate) and its required expert counts; the
export's keys; resume refusing another router. Expected values come from transformers only."""
from __future__ import annotations

import json

import pytest
import torch

import oracle
import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families_glm4_moe import _router

TOL = 1e-4
B = 2
FAMILY = "dots1"
FULL = "dots1_groups_bias_swa5"  # every feature on
PLAIN = "dots1_plain_tied"


def _logits_with(case, patch, seed=5, tokens=None):
    """transformers' logits of the case's model after patch(model) (under no_grad)."""
    m = of.build(case)
    if tokens is None:
        tokens, _ = of.batch(m, B, case.T, seed=seed)
    with torch.no_grad():
        patch(m)
    return of.logits(m, FAMILY, tokens)


def _no_qk_norm(m):
    """glm4_moe's use_qk_norm false (its default): the per-head norms left out."""
    for layer in m.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


def _half_rope(m):
    """glm4_moe's RoPE at its default partial_rotary_factor 0.5: rotate-half of the first half of
    each head with the frequencies of that half, the rest passed through (with _glm_rotation)."""
    from transformers.models.glm4_moe import modeling_glm4_moe as g
    c = m.config
    gc = g.Glm4MoeConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_parameters["rope_theta"],
                                          "partial_rotary_factor": 0.5})
    m.model.rotary_emb = g.Glm4MoeRotaryEmbedding(gc)


def _glm_rotation(monkeypatch):
    """Glm4Moe's apply_rotary_pos_emb (rotates the first cos.shape[-1] features of each head) in
    place of Dots1's, which Dots1Attention calls by its module's name."""
    from transformers.models.dots1 import modeling_dots1
    from transformers.models.glm4_moe import modeling_glm4_moe
    monkeypatch.setattr(modeling_dots1, "apply_rotary_pos_emb", modeling_glm4_moe.apply_rotary_pos_emb)


def _diff_logits(case, name, edit, monkeypatch):
    with monkeypatch.context() as mp:
        if edit is _half_rope:
            _glm_rotation(mp)
        return _logits_with(case, edit)


def _no_windows(m):
    for layer in m.model.layers:
        layer.self_attn.sliding_window = None
    m.config.layer_types = ["full_attention"] * len(m.model.layers)


DIFFS = {  # name: the glm4_moe rule in place of dots1's
    "no o_proj bias": of.zero_biases("o_proj"), "no q/k norms": _no_qk_norm, "partial RoPE 0.5": _half_rope,
    "no sliding layer": _no_windows,
}
EDITS = {  # name: a planted router mistake (test_families_glm4_moe._router)
    "bias ignored": _router("no_bias"), "no group limit": _router("no_groups"), "softmax scores": _router("softmax"),
    "no routed_scaling_factor": _router("no_scale"), "no renormalisation": _router("no_norm"),
}


def test_oracle_dots1_differences_change_the_model(monkeypatch):
    """In transformers itself, on the case with every feature on: each glm4_moe rule in place of
    dots1's (DIFFS) and each planted router mistake (EDITS) moves the logits by far more than the
    tolerance; the planted router with nothing planted and _half_rope's hook are inert where
    they should be (the router reproduces Dots1TopkRouter; the hook is what the layers call)."""
    case = of.CASE[FULL]
    m = of.build(case)
    assert [hasattr(layer.mlp, "experts") for layer in m.model.layers] == [False, True, True]
    assert list(m.config.layer_types) == ["full_attention", "full_attention", "sliding_attention"]
    assert all(layer.self_attn.o_proj.bias is not None for layer in m.model.layers)
    want = _logits_with(case, lambda m: None)
    assert oracle.rel_err(_logits_with(case, _router("none")), want) <= 1e-6
    with monkeypatch.context() as mp:  # Glm4Moe's rotation is Dots1's on a whole-head cos
        _glm_rotation(mp)
        assert oracle.rel_err(_logits_with(case, lambda m: None), want) <= 1e-6
    for name, edit in {**DIFFS, **EDITS}.items():
        err = oracle.rel_err(_diff_logits(case, name, edit, monkeypatch), want)
        assert err > 100 * TOL, f"{name} moves the logits by only {err:.3g}"


def test_dots1_matches_transformers_and_catches_planted_mistakes(tmp_path, open_session, monkeypatch):
    """ctitan reads the biased router, the o_proj biases, the q/k norms and the sliding layer:
    its logits match transformers' (test_families.py checks loss, gradients and AdamW steps) and
    are far from every glm4_moe rule (DIFFS) and planted router mistake (EDITS). Its export holds
    Dots1Config's keys (no use_qk_norm nor num_nextn_predict_layers), the same layer_types and the
    file's selection biases, and transformers reads it back to the same logits."""
    case = of.CASE[FULL]
    m = of.build(case)
    d = of.save(m, tmp_path / "hf")
    tokens, _ = of.batch(m, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    got = s.logits(tokens)
    assert oracle.rel_err(got, of.logits(m, FAMILY, tokens)) <= TOL
    for name, edit in {**DIFFS, **EDITS}.items():
        err = oracle.rel_err(got, _diff_logits(case, name, edit, monkeypatch))
        assert err > 100 * TOL, f"{name}: ctitan's logits are within {err:.3g} of it"
    s.save_hf(tmp_path / "out")
    conf = of.config_json(tmp_path / "out")
    assert conf["model_type"] == FAMILY and conf["architectures"] == ["Dots1ForCausalLM"]
    assert "use_qk_norm" not in conf and "num_nextn_predict_layers" not in conf, sorted(conf)
    assert conf["layer_types"] == list(m.config.layer_types) and conf["sliding_window"] == 5
    back = of.load(tmp_path / "out", FAMILY)
    want, have = of.router_biases(m), of.router_biases(back)
    assert len(want) == len(have) == 2 and all(torch.equal(a, b) for a, b in zip(want, have))
    err = oracle.rel_err(of.logits(back, FAMILY, tokens), of.logits(m, FAMILY, tokens))
    assert err <= TOL, f"logits of the reloaded export: rel err {err:.3g}"


@pytest.mark.parametrize("mw,want", [(1, [0, 5, 5]), (None, [0, 0, 0])])
def test_dots1_sliding_layers_from_max_window_layers(mw, want, tmp_path, open_session, run_ctitan):
    """A config.json without layer_types: Dots1Config makes layers i >= max_window_layers slide
    whenever sliding_window is set (no use_sliding_window key), max_window_layers 62 when absent
    (so no layer of a small model slides). ctitan's per-layer windows and logits at T = 16 > 5
    equal transformers' on the model loaded from the file."""
    case = of.CASE[FULL]
    m = of.build(case)
    d = of.save(m, tmp_path / "hf")
    conf = of.config_json(d)
    del conf["layer_types"]
    conf.pop("use_sliding_window", None)
    if mw is None:
        del conf["max_window_layers"]
    else:
        conf["max_window_layers"] = mw
    (d / "config.json").write_text(json.dumps(conf))
    ref = of.load(d, FAMILY)
    assert [5 if t == "sliding_attention" else 0 for t in ref.config.layer_types] == want
    _, out, _ = run_ctitan(["describe", d, "--json"])
    got = [layer["sliding_window"] for layer in json.loads(out)["layers"]]
    assert got == want, f"ctitan's per-layer windows {got}, transformers' {want}"
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, FAMILY, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


def test_dots1_max_window_layers_default_is_62(tmp_path, run_ctitan):
    """Dots1Config's max_window_layers defaults to 62, not Qwen2's 28: in a 64-layer config
    without layer_types nor max_window_layers exactly layers 62 and 63 slide (describe only)."""
    from transformers import AutoConfig
    conf = dict(_sizes_conf(), num_hidden_layers=64, sliding_window=5)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    want = [5 if t == "sliding_attention" else 0 for t in AutoConfig.from_pretrained(d).layer_types]
    assert want == [0] * 62 + [5, 5]
    _, out, _ = run_ctitan(["describe", d, "--json"])
    got = [layer["sliding_window"] for layer in json.loads(out)["layers"]]
    assert got == want, f"ctitan slides layers {[i for i, w in enumerate(got) if w]}"


def _sizes_conf():
    return {"model_type": FAMILY, "architectures": ["Dots1ForCausalLM"], "vocab_size": 160, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "moe_intermediate_size": 8}


def test_dots1_defaults(tmp_path, open_session, run_ctitan):
    """A file with only the sizes and the three expert counts Dots1Config leaves None:
    first_k_dense_replace 0 (every layer sparse), norm_topk_prob false, n_group = topk_group = 1,
    routed_scaling_factor 1, no attention biases, q/k norms on, eps 1e-6, untied, no sliding
    layer. ctitan's logits equal transformers' on the model loaded from it, describe counts its
    parameters, and its export writes back what transformers read."""
    from transformers import AutoConfig, Dots1ForCausalLM
    conf = _sizes_conf()
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    assert (hf.first_k_dense_replace, hf.norm_topk_prob, hf.n_group, hf.topk_group) == (0, False, 1, 1)
    assert (hf.routed_scaling_factor, hf.attention_bias, hf.rms_norm_eps, hf.tie_word_embeddings) == \
        (1.0, False, 1e-6, False)
    assert (hf.max_window_layers, hf.sliding_window, set(hf.layer_types)) == (62, 4096, {"full_attention"})
    hf._attn_implementation = "eager"
    model = Dots1ForCausalLM(hf).float()
    of.init_weights(model, FAMILY, 3)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(conf))  # save_pretrained wrote every key
    ref = of.load(d, FAMILY)
    assert all(hasattr(layer.mlp, "experts") for layer in ref.model.layers)
    tokens, _ = of.batch(ref, B, 12, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=12))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, FAMILY, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    _, out, _ = run_ctitan(["describe", d, "--config-out", d / "out.json"])
    n = sum(p.numel() for p in ref.parameters())
    assert f"parameters: {n} " in out, f"HF has {n} parameters:\n{out}"
    back = json.loads((d / "out.json").read_text())
    for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
              "topk_group", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob", "attention_bias",
              "tie_word_embeddings", "rms_norm_eps", "layer_types"):
        assert back.get(k, "<absent>") == getattr(hf, k), f"{k} = {back.get(k)!r}, transformers {getattr(hf, k)!r}"


@pytest.mark.parametrize("key", ["n_routed_experts", "num_experts_per_tok", "n_shared_experts"])
def test_dots1_expert_counts_required(key, tmp_path, open_session):
    """Dots1Config defaults the three expert counts to None and Dots1ForCausalLM fails without
    them (to build, or num_experts_per_tok None in its first forward): ctitan refuses the file,
    naming the key."""
    from transformers import AutoConfig, Dots1ForCausalLM
    conf = _sizes_conf()
    del conf[key]
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    assert getattr(hf, key) is None
    with pytest.raises((TypeError, RuntimeError)):
        Dots1ForCausalLM(hf)(input_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=12))
    assert key in str(ei.value), str(ei.value)


def test_dots1_num_local_experts_alias(tmp_path, run_ctitan):
    """Dots1Config's attribute_map: num_local_experts in place of n_routed_experts gives the
    expert count (and satisfies the requirement)."""
    from transformers import AutoConfig
    conf = _sizes_conf()
    conf["num_local_experts"] = conf.pop("n_routed_experts")
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    assert AutoConfig.from_pretrained(d).n_routed_experts == 4
    _, out, _ = run_ctitan(["describe", d])
    assert "experts: 2 of 4 per token, 8 wide, and a shared expert 8 wide (ungated)" in out, out


@pytest.mark.parametrize("key,value", [("n_group", 2), ("routed_scaling_factor", 1.5), ("first_k_dense_replace", 2),
                                       ("n_shared_experts", 1)])
def test_dots1_resume_with_other_keys_names_them(key, value, tmp_path, run_ctitan):
    """A checkpoint of the full case resumed with another group count, scaling, dense-layer count
    or shared-expert count is refused, naming Dots1Config's key."""
    err = of.resume_with_other_config(tmp_path, run_ctitan, FAMILY, of.CASE[FULL].kw, **{key: value})
    assert "config.json: " in err and key in err.split("config.json: ", 1)[1], err


def test_dots1_bf16_like_emulation(tmp_path, open_session):
    """training.mixed_precision_param = bfloat16 on the plain case (no attention biases, which
    the emulation's linear does not take): the sigmoid router, the per-head q/k norms and
    whole-head RoPE against test_moe's emulation of ctitan's bf16 semantics, with
    test_bf16.assert_like_emulation's bounds. Weight seed 2 (as test_families_glm4_moe's): seeds
    1 and 2 pass; with the case's 62 and with 3-7 (measured) a few tensors' bf16-effect cosine
    falls below the bound's 0.85 (62: 0.79, layer 0's expert 0 gate_proj) while the median stays
    >= 0.95: the sigmoid scores sit close, so a bf16 rounding flips a token's expert, in ctitan
    and the emulation at different tokens (test_families_glm4_moe's bf16 test found the same)."""
    of.assert_moe_bf16_like_emulation(tmp_path, open_session, of.CASE[PLAIN], B, seed=2, drop_idle=True)


def test_dots1_ignores_glm4_moe_keys(tmp_path, open_session):
    """use_qk_norm false and num_nextn_predict_layers 1 are no Dots1Config keys (kept as unused
    attributes): transformers still normalises q and k and builds every layer, and so does
    ctitan (the logits of the same file without the keys)."""
    case = of.CASE[PLAIN]
    m = of.build(case)
    d = of.save(m, tmp_path / "hf")
    conf = of.config_json(d)
    conf.update(use_qk_norm=False, num_nextn_predict_layers=1)
    (d / "config.json").write_text(json.dumps(conf))
    ref = of.load(d, FAMILY)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    want = of.logits(m, FAMILY, tokens)
    assert oracle.rel_err(of.logits(ref, FAMILY, tokens), want) <= 1e-6
    got = open_session(hf_session_args(d, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got, want) <= TOL


def test_dots1_case_is_not_glm4_moe():
    """The dataclass-level difference the reader's defaults rest on (Dots1Config vs
    Glm4MoeConfig): first_k_dense_replace, norm_topk_prob, the expert counts, eps."""
    from transformers import Dots1Config, Glm4MoeConfig
    d, g = Dots1Config(), Glm4MoeConfig()
    assert (d.first_k_dense_replace, d.norm_topk_prob, d.n_routed_experts, d.n_shared_experts) == (0, False, None, None)
    assert (g.first_k_dense_replace, g.norm_topk_prob, g.n_routed_experts, g.n_shared_experts) == (1, True, 128, 1)


@pytest.mark.parametrize("targets", ["mlp", "all-linear"])
def test_dots1_peft_rewrites_the_mlp_names(targets, tmp_path, open_session):
    """transformers maps dots1 to qwen2_moe's conversion (as glm4_moe), and PEFT with it:
    gate_proj + up_proj / down_proj become the sparse layers' mlp.experts target_parameters
    (all-linear adds the attention and the router), and neither the shared experts nor the dense
    first layer's MLP gets an adapter. ctitan given PEFT's adapter has its logits, loss and
    adapter gradients (through the biased group-limited router, the o_proj biases and the sliding
    layer); its saved adapter loads in PEFT."""
    import oracle_lora as OL
    from test_families_lora import experts_rewrite_matches_peft
    case = of.CASE[FULL]
    base = of.build(case)
    hf_dir = of.save(base, tmp_path / "hf")

    def loaded():
        return of.prepare_loaded(of.load(hf_dir, FAMILY), FAMILY)
    experts_rewrite_matches_peft(tmp_path, open_session, case, base, hf_dir, loaded,
                                 OL.MLP if targets == "mlp" else targets, r"layers\.0\.mlp\.", B)


def test_dots1_biased_layouts_and_resume(tmp_path):
    """The biased model loaded from its files (test_families_dist starts from ctitan's own init,
    whose selection biases are zero) trains 10 steps on one process, under EP 2, FSDP 2, TP 2 and
    PP 2 with the same losses and weights; stopped at step 4 under EP 2 and resumed on one process
    (the biases from the checkpoint's state.json), it continues the same run."""
    from test_families_dist import EP2, FSDP2, PP2, TP2, biased_moe_layouts_and_resume
    case = of.CASE[FULL]
    biased_moe_layouts_and_resume(tmp_path, of.build(case), of.build(case), FAMILY,
                                  {"ep2": EP2, "fsdp2": FSDP2, "tp2": TP2, "pp2": PP2})
