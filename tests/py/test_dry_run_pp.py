"""`ctitan train --dry-run` with pipeline stages (issue 16): a line per pipeline rank (its
layers, what it holds, its parameters and bytes), the schedule and its bubble, simulated
beside the textbook (P-1)/(M+P-1); the checks a pipeline run makes, with its messages."""
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import oracle
from test_dist import ENV
from test_dry_run import launch, ok

T = 32
HIDDEN, INTER, HEADS, KV, HD = 32, 48, 4, 2, 8
# with these shapes one layer's cost (forward FLOPs per token, pp.c's layer_cost at T = 32) is
# 2 (H (qd + 2 kvd) + qd H + 2 qd T + 3 H I) = 19456 and the lm_head's 2 V H: V = 304 makes the
# head cost exactly one layer, so stages can be balanced with split points
EQ_VOCAB = 304


@pytest.fixture(scope="module")
def pp_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dry_pp")
    shapes = dict(hidden=HIDDEN, inter=INTER, heads=HEADS, kv_heads=KV, head_dim=HD)
    oracle.tiny_config(vocab=254, layers=8, **shapes).save_pretrained(d / "untied")
    oracle.tiny_config(vocab=254, layers=8, tied=True, **shapes).save_pretrained(d / "tied")
    oracle.tiny_config(vocab=2048, hidden=256, inter=768, layers=8, heads=4, kv_heads=2, head_dim=64
                       ).save_pretrained(d / "medium")
    for L in (5, 7, 8):
        oracle.tiny_config(vocab=EQ_VOCAB, layers=L, **shapes).save_pretrained(d / f"eq{L}")
    data = oracle.write_bin(d / "t.bin", oracle.random_tokens(64 * 33, 254, seed=3))
    return d, data


def pp_args(model_dir, data, out, P, *extra, local=4, global_=0):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}", f"--training.dataset_path={data}",
            f"--training.seq_len={T}", f"--training.local_batch_size={local}", "--training.steps=1",
            f"--training.global_batch_size={global_ or -1}", "--metrics.peak_tflops=1", f"--job.dump_folder={out}",
            f"--parallelism.pipeline_parallel_degree={P}", *extra]


STAGE = re.compile(r"^  pipeline rank (\d+): layers ([0-9, -]+?)((?:, embedding)?(?:, final norm \+ lm_head"
                   r"(?: \(the tied embedding's copy\))?)?): (\d+) parameters; bytes: parameters (\d+), "
                   r"gradients \+ AdamW (\d+), activations (\d+) \(shared (\d+) \+ (\d+) banks? (\d+)\), "
                   r"point-to-point (\d+)(?:, weight-gradient stores (\d+) \((\d+) of them\))?; "
                   r"total (\d+) \([0-9.]+ GiB\)$", re.M)


def parse(out):
    """The pipeline section: world, schedule, bubble and a dict per pipeline rank."""
    world = re.search(r"^pipeline: world (\d+) = pipeline_parallel (\d+) x data_parallel_replicate (\d+)", out, re.M)
    sched = re.search(r"^  schedule (\S+): (\d+) stages? per rank, (\d+) micro-batches of (\d+) sequences? per "
                      r"step \(gradient accumulation (\d+) x", out, re.M)
    bub = re.search(r"^  bubble: simulated ([0-9.]+) .*, textbook ([0-9.]+) = ", out, re.M)
    assert world and sched and bub, out
    stages = []
    for m in STAGE.finditer(out):
        ranges = []
        for part in m.group(2).split(", "):
            a, _, b = part.partition("-")
            ranges.append((int(a), int(b or a) + 1))
        keys = ("rank", "n", "params", "grad_opt", "act", "shared", "n_banks", "banks", "p2p", "stores", "n_stores",
                "total")
        vals = [int(m.group(i) or 0) for i in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)]
        stages.append(dict(zip(keys, vals), ranges=ranges, holds=m.group(3)))
    return dict(world=int(world.group(1)), P=int(world.group(2)), rep=int(world.group(3)), schedule=sched.group(1),
                S=int(sched.group(2)), M=int(sched.group(3)), mb=int(sched.group(4)), accum=int(sched.group(5)),
                sim=float(bub.group(1)), book=float(bub.group(2)), stages=stages)


