"""LoRA fine-tuning and frozen tensors: ctitan against PEFT (peft 0.21.2) on transformers'
Qwen3 / Qwen3-MoE (eager, fp32) and torch.optim: logits, loss, every adapter gradient,
AdamW steps over the adapters only, adapter directories both ways (PEFT -> ctitan through
lora.adapter_path, ctitan -> PEFT through ctitan_save_adapter and `ctitan train`), the
fresh initialisation, training.freeze without LoRA, and damaged adapter files.

Every expected number comes from PEFT / torch (oracle_lora.py); ctitan's own numbers are
only compared with them, or with themselves where a value must be bit-identical."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
import oracle_lora as OL
import oracle_moe
from conftest import CtitanError, hf_session_args
from test_parity import make_batch
from test_train_loop import GLOBAL_BS, HP, LOCAL_BS, L, close, train_sections

TOL = 1e-4
R, ALPHA = 4, 8.0
SCHED = 10  # the schedule is laid out for 10 steps; the tests run the first RUN
RUN = 3

# From the fresh init (B = 0) the first step makes B = -lr m / (sqrt(v) + eps) entirely, and
# an entry whose gradient is near eps moves by lr * (fp32 noise of the gradient) / eps:
# with eps 1e-4 torch fp32 itself is 2e-4 (of max |B|) away from torch fp64 there
# (measured), so a correct fp32 implementation could fail 1e-4. With eps 3e-3 (28% of
# these B gradients are below it: eps still shapes the updates) fp32 vs fp64 is < 1e-5.
FRESH_HP = dict(HP, eps=3e-3)


def opt_args(hp=HP):
    return [f"--training.global_batch_size={GLOBAL_BS}", f"--training.steps={SCHED}",
            f"--training.max_norm={hp['max_norm']}", f"--optimizer.lr={hp['lr']}", f"--optimizer.eps={hp['eps']}",
            f"--optimizer.weight_decay={hp['weight_decay']}", f"--optimizer.beta1={hp['betas'][0]}",
            f"--optimizer.beta2={hp['betas'][1]}", f"--lr_scheduler.warmup_steps={hp['warmup_steps']}",
            f"--lr_scheduler.decay_type={hp['decay_type']}", f"--lr_scheduler.min_lr_factor={hp['min_lr_factor']}"]


OPT_ARGS = opt_args()


def dense_cfg():
    return oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                              rope_theta=1e4, tied=False)


def lora_args(r=R, alpha=ALPHA, targets=None, rslora=False, adapter=None, modules_to_save=None):
    a = [f"--lora.rank={r}", f"--lora.alpha={alpha}", f"--lora.use_rslora={'true' if rslora else 'false'}"]
    if targets is not None:
        a.append(f"--lora.target_modules={','.join(targets)}")
    if modules_to_save:
        a.append(f"--lora.modules_to_save={','.join(modules_to_save)}")
    if adapter is not None:
        a.append(f"--lora.adapter_path={adapter}")
    return a


def assert_step_matches(s, tokens, labels, ref_loss, ref_logits, ref_grads, names):
    """One micro-batch in session s against PEFT's: logits, loss and the gradient of each of
    `names`, to TOL."""
    err = oracle.rel_err(s.logits(tokens), ref_logits)
    assert err <= TOL, f"logits rel err {err:.3g}"
    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert close(loss, ref_loss, TOL), f"loss {loss} vs PEFT {ref_loss}"
    bad = [f"{n}: rel err {oracle.rel_err(s.get_grad(n), ref_grads[n]):.3g}" for n in names
           if not oracle.rel_err(s.get_grad(n), ref_grads[n]) <= TOL]
    assert not bad, "adapter gradients differ from torch autograd:\n" + "\n".join(bad)


def train_ref(pm, params, tokens, run=RUN, hp=HP):
    return OL.train(pm, params, tokens, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=SCHED,
                    run_steps=run, **hp)


def session_steps(s, tokens, names, run=RUN):
    """The loop of train_ref through the session API: per step loss, grad norm, lr and
    the values of `names` after the step."""
    accum = GLOBAL_BS // LOCAL_BS
    mbs = oracle.micro_batches(tokens, L, LOCAL_BS, run * accum)
    out = []
    for step in range(run):
        part = mbs[accum * step:accum * (step + 1)]
        total = sum(oracle.n_valid(lab) for _, lab in part)
        s.zero_grad()
        loss = sum(s.forward_backward(inp, lab, total) for inp, lab in part) / total
        gn, lr = s.optimizer_step()
        out.append({"loss": loss, "grad_norm": gn, "lr": lr, "params": {n: s.get_param(n) for n in names}})
    return out


def compare_steps(got, ref):
    assert len(got) == len(ref)
    bad = []
    for i, (g, r) in enumerate(zip(got, ref)):
        step = i + 1
        if not close(g["loss"], r["loss"], TOL):
            bad.append(f"step {step}: loss {g['loss']} vs torch {r['loss']}")
        if not close(g["grad_norm"], r["grad_norm"], TOL):
            bad.append(f"step {step}: grad norm {g['grad_norm']} vs torch {r['grad_norm']}")
        if not close(g["lr"], r["lr"], 1e-9):
            bad.append(f"step {step}: lr {g['lr']} vs torch {r['lr']}")
        for n, want in r["params"].items():
            e = oracle.rel_err(g["params"][n], want)
            if not e <= TOL:
                bad.append(f"step {step}: {n}: rel err {e:.3g}")
    assert not bad, "optimizer steps differ from the PyTorch loop over the trained tensors:\n" + "\n".join(bad)


def assert_table(s, base_names, layers, targets, ref_shapes):
    """ctitan's tensor table: the base tensors, and after each layer's base tensors (but
    before a MoE layer's experts) that layer's adapters (q, k, v, o, gate, up, down; lora_A
    then lora_B), with PEFT's shapes."""
    lora = OL.lora_names(range(layers), targets)
    names = s.names()
    assert set(names) == set(base_names) | set(lora), \
        f"tensor table: missing {sorted(set(base_names) | set(lora) - set(names))}, " \
        f"unexpected {sorted(set(names) - set(base_names) - set(lora))}"
    assert [n for n in names if ".lora_" in n] == lora, "adapters not in the order layer, q k v o gate up down, A B"
    pos = {n: i for i, n in enumerate(names)}
    for l in range(layers):
        mine = [pos[n] for n in lora if n.startswith(f"model.layers.{l}.")]
        # a MoE layer's experts come after the adapters: they and their own adapters end the layer
        base_l = [pos[n] for n in base_names if n.startswith(f"model.layers.{l}.") and ".experts." not in n]
        base_next = [pos[n] for n in base_names if n.startswith(f"model.layers.{l + 1}.")]
        if mine:
            assert min(mine) > max(base_l), f"layer {l}: adapters before the layer's base tensors"
            if base_next:
                assert max(mine) < min(base_next), f"layer {l}: adapters after layer {l + 1}'s base tensors"
    for n in lora:
        assert s.shapes[n] == ref_shapes[n], f"{n}: shape {s.shapes[n]} vs PEFT {ref_shapes[n]}"


def assert_base_unchanged(s, hf_dir, trained=()):
    saved = oracle.read_hf_tensors(hf_dir)
    bad = [n for n in saved if n not in trained and not np.array_equal(s.get_param(n), saved[n])]
    assert not bad, f"frozen base tensors changed: {bad}"


def open_error(open_session, args, tmp_path) -> str:
    """ctitan_open must fail: its message, without the echo of the arguments and with the
    test's directory written <tmp> (its name must not satisfy a check on the message)."""
    with pytest.raises(CtitanError) as ei:
        open_session(args)
    msg = str(ei.value)
    msg = msg.split("]) failed: ", 1)[1] if "]) failed: " in msg else msg
    return msg.replace(str(tmp_path), "<tmp>")


def assert_frozen_grad_refused(s, name):
    with pytest.raises(CtitanError, match="frozen"):
        s.get_grad(name)


# --------------------------------------------------------------------------- 1. dense parity

def trained_in_session(s):
    """The tensors whose gradient the session gives (the others must be refused as frozen)."""
    out = set()
    for n in s.names():
        try:
            s.get_grad(n)
            out.add(n)
        except CtitanError as e:
            assert "frozen" in str(e), f"get_grad({n}): {e}"
    return out


DENSE_CASES = [
    ("all7_alpha_over_r", dict(rslora=False, targets=OL.ALL7, mts=())),
    ("all7_rslora", dict(rslora=True, targets=OL.ALL7, mts=())),
    # PEFT: a modules_to_save name matches every module whose name ends with it, so "norm"
    # is model.norm and every layer's input/post_attention_layernorm, q_norm and k_norm
    ("q_v_up_mts_lm_head_norm", dict(rslora=False, targets=["q_proj", "v_proj", "up_proj"],
                                     mts=("lm_head", "norm"))),
]


@pytest.mark.parametrize("case", [c[1] for c in DENSE_CASES], ids=[c[0] for c in DENSE_CASES])
def test_dense_parity_from_peft_adapter(case, tmp_path, open_session):
    """A PEFT adapter with random non-zero A and B (and modules_to_save copies that differ
    from the base) on a dense Qwen3: ctitan loads it through lora.adapter_path, trains
    exactly the tensors PEFT trains, and gives PEFT's logits, loss and gradients; then 3
    AdamW steps over those tensors only equal torch's; the rest stays bit-identical."""
    rslora, targets, mts = case["rslora"], case["targets"], list(case["mts"])
    cfg = dense_cfg()
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=targets, rslora=rslora,
                      modules_to_save=mts, seed=5)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    lora = OL.lora_names(range(cfg.num_hidden_layers), targets)
    assert sorted(n for n in params if ".lora_" in n) == sorted(lora), "test setup: PEFT adapts other modules"
    assert bool(mts) == (len(params) > len(lora)), "test setup: modules_to_save"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=5)
    base_logits = oracle.hf_logits(oracle.load_hf(hf_dir), tokens)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    assert oracle.rel_err(ref_logits, base_logits) > 100 * TOL, "test setup: the adapter hardly changes the logits"

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=targets, rslora=rslora, adapter=ad, modules_to_save=mts)))
    base_names = oracle.expected_tensor_names(oracle.load_hf(hf_dir))
    assert_table(s, base_names, cfg.num_hidden_layers, targets, {n: tuple(p.shape) for n, p in params.items()})
    trained = trained_in_session(s)
    assert trained == set(params), \
        f"ctitan trains {sorted(trained - set(params))} that PEFT does not, and not {sorted(set(params) - trained)}"
    saved = OL.saved_state(pm)
    assert set(saved) == set(params)
    bad = [n for n in saved if not np.array_equal(s.get_param(n), saved[n])]
    assert not bad, f"adapter tensors not loaded exactly: {bad}"
    assert_base_unchanged(s, hf_dir, trained=params)

    assert_step_matches(s, tokens, labels, ref_loss, ref_logits, ref_grads, params)

    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=11)
    ref = train_ref(pm, params, stream)
    compare_steps(session_steps(s, stream, list(params)), ref)
    assert_base_unchanged(s, hf_dir, trained=params)


