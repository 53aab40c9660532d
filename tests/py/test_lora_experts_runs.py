"""Expert LoRA (lora.target_parameters on a Qwen3-MoE) through `ctitan train`, `generate`
and `export`: an interrupted run resumes bit for bit (one process and FSDP 2, gradient
accumulation); FSDP 2 and DP 2 train the adapters like one process; full activation
checkpointing gives the same bits; bf16 mixed precision trains; `generate --adapter`
equals PEFT's greedy output and `export --merge` PEFT's merged model.

Expected values are ctitan against itself (uninterrupted, one process, no checkpointing)
and PEFT / transformers (generate, merge)."""
import json

import numpy as np
import pytest
import torch

import oracle
import oracle_lora as OL
import oracle_moe
from test_lora_runs import MICRO, SEQ, STEPS, ckpt, lora_names, run, tensors, train_args
from test_resume import losses

R, ALPHA = 4, 8.0
VOCAB = 251
EXP = "--lora.target_parameters=mlp.experts.gate_up_proj,mlp.experts.down_proj"
ATTN = "--lora.target_modules=q_proj,o_proj"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3-MoE (layer 0 dense, layers 1-2 sparse; hidden 30 so that no FSDP piece
    divides evenly by 2) and a token file."""
    d = tmp_path_factory.mktemp("lora_experts_runs")
    cfg = oracle_moe.tiny_moe_config(vocab=VOCAB, hidden=30, layers=3, heads=4, kv_heads=2, head_dim=8, experts=4,
                                     top_k=2, moe_inter=12, mlp_only=(0,))
    oracle_moe.build_moe_model(cfg, seed=21).save_pretrained(str(d / "model"))
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(300 * (SEQ + 1), VOCAB, seed=7))
    return d, d / "model", data


def args(setup, out, *extra, ranks=1, accum=2):
    d, model, data = setup
    return train_args(model, data, out, ATTN, EXP, *extra, ranks=ranks, accum=accum)


@pytest.fixture(scope="module")
def straight(setup):
    """Uninterrupted runs: {1: one process, 2: FSDP 2}."""
    outs = {}
    for n in (1, 2):
        out = setup[0] / f"straight_{n}"
        run(n, args(setup, out, ranks=n))
        outs[n] = out
    return outs


def expert_names(t):
    return [k for k in lora_names(t) if ".mlp.experts." in k]


def assert_adapters_match(out, ref_out, what):
    """Run out trained like the one-process run ref_out: every step's loss to 1e-5 relative,
    the same final adapter tensors, each to 1e-5 of its largest element. Returns both
    adapters (out's, ref_out's) for the caller's checks."""
    want, got = losses(ref_out), losses(out)
    bad = [(s, got[s], want[s]) for s in want if not abs(got[s] - want[s]) <= 1e-5 * abs(want[s])]
    assert not bad, f"{what}: (step, loss, one process's) beyond 1e-5: {bad}"
    x = tensors(out, files=("adapter_model.safetensors",))
    y = tensors(ref_out, files=("adapter_model.safetensors",))
    assert x.keys() == y.keys(), f"{what}: adapter tensors differ: {sorted(set(x) ^ set(y))}"
    for k in lora_names(y):
        err = np.max(np.abs(x[k] - y[k])) / max(float(np.max(np.abs(y[k]))), 1e-30)
        assert err <= 1e-5, f"{what}: {k} differs from one process by {err:.3g}"
    return x, y


@pytest.mark.parametrize("ranks", [1, 2], ids=["1proc", "fsdp2"])
def test_expert_lora_resume_is_bit_identical(setup, straight, ranks):
    """Stopped at step 3 and resumed to 6: every loss and the final adapters and AdamW
    moments equal the uninterrupted run's bit for bit; the expert adapters moved."""
    out = setup[0] / f"resumed_{ranks}"
    a = args(setup, out, ranks=ranks)
    p = run(ranks, a + ["--training.stop_at_step=3"], check=False)
    assert p.returncode == 75, f"stop_at_step must exit 75, got {p.returncode}\n{p.stderr[-3000:]}"
    p = run(ranks, a)
    assert "resuming from" in p.stderr and "step-3" in p.stderr, p.stderr[-3000:]
    ref, got = losses(straight[ranks]), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert ref == got, f"losses differ: {[(s, ref[s], got[s]) for s in ref if ref[s] != got.get(s)]}"
    x, y = tensors(straight[ranks]), tensors(out)
    assert x.keys() == y.keys()
    ex = expert_names(x)
    assert len([k for k in ex if k.startswith("model.")]) == 2 * 2 * 2, \
        f"expert adapters (2 MoE layers x 2 parameters x A, B) in the checkpoint: {ex}"
    bad = [k for k in x if not np.array_equal(x[k], y[k])]
    assert not bad, f"resumed run not bit-identical: {bad[:6]}"
    moved = [k for k in ex if "lora_B" in k and "adapter_model" in k and np.any(x[k])]
    assert moved, "the expert lora_B never left zero: the experts' adapters did not train"


