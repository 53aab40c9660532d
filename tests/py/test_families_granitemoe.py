"""GraniteMoE (GraniteMoeForCausalLM) beyond oracle_families' shared checks: each of Granite's
four scalars and the fused experts' gate / up order matter in transformers itself (so a slip
fails the parity tests, shown here on planted mistakes), GraniteMoeTopKRouter's softmax over the
top-k logits equals the renormalised top-k softmax ctitan computes, GraniteMoeConfig's defaults
from a file that leaves the keys out, the parameter count against transformers' model, LoRA
targets PEFT refuses there, and a resume with another multiplier refused by name.
Expected values come from transformers, PEFT and torch only."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

import oracle
import oracle_families as of
from conftest import CtitanError, hf_session_args

TOL = 1e-4
B = 2
SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def test_oracle_granitemoe_scalars_change_the_model():
    """Each scalar of the granitemoe cases set back to GraniteMoeConfig's default 1.0 moves
    transformers' logits by far more than the tests' tolerance."""
    for cid in ("granitemoe_aux", "granitemoe_k3_tied_bias"):
        case = of.CASE[cid]
        a = of.build(case)
        tokens, _ = of.batch(a, B, case.T, seed=5)
        la = of.logits(a, case.family, tokens)
        for key in SCALARS:
            b = of.build(dataclasses.replace(case, kw={**case.kw, key: 1.0}))
            err = oracle.rel_err(of.logits(b, case.family, tokens), la)
            assert err > 100 * TOL, f"{cid} {key}: dropping it moves the logits by only {err:.3g}"


def test_oracle_router_is_renormalised_topk_softmax():
    """softmax(top-k logits) (GraniteMoeTopKRouter) = top-k of softmax(all logits) divided by
    their sum (ctitan's norm_topk_prob), the same experts in the same order."""
    case = of.CASE["granitemoe_k3_tied_bias"]
    m = of.build(case)
    router = m.model.layers[0].block_sparse_moe.router
    x = torch.randn(64, m.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, w, idx = router(x)
        p = torch.softmax(logits, dim=-1)
        pv, pi = torch.topk(p, m.config.num_experts_per_tok, dim=-1)
    assert torch.equal(idx, pi)
    np.testing.assert_allclose(w.numpy(), (pv / pv.sum(-1, keepdim=True)).numpy(), rtol=1e-6, atol=1e-7)


def _swap_gate_up(d):
    """The file's input_linear with each expert's gate and up halves exchanged."""
    from safetensors.torch import load_file, save_file
    f = d / "model.safetensors"
    t = load_file(str(f))
    for n in [n for n in t if n.endswith("block_sparse_moe.input_linear.weight")]:
        g, u = t[n].chunk(2, dim=1)
        t[n] = torch.cat([u, g], dim=1).contiguous()
    save_file(t, str(f), metadata={"format": "pt"})


def test_planted_mistakes_are_caught(tmp_path, open_session):
    """ctitan reads the fused input_linear as transformers does (gate rows first): on a file
    whose halves are swapped its logits follow transformers' on that file and differ from the
    original's by far more than the tolerance; and ctitan's logits differ from transformers'
    with any one multiplier dropped."""
    case = of.CASE["granitemoe_aux"]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    tokens, _ = of.batch(model, B, case.T, seed=5)
    want = of.logits(model, case.family, tokens)
    got = open_session(hf_session_args(d, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got, want) <= TOL
    for key in SCALARS:
        b = of.build(dataclasses.replace(case, kw={**case.kw, key: 1.0}))
        assert oracle.rel_err(got, of.logits(b, case.family, tokens)) > 100 * TOL, key
    sw = of.save(model, tmp_path / "swapped")
    _swap_gate_up(sw)
    got_sw = open_session(hf_session_args(sw, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got_sw, of.logits(of.load(sw, case.family), case.family, tokens)) <= TOL
    assert oracle.rel_err(got_sw, want) > 100 * TOL


def test_granitemoe_defaults(tmp_path, open_session, run_ctitan):
    """A file with only the sizes: GraniteMoeConfig's 8 experts, 2 per token, the scalars 1.0,
    router_aux_loss_coef 0.001. ctitan's logits equal transformers' on the model loaded from it;
    describe counts transformers' parameters and its config export reads back the same values."""
    from transformers import AutoConfig, GraniteMoeForCausalLM
    case = of.CASE["granitemoe_aux"]
    conf = {"model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"], "vocab_size": 160,
            "hidden_size": 32, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 128}
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.router_aux_loss_coef) == (8, 2, 0.001)
    hf._attn_implementation = "eager"
    model = GraniteMoeForCausalLM(hf).float()
    of.init_weights(model, "granitemoe", 3)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(conf))  # save_pretrained wrote every key
    ref = of.load(d, "granitemoe")
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    assert oracle.rel_err(s.logits(tokens), of.logits(ref, "granitemoe", tokens)) <= TOL
    _, out, _ = run_ctitan(["describe", d, "--config-out", d / "out.json"])
    assert "experts: 2 of 8 per token, 8 wide" in out, out
    n = sum(p.numel() for p in ref.parameters())
    assert re.search(rf"parameters: {n} ", out), f"HF has {n} parameters:\n{out}"
    back = json.loads((d / "out.json").read_text())
    for k in SCALARS + ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
                        "rms_norm_eps", "num_key_value_heads", "intermediate_size", "pad_token_id"):
        assert back.get(k, "<absent>") == getattr(hf, k), f"{k} = {back.get(k)!r}, transformers {getattr(hf, k)!r}"
    assert "router_jitter_noise" not in back and "moe_intermediate_size" not in back


