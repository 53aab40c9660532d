"""Checkpoint I/O spread over the ranks (docs/checkpoints.md, "Loading under mpirun").

A resume under mpirun reads, on each rank, only the rows of the tensors that rank keeps (its
FSDP shard, its TP slice, its pipeline stage's layers), with pread at the offsets the
safetensors header gives; and the whole-file checksums are read once per file system:
the ranks that see rank 0's checkpoint folder (a token file rank 0 writes there) take its
verdict, a rank with its own folder (another machine's disk) verifies its own.

Checked here against what the files hold, read with the safetensors package: each rank's
logged tensor bytes are about its share of the tensors' bytes (the header's shapes), the
ranks together read every byte, rank 0 alone checksums the files (their sizes in the
manifest) when the folder is shared, and the resumed run trains as the uninterrupted
one-process run does. A damaged file still stops every rank, naming the file."""
import json
import os
import re
import shutil
import subprocess

import pytest

import oracle
from conftest import BIN, crashed
from test_dist import mpirun

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", CTITAN_LOG_RANKS="all",
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
STEPS, STOP = 4, 2
READ = re.compile(r"rank (\d+) of (\d+): read (\d+) bytes of checkpoint tensors and checksummed (\d+) bytes")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckptio")
    # rows that no rank count divides, so shards and slices cut rows in the middle
    oracle.tiny_config(vocab=250, hidden=48, inter=72, layers=4, heads=4, kv_heads=2, head_dim=12,
                       tied=False).save_pretrained(d / "model")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(400 * 17, 250, seed=3))
    return d, data


def args(d, data, out, *extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={d / 'model'}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.global_batch_size=8",
            f"--training.steps={STEPS}", "--training.seed=5", "--optimizer.lr=3e-3", "--metrics.log_freq=1",
            f"--job.dump_folder={out}", "--checkpoint.enable", "--checkpoint.interval=1000",
            "--checkpoint.last_save_model_only=false", *extra]


def run(cmd, code=0, timeout=300):
    cmd = [str(c) for c in cmd]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == code, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-4000:]}"
    return p


def losses(out):
    return {r["step"]: r["loss"] for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def reference(setup):
    """The uninterrupted one-process run, and a one-process run stopped at step 2 (its checkpoint)."""
    d, data = setup
    ref = d / "ref"
    run([BIN, *args(d, data, ref)])
    stopped = d / "stopped"
    run([BIN, *args(d, data, stopped, f"--training.stop_at_step={STOP}")], code=75)
    return losses(ref), stopped


def tensor_bytes(step_dir):
    """Total tensor bytes of the checkpoint's two files and the bytes of one row of each tensor
    (lm_sink's rows: shape[1] floats, or one for a vector), from the safetensors headers."""
    from safetensors import safe_open
    total, rows = 0, []
    for name in ("model.safetensors", "optim.safetensors"):
        with safe_open(str(step_dir / name), framework="numpy") as f:
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                n = 1
                for s in shape:
                    n *= s
                total += 4 * n
                rows.append(4 * (shape[1] if len(shape) > 1 else 1))
    return total, rows


def file_bytes(step_dir):
    """The bytes of every file the manifest lists (what a checksum pass reads)."""
    return sum(f["bytes"] for f in json.loads((step_dir / "manifest.json").read_text())["files"].values())


def resume(setup, stopped, tmp_path, n, layout, mpmd_rank1=None):
    d, data = setup
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    a = [str(x) for x in args(d, data, out, *layout)]
    if mpmd_rank1 is None:
        cmd = mpirun() + ["-np", str(n), str(BIN), *a]
    else:
        cmd = mpirun() + ["-np", "1", str(BIN), *a, ":", "-np", str(n - 1), str(BIN), *a, *mpmd_rank1]
    p = run(cmd)
    reads = {int(m[1]): (int(m[3]), int(m[4])) for m in READ.finditer(p.stderr) if int(m[2]) == n}
    assert sorted(reads) == list(range(n)), f"every rank logs what it read:\n{p.stderr[-4000:]}"
    return out, reads, p


def assert_same_losses(out, ref, what):
    got = losses(out)
    for s in range(STOP + 1, STEPS + 1):
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), f"{what}: step {s} loss {got[s]!r} vs {ref[s]!r}"


