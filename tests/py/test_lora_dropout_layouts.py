"""LoRA dropout under every layout draws one process's masks (docs/lora.md, Layouts).

A mask element is a hash of (training.seed, step, the sequence's index in the step's global
batch, its position, layer, projection, column), so with lora.dropout > 0 a run under DP 2,
FSDP 2, HSDP 2 x 2, a pipeline of 2 (1F1B, GPipe, Interleaved1F1B, and 1F1B x DP 2), TP 2,
CP 2 (and x FSDP 2), EP 2 over FSDP 2 (a Qwen3-MoE, adapters on its attention), and one
process taking the step's 4 sequences as one micro-batch instead of two,
trains like one process with 2 micro-batches of 2: every step's loss and pre-clip gradient
norm to 1e-5 relative, and the final adapters (every tensor to 1e-5 of its largest element).

The expected values are one process's run (tied to PEFT's dropout, the same masks given to
PEFT's lora_dropout, by test_lora.py's dropout tests); a dropout-free run shows the masks
move every compared quantity by far more than the tolerance.

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import numpy as np
import pytest

import oracle
import oracle_moe
from test_dist_tp import grad_norms
from test_lora_runs import run, tensors
from test_resume import losses

P = "--parallelism."
SEQ, STEPS, GLOBAL = 16, 3, 4
TOL = 1e-5
DENSE_P, MOE_P = 0.2, 0.3  # lora.dropout of the dense and the MoE model's runs


def train_args(model, data, out, local, *extra, dropout, targets="all-linear"):
    """`ctitan train` of STEPS steps of GLOBAL sequences, local_batch_size `local` per
    data-parallel rank, LoRA r 4 on `targets`, a full checkpoint (adapters) at the end.
    AdamW eps 0.1 (lr 0.1: steps of about the gradient): at eps 1e-4 Adam scales a gradient
    element far below eps by 1 / eps and the large ones by 1 / |g|, so a last-bit difference
    of a 2e-6 element (TP 2's sums, dropout 0) moved a lora_B by 1.9e-4 of its largest
    element after 3 steps while the gradients agreed to 2e-6 of theirs; with eps above every
    gradient the adapters' error is the gradients'."""
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model}",
            f"--checkpoint.initial_load_path={model}", "--checkpoint.initial_load_in_hf",
            f"--training.dataset_path={data}", f"--training.seq_len={SEQ}", f"--training.local_batch_size={local}",
            f"--training.global_batch_size={GLOBAL}", f"--training.steps={STEPS}", "--training.seed=13",
            "--optimizer.lr=0.1", "--optimizer.eps=0.1", "--lr_scheduler.warmup_steps=1",
            "--metrics.log_freq=1", "--metrics.peak_tflops=1", f"--job.dump_folder={out}", "--checkpoint.enable",
            "--checkpoint.interval=1000", "--checkpoint.last_save_model_only=false",
            "--checkpoint.last_save_in_hf=false", "--checkpoint.keep_latest_k=0",
            "--lora.rank=4", "--lora.alpha=8", f"--lora.dropout={dropout}", f"--lora.target_modules={targets}",
            *extra]


ONE = [P + "data_parallel_shard_degree=1"]
PP2 = [P + "pipeline_parallel_degree=2", P + "pipeline_parallel_microbatch_size=1"] + ONE
LAYOUTS = {  # name: (ranks, local_batch_size, args); the reference: 1 process, 2 micro-batches of 2
    "accum1": (1, 4, []),
    "dp2": (2, 2, [P + "data_parallel_replicate_degree=2"] + ONE),
    "fsdp2": (2, 2, [P + "data_parallel_shard_degree=2"]),
    "hsdp2x2": (4, 1, [P + "data_parallel_replicate_degree=2", P + "data_parallel_shard_degree=2"]),
    "pp2_1f1b": (2, 2, PP2 + [P + "pipeline_parallel_schedule=1F1B"]),
    "pp2_gpipe": (2, 2, PP2 + [P + "pipeline_parallel_schedule=GPipe"]),
    "pp2_interleaved": (2, 2, PP2 + [P + "pipeline_parallel_schedule=Interleaved1F1B"]),
    "pp2_dp2": (4, 1, PP2[:2] + [P + "data_parallel_replicate_degree=2"] + ONE),
    "tp2": (2, 2, [P + "tensor_parallel_degree=2"] + ONE),
    "cp2": (2, 2, [P + "context_parallel_degree=2"] + ONE),
    "cp2_fsdp2": (4, 1, [P + "context_parallel_degree=2", P + "data_parallel_shard_degree=2"]),
}
EP_LAYOUTS = {
    "fsdp2_ep2": (2, 2, [P + "data_parallel_shard_degree=2", P + "expert_parallel_degree=2"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 of 4 layers (Interleaved1F1B puts 2 stages on each of 2 ranks; sizes TP 2
    divides) and a tiny Qwen3-MoE (layer 0 dense, layer 1 4 experts, top 2), a token file."""
    d = tmp_path_factory.mktemp("lora_dropout_layouts")
    oracle.save_random_hf(d / "dense", oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=4, heads=4,
                                                          kv_heads=2, head_dim=8), seed=21)
    cfg = oracle_moe.tiny_moe_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8,
                                     experts=4, top_k=2, moe_inter=16, mlp_only=(0,))
    oracle_moe.build_moe_model(cfg, seed=21).save_pretrained(str(d / "moe"))
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(200 * (SEQ + 1), 251, seed=7))
    return d


