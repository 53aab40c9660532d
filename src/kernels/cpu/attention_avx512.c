/* kernels/cpu/attention_avx512.c: register-blocked flash attention for AVX-512
 * ("blocked_avx512"), same contract as op_attention_fwd/bwd (kernels/ops.h).
 *
 * Design. The algorithm is the tiled one (kernels/ref/attention.c: 32-query x
 * 64-key tiles up to the diagonal, online softmax, backward recomputing
 * P = exp(S - lse)); what changes is that every product inside a tile is a
 * small GEMM whose accumulators live in zmm registers instead of a row of
 * memory updated once per element of hd:
 *   scores   S[4 rows][64 keys] = Q K^T: 16 zmm accumulators; per element of
 *            hd one 64-key row of the transposed K tile (4 loads) and 4 query
 *            broadcasts feed 16 FMAs (the tiled kernel: 2 loads and a store
 *            per FMA);
 *   P V      acc[4 rows][64 of hd] += P V: 16 accumulators, per key 4 loads of
 *            V and 4 broadcasts of P for 16 FMAs;
 *   backward dP = dO V^T as the scores; dV[4 keys][64] += P^T dO and
 *            dK[4 keys][64] += dS^T Q with the keys' accumulators held across
 *            all query rows of the tile; dQ[4 rows][64] += dS K as P V.
 * Masked lanes (keys past the diagonal or the end of the sequence, or left
 * of a sliding window) get p = 0 / dS = 0, so the blocked loops need no
 * ragged edges inside a tile.
 *
 * Options (kern_attn_opt): the scale; a window starts the key loop at the
 * tile holding the block's first visible key (tiles left of it are never
 * touched), masks the partial tiles, and narrows the P V / dS K products to
 * the columns some row of a micro-block sees and the dV / dK products to the
 * query rows that see the keys; a soft cap goes through the vector tanh
 * (avx512_util.h) with d tanh = 1 - tanh^2 in the backward.
 *
 * Shapes: the register tiles cover hd in chunks of 64, so head dims that are
 * multiples of 64 (64, 128, 256: every Qwen3) take this path; any other hd
 * falls back to the tiled AVX-512 kernel, which has the same contract.
 *
 * The forward's softmax runs a micro-block's rows in three sweeps (max; the
 * scalar expf of each rescaling; exp and sum), and its last tile of a block
 * prefetches the block's out rows during its P V, as blocked_avx2 does: the
 * same bits, W3's forward -8 to -10% (docs/benchmarks.md).
 *
 * Determinism: forward work is split by (b, head, query block), backward by
 * (b, kv head) as in the tiled kernel, so each output element is summed by
 * one thread in a fixed order; results do not depend on the thread count.
 * They differ from "ref" by summation order and the vector exp (kern_check). */
#if defined(__x86_64__) /* x86-64 only, the whole file (aarch64: the _neon files) */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/err.h"
#include "kernels/cpu/avx512_util.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"

#define A512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define A_INLINE A512 __attribute__((always_inline)) static inline

#define BQ 32 /* query rows per tile (8 micro-blocks of 4) */
#define BK 64 /* keys per tile: 4 zmm */
#define HC 64 /* columns of hd per register tile: 4 zmm */

/* Lanes c (of 64, in 4 masks of 16) with c < n. */
A_INLINE __mmask16 att_lanes(int n, int j) {
    int m = n - 16 * j;
    return m >= 16 ? (__mmask16)0xFFFF : m <= 0 ? (__mmask16)0 : (__mmask16)((1u << m) - 1u);
}
/* Lanes c with lo <= c < n (lo = 0: att_lanes). */
A_INLINE __mmask16 att_lanes2(int lo, int n, int j) { return att_lanes(n, j) & (__mmask16)~att_lanes(lo, j); }

/* Every K (or V) head transposed once per call, tile by tile: tile jt of head
 * (b, kh) is [hd][BK] at xt + ((b * nkv + kh) * Tp + jt * BK) * hd, element
 * [i][c] = x[b, jt * BK + c, kh, i] for keys < T, zero past T. The score products
 * read a 64-key row of a tile with 4 loads, and no tile is re-transposed for every
 * query head and block that reads it. Tile-major, so a tile is 32 KB in one piece
 * (hd 128): with rows Tp floats apart (1 KB at T = 256) its 128 rows fell into 16
 * of L1's 64 sets, 32 rows for 12 ways, and the tile was re-read from L2 by every
 * micro-block. */
