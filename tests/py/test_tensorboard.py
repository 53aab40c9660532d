"""TensorBoard event files (issue 18, part 1), read with the `tensorboard` package's
own reader as the oracle and compared with the same run's metrics.jsonl: every
scalar at every step, including validation, once and in order after a resume, and
every record passing the reader's CRC checks (which a flipped byte must fail)."""
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

import oracle
from conftest import BIN, TINY_CKPT, crashed, tiny_run

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.compat.tensorflow_stub import errors as tb_errors
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

STEPS = 10
TRAIN_TAGS = ["loss", "grad_norm", "lr", "memory_gib", "tps", "tflops", "mfu", "step_time_s", "tokens_seen",
              "comm_pct"]
RUN_TAGS = ["pp_bubble", "aux_loss"]  # a pipeline run's, a MoE model's
VAL_TAGS = ["val_loss", "val_perplexity"]


@pytest.fixture
def setup(tmp_path):
    _, out, args = tiny_run(tmp_path, "--metrics.enable_tensorboard", *TINY_CKPT, steps=STEPS, val=True)
    return out, args


def records(path):
    """Every record of an events file through TensorBoard's record reader, which
    raises DataLossError on a bad CRC (the loader above it swallows that and stops)."""
    r = pywrap_tensorflow.PyRecordReader_New(str(path).encode(), 0, b"", None)
    got = []
    while True:
        try:
            r.GetNext()
        except tb_errors.OutOfRangeError:
            return got
        got.append(r.record())