# --------------------------------------------------------------------------- 2. MoE parity

def moe_dense_layer0(tmp_path, **cfg_kw):
    """A tiny Qwen3-MoE (layer 0 dense, layer 1 sparse; cfg_kw: tiny_moe_config's, e.g. the
    load-balancing loss) saved in tmp_path / "hf", and a loader of it with eager experts."""
    cfg = oracle_moe.tiny_moe_config(vocab=128, layers=2, experts=4, top_k=2, mlp_only=(0,), **cfg_kw)
    hf_dir = tmp_path / "hf"
    oracle_moe.build_moe_model(cfg, seed=13).save_pretrained(str(hf_dir))

    def base():
        m = oracle.load_hf(hf_dir)
        m.config._experts_implementation = "eager"
        return m

    return cfg, hf_dir, base


def test_moe_parity_from_peft_adapter(tmp_path, open_session):
    """Qwen3-MoE with a dense layer (mlp_only_layers=[0]) and a sparse one, adapters on the
    attention projections only (the MLP names are PEFT's rewrite into expert adapters:
    test_lora_experts.py)."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=OL.ATTN, seed=6)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    lora = OL.lora_names(range(cfg.num_hidden_layers), OL.ATTN)
    assert sorted(params) == sorted(lora), f"test setup: PEFT trains {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=7)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    assert oracle.rel_err(ref_logits, oracle.hf_logits(base(), tokens)) > 100 * TOL, \
        "test setup: the adapter hardly changes the logits"

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=OL.ATTN, adapter=ad)))
    base_names = oracle_moe.expected_names(base())
    assert_table(s, base_names, cfg.num_hidden_layers, OL.ATTN, {n: tuple(p.shape) for n, p in params.items()})
    assert_base_unchanged(s, hf_dir)

    assert_step_matches(s, tokens, labels, ref_loss, ref_logits, ref_grads, lora)
    trained = trained_in_session(s)
    assert trained == set(params), f"ctitan trains {sorted(trained - set(params))}, not {sorted(set(params) - trained)}"

    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=12)
    compare_steps(session_steps(s, stream, lora), train_ref(pm, params, stream))
    assert_base_unchanged(s, hf_dir)


def test_moe_default_targets_saved_adapter_loads_in_peft(tmp_path, open_session):
    """lora.rank alone (target_modules defaulting to all seven) on a Qwen3-MoE with a dense
    layer: the adapter directory ctitan writes must load in PEFT without a warning, every
    tensor of the file must land in the model, and PEFT's logits must be ctitan's. PEFT
    reads gate_proj / up_proj / down_proj on qwen3_moe as the fused experts'
    target_parameters (no MLP Linear is wrapped, not even the dense layer's), so the
    adapter's MLP part must be something PEFT reads the same way."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=[f"--lora.rank={R}"]))
    random_adapters_load_in_peft(s, cfg, base, tmp_path / "saved_adapter", ".lora_B.")


def random_adapters_load_in_peft(s, cfg, base, ad, which):
    """Session s's adapter tensors whose names hold `which` set to random values (non-zero B:
    every adapter shows in the logits), saved to ad: the directory loads in PEFT strictly over
    base() and gives s's logits."""
    rng = np.random.default_rng(3)
    for n in s.names():
        if which in n:
            s.set_param(n, rng.normal(0, 0.1, s.shapes[n]).astype(np.float32))
    s.save_adapter(ad)
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=9)
    pm = OL.load_adapter_strict(base(), ad)
    err = oracle.rel_err(s.logits(tokens), oracle.hf_logits(pm, tokens))
    assert err <= TOL, f"ctitan logits vs PEFT with ctitan's adapter: rel err {err:.3g}"


