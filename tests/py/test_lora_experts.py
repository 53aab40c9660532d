"""LoRA on Qwen3-MoE experts in PEFT's target_parameters form (lora.target_parameters):
ctitan against PEFT 0.21.2's ParamWrapper on transformers' fused experts
(mlp.experts.gate_up_proj [E, 2 Im, H], mlp.experts.down_proj [E, H, Im]) together with
adapters on the attention projections: logits, loss, every adapter gradient and AdamW steps
(fp32, to 1e-4; alpha / r and rsLoRA), the base bit-unchanged, adapter directories both
ways (PEFT -> ctitan through lora.adapter_path, ctitan -> PEFT through save_adapter, which
PeftModel.from_pretrained loads without a warning), the fresh init, and the refusals
(a wrong expert-adapter shape, an unknown parameter name, dropout, as PEFT refuses it).
The router (target_parameters gate.weight, and all-linear on Qwen3-MoE / Mixtral, which
PEFT resolves to the attention Linears, the experts and the routers) the same way.

Every expected number comes from PEFT / torch (oracle_lora.py)."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
import oracle_lora as OL
import oracle_moe
from conftest import hf_session_args
from test_lora import (ALPHA, OPT_ARGS, R, TOL, assert_base_unchanged, assert_step_matches, compare_steps,
                       lora_args, moe_dense_layer0, open_error, random_adapters_load_in_peft, session_steps, train_ref,
                       trained_in_session)
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


def check_loaded_adapter(s, pm, params, lora, hf_dir, cfg, tokens, labels, ref):
    """A session that loaded PEFT model pm's saved adapter: PEFT's adapter tensors (names in
    order, shapes) and only those trained, loaded bit for bit; PEFT's loss, logits and every
    adapter gradient (ref: OL.loss_logits_grads of pm on tokens, labels); 3 AdamW steps equal
    torch's; the base never moves."""
    names = [n for n in s.names() if ".lora_" in n]
    assert names == lora, f"adapters: {names}"
    bad = [n for n in lora if s.shapes[n] != tuple(params[n].shape)]
    assert not bad, f"shapes differ from PEFT's: {[(n, s.shapes[n], tuple(params[n].shape)) for n in bad]}"
    assert trained_in_session(s) == set(params)
    saved = OL.saved_state(pm)
    bad = [n for n in saved if not np.array_equal(s.get_param(n), saved[n])]
    assert not bad, f"adapter tensors not loaded exactly: {bad}"
    assert_base_unchanged(s, hf_dir)
    assert_step_matches(s, tokens, labels, *ref, lora)
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=12)
    compare_steps(session_steps(s, stream, lora), train_ref(pm, params, stream))
    assert_base_unchanged(s, hf_dir)


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
    check_loaded_adapter(s, pm, params, lora, hf_dir, cfg, tokens, labels, (ref_loss, ref_logits, ref_grads))


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
    assert conf.get("target_parameters") == ["down_proj"] and conf.get("target_modules") == [], conf
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
    random_adapters_load_in_peft(s, cfg, base, tmp_path / "saved", ".lora_")


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
    c["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.gate_proj"]
    f.write_text(json.dumps(c))
    return "mlp.experts.gate_proj"


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
    if needle is None:
        open_session(args).close()
        return
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
    assert "no fused MoE experts" in msg and "lora.target_parameters" in msg, msg


