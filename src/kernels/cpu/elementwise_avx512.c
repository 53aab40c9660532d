/* kernels/cpu/elementwise_avx512.c: AVX-512 versions of the memory-bound ops
 * (embedding, rmsnorm, rope, the fused q/k-norm + RoPE, swiglu, geglu, add,
 * cross-entropy and its vocabulary-parallel phases, AdamW), registered as
 * "avx512" beside their references.
 *
 * Design. Each op is one pass (or as few as its data dependencies allow) over
 * its tensors with zmm loads, masked for the tails, so any size works and no
 * buffer needs padding. Threads: `omp for schedule(static)` over rows (or
 * fixed-size element blocks), so every output element is written by one
 * thread; each region is `omp parallel` + `omp for nowait` only so that its
 * threads can stamp the profiler's per-thread spans (kernels/ops.h). Reductions inside a row (norm sums, softmax max/sum, dot products)
 * use a fixed lane layout and a fixed final horizontal order; reductions
 * across rows (dw of the norms, dwte of the embedding) are split by columns or
 * by fixed row blocks summed in order afterwards. Nothing depends on the
 * thread count, so reruns are bit-identical at any OMP_NUM_THREADS (the resume
 * tests rely on this); the results differ from the references only by the
 * lane-parallel summation order and the vector exp (kern_check's 1e-5).
 *
 * AdamW and add are element-wise with the reference's exact operation order
 * and no FMA contraction, so they are bit-identical to "ref".
 *
 * Functions carry a target attribute instead of per-file -m flags, so the
 * build stays generic x86-64; the registry only installs them where the CPU
 * has AVX-512 F/BW/VL/DQ. */
#if defined(__x86_64__) /* x86-64 only, the whole file (aarch64: the _neon files) */
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/err.h"
#include "kernels/cpu/avx512_util.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"

#define EW512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define EW_INLINE EW512 __attribute__((always_inline)) static inline

/* Columns per task of the cross-row reductions split by columns (as the
 * reference's COL_CHUNK: several zmm wide, and enough tasks for the threads). */
#define EW_COLS 64
/* Rows per partial sum of the fused q/k-norm backward's dw (fixed, so the
 * partials and their in-order sum do not depend on the thread count). */
#define EW_ROWBLK 64

/* Whole vectors unmasked, a tail masked (avx512_util.h). One exception,
 * measured on Zen 5: the embedding's backward (its own masks, below). */
EW_INLINE __m512 ew_load(const float *p, long n) { return avx512_loadn(p, n); }
EW_INLINE void ew_store(float *p, __m512 v, long n) { avx512_storen(p, v, n); }


/* Exposed for the accuracy test of the vector exp (tests/c/kernels/test_kernels.c):
 * out[i] = e^x[i] through exp16 (avx512_util.h). */
EW512 void kern_exp_avx512(float *out, const float *x, long n) {
    for (long i = 0; i < n; i += 16) ew_store(out + i, exp16(ew_load(x + i, n - i)), n - i);
}

/* The same for the vector tanh (avx512_util.h's tanh16: attention's soft cap). */
EW512 void kern_tanh_avx512(float *out, const float *x, long n) {
    for (long i = 0; i < n; i += 16) ew_store(out + i, tanh16(ew_load(x + i, n - i)), n - i);
}

/* --------------------------------------------------------------- embedding */

EW512 void kern_embedding_fwd_avx512(float *out, const int32_t *tokens, const float *wte, int N, int C) {
    // out[N,C], tokens[N], wte[V,C]
    // A gather of whole rows: libc's memcpy is already the best copy there is.
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) memcpy(out + (size_t)n * C, wte + (size_t)tokens[n] * C, (size_t)C * sizeof(float));
        KERN_TRACE_EXIT(kt_);
    }
}

