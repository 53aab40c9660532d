"""The FMA peak behind MFU (core/cpu.c, `ctitan kernels peak`): a figure that cannot
put MFU above 100%, that is checked against clock x FMA width, that is never cached
from a busy machine, and that the trainer and the benchmarks read the same way."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

import oracle
from conftest import BIN, CHILD_ENV, ROOT

LANES = {"avx512": 16, "avx2": 8, "neon": 4, "scalar": 1}


def peak_json(home, threads=2, extra_env=None):
    env = dict(CHILD_ENV, HOME=str(home), **(extra_env or {}))
    p = subprocess.run([str(BIN), "kernels", "peak", "--json", "--threads", str(threads)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_peak_is_an_upper_bound_checked_against_theory(tmp_path):
    for threads in (1, 2):
        p = peak_json(tmp_path, threads)
        assert p["threads"] == threads
        assert str(tmp_path) in p["cache"] and f"-{p['isa']}-{p['bf16_isa']}-t{threads}" in p["cache"]
        for k in ("fp32_flops", "bf16_flops", "theory_fp32_flops", "clock_hz"):
            assert np.isfinite(p[k]) and p[k] > 0, (k, p)
        if p["source"] != "cached":
            assert p["measured_fp32_flops"] > 0
            # the figure MFU divides by is never below what this process measured
            assert p["fp32_flops"] >= p["measured_fp32_flops"]
        # the theory is the product it says it is, and the figure is at least the theory
        theory = threads * p["clock_hz"] * LANES[p["isa"]] * 2 * p["fma_per_cycle"]
        assert abs(p["theory_fp32_flops"] / theory - 1) < 1e-5
        assert p["fp32_flops"] >= p["theory_fp32_flops"] * (1 - 1e-6)
        assert p["bf16_flops"] >= p["fp32_flops"]
        # a clock between 0.5 and 7 GHz: the dependent-add chain measured cycles, not renamer tricks
        assert 0.5e9 < p["clock_hz"] < 7e9, p


def test_a_run_held_to_a_lower_level_gets_its_peak(tmp_path):
    """CTITAN_ISA=avx2 (a Zen 3 stand-in on a newer x86) holds the kernels to AVX2 + FMA:
    its MFU is against AVX2's FMA peak and no bf16 unit, cached apart from the CPU's own;
    "avx512" keeps AVX-512's bf16 dot products but not AMX; "neon" (aarch64) no BF16."""
    import platform
    full = peak_json(tmp_path / "full")
    if platform.machine() == "x86_64":
        held = peak_json(tmp_path / "avx2", extra_env={"CTITAN_ISA": "avx2"})
        assert (held["isa"], held["bf16_isa"]) == ("avx2", "fp32"), held
        assert "-avx2-fp32-t2" in held["cache"], held
        assert held["bf16_flops"] == held["fp32_flops"], held
        if full["isa"] == "avx512":
            # half the lanes at the same clock and FMA ports: half the theory (the clock is
            # measured again for each, so allow its drift)
            ratio = held["theory_fp32_flops"] / full["theory_fp32_flops"]
            assert 0.4 < ratio < 0.6, (held, full)
            assert held["cache"] != full["cache"]
        mid = peak_json(tmp_path / "avx512", extra_env={"CTITAN_ISA": "avx512"})
        assert mid["bf16_isa"] != "amx", mid
        if full["bf16_isa"] != "amx":  # nothing above AVX-512 to leave out
            assert (mid["isa"], mid["bf16_isa"]) == (full["isa"], full["bf16_isa"]), (mid, full)
    else:
        held = peak_json(tmp_path / "neon", extra_env={"CTITAN_ISA": "neon"})
        assert (held["isa"], held["bf16_isa"]) == ("neon", "fp32"), held
    # "auto": whatever the CPU has, as with no CTITAN_ISA
    odd = peak_json(tmp_path / "odd", extra_env={"CTITAN_ISA": "auto"})
    assert (odd["isa"], odd["bf16_isa"]) == (full["isa"], full["bf16_isa"]), (odd, full)


