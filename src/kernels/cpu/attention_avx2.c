/* kernels/cpu/attention_avx2.c: register-blocked flash attention for AVX2 +
 * FMA ("blocked_avx2"), same contract as op_attention_fwd/bwd (kernels/ops.h).
 *
 * Design. The algorithm of blocked_avx512 (attention_avx512.c) and of the
 * tiled reference: query blocks x 64-key tiles up to the diagonal, online
 * softmax, the backward recomputing P = exp(S - lse). AVX2 has 16 ymm
 * registers, not 32 zmm, so the register tile is the AVX2 GEMM's 6 x 16
 * (12 accumulators, 2 loads and 6 broadcasts per 12 FMAs) for every product:
 *   scores   S[6 rows][16 keys] = Q K^T per 16-key chunk of the tile, from the
 *            transposed K (2 loads of a key row of K^T per element of hd);
 *            chunks past the micro-block's last visible key are skipped, so
 *            the diagonal tiles cost at most 15 masked keys per row;
 *   P V      acc[6 rows][16 of hd] += P V, per key 2 loads of V and 6
 *            broadcasts of P;
 *   backward dP = dO V^T as the scores; dV[6 keys][16] += P^T dO and
 *            dK[6 keys][16] += dS^T Q with the keys' accumulators held across
 *            the tile's query rows (from the first row that sees the keys);
 *            dQ[6 rows][16] += dS K as P V.
 * Scores and probabilities of a micro-block go through a small L1 buffer
 * (6 x 64), since 6 rows x 64 keys do not fit in 16 registers. Query blocks
 * are 48 rows (8 micro-blocks of 6). Masked lanes (past the diagonal or the
 * sequence) get p = 0 and dS = 0, so the loops have no ragged edges inside a
 * tile; rows past the end of a partial block repeat the last row and are
 * never stored.
 *
 * Options (kern_attn_opt) as in blocked_avx512: a window starts the key loop
 * at the tile of the block's first visible key, masks lanes left of it,
 * skips the score chunks no row of a micro-block sees and narrows the key
 * products to the rows that see the keys; a soft cap uses tanh8 (avx2_util.h).
 *
 * Shapes: the register tiles cover hd in chunks of 16, so head dims that are
 * multiples of 16 (every Qwen3: 128) take this path; any other falls back to
 * tiled_avx2 ("tiled" compiled for AVX2, kernels/ref/attention.c), which has
 * the same contract.
 *
 * Determinism: forward work is split by (b, head, query block), backward by
 * (b, kv head) as in the tiled kernel, so each output element is summed by
 * one thread in a fixed order; results do not depend on the thread count.
 * They differ from "ref" by summation order and the vector exp (kern_check).
 * x86-64 only: the whole file compiles to nothing elsewhere. */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/err.h"
#include "kernels/cpu/avx2_util.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"

#define MR 6            /* query rows per micro-block */
#define BQ (8 * MR)     /* query rows per block: 48 */
#define BK 64           /* keys per tile (4 chunks of 16) */
#define KC 16           /* keys per score chunk, columns of hd per register tile: 2 ymm */

/* xt[(b * nkv + kh) * hd + i][j] = x[b, j, kh, i] for j < T, zero for T <= j < Tp:
 * every K (or V) head transposed once per call, so the score products read a
 * 16-key row of K^T with 2 loads, and no tile is re-transposed for every query
 * head and block that reads it. */
T256 static float *att2_transpose(const float *x, int B, int T, int nkv, int hd, int Tp) {
    // returns xt[B*nkv, hd, Tp]; x[B,T,nkv,hd]
    float *xt = ct_malloc((size_t)B * nkv * hd * Tp * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++) {
                float *dst = xt + ((size_t)b * nkv + kh) * hd * Tp;
                for (int j0 = 0; j0 < Tp; j0 += 16) { /* 16 keys at a time: 16 source rows stay in L1 */
                    int n = T - j0 < 16 ? (T - j0 > 0 ? T - j0 : 0) : 16;
                    for (int i = 0; i < hd; i++) {
                        float *d = dst + (size_t)i * Tp + j0;
                        for (int c = 0; c < n; c++) d[c] = x[(((size_t)b * T + j0 + c) * nkv + kh) * hd + i];
                        for (int c = n; c < 16; c++) d[c] = 0.0f;
                    }
                }
            }
        KERN_TRACE_EXIT(kt_);
    }
    return xt;
}

