"""Eleventh mutation audit (stop 53): the new families' defaults for absent config keys.

Every family case of oracle_families writes its RoPE keys, so a wrong default theta for an
absent rope_theta / rope_parameters (ERNIE 4.5's 5e5 planted as 1e4) passed the suite. Here a
config.json with the sizes only (and what a family requires: Seed-OSS's zero dropouts,
Ministral's head_dim): ctitan's describe must give transformers' inv_freq (the theta and GLM's
default partial factor), its parameter count (the kv heads, head_dim, tie and bias defaults)
and its tie switch, all read off the model transformers builds from the same file."""
import json

import numpy as np
import pytest
import torch

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
EXTRA = {"seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0), "glm": dict(pad_token_id=0),
         "glm4": dict(pad_token_id=0)}  # GLM's default pad id lies past this vocabulary


@pytest.mark.parametrize("mt", ["ernie4_5", "glm", "glm4", "seed_oss", "ministral", "exaone4"])
def test_absent_keys_default_as_transformers(mt, tmp_path, run_ctitan):
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = dict(SIZES, model_type=mt, **EXTRA.get(mt, {}))
    (tmp_path / "config.json").write_text(json.dumps(conf))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    _, out, _ = run_ctitan(["describe", str(tmp_path), "--json"])
    got = json.loads(out)
    assert got["num_parameters"] == sum(p.numel() for p in model.parameters()), (mt, got["num_parameters"])
    assert got["tie_word_embeddings"] == model.config.tie_word_embeddings, mt
    want = model.model.rotary_emb.inv_freq.to(torch.float64).numpy()
    inv = np.asarray(got["rope"]["full"]["inv_freq"])
    assert inv.shape == want.shape and np.allclose(inv, want, rtol=1e-6), (mt, inv, want)
