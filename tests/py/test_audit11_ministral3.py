"""Eleventh mutation audit (stop 53): Ministral 3's q scale keys at their edges.

- rope_parameters.original_max_position_embeddings = 0: transformers' get_llama_4_attn_scale
  divides the positions by it (0 / 0 at position 0: NaN logits); ctitan's q_scale_len 0 means
  "no q scale", so accepting it would train another model than the file's without a word. The
  mutant `len < 0` (0 accepted) passed the suite.
- The export's rope_parameters: the yarn dict already carries original_max_position_embeddings
  and the q scale writes it again; without the delete before the add the saved config.json had
  the key twice (json.loads keeps the last, so every reload passed). Read here with a
  duplicate-key check, and loaded back by transformers with the same q scale."""
import json

import numpy as np
import pytest
import torch

import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families import B
from test_families_ministral3 import DEFAULT, M3, _rp


def test_zero_q_scale_length_refused(tmp_path, open_session):
    case = _rp(DEFAULT, original_max_position_embeddings=0)
    model = of.build(case)
    tokens, _ = of.batch(model, B, case.T, seed=5)
    with torch.no_grad():
        logits = of.logits(model, case.family, tokens)
    assert np.isnan(np.asarray(logits)).any(), "test setup: transformers computes with L = 0"
    d = of.save(model, tmp_path / "hf")
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    assert "original_max_position_embeddings" in str(ei.value), str(ei.value)


def _no_dup(pairs):
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    assert not dup, f"config.json has duplicate keys {dup}"
    return dict(pairs)


def test_export_rope_parameters_keys_once(tmp_path, open_session):
    model = of.build(M3)
    d = of.save(model, tmp_path / "hf")
    s = open_session(hf_session_args(d, batch=B, seq_len=M3.T))
    s.save_hf(tmp_path / "export")
    conf = json.loads((tmp_path / "export" / "config.json").read_text(), object_pairs_hook=_no_dup)
    rp, want = conf["rope_parameters"], M3.kw["rope_parameters"]
    for k in ("original_max_position_embeddings", "llama_4_scaling_beta", "rope_type"):
        assert rp[k] == want[k], (k, rp, want)
