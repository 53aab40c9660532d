"""The MoE debug model in every layout of issue 7 at 2 and 4 ranks: tensor parallel (each
expert split like the dense MLP, the router replicated), TP x FSDP, TP x FSDP x EP, and
DP 4, FSDP 4, EP 4 over FSDP 4 (one expert per rank), EP 2 over FSDP 4 (each expert
sharded over the two FSDP ranks that hold it), EP 2 over DP 4 (each expert's gradient
summed over the two replicas that hold it), and pipeline stages with EP inside each
(PP 2 x DP 2 x EP 2, PP 2 x FSDP 2 x EP 2, with activation checkpointing, and
PP 2 x TP 2 x FSDP 2 x EP 2 over 8 ranks). Under EP a rank stores only its own experts:
the parameter count rank 0 reports is checked against the config's.

Each layout trains like one process with the same global batch: the loss of 10 steps,
the validation loss and the gradient norm to 1e-5 relative, and the first step's
gradients (AdamW's exp_avg after one step) to 1e-5 of each tensor's largest. The one
process is tied to PyTorch by test_moe.py / test_train_loop.py.

Final weights after 10 steps are compared per tensor as ||a - b|| / ||b|| <= 1e-5
(test_dist.assert_same_weights), not element by element. Measured on this model, one
process against itself with a different micro-batch split (local_batch_size 8 instead
of 2: the same math, other fp32 sums) already differs by 1.9e-5 of a tensor's largest
element after 10 steps, so an element-wise 1e-5 is below what fp32 reproduces here. The
cause is AdamW's division by sqrt(v) + eps: at step 1 one element of layer 1's expert 1
has the gradient -4.8e-9 (its tensor's largest is ~1e-4); a change in the last bits of
the sums moves it by 1%, and its update, about lr * g / (|g| + eps), by 0.3% of lr.
Element-wise figures for every layout are in docs/distributed.md. No auxiliary loss in
the gradient: it is a function of each micro-batch's tokens, which differ by layout."""
import re
import subprocess

import numpy as np
import pytest

import oracle
from conftest import BIN
from test_dist import ENV, STEPS, assert_same_run, losses, mpirun, run, train_args, weights

P = "--parallelism."


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_moe")
    from transformers import Qwen3MoeConfig
    # heads 4, kv heads 2, dense intermediate 48 (layer 0), experts' 20, vocabulary 256:
    # TP 2 divides all of them; 4 experts, top 2
    for name, moe_inter in (("model_moe", 20), ("model_moe_21", 21)):
        Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=moe_inter,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                       norm_topk_prob=True, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
                       output_router_logits=False).save_pretrained(d / name)
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    ref = d / "single"
    p = run(1, train_args(d / "model_moe", data, ref, "--checkpoint.last_save_model_only=false"))
    (d / "single.stderr").write_text(p.stderr)  # its start-up log: the whole model's figures
    return d, data, ref


LAYOUTS = {  # name: (ranks, data-parallel degree, args)
    "tp2": (2, 1, [P + "tensor_parallel_degree=2"]),
    "tp2_fsdp2": (4, 2, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"]),
    "tp2_fsdp2_ep2": (4, 2, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2",
                             P + "expert_parallel_degree=2"]),
    "tp2_dp2_ac_full": (4, 2, [P + "tensor_parallel_degree=2", P + "data_parallel_replicate_degree=2",
                               "--activation_checkpoint.mode=full"]),
    "tp2_fsdp2_ep2_ac_op": (4, 2, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2",
                                   P + "expert_parallel_degree=2", "--activation_checkpoint.mode=selective",
                                   "--activation_checkpoint.selective_ac_option=op"]),
    "dp4": (4, 4, [P + "data_parallel_replicate_degree=4"]),
    "fsdp4": (4, 4, [P + "data_parallel_shard_degree=4"]),
    "fsdp4_ep4": (4, 4, [P + "data_parallel_shard_degree=4", P + "expert_parallel_degree=4"]),
    # experts sharded over the 2 FSDP ranks that hold them; summed over the 2 replicas that do
    "fsdp4_ep2": (4, 4, [P + "data_parallel_shard_degree=4", P + "expert_parallel_degree=2"]),
    "dp4_ep2": (4, 4, [P + "data_parallel_replicate_degree=4", P + "expert_parallel_degree=2"]),
}