def test_expert_lora_dropout_refused(tmp_path, open_session):
    """PEFT's ParamWrapper raises on lora_dropout != 0; so does ctitan."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    msg = open_error(open_session, hf_session_args(hf_dir, extra=[f"--lora.rank={R}", "--lora.dropout=0.1",
                                                                  EXP_ARG]), tmp_path)
    assert "lora.dropout" in msg and "target_parameters" in msg, msg


def test_expert_lora_bf16_vs_peft_autocast(tmp_path, open_session):
    """bf16 mixed precision against PEFT under torch.autocast("cpu", bfloat16), with
    test_bf16.py's measured yardstick: d_amp = |autocast - fp32| per tensor (PEFT's fold
    W + scale B A runs in fp32 with autocast off, then the experts' products in bf16, as
    ctitan's). The loss within 1e-3 of autocast's; each trained tensor's gradient within
    4 d_amp of autocast's (median ratio <= 1.5), and away from ctitan's fp32 one (the mode
    applies to the experts too)."""
    import torch
    from test_bf16 import BF16

    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=OL.EXPERTS, seed=6)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    l32, _, g32 = OL.loss_logits_grads(pm, params, tokens, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lam, _, gam = OL.loss_logits_grads(pm, params, tokens, labels)
    assert abs(lam - l32) <= 1e-3 * l32, "the yardstick itself moved"
    res = {}
    for mode in ("fp32", "bf16"):
        s = open_session(hf_session_args(hf_dir, batch=2, seq_len=L, extra=lora_args(
            targets=["q_proj"], adapter=ad) + [EXP_ARG] + ([BF16] if mode == "bf16" else [])))
        s.zero_grad()
        nv = oracle.n_valid(labels)
        res[mode] = (s.forward_backward(tokens, labels, nv) / nv, {n: s.get_grad(n) for n in params})
        s.close()
    assert abs(res["bf16"][0] - lam) <= 1e-3 * lam, f"ctitan bf16 loss {res['bf16'][0]} vs autocast {lam}"
    bad, ratios = [], []
    for n in params:
        d_amp = oracle.rel_err(gam[n], g32[n])
        d_ct = oracle.rel_err(res["bf16"][1][n], gam[n])
        d_mode = oracle.rel_err(res["bf16"][1][n], res["fp32"][1][n])
        ratios.append(d_ct / d_amp)
        if not d_ct <= 4 * d_amp:
            bad.append(f"{n}: ctitan-bf16 vs autocast {d_ct:.2e} > 4 x {d_amp:.2e}")
        if not (d_mode >= 1e-3 and d_mode >= 0.1 * d_amp):
            bad.append(f"{n}: ctitan-bf16 vs fp32 only {d_mode:.2e}: bf16 not applied?")
    assert not bad, "\n".join(bad)
    assert np.median(ratios) <= 1.5, f"median ratio {np.median(ratios):.2f}"


def test_expert_lora_per_layer_names_both_ways(tmp_path, open_session):
    """PEFT's suffix rule picks layers: "layers.2.mlp.experts.gate_up_proj" adapts layer
    2's gate_up_proj only, "experts.down_proj" every MoE layer's down_proj, so layer 1
    has one wrapper (down_proj's keys without base_layer) and layer 2 two. PEFT's adapter
    loads in ctitan with PEFT's logits; ctitan's save lists every layer's full parameter
    name and loads back in PEFT with ctitan's logits."""
    cfg = oracle_moe.tiny_moe_config(vocab=128, layers=3, experts=4, top_k=2, mlp_only=(0,))
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle_moe.build_moe_model(cfg, seed=5).save_pretrained(str(hf_dir))

    def base():
        m = oracle.load_hf(hf_dir)
        m.config._experts_implementation = "eager"
        return m

    tp = ["layers.2.mlp.experts.gate_up_proj", "experts.down_proj"]
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=["v_proj"], target_parameters=tp, seed=4)
    pm.save_pretrained(str(ad))
    lora = OL.lora_names([0], ["v_proj"]) + OL.lora_names([1], ["v_proj"]) + OL.expert_lora_names(1, ["down_proj"]) \
        + OL.lora_names([2], ["v_proj"]) + OL.expert_lora_names(2, ["gate_up_proj", "down_proj"])
    assert sorted(OL.trainable(pm)) == sorted(lora), f"test setup: PEFT trains {sorted(OL.trainable(pm))}"
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=2)
    want = oracle.hf_logits(pm, tokens)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=L, extra=lora_args(targets=["v_proj"], adapter=ad) + [
        "--lora.target_parameters=" + ",".join(tp)]))
    assert [n for n in s.names() if ".lora_" in n] == lora
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"ctitan logits from PEFT's adapter: rel err {err:.3g}"
    out = tmp_path / "saved"
    s.save_adapter(out)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert sorted(conf["target_parameters"]) == ["model.layers.1.mlp.experts.down_proj",
                                                 "model.layers.2.mlp.experts.down_proj",
                                                 "model.layers.2.mlp.experts.gate_up_proj"], conf
    pm2 = OL.load_adapter_strict(base(), out)
    err = oracle.rel_err(oracle.hf_logits(pm2, tokens), want)
    assert err <= TOL, f"PEFT logits with ctitan's saved adapter: rel err {err:.3g}"


# --------------------------------------------------------------------------- PEFT's rewrite of MLP target_modules

REWRITE = ["q_proj", "gate_proj", "up_proj", "down_proj"]
PAT = r".*\.gate_up_proj"


