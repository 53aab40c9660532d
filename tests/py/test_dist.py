"""Many processes (issue 7): ctitan under mpirun on this 2-core machine, oversubscribed.

Every layout must train like one process with the same global batch: the same loss
for 10 steps to 1e-5 relative and the same final weights (norm-wise per tensor to 1e-5:
assert_same_weights says why not element-wise). The one-process run is
itself checked against PyTorch by test_train_loop.py, so agreeing with it ties
every layout to PyTorch. Checkpoints move between layouts; one rank's death ends
the job quickly; bad degrees are config errors naming the key. The MPI backend of
the communicator runs the C test tests/c/distributed/test_comm.c under mpirun.

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import oracle
from conftest import BIN, BUILD, ROOT, crashed
from test_data_hf import tokdir  # noqa: E402,F401  (fixture: a 700-id BPE tokenizer)

STEPS = 10
GLOBAL = 8   # sequences per optimizer step, whatever the layout
MICRO = 2    # sequences per micro-batch per rank

# One OpenMP thread per rank: up to 4 ranks share 2 cores.
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
ENV.pop("CTITAN_LOG_RANKS", None)


def mpirun():
    exe = shutil.which("mpirun")
    if not exe:
        pytest.fail("mpirun not found: run scripts/setup.sh (installs openmpi-bin)", pytrace=False)
    return [exe, "--oversubscribe", "--bind-to", "none"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    # sizes that no world size divides, so every FSDP piece has a padded last slice
    for tied in (False, True):
        cfg = oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=3, heads=4, kv_heads=2, head_dim=8,
                                 tied=tied)
        cfg.save_pretrained(d / ("model_tied" if tied else "model"))
    # MoE: layer 0 dense, layers 1-2 sparse, so FSDP pieces of both kinds; no aux loss in the
    # gradient (it is a function of each micro-batch's own tokens, which differ by layout)
    from transformers import Qwen3MoeConfig
    Qwen3MoeConfig(vocab_size=251, hidden_size=30, intermediate_size=49, moe_intermediate_size=20, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=False,
                   ).save_pretrained(d / "model_moe")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    return d, data


def train_args(model_dir, data, out, *extra, dp=1):
    # validation.local_batch_size is per rank (torchtitan's): 4 sequences over the data-parallel ranks
    val = ["--validation.enable", f"--validation.dataset_path={data}", "--validation.freq=5", "--validation.steps=2",
           f"--validation.local_batch_size={4 // dp}"]
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}",
            f"--training.dataset_path={data}", "--training.seq_len=16",
            f"--training.local_batch_size={MICRO}", f"--training.global_batch_size={GLOBAL}",
            f"--training.steps={STEPS}", "--training.shuffle", "--training.seed=5", "--optimizer.lr=3e-3",
            "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1", "--metrics.peak_tflops=1",
            f"--job.dump_folder={out}", "--checkpoint.enable", "--checkpoint.interval=1000",
            *val, *extra]


def run(np_, args, timeout=120, check=True):
    cmd = ([str(BIN)] if np_ == 1 else mpirun() + ["-np", str(np_), str(BIN)]) + [str(a) for a in args]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def losses(out):
    rows = [r for r in oracle.read_metrics(Path(out) / "metrics.jsonl") if "loss" in r]
    return {r["step"]: r["loss"] for r in rows}


def val_losses(out):
    return {r["step"]: r["val_loss"] for r in oracle.read_metrics(Path(out) / "metrics.jsonl") if "val_loss" in r}


def weights(out, step=STEPS, file="model.safetensors"):
    hdr, data = oracle.read_safetensors_raw(Path(out) / "checkpoint" / f"step-{step}" / file)
    res = {}
    for k, v in hdr.items():
        if k != "__metadata__":
            a, b = v["data_offsets"]
            res[k] = np.frombuffer(data[a:b], dtype=np.float32)
    return res


def assert_same_run(out, ref, what, steps=range(1, STEPS + 1), weights_too=True, ltol=1e-5):
    """Losses and validation losses to ltol relative (1e-5; looser only where the caller
    measured one process against itself, the same math, differing by more)."""
    got, want = losses(out), losses(ref)
    for s in steps:
        assert s in got, f"{what}: no loss for step {s}"
        assert abs(got[s] - want[s]) <= ltol * abs(want[s]), f"{what}: step {s} loss {got[s]!r} vs one rank {want[s]!r}"
    got, want = val_losses(out), val_losses(ref)
    assert set(want) == {5, 10} and set(got) == set(want), f"{what}: validation steps {sorted(got)} vs {sorted(want)}"
    for s in want:
        assert abs(got[s] - want[s]) <= ltol * abs(want[s]), f"{what}: step {s} val_loss {got[s]!r} vs {want[s]!r}"
    if weights_too:
        assert_same_weights(out, ref, what)


def grad_norms(out):
    return {r["step"]: r["grad_norm"] for r in oracle.read_metrics(Path(out) / "metrics.jsonl") if "grad_norm" in r}


def assert_same_norms(out, ref, what):
    """The logged gradient norm (clipping's, over every shard) of each step, to 1e-5 relative.
    With these models it stays under training.max_norm 1, so clipping never acts and a norm
    summed over the wrong ranks would leave the losses and weights unchanged."""
    got, want = grad_norms(out), grad_norms(ref)
    assert set(got) == set(want) == set(range(1, STEPS + 1)), f"{what}: grad_norm steps {sorted(got)}"
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{what}: step {s} grad_norm {got[s]!r} vs one rank {want[s]!r}"


def assert_same_weights(out, ref, what):
    """Final weights per tensor: ||a - b|| / ||b|| <= 1e-5. Not element by element: one
    process against itself with another micro-batch split (the same math, other fp32
    sums) already differs by up to 6.4e-6 (dense test model) and 1.9e-5 (MoE) of a
    tensor's largest element after 10 steps, because AdamW divides each element's step
    by sqrt(v) + eps and so magnifies the last bits of gradients near zero; norm-wise
    the same pair differs by 6.7e-7 and 2.5e-6 (docs/distributed.md, Numerics)."""
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys(), f"{what}: tensor names differ"
    for k in b:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        worst = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-30)
        assert err <= 1e-5, f"{what}: final {k} differs from one rank by {err:.3g} norm-wise " \
            f"({worst:.3g} of its largest element)"


@pytest.fixture(scope="module")
def single(setup):
    """The one-process runs every layout is compared with (untied and tied)."""
    d, data = setup
    outs = {}
    for tied in (False, True):
        out = d / ("single_tied" if tied else "single")
        run(1, train_args(d / ("model_tied" if tied else "model"), data, out))
        outs[tied] = out
    outs["moe"] = d / "single_moe"
    run(1, train_args(d / "model_moe", data, outs["moe"]))
    return outs


LAYOUTS = {  # name: (ranks, replicate, shard, extra)
    "dp2": (2, 2, 1, []),
    "fsdp2": (2, 1, 2, []),
    "fsdp2_no_reshard": (2, 1, 2, ["--parallelism.fsdp_reshard_after_forward=never"]),
    "dp4": (4, 4, 1, []),
    "fsdp4": (4, 1, -1, []),
    "hsdp2x2": (4, 2, 2, ["--activation_checkpoint.mode=full"]),
    # 2 micro-batches per rank: the replicas' sum of a layer's shard must wait for the last
    # one (with one micro-batch per rank, as above, a sum started in every micro-batch agrees)
    "hsdp2x2_accum2": (4, 2, 2, ["--training.local_batch_size=1"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(setup, single, name):
    d, data = setup
    n, rep, shard, extra = LAYOUTS[name]
    out = d / name
    p = run(n, train_args(d / "model", data, out, f"--parallelism.data_parallel_replicate_degree={rep}",
                          f"--parallelism.data_parallel_shard_degree={shard}", *extra, dp=n))
    # only rank 0 prints the metrics lines
    assert len([l for l in p.stdout.splitlines() if l.startswith("step: 1 ")]) == 1, p.stdout
    assert "comm:" in p.stdout
    assert_same_run(out, single[False], name)
    assert_same_norms(out, single[False], name)


def test_fsdp_tied_embeddings(setup, single):
    d, data = setup
    out = d / "fsdp4_tied"
    run(4, train_args(d / "model_tied", data, out, "--activation_checkpoint.mode=selective",
                      "--activation_checkpoint.selective_ac_option=op", dp=4))
    assert_same_run(out, single[True], "fsdp4 tied")
    assert_same_norms(out, single[True], "fsdp4 tied")


def test_frozen_tensors_under_fsdp_and_dp(setup, tmp_path):
    """training.freeze (the embedding and layer 0) under FSDP 2 and DP 2: AdamW and clipping's
    norm then run over the trainable runs only (each rank's held part of them under FSDP), the
    DP all-reduce over those runs only. max_norm 0.2, under every step's norm, so clipping
    acts and a norm summed over too few ranks changes the weights as well as the logged norm."""
    d, data = setup
    extra = ["--training.freeze=model.embed_tokens.weight,model.layers.0.*", "--training.max_norm=0.2"]
    ref = tmp_path / "one"
    run(1, train_args(d / "model", data, ref, *extra))
    assert min(grad_norms(ref).values()) > 0.2, grad_norms(ref)
    for name, rep, shard in (("fsdp2", 1, 2), ("dp2", 2, 1)):
        out = tmp_path / name
        run(2, train_args(d / "model", data, out, f"--parallelism.data_parallel_replicate_degree={rep}",
                          f"--parallelism.data_parallel_shard_degree={shard}", *extra, dp=2))
        assert_same_run(out, ref, f"frozen, {name}")
        assert_same_norms(out, ref, f"frozen, {name}")


@pytest.mark.parametrize("rep,shard", [(2, 1), (1, 2), (2, 2)])
def test_gradient_reduction_overlaps_backward(setup, tmp_path, rep, shard):
    """A layer's gradient reduction starts in its post-backward hook, while the layers below
    still run their backward (docs/distributed.md, overlap). With 3 layers, layers 2 and 1
    start theirs before the backward ends: FSDP reduce-scatters every micro-batch (2 per rank
    per step with 2 ranks), DP all-reduces once per step in the last micro-batch. HSDP adds
    the replicas' all-reduce of a layer's shard, started once its reduce-scatter has landed
    (at the next layer's post-backward): layer 2's during layer 0's backward. A reduction
    left to after the backward counts 0."""
    d, data = setup
    n = rep * shard
    out = tmp_path / f"overlap_{rep}x{shard}"
    run(n, train_args(d / "model", data, out, "--training.steps=2",
                      f"--parallelism.data_parallel_replicate_degree={rep}",
                      f"--parallelism.data_parallel_shard_degree={shard}", dp=n))
    rows = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    micro = GLOBAL // (MICRO * n)
    want = (3 - 1) * (micro if shard > 1 else 1) + (3 - 2 if rep > 1 and shard > 1 else 0)
    for r in rows:
        assert r["reductions_overlapped"] == want, f"step {r['step']}: {r['reductions_overlapped']} layer reductions " \
            f"started during the backward, want {want}"


@pytest.mark.parametrize("rep,shard", [(2, 1), (1, 2)])
def test_moe_layouts_match_one_rank(setup, single, rep, shard):
    d, data = setup
    out = d / f"moe_{rep}x{shard}"
    run(2, train_args(d / "model_moe", data, out, f"--parallelism.data_parallel_replicate_degree={rep}",
                      f"--parallelism.data_parallel_shard_degree={shard}", dp=2))
    assert any(".mlp.experts." in k for k in weights(out)), "the MoE model has no expert tensors"
    assert_same_run(out, single["moe"], f"MoE {rep}x{shard}")
    assert_same_norms(out, single["moe"], f"MoE {rep}x{shard}")


def test_checkpoint_moves_between_layouts(setup, single):
    """Written by 2-rank FSDP, resumed on 1 rank (and 1 -> 2-rank FSDP): the steps after
    the checkpoint equal the uninterrupted one-process run's, as do the final weights
    and AdamW moments."""
    d, data = setup
    stop = ["--training.stop_at_step=4", "--checkpoint.last_save_model_only=false"]
    for first, then in ((2, 1), (1, 2)):
        out = d / f"move_{first}_to_{then}"
        p = run(first, train_args(d / "model", data, out, *stop, dp=first), check=False)
        assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
        assert (out / "checkpoint" / "step-4" / "optim.safetensors").exists()
        run(then, train_args(d / "model", data, out, "--checkpoint.last_save_model_only=false", dp=then))
        assert_same_run(out, single[False], f"{first} -> {then} ranks", steps=range(5, STEPS + 1))
    # optimizer state too: compare with a one-process run that saved its moments
    ref = d / "single_full"
    run(1, train_args(d / "model", data, ref, "--checkpoint.last_save_model_only=false"))
    for first, then in ((2, 1), (1, 2)):
        a, b = weights(d / f"move_{first}_to_{then}", file="optim.safetensors"), weights(ref, file="optim.safetensors")
        for k in b:
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)
            assert err <= 1e-4, f"{first} -> {then}: {k} differs by {err:.3g}"


def test_resume_under_more_ranks_says_where_the_global_batch_came_from(setup, tmp_path):
    """A one-process run that set no global batch (local_batch_size 2: 2 sequences a step),
    resumed by the same command under mpirun -np 2: local_batch_size is per rank, so the
    step is 4 sequences and the data order would change. Still refused (exit 2), and the
    message says where 4 comes from and which setting keeps 2; with it the run resumes."""
    d, data = setup
    out = tmp_path / "run"
    args = [a for a in train_args(d / "model", data, out, "--training.stop_at_step=2",
                                  "--checkpoint.last_save_model_only=false")
            if not a.startswith(("--training.global_batch_size=", "--training.local_batch_size=",
                                 "--validation."))] + ["--training.local_batch_size=2"]
    p = run(1, args, check=False)
    assert p.returncode == 75, p.stderr[-3000:]
    p = run(2, args, check=False)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if l.startswith("ctitan: error:")]
    assert len(err) == 1, p.stderr[-3000:]
    for words in ("training.global_batch_size is 4 (not set: training.local_batch_size 2 x 2 data-parallel ranks)",
                  "the checkpoint was written with 2", "to keep 2, set --training.local_batch_size=1"):
        assert words in err[0], err[0]
    p = run(2, args + ["--training.local_batch_size=1"])
    assert re.search(r"resuming from \S*/step-2 \(step 2\)", p.stderr), p.stderr[-3000:]


def test_fsdp_memory_per_rank_shrinks(tmp_path):
    """The point of FSDP: with the model state dominant (27 M parameters, 16 bytes each:
    0.41 GiB), 4 ranks need well under half the memory of one process each."""
    cfg = oracle.tiny_config(vocab=2048, hidden=512, inter=1536, layers=8, heads=8, kv_heads=4, head_dim=64)
    cfg.save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(4000, 2048, seed=1))
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'model'}",
            f"--training.dataset_path={data}", "--training.seq_len=16", "--training.local_batch_size=1",
            "--training.steps=1", "--metrics.peak_tflops=1"]
    peak = {}
    for n in (1, 4):
        run(n, args + [f"--job.dump_folder={tmp_path / str(n)}"])
        peak[n] = oracle.read_metrics(tmp_path / str(n) / "metrics.jsonl")[0]["memory_gib"]  # largest rank's
    assert peak[4] < 0.55 * peak[1], f"FSDP over 4 ranks: {peak[4]:.3f} GiB per rank vs {peak[1]:.3f} GiB alone"


@pytest.mark.parametrize("source", ["seed", "hf"])
def test_no_rank_builds_the_whole_model(tmp_path, source):
    """Loading hands over the whole model's tensors one at a time and each rank keeps its
    slice, so no rank ever holds the whole model (which every rank used to build first:
    4 bytes x 27 M parameters = 0.102 GiB). Under FSDP 4 and TP 2 x FSDP 2 a rank keeps
    1 byte per parameter after loading (its fp32 quarter); the bound is the whole model's
    fp32 size, which the old start-up alone exceeded. From HF files the mapped pages of
    each tensor are dropped after it is taken (st_drop). The loaded weights are checked by
    the layout tests (the same losses as one process)."""
    cfg = oracle.tiny_config(vocab=2048, hidden=512, inter=1536, layers=8, heads=8, kv_heads=4, head_dim=64)
    model = oracle.build_model(cfg, seed=3)
    whole = 4 * sum(p.numel() for p in model.parameters())  # fp32 bytes of the whole model
    if source == "hf":
        model.save_pretrained(tmp_path / "model")
    else:
        cfg.save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(4000, 2048, seed=1))
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'model'}",
            f"--training.dataset_path={data}", "--training.seq_len=16", "--training.local_batch_size=1",
            "--training.steps=1", "--metrics.peak_tflops=1"]
    if source == "hf":
        args += [f"--checkpoint.initial_load_path={tmp_path / 'model'}", "--checkpoint.initial_load_in_hf"]
    env = dict(ENV, CTITAN_LOG_RANKS="all")
    for name, layout in (("fsdp4", []), ("tp2_fsdp2", ["--parallelism.tensor_parallel_degree=2"])):
        cmd = mpirun() + ["-np", "4", str(BIN)] + args + [f"--job.dump_folder={tmp_path / name}", *layout]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        after = [float(x) * 2**30 for x in
                 re.findall(r"rank \d of 4: ([0-9.]+) GiB peak after loading the model", p.stderr)]
        assert len(after) == 4, p.stderr[-3000:]
        assert max(after) < whole, f"{name} from {source}: a rank peaked at {max(after) / 2**30:.3f} GiB while " \
            f"loading; the whole model is {whole / 2**30:.3f} GiB"


def test_tensors_loaded_in_row_blocks(tmp_path):
    """The loaders hand a tensor over in blocks of rows (4 M floats, model/lm.h LM_BLOCK_ELEMS);
    each block goes to its place in every rank's FSDP shard or TP slice. Here the embedding and
    lm_head (6144 x 1024) are two blocks each (rows 0-4095 and 4096-6143, a third of the tokens
    of the data), drawn from training.seed (the same draws on any layout) under FSDP 2 and
    TP 2 (replicated embedding, vocabulary-parallel lm_head), and, with the embedding frozen
    in bf16, into FSDP's bf16 shard: 2 steps' losses and gradient norms equal one process's."""
    cfg = oracle.tiny_config(vocab=6144, hidden=1024, inter=16, layers=1, heads=2, kv_heads=2, head_dim=8)
    cfg.save_pretrained(tmp_path / "model")
    assert cfg.vocab_size * cfg.hidden_size > 4 << 20
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(2000, 6144, seed=2))
    base = ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'model'}",
            f"--training.dataset_path={data}", "--training.seq_len=16", "--training.local_batch_size=2",
            "--training.global_batch_size=4", "--training.steps=2", "--training.seed=5", "--metrics.log_freq=1",
            "--metrics.peak_tflops=1"]
    frozen = ["--training.freeze=model.embed_tokens.weight", "--training.frozen_dtype=bfloat16"]
    cases = {"one": (1, []), "fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"]),
             "tp2": (2, ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]),
             "one_frozen": (1, frozen), "fsdp2_frozen": (2, ["--parallelism.data_parallel_shard_degree=2", *frozen])}
    rows = {}
    for name, (n, extra) in cases.items():
        run(n, base + [f"--job.dump_folder={tmp_path / name}", *extra])
        rows[name] = {r["step"]: r for r in oracle.read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r}
    for name, ref in (("fsdp2", "one"), ("tp2", "one"), ("fsdp2_frozen", "one_frozen")):
        assert set(rows[name]) == set(rows[ref]) == {1, 2}, f"{name}: steps {sorted(rows[name])}"
        for s in (1, 2):
            for k in ("loss", "grad_norm"):
                got, want = rows[name][s][k], rows[ref][s][k]
                assert abs(got - want) <= 1e-5 * abs(want), f"{name}: step {s} {k} {got!r} vs one process {want!r}"


