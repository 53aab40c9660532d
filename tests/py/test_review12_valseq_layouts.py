"""validation.seq_len under the 4-rank layouts test_validation_seq_len_layouts.py leaves
(review12): HSDP (replicate 2 x shard 2) and PP 2 x CP 2. Training at 16 tokens, validation
at 8 and at 32 (shorter and longer than training's): the held-out loss over all 8 windows and
the step's training loss equal transformers' (lr 0: the loaded model), as in that file."""
import pytest

import oracle
from test_dist import mpirun, run
from test_validation_seq_len_layouts import _args, _check, setup  # noqa: F401 (fixture)

LAYOUTS = {  # name: (data-parallel degree, extra)
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
    "pp2_cp2": (1, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=1",
                    "--parallelism.context_parallel_degree=2"]),
}


@pytest.mark.parametrize("L", [8, 32])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_val_loss_under_4_rank_layout_matches_hf(setup, layout, L):
    mpirun()  # fails, rather than skips, without it
    d, train_tokens, val = setup
    dp, extra = LAYOUTS[layout]
    out = d / f"r12_{layout}_{L}"
    run(4, _args(d, out, L, dp, extra))
    _check(oracle.load_hf(d / "model"), train_tokens, val[L], out, L, dp)
