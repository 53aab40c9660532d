"""Twelfth mutation audit (docs/reliability.md): ERNIE 4.5 MoE's e_score_correction_bias as a
hostile file can hold it. Every other tensor ctitan reads is refused when non-finite or of the
wrong shape; the selection bias is read by its own path (checkpoint/hf.c), and with its
finiteness check or its shape check dropped the suite passed (its files are transformers'
own). An inf in one layer's bias, or a [1, E + 1] bias, must be refused naming the tensor."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle_families as of
from conftest import CtitanError, hf_session_args

BIASED = "ernie4_5_moe_score_bias"


def _edit_bias(d, edit):
    for f in d.glob("*.safetensors"):
        t = load_file(f)
        names = [n for n in t if n.endswith("e_score_correction_bias")]
        if names:
            t[names[-1]] = edit(t[names[-1]].clone())
            save_file(t, f, metadata={"format": "pt"})
            return names[-1]
    raise AssertionError(f"{d}: no e_score_correction_bias")


def _inf(b):
    b.view(-1)[1] = float("inf")
    return b


@pytest.mark.parametrize("edit,words", [
    (_inf, "non-finite"),
    (lambda b: torch.cat([b, b[..., :1]], dim=-1), "must have shape"),
], ids=["inf", "shape"])
def test_bad_correction_bias_refused(edit, words, tmp_path, open_session):
    case = of.CASE[BIASED]
    d = of.save(of.build(case), tmp_path / "hf")
    name = _edit_bias(d, edit)
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, batch=2, seq_len=case.T))
    msg = str(ei.value)
    assert name in msg and words in msg, msg
