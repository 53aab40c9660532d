"""a run stopped at a validation step validates it on resume (validation_pending),
under FSDP 2 and PP 2: every rank agrees (no hang), the point is logged once in metrics.jsonl
and TensorBoard, equal to an uninterrupted one-process run's; validation off on resume."""
import json

import pytest

import oracle
from test_dist import losses, run, train_args, val_losses
from test_tensorboard import scalars

LAYOUTS = {"one": (1, 1, []),
           "fsdp2": (2, 2, ["--parallelism.data_parallel_shard_degree=2"]),
           "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree=2",
                          "--parallelism.pipeline_parallel_microbatch_size=1"])}


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = tmp_path_factory.mktemp("r6v")
    oracle.tiny_config(vocab=64, hidden=24, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(d / "m")
    oracle.write_bin(d / "t.bin", oracle.learnable_stream(300 * 17, 64, seed=7))
    ref = d / "ref"
    run(1, train_args(d / "m", d / "t.bin", ref))
    return d, ref


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stop_at_validation_step_then_resume(d, name):
    d, ref = d
    n, dp, args = LAYOUTS[name]
    out = d / name
    base = train_args(d / "m", d / "t.bin", out, *args, "--metrics.enable_tensorboard", dp=dp)
    p = run(n, base + ["--training.stop_at_step=5"], check=False, timeout=300)
    assert p.returncode == 75, p.stderr[-2000:]
    state = json.loads((out / "checkpoint" / "step-5" / "state.json").read_text())
    assert state.get("validation_pending") is True, state
    assert val_losses(out) == {}
    run(n, base, timeout=300)
    rows = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in rows] == [5, 10], rows
    want = val_losses(ref)
    for r in rows:
        assert abs(r["val_loss"] - want[r["step"]]) <= 1e-5 * want[r["step"]], (r, want)
    got, lw = losses(out), losses(ref)
    for s in lw:
        assert abs(got[s] - lw[s]) <= 1e-5 * lw[s], (s, got[s], lw[s])
    tb = scalars(out / "tb")
    assert [s for s, _ in tb["val_loss"]] == [5, 10], tb["val_loss"]
    # the next checkpoint no longer carries the flag
    state = json.loads((out / "checkpoint" / "step-10" / "state.json").read_text())
    assert "validation_pending" not in state, state


@pytest.mark.parametrize("name", ["fsdp2", "pp2"])
def test_resume_with_validation_off(d, name):
    d, ref = d
    n, dp, args = LAYOUTS[name]
    out = d / f"off_{name}"
    base = train_args(d / "m", d / "t.bin", out, *args, dp=dp)
    p = run(n, base + ["--training.stop_at_step=5"], check=False, timeout=300)
    assert p.returncode == 75, p.stderr[-2000:]
    run(n, base + ["--validation.enable=false"], timeout=300)
    assert val_losses(out) == {}
    got, lw = losses(out), losses(ref)
    for s in lw:
        assert abs(got[s] - lw[s]) <= 1e-5 * lw[s], (s, got[s], lw[s])
