"""Ring attention for context parallel (parallelism.context_parallel_rotate_method =
"alltoall", PyTorch's _AllToAllRotater; docs/distributed.md): each rank keeps its own chunk
of k and v, the chunks travel round the ranks one at a time and merge into the pieces whose
causal prefix they reach by online softmax (kernels/ops.h, op_attention_fwd_blk), and the
backward sends dk, dv round with them back to their owner.

Every CP layout test_dist_cp.py covers runs once more under the ring and must train like one
process with test_dist_cp's checks and tolerances (losses, validation losses, gradient norms
and final weights to 1e-5; bf16 to RING_TOL's bounds, which say why). The ring
holds 8 B T/cp kv-width floats of scratch where the all-gather holds 6 B T: the dry run says
so, and so does the measured peak RSS at CP 4 on a long sequence. The block kernels
themselves are checked against torch in test_ops_torch.py (test_attention_blocks)."""
import re
import subprocess

import numpy as np
import pytest

import oracle
from conftest import BIN
from test_dist import ENV, mpirun, run, train_args
from test_dist_cp import (ADAPTED, CP, LAYOUTS, NONE, REF_EXTRA, TOL, TRAINED, _refs, assert_layout,  # noqa: F401
                          assert_same_cp, data_for, grad_norms, setup, single)

RING = "--parallelism.context_parallel_rotate_method=alltoall"
RING_LINE = "ring attention (context_parallel_rotate_method alltoall)"

# every kind of layout test_dist_cp runs, once each under the ring
RING_LAYOUTS = ["cp2", "cp4", "cp2_none", "cp4_none", "cp2_fsdp2", "cp2_bf16", "cp2_moe", "cp4_gemma3",
                "cp4_gemma3_none", "cp2_phi3_longrope", "cp2_tp2", "cp2_tp2_mistral_swa5", "cp2_ep2_fsdp2",
                "cp2_pp2", "cp2_pp2_tp2", "cp2_ac_full"]


# bf16 (weights 5e-3, gradient norms 1e-3): the ring's online softmax rounds the attention
# output differently from the one-process kernel in the last fp32 bit, and under bf16 products
# those bits flip bf16 roundings that AdamW then spreads (test_dist_cp.assert_same_cp). One
# process against itself with the other attention implementation (--kernels.attention=ref
# instead of the default tiled one, the same math) moved the embedding by 2.5e-3 norm-wise and
# a gradient norm by 4.7e-4 on this model after 10 steps; the ring moved them by 2.3e-3 and
# 2.3e-4 (the all-gather path, which runs the one-process kernel, by 1.7e-4 and 2.2e-4).
RING_TOL = dict(TOL, bf16=dict(wtol=5e-3, gtol=1e-3, ltol=TOL["bf16"]["ltol"]))


@pytest.mark.parametrize("name", RING_LAYOUTS)
def test_ring_matches_one_rank(setup, name):
    d, data = setup
    n, dp, model, ref, extra = LAYOUTS[name]
    want = single(setup, ref, model, *REF_EXTRA.get(ref, []))
    out = d / ("ring_" + name)
    p = run(n, train_args(d / model, data_for(d, data, model), out, *extra, RING, dp=dp), timeout=300)
    assert_layout(p.stderr, extra)
    assert RING_LINE in p.stderr, p.stderr[-2000:]
    assert_same_cp(out, want, "ring " + name, **RING_TOL.get(ref, {}))


@pytest.mark.parametrize("name", ["cp2_lora", "cp2_lora_dropout_none"])
def test_ring_trains_adapters_like_one_rank(setup, name):
    """LoRA under the ring: the adapters' gradients (through dq, dk, dv of every block) and
    final weights are the one-process run's."""
    from safetensors.numpy import load_file
    d, data = setup
    n, dp, ref, extra = ADAPTED[name]
    key = (d, "trained_" + ref)
    if key not in _refs:
        out = d / f"single_trained_{ref}"
        p = run(1, train_args(d / "model", data, out, *TRAINED[ref]))
        (out / "stderr.txt").write_text(p.stderr)
        _refs[key] = out
    want = _refs[key]
    out = d / ("ring_" + name)
    p = run(n, train_args(d / "model", data, out, *TRAINED[ref], *extra, RING, dp=dp), timeout=300)
    assert RING_LINE in p.stderr, p.stderr[-2000:]
    got, exp = grad_norms(out), grad_norms(want)
    assert set(got) == set(exp) and exp, (got, exp)
    for s in exp:
        assert abs(got[s] - exp[s]) <= 1e-5 * exp[s], f"{name}: step {s} grad_norm {got[s]!r} vs {exp[s]!r}"
    f = "checkpoint/step-10/adapter_model.safetensors"
    a, b = load_file(str(out / f)), load_file(str(want / f))
    assert a.keys() == b.keys() and b
    for k in b:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= 1e-5, f"{name}: final {k} differs from one rank by {err:.3g} norm-wise"