EW512 void kern_embedding_bwd_avx512(float *dwte, const float *dout, const int32_t *tokens, int N, int C) {
    // dwte[V,C], dout[N,C], tokens[N]
    // Tokens repeat, so rows of dwte collide: split by columns and keep n in order,
    // as the reference does (the same additions in the same order: bit-identical).
    int nchunks = (C + EW_COLS - 1) / EW_COLS;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int ch = 0; ch < nchunks; ch++) {
            int c0 = ch * EW_COLS, c1 = c0 + EW_COLS < C ? c0 + EW_COLS : C;
            for (int n = 0; n < N; n++) {
                float *drow = dwte + (size_t)tokens[n] * C;
                const float *grow = dout + (size_t)n * C;
                /* masked throughout: this read-modify-write of rows of dwte measured 60-87 GB/s
                 * so on Zen 5, against 43-58 with ew_store's unmasked whole vectors */
                for (int c = c0; c < c1; c += 16) {
                    __mmask16 mk = lanes(c1 - c);
                    _mm512_mask_storeu_ps(drow + c, mk,
                                          _mm512_add_ps(_mm512_maskz_loadu_ps(mk, drow + c), _mm512_maskz_loadu_ps(mk, grow + c)));
                }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* ----------------------------------------------------------------- rmsnorm */

/* sum of x[i] * y[i] over a row: four zmm accumulators (latency), combined in a fixed order */
EW_INLINE float ew_dot(const float *x, const float *y, long C) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long c = 0;
    for (; c + 64 <= C; c += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c), _mm512_loadu_ps(y + c), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(y + c + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 32), _mm512_loadu_ps(y + c + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 48), _mm512_loadu_ps(y + c + 48), a3);
    }
    for (; c < C; c += 16) a0 = _mm512_fmadd_ps(ew_load(x + c, C - c), ew_load(y + c, C - c), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

EW512 void kern_rmsnorm_fwd_avx512(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                                   float eps) {
    // out[N,C], rstd[N], inp[N,C], w[C]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C;
            float *y = out + (size_t)n * C;
            float r = 1.0f / sqrtf(ew_dot(x, x, C) / (float)C + eps);
            __m512 vr = _mm512_set1_ps(r);
            for (int c = 0; c < C; c += 16) /* (x r) w, HF's order */
                ew_store(y + c, _mm512_mul_ps(_mm512_mul_ps(ew_load(x + c, C - c), vr), ew_load(w + c, C - c)), C - c);
            rstd[n] = r;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

EW512 void kern_rmsnorm_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                   const float *rstd, int N, int C) {
    // dinp[N,C], dw[C], dout[N,C], inp[N,C], w[C], rstd[N]
    // dx_j = r w_j dy_j - (r^3 / C) x_j sum_i(dy_i w_i x_i)
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float r = rstd[n];
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < C; c += 16)
                acc = _mm512_fmadd_ps(_mm512_mul_ps(ew_load(dy + c, C - c), ew_load(w + c, C - c)), ew_load(x + c, C - c),
                                      acc);
            float k = _mm512_reduce_add_ps(acc) * r * r * r / (float)C;
            __m512 vr = _mm512_set1_ps(r), vk = _mm512_set1_ps(k);
            for (int c = 0; c < C; c += 16) {
                __m512 g = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(vr, ew_load(w + c, C - c)), ew_load(dy + c, C - c)),
                                         _mm512_mul_ps(vk, ew_load(x + c, C - c)));
                ew_store(dx + c, _mm512_add_ps(ew_load(dx + c, C - c), g), C - c);
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
    if (dw) kern_rmsnorm_bwd_w_avx512(dw, dout, inp, rstd, N, C);
}

EW512 void kern_rmsnorm_bwd_w_avx512(float *dw, const float *dout, const float *inp, const float *rstd, int N, int C) {
    // dw[C] +=, dout[N,C], inp[N,C], rstd[N]
    // dw_j = sum_n dy_nj x_nj r_n: over rows, split by columns, n in order
    int nchunks = (C + EW_COLS - 1) / EW_COLS;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int ch = 0; ch < nchunks; ch++) {
            int c0 = ch * EW_COLS, c1 = c0 + EW_COLS < C ? c0 + EW_COLS : C;
            __m512 a[EW_COLS / 16];
            for (int j = 0; j < EW_COLS / 16; j++) a[j] = _mm512_setzero_ps();
            for (int n = 0; n < N; n++) {
                const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
                __m512 vr = _mm512_set1_ps(rstd[n]);
                for (int c = c0, j = 0; c < c1; c += 16, j++)
                    a[j] = _mm512_fmadd_ps(ew_load(dy + c, c1 - c), _mm512_mul_ps(ew_load(x + c, c1 - c), vr), a[j]);
            }
            for (int c = c0, j = 0; c < c1; c += 16, j++)
                ew_store(dw + c, _mm512_add_ps(ew_load(dw + c, c1 - c), a[j]), c1 - c);
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* -------------------------------------------------------------------- rope */

/* One head row: y = R x over pairs (i, i + half), reading both halves before writing (y may be x). */
EW_INLINE void ew_rope_row(float *y, const float *x, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i += 16) {
        long m = half - i;
        __m512 x1 = ew_load(x + i, m), x2 = ew_load(x + half + i, m);
        __m512 vc = ew_load(c + i, m), vs = ew_load(s + i, m);
        ew_store(y + i, _mm512_sub_ps(_mm512_mul_ps(x1, vc), _mm512_mul_ps(x2, vs)), m);
        ew_store(y + half + i, _mm512_add_ps(_mm512_mul_ps(x2, vc), _mm512_mul_ps(x1, vs)), m);
    }
}

