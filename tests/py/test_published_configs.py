"""Published config.json files (tests/data/hf_configs, sources in SOURCES.md): what ctitan
derives from each (`ctitan describe --json`) equals what transformers derives from the same
file: head_dim, the score scale, every layer's sliding window and MoE kind, the RoPE cos/sin
of every layer type (inverse frequencies and attention scaling), and the parameter count of
the model transformers builds (on the meta device: no weights). Each native flavor
(model.spec = "qwen3") equals the published file of its size, key by key and descriptor by
descriptor."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import ROOT

CONFIGS = sorted((ROOT / "tests" / "data" / "hf_configs").glob("*.json"))
SEQ = 16


def ctitan_describe(run_ctitan, d: Path) -> dict:
    _, out, _ = run_ctitan(["describe", d, "--json", "--seq-len", str(SEQ)])
    return json.loads(out)


def hf_cos_sin(model, cfg, layer_type):
    """transformers' cos/sin [SEQ, head_dim] for a forward over positions 0..SEQ-1."""
    rot = type(model.model.rotary_emb)(config=cfg)
    x = torch.zeros(1, SEQ, 1, dtype=torch.float32)
    pos = torch.arange(SEQ)[None]
    with torch.no_grad():
        cos, sin = rot(x, pos, layer_type) if layer_type else rot(x, pos)
    return cos[0].double().numpy(), sin[0].double().numpy()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_descriptor_matches_transformers(path, run_ctitan, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    if path.name.endswith(".text_config.json"):
        # the text part of a multimodal config lists only what differs from the config class's
        # defaults: written out whole as transformers' save_pretrained does for that class
        raw = json.loads(path.read_text())
        AutoConfig.for_model(**raw).save_pretrained(d)
    else:
        shutil.copy(path, d / "config.json")
    got = ctitan_describe(run_ctitan, d)

    cfg = AutoConfig.from_pretrained(d)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert got["model_type"] == cfg.model_type
    assert got["num_parameters"] == sum(p.numel() for p in model.parameters())
    attn0 = model.model.layers[0].self_attn
    assert got["head_dim"] == attn0.head_dim
    assert got["scaling"] == pytest.approx(attn0.scaling, rel=1e-12)
    # the soft-caps the forward applies: the logits' wherever the config sets one (Gemma2/3's
    # CausalLM forward); the attention scores' only in Gemma2's eager attention (Gemma3 keeps the
    # key and never hands it to the attention function: test_families.py pins both on the logits)
    assert got["final_logit_softcapping"] == getattr(cfg, "final_logit_softcapping", None)
    assert got["attn_logit_softcapping"] == (cfg.attn_logit_softcapping if cfg.model_type == "gemma2" else None)
    layer_types = getattr(cfg, "layer_types", None)
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        # the window a layer's attention is called with: its own attribute where the family keeps
        # one (Qwen2/3, Gemma3), else the config's for every layer (Mistral, Mixtral, Phi3, Qwen3-MoE)
        sw = a.sliding_window if hasattr(a, "sliding_window") else getattr(cfg, "sliding_window", None)
        assert got["layers"][i]["sliding_window"] == (sw or 0), f"layer {i}"
        moe = hasattr(layer.mlp, "experts") or hasattr(layer, "block_sparse_moe")
        assert got["layers"][i]["moe"] == moe, f"layer {i}"
        if layer_types and cfg.model_type == "gemma3_text":
            assert got["layers"][i]["rope"] == ("sliding" if layer_types[i] == "sliding_attention" else "full")
    kinds = {"full": "full_attention", "sliding": "sliding_attention"} if cfg.model_type == "gemma3_text" else {"full": None}
    t = np.arange(SEQ, dtype=np.float64)[:, None]
    for kind, lt in kinds.items():
        want_cos, want_sin = hf_cos_sin(model, cfg, lt)
        r = got["rope"][kind]
        ang = t * np.asarray(r["inv_freq"])[None, :]
        cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=1) * r["attention_scaling"]
        sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=1) * r["attention_scaling"]
        # transformers forms the angles in fp32: about 1e-7 of a position-15 angle
        np.testing.assert_allclose(cos, want_cos, atol=1e-5, err_msg=f"{path.stem} {kind} cos")
        np.testing.assert_allclose(sin, want_sin, atol=1e-5, err_msg=f"{path.stem} {kind} sin")


# Native flavors (model.spec = "qwen3", src/model/lm_config.c) against the published file of
# the same size. The flavors without a file here: 1.7B (SOURCES.md, "Not found verbatim") and
# 235B-A22B (not collected); debugmodel and debugmodel_moe are torchtitan's test sizes.
FLAVOR_FILES = {"0.6B": "Qwen3-0.6B", "4B": "Qwen3-4B", "8B": "Qwen3-8B", "14B": "Qwen3-14B", "32B": "Qwen3-32B",
                "30B-A3B": "Qwen3-30B-A3B"}
