/* kernels/cpu/attention_neon.c: register-blocked flash attention for NEON
 * ("blocked_neon"), same contract as op_attention_fwd/bwd (kernels/ops.h).
 *
 * Design. The algorithm of blocked_avx2 / blocked_avx512 and of the tiled
 * reference: 48-row query blocks x 64-key tiles up to the diagonal, online
 * softmax, lse saved, the backward recomputing P = exp(S - lse). What is
 * NEON's own is the register tile and, following from it, the layout.
 *
 * Register tile: 12 query rows x 8 (keys, or columns of hd) for every
 * product: 24 accumulators, 3 + 2 operand vectors per step, 29 of the 32 q
 * registers (the GEMM's 8 x 12 budget, gemm_neon.c, with the roles turned).
 * The width that runs along hd has to divide the head dims: 8 divides every
 * family's (64, 80, 96, 128, 256), 12 does not divide 128 (Qwen3 would fall
 * back), and 8 rows x 16 columns needs 32 accumulators, leaving no register
 * for the operands. So the 8 goes along hd and the 12 on the query rows,
 * whose block sizes are ours to pick.
 *
 * Rows in lanes. fmla by lane (vfmaq_laneq_f32) takes one operand's values
 * from the lanes of a vector, as the GEMM takes its A values. The scores take
 * the 8 keys from the lanes of a K^T row and multiply 3 vectors of the
 * block's transposed q rows (12 rows): S comes out transposed, S^T[key][row],
 * one vector holding 4 rows' scores of one key. Every later step wants
 * exactly that layout:
 *   softmax  the running max m, sum l and rescaling alpha are vectors of 4
 *            rows, updated by vmaxq / vaddq per key: no horizontal reduction
 *            (AVX2's kernel does a hmax and a hsum per row per tile);
 *   P V      acc[12 rows][8 of hd] += P V: per key 3 loads of P^T[key][rows]
 *            (rows from lanes) and 2 of V's row (8 columns), 24 FMAs;
 *   backward dP^T = V dO^T as the scores; dQ[12][8] += dS K as P V;
 *            dV[8 keys][8] += P^T dO and dK[8 keys][8] += dS^T Q sum over
 *            query rows, and P^T[key][r..r+3] holds 4 rows' weights in lanes:
 *            4 query rows per step, 16 accumulators + 8 weight vectors + 2
 *            row vectors (26 registers), 64 FMAs per 16 loads, the keys'
 *            rows held across the tile's rows (from the first that sees them).
 * So neither P nor dS is ever transposed; the only transposes are of inputs
 * (neon_util.h's neon_transpose_slab4, 4 x 4 in registers): K (and V in the
 * backward) once per call into 8-key chunks, the block's q (and dout) rows
 * once per block. Masked entries (past the diagonal or the sequence, left of
 * a window, rows past the end of a partial block) hold p = 0 and dS = 0, so
 * no product has a ragged edge inside a tile; padded rows read zeros.
 *
 * Memory (Neoverse V1/V2: 64 KB L1d). Each product loops over the block's 4
 * micro-blocks inside the loop over the operand they share, so that operand
 * is read from L1 by all of them: a K^T (V^T) chunk [hd][8] (4 KB at hd 128)
 * beside the block's q^T (dout^T) [hd][48] (24 KB) for the scores; a tile's
 * V (k) rows as an 8-column slab [64][8] (2 KB) beside S^T [64][48] (12 KB)
 * for P V and dS K; the query rows the dV / dK products stream come from
 * slabs [hd/8][48][8] of the block. Outputs: the forward's acc and the
 * backward's dQ are [hd/8][48][8] slabs of the block, written to out / added
 * to dq once per block; dV and dK rows are updated in place once per tile.
 *
 * Options (kern_attn_opt) as in blocked_avx2: a window starts the key loop
 * at the tile of the block's first visible key, masks lanes left of it,
 * skips the 8-key chunks no row of a micro-block sees and narrows dV / dK to
 * the query rows that see the keys; a soft cap uses neon_tanh4 with
 * d tanh = 1 - tanh^2 in the backward.
 *
 * Shapes: hd % 8 == 0 takes this path; any other head dim falls back to
 * "tiled" (kernels/ref/attention.c, NEON through `omp simd` on aarch64),
 * which has the same contract.
 *
 * Block form (ops.h, kern_attn_blk: ring attention): att_fwd_body / att_bwd_body,
 * as blocked_avx512's (the offset form is the block with k0 = 0, the same bits).
 *
 * Determinism: forward work is split by (b, head, query block), backward by
 * (b, kv head) as in the tiled kernel, so each output element is summed by
 * one thread in a fixed order; results do not depend on the thread count.
 * They differ from "ref" by summation order and the vector exp (kern_check).
 * aarch64 only: the whole file compiles to nothing elsewhere. */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/cpu/neon_util.h"
#include "kernels/ops.h"

#define MR 12       /* query rows per micro-block: 3 q registers, one row per lane */
#define BQ (4 * MR) /* query rows per block: 48 */
#define NC 8        /* keys per score chunk and per dV/dK group, columns of hd per product: 2 q registers */
#define BK 64       /* keys per tile: 8 chunks */

static int imin(int a, int b) { return a < b ? a : b; }
static int imax(int a, int b) { return a > b ? a : b; }

