"""Context parallel on one machine: step time, peak RSS and attention time per rank of CP2 in
its two layouts (parallelism.context_parallel_load_balancer: "headtail", the default, and
"none", consecutive chunks) against one rank, and of CP 2 and 4 under ring attention
(context_parallel_rotate_method = "alltoall") against the all-gather, on W1's model (Qwen3-0.6B shapes cut to 4 layers)
at a long sequence (2048 by default).

Every run trains the same recipe from the same random init: local batch 1 sequence, a few
steps; the first steps are warm-up. The one-rank run gets every core; CP's ranks one thread
each, so on a 2-core machine CP cannot be faster. Each rank keeps the whole model, its
gradients and AdamW moments (FSDP would shard them) and the activations of its chunk of
seq_len / cp positions, plus the attention's scratch (docs/distributed.md, CP). The last
columns are each rank's last step, read from its profiler trace (profiling.enable_profiling):
the step's span, its attention kernels (forward + backward, every layer) and its collectives.
Under "none" the last rank's chunk attends over the whole prefix and costs (2 - 1/cp) times
the mean, and the others wait for it in the collectives; under "headtail" every rank's two
pieces cost the same. torchtitan's debugmodel (--shape debugmodel: 16 heads of 128, a
2048-token vocabulary) is a model where attention is most of the step.

Run:  .venv/bin/python bench/bench_cp.py [--steps 5] [--seq 2048] [--shape debugmodel]
            [--runs "CP2 none,CP2 headtail"]
      ring vs gather: --shape qwen3-0.6b-attn --seq 4096 --steps 2 --warmup 1
            --runs "CP2 headtail,CP2 ring,CP2 gather tiled,CP4 headtail,CP4 ring,CP4 gather tiled"
            [--repeat 3: the chosen runs 3 times, interleaved, so a shared machine's load spreads
            over all of them]
CTITAN_BUILD=build/x selects the build directory (default build).
"""
import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import SHAPES  # noqa: E402
from layout_runner import make_model_and_data, run_layout  # noqa: E402

CP2 = "--parallelism.context_parallel_degree=2"
CP4 = "--parallelism.context_parallel_degree=4"
RING = "--parallelism.context_parallel_rotate_method=alltoall"
# the tiled kernels on both sides: "CPn headtail" (the all-gather) and "CPn ring" run the default
# register-blocked kernel (its offset form and its block form), "gather tiled" the all-gather on
# tiled_avx512's loops, the kernel the ring ran before the register-blocked block forms
TILED = "--kernels.attention=tiled_avx512"
RUNS = [  # name, ranks, extra flags
    ("1 rank", 1, []),
    ("CP2 none", 2, [CP2, "--parallelism.context_parallel_load_balancer=none"]),
    ("CP2 headtail", 2, [CP2, "--parallelism.context_parallel_load_balancer=headtail"]),
    # ring attention (context_parallel_rotate_method = "alltoall") against the all-gather, both
    # on headtail
    ("CP2 ring", 2, [CP2, RING]),
    ("CP2 gather tiled", 2, [CP2, TILED]),
    ("CP4 headtail", 4, [CP4]),
    ("CP4 ring", 4, [CP4, RING]),
    ("CP4 gather tiled", 4, [CP4, TILED]),
]
# Qwen3-0.6B's widths and attention (16 heads, 8 kv heads of 128) in one layer with a 2048-token
# vocabulary: attention at T 2048-4096 is most of the step, not the 151936-row lm_head
SHAPES.setdefault("qwen3-0.6b-attn", dict(SHAPES["qwen3-0.6b"], num_hidden_layers=1, vocab_size=2048))


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "wait")


def traced_ms(trace):
    """A rank's traced step in milliseconds (its profiler trace): (the step's span, its
    attention calls, its collectives: under "none" rank 0 waits there for rank 1)."""
    ev = json.load(open(trace))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    ms = lambda names: sum(e.get("dur", 0) for e in ev if e.get("cat") != "thread" and e.get("name") in names) / 1e3
    return ms(("step",)), ms(("attention_fwd", "attention_bwd")), ms(COLLECTIVES)


def run(a, tmp, model, data, cores, name, ranks, extra):
    """One ctitan run of the recipe, its last step traced: one rank on every core, or `ranks`
    MPI ranks of one thread each. Returns (steady step seconds, peak RSS text, final loss,
    traced_ms per rank) or None when it failed."""
    got = run_layout(a, tmp, model, data, cores, name, ranks,
                     ["--profiling.enable_profiling", f"--profiling.profile_freq={a.steps}"] + extra, width=14)
    if got is None:
        return None
    traces = sorted(glob.glob(os.path.join(got.out, "profile_trace", f"iteration_{a.steps}", "rank*_trace.json")),
                    key=lambda f: int(re.search(r"rank(\d+)_", f).group(1)))
    return got.step_s, got.rss_txt, got.rows[-1]["loss"], [traced_ms(t) for t in traces]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--shape", default="qwen3-0.6b-4l", choices=sorted(SHAPES))
    ap.add_argument("--runs", default=",".join(r[0] for r in RUNS), help="comma-separated names of RUNS")
    ap.add_argument("--repeat", type=int, default=1, help="run the chosen runs this many times, interleaved")
    a = ap.parse_args()
    tmp, model, data, cores = make_model_and_data(a, "bench_cp_", "CP bench")
    print(f"{'run':14s} {'step s':>7s} {'tok/s':>6s} {'peak RSS/rank GiB':>17s} {'final loss':>10s}  "
          f"last step, ms per rank: step / attention / collectives")
    for name, ranks, extra in [r for _ in range(a.repeat) for r in RUNS]:
        if name not in a.runs.split(","):
            continue
        got = run(a, tmp, model, data, cores, name, ranks, extra)
        if got is None:
            continue
        step_s, rss_txt, loss, traced = got
        print(f"{name:14s} {step_s:7.3f} {a.batch * a.seq / step_s:6.0f} {rss_txt:>17s} {loss:10.5f}  "
              + ", ".join(" / ".join(f"{x:.0f}" for x in r) for r in traced))


if __name__ == "__main__":
    main()
