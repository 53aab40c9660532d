"""Inference of every model family (model/generate.c) against transformers' full forward.

generate keeps its own KV-cache forward (prefill chunks through GEMMs, single-token decode
rows), so each family's features (biases, q/k norm kinds, post and sandwich norms, sliding
windows in the cache, per-layer RoPE bases, score scale and soft-caps, GELU-tanh, embedding
scaling, the final logit cap, Mixtral's experts) are checked there too: the logits after each
piece of a sequence equal HF's logits of the whole sequence at that position. Expected values
come from transformers only (oracle_families builds the models)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import oracle_families as fam
from test_generate import MIN_MARGIN, cached_logits, gen, gen_cmd, gen_session, genlib, hf_greedy  # noqa: F401
# (gen, gen_cmd, genlib: the fixtures)

# one case per family; the sequence is longer than every window and crosses a prefill chunk
# (64 rows) so windows slide inside the cache and across chunks
IDS = ["llama_rope3_attnbias_hd16", "llama_mlpbias_tied", "mistral_swa5", "qwen2_swa6_layers", "qwen3_yarn",
       "qwen3_moe_aux", "qwen2_moe_step2_aux", "qwen2_moe_mlponly_norm_nobias", "mixtral_e4k2_aux_hd16", "olmo2",
       "phi3_longrope_short_swa7", "gemma3_text", "gemma2", "gemma_gelu_attnbias", "granite", "smollm3_nope_swa5",
       "olmo3_swa5_yarn", "smollm3_kinds", "olmoe_aux_bias", "olmoe_norm_topk_tied", "granitemoe_aux",
       "granitemoe_k3_tied_bias", "granitemoeshared_aux", "glm_bias_partial05", "glm4_partial075_tied",
       "ernie4_5_bias_tied", "seed_oss_outbias_mlpbias", "ministral_types_swa5",
       "exaone4_swa5_nope_tied", "ministral3_yarn_qscale", "helium_bias_interleaved", "vaultgemma_caps_bias",
       "hunyuan_qknorm_after_rope_bias", "ernie4_5_moe_interval2_aux", "ernie4_5_moe_noshared_end1",
       "flex_olmo_aux_hd16", "flex_olmo_norm_topk_tied", "glm4_moe_groups_bias_qknorm", "glm4_moe_plain_tied",
       "dots1_groups_bias_swa5", "dots1_plain_tied"]
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
    with gen_session(genlib, tmp_path / "m", len(seq)) as (st, V2):
        assert V2 == V
        for pos, n, got in cached_logits(genlib, st, V, seq, PIECES):
            ref = want[pos - 1]
            # fp32 against fp32; a window, RoPE base or norm slip moves logits by 1e-2 of their scale
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                       err_msg=f"{cid}: logits after {pos} tokens (piece of {n})")


# greedy `ctitan generate` = transformers' model.generate (its own cache: Gemma2's sliding
# layers keep a window of keys, the caps apply at every decode step), past every window
# case: weight seed with top-2 margins > MIN_MARGIN
GREEDY = {"gemma2": 7, "gemma_gelu_attnbias": 3, "granite": 3, "qwen2_moe_step2_aux": 13, "smollm3_nope_swa5": 3,
          "olmo3_swa5_yarn": 3, "olmoe_aux_bias": 13, "granitemoe_aux": 5, "glm4_partial075_tied": 3,
          "helium_bias_interleaved": 3, "vaultgemma_caps_bias": 7,
          "hunyuan_qknorm_after_rope_bias": 3, "ernie4_5_moe_interval2_aux": 4, "flex_olmo_aux_hd16": 21,
          "glm4_moe_groups_bias_qknorm": 3, "dots1_groups_bias_swa5": 3}


@pytest.mark.parametrize("cid", list(GREEDY))
def test_greedy_matches_model_generate(cid, gen, tmp_path):
    case = fam.CASE[cid]
    model = fam.build(case, seed=GREEDY[cid])
    fam.save(model, tmp_path / "m")
    prompt = np.random.default_rng(3).integers(0, model.config.vocab_size, 12).tolist()
    want, margin = hf_greedy(model, prompt, new=16)
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin}): change the seed"
    _, out, _ = gen(["--checkpoint", tmp_path / "m", "--prompt-ids", " ".join(map(str, prompt)), "--ids",
                     "--max-tokens", 16])
    assert [int(x) for x in out.decode().split()] == want
