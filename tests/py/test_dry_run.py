"""`ctitan train --dry-run`: the planned memory, before anything is allocated; for a layout
of several ranks (issue 7), what each rank plans, checked against runs of that layout."""
import re
import subprocess

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

import oracle
from conftest import BIN, crashed
from test_dist import ENV, mpirun


def test_dry_run_counts(tmp_path, run_ctitan):
    cfg = oracle.tiny_config(vocab=300, hidden=32, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8)
    model = oracle.save_random_hf(tmp_path / "m", cfg, seed=1)
    n_hf = sum(p.numel() for p in model.parameters())
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(8 * 33, 300, seed=1))
    common = ["--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'm'}", "--training.seq_len=32",
              "--training.local_batch_size=4", f"--training.dataset_path={data}", "--training.steps=1",
              f"--job.dump_folder={tmp_path / 'o'}", "--metrics.peak_tflops=1"]
    plans = {}
    for mode in ("none", "full"):
        _, out, _ = run_ctitan(["train", "--dry-run", f"--activation_checkpoint.mode={mode}"] + common)
        n = int(re.search(r"(\d+) parameters", out).group(1))
        assert n == n_hf, f"dry run counts {n} parameters, transformers {n_hf}"
        plans[mode] = int(re.search(r"activations \+ workspace \(planned\)\s+[0-9.]+ GiB\s+(\d+) bytes", out).group(1))
        assert int(re.search(r"parameters \(fp32\)\s+[0-9.]+ GiB\s+(\d+) bytes", out).group(1)) == 4 * n_hf
        # the run itself plans the same activations (its log says MiB)
        _, _, err = run_ctitan(["train", f"--activation_checkpoint.mode={mode}"] + common)
        mib = float(re.search(r"activations ([0-9.]+) MiB", err).group(1))
        assert abs(mib - plans[mode] / 2**20) < 0.05, (mib, plans[mode])
    assert plans["full"] < plans["none"]
    assert "per rank" not in out  # one process: the whole-model plan only


# --- per rank (issue 7): what each rank of a layout plans, tied to what a run of it allocates ---

