"""LoRA on embed_tokens at its edges, against PEFT 0.21.2 + transformers (oracle_lora.py): a
step of 8 tokens (1 x 8: the adapter's backward scratch sized by the first step it sees, however
small) holding the vocabulary's first and last ids, the last one twice (its dA column the sum of
both rows', as torch's index_add); logits, loss and every adapter gradient."""
import numpy as np

import oracle
from conftest import hf_session_args
from test_lora import OPT_ARGS
from test_lora_embed_tokens import EMB, assert_step, peft_setup
from test_lora_lm_head import cfg_qwen3, lora_args
from test_parity import make_batch


def test_eight_tokens_with_the_first_and_last_ids(tmp_path, open_session):
    cfg = cfg_qwen3()
    V, T = cfg.vocab_size, 8
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    ad, pm, params = peft_setup(tmp_path, hf_dir, oracle.load_hf(hf_dir), ["embed_tokens"])
    tokens, labels = make_batch(V, 1, T, seed=5)
    tokens[0, 0] = tokens[0, 5] = V - 1
    tokens[0, 3] = 0
    s = open_session(hf_session_args(hf_dir, batch=1, seq_len=T, extra=OPT_ARGS + lora_args(["embed_tokens"], ad)))
    grads = assert_step(s, pm, params, tokens, labels)
    assert np.any(grads[EMB[0]][:, V - 1]) and np.any(grads[EMB[0]][:, 0]), "test setup: no gradient at the ends"
