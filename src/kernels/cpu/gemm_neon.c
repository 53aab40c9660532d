/* kernels/cpu/gemm_neon.c: the aarch64 micro-kernels and packers of gemm_f32
 * (fp32 NEON, and bf16 with BFMMLA), and the matmul_bf16 entry points.
 *
 * fp32 ("neon"): register tile 8 x 12, 24 q-register accumulators (8 rows x
 * 3 vectors of 4 columns), 3 for the B row of the current k step and 2 for
 * the 8 A values, 29 of the 32 vector registers. Per k step: 5 vector loads,
 * 24 FMAs by lane (vfmaq_laneq_f32: the A element comes from a lane, no
 * broadcast instruction). 24 independent chains cover the FMA latency (4
 * cycles) x 4 pipes of Neoverse V1/V2. The lane index of the FMA must be a
 * constant, so the rows are spelled out (UK_ROW) rather than looped.
 * Blocking: kc = 256 (A micro-panel 8 KB, B micro-panel 12 KB, in a 64 KB
 * L1), ncb = 480 columns of B per A panel (480 KB of the 1-2 MB L2),
 * nc = 2040, mc = 1032 (1024 rows make one block).
 *
 * Edges as the x86 kernels: packed panels are zero-padded, an M-edge panel
 * runs a variant with fewer rows (8/4/2/1) computing each element with the
 * same FMA chain, and an N edge stores through a small buffer (NEON has no
 * masked stores). Summation order per element: k blocks ascending, k in
 * order inside: bit-identical for any thread count (gemm.c).
 *
 * bf16 ("bfmmla", CPUs with FEAT_BF16: Graviton 3/4, Neoverse V1/V2/N2):
 * BFMMLA multiplies a 2 x 4 bf16 matrix by a 4 x 2 one into a 2 x 2 fp32
 * tile, 16 multiply-adds per instruction. Register tile 8 x 8 = 4 x 4 such
 * tiles (16 accumulators), per group of 4 k: 4 loads of B (2 columns x 4 k
 * each), 4 of A, 16 BFMMLAs. The packers round to bf16 while packing (no
 * bf16 copy of any tensor) and store groups of 4 k: A as [row pair][2 rows
 * x 4 k], B as [column pair][2 columns x 4 k]. The driver sizes panels in
 * bf16 pairs (gemm_arch.kpack = 2: ceil(kc / 2) 32-bit lanes per row), so a
 * k block with kc % 4 in {1, 2} ends with a half group of one pair per row,
 * which the kernel widens to a group with zero k2, k3 (vzip with zero).
 * kc = 512 k values (the same bytes per panel as fp32's 256). BFMMLA's sums
 * of products round differently from a chain of fp32 FMAs (and flush
 * subnormals), so results differ from "ref" by summation order only, as
 * avx512bf16's do; kern_check holds them to the fp32 tolerance.
 *
 * "neon" matmul_bf16 (any aarch64): the fp32 kernel on panels rounded to bf16
 * in place after packing, as the x86 avx2/avx512 ones (a product of two bf16
 * values is exact in fp32). */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/cpu/neon_util.h"

#define MR 8
#define MRS 8
#define NR 12

/* ------------------------------------------------------------ fp32 kernel */

/* C[0:mr, 0:nr] (=, += when add) from the accumulator tile c[R][3]. */
NEON_INLINE void store_tile(const int R, float32x4_t c[MR][3], float *C, long ldc, int mr, int nr, int add) {
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        if (i >= mr) break;
        float *cr = C + i * ldc;
        if (nr == NR) {
            float32x4_t v0 = c[i][0], v1 = c[i][1], v2 = c[i][2];
            if (add) {
                v0 = vaddq_f32(vld1q_f32(cr), v0);
                v1 = vaddq_f32(vld1q_f32(cr + 4), v1);
                v2 = vaddq_f32(vld1q_f32(cr + 8), v2);
            }
            vst1q_f32(cr, v0);
            vst1q_f32(cr + 4, v1);
            vst1q_f32(cr + 8, v2);
            continue;
        }
#pragma GCC unroll 3
        for (int j = 0; j < 3; j++) {
            long n = nr - 4 * j;
            if (n <= 0) break;
            float32x4_t v = c[i][j];
            if (add) v = vaddq_f32(neon_loadn(cr + 4 * j, n), v);
            neon_storen(cr + 4 * j, v, n);
        }
    }
}

