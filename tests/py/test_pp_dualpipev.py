"""torch's DualPipeV (ScheduleDualPipeV), parallelism.pipeline_parallel_schedule = "DualPipeV".

Two stages a rank in a V (rank r: stages r and 2P-1-r, as ZBVZeroBubble), at least as many
micro-batches as stages. Its order mixes whole backwards (B) with split ones (I, then a W
torch queues), and pairs a forward of one local stage with a whole backward of the other in
an OVERLAP_F_B action; torch's runtime runs such a pair's two sub-actions one after the
other unless the model registers a function that overlaps them, and ctitan runs them the
same way.

1. The order each rank runs is torch's (`_calculate_single_rank_operations`, each OVERLAP_F_B
   flattened into its sub-actions), read from the dry run's `rank R order:` lines, for PP 2
   and PP 4; each (stage, micro-batch) has its forward and one backward, whole or I then W;
   the simulated bubble is recomputed here from those orders (B = 2 forwards, I = W = 1).
2. A schedule only reorders the work, so a run trains like one process (1e-5): untied,
   tied with clipping that acts, FSDP 2, TP 2, full AC with bf16, a MoE with the aux loss,
   LoRA with dropout: test_pp_zero_bubble.py's runs, which take DualPipeV beside the
   zero-bubble schedules.
3. Fewer micro-batches than stages, and split points giving other than 2 stages a rank, are
   refused naming the schedule."""
import re

import pytest

from test_dry_run import launch, ok
from test_dry_run_pp import parse, pp_args, pp_models  # noqa: F401 (fixture)
from test_pp import SCHED, assert_config_error
from test_pp_zero_bubble import simulate, torch_order as zb_torch_order, zbv_costs

DPV = f"{SCHED}=DualPipeV"


def torch_order(P, M, r):
    return zb_torch_order("DualPipeV", P, 2, M, r)


@pytest.mark.parametrize("P,local", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_dualpipev_order_is_torchs(pp_models, tmp_path, P, local):
    d, data = pp_models
    p = ok(launch(0, pp_args(d / "untied", data, tmp_path, P, DPV, local=local) + ["--dry-run"]))
    plan = parse(p.stdout)
    assert plan["schedule"] == "DualPipeV" and plan["S"] == 2 and plan["M"] == local, plan
    M = plan["M"]
    for st in plan["stages"]:  # the V: rank 0 holds the embedding and the lm_head
        r = st["rank"]
        assert ("embedding" in st["holds"]) == (r == 0) and ("lm_head" in st["holds"]) == (r == 0), st
    ords = {int(r): o.split() for r, o in re.findall(r"^    rank (\d+) order: (.*)$", p.stdout, re.M)}
    assert sorted(ords) == list(range(P)), p.stdout[-3000:]
    kinds = set()
    for r in range(P):
        want = torch_order(P, M, r)
        assert ords[r] == want, f"rank {r}: {ords[r]} vs torch's {want}"
        for v in (r, 2 * P - 1 - r):  # a forward and one backward each: whole, or I then its W
            for i in range(M):
                f, b, i_, w = (ords[r].count(f"{v}{k}{i}") for k in "FBIW")
                assert f == 1 and (b, i_, w) in ((1, 0, 0), (0, 1, 1)), (r, v, i, ords[r])
                if i_:
                    assert ords[r].index(f"{v}I{i}") < ords[r].index(f"{v}W{i}")
        kinds |= {re.sub(r"\d", "", a) for a in ords[r]}
    assert {"F", "B", "I", "W"} <= kinds, kinds
    want = simulate([ords[r] for r in range(P)], P, 2 * P, M, zbv_costs(plan, 254, 8))
    assert plan["sim"] == pytest.approx(want, abs=6e-5), (plan["sim"], want)


def test_dualpipev_needs_a_micro_batch_a_stage(pp_models, tmp_path):
    """torch: at least as many micro-batches as stages (3 on PP 2's 4 stages: no)."""
    d, data = pp_models
    p = launch(0, pp_args(d / "untied", data, tmp_path, 2, DPV, local=3) + ["--dry-run"])
    assert_config_error(p, "DualPipeV", "at least as many micro-batches as stages (4)", "has 3")


def test_dualpipev_needs_two_stages_a_rank(pp_models, tmp_path):
    d, data = pp_models
    p = launch(0, pp_args(d / "untied", data, tmp_path, 2, DPV,
                          "--parallelism.pipeline_parallel_split_points=layers.1,layers.2,layers.3,layers.4,layers.5",
                          local=8) + ["--dry-run"])
    assert_config_error(p, "DualPipeV", "exactly 2 stages per rank")
