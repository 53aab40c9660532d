"""review14: the staging copy async saves keep from one save to the next (docs/checkpoints.md,
"Asynchronous saves") where test_ckpt_async_stage.py does not go: a LoRA run (the checkpoint
holds the trained adapters' floats, and the PEFT adapter beside them) whose second background
save reuses the first's buffer, then ends in a synchronous model-only save
(checkpoint.last_save_model_only, its default true); and a run resumed from its step-2 whose
new process stages again (a new buffer, then the reused one). The oracle is the synchronous
run's bytes: every checkpoint file and the losses. The writer thread pauses halfway through each
write (CTITAN_CKPT_ASYNC_TEST_SLEEP), so a stage into the buffer before that thread is done
with it would put the later step's floats into the earlier checkpoint."""
import shutil

from conftest import tiny_run
from test_ckpt_async import ASYNC, losses, run, steps_in

SKIP = ("config.toml", "manifest.json")  # config.toml names the dump folder; the manifest hashes it
SAVE = ["--checkpoint.enable", "--checkpoint.interval=2"]  # the last save model-only (the default)


def _files(out, step):
    d = out / "checkpoint" / f"step-{step}"
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name not in SKIP}


def _same(ref, out, steps):
    for s in steps:
        a, b = _files(ref, s), _files(out, s)
        assert sorted(a) == sorted(b), (s, sorted(a), sorted(b))
        bad = [n for n in a if a[n] != b[n]]
        assert not bad, f"step-{s}: {bad} differ from the synchronous run's"


def _staged(stderr):
    return [ln for ln in stderr.splitlines() if "staged checkpoint" in ln]


def test_lora_async_saves_reuse_the_buffer_then_model_only(tmp_path):
    d = tmp_path
    lora = ["--lora.rank=4"]
    _, ref, args = tiny_run(d, *SAVE, *lora, layers=2, steps=6, out=d / "sync")
    run(args)
    _, out, args = tiny_run(d, *SAVE, *lora, ASYNC, layers=2, steps=6, out=d / "async")
    p = run(args, sleep=0.3)
    st = _staged(p.stderr)
    assert len(st) == 2 and "step-2 " in st[0] and "(a new staging copy)" in st[0], st
    assert "step-4 " in st[1] and "(the previous save's staging copy)" in st[1], st
    assert "model-only checkpoint" in p.stderr and "step-6" in p.stderr, p.stderr[-2000:]
    assert steps_in(out) == steps_in(ref) == [2, 4, 6]
    assert "adapter_model.safetensors" in _files(ref, 4)
    _same(ref, out, (2, 4, 6))
    assert losses(out) == losses(ref)


def test_resumed_run_stages_again(tmp_path):
    d = tmp_path
    _, ref, args = tiny_run(d, *SAVE, layers=2, steps=8, out=d / "sync")
    run(args)
    _, out, args = tiny_run(d, *SAVE, ASYNC, layers=2, steps=8, out=d / "async")
    run(args, sleep=0.2)
    for s in (4, 6, 8):
        shutil.rmtree(out / "checkpoint" / f"step-{s}")
    p = run(args, sleep=0.3)
    assert "resum" in p.stderr.lower() and "step-2" in p.stderr, p.stderr[-2000:]
    st = _staged(p.stderr)
    assert len(st) == 2 and "step-4 " in st[0] and "(a new staging copy)" in st[0], st
    assert "step-6 " in st[1] and "(the previous save's staging copy)" in st[1], st
    assert steps_in(out) == steps_in(ref) == [2, 4, 6, 8]
    _same(ref, out, (2, 4, 6, 8))
    assert losses(out) == losses(ref)
