"""Inference of every model family (model/generate.c) against transformers' full forward.

generate keeps its own KV-cache forward (prefill chunks through GEMMs, single-token decode
rows), so each family's features (biases, q/k norm kinds, post and sandwich norms, sliding
windows in the cache, per-layer RoPE bases, score scale and soft-caps, GELU-tanh, embedding
scaling, the final logit cap, Mixtral's experts) are checked there too: the logits after each
piece of a sequence equal HF's logits of the whole sequence at that position. Expected values
come from transformers only (oracle_families builds the models)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import oracle_families as fam
from test_generate import _Err, genlib  # noqa: F401 (the fixture: libctitan's model/generate.h entry points)

# one case per family; the sequence is longer than every window and crosses a prefill chunk
# (64 rows) so windows slide inside the cache and across chunks
IDS = ["llama_rope3_attnbias_hd16", "llama_mlpbias_tied", "mistral_swa5", "qwen2_swa6_layers", "qwen3_yarn",
       "qwen3_moe_aux", "mixtral_e4k2_aux_hd16", "olmo2", "phi3_longrope_short_swa7", "gemma3_text"]
PIECES = [70, 1, 1, 5, 1, 1]  # prefill (two chunks), decode, a warm 5-row prefill, decode


@pytest.mark.parametrize("cid", IDS)
def test_cached_logits_match_hf(cid, genlib, tmp_path):
    case = fam.CASE[cid]
    model = fam.build(case)
    if model.config.max_position_embeddings < sum(PIECES):  # longrope's long case would switch factors
        pytest.fail(f"test setup: {cid} allows {model.config.max_position_embeddings} positions")
    fam.save(model, tmp_path / "m")
    V = model.config.vocab_size
    seq = np.random.default_rng(5).integers(0, V, sum(PIECES)).tolist()
    with torch.no_grad():
        want = fam.logits(model, case.family, np.array([seq]))[0]  # [len(seq), V]
    err = _Err()
    h = ctypes.c_void_p()
    assert genlib.gen_model_open(ctypes.byref(h), str(tmp_path / "m").encode(), len(seq), ctypes.byref(err)) == 0, \
        err.msg.decode()
    try:
        st = genlib.gen_model_state(h)
        assert genlib.gen_model_vocab(h) == V
        pos = 0
        for n in PIECES:
            toks = np.ascontiguousarray(seq[pos:pos + n], dtype=np.int32)
            got = np.empty(V, dtype=np.float32)
            rc = genlib.gen_forward(st, toks.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n,
                                    got.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.byref(err))
            assert rc == 0, err.msg.decode()
            pos += n
            ref = want[pos - 1]
            # fp32 against fp32; a window, RoPE base or norm slip moves logits by 1e-2 of their scale
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                       err_msg=f"{cid}: logits after {pos} tokens (piece of {n})")
    finally:
        genlib.gen_model_close(h)
