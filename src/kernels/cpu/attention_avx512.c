/* kernels/cpu/attention_avx512.c: register-blocked flash attention for AVX-512
 * ("blocked_avx512"), same contract as op_attention_fwd/bwd (kernels/ops.h),
 * and its build with vdpbf16ps products for bf16 runs ("blocked_avx512bf16",
 * "bf16 products" below).
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
 * The backward's tiles are 64 queries tall (BQB), so each dK / dV register
 * tile is loaded and stored once per 64 query rows, and it sums dq, dk and dv
 * in contiguous copies of their rows, as blocked_avx2 does (in place their
 * rows are 4-8 KB apart, in a few L1 sets): at T = 2048 the backward -11 to
 * -13% on an Intel Xeon, level at T = 256, the same bits, as each sum keeps
 * its order (docs/benchmarks.md).
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
 * Block form (ops.h, kern_attn_blk: ring attention): att_fwd_body / att_bwd_body are
 * written for a block of keys at k0 against query rows at q0, strided in place; the
 * offset form is the block with k0 = 0, unstrided, started from m = -inf and finished
 * (the same operations as before: the same bits).
 *
 * Determinism: forward work is split by (b, head, query block), backward by
 * (b, kv head) as in the tiled kernel, so each output element is summed by
 * one thread in a fixed order; results do not depend on the thread count.
 * They differ from "ref" by summation order and the vector exp (kern_check). */
#if defined(__x86_64__) /* x86-64 only, the whole file (aarch64: the _neon files) */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/cpu/avx512_util.h"
#include "kernels/cpu/bf16_pairs.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"

#define A512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define A_INLINE A512 __attribute__((always_inline)) static inline
/* blocked_avx512bf16's parts ("bf16 products" below) */
#define A512B __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define AB_INLINE A512B __attribute__((always_inline)) static inline
#define AB_CALL A512B __attribute__((noinline)) static

#define BQ 32  /* query rows per tile of the forward (8 micro-blocks of 4) */
#define BQB 64 /* and of the backward (16 micro-blocks) */
#define BK 64 /* keys per tile: 4 zmm */
#define HC 64 /* columns of hd per register tile: 4 zmm */

/* Lanes c (of 64, in 4 masks of 16) with c < n. */
A_INLINE __mmask16 att_lanes(int n, int j) {
    int m = n - 16 * j;
    return m >= 16 ? (__mmask16)0xFFFF : m <= 0 ? (__mmask16)0 : (__mmask16)((1u << m) - 1u);
}
/* Lanes c with lo <= c < n (lo = 0: att_lanes). */
A_INLINE __mmask16 att_lanes2(int lo, int n, int j) { return att_lanes(n, j) & (__mmask16)~att_lanes(lo, j); }

/* r[c] = the 16 floats at head + (j0 + c) * ks for the keys c < n of a 16-key
 * block, zeros for the keys past T (read at the head's first row, a valid
 * address): what one in-register transpose of att_tiles takes. */
A_INLINE void att_gather16(__m512 r[16], const float *head, long ks, int j0, int n) {
    #pragma GCC unroll 16
    for (int c = 0; c < 16; c++)
        r[c] = _mm512_maskz_loadu_ps(c < n ? (__mmask16)0xFFFF : (__mmask16)0, head + (size_t)(c < n ? j0 + c : 0) * ks);
}
/* The same with 32 floats a key, as 16 bf16 pairs (element 2p in the low half of
 * lane p): after the transpose, 16 rows of pairs along hd. */
AB_CALL void att_gather16_pairs(__m512 r[16], const float *head, long ks, int j0, int n) {
    #pragma GCC unroll 16
    for (int c = 0; c < 16; c++) {
        __mmask16 m = c < n ? (__mmask16)0xFFFF : (__mmask16)0;
        const float *src = head + (size_t)(c < n ? j0 + c : 0) * ks;
        r[c] = _mm512_castsi512_ps(bf16_pair_along(_mm512_maskz_loadu_ps(m, src), _mm512_maskz_loadu_ps(m, src + 16)));
    }
}

/* Every K (or V) head transposed once per call, tile by tile: tile jt of head
 * (b, kh) is [rows][BK] 32-bit slots at xt + ((b * nkv + kh) * Tp + jt * BK) *
 * rows, slot [i][c] = x[b, jt * BK + c, kh, i] for keys < T, zero past T;
 * rows = hd. With `pairs` (blocked_avx512bf16's scores) rows = hd / 2 and slot
 * [p][c] is the bf16 pair (x[.., 2p], x[.., 2p + 1]); its gather is the BF16
 * code, so only the CPUs that have it call with pairs. The score products
 * read a 64-key row of a tile with 4 loads, and no tile is re-transposed for every
 * query head and block that reads it. Tile-major, so a tile is 32 KB in one piece
 * (hd 128): with rows Tp floats apart (1 KB at T = 256) its 128 rows fell into 16
 * of L1's 64 sets, 32 rows for 12 ways, and the tile was re-read from L2 by every
 * micro-block. */
A512 static float *att_tiles(const float *x, int B, int T, int ld, int nkv, int hd, int Tp, int pairs) {
    // returns xt[B*nkv, Tp/BK, rows, BK]; x[B,ld,nkv,hd], its first T rows per sequence
    int rows = pairs ? hd / 2 : hd, step = pairs ? 32 : 16; /* step: columns of hd per transpose */
    float *xt = ct_malloc64((size_t)B * nkv * rows * Tp * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++) {
                float *dst = xt + ((size_t)b * nkv + kh) * rows * Tp;
                const float *head = x + ((size_t)b * ld * nkv + kh) * hd; // key j at + j * nkv * hd
                for (int j0 = 0; j0 < Tp; j0 += 16) { /* 16 keys x 16 slots: one in-register transpose */
                    int n = T - j0 < 16 ? (T - j0 > 0 ? T - j0 : 0) : 16;
                    float *tile = dst + (size_t)(j0 / BK) * BK * rows + j0 % BK;
                    for (int i0 = 0; i0 < hd; i0 += step) { /* hd is a multiple of HC here */
                        __m512 r[16];
                        if (pairs) att_gather16_pairs(r, head + i0, (long)nkv * hd, j0, n);
                        else att_gather16(r, head + i0, (long)nkv * hd, j0, n);
                        transpose16(r); /* moves bits only */
                        #pragma GCC unroll 16
                        for (int i = 0; i < 16; i++) _mm512_storeu_ps(tile + (size_t)(i0 / step * 16 + i) * BK, r[i]);
                    }
                }
            }
        KERN_TRACE_EXIT(kt_);
    }
    return xt;
}

