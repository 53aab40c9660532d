"""Expert parallel (issue 7): a MoE layer's rows go to the rank that runs their
experts (all-to-allv) and come back to be weighted and summed on their own rank.

EP 2 over 2 data-parallel ranks (with DP replicate, with FSDP, and twice within HSDP
2x2 on 4 ranks) must train like one process with the same global batch: loss of 10
steps, validation loss and the final weights to 1e-5 (weights: of each tensor's
largest), and the first step's gradients (AdamW's exp_avg after one step) to 1e-5 (the
one-process run is tied to PyTorch by test_train_loop.py / test_moe.py). Beyond that,
EP changes where an expert runs and nothing else: with 2 ranks of FSDP it is bit for
bit the same run as FSDP 2 without EP (the owner runs each source rank's rows as that
rank's own kernel would and adds the two partial sums as the reduce-scatter does;
docs/distributed.md), and activation checkpointing (full, selective op, every 2nd
layer), which reruns the dispatch before a layer's backward, changes no bit either.
A checkpoint written under EP 2 resumes on one process with the uninterrupted run's
later steps. Bad degrees exit 2 naming the key. No auxiliary loss in the gradient: it
is a function of each micro-batch's own tokens, which differ by layout
(docs/distributed.md), so it would not match any layout."""
import numpy as np
import pytest

from test_dist import (assert_same_norms, assert_same_run, losses, run, setup,  # noqa: F401 (setup: fixture)
                       train_args, weights)

EP2 = ["--parallelism.expert_parallel_degree=2"]


@pytest.fixture(scope="module")
def single_moe(setup):
    d, data = setup
    out = d / "single_moe_ep"
    run(1, train_args(d / "model_moe", data, out))
    return out


def layout_run(d, data, out, rep, shard, *extra):
    """EP 2 (unless extra says otherwise) over rep x shard data-parallel ranks."""
    return run(rep * shard, train_args(d / "model_moe", data, out, *EP2,
                                       f"--parallelism.data_parallel_replicate_degree={rep}",
                                       f"--parallelism.data_parallel_shard_degree={shard}", *extra, dp=rep * shard))


@pytest.fixture(scope="module")
def ep_fsdp2(setup):
    """EP 2 over FSDP 2, without activation checkpointing."""
    d, data = setup
    out = d / "ep2_1x2"
    p = layout_run(d, data, out, 1, 2)
    return out, p


@pytest.mark.parametrize("rep,shard", [(2, 1), (1, 2), (2, 2)])
def test_ep2_matches_one_rank(setup, single_moe, ep_fsdp2, rep, shard):
    """EP 2 over DP 2, over FSDP 2, and as two EP groups of HSDP 2x2 (4 ranks)."""
    d, data = setup
    if (rep, shard) == (1, 2):
        out, p = ep_fsdp2
    else:
        out = d / f"ep2_{rep}x{shard}"
        p = layout_run(d, data, out, rep, shard)
    assert "expert_parallel 2: rank 0 runs experts 0..1 of 4 and stores only those" in p.stderr, p.stderr[-2000:]
    assert any(".mlp.experts.3." in k for k in weights(out)), "every expert must be in the checkpoint"
    assert_same_run(out, single_moe, f"EP2 over DP {rep}x{shard}")
    # each expert's squares counted once: over the EP group without FSDP, in the shard group with it
    assert_same_norms(out, single_moe, f"EP2 over DP {rep}x{shard}")


def assert_same_bits(out, ref, what):
    assert losses(out) == losses(ref), f"{what}: losses differ"
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys(), f"{what}: tensor names differ"
    for k in b:
        n = int(np.sum(a[k] != b[k]))
        assert n == 0, f"{what}: {n} elements of the final {k} differ (by up to {np.max(np.abs(a[k] - b[k])):.3g})"