@pytest.mark.parametrize("rslora", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_rewritten_mlp_targets_parity_from_peft_adapter(rslora, tmp_path, open_session):
    """LoraConfig(target_modules=[q_proj, gate_proj, up_proj, down_proj]) on a Qwen3-MoE:
    PEFT rewrites the MLP names into target_parameters gate_up_proj (rank 2r, alpha 2 alpha
    through rank_pattern / alpha_pattern) and down_proj (r), the dense layer 0's MLP
    unadapted. ctitan with the same lora.target_modules has PEFT's tensors, loads its
    adapter exactly, and gives its logits, loss, gradients and 3 AdamW steps (rsLoRA: the
    fused parameter's scale is 2 alpha / sqrt(2 r), not alpha / sqrt(r))."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=REWRITE, rslora=rslora, seed=6)
    pm.save_pretrained(str(ad))
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["rank_pattern"] == {PAT: 2 * R} and conf["alpha_pattern"] == {PAT: 2 * ALPHA}, \
        f"test setup: PEFT's rewrite changed: {conf['rank_pattern']} {conf['alpha_pattern']}"
    params = OL.trainable(pm)
    lora = expected_lora(cfg, ["q_proj"])
    assert sorted(params) == sorted(lora), f"test setup: PEFT trains {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=REWRITE, rslora=rslora, adapter=ad)))
    assert [n for n in s.names() if ".lora_" in n] == lora
    bad = [n for n in lora if s.shapes[n] != tuple(params[n].shape)]
    assert not bad, f"shapes differ from PEFT's: {[(n, s.shapes[n], tuple(params[n].shape)) for n in bad]}"
    saved = OL.saved_state(pm)
    bad = [n for n in saved if not np.array_equal(s.get_param(n), saved[n])]
    assert not bad, f"adapter tensors not loaded exactly: {bad}"
    assert_step_matches(s, tokens, labels, ref_loss, ref_logits, ref_grads, lora)
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=12)
    compare_steps(session_steps(s, stream, lora), train_ref(pm, params, stream))
    assert_base_unchanged(s, hf_dir)


def test_default_targets_on_moe_as_peft_rewrites_them(tmp_path, open_session):
    """lora.rank alone (target_modules all seven) on a Qwen3-MoE from ctitan's fresh init:
    the tensors PEFT's get_peft_model gives for the seven names (shapes: gate_up_proj at
    2r), A uniform in +-1/sqrt(in) and B zero; after 2 steps the saved directory has
    PEFT's rank_pattern / alpha_pattern and target_parameters, loads in PEFT strictly and
    gives ctitan's logits."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=4, extra=OPT_ARGS + [
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}"]))
    ref_pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=OL.ALL7)
    ref = {n: tuple(p.shape) for n, p in OL.trainable(ref_pm).items()}
    lora = [n for n in s.names() if ".lora_" in n]
    assert sorted(lora) == sorted(ref) and all(s.shapes[n] == ref[n] for n in lora), \
        f"ctitan {[(n, s.shapes[n]) for n in lora]} vs PEFT {ref}"
    for n in lora:
        v = s.get_param(n)
        if ".lora_B." in n:
            assert not np.any(v), n
        else:
            bound = 1 / np.sqrt(s.shapes[n][1])
            assert np.all(np.abs(v) <= bound) and np.abs(v).max() > 0.8 * bound, n
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=3)
    session_steps(s, stream, [], run=2)
    ad = tmp_path / "saved"
    s.save_adapter(ad)
    ref_pm.save_pretrained(str(tmp_path / "peft"))
    want = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    conf = json.loads((ad / "adapter_config.json").read_text())
    for k in ("rank_pattern", "alpha_pattern", "r", "lora_alpha"):
        assert conf[k] == want[k], f"{k}: ctitan {conf[k]} vs PEFT {want[k]}"
    assert sorted(conf["target_modules"]) == sorted(want["target_modules"]), conf
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=9)
    pm = OL.load_adapter_strict(base(), ad)
    want_logits = oracle.hf_logits(pm, tokens)
    assert oracle.rel_err(want_logits, oracle.hf_logits(base(), tokens)) > 10 * TOL, "test setup: 2 steps changed nothing"
    err = oracle.rel_err(s.logits(tokens), want_logits)
    assert err <= TOL, f"ctitan logits vs PEFT with ctitan's adapter: rel err {err:.3g}"


