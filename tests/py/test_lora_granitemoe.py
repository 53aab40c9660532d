"""LoRA on GraniteMoE and GraniteMoeShared as PEFT 0.21 adapts them (transformers 5.24).

What PEFT does there (found by running it on the tiny cases below): the experts
(GraniteMoe*Experts: gate_up_proj, down_proj parameters) and the router (a weight
parameter) are no nn.Linear, and PEFT's transformers-v5 MoE rewrite has no entry for
these families, so

* "all-linear" adapts q/k/v/o_proj on granitemoe; on granitemoeshared also the shared
  MLP's two Linears, shared_mlp.input_linear [2S, H] (gate rows, then up: one A [r, H],
  one B [2S, r]) and shared_mlp.output_linear [H, S];
* a name that matches nothing beside one that matches ("q_proj,up_proj") is skipped
  silently; names that all match nothing ("up_proj", "gate", "router.layer") raise
  "Target modules {...} not found in the base model".

ctitan, given PEFT's adapter, has PEFT's keys and shapes, logits, loss and every adapter
gradient, three AdamW steps of PEFT + torch, and its saved adapter loads in PEFT with
its logits; `generate --adapter` and `export --merge` are read back by transformers.
Expected values come from peft, transformers and torch only."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

import oracle
import oracle_families as fam
import oracle_lora as OL
from conftest import CtitanError, hf_session_args
from test_families_lora import check_generate_and_merge, lora_args, session_matches_peft

TOL = 1e-4
R, ALPHA = 4, 8
SHARED = "granitemoeshared_narrow_tied"  # 3 layers, S = 8 < the experts' 16, no aux loss
MOE = "granitemoe_k3_tied_bias"

# (case, lora.target_modules as ctitan is given it, what PEFT is given, the modules PEFT adapts)
ACCEPTED = [
    (MOE, "all-linear", "all-linear", set(OL.ATTN)),
    (MOE, "q_proj,up_proj", ["q_proj", "up_proj"], {"q_proj"}),
    (SHARED, "all-linear", "all-linear", set(OL.ATTN) | {"input_linear", "output_linear"}),
    (SHARED, "input_linear", ["input_linear"], {"input_linear"}),
    (SHARED, "q_proj,output_linear,up_proj", ["q_proj", "output_linear", "up_proj"], {"q_proj", "output_linear"}),
]


def granite_case(cid, tmp_path):
    case = fam.CASE[cid]
    base = fam.build(case)
    hf_dir = tmp_path / "hf"
    fam.save(base, hf_dir)
    return case, base, hf_dir, lambda: fam.prepare_loaded(fam.load(hf_dir, case.family), case.family)


def granite_peft(loaded, peft_targets, mods, ad, seed, std=0.1):
    """PEFT's adapter, saved in ad; asserts it adapts exactly `mods` in every layer, the
    shared MLP's at PEFT's fused shapes."""
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=peft_targets, seed=seed, std=std)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    cfg = pm.base_model.model.config
    got = {n.split(".lora_")[0].rsplit(".", 1)[1] for n in params}
    assert got == mods, f"test setup: PEFT adapts {sorted(got)}"
    S, H = getattr(cfg, "shared_intermediate_size", 0), cfg.hidden_size
    for n, p in params.items():
        if "input_linear.lora_B" in n:
            assert tuple(p.shape) == (2 * S, R), n
        if "output_linear.lora_A" in n:
            assert tuple(p.shape) == (R, S), n
    return pm, params


@pytest.mark.parametrize("cid,targets,peft_targets,mods", ACCEPTED)
def test_granite_adapters_as_peft(cid, targets, peft_targets, mods, tmp_path, open_session):
    """ctitan accepts what PEFT accepts, adapts what PEFT adapts (keys and shapes), and from
    PEFT's adapter gives its logits, loss and every adapter gradient; its saved adapter
    loads in PEFT (target_modules as saved) with its logits."""
    case, base, hf_dir, loaded = granite_case(cid, tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm, params = granite_peft(loaded, peft_targets, mods, ad, seed=5)
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(targets, ad)))
    assert {n: s.shapes[n] for n in s.names() if ".lora_" in n} == {n: tuple(p.shape) for n, p in params.items()}
    session_matches_peft(s, params, tokens, labels, ref, loaded, out,
                         load=lambda base_model, d: PeftModel.from_pretrained(base_model, str(d)).eval())
    tm = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert not any(t in ("gate_proj", "up_proj", "down_proj") for t in tm), tm


def _swap_halves(ad, swap):
    """PEFT's adapter file in ad with each input_linear B's gate and up row halves exchanged
    (swap "rows"), or its up half zeroed (swap "zero_up": an adapter on the gate half only)."""
    from safetensors.torch import load_file, save_file
    f = ad / "adapter_model.safetensors"
    t = load_file(str(f))
    for n in [n for n in t if "input_linear.lora_B" in n]:
        g, u = t[n].chunk(2, dim=0)
        t[n] = torch.cat([u, g] if swap == "rows" else [g, torch.zeros_like(u)], dim=0).contiguous()
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("swap", ["rows", "zero_up"])
def test_planted_mistakes_in_the_fused_b_are_caught(swap, tmp_path, open_session):
    """The tests can fail: ctitan reading an input_linear B whose gate / up halves are
    swapped (or whose up half is zero: the adapter on one half only) gives logits far from
    PEFT's on the true adapter, so a reading with the halves exchanged would be caught."""
    case, base, hf_dir, loaded = granite_case(SHARED, tmp_path)
    ad = tmp_path / "adapter"
    pm, params = granite_peft(loaded, ["input_linear"], {"input_linear"}, ad, seed=5, std=0.3)
    tokens, _ = fam.batch(base, 2, case.T, seed=5)
    with torch.no_grad():
        want = pm(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    _swap_halves(ad, swap)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args("input_linear", ad)))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err > 100 * TOL, f"{swap}: ctitan's logits move by only {err:.3g}"