def test_moe_peft_expert_adapter_needs_its_targets(tmp_path, open_session):
    """PEFT's adapter for all seven targets on a Qwen3-MoE adapts the fused experts
    (target_parameters gate_up_proj / down_proj, gate_up_proj at rank 2r through
    rank_pattern): ctitan opens it with the same seven target_modules (the parity is in
    test_lora_experts.py), and refuses it with the adapter's remaining target_modules
    (attention only: no expert adapters in the run), naming the file or key, rather than
    load the rest."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=OL.ALL7, seed=2)
    assert any(".mlp.experts." in n for n in OL.trainable(pm)), "test setup: PEFT adapts no expert"
    pm.save_pretrained(str(ad))
    conf = json.loads((ad / "adapter_config.json").read_text())
    open_session(hf_session_args(hf_dir, extra=lora_args(targets=OL.ALL7, adapter=ad))).close()
    targets = sorted(conf["target_modules"])
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=targets, adapter=ad)), tmp_path)
    assert any(k in msg for k in ("adapter_config.json", "mlp.experts", "target_parameters")), \
        f"--lora.target_modules={','.join(targets)}: the error names neither the file nor the key: {msg}"


# --------------------------------------------------------------------------- 3. ctitan -> PEFT

SAVE_CASES = [
    ("all7", dict(r=4, alpha=8.0, targets=OL.ALL7, rslora=False, modules_to_save=())),
    ("qv_down_rslora_mts", dict(r=2, alpha=6.0, targets=["q_proj", "v_proj", "down_proj"], rslora=True,
                                modules_to_save=("lm_head", "embed_tokens"))),
]


@pytest.mark.parametrize("case", [c[1] for c in SAVE_CASES], ids=[c[0] for c in SAVE_CASES])
def test_saved_adapter_loads_in_peft(case, tmp_path, open_session):
    """2 training steps from the fresh init, ctitan_save_adapter: PeftModel.from_pretrained
    loads the directory without a warning, every tensor of the file lands in the model,
    and the logits are ctitan's; adapter_config.json says what was trained."""
    cfg = dense_cfg()
    hf_dir, ad = tmp_path / "hf", tmp_path / "saved_adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=17)
    targets, mts = case["targets"], list(case["modules_to_save"])
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=4, extra=OPT_ARGS + lora_args(
        r=case["r"], alpha=case["alpha"], targets=targets, rslora=case["rslora"], modules_to_save=mts)))
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=3)
    session_steps(s, stream, [], run=2)
    s.save_adapter(ad)
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=9)
    logits = s.logits(tokens)

    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf.get("peft_type") == "LORA" and conf.get("task_type") == "CAUSAL_LM", conf
    assert conf.get("r") == case["r"] and conf.get("lora_alpha") == case["alpha"], conf
    assert conf.get("use_rslora") is case["rslora"], conf
    assert sorted(conf.get("target_modules") or []) == sorted(targets), conf
    assert sorted(conf.get("modules_to_save") or []) == sorted(mts), conf
    mts_names = {"lm_head": "lm_head.weight", "embed_tokens": "model.embed_tokens.weight"}
    lora = OL.lora_names(range(cfg.num_hidden_layers), targets)
    want_keys = {OL.PREFIX + n for n in lora} | {OL.PREFIX + mts_names[m] for m in mts}
    hdr, _ = oracle.read_safetensors_raw(ad / "adapter_model.safetensors")
    keys = {k for k in hdr if k != "__metadata__"}
    assert keys == want_keys, f"adapter keys: missing {sorted(want_keys - keys)}, unexpected {sorted(keys - want_keys)}"
    assert {hdr[k]["dtype"] for k in keys} == {"F32"}
    file = {k[len(OL.PREFIX):]: v.numpy() for k, v in load_file(str(ad / "adapter_model.safetensors")).items()}
    bad = [n for n in file if not np.array_equal(file[n], s.get_param(n))]
    assert not bad, f"saved tensors differ from the session's: {bad}"
    assert all(np.any(file[n]) for n in lora if ".lora_B." in n), "lora_B still zero after 2 steps"

    pm = OL.load_adapter_strict(oracle.load_hf(hf_dir), ad)
    ref_logits = oracle.hf_logits(pm, tokens)
    assert oracle.rel_err(ref_logits, oracle.hf_logits(oracle.load_hf(hf_dir), tokens)) > 10 * TOL, \
        "test setup: 2 steps hardly changed the logits"
    err = oracle.rel_err(logits, ref_logits)
    assert err <= TOL, f"ctitan logits vs PEFT with ctitan's adapter: rel err {err:.3g}"