/* ------------------------------------------------------- operand layouts */

/* Every K (or V) head transposed once per call into NC-key chunks: chunk jc
 * of head (b, kh) is [hd][NC] at xt + ((b * nkv + kh) * Tp + jc * NC) * hd,
 * element [i][c] = x[b, jc * NC + c, kh, i], zeros for keys >= T. A score
 * step reads the 8 keys' values at one element of hd as 2 vectors, and a
 * chunk (4 KB at hd 128) is read front to back by every micro-block. */
static float *att_heads_t(const float *x, int B, int T, int ld, int nkv, int hd, int Tp) {
    // returns xt[B*nkv, Tp/NC, hd, NC]; x[B,ld,nkv,hd], its first T rows per sequence
    float *xt = ct_malloc64((size_t)B * nkv * Tp * hd * sizeof(float));
    long xs = (long)nkv * hd; // row stride of x
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++) {
                float *dst = xt + ((size_t)b * nkv + kh) * Tp * hd;
                const float *src = x + (size_t)b * ld * xs + (size_t)kh * hd; // key j at + j*xs
                for (int j0 = 0; j0 < Tp; j0 += 4) {                          /* 4 keys x hd per slab */
                    int n = imax(imin(T - j0, 4), 0);
                    neon_transpose_slab4(dst + (size_t)(j0 / NC) * NC * hd + j0 % NC, NC,
                                         n ? src + (size_t)j0 * xs : src, xs, n, hd);
                }
            }
        KERN_TRACE_EXIT(kt_);
    }
    return xt;
}

/* dst[(i / NC) * n * NC + t * NC + i % NC] = x[t * xs + i] for t < rows, zeros
 * for rows <= t < n: rows of one head as NC-column slabs [hd/NC][n][NC]. A
 * product over 8 columns of hd then reads its rows as one contiguous piece
 * (2 KB for a 64-key tile); in the model's layout a head's rows are 4-8 KB
 * apart, and the 48-64 rows a tile walks fall into a few L1 sets. */
static void att_slabs_in(float *dst, const float *x, long xs, int rows, int n, int hd) {
    for (int t = 0; t < rows; t++)
        for (int c0 = 0; c0 < hd; c0 += NC) {
            float *d = dst + (size_t)c0 * n + (size_t)t * NC;
            vst1q_f32(d, vld1q_f32(x + (size_t)t * xs + c0));
            vst1q_f32(d + 4, vld1q_f32(x + (size_t)t * xs + c0 + 4));
        }
    for (int c0 = 0; c0 < hd; c0 += NC)
        memset(dst + (size_t)c0 * n + (size_t)rows * NC, 0, (size_t)(n - rows) * NC * sizeof(float));
}

/* vs[b * nkv + kh] = v[b, :, kh, :] as slabs (att_slabs_in), for the forward's P V. */
static float *att_heads_slabs(const float *v, int B, int T, int ld, int nkv, int hd) {
    // returns vs[B*nkv, hd/NC, T, NC]; v[B,ld,nkv,hd], its first T rows per sequence
    float *vs = ct_malloc64((size_t)B * nkv * T * hd * sizeof(float));
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++)
                att_slabs_in(vs + ((size_t)b * nkv + kh) * T * hd, v + ((size_t)b * ld * nkv + kh) * hd,
                             (long)nkv * hd, T, T, hd);
        KERN_TRACE_EXIT(kt_);
    }
    return vs;
}

/* dst[i * BQ + r] = x[r * xs + i] for r < rows, zeros for rows <= r < BQ: a
 * block's query (or dout) rows transposed, [hd][BQ], so one element of hd of
 * 12 rows is 3 contiguous vectors. */
static void att_block_t(float *dst, const float *x, long xs, int rows, int hd) {
    for (int r0 = 0; r0 < BQ; r0 += 4) {
        int n = imax(imin(rows - r0, 4), 0);
        neon_transpose_slab4(dst + r0, BQ, n ? x + (size_t)r0 * xs : x, xs, n, hd);
    }
}

/* Which keys of the tile at key position j0 (nk keys) each row of the block at t0 (nq
 * rows) sees: row r sees tile keys clo[r] <= c < ncr[r] (ncr[r] = 0: none;
 * rows past nq see none); micro-block mb's rows see keys mbc[mb][0] <=
 * c < mbc[mb][1] between them (0, 0: none). */
static void att_visible(int32_t clo[BQ], int32_t ncr[BQ], int mbc[BQ / MR][2], int t0, int nq, int j0, int nk,
                        int window) {
    for (int mb = 0; mb < BQ / MR; mb++) {
        int cmin = BK, ncmax = 0;
        for (int r = mb * MR; r < (mb + 1) * MR; r++) {
            if (r >= nq) {
                clo[r] = ncr[r] = 0;
                continue;
            }
            int nc = imin(t0 + r - j0 + 1, nk);                      // keys j0..t
            clo[r] = imax(kern_attn_first_key(t0 + r, window) - j0, 0); // and from lo(t) on
            ncr[r] = nc > clo[r] ? nc : 0;
            if (ncr[r]) {
                ncmax = imax(ncmax, ncr[r]);
                cmin = imin(cmin, clo[r]);
            }
        }
        mbc[mb][0] = ncmax ? cmin : 0;
        mbc[mb][1] = ncmax;
    }
}