# the model of moe_setup: every tensor's size, and how many of them are the experts'
H, V, I, IM, E, NH, NKV, HD, MOE_LAYERS = 30, 256, 48, 20, 4, 4, 2, 8, 2
EXPERT_PARAMS = MOE_LAYERS * E * 3 * H * IM
ALL_PARAMS = (2 * V * H + H + 3 * (2 * H + 2 * HD + 2 * NH * HD * H + 2 * NKV * HD * H)
              + 3 * I * H + MOE_LAYERS * E * H + EXPERT_PARAMS)


def grad_norms(out):
    return {r["step"]: r["grad_norm"] for r in oracle.read_metrics(out / "metrics.jsonl") if "grad_norm" in r}


def aux_losses(out):
    return {r["step"]: r["aux_loss"] for r in oracle.read_metrics(out / "metrics.jsonl") if "aux_loss" in r}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_one_rank(moe_setup, name):
    d, data, ref = moe_setup
    n, dp, args = LAYOUTS[name]
    out = d / name
    p = run(n, train_args(d / "model_moe", data, out, *args, dp=dp))
    assert len([l for l in p.stdout.splitlines() if l.startswith("step: 1 ")]) == 1, p.stdout
    held = int(re.search(r"ctitan: model \S+: (\d+) parameters", p.stderr).group(1))
    ep = int(re.search(r"_ep(\d)", name).group(1)) if "_ep" in name else 1
    if "tp2" not in name:  # rank 0 stores its 1/ep of the experts and everything else
        assert held == ALL_PARAMS - EXPERT_PARAMS + EXPERT_PARAMS // ep, f"{name}: rank 0 holds {held} parameters"
    # the model line gives the whole model in every layout, after the rank's part where it runs one
    line = re.search(r"ctitan: model \S+: .*", p.stderr).group(0)
    whole = f"{ALL_PARAMS} parameters{' in the whole model' if held != ALL_PARAMS else ''}, 3 layers, hidden {H}, " \
            f"heads {NH}/{NKV} x {HD}, vocab {V}"
    assert whole in line, f"{name}: {line}"
    if held != ALL_PARAMS:
        assert f": {held} parameters on rank 0 of {n} (its part" in line, f"{name}: {line}"
        assert ("heads 2/1" in line) == ("tp2" in name), f"{name}: {line}"
    # FLOPs per token: one process's figure, or this rank's share beside it (TP: MFU's, per rank)
    single = re.search(r"ctitan: (\S+) FLOPs/token \(6 x", (d / "single.stderr").read_text()).group(1)
    flops = re.search(r"ctitan: (\S+) FLOPs/token(.*)", p.stderr)
    if "tp2" in name:
        assert flops.group(2).startswith(f" per rank (its part of the model; the whole model: {single}; "), \
            f"{name}: {flops.group(0)}"
        assert float(flops.group(1)) < float(single)
    else:
        assert flops.group(1) == single and flops.group(2).startswith(" (6 x"), f"{name}: {flops.group(0)}"
    if ep > 1:
        assert f"expert_parallel {ep}: rank 0 runs experts 0..{E // ep - 1} of {E} and stores only those" \
            in p.stderr, p.stderr[-2000:]
    assert_same_run(out, ref, name)
    assert any(".mlp.experts.3.down_proj" in k for k in weights(out))
    got, want = grad_norms(out), grad_norms(ref)
    assert set(got) == set(want) == set(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{name}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"


# pipeline stages with expert parallel inside each stage (the EP group of a stage is its
# data-parallel ranks): 1F1B keeps 2 micro-batches in flight on stage 0 (of 2 or 4 a step),
# each with its own dispatch state
PM = P + "pipeline_parallel_microbatch_size"
PP_EP = {
    "pp2_dp2_ep2": (4, 2, [P + "pipeline_parallel_degree=2", P + "data_parallel_replicate_degree=2",
                           P + "expert_parallel_degree=2", PM + "=2"]),
    "pp2_fsdp2_ep2_mb1": (4, 2, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=2",
                                 P + "expert_parallel_degree=2", PM + "=1"]),
    "pp2_fsdp2_ep2_mb1_ac_op": (4, 2, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=2",
                                       P + "expert_parallel_degree=2", PM + "=1",
                                       "--activation_checkpoint.mode=selective",
                                       "--activation_checkpoint.selective_ac_option=op"]),
    "pp2_dp2_ep2_gpipe_mb1_ac_full": (4, 2, [P + "pipeline_parallel_degree=2", P + "data_parallel_replicate_degree=2",
                                             P + "expert_parallel_degree=2", PM + "=1",
                                             P + "pipeline_parallel_schedule=GPipe",
                                             "--activation_checkpoint.mode=full"]),
    # every layout at once: 8 ranks, each stage's experts over the EP ranks of its TP slice
    "pp2_tp2_fsdp2_ep2": (8, 2, [P + "pipeline_parallel_degree=2", P + "tensor_parallel_degree=2",
                                 P + "data_parallel_shard_degree=2", P + "expert_parallel_degree=2", PM + "=2"]),
}


