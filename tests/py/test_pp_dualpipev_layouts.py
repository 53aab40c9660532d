"""DualPipeV beyond test_pp_dualpipev's PP 2 / PP 4 with micro-batch counts that P divides
(review9): PP 3, and micro-batch counts of exactly 2P and odd.

1. The order each rank runs is torch's (ScheduleDualPipeV._calculate_single_rank_operations,
   each OVERLAP_F_B flattened into its forward then its whole backward) for PP 2 with 5
   micro-batches, PP 3 with 6 (= 2P: torch's step 4 then runs once on the last rank, its
   non-overlapped F0 B1, and never on the others) and with 7.
2. A run trains like one process (losses, validation losses, final weights, gradient norms):
   PP 3 on a 6-layer model (one layer a stage) with 6 and with 7 micro-batches, and PP 4 on an
   8-layer tied model with 8 micro-batches (rank 0 holds the embedding and the lm_head, the
   tied copy once) and clipping that acts."""
import re

import pytest

import oracle
from test_dist import assert_same_run, run, train_args
from test_dry_run import launch, ok
from test_dry_run_pp import parse, pp_args, pp_models  # noqa: F401 (fixture)
from test_pp import MB, PP, SCHED
from test_pp_zero_bubble import torch_order

DPV = f"{SCHED}=DualPipeV"


@pytest.mark.parametrize("P,M", [(2, 5), (3, 6), (3, 7)])
def test_dualpipev_order_pp3_and_odd(pp_models, tmp_path, P, M):
    d, data = pp_models
    p = ok(launch(0, pp_args(d / "untied", data, tmp_path, P, DPV, local=M) + ["--dry-run"]))
    plan = parse(p.stdout)
    assert plan["schedule"] == "DualPipeV" and plan["M"] == M and plan["S"] == 2, plan
    ords = {int(r): o.split() for r, o in re.findall(r"^    rank (\d+) order: (.*)$", p.stdout, re.M)}
    assert sorted(ords) == list(range(P)), p.stdout[-3000:]
    for r in range(P):
        assert ords[r] == torch_order("DualPipeV", P, 2, M, r), f"PP {P} M {M} rank {r}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpv_layouts")
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=6, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(d / "l6")
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=8, heads=4, kv_heads=2, head_dim=8, tied=True
                       ).save_pretrained(d / "l8_tied")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    return d, data


CLIP = "--training.max_norm=0.2"


@pytest.mark.parametrize("model,P,M", [("l6", 3, 6), ("l6", 3, 7), ("l8_tied", 4, 8)])
def test_dualpipev_matches_one_process(models, model, P, M):
    d, data = models
    batch = [f"--training.local_batch_size={M}", f"--training.global_batch_size={M}",
             "--validation.local_batch_size=2", CLIP]
    ref, out = d / f"one_{model}_{M}", d / f"dpv_{model}_pp{P}_{M}"
    run(1, train_args(d / model, data, ref, *batch))
    p = run(P, train_args(d / model, data, out, *batch, f"{PP}={P}", DPV, f"{MB}=1"), timeout=300)
    assert f"pipeline_parallel {P} (DualPipeV): 2 stage(s) per rank, {M} micro-batches of 1" in p.stderr, \
        p.stderr[-2000:]
    assert_same_run(out, ref, f"DualPipeV PP {P}, {M} micro-batches")
    got = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    assert got.keys() == want.keys() and all(g > 0.2 for g in want.values()), want  # clipping acts
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"step {s} grad_norm {got[s]!r} vs {want[s]!r}"