A512 static float *att_transpose(const float *x, int B, int T, int nkv, int hd, int Tp) {
    // returns xt[B*nkv, Tp/BK, hd, BK]; x[B,T,nkv,hd]
    float *xt = ct_malloc((size_t)B * nkv * hd * Tp * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++) {
                float *dst = xt + ((size_t)b * nkv + kh) * hd * Tp;
                for (int j0 = 0; j0 < Tp; j0 += 16) { /* 16 keys x 16 of hd: one in-register transpose */
                    int n = T - j0 < 16 ? (T - j0 > 0 ? T - j0 : 0) : 16;
                    float *tile = dst + (size_t)(j0 / BK) * BK * hd + j0 % BK;
                    for (int i0 = 0; i0 < hd; i0 += 16) { /* hd is a multiple of HC here */
                        __m512 r[16];
                        #pragma GCC unroll 16
                        for (int c = 0; c < 16; c++) /* keys past T: zeros, read from a valid address */
                            r[c] = _mm512_maskz_loadu_ps(c < n ? (__mmask16)0xFFFF : (__mmask16)0,
                                                         x + (((size_t)b * T + (c < n ? j0 + c : 0)) * nkv + kh) * hd + i0);
                        transpose16(r);
                        #pragma GCC unroll 16
                        for (int i = 0; i < 16; i++) _mm512_storeu_ps(tile + (size_t)(i0 + i) * BK, r[i]);
                    }
                }
            }
        KERN_TRACE_EXIT(kt_);
    }
    return xt;
}

/* dst[t * hd + i] = x[t * xs + i] for t < T: one head's rows, contiguous.
 * The model's layout puts a head's consecutive rows nkv * hd or nh * hd
 * floats apart (4 or 8 KB for Qwen3's hd 128), so the 32-64 rows a tile
 * walks all fall in the same few L1 sets and thrash the 12 ways; read from a
 * contiguous copy they stay in L1. */
A512 static void att_rows_in(float *dst, const float *x, long xs, int T, int hd) {
    for (int t = 0; t < T; t++) memcpy(dst + (size_t)t * hd, x + (size_t)t * xs, (size_t)hd * sizeof(float));
}

/* vh[(b * nkv + kh) * T + j][i] = v[b, j, kh, i]: every V head's rows contiguous
 * (att_rows_in), for the forward's P V product. */
A512 static float *att_heads(const float *v, int B, int T, int nkv, int hd) {
    float *vh = ct_malloc((size_t)B * nkv * T * hd * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++)
                att_rows_in(vh + ((size_t)b * nkv + kh) * T * hd, v + ((size_t)b * T * nkv + kh) * hd, (long)nkv * hd,
                            T, hd);
        KERN_TRACE_EXIT(kt_);
    }
    return vh;
}

/* s[r][j] (16 lanes each, 64 keys) = sum_i x_r[i] kt[i * ldk + 16 j + lane] for 4 rows x_r. */
A_INLINE void att_dots4_n(__m512 s[4][4], const float *const x[4], const float *kt, long ldk, int hd, int nch) {
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) s[r][j] = _mm512_setzero_ps();
    for (int i = 0; i < hd; i++) {
        const float *kr = kt + (size_t)i * ldk;
        __m512 k[4];
        #pragma GCC unroll 4
        for (int j = 0; j < nch; j++) k[j] = _mm512_loadu_ps(kr + 16 * j);
        #pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m512 b = _mm512_set1_ps(x[r][i]);
            #pragma GCC unroll 4
            for (int j = 0; j < nch; j++) s[r][j] = _mm512_fmadd_ps(b, k[j], s[r][j]);
        }
    }
}
/* The same over the first `keys` of the 64 (rounded up to 16): on the diagonal a
 * micro-block sees 4-64 keys of its tile, and the lanes past them are masked
 * whatever their scores, so the chunks past them are left at zero (T = 256:
 * ~20% of the score products were of such lanes). Each call is a constant
 * chunk count, so the loops unroll into registers. */
A_INLINE void att_dots4(__m512 s[4][4], const float *const x[4], const float *kt, long ldk, int hd, int keys) {
    switch ((keys + 15) / 16) {
    case 1: att_dots4_n(s, x, kt, ldk, hd, 1); break;
    case 2: att_dots4_n(s, x, kt, ldk, hd, 2); break;
    case 3: att_dots4_n(s, x, kt, ldk, hd, 3); break;
    default: att_dots4_n(s, x, kt, ldk, hd, 4); break;
    }
}

