"""One run per job.dump_folder (docs/checkpoints.md, "One run per folder").

Two trainings started on one folder used to both run: their checkpoints were saved over
each other, metrics.jsonl rewritten, events.jsonl interleaved. Rank 0 now holds an flock
on {dump_folder}/.ctitan.lock for the whole run, so a second run fails at once (exit 2,
naming the folder and the holder's pid and host), under mpirun too (every rank exits,
none waits), while a dry run still works beside it, and the kernel drops the lock however
the first run ends: the same command afterwards, or after a SIGKILL, resumes as before.
With the lock held, every temporary directory of a save cut short in the checkpoint
folder is stale, whatever pid it names: removed at the start, with a note."""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import oracle
from conftest import BIN, CHILD_ENV, ROOT, crashed
from test_dist import ENV as MPI_ENV, mpirun
from test_faults import fault_args, freeze, steps_in, train
from test_resume import losses

PID_MAX_PLUS = 4194305  # above Linux's largest pid_max (2^22): a pid that is never alive


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run_lock")
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    cfg.save_pretrained(tmp / "model")
    data = oracle.write_bin(tmp / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    return tmp, tmp / "model", data


def start_frozen(args, out, at_step=3):
    """Starts a run and SIGSTOPs it once it logged step `at_step`: it holds the folder
    (and, stopped, keeps holding it). The Popen, or None if it ended first."""
    cmd = [str(BIN)] + [str(a) for a in args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith(f"step: {at_step} ") and freeze(p.pid):
            return p
    p.communicate(timeout=60)
    return None


def frozen_run(args, out, at_step=3):
    """start_frozen, retried: a run on a busy machine may end before it is frozen. Three
    such ends in a row fail the test."""
    for _ in range(3):
        p = start_frozen(args, out, at_step)
        if p:
            return p
    pytest.fail(f"the run ended before it could be frozen at step {at_step}, 3 times")


def finish(p, sig=signal.SIGCONT):
    p.send_signal(sig)
    if sig != signal.SIGKILL:
        p.send_signal(signal.SIGCONT)
    out, err = p.communicate(timeout=120)
    return p.returncode, err


def assert_refused(p, out, holder_pid, took):
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if l.startswith("ctitan: error:")]
    assert len(err) == 1, p.stderr[-3000:]
    assert f"job.dump_folder = {out} is in use by another run" in err[0], err[0]
    assert f"pid {holder_pid} on host " in err[0] and ".ctitan.lock" in err[0], err[0]
    assert took < 30, f"the second run took {took:.1f} s to fail"


def test_second_run_in_a_held_folder_fails_at_once(setup, tmp_path):
    """A run frozen at step 3 holds the folder: the same command again exits 2 at once,
    naming the folder and the holder; it wrote nothing (the first run's metrics and
    events stay one run's); a dry run beside it works. Once the first run has ended, the
    same command resumes from its final checkpoint."""
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    args = fault_args(model_dir, data, out)
    first = frozen_run(args, out)
    try:
        lock = (out / ".ctitan.lock").read_text()
        assert lock.startswith(f"pid {first.pid} on host "), lock
        t0 = time.monotonic()
        p = train(args, timeout=60)
        assert_refused(p, out, first.pid, time.monotonic() - t0)
        assert "training.steps" not in p.stdout and not p.stdout.startswith("step:"), p.stdout[-2000:]
        dry = train(args + ["--dry-run"], timeout=60)
        assert dry.returncode == 0, dry.stderr[-3000:]
    finally:
        rc, err = finish(first)
    assert rc == 0, err[-3000:]
    assert "is in use" not in err
    assert sorted(losses(out)) == list(range(1, 41))  # one run's lines, each step once
    events = [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("start", "exit")] == ["start", "exit"], events
    # afterwards: the same folder, 2 more steps, resumed from the final checkpoint
    p = train(fault_args(model_dir, data, out, "--training.steps=42"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"resuming from \S*/step-40 \(step 40\)", p.stderr), p.stderr[-3000:]


def test_killed_run_leaves_no_lock_and_its_stale_saves_go(setup, tmp_path):
    """SIGKILL a run that holds the folder (the kernel drops its lock): the same command
    runs at once. Two stale temporary saves in its checkpoint folder, one naming a pid
    that is alive (this test's: a reused pid, which ckpt_prune spares) and one a pid that
    never is, are removed at the start with a note, even by a run that saves nothing."""
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    args = fault_args(model_dir, data, out, "--training.stop_at_step=5")
    p = train(args)
    assert p.returncode == 75, p.stderr[-3000:]
    ck = out / "checkpoint"
    live, dead = ck / f".step-7.tmp-{os.getpid()}", ck / f".step-8.tmp-{PID_MAX_PLUS}"
    for d in (live, dead):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 100)
    first = frozen_run(fault_args(model_dir, data, out), out, at_step=7)
    rc, err = finish(first, signal.SIGKILL)
    assert rc == -signal.SIGKILL, err[-3000:]
    notes = [l for l in err.splitlines() if "leftover" in l]
    assert len(notes) == 1 and f"{ck}" in notes[0] and "and 1 more" in notes[0], err[-3000:]
    assert not live.exists() and not dead.exists(), sorted(os.listdir(ck))
    assert (out / ".ctitan.lock").exists()  # the file stays; the kernel dropped the lock with the process
    # and a final Hugging Face save cut short (its name was parsed wrongly, so nothing removed it)
    hf = ck / f".hf-step-9.tmp-{PID_MAX_PLUS}"
    for d in (live, dead, hf):
        d.mkdir()
    # checkpoint.enable = false: no save at all, the leftovers still go
    p = train(fault_args(model_dir, data, out, "--checkpoint.enable=false", "--training.steps=2"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "is in use" not in p.stderr, p.stderr[-3000:]
    # the three above at least (the killed run may have left a save of its own)
    more = re.search(r"removed \S+ and (\d+) more from", p.stderr)
    assert more and int(more.group(1)) >= 2, p.stderr[-3000:]
    assert not live.exists() and not dead.exists() and not hf.exists(), sorted(os.listdir(ck))
    assert steps_in(ck)[-1] >= 5


def test_mpirun_second_run_fails_on_every_rank(setup, tmp_path):
    """Under mpirun only rank 0 takes the lock; when it cannot, the other ranks learn of it
    and the job ends at once with exit 2 and rank 0's message (no rank left waiting); once
    the first run has ended, the mpirun run resumes from its final checkpoint."""
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    args = fault_args(model_dir, data, out)
    first = frozen_run(args, out)
    cmd = mpirun() + ["-np", "2", str(BIN)] + [str(a) for a in args] + ["--parallelism.data_parallel_shard_degree=2",
                                                                         "--training.steps=2"]
    try:
        t0 = time.monotonic()
        p = subprocess.run(cmd, env=MPI_ENV, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        crashed(p.returncode, p.stderr, cmd)
        assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-3000:]}"
        assert f"job.dump_folder = {out} is in use by another run (pid {first.pid} on host " in p.stderr, \
            p.stderr[-3000:]
        assert took < 30, took
    finally:
        rc, err = finish(first)
    assert rc == 0, err[-3000:]
    p = subprocess.run(cmd[:-1] + ["--training.steps=42"], env=MPI_ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"resuming from \S*/step-40 \(step 40\)", p.stderr), p.stderr[-3000:]