/* Lanes (rows r..r+3, their clo / ncr in lo / hi) that see tile key c. */
NEON_INLINE uint32x4_t att_mask(int32x4_t lo, int32x4_t hi, int c) {
    int32x4_t vc = vdupq_n_s32(c);
    return vandq_u32(vcleq_s32(lo, vc), vcgtq_s32(hi, vc));
}

NEON_INLINE float32x4_t att_and(uint32x4_t mk, float32x4_t x) {
    return vreinterpretq_f32_u32(vandq_u32(mk, vreinterpretq_u32_f32(x)));
}

/* ------------------------------------------------------ register tiles */

/* s[c * BQ + r] = sum_i xt[i * BQ + r] kt[i * NC + c] for 12 rows r and 8
 * keys c: one score chunk S^T[8 keys][12 rows] of a micro-block, the rows
 * from the block's transposed q (or dout) [hd][BQ], the keys from a chunk of
 * K^T (or V^T) [hd][NC], whose lanes feed the FMAs. */
NEON_INLINE void att_scores(float *s, const float *xt, const float *kt, int hd) {
    float32x4_t a[NC][3];
#pragma GCC unroll 8
    for (int c = 0; c < NC; c++) a[c][0] = a[c][1] = a[c][2] = vdupq_n_f32(0.0f);
    for (int i = 0; i < hd; i++) {
        const float *xr = xt + (size_t)i * BQ, *kr = kt + (size_t)i * NC;
        float32x4_t x0 = vld1q_f32(xr), x1 = vld1q_f32(xr + 4), x2 = vld1q_f32(xr + 8);
        float32x4_t k0 = vld1q_f32(kr), k1 = vld1q_f32(kr + 4);
#define ATT_KEY(c, kv, l)                                                                                              \
    a[c][0] = vfmaq_laneq_f32(a[c][0], x0, kv, l);                                                                     \
    a[c][1] = vfmaq_laneq_f32(a[c][1], x1, kv, l);                                                                     \
    a[c][2] = vfmaq_laneq_f32(a[c][2], x2, kv, l);
        ATT_KEY(0, k0, 0) ATT_KEY(1, k0, 1) ATT_KEY(2, k0, 2) ATT_KEY(3, k0, 3)
        ATT_KEY(4, k1, 0) ATT_KEY(5, k1, 1) ATT_KEY(6, k1, 2) ATT_KEY(7, k1, 3)
#undef ATT_KEY
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; c++) {
        vst1q_f32(s + c * BQ, a[c][0]);
        vst1q_f32(s + c * BQ + 4, a[c][1]);
        vst1q_f32(s + c * BQ + 8, a[c][2]);
    }
}

/* acc[r * NC + 0:8] (+)= sum_{c < nc} w[c * BQ + r] y[c * NC + 0:8] for the
 * 12 rows r of a micro-block: the P V and dS K products, w = P^T (dS^T) from
 * the micro-block's first row and the first key, y a slab of V (k) rows, acc a
 * [12][8] piece of a slab. scale[r] (NULL: none) multiplies row r of acc
 * first: the online softmax's rescaling. */
NEON_INLINE void att_rows_axpy(float *acc, const float *scale, const float *w, const float *y, int nc) {
    float32x4_t a[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        a[r][0] = vld1q_f32(acc + r * NC);
        a[r][1] = vld1q_f32(acc + r * NC + 4);
        if (scale) {
            a[r][0] = vmulq_n_f32(a[r][0], scale[r]);
            a[r][1] = vmulq_n_f32(a[r][1], scale[r]);
        }
    }
    for (int c = 0; c < nc; c++) {
        const float *wr = w + (size_t)c * BQ, *yr = y + (size_t)c * NC;
        float32x4_t w0 = vld1q_f32(wr), w1 = vld1q_f32(wr + 4), w2 = vld1q_f32(wr + 8);
        float32x4_t y0 = vld1q_f32(yr), y1 = vld1q_f32(yr + 4);
#define ATT_ROW(r, wv, l)                                                                                              \
    a[r][0] = vfmaq_laneq_f32(a[r][0], y0, wv, l);                                                                     \
    a[r][1] = vfmaq_laneq_f32(a[r][1], y1, wv, l);
        ATT_ROW(0, w0, 0) ATT_ROW(1, w0, 1) ATT_ROW(2, w0, 2) ATT_ROW(3, w0, 3)
        ATT_ROW(4, w1, 0) ATT_ROW(5, w1, 1) ATT_ROW(6, w1, 2) ATT_ROW(7, w1, 3)
        ATT_ROW(8, w2, 0) ATT_ROW(9, w2, 1) ATT_ROW(10, w2, 2) ATT_ROW(11, w2, 3)
#undef ATT_ROW
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        vst1q_f32(acc + r * NC, a[r][0]);
        vst1q_f32(acc + r * NC + 4, a[r][1]);
    }
}

/* out[c * os + 0:8] += sum_{r0 <= r < r1} w[c * BQ + r] x[r * NC + 0:8] for
 * KEYS keys c (8, 4, 2, 1: a constant at every call): the dV += P^T dO and
 * dK += dS^T Q products, w = P^T (dS^T) from the group's first key, x a slab
 * of the block's dout (q) rows. The keys' rows stay in registers across the
 * query rows; r0 and r1 are multiples of 4, so the weights of 4 rows of a key
 * are one vector, and a lane of it feeds each row's FMAs. */
