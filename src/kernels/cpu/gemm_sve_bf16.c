/* kernels/cpu/gemm_sve_bf16.c: matmul_bf16 "sve_bfmmla", the BFMMLA kernel of
 * gemm_neon.c on SVE vectors of any length (CPUs with SVE and BF16: Graviton
 * 3, Neoverse V1/V2/N2). Compiled for +sve+bf16 (the pragma), run only where
 * the registry saw both (KERN_FEAT_SVE | KERN_FEAT_ARM_BF16).
 *
 * SVE's BFMMLA works per 128-bit segment: each segment of the accumulator is
 * a 2 x 2 fp32 tile += (2 x 4 bf16 of A) x (4 x 2 bf16 of B). A B vector
 * holds VL / 128 column pairs x 4 k, the row pair of A is one quadword
 * replicated to every segment (LD1RQ), so one instruction does VL / 8
 * multiply-adds. Register tile 8 x 2VL/32 (VL in bits: 8 x 8 at 128 bits,
 * 8 x 16 at 256, 8 x 32 at 512): 4 row pairs x 4 B vectors = 16
 * accumulators, 4 B vectors and an A quadword per group of 4 k.
 *
 * Packed layout: groups of 4 k; within a group, line l (a row of A, a column
 * of B) holds its 4 k values at [4l, 4l + 4), so a line pair is one
 * segment-sized 2 x 4 block, in line order. Panel depths are whole groups:
 * kpack = 2 (bf16 pairs per 32-bit lane), kalign = 2 (depths rounded to 2
 * lanes = 4 k, zero-filled by the packers, k blocks multiples of 4 but the
 * last): unlike gemm_neon.c's BFMMLA kernel there is no half group to widen.
 * The packers round fp32 to bf16 while packing (ties to even, neon_util.h's
 * neon_rne_bf16_bits, the NEON packers' rounding); a bf16 weight (wbf16) is
 * widened per block by the driver (exact) and so packs to the same bits.
 *
 * Storing: the accumulator's segment s holds [row 2r: c, c+1 | row 2r+1: c,
 * c+1] for its column pair; UZP1 / UZP2 on 64-bit elements of two adjacent
 * accumulators give rows 2r / 2r + 1 over their columns in order, stored
 * under WHILELT predicates at the N edge.
 *
 * Numerics as "bfmmla": inputs rounded to bf16, products summed by BFMMLA
 * (which rounds its sums its own way), fp32 accumulators, one chain per
 * element over k in order, k blocks ascending: bit-identical at any thread
 * count, within the fp32 tolerance of the bf16 reference. Untimed: no SVE
 * hardware here; tested under qemu-user (docs/kernels.md, "The SVE GEMM"). */
#if defined(__aarch64__)
#pragma GCC target("+sve+bf16")
#include <arm_neon.h>
#include <arm_sve.h>
#include <stdint.h>

#include "core/dtype.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/cpu/neon_util.h"

#define BMR 8 /* rows of the tile: 4 row pairs */
#define NVB 4 /* B vectors per group: NR = NVB * svcntd() columns (a 64-bit element per column pair and k half) */

#define SVE_INLINE __attribute__((always_inline)) static inline

/* ------------------------------------------------------------ packing */

/* 4 floats rounded to bf16 (ties to even), narrowed. */
SVE_INLINE uint16x4_t bf16x4(float32x4_t x) { return vshrn_n_u32(neon_rne_bf16_bits(x), 16); }

/* One panel of L lines (L a multiple of 4) over kc k values, line l element k
 * at p[l * ls + k * ks], of which lines < nl exist: groups of 4 k, line l at
 * [4l, 4l + 4) of its group, zeros beyond nl and kc; ceil(kc / 4) groups. */
