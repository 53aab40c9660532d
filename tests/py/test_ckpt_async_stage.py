"""checkpoint.async_mode's staging copy is kept from one save to the next (docs/checkpoints.md,
"Asynchronous saves"): the first save allocates it, the later ones copy into the same buffer,
which the run only reuses once the thread writing the previous save is done with it.

One run with saves at steps 2, 4 and 6 in the background (8, the last, synchronous), the thread
pausing halfway through each write (CTITAN_CKPT_ASYNC_TEST_SLEEP) while the steps run on: the
log says the second and third stages reused the first's buffer, and every checkpoint is the
synchronous run's, byte for byte. A stage into the buffer while the paused thread still reads
its second half would put a later step's floats in the earlier checkpoint's files. The
embedding (vocab 16384 x hidden 64, 4 MB a tensor) is big enough that the stage copies it in
several chunks over two threads."""
import pytest

import oracle
from test_ckpt_async import ASYNC, FILES, losses, run, same_files, steps_in

VOCAB = 16384


def setup(d, out, *flags):
    """A Qwen3 of vocab 16384, hidden 64, 2 layers, on a learnable stream; saves every 2 steps
    (the last full), 8 steps, 2 threads. Returns the train arguments."""
    model, data = d / "model", d / "d.bin"
    if not (model / "config.json").exists():
        oracle.tiny_config(vocab=VOCAB, hidden=64, inter=96, layers=2, heads=4, kv_heads=2,
                           head_dim=16).save_pretrained(model)
        oracle.write_bin(data, oracle.learnable_stream(40 * 17 + 5, VOCAB, seed=3))
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.steps=8", "--training.seed=5",
            "--training.threads=2", "--metrics.log_freq=1", f"--job.dump_folder={out}", "--checkpoint.enable",
            "--checkpoint.interval=2", "--checkpoint.last_save_model_only=false", *flags]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckstage")
    out = d / "sync"
    run(setup(d, out))
    return d, out


def test_staging_copy_reused_and_saves_byte_identical(sync_run, tmp_path):
    d, ref = sync_run
    out = tmp_path / "a"
    p = run(setup(d, out, ASYNC), sleep=0.3)
    staged = [ln for ln in p.stderr.splitlines() if "staged checkpoint" in ln]
    assert len(staged) == 3, p.stderr[-3000:]
    assert "step-2 " in staged[0] and "(a new staging copy)" in staged[0], staged
    for s, ln in zip((4, 6), staged[1:]):
        assert f"step-{s} " in ln and "(the previous save's staging copy)" in ln, staged
    # the later stages waited for the thread (paused 0.3 s mid-write) before they copied
    for s in (2, 4):
        assert f"for the checkpoint of step {s} written in the background" in p.stderr, p.stderr[-3000:]
    assert steps_in(out) == steps_in(ref) == [2, 4, 6, 8]
    for s in (2, 4, 6, 8):
        same_files(ref, out, s, FILES)
    assert losses(out) == losses(ref)