# --------------------------------------------------------------------------- 4. fresh init

def test_fresh_init(tmp_path, open_session):
    """lora.rank alone (alpha 8, all seven targets by default): B = 0, A uniform in
    +-1/sqrt(in) from training.seed, so the logits are the base model's; then 2 AdamW
    steps equal PEFT's started from the same A (only B has a gradient at step 1; A still
    decays)."""
    cfg = dense_cfg()
    hf_dir = tmp_path / "hf"
    base = oracle.save_random_hf(hf_dir, cfg, seed=19)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=7,
                                     extra=opt_args(FRESH_HP) + [f"--lora.rank={R}"]))
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=8, targets=OL.ALL7)
    params = OL.trainable(pm)
    assert_table(s, oracle.expected_tensor_names(base), cfg.num_hidden_layers, OL.ALL7,
                 {n: tuple(p.shape) for n, p in params.items()})
    lora = OL.lora_names(range(cfg.num_hidden_layers), OL.ALL7)
    assert trained_in_session(s) == set(lora), "with lora.rank > 0 exactly the adapters train"
    for n in lora:
        v = s.get_param(n)
        if ".lora_B." in n:
            assert not np.any(v), f"{n} is not zero at init"
        else:
            bound = 1.0 / np.sqrt(v.shape[1])
            assert np.all(np.abs(v) <= bound), f"{n}: outside +-1/sqrt(in) = {bound}"
            assert np.abs(v).max() > 0.5 * bound and len(np.unique(v)) > v.size // 2, f"{n}: not uniform random"
    same = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=7, extra=[f"--lora.rank={R}"]))
    other = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=8, extra=[f"--lora.rank={R}"]))
    a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert np.array_equal(s.get_param(a), same.get_param(a)), "same seed, different lora_A"
    assert not np.array_equal(s.get_param(a), other.get_param(a)), "seeds 7 and 8 gave the same lora_A"
    same.close()
    other.close()

    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=2)
    err = oracle.rel_err(s.logits(tokens), oracle.hf_logits(base, tokens))
    assert err <= TOL, f"fresh LoRA: logits differ from the base model's, rel err {err:.3g}"

    with torch.no_grad():
        for n, p in params.items():
            if ".lora_B." in n:
                assert not torch.any(p), "test setup: PEFT's B is not zero"
            else:
                p.copy_(torch.from_numpy(s.get_param(n)))
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=21)
    compare_steps(session_steps(s, stream, lora, run=2), train_ref(pm, params, stream, run=2, hp=FRESH_HP))
    assert_base_unchanged(s, hf_dir)


