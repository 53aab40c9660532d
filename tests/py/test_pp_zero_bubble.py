"""The zero-bubble pipeline schedules InterleavedZeroBubble (torch's
ScheduleInterleavedZeroBubble, ZB1P) and ZBVZeroBubble (ScheduleZBVZeroBubble, ZB-V),
parallelism.pipeline_parallel_schedule.

Each stage's backward runs as two actions: I, d(input), sent upstream when it ends, and W,
the weight gradients of the dense projections and the MoE experts, replayed later from what I
recorded (model/lm.h, lm_wstore; tests/c/model/test_lm_wsplit.c shows I then W is the fused
backward bit for bit). Each rank holds 2 stages: InterleavedZeroBubble as Interleaved1F1B
(rank r: stages r and r + P), ZBVZeroBubble in a V (rank r: stages r and 2P-1-r, so rank 0
holds the embedding and the lm_head, and a tied embedding has one copy).

1. The order each rank runs is the one torch builds (its _calculate_single_rank_operations,
   called here with the schedule's own fields), read from the dry run's `rank R order:`
   lines, for PP 2 and PP 4; every I comes before its W, so d(input) leaves before W; the
   simulated bubble is recomputed here from those orders (I = W = a forward); the dry run's
   layers per rank follow the placement.
2. A schedule only reorders the work, so a run trains like one process (test_pp.py's
   tolerance, 1e-5): losses, validation losses, gradient norms, final weights; with FSDP 2, TP 2,
   a MoE with the aux loss in the gradient, LoRA, full activation checkpointing, bf16,
   clipping that acts, and gradient accumulation (every case: 8 sequences a step in micro-
   batches of 1 or 2).
3. ZBVZeroBubble takes exactly 2 stages a rank. (DualPipeV, on the same V: test_pp_dualpipev.py.)"""
import re
import types

import pytest
from torch.distributed.pipelining.schedules import (ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
                                                    ScheduleZBVZeroBubble)

import oracle
from test_dist import GLOBAL as GLOBAL_MB, STEPS, assert_same_run, run, train_args
from test_dry_run import launch, ok
from test_dry_run_pp import parse, pp_args, pp_models, stage_costs  # noqa: F401 (fixture)
from test_pp import (MB, PP, SCHED, assert_config_error, assert_same_tensors, aux_single, lora_args,  # noqa: F401
                     lora_model, pp_run, run_bounded, setup, single)

ZB = f"{SCHED}=InterleavedZeroBubble"
SCHEDS = ["InterleavedZeroBubble", "ZBVZeroBubble"]
# the runs against one process take DualPipeV too (test_pp_dualpipev.py: its order and rules)
RUN_SCHEDS = SCHEDS + ["DualPipeV"]


# --------------------------------------------------------------------------- 1. the order

