"""Two lines of the pipeline's `ctitan train --dry-run` that no test read at their edges
(the eighth mutation audit).

LoopedBFS's bubble: the dry run prints the simulated bubble beside the textbook one, which
for the schedules holding S stages a rank is (P-1)/(S M + P-1). test_pp_schedules checks
LoopedBFS's order and simulated bubble but not the textbook figure, and test_dry_run_pp's
balanced cases cover 1F1B, GPipe and Interleaved1F1B only, so printing LoopedBFS's as
(P-1)/(M + P-1) passed every test. Here stages of equal cost (test_dry_run_pp's eq models:
the lm_head costs one layer) run torch's ScheduleLoopedBFS order through the independent
simulation: its bubble is (P-1)/(S M + P-1), and the dry run prints that as both figures.

The order line: docs/distributed.md promises each rank's actions listed "up to 256 actions a
rank". A rank with exactly 256 (1F1B, 128 micro-batches) was printed as a count instead
(`<` for `<=` passed: no case reached the cap); one with 258 is a count."""
import re

import pytest

from test_dry_run import launch, ok
from test_dry_run_pp import EQ_VOCAB, parse, pp_args, pp_models, stage_costs  # noqa: F401 (fixture)
from test_pp_schedules import simulate, torch_order


@pytest.mark.parametrize("model,P,split,global_", [
    ("eq7", 2, "layers.2,layers.4,layers.6", 16),
    ("eq7", 2, "layers.2,layers.4,layers.6", 0),
])
def test_looped_bfs_balanced_bubble_is_the_textbook_one(pp_models, tmp_path, model, P, split, global_):
    d, data = pp_models
    args = pp_args(d / model, data, tmp_path, P, f"--parallelism.pipeline_parallel_split_points={split}",
                   "--parallelism.pipeline_parallel_schedule=LoopedBFS", global_=global_)
    plan = parse(ok(launch(0, args + ["--dry-run"])).stdout)
    assert plan["schedule"] == "LoopedBFS"
    S, M = plan["S"], plan["M"]
    L = int(model[2:])
    cost = stage_costs(plan, EQ_VOCAB, L)
    assert max(cost) == min(cost), cost  # balanced, as the split points meant
    book = (P - 1) / (S * M + P - 1)
    torch_sim = simulate([torch_order(P, S, M, r) for r in range(P)], P, P * S, M, cost)
    assert torch_sim == pytest.approx(book, abs=1e-12), (torch_sim, book)
    assert plan["sim"] == pytest.approx(book, abs=6e-5), (plan["sim"], book)
    assert plan["book"] == pytest.approx(book, abs=6e-5), (plan["book"], book)


@pytest.mark.parametrize("M", [128, 129])
def test_order_line_lists_up_to_256_actions(pp_models, tmp_path, M):
    d, data = pp_models
    args = pp_args(d / "untied", data, tmp_path, 2, local=M)
    p = ok(launch(0, args + ["--dry-run"]))
    plan = parse(p.stdout)
    assert plan["schedule"] == "1F1B" and plan["S"] == 1 and plan["M"] == M
    ords = dict(re.findall(r"^    rank (\d+) order: (.*)$", p.stdout, re.M))
    assert sorted(ords) == ["0", "1"], p.stdout[-3000:]
    for r, line in ords.items():
        if 2 * M <= 256:  # every action, each micro-batch's forward and backward once
            acts = line.split()
            assert len(acts) == 2 * M, (r, line[:200])
            assert sorted(acts) == sorted(f"{r}{k}{i}" for k in "FB" for i in range(M)), (r, line[:200])
        else:
            assert line == f"{2 * M} actions (listed up to 256)", (r, line[:200])