@pytest.mark.parametrize("cid,targets,peft_targets,mods", [ACCEPTED[0], ACCEPTED[2]])
def test_granite_adapters_adamw_steps(cid, targets, peft_targets, mods, tmp_path, open_session):
    """Three AdamW steps (accumulation, clipping, weight decay, warmup) on PEFT's adapter
    equal PEFT + torch's loop: loss, grad norm, every adapter tensor."""
    from test_lora import SCHED, compare_steps, opt_args, session_steps
    from test_train_loop import GLOBAL_BS, HP, LOCAL_BS, L
    case, base, hf_dir, loaded = granite_case(cid, tmp_path)
    ad = tmp_path / "adapter"
    pm, params = granite_peft(loaded, peft_targets, mods, ad, seed=7)
    stream = oracle.random_tokens(8 * (L + 1), base.config.vocab_size, seed=16)
    ref = OL.train(pm, params, stream, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=SCHED, run_steps=3,
                   **HP)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(targets, ad) + opt_args()))
    compare_steps(session_steps(s, stream, list(params), run=3), ref)


def test_granite_shared_generate_and_merge(tmp_path, run_ctitan):
    """The shared MLP's adapters outside training: `generate --adapter` continues as greedy
    decoding with PEFT's model does; `export --merge` writes PEFT's merge_and_unload
    (the merged input_linear read by transformers: the adapted model's logits)."""
    case, base, hf_dir, loaded = granite_case(SHARED, tmp_path)
    ad = tmp_path / "adapter"
    pm, _ = granite_peft(loaded, "all-linear", set(OL.ATTN) | {"input_linear", "output_linear"}, ad, seed=9, std=0.3)
    check_generate_and_merge(run_ctitan, tmp_path, case, base, loaded(), pm, hf_dir, ad)


# (case, targets, PEFT's own targets): PEFT raises "Target modules {...} not found in the base model"
REFUSED = [(MOE, "up_proj", ["up_proj"]), (MOE, "gate", ["gate"]), (MOE, "input_linear", ["input_linear"]),
           (MOE, "gate_proj,up_proj,down_proj", OL.MLP), (SHARED, "gate", ["gate"]),
           (SHARED, "gate_proj,up_proj", ["gate_proj", "up_proj"])]


@pytest.mark.parametrize("cid,targets,peft_targets", REFUSED)
def test_granite_refusals_as_peft(cid, targets, peft_targets, tmp_path, open_session):
    """Names that match no Linear of the model are refused, as PEFT refuses them (shown on
    PEFT first), naming the key and the family."""
    case, base, hf_dir, loaded = granite_case(cid, tmp_path)
    with pytest.raises(ValueError, match="not found in the base model"):
        OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=peft_targets)
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(targets)))
    msg = str(ei.value)
    assert "lora.target_modules" in msg and targets.split(",")[0] in msg, msg


