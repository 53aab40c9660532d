#!/usr/bin/env python3
"""Issue 14's targets, judged on the runs `make bench` just made on this CPU.

bench_train.py and bench_moe.py append one JSON line per run to the file their
--record names (append_record below): the workload, the precision, both sides'
tokens/s, ctitan's MFU, the ISA ctitan ran at and the one PyTorch was held to, and
this CPU's model and vector features. This script reads such a file and prints one
markdown table for the CPU, the table docs/benchmarks.md keeps per CPU kind, with
each of issue 14's targets judged:

  - W1 (fp32 and bf16), W3 and the MoE workloads, full training: ctitan at least
    1.5x PyTorch, same threads and data;
  - W1 fp32: at least 50% of the measured fp32 FMA peak (ctitan's MFU);
  - W1 bf16 beside ctitan's own W1 fp32: at least 2x where the bf16 products run
    on AMX tiles, faster where they run on other bf16 hardware (AVX512_BF16,
    Arm BF16); no target where the run has none (an AVX2 CPU, or a level held
    below it by CTITAN_ISA), since bf16 then rounds and multiplies in fp32.

A target whose figures are missing (PyTorch not run, a side that failed) reads "not
measured", never "met". Other rows (W2, LoRA, named shapes) are listed without a
target. The last record of a label wins (a workload run again).

Run:  .venv/bin/python bench/scorecard.py build/bench-record.jsonl
"""
import datetime
import json
import os
import platform
import sys

RATIO_TARGET = 1.5
W1_MFU_TARGET = 0.5
AMX_BF16_OVER_FP32 = 2.0

