/* kernels/cpu/gemm_avx2.c: the AVX2 + FMA micro-kernel and packers of gemm_f32,
 * for x86-64 CPUs without AVX-512.
 *
 * Register tile 6 x 16: 12 ymm accumulators (6 rows x 2 vectors of 8
 * columns), 2 ymm for the B row of the current k step, 1 for the broadcast A
 * element: 15 of the 16 ymm registers. Per k step: 2 vector loads, 6
 * broadcasts, 12 FMAs; 12 independent chains cover FMA latency (4-5 cycles)
 * x 2 FMA ports. Packed A panels use row stride 8 (one aligned ymm per k,
 * lanes 6 and 7 zero) so the packers store whole aligned vectors.
 *
 * Each function carries target("avx2,fma") so the file builds in the generic
 * x86-64 build; the registry installs it only on CPUs with AVX2 and FMA.
 * Blocking: kc = 256 (A micro-panel 6 x 256 x 4 = 6 KB in L1, B micro-panel
 * 16 KB), ncb = 256 columns of B per A panel (256 KB in L2), nc = 2048,
 * mc = 1026 rows (1024 rows make one block). An A read in place over more
 * than ncb columns runs B-stationary in blocks of mcb = 192 rows (gemm.c):
 * 96-192 measured alike, the whole 1024 no better than the order above.
 *
 * uk_avx2_rm (the arch's ukernel_rm) reads a row-major A in place: 6 row
 * pointers, one broadcast from each per k, otherwise uk_avx2's loop. The 6
 * row pieces (6 x kc floats) stay in L1 across the B micro-panels as the
 * packed panel did; it saves the transposition that packing such an A took
 * (transpose_slab8, ~2% of a W3 step at CTITAN_ISA=avx2).
 *
 * Both kernels prefetch the C tile before their k loop when they add to it,
 * as the AVX-512 kernels do: in a training step C is usually cold (a weight
 * gradient last touched a step ago, a zeroed scratch buffer), and the tile's
 * 6 rows are ldc apart, a pattern the hardware prefetchers do not follow.
 * kernels bench (C hot, the same tile every rep) cannot see it; W3 steps at
 * CTITAN_ISA=avx2 ran 1.7% faster (docs/benchmarks.md). */
#if defined(__x86_64__) /* x86-64 only, the whole file (aarch64: the _neon files) */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/avx2_util.h"
#include "kernels/cpu/kern_cpu.h"

#define TAVX2 __attribute__((target("avx2,fma")))

#define MR 6
#define MRS 8
#define NR 16

/* Integer mask selecting the low n (clamped to 0..8) lanes, for maskload/maskstore. */
TAVX2 static inline __m256i lanes8(long n) {
    int c = n < 0 ? 0 : n > 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Rows [0, mr) of the R x 16 tile c into C (=, or += when add), columns [0, nr). */
TAVX2 __attribute__((always_inline)) static inline void store_tile(const int R, __m256 c[MR][2], float *C, long ldc,
                                                                   int mr, int nr, int add) {
    if (nr == NR) {
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            if (i >= mr) break;
            float *cr = C + i * ldc;
            __m256 v0 = c[i][0], v1 = c[i][1];
            if (add) {
                v0 = _mm256_add_ps(_mm256_loadu_ps(cr), v0);
                v1 = _mm256_add_ps(_mm256_loadu_ps(cr + 8), v1);
            }
            _mm256_storeu_ps(cr, v0);
            _mm256_storeu_ps(cr + 8, v1);
        }
        return;
    }
    __m256i m0 = lanes8(nr), m1 = lanes8(nr - 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) {
        if (i >= mr) break;
        float *cr = C + i * ldc;
        __m256 v0 = c[i][0], v1 = c[i][1];
        if (add) {
            v0 = _mm256_add_ps(_mm256_maskload_ps(cr, m0), v0);
            v1 = _mm256_add_ps(_mm256_maskload_ps(cr + 8, m1), v1);
        }
        _mm256_maskstore_ps(cr, m0, v0);
        _mm256_maskstore_ps(cr + 8, m1, v1);
    }
}

