"""review11: checkpoint.async_mode's corners the first tests left out (docs/checkpoints.md,
"Asynchronous saves").

- a write that fails in the background thread (a file-size limit: optim.safetensors cannot be
  written) ends the run non-zero at the next wait, naming the write's error, with no step-N
  that looks complete and no later save staged after it;
- a stop signal (SIGUSR1) while a save is in flight: the in-flight save completes, the stop's
  own checkpoint follows, and resuming trains the uninterrupted run's losses and bytes;
- enable_first_step_checkpoint with the run's end reached while the step before's save is
  still being written (and the same with last_save_in_hf): every checkpoint is the synchronous
  run's, byte for byte;
- PP, TP and LoRA under FSDP under mpirun, with keep_latest_k: async's files are the
  synchronous run's and it keeps the same ones.
CTITAN_CKPT_ASYNC_TEST_SLEEP (test-only) pauses the thread halfway through its write."""
import resource
import signal
import subprocess
import time

import pytest

import oracle
from conftest import BIN, crashed, tiny_run
from test_ckpt_async import ASYNC, ENV, FILES, SAVE, losses, run, same_files, steps_in


def small_files():
    """In the child: files may not grow past 150 kB (the tiny model's optim.safetensors is
    195 kB, everything else a few kB); SIGXFSZ ignored so that the write fails with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))


def test_write_failing_in_thread_ends_run_nonzero(tmp_path):
    """The save of step 2 fails in the background (EFBIG on optim.safetensors): the run goes on
    to step 3 and 4, and the wait before step 4's save reports it: exit 1 naming the file, no
    step-2 or step-4 directory, events.jsonl's exit line not ok and no checkpoint line."""
    _, out, args = tiny_run(tmp_path, *SAVE, ASYNC, layers=2, steps=6)
    p = run(args, code=1, sleep=0.3, preexec=small_files)
    assert "staged checkpoint step-2" in p.stderr, p.stderr[-2000:]
    assert "optim.safetensors" in p.stderr, p.stderr[-2000:]
    assert "staged checkpoint step-4" not in p.stderr, p.stderr[-2000:]
    assert "saved checkpoint" not in p.stderr, p.stderr[-2000:]
    assert steps_in(out) == []
    assert max(losses(out)) < 6, "the run went on past the failed save's wait"
    ev = oracle.read_metrics(out / "events.jsonl")
    assert not [r for r in ev if r.get("event") == "checkpoint"], ev
    ex = [r for r in ev if r.get("event") == "exit"]
    assert ex and ex[-1].get("code", ex[-1].get("rc")) not in (0, None), ev


def test_write_failing_in_thread_at_the_run_end(tmp_path):
    """The same failure where the only background save is the one the run's end waits for
    (interval 2, steps 3, the last save model-only and so small enough to write): exit 1."""
    _, out, args = tiny_run(tmp_path, "--checkpoint.enable", "--checkpoint.interval=2", ASYNC, layers=2, steps=3)
    p = run(args, code=1, sleep=0.3, preexec=small_files)
    assert "optim.safetensors" in p.stderr, p.stderr[-2000:]
    assert 2 not in steps_in(out)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The synchronous run: first-step checkpoint, saves at 1, 2, 4 and 5 (the last, full)."""
    d = tmp_path_factory.mktemp("r11async")
    _, out, args = tiny_run(d, *SAVE, "--checkpoint.enable_first_step_checkpoint", layers=2, steps=5,
                            out=d / "sync")
    run(args)
    return d, out, args


def test_first_step_and_end_while_writing(ref, tmp_path):
    """async with enable_first_step_checkpoint: step 1 and step 2 are written in the background
    (2 waits for 1), step 4's is still being written when step 5 ends the run: every checkpoint
    the synchronous run's bytes, every loss the same."""
    d, sync, _ = ref
    _, out, args = tiny_run(d, *SAVE, "--checkpoint.enable_first_step_checkpoint", ASYNC, layers=2, steps=5,
                            out=tmp_path / "a")
    p = run(args, sleep=0.5)
    for s in (1, 2, 4):
        assert f"staged checkpoint step-{s} " in p.stderr, p.stderr[-2000:]
    assert steps_in(out) == steps_in(sync) == [1, 2, 4, 5]
    for s in (1, 2, 4, 5):
        same_files(sync, out, s)
    assert losses(out) == losses(sync)


