"""PEFT's target_parameters on GraniteMoE / GraniteMoeShared (PEFT 0.21, transformers 5.24).

The experts (block_sparse_moe.experts.gate_up_proj [E, 2I, H], gate rows then up rows per
expert, and down_proj [E, H, I]) and the router (block_sparse_moe.router.weight [E, H]) are
no nn.Linear: PEFT reaches them only through target_parameters, wrapping each in a
ParamWrapper (experts: A [r E, in], B [out, r E]; router: A [r, H], B [E, r]; with both expert
parameters, gate_up_proj's adapter nested under the outer wrapper's base_layer). ctitan,
given PEFT's adapter, has PEFT's keys and shapes, logits, loss, every adapter gradient and
three AdamW steps; its saved adapter loads in PEFT; `export --merge` is read back by
transformers; EP 2 x FSDP 2 and TP 2 train as one process. Expected values come from peft,
transformers and torch only."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peft import PeftModel

import oracle
import oracle_families as fam
import oracle_lora as OL
from conftest import CtitanError, hf_session_args
from test_families_lora import check_merge, lora_args, session_matches_peft

TOL = 1e-4
R, ALPHA = 4, 8
SHARED = "granitemoeshared_narrow_tied"
MOE = "granitemoe_k3_tied_bias"

# (name, target_modules, target_parameters, the PEFT module suffixes adapted)
TARGETS = {
    "experts": (["q_proj"], ["gate_up_proj", "down_proj"], {"q_proj", "experts"}),
    "router": (["q_proj"], ["router.weight"], {"q_proj", "router"}),
    "both": (["q_proj"], ["gate_up_proj", "down_proj", "router.weight"], {"q_proj", "experts", "router"}),
}


def granite_case(cid, tmp_path):
    case = fam.CASE[cid]
    base = fam.build(case)
    hf_dir = tmp_path / "hf"
    fam.save(base, hf_dir)
    return case, base, hf_dir, lambda: fam.prepare_loaded(fam.load(hf_dir, case.family), case.family)


def params_args(tm, tp, ad=None):
    return lora_args(",".join(tm), ad) + [f"--lora.target_parameters={','.join(tp)}"]


def granite_peft(loaded, tm, tp, mods, ad, seed, std=0.1, **kw):
    """PEFT's adapter on target_modules tm and target_parameters tp, saved in ad; asserts it
    adapts exactly `mods`, the experts and router at ParamWrapper's shapes."""
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=tm, target_parameters=tp, seed=seed, std=std, **kw)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    got = {n.split(".lora_")[0].replace(".base_layer", "").rsplit(".", 1)[1] for n in params}
    assert got == mods, f"test setup: PEFT adapts {sorted(got)}"
    cfg = pm.base_model.model.config
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    rank = {n: p.shape[0] for n, p in params.items() if ".lora_A" in n}
    for n, p in params.items():  # the rank r of each adapter from its A (rank_pattern may change it)
        r = rank[n.replace("lora_B", "lora_A")]
        if "router.lora_" in n:
            assert tuple(p.shape) == ((r, H) if "lora_A" in n else (E, r)), n
        elif "experts." in n:
            r //= E
            want = [(r * E, H), (r * E, I)] if "lora_A" in n else [(2 * I, r * E), (H, r * E)]
            assert tuple(p.shape) in want, n
    return pm, params


CASES = [(cid, t) for cid in (MOE, SHARED) for t in TARGETS]


@pytest.mark.parametrize("cid,which", CASES)
def test_granite_params_as_peft(cid, which, tmp_path, open_session):
    """PEFT's adapter on the experts / router: ctitan's keys and shapes are PEFT's, and its
    logits, loss, every adapter gradient; its saved adapter loads in PEFT with its logits
    and names the parameters as PEFT's target_parameters."""
    tm, tp, mods = TARGETS[which]
    case, base, hf_dir, loaded = granite_case(cid, tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm, params = granite_peft(loaded, tm, tp, mods, ad, seed=5)
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=params_args(tm, tp, ad)))
    assert {n: s.shapes[n] for n in s.names() if ".lora_" in n} == {n: tuple(p.shape) for n, p in params.items()}
    session_matches_peft(s, params, tokens, labels, ref, loaded, out,
                         load=lambda base_model, d: PeftModel.from_pretrained(base_model, str(d)).eval())
    saved = json.loads((out / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == sorted(tp), saved["target_parameters"]


@pytest.mark.parametrize("cid", [MOE, SHARED])
def test_granite_params_adamw_steps(cid, tmp_path, open_session):
    """Three AdamW steps on PEFT's adapter (experts, router, q_proj) equal PEFT + torch's
    loop: loss, grad norm, every adapter tensor."""
    from test_lora import SCHED, compare_steps, opt_args, session_steps
    from test_train_loop import GLOBAL_BS, HP, LOCAL_BS, L
    tm, tp, mods = TARGETS["both"]
    case, base, hf_dir, loaded = granite_case(cid, tmp_path)
    ad = tmp_path / "adapter"
    pm, params = granite_peft(loaded, tm, tp, mods, ad, seed=7)
    stream = oracle.random_tokens(8 * (L + 1), base.config.vocab_size, seed=16)
    ref = OL.train(pm, params, stream, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=SCHED, run_steps=3,
                   **HP)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=params_args(tm, tp, ad) + opt_args()))
    compare_steps(session_steps(s, stream, list(params), run=3), ref)


