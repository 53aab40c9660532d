"""How many preads a checkpoint load makes (the eighth mutation audit).

docs/checkpoints.md: a load reads "8 MiB of rows at a time", and of a row-parallel weight's
TP slice "one pread per row piece, pieces that lie end to end in the file coalesced into
one". Reading every row (or row piece) with its own pread instead passed every test: the
bytes read, the values and the resumed losses do not change, only the number of system calls
(one per row: 151936 for Qwen3-0.6B's embedding where 75 blocks do). Counted here with
strace on the checkpoint's files (skipped without strace):

- one process: each tensor below 8 MiB is one pread of model.safetensors (parameters) or
  optim.safetensors (each moment);
- TP 2: a row-parallel weight (o_proj, down_proj: torchtitan's RowwiseParallel) is one
  pread per row on each rank, its rows' pieces not being end to end; every other tensor
  (a column-parallel block of whole rows, or a replicated tensor) one pread.

The tensors and their shapes come from the safetensors header, read with the safetensors
package."""
import collections
import re
import shutil

import pytest

from conftest import BIN
from test_ckpt_parallel_io import run
from test_ckpt_tp_io import ROWWISE, STOP, TP, args, header, reference, setup  # noqa: F401 (fixtures)
from test_dist import mpirun

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
PREAD = re.compile(r"^(?:\d+ +)?pread64\(\d+<([^>]*)>")


def preads(trace_files):
    """pread64 calls per checkpoint file (model / optim) of the resumed step, per trace file."""
    out = []
    for f in trace_files:
        n = collections.Counter()
        for line in open(f):
            m = PREAD.match(line)
            if m and f"/step-{STOP}/" in m[1] and m[1].endswith(".safetensors"):
                n[m[1].rsplit("/", 1)[1]] += 1
        out.append(n)
    return out


def want_preads(h, t):
    n = collections.Counter()
    for k, shape, nbytes in h:
        assert nbytes < 8 << 20, f"{k}: the test needs tensors below one 8 MiB block"
        f = "optim.safetensors" if ".exp_avg" in k else "model.safetensors"
        rowwise = t > 1 and any(f".{w}." in k for w in ROWWISE)
        n[f] += shape[0] if rowwise else 1
    return n


@pytest.mark.parametrize("t", [1, 2], ids=["one_process", "tp2"])
def test_a_load_reads_a_block_or_a_row_piece_per_pread(setup, reference, tmp_path, t):
    d, data = setup
    _, stopped = reference["model"]
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    tr = tmp_path / "trace"
    strace = ["strace", "-f", "-y", "-e", "trace=pread64", "-o"]
    a = [str(x) for x in args(d, "model", data, out, *([f"{TP}={t}"] if t > 1 else []))]
    if t == 1:
        run(strace + [str(tr), str(BIN), *a])
        traces = [tr]
    else:  # one trace per rank
        run(mpirun() + ["-np", str(t)] + strace[:-1] + ["-ff", "-o", str(tr), str(BIN), *a])
        traces = sorted(tmp_path.glob("trace.*"))
    got = [c for c in preads(traces) if c]
    assert len(got) == t, f"{len(got)} processes read the checkpoint: {got}"
    want = want_preads(header(out / "checkpoint" / f"step-{STOP}"), t)
    for c in got:
        assert c == want, f"preads per file {dict(c)}, a block or row piece each gives {dict(want)}"