NEON_INLINE void att_keys_axpy(const int KEYS, float *out, long os, const float *w, const float *x, int r0, int r1) {
    float32x4_t a[NC][2];
#pragma GCC unroll 8
    for (int c = 0; c < KEYS; c++) {
        a[c][0] = vld1q_f32(out + c * os);
        a[c][1] = vld1q_f32(out + c * os + 4);
    }
    for (int r = r0; r < r1; r += 4) {
        float32x4_t wv[NC];
#pragma GCC unroll 8
        for (int c = 0; c < KEYS; c++) wv[c] = vld1q_f32(w + (size_t)c * BQ + r);
        const float *xr = x + (size_t)r * NC;
#define ATT_QROW(l)                                                                                                    \
    {                                                                                                                  \
        float32x4_t x0 = vld1q_f32(xr + (l) * NC), x1 = vld1q_f32(xr + (l) * NC + 4);                                  \
        _Pragma("GCC unroll 8") for (int c = 0; c < KEYS; c++) {                                                       \
            a[c][0] = vfmaq_laneq_f32(a[c][0], x0, wv[c], l);                                                          \
            a[c][1] = vfmaq_laneq_f32(a[c][1], x1, wv[c], l);                                                          \
        }                                                                                                              \
    }
        ATT_QROW(0) ATT_QROW(1) ATT_QROW(2) ATT_QROW(3)
#undef ATT_QROW
    }
#pragma GCC unroll 8
    for (int c = 0; c < KEYS; c++) {
        vst1q_f32(out + c * os, a[c][0]);
        vst1q_f32(out + c * os + 4, a[c][1]);
    }
}

NEON_INLINE float att_dot(const float *x, const float *y, int n) {
    float32x4_t a = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 4) a = vfmaq_f32(a, vld1q_f32(x + i), vld1q_f32(y + i));
    return vaddvq_f32(a);
}

/* ---------------------------------------------------------------- forward */

/* The forward, written for the block form (ops.h, kern_attn_blk): Tq query rows at
 * positions q0.. against the Tk keys at positions k0.., in blocks of rows from q0 (t0:
 * a block's first position, lt0 = t0 - q0 its first row of q); key tiles are by index
 * in the block (j0), their masks by position (p0 = k0 + j0). With ls (the running sums
 * l) it is the block form: out, lse are the state acc, m, read first and written back;
 * without, the offset form (q0 = Tk - Tq, k0 = 0, unstrided), which starts from m =
 * -inf, l = 0 and finishes out = acc / l, lse = m + log l. hd % NC == 0. */
