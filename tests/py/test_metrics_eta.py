"""The trainer's logged figures that the seventh mutation audit found loosely checked or
unchecked: the ETA of each logged step (docs/formats.md: the steps left x the mean wall time
per step after the first), which test_progress.py holds only to a factor of 2 either way,
and the token counts under context parallel (tokens_seen, tps)."""
import json
import re
import subprocess

import pytest

import oracle
from conftest import BIN, crashed

STEPS = 10


@pytest.fixture(scope="module")
def eta_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("audit7_eta")
    oracle.tiny_config(vocab=512, hidden=256, inter=768, layers=4, heads=4, kv_heads=2, head_dim=64
                       ).save_pretrained(d / "model")
    data = oracle.write_bin(d / "t.bin", oracle.random_tokens(40 * 65, 512, seed=3))
    args = [str(BIN), "train", "--model.spec=hf", f"--model.hf_assets_path={d / 'model'}",
            f"--training.dataset_path={data}", "--training.seq_len=64", "--training.local_batch_size=4",
            f"--training.steps={STEPS}", "--metrics.log_freq=1", "--metrics.peak_tflops=1",
            f"--job.dump_folder={d / 'out'}"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, args)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(ln) for ln in (d / "out" / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    return rows, p.stdout


def test_eta_is_the_remaining_steps_at_the_mean_step_after_the_first(eta_run):
    """eta_s at step s = (STEPS - s) x (elapsed_s[s] - t1) / (s - 1), t1 the end of step 1
    (stamped before its line, so 0 <= t1 <= elapsed_s[1]). Then elapsed_s[s] - (s - 1) x eta_s /
    (STEPS - s) is t1 at every step, to the milliseconds they are printed with, whatever the
    machine's load did to the steps. A mean over s steps instead of s - 1 moves that figure
    by a share of a step (from about a half at step 2 to 7/8 at step 8), tens of
    milliseconds on these steps."""
    rows, out = eta_run
    el = {r["step"]: r["elapsed_s"] for r in rows}
    eta = {r["step"]: r["eta_s"] for r in rows}
    assert sorted(el) == list(range(1, STEPS + 1))
    per = (el[STEPS] - el[1]) / (STEPS - 1)
    assert per > 0.02, f"test setup: steps of {per * 1e3:.1f} ms are too short to tell"
    t1 = {s: el[s] - (s - 1) * eta[s] / (STEPS - s) for s in range(2, STEPS)}
    tol = {s: 0.0005 * (1 + (s - 1) / (STEPS - s)) + 0.0005 for s in t1}  # printed to the millisecond
    for s in t1:
        assert -tol[s] <= t1[s] <= el[1] + tol[s], (s, t1[s], el[1])
        assert abs(t1[s] - t1[2]) <= tol[s] + tol[2], f"step {s}: eta_s {eta[s]} implies step 1 ended at " \
            f"{t1[s]:.4f} s, step 2's {eta[2]} at {t1[2]:.4f} s"
    assert eta[STEPS] == 0
    logged = dict(re.findall(r"^step: (\d+) .*  eta: (\S+)$", out, re.M))
    assert logged[str(STEPS)] == "0s", logged


def test_context_parallel_logs_the_global_batchs_tokens_and_its_chunks_rate(tmp_path):
    """CP 2 over 2 ranks (one data-parallel rank of local batch 2, seq_len 32): metrics.jsonl's
    tokens_seen is step x global batch x seq_len (docs/formats.md: all ranks, whole sequences,
    here 2 x 32 a step), while tps is a rank's tokens per second, its chunk of each sequence
    (seq_len / 2; torchtitan's tps divides by the degree likewise): tps x step_time_s is the
    16 x 2 positions a rank ran in the step, to the digits they are printed with."""
    from test_dist import ENV, mpirun
    oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 33, 256, seed=3))
    B, T, cp, steps = 2, 32, 2, 3
    cmd = mpirun() + ["-np", "2", str(BIN), "train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'model'}",
                      f"--training.dataset_path={data}", f"--training.seq_len={T}", f"--training.local_batch_size={B}",
                      f"--training.steps={steps}", "--metrics.log_freq=1", "--metrics.peak_tflops=1",
                      f"--job.dump_folder={tmp_path / 'out'}", f"--parallelism.context_parallel_degree={cp}",
                      "--parallelism.data_parallel_shard_degree=1"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(ln) for ln in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["tokens_seen"] == r["step"] * B * T, r
        per_step = r["tps"] * r["step_time_s"]
        # tps printed to 1e-2, step_time_s to 1e-6 s (a step here is well under a millisecond)
        assert abs(per_step - B * T / cp) <= 5e-7 * r["tps"] + 0.005 * r["step_time_s"] + 1e-6, (r, per_step)