def rank_pids(mpirun_pid):
    """{rank: pid} of mpirun's children, from their environment."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != mpirun_pid:
                continue
            env = (p / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for kv in env:
            if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(kv.split(b"=", 1)[1])] = int(p.name)
    return out


def test_killed_rank_ends_the_job(setup, tmp_path):
    d, data = setup
    args = train_args(d / "model", data, tmp_path / "kill", "--training.steps=100000", "--training.global_batch_size=6")
    cmd = mpirun() + ["-np", "3", str(BIN)] + [str(a) for a in args]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in p.stdout:  # wait until training runs
            seen.append(line)
            if line.startswith("step: 3 "):
                break
        assert p.poll() is None, "".join(seen)[-2000:]
        pids = rank_pids(p.pid)
        assert 1 in pids, f"no rank 1 among mpirun's children: {pids}"
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        rest = p.stdout.read()
        rc = p.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert rc != 0
    assert took < 5, f"the job took {took:.1f} s to end after rank 1 was killed"
    assert "rank 1" in rest and "signal 9" in rest, rest[-2000:]


def test_error_on_one_rank_ends_the_job(setup, tmp_path):
    """Rank 0 alone fails (its checkpoint folder is a dangling symlink; only rank 0 writes)
    while rank 1 goes on into the next step's collectives: the job must end, with rank 0's
    error, instead of rank 1 waiting forever."""
    d, data = setup
    out = tmp_path / "err"
    out.mkdir()
    (out / "checkpoint").symlink_to(tmp_path / "missing" / "dir")
    t0 = time.monotonic()
    p = run(2, train_args(d / "model", data, out, "--training.steps=100000", "--checkpoint.interval=2"),
            check=False, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr[-2000:]
    assert "ctitan: error: [rank 0]" in p.stderr and "checkpoint" in p.stderr, p.stderr[-2000:]
    assert "ending the job" in p.stderr
    assert took < 30, f"{took:.1f} s"


def test_config_error_on_one_rank_alone_is_reported(setup, tmp_path):
    """Checkpoint folders on each machine's own disk, where rank 1's step-2 was written by
    another run (training.seed 6, this run's is 5): both ranks pick step-2, and rank 1 alone
    fails the resume's config check. Rank 0 used to say only that another rank had failed
    ("its error says why"), and rank 1's error, a config error, was never printed: config
    errors were printed by rank 0 alone. Now rank 0 says which rank failed and why, once.
    mpirun's MPMD form gives rank 1 its own checkpoint.folder, as its machine's disk would."""
    d, data = setup
    base = [a for a in train_args(d / "model", data, tmp_path / "a", "--checkpoint.last_save_model_only=false")
            if not a.startswith(("--job.dump_folder=", "--training.seed="))]
    for name, seed in (("a", 5), ("b", 6)):
        p = run(1, base + [f"--job.dump_folder={tmp_path / name}", f"--training.seed={seed}",
                           "--training.stop_at_step=2"], check=False)
        assert p.returncode == 75, p.stderr[-3000:]
    args = [str(a) for a in base + [f"--job.dump_folder={tmp_path / 'a'}", "--training.seed=5"]]
    other = tmp_path / "b" / "checkpoint"
    cmd = mpirun() + ["-np", "1", str(BIN), *args, ":", "-np", "1", str(BIN), *args, f"--checkpoint.folder={other}"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once:\n{p.stderr[-3000:]}"
    for words in ("rank 1", str(other / "step-2"), "training.seed is 5 but the checkpoint was written with 6"):
        assert words in err[0], f"{words!r} not in: {err[0]}"
    assert not (tmp_path / "a" / "checkpoint" / "step-3").exists()


def test_model_only_step_on_one_rank_alone_is_reported(setup, tmp_path):
    """Rank 0's step-2 is a full checkpoint, rank 1's (its machine's own folder) a finished
    run's model-only save: the picks agreed (same step), rank 1 alone refused to resume from
    a model-only save, with a config error no rank printed, and rank 0 waited for it in a
    collective: the job hung. Now the picks differ (model-only is part of the pick) and
    every rank says the ranks do not see the same checkpoints."""
    d, data = setup
    base = [a for a in train_args(d / "model", data, tmp_path / "a") if not a.startswith("--job.dump_folder=")]
    p = run(1, base + [f"--job.dump_folder={tmp_path / 'a'}", "--training.stop_at_step=2",
                       "--checkpoint.last_save_model_only=false"], check=False)
    assert p.returncode == 75, p.stderr[-3000:]
    p = run(1, [a for a in base if not a.startswith("--training.steps=")]
            + ["--training.steps=2", f"--job.dump_folder={tmp_path / 'b'}", "--checkpoint.last_save_model_only=true",
               "--checkpoint.last_save_in_hf=false"])
    other = tmp_path / "b" / "checkpoint"
    assert (other / "step-2" / "model.safetensors").exists() and not (other / "step-2" / "optim.safetensors").exists()
    args = [str(a) for a in base + [f"--job.dump_folder={tmp_path / 'a'}", "--checkpoint.load_step=2"]]
    cmd = mpirun() + ["-np", "1", str(BIN), *args, ":", "-np", "1", str(BIN), *args, f"--checkpoint.folder={other}"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    assert "the ranks do not see the same checkpoints" in p.stderr and "(model-only)" in p.stderr, p.stderr[-3000:]


def test_data_error_on_one_rank_alone_is_reported(setup, tokdir, tmp_path):  # noqa: F811
    """One machine's copy of the model folder holds another model's tokenizer (700 ids for
    this model's 251), and its data is text: rank 1 alone fails to open its data, with a
    config error. That error was printed by no rank (rank 0 prints config errors, and rank 0
    had none), and the job hung: rank 0 waited in the first step's collectives while rank 1
    ended (this test ran into its timeout). Now rank 0 says which rank failed and why, once,
    and every rank exits 2.
    mpirun's MPMD form gives rank 1 its own paths, as its machine's disk would."""
    d, data = setup
    other = tmp_path / "model_b"
    shutil.copytree(d / "model", other)
    shutil.copy(tokdir / "tokenizer.json", other / "tokenizer.json")
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "the quick brown fox"}) + "\n")
    args = [str(a) for a in train_args(d / "model", data, tmp_path / "out")]
    cmd = mpirun() + ["-np", "1", str(BIN), *args, ":", "-np", "1", str(BIN), *args,
                      f"--model.hf_assets_path={other}", f"--training.dataset_path={tmp_path / 'text.jsonl'}"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once:\n{p.stderr[-3000:]}"
    for words in ("rank 1 of 2 failed to open its data", "the tokenizer has", "vocabulary is 251"):
        assert words in err[0], f"{words!r} not in: {err[0]}"


def mpmd(args, rank1, env1=()):
    """mpirun's MPMD form: rank 1 runs the same command with `rank1` appended and, before it,
    the environment `env1` (through env(1)): what another machine's disk or CPU gives it."""
    args = [str(a) for a in args]
    return mpirun() + ["-np", "1", str(BIN), *args, ":", "-np", "1", *(["env", *env1] if env1 else []), str(BIN),
                       *args, *[str(a) for a in rank1]]


def run_once_reported(cmd, code, words, timeout=120):
    """The job ends with `code` and one error line, holding every one of `words`."""
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == code, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once:\n{p.stderr[-3000:]}"
    for w in words:
        assert w in err[0], f"{w!r} not in: {err[0]}"
    return p


def test_kernel_one_machine_cannot_run_is_reported(setup, tmp_path):
    """kernels.matmul = avx512 where rank 1's machine has AVX2 only (CTITAN_ISA=avx2 there):
    rank 1 alone met the config error, in cli_train's kernel check, and ended without a
    word (config errors are rank 0's to print); rank 0 went on into the trainer's first
    collectives and waited there for ever."""
    d, data = setup
    args = train_args(d / "model", data, tmp_path / "out", "--kernels.matmul=avx512", "--training.steps=2")
    run_once_reported(mpmd(args, [], ["CTITAN_ISA=avx2"]), 2,
                      ("rank 1 of 2 failed to", "matmul=avx512 needs CPU features"))


def test_config_file_one_machine_reads_differently_is_reported(setup, tmp_path):
    """The --config file lies on each machine's disk, and rank 1's copy is broken TOML: rank 1
    alone met the config error while parsing it, and ended without a word; rank 0 waited in
    the trainer's first collectives for ever."""
    d, data = setup
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    (good / "run.toml").write_text('[training]\nsteps = 2\n')
    (bad / "run.toml").write_text('[training]\nsteps = = 2\n')
    args = ["train", f"--config={good / 'run.toml'}"] + train_args(d / "model", data, tmp_path / "out")[1:]
    args = [a for a in args if not str(a).startswith("--training.steps=")]
    cmd = mpmd(args, [])
    i = len(cmd) - 1 - cmd[::-1].index(f"--config={good / 'run.toml'}")
    cmd[i] = f"--config={bad / 'run.toml'}"
    run_once_reported(cmd, 2, ("rank 1 of 2 failed to", str(bad / "run.toml")))


def test_model_config_one_machine_reads_differently_is_reported(setup, tmp_path):
    """Rank 1's machine holds a broken copy of the model's config.json (num_attention_heads
    not a multiple of num_key_value_heads): rank 1 alone failed to read the model's config
    and ended without a word; rank 0 waited in plan_init's collectives for ever."""
    d, data = setup
    other = tmp_path / "model_b"
    shutil.copytree(d / "model", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (other / "config.json").write_text(json.dumps(cfg))
    args = train_args(d / "model", data, tmp_path / "out", "--training.steps=2")
    run_once_reported(mpmd(args, [f"--model.hf_assets_path={other}"]), 2,
                      ("rank 1 of 2 failed to", "not a multiple of num_key_value_heads"))


def test_another_valid_model_on_one_machine_is_refused(setup, tmp_path):
    """Rank 1's machine holds another model's valid config.json (another rope_theta, which
    changes no shape): every rank built its own model and the run trained on, each rank with
    other maths, and exited 0. Now the ranks compare the model they built and refuse, every
    rank with exit 2, the error printed once."""
    d, data = setup
    other = tmp_path / "model_b"
    shutil.copytree(d / "model", other)
    cfg = json.loads((other / "config.json").read_text())
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    assert theta, cfg
    if "rope_parameters" in cfg:
        cfg["rope_parameters"]["rope_theta"] = theta * 2
    if "rope_theta" in cfg:
        cfg["rope_theta"] = theta * 2
    (other / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(other).to_dict() != AutoConfig.from_pretrained(d / "model").to_dict()
    args = train_args(d / "model", data, tmp_path / "out", "--training.steps=2")
    run_once_reported(mpmd(args, [f"--model.hf_assets_path={other}"]), 2,
                      ("the ranks built different models", "every machine must hold the same model files"))


def test_diverged_run_ends_every_rank_without_abort(setup, tmp_path):
    """A loss that is not finite (lr 1e30) is met by every rank at the same step (the loss is
    reduced over the ranks). Each rank used to take it for its own failure and call MPI_Abort,
    all at once, which crashed mpirun itself in a CI run (trainer_ckpt.c, agree_on_pick); now
    the ranks learn of it together, in the step's stop all-reduce, and each ends on its own."""
    d, data = setup
    p = run(2, train_args(d / "model", data, tmp_path / "out", "--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0",
                          "--training.steps=20"), check=False, timeout=60)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "ctitan: error: [rank 0] training diverged: loss is nan at step" in p.stderr, p.stderr[-3000:]
    assert "ending the job" not in p.stderr and "MPI_ABORT was invoked" not in p.stderr, p.stderr[-3000:]


def test_sigusr1_to_mpirun_stops_every_rank_with_a_checkpoint(setup, tmp_path):
    """mpirun forwards SIGUSR1 (its own SIGTERM kills the ranks at once): every rank stops
    after the same step, rank 0 saves, the job exits 75, and the same command resumes from
    that checkpoint. (That a resumed run equals an uninterrupted one is
    test_checkpoint_moves_between_layouts'.)"""
    d, data = setup
    out = tmp_path / "usr1"
    args = train_args(d / "model", data, out, "--training.steps=100000", "--parallelism.data_parallel_shard_degree=2",
                      dp=2)
    cmd = mpirun() + ["-np", "2", str(BIN)] + [str(a) for a in args]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in p.stdout:
            if line.startswith("step: 2 "):
                break
        p.send_signal(signal.SIGUSR1)
        rest = p.stdout.read()
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 75, rest[-2000:]
    saved = sorted((out / "checkpoint").glob("step-*"))
    assert len(saved) == 1, saved
    k = int(saved[0].name.split("-")[1])
    r = run(2, args + [f"--training.stop_at_step={k + 1}"], check=False)
    assert r.returncode == 75, r.stderr[-2000:]
    assert f"resuming from {saved[0]} (step {k})" in r.stderr, r.stderr[-2000:]
    assert (out / "checkpoint" / f"step-{k + 1}").is_dir()


@pytest.mark.parametrize("ranks,key,args,words", [
    (2, "data_parallel_shard_degree", ["--parallelism.data_parallel_shard_degree=3"], "world size is 2"),
    (2, "data_parallel_replicate_degree", ["--parallelism.data_parallel_replicate_degree=4"], "world size 2"),
    (2, "tensor_parallel_degree", ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"],
     "intermediate size"),
    (1, "tensor_parallel_degree", ["--parallelism.tensor_parallel_degree=3"], "heads"),
    (1, "expert_parallel_degree", ["--parallelism.expert_parallel_degree=2"], "no experts"),
    (1, "data_parallel_replicate_degree", ["--parallelism.data_parallel_replicate_degree=2"], "world size 1"),
    (2, "global_batch_size", ["--training.global_batch_size=6"], "data-parallel degree"),
])
def test_bad_degrees_exit_2(setup, tmp_path, ranks, key, args, words):
    d, data = setup
    p = run(ranks, train_args(d / "model", data, tmp_path / "bad", *args), check=False, timeout=60)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-2000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once (rank 0):\n{p.stderr[-2000:]}"
    assert key in err[0] and words in err[0], err[0]


def test_comm_backend_under_mpirun():
    exe = BUILD / "tests" / "test_comm"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run `make test-c` first", pytrace=False)
    for n in (2, 3):
        p = subprocess.run(mpirun() + ["-np", str(n), str(exe)], env=ENV, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"backend mpi, {n} rank(s)" in p.stdout and " 0 failed" in p.stdout, p.stdout


def test_run_train_script(setup, tmp_path):
    d, data = setup
    env = dict(ENV, NPROC="2", CONFIG_FILE=str(ROOT / "configs" / "debug.toml"), CTITAN=str(BIN))
    args = train_args(d / "model", data, tmp_path / "script")[1:] + ["--training.steps=2"]
    p = subprocess.run([str(ROOT / "scripts" / "run_train.sh"), *args], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "world 2 = data_parallel_replicate 1 x data_parallel_shard 2" in p.stderr
    assert [l for l in p.stdout.splitlines() if l.startswith("step: 2 ")] != [], p.stdout
    assert len([l for l in p.stdout.splitlines() if l.startswith("step: ")]) == 2, p.stdout  # rank 0 only


def test_fsdp_untied_embedding_released_after_the_lookup(tmp_path):
    """FSDP gathers the untied embedding for the lookup and gives its pages back at layer 0's
    forward, so the head (final norm, lm_head), gathered after the last layer, is the most a
    rank holds whole at once (fsdp.h). Kept gathered through the layers (the fourth mutation
    audit's mutant) trained the same numbers and held one embedding more at the head: here
    16384 x 512 floats, 32 MiB. Each rank's measured `peak memory` over a tiny model's (the
    runtime: MPI, libraries) against what transformers' tensor sizes give for FSDP 2: every
    piece's slice of the parameters, gradients and AdamW moments (16 bytes a float), the
    head's parameters and gradients whole, and the dry run's activations; at least the
    first two, and no more than all three + 12 MiB (test_dry_run.py's 8 MiB for MPI's and
    the allocator's buffers, and 4 for the runtime's peak, which moves by 2 MiB from run to
    run): the mutant's 32 MiB exceed it by 20."""
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch
    from test_dry_run import field, fsdp_stored, launch, layout_args, ok
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(64 * 33, 254, seed=3))
    shapes = {"tiny": dict(vocab=254, hidden=31, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8),
              "big": dict(vocab=16384, hidden=512, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16)}
    state, act, peak = {}, {}, {}
    for size, kw in shapes.items():
        model = tmp_path / f"model_{size}"
        oracle.tiny_config(**kw).save_pretrained(model)
        with torch.device("meta"):
            sizes = {k: p.numel() for k, p in
                     AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).named_parameters()}
        head = sum(n for k, n in sizes.items() if not k.startswith(("model.layers.", "model.embed_tokens.")))
        assert head == kw["vocab"] * kw["hidden"] + kw["hidden"], sizes  # lm_head and the final norm
        state[size] = 16 * fsdp_stored(model, 2, 1) + 8 * head
        args = layout_args(model, data, tmp_path / size, (1, 2, 1, 1))
        act[size] = field(ok(launch(0, args + ["--dry-run"])).stdout.split("per rank: ")[1],
                          "activations + workspace (planned)")
        err = ok(launch(2, args, env=dict(ENV, CTITAN_LOG_RANKS="all"))).stderr
        got = {int(r): float(g) * 2**30 for r, g in re.findall(r"rank (\d) of 2: peak memory ([0-9.]+) GiB", err)}
        assert sorted(got) == [0, 1], err[-3000:]
        peak[size] = got
    low = state["big"] - state["tiny"]
    high = low + act["big"] - act["tiny"] + 12 * 2**20
    for r in (0, 1):
        grew = peak["big"][r] - peak["tiny"][r]
        print(f"rank {r}: {grew / 2**20:.1f} MiB over the runtime; tensors {low / 2**20:.1f} MiB, "
              f"allowed {high / 2**20:.1f} MiB")
        assert low <= grew <= high, (r, grew / 2**20, low / 2**20, high / 2**20)
