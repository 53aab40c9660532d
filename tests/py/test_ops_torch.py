"""tests/py/test_ops_torch.py: kernels/ref against torch, the independent oracle.

The reference ops are compiled straight from src/kernels/ref/*.c and
src/core/*.c into a throwaway shared library (so this test does not depend on
the rest of the tree building) and called through ctypes. Each op's forward
and backward is compared with torch fp32 autograd written the way HF writes
the model (rotate_half RoPE with HF's inv_freq, explicit causal softmax
attention with repeat_interleave for GQA, ...). Backward buffers start from
random values so the += contract is checked at the same time.
Tolerance: 1e-5 of the largest magnitude in the reference tensor.
"""
import ctypes
import glob
import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BLAS_INC = "/usr/include/x86_64-linux-gnu/openblas-openmp"
BLAS_LIB = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
TOL = 1e-5

F32P = ctypes.POINTER(ctypes.c_float)
I32P = ctypes.POINTER(ctypes.c_int32)
c_int, c_long, c_float = ctypes.c_int, ctypes.c_long, ctypes.c_float


class AttnOpt(ctypes.Structure):
    """kernels/ops.h's kern_attn_opt: what a model family changes in attention, every field
    (the C side reads bf16 too: a struct that stopped before it let the kernels read past it)."""
    _fields_ = [("scale", c_float), ("window", c_int), ("softcap", c_float), ("bf16", c_int)]


OPTP = ctypes.POINTER(AttnOpt)

SIGNATURES = {
    "op_matmul_fwd": (None, [F32P, F32P, F32P, c_int, c_int, c_int, c_int]),
    "op_matmul_bwd": (None, [F32P, F32P, F32P, F32P, F32P, c_int, c_int, c_int, c_int]),
    "op_embedding_fwd": (None, [F32P, I32P, F32P, c_int, c_int]),
    "op_embedding_bwd": (None, [F32P, F32P, I32P, c_int, c_int]),
    "op_rmsnorm_fwd": (None, [F32P, F32P, F32P, F32P, c_int, c_int, c_float]),
    "op_rmsnorm_bwd": (None, [F32P, F32P, F32P, F32P, F32P, F32P, c_int, c_int]),
    "op_rope_fwd": (None, [F32P, F32P, F32P, F32P, c_int, c_int, c_int, c_int, c_int]),
    "op_rope_bwd": (None, [F32P, F32P, F32P, F32P, c_int, c_int, c_int, c_int, c_int]),
    "op_rope_tables": (None, [F32P, F32P, c_int, c_int, c_float]),
    "op_attention_fwd": (None, [F32P, F32P, F32P, F32P, F32P] + [c_int] * 5 + [OPTP]),
    "op_attention_bwd": (None, [F32P] * 9 + [c_int] * 5 + [OPTP, c_int]),
    "op_attention_fwd_tiled": (None, [F32P, F32P, F32P, F32P, F32P] + [c_int] * 5 + [OPTP]),
    "op_attention_bwd_tiled": (None, [F32P] * 9 + [c_int] * 5 + [OPTP, c_int]),
    "op_attention_fwd_tiled_avx512": (None, [F32P, F32P, F32P, F32P, F32P] + [c_int] * 5 + [OPTP]),
    "op_attention_bwd_tiled_avx512": (None, [F32P] * 9 + [c_int] * 5 + [OPTP, c_int]),
    "op_swiglu_fwd": (None, [F32P, F32P, F32P, c_int]),
    "op_swiglu_bwd": (None, [F32P, F32P, F32P, F32P, F32P, c_int, c_int]),
    "op_geglu_fwd": (None, [F32P, F32P, F32P, c_int]),
    "op_geglu_bwd": (None, [F32P, F32P, F32P, F32P, F32P, c_int, c_int]),
    "op_crossentropy_fwdbwd": (ctypes.c_double, [F32P, I32P, c_int, c_int, c_float, ctypes.POINTER(c_long)]),
    "op_crossentropy_fwd": (ctypes.c_double, [F32P, F32P, I32P, c_int, c_int]),
    "op_add": (None, [F32P, F32P, F32P, c_long]),
}


@pytest.fixture(scope="session")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("opsref") / "libopsref.so"
    srcs = sorted(glob.glob(os.path.join(ROOT, "src/kernels/ref/*.c")) + glob.glob(os.path.join(ROOT, "src/core/*.c")))
    cmd = ["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-fopenmp", "-D_GNU_SOURCE",
           "-I" + os.path.join(ROOT, "src"), "-I" + BLAS_INC, *srcs, "-o", str(out),
           "-L" + BLAS_LIB, "-Wl,-rpath," + BLAS_LIB, "-lopenblas", "-lm"]
    subprocess.run(cmd, check=True)
    so = ctypes.CDLL(str(out))
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = res, args
    return so


def P(a):
    """ctypes pointer to a contiguous numpy array (float32 or int32); None passes NULL."""
    if a is None:
        return None
    assert a.flags["C_CONTIGUOUS"]
    return a.ctypes.data_as(I32P if a.dtype == np.int32 else F32P)


def randn(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale)