def test_dropout_training_forwards_only(tmp_path, open_session):
    """lora.dropout acts on training forwards only: ctitan_logits are PEFT's eval-mode
    logits (dropout off); forward_backward's loss differs from the dropout-free session's
    and is the same again for the same seed; adapter_config.json records the rate."""
    cfg = dense_cfg()
    hf_dir, ad, pm, params, _ = OL.random_all7_adapter(tmp_path, cfg, hf_seed=37, r=R, alpha=ALPHA, seed=3)
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=3)
    ref_loss, ref_logits, _ = OL.loss_logits_grads(pm, params, tokens, labels)
    nv = oracle.n_valid(labels)

    def session(p):
        return open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(adapter=ad) + [
            f"--lora.dropout={p}"]))

    plain = session(0.0)
    plain.zero_grad()
    loss0 = plain.forward_backward(tokens, labels, nv) / nv
    assert close(loss0, ref_loss, TOL)
    losses = []
    for _ in range(2):
        s = session(0.3)
        err = oracle.rel_err(s.logits(tokens), ref_logits)
        assert err <= TOL, f"logits with lora.dropout=0.3 vs PEFT eval: rel err {err:.3g}"
        s.zero_grad()
        losses.append(s.forward_backward(tokens, labels, nv) / nv)
        out = tmp_path / f"saved{len(losses)}"
        s.save_adapter(out)
        conf = json.loads((out / "adapter_config.json").read_text())
        assert conf.get("lora_dropout") == 0.3, conf
        s.close()
    assert abs(losses[0] - loss0) > 1e-5 * loss0, f"lora.dropout=0.3 did not change the training loss ({losses[0]})"
    assert losses[0] == losses[1], f"same seed, different dropout: {losses}"


_U64 = np.uint64


def _splitmix(z):
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def lora_dropout_keep(seed, step, layer, proj, n, p, first=0):
    """ctitan's documented LoRA dropout mask (docs/lora.md: a counter hash of training.seed,
    step, layer, projection and the element of the step's whole adapter input), re-implemented
    from the rule, not read from ctitan: the mask seed is seed * golden ^ step << 20
    (trainer_lora_seed), the key mix(mask seed ^ mix(layer << 8 | projection)) with
    projection q k v o gate up down = 0..6, and element e of the step's adapter input
    [global batch x T, in] (row-major: sequence s of the step's global batch starts at
    e = s T in) is kept when the top 24 bits of mix(key + e) are >= float32(p) * 2^24.
    Returns a bool array of the n elements from `first`."""
    with np.errstate(over="ignore"):
        s = (_U64(seed) * _U64(0x9E3779B97F4A7C15)) ^ (_U64(step) << _U64(20))
        key = _splitmix(np.array([s ^ _splitmix(np.array([(layer << 8) | proj], dtype=_U64))[0]], dtype=_U64))[0]
        cut = int(float(np.float32(p)) * 16777216.0)
        return (_splitmix(key + np.arange(first, first + n, dtype=_U64)) >> _U64(40)) >= _U64(cut)


class _FixedDropout(torch.nn.Module):
    """nn.Dropout(p) with a given keep mask: x * keep / (1 - p), what PEFT's lora_dropout
    computes on the adapter's input (lora_B(lora_A(dropout(x))) * scaling) in train mode."""

    def __init__(self, keep, p):
        super().__init__()
        self.register_buffer("keep", torch.from_numpy(keep.astype(np.float32)))
        self.p = p

    def forward(self, x):
        assert x.shape == self.keep.shape, f"dropout input {tuple(x.shape)} vs mask {tuple(self.keep.shape)}"
        return x * self.keep / (1.0 - self.p)