@pytest.mark.parametrize("name", list(PP_EP))
def test_moe_pipeline_with_expert_parallel_matches_one_rank(moe_setup, name):
    """PP 2 x (DP or FSDP) 2 x EP 2, and with TP 2: each stage's MoE layers send their rows to the stage's
    EP ranks while other micro-batches wait in their banks for their backward; the losses,
    validation losses, gradient norms and final weights equal one process's, and rank 0
    stores half the experts of its stage's layers. With one dispatch state per layer (not
    per micro-batch in flight) the second step's loss was off by 1.5e-5 relative."""
    d, data, ref = moe_setup
    n, dp, args = PP_EP[name]
    out = d / name
    p = run(n, train_args(d / "model_moe", data, out, *args, dp=dp))
    assert "expert_parallel 2: rank 0 runs experts 0..1 of 4 and stores only those" in p.stderr, p.stderr[-2000:]
    assert re.search(rf"^ctitan: parallelism: world {n} .*pipeline\w* 2\b", p.stderr, re.M), p.stderr[-2000:]
    assert_same_run(out, ref, name)
    got, want = grad_norms(out), grad_norms(ref)
    assert set(got) == set(want) == set(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{name}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"


def _micro1(args):
    """train_args with one sequence per micro-batch (the step's 8 sequences as 8 micro-batches)."""
    out = [a for a in args if not a.startswith("--training.local_batch_size=")]
    assert len(out) == len(args) - 1
    return out + ["--training.local_batch_size=1"]


@pytest.mark.parametrize("name", ["dp4", "tp2_fsdp2_ep2"])
def test_moe_logged_aux_loss_matches_one_rank(moe_setup, name):
    """metrics.jsonl's aux_loss (the load-balancing loss, logged although this model's
    gradient leaves it out) is the mean over the step's micro-batches of every rank, so each
    step equals one process's to 1e-5, not dp times it. The loss is a function of each
    micro-batch's tokens and the layouts split a step's sequences into micro-batches
    differently, so both runs here take one sequence per micro-batch: the same 8 per step
    (the losses equal, as test_moe_layout_matches_one_rank checks), the same mean."""
    d, data, _ = moe_setup
    ref = d / "aux_single_mb1"
    if not (ref / "metrics.jsonl").exists():
        run(1, _micro1(train_args(d / "model_moe", data, ref)))
    n, dp, args = LAYOUTS[name]
    out = d / f"aux_{name}_mb1"
    run(n, _micro1(train_args(d / "model_moe", data, out, *args, dp=dp)))
    got, want = losses(out), losses(ref)
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), f"{name}: losses {got} vs {want}"
    got, want = aux_losses(out), aux_losses(ref)
    assert set(got) == set(want) == set(range(1, STEPS + 1)), f"{name}: aux_loss steps {sorted(got)}"
    for s in want:
        assert want[s] > 0 and abs(got[s] - want[s]) <= 1e-5 * want[s], \
            f"{name}: step {s} aux_loss {got[s]!r} vs one rank {want[s]!r}"