static void pack_lines_bf16(uint16_t *d, const float *p, long ls, long ks, long nl, long L, long kc) {
    long groups = neon_ceil_div(kc, 4);
    nl = neon_clampl(nl, 0, L);
    if (ks == 1) {
        /* each line's 4 k values are contiguous: one load, one 8-byte store */
        for (long l = 0; l < L; l++)
            for (long g = 0; g < groups; g++)
                vst1_u16(d + g * 4 * L + 4 * l, bf16x4(l < nl ? neon_loadn(p + l * ls + 4 * g, kc - 4 * g)
                                                              : vdupq_n_f32(0.0f)));
        return;
    }
    if (ls == 1) {
        /* for each k the lines are contiguous: 4 k rows of 4 lines interleaved by ST4 */
        for (long g = 0; g < groups; g++)
            for (long l0 = 0; l0 < L; l0 += 4) {
                uint16x4x4_t h;
                for (int kk = 0; kk < 4; kk++) {
                    long k = 4 * g + kk;
                    h.val[kk] = bf16x4(k < kc ? neon_loadn(p + k * ks + l0, nl - l0) : vdupq_n_f32(0.0f));
                }
                vst4_u16(d + g * 4 * L + 4 * l0, h);
            }
        return;
    }
    for (long g = 0; g < groups; g++)
        for (long l = 0; l < L; l++)
            for (long kk = 0; kk < 4; kk++) {
                long k = 4 * g + kk;
                d[g * 4 * L + 4 * l + kk] = l < nl && k < kc ? ct_f32_to_bf16(p[l * ls + k * ks]) : 0;
            }
}

static void pack_a_sbf(float *dst, gemm_view a, long m, long kc) {
    long np = neon_ceil_div(m, BMR), depth = 4 * neon_ceil_div(kc, 4); /* bf16 values per line of a panel */
    for (long p = 0; p < np; p++)
        pack_lines_bf16((uint16_t *)dst + p * BMR * depth, a.p + p * BMR * a.rs, a.rs, a.cs, m - p * BMR, BMR, kc);
}

static void pack_b_sbf(float *dst, gemm_view b, long kc, long n) {
    long NR = NVB * (long)svcntd(), np = neon_ceil_div(n, NR), depth = 4 * neon_ceil_div(kc, 4);
    for (long p = 0; p < np; p++)
        pack_lines_bf16((uint16_t *)dst + p * NR * depth, b.p + p * NR * b.cs, b.cs, b.rs, n - p * NR, NR, kc);
}

/* ------------------------------------------------------------ micro-kernel */

/* Rows 2r, 2r + 1 of C from row pair r's accumulators (the 4 column vectors
 * v0..v3), columns cut at nr by the predicates p0 (first VL / 32 columns),
 * p1 (the next). */
SVE_INLINE void store_pair(float *C, long ldc, int r, int mr, svfloat32_t v0, svfloat32_t v1, svfloat32_t v2,
                           svfloat32_t v3, svbool_t p0, svbool_t p1, int add) {
    const long vw = (long)svcntw();
    svfloat64_t d0 = svreinterpret_f64_f32(v0), d1 = svreinterpret_f64_f32(v1);
    svfloat64_t d2 = svreinterpret_f64_f32(v2), d3 = svreinterpret_f64_f32(v3);
    for (int h = 0; h < 2; h++) {
        int i = 2 * r + h;
        if (i >= mr) break;
        svfloat32_t lo = svreinterpret_f32_f64(h ? svuzp2_f64(d0, d1) : svuzp1_f64(d0, d1));
        svfloat32_t hi = svreinterpret_f32_f64(h ? svuzp2_f64(d2, d3) : svuzp1_f64(d2, d3));
        float *cr = C + i * ldc;
        if (add) {
            lo = svadd_f32_x(p0, svld1_f32(p0, cr), lo);
            hi = svadd_f32_x(p1, svld1_f32(p1, cr + vw), hi);
        }
        svst1_f32(p0, cr, lo);
        svst1_f32(p1, cr + vw, hi);
    }
}

