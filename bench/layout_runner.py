"""What the layout benches (bench_pp.py, bench_cp.py) share: a random-init model and token
stream for their recipe, and one `ctitan train` run of the recipe under a layout, timed from
its metrics.jsonl, with each rank's peak RSS from its log.

The recipe is the bench's arguments: a.shape (bench_train.SHAPES), a.batch sequences of
a.seq tokens per step, a.steps steps of which the first a.warmup are not timed.
CTITAN_BUILD=build/x selects the build directory (default build).
"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_train import SHAPES  # noqa: E402

# out: the run's dump folder; stderr: every rank's log (CTITAN_LOG_RANKS=all); rows: metrics.jsonl's
# training lines; step_s: the steady step seconds; rss_txt: the one rank's peak RSS, or every rank's
Run = collections.namedtuple("Run", "out stderr rows step_s rss_txt")


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


def run_layout(a, tmp, model, data, cores, name, ranks, extra, width):
    """One ctitan run of the recipe under the layout `extra` (flags) in tmp/<name>: one rank
    on every core, or `ranks` MPI ranks of one thread each (oversubscribed past the core
    count, so on a small machine a layout cannot be faster: what it shows is memory, waits
    and balance). Returns a Run, or None when the run failed (said on one line, the name
    padded to width, the bench's first column)."""
    out = os.path.join(tmp, re.sub(r"\W+", "_", name))
    threads = cores if ranks == 1 else 1
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               CTITAN_LOG_RANKS="all", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    binary = os.path.join(ROOT, os.environ.get("CTITAN_BUILD", "build"), "ctitan")
    cmd = [binary, "train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={data}",
           f"--training.local_batch_size={a.batch}", f"--training.seq_len={a.seq}", f"--training.steps={a.steps}",
           "--metrics.log_freq=1", f"--job.dump_folder={out}", f"--training.threads={threads}"] + extra
    if ranks > 1:
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + cmd
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{name:{width}s} failed: {p.stderr.strip().splitlines()[-1:]}")
        return None
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
    step_s = (rows[-1]["elapsed_s"] - rows[a.warmup - 1]["elapsed_s"]) / (len(rows) - a.warmup)
    rss = sorted((int(m.group(1)), float(m.group(2))) for m in
                 re.finditer(r"rank (\d+) of \d+: peak memory ([\d.]+) GiB", p.stderr))
    rss_txt = f"{max(r['memory_gib'] for r in rows):.2f}" if ranks == 1 else " ".join(f"{g:.2f}" for _, g in rss)
    return Run(out, p.stderr, rows, step_s, rss_txt)
