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
 * Scores and probabilities go through a [48 x 64] buffer in L1, since 6 rows
 * x 64 keys do not fit in 16 registers. Query blocks are 48 rows (8
 * micro-blocks of 6). Masked lanes (past the diagonal or the sequence) get
 * p = 0 and dS = 0, so the loops have no ragged edges inside a tile; rows
 * past the end of a partial block repeat the last row and are never stored.
 *
 * Memory. The operand each product re-reads for every micro-block is a
 * contiguous piece of at most 8 KB at hd 128, read by all micro-blocks of the
 * block while it stays in L1 (sized for Zen 3's 32 KB L1d, not only this
 * Sapphire Rapids' 48 KB): K^T and V^T (backward) as 16-key chunks [hd][16]
 * built with 8 x 8 in-register transposes; V (forward P V) and k (backward
 * dS K) as 16-column slabs [hd/16][T][16] of the head's rows; the block's q
 * rows (forward) and the query head's q and dout rows (backward) copied
 * contiguous; the backward's dk, dv and dq are summed in per-thread [T][hd]
 * copies (rows hd apart, copied in and back), not in place 4-8 KB a row apart. Each product
 * loops over the micro-blocks inside the loop over its operand's pieces, so
 * the forward computes every micro-block's scores of a tile before the P V
 * products. The model's layout puts a head's rows 4-8 KB apart, all in a few
 * L1 sets. These only move values: the results are bit-identical to the
 * earlier one-micro-block-at-a-time kernel on [hd][Tp] and strided rows.
 *
 * Prefetches: the loops over a head's rows in the model's layout (the copies
 * in and out, the backward's D = rowsum(dout * out)) prefetch KERN_ROWS_PF rows
 * ahead, and the forward's last tile of a block prefetches the block's out
 * rows during its P V: rows 4-8 KB apart, each its own page, which the
 * hardware prefetchers do not follow. The softmax and the backward's P / dS
 * pass skip the mask on vectors with every lane visible, and the forward's
 * softmax runs the block's rows in three sweeps (max; expf of the rescaling;
 * exp and sum) so one row's chain overlaps the next. None of this changes a
 * result bit (W3's shape: forward and backward -4% each, docs/benchmarks.md).
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
 * Block form (ops.h, kern_attn_blk: ring attention): att2_fwd_body / att2_bwd_body,
 * as blocked_avx512's (the offset form is the block with k0 = 0, the same bits).
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

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/cpu/avx2_util.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"

#define MR 6            /* query rows per micro-block */
#define BQ (8 * MR)     /* query rows per block: 48 */
#define BK 64           /* keys per tile (4 chunks of 16) */
#define KC 16           /* keys per score chunk, columns of hd per register tile: 2 ymm */

/* Every K (or V) head transposed once per call, 16-key chunk by chunk: chunk
 * jc of head (b, kh) is [hd][KC] at xt + ((b * nkv + kh) * Tp + jc * KC) * hd,
 * element [i][c] = x[b, jc * KC + c, kh, i] for keys < T, zero past T. The
 * score products read a chunk's 16-key row with 2 loads, and no chunk is
 * re-transposed for every query head and block that reads it. Chunk-major, so
 * the 16 x hd operand of a score chunk is one piece (8 KB at hd 128, a quarter
 * of Zen 3's 32 KB L1d) read front to back; with rows Tp floats apart (1 KB at
 * T = 256) the rows of a chunk fell into a few L1 sets and were re-read from
 * L2 by every micro-block. The transposes are 8 x 8 in registers (a scalar
 * gather before: the same values moved, so results do not change). */
T256 static float *att2_transpose(const float *x, int B, int T, int ld, int nkv, int hd, int Tp) {
    // returns xt[B*nkv, Tp/KC, hd, KC]; x[B,T,nkv,hd]
    float *xt = ct_malloc64((size_t)B * nkv * hd * Tp * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++) {
                float *dst = xt + ((size_t)b * nkv + kh) * hd * Tp;
                for (int j0 = 0; j0 < Tp; j0 += 8) { /* 8 keys x 8 of hd per transpose */
                    int n = T - j0 < 8 ? (T - j0 > 0 ? T - j0 : 0) : 8;
                    const float *src = x + (((size_t)b * ld + j0) * nkv + kh) * hd; // key j0 + c at + c*nkv*hd
                    float *ch = dst + (size_t)(j0 / KC) * KC * hd + j0 % KC;
                    for (int i0 = 0; i0 < hd; i0 += 8) { /* hd is a multiple of KC here */
                        __m256 r[8];
#pragma GCC unroll 8
                        for (int c = 0; c < 8; c++) /* keys past T: zeros */
                            r[c] = c < n ? _mm256_loadu_ps(src + (size_t)c * nkv * hd + i0) : _mm256_setzero_ps();
                        avx2_transpose8(r);
#pragma GCC unroll 8
                        for (int i = 0; i < 8; i++) _mm256_storeu_ps(ch + (size_t)(i0 + i) * KC, r[i]);
                    }
                }
            }
        KERN_TRACE_EXIT(kt_);
    }
    return xt;
}

/* dst[(i / KC) * T * KC + t * KC + i % KC] = x[t * xs + i] for t < T: rows of
 * one head as KC-column slabs [hd/KC][T][KC]. A product over 16 columns of hd
 * (P V, dS K) then reads its keys' rows as one contiguous piece (4 KB for a
 * 64-key tile), which stays in L1 while every micro-block of the block uses it;
 * from [T][hd] rows its 64 B per row fell 512 B apart, 8 of L1's 64 sets. */
T256 static void att2_slabs_in(float *dst, const float *x, long xs, int T, int hd) {
    for (int t = 0; t < T; t++) {
        if (t + KERN_ROWS_PF < T) kern_prefetch_row(x + (size_t)(t + KERN_ROWS_PF) * xs, hd, 0);
        for (int c0 = 0; c0 < hd; c0 += KC)
            memcpy(dst + (size_t)c0 * T + (size_t)t * KC, x + (size_t)t * xs + c0, KC * sizeof(float));
    }
}

/* vh[b * nkv + kh] = v[b, :, kh, :] as slabs (att2_slabs_in), for the forward's P V. */
T256 static float *att2_heads(const float *v, int B, int T, int ld, int nkv, int hd) {
    float *vh = ct_malloc64((size_t)B * nkv * T * hd * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++)
                att2_slabs_in(vh + ((size_t)b * nkv + kh) * T * hd, v + ((size_t)b * ld * nkv + kh) * hd,
                              (long)nkv * hd, T, hd);
        KERN_TRACE_EXIT(kt_);
    }
    return vh;
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

/* Whether vector j of a row (keys 8j .. 8j + 7) has a lane outside lo <= key < n:
 * the vectors that need att2_keymask(lo, n, 0, j); the others skip it (a blend
 * or an and with all lanes set changes nothing). */
T256_INLINE int att2_part_hidden(int lo, int n, int j) { return 8 * j < lo || 8 * j + 8 > n; }

/* The forward, written for the block form (ops.h, kern_attn_blk): Tq query rows at
 * positions q0.. against the Tk keys at positions k0.., in blocks of rows from q0 (t0:
 * a block's first position, lt0 = t0 - q0 its first row of q); key tiles are by index
 * in the block (j0), their masks by position (p0 = k0 + j0). With ls (the running sums
 * l) it is the block form: out, lse are the state acc, m, read first and written back;
 * without, the offset form (q0 = Tk - Tq, k0 = 0, unstrided), which starts from m =
 * -inf, l = 0 and finishes out = acc / l, lse = m + log l. hd % KC == 0. */
T256 static void att2_fwd_body(float *out, float *lse, float *ls, const float *q, const float *k, const float *v,
                               const kern_attn_blk *g, const kern_attn_opt *opt) {
    // out[B,ldq,nh,hd], lse[B,nh,ldq], q[B,ldq,nh,hd], k[B,ldk,nkv,hd], v[B,ldk,nkv,hd]
    int B = g->B, Tq = g->Tq, Tk = g->Tk, nh = g->nh, nkv = g->nkv, hd = g->hd;
    int group = nh / nkv, q0 = g->q0, k0 = g->k0, ldq = g->ldq;
    int nqb = (Tq + BQ - 1) / BQ;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int qs = nh * hd; // row stride of q and out
    int Tp = (Tk + BK - 1) / BK * BK;
    float *KT = att2_transpose(k, B, Tk, g->ldk, nkv, hd, Tp); // [B*nkv, Tp/KC, hd, KC]
    float *VH = att2_heads(v, B, Tk, g->ldk, nkv, hd);          // [B*nkv, hd/KC, Tk, KC]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *acc = ct_malloc64((size_t)BQ * hd * sizeof(float)); // [hd/KC, BQ, KC] unnormalised out
        float *QB = ct_malloc64((size_t)BQ * hd * sizeof(float));  // [BQ, hd] the block's q rows (kern_rows_in)
        float P[BQ * BK];                                        // [BQ, BK] scores, then probabilities
        float m[BQ], l[BQ], alpha[BQ];                           // running max, sum; rescaling
        int clo[BQ], ncr[BQ];                                    // row r sees keys clo[r] <= c < ncr[r] of the tile
        int mbc[BQ / MR][2];                                     // per micro-block: first, end key column
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < nh; h++) {
                for (int qb = 0; qb < nqb; qb++) {
                    int kh = h / group, lt0 = qb * BQ, t0 = q0 + lt0;
                    int nq = Tq - lt0 < BQ ? Tq - lt0 : BQ, nmb = (nq + MR - 1) / MR;
                    const float *kth = KT + ((size_t)b * nkv + kh) * hd * Tp; // chunk of key j0 at + j0*hd
                    const float *vh = VH + ((size_t)b * nkv + kh) * Tk * hd; // slab c0, row j at + c0*Tk + j*KC
                    float *sm = lse + ((size_t)b * nh + h) * ldq + lt0; // the rows' m (lse), l
                    /* the keys of the block that some row sees: from the tile of the first
                     * row's first key (the window) up to the last row's diagonal */
                    int jlo = kern_attn_first_key(t0, window) - k0, jend = t0 + nq - k0;
                    jlo = jlo > 0 ? jlo / BK * BK : 0, jend = jend < Tk ? jend : Tk;
                    if (ls && jlo >= jend) continue; /* the state stays as it is */
                    kern_rows_in(QB, hd, q + (((size_t)b * ldq + lt0) * nh + h) * hd, qs, nq, hd); // row r at + r*hd
                    for (int r = 0; r < BQ; r++) m[r] = -INFINITY, l[r] = 0.0f;
                    memset(acc, 0, (size_t)BQ * hd * sizeof(float));
                    if (ls)
                        for (int r = 0; r < nq; r++) {
                            const float *ar = out + (((size_t)b * ldq + lt0 + r) * nh + h) * hd;
                            m[r] = sm[r], l[r] = ls[sm - lse + r];
                            for (int i = 0; i < hd; i += KC)
                                memcpy(acc + (size_t)(i / KC) * KC * BQ + (size_t)r * KC, ar + i, KC * sizeof(float));
                        }
                    for (int j0 = jlo; j0 < jend; j0 += BK) {
                        int nk = jend - j0 < BK ? jend - j0 : BK, p0 = k0 + j0; /* p0: the tile's first position */
                        /* Each product loops over the block's micro-blocks inside the loop over
                         * its operand's pieces: a 16-key chunk of K (8 KB at hd 128), a 16-column
                         * slab of the tile's V rows (4 KB), so the piece stays in L1 (Zen 3:
                         * 32 KB) while the 8 micro-blocks read it, beside the block's q rows
                         * (24 KB) or its P (12 KB) and acc slab (3 KB). One micro-block at a time
                         * read the whole K and V tile (64 KB) each, from L2. */
                        for (int mb = 0; mb < nmb; mb++) {
                            int ncmax = 0, cmin = BK;
                            for (int r = mb * MR; r < (mb + 1) * MR; r++) {
                                int rr = r < nq ? r : nq - 1;                           /* rows past T repeat the last */
                                int nc = t0 + rr - p0 + 1 < nk ? t0 + rr - p0 + 1 : nk; // keys p0..t
                                int c0 = kern_attn_first_key(t0 + rr, window) - p0;    // and from lo(t) on
                                clo[r] = c0 > 0 ? c0 : 0;
                                ncr[r] = nc > clo[r] ? nc : 0;
                                if (ncr[r] > ncmax) ncmax = ncr[r];
                                if (ncr[r] && clo[r] < cmin) cmin = clo[r];
                            }
                            mbc[mb][0] = cmin;
                            mbc[mb][1] = ncmax;
                        }
                        /* scores: chunk ch of micro-block mb if it holds a visible key */
                        for (int ch = 0; ch < BK / KC; ch++) {
                            for (int mb = 0; mb < nmb; mb++) {
                                if (!mbc[mb][1] || ch < mbc[mb][0] / KC || ch >= (mbc[mb][1] + KC - 1) / KC) continue;
                                const float *x[MR];
#pragma GCC unroll 6
                                for (int r = 0; r < MR; r++) {
                                    int rr = mb * MR + r < nq ? mb * MR + r : nq - 1;
                                    x[r] = QB + (size_t)rr * hd;
                                }
                                att2_dots6(P + (size_t)mb * MR * BK + ch * KC, x, kth + (size_t)(j0 + ch * KC) * hd, KC,
                                           hd);
                            }
                        }
                        /* The online softmax, in three sweeps over the block's rows: the scores
                         * scaled and masked and each row's max; the new maxima and the scalar expf
                         * of each row's rescaling; then the exp pass and the sums. Row by row, each
                         * row's max -> expf -> exp pass was one dependent chain with a libm call in
                         * it, which the core could not overlap with the next row's (the softmax was
                         * ~14% of W3's forward, timed by leaving it out). The same operations in the
                         * same order per row: the same bits. Vectors whose 8 keys the row sees
                         * skip the mask (att2_part_hidden). */
                        float bmax[BQ];
                        for (int mb = 0; mb < nmb; mb++) {
                            if (!mbc[mb][1]) continue;
                            int ch0 = mbc[mb][0] / KC, nch = (mbc[mb][1] + KC - 1) / KC;
                            __m256 vsc = _mm256_set1_ps(scale);
                            for (int r = mb * MR; r < (mb + 1) * MR; r++) {
                                float *pr = P + (size_t)r * BK;
                                __m256 mx = _mm256_set1_ps(-INFINITY);
                                for (int j = 2 * ch0; j < 2 * nch; j++) {
                                    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(pr + 8 * j), vsc);
                                    if (att2_part_hidden(clo[r], ncr[r], j) || cap > 0.0f) {
                                        __m256 mk = att2_keymask(clo[r], ncr[r], 0, j);
                                        s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, mk);
                                        if (cap > 0.0f) { /* gemma: cap tanh(s / cap) */
                                            __m256 vc = _mm256_set1_ps(cap);
                                            s = _mm256_blendv_ps(s, _mm256_mul_ps(vc, tanh8(_mm256_div_ps(s, vc))), mk);
                                        }
                                    }
                                    _mm256_storeu_ps(pr + 8 * j, s);
                                    mx = _mm256_max_ps(mx, s);
                                }
                                bmax[r] = avx2_hmax(mx);
                            }
                        }
                        for (int mb = 0; mb < nmb; mb++) {
                            if (!mbc[mb][1]) continue;
                            for (int r = mb * MR; r < (mb + 1) * MR; r++) {
                                if (bmax[r] == -INFINITY) { /* no key of this block: nothing changes */
                                    alpha[r] = 1.0f;
                                    continue;
                                }
                                float mnew = bmax[r] > m[r] ? bmax[r] : m[r];
                                alpha[r] = expf(m[r] - mnew); // 0 on the first block (m = -inf)
                                m[r] = mnew;
                            }
                        }
                        for (int mb = 0; mb < nmb; mb++) {
                            if (!mbc[mb][1]) continue;
                            int ch0 = mbc[mb][0] / KC, nch = (mbc[mb][1] + KC - 1) / KC;
                            for (int r = mb * MR; r < (mb + 1) * MR; r++) {
                                float *pr = P + (size_t)r * BK;
                                if (bmax[r] == -INFINITY) {
                                    memset(pr + ch0 * KC, 0, (size_t)(nch - ch0) * KC * sizeof(float));
                                    continue;
                                }
                                __m256 vm = _mm256_set1_ps(m[r]), sum = _mm256_setzero_ps();
                                for (int j = 2 * ch0; j < 2 * nch; j++) {
                                    __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + 8 * j), vm)); // masked: 0
                                    sum = _mm256_add_ps(sum, p);
                                    _mm256_storeu_ps(pr + 8 * j, p);
                                }
                                l[r] = l[r] * alpha[r] + avx2_hsum(sum);
                            }
                        }
                        /* P V over keys cmin.. only: the columns before it are masked in every row */
                        int last = !ls && j0 + BK >= jend;
                        for (int c0 = 0; c0 < hd; c0 += KC)
                            for (int mb = 0; mb < nmb; mb++) {
                                int cmin = mbc[mb][0], ncmax = mbc[mb][1];
                                if (last) /* the block's out rows (qs floats apart), ahead of the stores below */
                                    for (int r = mb * MR; r < (mb + 1) * MR && r < nq; r++)
                                        __builtin_prefetch(out + ((size_t)b * ldq + lt0 + r) * qs + (size_t)h * hd + c0, 1, 3);
                                if (!ncmax) continue;
                                att2_rows6_axpy(acc + (size_t)c0 * BQ + (size_t)mb * MR * KC, KC, alpha + mb * MR,
                                                P + (size_t)mb * MR * BK + cmin, vh + (size_t)c0 * Tk + (size_t)(j0 + cmin) * KC,
                                                KC, ncmax - cmin);
                            }
                    }
                    for (int r = 0; r < nq; r++) {
                        float *ot = out + ((size_t)b * ldq + lt0 + r) * qs + (size_t)h * hd;
                        if (ls) { /* the state, unnormalised: the block form's finish divides */
                            for (int i = 0; i < hd; i += KC)
                                memcpy(ot + i, acc + (size_t)(i / KC) * KC * BQ + (size_t)r * KC, KC * sizeof(float));
                            sm[r] = m[r], ls[sm - lse + r] = l[r];
                            continue;
                        }
                        __m256 inv = _mm256_set1_ps(1.0f / l[r]);
                        for (int i = 0; i < hd; i += 8) {
                            const float *ar = acc + (size_t)(i / KC) * KC * BQ + (size_t)r * KC + i % KC;
                            _mm256_storeu_ps(ot + i, _mm256_mul_ps(_mm256_loadu_ps(ar), inv));
                        }
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
    free(VH);
}

