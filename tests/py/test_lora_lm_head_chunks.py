"""LoRA on lm_head with dropout when the fused lm_head + loss holds fewer rows of logits than
the step has (training.logits_chunk_rows): each block's mask is its own rows' (the documented
mask indexed by the row in the step, not in the block), forward and backward: the head's
adapter gradients, and v_proj's adapters below it, which the mask's backward on d(head input)
reaches. PEFT with each lora_dropout replaced by ctitan's documented mask
(test_lora.lora_dropout_keep: the head's key layer index n_layers, projection 0; v_proj's
layer l, projection 2) is the oracle, as in test_lora_lm_head.py's whole-block case."""
import pytest

import oracle
import oracle_lora as OL
from conftest import hf_session_args
from test_lora import _FixedDropout, close, lora_dropout_keep
from test_lora_lm_head import HEAD, TOL, cfg_qwen3, lora_args, peft_setup
from test_parity import make_batch
from test_train_loop import LOCAL_BS, L


@pytest.mark.parametrize("rows", [5])
def test_dropout_mask_by_the_steps_row_in_every_logits_block(rows, tmp_path, open_session):
    p, seed = 0.3, 5
    cfg = cfg_qwen3()
    assert LOCAL_BS * L > 2 * rows and (LOCAL_BS * L) % rows, "test setup: blocks of uneven rows"
    targets = ["v_proj", "lm_head"]
    hf_dir, ad, pm, params = peft_setup(tmp_path, cfg, targets)
    tokens, labels = make_batch(cfg.vocab_size, LOCAL_BS, L, seed=6)
    n = LOCAL_BS * L * cfg.hidden_size
    keep = lora_dropout_keep(seed, step=1, layer=cfg.num_hidden_layers, proj=0, n=n, p=p)
    pm.base_model.model.lm_head.lora_dropout["default"] = _FixedDropout(keep.reshape(LOCAL_BS, L, -1), p)
    for l, layer in enumerate(pm.base_model.model.model.layers):
        kv = lora_dropout_keep(seed, step=1, layer=l, proj=2, n=n, p=p)
        layer.self_attn.v_proj.lora_dropout["default"] = _FixedDropout(kv.reshape(LOCAL_BS, L, -1), p)
    ref_loss, _, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=seed, extra=lora_args(
        targets, ad, extra=[f"--lora.dropout={p}", f"--training.logits_chunk_rows={rows}"])))
    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert close(loss, ref_loss, TOL), f"loss {loss} vs PEFT with the same mask {ref_loss}"
    assert set(HEAD) < set(params)
    bad = [f"{k}: rel err {oracle.rel_err(s.get_grad(k), ref_grads[k]):.3g}" for k in params
           if not oracle.rel_err(s.get_grad(k), ref_grads[k]) <= TOL]
    assert not bad, "\n".join(bad)