def test_dropout_training_step_matches_peft_with_same_mask(tmp_path, open_session):
    """A training forward_backward with lora.dropout=0.3 (r 4, alpha 12: scale 3 != 1) on all
    seven targets of a dense Qwen3 against PEFT with each adapter's lora_dropout replaced by
    the same mask (x * keep / (1 - p) on the adapter's input, before lora_A): loss and every
    lora_A / lora_B gradient, to TOL. The mask is ctitan's documented hash re-implemented
    here (lora_dropout_keep); its kept fraction must be about 1 - p. This is what checks
    the 1 / (1 - p) of the dropped input and the dropout backward's scale on d(A x)
    (ctitan's dropout path is not the fused dropout-free kernel); the eval logits and seed
    repeatability are test_dropout_training_forwards_only's."""
    p, r, alpha, seed = 0.3, 4, 12.0, 5
    cfg = dense_cfg()
    hf_dir, ad, pm, params, lora = OL.random_all7_adapter(tmp_path, cfg, hf_seed=41, r=r, alpha=alpha, seed=9)
    tokens, labels = make_batch(cfg.vocab_size, LOCAL_BS, L, seed=6)
    nv = oracle.n_valid(labels)
    loss_nodrop, _, grads_nodrop = OL.loss_logits_grads(pm, params, tokens, labels)

    # step 1, micro-batch 0 of the session's first forward_backward
    widths = {"q_proj": cfg.hidden_size, "k_proj": cfg.hidden_size, "v_proj": cfg.hidden_size,
              "o_proj": cfg.num_attention_heads * cfg.head_dim, "gate_proj": cfg.hidden_size,
              "up_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}
    kept = total = 0
    layers = pm.base_model.model.model.layers
    for l in range(cfg.num_hidden_layers):
        for j, mod in enumerate(OL.ALL7):
            n = LOCAL_BS * L * widths[mod]
            keep = lora_dropout_keep(seed, step=1, layer=l, proj=j, n=n, p=p)
            frac = keep.mean()
            assert abs(frac - (1 - p)) < 0.1, f"layer {l} {mod}: mask keeps {frac:.3f}, not about {1 - p}"
            kept, total = kept + int(keep.sum()), total + n
            sub = getattr(layers[l], "self_attn" if mod in OL.ATTN else "mlp")
            getattr(sub, mod).lora_dropout["default"] = _FixedDropout(keep.reshape(LOCAL_BS, L, -1), p)
    assert abs(kept / total - (1 - p)) < 0.02, f"the masks keep {kept / total:.4f} of the inputs, not about {1 - p}"
    ref_loss, _, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    assert abs(ref_loss - loss_nodrop) > 100 * TOL * ref_loss, "test setup: the dropout hardly changes the loss"
    assert all(oracle.rel_err(ref_grads[n], grads_nodrop[n]) > 100 * TOL for n in lora), \
        "test setup: the dropout hardly changes some gradient"

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=seed, extra=lora_args(
        r=r, alpha=alpha, adapter=ad) + [f"--lora.dropout={p}"]))
    s.zero_grad()
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert close(loss, ref_loss, TOL), f"loss {loss} vs PEFT with the same mask {ref_loss} (no dropout: {loss_nodrop})"
    bad = [f"{n}: rel err {oracle.rel_err(s.get_grad(n), ref_grads[n]):.3g}" for n in lora
           if not oracle.rel_err(s.get_grad(n), ref_grads[n]) <= TOL]
    assert not bad, "adapter gradients with dropout differ from PEFT's with the same mask:\n" + "\n".join(bad)


def test_dropout_session_split_into_calls_draws_the_whole_batchs_masks(tmp_path, open_session):
    """The session API with lora.dropout = 0.3: one forward_backward of 2 x LOCAL_BS sequences
    and, after zero_grad, two calls of LOCAL_BS each (the second holding sequences LOCAL_BS..)
    give the same loss sums and adapter gradients: each call draws the masks of the sequences
    it holds in the step (ctitan.h), as the trainer's micro-batches do. A second call that drew
    the first call's masks (or a per-call seed) gives other gradients; the guard below shows
    the masks matter at this size."""
    p, r, alpha, seed = 0.3, 4, 12.0, 5
    cfg = dense_cfg()
    hf_dir, ad, pm, params, lora = OL.random_all7_adapter(tmp_path, cfg, hf_seed=47, r=r, alpha=alpha, seed=13)
    tokens, labels = make_batch(cfg.vocab_size, 2 * LOCAL_BS, L, seed=8)
    nv = oracle.n_valid(labels)
    s = open_session(hf_session_args(hf_dir, batch=2 * LOCAL_BS, seq_len=L, seed=seed, extra=lora_args(
        r=r, alpha=alpha, adapter=ad) + [f"--lora.dropout={p}"]))
    s.zero_grad()
    whole = s.forward_backward(tokens, labels, nv)
    g_whole = {n: s.get_grad(n) for n in lora}
    s.zero_grad()
    halves = [s.forward_backward(tokens[h * LOCAL_BS:(h + 1) * LOCAL_BS], labels[h * LOCAL_BS:(h + 1) * LOCAL_BS], nv)
              for h in range(2)]
    g_split = {n: s.get_grad(n) for n in lora}
    assert close(sum(halves), whole, TOL), f"loss sums: two calls {halves} vs one call {whole}"
    bad = [f"{n}: rel err {oracle.rel_err(g_split[n], g_whole[n]):.3g}" for n in lora
           if not oracle.rel_err(g_split[n], g_whole[n]) <= TOL]
    assert not bad, "two calls' adapter gradients differ from one call's:\n" + "\n".join(bad)
    # guard: the second half through a fresh accumulation (its masks are sequences 0.. of the step)
    s.zero_grad()
    s.forward_backward(tokens[:LOCAL_BS], labels[:LOCAL_BS], nv)
    s.zero_grad()
    other = s.forward_backward(tokens[LOCAL_BS:], labels[LOCAL_BS:], nv)
    assert abs(other - halves[1]) > 10 * TOL * abs(halves[1]), \
        f"test setup: the second half's loss hardly depends on its masks ({other} vs {halves[1]})"


