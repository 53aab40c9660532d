"""Zero-bubble schedules where a stage holds several layers and nothing is recorded between
one layer's q/k/v products and the next (lower) layer's: o_proj and the MLP frozen
(training.freeze), under full activation checkpointing, whose one scratch set every layer's
recomputation rewrites (model/lm.c). The next layer's q then reads the same buffer at the same
shape as the last record, but other values: I must copy its input again (a layer's records share
a copy, two layers' never). Against one process with the same freeze and checkpointing.

The dry run's textbook bubble of both zero-bubble schedules is the interleaved one,
(P - 1) / (S M + P - 1) for S stages a rank (docs/distributed.md; Narayanan et al. 2021's
interleaved schedule), not 1F1B's (P - 1) / (M + P - 1)."""
import pytest

import oracle
from test_dist import assert_same_run, run, train_args
from test_dry_run import launch, ok
from test_dry_run_pp import parse, pp_args, pp_models  # noqa: F401 (fixture)

PP, SCHED, MB = ("--parallelism.pipeline_parallel_degree", "--parallelism.pipeline_parallel_schedule",
                 "--parallelism.pipeline_parallel_microbatch_size")
FREEZE = "--training.freeze=model.layers.*.self_attn.o_proj.weight,model.layers.*.mlp.*"
AC = "--activation_checkpoint.mode=full"


@pytest.fixture(scope="module")
def zb8(tmp_path_factory):
    """An 8-layer tiny Qwen3: 4 stages on 2 ranks hold 2 layers each."""
    d = tmp_path_factory.mktemp("zb8")
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=8, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(d / "model")
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    run(1, train_args(d / "model", d / "tokens.bin", d / "single", FREEZE, AC))
    return d


@pytest.mark.parametrize("sched", ["ZBVZeroBubble"])
def test_two_layers_a_stage_qkv_after_qkv_under_full_checkpointing(zb8, sched):
    out = zb8 / f"zb_{sched}"
    p = run(2, train_args(zb8 / "model", zb8 / "tokens.bin", out, FREEZE, AC, f"{PP}=2", f"{SCHED}={sched}",
                          f"{MB}=2"))
    assert "weight-gradient stores held" in p.stderr, p.stderr[-2000:]
    assert_same_run(out, zb8 / "single", f"{sched}, o_proj and MLP frozen, full AC")


@pytest.mark.parametrize("sched", ["InterleavedZeroBubble", "ZBVZeroBubble"])
def test_dry_run_textbook_bubble_is_the_interleaved_one(pp_models, tmp_path, sched):
    d, data = pp_models
    P = 2
    plan = parse(ok(launch(0, pp_args(d / "untied", data, tmp_path, P, f"{SCHED}={sched}", local=4)
                           + ["--dry-run"])).stdout)
    S, M = plan["S"], plan["M"]
    assert S == 2 and M == 4, plan
    assert plan["book"] == pytest.approx((P - 1) / (S * M + P - 1), abs=1e-4), (plan["book"], S, M)
