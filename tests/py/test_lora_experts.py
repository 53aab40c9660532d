"""LoRA on Qwen3-MoE experts in PEFT's target_parameters form (lora.target_parameters):
ctitan against PEFT 0.21.2's ParamWrapper on transformers' fused experts
(mlp.experts.gate_up_proj [E, 2 Im, H], mlp.experts.down_proj [E, H, Im]) together with
adapters on the attention projections: logits, loss, every adapter gradient and AdamW steps
(fp32, to 1e-4; alpha / r and rsLoRA), the base bit-unchanged, adapter directories both
ways (PEFT -> ctitan through lora.adapter_path, ctitan -> PEFT through save_adapter, which
PeftModel.from_pretrained loads without a warning), the fresh init, and the refusals
(a wrong expert-adapter shape, an unknown parameter name, dropout, as PEFT refuses it).

Every expected number comes from PEFT / torch (oracle_lora.py)."""
import json

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

import oracle
import oracle_lora as OL
import oracle_moe
from conftest import hf_session_args
from test_lora import (ALPHA, OPT_ARGS, R, TOL, assert_base_unchanged, assert_step_matches, compare_steps,
                       lora_args, moe_dense_layer0, open_error, session_steps, train_ref, trained_in_session)
from test_parity import make_batch
from test_train_loop import LOCAL_BS, L

EXP_ARG = "--lora.target_parameters=" + ",".join(OL.EXPERTS)


def expected_lora(cfg, attn, experts=("gate_up_proj", "down_proj")):
    """ctitan's adapter names in table order: per layer the attention ones, then (MoE
    layers) the experts'."""
    out = []
    for l in range(cfg.num_hidden_layers):
        out += OL.lora_names([l], attn)
        if l not in cfg.mlp_only_layers:
            out += OL.expert_lora_names(l, experts)
    return out


CASES = [("alpha_over_r", False), ("rslora", True)]


@pytest.mark.parametrize("rslora", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_expert_parity_from_peft_adapter(rslora, tmp_path, open_session):
    """A PEFT adapter with random non-zero A and B on q/v and on both fused expert
    parameters of a Qwen3-MoE (layer 0 dense, layer 1 sparse): ctitan loads it, has PEFT's
    tensors (names, shapes, order), trains exactly them, gives PEFT's logits, loss and
    every adapter gradient, and 3 AdamW steps equal torch's; the base stays bit-identical."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    attn = ["q_proj", "v_proj"]
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=attn, rslora=rslora, target_parameters=OL.EXPERTS, seed=6)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    lora = expected_lora(cfg, attn)
    assert sorted(params) == sorted(lora), f"test setup: PEFT trains {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    assert oracle.rel_err(ref_logits, oracle.hf_logits(base(), tokens)) > 100 * TOL, \
        "test setup: the adapter hardly changes the logits"

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=attn, rslora=rslora, adapter=ad) + [EXP_ARG]))
    names = s.names()
    assert [n for n in names if ".lora_" in n] == lora, f"adapters: {[n for n in names if '.lora_' in n]}"
    bad = [n for n in lora if s.shapes[n] != tuple(params[n].shape)]
    assert not bad, f"shapes differ from PEFT's: {[(n, s.shapes[n], tuple(params[n].shape)) for n in bad]}"
    assert trained_in_session(s) == set(params)
    saved = OL.saved_state(pm)
    bad = [n for n in saved if not np.array_equal(s.get_param(n), saved[n])]
    assert not bad, f"adapter tensors not loaded exactly: {bad}"
    assert_base_unchanged(s, hf_dir)

    assert_step_matches(s, tokens, labels, ref_loss, ref_logits, ref_grads, lora)
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=12)
    compare_steps(session_steps(s, stream, lora), train_ref(pm, params, stream))
    assert_base_unchanged(s, hf_dir)


def test_expert_adapter_saved_loads_in_peft(tmp_path, open_session):
    """From ctitan's fresh init (B zero, A uniform in +-1/sqrt(in) as PEFT inits lora_A),
    2 training steps, save_adapter: adapter_config.json names the target_parameters,
    PeftModel.from_pretrained loads the directory without a warning, every tensor lands in
    the model, and PEFT's logits are ctitan's. Only the experts are adapted here
    (target_modules []), one parameter, so its keys are the outer wrapper's."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=4, extra=OPT_ARGS + [
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.target_modules=",
        "--lora.target_parameters=experts.down_proj"]))
    lora = [n for n in s.names() if ".lora_" in n]
    assert lora == OL.expert_lora_names(1, ["down_proj"]), lora
    a, b = lora
    assert s.shapes[a] == (R * cfg.num_experts, cfg.moe_intermediate_size), s.shapes[a]
    A0 = s.get_param(a)
    bound = 1 / np.sqrt(cfg.moe_intermediate_size)
    assert not np.any(s.get_param(b)) and np.all(np.abs(A0) <= bound) and np.abs(A0).max() > 0.8 * bound, \
        "fresh init: B must be zero and A uniform in +-1/sqrt(in)"
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=3)
    session_steps(s, stream, [], run=2)
    ad = tmp_path / "saved"
    s.save_adapter(ad)
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf.get("target_parameters") == ["mlp.experts.down_proj"] and not conf.get("target_modules"), conf
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=9)
    logits = s.logits(tokens)
    pm = OL.load_adapter_strict(base(), ad)
    ref = oracle.hf_logits(pm, tokens)
    assert oracle.rel_err(ref, oracle.hf_logits(base(), tokens)) > 10 * TOL, "test setup: 2 steps changed nothing"
    err = oracle.rel_err(logits, ref)
    assert err <= TOL, f"ctitan logits vs PEFT with ctitan's adapter: rel err {err:.3g}"


