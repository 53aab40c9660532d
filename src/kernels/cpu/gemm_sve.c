/* kernels/cpu/gemm_sve.c: a vector-length-agnostic SVE micro-kernel and
 * packers for gemm_f32 (matmul "sve"), for Arm CPUs with SVE (Graviton 3:
 * 256-bit vectors, A64FX: 512, Neoverse V2 / N2: 128).
 *
 * The whole file is compiled for SVE (the pragma below), but nothing in it
 * runs unless the registry saw HWCAP_SVE (KERN_FEAT_SVE): the rest of the
 * aarch64 build stays baseline armv8-a, as attention's "tiled_sve" does.
 *
 * Register tile MR x NR = 8 x 3 VL (VL = svcntw(), 32-bit lanes per vector,
 * read at run time): 24 accumulators (8 rows x 3 vectors), 3 for the B row of
 * the current k step and 2 for the 8 A values, 29 of the 32 z registers at
 * every vector length. The 8 A values are loaded with LD1RQ (one 128-bit
 * quadword replicated to every segment of the vector) and used by FMLA
 * (indexed), whose lane index selects within each 128-bit segment: the
 * NEON kernel's vfmaq_laneq_f32 scheme, unchanged at any width.
 *
 * Why NR is a multiple of VL chosen at run time rather than a fixed NR with
 * predicates on every FMA: a fixed NR (say 12) would leave most lanes idle at
 * 512 bits, or need a VL-dependent tile anyway. gemm_arch is read through a
 * pointer and its sizes are plain ints, so gemm_arch_sve() builds the
 * struct per call (on the caller's stack: no shared mutable state, one CNTW
 * instruction) and the driver (gemm.c) needs no change. Predicates are used
 * only where the data really ends: the N edge of a tile is stored with
 * WHILELT predicates (no staging buffer, unlike NEON), and the packers read
 * the row / column tails with predicated loads, which give zeros in the
 * inactive lanes (the zero padding the driver's contract asks for).
 *
 * Blocking: mc = 129 * MR as NEON; B micro-panel kc x NR at most ~24 KB of the
 * L1 (kc = 256 up to 256-bit vectors, 128 at 512, ...); nc ~ 2040 and ncb ~
 * 480 columns rounded to whole panels. These follow the NEON kernel's cache
 * reasoning and are not measured: no SVE hardware was available, the kernel
 * is tested under qemu-user only (docs/benchmarks.md), and that is also why
 * the registry lists it after "neon" (the default stays the measured one).
 *
 * Packing: a contiguous operand (B rows in dinp / dw, A^T in dw) is moved
 * with predicated SVE loads / stores; a transposed one (the forward's w,
 * row-major A) goes through 4 x 4 NEON transposes (neon_util.h), whose 128-bit
 * granule divides every NR here.
 *
 * Summation order per element: one FMA chain over k in order within a k
 * block, k blocks ascending (gemm.c): bit-identical for any thread count.
 * The k block size depends on VL (kc above), so results may differ in the
 * last bits between vector lengths, within kern_check's tolerance. M-edge
 * panels run a variant with fewer rows (8/4/2/1), each element on the same
 * chain. The few-row forward (nt_small) sums dot products in VL-wide
 * partial sums, then across lanes (svaddv). */
#if defined(__aarch64__)
#pragma GCC target("+sve")
#include <arm_neon.h>
#include <arm_sve.h>
#include <stdint.h>

#include "kernels/cpu/kern_cpu.h"
#include "kernels/cpu/neon_util.h"

#define MR 8
#define NV 3 /* vectors of B per row of the tile: NR = NV * svcntw() */

#define SVE_INLINE __attribute__((always_inline)) static inline

/* ------------------------------------------------------------ micro-kernel */

/* Tile row i of C (cr) (=, += when add) from its 3 accumulators, the N edge
 * cut by the predicates p0..p2 (columns < nr of each vector). */
SVE_INLINE void store_row(float *cr, long vl, svfloat32_t v0, svfloat32_t v1, svfloat32_t v2, svbool_t p0,
                          svbool_t p1, svbool_t p2, int add) {
    if (add) {
        v0 = svadd_f32_x(p0, svld1_f32(p0, cr), v0);
        v1 = svadd_f32_x(p1, svld1_f32(p1, cr + vl), v1);
        v2 = svadd_f32_x(p2, svld1_f32(p2, cr + 2 * vl), v2);
    }
    svst1_f32(p0, cr, v0);
    svst1_f32(p1, cr + vl, v1);
    svst1_f32(p2, cr + 2 * vl, v2);
}

/* The micro-kernel for R (compile-time) rows. SVE vectors are sizeless (no
 * arrays of them), so the 24 accumulators are named c<row><vector>. */
