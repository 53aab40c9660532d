/* kernels/cpu/gemm_bf16_avx512.c: the bf16 micro-kernel and packers of gemm_f32.
 *
 * Design: the operands stay fp32 in memory (fp32 master weights and
 * activations); they are rounded to bf16 while being packed, which the GEMM
 * does anyway, so mixed precision costs no extra pass and no bf16 copy of
 * any tensor. The packed panels hold bf16 PAIRS along k: one 32-bit lane =
 * (x[k], x[k+1]), k even, element k in the low half, which is the layout
 * vdpbf16ps (AVX512_BF16) multiplies:
 *     c[j] += a.hi * b.hi + a.lo * b.lo        (products exact, fp32 sums)
 * so one instruction does two k steps of 16 columns. An odd k count is
 * padded with a zero pair half on both sides.
 *
 * Register tile 14 x 32 as the fp32 kernel (gemm_avx512.c): 28 zmm
 * accumulators, 2 zmm of B pairs per k pair, the A pair of each row
 * broadcast from memory; per k PAIR 2 loads, 14 broadcasts, 28 vdpbf16ps.
 * Panels: A [ceil(kc/2)][16 lanes] (14 rows used), B [ceil(kc/2)][32 lanes]
 * (gemm_arch.kpack = 2 tells the driver their depth). kc = 768 k values: the
 * same bytes per A micro-panel (24 KB, L1) and per B chunk (768 KB, L2) as
 * the fp32 kernel's 384.
 *
 * Rounding (bf16_pairs.h, shared with the AMX kernel gemm_bf16_amx.c, which
 * also packs its B panels with gemm_pack_b_bf16 below): vcvtne2ps2bf16,
 * nearest even (NaN stays a quiet NaN), the values of torch's .to(bfloat16)
 * and of core/dtype's ct_f32_to_bf16, so the reference and this kernel
 * multiply the same bf16 values. The differences from the reference beyond
 * summation order: vdpbf16ps treats bf16 subnormals (below 1.2e-38) as zero
 * and flushes subnormal results, and the conversion turns fp32 subnormals
 * into zeros (bf16_pairs.h), irrelevant at the magnitudes of a model's
 * activations and gradients.
 *
 * Summation order per element of C: k blocks ascending (as the fp32 GEMM),
 * inside a block k pairs in order, the odd element of each pair first (the
 * instruction's order). Fixed for a given K, so results are bit-identical
 * for any thread count, like the fp32 GEMM.
 *
 * Also here: gemm_round_bf16_avx512, which rounds packed fp32 panels in
 * place (the "avx512" and "avx2" implementations of matmul_bf16 for CPUs
 * without AVX512_BF16: the fp32 micro-kernels on bf16 values give the same
 * products, exact in fp32). */
#if defined(__x86_64__) /* x86-64 only, the whole file (aarch64: the _neon files) */
#include <immintrin.h>
#include "kernels/cpu/avx512_util.h"
#include "kernels/cpu/bf16_pairs.h"
#include "kernels/cpu/kern_cpu.h"

#define MR 14
#define NR 32
#define MRS 16

/* The micro-kernel for R rows (compile-time R at each call site, so the
 * accumulators are registers): kc k values = ceil(kc/2) pair steps. As in the
 * fp32 kernel, each element of C is one chain whatever R is. */
T512BF16 __attribute__((always_inline)) static inline void uk_rows(const int R, long kc, const float *restrict A,
                                                                   const float *restrict B, float *C, long ldc, int mr,
                                                                   int nr, int add) {
    __m512 c[MR][2];
#pragma GCC unroll 14
    for (int i = 0; i < R; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    if (add) gemm_prefetch_c(C, ldc, mr, NR);
    long kd = (kc + 1) / 2;
    for (long k = 0; k < kd; k++) {
        __m512bh b0 = (__m512bh)_mm512_load_si512(B), b1 = (__m512bh)_mm512_load_si512(B + 16);
#pragma GCC unroll 14
        for (int i = 0; i < R; i++) {
            /* broadcast the 32-bit pair as a float: a move, the bits are kept */
            __m512bh a = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(A[i]));
            c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
            c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
        }
        A += MRS;
        B += NR;
    }
    __mmask16 m0 = lanes(nr), m1 = lanes(nr - 16);
#pragma GCC unroll 14
    for (int i = 0; i < R; i++) {
        if (i >= mr) break;
        float *cr = C + i * ldc;
        __m512 v0 = c[i][0], v1 = c[i][1];
        if (add) {
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, cr), v0);
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, cr + 16), v1);
        }
        _mm512_mask_storeu_ps(cr, m0, v0);
        _mm512_mask_storeu_ps(cr + 16, m1, v1);
    }
}