/* vh[(b * nkv + kh) * T + j][i] = v[b, j, kh, i] (v: [B, ld, nkv, hd]): every V head's
 * rows contiguous (kern_rows_in), for the forward's P V product. */
A512 static float *att_heads(const float *v, int B, int T, int ld, int nkv, int hd) {
    float *vh = ct_malloc64((size_t)B * nkv * T * hd * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++)
                kern_rows_in(vh + ((size_t)b * nkv + kh) * T * hd, hd, v + ((size_t)b * ld * nkv + kh) * hd,
                             (long)nkv * hd, T, hd);
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

/* a[c][0:4] = the HC floats at p + c * ps for c < n (a register tile of n rows), and back.
 * Inlined with a constant n, so the tile stays in registers (fp32 and bf16 kernels). */
A_INLINE void att_tile_load(__m512 a[4][4], const float *p, long ps, int n) {
    #pragma GCC unroll 4
    for (int c = 0; c < n; c++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) a[c][j] = _mm512_loadu_ps(p + c * ps + 16 * j);
}
A_INLINE void att_tile_store(float *p, long ps, __m512 a[4][4], int n) {
    #pragma GCC unroll 4
    for (int c = 0; c < n; c++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(p + c * ps + 16 * j, a[c][j]);
}

/* out_c[0:HC] += sum_{r < nr} w[r * BK + c] x_r[0:HC] for KEYS keys c = c0.., x_r = x + r * xs:
 * the dV += P^T dO and dK += dS^T Q products, the keys' rows held in registers
 * across all query rows of the tile. */
A_INLINE void att_keys_axpy(float *out, long os, int keys, const float *w, int c0, const float *x, long xs, int nr) {
    __m512 a[4][4];
    att_tile_load(a, out, os, keys);
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
    att_tile_store(out, os, a, keys);
}

A_INLINE float att_dot(const float *x, const float *y, int n) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), a);
    return _mm512_reduce_add_ps(a);
}

/* ------------------------------------------- bf16 products (kern_attn_opt.bf16) */

/* "blocked_avx512bf16": under kern_attn_opt.bf16, the products of the
 * forward's scores and of the whole backward run as vdpbf16ps on bf16 pairs:
 * q k^T and dout v^T over pairs along hd (the tiles of K and V packed as
 * [hd/2][BK] pairs, the query rows as bf16 rows whose pairs are broadcast),
 * dv += P^T dout and dk += dS^T q over pairs of query rows (P and dS of the
 * tile as pairs of rows, q and dout as pairs of rows), dq += dS k over pairs
 * of keys (dS rows as pairs along the keys, k as pairs of rows). Each pair's
 * two products are exact in fp32 (bf16 x bf16), as the fp32 kernels'
 * products of the same bf16 values are, so only the order of the fp32 sums
 * differs from them. The forward's P V keeps fp32 weights (the contract), so
 * it is the fp32 kernel's. The body of each direction is the fp32 kernel's
 * (att_fwd_body / att_bwd_body with vb = 1): only the products and the
 * operands' layouts change, in the A512B functions below, which the body
 * calls (not inlines: the body is compiled for AVX-512 without BF16, so that
 * blocked_avx512 runs on every AVX-512 CPU). Without the option, or for head
 * dims that are not multiples of 64, it is blocked_avx512. */


/* acc + the pair products of a and b: lane i += a[2i] b[2i] + a[2i+1] b[2i+1] */
AB_INLINE __m512 att_dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* rows[t][0:hd/2] = x[t * xs + 0:hd] as bf16 (pair p = elements 2p, 2p+1) for t < T,
 * zeros for T <= t < Tz: the rows whose pairs the score products broadcast. */
AB_INLINE void att_rows_bf16(uint32_t *rows, const float *x, long xs, int T, int Tz, int hd) {
    for (int t = 0; t < Tz; t++) {
        uint32_t *d = rows + (size_t)t * (hd / 2);
        for (int i = 0; i < hd; i += 32) {
            __m512i p = t < T ? bf16_pair_along(_mm512_loadu_ps(x + (size_t)t * xs + i),
                                                _mm512_loadu_ps(x + (size_t)t * xs + i + 16))
                              : _mm512_setzero_si512();
            _mm512_storeu_si512(d + i / 2, p);
        }
    }
}

/* pairs[t / 2][i] = (x[t][i], x[t + 1][i]) for even t < Tz (rows past T zeros), x[t]
 * at x + t * xs: [Tz/2][hd] pairs of rows, the operand the products over rows (dv,
 * dk) and over keys (dq) read 16 columns at a time. */
AB_INLINE void att_rowpairs_bf16(uint32_t *pairs, const float *x, long xs, int T, int Tz, int hd) {
    for (int t = 0; t < Tz; t += 2) {
        uint32_t *d = pairs + (size_t)(t / 2) * hd;
        for (int i = 0; i < hd; i += 16) {
            __m512 lo = t < T ? _mm512_loadu_ps(x + (size_t)t * xs + i) : _mm512_setzero_ps();
            __m512 hi = t + 1 < T ? _mm512_loadu_ps(x + (size_t)(t + 1) * xs + i) : _mm512_setzero_ps();
            _mm512_storeu_si512(d + i, bf16_pair_rows(lo, hi));
        }
    }
}

/* One query head's operands of the backward: q and dout as bf16 rows (qb, gb:
 * [Tz][hd/2]) and as pairs of rows (qr, gr: [Tz/2][hd]). */