# the environment that holds each side to an ISA level (recorded with every run)
ISA_ENV = ("CTITAN_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
# the vector features that decide which kernels run, as /proc/cpuinfo spells them
X86_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
ARM_FEATURES = ("asimd", "sve", "sve2", "bf16", "i8mm")


def cpu_description(cpuinfo="/proc/cpuinfo"):
    """{'model': name, 'id': family/model or implementer/part, 'features': [...]} of CPU 0."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor's block is enough
                    continue
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    if "flags" in fields:
        model = fields.get("model name", platform.processor() or "unknown x86-64")
        ident = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
        feats = [f for f in X86_FEATURES if f in flags]
    else:
        model = fields.get("model name") or f"Arm CPU part {fields.get('CPU part', '?')}"
        ident = f"implementer {fields.get('CPU implementer', '?')} part {fields.get('CPU part', '?')}"
        feats = [f for f in ARM_FEATURES if f in flags]
    return {"model": model, "id": ident, "features": feats, "cores": os.cpu_count()}


def append_record(path, rec):
    """One run as one JSON line, with the CPU and the ISA environment it ran under."""
    rec = dict(rec)
    rec.setdefault("cpu", cpu_description())
    rec.setdefault("env", {k: os.environ[k] for k in ISA_ENV if k in os.environ})
    rec.setdefault("utc", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"))
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_records(path):
    """The records of path by label, the last one of each label kept, in first-seen order."""
    by_label = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                by_label.pop(r["label"], None)
                by_label[r["label"]] = r
    return list(by_label.values())


def ratio_target_applies(r):
    """Issue 14's 1.5x: W1, W3 and the MoE workloads, full training (not LoRA, not W2)."""
    return not r.get("lora") and (r.get("workload") in ("W1", "W3") or str(r.get("workload", "")).startswith("MoE "))


def verdict(ok):
    """ok: whether a target holds, None where its figures are missing."""
    return "not measured" if ok is None else "met" if ok else "MISSED"


def judge(records):
    """Rows (label, ctitan tok/s, ctitan MFU or None, PyTorch tok/s, ratio, target, verdict)
    and extra lines (target, figure, verdict) for the targets that are not a ratio."""
    rows, extra = [], []
    for r in records:
        c, p = r.get("ctitan_tps"), r.get("pytorch_tps")
        ratio = c / p if c and p else None
        if ratio_target_applies(r):
            target = f">= {RATIO_TARGET}x PyTorch"
            status = verdict(None if ratio is None else ratio >= RATIO_TARGET)
            why = "; ".join(f"{side}: {m}" for side, m in (r.get("notes") or {}).items())
            if ratio is None and why:
                status += f" ({why})"
        else:
            target, status = "-", "-"
        rows.append((r["label"], c, r.get("ctitan_mfu"), p, ratio, target, status))
    full = {(r.get("workload"), r.get("precision")): r for r in records if not r.get("lora")}
    w1, w1b = full.get(("W1", "fp32")), full.get(("W1", "bf16"))
    if w1:
        mfu = w1.get("ctitan_mfu")
        extra.append((f"W1 fp32 at >= {W1_MFU_TARGET:.0%} of the measured fp32 peak",
                      "n/a" if mfu is None else f"{mfu:.1%} of {w1.get('peak_fp32', 0) / 1e9:.0f} GFLOP/s",
                      verdict(None if mfu is None else mfu >= W1_MFU_TARGET)))
    if w1b:
        hw = w1b.get("bf16_isa", "fp32")
        f32, f16 = (w1 or {}).get("ctitan_tps"), w1b.get("ctitan_tps")
        x = f16 / f32 if f16 and f32 else None
        fig = "n/a" if x is None else f"{x:.2f}x ({f16:.1f} against {f32:.1f} tok/s)"
        if hw == "amx":
            extra.append((f"W1 bf16 on AMX at >= {AMX_BF16_OVER_FP32}x ctitan's own fp32", fig,
                          verdict(None if x is None else x >= AMX_BF16_OVER_FP32)))
        elif hw != "fp32":
            extra.append((f"W1 bf16 faster than ctitan's own fp32 (bf16 products on {hw})", fig,
                          verdict(None if x is None else x > 1.0)))
        else:
            extra.append(("W1 bf16 against ctitan's own fp32", fig,
                          "no target: no bf16 hardware at this ISA level (bf16 rounds, multiplies in fp32)"))
    return rows, extra


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def render(records):
    """The markdown table of records (one CPU kind), with its heading lines."""
    if not records:
        return "no runs recorded\n"
    first = records[0]
    cpu, env = first.get("cpu", {}), first.get("env", {})
    held = ", ".join(f"{k}={v}" for k, v in env.items()) or "none (each side at its own best ISA)"
    out = [f"CPU: {cpu.get('model', '?')} ({cpu.get('id', '?')}), {cpu.get('cores', '?')} cores, "
           f"features {' '.join(cpu.get('features', [])) or 'none of note'}",
           f"ctitan at ISA {first.get('isa', '?')} (bf16 products: {first.get('bf16_isa', '?')}), "
           f"fp32 peak {first.get('peak_fp32', 0) / 1e9:.0f} GFLOP/s on {first.get('threads', '?')} threads; "
           f"ISA held by: {held}; runs {records[0].get('utc', '?')} to {records[-1].get('utc', '?')} UTC",
           "",
           "| workload | ctitan tok/s (MFU) | PyTorch tok/s | ratio | issue 14 target | verdict |",
           "|---|---|---|---|---|---|"]
    rows, extra = judge(records)
    for label, c, mfu, p, ratio, target, verdict in rows:
        mfu_s = f" ({mfu:.1%})" if mfu is not None else ""
        out.append(f"| {label} | {fmt(c, '.1f')}{mfu_s} | {fmt(p, '.1f')} | "
                   f"{'n/a' if ratio is None else f'{ratio:.2f}x'} | {target} | {verdict} |")
    if extra:
        out += ["", "| target | figure | verdict |", "|---|---|---|"]
        out += [f"| {t} | {f} | {v} |" for t, f, v in extra]
    mixed = {json.dumps(r.get("env", {}), sort_keys=True) for r in records}
    if len(mixed) > 1:
        out += ["", "warning: the runs were held to different ISA levels; compare one level per table"]
    return "\n".join(out) + "\n"


def main(argv):
    if len(argv) != 2:
        sys.stderr.write("usage: bench/scorecard.py RECORD.jsonl\n")
        return 2
    try:
        records = read_records(argv[1])
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"bench/scorecard.py: {argv[1]}: {e}\n")
        return 1
    sys.stdout.write(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
