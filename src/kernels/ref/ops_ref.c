/* kernels/ref/ops_ref.c: the plain reference of every op in kernels/ops.h.
 *
 * Design: each op is a readable forward/backward pair in the llm.c manner.
 * These are the ground truth that faster kernels are checked against, so
 * clarity wins over speed everywhere except the matmul, which goes through
 * CBLAS (the one place later speed work swaps in faster code).
 *
 * Numerics follow HF's fp32 eager path: float accumulation, the same order of
 * operations where it is cheap to match (x*rstd before *w, dot product before
 * *scale, log_softmax as (x - max) - log(sum)). Building with -std=c11 keeps
 * GCC from contracting a*b+c into FMAs, so results round like torch's.
 *
 * Determinism: every output element is written by exactly one thread and its
 * sums run in a fixed order, so results do not depend on the thread count.
 * Reductions across rows (dw of rmsnorm, dwte of embedding, dk/dv of
 * attention) are parallelised over the OUTPUT (column chunks, kv heads) with
 * the row loop kept sequential inside, never with float atomics or
 * omp reductions. */
#include "kernels/ops.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/ref/attention_bwd_elem.h"

/* Column chunk for reductions over rows: wide enough to vectorise, narrow
 * enough to give each thread work on small C. */
#define COL_CHUNK 64

/* ------------------------------------------------------------------ matmul */

void op_matmul_fwd(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    // out[M,N], inp[M,K], w[N,K]
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        // BLAS implementations disagree on K == 0; the answer is an empty sum.
        if (!accumulate) memset(out, 0, (size_t)M * N * sizeof(float));
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, inp, K, w, K,
                accumulate ? 1.0f : 0.0f, out, N);
}

void op_matmul_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                   int M, int K, int N, int accumulate) {
    // dinp[M,K], dw[N,K], dout[M,N], inp[M,K], w[N,K]
    if (M <= 0 || K <= 0) return;
    if (N <= 0) {
        // an empty sum (BLAS implementations disagree on it): dinp = 0 or unchanged, dw unchanged
        if (dinp && !accumulate) memset(dinp, 0, (size_t)M * K * sizeof(float));
        return;
    }
    if (dinp) {
        // dinp[M,K] (+)= dout[M,N] @ w[N,K]; beta 0 never reads dinp
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, dout, N, w, K,
                    accumulate ? 1.0f : 0.0f, dinp, K);
    }
    if (dw) {
        // dw[N,K] += dout[M,N]^T @ inp[M,K]
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, M, 1.0f, dout, N, inp, K,
                    1.0f, dw, K);
    }
}

/* --------------------------------------------------------------- embedding */

void op_embedding_fwd(float *out, const int32_t *tokens, const float *wte, int N, int C) {
    // out[N,C], tokens[N], wte[V,C]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            memcpy(out + (size_t)n * C, wte + (size_t)tokens[n] * C, (size_t)C * sizeof(float));
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_embedding_bwd(float *dwte, const float *dout, const int32_t *tokens, int N, int C) {
    // dwte[V,C], dout[N,C], tokens[N]
    // A token can repeat, so rows of dwte collide; split by columns instead and
    // keep n in order so each element sums in the same order as a serial loop.
    int nchunks = (C + COL_CHUNK - 1) / COL_CHUNK;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int ch = 0; ch < nchunks; ch++) {
            int c0 = ch * COL_CHUNK;
            int c1 = c0 + COL_CHUNK < C ? c0 + COL_CHUNK : C;
            for (int n = 0; n < N; n++) {
                float *drow = dwte + (size_t)tokens[n] * C;
                const float *grow = dout + (size_t)n * C;
                for (int c = c0; c < c1; c++) drow[c] += grow[c];
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* ----------------------------------------------------------------- rmsnorm */

void op_rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps) {
    // out[N,C], rstd[N], inp[N,C], w[C]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C;
            float *y = out + (size_t)n * C;
            float ss = 0.0f;
            for (int c = 0; c < C; c++) ss += x[c] * x[c];
            float r = 1.0f / sqrtf(ss / (float)C + eps);
            // HF normalises first (x * rstd), then scales by the weight.
            for (int c = 0; c < C; c++) y[c] = (x[c] * r) * w[c];
            rstd[n] = r;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_rmsnorm_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                    const float *rstd, int N, int C) {
    // dinp[N,C], dw[C], dout[N,C], inp[N,C], w[C], rstd[N]
    // y = x r w with r = (mean(x^2)+eps)^-1/2, so
    // dx_j = r w_j dy_j - (r^3 / C) x_j sum_i(dy_i w_i x_i).
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C;
            const float *dy = dout + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float r = rstd[n];
            float dot = 0.0f;
            for (int c = 0; c < C; c++) dot += dy[c] * w[c] * x[c];
            float k = dot * r * r * r / (float)C;
            for (int c = 0; c < C; c++) dx[c] += r * w[c] * dy[c] - k * x[c];
        }
        KERN_TRACE_EXIT(kt_);
    }
    if (dw) op_rmsnorm_bwd_w(dw, dout, inp, rstd, N, C);
}