def test_dropout_masks_follow_the_sequence_index(tmp_path, run_ctitan):
    """`ctitan train` with lora.dropout = 0.3 and two micro-batches per step (global batch
    2 x local): micro-batch a holds sequences a x local .. of the step's global batch and
    draws their masks (docs/lora.md: the hash takes the element of the step's whole input),
    so step 1's loss and pre-clip grad norm are PEFT's with micro-batch a's adapters'
    dropout replaced by lora_dropout_keep(seed, 1, ..., first = a x local x T x width), the
    gradients accumulated over both as torch does. The same masks for both micro-batches
    give another loss and norm (checked here, so the comparison can tell them apart)."""
    p, r, alpha, seed = 0.3, 4, 12.0, 5
    cfg = dense_cfg()
    hf_dir, ad, pm, params, lora = OL.random_all7_adapter(tmp_path, cfg, hf_seed=43, r=r, alpha=alpha, seed=11)
    accum = GLOBAL_BS // LOCAL_BS
    assert accum == 2
    stream = oracle.random_tokens(accum * LOCAL_BS * (L + 1), cfg.vocab_size, seed=17)
    mbs = oracle.micro_batches(stream, L, LOCAL_BS, accum)
    total = sum(oracle.n_valid(lab) for _, lab in mbs)
    widths = {"q_proj": cfg.hidden_size, "k_proj": cfg.hidden_size, "v_proj": cfg.hidden_size,
              "o_proj": cfg.num_attention_heads * cfg.head_dim, "gate_proj": cfg.hidden_size,
              "up_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}
    layers = pm.base_model.model.model.layers

    def reference(first_of):
        """Step 1's loss and grad norm with micro-batch a's masks drawn for its first sequence first_of(a)."""
        pm.zero_grad(set_to_none=True)
        loss = 0.0
        for a, (inp, lab) in enumerate(mbs):
            for l in range(cfg.num_hidden_layers):
                for j, mod in enumerate(OL.ALL7):
                    n = LOCAL_BS * L * widths[mod]
                    keep = lora_dropout_keep(seed, step=1, layer=l, proj=j, n=n, p=p,
                                             first=first_of(a) * L * widths[mod])
                    sub = getattr(layers[l], "self_attn" if mod in OL.ATTN else "mlp")
                    getattr(sub, mod).lora_dropout["default"] = _FixedDropout(keep.reshape(LOCAL_BS, L, -1), p)
            ls, _ = oracle.ce_sum(pm, inp, lab)
            (ls / total).backward()
            loss += ls.item()
        norm = torch.sqrt(sum((params[n].grad.double() ** 2).sum() for n in lora)).item()
        pm.zero_grad(set_to_none=True)
        return loss / total, norm

    want_loss, want_norm = reference(lambda a: a * LOCAL_BS)
    same_loss, same_norm = reference(lambda a: 0)
    assert abs(same_loss - want_loss) > 100 * TOL * want_loss, "test setup: micro-batch 1's mask hardly matters"
    assert abs(same_norm - want_norm) > 100 * TOL * want_norm, "test setup: micro-batch 1's mask hardly matters"

    data = oracle.write_bin(tmp_path / "d.bin", stream)
    out = tmp_path / "out"
    sec = train_sections(hf_dir, data, out, 1)
    sec["training"]["seed"] = seed
    sec["lr_scheduler"]["warmup_steps"] = 1
    sec["checkpoint"] = {"initial_load_path": str(hf_dir), "initial_load_in_hf": True}
    sec["lora"] = {"rank": r, "alpha": alpha, "use_rslora": False, "adapter_path": str(ad), "dropout": p}
    run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "train.toml", sec)])
    row = oracle.read_metrics(out / "metrics.jsonl")[0]
    assert row["step"] == 1
    assert close(row["loss"], want_loss, TOL), \
        f"loss {row['loss']} vs PEFT with each micro-batch's mask {want_loss} (one mask for both: {same_loss})"
    assert close(row["grad_norm"], want_norm, TOL), \
        f"grad norm {row['grad_norm']} vs PEFT with each micro-batch's mask {want_norm} (one mask: {same_norm})"


# --------------------------------------------------------------------------- 5. freeze without LoRA

def test_freeze_without_lora(tmp_path, open_session):
    """training.freeze with an exact name and a wildcard: no gradient (get_grad refuses),
    no update, no weight decay on those; the rest trains as torch with requires_grad False
    on the frozen tensors (clipping over the trained ones only)."""
    cfg = dense_cfg()
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=23)
    model = oracle.load_hf(hf_dir)

    def is_frozen(n):
        return n == "model.embed_tokens.weight" or n.startswith("model.layers.0.")

    for n, p in model.named_parameters():
        p.requires_grad_(not is_frozen(n))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = sorted(n for n in oracle.expected_tensor_names(model) if is_frozen(n))
    assert len(frozen) == 1 + 11 and len(params) == len(oracle.expected_tensor_names(model)) - len(frozen)
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=13)
    ref_loss, _, ref_grads = OL.loss_logits_grads(model, params, tokens, labels)

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + [
        "--training.freeze=model.embed_tokens.weight,model.layers.0.*"]))
    assert set(s.names()) == oracle.expected_tensor_names(model)
    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert close(loss, ref_loss, TOL), f"loss {loss} vs torch {ref_loss}"
    bad = [n for n in params if not oracle.rel_err(s.get_grad(n), ref_grads[n]) <= TOL]
    assert not bad, f"gradients of trained tensors differ from torch: {bad}"
    for n in frozen:
        assert_frozen_grad_refused(s, n)

    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=14)
    ref = OL.train(model, params, stream, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=SCHED,
                   run_steps=2, **HP)
    assert HP["weight_decay"] > 0
    compare_steps(session_steps(s, stream, list(params), run=2), ref)
    saved = oracle.read_hf_tensors(hf_dir)
    changed = [n for n in frozen if not np.array_equal(s.get_param(n), saved[n])]
    assert not changed, f"frozen tensors changed: {changed}"


