"""TP ranks whose vocabulary block would start past the end of the vocabulary (the ninth
mutation audit). DTensor Shard(0) cuts V rows in chunks of C = ceil(V / t); where (t - 1) C
exceeds V the last rank's block starts past row V and is empty. test_tp_vocab_uneven's empty
rank (9 over 4: 3, 3, 3, 0) starts exactly at V, so tp_chunk without its clamp of the start
to V passed it; 5 over 4 (2, 2, 1, 0: rank 3 would start at 6) did not: the unclamped
count underflows to a whole chunk read past the table. Expected rows from torch's own
Shard(0)._split_tensor; the run must train like one process (test_dist's tolerances)."""
import subprocess

from conftest import BIN
from test_dist import ENV, assert_same_norms, assert_same_run, run, train_args
from test_tp_vocab_uneven import ONE_ROW, split_rows, tp_args

import oracle

V, T = 5, 4


def test_block_past_the_end_is_empty(tmp_path):
    model, data = tmp_path / "v5", tmp_path / "tokens5.bin"
    oracle.tiny_config(vocab=V, hidden=24, inter=48, layers=2, heads=12, kv_heads=12, head_dim=4).save_pretrained(model)
    oracle.write_bin(data, oracle.learnable_stream(300 * 17, V, seed=7))
    sizes, chunk = split_rows(V, T)
    assert sizes == [2, 2, 1, 0] and (T - 1) * chunk > V
    args = train_args(model, data, tmp_path / "dry", *tp_args(T, False), *ONE_ROW, "--dry-run",
                      "--parallelism.data_parallel_shard_degree=1")
    p = subprocess.run([str(BIN), *map(str, args)], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    line = f"  vocabulary rows per TP rank {', '.join(map(str, sizes))} (chunks of {chunk}, as DTensor Shard(0)"
    assert line in p.stdout, (line, p.stdout[-3000:])
    one, tp = tmp_path / "one", tmp_path / "tp"
    run(1, train_args(model, data, one, "--checkpoint.last_save_model_only=false", *ONE_ROW))
    run(T, train_args(model, data, tp, *tp_args(T, False, "--parallelism.data_parallel_shard_degree=1"), *ONE_ROW))
    assert_same_run(tp, one, "tp4_v5")
    assert_same_norms(tp, one, "tp4_v5")
