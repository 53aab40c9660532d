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
   LoRA with dropout.
3. Fewer micro-batches than stages, and split points giving other than 2 stages a rank, are
   refused naming the schedule."""
import re
import types

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV

import oracle
from test_dist import GLOBAL as GLOBAL_MB, STEPS, assert_same_run, run, train_args
from test_dry_run import launch, ok
from test_dry_run_pp import parse, pp_args, pp_models  # noqa: F401 (fixture)
from test_pp import (MB, PP, SCHED, assert_config_error, aux_single, lora_args, lora_model,  # noqa: F401
                     pp_run, run_bounded, setup, single)
from test_pp_zero_bubble import LAYOUTS, zbv_costs

DPV = f"{SCHED}=DualPipeV"


def torch_order(P, M, r):
    """torch's actions of rank r as its _Action prints them ("3F1", "0B2", "0I6", "0W6"), each
    OVERLAP_F_B replaced by its (forward, whole backward) sub-actions in their order."""
    fake = types.SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=2 * P)
    acts = [a for a in ScheduleDualPipeV._calculate_single_rank_operations(fake, r) if a is not None]
    return [str(s) for a in acts for s in (a.sub_actions or (a,))]


def simulate(ords, P, V, M, cost):
    """The orders run with stage costs: F and I and W one forward each, B two; F(v, i) waits for
    F(v-1, i), B or I(v, i) for F(v, i) and B or I(v+1, i), W(v, i) for I(v, i)."""
    acts = [[(int(m.group(1)), m.group(2), int(m.group(3))) for m in (re.fullmatch(r"(\d+)([FBIW])(\d+)", a)
                                                                     for a in o)] for o in ords]
    done, clock, pos = {}, [0.0] * P, [0] * P
    while any(pos[r] < len(acts[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(acts[r]):
                v, k, i = acts[r][pos[r]]
                back = [("d", v + 1, i)] if v < V - 1 else []
                deps = {"F": [("F", v - 1, i)] if v > 0 else [], "B": [("F", v, i)] + back,
                        "I": [("F", v, i)] + back, "W": [("d", v, i)]}[k]
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + cost[v] * (2 if k == "B" else 1)
                done[("d" if k in "BI" else k, v, i)] = clock[r]
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return 1 - sum(3 * c for c in cost) * M / (P * max(clock))


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


@pytest.mark.parametrize("name", ["pp2_mb1", "pp2_mb2_tied_clip", "pp2_fsdp2_mb1_tied", "pp2_tp2_mb2",
                                  "pp2_ac_full_bf16_mb2"])
def test_dualpipev_matches_one_process(setup, single, name):
    """8 or 4 micro-batches a step through 4 stages on 2 ranks (test_pp_zero_bubble's layouts):
    losses, validation losses, final weights and the gradient norm equal one process's."""
    n, dp, mb, model, args, ref_args = LAYOUTS[name]
    out, p = pp_run(setup, f"dpv_{name}", n, *args, DPV, f"{MB}={mb}", model=model, dp=dp)
    ref = single(model, *ref_args)
    assert_same_run(out, ref, f"DualPipeV {name}")
    want = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    got = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{name}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"
    if name == "pp2_mb1":  # rank 0's split backwards keep their stores until their W
        pending, most = {}, {}
        for a in torch_order(2, GLOBAL_MB, 0):
            st, kind, _ = re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups()
            pending[st] = pending.get(st, 0) + {"I": 1, "W": -1}.get(kind, 0)
            most[st] = max(most.get(st, 0), pending[st])
        assert f"rank 0 of 2: the weight-gradient stores held at most" in p.stderr, p.stderr[-2000:]
        assert f"their {sum(most.values())} buffers take" in p.stderr, p.stderr[-2000:]


def test_dualpipev_moe_aux_loss_matches_one_process(setup, single):
    """Qwen3-MoE with HF's load-balancing loss in the gradient: the expert counts travel back
    with whole and split backwards alike."""
    ref = aux_single(single, "model_moe_aux", 1)
    out, _ = pp_run(setup, "dpv_moe_aux", 2, f"{PP}=2", DPV, f"{MB}=1", model="model_moe_aux")
    assert_same_run(out, ref, "DualPipeV MoE aux")
    got = {r["step"]: r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want = {r["step"]: r for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    for s in want:
        for k in ("grad_norm", "aux_loss"):
            assert abs(got[s][k] - want[s][k]) <= 1e-5 * abs(want[s][k]), \
                f"step {s} {k} {got[s][k]!r} vs one process {want[s][k]!r}"


def test_dualpipev_lora(setup):
    """LoRA (rank 4, dropout 0.1, micro-batches of 2) on HF weights: the PEFT adapter after 10
    steps equals one process's."""
    from test_pp import assert_same_tensors
    d, data = setup
    model = lora_model(setup)
    lora = lora_args(model, 0.1) + ["--checkpoint.last_save_in_hf"]
    ref, out = d / "zb_lora_single", d / "dpv_lora_pp2"
    if not ref.exists():
        run(1, train_args(model, data, ref, *lora))
    run(2, train_args(model, data, out, *lora, f"{PP}=2", DPV, f"{MB}=2"))
    assert_same_run(out, ref, "LoRA DualPipeV", weights_too=False)
    assert_same_tensors(out, ref, "LoRA DualPipeV", "adapter_model.safetensors", 2 * 7 * 4)