/* s[r*BK + 0:16] = sum_i x_r[i] kt[i * ldk + 0:16] for 6 rows x_r: one 6 x 16 score chunk,
 * stored to the micro-block's [MR, BK] buffer at column offset s. */
T256_INLINE void att2_dots6(float *s, const float *const x[MR], const float *kt, long ldk, int hd) {
    __m256 a[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i++) {
        const float *kr = kt + (size_t)i * ldk;
        __m256 k0 = _mm256_loadu_ps(kr), k1 = _mm256_loadu_ps(kr + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            __m256 b = _mm256_broadcast_ss(x[r] + i);
            a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(s + r * BK, a[r][0]);
        _mm256_storeu_ps(s + r * BK + 8, a[r][1]);
    }
}

/* acc_r[0:16] (+)= sum_{c < nc} w[r * BK + c] y_c[0:16] for 6 rows r, y_c = y + c * ys:
 * the P V and dS K products. acc rows at acc + r * as; `scale[r]` multiplies the
 * old acc first (the online softmax's rescaling; NULL: plain +=). */
T256_INLINE void att2_rows6_axpy(float *acc, long as, const float *scale, const float *w, const float *y, long ys,
                                 int nc) {
    __m256 a[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        a[r][0] = _mm256_loadu_ps(acc + r * as);
        a[r][1] = _mm256_loadu_ps(acc + r * as + 8);
        if (scale) {
            __m256 f = _mm256_set1_ps(scale[r]);
            a[r][0] = _mm256_mul_ps(a[r][0], f);
            a[r][1] = _mm256_mul_ps(a[r][1], f);
        }
    }
    for (int c = 0; c < nc; c++) {
        const float *yr = y + (size_t)c * ys;
        __m256 y0 = _mm256_loadu_ps(yr), y1 = _mm256_loadu_ps(yr + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            __m256 b = _mm256_broadcast_ss(w + r * BK + c);
            a[r][0] = _mm256_fmadd_ps(b, y0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, y1, a[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(acc + r * as, a[r][0]);
        _mm256_storeu_ps(acc + r * as + 8, a[r][1]);
    }
}

/* out_c[0:16] += sum_{r0 <= r < nr} w[r * BK + c0 + c] x_r[0:16] for KEYS keys c, x_r = x + r * xs:
 * the dV += P^T dO and dK += dS^T Q products, the keys' rows held in registers
 * across the tile's query rows. keys is a constant at every call (6, 4, 2, 1). */
T256_INLINE void att2_keys_axpy(float *out, long os, int keys, const float *w, int c0, const float *x, long xs,
                                int r0, int nr) {
    __m256 a[MR][2];
#pragma GCC unroll 6
    for (int c = 0; c < keys; c++) {
        a[c][0] = _mm256_loadu_ps(out + c * os);
        a[c][1] = _mm256_loadu_ps(out + c * os + 8);
    }
    for (int r = r0; r < nr; r++) {
        const float *xr = x + (size_t)r * xs;
        __m256 x0 = _mm256_loadu_ps(xr), x1 = _mm256_loadu_ps(xr + 8);
#pragma GCC unroll 6
        for (int c = 0; c < keys; c++) {
            __m256 b = _mm256_broadcast_ss(w + r * BK + c0 + c);
            a[c][0] = _mm256_fmadd_ps(b, x0, a[c][0]);
            a[c][1] = _mm256_fmadd_ps(b, x1, a[c][1]);
        }
    }
#pragma GCC unroll 6
    for (int c = 0; c < keys; c++) {
        _mm256_storeu_ps(out + c * os, a[c][0]);
        _mm256_storeu_ps(out + c * os + 8, a[c][1]);
    }
}

T256_INLINE float att2_dot(const float *x, const float *y, int n) {
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a);
    return avx2_hsum(a);
}

/* Lanes j of a 16-key chunk starting at key kc0 (of the tile) with lo <= kc0 + j < n, as a float blend mask
 * (lo = 0: the causal mask alone). */
T256_INLINE __m256 att2_keymask(int lo, int n, int kc0, int half) {
    return _mm256_castsi256_ps(_mm256_andnot_si256(avx2_lanes((long)lo - kc0 - 8 * half),
                                                   avx2_lanes((long)n - kc0 - 8 * half)));
}

T256 void kern_attention_fwd_avx2(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                  int T, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    // out[B,T,nh,hd], lse[B,nh,T], q[B,T,nh,hd], k[B,T,nkv,hd], v[B,T,nkv,hd]
    if (hd % KC) {
        op_attention_fwd_tiled_avx2(out, lse, q, k, v, B, T, nh, nkv, hd, opt);
        return;
    }
    int group = nh / nkv;
    int nqb = (T + BQ - 1) / BQ;
    float scale = opt && opt->scale != 0.0f ? opt->scale : 1.0f / sqrtf((float)hd);
    int window = opt && opt->window > 0 ? opt->window : 0;
    float cap = opt && opt->softcap > 0.0f ? opt->softcap : 0.0f;
    int qs = nh * hd, ks = nkv * hd; // row strides of q/out and k/v
    int Tp = (T + BK - 1) / BK * BK;
    float *KT = att2_transpose(k, B, T, nkv, hd, Tp); // [B*nkv, hd, Tp]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *acc = ct_malloc((size_t)BQ * hd * sizeof(float)); // [BQ, hd] unnormalised out
        float P[MR * BK];                                        // [MR, BK] scores, then probabilities
        float m[BQ], l[BQ], alpha[MR];                           // running max, sum; rescaling
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < nh; h++) {
                for (int qb = 0; qb < nqb; qb++) {
                    int kh = h / group, t0 = qb * BQ;
                    int nq = T - t0 < BQ ? T - t0 : BQ;
                    const float *qh = q + ((size_t)b * T * nh + h) * hd;      // row t at qh + t*qs
                    const float *kth = KT + ((size_t)b * nkv + kh) * hd * Tp; // [hd, Tp]
                    const float *vh = v + ((size_t)b * T * nkv + kh) * hd;
                    for (int r = 0; r < BQ; r++) m[r] = -INFINITY, l[r] = 0.0f;
                    memset(acc, 0, (size_t)BQ * hd * sizeof(float));
                    // from the tile of the first key the block sees (the window) up to the diagonal
                    for (int j0 = kern_attn_first_key(t0, window) / BK * BK; j0 < t0 + nq; j0 += BK) {
                        int nk = t0 + nq - j0 < BK ? t0 + nq - j0 : BK;
                        for (int r0 = 0; r0 < nq; r0 += MR) {
                            const float *x[MR];
                            int ncr[MR], clo[MR], ncmax = 0, cmin = BK; /* row r sees keys clo[r] <= c < ncr[r] */
#pragma GCC unroll 6
                            for (int r = 0; r < MR; r++) {
                                int rr = r0 + r < nq ? r0 + r : nq - 1; /* rows past T repeat the last */
                                x[r] = qh + (size_t)(t0 + rr) * qs;
                                int nc = t0 + rr - j0 + 1 < nk ? t0 + rr - j0 + 1 : nk; // keys j0..t
                                int c0 = kern_attn_first_key(t0 + rr, window) - j0;  // and from lo(t) on
                                clo[r] = c0 > 0 ? c0 : 0;
                                ncr[r] = nc > clo[r] ? nc : 0;
                                if (ncr[r] > ncmax) ncmax = ncr[r];
                                if (ncr[r] && clo[r] < cmin) cmin = clo[r];
                            }
                            if (!ncmax) continue;
                            /* score chunks ch0 <= ch < nch hold the visible keys */
                            int ch0 = cmin / KC, nch = (ncmax + KC - 1) / KC;
                            for (int ch = ch0; ch < nch; ch++) att2_dots6(P + ch * KC, x, kth + j0 + ch * KC, Tp, hd);
                            for (int r = 0; r < MR; r++) {
                                float *pr = P + r * BK;
                                __m256 mx = _mm256_set1_ps(-INFINITY), vsc = _mm256_set1_ps(scale);
                                for (int j = 2 * ch0; j < 2 * nch; j++) {
                                    __m256 mk = att2_keymask(clo[r], ncr[r], 0, j);
                                    __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                                _mm256_mul_ps(_mm256_loadu_ps(pr + 8 * j), vsc), mk);
                                    if (cap > 0.0f) { /* gemma: cap tanh(s / cap) */
                                        __m256 vc = _mm256_set1_ps(cap);
                                        s = _mm256_blendv_ps(s, _mm256_mul_ps(vc, tanh8(_mm256_div_ps(s, vc))), mk);
                                    }
                                    _mm256_storeu_ps(pr + 8 * j, s);
                                    mx = _mm256_max_ps(mx, s);
                                }
                                float bmax = avx2_hmax(mx);
                                float *mr = &m[r0 + r];
                                if (bmax == -INFINITY) { /* no key of this block: nothing changes */
                                    alpha[r] = 1.0f;
                                    memset(pr + ch0 * KC, 0, (size_t)(nch - ch0) * KC * sizeof(float));
                                    continue;
                                }
                                float mnew = bmax > *mr ? bmax : *mr;
                                alpha[r] = expf(*mr - mnew); // 0 on the first block (m = -inf)
                                __m256 vm = _mm256_set1_ps(mnew), sum = _mm256_setzero_ps();
                                for (int j = 2 * ch0; j < 2 * nch; j++) {
                                    __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + 8 * j), vm)); // masked: 0
                                    sum = _mm256_add_ps(sum, p);
                                    _mm256_storeu_ps(pr + 8 * j, p);
                                }
                                l[r0 + r] = l[r0 + r] * alpha[r] + avx2_hsum(sum);
                                *mr = mnew;
                            }
                            /* keys cmin.. only: the columns before it are masked in every row */
                            for (int c0 = 0; c0 < hd; c0 += KC)
                                att2_rows6_axpy(acc + (size_t)r0 * hd + c0, hd, alpha, P + cmin,
                                                vh + (size_t)(j0 + cmin) * ks + c0, ks, ncmax - cmin);
                        }
                    }
                    for (int r = 0; r < nq; r++) {
                        int t = t0 + r;
                        float *ot = out + ((size_t)b * T + t) * qs + (size_t)h * hd;
                        __m256 inv = _mm256_set1_ps(1.0f / l[r]);
                        for (int i = 0; i < hd; i += 8)
                            _mm256_storeu_ps(ot + i, _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)r * hd + i), inv));
                        lse[((size_t)b * nh + h) * T + t] = m[r] + logf(l[r]);
                    }
                }
            }
        }
        free(acc);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
}