AB_CALL void att_head_bf16(uint32_t *qb, uint32_t *gb, uint32_t *qr, uint32_t *gr, const float *q, const float *g,
                           long xs, int T, int Tz, int hd) {
    att_rows_bf16(qb, q, xs, T, Tz, hd);
    att_rows_bf16(gb, g, xs, T, Tz, hd);
    att_rowpairs_bf16(qr, q, xs, T, Tz, hd);
    att_rowpairs_bf16(gr, g, xs, T, Tz, hd);
}
/* A kv head's k as pairs of keys (kr: [Tp/2][hd]), the operand of dq += dS k. */
AB_CALL void att_kpairs_bf16(uint32_t *kr, const float *k, long ks, int T, int Tp, int hd) {
    att_rowpairs_bf16(kr, k, ks, T, Tp, hd);
}

/* s[r][j] = sum over pairs p of x_r's pair p times kp[p * BK + 16 j + lane] for 4
 * rows and nch chunks of 16 keys (att_dots4 on bf16 pairs). */
AB_INLINE void att_dots4_bf16_n(__m512 s[4][4], const uint32_t *const x[4], const uint32_t *kp, int hp, int nch) {
    /* the sums in locals, stored once: s is memory the caller reads, and __m512 may
     * alias anything, so sums kept in s[] were stored back on every pair */
    __m512 a[4][4];
    const uint32_t *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_ps();
    for (int p = 0; p < hp; p++) {
        const uint32_t *kr = kp + (size_t)p * BK;
        __m512i k[4];
        #pragma GCC unroll 4
        for (int j = 0; j < nch; j++) k[j] = _mm512_loadu_si512(kr + 16 * j);
        const __m512i b[4] = {_mm512_set1_epi32((int)x0[p]), _mm512_set1_epi32((int)x1[p]),
                              _mm512_set1_epi32((int)x2[p]), _mm512_set1_epi32((int)x3[p])};
        #pragma GCC unroll 4
        for (int r = 0; r < 4; r++)
            #pragma GCC unroll 4
            for (int j = 0; j < nch; j++) a[r][j] = att_dp(a[r][j], b[r], k[j]);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) s[r][j] = a[r][j];
}
/* The scores of 4 rows over the first `keys` of a tile (att_dots4's chunk rule). */
AB_CALL void att_dots4_bf16(__m512 s[4][4], const uint32_t *const x[4], const uint32_t *kp, int hp, int keys) {
    switch ((keys + 15) / 16) {
    case 1: att_dots4_bf16_n(s, x, kp, hp, 1); break;
    case 2: att_dots4_bf16_n(s, x, kp, hp, 2); break;
    case 3: att_dots4_bf16_n(s, x, kp, hp, 3); break;
    default: att_dots4_bf16_n(s, x, kp, hp, 4); break;
    }
}

/* A tile's P and dS (fp32 [BQB][BK], rows < nr, nr even) as the backward's bf16
 * operands: pt / st [nr/2][BK] pairs of rows (dv, dk), sr [nr][BK/2] pairs along
 * the keys (dq). */
AB_CALL void att_tile_pairs_bf16(uint32_t *pt, uint32_t *st, uint32_t *sr, const float *P, const float *dS, int nr) {
    for (int r = 0; r < nr; r += 2)
        #pragma GCC unroll 4
        for (int j = 0; j < BK / 16; j++) {
            const float *p0 = P + (size_t)r * BK + 16 * j, *s0 = dS + (size_t)r * BK + 16 * j;
            _mm512_storeu_si512(pt + (size_t)(r / 2) * BK + 16 * j,
                                bf16_pair_rows(_mm512_loadu_ps(p0), _mm512_loadu_ps(p0 + BK)));
            _mm512_storeu_si512(st + (size_t)(r / 2) * BK + 16 * j,
                                bf16_pair_rows(_mm512_loadu_ps(s0), _mm512_loadu_ps(s0 + BK)));
        }
    for (int r = 0; r < nr; r++)
        #pragma GCC unroll 2
        for (int j = 0; j < BK / 32; j++) {
            const float *s0 = dS + (size_t)r * BK + 32 * j;
            _mm512_storeu_si512(sr + (size_t)r * (BK / 2) + 16 * j,
                                bf16_pair_along(_mm512_loadu_ps(s0), _mm512_loadu_ps(s0 + 16)));
        }
}

/* out_c[0:HC] += sum_{rp < nrp} w[rp * BK + c0 + c] . x[rp * xs + 0:HC] (pairs) for
 * KEYS keys c, out_c at out + c * os: dv += P^T dout and dk += dS^T q over pairs of
 * query rows, the keys' rows held in registers (att_keys_axpy on pairs). */
AB_INLINE void att_keys_axpy_bf16_n(float *out, long os, int keys, const uint32_t *w, int c0, const uint32_t *x,
                                    long xs, int nrp) {
    __m512 a[4][4];
    att_tile_load(a, out, os, keys);
    for (int rp = 0; rp < nrp; rp++) {
        const uint32_t *xr = x + (size_t)rp * xs;
        __m512i x0 = _mm512_loadu_si512(xr), x1 = _mm512_loadu_si512(xr + 16), x2 = _mm512_loadu_si512(xr + 32),
                x3 = _mm512_loadu_si512(xr + 48);
        #pragma GCC unroll 4
        for (int c = 0; c < keys; c++) {
            __m512i b = _mm512_set1_epi32((int)w[(size_t)rp * BK + c0 + c]);
            a[c][0] = att_dp(a[c][0], b, x0);
            a[c][1] = att_dp(a[c][1], b, x1);
            a[c][2] = att_dp(a[c][2], b, x2);
            a[c][3] = att_dp(a[c][3], b, x3);
        }
    }
    att_tile_store(out, os, a, keys);
}
/* dv and dk of `keys` (4 or 1) keys c0.. of a tile over the row pairs [0, nrp) of pw / sw. */
AB_INLINE void att_dvdk_bf16(float *dvr, float *dkr, long os, int keys, const uint32_t *pw, const uint32_t *sw, int c0,
                           const uint32_t *gx, const uint32_t *qx, long xs, int nrp) {
    if (keys == 4) {
        att_keys_axpy_bf16_n(dvr, os, 4, pw, c0, gx, xs, nrp);
        att_keys_axpy_bf16_n(dkr, os, 4, sw, c0, qx, xs, nrp);
    } else {
        att_keys_axpy_bf16_n(dvr, os, 1, pw, c0, gx, xs, nrp);
        att_keys_axpy_bf16_n(dkr, os, 1, sw, c0, qx, xs, nrp);
    }
}

