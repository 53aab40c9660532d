/* kernels/cpu/gemm_avx512.c: the AVX-512 micro-kernel and packers of gemm_f32.
 *
 * Register tile 14 x 32: 28 zmm accumulators (14 rows x 2 vectors of 16
 * columns), 2 zmm for the B row of the current k step and the A element
 * broadcast straight from memory by the FMA ({1to16} embedded broadcast), 31
 * of the 32 zmm registers. Per k step: 2 vector loads, 14 broadcast loads, 28
 * FMAs. 28 independent accumulation chains cover the FMA latency (4 cycles)
 * times the FMA issue width (1 zmm/cycle on AMD Zen 4, 2 on Intel server
 * cores) with room to spare, and the load:FMA ratio stays under the load
 * ports' rate. 14 is also the largest row count that leaves registers for B.
 *
 * Every function here carries its own target attribute so the file compiles
 * in the generic x86-64 build; the registry only installs it when the CPU has
 * AVX-512 F/BW/VL/DQ (kernels/registry.c).
 *
 * Blocking (tuned on a 32 KB L1 / 1 MB L2 core, docs/kernels.md): kc = 384
 * (one packed A micro-panel, 16 x 384 x 4 = 24 KB, stays in L1; 256 and 512
 * measured within noise of it), ncb = 512 columns (a B chunk of 384 x 512 x 4
 * = 768 KB stays in L2), nc = 2048 columns per packed B block, mc = 1036 rows
 * (74 micro-panels, so M = 1024 is one block) per packed A block.
 *
 * A row-major A is packed, not read in place as on avx2 (ukernel_rm): 14 rows
 * lda apart share L1 sets when lda is a multiple of 1024 floats (14 lines for
 * 12 ways), and such a kernel ran at ~195 GFLOP/s against ~240; where the rows
 * spread it gained at one thread but left W3's step level (docs/kernels.md). */
#if defined(__x86_64__) /* x86-64 only, the whole file (aarch64: the _neon files) */
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/avx512_util.h"
#include "kernels/cpu/kern_cpu.h"

#define MR 14
#define NR 32
/* Panels of MR rows are stored with row stride MRS = 16: every k of a panel is
 * one aligned 64-byte vector (the last two lanes zero), so the packers store
 * whole aligned vectors and the kernel's broadcasts never split a cache line. */
#define MRS 16
/* k per block, of both tiles below: each element of C is one FMA chain per k
 * block, so the 28 x 16 tile gives the 14 x 32 one's bits only at the same kc */
#define KC_AVX512 384

/* The micro-kernel for R rows (R a compile-time constant at each call site
 * below, so c[][] is all registers and the loops unroll). Each element of C
 * is one FMA chain over k whatever R is, so the row variants give bitwise
 * the same results and only save the wasted rows of an edge panel. */
