"""LoRA adapters run as groups (q, k, v; gate, up; o; down) in one parallel region whose
threads split the rows (src/model/lora.c, lora_fwd_group / lora_bwd_group): the path is
taken only with at least 32 rows per thread, which the other LoRA tests' 2 x 16 tokens never
reach. Here 2 x 96 tokens on 2 threads: PEFT's loss, logits and every adapter gradient to
1e-4 (as test_lora.py), and the same bits on 1 thread (each element summed by the same
kernel in the same order whatever the thread count).

Every expected number comes from PEFT / torch (oracle_lora.py)."""
import numpy as np

import oracle_lora as OL
from conftest import hf_session_args
from test_lora import ALPHA, OPT_ARGS, R, assert_step_matches, dense_cfg, lora_args
from test_parity import make_batch

SEQ, BATCH = 96, 2


def test_grouped_adapters_match_peft_on_split_rows(tmp_path, open_session):
    cfg = dense_cfg()
    hf_dir, ad, pm, params, lora = OL.random_all7_adapter(tmp_path, cfg, hf_seed=11, r=R, alpha=ALPHA, seed=5)
    tokens, labels = make_batch(cfg.vocab_size, BATCH, SEQ, seed=5)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)

    grads = {}
    for threads in (2, 1):
        s = open_session(hf_session_args(hf_dir, batch=BATCH, seq_len=SEQ, extra=OPT_ARGS + lora_args(
            targets=OL.ALL7, adapter=ad) + [f"--training.threads={threads}"]))
        assert_step_matches(s, tokens, labels, ref_loss, ref_logits, ref_grads, lora)
        grads[threads] = {n: s.get_grad(n).copy() for n in lora}
        s.close()
    bad = [n for n in lora if not np.array_equal(grads[1][n], grads[2][n])]
    assert not bad, f"gradients differ between 1 and 2 threads: {bad}"