/* dq[r][0:hd] += sum_{cp0 <= cp < cp1} sr[r * BK/2 + cp] . kr[cp * hd + 0:hd] (pairs
 * of keys) for the rows r < nr (<= 4) of a micro-block, dq[r] at dq + r * qs: 4 rows
 * x 64 columns in registers at a time, a partial micro-block a row at a time (its
 * rows past T must not be written). */
AB_INLINE void att_dq_bf16(float *dq, long qs, int nr, const uint32_t *sr, const uint32_t *kr, int hd, int cp0,
                           int cp1) {
    if (nr == 4) {
        for (int c0 = 0; c0 < hd; c0 += HC) {
            __m512 a[4][4];
            att_tile_load(a, dq + c0, qs, 4);
            for (int cp = cp0; cp < cp1; cp++) {
                const uint32_t *y = kr + (size_t)cp * hd + c0;
                __m512i y0 = _mm512_loadu_si512(y), y1 = _mm512_loadu_si512(y + 16), y2 = _mm512_loadu_si512(y + 32),
                        y3 = _mm512_loadu_si512(y + 48);
                #pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    __m512i b = _mm512_set1_epi32((int)sr[(size_t)r * (BK / 2) + cp]);
                    a[r][0] = att_dp(a[r][0], b, y0);
                    a[r][1] = att_dp(a[r][1], b, y1);
                    a[r][2] = att_dp(a[r][2], b, y2);
                    a[r][3] = att_dp(a[r][3], b, y3);
                }
            }
            att_tile_store(dq + c0, qs, a, 4);
        }
        return;
    }
    for (int r = 0; r < nr; r++)
        for (int c0 = 0; c0 < hd; c0 += 16) {
            __m512 a = _mm512_loadu_ps(dq + r * qs + c0);
            for (int cp = cp0; cp < cp1; cp++)
                a = att_dp(a, _mm512_set1_epi32((int)sr[(size_t)r * (BK / 2) + cp]),
                           _mm512_loadu_si512(kr + (size_t)cp * hd + c0));
            _mm512_storeu_ps(dq + r * qs + c0, a);
        }
}

/* A tile's dv, dk and dq products from its bf16 operands (att_tile_pairs_bf16, the
 * head's att_head_bf16 and att_kpairs_bf16): the fp32 kernel's loops and ranges (t0:
 * the query block's first position less the key block's, k0),
 * the row ranges of dv / dk widened to whole pairs of rows and the key range of dq
 * to whole pairs of keys (the rows and keys they add hold P = dS = 0 there, and the
 * operands' padding rows are zeros). cmb / ceb: each micro-block's first and end
 * key column. dqh, dkh, dvh: the backward's contiguous copies, rows hd floats apart. */
AB_CALL void att_bf16_products(float *dqh, float *dkh, float *dvh, int hd, int j0, int t0, int lt0, int nq,
                               int nk, int window, const int *cmb, const int *ceb, const uint32_t *PT,
                               const uint32_t *ST, const uint32_t *SR, const uint32_t *KR, const uint32_t *QR,
                               const uint32_t *GR) {
    for (int c0 = 0; c0 < hd; c0 += HC)
        for (int c = 0; c < nk;) {
            int keys = c + 4 <= nk ? 4 : 1;
            int rs = j0 + c - t0 > 0 ? j0 + c - t0 : 0, re = nq; /* query rows that see the keys */
            if (window) {
                re = j0 + c + keys - 1 + window - t0;
                re = re < nq ? re : nq;
            }
            if (re > rs) {
                int rp0 = rs / 2, rp1 = (re + 1) / 2;
                att_dvdk_bf16(dvh + (size_t)(j0 + c) * hd + c0, dkh + (size_t)(j0 + c) * hd + c0, hd, keys,
                              PT + (size_t)rp0 * BK, ST + (size_t)rp0 * BK, c, GR + (size_t)(lt0 / 2 + rp0) * hd + c0,
                              QR + (size_t)(lt0 / 2 + rp0) * hd + c0, hd, rp1 - rp0);
            }
            c += keys;
        }
    for (int r0 = 0; r0 < nq; r0 += 4) {
        int cm = cmb[r0 / 4], ce = ceb[r0 / 4]; /* keys past ce: dS = 0 */
        if (cm >= ce) continue;
        att_dq_bf16(dqh + (size_t)(lt0 + r0) * hd, hd, nq - r0 < 4 ? nq - r0 : 4, SR + (size_t)r0 * (BK / 2),
                    KR + (size_t)(j0 / 2) * hd, hd, cm / 2, (ce + 1) / 2);
    }
}

/* The forward's q rows of one query block as bf16 rows (nq rows, zeros to BQ). */
AB_CALL void att_block_bf16(uint32_t *qb, const float *q, long qs, int nq, int hd) {
    att_rows_bf16(qb, q, qs, nq, BQ, hd);
}

/* The forward of both kernels: vb = 1 takes the scores as bf16 products. Written
 * for the block form (ops.h, kern_attn_blk): Tq query rows at positions q0.. against
 * the Tk keys at positions k0.., in blocks of rows from q0 (t0: a block's first
 * position, lt0 = t0 - q0 its first row of q); key tiles are by index in the block
 * (j0), their masks by position (k0 + j0). With ls (the running sums l) it is the
 * block form: out, lse are the state acc, m, read first and written back; without,
 * the offset form (q0 = Tk - Tq, k0 = 0, unstrided), which starts from m = -inf,
 * l = 0 and finishes out = acc / l, lse = m + log l. */