@pytest.mark.parametrize("name,rep,shard", [("fsdp2", 1, 2), ("dp2", 2, 1)])
def test_expert_lora_layout_matches_one_process(setup, name, rep, shard):
    """FSDP 2 and DP 2 (2 micro-batches per rank) against one process with 4: losses to
    1e-5 relative, final adapters to 1e-5 of each tensor's largest element."""
    d = setup[0]
    ref_out = d / "gb8"
    if not (ckpt(ref_out) / "adapter_model.safetensors").exists():
        run(1, args(setup, ref_out, accum=4))
    out = d / f"layout_{name}"
    a = [x for x in args(setup, out, ranks=2) if not x.startswith("--parallelism.")]
    run(2, a + [f"--parallelism.data_parallel_replicate_degree={rep}",
                f"--parallelism.data_parallel_shard_degree={shard}"])
    x, y = assert_adapters_match(out, ref_out, name)
    assert expert_names(y)


def test_expert_lora_activation_checkpointing_same_bits(setup, straight):
    """Full activation checkpointing recomputes each layer (the adapted experts too): the
    same losses and adapters, bit for bit."""
    out = setup[0] / "ac_full"
    run(1, args(setup, out, "--activation_checkpoint.mode=full"))
    assert losses(out) == losses(straight[1])
    x, y = tensors(out), tensors(straight[1])
    bad = [k for k in x if not np.array_equal(x[k], y[k])]
    assert not bad, f"checkpointed run differs: {bad[:6]}"


def test_expert_lora_bf16_mixed_precision_trains(setup, straight):
    """bf16 mixed precision (every linear, the adapted experts included, on bf16-rounded
    inputs): the run trains, its losses within 2e-2 of fp32's, and it is not fp32's."""
    out = setup[0] / "bf16"
    run(1, args(setup, out, "--training.mixed_precision_param=bfloat16"))
    want, got = losses(straight[1]), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(abs(got[s] - want[s]) <= 2e-2 * abs(want[s]) for s in want), (got, want)
    assert got != want, "bf16 gave fp32's exact losses: the mode was not applied"
    x = tensors(out, files=("adapter_model.safetensors",))
    assert all(np.any(x[k]) for k in expert_names(x) if "lora_B" in k), "bf16: the expert adapters did not train"


# --------------------------------------------------------------------------- generate, merge

def peft_expert_adapter(tmp_path, targets=("q_proj",), rewrite=False):
    """A tiny Qwen3-MoE and a PEFT adapter on `targets` and both expert parameters with
    random A, B -> the PeftModel (eval). rewrite: the experts through target_modules
    gate_proj, up_proj, down_proj and rsLoRA (PEFT's rank_pattern / alpha_pattern give
    gate_up_proj 2r, 2 alpha, so another scale than down_proj's)."""
    cfg = oracle_moe.tiny_moe_config(vocab=256, layers=2, experts=4, top_k=2, mlp_only=(0,))
    oracle_moe.build_moe_model(cfg, seed=3).save_pretrained(str(tmp_path / "hf"))
    base = oracle.load_hf(tmp_path / "hf")
    base.config._experts_implementation = "eager"
    if rewrite:
        pm = OL.make_peft(base, r=R, alpha=ALPHA, targets=list(targets) + OL.MLP, rslora=True, seed=9, std=0.3)
        assert pm.peft_config["default"].rank_pattern, "test setup: no rank_pattern"
    else:
        pm = OL.make_peft(base, r=R, alpha=ALPHA, targets=list(targets), target_parameters=OL.EXPERTS, seed=9,
                          std=0.3)
    pm.save_pretrained(str(tmp_path / "adapter"))
    return pm


def generate_matches_peft(pm, tmp_path, run_ctitan):
    """`generate --adapter` (base tmp_path/hf, adapter tmp_path/adapter) gives PeftModel pm's
    greedy continuation of a prompt, one the adapter changes."""
    prompt = [5, 17, 200, 3, 99]
    with torch.no_grad():
        ref = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
        with pm.disable_adapter():
            base_ids = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    assert base_ids != ref, "test setup: the adapter must change the greedy continuation"
    _, out, _ = run_ctitan(["generate", "--checkpoint", tmp_path / "hf", "--adapter", tmp_path / "adapter",
                            "--prompt-ids", " ".join(map(str, prompt)), "--max-tokens", "8", "--ids"])
    assert [int(x) for x in out.split()] == ref