static void att_fwd_body(float *out, float *lse, float *ls, const float *q, const float *k, const float *v,
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
    float *KT = att_heads_t(k, B, Tk, g->ldk, nkv, hd, Tp);  // [B*nkv, Tp/NC, hd, NC]
    float *VS = att_heads_slabs(v, B, Tk, g->ldk, nkv, hd);  // [B*nkv, hd/NC, Tk, NC]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *QT = ct_malloc64((size_t)hd * BQ * sizeof(float));  // [hd, BQ] the block's q rows, transposed
        float *acc = ct_malloc64((size_t)hd * BQ * sizeof(float)); // [hd/NC, BQ, NC] unnormalised out
        float *S = ct_malloc64((size_t)BK * BQ * sizeof(float));   // [BK, BQ] S^T: scores, then probabilities
        float m[BQ], l[BQ], alpha[BQ];                           // running max, sum; rescaling of the tile
        int32_t clo[BQ], ncr[BQ];                                // row r sees tile keys clo[r] <= c < ncr[r]
        int mbc[BQ / MR][2];                                     // keys some row of micro-block mb sees
        const float32x4_t vsc = vdupq_n_f32(scale), vcap = vdupq_n_f32(cap), ninf = vdupq_n_f32(-INFINITY);
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < nh; h++) {
                for (int qb = 0; qb < nqb; qb++) {
                    int kh = h / group, lt0 = qb * BQ, t0 = q0 + lt0;
                    int nq = imin(Tq - lt0, BQ), nmb = (nq + MR - 1) / MR;
                    const float *kth = KT + ((size_t)b * nkv + kh) * Tp * hd; // chunk of key j0 at + j0*hd
                    const float *vsh = VS + ((size_t)b * nkv + kh) * Tk * hd; // slab c0, key j at + c0*Tk + j*NC
                    float *sm = lse + ((size_t)b * nh + h) * ldq + lt0; // the rows' m (lse), l
                    /* the keys of the block that some row sees: from the tile of the first
                     * row's first key (the window) up to the last row's diagonal */
                    int jlo = kern_attn_first_key(t0, window) - k0, jend = imin(t0 + nq - k0, Tk);
                    jlo = jlo > 0 ? jlo / BK * BK : 0;
                    if (ls && jlo >= jend) continue; /* the state stays as it is */
                    att_block_t(QT, q + (((size_t)b * ldq + lt0) * nh + h) * hd, qs, nq, hd);
                    for (int r = 0; r < BQ; r++) m[r] = -INFINITY, l[r] = 0.0f;
                    memset(acc, 0, (size_t)hd * BQ * sizeof(float));
                    if (ls)
                        for (int r = 0; r < nq; r++) {
                            const float *ar = out + (((size_t)b * ldq + lt0 + r) * nh + h) * hd;
                            m[r] = sm[r], l[r] = ls[sm - lse + r];
                            for (int c0 = 0; c0 < hd; c0 += NC)
                                memcpy(acc + (size_t)c0 * BQ + (size_t)r * NC, ar + c0, NC * sizeof(float));
                        }
                    for (int j0 = jlo; j0 < jend; j0 += BK) {
                        int nk = imin(jend - j0, BK);
                        att_visible(clo, ncr, mbc, t0, nq, k0 + j0, nk, window); /* by position */
                        /* scores: each 8-key chunk of K^T (4 KB at hd 128) across the micro-blocks
                         * that see one of its keys, while it stays in L1 beside the block's q^T */
                        for (int ch = 0; ch < BK / NC; ch++)
                            for (int mb = 0; mb < nmb; mb++) {
                                if (ch < mbc[mb][0] / NC || ch >= (mbc[mb][1] + NC - 1) / NC) continue;
                                att_scores(S + (size_t)ch * NC * BQ + mb * MR, QT + mb * MR,
                                           kth + (size_t)(j0 + ch * NC) * hd, hd);
                            }
                        /* online softmax, 4 rows per vector: m, l, alpha without horizontal reductions */
                        for (int mb = 0; mb < nmb; mb++) {
                            if (!mbc[mb][1]) continue;
                            int c0 = mbc[mb][0] / NC * NC, c1 = (mbc[mb][1] + NC - 1) / NC * NC;
                            for (int r = mb * MR; r < (mb + 1) * MR; r += 4) {
                                int32x4_t lo = vld1q_s32(clo + r), hi = vld1q_s32(ncr + r);
                                float32x4_t mx = ninf;
                                for (int c = c0; c < c1; c++) {
                                    float *sc = S + (size_t)c * BQ + r;
                                    float32x4_t x = vmulq_f32(vld1q_f32(sc), vsc);
                                    if (cap > 0.0f) x = vmulq_f32(vcap, neon_tanh4(vdivq_f32(x, vcap))); /* gemma */
                                    x = vbslq_f32(att_mask(lo, hi, c), x, ninf);
                                    vst1q_f32(sc, x);
                                    mx = vmaxq_f32(mx, x);
                                }
                                float32x4_t mold = vld1q_f32(m + r), mnew = vmaxq_f32(mold, mx);
                                /* rows that see no key of this tile: nothing changes (alpha 1) */
                                float32x4_t a = vbslq_f32(vceqq_f32(mx, ninf), vdupq_n_f32(1.0f),
                                                          neon_exp4(vsubq_f32(mold, mnew))); // 0 on a row's first keys
                                float32x4_t sum = vdupq_n_f32(0.0f);
                                for (int c = c0; c < c1; c++) {
                                    float *sc = S + (size_t)c * BQ + r;
                                    float32x4_t p = neon_exp4(vsubq_f32(vld1q_f32(sc), mnew));
                                    p = att_and(att_mask(lo, hi, c), p);
                                    sum = vaddq_f32(sum, p);
                                    vst1q_f32(sc, p);
                                }
                                vst1q_f32(l + r, vfmaq_f32(sum, vld1q_f32(l + r), a));
                                vst1q_f32(m + r, mnew);
                                vst1q_f32(alpha + r, a);
                            }
                        }
                        /* P V: each 8-column slab of the tile's V rows (2 KB) across the micro-blocks,
                         * over the keys some row of the micro-block sees */
                        for (int c0 = 0; c0 < hd; c0 += NC)
                            for (int mb = 0; mb < nmb; mb++) {
                                int cmin = mbc[mb][0], ncmax = mbc[mb][1];
                                if (!ncmax) continue;
                                att_rows_axpy(acc + (size_t)c0 * BQ + mb * MR * NC, alpha + mb * MR,
                                              S + (size_t)cmin * BQ + mb * MR,
                                              vsh + (size_t)c0 * Tk + (size_t)(j0 + cmin) * NC, ncmax - cmin);
                            }
                    }
                    for (int r = 0; r < nq; r++) {
                        float *ot = out + ((size_t)b * ldq + lt0 + r) * qs + (size_t)h * hd;
                        if (ls) { /* the state, unnormalised: the block form's finish divides */
                            for (int c0 = 0; c0 < hd; c0 += NC)
                                memcpy(ot + c0, acc + (size_t)c0 * BQ + (size_t)r * NC, NC * sizeof(float));
                            sm[r] = m[r], ls[sm - lse + r] = l[r];
                            continue;
                        }
                        float inv = 1.0f / l[r];
                        for (int c0 = 0; c0 < hd; c0 += NC) {
                            const float *ar = acc + (size_t)c0 * BQ + (size_t)r * NC;
                            vst1q_f32(ot + c0, vmulq_n_f32(vld1q_f32(ar), inv));
                            vst1q_f32(ot + c0 + 4, vmulq_n_f32(vld1q_f32(ar + 4), inv));
                        }
                        sm[r] = m[r] + logf(l[r]);
                    }
                }
            }
        }
        free(QT);
        free(acc);
        free(S);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
    free(VS);
}

void kern_attention_fwd_q0_neon(float *out, float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    if (hd % NC) {
        op_attention_fwd_q0_tiled(out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt);
        return;
    }
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att_fwd_body(out, lse, NULL, q, k, v, &g, opt);
}

