"""Checkpoint loading under TP x FSDP reads only the rows a rank keeps (the seventh mutation
audit: test_ckpt_parallel_io.py checks TP and FSDP apart, and a TP rank that read every row
of its slice, ignoring which of them its FSDP shard keeps, passed every test). The share is
the TP bound of test_ckpt_parallel_io.py's table (0.8: the row-parallel weights' whole rows)
halved by FSDP 2, which shards each rank's slice."""
from test_ckpt_parallel_io import (STOP, assert_same_losses, file_bytes, reference, resume,  # noqa: F401
                                   setup, tensor_bytes)


def test_tp_fsdp_rank_reads_its_shard_of_its_slice(setup, reference, tmp_path):  # noqa: F811
    ref, stopped = reference
    n = 4
    out, reads, _ = resume(setup, stopped, tmp_path, n, ["--parallelism.tensor_parallel_degree=2",
                                                         "--parallelism.data_parallel_shard_degree=2"])
    step = out / "checkpoint" / f"step-{STOP}"
    total, rows = tensor_bytes(step)
    slack = 2 * sum(rows) + 64 * len(rows)  # whole rows at a shard's two ends, FSDP's padded chunks
    for r, (got, _) in reads.items():
        assert got <= 0.4 * total + slack, f"rank {r} read {got} of {total} tensor bytes (share 0.4): {reads}"
    assert sum(g for g, _ in reads.values()) >= total, f"the ranks read {reads}, the tensors hold {total}"
    assert reads[0][1] == file_bytes(step), f"rank 0 checksums every file once: {reads}"
    assert all(reads[r][1] == 0 for r in range(1, n)), f"the other ranks take rank 0's verdict: {reads}"
    assert_same_losses(out, ref, "tp2_fsdp2")