def test_last_save_in_hf_waits_for_background_save(ref, tmp_path):
    """last_save_in_hf: the run's end is no checkpoint save, only the HF export; step 4's
    background save (paused 1 s) must still be complete and the synchronous run's."""
    d, sync, _ = ref
    _, out, args = tiny_run(d, *SAVE, "--checkpoint.enable_first_step_checkpoint", "--checkpoint.last_save_in_hf",
                            ASYNC, layers=2, steps=5, out=tmp_path / "hf")
    run(args, sleep=1.0)
    assert steps_in(out) == [1, 2, 4, 5]  # step-5: the HF export
    assert not (out / "checkpoint" / "step-5" / "optim.safetensors").exists()
    for s in (1, 2, 4):
        same_files(sync, out, s)


def test_stop_signal_while_save_in_flight(ref, tmp_path):
    """SIGUSR1 while step 2's save is paused mid-write (2 s): the run stops after the step the
    signal came in (exit 75, preempted) with step 2 complete and the stop's checkpoint after it; the same
    command resumes and trains the uninterrupted run's losses and final bytes."""
    d, sync, _ = ref
    _, out, args = tiny_run(d, *SAVE, "--checkpoint.enable_first_step_checkpoint", ASYNC, layers=2, steps=5,
                            out=tmp_path / "s")
    log = tmp_path / "s.log"
    with open(log, "w") as f:
        p = subprocess.Popen([str(BIN)] + [str(a) for a in args], env=dict(ENV, CTITAN_CKPT_ASYNC_TEST_SLEEP="2"),
                             stderr=f, stdout=subprocess.DEVNULL)
        try:
            deadline = time.time() + 120
            while time.time() < deadline and p.poll() is None and "staged checkpoint step-2" not in log.read_text():
                time.sleep(0.02)
            assert p.poll() is None, log.read_text()[-2000:]
            p.send_signal(signal.SIGUSR1)
            rc = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = log.read_text()
    crashed(rc, text, args)
    assert rc == 75, text[-2000:]
    got = steps_in(out)
    assert got[:2] == [1, 2] and len(got) == 3 and got[2] in (3, 4), (got, text[-2000:])
    assert not list((out / "checkpoint").glob(".step-*")), "a temporary directory was left"
    same_files(sync, out, 2)
    run(args)
    assert losses(out) == losses(sync)
    same_files(sync, out, 5)


def mpi_run(args, np=2, sleep=None):
    from test_dist import mpirun
    cmd = mpirun() + ["-x", "CTITAN_CKPT_ASYNC_TEST_SLEEP", "-np", str(np), str(BIN), *[str(a) for a in args]]
    p = subprocess.run(cmd, env=dict(ENV, CTITAN_CKPT_ASYNC_TEST_SLEEP=str(sleep or "")), capture_output=True,
                       text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.parametrize("name,flags,files", [
    ("pp", ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=1"], FILES),
    ("tp", ["--parallelism.tensor_parallel_degree=2"], FILES),
    ("lora_fsdp", ["--parallelism.data_parallel_shard_degree=2", "--lora.rank=4"],
     FILES + ("adapter_model.safetensors", "adapter_config.json")),
])
def test_mpirun_async_is_the_synchronous_save(ref, tmp_path, name, flags, files):
    """Under mpirun (2 ranks), keep_latest_k = 2 over saves at 1, 2, 4 and the HF export at 5
    (which prunes nothing, so the pruning seen is the thread's): async (paused 0.3 s
    mid-write) keeps the synchronous run's checkpoints, byte for byte."""
    d, _, _ = ref
    outs = {}
    for mode, extra, sleep in (("sync", [], None), ("async", [ASYNC], 0.3)):
        _, out, args = tiny_run(d, *SAVE, "--checkpoint.enable_first_step_checkpoint", "--checkpoint.keep_latest_k=2",
                                "--checkpoint.last_save_in_hf", *flags, *extra, layers=2, steps=5, out=tmp_path / mode)
        p = mpi_run(args, sleep=sleep)
        if mode == "async":
            assert "staged checkpoint step-2 " in p.stderr, p.stderr[-2000:]
        outs[mode] = out
    assert steps_in(outs["sync"]) == steps_in(outs["async"]) == [2, 4, 5]
    for s in (2, 4):
        same_files(outs["sync"], outs["async"], s, files)
    hf = sorted(f.name for f in (outs["sync"] / "checkpoint" / "step-5").iterdir() if f.name != "config.toml")
    assert hf and hf == sorted(f.name for f in (outs["async"] / "checkpoint" / "step-5").iterdir()
                               if f.name != "config.toml")
    same_files(outs["sync"], outs["async"], 5, hf)
    assert losses(outs["sync"]) == losses(outs["async"])