def export_merge_matches_peft(pm, tmp_path, run_ctitan):
    """`export --merge` of tmp_path/hf + tmp_path/adapter loads in transformers with PeftModel
    pm's logits (which the adapter changes); returns the merged state dict and PEFT's
    merge_and_unload one, for the caller's tensors."""
    from transformers import AutoModelForCausalLM
    tok = torch.tensor(np.random.default_rng(1).integers(0, 256, (2, 12)))
    with torch.no_grad():
        want = pm(input_ids=tok).logits.numpy()
        with pm.disable_adapter():
            base = pm(input_ids=tok).logits.numpy()
    assert np.abs(base - want).max() > 1e-2 * np.abs(want).max(), "test setup: the adapter changes little"
    run_ctitan(["export", "--checkpoint", tmp_path / "hf", "--adapter", tmp_path / "adapter", "--merge",
                "--out", tmp_path / "merged"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                  attn_implementation="eager")
    merged.config._experts_implementation = "eager"
    with torch.no_grad():
        got = merged(input_ids=tok).logits.numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    return merged.state_dict(), pm.merge_and_unload().state_dict()


@pytest.mark.parametrize("targets,rewrite", [(("q_proj",), False), ((), False), (("q_proj",), True)],
                         ids=["q_and_experts", "experts_only", "rewritten_mlp_targets_rslora"])
def test_generate_with_expert_adapter_matches_peft(targets, rewrite, tmp_path, run_ctitan):
    pm = peft_expert_adapter(tmp_path, targets, rewrite)
    generate_matches_peft(pm, tmp_path, run_ctitan)


@pytest.mark.parametrize("rewrite", [False, True], ids=["target_parameters", "rewritten_mlp_targets_rslora"])
def test_export_merge_expert_adapter_matches_peft(rewrite, tmp_path, run_ctitan):
    pm = peft_expert_adapter(tmp_path, rewrite=rewrite)
    sd, ref = export_merge_matches_peft(pm, tmp_path, run_ctitan)
    for n in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert np.abs(sd[n].numpy() - ref[n].numpy()).max() <= 1e-5 * np.abs(ref[n].numpy()).max(), n


@pytest.mark.parametrize("shard", [1, 2], ids=["1proc", "fsdp2"])
def test_dry_run_counts_expert_lora_scratch(setup, run_ctitan, shard):
    """--dry-run counts expert LoRA's two transient buffers (the adapted experts and their
    weight gradient, 3 E Im H floats each, computed here from config.json) in its total,
    for one process and per rank of FSDP 2; a run without expert adapters has no such line."""
    import re
    d, model, data = setup
    cfg = json.loads((model / "config.json").read_text())
    want = 4 * 2 * 3 * cfg["num_local_experts"] * cfg["moe_intermediate_size"] * cfg["hidden_size"]
    line = r"^\s+(.+?)\s+[\d.]+ GiB\s+(\d+) bytes$"
    _, out, _ = run_ctitan(args(setup, d / f"dry{shard}", "--dry-run", ranks=shard))
    blocks = out.split("per rank:") if shard > 1 else [out]
    for b in blocks[-1:] if shard > 1 else blocks:
        lines = re.findall(line, b, re.M)
        got = [int(v) for k, v in lines if k == "expert LoRA fold + weight gradient"]
        assert got == [want], f"expert LoRA scratch {got}, want {want}:\n{b}"
        total = next(int(v) for k, v in lines if k.startswith("total planned"))
        parts = 0
        for k, v in lines:
            if k.startswith("total planned"):
                break
            parts += int(v)
        assert total == parts, f"the total {total} is not the sum of its lines {parts}:\n{b}"
    _, out, _ = run_ctitan(train_args(model, data, d / "dry_attn", ATTN, "--dry-run"))
    assert "expert LoRA" not in out, out


def test_rewritten_mlp_targets_fsdp2_matches_one_process(setup):
    """`ctitan train` with target_modules q_proj, o_proj, gate_proj, up_proj, down_proj
    (PEFT's rewrite: gate_up_proj at 2r): FSDP 2 against one process with the same global
    batch, losses to 1e-5 relative and final adapters to 1e-5 of each tensor's largest
    element; the final adapter directory has PEFT's rank_pattern and loads in PEFT
    strictly."""
    d, model, data = setup
    # AdamW's eps 1e-4 as test_lora's sessions: at the default 1e-8 an element of layer 2's
    # gate_up_proj A whose gradient is ~1e-8 turns the gradients' summation order (two
    # ranks, even unsharded DP 2) into 1.5e-5 - 4e-5 of the tensor; at 1e-4 every tensor
    # agrees to 3e-6 (measured)
    tm = ["--lora.target_modules=q_proj,o_proj,gate_proj,up_proj,down_proj", "--optimizer.eps=1e-4",
          "--checkpoint.last_save_in_hf=true"]
    ref_out, out = d / "rw_gb8", d / "rw_fsdp2"
    run(1, train_args(model, data, ref_out, *tm, accum=4))
    run(2, train_args(model, data, out, *tm, ranks=2))
    x, y = assert_adapters_match(out, ref_out, "FSDP 2, rewritten MLP targets")
    assert expert_names(y)
    ad = ckpt(out)
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["rank_pattern"] == {r".*\.gate_up_proj": 2 * R}, conf["rank_pattern"]
    base = oracle.load_hf(model)
    base.config._experts_implementation = "eager"
    OL.load_adapter_strict(base, ad)


# --------------------------------------------------------------------------- the router (all-linear)

ALL_LINEAR = ["--lora.target_modules=all-linear", "--optimizer.eps=1e-4"]


def test_all_linear_router_fsdp2_matches_one_process(setup, run_ctitan):
    """`ctitan train` with lora.target_modules = all-linear on a Qwen3-MoE (PEFT's: the
    attention Linears, the experts at gate_up_proj 2r, and every router's gate.weight):
    the dry run's trained count is PEFT's trainable parameters (get_nb_trainable_parameters
    on the same model); FSDP 2 against one process with the same global batch, losses to
    1e-5 relative and final adapters (the routers' moved away from B = 0) to 1e-5 of each
    tensor's largest element; the final adapter directory loads in PEFT strictly."""
    import re
    d, model, data = setup
    base = oracle.load_hf(model)
    base.config._experts_implementation = "eager"
    pm = OL.make_peft(base, r=R, alpha=ALPHA, targets="all-linear")
    want_trained, want_all = pm.get_nb_trainable_parameters()
    _, out, _ = run_ctitan(train_args(model, data, d / "al_dry", *ALL_LINEAR, "--dry-run"))
    m = re.search(r"trained: (\d+) parameters .* of (\d+), frozen", out)
    assert m and (int(m.group(1)), int(m.group(2))) == (want_trained, want_all), (m and m.groups(), want_trained,
                                                                                 want_all, out)
    ref_out, got_out = d / "al_gb8", d / "al_fsdp2"
    run(1, train_args(model, data, ref_out, *ALL_LINEAR, accum=4))
    run(2, train_args(model, data, got_out, *ALL_LINEAR, ranks=2))
    x, y = assert_adapters_match(got_out, ref_out, "FSDP 2, all-linear")
    routers = [k for k in lora_names(y) if ".mlp.gate.lora_" in k]
    assert len(routers) == 2 * 2, routers  # 2 MoE layers x A, B
    assert all(np.any(y[k]) for k in routers if "lora_B" in k), "a router's lora_B never left zero"
    ad = ckpt(got_out)
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert "gate.weight" in conf["target_parameters"], conf
    base = oracle.load_hf(model)
    base.config._experts_implementation = "eager"
    OL.load_adapter_strict(base, ad)


def peft_all_linear_adapter(tmp_path, tparams=None):
    """A tiny Qwen3-MoE and PEFT's all-linear adapter (or target_parameters tparams alone)
    with random A, B -> the PeftModel (eval)."""
    cfg = oracle_moe.tiny_moe_config(vocab=256, layers=2, experts=4, top_k=2, mlp_only=(0,))
    oracle_moe.build_moe_model(cfg, seed=3).save_pretrained(str(tmp_path / "hf"))
    base = oracle.load_hf(tmp_path / "hf")
    base.config._experts_implementation = "eager"
    pm = OL.make_peft(base, r=R, alpha=ALPHA, targets=[] if tparams else "all-linear", target_parameters=tparams,
                      seed=9, std=0.3)
    pm.save_pretrained(str(tmp_path / "adapter"))
    return pm


@pytest.mark.parametrize("tparams", [None, ["gate.weight"]], ids=["all_linear", "gate_weight_only"])
def test_router_adapter_generate_and_export_merge_match_peft(tparams, tmp_path, run_ctitan):
    """`generate --adapter` equals PEFT's greedy continuation; `export --merge` gives PEFT's
    merge_and_unload weights (the routers' W + scale B A among them) and its logits."""
    pm = peft_all_linear_adapter(tmp_path, tparams)
    generate_matches_peft(pm, tmp_path, run_ctitan)

    sd, ref_sd = export_merge_matches_peft(pm, tmp_path, run_ctitan)
    assert sd.keys() == ref_sd.keys()
    base = oracle.load_hf(tmp_path / "hf").state_dict()
    n = "model.layers.1.mlp.gate.weight"
    assert np.abs(ref_sd[n].numpy() - base[n].numpy()).max() > 1e-3, "test setup: the merge changes no router"
    for k in ref_sd:
        assert np.abs(sd[k].numpy() - ref_sd[k].numpy()).max() <= 1e-5 * np.abs(ref_sd[k].numpy()).max(), k