def scalars(tb_dir):
    acc = ea.EventAccumulator(str(tb_dir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected(out):
    rows = oracle.read_metrics(out / "metrics.jsonl")
    want = {tag: [(r["step"], r[tag]) for r in rows if tag in r] for tag in TRAIN_TAGS + VAL_TAGS + RUN_TAGS}
    return {tag: v for tag, v in want.items() if v or tag in TRAIN_TAGS}


def assert_matches(tb, want):
    assert sorted(tb) == sorted(want), f"tags: {sorted(tb)} != {sorted(want)}"
    for tag, rows in want.items():
        got = tb[tag]
        steps = [s for s, _ in got]
        assert steps == [s for s, _ in rows], f"{tag}: steps {steps} != metrics.jsonl's {[s for s, _ in rows]}"
        assert steps == sorted(set(steps)), f"{tag}: steps repeat or go back: {steps}"
        # simple_value is a float32; metrics.jsonl has 9 significant digits or fewer
        bad = [(s, v, w) for (s, v), (_, w) in zip(got, rows) if v != np.float32(w)
               and abs(v - w) > 2 * np.finfo(np.float32).eps * abs(w)]
        assert not bad, f"{tag}: (step, tensorboard, metrics.jsonl) differ: {bad[:5]}"


def crc_complaints(caplog):
    return [r.getMessage() for r in caplog.records
            if "DataLoss" in r.getMessage() or "crc" in r.getMessage().lower() or "Truncated" in r.getMessage()]


def events_files(tb_dir):
    return sorted(p for p in tb_dir.iterdir() if "tfevents" in p.name)


def test_scalars_match_metrics(setup, run_ctitan):
    out, args = setup
    run_ctitan(args)
    tb_dir = out / "tb"
    files = events_files(tb_dir)
    assert len(files) == 1, files
    want = expected(out)
    assert [s for s, _ in want["val_loss"]] == [3, 6, 9, 10], want["val_loss"]  # validation ran
    assert len(want["loss"]) == STEPS
    assert_matches(scalars(tb_dir), want)
    n = len(records(files[0]))
    assert n == 2 + STEPS * len(TRAIN_TAGS) + 4 * len(VAL_TAGS), f"{n} records"


def test_corrupted_crc_is_caught(setup, run_ctitan, tmp_path, caplog):
    out, args = setup
    run_ctitan([a if not a.startswith("--training.steps=") else "--training.steps=2" for a in args])
    src = events_files(out / "tb")[0]
    good = records(src)
    blob = bytearray(src.read_bytes())
    # a byte inside the last record's tag: only the data CRC can tell
    tag = blob.rfind(b"val_perplexity")  # step 2 is the last: validation ran
    assert tag > 0
    blob[tag] ^= 0x20
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    (bad_dir / src.name).write_bytes(bytes(blob))
    with pytest.raises(tb_errors.DataLossError, match="crc32"):
        records(bad_dir / src.name)
    # the accumulator stops at the bad record: one scalar fewer than the good file's, and
    # its log says why (what test_resume_has_each_step_once looks for and must not find)
    with caplog.at_level(logging.DEBUG):
        n_bad = sum(len(v) for v in scalars(bad_dir).values())
    assert crc_complaints(caplog), "the reader did not log the bad CRC"
    assert n_bad == sum(len(v) for v in scalars(out / "tb").values()) - 1
    assert len(good) == 2 + 2 * len(TRAIN_TAGS) + len(VAL_TAGS)


def test_resume_has_each_step_once(setup, run_ctitan, caplog):
    out, args = setup
    run_ctitan(args)
    first = scalars(out / "tb")
    # as a run killed after step 10 whose newest checkpoints were lost: it resumes from
    # step 4 and redoes 5..10, which the first file already logged
    for step in (8, 10):
        shutil.rmtree(out / "checkpoint" / f"step-{step}")
    rc, _, err = run_ctitan(args)
    assert "step 4" in err or "step-4" in err, err
    files = events_files(out / "tb")
    assert len(files) == 2, files
    for f in files:
        records(f)  # every record of both files passes the CRC checks
    with caplog.at_level(logging.DEBUG):
        tb = scalars(out / "tb")
    assert not crc_complaints(caplog), crc_complaints(caplog)
    want = expected(out)  # metrics.jsonl: steps 1-4 of the first run, 5-10 of the second
    assert_matches(tb, want)
    # the redone steps carry the second run's values, not the first's: timings differ
    redone = [v for s, v in tb["step_time_s"] if s > 4]
    assert redone != [v for s, v in first["step_time_s"] if s > 4]


def test_stop_and_resume(setup, run_ctitan):
    """The preemption path (training.stop_at_step saves and exits 75, as SIGTERM does):
    the rerun of the same command continues both files without a gap or a repeat."""
    out, args = setup
    rc, _, err = run_ctitan(args + ["--training.stop_at_step=6"], check=False)
    assert rc == 75, err
    assert max(s for s, _ in scalars(out / "tb")["loss"]) == 6
    run_ctitan(args)
    assert len(events_files(out / "tb")) == 2
    tb, want = scalars(out / "tb"), expected(out)
    assert [s for s, _ in tb["loss"]] == list(range(1, STEPS + 1))
    assert_matches(tb, want)


def test_two_ranks_one_writer(setup):
    """Data parallel over 2 ranks: only rank 0 writes, so one file, matching metrics.jsonl
    (whose tokens_seen counts both ranks' sequences)."""
    out, args = setup
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: run scripts/setup.sh (installs openmpi-bin)"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", str(BIN), *args,
           "--training.global_batch_size=4", "--training.steps=3"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(events_files(out / "tb")) == 1, events_files(out / "tb")
    want = expected(out)
    assert [v for _, v in want["tokens_seen"]] == [4 * 16 * s for s in (1, 2, 3)]
    assert_matches(scalars(out / "tb"), want)


def run_mpi(n, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [shutil.which("mpirun"), "--oversubscribe", "--bind-to", "none", "-np", str(n), str(BIN), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stderr[-3000:]


def test_pipeline_bubble_and_moe_aux_loss(tmp_path):
    """A pipeline run's pp_bubble and a MoE model's aux_loss reach TensorBoard as metrics.jsonl
    prints them (a dense one-process run has neither: test_scalars_match_metrics)."""
    from transformers import Qwen3MoeConfig
    _, out, args = tiny_run(tmp_path, "--metrics.enable_tensorboard", layers=2, steps=3)
    run_mpi(2, args + ["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=2"])
    want = expected(out)
    assert len(want["pp_bubble"]) == 3 and "aux_loss" not in want, sorted(want)
    assert_matches(scalars(out / "tb"), want)
    moe = tmp_path / "moe"
    Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                   num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, output_router_logits=True, router_aux_loss_coef=0.01).save_pretrained(moe)
    out2 = tmp_path / "out_moe"
    run_mpi(1, [a.replace(str(tmp_path / "model"), str(moe)).replace(str(out), str(out2)) for a in args])
    want = expected(out2)
    assert len(want["aux_loss"]) == 3 and "pp_bubble" not in want, sorted(want)
    assert_matches(scalars(out2 / "tb"), want)