def torch_order(sched, P, S, M, r):
    """torch's actions of rank r as its _Action prints them ("2F0", "0I7", "0W3", "3B1"), without
    its no-op padding (InterleavedZeroBubble's _add_bubbles_to_actions only adds no-ops), each
    DualPipeV OVERLAP_F_B replaced by its (forward, whole backward) sub-actions in order."""
    if sched == "DualPipeV":
        fake = types.SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=2 * P)
        acts = [a for a in ScheduleDualPipeV._calculate_single_rank_operations(fake, r) if a is not None]
        return [str(x) for a in acts for x in (a.sub_actions or (a,))]
    if sched == "ZBVZeroBubble":
        fake = types.SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=P * S)
        return [str(a) for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r) if a is not None]
    rounds = max(1, M // P)
    fake = types.SimpleNamespace(pp_group_size=P, n_local_stages=S, _n_microbatches=M, number_of_rounds=rounds,
                                 microbatches_per_round=M // rounds, rank=r)
    return [str(a) for a in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, r)
            if a is not None]


def simulate(ords, P, V, M, cost):
    """The run's simulation on explicit orders: F, I and W each cost a forward, a whole B two;
    F(v, i) waits for F(v-1, i), B or I(v, i) for F(v, i) and B or I(v+1, i), W(v, i) for I(v, i)."""
    acts = [[(int(m.group(1)), m.group(2), int(m.group(3))) for m in (re.fullmatch(r"(\d+)([FBIW])(\d+)", a)
                                                                     for a in o)] for o in ords]
    done, clock, pos = {}, [0.0] * P, [0] * P
    while any(pos[r] < len(acts[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(acts[r]):
                v, k, i = acts[r][pos[r]]
                back = [("I", v + 1, i)] if v < V - 1 else []  # a B stands as its I: d(input) sent
                deps = {"F": [("F", v - 1, i)] if v > 0 else [], "I": [("F", v, i)] + back,
                        "B": [("F", v, i)] + back, "W": [("I", v, i)]}[k]
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + cost[v] * (2 if k == "B" else 1)
                done[("I" if k == "B" else k, v, i)] = clock[r]
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return 1 - sum(3 * c for c in cost) * M / (P * max(clock))


@pytest.mark.parametrize("sched", SCHEDS)
@pytest.mark.parametrize("P,local,global_", [
    (2, 4, 0),   # 4 micro-batches: 2 rounds of 2
    (2, 2, 6),   # 6: 3 rounds of 2
    (4, 2, 6),   # 4 ranks, 3 micro-batches, fewer than ranks: 1 round (ZBV: fewer than 2P-1)
    (4, 4, 8),   # 8: 2 rounds of 4
])
def test_zero_bubble_order_is_torchs(pp_models, tmp_path, sched, P, local, global_):
    """The dry run lists each pipeline rank's actions: torch's order, each W after its I, and
    the simulated bubble that of those orders; each rank holds the stages of its placement."""
    d, data = pp_models
    p = ok(launch(0, pp_args(d / "untied", data, tmp_path, P, f"{SCHED}={sched}", local=local, global_=global_)
                  + ["--dry-run"]))
    plan = parse(p.stdout)
    assert plan["schedule"] == sched and plan["S"] == 2, plan
    S, M = plan["S"], plan["M"]
    for st in plan["stages"]:  # 8 layers, 2 P stages of 8 / (2 P) layers each (equal costs but the head's)
        r = st["rank"]
        vs = [r, r + P] if sched == "InterleavedZeroBubble" else [r, 2 * P - 1 - r]
        assert ("embedding" in st["holds"]) == (0 in vs) and ("lm_head" in st["holds"]) == (2 * P - 1 in vs), st
        assert [a for a, _ in st["ranges"]] == sorted(a for a, _ in st["ranges"]) and len(st["ranges"]) == 2, st
    ords = {int(r): o.split() for r, o in re.findall(r"^    rank (\d+) order: (.*)$", p.stdout, re.M)}
    assert sorted(ords) == list(range(P)), p.stdout[-3000:]
    for r in range(P):
        want = torch_order(sched, P, S, M, r)
        assert ords[r] == want, f"rank {r}: {ords[r]} vs torch's {want}"
        # I (d(input), sent when it ends) before its W; every (stage, micro-batch) once each
        for a in ords[r]:
            if "W" in a:
                i = a.replace("W", "I")
                assert i in ords[r] and ords[r].index(i) < ords[r].index(a), f"rank {r}: {a} before {i}"
        vs = [r, r + P] if sched == "InterleavedZeroBubble" else [r, 2 * P - 1 - r]
        assert sorted(ords[r]) == sorted(f"{v}{k}{i}" for v in vs for k in "FIW" for i in range(M))
    cost = stage_costs(plan, 254, 8) if sched == "InterleavedZeroBubble" else zbv_costs(plan, 254, 8)
    want = simulate([ords[r] for r in range(P)], P, P * S, M, cost)
    assert plan["sim"] == pytest.approx(want, abs=6e-5), (plan["sim"], want)


@pytest.mark.parametrize("sched", SCHEDS)
def test_zero_bubble_dry_run_counts_the_stores(pp_models, tmp_path, sched):
    """The dry run adds each rank's weight-gradient stores to its total: per local stage the most
    I's torch's order has waiting for their W, each holding, per layer, a micro-batch's rows x
    (4 H + 2 (q + kv widths) + 3 intermediate) floats (the inputs and d(outputs) of the dense
    projections, from transformers' config) and the RMSNorms' weight-gradient operands, W's
    too (torch's stage_backward_weight defers every parameter's): per norm its input and
    d(output) and one rstd a row, Qwen3's input and post-attention norms over H and its q/k
    norms per head over head_dim (2 (2 H + 1) + (heads + kv heads)(2 hd + 1) a row), the final
    norm's 2 H + 1 a row on the stage ending the model; the other schedules have none. With
    o_proj and down_proj frozen (training.freeze) their 2 H + q width + intermediate leave the
    count."""
    from test_dry_run_pp import T
    from transformers import AutoConfig
    d, data = pp_models
    c = AutoConfig.from_pretrained(d / "untied")
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    norms = 2 * (2 * H + 1) + (c.num_attention_heads + c.num_key_value_heads) * (2 * c.head_dim + 1)
    L = c.num_hidden_layers
    freeze = "--training.freeze=model.layers.*.self_attn.o_proj.weight,model.layers.*.mlp.down_proj.weight"
    for per_layer, extra in ((4 * H + 2 * (q + kv) + 3 * I, []), (2 * H + q + 2 * kv + 2 * I, [freeze])):
        p = ok(launch(0, pp_args(d / "untied", data, tmp_path, 2, f"{SCHED}={sched}", *extra, local=4, global_=0)
                      + ["--dry-run"]))
        plan = parse(p.stdout)
        rows, P, S, M = plan["mb"] * T, plan["P"], plan["S"], plan["M"]
        for st in plan["stages"]:
            r = st["rank"]
            vs = [r, r + P] if sched == "InterleavedZeroBubble" else [r, 2 * P - 1 - r]
            pending, most = {}, {}
            for a in torch_order(sched, P, S, M, r):
                v, kind, _ = re.fullmatch(r"(\d+)([FIW])(\d+)", a).groups()
                pending[int(v)] = pending.get(int(v), 0) + {"I": 1, "W": -1}.get(kind, 0)
                most[int(v)] = max(most.get(int(v), 0), pending[int(v)])
            want = sum(most[v] * 4 * rows * ((per_layer + norms) * (b - a) + (2 * H + 1) * (b == L))
                       for v, (a, b) in zip(vs, st["ranges"]))
            assert st["n_stores"] == sum(most.values()) and st["stores"] == want, (st, most, want)
            assert st["total"] == st["params"] + st["grad_opt"] + st["act"] + st["p2p"] + st["stores"], st
    p = ok(launch(0, pp_args(d / "untied", data, tmp_path, 2, f"{SCHED}=Interleaved1F1B", local=4, global_=0)
                  + ["--dry-run"]))
    assert all(st["stores"] == 0 for st in parse(p.stdout)["stages"]) and "weight-gradient" not in p.stdout


def zbv_costs(plan, vocab, L):
    """stage_costs under the V: rank r's second range is stage 2P-1-r."""
    from test_dry_run_pp import HIDDEN, layer_cost
    P = plan["P"]
    cost = [0.0] * (2 * P)
    for st in plan["stages"]:
        for v, (a, b) in zip([st["rank"], 2 * P - 1 - st["rank"]], st["ranges"]):
            cost[v] = (b - a) * layer_cost(vocab) + (2.0 * vocab * HIDDEN if b == L else 0)
    return cost


def test_zbv_needs_two_stages_a_rank(pp_models, tmp_path):
    """torch's ScheduleZBVZeroBubble takes exactly 2 stages a rank: split points giving 3 a
    rank (6 on PP 2) are refused, naming the schedule."""
    d, data = pp_models
    p = launch(0, pp_args(d / "untied", data, tmp_path, 2, f"{SCHED}=ZBVZeroBubble",
                          "--parallelism.pipeline_parallel_split_points=layers.1,layers.2,layers.3,layers.4,layers.5")
               + ["--dry-run"])
    assert_config_error(p, "ZBVZeroBubble", "exactly 2 stages per rank")


def test_zero_bubble_rounds_must_divide_the_micro_batches(setup, tmp_path):
    """torch's rule: the micro-batches split into M // P rounds of equal size (5 into 2: no)."""
    d, data = setup
    p = launch(0, pp_args(d / "model", data, tmp_path, 2, ZB, local=5, global_=0) + ["--dry-run"])
    assert_config_error(p, "InterleavedZeroBubble", "rounds")


# --------------------------------------------------------------------------- 2. against one process

CLIP = "--training.max_norm=0.2"  # under every step's norm: clipping acts
BF16 = "--training.mixed_precision_param=bfloat16"
AC = "--activation_checkpoint.mode=full"
LAYOUTS = {  # name: (ranks, data-parallel degree, micro-batch, model, args, the one process's extra args)
    "pp2_mb1": (2, 1, 1, "model", [f"{PP}=2"], []),
    "pp2_mb2_tied_clip": (2, 1, 2, "model_tied", [f"{PP}=2", CLIP], [CLIP]),
    # tied: under the V rank 0 holds both copies (one FSDP piece for the lookup and the head)
    "pp2_fsdp2_mb1_tied": (4, 2, 1, "model_tied", [f"{PP}=2", "--parallelism.data_parallel_shard_degree=2"], []),
    "pp2_tp2_mb2": (4, 1, 2, "model_tp", [f"{PP}=2", "--parallelism.tensor_parallel_degree=2",
                                          "--parallelism.data_parallel_shard_degree=1"], []),
    "pp2_ac_full_bf16_mb2": (2, 1, 2, "model", [f"{PP}=2", AC, BF16], [AC, BF16]),
}


@pytest.mark.parametrize("sched", RUN_SCHEDS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_bubble_matches_one_process(setup, single, sched, name):
    """8 or 4 micro-batches a step through 4 stages on 2 ranks: losses, validation losses,
    final weights and the gradient norm equal one process's."""
    n, dp, mb, model, args, ref_args = LAYOUTS[name]
    out, p = pp_run(setup, f"zb_{sched}_{name}", n, *args, f"{SCHED}={sched}", f"{MB}={mb}", model=model, dp=dp)
    assert "weight-gradient stores held" in p.stderr, p.stderr[-2000:]
    ref = single(model, *ref_args)
    assert_same_run(out, ref, f"{sched} {name}")
    want = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    got = {r["step"]: r["grad_norm"] for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{name}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"
    if name == "pp2_mb1":
        # the store's size (model/lm.h): rank 0 holds one layer a stage; per layer B T x
        # (4 H + 2 (q + kv widths) + 3 intermediate) floats, from transformers' config, and the
        # norms' input, d(output) and rstd (2 (2 H + 1) + (heads + kv heads)(2 hd + 1)); the
        # head's dW is never deferred, the final norm's is (2 H + 1): under the V rank 0 holds
        # the head's stage (3) too, whose store is the largest
        from transformers import AutoConfig
        c = AutoConfig.from_pretrained(setup[0] / model)
        H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        norms = 2 * (2 * H + 1) + (c.num_attention_heads + c.num_key_value_heads) * (2 * c.head_dim + 1)
        per = 4 * 16 * (4 * H + 2 * (q + kv) + 3 * c.intermediate_size + norms)
        final = 4 * 16 * (2 * H + 1) if sched != "InterleavedZeroBubble" else 0
        assert f"rank 0 of 2: the weight-gradient stores held at most {per + final} bytes per" in p.stderr, \
            p.stderr[-2000:]
        # an I takes a store its stage's W gives back: rank 0 keeps, per stage, the most I's its
        # order (torch's, 8 micro-batches) ever has pending before their W, not one per micro-batch
        pending, most = {}, {}
        for a in torch_order(sched, 2, 2, GLOBAL_MB, 0):
            st, kind, _ = re.fullmatch(r"(\d+)([FIWB])(\d+)", a).groups()
            pending[st] = pending.get(st, 0) + {"I": 1, "W": -1}.get(kind, 0)
            most[st] = max(most.get(st, 0), pending[st])
        n = sum(most.values())
        assert n < 2 * GLOBAL_MB, f"test setup: {most}"
        # each store is sized to what it holds (lm_wstore_floats), not grown by doubling
        size = sum(k * (per + final * (st == "3")) for st, k in most.items())
        assert f"rank 0 of 2: the weight-gradient stores held at most {per + final} bytes per (stage, " \
               f"micro-batch); their {n} buffers take {size} bytes" in p.stderr, p.stderr[-2000:]
    if CLIP in args:
        assert all(g > 0.2 for g in want.values()), f"clipping never acted: {want}"


@pytest.mark.parametrize("sched", RUN_SCHEDS)
def test_zero_bubble_moe_aux_loss_matches_one_process(setup, single, sched):
    """Qwen3-MoE with HF's load-balancing loss in the gradient, micro-batches of 1: the expert
    counts travel back with I's gradient; aux_loss and grad_norm too."""
    ref = aux_single(single, "model_moe_aux", 1)
    out, _ = pp_run(setup, f"zb_moe_aux_{sched}", 2, f"{PP}=2", f"{SCHED}={sched}", f"{MB}=1", model="model_moe_aux")
    assert_same_run(out, ref, f"{sched} MoE aux")
    got = {r["step"]: r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want = {r["step"]: r for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    for s in want:
        for k in ("grad_norm", "aux_loss"):
            assert abs(got[s][k] - want[s][k]) <= 1e-5 * abs(want[s][k]), \
                f"step {s} {k} {got[s][k]!r} vs one process {want[s][k]!r}"


def test_zero_bubble_defers_the_experts_bit_for_bit(setup):
    """Qwen3-MoE (layers 1-3 sparse, the aux loss in the gradient): I leaves the routed experts'
    gate / up / down gradients to W too (model/lm.h lm_wstore, op_moe_experts_bwd_w), and W adds
    the fused backward's bits. InterleavedZeroBubble runs the stages Interleaved1F1B runs, on
    the same ranks, with each stage's micro-batches in the same order, but its backward split:
    losses, gradient norms and final weights (experts included) equal Interleaved1F1B's exactly.
    (tests/c/model/test_lm_wsplit.c checks the same per stage, and that I alone leaves the experts'
    gradients untouched; test_pp_zero_bubble_store_sizes.py the stores' sizes with experts.)"""
    from test_dist import weights
    split, _ = pp_run(setup, "zb_moe_aux_split", 2, f"{PP}=2", f"{SCHED}=InterleavedZeroBubble", f"{MB}=1",
                      model="model_moe_aux")
    fused, _ = pp_run(setup, "zb_moe_aux_fused", 2, f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=1",
                      model="model_moe_aux")
    keys = ("loss", "grad_norm", "aux_loss")
    got = [{k: r[k] for k in keys} for r in oracle.read_metrics(split / "metrics.jsonl") if "loss" in r]
    want = [{k: r[k] for k in keys} for r in oracle.read_metrics(fused / "metrics.jsonl") if "loss" in r]
    assert got and got == want, (got, want)
    a, b = weights(split), weights(fused)
    assert any(".mlp.experts." in k for k in b), sorted(b)[:8]
    assert a.keys() == b.keys()
    bad = [k for k in b if a[k].tobytes() != b[k].tobytes()]
    assert not bad, f"final weights differ from the non-split backward's: {bad[:6]}"


@pytest.mark.parametrize("sched", RUN_SCHEDS)
def test_zero_bubble_lora(setup, sched):
    """LoRA (rank 4, dropout 0.1, micro-batches of 2) on HF weights: the PEFT adapter after 10
    steps equals one process's (the base is frozen: W has nothing to do, I everything)."""
    d, data = setup
    model = lora_model(setup)
    lora = lora_args(model, 0.1) + ["--checkpoint.last_save_in_hf"]
    ref, out = d / "zb_lora_single", d / f"zb_lora_pp2_{sched}"
    if not ref.exists():
        run(1, train_args(model, data, ref, *lora))
    run(2, train_args(model, data, out, *lora, f"{PP}=2", f"{SCHED}={sched}", f"{MB}=2"))
    assert_same_run(out, ref, f"LoRA {sched}", weights_too=False)
    assert_same_tensors(out, ref, f"LoRA {sched}", "adapter_model.safetensors", 2 * 7 * 4)


# --------------------------------------------------------------------------- 3. refusals

def test_resume_from_interleaved_under_zbv(setup, single):
    """A full checkpoint written at step 4 under Interleaved1F1B (rank 1 holds stages 1 and 3,
    the lm_head) resumed under ZBVZeroBubble (rank 1: stages 1 and 2; rank 0 the lm_head):
    each rank loads its new stages' units; steps 5-10 and the final weights equal one
    process's."""
    d, data = setup
    full = "--checkpoint.last_save_model_only=false"
    ref = single("model", full)
    out = d / "inter_to_zbv"
    p = run(2, train_args(d / "model", data, out, f"{PP}=2", f"{SCHED}=Interleaved1F1B", f"{MB}=1", full,
                          "--training.stop_at_step=4"), check=False)
    assert p.returncode == 75, p.stderr[-3000:]
    p = run(2, train_args(d / "model", data, out, f"{PP}=2", f"{SCHED}=ZBVZeroBubble", f"{MB}=1", full))
    assert "resuming from" in p.stderr and "step-4" in p.stderr, p.stderr[-3000:]
    assert_same_run(out, ref, "Interleaved1F1B -> ZBVZeroBubble", steps=range(5, STEPS + 1))