/* The micro-kernel for R (compile-time) rows; the row variants compute each
 * element of C with the same FMA chain, so they agree bitwise. */
TAVX2 __attribute__((always_inline)) static inline void uk_rows(const int R, long kc, const float *restrict A,
                                                                const float *restrict B, float *C, long ldc, int mr,
                                                                int nr, int add) {
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    if (add) gemm_prefetch_c(C, ldc, mr, NR); /* the tile's lines arrive while the k loop runs (top of file) */
    for (long k = 0; k < kc; k++) {
        __m256 b0 = _mm256_load_ps(B), b1 = _mm256_load_ps(B + 8);
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            __m256 a = _mm256_broadcast_ss(A + i);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
        A += MRS;
        B += NR;
    }
    store_tile(R, c, C, ldc, mr, nr, add);
}

/* Full panels take the 6-row kernel, an edge panel the smallest that covers it. */
TAVX2 static void uk_avx2(long kc, const float *restrict A, const float *restrict B, float *C, long ldc, int mr,
                          int nr, int add) {
    if (mr > 4) uk_rows(6, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) uk_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 1) uk_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else uk_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

/* uk_rows with A read in place, row i at A + i * lda (rows >= mr read row 0
 * instead, their sums never stored): the same broadcasts and FMAs in the
 * same order, so the same bits as from the packed panel. */
TAVX2 __attribute__((always_inline)) static inline void uk_rows_rm(const int R, long kc, const float *A, long lda,
                                                                   const float *restrict B, float *C, long ldc,
                                                                   int mr, int nr, int add) {
    const float *a[MR];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) a[i] = A + (i < mr ? i : 0) * lda;
    /* the rows below (the next micro-panel's, if any: an address only, never dereferenced) */
    uintptr_t pf = (uintptr_t)A + (uintptr_t)(MR * lda) * sizeof(float);
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    if (add) gemm_prefetch_c(C, ldc, mr, NR); /* the tile's lines arrive while the k loop runs (top of file) */
    for (long k0 = 0; k0 < kc; k0 += 16) {
        if (R == MR)
#pragma GCC unroll 6
            for (int i = 0; i < MR; i++)
                _mm_prefetch((const char *)(pf + (uintptr_t)(i * lda + k0) * sizeof(float)), _MM_HINT_T0);
        long k1 = kc - k0 < 16 ? kc : k0 + 16;
        for (long k = k0; k < k1; k++) {
            __m256 b0 = _mm256_load_ps(B), b1 = _mm256_load_ps(B + 8);
#pragma GCC unroll 6
            for (int i = 0; i < R; i++) {
                __m256 av = _mm256_broadcast_ss(a[i] + k);
                c[i][0] = _mm256_fmadd_ps(av, b0, c[i][0]);
                c[i][1] = _mm256_fmadd_ps(av, b1, c[i][1]);
            }
            B += NR;
        }
    }
    store_tile(R, c, C, ldc, mr, nr, add);
}

TAVX2 static void uk_avx2_rm(long kc, const float *A, long lda, const float *restrict B, float *C, long ldc, int mr,
                             int nr, int add) {
    if (mr > 4) uk_rows_rm(6, kc, A, lda, B, C, ldc, mr, nr, add);
    else if (mr > 2) uk_rows_rm(4, kc, A, lda, B, C, ldc, mr, nr, add);
    else if (mr > 1) uk_rows_rm(2, kc, A, lda, B, C, ldc, mr, nr, add);
    else uk_rows_rm(1, kc, A, lda, B, C, ldc, mr, nr, add);
}

/* r[i], row i's k0 .. k0 + kn - 1 (kn <= 8), transposed and stored as rows
 * k0 .. k0 + kn - 1 of dst (stride dstride, aligned): both slab packers' last step. */