EW512 void kern_rope_fwd_avx512(float *out, const float *inp, const float *cos, const float *sin, int B, int T,
                                int nh, int hd, int rd) {
    // out[B,T,nh,hd], inp[B,T,nh,hd], cos[T,rd/2], sin[T,rd/2]; features rd.. pass through
    int half = rd / 2;
    long BT = (long)B * T;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long bt = 0; bt < BT; bt++) {
            long t = bt % T;
            for (int h = 0; h < nh; h++) {
                size_t off = ((size_t)bt * nh + h) * hd;
                ew_rope_row(out + off, inp + off, cos + t * half, sin + t * half, half);
                if (rd < hd && out != inp) memcpy(out + off + rd, inp + off + rd, (size_t)(hd - rd) * sizeof(float));
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

EW512 void kern_rope_bwd_avx512(float *dinp, const float *dout, const float *cos, const float *sin, int B, int T,
                                int nh, int hd, int rd) {
    // dinp[B,T,nh,hd], dout[B,T,nh,hd], cos/sin [T,rd/2]: dinp += R^T dout (= when dinp == dout);
    // features rd.. pass through (dinp += dout there)
    int half = rd / 2;
    int inplace = dinp == dout;
    long BT = (long)B * T;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long bt = 0; bt < BT; bt++) {
            long t = bt % T;
            const float *c = cos + t * half, *s = sin + t * half;
            for (int h = 0; h < nh; h++) {
                size_t off = ((size_t)bt * nh + h) * hd;
                const float *dy = dout + off;
                float *dx = dinp + off;
                for (int i = 0; i < half; i += 16) {
                    long m = half - i;
                    __m512 d1 = ew_load(dy + i, m), d2 = ew_load(dy + half + i, m);
                    __m512 vc = ew_load(c + i, m), vs = ew_load(s + i, m);
                    __m512 g1 = _mm512_add_ps(_mm512_mul_ps(d1, vc), _mm512_mul_ps(d2, vs));
                    __m512 g2 = _mm512_sub_ps(_mm512_mul_ps(d2, vc), _mm512_mul_ps(d1, vs));
                    if (!inplace) {
                        g1 = _mm512_add_ps(ew_load(dx + i, m), g1);
                        g2 = _mm512_add_ps(ew_load(dx + half + i, m), g2);
                    }
                    ew_store(dx + i, g1, m);
                    ew_store(dx + half + i, g2, m);
                }
                if (!inplace)
                    for (int i = rd; i < hd; i += 16) {
                        long m = hd - i;
                        ew_store(dx + i, _mm512_add_ps(ew_load(dx + i, m), ew_load(dy + i, m)), m);
                    }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* ---------------------------------------------------- q/k norm + RoPE, fused */

EW512 void kern_qknorm_rope_fwd_avx512(float *out, float *rstd, const float *x, const float *w, const float *cos,
                                       const float *sin, int B, int T, int nh, int hd, float eps) {
    // out[B,T,nh,hd], rstd[B*T*nh], x[B,T,nh,hd], w[hd], cos/sin [T,hd/2]
    // One pass per head row while it sits in L1: sum of squares, then each
    // pair (i, i + half) normalised, scaled and rotated straight into out.
    int half = hd / 2;
    long BT = (long)B * T;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long bt = 0; bt < BT; bt++) {
            long t = bt % T;
            const float *c = cos + t * half, *s = sin + t * half;
            for (int h = 0; h < nh; h++) {
                size_t row = (size_t)bt * nh + h;
                const float *xr = x + row * hd;
                float *y = out + row * hd;
                float r = 1.0f / sqrtf(ew_dot(xr, xr, hd) / (float)hd + eps);
                __m512 vr = _mm512_set1_ps(r);
                for (int i = 0; i < half; i += 16) {
                    long m = half - i;
                    __m512 y1 = _mm512_mul_ps(_mm512_mul_ps(ew_load(xr + i, m), vr), ew_load(w + i, m));
                    __m512 y2 = _mm512_mul_ps(_mm512_mul_ps(ew_load(xr + half + i, m), vr), ew_load(w + half + i, m));
                    __m512 vc = ew_load(c + i, m), vs = ew_load(s + i, m);
                    ew_store(y + i, _mm512_sub_ps(_mm512_mul_ps(y1, vc), _mm512_mul_ps(y2, vs)), m);
                    ew_store(y + half + i, _mm512_add_ps(_mm512_mul_ps(y2, vc), _mm512_mul_ps(y1, vs)), m);
                }
                rstd[row] = r;
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

EW512 void kern_qknorm_rope_bwd_avx512(float *dx, float *dw, const float *dout, const float *x, const float *w,
                                       const float *rstd, const float *cos, const float *sin, int B, int T, int nh,
                                       int hd, int acc) {
    // dx[B,T,nh,hd] (+)= (acc 0: overwritten), dw[hd] += (may be NULL), dout[B,T,nh,hd] (w.r.t. the rotated output),
    // x[B,T,nh,hd] (the norm's input), w[hd], rstd[B*T*nh], cos/sin [T,hd/2]
    // Per row: g = R^T dout (the RoPE backward), then the RMSNorm backward of g;
    // dw gets g x r. dw sums over every row: fixed blocks of EW_ROWBLK rows each
    // write a partial [hd] (one thread per block), summed in block order after.
    // In the same pass as dx (one read of dout and x); kern_qknorm_rope_bwd_w_avx512,
    // a split backward's W, repeats exactly this dw arithmetic (kernels check: I then W).
    int half = hd / 2;
    long rows = (long)B * T * nh;
    long nblk = (rows + EW_ROWBLK - 1) / EW_ROWBLK;
    float *part = dw ? ct_malloc64((size_t)(nblk > 0 ? nblk : 1) * hd * sizeof(float)) : NULL; // [nblk, hd]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long blk = 0; blk < nblk; blk++) {
            float *pw = part ? part + (size_t)blk * hd : NULL;
            if (pw) memset(pw, 0, (size_t)hd * sizeof(float));
            long r1 = (blk + 1) * EW_ROWBLK < rows ? (blk + 1) * EW_ROWBLK : rows;
            for (long row = blk * EW_ROWBLK; row < r1; row++) {
                long t = (row / nh) % T;
                const float *c = cos + t * half, *s = sin + t * half;
                const float *xr = x + (size_t)row * hd, *dy = dout + (size_t)row * hd;
                float *dxr = dx + (size_t)row * hd;
                float r = rstd[row];
                __m512 dot = _mm512_setzero_ps();
                for (int i = 0; i < half; i += 16) {
                    long m = half - i;
                    __m512 d1 = ew_load(dy + i, m), d2 = ew_load(dy + half + i, m);
                    __m512 vc = ew_load(c + i, m), vs = ew_load(s + i, m);
                    __m512 g1 = _mm512_add_ps(_mm512_mul_ps(d1, vc), _mm512_mul_ps(d2, vs));
                    __m512 g2 = _mm512_sub_ps(_mm512_mul_ps(d2, vc), _mm512_mul_ps(d1, vs));
                    dot = _mm512_fmadd_ps(_mm512_mul_ps(g1, ew_load(w + i, m)), ew_load(xr + i, m), dot);
                    dot = _mm512_fmadd_ps(_mm512_mul_ps(g2, ew_load(w + half + i, m)), ew_load(xr + half + i, m), dot);
                }
                float k = _mm512_reduce_add_ps(dot) * r * r * r / (float)hd;
                __m512 vr = _mm512_set1_ps(r), vk = _mm512_set1_ps(k);
                for (int i = 0; i < half; i += 16) {
                    long m = half - i;
                    __m512 d1 = ew_load(dy + i, m), d2 = ew_load(dy + half + i, m);
                    __m512 vc = ew_load(c + i, m), vs = ew_load(s + i, m);
                    __m512 g[2] = {_mm512_add_ps(_mm512_mul_ps(d1, vc), _mm512_mul_ps(d2, vs)),
                                   _mm512_sub_ps(_mm512_mul_ps(d2, vc), _mm512_mul_ps(d1, vs))};
                    for (int j = 0; j < 2; j++) {
                        int o = i + j * half;
                        __m512 vx = ew_load(xr + o, m), vw = ew_load(w + o, m);
                        __m512 d = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(vr, vw), g[j]), _mm512_mul_ps(vk, vx));
                        ew_store(dxr + o, _mm512_add_ps(acc ? ew_load(dxr + o, m) : _mm512_setzero_ps(), d), m);
                        if (pw) ew_store(pw + o, _mm512_fmadd_ps(g[j], _mm512_mul_ps(vx, vr), ew_load(pw + o, m)), m);
                    }
                }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
    if (!dw) return;
    for (int c = 0; c < hd; c += 16) {
        __m512 a = _mm512_setzero_ps();
        for (long blk = 0; blk < nblk; blk++) a = _mm512_add_ps(a, ew_load(part + (size_t)blk * hd + c, hd - c));
        ew_store(dw + c, _mm512_add_ps(ew_load(dw + c, hd - c), a), hd - c);
    }
    free(part);
}

EW512 void kern_qknorm_rope_bwd_w_avx512(float *dw, const float *dout, const float *x, const float *rstd,
                                         const float *cos, const float *sin, int B, int T, int nh, int hd) {
    // dw[hd] +=, dout[B,T,nh,hd] (w.r.t. the rotated output), x[B,T,nh,hd], rstd[B*T*nh], cos/sin [T,hd/2]
    // dw = sum over rows of g x r, g = R^T dout: fixed blocks of EW_ROWBLK rows
    // each write a partial [hd] (one thread per block), summed in block order after.
    int half = hd / 2;
    long rows = (long)B * T * nh;
    long nblk = (rows + EW_ROWBLK - 1) / EW_ROWBLK;
    float *part = ct_malloc64((size_t)(nblk > 0 ? nblk : 1) * hd * sizeof(float)); // [nblk, hd]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long blk = 0; blk < nblk; blk++) {
            float *pw = part + (size_t)blk * hd;
            memset(pw, 0, (size_t)hd * sizeof(float));
            long r1 = (blk + 1) * EW_ROWBLK < rows ? (blk + 1) * EW_ROWBLK : rows;
            for (long row = blk * EW_ROWBLK; row < r1; row++) {
                long t = (row / nh) % T;
                const float *c = cos + t * half, *s = sin + t * half;
                const float *xr = x + (size_t)row * hd, *dy = dout + (size_t)row * hd;
                __m512 vr = _mm512_set1_ps(rstd[row]);
                for (int i = 0; i < half; i += 16) {
                    long m = half - i;
                    __m512 d1 = ew_load(dy + i, m), d2 = ew_load(dy + half + i, m);
                    __m512 vc = ew_load(c + i, m), vs = ew_load(s + i, m);
                    __m512 g[2] = {_mm512_add_ps(_mm512_mul_ps(d1, vc), _mm512_mul_ps(d2, vs)),
                                   _mm512_sub_ps(_mm512_mul_ps(d2, vc), _mm512_mul_ps(d1, vs))};
                    for (int j = 0; j < 2; j++) {
                        int o = i + j * half;
                        __m512 vx = ew_load(xr + o, m);
                        ew_store(pw + o, _mm512_fmadd_ps(g[j], _mm512_mul_ps(vx, vr), ew_load(pw + o, m)), m);
                    }
                }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
    for (int c = 0; c < hd; c += 16) {
        __m512 a = _mm512_setzero_ps();
        for (long blk = 0; blk < nblk; blk++) a = _mm512_add_ps(a, ew_load(part + (size_t)blk * hd + c, hd - c));
        ew_store(dw + c, _mm512_add_ps(ew_load(dw + c, hd - c), a), hd - c);
    }
    free(part);
}

/* ------------------------------------------------------------------ swiglu */

/* Element blocks per OpenMP task of the flat element-wise ops: whole zmm
 * vectors, so only the last block has a tail. */
#define EW_BLOCK 4096

EW512 void kern_swiglu_fwd_avx512(float *out, const float *gate, const float *up, int N) {
    // out[N], gate[N], up[N]: silu(g) u = g / (1 + e^-g) u
    long nb = ((long)N + EW_BLOCK - 1) / EW_BLOCK;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long b = 0; b < nb; b++) {
            long i1 = (b + 1) * EW_BLOCK < N ? (b + 1) * EW_BLOCK : N;
            for (long i = b * EW_BLOCK; i < i1; i += 16) {
                __m512 g = ew_load(gate + i, i1 - i);
                __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                __m512 silu = avx512_div(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                ew_store(out + i, _mm512_mul_ps(silu, ew_load(up + i, i1 - i)), i1 - i);
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

EW512 void kern_swiglu_bwd_avx512(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                                  int N, int acc) {
    // dgate[N], dup[N], dout[N], gate[N], up[N]; silu'(g) = sig (1 + g (1 - sig))
    long nb = ((long)N + EW_BLOCK - 1) / EW_BLOCK;
    const __m512 one = _mm512_set1_ps(1.0f);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long b = 0; b < nb; b++) {
            long i1 = (b + 1) * EW_BLOCK < N ? (b + 1) * EW_BLOCK : N;
            for (long i = b * EW_BLOCK; i < i1; i += 16) {
                long m = i1 - i;
                __m512 g = ew_load(gate + i, m), u = ew_load(up + i, m), d = ew_load(dout + i, m);
                __m512 sig = avx512_div(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                __m512 dsilu = _mm512_mul_ps(sig, _mm512_add_ps(one, _mm512_mul_ps(g, _mm512_sub_ps(one, sig))));
                __m512 g0 = acc ? ew_load(dgate + i, m) : _mm512_setzero_ps(); /* acc 0: 0 + x, x's bits */
                __m512 u0 = acc ? ew_load(dup + i, m) : _mm512_setzero_ps();
                ew_store(dgate + i, _mm512_add_ps(g0, _mm512_mul_ps(_mm512_mul_ps(d, u), dsilu)), m);
                ew_store(dup + i, _mm512_add_ps(u0, _mm512_mul_ps(d, _mm512_mul_ps(g, sig))), m);
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* ------------------------------------------------------------------- geglu */

/* geglu is written once for every instruction set (geglu_vec.inc, against
 * elementwise_vec.inc's vector API); here that API for 16-lane zmm, masked
 * tails and halved divisions as everywhere in this file. */
#define EWV_FN EW512
#define EWV_INLINE EW_INLINE
#define EWV_NAME(x) x##_avx512
#define EWV_W 16
#define EWV_BLOCK EW_BLOCK
typedef __m512 ewv_t;

EW_INLINE ewv_t ewv_zero(void) { return _mm512_setzero_ps(); }
EW_INLINE ewv_t ewv_set1(float f) { return _mm512_set1_ps(f); }
EW_INLINE ewv_t ewv_load(const float *p) { return _mm512_loadu_ps(p); }
EW_INLINE void ewv_store(float *p, ewv_t v) { _mm512_storeu_ps(p, v); }
EW_INLINE ewv_t ewv_loadn(const float *p, long n) { return ew_load(p, n); }
EW_INLINE void ewv_storen(float *p, ewv_t v, long n) { ew_store(p, v, n); }
EW_INLINE ewv_t ewv_fill_tail(ewv_t v, long n, float f) { return _mm512_mask_blend_ps(lanes(n), _mm512_set1_ps(f), v); }
EW_INLINE ewv_t ewv_add(ewv_t a, ewv_t b) { return _mm512_add_ps(a, b); }
EW_INLINE ewv_t ewv_sub(ewv_t a, ewv_t b) { return _mm512_sub_ps(a, b); }
EW_INLINE ewv_t ewv_mul(ewv_t a, ewv_t b) { return _mm512_mul_ps(a, b); }
EW_INLINE ewv_t ewv_div(ewv_t a, ewv_t b) { return avx512_div(a, b); }
EW_INLINE ewv_t ewv_max(ewv_t a, ewv_t b) { return _mm512_max_ps(a, b); }
EW_INLINE ewv_t ewv_sqrt(ewv_t a) { return avx512_sqrt(a); }
EW_INLINE ewv_t ewv_fma(ewv_t a, ewv_t b, ewv_t c) { return _mm512_fmadd_ps(a, b, c); }
EW_INLINE ewv_t ewv_exp(ewv_t x) { return exp16(x); }
EW_INLINE ewv_t ewv_tanh(ewv_t x) { return tanh16(x); }
EW_INLINE float ewv_hsum(ewv_t v) { return _mm512_reduce_add_ps(v); }
EW_INLINE float ewv_hmax(ewv_t v) { return _mm512_reduce_max_ps(v); }

#include "kernels/cpu/geglu_vec.inc"

/* --------------------------------------------------------------------- add */

EW512 void kern_add_avx512(float *out, const float *a, const float *b, long N) {
    // out[N], a[N], b[N] (out may alias a)
    long nb = (N + EW_BLOCK - 1) / EW_BLOCK;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long k = 0; k < nb; k++) {
            long i1 = (k + 1) * EW_BLOCK < N ? (k + 1) * EW_BLOCK : N;
            for (long i = k * EW_BLOCK; i < i1; i += 16)
                ew_store(out + i, _mm512_add_ps(ew_load(a + i, i1 - i), ew_load(b + i, i1 - i)), i1 - i);
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* ----------------------------------------------------------- cross entropy */

#define CE_IGNORE (-100)

static void ew_ce_check_targets(const int32_t *targets, int N, int V) {
    for (int n = 0; n < N; n++) {
        int32_t t = targets[n];
        if (t != CE_IGNORE && (t < 0 || t >= V)) {
            fprintf(stderr, "ctitan: error: cross-entropy target %d outside [0,%d) and not -100\n", (int)t, V);
            abort();
        }
    }
}

/* Row max, four accumulators. The max of a set is exact whatever the order. */
EW_INLINE float ew_row_max(const float *x, long V) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    long i = 0;
    for (; i + 64 <= V; i += 64) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + i));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + i + 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(x + i + 32));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(x + i + 48));
    }
    for (; i < V; i += 16) m0 = _mm512_mask_max_ps(m0, lanes(V - i), m0, ew_load(x + i, V - i));
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

/* sum_i e^(x_i - maxv); when `store`, e^(x_i - maxv) is also written to dst. */
EW_INLINE float ew_row_expsum(float *dst, const float *x, long V, float maxv, int store) {
    __m512 vm = _mm512_set1_ps(maxv);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    long i = 0;
    for (; i + 64 <= V; i += 64) {
        __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), vm));
        __m512 e2 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 32), vm));
        __m512 e3 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 48), vm));
        s0 = _mm512_add_ps(s0, e0), s1 = _mm512_add_ps(s1, e1), s2 = _mm512_add_ps(s2, e2), s3 = _mm512_add_ps(s3, e3);
        if (store) {
            _mm512_storeu_ps(dst + i, e0), _mm512_storeu_ps(dst + i + 16, e1);
            _mm512_storeu_ps(dst + i + 32, e2), _mm512_storeu_ps(dst + i + 48, e3);
        }
    }
    for (; i < V; i += 16) {
        __mmask16 k = lanes(V - i);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(ew_load(x + i, V - i), vm)));
        s0 = _mm512_add_ps(s0, e);
        if (store) _mm512_mask_storeu_ps(dst + i, k, e);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

