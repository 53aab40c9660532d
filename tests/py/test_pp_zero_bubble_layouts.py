"""Zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble) with sequence parallel and
training.freeze against one process.

I records each deferred dW product's input and d(output) in the (stage, micro-batch) store
(model/lm.c wdefer_put), sharing one copy of the input between consecutive records of a layer
that read the same buffer (q, k, v; gate, up). Under sequence parallel that buffer is
ws.sp_x, which sp_gather refills for the MLP (ln2's rows) and then for the attention (ln1's):
when o_proj records nothing (frozen), q's record came right after up's, read the same
pointer, and shared ln2's copy, so W computed q, k and v's gradients from the MLP's input.
Interleaved1F1B (no deferral) is right on the same layout."""
import pytest

from test_dist import assert_same_run
from test_pp import MB, PP, SCHED, pp_run, setup, single  # noqa: F401

TP_SP = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
         "--parallelism.sequence_parallel=true"]
FREEZE_O = "--training.freeze=model.layers.*.self_attn.o_proj.weight"


@pytest.mark.parametrize("sched", ["InterleavedZeroBubble", "ZBVZeroBubble"])
@pytest.mark.parametrize("model", ["model_tp", "model_moe_aux_tp"])
def test_zero_bubble_sequence_parallel_with_a_frozen_o_proj(setup, single, sched, model):
    """PP 2 x TP 2 with sequence parallel, o_proj frozen (nothing recorded between the MLP's
    and the attention's products): losses, validation losses and final weights equal one
    process's with the same freeze."""
    out, _ = pp_run(setup, f"zb_sp_freeze_o_{sched}_{model}", 4, f"{PP}=2", f"{SCHED}={sched}", f"{MB}=2", *TP_SP,
                    FREEZE_O, model=model)
    assert_same_run(out, single(model, FREEZE_O), f"{sched} {model} TP 2 SP, o_proj frozen")