# TP cuts input_linear's B as the base's rows (each rank its slice of the gate rows and of the
# up rows, Phi3's fused rule), output_linear's A by columns; EP x FSDP holds the shared MLP and
# its adapters whole on every EP rank, sharded by FSDP
LAYOUTS = {"tp2": (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2"], 1),
           "ep2_fsdp2": (4, ["--parallelism.data_parallel_shard_degree=4",
                             "--parallelism.expert_parallel_degree=2"], 4)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_granite_shared_adapters_under_tp_and_ep(layout, tmp_path):
    """all-linear adapters on granitemoeshared trained 10 steps on one process and under TP 2
    and EP 2 x FSDP 2: the same losses, validation losses and final adapter tensors."""
    import numpy as np
    from test_dist import assert_same_run, run, train_args, weights
    m = tmp_path / "cfg"
    fam.make_config(fam.CASE[SHARED]).save_pretrained(m)
    tokens = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(600 * 17, 128, seed=7))
    lora = ["--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=all-linear"]
    ref = tmp_path / "single"
    run(1, train_args(m, tokens, ref, *lora), timeout=300)
    n, extra, dp = LAYOUTS[layout]
    out = tmp_path / layout
    run(n, train_args(m, tokens, out, *lora, *extra, dp=dp), timeout=300)
    assert_same_run(out, ref, layout, weights_too=False)
    a, b = weights(out), weights(ref)
    keys = [k for k in b if "shared_mlp.input_linear.lora_" in k or "output_linear.lora_" in k]
    assert keys and set(a) == set(b), sorted(b)
    for k in keys:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= 1e-5, f"{layout}: final {k} differs from one rank by {err:.3g} norm-wise"


@pytest.mark.parametrize("param", ["gate_up_proj", "router.weight"])
def test_granite_expert_and_router_parameters_adapted(param, tmp_path, open_session):
    """PEFT's target_parameters reach GraniteMoE's experts and router (ParamWrapper on
    block_sparse_moe.experts.gate_up_proj, router.weight: shown on PEFT here); ctitan
    adapts them under PEFT's keys and shapes (their values, gradients, merge and layouts:
    test_lora_granitemoe_params.py)."""
    case, base, hf_dir, loaded = granite_case(MOE, tmp_path)
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=[param])
    params = OL.trainable(pm)
    mod = "experts" if param == "gate_up_proj" else "router"
    assert any(f"block_sparse_moe.{mod}.lora_A" in n for n in params), sorted(params)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T,
                                     extra=lora_args("q_proj") + [f"--lora.target_parameters={param}"]))
    assert {n: s.shapes[n] for n in s.names() if ".lora_" in n} == {n: tuple(p.shape) for n, p in params.items()}


def test_granite_shared_rank_pattern(tmp_path, open_session):
    """rank_pattern / alpha_pattern keys naming the shared MLP's Linears (PEFT's rule on
    shared_mlp.input_linear / output_linear): PEFT's shapes, logits, loss and gradients; the
    saved patterns load back in PEFT with ctitan's logits."""
    case, base, hf_dir, loaded = granite_case(SHARED, tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    ranks, alphas = {"input_linear": 6}, {"output_linear": 3}
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets="all-linear", seed=5, rank_pattern=ranks,
                      alpha_pattern=alphas)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert any(tuple(p.shape) == (16, 6) for n, p in params.items() if "input_linear.lora_B" in n), "test setup"
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    extra = lora_args("all-linear", ad) + [f"--lora.rank_pattern={json.dumps(ranks)}",
                                           f"--lora.alpha_pattern={json.dumps(alphas)}"]
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=extra))
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    session_matches_peft(s, params, tokens, labels, ref, loaded, out,
                         load=lambda base_model, d: PeftModel.from_pretrained(base_model, str(d)).eval())


def test_granite_unresolved_all_linear_adapter(tmp_path, open_session):
    """An adapter_config.json holding the string "all-linear" (PEFT resolves it on load, with
    no MoE rewrite for this family): ctitan reads it as PEFT's all-linear, PEFT's logits."""
    case, base, hf_dir, loaded = granite_case(SHARED, tmp_path)
    ad = tmp_path / "adapter"
    pm, params = granite_peft(loaded, "all-linear", set(OL.ATTN) | {"input_linear", "output_linear"}, ad, seed=5)
    cfg = json.loads((ad / "adapter_config.json").read_text())
    cfg["target_modules"] = "all-linear"
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    back = PeftModel.from_pretrained(loaded(), str(ad)).eval()
    tokens, _ = fam.batch(base, 2, case.T, seed=5)
    with torch.no_grad():
        want = back(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args("all-linear", ad)))
    assert oracle.rel_err(s.logits(tokens), want) <= TOL