/* The micro-kernel for R (compile-time) rows. */
NEON_INLINE void uk_rows(const int R, long kc, const float *restrict A, const float *restrict B, float *C, long ldc,
                         int mr, int nr, int add) {
    float32x4_t c[MR][3];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = c[i][2] = vdupq_n_f32(0.0f);
    for (long k = 0; k < kc; k++) {
        float32x4_t b0 = vld1q_f32(B), b1 = vld1q_f32(B + 4), b2 = vld1q_f32(B + 8);
        float32x4_t a0 = vld1q_f32(A), a1 = vld1q_f32(A + 4);
#define UK_ROW(i, av, l)                                                                                               \
    if (R > i) {                                                                                                       \
        c[i][0] = vfmaq_laneq_f32(c[i][0], b0, av, l);                                                                 \
        c[i][1] = vfmaq_laneq_f32(c[i][1], b1, av, l);                                                                 \
        c[i][2] = vfmaq_laneq_f32(c[i][2], b2, av, l);                                                                 \
    }
        UK_ROW(0, a0, 0) UK_ROW(1, a0, 1) UK_ROW(2, a0, 2) UK_ROW(3, a0, 3)
        UK_ROW(4, a1, 0) UK_ROW(5, a1, 1) UK_ROW(6, a1, 2) UK_ROW(7, a1, 3)
#undef UK_ROW
        A += MRS;
        B += NR;
    }
    store_tile(R, c, C, ldc, mr, nr, add);
}

/* Full panels take the 8-row kernel, an edge panel the smallest that covers it. */
static void uk_neon(long kc, const float *restrict A, const float *restrict B, float *C, long ldc, int mr, int nr,
                    int add) {
    if (mr > 4) uk_rows(8, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) uk_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 1) uk_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else uk_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

/* ------------------------------------------------------------ fp32 packing */

static void pack_a_neon(float *dst, gemm_view a, long m, long kc) {
    long np = neon_ceil_div(m, MR);
    if (a.rs == 1) {
        /* A given transposed: each source row holds 8 consecutive rows of a panel */
        for (long k = 0; k < kc; k++) {
            const float *src = a.p + k * a.cs;
            for (long p = 0; p < np; p++) {
                long rows = m - p * MR;
                float *d = dst + p * MRS * kc + k * MRS;
                vst1q_f32(d, neon_loadn(src + p * MR, rows));
                vst1q_f32(d + 4, neon_loadn(src + p * MR + 4, rows - 4));
            }
        }
        return;
    }
    if (a.cs == 1) {
        for (long p = 0; p < np; p++)
            for (long h = 0; h < 2; h++)
                neon_transpose_slab4(dst + p * MRS * kc + 4 * h, MRS, a.p + (p * MR + 4 * h) * a.rs, a.rs,
                                neon_clampl(m - p * MR - 4 * h, 0, 4), kc);
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int i = 0; i < MRS; i++)
                dst[p * MRS * kc + k * MRS + i] = p * MR + i < m ? a.p[(p * MR + i) * a.rs + k * a.cs] : 0.0f;
}

static void pack_b_neon(float *dst, gemm_view b, long kc, long n) {
    long np = neon_ceil_div(n, NR);
    if (b.cs == 1) {
        for (long k = 0; k < kc; k++) {
            const float *src = b.p + k * b.rs;
            for (long p = 0; p < np; p++) {
                long cols = n - p * NR;
                float *d = dst + p * NR * kc + k * NR;
                for (int h = 0; h < 3; h++) vst1q_f32(d + 4 * h, neon_loadn(src + p * NR + 4 * h, cols - 4 * h));
            }
        }
        return;
    }
    if (b.rs == 1) {
        for (long p = 0; p < np; p++)
            for (long h = 0; h < 3; h++)
                neon_transpose_slab4(dst + p * NR * kc + 4 * h, NR, b.p + (p * NR + 4 * h) * b.cs, b.cs,
                                neon_clampl(n - p * NR - 4 * h, 0, 4), kc);
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int j = 0; j < NR; j++)
                dst[p * NR * kc + k * NR + j] = p * NR + j < n ? b.p[k * b.rs + (p * NR + j) * b.cs] : 0.0f;
}

/* Few rows (M <= GEMM_SMALL_M): dot products along K without packing, 4 rows
 * of w at a time (16 accumulators + 4 w vectors + the inp vector). */
