"""The profiler trace (issue 18, part 4), read as an outside viewer would: every file
validated against a JSON Schema of the Trace Event Format (the JSON Object Format that
Perfetto and chrome://tracing import), then the structure a reader relies on: spans of
one thread nest, every kernel the model runs appears under the implementation the
`ctitan: kernels:` line chose, one layer span per layer and direction, exactly the steps
that are multiples of profile_freq, the summary table's totals equal to the trace's
durations, and under two ranks a file per rank whose FSDP collectives move a layer's
parameter bytes. The memory snapshot's planned figures are the dry run's.

Perfetto's own parser is not used: the `perfetto` PyPI package (0.59.1) parses through
trace_processor_shell, a binary it downloads on first use; nothing may be fetched at test
time, so the schema and the checks below stand in for it."""
import json
import os
import re
import shutil
import subprocess
from decimal import Decimal

import jsonschema
import pytest

from conftest import BIN, crashed, tiny_run

LAYERS = 2
STEPS = 6
FREQ = 3
# Trace Event Format, JSON Object Format ("Trace Event Format", Google doc of the Catapult
# project): complete events (ph X) need ts and dur in microseconds; metadata events (ph M)
# name processes and threads through args.name / args.sort_index.
TRACE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
        "traceEvents": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "ph", "pid", "tid"],
                "properties": {
                    "name": {"type": "string"},
                    "cat": {"type": "string"},
                    "ph": {"enum": ["B", "E", "X", "i", "I", "C", "b", "n", "e", "s", "t", "f", "P", "N", "O",
                                    "D", "M", "V", "v", "R", "c"]},
                    "ts": {"type": "number"},
                    "dur": {"type": "number", "minimum": 0},
                    "pid": {"type": "integer"},
                    "tid": {"type": "integer"},
                    "args": {"type": "object"},
                },
                "allOf": [
                    {"if": {"properties": {"ph": {"const": "X"}}},
                     "then": {"required": ["ts", "dur", "cat"], "properties": {"ts": {"minimum": 0}}}},
                    {"if": {"properties": {"ph": {"const": "M"}}},
                     "then": {"required": ["args"],
                              "properties": {"name": {"enum": ["process_name", "process_labels",
                                                               "process_sort_index", "thread_name",
                                                               "thread_sort_index"]}}}},
                ],
            },
        },
    },
}
# what a dense Qwen3 training step calls, by kern_ops member
MODEL_OPS = {"embedding_fwd", "embedding_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "matmul_fwd", "matmul_bwd",
             "qknorm_rope_fwd", "qknorm_rope_bwd", "attention_fwd", "attention_bwd", "swiglu_fwd", "swiglu_bwd",
             "crossentropy_fwdbwd", "adamw_step"}
# the model code's own OpenMP loops with an op span, by name: (op, impl "model": no registry kernel)
MODEL_CODE_OPS = {"zero_layer_scratch": "zero", "grad_norm": "grad_norm"}
# those of a dense Qwen3 step: no gradient scratch to zero (each buffer's first product overwrites it)
QWEN3_CODE_OPS = {"grad_norm"}


@pytest.fixture
def setup(tmp_path):
    return tiny_run(tmp_path, "--profiling.enable_profiling", f"--profiling.profile_freq={FREQ}", layers=LAYERS,
                    steps=STEPS)


def load(path):
    """The trace with exact decimals (ts + dur compared without float rounding)."""
    with open(path) as f:
        return json.load(f, parse_float=Decimal)


def validate(trace):
    # jsonschema's number type is int/float; a Decimal copy would fail it, so validate the float view
    jsonschema.validate(json.loads(json.dumps(trace, default=float)), TRACE_SCHEMA)