EW512 double kern_crossentropy_fwdbwd_avx512(float *logits, const int32_t *targets, int N, int V, float grad_scale,
                                             long *n_valid) {
    // logits[N,V] in: logits, out: (softmax - onehot) * grad_scale; targets[N]
    // Three passes over a row (600 KB at V = 151936, so L2-resident after the
    // first): max; e = exp(x - max) stored in place and summed; e * (1/sum) * scale.
    // The loss needs x[target], read before the row is overwritten.
    ew_ce_check_targets(targets, N, V);
    double *row_loss = ct_malloc64((size_t)(N > 0 ? N : 1) * sizeof(double)); // [N]
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
            float xt = x[tgt];
            float maxv = ew_row_max(x, V);
            float sum = ew_row_expsum(x, x, V, maxv, 1);
            row_loss[n] = -((xt - maxv) - logf(sum)); /* torch's log_softmax order */
            __m512 f = _mm512_set1_ps(1.0f / sum), sc = _mm512_set1_ps(grad_scale);
            for (long i = 0; i < V; i += 16)
                ew_store(x + i, _mm512_mul_ps(_mm512_mul_ps(ew_load(x + i, V - i), f), sc), V - i);
            x[tgt] -= grad_scale;
        }
        KERN_TRACE_EXIT(kt_);
    }
    double total = 0.0; /* serial, in row order: independent of the thread count */
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