# what PEFT accepts there (all-linear, a name matching nothing beside one that matches, the
# shared MLP's input_linear / output_linear) is test_lora_granitemoe.py's
@pytest.mark.parametrize("cid,targets", [(c, t) for c in ("granitemoe_aux", "granitemoeshared_aux")
                                         for t in ("gate_proj,up_proj,down_proj", "gate")])
def test_lora_beyond_attention_refused(cid, targets, tmp_path, open_session):
    """gate_proj and the like, and the router ("gate"), are no Linear on granitemoe (PEFT:
    "Target modules {...} not found in the base model"): named alone, ctitan refuses them,
    naming the family."""
    case = of.CASE[cid]
    d = of.save(of.build(case), tmp_path / "hf")
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, batch=B, seq_len=case.T, extra=[
            "--lora.rank=4", "--lora.alpha=8", f"--lora.target_modules={targets}"]))
    msg = str(ei.value)
    assert case.family in msg and "lora.target" in msg, msg


def test_resume_with_other_residual_multiplier_names_it(tmp_path, run_ctitan):
    err = of.resume_with_other_config(tmp_path, run_ctitan, "granitemoe", of.CASE["granitemoe_k3_tied_bias"].kw,
                                      residual_multiplier=0.5)
    assert "config.json: residual_multiplier is" in err, err


# --------------------------------------------------------------------------- granitemoeshared

def _no_shared(model):
    """The same model with every layer's shared MLP dropped (GraniteMoeSharedDecoderLayer adds
    nothing when shared_mlp is None)."""
    for layer in model.model.layers:
        layer.shared_mlp = None
    return model