T256 void kern_attention_fwd_q0_avx2(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                     int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    if (hd % KC) {
        op_attention_fwd_q0_tiled_avx2(out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt);
        return;
    }
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att2_fwd_body(out, lse, NULL, q, k, v, &g, opt);
}

T256 void kern_attention_fwd_avx2(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                  int T, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    kern_attention_fwd_q0_avx2(out, lse, q, k, v, B, T, T, nh, nkv, hd, opt);
}

/* The backward, for the block form as the forward: the query side's rows (q, dout,
 * out, lse, dq and their copies here) indexed from q0 (lt0 = t0 - q0), the keys' from
 * k0 (the tile at index j0 is at position p0 = k0 + j0), masks by position. With Dg
 * (the block form) D is given and out unused; without, D = rowsum(dout * out) here.
 * acc 0 overwrites dq, dk and dv. hd % KC == 0. */
T256 static void att2_bwd_body(float *dq, float *dk, float *dv, const float *dout, const float *out,
                               const float *lse, const float *Dg, const float *q, const float *k, const float *v,
                               const kern_attn_blk *g, const kern_attn_opt *opt, int acc) {
    // dq[B,ldq,nh,hd], dk[B,ldk,nkv,hd], dv[B,ldk,nkv,hd], dout[B,ldq,nh,hd], out[B,ldq,nh,hd], lse[B,nh,ldq],
    // q[B,ldq,nh,hd], k[B,ldk,nkv,hd], v[B,ldk,nkv,hd]
    int B = g->B, Tq = g->Tq, Tk = g->Tk, nh = g->nh, nkv = g->nkv, hd = g->hd;
    int group = nh / nkv, q0 = g->q0, k0 = g->k0, ldq = g->ldq, ldk = g->ldk;
    int nqb = (Tq + BQ - 1) / BQ;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int qs = nh * hd, ks = nkv * hd;
    int hdp = hd + KC; /* row stride of the q and dout copies (QS, GS) */
    int b16 = kern_attn_bf16(opt);
    int Tp = (Tk + BK - 1) / BK * BK;
    float *KT = att2_transpose(k, B, Tk, ldk, nkv, hd, Tp); // [B*nkv, Tp/KC, hd, KC]
    float *VT = att2_transpose(v, B, Tk, ldk, nkv, hd, Tp); // [B*nkv, Tp/KC, hd, KC]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *P = ct_malloc64((size_t)BQ * BK * sizeof(float));  // [BQ, BK] recomputed probs (0 where masked)
        float *dS = ct_malloc64((size_t)BQ * BK * sizeof(float)); // [BQ, BK] scale * dscores (0 where masked)
        float L[BQ];
        /* the rows the products stream, contiguous: k of the kv head as slabs
         * (att2_slabs_in; dS K reads a 4 KB slab of a tile per 16 columns), q and
         * dout of the query head as rows (kern_rows_in; the scores, dP, dV and dK
         * read the block's 48). The q and dout rows are hdp = hd + 16 floats
         * apart: the dV / dK products read 16 columns of the block's 48 rows,
         * which at a 512-byte stride fell into 8 of L1's 64 sets (measured
         * together with the gradient rows below, not apart). */
        float *KS = ct_malloc64(((size_t)(3 * Tk + Tq + MR) * hd + (size_t)2 * Tq * hdp + Tq) * sizeof(float));
        float *QS = KS + (size_t)Tk * hd, *GS = QS + (size_t)Tq * hdp;
        /* dk, dv of the kv head and dq of the query head, accumulated here as
         * [T][hd] rows (copied in, summed in the same order, copied back: the
         * same bits as summing in place). In place, the 6 rows a register
         * tile loads and stores were ks or qs floats apart (4 or 8 KB at hd
         * 128): every row its own page and all in one L1 set, so each tile's
         * accumulators came from L2 through a TLB miss, for the 33 rows (T 256)
         * of FMAs between that load and the store. Here they are 512 bytes
         * apart in one page. Rows, not [hd/16][T][16] slabs: the copies move
         * whole 512-byte rows, and measured 4% faster than slabs (8 x 64-byte
         * pieces per row). */
        float *DKS = GS + (size_t)Tq * hdp, *DVS = DKS + (size_t)Tk * hd, *DQS = DVS + (size_t)Tk * hd;
        /* DQS has MR rows past T, so the dS K product runs a partial last micro-block
         * as a whole one: its padded rows have dS = 0 and are never copied back
         * (row by row, each column chunk was one dependent FMA chain) */
        memset(DQS + (size_t)Tq * hd, 0, (size_t)MR * hd * sizeof(float));
        float *D = DQS + (size_t)(Tq + MR) * hd; /* [Tq] rowsum(dout * out) of the query head */
        // One thread per (b, kv head): it owns the dk/dv rows of that head and
        // the dq rows of the group's query heads, so every sum is its own.
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kth = KT + ((size_t)b * nkv + kh) * hd * Tp, *vth = VT + ((size_t)b * nkv + kh) * hd * Tp;
                const float *kh_ = KS; // slabs [hd/KC][Tk][KC] (att2_slabs_in)
                size_t ko = ((size_t)b * ldk * nkv + kh) * hd; /* the kv head's first row */
                float *dkh = dk + ko; // row j at + j*ks
                float *dvh = dv + ko;
                att2_slabs_in(KS, k + ko, ks, Tk, hd);
                kern_rows_sum_in(DKS, dkh, ks, Tk, hd, acc); // row j at + j*hd
                kern_rows_sum_in(DVS, dvh, ks, Tk, hd, acc);
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    size_t qo = ((size_t)b * ldq * nh + h) * hd; /* the query head's first row */
                    const float *oh = Dg ? NULL : out + qo; // position t at + (t - q0)*qs
                    const float *qh = QS, *gh = GS;         // position t at + (t - q0)*hdp
                    float *dqh = dq + qo;                   // position t at + (t - q0)*qs
                    const float *lh = lse + ((size_t)b * nh + h) * ldq; /* lse (and Dg) of row r at + r */
                    kern_rows_sum_in(DQS, dqh, qs, Tq, hd, acc); // position t at + (t - q0)*hd
                    kern_rows_in(QS, hdp, q + qo, qs, Tq, hd);
                    kern_rows_in(GS, hdp, dout + qo, qs, Tq, hd);
                    /* D = rowsum(dout * out) = sum_j p_j dp_j, the head's rows in one loop: out's
                     * rows are qs floats apart, a page or two each, which no hardware prefetcher
                     * follows; a block's 48 at a time (and in between, the tile products) left
                     * ~5% of W3's backward waiting on them; here the next rows are prefetched */
                    for (int t = 0; t < Tq; t++) {
                        if (Dg) { /* the block form: given */
                            D[t] = Dg[lh - lse + t];
                            continue;
                        }
                        if (t + KERN_ROWS_PF < Tq) kern_prefetch_row(oh + (size_t)(t + KERN_ROWS_PF) * qs, hd, 0);
                        D[t] = att2_dot(gh + (size_t)t * hdp, oh + (size_t)t * qs, hd);
                    }
                    for (int qb = 0; qb < nqb; qb++) {
                        int lt0 = qb * BQ, t0 = q0 + lt0;
                        int nq = Tq - lt0 < BQ ? Tq - lt0 : BQ, nmb = (nq + MR - 1) / MR;
                        /* the keys of the block that some row sees (the forward's range) */
                        int jlo = kern_attn_first_key(t0, window) - k0, jend = t0 + nq - k0;
                        jlo = jlo > 0 ? jlo / BK * BK : 0, jend = jend < Tk ? jend : Tk;
                        if (jlo >= jend) continue;
                        for (int r = 0; r < nq; r++) L[r] = lh[lt0 + r];
                        for (int j0 = jlo; j0 < jend; j0 += BK) {
                            int nk = jend - j0 < BK ? jend - j0 : BK, p0 = k0 + j0; /* p0: the tile's first position */
                            /* keys cmm <= c < ncm visible to each micro-block (cmm = 0 without a window) */
                            int ncm[BQ / MR], cmm[BQ / MR];
                            int ncr[BQ], clo[BQ]; /* row r: keys clo[r] <= c < ncr[r] */
                            for (int mb = 0; mb < nmb; mb++) {
                                int ncmax = 0, cmin = BK;
                                for (int r = mb * MR; r < (mb + 1) * MR; r++) {
                                    int rr = r < nq ? r : nq - 1;
                                    int nc = t0 + rr - p0 + 1 < nk ? t0 + rr - p0 + 1 : nk;
                                    int c0 = kern_attn_first_key(t0 + rr, window) - p0;
                                    clo[r] = c0 > 0 ? c0 : 0;
                                    ncr[r] = r < nq && nc > clo[r] ? nc : 0; /* padded rows: all masked */
                                    if (ncr[r] > ncmax) ncmax = ncr[r];
                                    if (ncr[r] && clo[r] < cmin) cmin = clo[r];
                                }
                                ncm[mb] = ncmax;
                                cmm[mb] = window && ncmax ? cmin : 0;
                            }
                            /* S = Q K^T, then dP = dO V^T, each a chunk of K (V) at a time across the
                             * micro-blocks that see it (the forward's order: the 8 KB chunk stays in L1
                             * beside the block's 24 KB of q, then of dout, rows) */
                            for (int pass = 0; pass < 2; pass++) {
                                const float *xh = pass ? gh : qh, *yt = pass ? vth : kth;
                                float *sb = pass ? dS : P;
                                for (int ch = 0; ch < BK / KC; ch++)
                                    for (int mb = 0; mb < nmb; mb++) {
                                        if (ch < cmm[mb] / KC || ch >= (ncm[mb] + KC - 1) / KC) continue;
                                        const float *x[MR];
#pragma GCC unroll 6
                                        for (int r = 0; r < MR; r++) {
                                            int rr = mb * MR + r < nq ? mb * MR + r : nq - 1;
                                            x[r] = xh + (size_t)(lt0 + rr) * hdp;
                                        }
                                        att2_dots6(sb + (size_t)mb * MR * BK + ch * KC, x,
                                                   yt + (size_t)(j0 + ch * KC) * hd, KC, hd);
                                    }
                            }
                            for (int mb = 0; mb < nmb; mb++) {
                                int r0 = mb * MR;
                                float *pb = P + (size_t)r0 * BK, *db = dS + (size_t)r0 * BK;
                                int ch0 = cmm[mb] / KC, nch = (ncm[mb] + KC - 1) / KC;
                                __m256 vsc = _mm256_set1_ps(scale), vc = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f);
                                for (int r = 0; r < MR; r++) {
                                    int rr = r0 + r < nq ? r0 + r : nq - 1, lo = clo[r0 + r], hi = ncr[r0 + r];
                                    __m256 vl = _mm256_set1_ps(L[rr]), vd = _mm256_set1_ps(D[lt0 + rr]);
                                    float *pr = pb + (size_t)r * BK, *dr = db + (size_t)r * BK;
                                    for (int j = 2 * ch0; j < 2 * nch; j++) {
                                        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(pr + 8 * j), vsc), p, ds;
                                        int part = att2_part_hidden(lo, hi, j);
                                        __m256 mk = part ? att2_keymask(lo, hi, 0, j) : _mm256_castsi256_ps(_mm256_set1_epi32(-1));
                                        if (cap > 0.0f) { /* s = cap tanh(x / cap), ds/dx = 1 - tanh^2 */
                                            __m256 th = tanh8(_mm256_div_ps(x, vc));
                                            p = _mm256_and_ps(mk, exp8(_mm256_sub_ps(_mm256_mul_ps(vc, th), vl)));
                                            ds = _mm256_mul_ps(
                                                _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dr + 8 * j), vd)),
                                                              _mm256_fnmadd_ps(th, th, one)),
                                                vsc);
                                        } else {
                                            p = exp8(_mm256_sub_ps(x, vl));
                                            if (part) p = _mm256_and_ps(mk, p);
                                            ds = _mm256_mul_ps(
                                                _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dr + 8 * j), vd)), vsc);
                                        }
                                        _mm256_storeu_ps(pr + 8 * j, p);
                                        _mm256_storeu_ps(dr + 8 * j, ds);
                                    }
                                    /* chunks no row of the micro-block sees: zero for the key loops below
                                     * (vector stores: four memset calls a row, mostly of 0 bytes, cost
                                     * more than the stores) */
                                    __m256 z = _mm256_setzero_ps();
                                    for (int j = 0; j < 2 * ch0; j++) {
                                        _mm256_storeu_ps(pr + 8 * j, z);
                                        _mm256_storeu_ps(dr + 8 * j, z);
                                    }
                                    for (int j = 2 * nch; j < 2 * (BK / KC); j++) {
                                        _mm256_storeu_ps(pr + 8 * j, z);
                                        _mm256_storeu_ps(dr + 8 * j, z);
                                    }
                                }
                            }
                            if (b16) { /* the products below take P and dS as bf16 (dS from fp32 P above) */
                                ct_round_bf16(P, (size_t)nmb * MR * BK);
                                ct_round_bf16(dS, (size_t)nmb * MR * BK);
                            }
                            // dv[j] += sum_t P[t,j] dout[t]; dk[j] += sum_t dS[t,j] q[t]; 6 keys at a time,
                            // each group over the query rows rs <= r < re that see one of its keys: from the
                            // first row that sees its first key, to the last that sees its last (a window)
                            for (int c0 = 0; c0 < hd; c0 += KC) {
                                const float *gx = gh + (size_t)lt0 * hdp + c0, *qx = qh + (size_t)lt0 * hdp + c0;
                                int c = 0;
                                while (c < nk) {
                                    int keys = nk - c >= 6 ? 6 : nk - c >= 4 ? 4 : nk - c >= 2 ? 2 : 1;
                                    int rs = p0 + c - t0 > 0 ? p0 + c - t0 : 0, re = nq;
                                    if (window) { /* row t sees key j iff j <= t < j + window */
                                        re = p0 + c + keys - 1 + window - t0;
                                        re = re < nq ? re : nq;
                                    }
                                    float *dvr = DVS + (size_t)(j0 + c) * hd + c0;
                                    float *dkr = DKS + (size_t)(j0 + c) * hd + c0;
                                    if (re <= rs) {
                                    } else if (keys == 6) {
                                        att2_keys_axpy(dvr, hd, 6, P, c, gx, hdp, rs, re);
                                        att2_keys_axpy(dkr, hd, 6, dS, c, qx, hdp, rs, re);
                                    } else if (keys == 4) {
                                        att2_keys_axpy(dvr, hd, 4, P, c, gx, hdp, rs, re);
                                        att2_keys_axpy(dkr, hd, 4, dS, c, qx, hdp, rs, re);
                                    } else if (keys == 2) {
                                        att2_keys_axpy(dvr, hd, 2, P, c, gx, hdp, rs, re);
                                        att2_keys_axpy(dkr, hd, 2, dS, c, qx, hdp, rs, re);
                                    } else {
                                        att2_keys_axpy(dvr, hd, 1, P, c, gx, hdp, rs, re);
                                        att2_keys_axpy(dkr, hd, 1, dS, c, qx, hdp, rs, re);
                                    }
                                    c += keys;
                                }
                            }
                            // dq[t] += sum_j dS[t,j] k[j]: 6 rows at a time over the keys the micro-block
                            // sees, a 16-column slab of the tile's k rows (4 KB, in L1) across the
                            // micro-blocks (a partial last one too: its rows past T are DQS's pad)
                            for (int c0 = 0; c0 < hd; c0 += KC) {
                                const float *ks_ = kh_ + (size_t)c0 * Tk; // key j's 16 at + j*KC
                                for (int mb = 0; mb < nmb; mb++) {
                                    int r0 = mb * MR, ncmax = ncm[mb], cm = cmm[mb];
                                    if (!ncmax) continue;
                                    att2_rows6_axpy(DQS + (size_t)(lt0 + r0) * hd + c0, hd, NULL, dS + (size_t)r0 * BK + cm,
                                                    ks_ + (size_t)(j0 + cm) * KC, KC, ncmax - cm);
                                }
                            }
                        }
                    }
                    kern_rows_out(dqh, qs, DQS, Tq, hd);
                }
                kern_rows_out(dkh, ks, DKS, Tk, hd);
                kern_rows_out(dvh, ks, DVS, Tk, hd);
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