static void nt_small_neon(float *out, long ldo, const float *inp, const float *w, int M, long K, long n0, long n1,
                          int accumulate) {
    for (long n = n0; n < n1; n += 4) {
        long nb = n1 - n < 4 ? n1 - n : 4;
        float32x4_t acc[GEMM_SMALL_M][4];
#pragma GCC unroll 4
        for (int m = 0; m < GEMM_SMALL_M; m++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[m][j] = vdupq_n_f32(0.0f);
        const float *wr[4];
        for (int j = 0; j < 4; j++) wr[j] = w + (n + (j < nb ? j : 0)) * K;
        for (long k0 = 0; k0 < K; k0 += 4) {
            long kn = K - k0;
            float32x4_t wv[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) wv[j] = neon_loadn(wr[j] + k0, kn);
#pragma GCC unroll 4
            for (int m = 0; m < GEMM_SMALL_M; m++) {
                if (m >= M) break;
                float32x4_t x = neon_loadn(inp + m * K + k0, kn);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) acc[m][j] = vfmaq_f32(acc[m][j], x, wv[j]);
            }
        }
        for (int m = 0; m < M; m++)
            for (int j = 0; j < nb; j++) {
                float v = vaddvq_f32(acc[m][j]);
                float *o = out + m * ldo + n + j;
                *o = accumulate ? *o + v : v;
            }
    }
}

const gemm_arch gemm_arch_neon = {
    .name = "neon",
    .mr = MR,
    .mrs = MRS,
    .nr = NR,
    .kc = 256,
    .mc = 129 * MR,
    .nc = 170 * NR,
    .ncb = 40 * NR,
    .ukernel = uk_neon,
    .pack_a = pack_a_neon,
    .pack_b = pack_b_neon,
    .nt_small = nt_small_neon,
};

/* ------------------------------------------- matmul_bf16 "neon": rounded panels */

/* Rounds n floats in place to the nearest bf16, kept as fp32. */
static void round_bf16_neon(float *p, size_t n) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(p + i, vreinterpretq_f32_u32(vandq_u32(neon_rne_bf16_bits(vld1q_f32(p + i)),
                                                         vdupq_n_u32(0xffff0000u))));
    for (; i < n; i++) p[i] = ct_bf16_to_f32(ct_f32_to_bf16(p[i]));
}

static void pack_a_rneon(float *dst, gemm_view a, long m, long kc) {
    pack_a_neon(dst, a, m, kc);
    round_bf16_neon(dst, (size_t)(neon_ceil_div(m, MR) * MRS * kc));
}
static void pack_b_rneon(float *dst, gemm_view b, long kc, long n) {
    pack_b_neon(dst, b, kc, n);
    round_bf16_neon(dst, (size_t)(neon_ceil_div(n, NR) * NR * kc));
}

/* The x86 version lives in gemm_bf16.c; on aarch64 the only base is gemm_arch_neon. */
gemm_arch gemm_arch_rounding_bf16(const gemm_arch *base) {
    gemm_arch ar = *base;
    ar.pack_a = pack_a_rneon;
    ar.pack_b = pack_b_rneon;
    ar.ukernel_rm = NULL; /* A must go through the rounding packer */
    ar.nt_small = NULL;
    return ar;
}

/* ------------------------------------------------------------ bf16 BFMMLA */

#define TBF16 __attribute__((target("arch=armv8.2-a+bf16")))
#define BMR 8 /* rows of the tile (and lanes per packed k pair of an A panel) */
#define BNR 8 /* columns */

/* One packed panel of up to 8 lines (rows of A, or columns of B) over kc k
 * values of the view: line l, element k at p[l * ls + k * ks]. Writes groups
 * of 4 k, [line pair][2 lines x 4 k] in bf16, zero-padded (lines >= nl,
 * k >= kc), then a half group [line][k pair] when kc % 4 is 1 or 2; in all
 * 8 * 2 * ceil(kc / 2) bf16 values. */