void op_rmsnorm_bwd_w(float *dw, const float *dout, const float *inp, const float *rstd, int N, int C) {
    // dw[C] +=, dout[N,C], inp[N,C], rstd[N]
    // dw_j = sum_n dy_nj x_nj r_n: a reduction over rows, split by columns.
    int nchunks = (C + COL_CHUNK - 1) / COL_CHUNK;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int ch = 0; ch < nchunks; ch++) {
            int c0 = ch * COL_CHUNK;
            int c1 = c0 + COL_CHUNK < C ? c0 + COL_CHUNK : C;
            for (int n = 0; n < N; n++) {
                const float *x = inp + (size_t)n * C;
                const float *dy = dout + (size_t)n * C;
                float r = rstd[n];
                for (int c = c0; c < c1; c++) dw[c] += dy[c] * (x[c] * r);
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* The RMSNorm of rows split over ranks, in phases (ops.h): the same sums as
 * op_rmsnorm_fwd/bwd, with the row sums handed out and back. */
void op_rmsnorm_sumsq(float *ss, const float *inp, int N, int C) {
    // ss[N], inp[N,C]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C;
            float s = 0.0f;
            for (int c = 0; c < C; c++) s += x[c] * x[c];
            ss[n] = s;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_rmsnorm_scale(float *out, const float *inp, const float *w, const float *rstd, int N, int C) {
    // out[N,C] = inp[N,C] * rstd[N] * w[C]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C;
            float *y = out + (size_t)n * C, r = rstd[n];
            for (int c = 0; c < C; c++) y[c] = (x[c] * r) * w[c];
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_rmsnorm_bwd_dot(float *dot, const float *dout, const float *inp, const float *w, int N, int C) {
    // dot[N] = sum_c dout[N,C] * w[C] * inp[N,C]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float s = 0.0f;
            for (int c = 0; c < C; c++) s += dy[c] * w[c] * x[c];
            dot[n] = s;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_rmsnorm_bwd_given(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                          const float *rstd, const float *dot, int N, int C, int Cw) {
    // dinp[N,C] +=, dw[C] +=, dout/inp [N,C], w[C], rstd[N], dot[N] (summed over the whole row of Cw)
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float r = rstd[n], k = dot[n] * r * r * r / (float)Cw;
            for (int c = 0; c < C; c++) dx[c] += r * w[c] * dy[c] - k * x[c];
        }
        KERN_TRACE_EXIT(kt_);
    }
    if (dw) op_rmsnorm_bwd_w(dw, dout, inp, rstd, N, C); /* the same sum as the whole row's */
}

/* -------------------------------------------------------------------- rope */

void op_rope_tables(float *cos, float *sin, int T, int hd, float theta) {
    // cos[T, hd/2], sin[T, hd/2]
    int half = hd / 2;
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            // HF: inv_freq = 1.0 / theta ** (arange(0, hd, 2).float() / hd), all fp32,
            // then freqs = pos * inv_freq in fp32, then cos/sin.
            float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)hd);
            float angle = (float)t * inv_freq;
            cos[(size_t)t * half + i] = cosf(angle);
            sin[(size_t)t * half + i] = sinf(angle);
        }
    }
}