/* acc_r[0:HC] (+)= sum_{c < nc} w[r * BK + c] y_c[0:HC] for 4 rows r, y_c = y + c * ys:
 * the P V and dS K products. acc rows at acc + r * as; `scale[r]` multiplies the
 * old acc first (the online softmax's rescaling; NULL: plain +=). */
A_INLINE void att_rows4_axpy(float *acc, long as, const float *scale, const float *w, const float *y, long ys,
                             int nc) {
    __m512 a[4][4];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        __m512 f = scale ? _mm512_set1_ps(scale[r]) : _mm512_set1_ps(1.0f);
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            a[r][j] = _mm512_loadu_ps(acc + r * as + 16 * j);
            if (scale) a[r][j] = _mm512_mul_ps(a[r][j], f);
        }
    }
    for (int c = 0; c < nc; c++) {
        const float *yr = y + (size_t)c * ys;
        __m512 y0 = _mm512_loadu_ps(yr), y1 = _mm512_loadu_ps(yr + 16), y2 = _mm512_loadu_ps(yr + 32),
               y3 = _mm512_loadu_ps(yr + 48);
        #pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m512 b = _mm512_set1_ps(w[r * BK + c]);
            a[r][0] = _mm512_fmadd_ps(b, y0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(b, y1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(b, y2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(b, y3, a[r][3]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + r * as + 16 * j, a[r][j]);
}

/* out_c[0:HC] += sum_{r < nr} w[r * BK + c] x_r[0:HC] for KEYS keys c = c0.., x_r = x + r * xs:
 * the dV += P^T dO and dK += dS^T Q products, the keys' rows held in registers
 * across all query rows of the tile. */
A_INLINE void att_keys_axpy(float *out, long os, int keys, const float *w, int c0, const float *x, long xs, int nr) {
    __m512 a[4][4];
    #pragma GCC unroll 4
    for (int c = 0; c < keys; c++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) a[c][j] = _mm512_loadu_ps(out + c * os + 16 * j);
    for (int r = 0; r < nr; r++) {
        const float *xr = x + (size_t)r * xs;
        __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16), x2 = _mm512_loadu_ps(xr + 32),
               x3 = _mm512_loadu_ps(xr + 48);
        #pragma GCC unroll 4
        for (int c = 0; c < keys; c++) {
            __m512 b = _mm512_set1_ps(w[r * BK + c0 + c]);
            a[c][0] = _mm512_fmadd_ps(b, x0, a[c][0]);
            a[c][1] = _mm512_fmadd_ps(b, x1, a[c][1]);
            a[c][2] = _mm512_fmadd_ps(b, x2, a[c][2]);
            a[c][3] = _mm512_fmadd_ps(b, x3, a[c][3]);
        }
    }
    #pragma GCC unroll 4
    for (int c = 0; c < keys; c++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + c * os + 16 * j, a[c][j]);
}

A_INLINE float att_dot(const float *x, const float *y, int n) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), a);
    return _mm512_reduce_add_ps(a);
}