A_INLINE void att_fwd_body(float *out, float *lse, float *ls, const float *q, const float *k, const float *v,
                           const kern_attn_blk *g, const kern_attn_opt *opt, int vb) {
    // out[B,ldq,nh,hd], lse[B,nh,ldq], q[B,ldq,nh,hd], k[B,ldk,nkv,hd], v[B,ldk,nkv,hd]
    int B = g->B, Tq = g->Tq, Tk = g->Tk, nh = g->nh, nkv = g->nkv, hd = g->hd;
    int group = nh / nkv, q0 = g->q0, k0 = g->k0, ldq = g->ldq;
    int nqb = (Tq + BQ - 1) / BQ;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int qs = nh * hd; // row stride of q and out
    int Tp = (Tk + BK - 1) / BK * BK, hp = hd / 2;
    float *KT = vb ? NULL : att_tiles(k, B, Tk, g->ldk, nkv, hd, Tp, 0);                // [B*nkv, Tp/BK, hd, BK]
    uint32_t *KP = vb ? (uint32_t *)att_tiles(k, B, Tk, g->ldk, nkv, hd, Tp, 1) : NULL; // [B*nkv, Tp/BK, hd/2, BK]
    float *VH = att_heads(v, B, Tk, g->ldk, nkv, hd);         // [B*nkv, Tk, hd]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *acc = ct_malloc64((size_t)BQ * hd * sizeof(float)); // [BQ, hd] unnormalised out
        uint32_t *QB = vb ? ct_malloc64((size_t)BQ * hp * sizeof(uint32_t)) : NULL; // [BQ, hd/2] the block's q, bf16
        float P[BQ * BK];                                        // [BQ, BK] probabilities of the tile
        float m[BQ], l[BQ], alpha[BQ];                           // running max, sum; rescaling
        int mbc[BQ / 4][2];                                      // per micro-block: first, end key column
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < nh; h++) {
                for (int qb = 0; qb < nqb; qb++) {
                    int kh = h / group, lt0 = qb * BQ, t0 = q0 + lt0;
                    int nq = Tq - lt0 < BQ ? Tq - lt0 : BQ;
                    const float *qh = q + ((size_t)b * ldq * nh + h) * hd; // position t at qh + (t - q0)*qs
                    const float *kth = vb ? NULL : KT + ((size_t)b * nkv + kh) * hd * Tp; // tile at + j0*hd
                    const uint32_t *kph = vb ? KP + ((size_t)b * nkv + kh) * hp * Tp : NULL; // tile at + j0*hp
                    const float *vh = VH + ((size_t)b * nkv + kh) * Tk * hd; // row j at vh + j*hd
                    float *sm = lse + ((size_t)b * nh + h) * ldq + lt0; // the rows' m (lse), l
                    /* the keys of the block that some row sees: from the tile of the first
                     * row's first key (the window) up to the last row's diagonal */
                    int jlo = kern_attn_first_key(t0, window) - k0, jend = t0 + nq - k0;
                    jlo = jlo > 0 ? jlo / BK * BK : 0, jend = jend < Tk ? jend : Tk;
                    if (ls && jlo >= jend) continue; /* the state stays as it is */
                    if (vb) att_block_bf16(QB, qh + (size_t)lt0 * qs, qs, nq, hd);
                    for (int r = 0; r < BQ; r++) m[r] = -INFINITY, l[r] = 0.0f;
                    memset(acc, 0, (size_t)BQ * hd * sizeof(float));
                    if (ls)
                        for (int r = 0; r < nq; r++) {
                            m[r] = sm[r], l[r] = ls[sm - lse + r];
                            memcpy(acc + (size_t)r * hd, out + ((size_t)b * ldq + lt0 + r) * qs + (size_t)h * hd,
                                   (size_t)hd * sizeof(float));
                        }
                    for (int j0 = jlo; j0 < jend; j0 += BK) {
                        int nk = jend - j0 < BK ? jend - j0 : BK, p0 = k0 + j0; /* p0: the tile's first position */
                        /* Two passes over the tile's micro-blocks: every score row first (the
                         * K tile, 32 KB at hd 128, stays in L1 across them), then every P V
                         * (the V tile stays in L1). One pass per micro-block needed both
                         * tiles at once, more than L1's 48 KB, and re-read them from L2. */
                        for (int r0 = 0; r0 < nq; r0 += 4) {
                            const float *x[4];
                            const uint32_t *xb[4];
                            int ncr[4], clo[4], ncmax = 0, cmin = BK; /* row r sees keys clo[r] <= c < ncr[r] */
                            #pragma GCC unroll 4
                            for (int r = 0; r < 4; r++) {
                                int rr = r0 + r < nq ? r0 + r : nq - 1; /* rows past T repeat the last */
                                x[r] = qh + (size_t)(lt0 + rr) * qs;
                                xb[r] = vb ? QB + (size_t)rr * hp : NULL;
                                int nc = t0 + rr - p0 + 1 < nk ? t0 + rr - p0 + 1 : nk; // keys p0..t
                                int c0 = kern_attn_first_key(t0 + rr, window) - p0;  // and from lo(t) on
                                clo[r] = c0 > 0 ? c0 : 0;
                                ncr[r] = nc > clo[r] ? nc : 0;
                                if (ncr[r] > ncmax) ncmax = ncr[r];
                                if (ncr[r] && clo[r] < cmin) cmin = clo[r];
                            }
                            mbc[r0 / 4][0] = cmin;
                            mbc[r0 / 4][1] = ncmax;
                            if (!ncmax) continue;
                            __m512 s[4][4];
                            if (vb) att_dots4_bf16(s, xb, kph + (size_t)j0 * hp, hp, ncmax);
                            else att_dots4(s, x, kth + (size_t)j0 * hd, BK, hd, ncmax);
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
                        int last = !ls && j0 + BK >= jend;
                        for (int r0 = 0; r0 < nq; r0 += 4) {
                            int cmin = mbc[r0 / 4][0], ncmax = mbc[r0 / 4][1];
                            /* the last tile prefetches the block's out rows (qs floats apart, a
                             * page each, cold) ahead of the stores below, as blocked_avx2 does */
                            if (last)
                                for (int r = r0; r < r0 + 4 && r < nq; r++) {
                                    const float *orow = out + ((size_t)b * ldq + lt0 + r) * qs + (size_t)h * hd;
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
                        float *ot = out + ((size_t)b * ldq + lt0 + r) * qs + (size_t)h * hd;
                        if (ls) { /* the state, unnormalised: the block form's finish divides */
                            memcpy(ot, acc + (size_t)r * hd, (size_t)hd * sizeof(float));
                            sm[r] = m[r], ls[sm - lse + r] = l[r];
                            continue;
                        }
                        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
                        for (int i = 0; i < hd; i += 16)
                            _mm512_storeu_ps(ot + i, _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * hd + i), inv));
                        sm[r] = m[r] + logf(l[r]);
                    }
                }
            }
        }
        free(acc);
        free(QB);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
    free(KP);
    free(VH);
}

