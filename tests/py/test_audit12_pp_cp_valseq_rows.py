"""Twelfth mutation audit (docs/reliability.md): PP 2 x CP 2 with validation.seq_len. Context
parallel's scratch holds a step's micro-batches at once, ceil(rows / Tmax) sequences of the
longer length (plan_attach); rounded down the suite passed, its row counts all dividing
(2 micro-batches of 16 against validation's 32). Three micro-batches of 16 tokens (48 rows)
with validation at 32: the scratch needs 2 sequences of 32, not 1. The step's training loss
and the held-out loss over all 8 windows are transformers' (lr 0: the loaded model)."""
import oracle
from test_dist import mpirun, run
from test_validation_seq_len_layouts import N_VAL, TRAIN_LEN, _args, _losses, setup  # noqa: F401 (fixture)


def test_pp_cp_three_microbatches_longer_validation(setup):
    mpirun()
    d, train_tokens, val = setup
    out = d / "a12_pp2_cp2_m3"
    run(4, _args(d, out, 32, 1, ["--parallelism.pipeline_parallel_degree=2",
                                 "--parallelism.pipeline_parallel_microbatch_size=1",
                                 "--parallelism.context_parallel_degree=2", "--training.local_batch_size=3",
                                 "--training.global_batch_size=3", "--validation.local_batch_size=1"]),
        timeout=300)
    model = oracle.load_hf(d / "model")
    loss, vals = _losses(out)
    w = oracle.windows(train_tokens, TRAIN_LEN)[:3]
    want = oracle.hf_loss(model, w[:, :-1], w[:, 1:])
    assert len(loss) == 1 and abs(loss[0] - want) <= 1e-4 * want, f"training loss {loss} vs HF {want}"
    v = oracle.windows(val[32], 32)
    want = oracle.hf_loss(model, v[:, :-1], v[:, 1:])
    assert len(vals) == 1 and vals[0]["val_targets"] == N_VAL * 32, vals
    assert abs(vals[0]["val_loss"] - want) <= 1e-4 * want, f"val_loss {vals[0]['val_loss']} vs HF {want}"