EW512 double kern_crossentropy_fwd_avx512(float *losses, const float *logits, const int32_t *targets, int N, int V) {
    // losses[N], logits[N,V], targets[N]
    ew_ce_check_targets(targets, N, V);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = logits + (size_t)n * V;
            if (targets[n] == CE_IGNORE) {
                losses[n] = 0.0f;
                continue;
            }
            float maxv = ew_row_max(x, V);
            float sum = ew_row_expsum(NULL, x, V, maxv, 0);
            losses[n] = -((x[targets[n]] - maxv) - logf(sum));
        }
        KERN_TRACE_EXIT(kt_);
    }
    double total = 0.0;
    for (int n = 0; n < N; n++) total += losses[n];
    return total;
}

/* The vocabulary-parallel phases (op_crossentropy_vp_* in ops.h) on the row
 * helpers above. The max is exact; the sums differ from the reference by the
 * lane order and exp16; the target logit and the loss terms are the
 * reference's scalar expressions, so they match it given the same stats. */

EW512 void kern_crossentropy_vp_max_avx512(float *maxv, const float *logits, int N, int V) {
    // maxv[N], logits[N,V]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) maxv[n] = ew_row_max(logits + (size_t)n * V, V);
        KERN_TRACE_EXIT(kt_);
    }
}