def test_gate_without_up_refused_as_peft(tmp_path, open_session):
    """PEFT refuses gate_proj without up_proj on a Qwen3-MoE (both are in gate_up_proj);
    so does ctitan, naming the key and the missing name."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    with pytest.raises(ValueError, match="up_proj"):
        OL.make_peft(base(), r=R, alpha=ALPHA, targets=["q_proj", "gate_proj"])
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=["q_proj", "gate_proj"])),
                     tmp_path)
    assert "lora.target_modules" in msg and "up_proj" in msg, msg


def _pattern_on_linear(ad):
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    c["rank_pattern"] = {PAT: 2 * R, "q_proj": 8}
    f.write_text(json.dumps(c))
    return "q_proj"


def _no_pattern(ad):
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    c["rank_pattern"], c["alpha_pattern"] = {}, {}
    f.write_text(json.dumps(c))
    return "rank_pattern"


def _first_key_wins(ad):
    """Two keys select gate_up_proj: PEFT takes the first that matches (get_pattern_key),
    here 3 r, which the 2 r tensors and the run's 2 r do not have."""
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    c["rank_pattern"] = {"mlp.experts.gate_up_proj": 3 * R, PAT: 2 * R}
    f.write_text(json.dumps(c))
    return "rank_pattern"


def _second_key_ignored(ad):
    """The same keys the other way round: the first, 2 r, is the run's, so it loads."""
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    c["rank_pattern"] = {PAT: 2 * R, "mlp.experts.gate_up_proj": 3 * R}
    f.write_text(json.dumps(c))
    return None


@pytest.mark.parametrize("damage", [None, _pattern_on_linear, _no_pattern, _first_key_wins, _second_key_ignored],
                         ids=["intact", "pattern_on_linear", "no_pattern", "first_key_wins", "second_key_ignored"])
def test_rewritten_adapter_patterns_checked(damage, tmp_path, open_session):
    """PEFT's rewritten adapter loads; a rank_pattern key on a Linear module is refused
    naming it, one without its patterns (gate_up_proj's tensors at 2r, config r) is
    refused naming rank_pattern, and of two keys for one parameter the first that
    matches counts, as in PEFT."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    OL.make_peft(base(), r=R, alpha=ALPHA, targets=REWRITE, seed=1).save_pretrained(str(ad))
    args = hf_session_args(hf_dir, extra=lora_args(targets=REWRITE, adapter=ad))
    if damage is None:
        open_session(args).close()
        return
    needle = damage(ad)
    if needle is None:
        open_session(args).close()
        return
    msg = open_error(open_session, args, tmp_path)
    assert needle in msg and "adapter_config.json" in msg, f"the error names neither {needle!r} nor the file: {msg}"


# --------------------------------------------------------------------------- the router (mlp.gate.weight)

ROUTER = [f"model.layers.1.mlp.gate.lora_{x}.weight" for x in "AB"]
# (LoraConfig target_modules, target_parameters, use_rslora); "all-linear" on a MoE model is
# PEFT's q/k/v/o_proj Linears plus target_parameters gate.weight, gate_up_proj (2 r, 2 alpha)
# and down_proj, and no adapter on the dense layer's MLP
ROUTER_CASES = {"all_linear": ("all-linear", None, False), "gate_weight_only": ([], ["gate.weight"], False),
                "all_linear_rslora": ("all-linear", None, True)}


def router_args(targets, tparams, rslora=False, adapter=None):
    a = [f"--lora.rank={R}", f"--lora.alpha={ALPHA}",
         "--lora.target_modules=" + (targets if isinstance(targets, str) else ",".join(targets))]
    if tparams:
        a.append("--lora.target_parameters=" + ",".join(tparams))
    if rslora:
        a.append("--lora.use_rslora=true")
    if adapter is not None:
        a.append(f"--lora.adapter_path={adapter}")
    return a


def expected_router_lora(cfg, targets):
    """ctitan's adapter names in table order: per layer the attention ones, then (MoE
    layers) the router's, then the experts' (with the experts, at the layer's end)."""
    out = []
    for l in range(cfg.num_hidden_layers):
        if targets == "all-linear":
            out += OL.lora_names([l], OL.ATTN)
        if l not in cfg.mlp_only_layers:
            out += [f"model.layers.{l}.mlp.gate.lora_{x}.weight" for x in "AB"]
            if targets == "all-linear":
                out += OL.expert_lora_names(l, ("gate_up_proj", "down_proj"))
    return out


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_parity_from_peft_adapter(case, tmp_path, open_session):
    """PEFT's LoraConfig(target_modules="all-linear") on a Qwen3-MoE (dense layer 0, sparse
    layer 1), and target_parameters ["gate.weight"] alone, with random non-zero A and B:
    ctitan with the same [lora] loads the directory, has PEFT's tensors (the router's
    A [r, H], B [E, r] under mlp.gate), trains exactly them, gives PEFT's logits, loss and
    every adapter gradient, and 3 AdamW steps equal torch's; the base stays bit-identical;
    the adapter ctitan then saves loads in PEFT strictly with ctitan's logits."""
    targets, tparams, rslora = ROUTER_CASES[case]
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=targets, rslora=rslora, target_parameters=tparams, seed=6)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    lora = expected_router_lora(cfg, targets)
    assert sorted(params) == sorted(lora), f"test setup: PEFT trains {sorted(params)}"
    assert tuple(params[ROUTER[0]].shape) == (R, cfg.hidden_size) and \
        tuple(params[ROUTER[1]].shape) == (cfg.num_experts, R), "test setup: the router's adapter shapes"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    assert oracle.rel_err(ref_logits, oracle.hf_logits(base(), tokens)) > 100 * TOL, \
        "test setup: the adapter hardly changes the logits"
    assert np.abs(ref_grads[ROUTER[1]]).max() > 0, "test setup: no gradient reaches the router's B"

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + router_args(
        targets, tparams, rslora, ad)))
    check_loaded_adapter(s, pm, params, lora, hf_dir, cfg, tokens, labels, (ref_loss, ref_logits, ref_grads))

    out = tmp_path / "saved"
    s.save_adapter(out)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert "gate.weight" in conf["target_parameters"], conf
    back = OL.load_adapter_strict(base(), out)
    err = oracle.rel_err(s.logits(tokens), oracle.hf_logits(back, tokens))
    assert err <= TOL, f"PEFT with ctitan's adapter: logits rel err {err:.3g}"