LAYOUTS = {  # name: (ranks, [parallelism], the most of the tensor bytes one rank may read)
    "fsdp4": (4, ["--parallelism.data_parallel_shard_degree=4"], 0.25),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"], 0.5),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=2"],
            0.75),
    # TP's row-parallel weights (o_proj, down_proj) are column slices: a rank reads its pieces of their rows
    # (test_ckpt_tp_io.py checks the exact shares)
    "tp2": (2, ["--parallelism.tensor_parallel_degree=2"], 0.55),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_reads_its_share_and_resumes_exactly(setup, reference, tmp_path, name):
    """Each rank reads about its share of the tensor bytes (FSDP 4: a quarter, plus at most
    two rows per tensor where a shard starts or ends mid-row), the ranks together read every
    byte, rank 0 alone checksums the files (the folder is shared), and the resumed steps
    equal the uninterrupted one-process run's. Before: every rank read (and checksummed,
    twice) the whole files and logged none of it."""
    ref, stopped = reference
    n, layout, share = LAYOUTS[name]
    out, reads, _ = resume(setup, stopped, tmp_path, n, layout)
    step = out / "checkpoint" / f"step-{STOP}"
    total, rows = tensor_bytes(step)
    slack = 2 * sum(rows) + 64 * len(rows)  # whole rows at a shard's two ends, FSDP's padded chunks
    for r, (got, _) in reads.items():
        assert got <= share * total + slack, f"{name}: rank {r} read {got} of {total} tensor bytes (share {share})"
    assert sum(g for g, _ in reads.values()) >= total, f"{name}: the ranks read {reads}, the tensors hold {total}"
    if name.startswith("fsdp"):
        assert sum(g for g, _ in reads.values()) <= total + n * slack, f"{name}: {reads} read twice?"
    assert reads[0][1] == file_bytes(step), f"{name}: rank 0 checksums every file once: {reads}"
    assert all(reads[r][1] == 0 for r in range(1, n)), f"{name}: the other ranks take rank 0's verdict: {reads}"
    assert_same_losses(out, ref, name)


def test_a_rank_with_its_own_folder_verifies_its_own(setup, reference, tmp_path):
    """Rank 1's checkpoint.folder is another copy (another machine's disk): it does not see
    rank 0's token file, so it checksums its own files; the run resumes. Damage in that copy
    alone stops the run, naming the copy's file."""
    ref, stopped = reference
    own = tmp_path / "own"
    shutil.copytree(stopped / "checkpoint", own)
    layout = ["--parallelism.data_parallel_shard_degree=2"]
    out, reads, _ = resume(setup, stopped, tmp_path, 2, layout, [f"--checkpoint.folder={own}"])
    step = out / "checkpoint" / f"step-{STOP}"
    assert reads[0][1] == file_bytes(step) and reads[1][1] == file_bytes(own / f"step-{STOP}"), reads
    assert_same_losses(out, ref, "own folder")

    d, data = setup
    shutil.rmtree(own)
    shutil.copytree(stopped / "checkpoint", own)
    bad = own / f"step-{STOP}" / "model.safetensors"
    b = bytearray(bad.read_bytes())
    b[-5] ^= 0x10
    bad.write_bytes(bytes(b))
    out2 = tmp_path / "run2"
    shutil.copytree(stopped, out2)
    a = [str(x) for x in args(d, data, out2, *layout, "--checkpoint.fallback=false")]
    p = run(mpirun() + ["-np", "1", str(BIN), *a, ":", "-np", "1", str(BIN), *a, f"--checkpoint.folder={own}"],
            code=3)
    assert f"{bad}: checksum mismatch" in p.stderr, p.stderr[-4000:]