MIB = 2**20
# name: (ranks, model, degrees (replicate, shard, tp, ep))
PER_RANK = {
    "tp2": (2, "dense", (1, 1, 2, 1)),
    "fsdp2": (2, "dense", (1, 2, 1, 1)),
    "ep2_fsdp2": (2, "moe", (1, 2, 1, 2)),
    "tp2_fsdp2": (4, "dense", (1, 2, 2, 1)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two sizes of each kind: 'tiny' (the plan is well under a MiB, so its measured peak is
    the runtime's: MPI, libraries) and 'medium' (4-7 M parameters: the plan dominates)."""
    d = tmp_path_factory.mktemp("per_rank")
    # hidden 31 makes the head piece odd: FSDP pads its last slice
    oracle.tiny_config(vocab=254, hidden=31, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(d / "dense_tiny")
    oracle.tiny_config(vocab=2048, hidden=256, inter=768, layers=4, heads=4, kv_heads=2, head_dim=64
                       ).save_pretrained(d / "dense_medium")
    for size, (v, h, i, mi, e, hd) in {"tiny": (251, 30, 49, 20, 4, 8), "medium": (2048, 256, 768, 256, 8, 64)}.items():
        Qwen3MoeConfig(vocab_size=v, hidden_size=h, intermediate_size=i, moe_intermediate_size=mi, num_experts=e,
                       num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                       num_hidden_layers=3 if size == "tiny" else 4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=hd, max_position_embeddings=256, tie_word_embeddings=False,
                       output_router_logits=False).save_pretrained(d / f"moe_{size}")
    data = oracle.write_bin(d / "t.bin", oracle.random_tokens(64 * 33, 251, seed=3))
    return d, data


def layout_args(model_dir, data, out, degrees):
    rep, shard, tp, ep = degrees
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}", f"--training.dataset_path={data}",
            "--training.seq_len=32", "--training.local_batch_size=2", "--training.steps=1",
            "--metrics.peak_tflops=1", f"--job.dump_folder={out}",
            f"--parallelism.data_parallel_replicate_degree={rep}", f"--parallelism.data_parallel_shard_degree={shard}",
            f"--parallelism.tensor_parallel_degree={tp}", f"--parallelism.expert_parallel_degree={ep}"]


def launch(np_, args, env=ENV, timeout=120):
    cmd = ([str(BIN)] if np_ == 0 else mpirun() + ["-np", str(np_), str(BIN)]) + [str(a) for a in args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    return p


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def field(out, label):
    """Bytes of a plan line `label ... GiB  N bytes`."""
    return int(re.search(re.escape(label) + r"\s+[0-9.]+ GiB\s+(\d+) bytes", out).group(1))


def fsdp_stored(model_dir, shard, ep):
    """Parameters a rank stores under FSDP, from transformers' own tensors (not ctitan's):
    the embedding, each layer (under EP its experts, E/ep of them here, a piece of their own
    over the shard/ep ranks holding them) and the head, each in slices of ceil(n / ranks)."""
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        sizes = {k: p.numel() for k, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    ceil = lambda a, b: -(-a // b)
    embed = sizes.pop("model.embed_tokens.weight")
    stored = ceil(embed, shard)
    for l in range(cfg.num_hidden_layers):
        pre = f"model.layers.{l}."
        layer = sum(n for k, n in sizes.items() if k.startswith(pre))
        experts = sum(n for k, n in sizes.items() if k.startswith(pre + "mlp.experts."))
        if ep > 1 and experts:
            stored += ceil(layer - experts, shard) + ceil(experts // ep, shard // ep)
        else:
            stored += ceil(layer, shard)
    stored += ceil(sum(n for k, n in sizes.items() if not k.startswith("model.layers.")), shard)  # norm, lm_head
    return stored


@pytest.mark.parametrize("name", PER_RANK)
def test_dry_run_per_rank_matches_a_run(models, tmp_path, name):
    """The dry run without mpirun (degrees fixed) plans for rank 0 what a 1-step run of the
    same layout under mpirun runs: its `model ...: N parameters` line; under FSDP the
    stored slice matches transformers' tensor sizes cut as FSDP cuts them. Its planned peak
    is checked against the run's measured `peak memory` of rank 0 on a medium model: never
    above it (everything planned is memory a step writes), and the measured excess over
    the plan no more than the runtime's (the tiny model's measured peak, whose plan is
    < 1 MiB) + 8 MiB (MPI's and the allocator's buffers that grow with message sizes, and
    what the dry run leaves out: FSDP staging of padded pieces, EP dispatch buffers)."""
    ranks, kind, degrees = PER_RANK[name]
    d, data = models
    peak, planned = {}, {}
    for size in ("tiny", "medium"):
        model_dir = d / f"{kind}_{size}"
        args = layout_args(model_dir, data, tmp_path / size, degrees)
        out = ok(launch(0, args + ["--dry-run"])).stdout
        assert f"per rank: world {ranks} = " in out, out
        n_plan = int(re.search(r"(\d+) parameters run by this rank", out).group(1))
        err = ok(launch(ranks, args)).stderr
        n_run = int(re.search(r"ctitan: model \S+: (\d+) parameters", err).group(1))
        assert n_plan == n_run, f"{name} {size}: dry run plans {n_plan} parameters on rank 0, the run has {n_run}"
        stored = n_plan
        if degrees[1] > 1:
            stored = int(re.search(r"FSDP over \d+ ranks.*: (\d+) parameters stored", out).group(1))
            want = fsdp_stored(model_dir, degrees[1], degrees[3]) if degrees[2] == 1 else None
            if want is not None:
                assert stored == want, f"{name} {size}: stored {stored}, FSDP's slices of the tensors {want}"
            if degrees[3] == 1:  # the state is 1/shard, up to the padding of each piece's last slice
                assert 0 <= stored - n_plan / degrees[1] < 8, (stored, n_plan)
        per = out.split("per rank: ")[1]
        assert field(per, "parameters (fp32)") == 4 * stored
        assert field(per, "AdamW moments (2 x fp32)") == 8 * stored
        planned[size] = field(per, "planned peak per rank")
        peak[size] = float(re.search(r"rank 0 of \d+: peak memory ([0-9.]+) GiB", err).group(1)) * 2**30
    print(f"{name}: planned peak {planned['medium'] / MIB:.1f} MiB, measured {peak['medium'] / MIB:.1f} MiB; "
          f"runtime (tiny model) {peak['tiny'] / MIB:.1f} MiB")
    assert planned["medium"] <= peak["medium"], (planned, peak)
    assert peak["medium"] - peak["tiny"] <= planned["medium"] - planned["tiny"] + 8 * MIB, (planned, peak)


def test_dry_run_under_mpirun_only_rank0_prints(models, tmp_path):
    """Under mpirun the world is MPI's (shard degree -1: FSDP over all of it); rank 0 prints
    exactly what the dry run without mpirun prints for those degrees, the others nothing
    (even when every rank may log), and all exit 0."""
    d, data = models
    args = layout_args(d / "dense_tiny", data, tmp_path / "o", (1, -1, 1, 1))
    p = ok(launch(2, args + ["--dry-run"], env=dict(ENV, CTITAN_LOG_RANKS="all")))
    assert p.stdout.count("dry run: model") == 1 and p.stdout.count("per rank: world 2 = ") == 1, p.stdout
    fixed = ok(launch(0, layout_args(d / "dense_tiny", data, tmp_path / "o", (1, 2, 1, 1)) + ["--dry-run"]))
    assert p.stdout == fixed.stdout


@pytest.mark.parametrize("ranks,degrees,words", [
    (0, (1, 1, 3, 1), "tensor_parallel_degree = 3 does not divide the model's attention heads"),
    (0, (1, 2, 1, 2), "expert_parallel_degree = 2 but the model"),
    (2, (1, 3, 1, 1), "world size is 2"),
])
def test_dry_run_bad_layout_exits_2(models, tmp_path, ranks, degrees, words):
    """A layout a run would reject, the dry run rejects the same way: exit 2, one message
    naming the key, nothing planned."""
    d, data = models
    p = launch(ranks, layout_args(d / "dense_tiny", data, tmp_path / "o", degrees) + ["--dry-run"], timeout=60)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1 and words in err[0], p.stderr
    assert "dry run" not in p.stdout


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_dry_run_per_rank_embedding_slice(tmp_path, tied):
    """Under TP 2 the embedding is vocabulary-parallel, tied or not: the dry run's rank 0
    holds rows 0 .. V/2 - 1, V/2 x H parameters (transformers' sizes), and its per-rank
    parameter count is every matrix's half plus the whole norms (transformers' tensors cut as
    the TP plan cuts them) and the count a TP 2 run prints for rank 0."""
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8, tied=tied)
    cfg.save_pretrained(tmp_path / "m")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(64 * 33, 256, seed=3))
    args = layout_args(tmp_path / "m", data, tmp_path / "o", (1, 1, 2, 1))
    out = ok(launch(0, args + ["--dry-run"])).stdout
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "m"))
    emb = model.get_input_embeddings().weight
    V, H = emb.shape
    want = sum(p.numel() // 2 if p.ndim == 2 else p.numel() for p in model.parameters())
    n_plan = int(re.search(r"(\d+) parameters run by this rank", out).group(1))
    assert n_plan == want, f"the dry run plans {n_plan} parameters on rank 0, transformers' tensors cut by TP 2: {want}"
    m = re.search(r"embedding: rows 0\.\.(\d+) of (\d+) here \((\d+) parameters", out)
    assert m, out
    assert (int(m.group(1)) + 1, int(m.group(2)), int(m.group(3))) == (V // 2, V, V // 2 * H), out
    err = ok(launch(2, args)).stderr
    n_run = int(re.search(r"ctitan: model \S+: (\d+) parameters", err).group(1))
    assert n_run == n_plan, err[-2000:]
