"""The pipeline schedules torchtitan takes beyond 1F1B, GPipe and Interleaved1F1B
(parallelism.pipeline_parallel_schedule, torch's get_schedule_class names).

LoopedBFS (torch's ScheduleLoopedBFS): each rank holds S >= 2 stages (2 by default, as
torchtitan's multi-stage schedules), runs every micro-batch through its first stage, then its
next, and the backwards from its last stage down, each stage's micro-batches last to first.
The order each rank runs is the one torch builds (its _calculate_single_rank_operations,
called here), read from the dry run's `    rank R order:` lines; its simulated bubble is
recomputed here from those orders and the stage costs. A schedule only reorders the work, so a
run trains like one process, as in test_pp.py: the same losses, validation losses, gradient
norms and final weights to 1e-5 (with the aux loss in the gradient, FSDP, TP, LoRA, full
activation checkpointing), and a checkpoint written under Interleaved1F1B resumes under
LoopedBFS.

Refused, exit 2, the message listing every accepted name: a name torch does not have, and
LoopedBFS with one stage a rank. InterleavedZeroBubble and ZBVZeroBubble are
test_pp_zero_bubble.py's, DualPipeV test_pp_dualpipev.py's."""
import re
import types

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleLoopedBFS

import oracle
from test_dist import STEPS, assert_same_run, run, train_args
from test_dry_run import launch, ok
from test_dry_run_pp import parse, pp_args, pp_models, stage_costs  # noqa: F401 (fixture)
from test_pp import (MB, PP, SCHED, SPLIT, assert_config_error, assert_same_tensors, aux_single, lora_args,  # noqa: F401
                     lora_model, pp_run, run_bounded, setup, single)

LOOPED = f"{SCHED}=LoopedBFS"


# --------------------------------------------------------------------------- 1. the order

def torch_order(P, S, M, r):
    """torch's LoopedBFS actions of rank r, as its _Action prints them ("2F0", "0B7"), without
    its no-op padding."""
    fake = types.SimpleNamespace(pp_group_size=P, _stages=list(range(S)), _n_microbatches=M)
    return [str(a) for a in ScheduleLoopedBFS._calculate_single_rank_operations(fake, r) if a is not None]


