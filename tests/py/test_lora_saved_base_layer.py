"""PEFT saves an adapted lm_head's or embed_tokens' base weight beside its adapter
(save_embedding_layers "auto": ...lm_head.base_layer.weight, ...embed_tokens.base_layer.weight)
and loads it back into the model. When the file's base weight is not the checkpoint's (a
vocabulary resized or trained before the adapter was saved), the model PEFT runs has the file's:
ctitan, given that adapter over the unchanged checkpoint, must give PEFT's logits (the file's
weight read, not only checked for its shape)."""
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import oracle
import oracle_lora as OL
from conftest import hf_session_args
from test_lora_lm_head import R, ALPHA, TOL, cfg_qwen3, lora_args, load_quietly
from test_train_loop import LOCAL_BS, L

KEYS = {"lm_head": ("base_model.model.lm_head.base_layer.weight", "lm_head.weight"),
        "embed_tokens": ("base_model.model.model.embed_tokens.base_layer.weight", "model.embed_tokens.weight")}


@pytest.mark.parametrize("target", list(KEYS))
def test_the_files_base_weight_is_the_models(target, tmp_path, open_session):
    key, name = KEYS[target]
    cfg = cfg_qwen3()
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=[target], seed=5)
    pm.save_pretrained(str(ad))
    f = ad / "adapter_model.safetensors"
    sd = load_file(str(f))
    assert key in sd, f"test setup: PEFT saved {sorted(sd)}"
    sd[key] = (sd[key] + np.random.default_rng(3).normal(0, 0.5, sd[key].shape)).astype(sd[key].dtype)
    save_file(sd, str(f), metadata={"format": "pt"})
    ref = load_quietly(oracle.load_hf(hf_dir), ad)
    got = dict(ref.named_parameters())[key].detach().numpy()
    assert np.array_equal(got, sd[key]), "test setup: PEFT did not load the file's base weight"
    tokens = oracle.random_tokens(2 * L, cfg.vocab_size, seed=4).reshape(2, L)
    with torch.no_grad():
        want = oracle.hf_logits(ref, tokens)
        base = oracle.hf_logits(oracle.load_hf(hf_dir), tokens)
    assert oracle.rel_err(want, base) > 100 * TOL, "test setup: the file's weight changes nothing"
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args([target], ad)))
    assert np.array_equal(s.get_param(name), sd[key]), f"{name} is not the adapter file's {key}"
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"logits vs PEFT's (the file's base weight): rel err {err:.3g}"
