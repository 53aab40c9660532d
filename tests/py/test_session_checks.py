"""The session API's own checks (src/api/ctitan.c), found untested by the seventh mutation
audit: a batch must fit the plan the session was opened with, and tokens and labels must be
ids of the model's vocabulary (or -100, the ignored label) before the model's ops, which
trust their arguments, see them. The bounds are the config's: vocab_size from config.json,
the plan from training.local_batch_size and training.seq_len."""
import numpy as np
import torch
import pytest

import oracle
from conftest import CtitanError, hf_session_args

B, T, VOCAB = 2, 16, 128


@pytest.fixture
def session(tmp_path, open_session):
    oracle.tiny_config(vocab=VOCAB, hidden=32, inter=48, layers=1, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(tmp_path / "model")
    return open_session(hf_session_args(tmp_path / "model", load=False, batch=B, seq_len=T))


def batch(b, t, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(b, t), dtype=np.int32)
    return tokens, tokens.copy()


def test_the_planned_batch_and_every_id_in_range_are_taken(session):
    """B x T as planned, the last id of the vocabulary as a token and a label, and -100
    labels: accepted (a finite loss sum)."""
    tokens, labels = batch(B, T)
    tokens[0, 0] = labels[1, 3] = VOCAB - 1
    labels[0, :4] = -100
    loss = session.forward_backward(tokens, labels, int((labels != -100).sum()))
    assert np.isfinite(loss), loss
    assert session.logits(tokens).shape == (B, T, VOCAB)


@pytest.mark.parametrize("b,t", [(B, T + 1), (B + 1, T), (0, T), (B, 0)])
def test_a_batch_outside_the_plan_is_refused(session, b, t):
    """One row or one position more than training.local_batch_size x training.seq_len, or an
    empty side: refused, naming both shapes, before the model runs."""
    tokens, labels = batch(max(b, 1), max(t, 1))
    tokens, labels = tokens[:b, :t], labels[:b, :t]
    with pytest.raises(CtitanError, match=rf"batch {b} x {t} does not fit the planned {B} x {T}"):
        session.forward_backward(tokens, labels, 1)
    with pytest.raises(CtitanError, match=rf"batch {b} x {t} does not fit the planned {B} x {T}"):
        session.logits(tokens)


@pytest.mark.parametrize("what,value", [("token", VOCAB), ("token", -1), ("label", VOCAB), ("label", -2)])
def test_an_id_outside_the_vocabulary_is_refused(session, what, value):
    """vocab_size (one past the last id) or a negative id other than the label -100:
    refused naming the id and its flat index."""
    tokens, labels = batch(B, T)
    (tokens if what == "token" else labels)[1, 5] = value
    with pytest.raises(CtitanError, match=rf"{what} {value} at {T + 5} is outside the vocabulary"):
        session.forward_backward(tokens, labels, 1)


def test_n_valid_total_must_be_positive(session):
    tokens, labels = batch(B, T)
    with pytest.raises(CtitanError, match="n_valid_total must be positive"):
        session.forward_backward(tokens, labels, 0)


def test_dropout_after_an_optimizer_step_draws_the_next_steps_masks_from_its_first_sequence(tmp_path, open_session):
    """lora.dropout = 0.3 through the session: forward_backward, optimizer_step, then the
    next step's forward_backward without a zero_grad (the optimizer zeroes the gradients).
    That call holds sequences 0.. of step 2, so its loss and adapter gradients are PEFT's
    with step 2's documented masks from element 0 (test_lora.lora_dropout_keep), on the
    adapters the first step left. A count of sequences carried over the optimizer step drew
    the masks of sequences LOCAL_BS.. instead."""
    import oracle_lora as OL
    from test_lora import _FixedDropout, dense_cfg, lora_args, lora_dropout_keep
    from test_parity import make_batch
    from test_train_loop import LOCAL_BS, L
    tol = 1e-4
    p, r, alpha, seed = 0.3, 4, 12.0, 5
    cfg = dense_cfg()
    hf_dir, ad, pm, params, lora = OL.random_all7_adapter(tmp_path, cfg, hf_seed=43, r=r, alpha=alpha, seed=11)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=seed, extra=lora_args(
        r=r, alpha=alpha, adapter=ad) + [f"--lora.dropout={p}"]))
    t1, l1 = make_batch(cfg.vocab_size, LOCAL_BS, L, seed=2)
    t2, l2 = make_batch(cfg.vocab_size, LOCAL_BS, L, seed=3)
    s.zero_grad()
    s.forward_backward(t1, l1, oracle.n_valid(l1))
    s.optimizer_step()
    nv = oracle.n_valid(l2)
    loss = s.forward_backward(t2, l2, nv) / nv
    with torch.no_grad():  # PEFT on the adapters after step 1
        for n in lora:
            params[n].copy_(torch.from_numpy(s.get_param(n)))
    widths = {"q_proj": cfg.hidden_size, "k_proj": cfg.hidden_size, "v_proj": cfg.hidden_size,
              "o_proj": cfg.num_attention_heads * cfg.head_dim, "gate_proj": cfg.hidden_size,
              "up_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}
    layers = pm.base_model.model.model.layers

    def peft(first):
        for l in range(cfg.num_hidden_layers):
            for j, mod in enumerate(OL.ALL7):
                n = LOCAL_BS * L * widths[mod]
                keep = lora_dropout_keep(seed, step=2, layer=l, proj=j, n=n, p=p, first=first * widths[mod])
                sub = getattr(layers[l], "self_attn" if mod in OL.ATTN else "mlp")
                getattr(sub, mod).lora_dropout["default"] = _FixedDropout(keep.reshape(LOCAL_BS, L, -1), p)
        return OL.loss_logits_grads(pm, params, t2, l2)

    ref_loss, _, ref_grads = peft(0)
    other, _, _ = peft(LOCAL_BS * L)  # the masks of the step's next sequences
    assert abs(other - ref_loss) > 100 * tol * ref_loss, "test setup: the masks hardly change the loss"
    assert abs(loss - ref_loss) <= tol * abs(ref_loss), f"step 2 loss {loss} vs PEFT with its masks {ref_loss} " \
        f"(with sequences {LOCAL_BS}..'s masks: {other})"
    bad = [f"{n}: rel err {oracle.rel_err(s.get_grad(n), ref_grads[n]):.3g}" for n in lora
           if not oracle.rel_err(s.get_grad(n), ref_grads[n]) <= tol]
    assert not bad, "step 2's adapter gradients differ from PEFT's with its masks:\n" + "\n".join(bad)