def test_moe_logged_loads_are_every_data_parallel_rank_s(moe_setup):
    """load(min/max) of the console line and metrics.jsonl's moe_load_min / moe_load_max,
    under data parallel 4 with expert parallel 2: the fewest and the most tokens an expert
    got in any data-parallel rank's last micro-batch, as aux_loss is their mean, so every
    rank logs the same figures (CTITAN_LOG_RANKS=all shows each one's line), not its own
    micro-batch's, and metrics.jsonl holds what the console shows."""
    d, data, _ = moe_setup
    n, dp, args = LAYOUTS["dp4_ep2"]
    out = d / "loads_dp4_ep2"
    cmd = mpirun() + ["-np", str(n), str(BIN)] + [str(a) for a in train_args(d / "model_moe", data, out, *args,
                                                                               dp=dp)]
    p = subprocess.run(cmd, env=dict(ENV, CTITAN_LOG_RANKS="all"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    by_step = {}
    for m in re.finditer(r"^step: (\d+) .*?(aux_loss: \S+  load\(min/max\):[ 0-9/]+)", p.stdout, re.M):
        by_step.setdefault(int(m.group(1)), []).append(m.group(2).strip())
    assert sorted(by_step) == list(range(1, STEPS + 1)), sorted(by_step)
    for s, lines in by_step.items():
        assert len(lines) == n and len(set(lines)) == 1, f"step {s}: the ranks log {lines}"
    rows = [r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r]
    for r in rows:
        assert len(r["moe_load_min"]) == MOE_LAYERS and all(a <= b for a, b in zip(r["moe_load_min"],
                                                                                   r["moe_load_max"])), r
        shown = by_step[r["step"]][0].split("load(min/max):")[1].split()
        assert shown == [f"{a}/{b}" for a, b in zip(r["moe_load_min"], r["moe_load_max"])], (shown, r)


@pytest.mark.parametrize("name", ["tp2", "tp2_fsdp2_ep2"])
def test_moe_first_step_gradients(moe_setup, name):
    """Every tensor's gradient (sliced experts, replicated router and norms, the
    vocabulary-parallel lm_head) equals one process's after one step."""
    d, data, _ = moe_setup
    outs = {}
    for key, (n, dp, args) in (("one", (1, 1, [])), (name, LAYOUTS[name])):
        outs[key] = d / f"grad1_{key}_{name}"
        p = run(n, train_args(d / "model_moe", data, outs[key], "--training.stop_at_step=1",
                              "--checkpoint.last_save_model_only=false", *args, dp=dp), check=False)
        assert p.returncode == 75, p.stderr[-3000:]
    a = weights(outs[name], step=1, file="optim.safetensors")
    b = weights(outs["one"], step=1, file="optim.safetensors")
    assert a.keys() == b.keys() and any("experts.3.up_proj" in k for k in b)
    for k in b:
        if k.endswith("exp_avg"):
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-30)
            assert err <= 1e-5, f"{name}: {k}: gradient differs from one process by {err:.3g} (relative to its max)"


@pytest.mark.parametrize("first,then", [("tp2_fsdp2_ep2", "one"), ("one", "tp2"), ("pp2_dp2_ep2", "fsdp4_ep4"),
                                        ("one", "pp2_fsdp2_ep2_mb1")])
def test_moe_checkpoint_moves_between_layouts(moe_setup, first, then):
    """Written under TP 2 x FSDP 2 x EP 2 and resumed on one process (one process -> TP 2,
    PP 2 x DP 2 x EP 2 -> FSDP 4 x EP 4, one process -> PP 2 x FSDP 2 x EP 2): the steps
    after the checkpoint equal the uninterrupted one-process run's."""
    d, data, ref = moe_setup
    lay = dict(LAYOUTS, **PP_EP, one=(1, 1, []))
    (n1, dp1, a1), (n2, dp2, a2) = lay[first], lay[then]
    out = d / f"move_{first}_to_{then}"
    p = run(n1, train_args(d / "model_moe", data, out, "--training.stop_at_step=4",
                           "--checkpoint.last_save_model_only=false", *a1, dp=dp1), check=False)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    p = run(n2, train_args(d / "model_moe", data, out, "--checkpoint.last_save_model_only=false", *a2, dp=dp2))
    assert "resuming from" in p.stderr, p.stderr[-2000:]
    assert_same_run(out, ref, f"{first} -> {then}", steps=range(5, STEPS + 1))


def test_moe_tp_degree_must_divide_the_experts(moe_setup):
    d, data, _ = moe_setup
    p = run(2, train_args(d / "model_moe_21", data, d / "bad_tp_moe", P + "tensor_parallel_degree=2"), check=False,
            timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1 and "tensor_parallel_degree = 2 does not divide the model's moe_intermediate_size (21)" \
        in err[0], p.stderr[-2000:]