def _swap_shared_halves(d):
    from safetensors.torch import load_file, save_file
    f = d / "model.safetensors"
    t = load_file(str(f))
    for n in [n for n in t if n.endswith("shared_mlp.input_linear.weight")]:
        g, u = t[n].chunk(2, dim=0)
        t[n] = torch.cat([u, g], dim=0).contiguous()
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("cid", ["granitemoeshared_aux", "granitemoeshared_narrow_tied"])
def test_shared_mlp_planted_mistakes(cid, tmp_path, open_session):
    """The shared MLP matters in transformers (dropping it moves the logits far past the
    tolerance), ctitan computes it (its logits differ from the model without it), and reads
    shared_mlp.input_linear's gate rows first (on a file with the halves swapped it follows
    transformers on that file)."""
    case = of.CASE[cid]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    tokens, _ = of.batch(model, B, case.T, seed=5)
    want = of.logits(model, case.family, tokens)
    bare = of.logits(_no_shared(of.build(case)), case.family, tokens)
    assert oracle.rel_err(bare, want) > 100 * TOL
    got = open_session(hf_session_args(d, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got, want) <= TOL
    assert oracle.rel_err(got, bare) > 100 * TOL
    sw = of.save(model, tmp_path / "swapped")
    _swap_shared_halves(sw)
    got_sw = open_session(hf_session_args(sw, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got_sw, of.logits(of.load(sw, case.family), case.family, tokens)) <= TOL
    assert oracle.rel_err(got_sw, want) > 100 * TOL


@pytest.mark.parametrize("shared", [None, 12])
def test_granitemoeshared_sizes_and_describe(shared, tmp_path, run_ctitan):
    """GraniteMoeSharedConfig's shared_intermediate_size defaults to 0 (no shared MLP): ctitan's
    parameter count equals transformers' with and without it, describe names the ungated
    shared MLP, and the config export writes back what transformers read."""
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = {"model_type": "granitemoeshared", "architectures": ["GraniteMoeSharedForCausalLM"],
            "vocab_size": 160, "hidden_size": 32, "intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 128}
    if shared is not None:
        conf["shared_intermediate_size"] = shared
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    _, out, _ = run_ctitan(["describe", d, "--config-out", d / "out.json"])
    assert re.search(rf"parameters: {n} ", out), f"HF has {n} parameters:\n{out}"
    assert ("shared expert 12 wide (ungated)" in out) == (shared == 12), out
    back = json.loads((d / "out.json").read_text())
    assert back["shared_intermediate_size"] == hf.shared_intermediate_size


@pytest.mark.parametrize("ranks", [1, 4])
def test_final_hf_save_writes_the_fused_files(tmp_path, run_ctitan, ranks):
    """The trainer's final HF save (checkpoint.last_save_in_hf) writes GraniteMoE's fused
    input_linear / output_linear as transformers reads them, in one process and under EP 2 x
    FSDP 2 (rank 0 assembles each layer from the ranks' experts): transformers loads the folder
    and its tensors equal what `ctitan export` writes from the run's own checkpoint of the same
    step, whose per-expert weights they must also equal."""
    from safetensors.numpy import load_file
    import test_dist as TD
    kw = of.CASE["granitemoeshared_narrow_tied"].kw
    of.make_config(of.Case("a", "granitemoeshared", kw)).save_pretrained(tmp_path / "a")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'a'}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.steps=2", "--checkpoint.enable",
            "--checkpoint.interval=1", f"--job.dump_folder={tmp_path / 'o'}", "--checkpoint.last_save_in_hf=true"]
    if ranks > 1:
        args += ["--parallelism.data_parallel_shard_degree=4", "--parallelism.expert_parallel_degree=2"]
        TD.run(ranks, args, timeout=300)
    else:
        run_ctitan(args)
    ck = tmp_path / "o" / "checkpoint"
    saved = sorted(d for d in ck.iterdir() if d.name.startswith("hf-step-2") or
                   (d.name == "step-2" and (d / "config.json").exists()))
    assert len(saved) == 1, sorted(p.name for p in ck.iterdir())
    hf = saved[0]
    # `ctitan export` of the run's own step-2 checkpoint (hf_save: one process, the whole table)
    run_ctitan(["export", "--checkpoint", ck / "step-2", "--out", tmp_path / "x"])
    mine, want = {}, {}
    for f in hf.glob("*.safetensors"):
        mine.update(load_file(str(f)))
    for f in (tmp_path / "x").glob("*.safetensors"):
        want.update(load_file(str(f)))
    assert set(mine) == set(want), (sorted(set(mine) ^ set(want)))
    bad = [k for k in want if not np.array_equal(mine[k], want[k])]
    assert not bad, f"the final save differs from the export of the same step: {bad}"
    assert not any(".experts." in k for k in mine), sorted(mine)
    back = of.load(hf, "granitemoeshared")  # transformers reads the final save as it is
    c = back.config
    k0 = next(k for k in mine if k.endswith("block_sparse_moe.input_linear.weight"))
    assert mine[k0].shape == (c.num_local_experts, 2 * c.intermediate_size, c.hidden_size), mine[k0].shape
    sd = {k: v.detach().numpy() for k, v in back.state_dict().items()}
    bad = [k for k, v in mine.items() if k in sd and not np.array_equal(sd[k], v)]
    assert not bad, f"transformers read other values for {bad}"


def test_bf16_files_read_and_written_fused(tmp_path, open_session):
    """A bf16 checkpoint's fused tensors are read piece by piece at 2 bytes an element (the
    offsets scale with the dtype): ctitan's logits equal transformers' on the same file read
    into fp32; ctitan's bf16 export holds the same bits as the file it read."""
    from safetensors.torch import load_file
    case = of.CASE["granitemoeshared_aux"]
    model = of.build(case)
    d = tmp_path / "hf"
    model.to(torch.bfloat16).save_pretrained(d)
    ref = of.load(d, case.family)  # fp32 from the bf16 file
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    assert oracle.rel_err(s.logits(tokens), of.logits(ref, case.family, tokens)) <= TOL
    s.save_hf(tmp_path / "out", "bfloat16")
    a, b = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(a) == set(b)
    bad = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not bad, f"bf16 export differs from the bf16 file: {bad}"


@pytest.mark.parametrize("family, kw, key", [
    ("granitemoe", dict(intermediate_size=21), "experts' intermediate_size (21)"),
    ("granitemoeshared", dict(intermediate_size=16, shared_intermediate_size=41), "shared_intermediate_size (41)"),
    ("olmoe", dict(intermediate_size=21), "experts' intermediate_size (21)"),
])
def test_tp_width_refusal_names_the_familys_key(tmp_path, run_ctitan, family, kw, key):
    """A TP degree that does not divide the experts' or the shared MLP's width is refused naming
    the key these families' config.json has (GraniteMoE and OLMoE have no moe_intermediate_size,
    GraniteMoeShared no shared_expert_intermediate_size); the config class says which exist."""
    from transformers import AutoConfig
    cfg = of.make_config(of.Case("w", family, dict(num_hidden_layers=2, **kw)))
    cfg.save_pretrained(tmp_path / "m")
    names = set(AutoConfig.from_pretrained(tmp_path / "m").to_dict())
    assert key.split(" (")[0].split()[-1] in names and "moe_intermediate_size" not in names, "test setup"
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(8 * 17, 160, seed=1))
    rc, _, err = run_ctitan(["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'm'}",
                             "--training.seq_len=16", "--training.local_batch_size=2", f"--training.dataset_path={data}",
                             "--training.steps=1", f"--job.dump_folder={tmp_path / 'o'}",
                             "--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2"],
                            check=False)
    assert rc == 2 and f"tensor_parallel_degree = 2 does not divide the model's {key}" in err, err[-2000:]
