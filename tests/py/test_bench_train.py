"""bench/bench_train.py as a user runs it (ctitan only, a few steps of a small model): the
ctitan row with its figures, and a --ctitan-arg that moves the run's dump folder (a
profiling run kept for its trace) moving where the script reads the metrics too (it
reported "ctitan failed (exit 0)" for a run that had trained); the --record line that
bench/scorecard.py reads holds the printed figure. No figure is judged."""
import json
import re
import subprocess
import sys

from conftest import CHILD_ENV, ROOT


def test_ctitan_row_with_its_dump_folder_moved(tmp_path):
    dump = tmp_path / "kept"
    env = dict(CHILD_ENV, HOME=str(tmp_path), BENCH_TMP=str(tmp_path))
    p = subprocess.run([sys.executable, "bench/bench_train.py", "--shape", "debugmodel", "--batch", "1", "--seq", "32",
                        "--steps", "3", "--warmup", "1", "--threads", "2", "--no-torch",
                        f"--ctitan-arg=--job.dump_folder={dump}", "--record", str(tmp_path / "rec.jsonl")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "failed" not in p.stdout, p.stdout
    m = re.search(r"^ctitan\s+([0-9.]+)\s+([0-9.]+)", p.stdout, re.M)
    assert m and float(m[1]) > 0 and float(m[2]) > 0, p.stdout  # tokens/s, GFLOP/s
    steps = [json.loads(l)["step"] for l in open(dump / "metrics.jsonl") if '"step"' in l]
    assert sorted(set(steps)) == [1, 2, 3], steps
    rec = [json.loads(l) for l in open(tmp_path / "rec.jsonl")]
    assert len(rec) == 1 and rec[0]["label"] == "debugmodel fp32", rec
    assert abs(rec[0]["ctitan_tps"] - float(m[1])) < 0.1 and rec[0]["pytorch_tps"] is None, rec
    assert rec[0]["isa"] and rec[0]["cpu"]["model"], rec