void kern_attention_fwd_neon(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                             int nh, int nkv, int hd, const kern_attn_opt *opt) {
    kern_attention_fwd_q0_neon(out, lse, q, k, v, B, T, T, nh, nkv, hd, opt);
}

/* --------------------------------------------------------------- backward */

/* GCC 12's scheduler before register allocation (-fschedule-insns, on at -O2
 * for aarch64) interleaves att_keys_axpy's 4 query rows so that the allocator
 * then rotates the 16 accumulators through vector moves: the 8-key loop came
 * out as 98 instructions (64 FMAs, 15 moves) against 80 without it (64 FMAs,
 * 12 loads, 4 of loop; the other loops of the file are the same either way).
 * Out-of-order cores reorder for themselves; only the backward opts out. */
#if defined(__GNUC__) && !defined(__clang__)
#define ATT_NO_PRESCHED __attribute__((optimize("no-schedule-insns")))
#else
#define ATT_NO_PRESCHED
#endif

/* The backward, for the block form as the forward: the query side's rows (q, dout,
 * out, lse, dq) indexed from q0 (lt0 = t0 - q0), the keys' from k0 (the tile at index
 * j0 is at position p0 = k0 + j0), masks by position. With Dg (the block form) D is
 * given and out unused; without, D = rowsum(dout * out) here. Adds into dq, dk, dv
 * (the offset form's acc 0 zeroes them first). hd % NC == 0. */