A512 void kern_attention_fwd_avx512(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                    int T, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    // out[B,T,nh,hd], lse[B,nh,T], q[B,T,nh,hd], k[B,T,nkv,hd], v[B,T,nkv,hd]
    if (hd % HC) {
        op_attention_fwd_tiled_avx512(out, lse, q, k, v, B, T, nh, nkv, hd, opt);
        return;
    }
    int group = nh / nkv;
    int nqb = (T + BQ - 1) / BQ;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int qs = nh * hd; // row stride of q and out
    int Tp = (T + BK - 1) / BK * BK;
    float *KT = att_transpose(k, B, T, nkv, hd, Tp); // [B*nkv, Tp/BK, hd, BK]
    float *VH = att_heads(v, B, T, nkv, hd);         // [B*nkv, T, hd]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *acc = ct_malloc((size_t)BQ * hd * sizeof(float)); // [BQ, hd] unnormalised out
        float P[BQ * BK];                                        // [BQ, BK] probabilities of the tile
        float m[BQ], l[BQ], alpha[BQ];                           // running max, sum; rescaling
        int mbc[BQ / 4][2];                                      // per micro-block: first, end key column
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < nh; h++) {
                for (int qb = 0; qb < nqb; qb++) {
                    int kh = h / group, t0 = qb * BQ;
                    int nq = T - t0 < BQ ? T - t0 : BQ;
                    const float *qh = q + ((size_t)b * T * nh + h) * hd; // row t at qh + t*qs
                    const float *kth = KT + ((size_t)b * nkv + kh) * hd * Tp; // tile at + j0*hd
                    const float *vh = VH + ((size_t)b * nkv + kh) * T * hd; // row j at vh + j*hd
                    for (int r = 0; r < BQ; r++) m[r] = -INFINITY, l[r] = 0.0f;
                    memset(acc, 0, (size_t)BQ * hd * sizeof(float));
                    // from the tile of the first key the block sees (the window) up to the diagonal
                    for (int j0 = kern_attn_first_key(t0, window) / BK * BK; j0 < t0 + nq; j0 += BK) {
                        int nk = t0 + nq - j0 < BK ? t0 + nq - j0 : BK;
                        /* Two passes over the tile's micro-blocks: every score row first (the
                         * K tile, 32 KB at hd 128, stays in L1 across them), then every P V
                         * (the V tile stays in L1). One pass per micro-block needed both
                         * tiles at once, more than L1's 48 KB, and re-read them from L2. */
                        for (int r0 = 0; r0 < nq; r0 += 4) {
                            const float *x[4];
                            int ncr[4], clo[4], ncmax = 0, cmin = BK; /* row r sees keys clo[r] <= c < ncr[r] */
                            #pragma GCC unroll 4
                            for (int r = 0; r < 4; r++) {
                                int rr = r0 + r < nq ? r0 + r : nq - 1; /* rows past T repeat the last */
                                x[r] = qh + (size_t)(t0 + rr) * qs;
                                int nc = t0 + rr - j0 + 1 < nk ? t0 + rr - j0 + 1 : nk; // keys j0..t
                                int c0 = kern_attn_first_key(t0 + rr, window) - j0;  // and from lo(t) on
                                clo[r] = c0 > 0 ? c0 : 0;
                                ncr[r] = nc > clo[r] ? nc : 0;
                                if (ncr[r] > ncmax) ncmax = ncr[r];
                                if (ncr[r] && clo[r] < cmin) cmin = clo[r];
                            }
                            mbc[r0 / 4][0] = cmin;
                            mbc[r0 / 4][1] = ncmax;
                            if (!ncmax) continue;
                            __m512 s[4][4];
                            att_dots4(s, x, kth + (size_t)j0 * hd, BK, hd, ncmax);
                            /* The online softmax in three sweeps over the micro-block's rows:
                             * the scaled, masked scores to P and each row's max; the new maxima
                             * and the scalar expf of each rescaling; then the exp pass and the
                             * sums. Row by row, each expf call came with the other rows' 12 score
                             * registers live across it (a call clobbers every zmm), so they were
                             * spilled and reloaded around every call. The same operations in the
                             * same order per row: the same bits. */
                            float bmax[4];
                            #pragma GCC unroll 4
                            for (int r = 0; r < 4; r++) {
                                __m512 mx = _mm512_set1_ps(-INFINITY);
                                #pragma GCC unroll 4
                                for (int j = 0; j < 4; j++) {
                                    __mmask16 mk = att_lanes2(clo[r], ncr[r], j);
                                    __m512 vs = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mk, s[r][j],
                                                                   _mm512_set1_ps(scale));
                                    if (cap > 0.0f) { /* gemma: cap tanh(s / cap) */
                                        __m512 vc = _mm512_set1_ps(cap);
                                        vs = _mm512_mask_mul_ps(vs, mk, vc, tanh16(_mm512_div_ps(vs, vc)));
                                    }
                                    mx = _mm512_max_ps(mx, vs);
                                    _mm512_storeu_ps(P + (r0 + r) * BK + 16 * j, vs);
                                }
                                bmax[r] = _mm512_reduce_max_ps(mx);
                            }
                            for (int r = 0; r < 4; r++) {
                                float *mr = &m[r0 + r];
                                if (bmax[r] == -INFINITY) { /* no key of this block: nothing changes */
                                    alpha[r0 + r] = 1.0f;
                                    continue;
                                }
                                float mnew = bmax[r] > *mr ? bmax[r] : *mr;
                                alpha[r0 + r] = expf(*mr - mnew); // 0 on the first block (m = -inf)
                                *mr = mnew;
                            }
                            #pragma GCC unroll 4
                            for (int r = 0; r < 4; r++) {
                                float *pr = P + (r0 + r) * BK;
                                if (bmax[r] == -INFINITY) {
                                    memset(pr, 0, BK * sizeof(float));
                                    continue;
                                }
                                __m512 vm = _mm512_set1_ps(m[r0 + r]), sum = _mm512_setzero_ps();
                                #pragma GCC unroll 4
                                for (int j = 0; j < 4; j++) {
                                    /* masked lanes: e^-inf = 0 */
                                    __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(pr + 16 * j), vm));
                                    sum = _mm512_add_ps(sum, p);
                                    _mm512_storeu_ps(pr + 16 * j, p);
                                }
                                l[r0 + r] = l[r0 + r] * alpha[r0 + r] + _mm512_reduce_add_ps(sum);
                            }
                        }
                        int last = j0 + BK >= t0 + nq;
                        for (int r0 = 0; r0 < nq; r0 += 4) {
                            int cmin = mbc[r0 / 4][0], ncmax = mbc[r0 / 4][1];
                            /* the last tile prefetches the block's out rows (qs floats apart, a
                             * page each, cold) ahead of the stores below, as blocked_avx2 does */
                            if (last)
                                for (int r = r0; r < r0 + 4 && r < nq; r++) {
                                    const float *orow = out + ((size_t)b * T + t0 + r) * qs + (size_t)h * hd;
                                    for (int i = 0; i < hd; i += 16) __builtin_prefetch(orow + i, 1, 3);
                                }
                            if (!ncmax) continue;
                            /* keys cmin.. only: the columns before it are masked in every row */
                            for (int c0 = 0; c0 < hd; c0 += HC)
                                att_rows4_axpy(acc + (size_t)r0 * hd + c0, hd, alpha + r0, P + (size_t)r0 * BK + cmin,
                                               vh + (size_t)(j0 + cmin) * hd + c0, hd, ncmax - cmin);
                        }
                    }
                    for (int r = 0; r < nq; r++) {
                        int t = t0 + r;
                        float *ot = out + ((size_t)b * T + t) * qs + (size_t)h * hd;
                        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
                        for (int i = 0; i < hd; i += 16)
                            _mm512_storeu_ps(ot + i, _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * hd + i), inv));
                        lse[((size_t)b * nh + h) * T + t] = m[r] + logf(l[r]);
                    }
                }
            }
        }
        free(acc);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
    free(VH);
}