T512BF16 static void uk_bf16(long kc, const float *restrict A, const float *restrict B, float *C, long ldc, int mr,
                             int nr, int add) {
    if (mr > 8) uk_rows(14, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 4) uk_rows(8, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) uk_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 1) uk_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else uk_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

/* r[i], row i's 16 pair lanes of k0 .. k0 + 31, transposed and stored as
 * the pair rows k0 / 2 + j of dst (stride dstride) that the panel's depth kd
 * has. */
T512 static inline void store_pair_slab(float *dst, long dstride, __m512 r[16], long k0, long kd) {
    transpose16(r);
    long pn = kd - k0 / 2;
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        if (j < pn) _mm512_store_ps(dst + (k0 / 2 + j) * dstride, r[j]);
}

/* A rows x kc slab (rows <= 16, row stride ld, contiguous in k) as pairs
 * transposed: dst[k2 * dstride + i] = (x[i][2 k2], x[i][2 k2 + 1]) for k2 <
 * kd (>= ceil(kc / 2)), 32 k at a time (16 rows x 16 pair lanes, one 16 x 16
 * transpose); rows beyond `rows` and k beyond kc are zeros. pf_rows rows at
 * pf (the next slab the caller packs, same stride) are prefetched two lines
 * a row per 32 k, as the fp32 packers' transpose_slab does: in a step the
 * source is cold and its rows ld apart, no stream for the hardware. */
T512BF16 static void pair_transpose_slab(float *dst, long dstride, const float *src, long ld, int rows, long kc,
                                         long kd, const float *pf, int pf_rows) {
    for (long k0 = 0; k0 < 2 * kd; k0 += 32) {
        long kn = kc - k0 < 32 ? kc - k0 : 32; /* <= 0 in padding past kc: zeros */
        if (kn > 0)
            for (int i = 0; i < pf_rows; i++) {
                _mm_prefetch((const char *)(pf + i * ld + k0), _MM_HINT_T0);
                _mm_prefetch((const char *)(pf + i * ld + k0 + (kn > 16 ? 16 : 0)), _MM_HINT_T0);
            }
        __mmask16 m0 = lanes((int)kn), m1 = lanes((int)kn - 16);
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const float *p = src + (i < rows ? i : 0) * ld + (kn > 0 ? k0 : 0);
            __m512 x0 = _mm512_maskz_loadu_ps(i < rows ? m0 : (__mmask16)0, p);
            __m512 x1 = _mm512_maskz_loadu_ps(i < rows ? m1 : (__mmask16)0, p + 16);
            r[i] = _mm512_castsi512_ps(bf16_pair_along(x0, x1));
        }
        store_pair_slab(dst, dstride, r, k0, kd);
    }
}

/* Mask of the first n of 32 16-bit lanes. */
T512 static inline __mmask32 lanes32(long n) {
    return n >= 32 ? (__mmask32)0xFFFFFFFFu : n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1u);
}

/* pair_transpose_slab from a bf16 source: each k pair of a row is one 32-bit
 * word already (k in the low half, little-endian), so the pairs are copied,
 * not rounded. */
T512 static void pair_transpose_slab_h(float *dst, long dstride, const uint16_t *src, long ld, int rows, long kc,
                                       long kd) {
    for (long k0 = 0; k0 < 2 * kd; k0 += 32) {
        __mmask32 mk = lanes32(kc - k0); /* 0 in the padding past kc: zeros */
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            int in = i < rows && mk;
            r[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(in ? mk : (__mmask32)0, src + (in ? i * ld + k0 : 0)));
        }
        store_pair_slab(dst, dstride, r, k0, kd);
    }
}

