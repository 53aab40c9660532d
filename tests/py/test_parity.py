"""Forward/backward parity of a ctitan session against HF Qwen3ForCausalLM (eager, fp32)."""
import math

import numpy as np
import pytest
import torch

import oracle
from conftest import hf_session_args

TOL = 1e-4

# (id, tiny_config kwargs, T). Together: head_dim != hidden/heads, GQA, MQA, MHA, tied,
# untied, rope_theta 1e4 / 1e6 / 5e6, 1 to 3 layers, T < seq_len.
CONFIGS = [
    ("gqa_hd16_untied_theta1e4_L2",
     dict(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16, rope_theta=1e4, tied=False), 16),
    ("mha_tied_theta1e6_L1",
     dict(vocab=200, hidden=48, inter=40, layers=1, heads=4, kv_heads=4, head_dim=12, rope_theta=1e6, tied=True), 16),
    ("gqa4_untied_theta5e6_L3",
     dict(vocab=320, hidden=64, inter=96, layers=3, heads=8, kv_heads=2, head_dim=8, rope_theta=5e6, tied=False), 13),
    ("mqa_hd8_tied_theta1e4_L2",
     dict(vocab=512, hidden=32, inter=48, layers=2, heads=8, kv_heads=1, head_dim=8, rope_theta=1e4, tied=True), 16),
    # head_dim 64 takes the register-blocked attention (hd % 64 == 0); T = 70 crosses its
    # 32-query and 64-key tiles and leaves partial 4-row micro-blocks
    ("gqa_hd64_tied_theta1e6_L2_T70",
     dict(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=64, rope_theta=1e6, tied=True), 70),
]


def make_batch(vocab, B, T, seed, n_ignore=5):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(B, T)).astype(np.int64)
    labels = rng.integers(0, vocab, size=(B, T)).astype(np.int64)
    flat = labels.reshape(-1)
    flat[rng.choice(B * T, size=n_ignore, replace=False)] = oracle.IGNORE
    return tokens, labels


@pytest.mark.parametrize("cid,kw,T", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_logits_loss_grads(cid, kw, T, tmp_path, open_session):
    cfg = oracle.tiny_config(**kw)
    hf_dir = tmp_path / "hf"
    model = oracle.save_random_hf(hf_dir, cfg, seed=11)
    B = 2
    tokens, labels = make_batch(cfg.vocab_size, B, T, seed=5)

    ref_loss, ref_logits, ref_grads = oracle.hf_loss_and_grads(model, tokens, labels)

    s = open_session(hf_session_args(hf_dir, batch=B, seq_len=max(16, T)))
    assert s.vocab_size == cfg.vocab_size
    # Same tensors, same names and shapes as HF (tied: no lm_head.weight).
    expected = oracle.expected_tensor_names(model)
    assert set(s.names()) == expected
    sd = model.state_dict()
    for n in expected:
        assert s.shapes[n] == tuple(sd[n].shape), n
        # The loaded weights are exactly the saved fp32 weights.
        assert np.array_equal(s.get_param(n), sd[n].numpy()), f"{n} loaded != saved"

    logits = s.logits(tokens)
    err = oracle.rel_err(logits, ref_logits)
    assert err <= TOL, f"logits rel err {err:.3g}"

    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss_sum = s.forward_backward(tokens, labels, nv)
    loss = loss_sum / nv
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"loss {loss} vs HF {ref_loss}"

    bad = []
    for n in expected:
        g = s.get_grad(n)
        e = oracle.rel_err(g, ref_grads[n])
        if not e <= TOL:
            bad.append(f"{n}: rel err {e:.3g}")
    assert not bad, "gradients differ from torch autograd:\n" + "\n".join(bad)


@pytest.mark.parametrize("tied,rows", [(False, 5), (True, 5), (False, 16)])
def test_logits_in_chunks(tied, rows, tmp_path, open_session):
    """The fused lm_head + loss over blocks of `rows` logits rows (training.logits_chunk_rows;
    2 x 16 rows: 7 blocks and a last one of 2, or 2 whole ones) gives HF's loss and every
    gradient, lm_head's (or the tied embedding's) summed over the blocks."""
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             tied=tied)
    hf_dir = tmp_path / "hf"
    model = oracle.save_random_hf(hf_dir, cfg, seed=6)
    tokens, labels = make_batch(cfg.vocab_size, 2, 16, seed=9)
    ref_loss, ref_logits, ref_grads = oracle.hf_loss_and_grads(model, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=16, extra=[f"--training.logits_chunk_rows={rows}"]))
    assert oracle.rel_err(s.logits(tokens), ref_logits) <= TOL
    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"loss {loss} vs HF {ref_loss}"
    bad = [f"{n}: rel err {e:.3g}" for n in oracle.expected_tensor_names(model)
           if not (e := oracle.rel_err(s.get_grad(n), ref_grads[n])) <= TOL]
    assert not bad, "gradients differ from torch autograd:\n" + "\n".join(bad)