@pytest.mark.parametrize("file", ["model.safetensors", "optim.safetensors"])
def test_damaged_file_stops_every_rank_naming_it(setup, reference, tmp_path, file):
    """A flipped bit in the shared folder: rank 0 finds it, the other ranks take its verdict
    and verify for themselves, so every rank's error names the damaged file (exit 3 with
    checkpoint.fallback = false), as when every rank checksummed the files itself."""
    d, data = setup
    _, stopped = reference
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    bad = out / "checkpoint" / f"step-{STOP}" / file
    b = bytearray(bad.read_bytes())
    b[len(b) // 2] ^= 0x01
    bad.write_bytes(bytes(b))
    a = [str(x) for x in args(d, data, out, "--parallelism.data_parallel_shard_degree=2",
                              "--checkpoint.fallback=false")]
    p = run(mpirun() + ["-np", "2", str(BIN), *a], code=3)
    named = [l for l in p.stderr.splitlines() if f"{bad}: checksum mismatch" in l]
    assert len(named) >= 2, f"each rank names {bad}:\n{p.stderr[-4000:]}"
    assert not any(x.name.startswith(".ctitan-fs-probe") for x in (out / "checkpoint").iterdir())


# ---------------------------------------------------------------- saving in parts

WROTE = re.compile(r"rank (\d+) of (\d+): wrote (\d+) bytes of checkpoint tensors")
FSDP = "--parallelism.data_parallel_shard_degree"
SAVE_LAYOUTS = {  # name: (ranks, [parallelism and run options], whether the ranks write their parts)
    "dp2": (2, ["--parallelism.data_parallel_replicate_degree=2"], True),
    "fsdp2": (2, [f"{FSDP}=2"], True),
    "fsdp4": (4, [f"{FSDP}=4"], True),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree=2", f"{FSDP}=2"], True),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=2"],
            True),
    "pp2_fsdp2": (4, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=2",
                      f"{FSDP}=2"], True),
    "cp2": (2, ["--parallelism.context_parallel_degree=2"], True),
    # LoRA: the adapters (and modules_to_save) only, under FSDP
    "lora_fsdp2": (2, [f"{FSDP}=2", "--lora.rank=4", "--lora.modules_to_save=norm"], True),
    # a frozen base stored in bf16 (not in the checkpoint), the rest trained
    "bf16_frozen_fsdp2": (2, [f"{FSDP}=2", "--training.freeze=model.embed_tokens.weight,model.layers.0.*",
                              "--training.frozen_dtype=bfloat16"], True),
    # column slices of row-parallel weights: each rank writes its pieces of their rows (test_ckpt_tp_io.py)
    "tp2": (2, ["--parallelism.tensor_parallel_degree=2"], True),
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree=2", f"{FSDP}=2"], True),
}


def save_run(setup, out, n, layout, gather, *extra):
    d, data = setup
    return run_saving([str(x) for x in args(d, data, out, *layout, *extra)], n, gather)


def run_saving(a, n, gather):
    """ctitan's arguments a on n ranks, saving in parts or (gather) gathered to rank 0"""
    cmd = mpirun() + ["-x", "CTITAN_CKPT_GATHER", "-np", str(n), str(BIN), *a]  # the knob on every rank
    p = subprocess.run(cmd, env=dict(ENV, CTITAN_CKPT_GATHER="1" if gather else "0"), capture_output=True, text=True,
                       timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-4000:]}"
    return p


@pytest.mark.parametrize("name", list(SAVE_LAYOUTS))
def test_checkpoint_written_in_parts_is_the_gathered_one(setup, tmp_path, name):
    """The same run twice, its checkpoint written by every rank into its part of the files
    (pwrite at the header's offsets) and gathered to rank 0 (CTITAN_CKPT_GATHER=1, the old
    path): the files are byte-identical, safetensors.torch.load_file reads them, and each
    writing rank wrote about its share of the tensor bytes (FSDP: 1/shards of them; the
    ranks together exactly all of them, once)."""
    from safetensors.torch import load_file
    n, layout, in_parts = SAVE_LAYOUTS[name]
    p = save_run(setup, tmp_path / "parts", n, layout, False)
    save_run(setup, tmp_path / "gather", n, layout, True)
    step = f"checkpoint/step-{STEPS}"
    for f in ("model.safetensors", "optim.safetensors", "state.json"):  # config.toml names each run's folder
        a, b = (tmp_path / "parts" / step / f).read_bytes(), (tmp_path / "gather" / step / f).read_bytes()
        assert a == b, f"{name}: {f} differs between the parts and the gathered save"
    for f in ("model.safetensors", "optim.safetensors"):
        load_file(str(tmp_path / "parts" / step / f))
    wrote = {int(m[1]): int(m[3]) for m in WROTE.finditer(p.stderr) if int(m[2]) == n}
    if not in_parts:
        assert not wrote, f"{name}: rank 0 gathers this layout's save: {wrote}"
        return
    total, _ = tensor_bytes(tmp_path / "parts" / step)
    assert sorted(wrote) == list(range(n)), f"{name}: every rank logs what it wrote:\n{p.stderr[-3000:]}"
    assert sum(wrote.values()) == total, f"{name}: the ranks wrote {wrote}, the tensors hold {total} bytes"
    if name.startswith("fsdp"):
        shards = n
        for r, w in wrote.items():
            assert w <= total / shards + 64 * 64, f"{name}: rank {r} wrote {w} of {total}"