T512 __attribute__((always_inline)) static inline void uk_rows(const int R, long kc, const float *restrict A,
                                                               const float *restrict B, float *C, long ldc, int mr,
                                                               int nr, int add) {
    __m512 c[MR][2];
#pragma GCC unroll 14
    for (int i = 0; i < R; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    if (add) gemm_prefetch_c(C, ldc, mr, NR); /* the tile's lines arrive while the k loop runs */
    /* Two k per trip, and B's lines 8 k ahead asked for: on an Intel Xeon (AVX-512,
     * 2 FMA ports) the kernel alone ran at ~84% of the FMA peak with its panels in
     * cache, the GEMM at 60-70%; these two took W3 steps +2-4% with matmul forced to avx512
     * (docs/benchmarks.md). Same FMAs in the same order: the same bits. */
#pragma GCC unroll 2
    for (long k = 0; k < kc; k++) {
        __m512 b0 = _mm512_load_ps(B), b1 = _mm512_load_ps(B + 16);
        _mm_prefetch((const char *)(B + 8 * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(B + 8 * NR + 16), _MM_HINT_T0);
#pragma GCC unroll 14
        for (int i = 0; i < R; i++) {
            __m512 a = _mm512_set1_ps(A[i]);
            c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
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

/* Full panels take the 14-row kernel; an edge panel (M not a multiple of 14,
 * e.g. 256 = 18 x 14 + 4) the smallest variant that covers its rows. */
T512 static void uk_avx512(long kc, const float *restrict A, const float *restrict B, float *C, long ldc, int mr,
                           int nr, int add) {
    if (mr > 8) uk_rows(14, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 4) uk_rows(8, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) uk_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 1) uk_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else uk_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

/* r[i], row i's k0 .. k0 + kn - 1 (kn <= 16), transposed and stored as rows
 * k0 .. k0 + kn - 1 of dst (stride dstride): the step both slab packers end in. */
T512 __attribute__((always_inline)) static inline void store_transposed16(float *dst, long dstride, __m512 r[16], long k0, long kn) {
    transpose16(r);
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; kk++)
        if (kk < kn) _mm512_store_ps(dst + (k0 + kk) * dstride, r[kk]);
}

/* Transposes a rows x kc slab (rows <= 16, row stride ld, contiguous in k)
 * into dst[k * dstride + i], 16 k at a time; rows beyond `rows` become zeros.
 * pf_rows rows at pf (same stride: the next slab the caller packs) are
 * prefetched a line a row per 16 k, as gemm_avx2.c's transpose_slab8 does: in
 * a step the source is cold and its rows are ld apart, no stream for the
 * hardware prefetcher (W3 +0.7%, with pack_a's below; docs/kernels.md). */
T512 static void transpose_slab(float *dst, long dstride, const float *src, long ld, int rows, long kc,
                                const float *pf, int pf_rows) {
    /* written so every r[] index is a constant after unrolling: the block then
     * lives in registers (a runtime index would put it on the stack) */
    for (long k0 = 0; k0 < kc; k0 += 16) {
        long kn = kc - k0 < 16 ? kc - k0 : 16;
        for (int i = 0; i < pf_rows; i++) _mm_prefetch((const char *)(pf + i * ld + k0), _MM_HINT_T0);
        __mmask16 mk = lanes((int)kn);
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            /* rows past the slab load nothing (mask 0) from a valid address */
            const float *p = src + (i < rows ? i : 0) * ld + k0;
            r[i] = _mm512_maskz_loadu_ps(i < rows ? mk : (__mmask16)0, p);
        }
        store_transposed16(dst, dstride, r, k0, kn);
    }
}

T512 static void pack_a_avx512(float *dst, gemm_view a, long m, long kc) {
    long np = (m + MR - 1) / MR;
    if (a.rs == 1) {
        /* A given transposed (dw's dout^T): row k of the source holds the m
         * values of one k contiguously, 14 to each panel; in blocks of
         * GEMM_PACK_KB k, so that a panel receives consecutive lines while the
         * block's source rows stay in L1 (k by k across all panels, every
         * store went to another panel MRS x kc floats apart, the same L1 set:
         * the packing took 17% of a dw at K = 256, see gemm_avx2.c) */
        for (long k0 = 0; k0 < kc; k0 += GEMM_PACK_KB) {
            long kn = kc - k0 < GEMM_PACK_KB ? kc - k0 : GEMM_PACK_KB;
            long kpf = kc - k0 - kn < GEMM_PACK_KB ? kc - k0 - kn : GEMM_PACK_KB; /* rows of the next block */
            for (long p = 0; p < np; p++) {
                for (long k = 0; k < kpf; k++) /* every 14 floats: each line at least once */
                    _mm_prefetch((const char *)(a.p + (k0 + kn + k) * a.cs + p * MR), _MM_HINT_T0);
                __mmask16 mk = lanes((int)(m - p * MR < MR ? m - p * MR : MR));
                const float *src = a.p + k0 * a.cs + p * MR;
                float *d = dst + p * MRS * kc + k0 * MRS;
                for (long k = 0; k < kn; k++) _mm512_store_ps(d + k * MRS, _mm512_maskz_loadu_ps(mk, src + k * a.cs));
            }
        }
        return;
    }
    if (a.cs == 1) {
        /* row-major A: transpose 14 rows x 16 k at a time */
        for (long p = 0; p < np; p++) {
            int rows = (int)(m - p * MR < MR ? m - p * MR : MR);
            const float *src = a.p + p * MR * a.rs;
            int pr; /* rows of the next panel */
            const float *pf = gemm_next_slab(src, a.rs, MR, m - (p + 1) * MR, &pr);
            transpose_slab(dst + p * MRS * kc, MRS, src, a.rs, rows, kc, pf, pr);
        }
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int i = 0; i < MRS; i++)
                dst[p * MRS * kc + k * MRS + i] =
                    i < MR && p * MR + i < m ? a.p[(p * MR + i) * a.rs + k * a.cs] : 0.0f;
}

/* 16 bf16 widened to fp32 (exact: the bits moved up by 16); lanes outside mk are zeros. */
T512 static inline __m512 widen16(__mmask16 mk, const uint16_t *s) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, s)), 16));
}

