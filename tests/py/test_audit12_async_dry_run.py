"""Twelfth mutation audit (docs/reliability.md): the dry run's line for checkpoint.async_mode's
staging copy. Rank 0 stages what the checkpoint holds, the trained tensors and their two AdamW
moments in fp32: 12 bytes a trained parameter, the same bytes as the parameters line plus the
moments line; the total holds it. Planted: 8 bytes a parameter, and a total without the copy,
both passed (the suite checked that the line is there)."""
import re

from conftest import tiny_run
from test_ckpt_async import ASYNC, run


def _bytes(out, what):
    line = [ln for ln in out.splitlines() if ln.strip().startswith(what)]
    assert len(line) == 1, out
    return int(re.search(r"(\d+) bytes", line[0]).group(1))


def test_dry_run_staging_is_parameters_and_moments(tmp_path):
    _, _, args = tiny_run(tmp_path, steps=1)
    base = run(args + ["--dry-run"]).stdout
    on = run(args + ["--dry-run", ASYNC]).stdout
    n = int(re.search(r"model hf, (\d+) parameters", on).group(1))
    st = _bytes(on, "checkpoint staging")
    assert st == 12 * n == _bytes(on, "parameters (fp32)") + _bytes(on, "AdamW moments"), on
    assert _bytes(on, "total planned") == _bytes(base, "total planned") + st, (base, on)
