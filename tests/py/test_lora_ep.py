"""LoRA and training.freeze under expert and tensor parallelism (docs/lora.md, Layouts).

Expert parallel: an EP rank holds the adapters of its own experts (A's rows and B's columns
of those experts), summed over the ranks that hold the same experts as the experts are, and
gathered whole into checkpoints and the saved PEFT adapter; the attention's and the
router's adapters are replicated and summed over every data-parallel rank; frozen tensors
are neither summed nor stepped. Tensor parallel: the experts' adapters are cut with the
experts along moe_intermediate (gate_up_proj's B by rows, down_proj's A by columns; the
other two replicated, with gradients summed over the group), the routers' adapters are
replicated and kept out of the group's sums.

EP 2 over DP 2, FSDP 2, DP 4 (each expert's adapters summed over the two replicas holding
them), HSDP 2 x 2, pipeline 2 x FSDP 2 and context 2 x FSDP 2, and TP 2, TP 2 x FSDP 2, TP 2 x FSDP 2 x EP 2,
TP 2 x DP 2 x EP 2 and PP 2 x TP 2 must train like one process with the same global batch:
every step's loss and gradient norm to 1e-5 relative, the final adapter (every tensor to
1e-5 of its largest element, the same keys, shapes and adapter_config.json) for all-linear
on a tiny Qwen3-MoE (the attention, both expert parameters with gate_up_proj at rank 2r,
every router) and on a tiny Mixtral, and for a bf16-stored frozen base (with the experts
adapted, and with frozen experts that the EP ranks read from the bf16 store); with
training.freeze (no LoRA: the embedding, layer 0, layer 1's experts and layer 2's router
frozen) the final HF export holds the frozen tensors bit for bit and the others to 1e-5 of
each one's largest. A checkpoint moves between EP 2 and one process both ways; PEFT loads
the EP and the TP runs' adapters strictly and gives the one-process adapter's logits. The
expected values are one process's run (tied to PEFT by test_lora_experts_runs.py,
test_lora_experts.py and test_families_lora.py) and PEFT.

AdamW's eps is 1e-4 as in test_lora_experts_runs.py's all-linear test: at 1e-8 an element
whose gradient is ~1e-8 turns the order of a sum over ranks into more than 1e-5 of its
tensor (measured there).

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import json

import numpy as np
import pytest
import torch

import oracle
import oracle_families as fam
import oracle_lora as OL
import oracle_moe
from test_dist_tp import grad_norms
from test_lora_runs import STEPS, ckpt, lora_names, run, tensors, train_args
from test_resume import losses

P = "--parallelism."
LORA = ["--lora.target_modules=all-linear", "--optimizer.eps=1e-4"]
FROZEN = ("model.embed_tokens.weight", "model.layers.0.*", "model.layers.1.mlp.experts.*",
          "model.layers.2.mlp.gate.weight")
CASES = {  # name: (model, args); LoRA at rank 4, alpha 8, dropout 0 (test_lora_runs.train_args)
    "all_linear": ("qwen", LORA),
    "mixtral": ("mixtral", LORA),
    "bf16_base": ("qwen", LORA + ["--training.frozen_dtype=bfloat16"]),
    # the experts frozen in bf16 with no adapter: the EP ranks run them from the bf16 store
    "bf16_router": ("qwen", ["--lora.target_modules=q_proj,o_proj,gate", "--optimizer.eps=1e-4",
                             "--training.frozen_dtype=bfloat16"]),
    # no LoRA; the final save is the HF model, frozen tensors included
    "freeze": ("qwen", ["--optimizer.eps=1e-4", f"--training.freeze={','.join(FROZEN)}",
                        "--checkpoint.last_save_in_hf=true", "--checkpoint.last_save_model_only=true"]),
}
EP2, TP2 = P + "expert_parallel_degree=2", P + "tensor_parallel_degree=2"
LAYOUTS = {  # name: (ranks, args); every layout's global batch is 8 sequences, one process's 4 micro-batches
    "dp2_ep2": (2, [P + "data_parallel_replicate_degree=2", P + "data_parallel_shard_degree=1", EP2]),
    "fsdp2_ep2": (2, [P + "data_parallel_shard_degree=2", EP2]),
    "dp4_ep2": (4, [P + "data_parallel_replicate_degree=4", P + "data_parallel_shard_degree=1", EP2]),
    "hsdp2x2_ep2": (4, [P + "data_parallel_replicate_degree=2", P + "data_parallel_shard_degree=2", EP2]),
    "pp2_fsdp2_ep2": (4, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=2",
                          P + "pipeline_parallel_microbatch_size=1", EP2]),
    "cp2_fsdp2_ep2": (4, [P + "context_parallel_degree=2", P + "data_parallel_shard_degree=2", EP2]),
    "tp2": (2, [TP2, P + "data_parallel_shard_degree=1"]),
    "tp2_fsdp2": (4, [TP2, P + "data_parallel_shard_degree=2"]),
    "tp2_fsdp2_ep2": (4, [TP2, P + "data_parallel_shard_degree=2", EP2]),
    "tp2_dp2_ep2": (4, [TP2, P + "data_parallel_replicate_degree=2", P + "data_parallel_shard_degree=1", EP2]),
    "pp2_tp2": (4, [TP2, P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=1",
                    P + "pipeline_parallel_microbatch_size=1"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3-MoE (layer 0 dense, layers 1-2 with 4 experts, top 2; hidden 30 so that no
    FSDP piece divides evenly by 2), test_families' tiny Mixtral (2 layers of 4 experts,
    vocabulary 160) and token files."""
    d = tmp_path_factory.mktemp("lora_ep")
    cfg = oracle_moe.tiny_moe_config(vocab=256, hidden=30, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8,
                                     experts=4, top_k=2, moe_inter=12, mlp_only=(0,))
    oracle_moe.build_moe_model(cfg, seed=21).save_pretrained(str(d / "qwen"))
    fam.save(fam.build(fam.CASE["mixtral_e4k2"]), d / "mixtral")
    oracle.write_bin(d / "qwen.bin", oracle.learnable_stream(300 * 17, 251, seed=7))
    oracle.write_bin(d / "mixtral.bin", oracle.learnable_stream(300 * 17, 160, seed=7))
    return d