def test_rotate_method_option(setup, tmp_path):
    """torchtitan's key: "allgather" by default (torchtitan's and PyTorch's default), "alltoall"
    the ring; anything else is refused naming the values taken."""
    p = subprocess.run([str(BIN), "train", "--help"], capture_output=True, text=True, timeout=60)
    entry = p.stdout.split("--parallelism.context_parallel_rotate_method=", 1)[1].split("\n  --", 1)[0]
    assert entry.startswith("<allgather|alltoall>") and '(default: "allgather")' in entry, entry
    d, data = setup
    p = subprocess.run([str(BIN), *train_args(d / "model", data, tmp_path / "bad", f"{CP}=2",
                                              "--parallelism.context_parallel_rotate_method=ring"), "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "parallelism.context_parallel_rotate_method: 'ring' is not one of: allgather, alltoall" in p.stderr


def scratch_floats(B, T, cp, nh, nkv, hd, headtail, ring):
    """The attention scratch per rank, from docs/distributed.md's description of the two
    methods: the all-gather's k, v gathered, the prefix's k, v and their gradients (6 B T kv
    width) and, under headtail, one piece's q, out, dq, d(out) and lse (4 B L q width + B nh L,
    L = T / 2cp); the ring's two receive buffers of a chunk's k, v, dk, dv (8 B T/cp kv width)
    and one row sum per query row (B nh T/cp)."""
    kv, q, Tl = nkv * hd, nh * hd, T // cp
    if ring:
        return 8 * B * Tl * kv + B * nh * Tl
    return 6 * B * T * kv + (4 * B * (Tl // 2) * q + B * nh * (Tl // 2) if headtail else 0)


def dry_lines(stdout):
    m = re.search(r"^per rank: world .*$", stdout, re.M)
    assert m, stdout
    return dict((k.strip(), int(v)) for k, v in
                re.findall(r"^  (\S.*?)\s+[0-9.]+ GiB\s+(\d+) bytes$", stdout[m.end():], re.M))


@pytest.mark.parametrize("cp,extra", [(2, []), (4, []), (2, [NONE]), (4, [NONE])])
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_dry_run_counts_the_methods_scratch(setup, tmp_path, cp, extra, rotate):
    """--dry-run's "context parallel attention scratch" is what the configured load balancer
    and rotate method allocate (scratch_floats, fp32), and is part of the total."""
    d, data = setup
    # dp 2: validation.local_batch_size 2, so the largest batch planned is the training one
    args = [a for a in train_args(d / "model", data, tmp_path / "out", dp=2) if not a.startswith("--parallelism.")]
    p = subprocess.run([str(BIN), *args, "--parallelism.data_parallel_shard_degree=1", f"{CP}={cp}", *extra,
                        f"--parallelism.context_parallel_rotate_method={rotate}", "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = dry_lines(p.stdout)
    B, T, nh, nkv, hd = 2, 16, 4, 2, 8  # train_args' local batch and seq_len; the model's heads
    want = 4 * scratch_floats(B, T, cp, nh, nkv, hd, NONE not in extra, rotate == "alltoall")
    assert lines["context parallel attention scratch"] == want, lines


def peak_rss(stderr):
    got = {int(m.group(1)): float(m.group(2)) * 2 ** 30
           for m in re.finditer(r"rank (\d+) of \d+: peak memory ([\d.]+) GiB", stderr)}
    assert got, stderr[-2000:]
    return got


def test_ring_holds_less_than_the_gather_at_cp4(tmp_path):
    """CP 4 at seq_len 2048 on a model whose attention scratch dominates (8 kv heads of 64, one
    layer): each rank's peak RSS under the ring is below the all-gather's by at least half of
    what scratch_floats says the two allocate apart (the rest of the process is the same), and
    both runs train to the same loss."""
    model = tmp_path / "model"
    oracle.tiny_config(vocab=251, hidden=64, inter=64, layers=1, heads=8, kv_heads=8, head_dim=64,
                       tied=False).save_pretrained(model)
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(2048 * 8, 251, seed=3))
    T, cp, nh, nkv, hd = 2048, 4, 8, 8, 64
    env = dict(ENV, CTITAN_LOG_RANKS="all")
    peaks, loss = {}, {}
    for rotate in ("allgather", "alltoall"):
        out = tmp_path / rotate
        cmd = mpirun() + ["-np", "4", str(BIN), "train", "--model.spec=hf", f"--model.hf_assets_path={model}",
                          f"--training.dataset_path={data}", f"--training.seq_len={T}", "--training.local_batch_size=1",
                          "--training.steps=1", "--metrics.log_freq=1", f"--job.dump_folder={out}",
                          "--parallelism.data_parallel_shard_degree=1", f"{CP}={cp}",
                          f"--parallelism.context_parallel_rotate_method={rotate}"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        peaks[rotate] = peak_rss(p.stderr)
        loss[rotate] = [r["loss"] for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert np.allclose(loss["alltoall"], loss["allgather"], rtol=1e-5), loss
    saving = 4 * (scratch_floats(1, T, cp, nh, nkv, hd, True, False) - scratch_floats(1, T, cp, nh, nkv, hd, True, True))
    for r in range(cp):
        g, a = peaks["allgather"][r], peaks["alltoall"][r]
        assert g - a >= 0.5 * saving, f"rank {r}: peak {a / 2**20:.1f} MiB under the ring vs {g / 2**20:.1f} MiB " \
                                      f"gathering; expected ~{saving / 2**20:.1f} MiB less"