void op_rope_fwd(float *out, const float *inp, const float *cos, const float *sin, int B, int T, int nh, int hd,
                 int rd) {
    // out[B,T,nh,hd], inp[B,T,nh,hd], cos[T,rd/2], sin[T,rd/2]; features rd.. pass through
    int half = rd / 2;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++) {
            for (int t = 0; t < T; t++) {
                const float *c = cos + (size_t)t * half;
                const float *s = sin + (size_t)t * half;
                for (int h = 0; h < nh; h++) {
                    size_t off = (((size_t)b * T + t) * nh + h) * hd;
                    const float *x = inp + off;
                    float *y = out + off;
                    for (int i = 0; i < half; i++) {
                        // both read before either write: out may alias inp
                        float x1 = x[i], x2 = x[i + half];
                        y[i] = x1 * c[i] - x2 * s[i];
                        y[i + half] = x2 * c[i] + x1 * s[i];
                    }
                    if (y != x)
                        for (int i = rd; i < hd; i++) y[i] = x[i];
                }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_rope_bwd(float *dinp, const float *dout, const float *cos, const float *sin, int B, int T, int nh, int hd,
                 int rd) {
    // dinp[B,T,nh,hd], dout[B,T,nh,hd], cos[T,rd/2], sin[T,rd/2]; features rd.. pass through
    // The rotation R acts on each pair (i, i+half); backward applies R^T.
    // When dinp == dout the gradient is transformed in place (dinp = R^T dout),
    // which is what accumulating into a zeroed buffer would give; adding to the
    // buffer being read would be meaningless.
    int half = rd / 2;
    int inplace = dinp == dout;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++) {
            for (int t = 0; t < T; t++) {
                const float *c = cos + (size_t)t * half;
                const float *s = sin + (size_t)t * half;
                for (int h = 0; h < nh; h++) {
                    size_t off = (((size_t)b * T + t) * nh + h) * hd;
                    const float *dy = dout + off;
                    float *dx = dinp + off;
                    for (int i = 0; i < half; i++) {
                        float d1 = dy[i], d2 = dy[i + half];
                        float g1 = d1 * c[i] + d2 * s[i];
                        float g2 = d2 * c[i] - d1 * s[i];
                        if (inplace) {
                            dx[i] = g1;
                            dx[i + half] = g2;
                        } else {
                            dx[i] += g1;
                            dx[i + half] += g2;
                        }
                    }
                    if (!inplace) /* the identity's gradient; in place it is already there */
                        for (int i = rd; i < hd; i++) dx[i] += dy[i];
                }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* --------------------------------------------------------------- attention */

/* The plain form of the recompute-in-backward attention: one query row at a
 * time, a two-pass softmax over the keys it sees in a [Tk] scratch row, and
 * the row's log-sum-exp kept instead of its probabilities. The tiled kernel
 * (attention.c) runs the same algorithm a block at a time and is checked
 * against this. Options (kern_attn_opt): the scale, a sliding window (keys
 * lo..t, lo = kern_attn_first_key) and the soft cap s = cap tanh(x / cap) of
 * the scaled score x, differentiated as cap tanh' = 1 - tanh^2 (the cap
 * cancels). Without options every expression is the one of the plain causal
 * attention, so results do not change. Written for the offset form (the last
 * Tq of Tk positions, ops.h); the whole-sequence op is its Tq = Tk case. */

void op_attention_fwd_q0(float *out, float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                         int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    // out[B,Tq,nh,hd], lse[B,nh,Tq], q[B,Tq,nh,hd], k[B,Tk,nkv,hd], v[B,Tk,nkv,hd]
    int group = nh / nkv, q0 = Tk - Tq;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *p = ct_malloc((size_t)(Tk > 0 ? Tk : 1) * sizeof(float)); // [Tk] scores of one row
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < nh; h++) {
                for (int r = 0; r < Tq; r++) { /* query row r: position t */
                    int t = q0 + r, kh = h / group, lo = kern_attn_first_key(t, window);
                    const float *qt = q + (((size_t)b * Tq + r) * nh + h) * hd;
                    // scores, causal: keys lo..t only
                    float maxv = -INFINITY;
                    for (int t2 = lo; t2 <= t; t2++) {
                        const float *kt = k + (((size_t)b * Tk + t2) * nkv + kh) * hd;
                        float dot = 0.0f;
                        for (int i = 0; i < hd; i++) dot += qt[i] * kt[i];
                        float sc = dot * scale; // HF: (q @ k^T) * scaling
                        if (cap > 0.0f) sc = cap * tanhf(sc / cap); // gemma: tanh(s / cap) * cap
                        p[t2] = sc;
                        if (sc > maxv) maxv = sc;
                    }
                    float sum = 0.0f;
                    for (int t2 = lo; t2 <= t; t2++) {
                        p[t2] = expf(p[t2] - maxv);
                        sum += p[t2];
                    }
                    lse[((size_t)b * nh + h) * Tq + r] = maxv + logf(sum);
                    // out = softmax @ v
                    float *ot = out + (((size_t)b * Tq + r) * nh + h) * hd;
                    for (int i = 0; i < hd; i++) ot[i] = 0.0f;
                    for (int t2 = lo; t2 <= t; t2++) {
                        const float *vt = v + (((size_t)b * Tk + t2) * nkv + kh) * hd;
                        float pt = p[t2] / sum;
                        for (int i = 0; i < hd; i++) ot[i] += pt * vt[i];
                    }
                }
            }
        }
        free(p);
        KERN_TRACE_EXIT(kt_);
    }
}

void op_attention_bwd_q0(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                         const float *q, const float *k, const float *v, int B, int Tq, int Tk, int nh, int nkv,
                         int hd, const kern_attn_opt *opt, int acc) {
    // dq[B,Tq,nh,hd], dk[B,Tk,nkv,hd], dv[B,Tk,nkv,hd], dout[B,Tq,nh,hd], out[B,Tq,nh,hd], lse[B,nh,Tq],
    // q[B,Tq,nh,hd], k[B,Tk,nkv,hd], v[B,Tk,nkv,hd]
    // All query heads of a group and all query positions add into the same kv
    // rows, so one thread owns a whole (b, kv head) and walks them in order;
    // it then also owns the dq rows of the group's query heads.
    if (!acc) kern_attn_zero_grads_q0(dq, dk, dv, B, Tq, Tk, nh, nkv, hd);
    int group = nh / nkv, q0 = Tk - Tq;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int b16 = kern_attn_bf16(opt);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < nkv; kh++) {
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    for (int r = 0; r < Tq; r++) { /* query row r: position t */
                        int t = q0 + r;
                        const float *qt = q + (((size_t)b * Tq + r) * nh + h) * hd;
                        const float *ot = out + (((size_t)b * Tq + r) * nh + h) * hd;
                        const float *dot_ = dout + (((size_t)b * Tq + r) * nh + h) * hd;
                        float *dqt = dq + (((size_t)b * Tq + r) * nh + h) * hd;
                        float L = lse[((size_t)b * nh + h) * Tq + r];
                        // softmax backward needs sum_j p_j dp_j = dout . out (out = sum_j p_j v_j)
                        float D = 0.0f;
                        for (int i = 0; i < hd; i++) D += dot_[i] * ot[i];
                        for (int t2 = kern_attn_first_key(t, window); t2 <= t; t2++) {
                            const float *kt = k + (((size_t)b * Tk + t2) * nkv + kh) * hd;
                            const float *vt = v + (((size_t)b * Tk + t2) * nkv + kh) * hd;
                            float *dkt = dk + (((size_t)b * Tk + t2) * nkv + kh) * hd;
                            float *dvt = dv + (((size_t)b * Tk + t2) * nkv + kh) * hd;
                            /* p = exp(score - lse), dv += p dout, ds = p (dout . v - D), dq, dk */
                            op_attention_bwd_elem(dqt, dkt, dvt, qt, kt, vt, dot_, L, D, hd, scale, cap, b16);
                        }
                    }
                }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                      int B, int T, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    op_attention_fwd_q0(out, lse, q, k, v, B, T, T, nh, nkv, hd, opt);
}

