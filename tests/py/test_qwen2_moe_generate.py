"""generate's KV-cache forward (lm_kv_layout's per-chunk shared-expert buffers) on qwen2_moe
with a shared expert wider than the dense MLP and the experts' rows, all-sparse and mixed,
through a long prompt (three prefill chunks) then decode steps: the logits after each piece
equal transformers' full forward at that position."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import oracle_families as fam
from test_generate import cached_logits, gen_session, genlib  # noqa: F401 (fixture)

KW = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
          max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
CASES = {"wide_mixed": dict(KW, shared_expert_intermediate_size=96, decoder_sparse_step=2),
         "wide_all_sparse": dict(KW, shared_expert_intermediate_size=200),
         "narrow_all_sparse": dict(KW, shared_expert_intermediate_size=8)}
PIECES = [150, 1, 1, 5, 1, 40, 1]


@pytest.mark.parametrize("cid", list(CASES))
def test_long_prompt_cached_logits(cid, genlib, tmp_path):
    case = fam.Case(f"q2m_gen_{cid}", "qwen2_moe", CASES[cid], seed=13)
    model = fam.build(case)
    fam.save(model, tmp_path / "m")
    V = model.config.vocab_size
    seq = np.random.default_rng(5).integers(0, V, sum(PIECES)).tolist()
    with torch.no_grad():
        want = fam.logits(model, case.family, np.array([seq]))[0]
    with gen_session(genlib, tmp_path / "m", len(seq)) as (st, V2):
        assert V2 == V
        for pos, n, got in cached_logits(genlib, st, V, seq, PIECES):
            ref = want[pos - 1]
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                       err_msg=f"{cid}: logits after {pos} tokens (piece of {n})")