ATT_NO_PRESCHED static void att_bwd_body(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                         const float *lse, const float *Dg, const float *q, const float *k,
                                         const float *v, const kern_attn_blk *g, const kern_attn_opt *opt) {
    // dq[B,ldq,nh,hd], dk[B,ldk,nkv,hd], dv[B,ldk,nkv,hd], dout[B,ldq,nh,hd], out[B,ldq,nh,hd], lse[B,nh,ldq],
    // q[B,ldq,nh,hd], k[B,ldk,nkv,hd], v[B,ldk,nkv,hd]
    int B = g->B, Tq = g->Tq, Tk = g->Tk, nh = g->nh, nkv = g->nkv, hd = g->hd;
    int group = nh / nkv, q0 = g->q0, k0 = g->k0, ldq = g->ldq, ldk = g->ldk;
    int nqb = (Tq + BQ - 1) / BQ;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int qs = nh * hd, ks = nkv * hd; // row strides
    int b16 = kern_attn_bf16(opt);
    int Tp = (Tk + BK - 1) / BK * BK;
    float *KT = att_heads_t(k, B, Tk, ldk, nkv, hd, Tp); // [B*nkv, Tp/NC, hd, NC]
    float *VT = att_heads_t(v, B, Tk, ldk, nkv, hd, Tp); // [B*nkv, Tp/NC, hd, NC]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        size_t blk = (size_t)hd * BQ;
        float *KS = ct_malloc64((size_t)Tk * hd * sizeof(float)); // [hd/NC, Tk, NC] the kv head's k rows (dS K)
        float *QT = ct_malloc64(5 * blk * sizeof(float));       // [hd, BQ] the block's q rows, transposed
        float *GT = QT + blk;                                  // [hd, BQ] its dout rows, transposed
        float *QS = GT + blk;                                  // [hd/NC, BQ, NC] its q rows as slabs (dK)
        float *GS = QS + blk;                                  // [hd/NC, BQ, NC] its dout rows as slabs (dV)
        float *DQ = GS + blk;                                  // [hd/NC, BQ, NC] its dq, summed over the tiles
        float *P = ct_malloc64((size_t)2 * BK * BQ * sizeof(float)); // [BK, BQ] S^T, then P^T (0 where masked)
        float *dS = P + (size_t)BK * BQ;                           // [BK, BQ] dP^T, then scale * dS^T (0 where masked)
        float D[BQ], L[BQ];                                        // rowsum(dout * out), lse of the block's rows
        int32_t clo[BQ], ncr[BQ];                                  // row r sees tile keys clo[r] <= c < ncr[r]
        int mbc[BQ / MR][2];                                       // keys some row of micro-block mb sees
        const float32x4_t vsc = vdupq_n_f32(scale), vcap = vdupq_n_f32(cap), one = vdupq_n_f32(1.0f);
        // One thread per (b, kv head): it owns the dk/dv rows of that head and
        // the dq rows of the group's query heads, so every sum is its own.
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kth = KT + ((size_t)b * nkv + kh) * Tp * hd; // chunk of key j0 at + j0*hd
                const float *vth = VT + ((size_t)b * nkv + kh) * Tp * hd;
                size_t ko = ((size_t)b * ldk * nkv + kh) * hd; /* the kv head's first row */
                float *dkh = dk + ko; // row j at + j*ks
                float *dvh = dv + ko;
                att_slabs_in(KS, k + ko, ks, Tk, Tk, hd);
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    for (int qb = 0; qb < nqb; qb++) {
                        int lt0 = qb * BQ, t0 = q0 + lt0;
                        int nq = imin(Tq - lt0, BQ), nmb = (nq + MR - 1) / MR;
                        size_t row0 = ((size_t)b * ldq + lt0) * nh + h; // the block's first row of q, dout, out, dq
                        size_t ro = ((size_t)b * nh + h) * ldq + lt0;   // its first row of lse (and Dg)
                        /* the keys of the block that some row sees (the forward's range) */
                        int jlo = kern_attn_first_key(t0, window) - k0, jend = imin(t0 + nq - k0, Tk);
                        jlo = jlo > 0 ? jlo / BK * BK : 0;
                        if (jlo >= jend) continue;
                        // the block's rows of q, dout, out: row r at + r*qs
                        const float *qb_ = q + row0 * hd, *gb = dout + row0 * hd, *ob = Dg ? NULL : out + row0 * hd;
                        att_block_t(QT, qb_, qs, nq, hd);
                        att_block_t(GT, gb, qs, nq, hd);
                        att_slabs_in(QS, qb_, qs, nq, BQ, hd);
                        att_slabs_in(GS, gb, qs, nq, BQ, hd);
                        memset(DQ, 0, blk * sizeof(float));
                        for (int r = 0; r < BQ; r++) { // padded rows: masked everywhere
                            D[r] = r >= nq ? 0.0f
                                   : Dg  ? Dg[ro + r] /* the block form: given */
                                         : att_dot(gb + (size_t)r * qs, ob + (size_t)r * qs, hd);
                            L[r] = r < nq ? lse[ro + r] : 0.0f;
                        }
                        for (int j0 = jlo; j0 < jend; j0 += BK) {
                            int nk = imin(jend - j0, BK), p0 = k0 + j0; /* p0: the tile's first position */
                            att_visible(clo, ncr, mbc, t0, nq, p0, nk, window);
                            /* S^T = K Q^T, then dP^T = V dO^T, a chunk of K^T (V^T) at a time across the
                             * micro-blocks that see it (the forward's order) */
                            for (int pass = 0; pass < 2; pass++) {
                                const float *xt = pass ? GT : QT, *yt = pass ? vth : kth;
                                float *sb = pass ? dS : P;
                                for (int ch = 0; ch < BK / NC; ch++)
                                    for (int mb = 0; mb < nmb; mb++) {
                                        if (ch < mbc[mb][0] / NC || ch >= (mbc[mb][1] + NC - 1) / NC) continue;
                                        att_scores(sb + (size_t)ch * NC * BQ + mb * MR, xt + mb * MR,
                                                   yt + (size_t)(j0 + ch * NC) * hd, hd);
                                    }
                            }
                            /* P = exp(S - lse), dS = P (dP - D) scale (times 1 - tanh^2 under a cap), for
                             * every key of the tile and row of the block: 0 where masked, and in chunks
                             * no row of the micro-block sees (the key loops below read them) */
                            for (int mb = 0; mb < BQ / MR; mb++)
                                for (int ch = 0; ch < BK / NC; ch++) {
                                    int seen = mb < nmb && ch >= mbc[mb][0] / NC && ch < (mbc[mb][1] + NC - 1) / NC;
                                    for (int c = ch * NC; c < (ch + 1) * NC; c++)
                                        for (int r = mb * MR; r < (mb + 1) * MR; r += 4) {
                                            float *pc = P + (size_t)c * BQ + r, *dc = dS + (size_t)c * BQ + r;
                                            if (!seen) {
                                                vst1q_f32(pc, vdupq_n_f32(0.0f));
                                                vst1q_f32(dc, vdupq_n_f32(0.0f));
                                                continue;
                                            }
                                            uint32x4_t mk = att_mask(vld1q_s32(clo + r), vld1q_s32(ncr + r), c);
                                            float32x4_t x = vmulq_f32(vld1q_f32(pc), vsc), p, ds;
                                            float32x4_t dpd = vsubq_f32(vld1q_f32(dc), vld1q_f32(D + r));
                                            if (cap > 0.0f) { /* s = cap tanh(x / cap), ds/dx = 1 - tanh^2 */
                                                float32x4_t th = neon_tanh4(vdivq_f32(x, vcap));
                                                p = neon_exp4(vsubq_f32(vmulq_f32(vcap, th), vld1q_f32(L + r)));
                                                ds = vmulq_f32(vmulq_f32(p, dpd), vfmsq_f32(one, th, th));
                                                ds = vmulq_f32(ds, vsc);
                                            } else {
                                                p = neon_exp4(vsubq_f32(x, vld1q_f32(L + r)));
                                                ds = vmulq_f32(vmulq_f32(p, dpd), vsc);
                                            }
                                            vst1q_f32(pc, att_and(mk, p)); /* masked: exp may be inf there */
                                            vst1q_f32(dc, att_and(mk, ds));
                                        }
                                }
                            if (b16) /* the products below take P and dS as bf16 (dS from fp32 P above) */
                                ct_round_bf16(P, (size_t)2 * BK * BQ); /* P^T and dS^T, one buffer */
                            // dv[j] += sum_t P[t,j] dout[t]; dk[j] += sum_t dS[t,j] q[t]: 8 keys at a time
                            // (then 4, 2, 1), over the query rows rs <= r < re that see one of them (from
                            // the first row that sees the first key to the last that sees the last, a
                            // window), widened to whole vectors of 4 rows (the others hold p = dS = 0)
                            for (int c0 = 0; c0 < hd; c0 += NC) {
                                const float *gx = GS + (size_t)c0 * BQ, *qx = QS + (size_t)c0 * BQ; // row r at + r*NC
                                for (int c = 0; c < nk;) {
                                    int keys = nk - c >= 8 ? 8 : nk - c >= 4 ? 4 : nk - c >= 2 ? 2 : 1;
                                    int rs = imax(p0 + c - t0, 0), re = nq;
                                    if (window) re = imin(p0 + c + keys - 1 + window - t0, nq); /* t < j + window */
                                    if (re > rs) {
                                        rs &= ~3;
                                        re = (re + 3) & ~3;
                                        float *dvr = dvh + (size_t)(j0 + c) * ks + c0;
                                        float *dkr = dkh + (size_t)(j0 + c) * ks + c0;
                                        const float *pw = P + (size_t)c * BQ, *dw = dS + (size_t)c * BQ;
                                        if (keys == 8) {
                                            att_keys_axpy(8, dvr, ks, pw, gx, rs, re);
                                            att_keys_axpy(8, dkr, ks, dw, qx, rs, re);
                                        } else if (keys == 4) {
                                            att_keys_axpy(4, dvr, ks, pw, gx, rs, re);
                                            att_keys_axpy(4, dkr, ks, dw, qx, rs, re);
                                        } else if (keys == 2) {
                                            att_keys_axpy(2, dvr, ks, pw, gx, rs, re);
                                            att_keys_axpy(2, dkr, ks, dw, qx, rs, re);
                                        } else {
                                            att_keys_axpy(1, dvr, ks, pw, gx, rs, re);
                                            att_keys_axpy(1, dkr, ks, dw, qx, rs, re);
                                        }
                                    }
                                    c += keys;
                                }
                            }
                            // dq[t] += sum_j dS[t,j] k[j]: 12 rows at a time over the keys the micro-block
                            // sees, an 8-column slab of the tile's k rows (2 KB) across the micro-blocks,
                            // into the block's DQ (whole micro-blocks: it has BQ rows)
                            for (int c0 = 0; c0 < hd; c0 += NC)
                                for (int mb = 0; mb < nmb; mb++) {
                                    int cmin = mbc[mb][0], ncmax = mbc[mb][1];
                                    if (!ncmax) continue;
                                    att_rows_axpy(DQ + (size_t)c0 * BQ + mb * MR * NC, NULL,
                                                  dS + (size_t)cmin * BQ + mb * MR,
                                                  KS + (size_t)c0 * Tk + (size_t)(j0 + cmin) * NC, ncmax - cmin);
                                }
                        }
                        for (int r = 0; r < nq; r++) { /* dq += the block's sum */
                            float *dqr = dq + (row0 + (size_t)r * nh) * hd;
                            for (int c0 = 0; c0 < hd; c0 += NC) {
                                const float *s = DQ + (size_t)c0 * BQ + (size_t)r * NC;
                                vst1q_f32(dqr + c0, vaddq_f32(vld1q_f32(dqr + c0), vld1q_f32(s)));
                                vst1q_f32(dqr + c0 + 4, vaddq_f32(vld1q_f32(dqr + c0 + 4), vld1q_f32(s + 4)));
                            }
                        }
                    }
                }
            }
        }
        free(KS);
        free(QT);
        free(P);
        KERN_TRACE_EXIT(kt_);
    }
    free(KT);
    free(VT);
}

