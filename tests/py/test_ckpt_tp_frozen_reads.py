"""A TP rank resuming a run with frozen tensors reads only its slice of each trained tensor
(the eighth mutation audit).

With training.freeze the checkpoint holds the trained tensors only, and the load reads it
through a table of those (trainer_ckpt.c's trained_table), which passes the plan's rows AND
its columns on to the reader. Handing it the rows alone made every TP rank read whole rows of
each row-parallel weight (o_proj, down_proj): the resumed run was right, so only the bytes
read moved, and test_ckpt_tp_io's read checks run without a freeze. Here a TP 2 run with
layer 0 and the embedding frozen stops at step 2 and resumes under TP 2: each rank's logged
tensor bytes read are exactly its share of the checkpoint's tensors (torchtitan's TP plan,
computed from the safetensors header), and the resumed steps equal one process's
uninterrupted run with the same freeze."""
import shutil

from conftest import BIN
from test_ckpt_parallel_io import READ, losses, run
from test_ckpt_tp_io import STEPS, STOP, TP, args, header, mesh_of, setup, share  # noqa: F401 (fixture)
from test_dist import mpirun

FREEZE = "--training.freeze=model.embed_tokens.weight,model.layers.0.*"


def test_tp_resume_with_frozen_tensors_reads_its_slice(setup, tmp_path):
    d, data = setup
    ref, stopped, out = tmp_path / "ref", tmp_path / "stopped", tmp_path / "run"
    run([BIN, *args(d, "model", data, ref, FREEZE)])
    run([BIN, *args(d, "model", data, stopped, FREEZE, f"--training.stop_at_step={STOP}")], code=75)
    shutil.copytree(stopped, out)
    p = run(mpirun() + ["-np", "2", str(BIN), *args(d, "model", data, out, FREEZE, f"{TP}=2")])
    reads = {int(m[1]): int(m[3]) for m in READ.finditer(p.stderr) if int(m[2]) == 2}
    assert sorted(reads) == [0, 1], f"every rank logs what it read:\n{p.stderr[-4000:]}"
    h = header(out / "checkpoint" / f"step-{STOP}")
    assert not any(k.startswith("model.layers.0.") or k.startswith("model.embed_tokens") for k, _, _ in h), \
        "the checkpoint holds the trained tensors only"
    assert any(".o_proj." in k for k, _, _ in h) and any(".down_proj." in k for k, _, _ in h)
    for r, got in reads.items():
        tr, er = mesh_of(r, 2, 1, 1)
        want = sum(share(k, s, b, 2, tr, 1, er, 4) for k, s, b in h)
        assert got == want, f"rank {r} read {got} tensor bytes, its share is {want}"
    want_loss, got_loss = losses(ref), losses(out)
    for s in range(STOP + 1, STEPS + 1):
        assert abs(got_loss[s] - want_loss[s]) <= 1e-5 * abs(want_loss[s]), (s, got_loss[s], want_loss[s])
