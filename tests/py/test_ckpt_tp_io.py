"""Checkpoint I/O under tensor and expert parallelism (docs/checkpoints.md, "Under mpirun").

A TP rank holds a block of rows of a column-parallel weight (q/k/v, gate/up, the
vocabulary-parallel embedding and head) and a block of COLUMNS of a row-parallel one
(o_proj, down_proj): in the file each row of the latter holds every rank's piece, so
its slice is strided. Loading, a rank preads only its pieces; saving, every rank
pwrites its pieces into the files rank 0 laid out (a tensor replicated over the TP or
EP group by one owner), instead of gathering each unit to rank 0.

Checked against what the files hold, read with the safetensors package: each rank's
logged tensor bytes read equal its share computed here from the header's shapes and
torchtitan's Qwen3 TP plan (ColwiseParallel: rows / t; RowwiseParallel: columns / t;
the rest replicated; an expert's tensors on its EP rank only); the files every rank
wrote are byte for byte the ones rank 0 gathered (CTITAN_CKPT_GATHER=1); the ranks
together wrote every tensor byte exactly once; and resumed runs train as the
uninterrupted one-process run does."""
import re
import shutil
import subprocess

import pytest

import oracle
import oracle_moe
from conftest import BIN, crashed
from test_ckpt_parallel_io import ENV, READ, WROTE, file_bytes, losses, run, run_saving
from test_dist import mpirun

STEPS, STOP = 4, 2
TP = "--parallelism.tensor_parallel_degree"
FSDP = "--parallelism.data_parallel_shard_degree"
REP = "--parallelism.data_parallel_replicate_degree"
EP = "--parallelism.expert_parallel_degree"
PP = ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=2"]
ROWWISE = ("o_proj", "down_proj")  # torchtitan's RowwiseParallel: the input dimension (columns) is split
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpttp")
    # 4 kv heads and an intermediate of 72 so TP 4 divides them; hidden 48 rows no shard count divides evenly
    oracle.tiny_config(vocab=256, hidden=48, inter=72, layers=4, heads=4, kv_heads=4, head_dim=12,
                       tied=False).save_pretrained(d / "model")
    # tied, with a vocabulary TP 4 does not divide: the embedding is then replicated (one owner writes it)
    oracle.tiny_config(vocab=250, hidden=48, inter=72, layers=4, heads=4, kv_heads=4, head_dim=12,
                       tied=True).save_pretrained(d / "tied")
    oracle_moe.tiny_moe_config(vocab=256, hidden=32, inter=40, layers=2, heads=4, kv_heads=2, head_dim=16,
                               experts=4, top_k=2, moe_inter=24).save_pretrained(d / "moe")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(400 * 17, 250, seed=3))
    return d, data


def args(d, model, data, out, *extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={d / model}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.global_batch_size=8",
            f"--training.steps={STEPS}", "--training.seed=5", "--optimizer.lr=3e-3", "--metrics.log_freq=1",
            f"--job.dump_folder={out}", "--checkpoint.enable", "--checkpoint.interval=1000",
            "--checkpoint.last_save_model_only=false", *extra]


def header(step_dir):
    """[(name, shape, bytes)] of every tensor of the checkpoint's files."""
    from safetensors import safe_open
    out = []
    for f in ("model.safetensors", "optim.safetensors"):
        with safe_open(str(step_dir / f), framework="numpy") as h:
            for k in h.keys():
                shape = h.get_slice(k).get_shape()
                n = 4
                for s in shape:
                    n *= s
                out.append((k, shape, n))
    return out


def expert_of(name):
    m = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    return int(m[1]) if m else None