FLAVORS_WITHOUT_FILE = {"debugmodel", "debugmodel_moe", "1.7B", "235B-A22B"}
# config.json keys that say nothing about the network's shape or arithmetic
NOT_ARCHITECTURE = {
    "_name_or_path": "where the file was read from",
    "bos_token_id": "the tokenizer's ids (ctitan reads them from tokenizer_config.json)",
    "eos_token_id": "the tokenizer's ids (ctitan reads them from tokenizer_config.json)",
    "dtype": "the storage dtype of the published weights",
    "transformers_version": "the writer's version",
    "use_cache": "an inference option",
}


def test_every_flavor_is_compared_or_listed(run_ctitan):
    _, out, _ = run_ctitan(["train", "--help"])
    line = next(l for l in out.splitlines() if "--model.flavor" in l)
    flavors = set(line.split("(", 1)[1].split(")", 1)[0].replace(",", " ").split())
    assert flavors == set(FLAVOR_FILES) | FLAVORS_WITHOUT_FILE, f"flavors {sorted(flavors)}"
    for stem in FLAVOR_FILES.values():
        assert (ROOT / "tests" / "data" / "hf_configs" / f"{stem}.json").exists(), stem


@pytest.mark.parametrize("flavor", sorted(FLAVOR_FILES))
def test_flavor_matches_published_config(flavor, run_ctitan, tmp_path):
    pub, nat = tmp_path / "published", tmp_path / "flavor"
    pub.mkdir()
    nat.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "hf_configs" / f"{FLAVOR_FILES[flavor]}.json", pub / "config.json")
    _, out, _ = run_ctitan(["describe", "--flavor", flavor, "--json", "--seq-len", str(SEQ),
                            "--config-out", nat / "config.json"])
    got = json.loads(out)

    # every key of both files as transformers reads them (it resolves rope_theta and
    # rope_scaling into rope_parameters), architectural ones equal
    a = AutoConfig.from_pretrained(pub).to_dict()
    b = AutoConfig.from_pretrained(nat).to_dict()
    compared = 0
    for k in sorted(set(a) | set(b)):
        if k in NOT_ARCHITECTURE:
            continue
        if k == "max_window_layers" and not a.get("use_sliding_window") and k not in b:
            continue  # read only to choose sliding layers, and use_sliding_window is false
        assert k in a and k in b, f"{flavor}: {k} only in the {'published file' if k in a else 'flavor'}"
        assert b[k] == a[k], f"{flavor}: {k} = {b[k]!r}, the published file says {a[k]!r}"
        compared += 1
    assert compared >= 20, f"{flavor}: only {compared} keys compared"

    # what ctitan builds from the flavor equals what it builds from the published file,
    # which test_descriptor_matches_transformers ties to transformers
    want = ctitan_describe(run_ctitan, pub)
    assert got == want, f"{flavor}: describe --flavor differs from describe of {FLAVOR_FILES[flavor]}.json"
    cfg = AutoConfig.from_pretrained(pub)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert got["num_parameters"] == sum(p.numel() for p in model.parameters()), flavor


# The keys the descriptor does not show, per family (Gemma's scaling is query_pre_attn_scalar's,
# Granite's attention_multiplier): the soft-caps, the activation, the window layout and
# Granite's four scalars that ctitan's export writes for a published file are what
# transformers reads from the file itself.
EXPORTED_KEYS = {
    "gemma": ["hidden_act", "head_dim"],
    "gemma2": ["hidden_activation", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
               "layer_types", "sliding_window", "head_dim"],
    "granite": ["embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                "rms_norm_eps"],
    "qwen2_moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                  "output_router_logits", "qkv_bias", "layer_types", "sliding_window", "intermediate_size"],
}
KEYED_FILES = [p for p in CONFIGS if json.loads(p.read_text()).get("model_type") in EXPORTED_KEYS]


@pytest.mark.parametrize("path", KEYED_FILES, ids=[p.stem for p in KEYED_FILES])
def test_family_keys_as_transformers_reads_them(path, run_ctitan, tmp_path):
    pub, out = tmp_path / "published", tmp_path / "export"
    pub.mkdir()
    out.mkdir()
    shutil.copy(path, pub / "config.json")
    run_ctitan(["describe", pub, "--config-out", out / "config.json"])
    a, b = AutoConfig.from_pretrained(pub), AutoConfig.from_pretrained(out)
    assert b.model_type == a.model_type
    for k in EXPORTED_KEYS[a.model_type] + ["tie_word_embeddings", "pad_token_id", "num_key_value_heads",
                                           "rope_parameters"]:
        assert getattr(b, k) == getattr(a, k), f"{path.stem}: {k} = {getattr(b, k)!r}, transformers {getattr(a, k)!r}"