T256 void kern_attention_bwd_avx2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                  const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                  int nh, int nkv, int hd, const kern_attn_opt *opt) {
    // dq[B,T,nh,hd], dk[B,T,nkv,hd], dv[B,T,nkv,hd], dout[B,T,nh,hd], out[B,T,nh,hd], lse[B,nh,T],
    // q[B,T,nh,hd], k[B,T,nkv,hd], v[B,T,nkv,hd]
    if (hd % KC) {
        op_attention_bwd_tiled_avx2(dq, dk, dv, dout, out, lse, q, k, v, B, T, nh, nkv, hd, opt);
        return;
    }
    int group = nh / nkv;
    int nqb = (T + BQ - 1) / BQ;
    float scale = opt && opt->scale != 0.0f ? opt->scale : 1.0f / sqrtf((float)hd);
    int window = opt && opt->window > 0 ? opt->window : 0;
    float cap = opt && opt->softcap > 0.0f ? opt->softcap : 0.0f;
    int qs = nh * hd, ks = nkv * hd;
    int Tp = (T + BK - 1) / BK * BK;
    float *KT = att2_transpose(k, B, T, nkv, hd, Tp); // [B*nkv, hd, Tp]
    float *VT = att2_transpose(v, B, T, nkv, hd, Tp); // [B*nkv, hd, Tp]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *P = ct_malloc((size_t)BQ * BK * sizeof(float));  // [BQ, BK] recomputed probs (0 where masked)
        float *dS = ct_malloc((size_t)BQ * BK * sizeof(float)); // [BQ, BK] scale * dscores (0 where masked)
        float D[BQ], L[BQ];
        // One thread per (b, kv head): it owns the dk/dv rows of that head and
        // the dq rows of the group's query heads, so every sum is its own.
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kh_ = k + ((size_t)b * T * nkv + kh) * hd; // row j at + j*ks
                const float *kth = KT + ((size_t)b * nkv + kh) * hd * Tp, *vth = VT + ((size_t)b * nkv + kh) * hd * Tp;
                float *dkh = dk + ((size_t)b * T * nkv + kh) * hd;
                float *dvh = dv + ((size_t)b * T * nkv + kh) * hd;
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    const float *qh = q + ((size_t)b * T * nh + h) * hd; // row t at + t*qs
                    const float *oh = out + ((size_t)b * T * nh + h) * hd;
                    const float *gh = dout + ((size_t)b * T * nh + h) * hd;
                    float *dqh = dq + ((size_t)b * T * nh + h) * hd;
                    for (int qb = 0; qb < nqb; qb++) {
                        int t0 = qb * BQ;
                        int nq = T - t0 < BQ ? T - t0 : BQ;
                        for (int r = 0; r < nq; r++) {
                            // D = rowsum(dout * out) = sum_j p_j dp_j
                            D[r] = att2_dot(gh + (size_t)(t0 + r) * qs, oh + (size_t)(t0 + r) * qs, hd);
                            L[r] = lse[((size_t)b * nh + h) * T + t0 + r];
                        }
                        // from the tile of the first key the block sees (the window) up to the diagonal
                        for (int j0 = kern_attn_first_key(t0, window) / BK * BK; j0 < t0 + nq; j0 += BK) {
                            int nk = t0 + nq - j0 < BK ? t0 + nq - j0 : BK;
                            /* keys cmm <= c < ncm visible to each micro-block (cmm = 0 without a window) */
                            int ncm[BQ / MR], cmm[BQ / MR];
                            for (int r0 = 0; r0 < nq; r0 += MR) {
                                const float *xq[MR], *xg[MR];
                                int ncr[MR], clo[MR], ncmax = 0, cmin = BK; /* row r: keys clo[r] <= c < ncr[r] */
#pragma GCC unroll 6
                                for (int r = 0; r < MR; r++) {
                                    int rr = r0 + r < nq ? r0 + r : nq - 1;
                                    xq[r] = qh + (size_t)(t0 + rr) * qs;
                                    xg[r] = gh + (size_t)(t0 + rr) * qs;
                                    int nc = t0 + rr - j0 + 1 < nk ? t0 + rr - j0 + 1 : nk;
                                    int c0 = kern_attn_first_key(t0 + rr, window) - j0;
                                    clo[r] = c0 > 0 ? c0 : 0;
                                    ncr[r] = r0 + r < nq && nc > clo[r] ? nc : 0; /* padded rows: all masked */
                                    if (ncr[r] > ncmax) ncmax = ncr[r];
                                    if (ncr[r] && clo[r] < cmin) cmin = clo[r];
                                }
                                ncm[r0 / MR] = ncmax;
                                cmm[r0 / MR] = window && ncmax ? cmin : 0;
                                float *pb = P + (size_t)r0 * BK, *db = dS + (size_t)r0 * BK;
                                int ch0 = cmm[r0 / MR] / KC, nch = (ncmax + KC - 1) / KC;
                                for (int ch = ch0; ch < nch; ch++) {
                                    att2_dots6(pb + ch * KC, xq, kth + j0 + ch * KC, Tp, hd);
                                    att2_dots6(db + ch * KC, xg, vth + j0 + ch * KC, Tp, hd); // dP = dout . v
                                }
                                __m256 vsc = _mm256_set1_ps(scale), vc = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f);
                                for (int r = 0; r < MR; r++) {
                                    int rr = r0 + r < nq ? r0 + r : nq - 1;
                                    __m256 vl = _mm256_set1_ps(L[rr]), vd = _mm256_set1_ps(D[rr]);
                                    float *pr = pb + (size_t)r * BK, *dr = db + (size_t)r * BK;
                                    for (int j = 2 * ch0; j < 2 * nch; j++) {
                                        __m256 mk = att2_keymask(clo[r], ncr[r], 0, j), p, ds;
                                        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(pr + 8 * j), vsc);
                                        if (cap > 0.0f) { /* s = cap tanh(x / cap), ds/dx = 1 - tanh^2 */
                                            __m256 th = tanh8(_mm256_div_ps(x, vc));
                                            p = _mm256_and_ps(mk, exp8(_mm256_sub_ps(_mm256_mul_ps(vc, th), vl)));
                                            ds = _mm256_mul_ps(
                                                _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dr + 8 * j), vd)),
                                                              _mm256_fnmadd_ps(th, th, one)),
                                                vsc);
                                        } else {
                                            p = _mm256_and_ps(mk, exp8(_mm256_sub_ps(x, vl)));
                                            ds = _mm256_mul_ps(
                                                _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dr + 8 * j), vd)), vsc);
                                        }
                                        _mm256_storeu_ps(pr + 8 * j, p);
                                        _mm256_storeu_ps(dr + 8 * j, ds);
                                    }
                                    /* chunks no row of the micro-block sees: zero for the key loops below */
                                    memset(pr, 0, (size_t)ch0 * KC * sizeof(float));
                                    memset(dr, 0, (size_t)ch0 * KC * sizeof(float));
                                    memset(pr + nch * KC, 0, (size_t)(BK - nch * KC) * sizeof(float));
                                    memset(dr + nch * KC, 0, (size_t)(BK - nch * KC) * sizeof(float));
                                }
                            }
                            // dv[j] += sum_t P[t,j] dout[t]; dk[j] += sum_t dS[t,j] q[t]; 6 keys at a time,
                            // each group over the query rows rs <= r < re that see one of its keys: from the
                            // first row that sees its first key, to the last that sees its last (a window)
                            for (int c0 = 0; c0 < hd; c0 += KC) {
                                const float *gx = gh + (size_t)t0 * qs + c0, *qx = qh + (size_t)t0 * qs + c0;
                                int c = 0;
                                while (c < nk) {
                                    int keys = nk - c >= 6 ? 6 : nk - c >= 4 ? 4 : nk - c >= 2 ? 2 : 1;
                                    int rs = j0 + c - t0 > 0 ? j0 + c - t0 : 0, re = nq;
                                    if (window) { /* row t sees key j iff j <= t < j + window */
                                        re = j0 + c + keys - 1 + window - t0;
                                        re = re < nq ? re : nq;
                                    }
                                    float *dvr = dvh + (size_t)(j0 + c) * ks + c0;
                                    float *dkr = dkh + (size_t)(j0 + c) * ks + c0;
                                    if (re <= rs) {
                                    } else if (keys == 6) {
                                        att2_keys_axpy(dvr, ks, 6, P, c, gx, qs, rs, re);
                                        att2_keys_axpy(dkr, ks, 6, dS, c, qx, qs, rs, re);
                                    } else if (keys == 4) {
                                        att2_keys_axpy(dvr, ks, 4, P, c, gx, qs, rs, re);
                                        att2_keys_axpy(dkr, ks, 4, dS, c, qx, qs, rs, re);
                                    } else if (keys == 2) {
                                        att2_keys_axpy(dvr, ks, 2, P, c, gx, qs, rs, re);
                                        att2_keys_axpy(dkr, ks, 2, dS, c, qx, qs, rs, re);
                                    } else {
                                        att2_keys_axpy(dvr, ks, 1, P, c, gx, qs, rs, re);
                                        att2_keys_axpy(dkr, ks, 1, dS, c, qx, qs, rs, re);
                                    }
                                    c += keys;
                                }
                            }
                            // dq[t] += sum_j dS[t,j] k[j]: 6 rows at a time over the keys the micro-block
                            // sees (whole micro-blocks: the rows past nq would write past T, so the last
                            // partial one runs row by row)
                            for (int r0 = 0; r0 < nq; r0 += MR) {
                                int ncmax = ncm[r0 / MR], cm = cmm[r0 / MR];
                                if (!ncmax) continue;
                                if (r0 + MR <= nq) {
                                    for (int c0 = 0; c0 < hd; c0 += KC)
                                        att2_rows6_axpy(dqh + (size_t)(t0 + r0) * qs + c0, qs, NULL,
                                                        dS + (size_t)r0 * BK + cm, kh_ + (size_t)(j0 + cm) * ks + c0,
                                                        ks, ncmax - cm);
                                    continue;
                                }
                                for (int r = r0; r < nq; r++) {
                                    float *dqr = dqh + (size_t)(t0 + r) * qs;
                                    const float *dr = dS + (size_t)r * BK;
                                    for (int c0 = 0; c0 < hd; c0 += 8) {
                                        __m256 a = _mm256_loadu_ps(dqr + c0);
                                        for (int c = cm; c < ncmax; c++)
                                            a = _mm256_fmadd_ps(_mm256_broadcast_ss(dr + c),
                                                                _mm256_loadu_ps(kh_ + (size_t)(j0 + c) * ks + c0), a);
                                        _mm256_storeu_ps(dqr + c0, a);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        free(P);
        free(dS);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
    free(VT);
}

#endif /* __x86_64__ */