T512BF16 static void pack_a_bf16(float *dst, gemm_view a, long m, long kc) {
    long np = (m + MR - 1) / MR, kd = (kc + 1) / 2;
    if (a.rs == 1) {
        /* A given transposed (dw's dout^T): rows k and k+1 of the source hold
         * the m values of two k contiguously; pair them lane by lane. In
         * blocks of GEMM_PACK_KB pairs with the panels inside, so each panel
         * receives consecutive lines (pair by pair across all panels, every
         * store went to another panel MRS x kd floats apart: the same L1
         * set; the fp32 packers' reason, kern_cpu.h), and the next block's
         * source rows prefetched, a line per 14 floats */
        for (long k20 = 0; k20 < kd; k20 += GEMM_PACK_KB) {
            long kn = kd - k20 < GEMM_PACK_KB ? kd - k20 : GEMM_PACK_KB;
            long kpf = kc - 2 * (k20 + kn); /* source rows of the next block */
            kpf = kpf < 0 ? 0 : kpf > 2 * GEMM_PACK_KB ? 2 * GEMM_PACK_KB : kpf;
            for (long p = 0; p < np; p++) {
                for (long k = 0; k < kpf; k++)
                    _mm_prefetch((const char *)(a.p + (2 * (k20 + kn) + k) * a.cs + p * MR), _MM_HINT_T0);
                __mmask16 mk = lanes((int)(m - p * MR < MR ? m - p * MR : MR));
                float *d = dst + p * MRS * kd;
                for (long k2 = k20; k2 < k20 + kn; k2++) {
                    const float *s0 = a.p + 2 * k2 * a.cs + p * MR;
                    int has1 = 2 * k2 + 1 < kc;
                    __m512 x0 = _mm512_maskz_loadu_ps(mk, s0);
                    __m512 x1 = _mm512_maskz_loadu_ps(has1 ? mk : (__mmask16)0, has1 ? s0 + a.cs : s0);
                    _mm512_store_si512(d + k2 * MRS, bf16_pair_rows(x0, x1));
                }
            }
        }
        return;
    }
    if (a.cs == 1) {
        /* row-major A: each row's k pairs are adjacent; 14 rows x 32 k at a time */
        for (long p = 0; p < np; p++) {
            int rows = (int)(m - p * MR < MR ? m - p * MR : MR);
            const float *src = a.p + p * MR * a.rs;
            int pr; /* rows of the next panel */
            const float *pf = gemm_next_slab(src, a.rs, MR, m - (p + 1) * MR, &pr);
            pair_transpose_slab(dst + p * MRS * kd, MRS, src, a.rs, rows, kc, kd, pf, pr);
        }
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k2 = 0; k2 < kd; k2++)
            for (int i = 0; i < MRS; i++) {
                long r = p * MR + i, k = 2 * k2;
                int in = i < MR && r < m;
                float lo = in ? a.p[r * a.rs + k * a.cs] : 0.0f;
                float hi = in && k + 1 < kc ? a.p[r * a.rs + (k + 1) * a.cs] : 0.0f;
                dst[p * MRS * kd + k2 * MRS + i] = bf16_pair_scalar(lo, hi);
            }
}

T512BF16 void gemm_pack_b_bf16(float *dst, gemm_view b, long kc, long n, long kd) {
    long np = (n + NR - 1) / NR;
    if (b.cs == 1) {
        /* row-major B (dinp's w, dw's inp): pair source rows k and k+1 lane
         * by lane, in blocks of GEMM_PACK_KB pairs with the panels inside
         * (consecutive lines to each panel, as pack_a_bf16's transposed A) */
        for (long k20 = 0; k20 < kd; k20 += GEMM_PACK_KB) {
            long kn = kd - k20 < GEMM_PACK_KB ? kd - k20 : GEMM_PACK_KB;
            for (long p = 0; p < np; p++) {
                long cols = n - p * NR;
                __mmask16 m0 = lanes((int)cols), m1 = lanes((int)(cols - 16));
                float *d = dst + p * NR * kd;
                for (long k2 = k20; k2 < k20 + kn; k2++) {
                    int has0 = 2 * k2 < kc, has1 = 2 * k2 + 1 < kc;
                    const float *s0 = b.p + (has0 ? 2 * k2 : 0) * b.rs + p * NR, *s1 = has1 ? s0 + b.rs : s0;
                    __m512 x0 = _mm512_maskz_loadu_ps(has0 ? m0 : (__mmask16)0, s0);
                    __m512 x1 = _mm512_maskz_loadu_ps(has1 ? m0 : (__mmask16)0, s1);
                    __m512 y0 = _mm512_maskz_loadu_ps(has0 ? m1 : (__mmask16)0, s0 + 16);
                    __m512 y1 = _mm512_maskz_loadu_ps(has1 ? m1 : (__mmask16)0, s1 + 16);
                    _mm512_store_si512(d + k2 * NR, bf16_pair_rows(x0, x1));
                    _mm512_store_si512(d + k2 * NR + 16, bf16_pair_rows(y0, y1));
                }
            }
        }
        return;
    }
    if (b.rs == 1) {
        /* B given transposed (the forward's w[N,K]): pairs adjacent in each row of w */
        for (long p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                long cols = n - p * NR - 16 * h;
                int c = (int)(cols > 16 ? 16 : cols < 0 ? 0 : cols);
                const float *src = b.p + (p * NR + 16 * h) * b.cs;
                int pc; /* columns of the next slab */
                const float *pf = gemm_next_slab(src, b.cs, 16, cols - 16, &pc);
                pair_transpose_slab(dst + p * NR * kd + 16 * h, NR, src, b.cs, c, kc, kd, pf, pc);
            }
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k2 = 0; k2 < kd; k2++)
            for (int j = 0; j < NR; j++) {
                long col = p * NR + j, k = 2 * k2;
                float lo = col < n && k < kc ? b.p[k * b.rs + col * b.cs] : 0.0f;
                float hi = col < n && k + 1 < kc ? b.p[(k + 1) * b.rs + col * b.cs] : 0.0f;
                dst[p * NR * kd + k2 * NR + j] = bf16_pair_scalar(lo, hi);
            }
}