void op_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                      const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                      const kern_attn_opt *opt, int acc) {
    op_attention_bwd_q0(dq, dk, dv, dout, out, lse, q, k, v, B, T, T, nh, nkv, hd, opt, acc);
}

/* ------------------------------------------------------------------ swiglu */

void op_swiglu_fwd(float *out, const float *gate, const float *up, int N) {
    // out[N], gate[N], up[N]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int i = 0; i < N; i++) {
            float g = gate[i];
            float silu = g / (1.0f + expf(-g));
            out[i] = silu * up[i];
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N, int acc) {
    // dgate[N], dup[N], dout[N], gate[N], up[N]
    // silu'(g) = sig(g) (1 + g (1 - sig(g)))
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int i = 0; i < N; i++) {
            float g = gate[i];
            float sig = 1.0f / (1.0f + expf(-g));
            float silu = g * sig;
            dgate[i] = (acc ? dgate[i] : 0.0f) + dout[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
            dup[i] = (acc ? dup[i] : 0.0f) + dout[i] * silu;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* ------------------------------------------------------------------- geglu */

/* torch's gelu(approximate="tanh") term by term (its CPU kernel and
 * GeluBackward): beta = sqrt(2/pi), kappa = 0.044715. */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

void op_geglu_fwd(float *out, const float *gate, const float *up, int N) {
    // out[N], gate[N], up[N]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int i = 0; i < N; i++) {
            float x = gate[i];
            float inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
            out[i] = 0.5f * x * (1.0f + tanhf(inner)) * up[i];
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_geglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N, int acc) {
    // dgate[N], dup[N], dout[N], gate[N], up[N]
    // gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) beta (1 + 3 kappa x^2), u = beta (x + kappa x^3)
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int i = 0; i < N; i++) {
            float x = gate[i];
            float th = tanhf(GELU_BETA * (x + GELU_KAPPA * (x * x * x)));
            float gelu = 0.5f * x * (1.0f + th);
            float dgelu = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * x * x);
            dgate[i] = (acc ? dgate[i] : 0.0f) + dout[i] * up[i] * dgelu;
            dup[i] = (acc ? dup[i] : 0.0f) + dout[i] * gelu;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* ----------------------------------------------------------- cross entropy */

#define CE_IGNORE (-100)

static void ce_check_target(int32_t tgt, int V) {
    // An out-of-range label is a caller bug (torch raises too); reading past the
    // row would silently give a wrong loss.
    if (tgt != CE_IGNORE && (tgt < 0 || tgt >= V)) {
        fprintf(stderr, "ctitan: error: cross-entropy target %d outside [0,%d) and not -100\n",
                (int)tgt, V);
        abort();
    }
}

/* -log softmax(x)[tgt] computed as torch's log_softmax: (x - max) - log(sum). */
static float ce_row_loss(const float *x, int32_t tgt, int V, float *maxv_out, float *sum_out) {
    float maxv = -INFINITY;
    for (int i = 0; i < V; i++)
        if (x[i] > maxv) maxv = x[i];
    float sum = 0.0f;
    for (int i = 0; i < V; i++) sum += expf(x[i] - maxv);
    *maxv_out = maxv;
    *sum_out = sum;
    return -((x[tgt] - maxv) - logf(sum));
}

double op_crossentropy_fwdbwd(float *logits, const int32_t *targets, int N, int V, float grad_scale,
                              long *n_valid) {
    // logits[N,V] in: logits, out: dlogits * grad_scale; targets[N]
    for (int n = 0; n < N; n++) ce_check_target(targets[n], V);
    double *row_loss = ct_malloc((size_t)(N > 0 ? N : 1) * sizeof(double)); // [N]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            float *x = logits + (size_t)n * V;
            int32_t tgt = targets[n];
            if (tgt == CE_IGNORE) {
                memset(x, 0, (size_t)V * sizeof(float));
                row_loss[n] = 0.0;
                continue;
            }
            float maxv, sum;
            row_loss[n] = ce_row_loss(x, tgt, V, &maxv, &sum);
            float inv = 1.0f / sum;
            for (int i = 0; i < V; i++) x[i] = expf(x[i] - maxv) * inv * grad_scale;
            x[tgt] -= grad_scale;
        }
        KERN_TRACE_EXIT(kt_);
    }
    // serial sum: the loss must not depend on the thread count
    double total = 0.0;
    long count = 0;
    for (int n = 0; n < N; n++) {
        if (targets[n] == CE_IGNORE) continue;
        total += row_loss[n];
        count++;
    }
    free(row_loss);
    if (n_valid) *n_valid += count;
    return total;
}

