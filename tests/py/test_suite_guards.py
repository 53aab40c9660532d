"""What keeps the suite honest about itself (issue 17, part 4): `ctitan kernels check` names
in its summary line every implementation it did not run on this CPU and counts the lower
instruction-set paths it ran; every C test binary runs under a timeout; the reference-kernel
selection of the suite reaches `ctitan train` as well as the sessions."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

import conftest
import oracle
from conftest import BIN, CHILD_ENV, ROOT

# CTITAN_ISA's levels (docs/kernels.md) by the CPU features each adds; they nest
LEVELS = ["portable", "avx2", "avx512", "amx"]
LEVEL_FEATS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16"},
    "amx": {"amx_bf16"},
}
ALL_FEATS = set().union(*LEVEL_FEATS.values())


def level_of(needs: set[str]) -> str:
    """The lowest level whose features include `needs`."""
    have = set()
    for lv in LEVELS:
        have |= LEVEL_FEATS.get(lv, set())
        if needs <= have:
            return lv
    raise AssertionError(f"features {needs} beyond every x86 level")


def registered(op):
    """[(impl, needed features, level)] of op's non-reference implementations, and the
    hardware's features."""
    p = subprocess.run([str(BIN), "kernels", "list"], env=dict(CHILD_ENV, CTITAN_ISA="auto"), capture_output=True,
                       text=True, timeout=60)
    conftest.crashed(p.returncode, p.stderr, ["kernels", "list"])
    assert p.returncode == 0, p.stderr
    hw = set(p.stdout.split("\n", 1)[0].split(":", 1)[1].split())
    rows, head = [], False
    for line in p.stdout.splitlines():
        if re.match(r"^op +impl", line):
            head = True
            continue
        f = line.split()
        if head and f and f[0] == op and f[1] != "ref":
            needs = {t for t in f[4:] if t in ALL_FEATS}
            rows.append((f[1], needs, level_of(needs)))
    assert rows, f"no implementation of {op} besides ref in `kernels list`"
    return rows, hw


def check_summary(op, isa):
    env = dict(CHILD_ENV)
    env.pop("CTITAN_ISA", None)
    if isa:
        env["CTITAN_ISA"] = isa
    cmd = [str(BIN), "kernels", "check", "--op", op]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    conftest.crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    last = p.stdout.rstrip("\n").rsplit("\n", 1)[-1]
    assert last.startswith("kernels check:"), f"the summary must be the last line (CI tails it): {last!r}"
    return last


def parse_counts(text):
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(\w+) (\d+)", text)}


@pytest.mark.parametrize("isa", [None, "avx2", "avx512"])
@pytest.mark.parametrize("op", ["add", "matmul_bf16"])
def test_kernels_check_summary_names_what_it_did_not_run(op, isa):
    rows, hw = registered(op)
    cap = LEVELS.index(isa) if isa else len(LEVELS) - 1
    if isa and not LEVEL_FEATS[isa] - {"avx512bf16"} <= hw:
        pytest.fail(f"this CPU ({sorted(hw)}) cannot run CTITAN_ISA={isa}: the suite expects an x86 CPU with it",
                    pytrace=False)
    # what this process may run: the hardware's features up to the forced level
    allowed = set().union(*(LEVEL_FEATS.get(lv, set()) for lv in LEVELS[:cap + 1])) & hw
    # an implementation runs when the CPU (as limited) has every feature it needs
    runs, skipped = {}, {}
    for impl, needs, lv in rows:
        (runs if needs <= allowed else skipped)[impl] = lv
    last = check_summary(op, isa)

    m = re.search(r"(\d+) implementations run against ref \([^)]*\):([^;]*)", last)
    assert m, f"the summary does not count the implementations it ran: {last!r}"
    assert int(m.group(1)) == len(runs), last
    want = {}
    for lv in runs.values():
        want[lv] = want.get(lv, 0) + 1
    # every lower level this CPU runs is counted: a check that ran only the default path
    # (the highest level) would leave avx2 untested on AVX-512 machines
    assert parse_counts(m.group(2)) == want, f"ran per level: want {want}: {last!r}"

    m = re.search(r"(\d+) implementations NOT RUN on this CPU( \(CTITAN_ISA=(\w+)\))?:(.*)$", last)
    if not skipped:
        assert m is None and " 0 implementations skipped" in last, last
        return
    assert m, f"implementations were skipped but the summary does not say which: {last!r}"
    assert int(m.group(1)) == len(skipped), last
    if isa:
        assert m.group(3) == isa, f"the summary must say the level was forced: {last!r}"
    for impl, lv in skipped.items():
        assert re.search(rf"\b{lv} \d+ \([^)]*\b{op}:{impl}\b", m.group(4)), f"{op}:{impl} ({lv}) not named: {last!r}"


def test_c_test_runner_stops_a_hanging_binary(tmp_path):
    hang = tmp_path / "test_hang"
    hang.write_text("#!/bin/sh\nsleep 60\n")
    ok = tmp_path / "test_ok"
    ok.write_text("#!/bin/sh\nexit 0\n")
    for f in (hang, ok):
        f.chmod(0o755)
    p = subprocess.run(["bash", str(ROOT / "scripts" / "run_c_tests.sh"), str(ok), str(hang)],
                       env=dict(os.environ, CT_TEST_TIMEOUT="1"), capture_output=True, text=True, timeout=30)
    assert p.returncode != 0, p.stdout
    assert f"TIMEOUT: {hang}" in p.stdout, p.stdout
    assert "c-tests: 1 passed, 1 failed" in p.stdout, p.stdout


def test_ref_kernel_selection_reaches_the_cli(tmp_path, run_ctitan, monkeypatch):
    """make test-py reruns the CLI tests with CTITAN_TEST_KERNELS: it must change what
    `ctitan train` computes with, or that pass tests the default kernels twice."""
    cfg = oracle.tiny_config(vocab=64, hidden=16, inter=32, layers=1, heads=2, kv_heads=1, head_dim=8)
    cfg.save_pretrained(tmp_path / "m")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(4 * 17, 64, seed=1))
    sec = oracle.train_sections(tmp_path / "o", data, tmp_path / "m", load=False, steps=1)
    monkeypatch.setenv("CTITAN_TEST_KERNELS", "matmul=ref,attention=ref,rmsnorm=ref")
    _, _, err = run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "c.toml", sec)])
    line = next((l for l in err.splitlines() if "kernels:" in l and "matmul=" in l), "")
    for kv in ("matmul=ref", "attention=ref", "rmsnorm=ref"):
        assert re.search(rf"\b{kv}\b", line), f"{kv} not in the run's kernel line: {line!r}"