def test_router_all_linear_fresh_save_loads_in_peft(tmp_path, open_session):
    """lora.target_modules = all-linear on a Qwen3-MoE from ctitan's fresh init: the table
    is PEFT's (the router's A uniform in +-1/sqrt(H), B zero), the adapters set to random
    values are saved with PEFT's resolved config (q/k/v/o_proj, target_parameters with the
    router, gate_up_proj's rank_pattern / alpha_pattern at 2 r, 2 alpha) and load in PEFT
    strictly with ctitan's logits."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=4, extra=router_args("all-linear", None)))
    names = [n for n in s.names() if ".lora_" in n]
    assert names == expected_router_lora(cfg, "all-linear"), names
    A0, B0 = s.get_param(ROUTER[0]), s.get_param(ROUTER[1])
    bound = 1 / np.sqrt(cfg.hidden_size)
    assert not np.any(B0) and np.all(np.abs(A0) <= bound) and np.abs(A0).max() > 0.5 * bound
    ad = tmp_path / "saved"
    random_adapters_load_in_peft(s, cfg, base, ad, ".lora_")
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert sorted(conf["target_modules"]) == sorted(OL.ATTN), conf["target_modules"]
    assert sorted(conf["target_parameters"]) == sorted(["gate_up_proj", "down_proj", "gate.weight"]), \
        conf["target_parameters"]
    assert conf["rank_pattern"] == {r".*\.gate_up_proj": 2 * R} and \
        conf["alpha_pattern"] == {r".*\.gate_up_proj": 2 * ALPHA}, conf


def test_router_lora_dropout_refused(tmp_path, open_session):
    """PEFT's ParamWrapper refuses lora_dropout on the router as on the experts; so does
    ctitan (all-linear brings the router in)."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    msg = open_error(open_session, hf_session_args(hf_dir, extra=router_args([], ["gate.weight"]) + [
        "--lora.dropout=0.1"]), tmp_path)
    assert "lora.dropout" in msg and "router" in msg, msg


def test_mixtral_all_linear_router_parity_and_merge(tmp_path, open_session):
    """PEFT's all-linear on Mixtral (transformers v5: router mlp.gate, experts stacked as
    Qwen3-MoE's): ctitan loads PEFT's adapter and gives its logits, loss and every adapter
    gradient (the routers' among them); its saved adapter loads in PEFT strictly with its
    logits; merge keeps the logits."""
    import oracle_families as fam
    from test_families_lora import saved_case, session_matches_peft
    case, model, hf_dir, loaded = saved_case("mixtral_e4k2", tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets="all-linear", seed=5)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    routers = [n for n in params if ".mlp.gate.lora_" in n]
    assert len(routers) == 2 * model.config.num_hidden_layers, f"test setup: PEFT trains {sorted(params)}"
    tokens, labels = fam.batch(model, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=router_args("all-linear", None, False, ad)))
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    want = session_matches_peft(s, params, tokens, labels, ref, loaded, out)
    s.merge_adapter()
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"after merge: logits rel err {err:.3g}"