def test_grad_accumulation(tmp_path, open_session):
    """Two micro-batches with the step's total valid count give the gradient of the whole
    batch's mean; zero_grad resets."""
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    hf_dir = tmp_path / "hf"
    model = oracle.save_random_hf(hf_dir, cfg, seed=4)
    tokens, labels = make_batch(cfg.vocab_size, 4, 16, seed=8, n_ignore=9)
    ref_loss, _, ref_grads = oracle.hf_loss_and_grads(model, tokens, labels)

    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=16))
    nv = oracle.n_valid(labels)
    for _ in range(2):  # the second round checks that zero_grad really zeroes
        s.zero_grad()
        l0 = s.forward_backward(tokens[:2], labels[:2], nv)
        l1 = s.forward_backward(tokens[2:], labels[2:], nv)
        loss = (l0 + l1) / nv
        assert abs(loss - ref_loss) <= TOL * ref_loss, f"{loss} vs {ref_loss}"
        for n in oracle.expected_tensor_names(model):
            e = oracle.rel_err(s.get_grad(n), ref_grads[n])
            assert e <= TOL, f"{n}: rel err {e:.3g}"
    # zero_grad leaves exact zeros.
    s.zero_grad()
    for n in s.names():
        assert not np.any(s.get_grad(n)), n


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_set_get_param_roundtrip(tied, tmp_path, open_session):
    """set_param/get_param are exact, and the values set are the ones the model computes
    with (logits equal HF's with the same new weights)."""
    cfg = oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=1e4, tied=tied)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=1)
    other = oracle.build_model(cfg, seed=2)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=16))
    new = {n: p.detach().numpy().copy() for n, p in oracle.param_dict(other).items()}
    assert set(s.names()) == oracle.expected_tensor_names(other)
    for n in s.names():
        s.set_param(n, new[n])
    for n in s.names():
        assert np.array_equal(s.get_param(n), new[n]), f"{n} round trip"
    tokens, _ = make_batch(cfg.vocab_size, 2, 16, seed=3)
    err = oracle.rel_err(s.logits(tokens), oracle.hf_logits(other, tokens))
    assert err <= TOL, f"logits after set_param: rel err {err:.3g}"