def hf_count(model_dir):
    """transformers' parameter count of the whole model (a tied embedding once) and its config."""
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in m.parameters()), cfg


# --- an independent simulation of the schedules from the stage costs ---

def layer_cost(vocab, t=T):
    qd, kvd = HEADS * HD, KV * HD
    return 2.0 * (HIDDEN * (qd + 2 * kvd) + qd * HIDDEN + 2.0 * qd * t + 3.0 * HIDDEN * INTER)


def orders(schedule, P, S, M, r):
    """Rank r's actions (kind, local stage, micro-batch): GPipe every forward first; 1F1B P-r-1
    warm-up forwards, then one forward one backward; Interleaved1F1B Megatron's groups of P
    micro-batches chunk by chunk, warming up with 2 (P-r-1) + (S-1) P."""
    if schedule == "Interleaved1F1B":
        groups = [range(g, min(g + P, M)) for g in range(0, M, P)]
        fwd = [("F", c, i) for g in groups for c in range(S) for i in g]
        bwd = [("B", c, i) for g in groups for c in reversed(range(S)) for i in g]
        warm = 2 * (P - r - 1) + (S - 1) * P
    else:
        fwd, bwd = [("F", 0, i) for i in range(M)], [("B", 0, i) for i in range(M)]
        warm = M if schedule == "GPipe" else P - r - 1
    warm = min(warm, len(fwd))
    out, f, b = fwd[:warm], warm, 0
    while f < len(fwd) or b < len(bwd):
        if f < len(fwd):
            out.append(fwd[f])
            f += 1
        if b < len(bwd):
            out.append(bwd[b])
            b += 1
    return out