TAVX2 __attribute__((always_inline)) static inline void store_transposed8(float *dst, long dstride, __m256 r[8], long k0, long kn) {
    avx2_transpose8(r);
#pragma GCC unroll 8
    for (int kk = 0; kk < 8; kk++)
        if (kk < kn) _mm256_store_ps(dst + (k0 + kk) * dstride, r[kk]);
}

/* Transposes a rows x kc slab (rows <= 8, row stride ld, contiguous in k)
 * into dst[k * dstride + i] (aligned), 8 k at a time; rows beyond `rows` become zeros.
 * pf_rows rows at pf (same stride; the next slab the caller packs) are
 * prefetched alongside, line by line: a slab's rows are a few lines each, ld
 * apart, too short for the hardware prefetcher to pick them up, and the
 * loads of the slab stalled on L3 (a tenth of a forward at K = 3072). */
TAVX2 static void transpose_slab8(float *dst, long dstride, const float *src, long ld, int rows, long kc,
                                  const float *pf, int pf_rows) {
    /* constant r[] indices after unrolling keep the block in registers */
    for (long k0 = 0; k0 < kc; k0 += 8) {
        long kn = kc - k0 < 8 ? kc - k0 : 8;
        if (!(k0 & 15))
            for (int i = 0; i < pf_rows; i++) _mm_prefetch((const char *)(pf + i * ld + k0), _MM_HINT_T0);
        __m256i mk = lanes8(kn), none = _mm256_setzero_si256();
        __m256 r[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const float *p = src + (i < rows ? i : 0) * ld + k0;
            r[i] = _mm256_maskload_ps(p, i < rows ? mk : none);
        }
        store_transposed8(dst, dstride, r, k0, kn);
    }
}

TAVX2 static void pack_a_avx2(float *dst, gemm_view a, long m, long kc) {
    long np = (m + MR - 1) / MR;
    if (a.rs == 1) {
        /* A given transposed (dw's dout^T): row k of the source holds the m
         * values of one k contiguously, 6 to each panel. Taken k by k across
         * all panels, each store went to another panel, MRS x kc floats
         * (8 KB) apart: the same L1 set every time, so nearly every 32-byte
         * store missed (the packing took 20% of a dw at K = 256). In blocks of
         * GEMM_PACK_KB k instead, a panel receives that many consecutive k
         * (whole lines) while the block's source rows stay in L1. Each
         * source row is read for only m floats per block (a few lines), too
         * short a run for the hardware prefetcher: the loads waited on L3,
         * so the next block's rows are prefetched alongside. */
        for (long k0 = 0; k0 < kc; k0 += GEMM_PACK_KB) {
            long kn = kc - k0 < GEMM_PACK_KB ? kc - k0 : GEMM_PACK_KB;
            long kpf = kc - k0 - kn < GEMM_PACK_KB ? kc - k0 - kn : GEMM_PACK_KB; /* rows of the next block */
            for (long p = 0; p < np; p++) {
                if (!(p & 1)) /* every 12 floats: each line at least once */
                    for (long k = 0; k < kpf; k++)
                        _mm_prefetch((const char *)(a.p + (k0 + kn + k) * a.cs + p * MR), _MM_HINT_T0);
                __m256i mk = lanes8(m - p * MR < MR ? m - p * MR : MR);
                const float *src = a.p + k0 * a.cs + p * MR;
                float *d = dst + p * MRS * kc + k0 * MRS;
                for (long k = 0; k < kn; k++) _mm256_store_ps(d + k * MRS, _mm256_maskload_ps(src + k * a.cs, mk));
            }
        }
        return;
    }
    if (a.cs == 1) {
        for (long p = 0; p < np; p++) {
            int rows = (int)(m - p * MR < MR ? m - p * MR : MR);
            const float *src = a.p + p * MR * a.rs;
            int pr; /* rows of the next panel */
            const float *pf = gemm_next_slab(src, a.rs, MR, m - (p + 1) * MR, &pr);
            transpose_slab8(dst + p * MRS * kc, MRS, src, a.rs, rows, kc, pf, pr);
        }
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int i = 0; i < MRS; i++)
                dst[p * MRS * kc + k * MRS + i] =
                    i < MR && p * MR + i < m ? a.p[(p * MR + i) * a.rs + k * a.cs] : 0.0f;
}