def share(name, shape, nbytes, t, tp_rank, ep, ep_rank, n_experts):
    """Bytes of tensor `name` a rank of TP index tp_rank and EP index ep_rank holds (the plan)."""
    e = expert_of(name)
    if e is not None and ep > 1 and e // (n_experts // ep) != ep_rank:
        return 0
    base = name.split(".exp_avg")[0]
    if t > 1 and any(f".{k}." in base or base.startswith(f"{k}.") or f"{k}.weight" in base for k in COLWISE):
        if "embed_tokens" in base or "lm_head" in base:  # DTensor Shard(0)'s ceil chunks of the rows
            c = -(-shape[0] // t)
            return nbytes * max(0, min(c, shape[0] - tp_rank * c)) // shape[0]
        return nbytes // t
    if t > 1 and any(f".{k}." in base for k in ROWWISE):
        return nbytes // t
    return nbytes


@pytest.fixture(scope="module")
def reference(setup):
    """Uninterrupted one-process runs, and ones stopped at step 2 (their checkpoints), per model."""
    d, data = setup
    got = {}
    for model in ("model", "moe"):
        ref, stopped = d / f"ref_{model}", d / f"stopped_{model}"
        run([BIN, *args(d, model, data, ref)])
        run([BIN, *args(d, model, data, stopped, f"--training.stop_at_step={STOP}")], code=75)
        got[model] = (losses(ref), stopped)
    return got


def assert_same_losses(out, ref, what):
    got = losses(out)
    for s in range(STOP + 1, STEPS + 1):
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), f"{what}: step {s} loss {got[s]!r} vs {ref[s]!r}"


# name: (model, ranks, layout, t, ep, FSDP shards)
LOADS = {
    "tp2": ("model", 2, [f"{TP}=2"], 2, 1, 1),
    "tp2_fsdp2": ("model", 4, [f"{TP}=2", f"{FSDP}=2"], 2, 1, 2),
    "ep2": ("moe", 2, [f"{EP}=2", f"{REP}=2", f"{FSDP}=1"], 1, 2, 1),
    "fsdp2_ep2": ("moe", 2, [f"{EP}=2", f"{FSDP}=2"], 1, 2, 2),
    "tp2_ep2": ("moe", 4, [f"{TP}=2", f"{EP}=2", f"{REP}=2", f"{FSDP}=1"], 2, 2, 1),
}


def mesh_of(rank, t, shards, ep):
    """(tp index, ep index) of a rank: tp fastest, then the data-parallel rank (mesh.h)."""
    dp = rank // t
    return rank % t, dp % ep