T256 void kern_attention_bwd_q0_avx2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                     const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                     int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc) {
    if (hd % KC) {
        op_attention_bwd_q0_tiled_avx2(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, acc);
        return;
    }
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att2_bwd_body(dq, dk, dv, dout, out, lse, NULL, q, k, v, &g, opt, acc);
}

T256 void kern_attention_bwd_avx2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                  const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                  int nh, int nkv, int hd, const kern_attn_opt *opt, int acc) {
    kern_attention_bwd_q0_avx2(dq, dk, dv, dout, out, lse, q, k, v, B, T, T, nh, nkv, hd, opt, acc);
}

/* The block form (ops.h, kern_attn_blk; ring attention): the bodies above with the
 * block's state and strides; the generic tiled pair for head dims they do not take. */
T256 void kern_attention_fwd_blk_avx2(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                                      const kern_attn_blk *g, const kern_attn_opt *opt) {
    if (g->hd % KC) {
        op_attention_fwd_blk_tiled(acc, m, l, q, k, v, g, opt);
        return;
    }
    att2_fwd_body(acc, m, l, q, k, v, g, opt);
}

T256 void kern_attention_bwd_blk_avx2(float *dq, float *dk, float *dv, const float *dout, const float *lse,
                                      const float *D, const float *q, const float *k, const float *v,
                                      const kern_attn_blk *g, const kern_attn_opt *opt) {
    if (g->hd % KC) {
        op_attention_bwd_blk_tiled(dq, dk, dv, dout, lse, D, q, k, v, g, opt);
        return;
    }
    att2_bwd_body(dq, dk, dv, dout, NULL, lse, D, q, k, v, g, opt, 1);
}

#endif /* __x86_64__ */