/* The first n (clamped to 0..8) of 8 bf16 at s widened to fp32 (exact: the
 * bits moved up by 16), zeros beyond. AVX2 has no 16-bit masked load, so a
 * short run is copied through a zeroed buffer first (edges only). */
TAVX2 static inline __m256 widen8(const uint16_t *s, long n) {
    __m128i x;
    if (n >= 8) {
        x = _mm_loadu_si128((const __m128i *)s);
    } else {
        uint16_t t[8] = {0};
        for (long i = 0; i < n; i++) t[i] = s[i];
        x = _mm_loadu_si128((const __m128i *)t);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

/* Row-major B (cs == 1), rows rs apart, of fp32 f or of bf16 h widened as it
 * loads (the other NULL; constant at each call, so each caller compiles to
 * its own loops): GEMM_PACK_KB source rows at a time, dealt panel by panel
 * (as pack_a's transposed A: consecutive lines of a panel, not one line in
 * each panel per k). Full panels load without masks. */
TAVX2 __attribute__((always_inline)) static inline void pack_b_rows(float *dst, const float *f, const uint16_t *h,
                                                                    long rs, long kc, long n) {
    long np = (n + NR - 1) / NR;
    for (long k0 = 0; k0 < kc; k0 += GEMM_PACK_KB) {
        long kn = kc - k0 < GEMM_PACK_KB ? kc - k0 : GEMM_PACK_KB;
        for (long p = 0; p < np; p++) {
            long cols = n - p * NR, o = k0 * rs + p * NR;
            float *d = dst + p * NR * kc + k0 * NR;
            if (cols >= NR) {
                for (long k = 0; k < kn; k++, o += rs) {
                    _mm256_store_ps(d + k * NR, h ? widen8(h + o, 8) : _mm256_loadu_ps(f + o));
                    _mm256_store_ps(d + k * NR + 8, h ? widen8(h + o + 8, 8) : _mm256_loadu_ps(f + o + 8));
                }
            } else {
                __m256i m0 = lanes8(cols), m1 = lanes8(cols - 8);
                for (long k = 0; k < kn; k++, o += rs) {
                    _mm256_store_ps(d + k * NR, h ? widen8(h + o, cols) : _mm256_maskload_ps(f + o, m0));
                    _mm256_store_ps(d + k * NR + 8, h ? widen8(h + o + 8, cols - 8) : _mm256_maskload_ps(f + o + 8, m1));
                }
            }
        }
    }
}

TAVX2 static void pack_b_avx2(float *dst, gemm_view b, long kc, long n) {
    long np = (n + NR - 1) / NR;
    if (b.cs == 1) {
        pack_b_rows(dst, b.p, NULL, b.rs, kc, n);
        return;
    }
    if (b.rs == 1) {
        for (long p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                long cols = n - p * NR - 8 * h;
                int c = (int)(cols > 8 ? 8 : cols < 0 ? 0 : cols);
                const float *src = b.p + (p * NR + 8 * h) * b.cs;
                int pc; /* columns of the next slab */
                const float *pf = gemm_next_slab(src, b.cs, 8, cols - 8, &pc);
                transpose_slab8(dst + p * NR * kc + 8 * h, NR, src, b.cs, c, kc, pf, pc);
            }
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int j = 0; j < NR; j++)
                dst[p * NR * kc + k * NR + j] = p * NR + j < n ? b.p[k * b.rs + (p * NR + j) * b.cs] : 0.0f;
}

/* transpose_slab8 from a bf16 source, widening as it loads. */
TAVX2 static void transpose_slab8_h(float *dst, long dstride, const uint16_t *src, long ld, int rows, long kc) {
    for (long k0 = 0; k0 < kc; k0 += 8) {
        long kn = kc - k0 < 8 ? kc - k0 : 8;
        __m256 r[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) r[i] = i < rows ? widen8(src + i * ld + k0, kn) : _mm256_setzero_ps();
        store_transposed8(dst, dstride, r, k0, kn);
    }
}

/* pack_b of a bf16 view (a frozen weight's store), widening while packing, in
 * one pass (see pack_b_h_avx512); the bits of pack_b_avx2 on the widening. */
TAVX2 static void pack_b_h_avx2(float *dst, gemm_view b, long kc, long n) {
    long np = (n + NR - 1) / NR;
    if (b.cs == 1) { /* row-major B (dinp's w) */
        pack_b_rows(dst, NULL, b.h, b.rs, kc, n);
        return;
    }
    if (b.rs == 1) {
        for (long p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                long cols = n - p * NR - 8 * h;
                int c = (int)(cols > 8 ? 8 : cols < 0 ? 0 : cols);
                transpose_slab8_h(dst + p * NR * kc + 8 * h, NR, b.h + (p * NR + 8 * h) * b.cs, b.cs, c, kc);
            }
        return;
    }
    gemm_pack_b_h_strided(dst, b, kc, n, NR); /* any other strides (not used by the model) */
}

/* Sum of the 8 lanes in a fixed order. */
TAVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Few rows (M <= GEMM_SMALL_M): dot products along K without packing, as in
 * gemm_avx512.c; 3 rows of w at a time so 12 partial sums + 3 w vectors + 1
 * inp vector fit the 16 ymm registers. */
TAVX2 static void nt_small_avx2(float *out, long ldo, const float *inp, const float *w, int M, long K, long n0,
                               long n1, int accumulate) {
    const __m256i none = _mm256_setzero_si256();
    for (long n = n0; n < n1; n += 3) {
        long nb = n1 - n < 3 ? n1 - n : 3;
        __m256 acc[GEMM_SMALL_M][3];
#pragma GCC unroll 4
        for (int m = 0; m < GEMM_SMALL_M; m++)
#pragma GCC unroll 3
            for (int j = 0; j < 3; j++) acc[m][j] = _mm256_setzero_ps();
        for (long k0 = 0; k0 < K; k0 += 8) {
            __m256i mk = lanes8(K - k0);
            __m256 wv[3];
#pragma GCC unroll 3
            for (int j = 0; j < 3; j++)
                wv[j] = _mm256_maskload_ps(w + (n + (j < nb ? j : 0)) * K + k0, j < nb ? mk : none);
#pragma GCC unroll 4
            for (int m = 0; m < GEMM_SMALL_M; m++) {
                if (m >= M) break;
                __m256 x = _mm256_maskload_ps(inp + m * K + k0, mk);
#pragma GCC unroll 3
                for (int j = 0; j < 3; j++) acc[m][j] = _mm256_fmadd_ps(x, wv[j], acc[m][j]);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < GEMM_SMALL_M; m++) {
            if (m >= M) break;
#pragma GCC unroll 3
            for (int j = 0; j < 3; j++) {
                if (j >= nb) break;
                float v = hsum8(acc[m][j]);
                float *o = out + m * ldo + n + j;
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

const gemm_arch gemm_arch_avx2 = {
    .name = "avx2",
    .mr = MR,
    .mrs = MRS,
    .nr = NR,
    .kc = 256,
    .mc = 171 * MR,
    .nc = 2048,
    .ncb = 256,
    .mcb = 32 * MR,
    .ukernel = uk_avx2,
    .ukernel_rm = uk_avx2_rm,
    .pack_a = pack_a_avx2,
    .pack_b = pack_b_avx2,
    .pack_b_h = pack_b_h_avx2,
    .nt_small = nt_small_avx2,
};
#endif /* __x86_64__ */
