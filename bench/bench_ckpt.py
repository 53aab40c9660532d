#!/usr/bin/env python3
"""What checkpoint.async_mode saves: the same training run with a full checkpoint every
--interval steps, written synchronously (async_mode "disabled") and in the background
("async"), beside the same run with no checkpoints, and, for comparison, PyTorch doing what
torchtitan does on the same shapes (torch.distributed.checkpoint's save, or its async_save on
a gloo process group of 1, the result awaited before the next save). Not part of `make test`.

Each run trains a random-init model (bench_train.SHAPES; torchtitan's debugmodel by default:
32.5 M parameters, 130 MB fp32, so each full checkpoint is about 390 MB: the parameters and
both AdamW moments) on random tokens, one process on every core, and reports:
  steps/s   the steps over the loop's time (launch to exit less the startup: the saves, the
            final save and its waits included)
  blocked   what the saves held the step loop up: ctitan's exit line in events.jsonl
            (ckpt_save_s: synchronous saves whole, async stages; ckpt_wait_s: waits for the
            thread); PyTorch's: its save / async_save calls and the waits on their futures
  wall      the whole process, launch to exit (startup, the loop, the final save)
  written   bytes of checkpoint files written over the run (ctitan: its checkpoint lines'
            MiB; PyTorch: each save's directory, measured before it is pruned)
  stage     ctitan async: the median (and the largest) of the run's stages, the log's
            "staged checkpoint ... in X s" (the first stage allocates the staging copy)
The last save of a run is synchronous in every mode (ctitan and torchtitan alike: the run ends
there); keep_latest_k = 2 bounds the disk. On a CPU the background writer shares the cores the
steps run on (a GPU trainer's writer does not), so part of what async saves in blocked time
comes back as slower steps: compare steps/s, not blocked alone.

Run:  .venv/bin/python bench/bench_ckpt.py [--shape debugmodel] [--batch 1] [--seq 128]
          [--steps 20] [--interval 4] [--runs none,disabled,async,torch_none,torch,torch_async]
          [--repeat 3: every run 3 times, interleaved, and each column's median]
CTITAN_BUILD=build/x selects the build directory (default build).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import thread_env  # noqa: E402
from layout_runner import ROOT, make_model_and_data  # noqa: E402

RUNS = ("none", "disabled", "async", "torch_none", "torch", "torch_async")


def events(out):
    return [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))]


def ctitan_run(a, tmp, model, data, cores, mode):
    """One `ctitan train` of the recipe: mode "none" (no checkpoint), "disabled" or "async".
    Returns a dict of the figures, or None (said) when the run failed."""
    out = os.path.join(tmp, "ct_" + mode)
    shutil.rmtree(out, ignore_errors=True)
    binary = os.path.join(ROOT, os.environ.get("CTITAN_BUILD", "build"), "ctitan")
    cmd = [binary, "train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={data}",
           f"--training.local_batch_size={a.batch}", f"--training.seq_len={a.seq}", f"--training.steps={a.steps}",
           "--metrics.log_freq=1", f"--job.dump_folder={out}", f"--training.threads={cores}"]
    if mode != "none":
        cmd += ["--checkpoint.enable", f"--checkpoint.interval={a.interval}", "--checkpoint.keep_latest_k=2",
                "--checkpoint.last_save_model_only=false", f"--checkpoint.async_mode={mode}"]
    t0 = time.time()
    p = subprocess.run(cmd, env=dict(thread_env(cores), OMP_WAIT_POLICY="passive"), capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        print(f"ctitan {mode} failed: {p.stderr.strip().splitlines()[-1:]}")
        return None
    ev = events(out)
    start = [e for e in ev if e["event"] == "start"][-1]
    ex = [e for e in ev if e["event"] == "exit"][-1]
    saves = [e for e in ev if e["event"] == "checkpoint"]
    loop = ex["wall_s"] - start["startup_s"]
    # async: each stage's seconds, from the log's "staged checkpoint step-N (... MiB of tensors) in X s"
    staged = [float(ln.split(" in ")[1].split()[0]) for ln in p.stderr.splitlines() if "staged checkpoint" in ln]
    return dict(name=f"ctitan {mode}", steps_s=a.steps / loop, loop_s=loop, save_s=ex["ckpt_save_s"],
                wait_s=ex["ckpt_wait_s"], wall_s=wall, bytes=sum(e.get("mib", 0) for e in saves) * 2**20,
                saves=len(saves), stage_s=statistics.median(staged) if staged else 0,
                stage_max_s=max(staged) if staged else 0)


# ------------------------------------------------------------------ PyTorch side (child)

def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def torch_worker(a):
    """The recipe in PyTorch eager (HF model from the same config.json, random init, AdamW),
    saving as torchtitan's CheckpointManager does: async_mode "disabled" dcp.save, "async"
    dcp.async_save on a gloo group (AsyncCheckpointerType.THREAD, dcp's default), whose future
    the next save (and the run's end) waits on; the last step's save synchronous; --no-save: no
    checkpoint (the baseline). Prints one JSON line of figures."""
    t_launch = time.time()
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{a.out}.rendezvous", rank=0, world_size=1)
    pg = dist.new_group(backend="gloo") if a.async_save else None  # torchtitan's async group
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model_dir), attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.from_numpy(np.fromfile(a.data, dtype=np.uint32).astype(np.int64))
    n = a.batch * (a.seq + 1)
    os.makedirs(a.out, exist_ok=True)
    blocked_save = blocked_wait = 0.0
    written, kept, future, saves = 0, [], None, 0

    def wait():
        nonlocal blocked_wait, future, written
        if future is not None:
            t0 = time.time()
            future.result()
            blocked_wait += time.time() - t0
            written += dir_bytes(kept[-1])
            future = None

    t_loop = time.time()
    for step in range(1, a.steps + 1):
        w = tokens[(step - 1) * n:step * n].view(a.batch, a.seq + 1)
        loss = model(input_ids=w[:, :-1], labels=w[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.no_save or step % a.interval and step != a.steps:
            continue
        wait()  # torchtitan: the previous async save ends before the next one
        path = os.path.join(a.out, f"step-{step}")
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        t0 = time.time()
        if a.async_save and step != a.steps:
            future = dcp.async_save(state, checkpoint_id=path, process_group=pg)
            blocked_save += time.time() - t0
            kept.append(path)
        else:
            dcp.save(state, checkpoint_id=path)
            blocked_save += time.time() - t0
            kept.append(path)
            written += dir_bytes(path)
        saves += 1
        while len(kept) > (3 if future else 2):  # keep_latest_k = 2 complete ones (untimed)
            shutil.rmtree(kept.pop(0), ignore_errors=True)
    wait()
    loop = time.time() - t_loop
    dist.destroy_process_group()
    print(json.dumps(dict(steps_s=a.steps / loop, loop_s=loop, save_s=blocked_save, wait_s=blocked_wait,
                          bytes=written, saves=saves, wall_in_s=time.time() - t_launch)))


def torch_run(a, tmp, model, data, cores, mode):
    out = os.path.join(tmp, "pt_" + mode)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--model-dir", model, "--data", data,
           "--out", out, "--threads", str(cores), "--batch", str(a.batch), "--seq", str(a.seq),
           "--steps", str(a.steps), "--interval", str(a.interval)]
    cmd += {"torch_async": ["--async-save"], "torch_none": ["--no-save"]}.get(mode, [])
    t0 = time.time()
    p = subprocess.run(cmd, env=thread_env(cores), capture_output=True, text=True)
    wall = time.time() - t0
    shutil.rmtree(out, ignore_errors=True)
    if p.returncode != 0:
        print(f"{mode} failed: {p.stderr.strip().splitlines()[-3:]}")
        return None
    r = json.loads(p.stdout.strip().splitlines()[-1])
    name = {"torch_async": "torch dcp.async_save", "torch_none": "torch none"}.get(mode, "torch dcp.save")
    return dict(r, name=name, wall_s=wall)


HEAD = (f"{'run':22s} {'steps/s':>8s} {'loop s':>7s} {'blocked s':>9s} {'(save':>7s} {'wait)':>6s} "
        f"{'wall s':>7s} {'saves':>5s} {'written MB':>10s} {'stage s':>7s} {'(max)':>6s}")


def row(g):
    return (f"{g['name']:22s} {g['steps_s']:8.3f} {g['loop_s']:7.2f} {g['save_s'] + g['wait_s']:9.2f} "
            f"{g['save_s']:7.2f} {g['wait_s']:6.2f} {g['wall_s']:7.2f} {int(g['saves']):5d} {g['bytes'] / 1e6:10.1f} "
            f"{g.get('stage_s', 0):7.3f} {g.get('stage_max_s', 0):6.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="debugmodel")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--repeat", type=int, default=1, help="every run this many times, interleaved (a shared "
                    "machine's load spreads over all of them)")
    # the PyTorch child's own arguments
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--async-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        return torch_worker(a)
    runs = [r for r in a.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        sys.exit(f"bench_ckpt: unknown run {bad}: choose from {', '.join(RUNS)}")
    a.warmup = 0  # make_model_and_data's header
    tmp, model, data, cores = make_model_and_data(a, "bench_ckpt_", "checkpoint saves")
    print(f"a full checkpoint every {a.interval} steps (the last step's synchronous in every mode), keep_latest_k 2; "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    print(HEAD)
    seen = {}
    try:
        for _ in range(a.repeat):
            for r in runs:
                got = (torch_run if r.startswith("torch") else ctitan_run)(a, tmp, model, data, cores, r)
                if got is not None:
                    print(row(got), flush=True)
                    seen.setdefault(got["name"], []).append(got)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.repeat > 1:
        print(f"median of each column over the {a.repeat} runs of each:")
        print(HEAD)
        for name, rs in seen.items():
            print(row({k: (statistics.median(r[k] for r in rs) if k != "name" else name) for k in rs[0]}))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
