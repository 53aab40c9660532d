"""Context parallel on one machine: step time and peak RSS per rank of CP2 against one rank, on
W1's model (Qwen3-0.6B shapes cut to 4 layers) at a long sequence (2048 by default).

Every run trains the same recipe from the same random init: local batch 1 sequence, a few
steps; the first steps are warm-up. The one-rank run gets every core; CP's ranks one thread
each, so on a 2-core machine CP cannot be faster. What the table shows is what a rank holds:
every rank keeps the whole model, its gradients and AdamW moments (FSDP would shard them), and
the activations of its chunk of seq_len / cp positions, plus the attention's whole-sequence
scratch (docs/distributed.md, CP). The padded-prefix attention makes the last rank run a
whole-sequence attention, so the step time is bounded below by it.

Run:  .venv/bin/python bench/bench_cp.py [--steps 5] [--seq 2048]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pp import make_model_and_data, run_layout  # noqa: E402
from bench_train import SHAPES  # noqa: E402

RUNS = [  # name, ranks, extra flags
    ("1 rank", 1, []),
    ("CP2", 2, ["--parallelism.context_parallel_degree=2"]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--shape", default="qwen3-0.6b-4l", choices=sorted(SHAPES))
    a = ap.parse_args()
    tmp, model, data, cores = make_model_and_data(a, "bench_cp_", "CP bench")
    print(f"{'run':10s} {'step s':>8s} {'tok/s':>8s} {'peak RSS per rank (GiB)':>26s} {'final loss':>11s}")
    for name, ranks, extra in RUNS:
        got = run_layout(a, tmp, model, data, cores, name, ranks, extra)
        if got is None:
            continue
        _, rows, step_s, rss_txt = got
        print(f"{name:10s} {step_s:8.3f} {a.batch * a.seq / step_s:8.0f} {rss_txt:>26s} {rows[-1]['loss']:11.5f}")


if __name__ == "__main__":
    main()