def torch_interleaved_order(P, S, M, r):
    """torch's Interleaved1F1B actions of rank r (its flexible rounds: max(1, M // P) of
    M // rounds micro-batches), without its no-op padding."""
    rounds = max(1, M // P)
    fake = types.SimpleNamespace(pp_group_size=P, n_local_stages=S, number_of_rounds=rounds,
                                 microbatches_per_round=M // rounds, _n_microbatches=M)
    return [str(a) for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r) if a is not None]


def simulate(ords, P, V, M, cost):
    """test_dry_run_pp's simulation on explicit orders: a backward costs two forwards, F(v, i)
    waits for F(v-1, i), B(v, i) for F(v, i) and B(v+1, i); the idle share of P x makespan."""
    acts = [[(int(re.match(r"\d+", a).group()), re.search(r"[FB]", a).group(), int(a.split("F")[-1].split("B")[-1]))
             for a in o] for o in ords]
    done, clock, pos = {}, [0.0] * P, [0] * P
    while any(pos[r] < len(acts[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(acts[r]):
                v, k, i = acts[r][pos[r]]
                deps = [("F", v - 1, i)] if k == "F" and v > 0 else []
                if k == "B":
                    deps = [("F", v, i)] + ([("B", v + 1, i)] if v < V - 1 else [])
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + cost[v] * (1 if k == "F" else 2)
                done[(k, v, i)] = clock[r]
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return 1 - sum(3 * c for c in cost) * M / (P * max(clock))


@pytest.mark.parametrize("P,split,local,global_", [
    (2, "", 4, 0),                                        # 2 stages a rank, 4 micro-batches
    (2, "layers.1,layers.3,layers.4,layers.5,layers.7", 2, 8),   # 3 stages a rank, uneven
    (4, "", 2, 6),                                        # 4 ranks, 3 micro-batches: fewer than ranks
])
def test_looped_bfs_order_is_torchs(pp_models, tmp_path, P, split, local, global_):
    """The dry run lists each pipeline rank's actions: they are torch's ScheduleLoopedBFS
    order, and the simulated bubble is the one of those orders with the printed stages'
    costs (so the simulation the run's deadlock check makes ran torch's order)."""
    d, data = pp_models
    extra = [LOOPED] + ([f"{SPLIT}={split}"] if split else [])
    p = ok(launch(0, pp_args(d / "untied", data, tmp_path, P, *extra, local=local, global_=global_) + ["--dry-run"]))
    plan = parse(p.stdout)
    assert plan["schedule"] == "LoopedBFS"
    S, M = plan["S"], plan["M"]
    assert S == (3 if split else 2)
    ords = {int(r): o.split() for r, o in re.findall(r"^    rank (\d+) order: (.*)$", p.stdout, re.M)}
    assert sorted(ords) == list(range(P)), p.stdout[-3000:]
    for r in range(P):
        assert ords[r] == torch_order(P, S, M, r), f"rank {r}: {ords[r]} vs torch's {torch_order(P, S, M, r)}"
    want = simulate([ords[r] for r in range(P)], P, P * S, M, stage_costs(plan, 254, 8))
    assert plan["sim"] == pytest.approx(want, abs=6e-5), (plan["sim"], want)


# --------------------------------------------------------------------------- 2. against one process

LAYOUTS = {  # name: (ranks, data-parallel degree, micro-batch, model, args)
    "pp2_mb1": (2, 1, 1, "model", [f"{PP}=2", LOOPED]),
    "pp2_mb2_tied": (2, 1, 2, "model_tied", [f"{PP}=2", LOOPED]),
    # 4 stages, uneven: stage 0 one layer and the embedding
    "pp2_split_mb1": (2, 1, 1, "model", [f"{PP}=2", LOOPED, f"{SPLIT}=layers.1,layers.2,3"]),
    "pp2_fsdp2_mb1": (4, 2, 1, "model", [f"{PP}=2", LOOPED, "--parallelism.data_parallel_shard_degree=2"]),
    "pp2_tp2_mb1": (4, 1, 1, "model_tp", [f"{PP}=2", LOOPED, "--parallelism.tensor_parallel_degree=2",
                                          "--parallelism.data_parallel_shard_degree=1"]),
    "pp2_ac_full_mb1": (2, 1, 1, "model", [f"{PP}=2", LOOPED, "--activation_checkpoint.mode=full"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_looped_bfs_matches_one_process(setup, single, name):
    """8 or 4 micro-batches a step through 4 stages on 2 ranks: losses, validation losses,
    final weights and the gradient norm equal one process's."""
    n, dp, mb, model, args = LAYOUTS[name]
    out, _ = pp_run(setup, f"looped_{name}", n, *args, f"{MB}={mb}", model=model, dp=dp)
    ref = single(model)
    assert_same_run(out, ref, f"LoopedBFS {name}")
    want = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    got = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{name}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"


def test_looped_bfs_moe_aux_loss_matches_one_process(setup, single):
    """Qwen3-MoE with HF's load-balancing loss in the gradient, micro-batches of 1: the expert
    counts travel with the activations and back with the gradients, which LoopedBFS sends last
    micro-batch first; aux_loss and grad_norm too."""
    ref = aux_single(single, "model_moe_aux", 1)
    out, _ = pp_run(setup, "looped_moe_aux", 2, f"{PP}=2", LOOPED, f"{MB}=1", model="model_moe_aux")
    assert_same_run(out, ref, "LoopedBFS MoE aux")
    got = {r["step"]: r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want = {r["step"]: r for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    for s in want:
        for k in ("grad_norm", "aux_loss"):
            assert abs(got[s][k] - want[s][k]) <= 1e-5 * abs(want[s][k]), \
                f"step {s} {k} {got[s][k]!r} vs one process {want[s][k]!r}"


def test_looped_bfs_lora(setup):
    """LoRA (rank 4, dropout 0.1, micro-batches of 2) on HF weights: the PEFT adapter after 10
    steps equals one process's."""
    d, data = setup
    model = lora_model(setup)
    lora = lora_args(model, 0.1) + ["--checkpoint.last_save_in_hf"]
    ref, out = d / "looped_lora_single", d / "looped_lora_pp2"
    run(1, train_args(model, data, ref, *lora))
    run(2, train_args(model, data, out, *lora, f"{PP}=2", LOOPED, f"{MB}=2"))
    assert_same_run(out, ref, "LoRA LoopedBFS", weights_too=False)
    assert_same_tensors(out, ref, "LoRA LoopedBFS", "adapter_model.safetensors", 2 * 7 * 4)


def test_resume_from_interleaved_under_looped_bfs(setup, single):
    """A full checkpoint written at step 4 under Interleaved1F1B resumed under LoopedBFS (the
    same 4 stages, another order): steps 5-10 and the final weights equal one process's."""
    d, data = setup
    full = "--checkpoint.last_save_model_only=false"
    ref = single("model", full)
    out = d / "inter_to_looped"
    p = run(2, train_args(d / "model", data, out, f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=1", full,
                          "--training.stop_at_step=4"), check=False)
    assert p.returncode == 75, p.stderr[-3000:]
    p = run(2, train_args(d / "model", data, out, f"{PP}=2", LOOPED, f"{MB}=1", full))
    assert "resuming from" in p.stderr and "step-4" in p.stderr, p.stderr[-3000:]
    assert_same_run(out, ref, "Interleaved1F1B -> LoopedBFS", steps=range(5, STEPS + 1))


# --------------------------------------------------------------------------- 3. refusals

ACCEPTED = ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("name", ["ZeroBubble", "DualPipe"])
def test_refused_schedules_name_every_accepted_one(setup, tmp_path, name):
    """Not torch's names (in any case: test_pp_schedule_toml.py)."""
    d, data = setup
    p = run_bounded(2, train_args(d / "model", data, tmp_path / "bad", f"{PP}=2", f"{SCHED}={name}"), timeout=8)
    assert_config_error(p, "pipeline_parallel_schedule", name, *ACCEPTED)


def test_looped_bfs_needs_two_stages_a_rank(setup, tmp_path):
    """torchtitan's multi-stage schedules need at least 2 stages a rank."""
    d, data = setup
    p = run_bounded(2, train_args(d / "model", data, tmp_path / "bad", f"{PP}=2", LOOPED, f"{SPLIT}=layers.2"),
                    timeout=8)
    assert_config_error(p, "pipeline_parallel_split_points", "LoopedBFS")



@pytest.mark.parametrize("name,code", [("LoopedBFS", 0), ("InterleavedZeroBubble", 0), ("ZBVZeroBubble", 0),
                                       ("DualPipeV", 0), ("Interleaved1F1Bv2", 2)])
def test_torchtitan_toml_schedule(setup, tmp_path, name, code):
    """A torchtitan toml naming the schedule (`ctitan train --config F --dry-run`): LoopedBFS is
    planned with 2 stages a rank, and the zero-bubble ones and DualPipeV; a misspelt name is refused
    naming the key."""
    d, data = setup
    cfg = tmp_path / "train.toml"
    cfg.write_text(f'[model]\nspec = "hf"\nhf_assets_path = "{d / "model"}"\n'
                   f'[training]\ndataset_path = "{data}"\nseq_len = 16\nlocal_batch_size = 4\nsteps = 1\n'
                   f'[job]\ndump_folder = "{tmp_path / "out"}"\n'
                   f'[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "{name}"\n')
    p = launch(0, ["train", "--config", cfg, "--dry-run"])
    if code:
        assert_config_error(p, "parallelism.pipeline_parallel_schedule", name, *ACCEPTED)
    else:
        plan = parse(ok(p).stdout)
        assert plan["schedule"] == name and plan["S"] == 2 and plan["M"] == 4, plan


@pytest.mark.parametrize("P,local,global_", [
    (2, 4, 0),    # 4 micro-batches: 2 rounds of P, Megatron's order
    (2, 3, 0),    # 3: fewer than 2 rounds, 1 round of 3 (torch's flexible rounds)
    (4, 6, 0),    # 6 on 4 ranks: 1 round of 6
    (4, 10, 0),   # 10 on 4 ranks: 2 rounds of 5
])
def test_interleaved_order_is_torchs(pp_models, tmp_path, P, local, global_):
    """Interleaved1F1B's order is torch's ScheduleInterleaved1F1B's, whose rounds need not be
    of P micro-batches (M a multiple of max(1, M // P)): each rank's actions from the dry run."""
    d, data = pp_models
    p = ok(launch(0, pp_args(d / "untied", data, tmp_path, P, f"{SCHED}=Interleaved1F1B", local=local,
                             global_=global_) + ["--dry-run"]))
    plan = parse(p.stdout)
    ords = {int(r): o.split() for r, o in re.findall(r"^    rank (\d+) order: (.*)$", p.stdout, re.M)}
    for r in range(P):
        want = torch_interleaved_order(P, plan["S"], plan["M"], r)
        assert ords[r] == want, f"rank {r}: {ords[r]} vs torch's {want}"


def test_interleaved_three_micro_batches_match_one_process(setup):
    """3 micro-batches a step on PP 2 (one round of 3, which P = 2 does not divide; refused
    before, as Megatron's groups of P needed): losses and weights equal one process's."""
    d, data = setup
    three = ["--training.local_batch_size=3", "--training.global_batch_size=3", "--validation.local_batch_size=3"]
    ref, out = d / "inter3_single", d / "inter3_pp2"
    run(1, train_args(d / "model", data, ref, *three))
    run(2, train_args(d / "model", data, out, *three, f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=1"))
    assert_same_run(out, ref, "Interleaved1F1B, 3 micro-batches")
