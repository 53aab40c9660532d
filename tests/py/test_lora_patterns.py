"""PEFT's target_modules = "all-linear", per-layer targets, rank_pattern / alpha_pattern and
the adapter_config.json keys ctitan refuses (issue 13 leftovers), against peft 0.21.2 +
transformers on tiny random Qwen3 / Qwen3-MoE models.

Every expected number, every set of adapted modules and every rank comes from PEFT
(get_peft_model / PeftModel.from_pretrained) or torch; ctitan's own numbers are only
compared with them. Facts this relies on (read in the installed peft):

* "all-linear" (tuners_utils._maybe_include_all_linear_layers) adapts every nn.Linear but
  the model's output embedding (lm_head); PEFT then saves target_modules as the full module
  names when there are fewer than 20 of them (a tiny model).
* On qwen3_moe, transformers v5's router (mlp.gate) is a Qwen3MoeTopKRouter, not an
  nn.Linear, but PEFT's MoE conversion (_resolve_string_target_modules,
  _convert_peft_config_moe) adds the v4 names gate / gate_proj / up_proj / down_proj: the
  router becomes target_parameters "gate.weight" and gets an adapter.
* rank_pattern / alpha_pattern keys are tried in dict order against each module's full name
  as re.match(rf"(.*\\.)?({key})$", name); the first match gives r (alpha)
  (utils/other.py get_pattern_key, lora/model.py _create_and_replace).
"""
import json

import numpy as np
import pytest

import oracle
import oracle_lora as OL
from test_lora import (ALPHA, OPT_ARGS, R, TOL, assert_step_matches, compare_steps, dense_cfg, lora_args,
                       moe_dense_layer0, open_error, random_adapters_load_in_peft, session_steps, train_ref,
                       trained_in_session)
from test_parity import make_batch
from test_train_loop import L, LOCAL_BS
from conftest import hf_session_args


def peft_adapter(tmp_path, cfg, *, seed, **kw):
    """A tiny random HF model and a PEFT adapter on it (random non-zero A and B), saved."""
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=seed)
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, seed=seed + 1, **kw)
    pm.save_pretrained(str(ad))
    return hf_dir, ad, pm


def session_logits_match(s, tokens, want):
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"ctitan logits vs PEFT's: rel err {err:.3g}"


def rewrite_config(ad, **changes):
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    c.update(changes)
    f.write_text(json.dumps(c))


# --------------------------------------------------------------------------- 1. all-linear

def test_all_linear_dense_as_peft(tmp_path, open_session):
    """PEFT's all-linear on a dense Qwen3 adapts the seven projections of every layer (not
    lm_head); ctitan's lora.target_modules = all-linear adapts the same set, loads PEFT's
    adapter (saved with every module's full name) and gives its logits, loss and adapter
    gradients; ctitan's save loads in PEFT strictly; an adapter_config.json that says
    "all-linear" itself reads the same."""
    cfg = dense_cfg()
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=41, targets="all-linear")
    params = OL.trainable(pm)
    assert sorted(params) == sorted(OL.lora_names(range(cfg.num_hidden_layers), OL.ALL7)), \
        f"PEFT's all-linear adapts {sorted(params)}"
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.down_proj" in conf["target_modules"], f"test setup: PEFT saved {conf['target_modules']}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=3)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=["all-linear"], adapter=ad)))
    assert trained_in_session(s) == set(params)
    assert {n: s.shapes[n] for n in params} == {n: tuple(p.shape) for n, p in params.items()}
    assert_step_matches(s, tokens, labels, *ref, params)
    random_adapters_load_in_peft(s, cfg, lambda: oracle.load_hf(hf_dir), tmp_path / "saved", ".lora_")
    s.close()

    rewrite_config(ad, target_modules="all-linear")
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(
        targets=["all-linear"], adapter=ad)))
    session_logits_match(s, tokens, ref[1])


def test_all_linear_moe_router_refused(tmp_path, open_session):
    """On Qwen3-MoE PEFT's all-linear also adapts every MoE layer's router (mlp.gate): ctitan
    cannot, so lora.target_modules = all-linear is refused naming it, and so is PEFT's adapter
    (its target_parameters hold gate.weight)."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets="all-linear")
    assert any(".mlp.gate.lora_A." in n for n in OL.trainable(pm)), "test setup: PEFT adapts no router"
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=["all-linear"])), tmp_path)
    assert "all-linear" in msg and "mlp.gate" in msg, msg
    ad = tmp_path / "adapter"
    pm.save_pretrained(str(ad))
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=OL.ALL7, adapter=ad)), tmp_path)
    assert "gate.weight" in msg and "router" in msg and "adapter_config.json" in msg, msg


def test_per_layer_targets_as_peft(tmp_path, open_session):
    """target_modules naming one layer's module (PEFT's rule: the full name ends with it) beside
    a name of every layer's: the same adapters as PEFT, its logits and gradients; ctitan's save
    (every module by its full name) loads in PEFT strictly."""
    cfg = dense_cfg()
    targets = ["q_proj", "layers.1.mlp.down_proj"]
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=43, targets=targets)
    params = OL.trainable(pm)
    assert sorted(params) == sorted(OL.lora_names([0, 1], ["q_proj"]) + OL.lora_names([1], ["down_proj"])), \
        f"test setup: PEFT adapts {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=4)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=targets, adapter=ad)))
    assert trained_in_session(s) == set(params)
    assert_step_matches(s, tokens, labels, *ref, params)
    random_adapters_load_in_peft(s, cfg, lambda: oracle.load_hf(hf_dir), tmp_path / "saved", ".lora_")
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=["q_proj", "down_proj"],
                                                                           adapter=ad)), tmp_path)
    assert "model.layers.0.mlp.down_proj" in msg, msg