ATT_NO_PRESCHED void kern_attention_bwd_q0_neon(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                                const float *lse, const float *q, const float *k, const float *v,
                                                int B, int Tq, int Tk, int nh, int nkv, int hd,
                                                const kern_attn_opt *opt, int acc) {
    if (hd % NC) {
        op_attention_bwd_q0_tiled(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, acc);
        return;
    }
    if (!acc) kern_attn_zero_grads_q0(dq, dk, dv, B, Tq, Tk, nh, nkv, hd); /* dk, dv are summed in place */
    kern_attn_blk g = {B, nh, nkv, hd, Tq, Tk - Tq, Tq, Tk, 0, Tk};
    att_bwd_body(dq, dk, dv, dout, out, lse, NULL, q, k, v, &g, opt);
}

void kern_attention_bwd_neon(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                             const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                             const kern_attn_opt *opt, int acc) {
    kern_attention_bwd_q0_neon(dq, dk, dv, dout, out, lse, q, k, v, B, T, T, nh, nkv, hd, opt, acc);
}

/* The block form (ops.h, kern_attn_blk; ring attention): the bodies above with the
 * block's state and strides; the generic tiled pair for head dims they do not take. */
void kern_attention_fwd_blk_neon(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                                 const kern_attn_blk *g, const kern_attn_opt *opt) {
    if (g->hd % NC) {
        op_attention_fwd_blk_tiled(acc, m, l, q, k, v, g, opt);
        return;
    }
    att_fwd_body(acc, m, l, q, k, v, g, opt);
}

void kern_attention_bwd_blk_neon(float *dq, float *dk, float *dv, const float *dout, const float *lse, const float *D,
                                 const float *q, const float *k, const float *v, const kern_attn_blk *g,
                                 const kern_attn_opt *opt) {
    if (g->hd % NC) {
        op_attention_bwd_blk_tiled(dq, dk, dv, dout, lse, D, q, k, v, g, opt);
        return;
    }
    att_bwd_body(dq, dk, dv, dout, NULL, lse, D, q, k, v, g, opt);
}

#endif /* __aarch64__ */
