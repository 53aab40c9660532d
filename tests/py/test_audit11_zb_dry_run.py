"""Eleventh mutation audit (stop 53): the dry run's banks and total under the zero-bubble
schedules and DualPipeV.

- Banks: a forward's bank is free once its input backward ran (I, or a whole B); W reads the
  store's copies. most_pending counting only B as a close (I left open) kept a bank per
  split backward until the end and passed: test_dry_run_pp's bank check covers 1F1B, GPipe
  and Interleaved1F1B only. The oracle: torch's order of the same schedule (F opens, I or B
  closes, W neither), per local stage, the most in flight summed.
- Stores: one per I whose W has not run; DualPipeV's whole backwards (B) record nothing.
  Counting B as opening one (the most_pending call given "IB") passed: the store-size test
  runs the zero-bubble schedules, not DualPipeV. The oracle: torch's order again.
- Total: the weight-gradient stores are part of the planned total; the total without them
  passed (the store sizes and the run's peak were checked, not the sum). The printed total
  must hold every printed term."""
import re

import pytest

from test_dry_run import launch, ok
from test_dry_run_pp import parse, pp_args, pp_models  # noqa: F401 (fixture)
from test_pp import SCHED
from test_pp_zero_bubble import torch_order


def torch_pending(sched, P, S, M, r, opens, closes):
    """The most actions of a kind in opens whose closing one has not run, per local stage, summed."""
    live, most = {}, {}
    for a in torch_order(sched, P, S, M, r):
        v, kind, _ = re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups()
        v = int(v)
        live[v] = live.get(v, 0) + (1 if kind in opens else -1 if kind in closes else 0)
        most[v] = max(most.get(v, 0), live[v])
    assert all(n == 0 for n in live.values()), (sched, r, live)
    return sum(most.values())


@pytest.mark.parametrize("sched,P,local", [("ZBVZeroBubble", 2, 4), ("InterleavedZeroBubble", 2, 4),
                                          ("DualPipeV", 2, 6)])
def test_zero_bubble_banks_and_total(sched, P, local, pp_models, tmp_path):
    d, data = pp_models
    plan = parse(ok(launch(0, pp_args(d / "untied", data, tmp_path, P, f"{SCHED}={sched}", local=local)
                           + ["--dry-run"])).stdout)
    S, M = plan["S"], plan["M"]
    for s in plan["stages"]:
        want = torch_pending(sched, P, S, M, s["rank"], "F", "BI")
        assert s["n_banks"] == want, f"{sched} rank {s['rank']}: {s['n_banks']} banks, torch keeps {want} in flight"
        want = torch_pending(sched, P, S, M, s["rank"], "I", "W")  # a whole B records nothing
        assert s["n_stores"] == want > 0, f"{sched} rank {s['rank']}: {s['n_stores']} stores, torch: {want}"
        parts = s["params"] + s["grad_opt"] + s["act"] + s["p2p"] + s["stores"]
        assert s["total"] >= parts, f"{sched} rank {s['rank']}: total {s['total']} < its terms {parts}: {s}"
