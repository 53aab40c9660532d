"""The seventh mutation audit's gaps in the layouts' code paths (docs/reliability.md, "A
seventh mutation audit"): each test here failed on a planted mistake that every other test
passed, and passes on the code.

Expected values come from the HF config (the tensor shapes the architecture implies), the
arithmetic a rule states, or the run itself where a plan must predict it."""
import re
import subprocess

import pytest

import oracle
from conftest import BIN, crashed
from test_dist import ENV, mpirun
from test_dist import setup as dist_setup  # noqa: F401 (a fixture)
from test_dry_run import launch, ok
from test_dry_run_pp import pp_args

TP2 = "--parallelism.tensor_parallel_degree=2"
MIB = 2**20
# a pipeline rank's line of --dry-run under TP (the slice note between the count and the bytes)
STAGE_TP = re.compile(r"^  pipeline rank (\d+): layers (\d+)-(\d+)(.*?): \d+ parameters \(its slice: TP rank 0 of "
                      r"(\d+), EP rank 0 of 1\); bytes: .*?activations (\d+) \(shared (\d+) \+ (\d+) banks? (\d+)\)",
                      re.M)


def r16(n):
    """floats carved in 64-byte units (lm_plan_memory's carving)"""
    return -(-n // 16) * 16


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    d = tmp_path_factory.mktemp("audit7")
    oracle.tiny_config(vocab=2048, hidden=256, inter=768, layers=4, heads=4, kv_heads=2, head_dim=64
                       ).save_pretrained(d / "medium")
    oracle.tiny_config(vocab=256, hidden=30, inter=48, layers=3, heads=4, kv_heads=4, head_dim=8
                       ).save_pretrained(d / "small")
    data = oracle.write_bin(d / "t.bin", oracle.random_tokens(64 * 33, 254, seed=3))
    return d, data


def test_pipeline_stage_plan_counts_sequence_parallel_rows(medium, tmp_path):
    """--dry-run's pipeline ranks under PP 2 x TP 2: sequence parallel keeps 1/t of a
    micro-batch's rows in the residual stream, so each bank of saved activations (one
    micro-batch of mb x T rows) shrinks per held layer by its residual at the layer's input
    and after attention, the two pre-norms' outputs ([BT, H] each) and their rstd ([BT]), and
    the last stage's bank by the final norm's input and output and its rstd; the shared
    workspace gains the two [BT, H] buffers of gathered rows and gradients (and the norm
    weights' partial sums) and keeps d(residual) for BT/t rows. Sizes from the HF config.
    Each stage's run logs the activations it planned: the shared arena, its banks (their count
    too) and their total. The stage plan counted whole rows under SP (its
    config's tp_seq unset), so SP on and off planned the same bytes."""
    from transformers import AutoConfig
    d, data = medium
    cfg = AutoConfig.from_pretrained(d / "medium")
    H, t, T, mb = cfg.hidden_size, 2, 32, 1  # pp_args' seq_len 32, the default micro-batch 1
    plan = {}
    for sp in ("false", "true"):
        args = pp_args(d / "medium", data, tmp_path / sp, 2, TP2, "--parallelism.data_parallel_shard_degree=1",
                       f"--parallelism.sequence_parallel={sp}", local=2)
        out = ok(launch(0, args + ["--dry-run"])).stdout
        stages = {int(m.group(1)): dict(layers=int(m.group(3)) - int(m.group(2)) + 1, head="lm_head" in m.group(4),
                                        tp=int(m.group(5)), shared=int(m.group(7)), n_banks=int(m.group(8)),
                                        banks=int(m.group(9))) for m in STAGE_TP.finditer(out)}
        assert sorted(stages) == [0, 1] and all(s["tp"] == t for s in stages.values()), out
        plan[sp] = stages
        err = ok(launch(4, args, env=dict(ENV, CTITAN_LOG_RANKS="all"))).stderr
        logged = re.findall(r"ctitan: batch .* activations ([0-9.]+) MiB \(shared ([0-9.]+) MiB \+ (\d+) banks? "
                            r"([0-9.]+) MiB\)", err)
        assert len(logged) == 4, err[-3000:]

        def planned(got, s):  # the run's line is the stage's plan, to the log's 0.1 MiB
            return got[2] == s["n_banks"] and all(abs(g - b / MIB) < 0.05 for g, b in zip(
                (got[0], got[1], got[3]), (s["shared"] + s["banks"], s["shared"], s["banks"])))
        # the ranks' lines come in any order: each stage's two TP ranks log its plan
        got = [(float(a), float(b), int(n), float(c)) for a, b, n, c in logged]
        for v, s in stages.items():
            assert sum(planned(g, s) for g in got) == 2, (sp, v, s, got)
    BT, BS = mb * T, mb * T // t
    per_layer = 4 * (r16(BT * H) - r16(BS * H)) + 2 * (r16(BT) - r16(BS))
    final = 2 * (r16(BT * H) - r16(BS * H)) + r16(BT) - r16(BS)
    # the shared workspace: at least the gathered rows' and gradients' buffers, less d(residual)'s
    # rows (beside them the norm weights' partial sums, a few [H])
    shared = 2 * r16(BT * H) - (r16(BT * H) - r16(BS * H))
    for r in (0, 1):
        off, on = plan["false"][r], plan["true"][r]
        assert off["n_banks"] == on["n_banks"], (off, on)
        bank = off["layers"] * per_layer + (final if off["head"] else 0)
        assert off["banks"] - on["banks"] == 4 * on["n_banks"] * bank, (r, off, on, bank)
        assert on["shared"] - off["shared"] >= 4 * shared, (r, off, on, shared)


@pytest.mark.parametrize("name,n,extra", [
    ("pp2", 2, ["--parallelism.pipeline_parallel_degree=2"]),
    ("pp2_fsdp2", 4, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
])
def test_frozen_tensors_under_pp_clip_by_the_whole_models_norm(dist_setup, tmp_path, name, n, extra):
    """training.freeze under pipeline parallel: clipping's norm runs over the trainable runs
    of every stage (each stage's squares summed over the pipeline), as one process's
    clip_grad_norm_ over all trainable tensors. max_norm 0.2, under every step's norm, so
    clipping acts: a stage clipping by its own part of the norm logs another norm and steps
    other weights (test_dist.py's frozen-tensor test, which covers FSDP and DP)."""
    from test_dist import assert_same_norms, assert_same_run, grad_norms, run, train_args
    d, data = dist_setup
    frozen = ["--training.freeze=model.embed_tokens.weight,model.layers.0.*", "--training.max_norm=0.2"]
    ref = tmp_path / "one"
    run(1, train_args(d / "model", data, ref, *frozen))
    assert min(grad_norms(ref).values()) > 0.2, grad_norms(ref)
    out = tmp_path / name
    run(n, train_args(d / "model", data, out, *extra, "--parallelism.pipeline_parallel_microbatch_size=1",
                      *frozen, dp=n // 2))
    assert_same_run(out, ref, f"frozen, {name}")
    assert_same_norms(out, ref, f"frozen, {name}")
