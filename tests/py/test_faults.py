"""Faults during a run (issue 17, part 3): a checkpoint damaged after it was written, the
disk filling up during a save, SIGTERM/SIGINT, an MPI rank killed mid-step.

Each fault is judged by what matters to the user: the error names the file, the exit code
is the documented one, no checkpoint that verified before the fault is lost, and the run
continued from what is left ends bit-identical (weights and AdamW moments) to an
uninterrupted run. docs/reliability.md, "Faults during a run", has the figures."""
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import oracle
from conftest import BIN, CHILD_ENV, LIB, ROOT, crashed
from test_dist import ENV as MPI_ENV, mpirun, rank_pids
from test_resume import args_for, final_tensors, losses

# Long enough that a signal or a kill sent on seeing "step: 3" (or 7) usually lands well
# before the end (a step of this model takes a few ms; see TRIES for the other case);
# every single-process run here shares one reference.
STEPS = 40
INTERVAL = 5


def fault_args(model_dir, data, out, *extra):
    """test_resume's run with STEPS steps and a checkpoint every INTERVAL steps."""
    base = [a for a in args_for(model_dir, data, out) if not a.startswith("--training.steps=")]
    return base + [f"--training.steps={STEPS}", f"--checkpoint.interval={INTERVAL}", *extra]


def run(cmd, timeout=120, env=CHILD_ENV, **kw):
    cmd = [str(c) for c in cmd]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    crashed(p.returncode, p.stderr, cmd)
    return p


def train(args, **kw):
    return run([BIN] + list(args), **kw)


class _CtErr(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * 1024), ("all_ranks", ctypes.c_int)]


_lib = None


def verify(d):
    """ckpt_verify's verdict on checkpoint directory d (libctitan's own check): '' if intact."""
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(str(LIB))
        _lib.ckpt_verify.argtypes = [ctypes.c_char_p, ctypes.POINTER(_CtErr)]
        _lib.ckpt_verify.restype = ctypes.c_int
    e = _CtErr()
    return "" if _lib.ckpt_verify(str(d).encode(), ctypes.byref(e)) == 0 else e.msg.decode(errors="replace")