double op_crossentropy_fwd(float *losses, const float *logits, const int32_t *targets, int N, int V) {
    // losses[N], logits[N,V], targets[N]
    for (int n = 0; n < N; n++) ce_check_target(targets[n], V);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            float maxv, sum;
            losses[n] = targets[n] == CE_IGNORE
                            ? 0.0f
                            : ce_row_loss(logits + (size_t)n * V, targets[n], V, &maxv, &sum);
        }
        KERN_TRACE_EXIT(kt_);
    }
    double total = 0.0;
    for (int n = 0; n < N; n++) total += losses[n];
    return total;
}

/* --------------------------------------------------------------------- add */

void op_add(float *out, const float *a, const float *b, long N) {
    // out[N], a[N], b[N]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long i = 0; i < N; i++) out[i] = a[i] + b[i];
        KERN_TRACE_EXIT(kt_);
    }
}

void op_bias_add(float *out, const float *b, int N, int C) {
    // out[N,C] += b[C]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++)
            for (int c = 0; c < C; c++) out[(size_t)n * C + c] += b[c];
        KERN_TRACE_EXIT(kt_);
    }
}

void op_bias_bwd(float *db, const float *dout, int N, int C) {
    // db[C] += sum over rows of dout[N,C]; each column summed in row order by one
    // thread, so the result does not depend on the thread count
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int c = 0; c < C; c++) {
            float acc = 0.0f;
            for (int n = 0; n < N; n++) acc += dout[(size_t)n * C + c];
            db[c] += acc;
        }
        KERN_TRACE_EXIT(kt_);
    }
}
