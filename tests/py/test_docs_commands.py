"""Commands and help texts the README and docs give, run as a user types them.

- README, "Using it": `python3 scripts/gen_tokens.py data/debug_tokens.bin` right after
  `make`, on a fresh clone: there is no data/ folder there (git does not hold it; `make run`
  makes it), and the script died with FileNotFoundError. It must write the file, making the
  folder, and the file must be what configs/debug.toml trains on.
- `ctitan prepare --help` said "the trainer reads "text" only, so data with another field is
  prepared first", while `training.text_field` (docs/data.md, "Sources"; `train --help`) reads
  another field: the help must name training.text_field and not say the trainer cannot.
"""
import struct
import subprocess
import sys

from conftest import ROOT


def test_gen_tokens_on_a_fresh_clone(tmp_path):
    assert not (tmp_path / "data").exists()
    p = subprocess.run([sys.executable, str(ROOT / "scripts/gen_tokens.py"), "data/debug_tokens.bin"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    raw = (tmp_path / "data/debug_tokens.bin").read_bytes()
    # the script's defaults: 400,000 uint32 tokens below a vocabulary of 512 (debug.toml's model has 2048)
    assert len(raw) == 4 * 400_000
    toks = struct.unpack(f"<{len(raw) // 4}I", raw)
    assert max(toks) < 512


def test_prepare_help_names_training_text_field(run_ctitan):
    _, out, err = run_ctitan(["prepare", "--help"])
    text = " ".join((out + err).split())
    assert "training.text_field" in text, text
    assert 'the trainer reads "text" only' not in text, text
    # and what it says is so: train --help lists the key
    _, tout, terr = run_ctitan(["train", "--help"])
    assert "--training.text_field=" in tout + terr