def test_expert_adapter_both_params_saved_loads_in_peft(tmp_path, open_session):
    """Attention and both expert parameters, adapters set to random values through the
    session: the saved directory loads in PEFT (nested wrappers: gate_up_proj's under
    base_layer) and gives ctitan's logits."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=[
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.use_rslora=true", EXP_ARG]))
    rng = np.random.default_rng(3)
    for n in s.names():
        if ".lora_" in n:
            s.set_param(n, rng.normal(0, 0.1, s.shapes[n]).astype(np.float32))
    ad = tmp_path / "saved"
    s.save_adapter(ad)
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=9)
    pm = OL.load_adapter_strict(base(), ad)
    err = oracle.rel_err(s.logits(tokens), oracle.hf_logits(pm, tokens))
    assert err <= TOL, f"ctitan logits vs PEFT with ctitan's adapter: rel err {err:.3g}"


# --------------------------------------------------------------------------- refusals

def _peft_adapter(tmp_path, base):
    ad = tmp_path / "adapter"
    OL.make_peft(base(), r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=OL.EXPERTS,
                 seed=1).save_pretrained(str(ad))
    return ad


def _fewer_experts(ad):
    f = ad / "adapter_model.safetensors"
    t = load_file(str(f))
    k = OL.PREFIX + "model.layers.1.mlp.experts.lora_A.weight"
    t[k] = t[k][: R * 3].contiguous()  # 3 experts' rows of 4
    save_file(t, str(f), metadata={"format": "pt"})
    return "model.layers.1.mlp.experts.lora_A.weight"


def _unknown_param(ad):
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    c["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.gate.weight"]
    f.write_text(json.dumps(c))
    return "mlp.gate.weight"


@pytest.mark.parametrize("damage", [None, _fewer_experts, _unknown_param], ids=["intact", "fewer_experts",
                                                                                 "unknown_param"])
def test_damaged_expert_adapter_rejected(damage, tmp_path, open_session):
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = _peft_adapter(tmp_path, base)
    args = hf_session_args(hf_dir, extra=lora_args(targets=["q_proj"], adapter=ad) + [EXP_ARG])
    if damage is None:
        open_session(args).close()
        return
    needle = damage(ad)
    msg = open_error(open_session, args, tmp_path)
    assert needle in msg and "adapter_" in msg, f"the error names neither {needle!r} nor the file: {msg}"


@pytest.mark.parametrize("value,needle", [("mlp.experts.up_proj", "mlp.experts.up_proj"),
                                          ("self_attn.q_proj.weight", "self_attn.q_proj.weight")])
def test_unknown_target_parameter_refused(value, needle, tmp_path, open_session):
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    msg = open_error(open_session, hf_session_args(hf_dir, extra=[f"--lora.rank={R}",
                                                                  f"--lora.target_parameters={value}"]), tmp_path)
    assert needle in msg and "lora.target_parameters" in msg, msg


def test_expert_lora_on_dense_model_refused(tmp_path, open_session):
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, oracle.tiny_config(vocab=64, hidden=32, inter=64, layers=1, heads=4,
                                                      kv_heads=2, head_dim=16), seed=1)
    msg = open_error(open_session, hf_session_args(hf_dir, extra=[f"--lora.rank={R}", EXP_ARG]), tmp_path)
    assert "no fused Qwen3-MoE experts" in msg and "lora.target_parameters" in msg, msg


def test_expert_lora_dropout_refused(tmp_path, open_session):
    """PEFT's ParamWrapper raises on lora_dropout != 0; so does ctitan."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    msg = open_error(open_session, hf_session_args(hf_dir, extra=[f"--lora.rank={R}", "--lora.dropout=0.1",
                                                                  EXP_ARG]), tmp_path)
    assert "lora.dropout" in msg and "target_parameters" in msg, msg