def test_busy_machine_is_not_cached(tmp_path):
    """Processes spinning on every CPU while it measures: the figure is still given
    (timed by the thread's CPU clock) but not cached, and the reason is said."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(0.3)
        p = peak_json(tmp_path)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert p["source"] == "measured, not cached", p
    assert p["note"], p
    assert not os.path.exists(p["cache"]), "a peak measured beside spinning processes was cached"
    assert p["fp32_flops"] > 0


def test_cache_is_read_and_a_broken_one_ignored(tmp_path):
    p = peak_json(tmp_path)
    cache = p["cache"]
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache, "w") as f:  # at this machine's clock: a cache for another clock is not used (below)
        f.write(f"fp32 1.234e+11\nbf16 5.0e+11\ntheory 1.2e+11\nclock {p['clock_hz']:.6e}\nfma_per_cycle 2\n")
    q = peak_json(tmp_path)
    assert q["source"] == "cached"
    assert q["fp32_flops"] == 1.234e11 and q["bf16_flops"] == 5.0e11 and q["fma_per_cycle"] == 2
    with open(cache, "w") as f:
        f.write("fp32 nan\n")  # half-written or from another version: measured again
    r = peak_json(tmp_path)
    assert r["source"] != "cached" and np.isfinite(r["fp32_flops"]) and r["fp32_flops"] > 0


def test_cache_for_another_clock_is_measured_again(tmp_path):
    """A VM keeps its CPU model name when it moves to a host that clocks
    differently: a cache whose clock is far from the clock now is not used."""
    p = peak_json(tmp_path)
    cache = p["cache"]
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    for factor in (0.5, 1.6):
        with open(cache, "w") as f:
            f.write(f"fp32 1.234e+11\nbf16 5.0e+11\ntheory 1.2e+11\nclock {factor * p['clock_hz']:.6e}\n"
                    "fma_per_cycle 2\n")
        q = peak_json(tmp_path)
        assert q["source"] in ("measured again", "measured, not cached"), (factor, q)
        assert q["fp32_flops"] != 1.234e11 and 0.5e9 < q["clock_hz"] < 7e9, (factor, q)
        assert abs(q["clock_hz"] / p["clock_hz"] - 1) < 0.5, (factor, q, p)
        if q["source"] == "measured again":  # a quiet machine: the stale figure was replaced and its clocks named
            assert "GHz" in q["note"], q
            with open(cache) as f:
                assert "1.234e+11" not in f.read()


def test_trainer_mfu_uses_the_peak_of_its_precision(tmp_path, run_ctitan):
    """The train log's MFU is tflops / the peak it names, and that peak is the bf16
    one for a bf16 run (as `kernels peak` reports it from the same cache)."""
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    hf = tmp_path / "hf"
    oracle.save_random_hf(hf, cfg)
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(2000, 256, 0))
    p0 = peak_json(tmp_path)
    cache = p0["cache"]
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache, "w") as f:  # known, distinct figures: which one the trainer divided by is then plain
        f.write(f"fp32 2.0e+11\nbf16 8.0e+11\ntheory 2.0e+11\nclock {p0['clock_hz']:.6e}\nfma_per_cycle 2\n")
    for prec, peak in (("float32", 2.0e11), ("bfloat16", 8.0e11)):
        out = tmp_path / prec
        conf = oracle.write_toml(tmp_path / f"{prec}.toml", oracle.train_sections(
            out, data, hf, steps=3, options={"training.mixed_precision_param": prec, "metrics.file": "metrics.jsonl"}))
        env = dict(CHILD_ENV, HOME=str(tmp_path))
        p = subprocess.run([str(BIN), "train", "--config", str(conf)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        want = "bf16" if prec == "bfloat16" else "fp32"
        m = re.search(r"peak ([0-9.]+) GFLOP/s (\w+) on", p.stderr)
        assert m and m.group(2) == want and abs(float(m.group(1)) - peak / 1e9) < 0.1, p.stderr
        rows = oracle.read_metrics(out / "metrics.jsonl")
        assert len(rows) == 3
        for r in rows:
            assert r["tflops"] >= 1e-5 and 0 < r["mfu"] <= 100, r
            # metrics.jsonl prints tflops to 1e-6 and mfu to 1e-4: compare within that rounding
            # (dividing by the other precision's peak would be off by 4x)
            assert abs(r["mfu"] - 100 * r["tflops"] * 1e12 / peak) <= 6e-5 + 100 * 5e-7 * 1e12 / peak, r