static void pack8_bf16(uint16_t *d, const float *p, long ls, long ks, long nl, long kc) {
    for (long k0 = 0; k0 < kc; k0 += 4) {
        long kn = kc - k0;
        float32x4_t r[8]; /* r[l] = line l, k0..k0+3 */
        if (ks == 1) {
            for (long l = 0; l < 8; l++) r[l] = l < nl ? neon_loadn(p + l * ls + k0, kn) : vdupq_n_f32(0.0f);
        } else if (ls == 1) {
            /* the 8 lines are contiguous for each k: load by k, transpose 4 x 4 twice */
            float32x4_t lo[4], hi[4];
            for (long kk = 0; kk < 4; kk++) {
                const float *q = p + (k0 + kk) * ks;
                lo[kk] = kk < kn ? neon_loadn(q, nl) : vdupq_n_f32(0.0f);
                hi[kk] = kk < kn ? neon_loadn(q + 4, nl - 4) : vdupq_n_f32(0.0f);
            }
            neon_transpose4(lo);
            neon_transpose4(hi);
            for (int l = 0; l < 4; l++) r[l] = lo[l], r[4 + l] = hi[l];
        } else {
            for (long l = 0; l < 8; l++) {
                float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (long kk = 0; kk < 4 && kk < kn; kk++)
                    if (l < nl) t[kk] = p[l * ls + (k0 + kk) * ks];
                r[l] = vld1q_f32(t);
            }
        }
        uint16x4_t h[8];
        for (int l = 0; l < 8; l++) h[l] = vshrn_n_u32(neon_rne_bf16_bits(r[l]), 16);
        if (kn >= 3) {
            for (int lp = 0; lp < 4; lp++) vst1q_u16(d + 8 * lp, vcombine_u16(h[2 * lp], h[2 * lp + 1]));
            d += 32;
        } else {
            /* half group: the (k0, k0 + 1) pair of each line, one 32-bit lane each */
            for (int q = 0; q < 2; q++) {
                uint32x2_t p01 = vzip1_u32(vreinterpret_u32_u16(h[4 * q]), vreinterpret_u32_u16(h[4 * q + 1]));
                uint32x2_t p23 = vzip1_u32(vreinterpret_u32_u16(h[4 * q + 2]), vreinterpret_u32_u16(h[4 * q + 3]));
                vst1q_u16(d + 8 * q, vreinterpretq_u16_u32(vcombine_u32(p01, p23)));
            }
            d += 16;
        }
    }
}

static void pack_a_bfmmla(float *dst, gemm_view a, long m, long kc) {
    long np = neon_ceil_div(m, BMR), depth = 2 * ((kc + 1) / 2); /* bf16 values per row of a panel */
    for (long p = 0; p < np; p++)
        pack8_bf16((uint16_t *)dst + p * BMR * depth, a.p + p * BMR * a.rs, a.rs, a.cs, m - p * BMR, kc);
}
static void pack_b_bfmmla(float *dst, gemm_view b, long kc, long n) {
    long np = neon_ceil_div(n, BNR), depth = 2 * ((kc + 1) / 2);
    for (long p = 0; p < np; p++)
        pack8_bf16((uint16_t *)dst + p * BNR * depth, b.p + p * BNR * b.cs, b.cs, b.rs, n - p * BNR, kc);
}

/* [a pair, 0, b pair, 0] from lanes (0, 1) (hi = 0) or (2, 3) (hi = 1) of v: a
 * half group's line pair widened to 2 x 4 with k2 = k3 = 0. */
TBF16 static inline bfloat16x8_t widen_pairs(uint32x4_t v, int hi) {
    uint32x4_t z = vdupq_n_u32(0);
    return vreinterpretq_bf16_u32(hi ? vzip2q_u32(v, z) : vzip1q_u32(v, z));
}

/* RP (compile-time) row pairs of the 8 x 8 tile. */
TBF16 __attribute__((always_inline)) static inline void ukb_rows(const int RP, long kc, const float *A,
                                                                 const float *B, float *C, long ldc, int mr, int nr,
                                                                 int add) {
    const uint16_t *a = (const uint16_t *)A, *b = (const uint16_t *)B;
    float32x4_t c[4][4]; /* c[rp][cp] = rows 2rp, 2rp+1 x columns 2cp, 2cp+1, row-major */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = vdupq_n_f32(0.0f);
    long groups = kc / 4 + (kc % 4 == 3);
    for (long g = 0; g < groups; g++) {
        bfloat16x8_t b0 = vreinterpretq_bf16_u16(vld1q_u16(b)), b1 = vreinterpretq_bf16_u16(vld1q_u16(b + 8));
        bfloat16x8_t b2 = vreinterpretq_bf16_u16(vld1q_u16(b + 16)), b3 = vreinterpretq_bf16_u16(vld1q_u16(b + 24));
#pragma GCC unroll 4
        for (int rp = 0; rp < RP; rp++) {
            bfloat16x8_t av = vreinterpretq_bf16_u16(vld1q_u16(a + 8 * rp));
            c[rp][0] = vbfmmlaq_f32(c[rp][0], av, b0);
            c[rp][1] = vbfmmlaq_f32(c[rp][1], av, b1);
            c[rp][2] = vbfmmlaq_f32(c[rp][2], av, b2);
            c[rp][3] = vbfmmlaq_f32(c[rp][3], av, b3);
        }
        a += 32;
        b += 32;
    }
    if (kc % 4 == 1 || kc % 4 == 2) {
        uint32x4_t bp0 = vreinterpretq_u32_u16(vld1q_u16(b)), bp1 = vreinterpretq_u32_u16(vld1q_u16(b + 8));
        bfloat16x8_t b0 = widen_pairs(bp0, 0), b1 = widen_pairs(bp0, 1), b2 = widen_pairs(bp1, 0),
                     b3 = widen_pairs(bp1, 1);
#pragma GCC unroll 4
        for (int rp = 0; rp < RP; rp++) {
            bfloat16x8_t av = widen_pairs(vreinterpretq_u32_u16(vld1q_u16(a + 8 * (rp / 2))), rp % 2);
            c[rp][0] = vbfmmlaq_f32(c[rp][0], av, b0);
            c[rp][1] = vbfmmlaq_f32(c[rp][1], av, b1);
            c[rp][2] = vbfmmlaq_f32(c[rp][2], av, b2);
            c[rp][3] = vbfmmlaq_f32(c[rp][3], av, b3);
        }
    }
#pragma GCC unroll 4
    for (int rp = 0; rp < RP; rp++) {
        float64x2_t t[4];
        for (int cp = 0; cp < 4; cp++) t[cp] = vreinterpretq_f64_f32(c[rp][cp]);
        /* row 2rp: the low halves of the column pairs, row 2rp + 1 the high halves */
        float32x4_t row[2][2] = {
            {vreinterpretq_f32_f64(vzip1q_f64(t[0], t[1])), vreinterpretq_f32_f64(vzip1q_f64(t[2], t[3]))},
            {vreinterpretq_f32_f64(vzip2q_f64(t[0], t[1])), vreinterpretq_f32_f64(vzip2q_f64(t[2], t[3]))}};
        for (int h = 0; h < 2; h++) {
            int i = 2 * rp + h;
            if (i >= mr) break;
            float *cr = C + i * ldc;
            for (int j = 0; j < 2; j++) {
                long n = nr - 4 * j;
                if (n <= 0) break;
                float32x4_t v = row[h][j];
                if (add) v = vaddq_f32(neon_loadn(cr + 4 * j, n), v);
                neon_storen(cr + 4 * j, v, n);
            }
        }
    }
}

