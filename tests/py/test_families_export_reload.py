"""SmolLM3 and Olmo 3 probes (stop 51 review): export -> transformers reload, Hub-style config.json of each family."""
import dataclasses
import json

import numpy as np
import pytest
import torch

import oracle
import oracle_families as of
from conftest import hf_session_args

B, TOL = 2, 2e-5


def _hf_logits_from(d, family, tokens):
    from transformers import AutoConfig, AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32, attn_implementation="eager")
    return of.logits(of.prepare_loaded(m, family), family, tokens)


@pytest.mark.parametrize("cid,legacy", [("olmo3_swa5_yarn", False), ("olmo3_swa5_yarn", True),
                                        ("smollm3_nope_swa5", False)])
def test_export_reloads_same_model(cid, legacy, tmp_path, run_ctitan):
    """ctitan's exported config.json, loaded by transformers over the same weights, gives the
    same logits as the original config.json."""
    case = of.CASE[cid]
    d = of.save(of.build(case), tmp_path / "hf")
    if legacy:  # the published Olmo 3 keys: top-level rope_theta, legacy rope_scaling, no layer_types
        conf = of.config_json(d)
        for k in ("layer_types", "rope_parameters"):
            conf.pop(k, None)
        conf.update(rope_theta=1e4, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32})
        (d / "config.json").write_text(json.dumps(conf, indent=2))
    ref = of.load(d, case.family)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    want = of.logits(ref, case.family, tokens)
    run_ctitan(["describe", d, "--config-out", tmp_path / "out.json"])
    e = tmp_path / "exp"
    e.mkdir()
    for f in d.iterdir():
        if f.name != "config.json":
            (e / f.name).symlink_to(f)
    (e / "config.json").write_text((tmp_path / "out.json").read_text())
    got = _hf_logits_from(e, case.family, tokens)
    err = oracle.rel_err(got, want)
    assert err <= 1e-6, f"exported config.json changes transformers' model: rel err {err:.3g}\n" + \
        (tmp_path / "out.json").read_text()


def _hub_smollm3(n_layers=4):
    return {"architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": None, "eos_token_id": 5, "hidden_act": "silu", "hidden_size": 48,
            "initializer_range": 0.02, "intermediate_size": 64, "layer_types": ["full_attention"] * n_layers,
            "max_position_embeddings": 65536, "max_window_layers": 28, "mlp_bias": False, "model_type": "smollm3",
            "no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n_layers)],
            "num_attention_heads": 3, "num_hidden_layers": n_layers, "num_key_value_heads": 1, "pad_token_id": 3,
            "pretraining_tp": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0,
            "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "transformers_version": "4.54.0.dev0", "use_cache": False, "use_sliding_window": False,
            "vocab_size": 160}


def _hub_olmo3(n_layers=4):
    return {"architectures": ["Olmo3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 48, "initializer_range": 0.02,
            "intermediate_size": 64, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "max_position_embeddings": 65536, "model_type": "olmo3", "num_attention_heads": 3,
            "num_hidden_layers": n_layers, "num_key_value_heads": 3, "pad_token_id": 1, "rms_norm_eps": 1e-06,
            "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1,
                             "factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "yarn"},
            "rope_theta": 500000, "sliding_window": 5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.57.0.dev0", "use_cache": True, "vocab_size": 160}


@pytest.mark.parametrize("which", ["smollm3", "olmo3", "smollm3_types_disagree", "smollm3_types_window"])
def test_hub_style_config(which, tmp_path, open_session):
    """A config.json laid out as the Hub's (every key written, legacy rope keys): ctitan's
    logits equal transformers' on the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    fam = which.split("_")[0]
    conf = _hub_smollm3() if fam == "smollm3" else _hub_olmo3()
    if which == "smollm3_types_disagree":  # layer_types given, sliding a RoPE layer and a NoPE one
        conf.update(use_sliding_window=True, sliding_window=5, no_rope_layers=[0, 1, 1, 0],
                    layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"])
    if which == "smollm3_types_window":  # a window and NoPE layers, layer_types all full: nothing slides
        conf.update(use_sliding_window=True, sliding_window=5, no_rope_layers=[0, 1, 0, 1])
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    ref = AutoModelForCausalLM.from_config(hf, attn_implementation="eager", torch_dtype=torch.float32)
    of.init_weights(ref, fam, 3)
    ref = of.prepare_loaded(ref, fam)
    ref.save_pretrained(str(d))
    (d / "config.json").write_text(json.dumps(conf))
    tokens, _ = of.batch(ref, B, 16, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=16))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, fam, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
