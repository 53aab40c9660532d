"""Pipeline parallel on one machine (issue 16): step time, peak RSS per rank and the bubble
of PP2 / PP4 against one rank, on W1 (Qwen3-0.6B shapes cut to 4 layers, seq 512).

Every run trains the same recipe from the same random init: local batch 4 sequences
(pipeline micro-batches of 1: 4 per step), a few steps; the first steps are warm-up.
The one-rank run gets every core; a pipeline's ranks share them (one thread each, ranks
oversubscribed past the core count), so on a 2-core machine a pipeline cannot be faster:
what the table shows is the memory each stage holds (a stage keeps its layers, their
gradients and AdamW moments, and one activation bank per micro-batch in flight) and the
bubble, measured (the share of a step the stages spent waiting for an input, their mean,
from metrics.jsonl's pp_bubble) beside the schedule's simulated one (the
run's log: every stage's cost, the lm_head's on the last, backward = 2 forwards) and the
textbook (P - 1) / (M + P - 1) for equal stages.

Run:  .venv/bin/python bench/bench_pp.py [--steps 6] [--seq 512]
CTITAN_BUILD=build/x selects the build directory (default build).
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import SHAPES  # noqa: E402
from layout_runner import make_model_and_data, run_layout  # noqa: E402

RUNS = [  # name, ranks, extra flags
    ("1 rank", 1, []),
    ("PP2 1F1B", 2, ["--parallelism.pipeline_parallel_degree=2"]),
    ("PP2 GPipe", 2, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=GPipe"]),
    ("PP2 Interleaved1F1B", 2, ["--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"]),
    ("PP2 LoopedBFS", 2, ["--parallelism.pipeline_parallel_degree=2",
                          "--parallelism.pipeline_parallel_schedule=LoopedBFS"]),
    ("PP2 InterleavedZB", 2, ["--parallelism.pipeline_parallel_degree=2",
                              "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble"]),
    ("PP2 ZBVZeroBubble", 2, ["--parallelism.pipeline_parallel_degree=2",
                              "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble"]),
    ("PP2 DualPipeV", 2, ["--parallelism.pipeline_parallel_degree=2",
                          "--parallelism.pipeline_parallel_schedule=DualPipeV"]),
    ("PP4 1F1B", 4, ["--parallelism.pipeline_parallel_degree=4"]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--shape", default="qwen3-0.6b-4l", choices=sorted(SHAPES))
    ap.add_argument("--runs", default="", help="comma-separated names of the runs to do (default: all), e.g. "
                    "'PP2 1F1B,PP2 ZBVZeroBubble'")
    a = ap.parse_args()
    tmp, model, data, cores = make_model_and_data(a, "bench_pp_", "W1-style bench")
    print(f"{'run':22s} {'step s':>8s} {'tok/s':>8s} {'peak RSS per rank (GiB)':>28s} {'bubble meas.':>12s} "
          f"{'simulated':>10s} {'textbook':>9s}")
    only = [n.strip() for n in a.runs.split(",") if n.strip()]
    unknown = [n for n in only if n not in [r[0] for r in RUNS]]
    if unknown:
        sys.exit(f"bench_pp.py: --runs: no run named {unknown}; the runs: {[r[0] for r in RUNS]}")
    for name, ranks, extra in RUNS:
        if only and name not in only:
            continue
        got = run_layout(a, tmp, model, data, cores, name, ranks,
                         ["--parallelism.pipeline_parallel_microbatch_size=1"] + extra, width=22)
        if got is None:
            continue
        err, rows, step_s, rss_txt = got.stderr, got.rows, got.step_s, got.rss_txt
        tps = a.batch * a.seq / step_s
        bub = [r["pp_bubble"] for r in rows[a.warmup:] if "pp_bubble" in r]
        sim = re.search(r"simulated bubble ([\d.]+)%; stages' first layers:([\d ]+)", err)
        m = a.batch  # micro-batches per step
        S = 2 if "Interleaved" in name or "BFS" in name or "ZBV" in name or "DualPipeV" in name else 1
        book = (ranks - 1) / (S * m + ranks - 1) if ranks > 1 else 0
        # the zero-bubble schedules have no closed-form bubble here (their W fills it as costs allow)
        book_txt = "-" if "ZB" in name or "DualPipeV" in name else f"{100 * book:.1f}%"
        print(f"{name:22s} {step_s:8.3f} {tps:8.0f} {rss_txt:>28s} "
              f"{(100 * sum(bub) / len(bub)) if bub else 0:11.1f}% {float(sim.group(1)) if sim else 0:9.1f}% "
              f"{book_txt:>9s}" + (f"   stages start at layers{sim.group(2)}" if sim else ""))


if __name__ == "__main__":
    main()