def np32(t):
    return np.ascontiguousarray(t.detach().numpy().astype(np.float32))


def assert_close(got, want, what):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    got = np.asarray(got, dtype=np.float64)
    ref = max(float(np.abs(want).max()) if want.size else 0.0, 1e-30)
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    assert err <= TOL * ref, f"{what}: max err {err:.3g} vs max |ref| {ref:.3g} (rel {err / ref:.3g})"


def backward(out, inputs, gen):
    """Gradients of sum(out * g) w.r.t. inputs for a random upstream g."""
    g = randn(gen, *out.shape)
    grads = torch.autograd.grad(out, inputs, grad_outputs=g)
    return g, grads


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("M,K,N", [(5, 3, 7), (1, 3, 7), (33, 64, 17), (64, 48, 80)])
def test_matmul(lib, gen, M, K, N):
    x = randn(gen, M, K).requires_grad_()
    w = randn(gen, N, K).requires_grad_()
    out_t = x @ w.T
    out = np.zeros((M, N), np.float32)
    lib.op_matmul_fwd(P(out), P(np32(x)), P(np32(w)), M, K, N, 0)
    assert_close(out, out_t, "matmul fwd")
    acc = np32(randn(gen, M, N))
    acc0 = acc.copy()
    lib.op_matmul_fwd(P(acc), P(np32(x)), P(np32(w)), M, K, N, 1)
    assert_close(acc - acc0, out_t, "matmul fwd accumulate")

    g, (dx_t, dw_t) = backward(out_t, (x, w), gen)
    dx0, dw0 = np32(randn(gen, M, K)), np32(randn(gen, N, K))
    dx, dw = dx0.copy(), dw0.copy()
    lib.op_matmul_bwd(P(dx), P(dw), P(np32(g)), P(np32(x)), P(np32(w)), M, K, N, 1)
    assert_close(dx - dx0, dx_t, "matmul dinp")
    assert_close(dw - dw0, dw_t, "matmul dw")
    # accumulate 0: d(input) overwritten (its NaNs never read), dw still added to
    dx = np.full((M, K), np.nan, np.float32)
    dw = dw0.copy()
    lib.op_matmul_bwd(P(dx), P(dw), P(np32(g)), P(np32(x)), P(np32(w)), M, K, N, 0)
    assert_close(dx, dx_t, "matmul dinp overwritten")
    assert_close(dw - dw0, dw_t, "matmul dw (dinp overwritten)")


# ------------------------------------------------------------------------- embedding

def test_embedding(lib, gen):
    V, N, C = 11, 20, 7
    wte = randn(gen, V, C).requires_grad_()
    tok = torch.randint(0, V, (N,), generator=gen)
    tok[:4] = 3  # repeats
    out_t = F.embedding(tok, wte)
    tok32 = tok.numpy().astype(np.int32)
    out = np.zeros((N, C), np.float32)
    lib.op_embedding_fwd(P(out), P(tok32), P(np32(wte)), N, C)
    assert_close(out, out_t, "embedding fwd")
    g, (dw_t,) = backward(out_t, (wte,), gen)
    d0 = np32(randn(gen, V, C))
    d = d0.copy()
    lib.op_embedding_bwd(P(d), P(np32(g)), P(tok32), N, C)
    assert_close(d - d0, dw_t, "embedding dwte")


# --------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("N,C", [(6, 7), (1, 128), (9, 130)])
def test_rmsnorm(lib, gen, N, C):
    eps = 1e-6
    x = randn(gen, N, C, scale=3.0)
    # rows whose mean square is near eps, and a zero row (rstd = 1/sqrt(eps)): at scale 3
    # alone eps is 1e-7 of a row's mean square, below the tolerance, and a norm that lost
    # it went unnoticed (a mutation audit); a zero row without it is inf
    x[::3] *= 1e-3
    x[N // 2] = 0.0
    x.requires_grad_()
    w = randn(gen, C).requires_grad_()
    out_t = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    out, rstd = np.zeros((N, C), np.float32), np.zeros(N, np.float32)
    lib.op_rmsnorm_fwd(P(out), P(rstd), P(np32(x)), P(np32(w)), N, C, eps)
    assert_close(out, out_t, "rmsnorm fwd")
    assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1) + eps), "rmsnorm rstd")
    g, (dx_t, dw_t) = backward(out_t, (x, w), gen)
    dx0, dw0 = np32(randn(gen, N, C)), np32(randn(gen, C))
    dx, dw = dx0.copy(), dw0.copy()
    lib.op_rmsnorm_bwd(P(dx), P(dw), P(np32(g)), P(np32(x)), P(np32(w)), P(rstd), N, C)
    assert_close(dx - dx0, dx_t, "rmsnorm dinp")
    assert_close(dw - dw0, dw_t, "rmsnorm dw")


# ------------------------------------------------------------------------------ rope