EW512 void kern_crossentropy_vp_sums_avx512(float *sumexp, float *tlogit, const float *logits, const float *maxv,
                                            const int32_t *targets, int N, int V, int v0) {
    // sumexp[N], tlogit[N], logits[N,V], maxv[N] (global), targets[N] (global column ids)
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = logits + (size_t)n * V;
            sumexp[n] = ew_row_expsum(NULL, x, V, maxv[n], 0);
            int y = targets[n] - v0;
            tlogit[n] = targets[n] != CE_IGNORE && y >= 0 && y < V ? x[y] - maxv[n] : 0.0f;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

EW512 double kern_crossentropy_vp_grad_avx512(float *logits, const float *maxv, const float *sumexp,
                                              const float *tlogit, const int32_t *targets, int N, int V, int v0,
                                              float grad_scale, long *n_valid) {
    // logits[N,V] in: logits, out: dlogits * grad_scale; maxv, sumexp, tlogit [N] (global); targets[N]
    double total = op_crossentropy_vp_loss(sumexp, tlogit, targets, N, n_valid); /* the reference's own */
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            float *x = logits + (size_t)n * V;
            if (targets[n] == CE_IGNORE) {
                memset(x, 0, (size_t)V * sizeof(float));
                continue;
            }
            /* one pass: e^(x - max) (1/sum) scale, the reference's order */
            __m512 vm = _mm512_set1_ps(maxv[n]), f = _mm512_set1_ps(1.0f / sumexp[n]), sc = _mm512_set1_ps(grad_scale);
            for (long i = 0; i < V; i += 16) {
                __m512 e = exp16(_mm512_sub_ps(ew_load(x + i, V - i), vm));
                ew_store(x + i, _mm512_mul_ps(_mm512_mul_ps(e, f), sc), V - i);
            }
            int y = targets[n] - v0;
            if (y >= 0 && y < V) x[y] -= grad_scale;
        }
        KERN_TRACE_EXIT(kt_);
    }
    return total;
}