/* RP (compile-time) row pairs of the tile; accumulators c<pair><vector>. */
SVE_INLINE void ukb_rows(const int RP, long kc, const float *A, const float *B, float *C, long ldc, int mr, int nr,
                         int add) {
    const bfloat16_t *a = (const bfloat16_t *)A, *b = (const bfloat16_t *)B;
    const long vh = (long)svcnth();
    const svbool_t ph = svptrue_b16();
#define UKB_DECL(r) svfloat32_t c##r##0 = svdup_n_f32(0.0f), c##r##1 = c##r##0, c##r##2 = c##r##0, c##r##3 = c##r##0;
    UKB_DECL(0) UKB_DECL(1) UKB_DECL(2) UKB_DECL(3)
#undef UKB_DECL
    long groups = neon_ceil_div(kc, 4);
    for (long g = 0; g < groups; g++) {
        svbfloat16_t b0 = svld1_bf16(ph, b), b1 = svld1_bf16(ph, b + vh);
        svbfloat16_t b2 = svld1_bf16(ph, b + 2 * vh), b3 = svld1_bf16(ph, b + 3 * vh);
#define UKB_PAIR(r)                                                                                                    \
    if (RP > r) {                                                                                                      \
        svbfloat16_t av = svld1rq_bf16(ph, a + 8 * r);                                                                 \
        c##r##0 = svbfmmla_f32(c##r##0, av, b0);                                                                       \
        c##r##1 = svbfmmla_f32(c##r##1, av, b1);                                                                       \
        c##r##2 = svbfmmla_f32(c##r##2, av, b2);                                                                       \
        c##r##3 = svbfmmla_f32(c##r##3, av, b3);                                                                       \
    }
        UKB_PAIR(0) UKB_PAIR(1) UKB_PAIR(2) UKB_PAIR(3)
#undef UKB_PAIR
        a += 4 * BMR;
        b += 4 * vh;
    }
    svbool_t p0 = svwhilelt_b32_s64(0, nr), p1 = svwhilelt_b32_s64((long)svcntw(), nr);
#define UKB_STORE(r)                                                                                                   \
    if (RP > r) store_pair(C, ldc, r, mr, c##r##0, c##r##1, c##r##2, c##r##3, p0, p1, add);
    UKB_STORE(0) UKB_STORE(1) UKB_STORE(2) UKB_STORE(3)
#undef UKB_STORE
}

static void uk_sbf(long kc, const float *A, const float *B, float *C, long ldc, int mr, int nr, int add) {
    if (mr > 4) ukb_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) ukb_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else ukb_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

/* By value: NR follows the vector length (gemm_sve.c's gemm_arch_sve, why). */
static gemm_arch arch_sbf(void) {
    const int nr = NVB * (int)svcntd();
    gemm_arch ar = {
        .name = "sve_bfmmla",
        .mr = BMR,
        .mrs = BMR,
        .nr = nr,
        /* a B micro-panel of at most 12288 bf16 (24 KB), never deeper than bfmmla's 512 */
        .kc = (int)(neon_clampl(12288 / nr, 64, 512) / 4 * 4),
        .mc = 129 * BMR,
        .nc = (int)(neon_ceil_div(2048, nr) * nr),
        .ncb = (int)(neon_ceil_div(512, nr) * nr),
        .ukernel = uk_sbf,
        .pack_a = pack_a_sbf,
        .pack_b = pack_b_sbf,
        .nt_small = NULL,
        .kpack = 2,
        .kalign = 2,
    };
    return ar;
}

/* --------------------------------------------------- the ops.h entry points */

void kern_matmul_bf16_fwd_sve_bfmmla(float *out, const float *inp, const float *w, int M, int K, int N,
                                     int accumulate) {
    gemm_arch ar = arch_sbf();
    gemm_view a = {inp, K, 1, NULL}, b = {w, 1, K, NULL};
    gemm_f32(&ar, M, N, K, a, b, out, N, accumulate);
}
void kern_matmul_bf16_bwd_sve_bfmmla(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                     int M, int K, int N, int accumulate) {
    gemm_arch ar = arch_sbf();
    gemm_matmul_bwd(&ar, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
void kern_matmul_fwd_wbf16_bf16_sve_bfmmla(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                           int accumulate) {
    gemm_arch ar = arch_sbf();
    gemm_matmul_fwd_wbf16(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_bf16_sve_bfmmla(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                            int ldd, int accumulate) {
    gemm_arch ar = arch_sbf();
    gemm_matmul_dinp_wbf16(&ar, dinp, dout, w, M, K, N, ldd, accumulate);
}
#endif /* __aarch64__ */