def args(d, case, out, layout=None, *extra):
    model, a = CASES[case]
    lora = case != "freeze"
    res = train_args(d / model, d / f"{model}.bin", out, *a, accum=4, lora=lora)
    if layout:
        res += LAYOUTS[layout][1]
    return res + list(extra)


def ep_run(d, case, layout, out, *extra, check=True):
    return run(LAYOUTS[layout][0], args(d, case, out, layout, *extra), timeout=240, check=check)


@pytest.fixture(scope="module")
def one(setup):
    """One process's run of a case, made once: {case: out}."""
    done = {}

    def get(case):
        if case not in done:
            done[case] = setup / f"one_{case}"
            p = run(1, args(setup, case, done[case]))
            (done[case] / "stderr.txt").write_text(p.stderr)
        return done[case]
    return get


def close(x, y, what, tol=1e-5):
    """Each tensor of y (one process's) in x to tol of its largest element."""
    assert x.keys() == y.keys(), f"{what}: tensors differ: {sorted(set(x) ^ set(y))}"
    for k in y:
        assert x[k].shape == y[k].shape, f"{what}: {k} shape {x[k].shape} vs {y[k].shape}"
        err = np.max(np.abs(x[k] - y[k])) / max(float(np.max(np.abs(y[k]))), 1e-30)
        assert err <= tol, f"{what}: {k} differs from one process's by {err:.3g} of its largest element"


def assert_same_steps(out, ref, what, steps=range(1, STEPS + 1)):
    """Every step's loss and gradient norm to 1e-5 relative."""
    for name, get in (("loss", losses), ("grad_norm", grad_norms)):
        got, want = get(out), get(ref)
        assert set(steps) <= set(got), f"{what}: {name} steps {sorted(got)}"
        bad = [(s, got[s], want[s]) for s in steps if not abs(got[s] - want[s]) <= 1e-5 * abs(want[s])]
        assert not bad, f"{what}: (step, {name}, one process's) beyond 1e-5: {bad}"


