"""`ctitan kernels bench` (cli/cmd_kernels.c, kernels/timing.c) as a user runs it: the
figures it prints and its --cold mode, which says how much it writes between timed calls
(tests/c/kernels/test_tune.c checks that the writing happens; no test here times anything)."""
import re
import subprocess

from conftest import BIN, CHILD_ENV, ROOT


def bench(tmp_path, *args):
    env = dict(CHILD_ENV, HOME=str(tmp_path))
    p = subprocess.run([str(BIN), "kernels", "bench", "--op", "add", "--reps", "1", "--threads", "2",
                        "--peak", "100", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rates = [float(m) for m in re.findall(r"^add\s+\S+\s+N=\S+\s+([0-9.]+) GB/s", p.stdout, re.M)]
    assert rates and all(r > 0 for r in rates), p.stdout  # every implementation the CPU runs, ref included
    return p.stdout


def test_bench_prints_every_implementation_and_the_cold_scratch(tmp_path):
    hot = bench(tmp_path)
    assert "cold:" not in hot, hot
    cold = bench(tmp_path, "--cold")
    m = re.search(r"^cold: before each timed call every thread writes its share of (\d+) MB", cold, re.M)
    assert m and 64 <= int(m[1]) <= 1024, cold  # 4 x the last-level cache, clamped
    assert len(re.findall(r"^add ", cold, re.M)) == len(re.findall(r"^add ", hot, re.M)), (hot, cold)


def test_bench_repetitions_take_no_fresh_pages(tmp_path):
    """The attention kernels allocate multi-MB scratch per call; glibc used to hand it back to
    the kernel on free, so every timed call paid ~3000 page faults and the first attention rows
    of a run read 1.4-1.8x slower than the same kernel's later ones. `kernels bench` keeps
    freed memory (cmd_kernels.c): five more repetitions add no fresh pages (measured 0; ~33 k
    before with blocked_avx2). Minor faults of the child, not time."""
    import platform
    import resource

    # a register-blocked attention this CPU runs (they allocate per call; "tiled" does not)
    impl = "blocked_neon" if platform.machine() == "aarch64" else "blocked_avx2"

    def faults(reps):
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        p = subprocess.run([str(BIN), "kernels", "bench", "--op", "attention", "--impl", impl, "--reps", str(reps),
                            "--threads", "2", "--peak", "100"], cwd=ROOT, env=dict(CHILD_ENV, HOME=str(tmp_path)),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before

    extra = faults(6) - faults(1)
    assert extra < 2000, f"5 more repetitions of the attention rows took {extra} fresh pages"