@pytest.mark.parametrize("name", list(LOADS))
def test_each_rank_reads_its_slice_of_each_tensor(setup, reference, tmp_path, name):
    """Without FSDP a rank's logged tensor bytes are exactly its TP/EP share of the header's
    tensors (a row-parallel weight: rows x columns / t, not its whole rows); under FSDP its
    share over the shards, plus at most two local rows per tensor where a shard cuts a row,
    and the shard group together reads at least its share. The resumed steps equal the
    uninterrupted one-process run's. Before: a TP rank read whole rows of o_proj and
    down_proj (tp2 read 20% more than its share here)."""
    model, n, layout, t, ep, shards = LOADS[name]
    ref, stopped = reference[model]
    d, data = setup
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    p = run(mpirun() + ["-np", str(n), str(BIN), *args(d, model, data, out, *layout)])
    reads = {int(m[1]): int(m[3]) for m in READ.finditer(p.stderr) if int(m[2]) == n}
    assert sorted(reads) == list(range(n)), f"every rank logs what it read:\n{p.stderr[-4000:]}"
    h = header(out / "checkpoint" / f"step-{STOP}")
    n_experts = 4
    for r, got in reads.items():
        tr, er = mesh_of(r, t, shards, ep)
        # FSDP shards an expert's tensors over the ranks holding that expert (shards / ep of them)
        spread = [shards if expert_of(k) is None else max(shards // ep, 1) for k, _, _ in h]
        want = sum(share(k, s, b, t, tr, ep, er, n_experts) / g for (k, s, b), g in zip(h, spread))
        if shards == 1:
            assert got == want, f"{name}: rank {r} read {got} tensor bytes, its share is {want}"
            continue
        # a shard's two ends may cut a row: that row's local piece is read whole
        slack = sum(2 * share(k, s, 4 * (s[1] if len(s) > 1 else 1), t, tr, ep, er, n_experts) for k, s, _ in h)
        assert got <= want + slack, f"{name}: rank {r} read {got}, its share {want} + {slack}"
    if shards > 1:
        for tr in range(t):
            group = [r for r in reads if mesh_of(r, t, shards, ep)[0] == tr]
            whole = sum(share(k, s, b, t, tr, 1, 0, n_experts) for k, s, b in h)
            assert sum(reads[r] for r in group) >= whole, f"{name}: TP index {tr}'s ranks {group} read too little"
    assert_same_losses(out, ref, name)


# name: (model, ranks, layout and options, t, ep, FSDP shards: per-rank bytes checked exactly without FSDP)
SAVES = {
    "tp2": ("model", 2, [f"{TP}=2"], 2, 1, 1),
    "tp4": ("model", 4, [f"{TP}=4"], 4, 1, 1),
    "tp2_fsdp2": ("model", 4, [f"{TP}=2", f"{FSDP}=2"], 2, 1, 2),
    "tp2_pp2": ("model", 4, [f"{TP}=2", *PP], 2, 1, 0),
    "tied_tp2": ("tied", 2, [f"{TP}=2"], 2, 1, 1),
    "tied_tp4_uneven_vocab": ("tied", 4, [f"{TP}=4"], 4, 1, 1),
    "ep2": ("moe", 2, [f"{EP}=2", f"{REP}=2", f"{FSDP}=1"], 1, 2, 1),
    "fsdp2_ep2": ("moe", 2, [f"{EP}=2", f"{FSDP}=2"], 1, 2, 2),
    "tp2_fsdp2_ep2": ("moe", 4, [f"{TP}=2", f"{EP}=2", f"{FSDP}=2"], 2, 2, 2),
    # the experts' fused adapters: cut with their experts (several column runs per row under TP x EP)
    "moe_lora_tp2_ep2": ("moe", 4, [f"{TP}=2", f"{EP}=2", f"{REP}=2", f"{FSDP}=1", "--lora.rank=4",
                                    "--lora.target_parameters=mlp.experts.gate_up_proj,mlp.experts.down_proj"],
                         2, 2, 0),
    "lora_tp2": ("model", 2, [f"{TP}=2", "--lora.rank=4", "--lora.modules_to_save=norm"], 2, 1, 0),
    "bf16_frozen_tp2": ("model", 2, [f"{TP}=2", "--training.freeze=model.embed_tokens.weight,model.layers.0.*",
                                     "--training.frozen_dtype=bfloat16"], 2, 1, 1),
}


def save_run(d, data, model, out, n, layout, gather):
    return run_saving([str(x) for x in args(d, model, data, out, *layout)], n, gather)


@pytest.mark.parametrize("name", list(SAVES))
def test_tp_ep_checkpoint_written_in_parts_is_the_gathered_one(setup, tmp_path, name):
    """The same run twice, its step-4 written by every rank into its pieces of the files and
    gathered to rank 0 (CTITAN_CKPT_GATHER=1): the files are byte-identical and load with
    safetensors; every rank logs its write (the gather logs none: it was not used), the
    ranks together wrote exactly the tensor bytes (a replicated tensor by one owner), and
    without FSDP or a pipeline each rank wrote exactly its share (the replicated tensors on
    TP index 0 and EP index 0 only). Before: rank 0 gathered every TP/EP layout's save."""
    from safetensors.torch import load_file
    d, data = setup
    model, n, layout, t, ep, shards = SAVES[name]
    p = save_run(d, data, model, tmp_path / "parts", n, layout, False)
    g = save_run(d, data, model, tmp_path / "gather", n, layout, True)
    step = f"checkpoint/step-{STEPS}"
    for f in ("model.safetensors", "optim.safetensors", "state.json"):
        a, b = (tmp_path / "parts" / step / f).read_bytes(), (tmp_path / "gather" / step / f).read_bytes()
        assert a == b, f"{name}: {f} differs between the parts and the gathered save"
    for f in ("model.safetensors", "optim.safetensors"):
        load_file(str(tmp_path / "parts" / step / f))
    assert not WROTE.search(g.stderr), f"{name}: the gathered save logs no part writes"
    wrote = {int(m[1]): int(m[3]) for m in WROTE.finditer(p.stderr) if int(m[2]) == n}
    assert sorted(wrote) == list(range(n)), f"{name}: every rank logs what it wrote:\n{p.stderr[-3000:]}"
    h = header(tmp_path / "parts" / step)
    total = sum(b for _, _, b in h)
    assert sum(wrote.values()) == total, f"{name}: the ranks wrote {wrote}, the tensors hold {total} bytes"
    if shards == 1:
        for r, w in wrote.items():
            tr, er = mesh_of(r, t, 1, ep)
            want = sum(written_share(k, s, b, t, tr, ep, er) for k, s, b in h)
            assert w == want, f"{name}: rank {r} wrote {w}, its share is {want}"


def written_share(name, shape, nbytes, t, tp_rank, ep, ep_rank):
    """What one owner per element writes: an expert's tensors its EP rank (each TP index its
    slice), the rest EP index 0; a TP-sliced tensor every TP index its slice, a replicated
    one TP index 0."""
    if expert_of(name) is None and ep > 1 and ep_rank != 0:
        return 0
    mine = share(name, shape, nbytes, t, tp_rank, ep, ep_rank, 4)
    if mine == nbytes and t > 1 and tp_rank != 0:  # whole on every TP index
        return 0
    return mine


def test_tp_checkpoint_in_parts_resumes_on_one_process(setup, reference, tmp_path):
    """A TP 2 run stopped at step 2, its checkpoint written in parts, resumed by one
    process: the later steps equal the uninterrupted one-process run's."""
    d, data = setup
    ref, _ = reference["model"]
    out = tmp_path / "run"
    a = [str(x) for x in args(d, "model", data, out, f"{TP}=2", f"--training.stop_at_step={STOP}")]
    p = run(mpirun() + ["-np", "2", str(BIN), *a], code=75)
    assert WROTE.search(p.stderr), p.stderr[-3000:]
    run([BIN, *args(d, "model", data, out)])
    assert_same_losses(out, ref, "tp2 -> 1")


def test_one_rank_failing_its_write_stops_every_rank(setup, tmp_path):
    """Rank 1 alone may not write past 64 KiB of a file (RLIMIT_FSIZE, SIGXFSZ ignored: its
    pwrite fails with EFBIG) while rank 0 lays the files out and writes its pieces: rank
    1's failure reaches rank 0, the run exits 1 naming the file, and the checkpoint folder
    holds no step-N and no temp dir."""
    d, data = setup
    a = [str(x) for x in args(d, "model", data, tmp_path / "out", f"{TP}=2")]
    limited = ["bash", "-c", 'trap "" XFSZ; ulimit -f 64; exec "$@"', "ctitan", str(BIN), *a]
    cmd = mpirun() + ["-np", "1", str(BIN), *a, ":", "-np", "1", *limited]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stderr[-4000:]}"
    err = [line for line in p.stderr.splitlines() if "ctitan: error" in line]
    assert any(re.search(r"\.step-4\.tmp-\d+/(model|optim)\.safetensors: write failed at byte \d+: File too large",
                         line) for line in err), p.stderr[-4000:]
    left = sorted(x.name for x in (tmp_path / "out" / "checkpoint").iterdir())
    assert left == [], f"a failed save leaves nothing: {left}"
