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
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_train import SHAPES  # noqa: E402

RUNS = [  # name, ranks, extra flags
    ("1 rank", 1, []),
    ("PP2 1F1B", 2, ["--parallelism.pipeline_parallel_degree=2"]),
    ("PP2 GPipe", 2, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=GPipe"]),
    ("PP2 Interleaved1F1B", 2, ["--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"]),
    ("PP4 1F1B", 4, ["--parallelism.pipeline_parallel_degree=4"]),
]


def make_model_and_data(a, prefix, title):
    """A random-init model of shape a.shape (config.json only) and a random token stream
    long enough for a.steps steps of a.batch x a.seq, in a new temporary folder; prints the
    bench's header line (title) and the CPU. Returns (folder, model dir, tokens path, cores)."""
    from transformers import AutoConfig
    import numpy as np
    tmp = tempfile.mkdtemp(prefix=prefix)
    shape = dict(SHAPES[a.shape])
    mt = shape.pop("model_type", "qwen3")
    model = os.path.join(tmp, "model")
    AutoConfig.for_model(mt, **shape, max_position_embeddings=max(4096, a.seq)).save_pretrained(model)
    data = os.path.join(tmp, "tokens.bin")
    np.random.default_rng(0).integers(0, shape["vocab_size"], size=(a.batch * (a.seq + 1) * (a.steps + 2) * 4,),
                                      dtype=np.uint32).tofile(data)
    cores = os.cpu_count()
    print(f"{title}: {a.shape}, batch {a.batch} x {a.seq}, {a.steps} steps ({a.warmup} warm-up), "
          f"{cores} cores")
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            print("cpu:", line.split(":", 1)[1].strip())
    return tmp, model, data, cores


def run_layout(a, tmp, model, data, cores, name, ranks, extra):
    """One ctitan run of the recipe: one rank on every core, or `ranks` MPI ranks of one thread
    each (oversubscribed past the core count). Returns (stderr, metrics rows, steady step
    seconds, peak RSS text: the one rank's, or every rank's), or None when the run failed."""
    out = os.path.join(tmp, re.sub(r"\W+", "_", name))
    threads = cores if ranks == 1 else 1
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               CTITAN_LOG_RANKS="all", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [os.path.join(ROOT, "build", "ctitan"), "train", "--model.spec=hf", f"--model.hf_assets_path={model}",
           f"--training.dataset_path={data}", f"--training.local_batch_size={a.batch}",
           f"--training.seq_len={a.seq}", f"--training.steps={a.steps}", "--metrics.log_freq=1",
           f"--job.dump_folder={out}", f"--training.threads={threads}"] + extra
    if ranks > 1:
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + cmd
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{name:22s} failed: {p.stderr.strip().splitlines()[-1:]}")
        return None
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
    t_a, t_b = rows[a.warmup - 1]["elapsed_s"], rows[-1]["elapsed_s"]
    step_s = (t_b - t_a) / (len(rows) - a.warmup)
    rss = sorted((int(m.group(1)), float(m.group(2))) for m in
                 re.finditer(r"rank (\d+) of \d+: peak memory ([\d.]+) GiB", p.stderr))
    rss_txt = f"{max(r['memory_gib'] for r in rows):.2f}" if ranks == 1 else " ".join(f"{g:.2f}" for _, g in rss)
    return p.stderr, rows, step_s, rss_txt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--shape", default="qwen3-0.6b-4l", choices=sorted(SHAPES))
    a = ap.parse_args()
    tmp, model, data, cores = make_model_and_data(a, "bench_pp_", "W1-style bench")
    print(f"{'run':22s} {'step s':>8s} {'tok/s':>8s} {'peak RSS per rank (GiB)':>28s} {'bubble meas.':>12s} "
          f"{'simulated':>10s} {'textbook':>9s}")
    for name, ranks, extra in RUNS:
        got = run_layout(a, tmp, model, data, cores, name, ranks,
                         ["--parallelism.pipeline_parallel_microbatch_size=1"] + extra)
        if got is None:
            continue
        err, rows, step_s, rss_txt = got
        tps = a.batch * a.seq / step_s
        bub = [r["pp_bubble"] for r in rows[a.warmup:] if "pp_bubble" in r]
        sim = re.search(r"simulated bubble ([\d.]+)%; stages' first layers:([\d ]+)", err)
        m = a.batch  # micro-batches per step
        S = 2 if "Interleaved" in name else 1
        book = (ranks - 1) / (S * m + ranks - 1) if ranks > 1 else 0
        print(f"{name:22s} {step_s:8.3f} {tps:8.0f} {rss_txt:>28s} "
              f"{(100 * sum(bub) / len(bub)) if bub else 0:11.1f}% {float(sim.group(1)) if sim else 0:9.1f}% "
              f"{100 * book:8.1f}%" + (f"   stages start at layers{sim.group(2)}" if sim else ""))


if __name__ == "__main__":
    main()
