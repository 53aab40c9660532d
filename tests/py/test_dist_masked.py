"""Loss masks through the CLI on several ranks (issue 17, part 4): labels masked to -100 by a
token file's `.mask` (docs/data.md, "Packing") in one process, DP, FSDP and TP runs under
mpirun, each compared with PyTorch on the same masked batch: the step-1 loss and grad norm,
then the step-2 loss and grad norm (after the first AdamW step, so they see its weights).

The loss of a step is the mean over the valid targets of the whole global batch: each rank
scales its gradient by 1 / (valid targets summed over every rank and micro-batch). The
masks here are uneven across ranks and micro-batches (one rank of the dp4 layout has no
valid target at all in step 1), so a count that stayed per rank or per micro-batch gives
another loss and another gradient."""
import re

import numpy as np
import pytest
import torch

import conftest
import oracle
from test_dist import ENV, run  # noqa: F401  (mpirun, one thread per rank)

L = 16
MICRO, GLOBAL, STEPS = 2, 8, 2
# valid targets of each window of the first two steps (windows 0-7: step 1, 8-15: step 2).
# No shuffling: in step 1, rank r of a dp2 run takes windows r, r+2, r+4, r+6 and of a dp4
# run r and r+4, so rank 0 of dp4 has none and rank 1 of dp2 has 45 of 53.
VALID = [0, 16, 3, 14, 0, 12, 5, 3, 16, 1, 8, 0, 11, 16, 2, 7]
LAYOUTS = {  # name: (ranks, extra args)
    "one_process": (1, []),
    "dp2": (2, ["--parallelism.data_parallel_replicate_degree=2"]),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"]),
    "dp4": (4, ["--parallelism.data_parallel_replicate_degree=4"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree=2"]),
    # the count is summed over the data-parallel ranks only: TP ranks share one batch
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
}
LR, WARMUP = 3e-3, 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("masked")
    # vocab 252: TP splits the lm_head by rows (vocabulary-parallel cross-entropy)
    cfg = oracle.tiny_config(vocab=252, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(d / "model", cfg, seed=13)
    n_win = 24
    tokens = oracle.learnable_stream(n_win * (L + 1), 251, seed=3)
    rng = np.random.default_rng(8)
    mask = np.ones(len(tokens), dtype=np.uint8)
    for w in range(n_win):
        k = VALID[w] if w < len(VALID) else L
        # a window's targets are its tokens 1..L; token 0 is never a target of it
        m = np.zeros(L, dtype=np.uint8)
        m[rng.choice(L, size=k, replace=False)] = 1
        mask[w * (L + 1) + 1: (w + 1) * (L + 1)] = m
    data = d / "data"
    data.mkdir()
    oracle.write_bin(data / "tokens.bin", tokens)
    mask.tofile(data / "tokens.mask")  # read beside tokens.bin (docs/data.md)
    return d, tokens, mask


def reference(model_dir, tokens, mask):
    """torchtitan's loop in PyTorch on the masked windows: per step the CE sum over the
    valid targets of all 8 windows / their count, clip to 1, AdamW, the warmup schedule."""
    w = oracle.windows(tokens, L)
    mw = mask[: len(w) * (L + 1)].reshape(len(w), L + 1)
    x, y = w[:, :-1], np.where(mw[:, 1:] == 1, w[:, 1:], oracle.IGNORE)
    model = oracle.load_hf(model_dir)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, oracle.make_lr_lambda(STEPS, WARMUP))
    losses, norms = [], []
    model.train()
    for s in range(STEPS):
        xs, ys = x[s * GLOBAL:(s + 1) * GLOBAL], y[s * GLOBAL:(s + 1) * GLOBAL]
        assert oracle.n_valid(ys) == sum(VALID[s * GLOBAL:(s + 1) * GLOBAL])
        opt.zero_grad(set_to_none=True)
        ls, _ = oracle.ce_sum(model, xs, ys)
        loss = ls / oracle.n_valid(ys)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        losses.append(loss.item())
        opt.step()
        sched.step()
    return losses, norms


@pytest.fixture(scope="module")
def ref(setup):
    d, tokens, mask = setup
    losses, norms = reference(d / "model", tokens, mask)
    # the masks matter: the mean of dp2's per-rank means (a count left per rank) is 100 times
    # the tolerance of the comparison below away from the global mean
    w = oracle.windows(tokens, L)[:GLOBAL]
    mw = mask[: GLOBAL * (L + 1)].reshape(GLOBAL, L + 1)
    y = np.where(mw[:, 1:] == 1, w[:, 1:], oracle.IGNORE)
    model = oracle.load_hf(d / "model")
    per_rank = [oracle.hf_loss(model, w[r::2, :-1], y[r::2]) for r in range(2)]
    assert abs(np.mean(per_rank) - losses[0]) > 100 * 1e-5 * losses[0], (per_rank, losses[0])
    return losses, norms


def train_args(d, out, extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={d / 'model'}",
            f"--checkpoint.initial_load_path={d / 'model'}", "--checkpoint.initial_load_in_hf",
            f"--training.dataset_path={d / 'data'}", f"--training.seq_len={L}",
            f"--training.local_batch_size={MICRO}", f"--training.global_batch_size={GLOBAL}",
            f"--training.steps={STEPS}", "--training.seed=5", f"--optimizer.lr={LR}",
            f"--lr_scheduler.warmup_steps={WARMUP}", "--metrics.log_freq=1", "--metrics.peak_tflops=1",
            f"--job.dump_folder={out}", *extra]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_masked_loss_matches_pytorch(setup, ref, name):
    d, _, _ = setup
    n, extra = LAYOUTS[name]
    out = d / name
    p = run(n, train_args(d, out, extra), check=False)
    conftest.crashed(p.returncode, p.stderr, ["mpirun", "-np", n, "ctitan", *train_args(d, out, extra)])
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}"
    rows = {r["step"]: r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want_loss, want_norm = ref
    for s in range(1, STEPS + 1):
        got = rows[s]
        assert abs(got["loss"] - want_loss[s - 1]) <= 1e-5 * want_loss[s - 1], \
            f"{name}: step {s} loss {got['loss']!r} vs PyTorch {want_loss[s - 1]!r}"
        assert abs(got["grad_norm"] - want_norm[s - 1]) <= 1e-4 * want_norm[s - 1], \
            f"{name}: step {s} grad_norm {got['grad_norm']!r} vs PyTorch {want_norm[s - 1]!r}"
        # the valid-target count of the step, summed over ranks and micro-batches
        assert got["valid_targets"] == sum(VALID[(s - 1) * GLOBAL: s * GLOBAL]), f"{name}: step {s}: {got}"