@pytest.mark.parametrize("name", ["fsdp4", "pp2", "cp2", "dp2"])
def test_untrained_weights_in_parts_are_one_process_bytes(setup, tmp_path, name):
    """With lr 0 the weights stay the seeded ones every layout draws alike: the parts'
    model.safetensors is byte for byte the one-process run's."""
    d, data = setup
    one = tmp_path / "one"
    run([BIN, *args(d, data, one, "--optimizer.lr=0")])
    n, layout, _ = SAVE_LAYOUTS[name]
    save_run(setup, tmp_path / name, n, layout, False, "--optimizer.lr=0")
    step = f"checkpoint/step-{STEPS}/model.safetensors"
    assert (tmp_path / name / step).read_bytes() == (one / step).read_bytes(), name


def test_a_failed_write_on_any_rank_leaves_no_step(setup, tmp_path):
    """The checkpoint folder on a tmpfs too small for the tensors: the headers are written and
    the files sized (sparse), then some rank's pwrite fails (no space). Its error reaches every
    rank, the run exits 1 naming the file, and the folder holds no step-N and no temp dir."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if m.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        d, data = setup
        a = [str(x) for x in args(d, data, tmp_path / "out", f"{FSDP}=4", f"--checkpoint.folder={mnt / 'ckpt'}")]
        p = subprocess.run(mpirun() + ["-np", "4", str(BIN), *a], env=ENV, capture_output=True, text=True,
                           timeout=300)
        crashed(p.returncode, p.stderr, a)
        assert p.returncode == 1, f"exit {p.returncode}\n{p.stderr[-4000:]}"
        err = [line for line in p.stderr.splitlines() if "ctitan: error" in line]
        assert err and any("safetensors: write failed" in line and "No space left on device" in line
                           for line in err), p.stderr[-4000:]
        left = sorted(x.name for x in (mnt / "ckpt").iterdir())
        assert left == [], f"a failed save leaves nothing: {left}"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_non_finite_value_a_rank_reads_mid_tensor_is_named_at_its_element(setup, reference, tmp_path):
    """A NaN in the last row of the embedding, which FSDP 2 leaves to rank 1 (its shard of
    the embedding's piece starts at row 125): the load stops (exit 3, a format error),
    naming the tensor and the element's index in the whole tensor, row * columns + column,
    as a one-process load does (test_ckpt_integrity.py). A rank's block read from row r0
    named element r0 + its offset in the block (6082 here) instead."""
    from test_ckpt_integrity import resign, set_float
    d, data = setup
    _, stopped = reference
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    step = out / "checkpoint" / f"step-{STOP}"
    name, rows, cols = "model.embed_tokens.weight", 250, 48  # [vocab, hidden] of setup's model
    at = (rows - 1) * cols + 5
    set_float(step / "model.safetensors", name, at, float("nan"))
    resign(step)
    a = [str(x) for x in args(d, data, out, "--parallelism.data_parallel_shard_degree=2",
                              "--checkpoint.fallback=false")]
    p = run(mpirun() + ["-np", "2", str(BIN), *a], code=3)
    want = f'model.safetensors: tensor "{name}" holds a non-finite value (nan) at element {at}'
    assert want in p.stderr, p.stderr[-4000:]


def test_resume_pick_checksum_pass_has_a_bar(setup, reference, tmp_path):
    """The pick's checksum pass reads every byte of the files on rank 0 (as long as the load
    itself, or longer): it has its own bar, "checkpoint verify step-N", whose total is the
    bytes of the files the manifest lists, before the load's "(read)" bar. Before: no bar
    while the files were checksummed."""
    from test_progress import check_plain, fields
    d, data = setup
    _, stopped = reference
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    a = [str(x) for x in args(d, data, out, f"{FSDP}=2")]
    cmd = mpirun() + ["-x", "CTITAN_PROGRESS", "-x", "CTITAN_PROGRESS_MIN_S", "-x", "CTITAN_PROGRESS_PERIOD",
                      "-np", "2", str(BIN), *a]
    p = subprocess.run(cmd, env=dict(ENV, CTITAN_LOG_RANKS="0", CTITAN_PROGRESS="plain", CTITAN_PROGRESS_MIN_S="0",
                                     CTITAN_PROGRESS_PERIOD="0"), capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stderr[-4000:]
    label = f"checkpoint verify step-{STOP}"
    lines = check_plain(p.stderr, label)
    total = fields(lines[-1]).group(4)
    size = file_bytes(out / "checkpoint" / f"step-{STOP}")
    n = float(total.split()[0]) * {"B": 1, "KiB": 1024, "MiB": 1 << 20}[total.split()[1]]
    assert abs(n - size) <= 0.06 * (1 << 20) + 0.01 * size, (total, size)
    err = p.stderr
    assert err.index(lines[-1]) < err.index(f"checkpoint load step-{STOP} (read)"), err[-3000:]
