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
    from transformers import AutoConfig
    tmp = tempfile.mkdtemp(prefix="bench_cp_")
    shape = dict(SHAPES[a.shape])
    mt = shape.pop("model_type", "qwen3")
    AutoConfig.for_model(mt, **shape, max_position_embeddings=max(4096, a.seq)).save_pretrained(
        os.path.join(tmp, "model"))
    import numpy as np
    data = os.path.join(tmp, "tokens.bin")
    np.random.default_rng(0).integers(0, shape["vocab_size"], size=(a.batch * (a.seq + 1) * (a.steps + 2) * 2,),
                                      dtype=np.uint32).tofile(data)
    cores = os.cpu_count()
    print(f"CP bench: {a.shape}, batch {a.batch} x {a.seq}, {a.steps} steps ({a.warmup} warm-up), {cores} cores")
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            print("cpu:", line.split(":", 1)[1].strip())
    print(f"{'run':10s} {'step s':>8s} {'tok/s':>8s} {'peak RSS per rank (GiB)':>26s} {'final loss':>11s}")
    for name, ranks, extra in RUNS:
        out = os.path.join(tmp, re.sub(r"\W+", "_", name))
        threads = cores if ranks == 1 else 1
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                   CTITAN_LOG_RANKS="all", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [os.path.join(ROOT, "build", "ctitan"), "train", "--model.spec=hf",
               f"--model.hf_assets_path={os.path.join(tmp, 'model')}", f"--training.dataset_path={data}",
               f"--training.local_batch_size={a.batch}", f"--training.seq_len={a.seq}", f"--training.steps={a.steps}",
               "--metrics.log_freq=1", f"--job.dump_folder={out}", f"--training.threads={threads}"] + extra
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + cmd
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{name:10s} failed: {p.stderr.strip().splitlines()[-1:]}")
            continue
        rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
        t_a, t_b = rows[a.warmup - 1]["elapsed_s"], rows[-1]["elapsed_s"]
        step_s = (t_b - t_a) / (len(rows) - a.warmup)
        rss = sorted((int(m.group(1)), float(m.group(2))) for m in
                     re.finditer(r"rank (\d+) of \d+: peak memory ([\d.]+) GiB", p.stderr))
        rss_txt = f"{max(r['memory_gib'] for r in rows):.2f}" if ranks == 1 else " ".join(f"{g:.2f}" for _, g in rss)
        print(f"{name:10s} {step_s:8.3f} {a.batch * a.seq / step_s:8.0f} {rss_txt:>26s} {rows[-1]['loss']:11.5f}")


if __name__ == "__main__":
    main()
