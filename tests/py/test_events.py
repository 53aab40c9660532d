"""events.jsonl (issue 18), the run's own log of its launches, checkpoints and exits that
`ctitan compare` counts restarts and prices runs from: checked on real tiny runs against
what the test itself saw (the checkpoint directories on disk, the clock around the
process, the exit status, the signal it sent) and, for a resume, against the raw
metrics.jsonl read before the resume cut it back."""
import json
import os
import signal
import subprocess
import time

import pytest

import oracle
from conftest import BIN, CHILD_ENV, ROOT, TINY_CKPT, crashed, tiny_run
from test_dist import ENV as MPI_ENV, mpirun

STEPS = 10


@pytest.fixture
def setup(tmp_path):
    _, out, args = tiny_run(tmp_path, *TINY_CKPT, steps=STEPS)
    return out, args


def run(args, env=None, cmd=None, timeout=180):
    cmd = (cmd or [str(BIN)]) + [str(a) for a in args]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env or CHILD_ENV, capture_output=True, text=True, timeout=timeout)
    t1 = time.time()
    crashed(p.returncode, p.stderr, cmd)
    return p, t0, t1


def events(out):
    lines = (out / "events.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def ckpt_dirs(out):
    return sorted(int(p.name[5:]) for p in (out / "checkpoint").iterdir() if p.name.startswith("step-"))


def test_fresh_run(setup):
    out, args = setup
    p, t0, t1 = run(args)
    assert p.returncode == 0, p.stderr[-2000:]
    ev = events(out)
    kinds = [e["event"] for e in ev]
    assert kinds == ["start", "checkpoint", "checkpoint", "checkpoint", "exit"], kinds
    start, exit_ = ev[0], ev[-1]
    assert start["step"] == 0 and "resumed_from" not in start, start
    assert start["world"] == 1 and start["machines"] == 1 and start["steps"] == STEPS, start
    assert t0 <= start["launch_time"] <= start["time"] <= t1, (t0, start, t1)
    assert 0 <= start["startup_s"] <= t1 - t0
    # a checkpoint event for every step-N directory on disk, naming it, and no other
    ck = [e for e in ev if e["event"] == "checkpoint"]
    assert [e["step"] for e in ck] == ckpt_dirs(out) == [4, 8, 10], (ck, ckpt_dirs(out))
    for e in ck:
        assert os.path.samefile(e["path"], out / "checkpoint" / f"step-{e['step']}"), e
        assert e["kind"] == "full" and e["save_s"] >= 0 and e["mib"] > 0, e
    assert exit_["reason"] == "done" and exit_["step"] == STEPS, exit_
    assert 0 < exit_["wall_s"] <= t1 - t0, (exit_, t1 - t0)
    assert exit_["time"] <= t1 and exit_["cpu_s"] > 0
    assert "energy_j" in exit_ or exit_["energy_unavailable"], exit_
    times = [e["time"] for e in ev]
    assert times == sorted(times), times


def test_stop_then_resume_appends(setup):
    out, args = setup
    p, _, _ = run(args + ["--training.stop_at_step=5"])
    assert p.returncode == 75, p.stderr[-2000:]
    first = (out / "events.jsonl").read_text()
    ev = events(out)
    assert [e["event"] for e in ev] == ["start", "checkpoint", "checkpoint", "exit"], ev
    assert ev[-1]["reason"] == "stopped" and ev[-1]["step"] == 5, ev[-1]
    assert ev[2]["step"] == 5 and ev[2]["kind"] == "full", ev[2]
    p, t0, _ = run(args)
    assert p.returncode == 0, p.stderr[-2000:]
    text = (out / "events.jsonl").read_text()
    assert text.startswith(first), "the resume must append, never rewrite"
    ev = events(out)
    start = ev[4]
    assert start["event"] == "start" and start["step"] == 5, start
    assert os.path.samefile(start["resumed_from"], out / "checkpoint" / "step-5"), start
    assert start["load_s"] >= 0 and start["launch_time"] >= t0
    assert start["metrics_last_step"] == 5, start  # the stop wrote up to step 5: nothing to redo
    assert [e["event"] for e in ev[5:]] == ["checkpoint", "checkpoint", "exit"], ev[5:]
    assert ev[-1]["reason"] == "done" and ev[-1]["step"] == STEPS


def test_error_exit(setup):
    out, args = setup
    p, _, _ = run(args + ["--optimizer.lr=1e30", "--training.max_norm=1e30"])
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "diverged" in p.stderr, p.stderr[-2000:]
    ev = events(out)
    assert ev[0]["event"] == "start" and ev[-1]["event"] == "exit", ev
    x = ev[-1]
    assert x["reason"] == "error" and x["code"] == 1 and "diverged" in x["message"], x
    assert 1 <= x["step"] < STEPS


def killed_run(d):
    """A run in d/out SIGKILLed once metrics.jsonl has 8 lines (checkpoints every 3 steps):
    (its train command without training.steps, the dump folder, the raw metrics lines left,
    its stderr). test_compare.py resumes one too."""
    oracle.tiny_config(vocab=512, hidden=128, inter=256, layers=4, heads=4, kv_heads=2,
                       head_dim=32).save_pretrained(d / "model")
    data = oracle.write_bin(d / "d.bin", oracle.learnable_stream(400 * 65 + 5, 512, seed=3))
    out = d / "out"
    args = [str(BIN), "train", "--model.spec=hf", f"--model.hf_assets_path={d / 'model'}",
            f"--training.dataset_path={data}", "--training.seq_len=64", "--training.local_batch_size=4",
            "--training.seed=5", "--metrics.log_freq=1", "--metrics.peak_tflops=1",
            f"--job.dump_folder={out}", "--checkpoint.enable", "--checkpoint.interval=3",
            "--checkpoint.keep_latest_k=0"]
    p = subprocess.Popen(args + ["--training.steps=400"], cwd=ROOT, env=CHILD_ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if metrics.exists() and sum(1 for _ in metrics.open()) >= 8:
            break
        time.sleep(0.005)
    assert p.poll() is None, "the run ended before it could be killed (make it longer)"
    p.send_signal(signal.SIGKILL)
    _, err = p.communicate()
    assert p.returncode == -signal.SIGKILL
    raw = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
    return args, out, raw, err


def test_sigkill_keeps_lines_and_resume_appends(tmp_path):
    """A killed run leaves no exit but every line before the kill; the resume appends a
    start whose metrics_last_* are the raw metrics.jsonl's furthest step and latest time
    (the lines the resume then removes)."""
    args, out, raw, _ = killed_run(tmp_path)
    before = (out / "events.jsonl").read_text()
    ev = [json.loads(x) for x in before.splitlines()]  # every line whole
    assert ev[0]["event"] == "start" and all(e["event"] != "exit" for e in ev), ev
    ck = [e["step"] for e in ev if e["event"] == "checkpoint"]
    assert ck and ck == ckpt_dirs(out)[:len(ck)], (ck, ckpt_dirs(out))
    last_step = max(r["step"] for r in raw)
    last_time = max(r["time"] for r in raw)
    # resume with fewer steps so it ends soon
    q = subprocess.run(args + [f"--training.steps={last_step + 2}"], cwd=ROOT,
                       env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    crashed(q.returncode, q.stderr, args)
    assert q.returncode == 0, q.stderr[-2000:]
    text = (out / "events.jsonl").read_text()
    assert text.startswith(before)
    new = [json.loads(x) for x in text[len(before):].splitlines()]
    start = new[0]
    newest = max(s for s in ckpt_dirs(out) if s <= last_step)
    assert start["event"] == "start" and start["step"] == newest, (start, newest)
    assert os.path.samefile(start["resumed_from"], out / "checkpoint" / f"step-{newest}")
    assert start["metrics_last_step"] == last_step, (start, last_step)
    assert abs(start["metrics_last_time"] - last_time) < 1e-3, (start, last_time)
    assert new[-1]["event"] == "exit" and new[-1]["reason"] == "done"


def test_two_ranks_rank0_writes(setup):
    out, args = setup
    p, _, _ = run(args, env=MPI_ENV, cmd=mpirun() + ["-np", "2", str(BIN)])
    assert p.returncode == 0, p.stderr[-2000:]
    ev = events(out)
    assert [e["event"] for e in ev] == ["start", "checkpoint", "checkpoint", "checkpoint", "exit"], ev
    assert ev[0]["world"] == 2 and ev[0]["machines"] == 1, ev[0]


def fake_powercap(root, uj):
    for n in (0, 1):
        d = root / f"intel-rapl:{n}"
        d.mkdir(parents=True)
        (d / "energy_uj").write_text(f"{uj[n]}\n")
        (d / "max_energy_range_uj").write_text("262143328850\n")


@pytest.mark.parametrize("have", [True, False])
def test_energy(setup, tmp_path, have):
    out, args = setup
    pc = tmp_path / "powercap"
    if have:
        fake_powercap(pc, [123456, 789])  # counters that do not move: 0 J used
    p, _, _ = run(args + ["--training.steps=2"], env=dict(CHILD_ENV, CTITAN_POWERCAP=str(pc)))
    assert p.returncode == 0, p.stderr[-2000:]
    x = events(out)[-1]
    if have:
        assert x["energy_j"] == 0 and "energy_unavailable" not in x, x
    else:
        assert "energy_j" not in x and str(pc) in x["energy_unavailable"], x