A512 void kern_attention_bwd_avx512(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                    const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                    int nh, int nkv, int hd, const kern_attn_opt *opt) {
    // dq[B,T,nh,hd], dk[B,T,nkv,hd], dv[B,T,nkv,hd], dout[B,T,nh,hd], out[B,T,nh,hd], lse[B,nh,T],
    // q[B,T,nh,hd], k[B,T,nkv,hd], v[B,T,nkv,hd]
    if (hd % HC) {
        op_attention_bwd_tiled_avx512(dq, dk, dv, dout, out, lse, q, k, v, B, T, nh, nkv, hd, opt);
        return;
    }
    int group = nh / nkv;
    int nqb = (T + BQ - 1) / BQ;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int qs = nh * hd, ks = nkv * hd;
    int Tp = (T + BK - 1) / BK * BK;
    float *KT = att_transpose(k, B, T, nkv, hd, Tp); // [B*nkv, Tp/BK, hd, BK]
    float *VT = att_transpose(v, B, T, nkv, hd, Tp); // [B*nkv, Tp/BK, hd, BK]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *P = ct_malloc((size_t)BQ * BK * sizeof(float));  // [BQ, BK] recomputed probs (0 where masked)
        float *dS = ct_malloc((size_t)BQ * BK * sizeof(float)); // [BQ, BK] scale * dscores (0 where masked)
        float D[BQ], L[BQ];
        /* the rows the products stream, contiguous (att_rows_in): k of the kv
         * head (dS K reads 64 of them per tile), q and dout of the query head
         * (dV and dK read 32 per tile). The outputs are 4 rows at a time and stay
         * in place. */
        float *KS = ct_malloc((size_t)3 * T * hd * sizeof(float));
        float *QS = KS + (size_t)T * hd, *GS = QS + (size_t)T * hd;
        // One thread per (b, kv head): it owns the dk/dv rows of that head and
        // the dq rows of the group's query heads, so every sum is its own.
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kth = KT + ((size_t)b * nkv + kh) * hd * Tp, *vth = VT + ((size_t)b * nkv + kh) * hd * Tp;
                const float *kh_ = KS; // row j at + j*hd
                float *dkh = dk + ((size_t)b * T * nkv + kh) * hd; // row j at + j*ks
                float *dvh = dv + ((size_t)b * T * nkv + kh) * hd;
                att_rows_in(KS, k + ((size_t)b * T * nkv + kh) * hd, ks, T, hd);
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    const float *oh = out + ((size_t)b * T * nh + h) * hd; // row t at + t*qs
                    const float *qh = QS, *gh = GS; // row t at + t*hd
                    float *dqh = dq + ((size_t)b * T * nh + h) * hd; // row t at + t*qs
                    att_rows_in(QS, q + ((size_t)b * T * nh + h) * hd, qs, T, hd);
                    att_rows_in(GS, dout + ((size_t)b * T * nh + h) * hd, qs, T, hd);
                    for (int qb = 0; qb < nqb; qb++) {
                        int t0 = qb * BQ;
                        int nq = T - t0 < BQ ? T - t0 : BQ;
                        for (int r = 0; r < nq; r++) {
                            // D = rowsum(dout * out) = sum_j p_j dp_j
                            D[r] = att_dot(gh + (size_t)(t0 + r) * hd, oh + (size_t)(t0 + r) * qs, hd);
                            L[r] = lse[((size_t)b * nh + h) * T + t0 + r];
                        }
                        // from the tile of the first key the block sees (the window) up to the diagonal
                        for (int j0 = kern_attn_first_key(t0, window) / BK * BK; j0 < t0 + nq; j0 += BK) {
                            int nk = t0 + nq - j0 < BK ? t0 + nq - j0 : BK;
                            int cmb[BQ / 4]; /* first key column a micro-block sees (0 without a window) */
                            int ceb[BQ / 4]; /* and the end of the columns it sees (the diagonal) */
                            for (int r0 = 0; r0 < nq; r0 += 4) {
                                const float *xq[4], *xg[4];
                                int ncr[4], clo[4], cmin = BK; /* row r sees keys clo[r] <= c < ncr[r] */
                                #pragma GCC unroll 4
                                for (int r = 0; r < 4; r++) {
                                    int rr = r0 + r < nq ? r0 + r : nq - 1;
                                    xq[r] = qh + (size_t)(t0 + rr) * hd;
                                    xg[r] = gh + (size_t)(t0 + rr) * hd;
                                    int nc = t0 + rr - j0 + 1 < nk ? t0 + rr - j0 + 1 : nk;
                                    int c0 = kern_attn_first_key(t0 + rr, window) - j0;
                                    clo[r] = c0 > 0 ? c0 : 0;
                                    ncr[r] = r0 + r < nq && nc > clo[r] ? nc : 0; /* padded rows: all masked */
                                    if (ncr[r] && clo[r] < cmin) cmin = clo[r];
                                }
                                cmb[r0 / 4] = window ? cmin : 0;
                                ceb[r0 / 4] = 0;
                                if (cmin == BK) { /* no row sees a key of this tile (a window): P = dS = 0 */
                                    memset(P + (size_t)r0 * BK, 0, 4 * BK * sizeof(float));
                                    memset(dS + (size_t)r0 * BK, 0, 4 * BK * sizeof(float));
                                    continue;
                                }
                                __m512 s[4][4], dp[4][4];
                                int ncm = 0; /* keys any row of the micro-block sees */
                                #pragma GCC unroll 4
                                for (int r = 0; r < 4; r++) ncm = ncr[r] > ncm ? ncr[r] : ncm;
                                ceb[r0 / 4] = ncm;
                                att_dots4(s, xq, kth + (size_t)j0 * hd, BK, hd, ncm);
                                att_dots4(dp, xg, vth + (size_t)j0 * hd, BK, hd, ncm); // dP = dout . v
                                #pragma GCC unroll 4
                                for (int r = 0; r < 4; r++) {
                                    int rr = r0 + r < nq ? r0 + r : nq - 1;
                                    __m512 vl = _mm512_set1_ps(L[rr]), vd = _mm512_set1_ps(D[rr]);
                                    __m512 vsc = _mm512_set1_ps(scale);
                                    #pragma GCC unroll 4
                                    for (int j = 0; j < 4; j++) {
                                        __mmask16 mk = att_lanes2(clo[r], ncr[r], j);
                                        __m512 p, ds;
                                        if (cap > 0.0f) { /* s = cap tanh(x / cap), ds/dx = 1 - tanh^2 */
                                            __m512 vc = _mm512_set1_ps(cap);
                                            __m512 th = tanh16(_mm512_div_ps(_mm512_mul_ps(s[r][j], vsc), vc));
                                            p = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_mul_ps(vc, th), vl)));
                                            ds = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(dp[r][j], vd)),
                                                                             _mm512_fnmadd_ps(th, th, _mm512_set1_ps(1.0f))),
                                                               vsc);
                                        } else {
                                            p = _mm512_maskz_mov_ps(
                                                mk, exp16(_mm512_sub_ps(_mm512_mul_ps(s[r][j], vsc), vl)));
                                            ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(dp[r][j], vd)), vsc);
                                        }
                                        _mm512_storeu_ps(P + (size_t)(r0 + r) * BK + 16 * j, p);
                                        _mm512_storeu_ps(dS + (size_t)(r0 + r) * BK + 16 * j, ds);
                                    }
                                }
                            }
                            // dv[j] += sum_t P[t,j] dout[t]; dk[j] += sum_t dS[t,j] q[t]; 4 keys at a time,
                            // over the query rows rs <= r < re that can see them (all rows without a window)
                            for (int c0 = 0; c0 < hd; c0 += HC) {
                                int c = 0;
                                for (; c < nk;) {
                                    int keys = c + 4 <= nk ? 4 : 1;
                                    /* row t sees key j iff j <= t (< j + window): the rows above the
                                     * diagonal hold P = dS = 0 and are skipped */
                                    int rs = j0 + c - t0 > 0 ? j0 + c - t0 : 0, re = nq;
                                    if (window) {
                                        re = j0 + c + keys - 1 + window - t0;
                                        re = re < nq ? re : nq;
                                    }
                                    if (re > rs) {
                                        const float *pw = P + (size_t)rs * BK, *sw = dS + (size_t)rs * BK;
                                        const float *gx = gh + (size_t)(t0 + rs) * hd + c0;
                                        const float *qx = qh + (size_t)(t0 + rs) * hd + c0;
                                        float *dvr = dvh + (size_t)(j0 + c) * ks + c0, *dkr = dkh + (size_t)(j0 + c) * ks + c0;
                                        if (keys == 4) {
                                            att_keys_axpy(dvr, ks, 4, pw, c, gx, hd, re - rs);
                                            att_keys_axpy(dkr, ks, 4, sw, c, qx, hd, re - rs);
                                        } else {
                                            att_keys_axpy(dvr, ks, 1, pw, c, gx, hd, re - rs);
                                            att_keys_axpy(dkr, ks, 1, sw, c, qx, hd, re - rs);
                                        }
                                    }
                                    c += keys;
                                }
                            }
                            // dq[t] += sum_j dS[t,j] k[j]: 4 rows at a time (whole micro-blocks: the
                            // rows past nq would write past T, so the last partial one runs row by row),
                            // over the keys cm.. some row of the micro-block sees
                            for (int r0 = 0; r0 < nq; r0 += 4) {
                                int cm = cmb[r0 / 4], ce = ceb[r0 / 4]; /* keys past ce: dS = 0 */
                                if (cm >= ce) continue;
                                if (r0 + 4 <= nq) {
                                    for (int c0 = 0; c0 < hd; c0 += HC)
                                        att_rows4_axpy(dqh + (size_t)(t0 + r0) * qs + c0, qs, NULL,
                                                       dS + (size_t)r0 * BK + cm, kh_ + (size_t)(j0 + cm) * hd + c0,
                                                       hd, ce - cm);
                                    continue;
                                }
                                for (int r = r0; r < nq; r++) {
                                    float *dqr = dqh + (size_t)(t0 + r) * qs;
                                    const float *dr = dS + (size_t)r * BK;
                                    for (int c0 = 0; c0 < hd; c0 += 16) {
                                        __m512 a = _mm512_loadu_ps(dqr + c0);
                                        for (int c = cm; c < ce; c++)
                                            a = _mm512_fmadd_ps(_mm512_set1_ps(dr[c]),
                                                                _mm512_loadu_ps(kh_ + (size_t)(j0 + c) * hd + c0), a);
                                        _mm512_storeu_ps(dqr + c0, a);
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
        free(KS);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
    free(VT);
}
#endif /* __x86_64__ */
