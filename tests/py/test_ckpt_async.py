"""checkpoint.async_mode (docs/checkpoints.md, "Asynchronous saves").

A save between steps is staged (a copy of everything the checkpoint holds) and written by a
background thread while training goes on; the next save, the end of the run and its exits
wait for it. Checked here: the files are the synchronous run's, byte for byte, and the
losses the same; a run resumed from a checkpoint written in the background trains as the
uninterrupted one; a run killed while the thread writes leaves only a temporary directory
that resume ignores (and clears); keep_latest_k prunes as a synchronous run does; FSDP 2
under mpirun gives the same bytes; a bad value is refused naming the key.
CTITAN_CKPT_ASYNC_TEST_SLEEP (test-only) makes the thread pause halfway through its write, so
that the step loop really runs on while a save is in flight."""
import os
import shutil
import signal
import subprocess
import time

import pytest

import oracle
from conftest import BIN, crashed, tiny_run
from test_dist import losses

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_WAIT_POLICY="passive",
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
FILES = ("model.safetensors", "optim.safetensors", "state.json", "config.json")  # config.toml names the folder
SAVE = ["--checkpoint.enable", "--checkpoint.interval=2", "--checkpoint.last_save_model_only=false"]
ASYNC = "--checkpoint.async_mode=async"


def run(args, code=0, sleep=None, timeout=300, preexec=None):
    """ctitan with args, its exit code asserted; sleep: the writer thread pauses halfway
    (CTITAN_CKPT_ASYNC_TEST_SLEEP); preexec: run in the child before exec (limits)."""
    cmd = [str(BIN)] + [str(a) for a in args]
    env = dict(ENV, CTITAN_CKPT_ASYNC_TEST_SLEEP=str(sleep)) if sleep else ENV
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == code, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-3000:]}"
    return p


def steps_in(out):
    return sorted(int(p.name[5:]) for p in (out / "checkpoint").glob("step-*"))


def same_files(a, b, step, files=FILES):
    for f in files:
        x, y = (a / "checkpoint" / f"step-{step}" / f).read_bytes(), (b / "checkpoint" / f"step-{step}" / f).read_bytes()
        assert x == y, f"step-{step}/{f} differs between {a.name} and {b.name}"


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The synchronous run: saves at steps 2, 4 and 6 (the last, full)."""
    d = tmp_path_factory.mktemp("ckasync")
    _, out, args = tiny_run(d, *SAVE, layers=2, steps=6, out=d / "sync")
    run(args)
    return d, out


def test_async_checkpoints_are_the_synchronous_ones(sync_run, tmp_path):
    """async and async_with_pinned_mem write the synchronous run's files byte for byte and
    train the same losses; the log says each save was staged and finished in the background,
    and the next save waited for the one in flight (the thread pauses 0.4 s mid-write)."""
    d, ref = sync_run
    for mode in ("async", "async_with_pinned_mem"):
        _, out, args = tiny_run(d, *SAVE, f"--checkpoint.async_mode={mode}", layers=2, steps=6, out=tmp_path / mode)
        p = run(args, sleep=0.4)
        assert steps_in(out) == steps_in(ref) == [2, 4, 6]
        for s in (2, 4, 6):
            same_files(ref, out, s)
        assert losses(out) == losses(ref)
        for s in (2, 4):  # the last save (6) is synchronous
            assert f"staged checkpoint step-{s} " in p.stderr, p.stderr[-2000:]
            assert f"checkpoint/step-{s}: " in p.stderr and "finished in the background in" in p.stderr, p.stderr
            assert f"waited" in p.stderr and f"for the checkpoint of step {s} written in the background" in p.stderr
        assert "staged checkpoint step-6" not in p.stderr
        ev = [r for r in oracle.read_metrics(out / "events.jsonl") if r.get("event") == "checkpoint"]
        assert [r["step"] for r in ev] == [2, 4, 6], ev


def test_resume_from_async_checkpoint_matches_uninterrupted(sync_run, tmp_path):
    """An async run's step-2 (written in the background), resumed with the same command: the
    steps after it train the uninterrupted run's losses and its final checkpoint's bytes."""
    d, ref = sync_run
    _, out, args = tiny_run(d, *SAVE, ASYNC, layers=2, steps=6, out=tmp_path / "a")
    run(args, sleep=0.2)
    for s in (4, 6):
        shutil.rmtree(out / "checkpoint" / f"step-{s}")
    p = run(args)
    assert "step-2" in p.stderr and "resum" in p.stderr.lower(), p.stderr[-2000:]
    assert losses(out) == losses(ref)
    same_files(ref, out, 6)


def test_kill_during_background_write_leaves_nothing_taken(sync_run, tmp_path):
    """SIGKILL while the thread is halfway through step-2 (paused there): no step-2 exists, only
    its temporary directory; the same command again starts afresh (no checkpoint to take),
    clears the leftover and ends with the uninterrupted run's checkpoints."""
    d, ref = sync_run
    _, out, args = tiny_run(d, *SAVE, ASYNC, layers=2, steps=6, out=tmp_path / "k")
    log = tmp_path / "k.log"
    with open(log, "w") as f:
        p = subprocess.Popen([str(BIN)] + [str(a) for a in args], env=dict(ENV, CTITAN_CKPT_ASYNC_TEST_SLEEP="60"),
                             stderr=f, stdout=subprocess.DEVNULL)
        try:
            deadline = time.time() + 120
            tmp = []
            while time.time() < deadline and p.poll() is None:
                tmp = [t for t in (out / "checkpoint").glob(".step-2.tmp-*") if (t / "model.safetensors").exists()]
                if tmp and (tmp[0] / "model.safetensors").stat().st_size > 0 and "staged checkpoint step-2" in \
                        log.read_text():
                    break
                time.sleep(0.05)
            assert tmp and p.poll() is None, f"no save in flight:\n{log.read_text()[-2000:]}"
            time.sleep(0.3)  # the step loop runs on meanwhile
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
    assert not (out / "checkpoint" / "step-2").exists(), "a step-2 appeared though its write was cut short"
    assert (out / "checkpoint" / f".step-2.tmp-{p.pid}").is_dir()
    assert steps_in(out) == []
    q = run(args)
    assert f".step-2.tmp-{p.pid}" in q.stderr, q.stderr[-2000:]  # the note naming the stale entry removed
    assert not list((out / "checkpoint").glob(".step-*"))
    assert steps_in(out) == [2, 4, 6]
    for s in (2, 4, 6):
        same_files(ref, out, s)
    assert losses(out) == losses(ref)