def assert_same_adapter(out, ref, what, step=STEPS):
    """adapter_model.safetensors holds every adapter whole (one process's keys and shapes, each
    tensor to 1e-5 of its largest element) with one process's adapter_config.json."""
    x = tensors(out, step, files=("adapter_model.safetensors",))
    y = tensors(ref, step, files=("adapter_model.safetensors",))
    assert lora_names(y) == sorted(y), f"test setup: {sorted(y)}"
    close(x, y, what)
    a, b = (json.loads((ckpt(o, step) / "adapter_config.json").read_text()) for o in (out, ref))
    assert a == b, f"{what}: adapter_config.json differs"
    return y


def trained_line(stderr):
    lines = [l for l in stderr.splitlines() if l.startswith("ctitan: trained:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("case,layout", [
    ("all_linear", "dp2_ep2"), ("all_linear", "fsdp2_ep2"), ("all_linear", "dp4_ep2"), ("all_linear", "hsdp2x2_ep2"),
    ("all_linear", "pp2_fsdp2_ep2"), ("all_linear", "cp2_fsdp2_ep2"), ("mixtral", "dp2_ep2"), ("bf16_base", "dp2_ep2"),
    ("bf16_base", "fsdp2_ep2"),
    ("bf16_router", "dp2_ep2"), ("bf16_router", "fsdp2_ep2"), ("freeze", "dp2_ep2"), ("freeze", "fsdp2_ep2"),
    # tensor parallel: the experts' adapters cut along moe_intermediate with the experts, the routers' whole
    ("all_linear", "tp2"), ("all_linear", "tp2_fsdp2"), ("all_linear", "tp2_fsdp2_ep2"), ("all_linear", "tp2_dp2_ep2"),
    ("all_linear", "pp2_tp2"), ("mixtral", "tp2"), ("bf16_base", "tp2"), ("bf16_router", "tp2_fsdp2_ep2"),
    ("freeze", "tp2_fsdp2_ep2")])
def test_layout_matches_one_process(setup, one, case, layout):
    ref = one(case)
    out = setup / f"{case}_{layout}"
    p = ep_run(setup, case, layout, out)
    what = f"{case} under {layout}"
    assert ("expert_parallel 2" in p.stderr) == ("_ep2" in layout), p.stderr[-3000:]
    assert_same_steps(out, ref, what)
    # the trained-parameter count is the whole model's, as one process prints it
    assert trained_line(p.stderr) == trained_line((ref / "stderr.txt").read_text())
    if case != "freeze":
        y = assert_same_adapter(out, ref, what)
        experts = [k for k in y if ".mlp.experts." in k and "lora_B" in k]
        routers = [k for k in y if ".mlp.gate.lora_B" in k]
        assert len(experts) == (0 if case == "bf16_router" else 2 * 2) and len(routers) == 2, f"test setup: {sorted(y)}"
        assert all(np.any(y[k]) for k in experts + routers), "an expert's or router's lora_B never left zero"
        return
    a, b = oracle.read_hf_tensors(ckpt(out)), oracle.read_hf_tensors(ckpt(ref))
    init = oracle.read_hf_tensors(setup / "qwen")
    frozen = [k for k in b if k == FROZEN[0] or k == FROZEN[3] or ".layers.0." in k
              or k.startswith("model.layers.1.mlp.experts.")]
    assert len(frozen) > 3 and all(np.array_equal(b[k], init[k]) for k in frozen), "one process moved a frozen one"
    bad = [k for k in frozen if not np.array_equal(a[k], b[k])]
    assert not bad, f"{what}: frozen tensors moved: {bad}"
    close({k: a[k] for k in a if k not in frozen}, {k: b[k] for k in b if k not in frozen}, what)
    moved = [k for k in b if k.startswith("model.layers.2.mlp.experts.") and not np.array_equal(b[k], init[k])]
    assert moved, f"test setup: layer 2's experts did not train: {sorted(b)}"