# --------------------------------------------------------------------------- 6. damaged adapters

ADAPTER_KEY = OL.PREFIX + "model.layers.0.self_attn.q_proj.lora_A.weight"


def _wrong_shape(ad):
    t = load_file(str(ad / "adapter_model.safetensors"))
    t[ADAPTER_KEY] = torch.zeros(R, 31)
    save_file(t, str(ad / "adapter_model.safetensors"), metadata={"format": "pt"})


def _rank_mismatch(ad):
    c = json.loads((ad / "adapter_config.json").read_text())
    c["r"] = 8
    (ad / "adapter_config.json").write_text(json.dumps(c))


def _missing_layer(ad):
    t = load_file(str(ad / "adapter_model.safetensors"))
    t[ADAPTER_KEY.replace("layers.0.", "layers.7.")] = t[ADAPTER_KEY].clone()
    save_file(t, str(ad / "adapter_model.safetensors"), metadata={"format": "pt"})


def _unknown_target(ad):
    c = json.loads((ad / "adapter_config.json").read_text())
    c["target_modules"] = list(c["target_modules"]) + ["c_attn"]
    (ad / "adapter_config.json").write_text(json.dumps(c))


HOSTILE = [
    ("intact", None, None),
    ("lora_A_wrong_shape", _wrong_shape, "layers.0.self_attn.q_proj.lora_A"),
    ("config_r_not_lora_rank", _rank_mismatch, "adapter_config.json"),
    ("key_for_layer_7_of_2", _missing_layer, "layers.7"),
    ("unknown_target_module", _unknown_target, "c_attn"),
]


@pytest.mark.parametrize("damage,needle", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_damaged_adapter_rejected(damage, needle, tmp_path, open_session):
    """A damaged adapter directory fails ctitan_open with a message that names the key or
    the file (the intact one opens: the damage is what is refused)."""
    cfg = dense_cfg()
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=29)
    OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=OL.ALL7, seed=1).save_pretrained(str(ad))
    args = hf_session_args(hf_dir, extra=lora_args(adapter=ad))
    if damage is None:
        open_session(args).close()
        return
    damage(ad)
    msg = open_error(open_session, args, tmp_path)
    assert needle in msg, f"the error does not name {needle!r}: {msg}"


# --------------------------------------------------------------------------- 7. `ctitan train`

def test_cli_train_writes_peft_adapters(tmp_path, run_ctitan):
    """`ctitan train` from a PEFT adapter (TOML arrays for the lists), checkpoint every
    step, last_save_in_hf: step-1 and step-2 hold adapter_config.json and
    adapter_model.safetensors that PEFT loads without a warning, with torch's adapters
    after 1 and 2 steps; the logged losses are torch's."""
    cfg = dense_cfg()
    hf_dir, ad, out = tmp_path / "hf", tmp_path / "adapter", tmp_path / "run"
    oracle.save_random_hf(hf_dir, cfg, seed=31)
    targets = ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=targets, seed=8)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=15)
    data = oracle.write_bin(tmp_path / "tokens.bin", stream)
    ref = OL.train(pm, params, stream, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=2, run_steps=2, **HP)

    sec = train_sections(hf_dir, data, out, 2)
    sec["lora"] = {"rank": R, "alpha": ALPHA, "adapter_path": str(ad), "target_modules": oracle.Raw(json.dumps(targets))}
    sec["checkpoint"].update(interval=1, keep_latest_k=0)
    del sec["checkpoint"]["export_dtype"]
    run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "lora.toml", sec)])
    rows = oracle.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r, want in zip(rows, ref):
        assert close(r["loss"], want["loss"], TOL), f"step {r['step']}: loss {r['loss']} vs torch {want['loss']}"

    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=4)
    for step, want in ((1, ref[0]), (2, ref[1])):
        d = out / "checkpoint" / f"step-{step}"
        assert (d / "adapter_config.json").exists() and (d / "adapter_model.safetensors").exists(), \
            f"{d} lacks the adapter files: {sorted(p.name for p in d.iterdir())}"
        conf = json.loads((d / "adapter_config.json").read_text())
        assert sorted(conf.get("target_modules") or []) == sorted(targets), conf
        got = {k[len(OL.PREFIX):]: v.numpy() for k, v in load_file(str(d / "adapter_model.safetensors")).items()}
        assert set(got) == set(want["params"]), f"step-{step} adapter keys {sorted(got)}"
        bad = [n for n in got if not oracle.rel_err(got[n], want["params"][n]) <= TOL]
        assert not bad, f"step-{step}: adapters differ from torch's: {bad}"
        pm_step = OL.load_adapter_strict(oracle.load_hf(hf_dir), d)
        ref_pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=targets)
        with torch.no_grad():
            for n, p in OL.trainable(ref_pm).items():
                p.copy_(torch.from_numpy(want["params"][n]))
        err = oracle.rel_err(oracle.hf_logits(pm_step, tokens), oracle.hf_logits(ref_pm, tokens))
        assert err <= TOL, f"step-{step}: PEFT logits with ctitan's adapter vs torch's: rel err {err:.3g}"