TBF16 static void uk_bfmmla(long kc, const float *A, const float *B, float *C, long ldc, int mr, int nr, int add) {
    if (mr > 4) ukb_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) ukb_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else ukb_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

const gemm_arch gemm_arch_bfmmla = {
    .name = "bfmmla",
    .mr = BMR,
    .mrs = BMR,
    .nr = BNR,
    .kc = 512,
    .mc = 129 * BMR,
    .nc = 256 * BNR,
    .ncb = 64 * BNR,
    .ukernel = uk_bfmmla,
    .pack_a = pack_a_bfmmla,
    .pack_b = pack_b_bfmmla,
    .nt_small = NULL,
    .kpack = 2,
};

/* --------------------------------------------------- the three products */

static void mm_fwd(const gemm_arch *ar, float *out, const float *inp, const float *w, int M, int K, int N,
                   int accumulate) {
    gemm_view a = {inp, K, 1, NULL}, b = {w, 1, K, NULL};
    gemm_f32(ar, M, N, K, a, b, out, N, accumulate);
}

void kern_matmul_bf16_fwd_bfmmla(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    mm_fwd(&gemm_arch_bfmmla, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_bwd_bfmmla(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                                 int K, int N, int accumulate) {
    gemm_matmul_bwd(&gemm_arch_bfmmla, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_fwd_neon(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    gemm_arch ar = gemm_arch_rounding_bf16(&gemm_arch_neon);
    mm_fwd(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_bwd_neon(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                               int K, int N, int accumulate) {
    gemm_arch ar = gemm_arch_rounding_bf16(&gemm_arch_neon);
    gemm_matmul_bwd(&ar, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
/* A bf16 w: no pack_b_h on these archs, so the driver widens each block
 * first (exact; the rounding packers then leave it as it is). */
void kern_matmul_fwd_wbf16_bf16_bfmmla(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                       int accumulate) {
    gemm_matmul_fwd_wbf16(&gemm_arch_bfmmla, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_bf16_bfmmla(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                        int ldd, int accumulate) {
    gemm_matmul_dinp_wbf16(&gemm_arch_bfmmla, dinp, dout, w, M, K, N, ldd, accumulate);
}
void kern_matmul_fwd_wbf16_bf16_neon(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                     int accumulate) {
    gemm_arch ar = gemm_arch_rounding_bf16(&gemm_arch_neon);
    gemm_matmul_fwd_wbf16(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_bf16_neon(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                      int ldd, int accumulate) {
    gemm_arch ar = gemm_arch_rounding_bf16(&gemm_arch_neon);
    gemm_matmul_dinp_wbf16(&ar, dinp, dout, w, M, K, N, ldd, accumulate);
}
#endif /* __aarch64__ */