def test_keep_latest_k_as_synchronous(sync_run, tmp_path):
    """keep_latest_k = 2 over saves at 2, 4, 6, all written in the background (the final save
    is a Hugging Face export at 8, which prunes nothing): the run keeps what the synchronous
    run keeps, pruned by the thread once each save is complete."""
    d, _ = sync_run
    kept = {}
    for name, extra, sleep in (("sync", [], None), ("async", [ASYNC], 0.3)):
        _, out, args = tiny_run(d, *SAVE, "--checkpoint.keep_latest_k=2", "--checkpoint.last_save_in_hf", *extra,
                                layers=2, steps=8, out=tmp_path / name)
        run(args, sleep=sleep)
        kept[name] = steps_in(out)
    assert kept["sync"] == [4, 6, 8]
    assert kept["async"] == kept["sync"]


def test_lora_async_adapter_is_the_synchronous_one(sync_run, tmp_path):
    """A LoRA run: the checkpoint written in the background also holds the PEFT adapter
    (gathered at the stage, written into step-N after its rename), byte for byte the
    synchronous run's."""
    d, _ = sync_run
    outs = {}
    for name, extra, sleep in (("sync", [], None), ("async", [ASYNC], 0.2)):
        _, out, args = tiny_run(d, *SAVE, "--lora.rank=4", *extra, layers=2, steps=4, out=tmp_path / name)
        run(args, sleep=sleep)
        outs[name] = out
    for f in FILES + ("adapter_config.json", "adapter_model.safetensors"):
        a, b = (outs[k] / "checkpoint" / "step-2" / f for k in ("sync", "async"))
        assert a.read_bytes() == b.read_bytes(), f"step-2/{f} differs"


def test_fsdp2_async_is_the_synchronous_save(sync_run, tmp_path):
    """FSDP 2 under mpirun: async's files (gathered to rank 0, whose thread writes them) are
    byte for byte the synchronous save's (each rank writing its part), losses the same."""
    from test_dist import mpirun
    d, _ = sync_run
    outs = {}
    for name, extra in (("sync", []), ("async", [ASYNC])):
        _, out, args = tiny_run(d, *SAVE, "--parallelism.data_parallel_shard_degree=2", *extra, layers=2, steps=4,
                                out=tmp_path / name)
        cmd = mpirun() + ["-x", "CTITAN_CKPT_ASYNC_TEST_SLEEP", "-np", "2", str(BIN), *[str(a) for a in args]]
        p = subprocess.run(cmd, env=dict(ENV, CTITAN_CKPT_ASYNC_TEST_SLEEP="0.3"), capture_output=True, text=True,
                           timeout=300)
        crashed(p.returncode, p.stderr, cmd)
        assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-3000:]}"
        if name == "async":
            assert "staged checkpoint step-2 " in p.stderr and "finished in the background" in p.stderr, p.stderr
        outs[name] = out
    assert steps_in(outs["sync"]) == steps_in(outs["async"]) == [2, 4]
    for s in (2, 4):
        same_files(outs["sync"], outs["async"], s)
    assert losses(outs["sync"]) == losses(outs["async"])


def test_bad_async_mode_refused_naming_the_key(tmp_path):
    _, _, args = tiny_run(tmp_path, steps=1)
    p = run(args + ["--checkpoint.async_mode=sync"], code=2)
    assert "checkpoint.async_mode" in p.stderr and "async_with_pinned_mem" in p.stderr, p.stderr


def test_dry_run_plans_the_staging_copy(tmp_path):
    """The dry run's plan has a line for the staging copy (one more of the checkpoint's fp32
    parameters and moments) with async_mode, none without."""
    _, _, args = tiny_run(tmp_path, steps=1)
    base = run(args + ["--dry-run"]).stdout
    on = run(args + ["--dry-run", ASYNC]).stdout
    assert "checkpoint staging" not in base
    line = [ln for ln in on.splitlines() if "checkpoint staging" in ln]
    assert line, on