def test_ep2_over_fsdp2_is_fsdp2_bit_for_bit(setup, ep_fsdp2):
    """Each source rank's rows are the GEMM that rank runs without EP, and the two
    partial sums meet as in FSDP's reduce-scatter: nothing but the place changes."""
    d, data = setup
    out = d / "fsdp2_no_ep"
    p = layout_run(d, data, out, 1, 2, "--parallelism.expert_parallel_degree=1")
    assert "expert_parallel" not in p.stderr, "the later --parallelism.expert_parallel_degree=1 must win"
    assert_same_bits(ep_fsdp2[0], out, "EP2 over FSDP 2 vs FSDP 2 without EP")


@pytest.mark.parametrize("rep,shard,ac", [
    (1, 2, ["--activation_checkpoint.mode=full"]),
    (1, 2, ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]),
    (2, 1, ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"]),
])
def test_ep2_with_activation_checkpointing(setup, single_moe, ep_fsdp2, rep, shard, ac):
    """Full: both MoE layers share one dispatch, rerun before each backward (the last
    layer's is still there). op: h is rebuilt from the kept gate/up. 2: layer 1 only
    (full), layer 2 not checkpointed. Same as one rank; over FSDP 2 the same bits as
    without checkpointing."""
    d, data = setup
    out = d / f"ep2_ac_{rep}x{shard}_{ac[-1].split('=')[1]}"
    layout_run(d, data, out, rep, shard, *ac)
    assert_same_run(out, single_moe, f"EP2 over DP {rep}x{shard} with {' '.join(ac)}")
    if (rep, shard) == (1, 2):
        assert_same_bits(out, ep_fsdp2[0], f"EP2 over FSDP 2 with {' '.join(ac)} vs without")


def test_ep2_first_step_gradients_match_one_rank(setup):
    d, data = setup
    one = ["--training.steps=1", "--checkpoint.last_save_model_only=false"]
    run(1, train_args(d / "model_moe", data, d / "grad1", *one))
    run(2, train_args(d / "model_moe", data, d / "grad2", *EP2, *one, dp=2))
    a, b = weights(d / "grad2", 1, "optim.safetensors"), weights(d / "grad1", 1, "optim.safetensors")
    assert a.keys() == b.keys() and any("experts.3" in k and "exp_avg" in k for k in b), sorted(b)[:8]
    for k in b:
        if "exp_avg" in k and "exp_avg_sq" not in k:
            err = np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)
            assert err <= 1e-5, f"{k}: first step's gradient differs from one rank by {err:.3g}"


def test_ep2_checkpoint_resumes_on_one_rank(setup, single_moe):
    d, data = setup
    out = d / "ep2_to_1"
    p = run(2, train_args(d / "model_moe", data, out, *EP2, "--training.stop_at_step=4",
                          "--checkpoint.last_save_model_only=false", dp=2), check=False)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    run(1, train_args(d / "model_moe", data, out, "--checkpoint.last_save_model_only=false"))
    assert any("experts.3." in k and "exp_avg_sq" in k for k in weights(out, 4, "optim.safetensors"))
    assert_same_run(out, single_moe, "EP2 -> 1 rank", steps=range(5, 11))


@pytest.mark.parametrize("ranks,model,args,words", [
    (2, "model_moe", ["--parallelism.expert_parallel_degree=3"], "does not divide the model's 4 experts"),
    (2, "model_moe", ["--parallelism.expert_parallel_degree=4"],
     "needs at least 4 data-parallel ranks, but there are 2 (data_parallel_replicate_degree 1 x "
     "data_parallel_shard_degree 2 from -1: 2 ranks started by mpirun -np)"),
    (2, "model", ["--parallelism.expert_parallel_degree=2"], "no experts"),
])
def test_ep_bad_degrees_exit_2(setup, tmp_path, ranks, model, args, words):
    d, data = setup
    p = run(ranks, train_args(d / model, data, tmp_path / "bad", *args, dp=2), check=False, timeout=60)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-2000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once (rank 0):\n{p.stderr[-2000:]}"
    assert "expert_parallel_degree" in err[0] and words in err[0], err[0]
