"""How a run's kernels are chosen: by measurement on the run's sizes at first use, cached
per CPU and threads (kernels/tune.c); forced by [kernels] per op or by CTITAN_ISA per
instruction-set level."""
import glob
import os
import re
import subprocess

import pytest

import oracle
from conftest import BIN, CHILD_ENV, ROOT, crashed


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One HOME (so one kernel cache) for the module: kern_check verdicts are measured once."""
    return tmp_path_factory.mktemp("home")


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def tiny_run(tmp_path, home, name="run", extra=(), env_extra=None, hidden=64):
    cfg = oracle.tiny_config(vocab=256, hidden=hidden, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16)
    hf = tmp_path / "hf"
    if not hf.exists():
        oracle.save_random_hf(hf, cfg)
        oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(4000, 256, 0))
    out = tmp_path / name
    conf = oracle.write_toml(tmp_path / f"{name}.toml", oracle.train_sections(
        out, tmp_path / "tokens.bin", hf, steps=3, options={"metrics.file": "metrics.jsonl"}))
    # the suite runs with CTITAN_KERNEL_TUNE=0 (conftest); these tests are about the timed choice
    env = dict(CHILD_ENV, HOME=str(home), CTITAN_KERNEL_TUNE="1")
    env.pop("CTITAN_ISA", None)
    for k, v in (env_extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    p = subprocess.run([str(BIN), "train", "--config", str(conf), *extra], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    crashed(p.returncode, p.stderr, [BIN, "train", conf])
    return p, out


def kernels_line(stderr):
    return next(l for l in stderr.splitlines() if l.startswith("ctitan: kernels:"))


def test_first_run_measures_then_the_cache_decides(tmp_path, home):
    # hidden 48: sizes no other test of this module uses, so nothing is cached for them yet
    p1, out1 = tiny_run(tmp_path, home, "a", hidden=48)
    assert p1.returncode == 0, p1.stderr
    line1 = kernels_line(p1.stderr)
    assert "(measured " in line1, line1  # several candidates on any CPU this runs on (e.g. attention)
    caches = glob.glob(str(home / ".cache/ctitan/kernels-v2-*-t2.txt"))
    assert len(caches) == 1, caches
    picks = [l.split() for l in open(caches[0]) if l.startswith("pick ")]
    assert picks, "no pick cached"
    # what the log says was picked is what was cached
    for _, op, key, impl, _secs in picks:
        assert re.search(rf"\b{op}={impl} \(measured {key}", line1), (op, impl, line1)

    p2, out2 = tiny_run(tmp_path, home, "b", hidden=48)
    assert p2.returncode == 0, p2.stderr
    line2 = kernels_line(p2.stderr)
    assert "(measured " not in line2 and "(cached)" in line2, line2
    chosen = lambda l: re.findall(r"\b(\w+)=(\w+)", l)
    assert chosen(line1) == chosen(line2)
    # same kernels, same data, same seed: the same bits
    assert oracle.read_metrics(out1 / "metrics.jsonl") and \
        [r["loss"] for r in oracle.read_metrics(out1 / "metrics.jsonl")] == \
        [r["loss"] for r in oracle.read_metrics(out2 / "metrics.jsonl")]


def test_tune_false_and_forced_ops_time_nothing(tmp_path, home):
    caches = lambda: sorted(open(f).read() for f in glob.glob(str(home / ".cache/ctitan/kernels-v2-*")))
    before = caches()
    p, _ = tiny_run(tmp_path, home, "c", extra=["--kernels.tune=false"], hidden=40,
                    env_extra={"CTITAN_KERNEL_TUNE": None})
    assert p.returncode == 0, p.stderr
    assert "measured" not in kernels_line(p.stderr) and "cached" not in kernels_line(p.stderr)
    assert caches() == before, "kernels.tune=false wrote the cache"
    p, _ = tiny_run(tmp_path, home, "d", extra=["--kernels.attention=ref"])
    assert p.returncode == 0, p.stderr
    assert "attention=ref (forced)" in kernels_line(p.stderr)
    # CTITAN_KERNEL_TUNE=0 wins over the config's default (on)
    p, _ = tiny_run(tmp_path, home, "e", env_extra={"CTITAN_KERNEL_TUNE": "0"}, hidden=40)
    assert p.returncode == 0, p.stderr
    assert "measured" not in kernels_line(p.stderr) and "cached" not in kernels_line(p.stderr)


def test_ctitan_isa_limits_the_kernels(tmp_path, home):
    flags = cpu_flags()
    levels = ["ref"] + (["avx2"] if {"avx2", "fma"} <= flags else [])
    for isa in levels:
        # OPENBLAS_CORETYPE unset: ctitan chooses OpenBLAS's kernels itself (cli/main.c)
        p, out = tiny_run(tmp_path, home, f"isa_{isa}", env_extra={"CTITAN_ISA": isa, "OPENBLAS_CORETYPE": None})
        assert p.returncode == 0, p.stderr
        assert f"CTITAN_ISA={isa}: kernels limited to CPU features: " in p.stderr
        line = kernels_line(p.stderr)
        assert "avx512" not in line and "amx" not in line, line
        if isa == "ref":
            # no ISA of ours: every op but matmul (OpenBLAS dispatches by itself) on its reference
            for op, impl in re.findall(r"\b(\w+)=(\w+)", line.split(":", 2)[2]):
                assert impl in ("ref", "tiled", "openblas"), (op, impl)
        if isa == "avx2":
            assert re.search(r"\bmatmul=(avx2|openblas)\b", line), line
            # the "openblas" matmul is a candidate too: on an AVX-512 CPU its SkylakeX kernels
            # would run the stand-in's products at twice an AVX2 CPU's width
            assert re.search(r"CTITAN_ISA=avx2: .*; OpenBLAS kernels Haswell$", p.stderr, re.M), p.stderr
        assert len(oracle.read_metrics(out / "metrics.jsonl")) == 3
    p, _ = tiny_run(tmp_path, home, "bogus", env_extra={"CTITAN_ISA": "avx9000"})
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert 'CTITAN_ISA="avx9000": unknown instruction-set level' in p.stderr


@pytest.mark.parametrize("sub", [["list"], ["check", "--op", "add", "--quick"], ["bench", "--op", "add"], ["peak"]])
def test_kernels_refuses_an_unknown_isa(sub):
    """An unknown CTITAN_ISA is a config error (exit 2 naming the value) in every `kernels`
    subcommand, as in train and generate: check, bench and peak used to run on the whole
    CPU at exit 0, and list exited 1 (the fifth mutation audit)."""
    env = dict(CHILD_ENV, CTITAN_ISA="avx9000")
    p = subprocess.run([str(BIN), "kernels", *sub], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, [BIN, "kernels", *sub])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert 'CTITAN_ISA="avx9000": unknown instruction-set level' in p.stderr, p.stderr[-2000:]
    assert "cpu features" not in p.stdout and "GFLOP" not in p.stdout, p.stdout[-2000:]
