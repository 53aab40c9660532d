"""optimizer.name = "Adam" in the layouts test_optim_adam leaves out (review9), and its one
identity with AdamW.

1. weight_decay 0: torch.optim.Adam and torch.optim.AdamW are the same update (AdamW's
   decoupled factor 1 - lr x 0 is 1, Adam's added 0 x param is 0), so shown here first in torch
   bit for bit, ctitan's two runs are bit-identical too (weights, losses, gradient norms).
2. Adam with weight decay 0.1 and clipping that acts, under DualPipeV PP 2, TP 2 and PP 2 x TP 2,
   trains like one process (losses, validation losses, final weights): the L2 term is added to
   each rank's clipped shard of the gradient, the norm taken before it."""
import numpy as np
import pytest
import torch

import oracle
from test_dist import assert_same_run, run, train_args, weights
from test_pp import MB, PP, SCHED, setup, single  # noqa: F401

ADAM = ["--optimizer.name=Adam", "--optimizer.weight_decay=0.1", "--optimizer.eps=1e-4", "--training.max_norm=0.2"]
TP2 = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
DPV = [f"{PP}=2", f"{SCHED}=DualPipeV", f"{MB}=1"]


def test_adam_and_adamw_agree_at_zero_weight_decay(setup):
    # torch first: the identity the ctitan runs rely on
    g = torch.Generator().manual_seed(0)
    w0, grads = torch.randn(64, generator=g), [torch.randn(64, generator=g) for _ in range(5)]
    ends = []
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        p = torch.nn.Parameter(w0.clone())
        opt = cls([p], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
        ends.append(p.detach().clone())
    assert torch.equal(ends[0], ends[1])
    d, data = setup
    outs = {}
    for name in ("Adam", "AdamW"):
        outs[name] = d / f"r9_wd0_{name}"
        run(1, train_args(d / "model", data, outs[name], f"--optimizer.name={name}", "--optimizer.weight_decay=0",
                          "--training.max_norm=0.2"))
    a, b = weights(outs["Adam"]), weights(outs["AdamW"])
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in b)
    ma, mb = (oracle.read_metrics(outs[n] / "metrics.jsonl") for n in ("Adam", "AdamW"))
    key = [(r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in ma]
    assert key == [(r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in mb]
    # and weight decay 0.1 tells them apart
    run(1, train_args(d / "model", data, d / "r9_wd01_Adam", *ADAM))
    run(1, train_args(d / "model", data, d / "r9_wd01_AdamW", *ADAM[1:]))
    a, b = weights(d / "r9_wd01_Adam"), weights(d / "r9_wd01_AdamW")
    assert any(not np.array_equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("name,n,args", [("dualpipev", 2, DPV), ("tp2", 2, TP2), ("dualpipev_tp2", 4, DPV + TP2)])
def test_adam_layouts_match_one_process(setup, single, name, n, args):
    d, data = setup
    ref = single("model_tp", *ADAM)
    out = d / f"r9_adam_{name}"
    run(n, train_args(d / "model_tp", data, out, *ADAM, *args), timeout=300)
    assert_same_run(out, ref, f"Adam {name}")
    want = [r["grad_norm"] for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r]
    assert all(g > 0.2 for g in want), want  # clipping acts on every step