T512 void gemm_pack_b_bf16_h(float *dst, gemm_view b, long kc, long n, long kd) {
    long np = (n + NR - 1) / NR;
    if (b.cs == 1) {
        /* row-major B (dinp's w): source rows k and k+1 zero-extended, k+1 shifted into the high half */
        for (long k2 = 0; k2 < kd; k2++) {
            int has0 = 2 * k2 < kc, has1 = 2 * k2 + 1 < kc;
            const uint16_t *s0 = b.h + (has0 ? 2 * k2 : 0) * b.rs, *s1 = has1 ? s0 + b.rs : s0;
            for (long p = 0; p < np; p++) {
                long cols = n - p * NR;
                float *d = dst + p * NR * kd + k2 * NR;
                for (int h = 0; h < 2; h++) {
                    __mmask16 mk = lanes((int)(cols - 16 * h));
                    __m256i x0 = _mm256_maskz_loadu_epi16(has0 ? mk : (__mmask16)0, s0 + p * NR + 16 * h);
                    __m256i x1 = _mm256_maskz_loadu_epi16(has1 ? mk : (__mmask16)0, s1 + p * NR + 16 * h);
                    __m512i v = _mm512_or_si512(_mm512_cvtepu16_epi32(x0),
                                                _mm512_slli_epi32(_mm512_cvtepu16_epi32(x1), 16));
                    _mm512_store_si512(d + 16 * h, v);
                }
            }
        }
        return;
    }
    if (b.rs == 1) {
        /* B given transposed (the forward's w[N,K]): pairs adjacent in each row of w */
        for (long p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                long cols = n - p * NR - 16 * h;
                int c = (int)(cols > 16 ? 16 : cols < 0 ? 0 : cols);
                pair_transpose_slab_h(dst + p * NR * kd + 16 * h, NR, b.h + (p * NR + 16 * h) * b.cs, b.cs, c, kc,
                                      kd);
            }
        return;
    }
    for (long p = 0; p < np; p++) /* any other strides (not used by the model) */
        for (long k2 = 0; k2 < kd; k2++)
            for (int j = 0; j < NR; j++) {
                long col = p * NR + j, k = 2 * k2;
                uint32_t lo = col < n && k < kc ? b.h[k * b.rs + col * b.cs] : 0;
                uint32_t hi = col < n && k + 1 < kc ? b.h[(k + 1) * b.rs + col * b.cs] : 0;
                uint32_t u = lo | hi << 16;
                memcpy(dst + p * NR * kd + k2 * NR + j, &u, sizeof u);
            }
}

T512 static void pack_b_bf16_h(float *dst, gemm_view b, long kc, long n) {
    gemm_pack_b_bf16_h(dst, b, kc, n, (kc + 1) / 2);
}

/* The avx512bf16 arch's B panels: ceil(kc / 2) pairs deep (kpack = 2). */
T512BF16 static void pack_b_bf16(float *dst, gemm_view b, long kc, long n) {
    gemm_pack_b_bf16(dst, b, kc, n, (kc + 1) / 2);
}

const gemm_arch gemm_arch_avx512bf16 = {
    .name = "avx512bf16",
    .mr = MR,
    .mrs = MRS,
    .nr = NR,
    .kc = 768,
    .mc = 74 * MR,
    .nc = 2048,
    .ncb = 512,
    .ukernel = uk_bf16,
    .pack_a = pack_a_bf16,
    .pack_b = pack_b_bf16,
    .pack_b_h = pack_b_bf16_h,
    .nt_small = NULL, /* matmul_bf16 always packs (see gemm_bf16.c) */
    .kpack = 2,
};

T512 void gemm_round_bf16_avx512(float *p, size_t n) {
    const __m512i keep = _mm512_set1_epi32((int)0xffff0000u);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_si512(p + i, _mm512_and_si512(bf16_rne_hi(_mm512_loadu_ps(p + i)), keep));
    __mmask16 mk = lanes((int)(n - i));
    if (mk) _mm512_mask_storeu_epi32(p + i, mk, _mm512_and_si512(bf16_rne_hi(_mm512_maskz_loadu_ps(mk, p + i)), keep));
}
#endif /* __x86_64__ */
