"""Sequence parallel's rows in `ctitan train --dry-run` at the edges test_tp_sp's
test_sp_dry_run_names_the_dtensor_chunks does not reach (the eighth mutation audit):

- a batch whose DTensor Shard chunks leave a rank past the end (5 rows over TP 4: chunks of
  2, so 2, 2, 1 and a rank with none): printing BT - r C unclamped gave that rank -1 rows,
  and no case had a rank starting past the last row;
- a pipeline stage under context parallel: its forward is one micro-batch of a CP rank's
  seq_len / cp positions, which the pipeline's line must cut over TP (printing the whole
  sequence's rows passed: no dry-run case combined PP, CP and TP);
- a pipeline under TP with sequence_parallel = false: every rank holds all rows, so the
  pipeline's plan names no SP cut (printing it whenever TP > 1 passed: test_pp_plan_and_clip
  reads SP off's stage lines only).

Expected rows: torch's own Shard(0)._split_tensor of the forward's rows over the TP degree."""
import subprocess

import pytest

from conftest import BIN
from test_dist import ENV, train_args
from test_tp_sp import SP, sp_setup  # noqa: F401 (fixture)


def shard_line(rows, ranks, batch, positions):
    import torch
    from torch.distributed.tensor.placement_types import Shard
    shards, pads = Shard(0)._split_tensor(torch.empty(rows), ranks, with_padding=True)
    sizes = [int(x.numel()) - pad for x, pad in zip(shards, pads)]
    sizes += [0] * (ranks - len(sizes))
    line = (f"sequence parallel: the residual stream and norms of {max(sizes)} of the {rows} rows "
            f"(batch {batch} x {positions})")
    if rows % ranks:
        line += f"; rows per rank {', '.join(map(str, sizes))}, padded to {int(shards[0].numel())} in the collectives"
    return line + "\n"


@pytest.mark.parametrize("ranks, seq, batch, pp, cp", [
    (4, 5, 1, 1, 1),    # chunks 2, 2, 1, 0: the last rank starts past the last row
    (4, 9, 1, 1, 1),    # 3, 3, 3, 0: it starts at the end
    (2, 14, 1, 2, 2),   # a stage's 7 positions of a CP rank over TP 2: 4, 3
    (4, 16, 1, 2, 2),   # 8 positions over TP 4: 2 each
])
def test_sp_dry_run_rows_at_the_edges(sp_setup, ranks, seq, batch, pp, cp):
    d, data, _ = sp_setup
    args = train_args(d / "model", data, d / "dry_edges", SP, f"--parallelism.tensor_parallel_degree={ranks}",
                      "--parallelism.data_parallel_shard_degree=1", f"--training.seq_len={seq}",
                      f"--training.local_batch_size={batch}", f"--validation.local_batch_size={batch}",
                      f"--parallelism.pipeline_parallel_degree={pp}", f"--parallelism.context_parallel_degree={cp}",
                      "--parallelism.context_parallel_load_balancer=none", "--dry-run")
    p = subprocess.run([str(BIN), *map(str, args)], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    positions = seq // cp
    rows = (1 if pp > 1 else batch) * positions  # under PP a stage's forward: one micro-batch of 1 sequence
    line = shard_line(rows, ranks, 1 if pp > 1 else batch, positions)
    assert line in p.stdout, (line, p.stdout[-3000:])
    assert " -" not in "".join(x for x in p.stdout.splitlines(True) if "rows per rank" in x), p.stdout[-3000:]


def test_no_sp_line_with_sequence_parallel_off(sp_setup):
    d, data, _ = sp_setup
    for pp in (1, 2):
        args = train_args(d / "model", data, d / "dry_off", "--parallelism.sequence_parallel=false",
                          "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                          "--training.seq_len=15", "--training.local_batch_size=1",
                          "--validation.local_batch_size=1", f"--parallelism.pipeline_parallel_degree={pp}",
                          "--dry-run")
        p = subprocess.run([str(BIN), *map(str, args)], env=ENV, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "TP rank 0 of 2" in p.stdout or "tensor_parallel 2" in p.stdout, p.stdout[-2000:]  # a TP plan
        assert "sequence parallel:" not in p.stdout, (pp, p.stdout[-3000:])