/* Row-major B (cs == 1), rows rs apart, of fp32 f or of bf16 h widened as it
 * loads (the other NULL; constant at each call, so each caller compiles to
 * one loop): GEMM_PACK_KB source rows at a time, 32 columns of each to each
 * panel, consecutive lines of a panel rather than one pair of lines in each
 * panel per k (see pack_a's transposed A). */
T512 __attribute__((always_inline)) static inline void pack_b_rows(float *dst, const float *f, const uint16_t *h,
                                                                   long rs, long kc, long n) {
    long np = (n + NR - 1) / NR;
    for (long k0 = 0; k0 < kc; k0 += GEMM_PACK_KB) {
        long kn = kc - k0 < GEMM_PACK_KB ? kc - k0 : GEMM_PACK_KB;
        for (long p = 0; p < np; p++) {
            long cols = n - p * NR, o = k0 * rs + p * NR;
            float *d = dst + p * NR * kc + k0 * NR;
            __mmask16 m0 = lanes(cols >= NR ? 16 : (int)cols), m1 = lanes(cols >= NR ? 16 : (int)cols - 16);
            for (long k = 0; k < kn; k++, o += rs) {
                _mm512_store_ps(d + k * NR, h ? widen16(m0, h + o) : _mm512_maskz_loadu_ps(m0, f + o));
                _mm512_store_ps(d + k * NR + 16, h ? widen16(m1, h + o + 16) : _mm512_maskz_loadu_ps(m1, f + o + 16));
            }
        }
    }
}

T512 static void pack_b_avx512(float *dst, gemm_view b, long kc, long n) {
    long np = (n + NR - 1) / NR;
    if (b.cs == 1) {
        pack_b_rows(dst, b.p, NULL, b.rs, kc, n);
        return;
    }
    if (b.rs == 1) {
        /* B given transposed (the forward's w[N,K]): two 16-column transposes per panel */
        for (long p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                long cols = n - p * NR - 16 * h;
                int c = (int)(cols > 16 ? 16 : cols < 0 ? 0 : cols);
                const float *src = b.p + (p * NR + 16 * h) * b.cs;
                int pc; /* columns of the next slab */
                const float *pf = gemm_next_slab(src, b.cs, 16, cols - 16, &pc);
                transpose_slab(dst + p * NR * kc + 16 * h, NR, src, b.cs, c, kc, pf, pc);
            }
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int j = 0; j < NR; j++)
                dst[p * NR * kc + k * NR + j] = p * NR + j < n ? b.p[k * b.rs + (p * NR + j) * b.cs] : 0.0f;
}


/* transpose_slab from a bf16 source, widening as it loads: the same stores
 * as transpose_slab on the fp32 widening of the slab. */
T512 static void transpose_slab_h(float *dst, long dstride, const uint16_t *src, long ld, int rows, long kc) {
    for (long k0 = 0; k0 < kc; k0 += 16) {
        long kn = kc - k0 < 16 ? kc - k0 : 16;
        __mmask16 mk = lanes((int)kn);
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) r[i] = widen16(i < rows ? mk : (__mmask16)0, src + (i < rows ? i : 0) * ld + k0);
        store_transposed16(dst, dstride, r, k0, kn);
    }
}

/* pack_b of a bf16 view (a frozen weight's store), widening while packing:
 * one pass over half the bytes instead of a widening pass into a scratch
 * block and a packing pass over it (gemm.c, pack_b_any). Same layout and
 * bits as pack_b_avx512 on the widened block. */
T512 static void pack_b_h_avx512(float *dst, gemm_view b, long kc, long n) {
    long np = (n + NR - 1) / NR;
    if (b.cs == 1) { /* row-major B (dinp's w) */
        pack_b_rows(dst, NULL, b.h, b.rs, kc, n);
        return;
    }
    if (b.rs == 1) {
        /* B given transposed (the forward's w[N,K]): two 16-column transposes per panel */
        for (long p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                long cols = n - p * NR - 16 * h;
                int c = (int)(cols > 16 ? 16 : cols < 0 ? 0 : cols);
                transpose_slab_h(dst + p * NR * kc + 16 * h, NR, b.h + (p * NR + 16 * h) * b.cs, b.cs, c, kc);
            }
        return;
    }
    gemm_pack_b_h_strided(dst, b, kc, n, NR); /* any other strides (not used by the model) */
}

/* Few rows (decode steps: M = 1): out[m, n] (+)= dot(inp[m, :], w[n, :]) for
 * n in [n0, n1). Both operands are contiguous along K, so no packing: the
 * GEMM would copy all of w to read it once, tripling the memory traffic of
 * what is a matrix-vector product bound by reading w. 4 rows of w at a time,
 * 16 k per step, one zmm partial sum per (row of inp, row of w), reduced in a
 * fixed order at the end. */