@pytest.mark.parametrize("cid", [MOE, SHARED])
def test_granite_params_merge(cid, tmp_path, run_ctitan):
    """`export --merge` folds the expert and router adapters into the base weights as PEFT's
    merge_and_unload does: transformers reading the merged files gives the adapted logits."""
    tm, tp, mods = TARGETS["both"]
    case, base, hf_dir, loaded = granite_case(cid, tmp_path)
    ad = tmp_path / "adapter"
    pm, _ = granite_peft(loaded, tm, tp, mods, ad, seed=9, std=0.3)
    check_merge(run_ctitan, tmp_path, case, base, pm, hf_dir, ad)


def test_granite_params_rank_pattern(tmp_path, open_session):
    """rank_pattern / alpha_pattern on the expert and router parameters (PEFT's keys): PEFT's
    shapes, logits, loss and gradients; the saved patterns load back in PEFT."""
    tm, tp, mods = TARGETS["both"]
    case, base, hf_dir, loaded = granite_case(MOE, tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    ranks, alphas = {"gate_up_proj": 6, "router.weight": 2}, {"down_proj": 3, "router.weight": 5}
    pm, params = granite_peft(loaded, tm, tp, mods, ad, seed=5, rank_pattern=ranks, alpha_pattern=alphas)
    E = pm.base_model.model.config.num_local_experts
    assert any(tuple(p.shape)[0] == 6 * E for n, p in params.items() if "experts.base_layer.lora_A" in n), "setup"
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    extra = params_args(tm, tp, ad) + [f"--lora.rank_pattern={json.dumps(ranks)}",
                                       f"--lora.alpha_pattern={json.dumps(alphas)}"]
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=extra))
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    session_matches_peft(s, params, tokens, labels, ref, loaded, out,
                         load=lambda base_model, d: PeftModel.from_pretrained(base_model, str(d)).eval())


def _plant(ad, mistake):
    """PEFT's adapter file in ad with a planted mistake: "swap_gate_up" exchanges the gate and
    up row halves of the gate_up_proj adapter's B; "skip_router" zeroes the router's B (an
    adapter that adds nothing, as if skipped)."""
    from safetensors.torch import load_file, save_file
    f = ad / "adapter_model.safetensors"
    t = load_file(str(f))
    for n in list(t):
        if mistake == "swap_gate_up" and "experts.base_layer.lora_B" in n:
            g, u = t[n].chunk(2, dim=0)
            t[n] = torch.cat([u, g], dim=0).contiguous()
        if mistake == "skip_router" and "router.lora_B" in n:
            t[n] = torch.zeros_like(t[n])
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("mistake", ["swap_gate_up", "skip_router"])
def test_planted_mistakes_are_caught(mistake, tmp_path, open_session):
    """The tests can fail: ctitan reading an adapter whose gate_up_proj B has its gate / up
    halves swapped, or whose router adapter is dropped, gives logits far from PEFT's on the
    true adapter."""
    tm, tp, mods = TARGETS["both"]
    case, base, hf_dir, loaded = granite_case(MOE, tmp_path)
    ad = tmp_path / "adapter"
    pm, _ = granite_peft(loaded, tm, tp, mods, ad, seed=5, std=0.3)
    tokens, _ = fam.batch(base, 2, case.T, seed=5)
    with torch.no_grad():
        want = pm(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    _plant(ad, mistake)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=params_args(tm, tp, ad)))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err > 100 * TOL, f"{mistake}: ctitan's logits move by only {err:.3g}"


LAYOUTS = {"tp2": (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2"], 1),
           "ep2_fsdp2": (4, ["--parallelism.data_parallel_shard_degree=4",
                             "--parallelism.expert_parallel_degree=2"], 4)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_granite_params_under_tp_and_ep(layout, tmp_path):
    """Expert and router adapters on granitemoeshared trained 10 steps on one process and
    under TP 2 and EP 2 x FSDP 2: the same losses, validation losses and final adapters."""
    from test_dist import assert_same_run, run, train_args, weights
    m = tmp_path / "cfg"
    fam.make_config(fam.CASE[SHARED]).save_pretrained(m)
    tokens = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(600 * 17, 128, seed=7))
    lora = ["--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=q_proj",
            "--lora.target_parameters=gate_up_proj,down_proj,router.weight"]
    ref = tmp_path / "single"
    run(1, train_args(m, tokens, ref, *lora), timeout=300)
    n, extra, dp = LAYOUTS[layout]
    out = tmp_path / layout
    run(n, train_args(m, tokens, out, *lora, *extra, dp=dp), timeout=300)
    assert_same_run(out, ref, layout, weights_too=False)
    a, b = weights(out), weights(ref)
    keys = [k for k in b if "experts." in k and ".lora_" in k or "router.lora_" in k]
    assert keys and set(a) == set(b), sorted(b)
    for k in keys:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= 1e-5, f"{layout}: final {k} differs from one rank by {err:.3g} norm-wise"


def test_granite_params_old_names_skipped_as_peft(tmp_path, open_session, capfd):
    """Qwen3-MoE's router name mlp.gate.weight selects no parameter on GraniteMoE: PEFT
    (shown here) adapts q_proj alone and no router, and so does ctitan, warning that it
    skipped the name."""
    case, base, hf_dir, loaded = granite_case(MOE, tmp_path)
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=["mlp.gate.weight"])
    want = sorted(n for n in OL.trainable(pm))
    assert not any("router" in n or "experts" in n for n in want), want
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T,
                                     extra=params_args(["q_proj"], ["mlp.gate.weight"])))
    assert sorted(n for n in s.names() if ".lora_" in n) == want
    err = capfd.readouterr().err
    assert "mlp.gate.weight" in err and "skipped, as PEFT skips it" in err, err