A512 void kern_attention_fwd_q0_avx512(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                       int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    if (hd % HC) {
        op_attention_fwd_q0_tiled_avx512(out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt);
        return;
    }
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att_fwd_body(out, lse, NULL, q, k, v, &g, opt, 0);
}

A512 void kern_attention_fwd_q0_avx512bf16(float *out, float *lse, const float *q, const float *k, const float *v,
                                           int B, int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    if (!kern_attn_bf16(opt) || hd % HC) {
        kern_attention_fwd_q0_avx512(out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt);
        return;
    }
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att_fwd_body(out, lse, NULL, q, k, v, &g, opt, 1);
}

A512 void kern_attention_fwd_avx512(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                    int T, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    kern_attention_fwd_q0_avx512(out, lse, q, k, v, B, T, T, nh, nkv, hd, opt);
}

A512 void kern_attention_fwd_avx512bf16(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                        int T, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    kern_attention_fwd_q0_avx512bf16(out, lse, q, k, v, B, T, T, nh, nkv, hd, opt);
}

/* The backward of both kernels: vb = 1 runs every product as bf16 pairs; acc 0
 * overwrites dq, dk and dv (their row copies start from 0). The block form as the
 * forward's: the query side's rows (q, dout, out, lse, dq and their copies here)
 * indexed from q0 (lt0 = t0 - q0), the keys' from k0 (the tile at index j0 is at
 * position p0 = k0 + j0), masks by position. With Dg (the block form) D is given
 * and out unused; without, D = rowsum(dout * out) here. */