def test_router_rank_pattern_and_layers_to_transform_as_peft(tmp_path, open_session):
    """rank_pattern / alpha_pattern on the router (PEFT matches them against the parameter's
    full name model.layers.N.mlp.gate.weight: rank 2 r, alpha 3 alpha) and layers_to_transform
    [0] (PEFT's target_parameters ignore it: the router of layer 1 keeps its adapter while
    q_proj is adapted in layer 0 only): ctitan with the same modules and patterns loads PEFT's
    adapter, gives its logits, loss and every adapter gradient, and its saved adapter loads in
    PEFT strictly with its logits."""
    from test_families_lora import session_matches_peft
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pat = {"mlp.gate.weight": 2 * R}, {"mlp.gate.weight": 3 * ALPHA}
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=["gate.weight"],
                      rank_pattern=pat[0], alpha_pattern=pat[1], layers_to_transform=[0], seed=6)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert sorted(params) == sorted(OL.lora_names([0], ["q_proj"]) + ROUTER), f"test setup: {sorted(params)}"
    assert tuple(params[ROUTER[0]].shape) == (2 * R, cfg.hidden_size), "test setup: the router's rank"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=[
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.target_modules=model.layers.0.self_attn.q_proj",
        "--lora.target_parameters=gate.weight", f"--lora.rank_pattern={json.dumps(pat[0])}",
        f"--lora.alpha_pattern={json.dumps(pat[1])}", f"--lora.adapter_path={ad}"]))
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    session_matches_peft(s, params, tokens, labels, ref, base, tmp_path / "saved", load=load_router_pattern_adapter)


def load_router_pattern_adapter(model, ad):
    """OL.load_adapter_strict's checks, less PEFT 0.21.2's warning on a rank_pattern /
    alpha_pattern key of the router: that check looks at the Linear targets only, while the
    ParamWrapper does take the router's rank and alpha from it (its tensors are 2 r wide)."""
    import warnings
    from peft import PeftModel
    from safetensors.torch import load_file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any "
                                r"targeted module and were ignored: \['\.\*\\\\\.gate\\\\\.weight'\]\.$",
                                category=RuntimeWarning)
        pm = PeftModel.from_pretrained(model, str(ad))
    pm.eval()
    file = {k: v.float().numpy() for k, v in load_file(str(ad / "adapter_model.safetensors")).items()}
    got = {OL.PREFIX + k: v for k, v in OL.saved_state(pm).items()}
    assert set(file) == set(got), sorted(set(file) ^ set(got))
    assert all(np.array_equal(file[k], got[k]) for k in file), "tensors loaded with other values"
    return pm