# PEFT's adapters on the experts refuse dropout: the MoE model's adapters are the attention's
MOE_TARGETS = "q_proj,k_proj,v_proj,o_proj"


def one_run(d, model, name, ranks, local, extra, dropout):
    out = d / f"{model}_{name}_{dropout}"
    if not (out / "metrics.jsonl").exists():
        targets = "all-linear" if model == "dense" else MOE_TARGETS
        run(ranks, train_args(d / model, d / "tokens.bin", out, local, *extra, dropout=dropout, targets=targets),
            timeout=240)
    return out


@pytest.fixture(scope="module")
def reference(setup):
    """{model: out} of one process, 2 micro-batches of 2 sequences per step, with dropout."""
    return {"dense": one_run(setup, "dense", "ref", 1, 2, [], DENSE_P),
            "moe": one_run(setup, "moe", "ref", 1, 2, [], MOE_P)}


def adapters(out):
    return {k.split(":", 1)[1]: v for k, v in tensors(out, STEPS, files=("adapter_model.safetensors",)).items()}


def differences(ref, got):
    """What differs by more than TOL between two runs: losses, grad norms, adapters."""
    bad = []
    for what, get in (("loss", losses), ("grad_norm", grad_norms)):
        a, b = get(ref), get(got)
        assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), f"{what} steps: {sorted(a)} vs {sorted(b)}"
        bad += [f"step {s} {what} {b[s]!r} vs {a[s]!r}" for s in a if not abs(b[s] - a[s]) <= TOL * abs(a[s])]
    a, b = adapters(ref), adapters(got)
    assert a.keys() == b.keys(), f"adapter tensors differ: {sorted(a.keys() ^ b.keys())[:6]}"
    for k in sorted(a):
        assert a[k].shape == b[k].shape, f"{k}: {b[k].shape} vs {a[k].shape}"
        err = float(np.max(np.abs(b[k] - a[k]))) / float(np.max(np.abs(a[k])))
        if not err <= TOL:
            bad.append(f"{k}: max |diff| / max |ref| = {err:.3g}")
    return bad


def test_dropout_matters(setup, reference):
    """Guard: the masks move the step-1 gradient norm, later losses and the adapters by far
    more than TOL (lora_B starts at 0, so step 1's loss is the base model's either way)."""
    for model, p in (("dense", DENSE_P), ("moe", MOE_P)):
        plain = one_run(setup, model, "ref", 1, 2, [], 0.0)
        bad = differences(reference[model], plain)
        assert any(s.startswith("step 1 grad_norm") for s in bad), f"{model}: dropout {p} vs 0: {bad[:4]}"
        assert any(s.startswith(f"step {STEPS} loss") for s in bad), f"{model}: dropout {p} vs 0: {bad[:4]}"
        assert sum("lora_A" in s for s in bad) >= 4, f"{model}: dropout {p} vs 0: {bad[:4]}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dense_layout_matches_one_process(setup, reference, layout):
    ranks, local, extra = LAYOUTS[layout]
    got = one_run(setup, "dense", layout, ranks, local, extra, DENSE_P)
    bad = differences(reference["dense"], got)
    assert not bad, f"{layout} with lora.dropout={DENSE_P} vs one process:\n" + "\n".join(bad[:12])


@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_moe_layout_matches_one_process(setup, reference, layout):
    ranks, local, extra = EP_LAYOUTS[layout]
    got = one_run(setup, "moe", layout, ranks, local, extra, MOE_P)
    bad = differences(reference["moe"], got)
    assert not bad, f"{layout} with lora.dropout={MOE_P} vs one process:\n" + "\n".join(bad[:12])