A_INLINE void att_bwd_body(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                           const float *Dg, const float *q, const float *k, const float *v, const kern_attn_blk *g,
                           const kern_attn_opt *opt, int vb, int acc) {
    // dq[B,ldq,nh,hd], dk[B,ldk,nkv,hd], dv[B,ldk,nkv,hd], dout[B,ldq,nh,hd], out[B,ldq,nh,hd], lse[B,nh,ldq],
    // q[B,ldq,nh,hd], k[B,ldk,nkv,hd], v[B,ldk,nkv,hd]
    int B = g->B, Tq = g->Tq, Tk = g->Tk, nh = g->nh, nkv = g->nkv, hd = g->hd;
    int group = nh / nkv, q0 = g->q0, k0 = g->k0, ldq = g->ldq, ldk = g->ldk;
    int nqb = (Tq + BQB - 1) / BQB;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int qs = nh * hd, ks = nkv * hd;
    int b16 = kern_attn_bf16(opt);
    int Tp = (Tk + BK - 1) / BK * BK, hp = hd / 2, Tz = nqb * BQB; /* Tz: the query rows the blocks cover */
    float *KT = vb ? NULL : att_tiles(k, B, Tk, ldk, nkv, hd, Tp, 0);                // [B*nkv, Tp/BK, hd, BK]
    float *VT = vb ? NULL : att_tiles(v, B, Tk, ldk, nkv, hd, Tp, 0);                // [B*nkv, Tp/BK, hd, BK]
    uint32_t *KP = vb ? (uint32_t *)att_tiles(k, B, Tk, ldk, nkv, hd, Tp, 1) : NULL; // [B*nkv, Tp/BK, hd/2, BK]
    uint32_t *VP = vb ? (uint32_t *)att_tiles(v, B, Tk, ldk, nkv, hd, Tp, 1) : NULL; // [B*nkv, Tp/BK, hd/2, BK]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *P = ct_malloc64((size_t)BQB * BK * sizeof(float));  // [BQB, BK] recomputed probs (0 where masked)
        float *dS = ct_malloc64((size_t)BQB * BK * sizeof(float)); // [BQB, BK] scale * dscores (0 where masked)
        float D[BQB], L[BQB];
        /* vb: the bf16 operands. The tile's P and dS as pairs of rows (PT, ST: [BQB/2, BK]) and
         * dS as pairs along the keys (SR: [BQB, BK/2]); the kv head's k as pairs of keys (KR:
         * [Tp/2, hd]); the query head's q and dout as bf16 rows (QB, GB: [Tz, hd/2]) and as
         * pairs of rows (QR, GR: [Tz/2, hd]) */
        uint32_t *PT = NULL, *ST = NULL, *SR = NULL, *KR = NULL, *QB = NULL, *GB = NULL, *QR = NULL, *GR = NULL;
        if (vb) {
            PT = ct_malloc64((size_t)3 * BQB * BK / 2 * sizeof(uint32_t));
            ST = PT + BQB * BK / 2, SR = ST + BQB * BK / 2;
            KR = ct_malloc64(((size_t)Tp * hd / 2 + (size_t)4 * Tz * hd / 2) * sizeof(uint32_t));
            QB = KR + (size_t)Tp * hd / 2, GB = QB + (size_t)Tz * hp, QR = GB + (size_t)Tz * hp;
            GR = QR + (size_t)Tz / 2 * hd;
        }
        /* the rows the products stream, contiguous (kern_rows_in): k of the kv
         * head (dS K reads 64 of them per tile), q and dout of the query head
         * (dV and dK read up to BQB per tile). */
        float *KS = vb ? NULL : ct_malloc64(((size_t)Tk + 2 * (size_t)Tq) * hd * sizeof(float));
        float *QS = vb ? NULL : KS + (size_t)Tk * hd, *GS = vb ? NULL : QS + (size_t)Tq * hd;
        /* the gradients' rows, contiguous while they are summed: in place, dk and dv rows
         * are ks floats apart (4 KB at Qwen3's 8 kv heads of 128) and dq rows qs apart
         * (8 KB), so the rows of a tile fell into a few L1 sets and every register tile
         * of them was re-read from L2 (kern_rows_in) */
        float *DQ = ct_malloc64(((size_t)Tq + 2 * (size_t)Tk) * hd * sizeof(float)); // [Tq, hd] the dq rows
        float *DK = DQ + (size_t)Tq * hd, *DV = DK + (size_t)Tk * hd; // [Tk, hd] the kv head's dk, dv rows
        // One thread per (b, kv head): it owns the dk/dv rows of that head and
        // the dq rows of the group's query heads, so every sum is its own.
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kth = vb ? NULL : KT + ((size_t)b * nkv + kh) * hd * Tp;
                const float *vth = vb ? NULL : VT + ((size_t)b * nkv + kh) * hd * Tp;
                const uint32_t *kph = vb ? KP + ((size_t)b * nkv + kh) * hp * Tp : NULL; // tile at + j0*hp
                const uint32_t *vph = vb ? VP + ((size_t)b * nkv + kh) * hp * Tp : NULL;
                const float *kh_ = KS; // row j at + j*hd
                float *dkh = DK, *dvh = DV; // row j at + j*hd
                /* the rows of the kv head (key j at + j * ks) and of a query head (row r at + r * qs) */
                size_t ko = ((size_t)b * ldk * nkv + kh) * hd;
                kern_rows_sum_in(DK, dk + ko, ks, Tk, hd, acc);
                kern_rows_sum_in(DV, dv + ko, ks, Tk, hd, acc);
                if (vb) att_kpairs_bf16(KR, k + ko, ks, Tk, Tp, hd);
                else kern_rows_in(KS, hd, k + ko, ks, Tk, hd);
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    size_t qo = ((size_t)b * ldq * nh + h) * hd;
                    const float *oh = Dg ? NULL : out + qo; // position t at + (t - q0)*qs
                    const float *qh = QS, *gh = GS; // position t at + (t - q0)*hd
                    float *dqh = DQ; // position t at + (t - q0)*hd
                    kern_rows_sum_in(DQ, dq + qo, qs, Tq, hd, acc);
                    if (vb) {
                        att_head_bf16(QB, GB, QR, GR, q + qo, dout + qo, qs, Tq, Tz, hd);
                        gh = dout + qo; /* D below: rows qs apart */
                    } else {
                        kern_rows_in(QS, hd, q + qo, qs, Tq, hd);
                        kern_rows_in(GS, hd, dout + qo, qs, Tq, hd);
                    }
                    long gs = vb ? qs : hd; /* the row stride of gh */
                    for (int qb = 0; qb < nqb; qb++) {
                        int lt0 = qb * BQB, t0 = q0 + lt0;
                        int nq = Tq - lt0 < BQB ? Tq - lt0 : BQB;
                        size_t ro = ((size_t)b * nh + h) * ldq + lt0; /* the rows' lse, D */
                        /* the keys of the block that some row sees (the forward's range) */
                        int jlo = kern_attn_first_key(t0, window) - k0, jend = t0 + nq - k0;
                        jlo = jlo > 0 ? jlo / BK * BK : 0, jend = jend < Tk ? jend : Tk;
                        if (jlo >= jend) continue;
                        for (int r = 0; r < nq; r++) {
                            // D = rowsum(dout * out) = sum_j p_j dp_j (the block form: given)
                            D[r] = Dg ? Dg[ro + r]
                                      : att_dot(gh + (size_t)(lt0 + r) * gs, oh + (size_t)(lt0 + r) * qs, hd);
                            L[r] = lse[ro + r];
                        }
                        for (int j0 = jlo; j0 < jend; j0 += BK) {
                            int nk = jend - j0 < BK ? jend - j0 : BK, p0 = k0 + j0; /* p0: the tile's first position */
                            int cmb[BQB / 4]; /* first key column a micro-block sees (0 without a window) */
                            int ceb[BQB / 4]; /* and the end of the columns it sees (the diagonal) */
                            for (int r0 = 0; r0 < nq; r0 += 4) {
                                const float *xq[4], *xg[4];
                                const uint32_t *bq[4], *bg[4];
                                int ncr[4], clo[4], cmin = BK; /* row r sees keys clo[r] <= c < ncr[r] */
                                #pragma GCC unroll 4
                                for (int r = 0; r < 4; r++) {
                                    int rr = r0 + r < nq ? r0 + r : nq - 1;
                                    xq[r] = vb ? NULL : qh + (size_t)(lt0 + rr) * hd;
                                    xg[r] = vb ? NULL : gh + (size_t)(lt0 + rr) * hd;
                                    bq[r] = vb ? QB + (size_t)(lt0 + rr) * hp : NULL;
                                    bg[r] = vb ? GB + (size_t)(lt0 + rr) * hp : NULL;
                                    int nc = t0 + rr - p0 + 1 < nk ? t0 + rr - p0 + 1 : nk;
                                    int c0 = kern_attn_first_key(t0 + rr, window) - p0;
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
                                if (vb) {
                                    att_dots4_bf16(s, bq, kph + (size_t)j0 * hp, hp, ncm);
                                    att_dots4_bf16(dp, bg, vph + (size_t)j0 * hp, hp, ncm); // dP = dout . v
                                } else {
                                    att_dots4(s, xq, kth + (size_t)j0 * hd, BK, hd, ncm);
                                    att_dots4(dp, xg, vth + (size_t)j0 * hd, BK, hd, ncm); // dP = dout . v
                                }
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
                            if (vb) { /* the products below take P and dS as bf16 pairs */
                                att_tile_pairs_bf16(PT, ST, SR, P, dS, (nq + 3) & ~3);
                                att_bf16_products(dqh, dkh, dvh, hd, j0, t0 - k0, lt0, nq, nk, window, cmb, ceb, PT,
                                                  ST, SR, KR, QR, GR);
                                continue;
                            }
                            if (b16) { /* the products below take P and dS as bf16 (dS from fp32 P above) */
                                ct_round_bf16(P, (size_t)((nq + 3) & ~3) * BK);
                                ct_round_bf16(dS, (size_t)((nq + 3) & ~3) * BK);
                            }
                            // dv[j] += sum_t P[t,j] dout[t]; dk[j] += sum_t dS[t,j] q[t]; 4 keys at a time,
                            // over the query rows rs <= r < re that can see them (all rows without a window)
                            for (int c0 = 0; c0 < hd; c0 += HC) {
                                int c = 0;
                                for (; c < nk;) {
                                    int keys = c + 4 <= nk ? 4 : 1;
                                    /* row t sees key j iff j <= t (< j + window): the rows above the
                                     * diagonal hold P = dS = 0 and are skipped */
                                    int rs = p0 + c - t0 > 0 ? p0 + c - t0 : 0, re = nq;
                                    if (window) {
                                        re = p0 + c + keys - 1 + window - t0;
                                        re = re < nq ? re : nq;
                                    }
                                    if (re > rs) {
                                        const float *pw = P + (size_t)rs * BK, *sw = dS + (size_t)rs * BK;
                                        const float *gx = gh + (size_t)(lt0 + rs) * hd + c0;
                                        const float *qx = qh + (size_t)(lt0 + rs) * hd + c0;
                                        float *dvr = dvh + (size_t)(j0 + c) * hd + c0, *dkr = dkh + (size_t)(j0 + c) * hd + c0;
                                        if (keys == 4) {
                                            att_keys_axpy(dvr, hd, 4, pw, c, gx, hd, re - rs);
                                            att_keys_axpy(dkr, hd, 4, sw, c, qx, hd, re - rs);
                                        } else {
                                            att_keys_axpy(dvr, hd, 1, pw, c, gx, hd, re - rs);
                                            att_keys_axpy(dkr, hd, 1, sw, c, qx, hd, re - rs);
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
                                        att_rows4_axpy(dqh + (size_t)(lt0 + r0) * hd + c0, hd, NULL,
                                                       dS + (size_t)r0 * BK + cm, kh_ + (size_t)(j0 + cm) * hd + c0,
                                                       hd, ce - cm);
                                    continue;
                                }
                                for (int r = r0; r < nq; r++) {
                                    float *dqr = dqh + (size_t)(lt0 + r) * hd;
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
                    kern_rows_out(dq + qo, qs, DQ, Tq, hd);
                }
                kern_rows_out(dk + ko, ks, DK, Tk, hd);
                kern_rows_out(dv + ko, ks, DV, Tk, hd);
            }
        }
        free(P);
        free(dS);
        free(KS);
        free(DQ);
        free(PT);
        free(KR);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
    free(VT);
    free(KP);
    free(VP);
}

A512 void kern_attention_bwd_q0_avx512(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                       const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                       int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc) {
    if (hd % HC) {
        op_attention_bwd_q0_tiled_avx512(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, acc);
        return;
    }
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att_bwd_body(dq, dk, dv, dout, out, lse, NULL, q, k, v, &g, opt, 0, acc);
}

A512 void kern_attention_bwd_q0_avx512bf16(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                           const float *lse, const float *q, const float *k, const float *v, int B,
                                           int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt,
                                           int acc) {
    if (!kern_attn_bf16(opt) || hd % HC) {
        kern_attention_bwd_q0_avx512(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, acc);
        return;
    }
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att_bwd_body(dq, dk, dv, dout, out, lse, NULL, q, k, v, &g, opt, 1, acc);
}

A512 void kern_attention_bwd_avx512(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                    const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                    int nh, int nkv, int hd, const kern_attn_opt *opt, int acc) {
    kern_attention_bwd_q0_avx512(dq, dk, dv, dout, out, lse, q, k, v, B, T, T, nh, nkv, hd, opt, acc);
}

A512 void kern_attention_bwd_avx512bf16(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                        const float *lse, const float *q, const float *k, const float *v, int B,
                                        int T, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc) {
    kern_attention_bwd_q0_avx512bf16(dq, dk, dv, dout, out, lse, q, k, v, B, T, T, nh, nkv, hd, opt, acc);
}

/* The block form (ops.h, kern_attn_blk; ring attention): the bodies above with the
 * state and strides of the block, and the tiled AVX-512 pair where they do not apply
 * (hd not a multiple of HC; blocked_avx512bf16 without bf16 products). */
A512 void kern_attention_fwd_blk_avx512(float *acc, float *m, float *l, const float *q, const float *k,
                                        const float *v, const kern_attn_blk *g, const kern_attn_opt *opt) {
    if (g->hd % HC) {
        op_attention_fwd_blk_tiled_avx512(acc, m, l, q, k, v, g, opt);
        return;
    }
    att_fwd_body(acc, m, l, q, k, v, g, opt, 0);
}

A512 void kern_attention_fwd_blk_avx512bf16(float *acc, float *m, float *l, const float *q, const float *k,
                                            const float *v, const kern_attn_blk *g, const kern_attn_opt *opt) {
    if (!kern_attn_bf16(opt) || g->hd % HC) {
        kern_attention_fwd_blk_avx512(acc, m, l, q, k, v, g, opt);
        return;
    }
    att_fwd_body(acc, m, l, q, k, v, g, opt, 1);
}

A512 void kern_attention_bwd_blk_avx512(float *dq, float *dk, float *dv, const float *dout, const float *lse,
                                        const float *D, const float *q, const float *k, const float *v,
                                        const kern_attn_blk *g, const kern_attn_opt *opt) {
    if (g->hd % HC) {
        op_attention_bwd_blk_tiled_avx512(dq, dk, dv, dout, lse, D, q, k, v, g, opt);
        return;
    }
    att_bwd_body(dq, dk, dv, dout, NULL, lse, D, q, k, v, g, opt, 0, 1);
}

A512 void kern_attention_bwd_blk_avx512bf16(float *dq, float *dk, float *dv, const float *dout, const float *lse,
                                            const float *D, const float *q, const float *k, const float *v,
                                            const kern_attn_blk *g, const kern_attn_opt *opt) {
    if (!kern_attn_bf16(opt) || g->hd % HC) {
        kern_attention_bwd_blk_avx512(dq, dk, dv, dout, lse, D, q, k, v, g, opt);
        return;
    }
    att_bwd_body(dq, dk, dv, dout, NULL, lse, D, q, k, v, g, opt, 1, 1);
}
#endif /* __x86_64__ */