def simulate(schedule, P, S, M, cost):
    """Idle share of P x makespan; a backward costs two forwards; F(v, i) waits for F(v-1, i),
    B(v, i) for B(v+1, i) and F(v, i)."""
    V = P * S
    ords = [orders(schedule, P, S, M, r) for r in range(P)]
    done, clock, pos = {}, [0.0] * P, [0] * P
    while any(pos[r] < len(ords[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(ords[r]):
                k, c, i = ords[r][pos[r]]
                v = c * P + r
                deps = [("F", v - 1, i)] if k == "F" and v > 0 else []
                if k == "B":
                    deps = [("F", v, i)] + ([("B", v + 1, i)] if v < V - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + cost[v] * (1 if k == "F" else 2)
                done[(k, v, i)] = clock[r]
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    busy = sum(3 * cost[v] for v in range(V)) * M
    return 1 - busy / (P * max(clock))


def stage_costs(plan, vocab, L):
    """Each virtual stage's cost from the layer ranges the dry run prints."""
    P, S = plan["P"], plan["S"]
    cost = [0.0] * (P * S)
    for st in plan["stages"]:
        assert len(st["ranges"]) == S
        for c, (a, b) in enumerate(st["ranges"]):
            v = c * P + st["rank"]
            cost[v] = (b - a) * layer_cost(vocab) + (2.0 * vocab * HIDDEN if b == L else 0)
    return cost


def test_simulation_matches_the_textbook_with_equal_costs():
    """The Python simulation itself: equal stage costs give the textbook bubble."""
    for P, M in ((2, 4), (3, 4), (4, 8), (3, 1)):
        for sched in ("1F1B", "GPipe"):
            assert simulate(sched, P, 1, M, [1.0] * P) == pytest.approx((P - 1) / (M + P - 1))
    for P, S, M in ((2, 2, 4), (2, 3, 8), (4, 2, 8)):
        assert simulate("Interleaved1F1B", P, S, M, [1.0] * P * S) == pytest.approx((P - 1) / (S * M + P - 1))


CASES = {  # name: (model, P, extra args, local batch, global batch)
    "1f1b_p2": ("untied", 2, [], 4, 0),
    "1f1b_p4_tied": ("tied", 4, [], 4, 8),
    "gpipe_p3_mb2": ("untied", 3, ["--parallelism.pipeline_parallel_schedule=GPipe",
                                   "--parallelism.pipeline_parallel_microbatch_size=2"], 4, 8),
    "interleaved_p2": ("untied", 2, ["--parallelism.pipeline_parallel_schedule=Interleaved1F1B"], 4, 8),
    "interleaved_p2_tied_s4": ("tied", 2, ["--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                                           "--parallelism.pipeline_parallel_split_points=layers.1,layers.2,"
                                           "layers.3,layers.4,layers.5,layers.6,layers.7"], 4, 0),
    "replicas": ("untied", 2, ["--parallelism.data_parallel_replicate_degree=2",
                               "--parallelism.data_parallel_shard_degree=1"], 4, 16),
}


@pytest.mark.parametrize("name", CASES)
def test_dry_run_pp_stages(pp_models, tmp_path, name):
    """A line for every pipeline rank; together their layer ranges tile the model in virtual
    stage order (rank r holds v = r, r + P, ...); the embedding is on rank 0, the final norm and
    lm_head on rank P-1; the parameters add up to transformers' count of the whole model (plus
    the tied embedding's second copy on the last rank); each line's bytes add up; the schedule's
    micro-batches are gradient accumulation x local batch / micro-batch; the bubble is the
    simulation of the printed stages' costs, at least the textbook one."""
    kind, P, extra, local, global_ = CASES[name]
    d, data = pp_models
    out = ok(launch(0, pp_args(d / kind, data, tmp_path, P, *extra, local=local, global_=global_) + ["--dry-run"])).stdout
    n_whole = int(re.search(r"^dry run: model \S+, (\d+) parameters", out, re.M).group(1))
    n_hf, cfg = hf_count(d / kind)
    assert n_whole == n_hf
    plan = parse(out)
    rep = 2 if name == "replicas" else 1
    assert plan["P"] == P and plan["rep"] == rep and plan["world"] == P * rep
    stages = plan["stages"]
    assert [s["rank"] for s in stages] == list(range(P)), out
    S, L = plan["S"], cfg.num_hidden_layers
    virtual = sorted((c * P + s["rank"], rng) for s in stages for c, rng in enumerate(s["ranges"]))
    assert [v for v, _ in virtual] == list(range(P * S))
    assert virtual[0][1][0] == 0 and virtual[-1][1][1] == L
    assert all(virtual[k][1][1] == virtual[k + 1][1][0] for k in range(P * S - 1)), virtual
    assert all(a < b for _, (a, b) in virtual)
    for s in stages:
        assert ("embedding" in s["holds"]) == (s["rank"] == 0 or (cfg.tie_word_embeddings and s["rank"] == P - 1))
        assert ("lm_head" in s["holds"]) == (s["rank"] == P - 1)
        assert s["params"] == 4 * s["n"] and s["grad_opt"] == 12 * s["n"]
        assert s["act"] == s["shared"] + s["banks"] and s["n_banks"] >= 1
        assert s["p2p"] == 4 * 4 * S * plan["M"] * plan["mb"] * T * HIDDEN
        assert s["total"] == s["params"] + s["grad_opt"] + s["act"] + s["p2p"]
    tied_copy = cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0
    assert sum(s["n"] for s in stages) == n_hf + tied_copy
    dp = rep
    accum = (global_ or local * dp) // (local * dp)
    assert plan["accum"] == accum and plan["M"] == accum * local // plan["mb"]
    M = plan["M"]
    book = (P - 1) / ((S * M if plan["schedule"] == "Interleaved1F1B" else M) + P - 1)
    assert plan["book"] == pytest.approx(book, abs=6e-5)
    want = simulate(plan["schedule"], P, S, M, stage_costs(plan, cfg.vocab_size, L))
    assert plan["sim"] == pytest.approx(want, abs=6e-5), (plan["sim"], want)
    assert book - 6e-5 <= plan["sim"] < 1


@pytest.mark.parametrize("model,P,split,schedule,global_", [
    ("eq5", 2, "layers.3", "1F1B", 0),
    ("eq8", 3, "layers.3,layers.6", "1F1B", 8),
    ("eq8", 3, "layers.3,layers.6", "GPipe", 0),
    ("eq7", 2, "layers.2,layers.4,layers.6", "Interleaved1F1B", 16),
])
def test_dry_run_pp_balanced_bubble_is_the_textbook_one(pp_models, tmp_path, model, P, split, schedule, global_):
    """Stages of equal cost (the lm_head costs one layer here, so the last stage has one layer
    fewer): the simulated bubble is the textbook (P-1)/(M+P-1), (P-1)/(S M+P-1) interleaved."""
    d, data = pp_models
    args = pp_args(d / model, data, tmp_path, P, f"--parallelism.pipeline_parallel_split_points={split}",
                   f"--parallelism.pipeline_parallel_schedule={schedule}", global_=global_)
    plan = parse(ok(launch(0, args + ["--dry-run"])).stdout)
    L = int(model[2:])
    cost = stage_costs(plan, EQ_VOCAB, L)
    assert max(cost) == min(cost), cost  # balanced, as the split points meant
    S, M = plan["S"], plan["M"]
    book = (P - 1) / (S * M + P - 1)
    assert plan["sim"] == pytest.approx(book, abs=6e-5) and plan["book"] == pytest.approx(book, abs=6e-5)


def test_dry_run_pp_parameters_match_a_run(pp_models, tmp_path):
    """What each pipeline rank of a 1-step run under mpirun logs (`ctitan: model ...: N
    parameters` on the rank CTITAN_LOG_RANKS shows) is what the dry run plans for it."""
    d, data = pp_models
    args = pp_args(d / "tied", data, tmp_path, 2)
    plan = parse(ok(launch(0, args + ["--dry-run"])).stdout)
    for r in range(2):
        err = ok(launch(2, args, env=dict(ENV, CTITAN_LOG_RANKS=str(r)))).stderr
        n_run = int(re.search(r"ctitan: model \S+: (\d+) parameters", err).group(1))
        assert n_run == plan["stages"][r]["n"], (r, n_run, plan["stages"][r])


@pytest.mark.parametrize("n,extra", [
    (4, ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1",
         "--parallelism.expert_parallel_degree=2"]),
    (8, ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
         "--parallelism.expert_parallel_degree=2"]),
], ids=["pp2_dp2_ep2", "pp2_tp2_fsdp2_ep2"])
def test_dry_run_pp_plans_each_ranks_slice(pp_models, tmp_path, n, extra):
    """Under PP x TP / EP each pipeline rank's line plans TP rank 0's and EP rank 0's slice of
    its stage (fewer heads, half the experts), as the run builds it: the parameter count that
    the first rank of each pipeline stage logs in a 1-step run. The line counted the whole
    stage before (the plan ignored every slice within a stage)."""
    from transformers import Qwen3MoeConfig
    _, data = pp_models
    Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=20, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, tie_word_embeddings=False).save_pretrained(tmp_path / "moe")
    args = pp_args(tmp_path / "moe", data, tmp_path / "out", 2, *extra, local=2)
    out = ok(launch(0, args + ["--dry-run"])).stdout
    tp = 2 if any("tensor_parallel_degree=2" in a for a in extra) else 1
    assert re.search(rf"^pipeline: world {n} = .* x tensor_parallel {tp}, expert_parallel 2 ", out, re.M), out
    lines = re.findall(rf"^  pipeline rank (\d+): .*?: (\d+) parameters \(its slice: TP rank 0 of {tp}, EP rank 0 of "
                       r"2\)", out, re.M)
    assert [int(r) for r, _ in lines] == [0, 1], out
    err = ok(launch(n, args, env=dict(ENV, CTITAN_LOG_RANKS="all"))).stderr
    held = {int(r): int(k) for k, r in re.findall(r"ctitan: model \S+: (\d+) parameters on rank (\d+) of", err)}
    for r, k in lines:  # pipeline rank r's first world rank: stages are the outermost layout
        assert held[int(r) * (n // 2)] == int(k), (r, k, held)


MIB = 2**20


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B"])
def test_dry_run_pp_total_matches_a_runs_peak(pp_models, tmp_path, schedule):
    """Each pipeline rank's planned total against its measured `peak memory` in a 2-step run
    (the banks are allocated in the first step, reused in the second) of a medium model (7 M
    parameters: the plan dominates): never above it, and the excess no more than a tiny model's
    measured peak (the runtime: MPI, libraries) + 8 MiB, as test_dry_run.py's per-rank test."""
    d, data = pp_models
    peak, planned = {}, {}
    for kind in ("untied", "medium"):
        args = pp_args(d / kind, data, tmp_path / kind, 2, f"--parallelism.pipeline_parallel_schedule={schedule}",
                       global_=8)
        args[args.index("--training.steps=1")] = "--training.steps=2"
        planned[kind] = [s["total"] for s in parse(ok(launch(0, args + ["--dry-run"])).stdout)["stages"]]
        err = ok(launch(2, args, env=dict(ENV, CTITAN_LOG_RANKS="all"))).stderr
        got = dict((int(r), float(g) * 2**30) for r, g in re.findall(r"rank (\d+) of 2: peak memory ([0-9.]+) GiB", err))
        peak[kind] = [got[0], got[1]]
    for r in range(2):
        print(f"{schedule} rank {r}: planned {planned['medium'][r] / MIB:.1f} MiB, measured "
              f"{peak['medium'][r] / MIB:.1f} MiB; runtime (tiny model) {peak['untied'][r] / MIB:.1f} MiB")
        assert planned["medium"][r] <= peak["medium"][r], (r, planned, peak)
        assert peak["medium"][r] - planned["medium"][r] <= peak["untied"][r] + 8 * MIB, (r, planned, peak)


def test_dry_run_pp_under_mpirun(pp_models, tmp_path):
    """Under mpirun the world is MPI's; rank 0 prints what the dry run without it prints."""
    d, data = pp_models
    args = pp_args(d / "untied", data, tmp_path, 2)
    p = ok(launch(2, args + ["--dry-run"], env=dict(ENV, CTITAN_LOG_RANKS="all")))
    assert p.stdout.count("pipeline: world 2 = ") == 1 and p.stdout.count("  pipeline rank ") == 2, p.stdout
    assert p.stdout == ok(launch(0, args + ["--dry-run"])).stdout


ERRORS = [  # (ranks of the dry run (0: no mpirun), ranks of the run, P, extra args, words)
    (0, 2, 2, ["--parallelism.pipeline_parallel_microbatch_size=3"],
     "pipeline_parallel_microbatch_size = 3 does not divide training.local_batch_size = 4"),
    (0, 2, 2, ["--parallelism.data_parallel_replicate_degree=3"],
     "does not divide the world size 2 (ranks started by mpirun -np) / pipeline_parallel_degree"),
    (0, 2, 2, ["--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--training.local_batch_size=5"],
     "Interleaved1F1B takes micro-batches in 2 rounds (micro-batches / pipeline_parallel_degree 2), which must "
     "divide them, but a step has 5"),
    (0, 2, 2, ["--parallelism.pipeline_parallel_split_points=layers.2,layers.4"],
     "gives 3"),
    (0, 9, 9, [], "pipeline_parallel_degree = 9: the model has only 8 layers"),
    (3, 3, 2, [], "pipeline_parallel_degree = 2 does not divide the world size 3"),
]


@pytest.mark.parametrize("ranks,world,P,extra,words", ERRORS)
def test_dry_run_pp_errors(pp_models, tmp_path, ranks, world, P, extra, words):
    """A pipeline a run would reject, the dry run rejects with the run's message: exit 2, one
    error line, nothing planned. The run itself (under mpirun, its world) says the same."""
    d, data = pp_models
    args = pp_args(d / "untied", data, tmp_path, P, *extra)
    p = launch(ranks, args + ["--dry-run"], timeout=60)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1 and words in err[0], p.stderr
    assert "dry run" not in p.stdout and "pipeline rank" not in p.stdout
    run = launch(world, args, timeout=60)  # the world the dry run computed from the degrees
    run_err = [l for l in run.stderr.splitlines() if "ctitan: error" in l]
    assert run.returncode == 2 and len(run_err) == 1, run.stderr
    strip = lambda s: s.replace("[rank 0] ", "")
    assert strip(run_err[0]) == strip(err[0])


@pytest.mark.parametrize("split,words", [("layers.9", "\"layers.9\" is not a layer"),
                                         ("layers.5,layers.3", "\"layers.3\" does not come after layers.5")])
def test_dry_run_pp_bad_split_points(pp_models, tmp_path, split, words):
    d, data = pp_models
    p = launch(0, pp_args(d / "untied", data, tmp_path, 2, f"--parallelism.pipeline_parallel_split_points={split}")
               + ["--dry-run"], timeout=60)
    assert p.returncode == 2 and words in p.stderr, p.stderr


def torch_banks(schedule, P, S, M, r):
    """Per local stage of pipeline rank r, the most forwards whose backward has not run, in
    PyTorch's schedules (torch.distributed.pipelining.schedules): Schedule1F1B warms up with
    min(M, P - r) forwards and then runs one backward before each further forward;
    ScheduleGPipe runs every forward first; ScheduleInterleaved1F1B's order is its own
    pipeline_order for rank r (its warm-up and 1F1B ops, built by its module's functions)."""
    if schedule == "1F1B":
        return [min(M, P - r)]
    if schedule == "GPipe":
        return [M]
    from torch.distributed.pipelining import schedules as ts
    rounds = max(1, M // P)
    per_round = M // rounds
    warm = ts._get_warmup_ops(r, S, per_round, P, M)
    fwd_bwd = S * M - warm
    ops = ts._get_1f1b_rank_ops(S, P, warm, fwd_bwd, S * M - fwd_bwd, r,
                                lambda k: (k // per_round) % S * P + r,
                                lambda k: (S - 1 - (k - warm) // per_round % S) * P + r)
    live, most = [0] * S, [0] * S
    for a in ops:
        if a is None:
            continue
        c = a.stage_index // P
        live[c] += 1 if a.computation_type == ts._ComputationType.FORWARD else -1
        most[c] = max(most[c], live[c])
    assert all(n == 0 for n in live), ops
    return most


@pytest.mark.parametrize("name", CASES)
def test_dry_run_pp_banks_are_torchs_forwards_in_flight(pp_models, tmp_path, name):
    """Each pipeline rank's activation banks (one per forward whose backward has not run, per
    local stage) are the most forwards PyTorch's schedule of the same name keeps in flight on
    that rank. A 1F1B warm-up one forward longer trains to the same numbers and kept one more
    bank per stage (the fourth mutation audit): only this count shows it."""
    kind, P, extra, local, global_ = CASES[name]
    d, data = pp_models
    args = pp_args(d / kind, data, tmp_path, P, *extra, local=local, global_=global_)
    plan = parse(ok(launch(0, args + ["--dry-run"])).stdout)
    S, M = plan["S"], plan["M"]
    assert M > P, f"{name}: {M} micro-batches: a warm-up one longer must have a forward left to run"
    for s in plan["stages"]:
        want = sum(torch_banks(plan["schedule"], P, S, M, s["rank"]))
        assert s["n_banks"] == want, f"{name} rank {s['rank']}: {s['n_banks']} banks, torch keeps {want} in flight"