@pytest.mark.parametrize("first,then", [("fsdp2_ep2", None), (None, "dp2_ep2")], ids=["ep_to_one", "one_to_ep"])
def test_ep_checkpoint_moves_to_and_from_one_process(setup, one, first, then):
    """all-linear stopped at step 3 under EP 2 and resumed on one process, and the reverse: the
    steps after it, the final adapter and every AdamW moment of the checkpoint equal the
    uninterrupted one-process run's."""
    ref = one("all_linear")
    out = setup / f"move_{first}_{then}"
    stop = "--training.stop_at_step=3"
    p = ep_run(setup, "all_linear", first, out, stop, check=False) if first else \
        run(1, args(setup, "all_linear", out, None, stop), check=False)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    p = ep_run(setup, "all_linear", then, out) if then else run(1, args(setup, "all_linear", out))
    assert "resuming from" in p.stderr, p.stderr[-2000:]
    what = f"{first or 'one'} -> {then or 'one'}"
    assert_same_steps(out, ref, what, steps=range(4, STEPS + 1))
    assert_same_adapter(out, ref, what)
    close(tensors(out, files=("optim.safetensors",)), tensors(ref, files=("optim.safetensors",)), what)


@pytest.mark.parametrize("layout", ["fsdp2_ep2", "tp2"])
def test_peft_loads_the_layout_adapter(setup, one, layout):
    """all-linear: the adapter of the FSDP 2 x EP 2 (or TP 2) run's final checkpoint loads into
    PEFT strictly (every tensor with its value) and gives the logits of the one-process run's
    adapter, which moves them away from the base model's."""
    ref = one("all_linear")
    out = setup / f"all_linear_{layout}"
    if not ckpt(out).exists():
        ep_run(setup, "all_linear", layout, out)
    tokens = torch.as_tensor(oracle.random_tokens(2 * 16, 251, seed=4).reshape(2, 16))

    def base():
        m = oracle.load_hf(setup / "qwen")
        m.config._experts_implementation = "eager"
        return m
    with torch.no_grad():
        plain = base()(input_ids=tokens).logits.float().numpy()
    logits = {}
    for name, o in (("ep", out), ("one", ref)):
        pm = OL.load_adapter_strict(base(), ckpt(o))
        with torch.no_grad():
            logits[name] = pm(input_ids=tokens).logits.float().numpy()
    err = oracle.rel_err(logits["ep"], logits["one"])
    assert err <= 1e-5, f"PEFT's logits with the {layout} adapter vs the one-process adapter: rel err {err:.3g}"
    moved = oracle.rel_err(logits["one"], plain)
    assert moved > 1e-3, f"the adapter hardly changes the logits ({moved:.3g}): the comparison proves nothing"