def test_router_adapter_bf16_frozen_storage_is_bit_identical(tmp_path, open_session):
    """all-linear on a Qwen3-MoE whose weights are bf16 already: with training.frozen_dtype
    bfloat16 the frozen router is stored in bf16 and its adapter folds into its widening
    (W + scale B A in fp32, as PEFT's fold of an fp32 base): losses, the routers' adapter
    gradients over 3 steps, the logits and every tensor equal frozen_dtype float32's bit for
    bit."""
    cfg = oracle_moe.tiny_moe_config(vocab=256, layers=3, mlp_only=(1,))
    oracle_moe.build_moe_model(cfg, seed=11).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 256, (2, 16)).astype(np.int32)
    lab = rng.integers(0, 256, (2, 16)).astype(np.int32)
    runs = []
    for fd in ("float32", "bfloat16"):
        s = open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=16, extra=router_args("all-linear", None) + [
            f"--training.frozen_dtype={fd}"]))
        routers = [n for n in s.names() if ".mlp.gate.lora_" in n]
        assert len(routers) == 4, routers
        out = []
        for _ in range(3):
            out.append(s.forward_backward(tok, lab, 32))
            out += [s.get_grad(n) for n in routers]
            s.optimizer_step()
        out.append(s.logits(tok))
        out += [s.get_param(n) for n in s.names()]
        runs.append(out)
        s.close()
    assert np.any(runs[0][2 + 4]), "test setup: no gradient reaches the routers' B after a step"
    for i, (a, b) in enumerate(zip(*runs)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"item {i} differs between fp32 and bf16 storage"


def test_target_parameter_beyond_experts_and_routers_refused_as_peft(tmp_path, open_session):
    """target_parameters ["weight"]: PEFT matches an item against every parameter's name (equal,
    or ending with "." + the item), so besides the routers it wraps the embedding, the
    projections and the norms, and raises on a norm's 1-D weight. ctitan, which adapted the
    routers alone and trained another model, refuses it, naming the key, the item and a
    parameter PEFT's rule selects that is neither an expert's nor a router's."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    with pytest.raises(ValueError, match="1 dimensional"):
        OL.make_peft(base(), r=R, alpha=ALPHA, targets=[], target_parameters=["weight"], seed=6)
    msg = open_error(open_session, hf_session_args(hf_dir, extra=router_args([], ["weight"])), tmp_path)
    assert 'lora.target_parameters: "weight" also selects ' in msg, msg
    other = msg.split(" also selects ", 1)[1].split(" ", 1)[0]
    names = [n for n, _ in base().named_parameters()]
    assert other in names and other.endswith(".weight") and ".mlp.gate." not in other and \
        ".mlp.experts." not in other, f"{other!r} is not another parameter PEFT's rule selects"


# target_modules holding "gate", PEFT's transformers-v4 name of the router module: PEFT
# 0.21.2's _convert_peft_config_moe maps it to target_parameters "gate.weight"
GATE_CASES = {"gate": ["gate"], "q_proj_gate": ["q_proj", "gate"]}


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_gate_in_target_modules_adapts_the_routers_as_peft(case, tmp_path, open_session):
    """LoraConfig(target_modules=["gate"]) / ["q_proj", "gate"] on a Qwen3-MoE (dense layer 0,
    sparse layer 1): PEFT trains the MoE layer's router (and q_proj), not the dense layer's
    MLP, and saves target_modules without "gate" and target_parameters ["gate.weight"].
    ctitan with the same lora.target_modules trains PEFT's set from a fresh start; with PEFT's
    random adapter it gives PEFT's logits, loss and every adapter gradient; the adapter it
    saves has PEFT's target_modules, target_parameters selecting the same parameters, and
    loads in PEFT strictly with ctitan's logits."""
    from test_families_lora import session_matches_peft
    targets = GATE_CASES[case]
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=targets, seed=6)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    attn = [t for t in targets if t != "gate"]
    want = []
    for l in range(cfg.num_hidden_layers):
        want += OL.lora_names([l], attn)
        if l not in cfg.mlp_only_layers:
            want += [f"model.layers.{l}.mlp.gate.lora_{x}.weight" for x in "AB"]
    assert sorted(params) == sorted(want), f"test setup: PEFT trains {sorted(params)}"
    peft_conf = json.loads((ad / "adapter_config.json").read_text())
    assert sorted(peft_conf["target_modules"]) == attn and peft_conf["target_parameters"] == ["gate.weight"], \
        f"test setup: PEFT saved {peft_conf}"

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=router_args(targets, None)))
    assert [n for n in s.names() if ".lora_" in n] == want
    assert trained_in_session(s) == set(params)
    s.close()

    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    assert np.abs(ref[2][ROUTER[1]]).max() > 0, "test setup: no gradient reaches the router's B"
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=router_args(targets, None, False, ad)))
    out = tmp_path / "saved"
    session_matches_peft(s, params, tokens, labels, ref, base, out)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert sorted(conf["target_modules"]) == attn, conf

    def selected(items):  # PEFT's rule for target_parameters over the model's parameter names
        return {n for n, _ in base().named_parameters() for t in items if n == t or n.endswith("." + t)}
    assert selected(conf["target_parameters"]) == selected(peft_conf["target_parameters"]), conf