def tree(folder):
    """{relative path: bytes} of every file under folder."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def intact(folder):
    """{step-N: its files' bytes} of the checkpoints of folder that verify."""
    folder = Path(folder)
    return {d.name: tree(d) for d in sorted(folder.iterdir())
            if d.is_dir() and d.name.startswith("step-") and not verify(d)}


def assert_none_lost(before, folder):
    """Every checkpoint that verified before a fault still verifies, with the same bytes."""
    for name, files in before.items():
        d = Path(folder) / name
        assert d.is_dir(), f"{d}: a checkpoint that verified before the fault is gone"
        assert not verify(d), f"{d}: verified before the fault, not after: {verify(d)}"
        assert tree(d) == files, f"{d}: its files changed"


def assert_same_run(ref, out, steps=STEPS):
    """Every step's loss equal and the final weights and moments bit-identical."""
    a, b = losses(ref), losses(out)
    assert sorted(b) == list(range(1, steps + 1)), f"steps logged: {sorted(b)}"
    diff = [(s, a[s], b[s]) for s in a if a[s] != b[s]]
    assert not diff, f"losses differ (step, uninterrupted, continued): {diff[:5]}"
    x, y = final_tensors(ref, steps), final_tensors(out, steps)
    assert x.keys() == y.keys()
    bad = [k for k in x if x[k] != y[k]]
    assert not bad, f"final weights / AdamW moments not bit-identical: {bad[:5]}"


def steps_in(folder):
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(d.name[5:]) for d in folder.iterdir() if re.fullmatch(r"step-\d+", d.name))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    cfg.save_pretrained(tmp / "model")  # config.json only: ctitan initialises from training.seed
    data = oracle.write_bin(tmp / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    return tmp, tmp / "model", data


@pytest.fixture(scope="module")
def reference(setup):
    tmp, model_dir, data = setup
    ref = tmp / "ref"
    p = train(fault_args(model_dir, data, ref))
    assert p.returncode == 0, p.stderr[-3000:]
    return ref


@pytest.fixture(scope="module")
def stopped(setup):
    """A run stopped after step 10 with checkpoints step-5 and step-10 (copied per test)."""
    tmp, model_dir, data = setup
    out = tmp / "stopped"
    p = train(fault_args(model_dir, data, out, "--training.stop_at_step=10"))
    assert p.returncode == 75, p.stderr[-3000:]
    assert steps_in(out / "checkpoint") == [5, 10]
    return out


def flip(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit, in the data (model, optim) or mid-JSON (manifest)
    path.write_bytes(bytes(raw))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# (name, what is done to step-10, the file the error must name, a word of its reason)
DAMAGE = [
    ("model_flipped", lambda d: flip(d / "model.safetensors"), "model.safetensors", "checksum"),
    ("optim_flipped", lambda d: flip(d / "optim.safetensors"), "optim.safetensors", "checksum"),
    ("model_deleted", lambda d: (d / "model.safetensors").unlink(), "model.safetensors", "missing"),
    ("state_deleted", lambda d: (d / "state.json").unlink(), "state.json", "missing"),
    ("manifest_truncated", lambda d: truncate(d / "manifest.json"), "manifest.json", "truncated"),
    ("manifest_deleted", lambda d: (d / "manifest.json").unlink(), "manifest.json", "missing"),
]


@pytest.mark.parametrize("name,damage,file,why", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_newest_falls_back_or_stops(setup, reference, stopped, tmp_path, name, damage, file, why):
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    ck = out / "checkpoint"
    good = intact(ck)
    assert set(good) == {"step-5", "step-10"}
    damage(ck / "step-10")
    named = str(ck / "step-10" / file)
    before = tree(ck)
    # checkpoint.fallback = false: exit 3 naming the file; nothing written
    p = train(fault_args(model_dir, data, out, "--checkpoint.fallback=false"))
    assert p.returncode == 3, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    assert named in p.stderr and why in p.stderr and "checkpoint.fallback" in p.stderr, p.stderr[-3000:]
    assert tree(ck) == before, "a run that stopped on a damaged checkpoint changed the folder"
    # the default: the damage is named, the run continues from step-5 and ends as if never hurt
    p = train(fault_args(model_dir, data, out))
    assert p.returncode == 0, p.stderr[-3000:]
    warn = [l for l in p.stderr.splitlines() if "skipping damaged checkpoint" in l]
    assert len(warn) == 1 and named in warn[0] and why in warn[0], p.stderr[-3000:]
    assert re.search(r"resuming from \S*/step-5 \(step 5\)", p.stderr), p.stderr[-3000:]
    assert_none_lost({"step-5": good["step-5"]}, ck)
    assert_same_run(reference, out)


def test_fallback_never_prunes_what_it_writes(setup, reference, stopped, tmp_path):
    """keep_latest_k = 1 after a fallback from a damaged step-10 to step-5: the run stopped
    at step 7 must keep step-7 (and step-5), not count the damaged step-10 as the one
    to keep (pruning checks sizes, not checksums) and delete everything intact."""
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    ck = out / "checkpoint"
    flip(ck / "step-10" / "model.safetensors")
    good = intact(ck)
    assert set(good) == {"step-5"}
    args = fault_args(model_dir, data, out, "--checkpoint.keep_latest_k=1")
    p = train(args + ["--training.stop_at_step=7"])
    assert p.returncode == 75, p.stderr[-3000:]
    assert steps_in(ck) == [5, 7, 10] and not verify(ck / "step-7"), (steps_in(ck), verify(ck / "step-7"))
    assert_none_lost(good, ck)
    p = train(args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"resuming from \S*/step-7 \(step 7\)", p.stderr), p.stderr[-3000:]
    assert steps_in(ck) == [STEPS], f"keep_latest_k = 1 once past step 10: {steps_in(ck)}"
    assert_same_run(reference, out)


def test_every_checkpoint_damaged_is_an_error(setup, stopped, tmp_path):
    """Nothing intact to continue from: exit 3 naming each damaged one, never a fresh start
    that would overwrite them (checkpoints, metrics and all, byte for byte)."""
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    ck = out / "checkpoint"
    flip(ck / "step-10" / "optim.safetensors")
    truncate(ck / "step-5" / "manifest.json")
    # every file but the folder's lock, which names the run that holds it (docs/checkpoints.md)
    files = lambda: {k: v for k, v in tree(out).items() if k != ".ctitan.lock"}
    before = files()
    p = train(fault_args(model_dir, data, out))
    assert p.returncode == 3, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    for f in ("step-10/optim.safetensors", "step-5/manifest.json"):
        assert str(ck / f) in p.stderr, f"{f} not named:\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if l.startswith("ctitan: error:")]
    assert len(err) == 1 and "step-10" in err[0] and "step-5" in err[0], p.stderr[-3000:]
    assert "step:" not in p.stdout, "it trained"
    assert files() == before, "the damaged run's files changed"


def in_small_tmpfs(cmd, mount, size, keep):
    """Runs cmd with a tmpfs of `size` bytes mounted at `mount` in a private mount namespace
    (as root; else in a user namespace), then copies what the tmpfs holds to `keep` (the
    namespace and its tmpfs end with the command). None where neither works (a container
    without the capability): the caller then limits the file size instead."""
    script = ('mount -t tmpfs -o size="$1" tmpfs "$2" || exit 99; shift 3; "$@"; rc=$?; '
              'cp -a "$0/." "$KEEP_DIR/" || exit 98; exit $rc')
    env = dict(CHILD_ENV, KEEP_DIR=str(keep))
    for ns in (["unshare", "-m", "--propagation", "private"], ["unshare", "-r", "-m", "--propagation", "private"]):
        if ns[1] == "-m" and os.geteuid() != 0:
            continue
        p = subprocess.run(ns + ["sh", "-c", script, str(mount), str(size), str(mount), "--"] + [str(c) for c in cmd],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        if p.returncode not in (99, 98) and "unshare:" not in p.stderr[:200]:
            crashed(p.returncode, p.stderr, cmd)
            return p
    print(f"no way to mount a small tmpfs here (unshare -m / -rm): {p.stderr[-500:]}")
    return None


def pages(n):
    return -(-n // 4096)


# Where step-10's save runs out of room (tmpfs counts whole 4 KiB pages per file): inside
# optim.safetensors (the streamed tensors), or after both tensor files and state.json, in
# the small files written whole (config.toml, config.json, the manifest).
ROOM = {
    "in_tensors": lambda f: sum(pages(len(b)) for b in f.values()) * 3 // 2,
    "in_small_files": lambda f: sum(pages(len(b)) for b in f.values())
    + sum(pages(len(f[n])) for n in ("model.safetensors", "optim.safetensors", "state.json")),
}


@pytest.mark.parametrize("where", list(ROOM))
def test_disk_full_while_saving(setup, reference, tmp_path, where):
    """The checkpoint folder on a tmpfs with room for step-5 and part of step-10. Exit 1
    naming the path and ENOSPC, no step-10 and no temporary directory left, step-5 intact;
    the same command then continues from it."""
    tmp, model_dir, data = setup
    room = ROOM[where](tree(reference / "checkpoint" / "step-5")) * 4096
    out = tmp_path / "run"
    ck = out / "checkpoint"
    ck.mkdir(parents=True)
    keep = tmp_path / "kept"
    keep.mkdir()
    t0 = time.monotonic()
    p = in_small_tmpfs([BIN] + fault_args(model_dir, data, out), ck, room, keep)
    took = time.monotonic() - t0
    if p is None:  # never a skip: the nearest fault this machine can make
        print("disk full: no tmpfs here, RLIMIT_FSIZE (EFBIG) instead")
        check_file_too_large(setup, reference, tmp_path / "fsize")
        return
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if l.startswith("ctitan: error:")]
    assert len(err) == 1 and str(ck) in err[0] and "No space left on device" in err[0], p.stderr[-3000:]
    assert "saved checkpoint" in p.stderr and "step-5" in p.stderr, p.stderr[-3000:]
    assert sorted(os.listdir(keep)) == ["step-5"], f"left on the full disk: {sorted(os.listdir(keep))}"
    assert not verify(keep / "step-5"), verify(keep / "step-5")
    kept, ref5 = tree(keep / "step-5"), tree(reference / "checkpoint" / "step-5")
    for f in ("model.safetensors", "optim.safetensors", "state.json"):  # config.toml names the run's folder
        assert kept[f] == ref5[f], f"step-5/{f} differs from the uninterrupted run's"
    # continue, on a disk with room, from what the full one kept
    shutil.rmtree(ck)
    shutil.copytree(keep, ck)
    p = train(fault_args(model_dir, data, out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"resuming from \S*/step-5 \(step 5\)", p.stderr), p.stderr[-3000:]
    assert_same_run(reference, out)
    print(f"disk full ({where}): the failed run took {took:.1f} s: {err[0]}")


def check_file_too_large(setup, reference, base):
    """A run stopped at step 5 continues under RLIMIT_FSIZE between the sizes of
    model.safetensors and optim.safetensors: step-10's save fails with EFBIG. Exit 1 naming
    the path, no step-10 nor temporary directory, step-5 as it was; then it continues."""
    tmp, model_dir, data = setup
    out, ck = base / "run", base / "run" / "checkpoint"
    p = train(fault_args(model_dir, data, out, "--training.stop_at_step=5"))
    assert p.returncode == 75, p.stderr[-3000:]
    before = intact(ck)
    assert set(before) == {"step-5"}
    limit = len(before["step-5"]["model.safetensors"]) + 4096
    assert len(before["step-5"]["optim.safetensors"]) > limit

    def limited():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = train(fault_args(model_dir, data, out), preexec_fn=limited)
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if l.startswith("ctitan: error:")]
    assert len(err) == 1 and str(ck) in err[0] and "File too large" in err[0], p.stderr[-3000:]
    assert sorted(os.listdir(ck)) == ["step-5"], f"left behind: {sorted(os.listdir(ck))}"
    assert_none_lost(before, ck)
    p = train(fault_args(model_dir, data, out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"resuming from \S*/step-5 \(step 5\)", p.stderr), p.stderr[-3000:]
    assert_same_run(reference, out)
    return err[0]


def test_file_too_large_while_saving(setup, reference, tmp_path):
    """The file-size limit's EFBIG, another write error of a save (and what the disk-full
    test falls back to where no tmpfs can be mounted)."""
    print(f"file too large: {check_file_too_large(setup, reference, tmp_path)}")


def freeze(pid):
    """SIGSTOPs pid: True once it is stopped, False when it had already ended (a run that
    outran the test: the fault never landed, and the caller tries again)."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    for _ in range(2000):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in "TtZX":
            return state in "Tt"
        time.sleep(0.001)
    return False


TRIES = 3  # runs that end before the fault lands (a loaded machine) are started again


def stop_with(sig, args, out, at_step=3):
    """Starts a run, freezes it (SIGSTOP) on seeing "step: at_step", queues `sig`, lets it go
    on: the signal lands mid-run however loaded the machine is. (rc, stdout, stderr), or
    None when the run had ended before it could be frozen."""
    cmd = [str(BIN)] + [str(a) for a in args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, landed = [], False
    try:
        for line in p.stdout:
            seen.append(line)
            if line.startswith(f"step: {at_step} "):
                landed = freeze(p.pid)
                # frozen in its last step, it would just finish: the fault would not land
                if landed and max(losses(out), default=0) >= STEPS - 1:
                    landed = False
                    p.send_signal(signal.SIGCONT)
                if landed:
                    p.send_signal(sig)
                    p.send_signal(signal.SIGCONT)
                break
        # the rest through the same reader: communicate() reads the raw pipe, and lines the
        # loop's reader had already buffered (a fast run's steps after at_step) were lost
        timer = threading.Timer(60, p.kill)  # a hung run still ends the test
        timer.start()
        try:
            rest, err = p.stdout.read(), p.stderr.read()
            p.wait()
        finally:
            timer.cancel()
    finally:
        if p.poll() is None:
            p.kill()
    crashed(p.returncode, err, cmd)
    assert landed or p.returncode == 0, f"exit {p.returncode} before the signal\n{err[-3000:]}"
    return (p.returncode, "".join(seen) + rest, err) if landed else None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_with_a_checkpoint(setup, reference, tmp_path, sig):
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    args = fault_args(model_dir, data, out)
    for _ in range(TRIES):
        shutil.rmtree(out, ignore_errors=True)
        got = stop_with(sig, args, out)
        if got:
            break
    assert got, f"the run ended before the signal could be sent, {TRIES} times"
    rc, stdout, err = got
    assert rc == 75, f"exit {rc}\n{err[-3000:]}"
    m = re.search(r"stopped after step (\d+) \(signal\)", err)
    assert m, err[-3000:]
    n = int(m.group(1))
    assert 3 <= n < STEPS, n
    # the step it says, the last step it logged, and its newest checkpoint agree
    logged = [int(x) for x in re.findall(r"^step: (\d+) ", stdout, re.M)]
    assert logged and logged[-1] == n, f"stdout's last step {logged[-1:]} vs {n}"
    assert max(losses(out)) == n
    ck = out / "checkpoint"
    assert steps_in(ck)[-1:] == [n] and not verify(ck / f"step-{n}"), (steps_in(ck), verify(ck / f"step-{n}"))
    assert f'"step": {n},' in (ck / f"step-{n}" / "manifest.json").read_text()
    before = intact(ck)
    assert set(before) == {f"step-{s}" for s in steps_in(ck)}
    p = train(args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(rf"resuming from \S*/step-{n} \(step {n}\)", p.stderr), p.stderr[-3000:]
    assert_none_lost(before, ck)
    assert_same_run(reference, out)


def test_signal_during_validation_and_save_stops_after_them(setup, reference, tmp_path):
    """A signal that comes after a step's stop check, during its validation or its periodic
    save (seconds, where the step takes milliseconds), stops the run right after that save:
    exit 75 at the same step, with the checkpoint just written and no other, where it ran
    one more step and saved a second full checkpoint. Validation of 3000 batches (about a
    second here) holds the window open: the signal goes 0.2 s after "step: 5" is logged,
    the stop check being microseconds after that line. A signal that still landed before
    the check (the run then skips validation, as a stop does) is tried again."""
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    val = ["--validation.enable", f"--validation.dataset_path={data}", "--validation.freq=5",
           "--validation.steps=3000"]
    args = fault_args(model_dir, data, out, *val)
    for _ in range(TRIES):
        shutil.rmtree(out, ignore_errors=True)
        cmd = [str(BIN)] + [str(a) for a in args]
        p = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = []
        try:
            for line in p.stdout:
                seen.append(line)
                if line.startswith("step: 5 "):
                    time.sleep(0.2)
                    p.send_signal(signal.SIGINT)
                    break
            rest, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        crashed(p.returncode, err, cmd)
        stdout = "".join(seen) + rest
        if "validate step: 5 " in stdout:
            break
    assert "validate step: 5 " in stdout, f"the signal landed before the stop check, {TRIES} times"
    assert p.returncode == 75, f"exit {p.returncode}\n{err[-3000:]}"
    said = [l for l in err.splitlines() if "stopped" in l or "saved" in l]
    assert re.search(r"stopped after step 5 \(signal\)", err), said
    logged = [int(x) for x in re.findall(r"^step: (\d+) ", stdout, re.M)]
    assert logged[-1] == 5 and max(losses(out)) == 5, f"steps after the signal: {logged[-3:]}"
    saves = re.findall(r"saved checkpoint \S+/(step-\d+):", err)
    assert saves == ["step-5"], f"saves: {saves}"
    ck = out / "checkpoint"
    assert steps_in(ck) == [5] and not verify(ck / "step-5"), (steps_in(ck), verify(ck / "step-5"))
    ev = [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in ev] == [("start", 0), ("checkpoint", 5), ("exit", 5)], ev
    assert ev[-1]["reason"] == "stopped", ev[-1]
    # the same command, without the slow validation, continues to the uninterrupted run's bits
    p = train(fault_args(model_dir, data, out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"resuming from \S*/step-5 \(step 5\)", p.stderr), p.stderr[-3000:]
    assert_same_run(reference, out)


MPI_ARGS = ["--parallelism.data_parallel_shard_degree=2"]


@pytest.fixture(scope="module")
def mpi_reference(setup):
    tmp, model_dir, data = setup
    ref = tmp / "mpi_ref"
    p = run(mpirun() + ["-np", "2", BIN] + fault_args(model_dir, data, ref, *MPI_ARGS), env=MPI_ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return ref


def kill_rank_1(cmd, ck):
    """Runs the job, freezes rank 1 once "step: 7" is logged, notes the checkpoints that
    verify, kills rank 1. (mpirun's exit, its output after the kill, seconds from the kill
    to its exit, the checkpoints that verified), or None when the job had ended first."""
    p = subprocess.Popen(cmd, env=MPI_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if line.startswith("step: 7 "):
                break
        pids = rank_pids(p.pid)
        if 1 not in pids or not freeze(pids[1]):
            p.communicate(timeout=60)
            assert p.returncode == 0, "".join(seen)[-3000:]
            return None
        before = intact(ck)
        assert "step-5" in before, sorted(before)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        rest = p.stdout.read()
        rc = p.wait(timeout=60)
        return rc, rest, time.monotonic() - t0, before
    finally:
        if p.poll() is None:
            p.kill()


def test_killed_rank_ends_the_job_and_it_resumes(setup, mpi_reference, tmp_path):
    """FSDP over 2 ranks; rank 1 frozen after step 7 is logged (so the job is mid-step,
    rank 0 waiting on it), then killed. The job must end within a bound, saying which rank
    died, lose no checkpoint, and the same command must continue from the newest one to
    the uninterrupted run's bits."""
    tmp, model_dir, data = setup
    out = tmp_path / "run"
    cmd = mpirun() + ["-np", "2", str(BIN)] + [str(a) for a in fault_args(model_dir, data, out, *MPI_ARGS)]
    for _ in range(TRIES):
        shutil.rmtree(out, ignore_errors=True)
        got = kill_rank_1(cmd, out / "checkpoint")
        if got:
            break
    assert got, f"the job ended before rank 1 could be killed, {TRIES} times"
    rc, rest, took, before = got
    ck = out / "checkpoint"
    crashed(rc, rest, cmd)
    assert rc != 0 and "rank 1" in rest and "signal 9" in rest, rest[-2000:]
    assert took < 5, f"the job took {took:.1f} s to end after rank 1 was killed"
    assert_none_lost(before, ck)
    newest = max(int(k[5:]) for k in intact(ck))  # rank 0 may have published one more after `before`
    p = run(cmd, env=MPI_ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(rf"resuming from \S*/step-{newest} \(step {newest}\)", p.stderr), p.stderr[-3000:]
    assert_none_lost(before, ck)
    assert_same_run(mpi_reference, out)
    print(f"killed rank: the job ended {took:.2f} s after rank 1 was killed (mpirun exit {rc})")