def test_random_init(tmp_path, open_session):
    """No initial_load_path: N(0, 0.02) matrices, ones for norms, deterministic from the
    seed; the loss on random tokens is then close to ln(vocab)."""
    cfg = oracle.tiny_config(vocab=512, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    cfg.save_pretrained(str(hf_dir))  # config.json only
    a = open_session(hf_session_args(hf_dir, load=False, seed=7))
    b = open_session(hf_session_args(hf_dir, load=False, seed=7))
    c = open_session(hf_session_args(hf_dir, load=False, seed=8))
    ref_names = oracle.expected_tensor_names(oracle.build_model(cfg))
    assert set(a.names()) == ref_names
    differs = False
    for n in a.names():
        pa = a.get_param(n)
        assert np.array_equal(pa, b.get_param(n)), f"{n}: same seed, different init"
        differs |= not np.array_equal(pa, c.get_param(n))
        if pa.ndim == 1:
            assert np.all(pa == 1.0), f"{n}: norm weights must start at 1"
        else:
            k = 5.0 / math.sqrt(pa.size)  # 5 standard errors
            assert abs(float(pa.mean())) < 0.02 * k, f"{n}: mean {pa.mean()}"
            assert abs(float(pa.std()) / 0.02 - 1) < k, f"{n}: std {pa.std()} (want 0.02)"
    assert differs, "seeds 7 and 8 gave identical weights"

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 16))
    labels = rng.integers(0, cfg.vocab_size, size=(2, 16))
    a.zero_grad()
    loss = a.forward_backward(tokens, labels, labels.size) / labels.size
    lnv = math.log(cfg.vocab_size)
    assert abs(loss - lnv) < 0.02 * lnv, f"random-init loss {loss} vs ln(V) {lnv}"
    # And it is the loss HF computes with ctitan's random weights (set into an HF model).
    m = oracle.build_model(cfg)
    with torch.no_grad():
        for n, p in oracle.param_dict(m).items():
            p.copy_(torch.from_numpy(a.get_param(n)))
    ref = oracle.hf_loss(m, tokens, labels)
    assert abs(loss - ref) <= TOL * ref


AC_MODES = [
    ("full", ["--activation_checkpoint.mode=full"]),
    ("selective_every2", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"]),
    ("selective_every1", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=1"]),
    ("selective_op", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]),
]


def test_activation_checkpointing_bitwise(tmp_path, open_session):
    """Activation checkpointing only reruns the forward's own deterministic kernels: loss
    and every gradient are bit-identical to mode none, and so match HF to TOL too. Two
    micro-batches: the second backward must not reuse the first one's recomputed scratch."""
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=4, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=1e4, tied=False)
    hf_dir = tmp_path / "hf"
    model = oracle.save_random_hf(hf_dir, cfg, seed=21)
    tokens, labels = make_batch(cfg.vocab_size, 4, 70, seed=6, n_ignore=9)  # T=70: several attention tiles
    ref_loss, _, ref_grads = oracle.hf_loss_and_grads(model, tokens, labels)
    nv = oracle.n_valid(labels)

    def run(extra):
        s = open_session(hf_session_args(hf_dir, batch=2, seq_len=70, extra=extra))
        s.zero_grad()
        loss = s.forward_backward(tokens[:2], labels[:2], nv) + s.forward_backward(tokens[2:], labels[2:], nv)
        return loss, {n: s.get_grad(n) for n in s.names()}

    base_loss, base = run([])
    assert abs(base_loss / nv - ref_loss) <= TOL * ref_loss
    for n, g in base.items():
        e = oracle.rel_err(g, ref_grads[n])
        assert e <= TOL, f"mode none {n}: rel err {e:.3g}"
    for name, extra in AC_MODES:
        loss, grads = run(extra)
        assert loss == base_loss, f"{name}: loss {loss!r} vs {base_loss!r}"
        bad = [n for n in base if not np.array_equal(grads[n], base[n])]
        assert not bad, f"{name}: gradients not bit-identical to mode none: {bad}"
        for n, g in grads.items():
            e = oracle.rel_err(g, ref_grads[n])
            assert e <= TOL, f"{name} {n}: rel err {e:.3g}"


@pytest.mark.parametrize("extra,key", [
    (["--activation_checkpoint.mode=partial"], "activation_checkpoint.mode"),
    (["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=0"],
     "selective_ac_option"),
    (["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2x"],
     "selective_ac_option"),
])
def test_activation_checkpointing_bad_config(tmp_path, open_session, extra, key):
    cfg = oracle.tiny_config(vocab=64, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    cfg.save_pretrained(str(hf_dir))
    with pytest.raises(Exception, match=key):
        open_session(hf_session_args(hf_dir, load=False, extra=extra))