def test_router_adapter_with_aux_loss_in_gradient_matches_peft(tmp_path, open_session):
    """output_router_logits true, router_aux_loss_coef 0.5: HF adds coef x the load-balancing
    loss to the loss, and its gradient reaches the router's adapter through the routing
    softmax. With PEFT's target_parameters ["gate.weight"] (random A, B), the router's A and B
    gradients of ctitan equal torch's of CE / n + coef x aux_loss, and the aux term is a
    sizeable share of them (the test sees it)."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path, aux=True, aux_coef=0.5)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=[], target_parameters=["gate.weight"], seed=6)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert sorted(params) == sorted(ROUTER), f"test setup: PEFT trains {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    n = oracle.n_valid(labels)
    t = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    lab = torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1)

    def grads(aux):
        pm.zero_grad(set_to_none=True)
        out = pm(input_ids=t, output_router_logits=aux)
        loss = torch.nn.functional.cross_entropy(out.logits.float().reshape(lab.numel(), -1), lab,
                                                 ignore_index=-100, reduction="sum") / n
        if aux:
            loss = loss + cfg.router_aux_loss_coef * out.aux_loss
        loss.backward()
        return {k: p.grad.detach().numpy().copy() for k, p in params.items()}

    ref, ce_only = grads(True), grads(False)
    for k in ref:
        share = oracle.rel_err(ce_only[k], ref[k])
        assert share > 0.1, f"test setup: the aux term is {share:.3g} of {k}'s gradient"

    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=L, extra=["--training.global_batch_size=2"] +
                                     router_args([], ["gate.weight"], False, ad)))
    s.zero_grad()
    s.forward_backward(tokens, labels, n)
    bad = [f"{k}: rel err {oracle.rel_err(s.get_grad(k), ref[k]):.3g}" for k in ref
           if not oracle.rel_err(s.get_grad(k), ref[k]) <= TOL]
    assert not bad, "router adapter gradients differ from PEFT's with the aux loss:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- adapter_config.json as PEFT spells it

# recipe: (LoraConfig / [lora] target_modules, target_parameters or None). ctitan's spelling of
# target_parameters is one canonical form (the short names PEFT's rewrite writes) whatever the
# items it was given, so the recipes that give target_parameters directly give them in that form
SPELLING_CASES = {
    "all_linear": ("all-linear", None),
    "seven": (OL.ALL7, None),
    "mlp": (OL.MLP, None),
    "q_proj_mlp": (["q_proj"] + OL.MLP, None),
    "gate": (["gate"], None),
    "q_proj_gate": (["q_proj", "gate"], None),
    "params_only": ([], ["gate_up_proj", "down_proj", "gate.weight"]),
    "q_proj_down_router": (["q_proj"], ["down_proj", "gate.weight"]),
    "mixtral_all_linear": ("all-linear", None),
    "mixtral_mlp": (["w1", "w3", "w2"], None),
}


@pytest.mark.parametrize("case", list(SPELLING_CASES))
def test_saved_adapter_config_spelled_as_peft(case, tmp_path, open_session):
    """For the same recipe on a Qwen3-MoE (dense layer 0, sparse layer 1) or a Mixtral, the
    adapter_config.json ctitan saves holds PEFT 0.21's target_modules (a list, [] where no
    Linear is adapted, not null), target_parameters (the short names gate_up_proj, down_proj,
    gate.weight of PEFT's rewrite), rank_pattern and alpha_pattern. PEFT builds its lists
    from sets (all-linear's target_modules come out in set order), so the lists compare as
    sets; each list must hold no repeated item either."""
    targets, tparams = SPELLING_CASES[case]
    if case.startswith("mixtral"):
        from test_families_lora import saved_case
        _, _, hf_dir, base = saved_case("mixtral_e4k2", tmp_path)
    else:
        _, hf_dir, base = moe_dense_layer0(tmp_path)
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=targets, target_parameters=tparams)
    pm.save_pretrained(str(tmp_path / "peft"))
    want = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=router_args(targets, tparams)))
    assert sorted(n for n in s.names() if ".lora_" in n) == sorted(OL.trainable(pm)), "test setup: other adapters"
    s.save_adapter(tmp_path / "saved")
    got = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    bad = []
    for k in ("target_modules", "target_parameters"):
        w, g = want.get(k), got.get(k)
        if not isinstance(w, list):
            bad.append(f"test setup: PEFT's {k} is {w!r}, not a list")
        elif not isinstance(g, list) or len(set(g)) != len(g) or set(g) != set(w):
            bad.append(f"{k}: ctitan {g!r}, PEFT {w!r}")
    bad += [f"{k}: ctitan {got.get(k)!r}, PEFT {want.get(k)!r}" for k in ("rank_pattern", "alpha_pattern")
            if got.get(k) != want.get(k)]
    assert not bad, "adapter_config.json differs from PEFT's:\n" + "\n".join(bad)


@pytest.mark.parametrize("spelling", ["peft", "older_ctitan"])
def test_adapter_config_read_in_either_spelling(spelling, tmp_path, open_session):
    """PEFT's adapter with random A and B on the experts and the router alone (target_modules
    [], target_parameters gate_up_proj, down_proj, gate.weight), as PEFT saved it and as
    ctitan saved such an adapter before it wrote PEFT's spelling (target_modules null,
    target_parameters mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight):
    ctitan loads both with PEFT's logits."""
    tparams = ["gate_up_proj", "down_proj", "gate.weight"]
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=[], target_parameters=tparams, seed=6)
    pm.save_pretrained(str(ad))
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    assert c["target_modules"] == [] and sorted(c["target_parameters"]) == sorted(tparams), f"test setup: {c}"
    if spelling == "older_ctitan":
        c["target_modules"] = None
        c["target_parameters"] = OL.EXPERTS + ["mlp.gate.weight"]
        f.write_text(json.dumps(c))
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=7)
    want = oracle.hf_logits(pm, tokens)
    assert oracle.rel_err(want, oracle.hf_logits(base(), tokens)) > 100 * TOL, "test setup: the adapter does nothing"
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=router_args([], tparams, False, ad)))
    assert sorted(n for n in s.names() if ".lora_" in n) == sorted(OL.trainable(pm))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"ctitan logits with the adapter in {spelling}'s spelling: rel err {err:.3g}"