def spans(trace, cat=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


def inside(a, b):
    """a lies within b in time."""
    return b["ts"] <= a["ts"] and a["ts"] + a["dur"] <= b["ts"] + b["dur"]


def check_nesting(trace):
    """On each (pid, tid), spans are a forest: each starts after the previous ends or ends
    within it (what Perfetto's slice tracks require of complete events)."""
    by_thread = {}
    for e in spans(trace):
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            assert not stack or inside(e, stack[-1]), f"{key}: {e['name']} overlaps {stack[-1]['name']} partially"
            stack.append(e)


def kernels_line(stderr):
    line = next(l for l in stderr.splitlines() if l.startswith("ctitan: kernels:"))
    return dict(re.findall(r"(\w+)=(\w+)", line.split("kernels:", 1)[1].split(";")[0]))


def summary_rows(stderr):
    """ctitan: profile: CATEGORY NAME OP IMPL CALLS TOTAL_MS %STEP"""
    rows = {}
    for l in stderr.splitlines():
        m = re.match(r"ctitan: profile: (op|collective)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", l)
        if m:
            rows[(m[1], m[2], m[3], m[4])] = (int(m[5]), Decimal(m[6]))
    return rows


def layer_bytes(cfg):
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return 4 * (q * H + 2 * kv * H + H * q + 3 * I * H + 2 * hd + 2 * H)


def test_trace_single_rank(setup, run_ctitan):
    cfg, out, args = setup
    _, _, err = run_ctitan(args)
    traced = sorted(int(d.name.split("_")[1]) for d in (out / "profile_trace").iterdir())
    assert traced == [s for s in range(1, STEPS + 1) if s % FREQ == 0], traced
    chosen = kernels_line(err)
    per_op, per_coll = {}, {}
    for step in traced:
        folder = out / "profile_trace" / f"iteration_{step}"
        assert sorted(p.name for p in folder.iterdir()) == ["rank0_trace.json"]  # no temporary file left
        trace = load(folder / "rank0_trace.json")
        validate(trace)
        assert trace["otherData"]["step"] == step
        check_nesting(trace)
        meta = {e["name"]: e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
        assert meta["process_name"]["name"] == "rank 0"
        assert all(e["pid"] == 0 for e in trace["traceEvents"])
        ops = spans(trace, "op")
        assert {e["name"] for e in ops} == MODEL_OPS | QWEN3_CODE_OPS
        for e in ops:
            if e["name"] in MODEL_CODE_OPS:
                assert e["args"] == {"op": MODEL_CODE_OPS[e["name"]], "impl": "model"}, e
            else:
                assert e["args"]["impl"] == chosen[e["args"]["op"]], (e, chosen)
            per_op[e["name"]] = per_op.get(e["name"], Decimal(0)) + e["dur"]
        for c in spans(trace, "collective"):
            a = c["args"]
            key = (c["name"], a["op"] or "-", f"{a['dtype']}/{a['comm_size']}")
            per_coll[key] = per_coll.get(key, Decimal(0)) + c["dur"]
        # q, k, v, o, gate, up, down per layer and the lm_head
        assert sum(e["name"] == "matmul_fwd" for e in ops) == 7 * LAYERS + 1
        layers = spans(trace, "layer")
        assert [(e["name"], e["args"]["layer"]) for e in sorted(layers, key=lambda e: e["ts"])] == \
            [("layer_fwd", l) for l in range(LAYERS)] + [("layer_bwd", l) for l in reversed(range(LAYERS))]
        for lay in layers:  # each layer's kernels are inside its span: attention and the MLP
            names = {e["name"] for e in ops if inside(e, lay)}
            d = lay["name"][-3:]
            assert {f"attention_{d}", f"swiglu_{d}", f"matmul_{d}"} <= names, (lay, names)
        phases = {e["name"]: e for e in spans(trace, "phase")}
        assert set(phases) == {"data", "forward_backward", "reduce", "optimizer"}
        (step_span,) = spans(trace, "step")
        assert all(inside(e, step_span) for e in spans(trace) if e is not step_span)
        assert all(inside(e, phases["forward_backward"]) or inside(e, phases["optimizer"]) for e in ops)
        for c in spans(trace, "collective"):
            assert {"bytes", "count", "dtype", "op", "comm_size"} <= set(c["args"])
            assert c["args"]["bytes"] == c["args"]["count"] * {"f32": 4, "f64": 8, "i32": 4, "i64": 8}[c["args"]["dtype"]]
    # the table's head: the traced steps and their time, the step spans' durations summed
    head = re.search(r"^ctitan: profile of rank 0, (\d+) traced step\(s\), ([\d.]+) ms of steps:$", err, re.M)
    assert head, err[-2000:]
    step_us = sum(spans(load(out / "profile_trace" / f"iteration_{s}" / "rank0_trace.json"), "step")[0]["dur"]
                  for s in traced)
    assert int(head[1]) == len(traced)
    assert abs(Decimal(head[2]) - step_us / 1000) <= Decimal("0.0005"), (head[2], step_us)
    # each row's %step is its total over the traced steps' total (all of them, not one step's)
    pct = [re.match(r"ctitan: profile: (?:op|collective)\s.*\s([\d.]+)\s+([\d.]+)$", l) for l in err.splitlines()]
    pct = [m for m in pct if m]
    assert len(pct) >= len(MODEL_OPS)
    for m in pct:
        assert abs(Decimal(m[2]) - 100 * Decimal(m[1]) * 1000 / step_us) <= Decimal("0.0051"), (m[0], step_us)
    # the table at the end: the trace's durations summed per op (ns kept exactly in both)
    rows = summary_rows(err)
    got = {k[1]: v for k, v in rows.items() if k[0] == "op"}
    assert set(got) == MODEL_OPS | QWEN3_CODE_OPS
    for name, total_us in per_op.items():
        assert got[name][1] == total_us / 1000, (name, got[name], total_us)
    coll = {k[1:]: v for k, v in rows.items() if k[0] == "collective"}
    assert per_coll and set(coll) == set(per_coll), (coll, per_coll)
    for key, total_us in per_coll.items():
        assert coll[key][1] == total_us / 1000, (key, coll[key], total_us)


def mpirun2(args, threads=1):
    """`ctitan train args` on 2 ranks (mpirun, every rank logging); the finished process."""
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: run scripts/setup.sh (installs openmpi-bin)"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", CTITAN_LOG_RANKS="all")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", str(BIN), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


FSDP2 = ["--parallelism.data_parallel_shard_degree=2", "--training.global_batch_size=4"]


def test_two_ranks_fsdp(setup):
    """FSDP over 2 ranks: a trace per rank, pid = rank, and each layer's parameters
    all-gathered and its gradients reduce-scattered in whole (bytes of the layer)."""
    cfg, out, args = setup
    p = mpirun2(args + FSDP2 + ["--training.steps=3"])
    folder = out / "profile_trace" / "iteration_3"
    assert sorted(x.name for x in folder.iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
    want = layer_bytes(cfg)
    for rank in (0, 1):
        trace = load(folder / f"rank{rank}_trace.json")
        validate(trace)
        check_nesting(trace)
        assert {e["pid"] for e in trace["traceEvents"]} == {rank}
        coll = spans(trace, "collective")
        gathers = [c for c in coll if c["name"] in ("all_gather", "iall_gather") and c["args"]["bytes"] == want]
        scatters = [c for c in coll if c["name"] in ("reduce_scatter", "ireduce_scatter")
                    and c["args"]["bytes"] == want]
        assert len(gathers) >= LAYERS, [(c["name"], c["args"]) for c in coll]
        assert len(scatters) == LAYERS, [(c["name"], c["args"]) for c in coll]
        assert all(c["args"]["comm_size"] == 2 and c["args"]["dtype"] == "f32" for c in gathers + scatters)
    assert p.stderr.count("traced step(s)") == 2  # a summary table per rank (CTITAN_LOG_RANKS=all)


def check_worker_spans(trace, rank):
    """The OpenMP threads' shares of the ops: cat "thread" spans on tracks of their own
    (tid = OpenMP thread number, named "omp worker N" by metadata), each within the span of
    the same op (name and args) on the recording thread; at least two such tracks. Returns
    the worker tids."""
    meta = {(e["tid"], e["name"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
    (main_tid,) = {e["tid"] for e in spans(trace, "step")}
    workers = spans(trace, "thread")
    tids = {e["tid"] for e in workers}
    assert len(tids) >= 2 and main_tid not in tids, (tids, main_tid)
    assert all(e["pid"] == rank for e in workers)
    for t in tids:
        assert meta[(t, "thread_name")] == {"name": f"omp worker {t}"}, (t, meta)
    ops = [e for e in spans(trace, "op") if e["tid"] == main_tid]
    assert len(ops) == len(spans(trace, "op"))
    for w in workers:
        assert any(o["name"] == w["name"] and o["args"] == w["args"] and inside(w, o) for o in ops), w
    # a worker's span is its own thread's time, from its first entry into the op's regions (after
    # the op began), not the op's start copied: the ns clock tells them apart
    later = sum(any(o["name"] == w["name"] and inside(w, o) and w["ts"] > o["ts"] for o in ops) for w in workers)
    assert later >= 0.9 * len(workers), f"only {later} of {len(workers)} worker spans start after their op"
    # one span per thread per op call: never more worker spans of an op than its calls times threads
    for name in {w["name"] for w in workers}:
        calls = sum(o["name"] == name for o in ops)
        for t in tids:
            assert sum(w["name"] == name and w["tid"] == t for w in workers) <= calls, (name, t)
    return tids


def test_omp_worker_spans(tmp_path, run_ctitan):
    """training.threads=2: each kernel's parallel regions show up per OpenMP thread, the
    element-wise ops (row-parallel at any size) at least, nested in time in the op's span."""
    _, out, args = tiny_run(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq=2",
                            "--training.threads=2", layers=LAYERS, steps=2)
    _, _, err = run_ctitan(args)
    trace = load(out / "profile_trace" / "iteration_2" / "rank0_trace.json")
    validate(trace)
    check_nesting(trace)
    check_worker_spans(trace, 0)
    names = {w["name"] for w in spans(trace, "thread")}
    assert {"rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "attention_fwd", "attention_bwd"} <= names, names
    # the summary table stays per op: the workers' shares are not rows of their own
    cats = {l.split()[2] for l in err.splitlines() if l.startswith("ctitan: profile: ")}
    assert cats == {"category", "op", "collective"}, cats


def test_model_code_worker_spans(tmp_path, run_ctitan):
    """The model code's own parallel loops (outside the kernels) show their threads too:
    zeroing a layer's gradient scratch and the gradient norm, each an op span of impl
    "model" with a worker span per thread inside it; with LoRA dropout, the dropout mask's
    forward and backward loops. The model is just large enough for those loops to go
    parallel (the norm's groups of 4 x 2^16 gradients, of which it needs two, since one
    group runs without a region: inter 3072 gives ~660 k); without dropout, the LoRA
    group's own region (lora_fwd / lora_bwd: 128 rows, 64 per thread). Qwen3 zeroes no
    scratch (each buffer's first product overwrites it); a Llama, whose RoPE backward adds
    into d(q) and d(k) of the projections, zeroes those (2^18 floats or more: 16 heads of
    128 and 8 kv heads, 128 tokens)."""
    import oracle
    from transformers import LlamaConfig
    cfg = oracle.tiny_config(vocab=128, hidden=64, inter=3072, layers=1, heads=4, kv_heads=2, head_dim=16)
    model, llama, data = tmp_path / "model", tmp_path / "llama", tmp_path / "d.bin"
    cfg.save_pretrained(model)
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=256, tie_word_embeddings=False,
                use_cache=False).save_pretrained(llama)
    oracle.write_bin(data, oracle.learnable_stream(4 * 129 + 5, 128, seed=3))
    base = ["train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={data}",
            "--training.seq_len=64", "--training.local_batch_size=2", "--training.steps=2", "--training.threads=2",
            "--metrics.log_freq=1", "--metrics.peak_tflops=1", "--profiling.enable_profiling",
            "--profiling.profile_freq=2"]
    runs = {"full": ([], {"grad_norm"}),
            "llama": ([f"--model.hf_assets_path={llama}"], {"zero_layer_scratch", "grad_norm"}),
            "lora": (["--lora.rank=4", "--lora.alpha=8", "--lora.dropout=0.25", "--lora.target_modules=q_proj,up_proj"],
                     {"lora_dropout_fwd", "lora_dropout_bwd"}),
            # without dropout the adapters of one input run as a group in one region (model/lora.h)
            "lora-group": (["--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=q_proj,k_proj,up_proj"],
                           {"lora_fwd", "lora_bwd"})}
    for name, (flags, want) in runs.items():
        out = tmp_path / name
        _, _, err = run_ctitan(base + [f"--job.dump_folder={out}"] + flags)
        trace = load(out / "profile_trace" / "iteration_2" / "rank0_trace.json")
        validate(trace)
        check_nesting(trace)
        tids = check_worker_spans(trace, 0)
        ops = [e for e in spans(trace, "op") if e["name"] in want]
        assert {e["name"] for e in ops} == want, (name, sorted({e["name"] for e in spans(trace, "op")}))
        if name == "full":  # Qwen3: nothing to zero
            assert not [e for e in spans(trace, "op") if e["name"] == "zero_layer_scratch"]
        for e in ops:  # the group's products run the matmul kernel, nested in its region
            assert e["args"]["impl"] == ("model" if "dropout" in e["name"] or name in ("full", "llama")
                                         else f"matmul:{kernels_line(err)['matmul']}"), e
        for n in want:  # every thread of the loop has its share under the op
            got = {w["tid"] for w in spans(trace, "thread") if w["name"] == n}
            assert got == tids, (name, n, got, tids)


# Generation's attention over the KV cache runs outside training steps, which are all the
# profiler traces: its loops need no stamps.
UNTRACED_REGIONS = {("src/model/lm.c", "kv_attention_decode"), ("src/model/lm.c", "kv_attention_prefill")}


def test_every_parallel_region_stamps_its_threads(root):
    """Each `omp parallel` region of the kernels, the model and the optimizer reads the armed
    trace earlier in its function and stamps entry and exit inside it (kernels/ops.h, per-thread spans): a
    region without them would leave its threads' time out of the trace, or, as a combined
    `parallel for`, could not stamp at all."""
    missing, regions = [], 0
    for folder in ("src/kernels", "src/model", "src/optim"):
        for path in sorted((root / folder).rglob("*.c")):
            rel = str(path.relative_to(root))
            lines = path.read_text().splitlines()
            func, start = None, 0
            for i, line in enumerate(lines):
                m = re.match(r"^(?:static\s+)?[\w\s\*]+?\b(\w+)\(", line)
                if m and not line.startswith((" ", "#", "/", "}")):
                    func, start = m[1], i
                if not re.match(r"\s*#pragma omp parallel\b", line) or (rel, func) in UNTRACED_REGIONS:
                    continue
                regions += 1
                before = "\n".join(lines[start:i])  # read once per function serves all its regions
                body = "\n".join(lines[i + 1:i + 4])
                if "kern_trace_armed()" not in before or "KERN_TRACE_ENTER(" not in body:
                    missing.append(f"{rel}:{i + 1} ({func})")
    assert regions > 40, regions  # the scan found the regions at all
    assert not missing, missing


def test_memory_snapshot_matches_dry_run(setup, run_ctitan):
    cfg, out, args = setup
    _, _, err = run_ctitan(args + ["--profiling.enable_memory_snapshot"])
    _, dry, _ = run_ctitan([a for a in args if not a.startswith("--profiling")] + ["--dry-run"])
    planned = {}
    for l in dry.splitlines():
        m = re.match(r"\s+(parameters|gradients|AdamW moments|activations \+ workspace).*GiB\s+(\d+) bytes$", l)
        if m:
            planned[m[1]] = int(m[2])
    names = {"parameters": "parameters", "gradients": "gradients", "AdamW moments": "adamw_moments",
             "activations + workspace": "activations_workspace"}
    assert len(planned) == 4, dry
    snaps = sorted((out / "memory_snapshot").iterdir())
    assert [d.name for d in snaps] == [f"iteration_{s}" for s in range(FREQ, STEPS + 1, FREQ)]
    for d in snaps:
        snap = json.loads((d / "rank0_memory_snapshot.json").read_text())
        cats = {c["name"]: c for c in snap["categories"]}
        for k, v in planned.items():
            assert cats[names[k]]["planned"] == v, (k, cats, planned)
            # every buffer of a one-process run is written during a step, so all of it is resident
            assert 0.5 * v < cats[names[k]]["measured"] <= v, (k, cats[names[k]])
        assert snap["total_measured"] <= snap["peak_rss"]
    assert "ctitan: memory: total" in err


def test_two_ranks_ddp_collectives_and_threads(setup):
    """Data parallel (replicas) over 2 ranks, 2 OpenMP threads each: every rank's trace has
    its gradient all-reduces, whose f32 sum bytes add up to the model's parameters (torch's
    count of the same config), a layer's bucket the layer's bytes; and its own worker tracks,
    within its ops, under its pid."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg, out, args = setup
    mpirun2(args + ["--parallelism.data_parallel_replicate_degree=2", "--training.global_batch_size=4",
                    "--training.steps=3", "--training.threads=2"], threads=2)
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    folder = out / "profile_trace" / "iteration_3"
    for rank in (0, 1):
        trace = load(folder / f"rank{rank}_trace.json")
        validate(trace)
        check_nesting(trace)
        assert {e["pid"] for e in trace["traceEvents"]} == {rank}
        coll = spans(trace, "collective")
        for c in coll:
            a = c["args"]
            assert a["bytes"] == a["count"] * {"f32": 4, "f64": 8, "i32": 4, "i64": 8}[a["dtype"]], c
            assert a["comm_size"] == 2, c
        grads = [c for c in coll if c["name"] in ("all_reduce", "iall_reduce") and c["args"]["dtype"] == "f32"
                 and c["args"]["op"] == "sum"]
        assert sum(c["args"]["bytes"] for c in grads) == 4 * n_params, [(c["name"], c["args"]) for c in grads]
        assert sum(c["args"]["bytes"] == layer_bytes(cfg) for c in grads) == LAYERS, [c["args"] for c in grads]
        (red,) = [e for e in spans(trace, "phase") if e["name"] == "reduce"]
        (fb,) = [e for e in spans(trace, "phase") if e["name"] == "forward_backward"]
        assert all(inside(c, red) or inside(c, fb) for c in grads)
        check_worker_spans(trace, rank)


DRY_NAMES = {"parameters": "parameters", "gradients": "gradients", "AdamW moments": "adamw_moments",
             "FSDP gathered": "fsdp_gathered", "activations + workspace": "activations_workspace"}


def dry_table(text):
    """{snapshot category: bytes} of a dry-run table (the lines "  what ... GiB  N bytes")."""
    got = {}
    for l in text.splitlines():
        m = re.match(r"\s+(parameters|gradients|AdamW moments|FSDP gathered|activations \+ workspace).*GiB\s+(\d+) bytes$",
                     l)
        if m:
            got[DRY_NAMES[m[1]]] = int(m[2])
    return got


def test_memory_snapshot_fsdp_is_per_shard(setup, run_ctitan):
    """FSDP over 2 ranks: each rank's snapshot plans what that rank holds, the dry run's
    per-rank table (its shard of parameters, gradients and moments, and the pieces FSDP
    gathers), not the whole model; the parameters are half the model's (torch's count of the
    same config, up to a float of padding per piece and rank), and every category is
    measured on every rank."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg, out, args = setup
    base = [a for a in args if not a.startswith("--profiling")]
    _, dry, _ = run_ctitan(base + FSDP2 + ["--dry-run"])
    per_rank = dry_table(dry.split("per rank:", 1)[1])
    assert set(per_rank) == set(DRY_NAMES.values()), dry
    torch.manual_seed(0)
    whole = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    pieces = LAYERS + 2  # the embedding, each layer, the head (norm and lm_head)
    mpirun2(base + FSDP2 + ["--training.steps=2", "--profiling.enable_memory_snapshot", "--profiling.profile_freq=2"])
    for rank in (0, 1):
        snap = json.loads((out / "memory_snapshot" / "iteration_2" / f"rank{rank}_memory_snapshot.json").read_text())
        cats = {c["name"]: c for c in snap["categories"]}
        assert {k: c["planned"] for k, c in cats.items()} == per_rank, (rank, cats, per_rank)
        assert whole <= 2 * cats["parameters"]["planned"] <= whole + 2 * 4 * pieces, (cats["parameters"], whole)
        for k, c in cats.items():
            assert isinstance(c["measured"], int) and c["measured"] >= 0, (rank, k, c)
        # every rank wrote its own shard during the step: all of it is resident
        for k in ("parameters", "gradients", "adamw_moments"):
            assert 0.5 * cats[k]["planned"] < cats[k]["measured"] <= cats[k]["planned"], (rank, k, cats[k])
        assert cats["fsdp_gathered"]["measured"] <= cats["fsdp_gathered"]["planned"] + 4096, cats["fsdp_gathered"]
        assert snap["total_planned"] == sum(per_rank.values())


def test_memory_snapshot_lora_leaves_frozen_pages_out(tmp_path, run_ctitan):
    """A LoRA run's gradient and moment buffers span the whole model, but only the adapters'
    runs are ever written: before step 1 the trainer writes exactly those (its prefault of
    the += accumulators), and the frozen tensors' pages never exist. With a model of ~1.1 M
    frozen floats (~1100 pages per buffer) and rank-2 adapters, the snapshot after step 1
    measures the gradients and moments at the dry run's planned (trained) bytes, up to the
    pages the adapters' runs share with frozen neighbours, and far below the whole buffers."""
    import oracle
    cfg = oracle.tiny_config(vocab=2048, hidden=256, inter=512, layers=2, heads=4, kv_heads=2, head_dim=64)
    cfg.save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "d.bin", oracle.learnable_stream(2000, 2048, seed=3))
    out = tmp_path / "out"
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'model'}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=1", "--training.steps=1", "--training.seed=5",
            "--metrics.peak_tflops=1", f"--job.dump_folder={out}", "--lora.rank=2", "--lora.alpha=4"]
    _, dry, _ = run_ctitan(args + ["--dry-run"])
    planned = dry_table(dry)
    _, _, err = run_ctitan(args + ["--profiling.enable_profiling", "--profiling.profile_freq=1",
                                   "--profiling.enable_memory_snapshot"])
    snap = json.loads((out / "memory_snapshot" / "iteration_1" / "rank0_memory_snapshot.json").read_text())
    cats = {c["name"]: c for c in snap["categories"]}
    whole = 4 * (2 * 2048 * 256 + 2 * (256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 512))  # frozen fp32 bytes
    runs = 2 * 7 * 2  # adapter tensors (A and B of the seven projections, two layers)
    for k, copies in (("gradients", 1), ("adamw_moments", 2)):
        assert cats[k]["planned"] == planned[k], (k, cats[k], planned)
        assert planned[k] < copies * whole / 50, (k, planned[k], whole)  # the dry run plans the trained part only
        # written: all of the trained floats, plus at most two partial pages a run per copy
        assert 0.5 * planned[k] < cats[k]["measured"] <= planned[k] + copies * runs * 2 * 4096, (k, cats[k])


def test_profile_freq_must_be_positive(setup, run_ctitan):
    _, _, args = setup
    rc, _, err = run_ctitan(args + ["--profiling.profile_freq=0"], check=False)
    assert rc == 2 and "profiling.profile_freq" in err, (rc, err)
    _, help_out, help_err = run_ctitan(["train", "--help"])
    for key in ("enable_profiling", "save_traces_folder", "profile_freq", "enable_memory_snapshot",
                "save_memory_snapshot_folder"):
        assert f"--profiling.{key}=" in help_out + help_err


def test_bf16_matmuls_are_the_bf16_op(setup, run_ctitan):
    """Under bf16 mixed precision the model's matmul calls run matmul_bf16's choice: their
    spans say so, with the implementation the log names for matmul_bf16."""
    _, out, args = setup
    _, _, err = run_ctitan(args + ["--training.mixed_precision_param=bfloat16", f"--training.steps={FREQ}"])
    chosen = kernels_line(err)
    trace = load(out / "profile_trace" / f"iteration_{FREQ}" / "rank0_trace.json")
    mm = [e for e in spans(trace, "op") if e["name"].startswith("matmul_")]
    assert mm and all(e["args"]["op"] == "matmul_bf16" and e["args"]["impl"] == chosen["matmul_bf16"] for e in mm)


def test_bf16_experts_are_the_bf16_op(tmp_path, run_ctitan):
    """The same for the MoE experts: under bf16 mixed precision the model's experts calls run
    moe_experts_bf16's choice, and their spans say so."""
    import oracle_moe
    _, out, args = tiny_run(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq=2", steps=2)
    moe_dir = tmp_path / "moe_model"
    oracle_moe.tiny_moe_config(vocab=128, hidden=32, layers=2, mlp_only=(1,)).save_pretrained(moe_dir)
    args = [f"--model.hf_assets_path={moe_dir}" if a.startswith("--model.hf_assets_path=") else a for a in args]
    _, _, err = run_ctitan(args + ["--training.mixed_precision_param=bfloat16"])
    chosen = kernels_line(err)
    trace = load(out / "profile_trace" / "iteration_2" / "rank0_trace.json")
    ex = [e for e in spans(trace, "op") if e["name"] in ("moe_fwd", "moe_bwd")]
    assert {e["name"] for e in ex} == {"moe_fwd", "moe_bwd"}, sorted({e["name"] for e in spans(trace, "op")})
    assert all(e["args"] == {"op": "moe_experts_bf16", "impl": chosen["moe_experts_bf16"]} for e in ex), \
        [e["args"] for e in ex]


def test_moe_router_spans(tmp_path, run_ctitan):
    """A Qwen3-MoE run: each MoE layer's router (model code around a registry matmul) is an
    op span of its own, moe_route_fwd and moe_route_bwd, inside that layer's span, named with
    the matmul implementation it runs; the experts are the moe_experts op; the summary has
    the router's rows with the trace's totals."""
    import oracle_moe
    cfg, out, args = tiny_run(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq=2", steps=2)
    moe_dir = tmp_path / "moe_model"
    oracle_moe.tiny_moe_config(vocab=128, hidden=32, layers=2, mlp_only=(1,)).save_pretrained(moe_dir)
    args = [f"--model.hf_assets_path={moe_dir}" if a.startswith("--model.hf_assets_path=") else a for a in args]
    _, _, err = run_ctitan(args)
    chosen = kernels_line(err)
    trace = load(out / "profile_trace" / "iteration_2" / "rank0_trace.json")
    validate(trace)
    check_nesting(trace)
    ops = spans(trace, "op")
    layers = spans(trace, "layer")
    per_dir = {"fwd": [], "bwd": []}
    for d in per_dir:
        per_dir[d] = [e for e in ops if e["name"] == f"moe_route_{d}"]
        # layer 0 is MoE, layer 1 dense (mlp_only_layers): one router call per direction
        assert len(per_dir[d]) == 1, [e["name"] for e in ops]
        (r,) = per_dir[d]
        assert r["args"] == {"op": "moe_route", "impl": f"matmul:{chosen['matmul']}"}, r["args"]
        (lay,) = [l for l in layers if inside(r, l)]
        assert lay["name"] == f"layer_{d}" and lay["args"]["layer"] == 0, lay
        assert any(e["name"] == f"moe_{d}" and e["args"]["op"] == "moe_experts" and inside(e, lay) for e in ops), \
            sorted({e["name"] for e in ops if inside(e, lay)})
    rows = summary_rows(err)
    for d, (r,) in per_dir.items():
        calls, ms = rows[("op", f"moe_route_{d}", "moe_route", f"matmul:{chosen['matmul']}")]
        assert calls == 1 and ms == r["dur"] / 1000, (calls, ms, r["dur"])