/* ------------------------------------------------------------------- adamw */

EW512 void kern_adamw_step_avx512(adamw_state *s, float *params, float *grads, float gscale, double lr,
                                  const adamw_hparams *h) {
    // params[n], grads[n], s->m[n], s->v[n]: one pass, each element read and written once
    // (grads: read as grads * gscale, the clipping pass's product, then zeroed).
    // The scalars come from adamw_begin_step, as in optim.c's adamw_step, and the
    // element-wise expression is that function's, operation for operation and without FMAs (the reference is built without contraction),
    // so the result is bit-identical to "ref".
    const adamw_scalars sc = adamw_begin_step(s, lr, h);
    const float decay = sc.decay, b1 = sc.b1, b2 = sc.b2, step_size = sc.step_size, bc2_sqrt = sc.bc2_sqrt,
                eps = sc.eps;
    const __m512 vdecay = _mm512_set1_ps(decay), vb2 = _mm512_set1_ps(b2);
    const __m512 omb1 = _mm512_set1_ps(1.0f - b1), omb2 = _mm512_set1_ps(1.0f - b2);
    const __m512 vstep = _mm512_set1_ps(step_size), vbc2 = _mm512_set1_ps(bc2_sqrt), veps = _mm512_set1_ps(eps);
    const __m512 vgs = _mm512_set1_ps(gscale);
    float *m = s->m, *v = s->v;
    long n = (long)s->n;
    long nb = (n + EW_BLOCK - 1) / EW_BLOCK;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel if (n >= ADAMW_PARALLEL_MIN) /* a small range: no second thread to wake (optim.h) */
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long b = 0; b < nb; b++) {
            long i1 = (b + 1) * EW_BLOCK < n ? (b + 1) * EW_BLOCK : n;
            for (long i = b * EW_BLOCK; i < i1; i += 16) {
                long k = i1 - i;
                __m512 g = _mm512_mul_ps(ew_load(grads + i, k), vgs), vm = ew_load(m + i, k), vv = ew_load(v + i, k);
                __m512 p = _mm512_mul_ps(ew_load(params + i, k), vdecay);
                vm = _mm512_add_ps(vm, _mm512_mul_ps(omb1, _mm512_sub_ps(g, vm)));
                vv = _mm512_add_ps(_mm512_mul_ps(vv, vb2), _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
                __m512 denom = _mm512_add_ps(avx512_div(avx512_sqrt(vv), vbc2), veps);
                p = _mm512_sub_ps(p, _mm512_mul_ps(vstep, avx512_div(vm, denom)));
                ew_store(m + i, vm, k);
                ew_store(v + i, vv, k);
                ew_store(params + i, p, k);
                ew_store(grads + i, _mm512_setzero_ps(), k);
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}
#endif /* __x86_64__ */