def hf_cos_sin(T, hd, theta):
    """HF's default RoPE init and forward, all fp32: cos/sin of shape [T, hd]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(dtype=torch.float) / hd))
    pos = torch.arange(T, dtype=torch.int64)[None, :].float()
    freqs = (inv_freq[None, :, None].float() @ pos[:, None, :]).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("T,hd,theta", [(16, 128, 1e6), (37, 6, 10000.0), (512, 128, 5e6)])
def test_rope_tables(lib, T, hd, theta):
    cos_t, sin_t = hf_cos_sin(T, hd, theta)
    cos, sin = np.zeros((T, hd // 2), np.float32), np.zeros((T, hd // 2), np.float32)
    lib.op_rope_tables(P(cos), P(sin), T, hd, theta)
    assert_close(cos, cos_t[:, : hd // 2], "rope cos")
    assert_close(sin, sin_t[:, : hd // 2], "rope sin")
    # HF duplicates the angles for the second half
    assert torch.equal(cos_t[:, : hd // 2], cos_t[:, hd // 2:])


# rd < hd: partial_rotary_factor as transformers' Phi3 applies it (rotate q[..., :rd], the
# rest passes through), with the tables over rd.
@pytest.mark.parametrize("B,T,nh,hd,rd", [(2, 5, 3, 6, 6), (1, 1, 2, 8, 8), (2, 9, 4, 128, 128),
                                          (2, 5, 3, 8, 4), (1, 7, 2, 128, 96)])
def test_rope(lib, gen, B, T, nh, hd, rd):
    theta = 1e6
    cos_t, sin_t = hf_cos_sin(T, rd, theta)
    x = randn(gen, B, T, nh, hd).requires_grad_()
    # HF: [B, nh, T, hd] with cos unsqueezed on the head axis; here heads sit after T.
    xr = x[..., :rd]
    out_t = torch.cat([xr * cos_t[None, :, None, :] + rotate_half(xr) * sin_t[None, :, None, :], x[..., rd:]], -1)
    cos, sin = np.zeros((T, rd // 2), np.float32), np.zeros((T, rd // 2), np.float32)
    lib.op_rope_tables(P(cos), P(sin), T, rd, theta)
    out = np.zeros((B, T, nh, hd), np.float32)
    lib.op_rope_fwd(P(out), P(np32(x)), P(cos), P(sin), B, T, nh, hd, rd)
    assert_close(out, out_t, "rope fwd")
    g, (dx_t,) = backward(out_t, (x,), gen)
    dx0 = np32(randn(gen, B, T, nh, hd))
    dx = dx0.copy()
    lib.op_rope_bwd(P(dx), P(np32(g)), P(cos), P(sin), B, T, nh, hd, rd)
    assert_close(dx - dx0, dx_t, "rope dinp")


# ------------------------------------------------------------------------- attention

def torch_attention(q, k, v, scale=None, window=0, softcap=0.0):
    """q [B,Tq,nh,hd] at positions q0 .. q0+Tq-1 (q0 = Tk - Tq; 0 for a whole sequence), k/v
    [B,Tk,nkv,hd] -> out [B,Tq,nh,hd], lse [B,nh,Tq], as HF eager: scores times `scale` (default
    hd^-0.5), then softcap * tanh(scores / softcap) (gemma), then the causal mask and, with a
    window, transformers' sliding_window_overlay (keep kv_idx > q_idx - window), both by
    position (no query rows for the first q0 positions: the kernels' query-offset form)."""
    B, Tq, nh, hd = q.shape
    Tk, nkv = k.shape[1], k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kh = kh.repeat_interleave(nh // nkv, dim=1)
    vh = vh.repeat_interleave(nh // nkv, dim=1)
    scores = torch.matmul(qh, kh.transpose(2, 3)) * (hd ** -0.5 if scale is None else scale)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos, kv_idx = torch.arange(Tk - Tq, Tk)[:, None], torch.arange(Tk)[None, :]
    visible = kv_idx <= q_pos
    if window > 0:
        visible &= kv_idx > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs, vh).transpose(1, 2), torch.logsumexp(scores, dim=-1)


def _has_avx512():
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


@pytest.mark.parametrize("B,T,nh,nkv,hd", [
    (2, 7, 4, 2, 6),     # nh/nkv = 2
    (1, 5, 3, 3, 6),     # nh/nkv = 1
    (1, 6, 4, 1, 8),     # MQA
    (2, 1, 2, 1, 6),     # T = 1
    (1, 33, 4, 2, 128),  # real head_dim
    (2, 150, 4, 2, 16),  # several 32 x 64 tiles of the tiled kernel, partial last ones
])
@pytest.mark.parametrize("impl", ["", "_tiled", "_tiled_avx512"])
def test_attention(lib, gen, impl, B, T, nh, nkv, hd):
    if impl == "_tiled_avx512" and not _has_avx512():
        pytest.skip("no AVX-512")
    q = randn(gen, B, T, nh, hd).requires_grad_()
    k = randn(gen, B, T, nkv, hd).requires_grad_()
    v = randn(gen, B, T, nkv, hd).requires_grad_()
    fwd, bwd = getattr(lib, "op_attention_fwd" + impl), getattr(lib, "op_attention_bwd" + impl)
    out_t, lse_t = torch_attention(q, k, v)
    out, lse = np.zeros((B, T, nh, hd), np.float32), np.zeros((B, nh, T), np.float32)
    fwd(P(out), P(lse), P(np32(q)), P(np32(k)), P(np32(v)), B, T, nh, nkv, hd, None)
    assert_close(out, out_t, "attention fwd")
    assert_close(lse, lse_t, "attention lse")
    g, (dq_t, dk_t, dv_t) = backward(out_t, (q, k, v), gen)
    dq0, dk0, dv0 = np32(randn(gen, *q.shape)), np32(randn(gen, *k.shape)), np32(randn(gen, *v.shape))
    dq, dk, dv = dq0.copy(), dk0.copy(), dv0.copy()
    bwd(P(dq), P(dk), P(dv), P(np32(g)), P(out), P(lse), P(np32(q)), P(np32(k)), P(np32(v)), B, T, nh, nkv, hd, None, 1)
    assert_close(dq - dq0, dq_t, "attention dq")
    assert_close(dk - dk0, dk_t, "attention dk")
    assert_close(dv - dv0, dv_t, "attention dv")
    # acc 0: the gradients overwrite what the buffers held (NaN here)
    dq, dk, dv = np.full_like(dq0, np.nan), np.full_like(dk0, np.nan), np.full_like(dv0, np.nan)
    bwd(P(dq), P(dk), P(dv), P(np32(g)), P(out), P(lse), P(np32(q)), P(np32(k)), P(np32(v)), B, T, nh, nkv, hd, None, 0)
    assert_close(dq, dq_t, "attention dq (acc 0)")
    assert_close(dk, dk_t, "attention dk (acc 0)")
    assert_close(dv, dv_t, "attention dv (acc 0)")


# The families' variants (kern_attn_opt): (scale, window, softcap); scale 0 is the default 1/sqrt(hd).
ATTN_OPTS = [
    (0.0, 1, 0.0),      # each query sees itself only
    (0.0, 5, 0.0),      # a window inside one key tile
    (0.0, 37, 0.0),     # not a multiple of the 32 x 64 tiles: partial tiles, whole tiles skipped
    (0.0, 64, 0.0),
    (0.0, 1000, 0.0),   # wider than T: plain causal
    (0.3, 0, 0.0),      # Gemma's query_pre_attn_scalar instead of head_dim
    (0.0, 0, 2.0),      # a cap that bites (scores reach ~10 here)
    (0.0, 0, 50.0),     # Gemma 2's attention cap
    (0.25, 7, 5.0),     # all three
    (1.0, 70, 3.0),
]


@pytest.mark.parametrize("scale,window,softcap", ATTN_OPTS)
@pytest.mark.parametrize("B,T,nh,nkv,hd", [
    (2, 9, 4, 2, 6),
    (1, 150, 4, 2, 16),  # several tiles, partial last ones
    (1, 70, 2, 1, 64),
])
@pytest.mark.parametrize("impl", ["", "_tiled", "_tiled_avx512"])
def test_attention_options(lib, gen, impl, B, T, nh, nkv, hd, scale, window, softcap):
    if impl == "_tiled_avx512" and not _has_avx512():
        pytest.skip("no AVX-512")
    q = randn(gen, B, T, nh, hd, scale=1.5).requires_grad_()
    k = randn(gen, B, T, nkv, hd, scale=1.5).requires_grad_()
    v = randn(gen, B, T, nkv, hd).requires_grad_()
    fwd, bwd = getattr(lib, "op_attention_fwd" + impl), getattr(lib, "op_attention_bwd" + impl)
    out_t, lse_t = torch_attention(q, k, v, scale=scale or None, window=window, softcap=softcap)
    opt = ctypes.byref(AttnOpt(scale, window, softcap))
    out, lse = np.zeros((B, T, nh, hd), np.float32), np.zeros((B, nh, T), np.float32)
    fwd(P(out), P(lse), P(np32(q)), P(np32(k)), P(np32(v)), B, T, nh, nkv, hd, opt)
    what = f"attention scale={scale} window={window} softcap={softcap}"
    assert_close(out, out_t, what + " fwd")
    assert_close(lse, lse_t, what + " lse")
    g, (dq_t, dk_t, dv_t) = backward(out_t, (q, k, v), gen)
    dq0, dk0, dv0 = np32(randn(gen, *q.shape)), np32(randn(gen, *k.shape)), np32(randn(gen, *v.shape))
    dq, dk, dv = dq0.copy(), dk0.copy(), dv0.copy()
    bwd(P(dq), P(dk), P(dv), P(np32(g)), P(out), P(lse), P(np32(q)), P(np32(k)), P(np32(v)), B, T, nh, nkv, hd, opt, 1)
    # (window 1: no gradient reaches q and k, a softmax over one key; both sides give exact zeros)
    assert_close(dq - dq0, dq_t, what + " dq")
    assert_close(dk - dk0, dk_t, what + " dk")
    assert_close(dv - dv0, dv_t, what + " dv")


# ---------------------------------------------------------------------------- swiglu

def test_swiglu(lib, gen):
    N = 257
    gate = randn(gen, N, scale=4.0)
    gate[:3] = torch.tensor([30.0, -30.0, -100.0])
    gate.requires_grad_()
    up = randn(gen, N).requires_grad_()
    out_t = F.silu(gate) * up
    out = np.zeros(N, np.float32)
    lib.op_swiglu_fwd(P(out), P(np32(gate)), P(np32(up)), N)
    assert_close(out, out_t, "swiglu fwd")
    g, (dg_t, du_t) = backward(out_t, (gate, up), gen)
    dg0, du0 = np32(randn(gen, N)), np32(randn(gen, N))
    dg, du = dg0.copy(), du0.copy()
    lib.op_swiglu_bwd(P(dg), P(du), P(np32(g)), P(np32(gate)), P(np32(up)), N, 1)
    assert_close(dg - dg0, dg_t, "swiglu dgate")
    assert_close(du - du0, du_t, "swiglu dup")
    dg, du = np.full_like(dg0, np.nan), np.full_like(du0, np.nan)  # acc 0: overwritten
    lib.op_swiglu_bwd(P(dg), P(du), P(np32(g)), P(np32(gate)), P(np32(up)), N, 0)
    assert_close(dg, dg_t, "swiglu dgate (acc 0)")
    assert_close(du, du_t, "swiglu dup (acc 0)")


# ----------------------------------------------------------------------------- geglu

def test_geglu(lib, gen):
    N = 1001
    gate = randn(gen, N, scale=4.0)
    gate[:5] = torch.tensor([30.0, -30.0, -100.0, 0.0, -3.0])
    gate.requires_grad_()
    up = randn(gen, N).requires_grad_()
    out_t = F.gelu(gate, approximate="tanh") * up  # transformers' gelu_pytorch_tanh (Gemma)
    out = np.zeros(N, np.float32)
    lib.op_geglu_fwd(P(out), P(np32(gate)), P(np32(up)), N)
    assert_close(out, out_t, "geglu fwd")
    g, (dg_t, du_t) = backward(out_t, (gate, up), gen)
    dg0, du0 = np32(randn(gen, N)), np32(randn(gen, N))
    dg, du = dg0.copy(), du0.copy()
    lib.op_geglu_bwd(P(dg), P(du), P(np32(g)), P(np32(gate)), P(np32(up)), N, 1)
    assert_close(dg - dg0, dg_t, "geglu dgate")
    assert_close(du - du0, du_t, "geglu dup")
    dg, du = np.full_like(dg0, np.nan), np.full_like(du0, np.nan)  # acc 0: overwritten
    lib.op_geglu_bwd(P(dg), P(du), P(np32(g)), P(np32(gate)), P(np32(up)), N, 0)
    assert_close(dg, dg_t, "geglu dgate (acc 0)")
    assert_close(du, du_t, "geglu dup (acc 0)")


# --------------------------------------------------------------------- cross entropy

@pytest.mark.parametrize("N,V,grad_scale", [(9, 13, 0.125), (4, 1000, 1.0), (3, 5, 2.0)])
def test_crossentropy(lib, gen, N, V, grad_scale):
    logits = randn(gen, N, V, scale=3.0)
    logits[0, 0] = 90.0  # large logit: needs max subtraction
    logits.requires_grad_()
    tgt = torch.randint(0, V, (N,), generator=gen)
    tgt[1] = -100
    if N > 5:
        tgt[N - 1] = -100
    valid = int((tgt != -100).sum())
    loss_t = F.cross_entropy(logits, tgt, ignore_index=-100, reduction="sum")
    (dl_t,) = torch.autograd.grad(loss_t * grad_scale, (logits,))
    rows_t = F.cross_entropy(logits, tgt, ignore_index=-100, reduction="none")
    tgt32 = tgt.numpy().astype(np.int32)

    losses = np.zeros(N, np.float32)
    s = lib.op_crossentropy_fwd(P(losses), P(np32(logits)), P(tgt32), N, V)
    assert_close(losses, rows_t, "ce per-row losses")
    assert abs(s - loss_t.item()) <= TOL * max(abs(loss_t.item()), 1.0)

    buf = np32(logits)
    nv = c_long(5)
    s2 = lib.op_crossentropy_fwdbwd(P(buf), P(tgt32), N, V, grad_scale, ctypes.byref(nv))
    assert abs(s2 - loss_t.item()) <= TOL * max(abs(loss_t.item()), 1.0)
    assert nv.value == 5 + valid
    assert_close(buf, dl_t, "ce dlogits")
    assert not buf[1].any(), "ignored row must be zero"


def test_add(lib, gen):
    N = 1001
    a, b = np32(randn(gen, N)), np32(randn(gen, N))
    out = np.zeros(N, np.float32)
    lib.op_add(P(out), P(a), P(b), N)
    np.testing.assert_array_equal(out, a + b)


# ------------------------------------------------------ attention with a query offset

Q0_FWD = [F32P] * 5 + [c_int] * 6 + [ctypes.POINTER(AttnOpt)]
Q0_BWD = [F32P] * 9 + [c_int] * 6 + [ctypes.POINTER(AttnOpt), c_int]


@pytest.mark.parametrize("scale,window,softcap", [(0.0, 0, 0.0), (0.0, 5, 0.0), (0.0, 37, 0.0), (0.25, 7, 5.0)])
@pytest.mark.parametrize("B,Tk,Tq,nh,nkv,hd", [
    (2, 16, 8, 4, 2, 6),      # context parallel 2's second chunk
    (1, 16, 4, 4, 2, 6),      # headtail's piece 2 of 4 (positions 4..7) is Tk 8; this: the last of 4
    (2, 9, 1, 4, 2, 6),       # the last row alone
    (1, 70, 70, 2, 1, 64),    # q0 = 0: the whole sequence
    (1, 150, 37, 4, 2, 16),   # q0 = 113: inside a tile, several key tiles before it
    (1, 96, 24, 4, 1, 8),     # MQA, q0 = 72
])
@pytest.mark.parametrize("impl", ["", "_tiled", "_tiled_avx512"])
def test_attention_query_offset(lib, gen, impl, B, Tk, Tq, nh, nkv, hd, scale, window, softcap):
    """op_attention_fwd_q0 / _bwd_q0 (kernels/ops.h): the last Tq of Tk positions' attention,
    forward, lse and the three gradients (dk, dv of every key position, acc 1 and 0), against
    torch's softmax over the same keys with the causal mask and window by position."""
    if impl == "_tiled_avx512" and not _has_avx512():
        pytest.skip("no AVX-512")
    name = "op_attention_%s_q0" + impl
    fwd, bwd = getattr(lib, name % "fwd"), getattr(lib, name % "bwd")
    fwd.restype, fwd.argtypes, bwd.restype, bwd.argtypes = None, Q0_FWD, None, Q0_BWD
    q = randn(gen, B, Tq, nh, hd, scale=1.5).requires_grad_()
    k = randn(gen, B, Tk, nkv, hd, scale=1.5).requires_grad_()
    v = randn(gen, B, Tk, nkv, hd).requires_grad_()
    out_t, lse_t = torch_attention(q, k, v, scale=scale or None, window=window, softcap=softcap)
    opt = ctypes.byref(AttnOpt(scale, window, softcap, 0))
    out, lse = np.full((B, Tq, nh, hd), np.nan, np.float32), np.full((B, nh, Tq), np.nan, np.float32)
    fwd(P(out), P(lse), P(np32(q)), P(np32(k)), P(np32(v)), B, Tq, Tk, nh, nkv, hd, opt)
    what = f"attention q0={Tk - Tq} scale={scale} window={window} softcap={softcap}"
    assert_close(out, out_t, what + " fwd")
    assert_close(lse, lse_t, what + " lse")
    g, (dq_t, dk_t, dv_t) = backward(out_t, (q, k, v), gen)
    dq0, dk0, dv0 = np32(randn(gen, *q.shape)), np32(randn(gen, *k.shape)), np32(randn(gen, *v.shape))
    dq, dk, dv = dq0.copy(), dk0.copy(), dv0.copy()
    args = (P(np32(g)), P(out), P(lse), P(np32(q)), P(np32(k)), P(np32(v)), B, Tq, Tk, nh, nkv, hd, opt)
    bwd(P(dq), P(dk), P(dv), *args, 1)
    assert_close(dq - dq0, dq_t, what + " dq")
    assert_close(dk - dk0, dk_t, what + " dk")
    assert_close(dv - dv0, dv_t, what + " dv")
    dq, dk, dv = np.full_like(dq0, np.nan), np.full_like(dk0, np.nan), np.full_like(dv0, np.nan)  # acc 0
    bwd(P(dq), P(dk), P(dv), *args, 0)
    assert_close(dq, dq_t, what + " dq (acc 0)")
    assert_close(dk, dk_t, what + " dk (acc 0)")
    assert_close(dv, dv_t, what + " dv (acc 0)")


# ---------------------------------------------------------- attention, block form (ring)

class AttnBlk(ctypes.Structure):
    """kernels/ops.h's kern_attn_blk: the query rows and the key block of one block call."""
    _fields_ = [(n, c_int) for n in ("B", "nh", "nkv", "hd", "Tq", "q0", "ldq", "Tk", "k0", "ldk")]


BLK_SIGS = {
    "op_attention_blk_finish": [F32P, F32P, F32P, ctypes.POINTER(AttnBlk)],
    "op_attention_blk_rowdot": [F32P, F32P, F32P, ctypes.POINTER(AttnBlk)],
}
for _impl in ("", "_tiled", "_tiled_avx512"):
    BLK_SIGS["op_attention_fwd_blk" + _impl] = [F32P] * 6 + [ctypes.POINTER(AttnBlk), OPTP]
    BLK_SIGS["op_attention_bwd_blk" + _impl] = [F32P] * 9 + [ctypes.POINTER(AttnBlk), OPTP]


def _blk_lib(lib):
    for name, args in BLK_SIGS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, args
    return lib


def _cpu_flags():
    try:
        return set(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


# the register-blocked kernels' block forms (kernels/cpu/attention_*.c, in the built libctitan):
# the CPU flags each needs
BLK_BLOCKED = {
    "blocked_avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "blocked_avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "blocked_avx2": ("avx2", "fma"),
}
BLK_IMPLS = ["", "_tiled", "_tiled_avx512", *BLK_BLOCKED]


def _blk_fns(lib, libctitan, impl):
    """The block-form pair of an implementation: the reference library's op_attention_*_blk{impl},
    or a register-blocked kernel's from libctitan (skipped where the CPU lacks its instructions)."""
    if impl in BLK_BLOCKED:
        if not all(f in _cpu_flags() for f in BLK_BLOCKED[impl]):
            pytest.skip(impl + ": not this CPU")
        suffix = impl[len("blocked_"):]
        fns = (getattr(libctitan, "kern_attention_fwd_blk_" + suffix),
               getattr(libctitan, "kern_attention_bwd_blk_" + suffix))
        for fn, n in zip(fns, (6, 9)):
            fn.restype, fn.argtypes = None, [F32P] * n + [ctypes.POINTER(AttnBlk), OPTP]
        return fns
    if impl == "_tiled_avx512" and not _has_avx512():
        pytest.skip("no AVX-512")
    return getattr(lib, "op_attention_fwd_blk" + impl), getattr(lib, "op_attention_bwd_blk" + impl)


def PA(a, elems):
    """ctypes pointer `elems` floats into the contiguous float32 array a (a strided piece used in place)."""
    assert a.flags["C_CONTIGUOUS"] and a.dtype == np.float32
    return ctypes.cast(a.ctypes.data + 4 * elems, F32P)


def _cuts(T, sizes):
    """[(start, length)] covering 0..T-1 with the given lengths (the last takes the rest)."""
    out, p = [], 0
    for s in sizes:
        if p >= T:
            break
        s = min(s, T - p)
        out.append((p, s))
        p += s
    if p < T:
        out.append((p, T - p))
    return out


# (B, T, nh, nkv, hd, query pieces' lengths, key blocks' lengths, (scale, window, softcap))
ATTN_BLK_CASES = [
    (2, 12, 4, 2, 6, [3] * 4, [3] * 4, (0.0, 0, 0.0)),         # ring pieces: diagonal, past, future blocks
    (1, 16, 4, 1, 8, [2, 6, 6, 2], [2, 6, 6, 2], (0.0, 0, 0.0)),  # headtail-like uneven order, MQA
    (2, 13, 3, 3, 6, [5, 8], [4, 4, 5], (0.0, 0, 0.0)),        # blocks cutting across the query pieces' diagonal
    (1, 40, 4, 2, 16, [10] * 4, [10] * 4, (0.0, 6, 0.0)),       # a window: whole blocks left of it skipped
    (1, 40, 4, 2, 16, [7, 13, 20], [9, 11, 20], (0.0, 13, 0.0)),
    (1, 24, 2, 1, 8, [6] * 4, [6] * 4, (0.0, 0, 2.0)),          # a soft cap that bites
    (1, 24, 2, 1, 8, [12, 12], [5, 7, 12], (0.25, 7, 5.0)),     # all three options
    (1, 33, 4, 2, 128, [11] * 3, [11] * 3, (0.0, 0, 0.0)),      # real head_dim
    (1, 300, 4, 2, 16, [150] * 2, [130, 170], (0.0, 0, 0.0)),   # several 32-row, 64-key tiles, partial ones
    (1, 300, 4, 2, 16, [100] * 3, [100] * 3, (0.0, 70, 3.0)),   # tiles across a window and a cap
    # the register-blocked kernels' head dims (64, 128): 70-row pieces (past a query tile, starting
    # inside tiles) in rows T apart, blocks past a 64-key tile, GQA groups of 3
    (1, 280, 6, 2, 64, [70] * 4, [70] * 4, (0.0, 0, 0.0)),
    (2, 210, 6, 2, 128, [70] * 3, [100, 110], (0.0, 90, 0.0)),   # a window across the blocks' edges
    (1, 280, 6, 2, 64, [70] * 4, [130, 150], (0.2, 90, 3.0)),    # and scale with a cap
]


@pytest.mark.parametrize("B,T,nh,nkv,hd,qcuts,kcuts,o", ATTN_BLK_CASES)
@pytest.mark.parametrize("impl", BLK_IMPLS)
def test_attention_blocks(lib, libctitan, gen, impl, B, T, nh, nkv, hd, qcuts, kcuts, o):
    """Each query piece against every key block (in a scrambled order, future blocks
    included), merged by the online softmax and finished, is torch's causal attention of
    those rows over the whole sequence; the blocks' backward sums to torch's gradients."""
    _blk_lib(lib)
    fwd_blk, bwd_blk = _blk_fns(lib, libctitan, impl)
    scale, window, softcap = o
    q = randn(gen, B, T, nh, hd, scale=1.5).requires_grad_()
    k = randn(gen, B, T, nkv, hd, scale=1.5).requires_grad_()
    v = randn(gen, B, T, nkv, hd).requires_grad_()
    out_t, lse_t = torch_attention(q, k, v, scale=scale or None, window=window, softcap=softcap)
    g, (dq_t, dk_t, dv_t) = backward(out_t, (q, k, v), gen)
    qn, kn, vn, gn = np32(q), np32(k), np32(v), np32(g)
    opt = ctypes.byref(AttnOpt(scale, window, softcap, 0))
    out = np.zeros((B, T, nh, hd), np.float32)       # acc, then out, in place
    lse = np.full((B, nh, T), -np.inf, np.float32)   # m, then lse
    l = np.zeros((B, nh, T), np.float32)
    blocks = _cuts(T, kcuts)
    order = list(range(len(blocks)))
    order = order[1::2] + order[0::2][::-1]          # not position order: the merge must not care
    pieces = _cuts(T, qcuts)
    geo = lambda q0, Lq, k0, Lk: ctypes.byref(AttnBlk(B, nh, nkv, hd, Lq, q0, T, Lk, k0, T))
    for q0, Lq in pieces:
        for bi in order:
            k0, Lk = blocks[bi]
            fwd_blk(PA(out, q0 * nh * hd), PA(lse, q0), PA(l, q0), PA(qn, q0 * nh * hd),
                                     PA(kn, k0 * nkv * hd), PA(vn, k0 * nkv * hd), geo(q0, Lq, k0, Lk), opt)
        lib.op_attention_blk_finish(PA(out, q0 * nh * hd), PA(lse, q0), PA(l, q0), geo(q0, Lq, 0, 0))
    what = f"attention blocks q{qcuts} k{kcuts} opt {o}"
    assert_close(out, out_t, what + " fwd")
    assert_close(lse, lse_t, what + " lse")
    dq0, dk0, dv0 = np32(randn(gen, *q.shape)), np32(randn(gen, *k.shape)), np32(randn(gen, *v.shape))
    dq, dk, dv = dq0.copy(), dk0.copy(), dv0.copy()
    D = np.full((B, nh, T), np.nan, np.float32)
    for q0, Lq in pieces:
        lib.op_attention_blk_rowdot(PA(D, q0), PA(gn, q0 * nh * hd), PA(out, q0 * nh * hd), geo(q0, Lq, 0, 0))
        for bi in order:
            k0, Lk = blocks[bi]
            qo, ko = q0 * nh * hd, k0 * nkv * hd
            bwd_blk(PA(dq, qo), PA(dk, ko), PA(dv, ko), PA(gn, qo), PA(lse, q0), PA(D, q0),
                                     PA(qn, qo), PA(kn, ko), PA(vn, ko), geo(q0, Lq, k0, Lk), opt)
    assert_close(dq - dq0, dq_t, what + " dq")
    assert_close(dk - dk0, dk_t, what + " dk")
    assert_close(dv - dv0, dv_t, what + " dv")


@pytest.mark.parametrize("impl", BLK_IMPLS)
def test_attention_blocks_bf16(lib, libctitan, gen, impl):
    """Under bf16 products the blocks' backward rounds P and dS as the offset form's
    reference does (checked against torch above in fp32): the two agree to 1e-5. The
    register-blocked kernels at their head dim, in blocks past a key tile (bf16 P and dS
    from fp32 values that differ in the last bits round apart now and then: to 4e-3,
    kernels/registry.h's KERN_ATTN_BF16_TOL, as `kernels check` bounds them)."""
    _blk_lib(lib)
    bwd_blk = _blk_fns(lib, libctitan, impl)[1]
    B, T, nh, nkv, hd, L = (1, 200, 6, 2, 64, 100) if impl in BLK_BLOCKED else (1, 20, 4, 2, 8, 5)
    tol = 4e-3 if impl in BLK_BLOCKED else TOL
    bf = lambda t: np32(t.to(torch.bfloat16).float())
    q, k, v, g = (bf(randn(gen, B, T, n, hd)) for n in (nh, nkv, nkv, nh))
    opt = ctypes.byref(AttnOpt(0.0, 0, 0.0, 1))
    out, lse = np.zeros((B, T, nh, hd), np.float32), np.zeros((B, nh, T), np.float32)
    lib.op_attention_fwd(P(out), P(lse), P(q), P(k), P(v), B, T, nh, nkv, hd, opt)
    want = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    lib.op_attention_bwd(*(P(x) for x in want), P(g), P(out), P(lse), P(q), P(k), P(v), B, T, nh, nkv, hd, opt, 0)
    got = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    D = np.zeros((B, nh, T), np.float32)
    lib.op_attention_blk_rowdot(P(D), P(g), P(out), ctypes.byref(AttnBlk(B, nh, nkv, hd, T, 0, T, 0, 0, T)))
    for k0 in range(0, T, L):
        bwd_blk(P(got[0]), PA(got[1], k0 * nkv * hd), PA(got[2], k0 * nkv * hd), P(g), P(lse), P(D),
                P(q), PA(k, k0 * nkv * hd), PA(v, k0 * nkv * hd),
                ctypes.byref(AttnBlk(B, nh, nkv, hd, T, 0, T, L, k0, T)), opt)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        err = float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30)
        assert err <= tol, f"attention blocks bf16 {impl} {name}: rel err {err:.3g}"