def fsdp_trained_floats(pm, base, shard, ep, experts_slice=lambda s, ep, g: s // ep):
    """[trained fp32 floats of shard rank s's FSDP slices for s in range(shard)], from PEFT's
    adapter shapes and HF's parameter sizes, by the piece layout of docs/distributed.md
    ("FSDP") and docs/lora.md ("Layouts"): the embedding and the head are frozen; a layer's
    piece is its base tensors and then its adapters (a MoE layer's: attention's, then the
    router's), its experts and their adapters apart in a piece of their own, the EP rank's
    E / ep experts and its share of each expert adapter (A's rows, B's columns), the adapters
    last. A piece of n floats over g ranks is cut in slices of ceil(n / g); a layer piece's
    slice s is shard rank s's; the experts piece is cut over the g = shard / ep ranks holding
    the same experts (mesh.edp: the shard ranks of one s % ep, in order), so rank s holds
    its slice s // ep (experts_slice(s, ep, g); None: none)."""
    sizes = {n: p.numel() for n, p in base.named_parameters()}
    trained = {n: p.numel() for n, p in pm.named_parameters() if p.requires_grad}

    def slices(n, tail, g):  # trained floats (the last `tail` of n) in each of g slices
        c = -(-n // g)
        return [max(0, min(n, (r + 1) * c) - max(n - tail, r * c)) for r in range(g)]
    per = [0] * shard
    for l in range(base.config.num_hidden_layers):
        b = {n: v for n, v in sizes.items() if n.startswith(f"model.layers.{l}.")}
        a = {n: v for n, v in trained.items() if f".layers.{l}." in n}
        exp_b = sum(v for n, v in b.items() if ".mlp.experts." in n)
        exp_a = sum(v for n, v in a.items() if ".mlp.experts." in n)
        other_a = sum(a.values()) - exp_a
        for s, x in enumerate(slices(sum(b.values()) - exp_b + other_a, other_a, shard)):
            per[s] += x
        if exp_b:
            g = shard // ep
            held = slices((exp_b + exp_a) // ep, exp_a // ep, g)
            for s in range(shard):
                k = experts_slice(s, ep, g)
                per[s] += held[k] if k is not None else 0
    return per


@pytest.mark.parametrize("shard", [4, 2], ids=["fsdp4_ep2", "fsdp2_ep2"])
def test_dry_run_trained_bytes_per_rank_fsdp_ep(setup, run_ctitan, shard):
    """--dry-run of all-linear on the tiny Qwen3-MoE under FSDP `shard` x EP 2: its per-rank
    "gradients (fp32, trained only)" line is 4 bytes x the trained floats of the shard rank
    that holds the most (plan_dry.c's dry_fsdp_plan takes the maximum over the shard ranks,
    not rank 0's, which here holds none: the adapters end each piece, in its last slices),
    computed by fsdp_trained_floats from PEFT's adapter shapes. The layer pieces' adapters
    sit in the last shard ranks' slices, the experts' adapters in the last edp slice, which
    the last shard ranks hold too: crediting the experts piece's slice r to shard rank r
    (r < shard / ep), as the dry run did before commit b8bf05d, gives a smaller maximum,
    which the test setup checks, so the line tells the two apart."""
    import re
    base = oracle.load_hf(setup / "qwen")
    pm = OL.make_peft(oracle.load_hf(setup / "qwen"), r=4, alpha=8.0, targets="all-linear")
    per = fsdp_trained_floats(pm, base, shard, 2)
    want = 4 * max(per)
    old = 4 * max(fsdp_trained_floats(pm, base, shard, 2, lambda s, ep, g: s if s < g else None))
    assert want != old and per[0] < max(per), f"test setup: the layouts give {per} ({want} vs {old} bytes)"
    _, out, _ = run_ctitan(args(setup, "all_linear", setup / f"dry_fsdp{shard}_ep2", None, "--dry-run",
                                P + f"data_parallel_shard_degree={shard}", EP2))
    block = out.split("per rank:")[-1]
    assert f"FSDP over {shard} ranks, the experts over the {shard // 2} holding the same ones" in block, block
    got = [int(v) for v in re.findall(r"^\s+gradients \(fp32, trained only\)\s+[\d.]+ GiB\s+(\d+) bytes$", block,
                                      re.M)]
    assert got == [want], f"per-rank trained gradient bytes {got}, want {want} (floats per shard rank {per}):\n{block}"


def test_tp_loads_an_expert_b_wider_than_every_row_slice(tmp_path):
    """Under TP without EP an expert adapter's B [out, r E] keeps its whole rows, which the
    loader used to copy into a scratch sized for the row-parallel slices alone: with 16
    experts at rank 16 (B of down_proj 30 x 256 floats per layer against o_proj's 30 x 16)
    the copy ran past it (a heap overflow, then a crash at the first load). TP 2 (and
    TP 2 x FSDP 2) must train this model like one process: every step's loss and gradient
    norm to 1e-5."""
    cfg = oracle_moe.tiny_moe_config(vocab=256, hidden=30, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8,
                                     experts=16, top_k=2, moe_inter=12, mlp_only=())
    oracle_moe.build_moe_model(cfg, seed=21).save_pretrained(str(tmp_path / "moe16"))
    oracle.write_bin(tmp_path / "moe16.bin", oracle.learnable_stream(300 * 17, 251, seed=7))
    wide = LORA + ["--lora.rank=16", "--lora.alpha=32"]  # after train_args' rank 4: the last one counts

    def go(name, ranks, layout):
        out = tmp_path / name
        run(ranks, train_args(tmp_path / "moe16", tmp_path / "moe16.bin", out, *wide, accum=4, steps=3) + layout,
            timeout=240)
        return out
    ref = go("one", 1, [])
    for name, ranks, layout in (("tp2", 2, LAYOUTS["tp2"][1]), ("tp2_fsdp2", 4, LAYOUTS["tp2_fsdp2"][1])):
        assert_same_steps(go(name, ranks, layout), ref, name, steps=range(1, 4))