SVE_INLINE void uk_rows(const int R, long kc, const float *restrict A, const float *restrict B, float *C, long ldc,
                        int mr, int nr, int add) {
    const long vl = (long)svcntw();
    const svbool_t pt = svptrue_b32();
#define UK_DECL(i) svfloat32_t c##i##0 = svdup_n_f32(0.0f), c##i##1 = c##i##0, c##i##2 = c##i##0;
    UK_DECL(0) UK_DECL(1) UK_DECL(2) UK_DECL(3) UK_DECL(4) UK_DECL(5) UK_DECL(6) UK_DECL(7)
#undef UK_DECL
    for (long k = 0; k < kc; k++) {
        svfloat32_t b0 = svld1_f32(pt, B), b1 = svld1_f32(pt, B + vl), b2 = svld1_f32(pt, B + 2 * vl);
        svfloat32_t a0 = svld1rq_f32(pt, A), a1 = svld1rq_f32(pt, A + 4);
#define UK_ROW(i, av, l)                                                                                               \
    if (R > i) {                                                                                                       \
        c##i##0 = svmla_lane_f32(c##i##0, b0, av, l);                                                                  \
        c##i##1 = svmla_lane_f32(c##i##1, b1, av, l);                                                                  \
        c##i##2 = svmla_lane_f32(c##i##2, b2, av, l);                                                                  \
    }
        UK_ROW(0, a0, 0) UK_ROW(1, a0, 1) UK_ROW(2, a0, 2) UK_ROW(3, a0, 3)
        UK_ROW(4, a1, 0) UK_ROW(5, a1, 1) UK_ROW(6, a1, 2) UK_ROW(7, a1, 3)
#undef UK_ROW
        A += MR;
        B += NV * vl;
    }
    svbool_t p0 = svwhilelt_b32_s64(0, nr), p1 = svwhilelt_b32_s64(vl, nr), p2 = svwhilelt_b32_s64(2 * vl, nr);
#define UK_STORE(i)                                                                                                    \
    if (R > i && i < mr) store_row(C + i * ldc, vl, c##i##0, c##i##1, c##i##2, p0, p1, p2, add);
    UK_STORE(0) UK_STORE(1) UK_STORE(2) UK_STORE(3) UK_STORE(4) UK_STORE(5) UK_STORE(6) UK_STORE(7)
#undef UK_STORE
}

/* Full panels take the 8-row kernel, an edge panel the smallest that covers it. */
static void uk_sve(long kc, const float *restrict A, const float *restrict B, float *C, long ldc, int mr, int nr,
                   int add) {
    if (mr > 4) uk_rows(8, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) uk_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 1) uk_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else uk_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

/* ------------------------------------------------------------ packing */

/* `width` floats of dst from the first `have` (clamped to [0, width]) of
 * src, zeros after: predicated loads read nothing past `have`. */
static void copy_padded(float *dst, const float *src, long have, long width) {
    const long vl = (long)svcntw();
    have = neon_clampl(have, 0, width);
    for (long i = 0; i < width; i += vl)
        svst1_f32(svwhilelt_b32_s64(i, width), dst + i, svld1_f32(svwhilelt_b32_s64(i, have), src + i));
}

static void pack_a_sve(float *dst, gemm_view a, long m, long kc) {
    long np = neon_ceil_div(m, MR);
    if (a.rs == 1) {
        /* A given transposed (dw's dout): each k holds 8 consecutive rows of a panel */
        for (long k = 0; k < kc; k++)
            for (long p = 0; p < np; p++)
                copy_padded(dst + p * MR * kc + k * MR, a.p + k * a.cs + p * MR, m - p * MR, MR);
        return;
    }
    if (a.cs == 1) {
        for (long p = 0; p < np; p++)
            for (long h = 0; h < 2; h++)
                neon_transpose_slab4(dst + p * MR * kc + 4 * h, MR, a.p + (p * MR + 4 * h) * a.rs, a.rs,
                                neon_clampl(m - p * MR - 4 * h, 0, 4), kc);
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int i = 0; i < MR; i++)
                dst[p * MR * kc + k * MR + i] = p * MR + i < m ? a.p[(p * MR + i) * a.rs + k * a.cs] : 0.0f;
}

static void pack_b_sve(float *dst, gemm_view b, long kc, long n) {
    const long NR = NV * (long)svcntw(), np = neon_ceil_div(n, NR);
    if (b.cs == 1) {
        /* rows of B contiguous (dinp's w, dw's inp): predicated copies, the last panel's tail zeroed */
        for (long k = 0; k < kc; k++)
            for (long p = 0; p < np; p++)
                copy_padded(dst + p * NR * kc + k * NR, b.p + k * b.rs + p * NR, n - p * NR, NR);
        return;
    }
    if (b.rs == 1) {
        /* the forward's w [N, K]: columns of B contiguous, 4 at a time transposed */
        for (long p = 0; p < np; p++)
            for (long h = 0; h < NR / 4; h++)
                neon_transpose_slab4(dst + p * NR * kc + 4 * h, NR, b.p + (p * NR + 4 * h) * b.cs, b.cs,
                                neon_clampl(n - p * NR - 4 * h, 0, 4), kc);
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (long j = 0; j < NR; j++)
                dst[p * NR * kc + k * NR + j] = p * NR + j < n ? b.p[k * b.rs + (p * NR + j) * b.cs] : 0.0f;
}

/* Few rows (M <= GEMM_SMALL_M = 4): one row of w at a time against every row
 * of inp, so w is read once; the K tail by predicate (merging FMAs keep the
 * inactive lanes' partial sums). */
static void nt_small_sve(float *out, long ldo, const float *inp, const float *w, int M, long K, long n0, long n1,
                         int accumulate) {
    const long vl = (long)svcntw();
    const svbool_t pt = svptrue_b32();
    for (long n = n0; n < n1; n++) {
        const float *wr = w + n * K;
        svfloat32_t s0 = svdup_n_f32(0.0f), s1 = s0, s2 = s0, s3 = s0;
        for (long k0 = 0; k0 < K; k0 += vl) {
            svbool_t pk = svwhilelt_b32_s64(k0, K);
            svfloat32_t wv = svld1_f32(pk, wr + k0);
            s0 = svmla_f32_m(pk, s0, svld1_f32(pk, inp + k0), wv);
            if (M > 1) s1 = svmla_f32_m(pk, s1, svld1_f32(pk, inp + K + k0), wv);
            if (M > 2) s2 = svmla_f32_m(pk, s2, svld1_f32(pk, inp + 2 * K + k0), wv);
            if (M > 3) s3 = svmla_f32_m(pk, s3, svld1_f32(pk, inp + 3 * K + k0), wv);
        }
        float v[4] = {svaddv_f32(pt, s0), svaddv_f32(pt, s1), svaddv_f32(pt, s2), svaddv_f32(pt, s3)};
        for (int m = 0; m < M && m < 4; m++) {
            float *o = out + m * ldo + n;
            *o = accumulate ? *o + v[m] : v[m];
        }
    }
}

int gemm_sve_vector_bits(void) { return 8 * (int)svcntb(); }

gemm_arch gemm_arch_sve(void) {
    const int nr = NV * (int)svcntw();
    gemm_arch ar = {
        .name = "sve",
        .mr = MR,
        .mrs = MR,
        .nr = nr,
        /* a B micro-panel of at most 6144 floats (24 KB), never deeper than NEON's 256 */
        .kc = (int)neon_clampl(6144 / nr, 16, 256),
        .mc = 129 * MR,
        .nc = (int)(neon_ceil_div(2040, nr) * nr),
        .ncb = (int)(neon_ceil_div(480, nr) * nr),
        .ukernel = uk_sve,
        .pack_a = pack_a_sve,
        .pack_b = pack_b_sve,
        .nt_small = nt_small_sve,
    };
    return ar;
}

/* --------------------------------------------------- the ops.h entry points */

void kern_matmul_fwd_sve(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    gemm_arch ar = gemm_arch_sve();
    if (M <= GEMM_SMALL_M) {
        gemm_nt_small(&ar, out, inp, w, M, K, N, accumulate);
        return;
    }
    gemm_view a = {inp, K, 1, NULL}, b = {w, 1, K, NULL};
    gemm_f32(&ar, M, N, K, a, b, out, N, accumulate);
}
void kern_matmul_bwd_sve(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                         int N, int accumulate) {
    gemm_arch ar = gemm_arch_sve();
    gemm_matmul_bwd(&ar, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
/* A bf16 w: no pack_b_h, so the driver widens each block to fp32 first
 * (exact), and the few-row forward widens w for nt_small: the same bits as
 * the fp32 entry points on the widened w. */
void kern_matmul_fwd_wbf16_sve(float *out, const float *inp, const uint16_t *w, int M, int K, int N, int accumulate) {
    gemm_arch ar = gemm_arch_sve();
    gemm_matmul_fwd_wbf16(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_sve(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                int ldd, int accumulate) {
    gemm_arch ar = gemm_arch_sve();
    gemm_matmul_dinp_wbf16(&ar, dinp, dout, w, M, K, N, ldd, accumulate);
}
#endif /* __aarch64__ */