T512 static void nt_small_avx512(float *out, long ldo, const float *inp, const float *w, int M, long K, long n0,
                                 long n1, int accumulate) {
    for (long n = n0; n < n1; n += 4) {
        long nb = n1 - n < 4 ? n1 - n : 4;
        __m512 acc[GEMM_SMALL_M][4];
#pragma GCC unroll 4
        for (int m = 0; m < GEMM_SMALL_M; m++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
        for (long k0 = 0; k0 < K; k0 += 16) {
            __mmask16 mk = lanes(K - k0 < 16 ? (int)(K - k0) : 16);
            __m512 wv[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                wv[j] = _mm512_maskz_loadu_ps(j < nb ? mk : (__mmask16)0, w + (n + (j < nb ? j : 0)) * K + k0);
#pragma GCC unroll 4
            for (int m = 0; m < GEMM_SMALL_M; m++) {
                if (m >= M) break;
                __m512 x = _mm512_maskz_loadu_ps(mk, inp + m * K + k0);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(x, wv[j], acc[m][j]);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < GEMM_SMALL_M; m++) {
            if (m >= M) break;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                if (j >= nb) break;
                float v = _mm512_reduce_add_ps(acc[m][j]);
                float *o = out + m * ldo + n + j;
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

/* ------------------------------------------------ narrow C: 16 columns */

/* Register tile 28 x 16 for products whose C is at most 16 columns wide (a
 * LoRA adapter's rank-r side: u = x A^T, du = dy B, dB = dy^T u, r <= 16):
 * the 14 x 32 tile would compute half its columns for nothing. 28 zmm
 * accumulators (one vector of 16 columns per row), one B vector per k step,
 * A broadcast from memory: 29 loads per 28 FMAs, under the load ports' rate
 * on the Intel and AMD cores with 2 or 3 of them. Measured on the AMX Xeon (1
 * thread, LoRA's three 16-wide products at 0.6B's widths): 1.5-2x the 14 x 32
 * tile, level with OpenBLAS (docs/kernels.md, "Narrow C"). Each element of C
 * is the same FMA chain over k as in uk_rows, in k blocks of the same kc
 * (KC_AVX512), so both tiles give the same bits: which one a product runs on
 * changes no result. */
#define MR_N 28
#define MRS_N 32
#define NR_N 16

T512 __attribute__((always_inline)) static inline void uk_n16_rows(const int R, long kc, const float *restrict A,
                                                                   const float *restrict B, float *C, long ldc,
                                                                   int mr, int nr, int add) {
    __m512 c[MR_N];
#pragma GCC unroll 28
    for (int i = 0; i < R; i++) c[i] = _mm512_setzero_ps();
    if (add) gemm_prefetch_c(C, ldc, mr < R ? mr : R, NR_N);
#pragma GCC unroll 2
    for (long k = 0; k < kc; k++) {
        __m512 b = _mm512_load_ps(B);
        _mm_prefetch((const char *)(B + 8 * NR_N), _MM_HINT_T0);
#pragma GCC unroll 28
        for (int i = 0; i < R; i++) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(A[i]), b, c[i]);
        A += MRS_N;
        B += NR_N;
    }
    __mmask16 m = lanes(nr);
#pragma GCC unroll 28
    for (int i = 0; i < R; i++) {
        if (i >= mr) break;
        float *cr = C + i * ldc;
        __m512 v = c[i];
        if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, cr), v);
        _mm512_mask_storeu_ps(cr, m, v);
    }
}

T512 static void uk_avx512_n16(long kc, const float *restrict A, const float *restrict B, float *C, long ldc, int mr,
                               int nr, int add) {
    if (mr > 16) uk_n16_rows(28, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 8) uk_n16_rows(16, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 4) uk_n16_rows(8, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 2) uk_n16_rows(4, kc, A, B, C, ldc, mr, nr, add);
    else if (mr > 1) uk_n16_rows(2, kc, A, B, C, ldc, mr, nr, add);
    else uk_n16_rows(1, kc, A, B, C, ldc, mr, nr, add);
}

/* pack_a_avx512's layout for panels of 28 rows, row stride 32. */
T512 static void pack_a_avx512_n16(float *dst, gemm_view a, long m, long kc) {
    long np = (m + MR_N - 1) / MR_N;
    if (a.rs == 1) { /* transposed A (dB's dy^T): GEMM_PACK_KB k across all panels, as pack_a_avx512 */
        for (long k0 = 0; k0 < kc; k0 += GEMM_PACK_KB) {
            long kn = kc - k0 < GEMM_PACK_KB ? kc - k0 : GEMM_PACK_KB;
            for (long p = 0; p < np; p++) {
                int rows = (int)(m - p * MR_N < MR_N ? m - p * MR_N : MR_N);
                __mmask16 m0 = lanes(rows), m1 = lanes(rows - 16);
                const float *src = a.p + k0 * a.cs + p * MR_N;
                float *d = dst + p * MRS_N * kc + k0 * MRS_N;
                for (long k = 0; k < kn; k++) {
                    _mm512_store_ps(d + k * MRS_N, _mm512_maskz_loadu_ps(m0, src + k * a.cs));
                    _mm512_store_ps(d + k * MRS_N + 16, _mm512_maskz_loadu_ps(m1, src + k * a.cs + 16));
                }
            }
        }
        return;
    }
    if (a.cs == 1) { /* row-major A: two 16-row transposes per panel (the second 12 rows, zeros after) */
        for (long p = 0; p < np; p++) {
            int rows = (int)(m - p * MR_N < MR_N ? m - p * MR_N : MR_N);
            const float *src = a.p + p * MR_N * a.rs;
            int pr;
            const float *pf = gemm_next_slab(src, a.rs, MR_N, m - (p + 1) * MR_N, &pr);
            transpose_slab(dst + p * MRS_N * kc, MRS_N, src, a.rs, rows < 16 ? rows : 16, kc, pf, pr < 16 ? pr : 16);
            transpose_slab(dst + p * MRS_N * kc + 16, MRS_N, src + 16 * a.rs, a.rs, rows > 16 ? rows - 16 : 0, kc, NULL, 0);
        }
        return;
    }
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int i = 0; i < MRS_N; i++)
                dst[p * MRS_N * kc + k * MRS_N + i] =
                    i < MR_N && p * MR_N + i < m ? a.p[(p * MR_N + i) * a.rs + k * a.cs] : 0.0f;
}

/* pack_b_avx512's layout for panels of 16 columns. */
T512 static void pack_b_avx512_n16(float *dst, gemm_view b, long kc, long n) {
    long np = (n + NR_N - 1) / NR_N;
    for (long p = 0; p < np; p++) {
        int cols = (int)(n - p * NR_N < NR_N ? n - p * NR_N : NR_N);
        float *d = dst + p * NR_N * kc;
        if (b.cs == 1) { /* row-major B (du's B, dB's u) */
            __mmask16 mk = lanes(cols);
            const float *src = b.p + p * NR_N;
            for (long k = 0; k < kc; k++) _mm512_store_ps(d + k * NR_N, _mm512_maskz_loadu_ps(mk, src + k * b.rs));
        } else if (b.rs == 1) { /* transposed B (the forward's A[r, K]) */
            transpose_slab(d, NR_N, b.p + p * NR_N * b.cs, b.cs, cols, kc, NULL, 0);
        } else {
            for (long k = 0; k < kc; k++)
                for (int j = 0; j < NR_N; j++) d[k * NR_N + j] = j < cols ? b.p[k * b.rs + (p * NR_N + j) * b.cs] : 0.0f;
        }
    }
}

/* kc: gemm_arch_avx512's (the bits above depend on it). mc: 4 panels, not
 * 74: with C 16 wide there is one B panel, so each packed A panel is used
 * once, and a large block only sent it through L2 and back (15% of these
 * products at 1 thread). */
const gemm_arch gemm_arch_avx512_n16 = {
    .name = "avx512_n16",
    .mr = MR_N,
    .mrs = MRS_N,
    .nr = NR_N,
    .kc = KC_AVX512,
    .mc = 4 * MR_N,
    .nc = 2048,
    .ncb = 512,
    .ukernel = uk_avx512_n16,
    .pack_a = pack_a_avx512_n16,
    .pack_b = pack_b_avx512_n16,
    .nt_small = nt_small_avx512,
};

const gemm_arch gemm_arch_avx512 = {
    .name = "avx512",
    .mr = MR,
    .mrs = MRS,
    .nr = NR,
    .kc = KC_AVX512,
    .mc = 74 * MR,
    .nc = 2048,
    .ncb = 512,
    .ukernel = uk_avx512,
    .pack_a = pack_a_avx512,
    .pack_b = pack_b_avx512,
    .pack_b_h = pack_b_h_avx512,
    .nt_small = nt_small_avx512,
};
#endif /* __x86_64__ */
