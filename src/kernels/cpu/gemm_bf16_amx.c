/* kernels/cpu/gemm_bf16_amx.c: matmul_bf16 on Intel AMX tiles (TDPBF16PS).
 *
 * Why: on Sapphire Rapids vdpbf16ps (gemm_bf16_avx512.c) runs at half the
 * FMA ports' throughput, so the "avx512bf16" kernel is no faster than the
 * fp32 GEMM there; one TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16
 * one (8192 multiply-adds) into 16 x 16 fp32 accumulators.
 *
 * It is another gemm_arch of the portable driver gemm_f32 (gemm.c): same
 * blocking, thread split, determinism and strided views as the fp32 and
 * avx512bf16 GEMMs; operands stay fp32 in memory and are rounded to bf16
 * (nearest even, bf16_pairs.h, the same helpers as avx512bf16: the packers
 * round with vcvtne2ps2bf16, so this arch also needs AVX512_BF16, which every
 * CPU with AMX-BF16 has) while packed.
 *
 * Tiles (8 of 16 rows x 64 bytes, one configuration for all):
 *   tmm0..3  C accumulators, fp32 16 x 16 each: a 32 x 32 block of C (2 x 2)
 *   tmm4, 5  A: rows 0-15 and 16-31 of the micro-panel, 16 k pairs per row
 *   tmm6, 7  B: columns 0-15 and 16-31, 16 rows of k pairs (VNNI layout)
 * Per step of 32 k: 2 A + 2 B tile loads, 4 TDPBF16PS; every loaded tile is
 * used twice (the usual 2 x 2 blocking: 4 accumulators + 2 + 2 = 8 tiles).
 *
 * Packed layouts (kpack = 2: one 32-bit lane is a bf16 pair (x[k], x[k+1]),
 * k even, element k in the low half; kalign = 16: panel depths kd are whole
 * tile rows of 16 pairs, the padding is zeros, so the kernel has no k tail):
 *   A micro-panel (MR = 32 rows): [kd / 16][32 rows][16 pairs], so each A
 *     tile is 1 KB contiguous (64-byte row stride). Row-major A (forward's
 *     inp, dinp's dout) is rounded row by row with no transpose; A given
 *     transposed (dw's dout^T) pairs two source rows and transposes 16 x 16.
 *   B micro-panel (NR = 32 columns): [kd][32 lanes], the avx512bf16 arch's
 *     own layout (gemm_pack_b_bf16); a B tile is 16 of its rows read with a
 *     128-byte stride (every tile row one aligned cache line).
 *
 * Accumulators start at zero for each (micro-panel pair, k block) and leave
 * through _tile_stored: straight into C when the block overwrites a full
 * 32 x 32 tile, else into a 4 KB fp32 buffer that is added (`add`) or copied
 * into the mr x nr corner of C with masked stores (M, N edges; C never read
 * when overwritten). Both paths store the same bits. Edge blocks of at most
 * 16 rows or columns skip the tiles they do not need.
 *
 * Blocking: kc = 1024 k values, so C (read and written once per k block, 4 KB
 * per 2 MFLOP of tiles) is swept once for the model's K <= 1024 and the tiles
 * are not waiting on memory for C; B chunks of 256 columns (512 KB) and A
 * blocks of 512 rows (1 MB) stay in the 2 MB L2 together, the 64 KB A
 * micro-panel streams from there. k blocks are rounded to whole 32-k tile
 * steps (gemm.c, kalign). Measured on Sapphire Rapids (1 thread, CPU time,
 * the 0.6B shapes): kc 256-4096, ncb 128-512 and mc 256-1024 all lie within
 * ~15% of each other under the machine's background load; this one was among
 * the best. The tiles alone (panels in cache) reach ~1.9 TFLOP/s per core; the
 * GEMM ~0.6-0.8, the rest being packing (rounding fp32 operands read from
 * memory, ~20-30%) and the traffic of C.
 *
 * Determinism: each element of C is summed by one thread in a fixed order
 * (k blocks ascending, TDPBF16PS's own order inside a block, one add to C per
 * block); the blocking depends on K only, so results are bit-identical for
 * any thread count. TDPBF16PS treats bf16 subnormals as zero and flushes
 * subnormal results (like vdpbf16ps); irrelevant at a model's magnitudes.
 *
 * Tile state: the configuration is per thread, loaded by thread_begin in every
 * thread that runs a share of a gemm_f32 call and released by thread_end.
 * Linux only lets a process use the tile data state after it asked for it
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); before that, the first
 * tile instruction raises SIGILL. cpu_amx_bf16_ready() asks once per process
 * and KERN_FEAT_AMXBF16 is set only if it succeeded; thread_begin checks it
 * again, so no path executes a tile instruction without the permission. */
#include "kernels/registry.h"

#if defined(__x86_64__) /* AMX is x86-64 only */
#include "core/cpu.h"
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels/cpu/avx512_util.h"
#include "kernels/cpu/bf16_pairs.h"
#include "kernels/cpu/kern_cpu.h"

#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")))

#define MR 32    /* rows of C per micro-kernel: 2 tiles of 16 */
#define NR 32    /* columns of C per micro-kernel: 2 tiles of 16 */
#define KSTEP 16 /* k pairs per tile row (64 bytes) */

/* ----------------------------------------------------------- tile state */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

TAMX static void amx_begin(void) {
    const char *why;
    if (!cpu_amx_bf16_ready(&why)) {
        /* the registry never selects this arch then; a direct caller must not get SIGILL */
        fprintf(stderr, "ctitan: error: the AMX GEMM was called but AMX is not usable: %s\n", why);
        abort();
    }
    _Alignas(64) amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    /* not _tile_loadconfig: GCC 12's macro declares an 8-byte memory operand,
     * so the compiler dropped the stores of colsb / rows as dead (measured:
     * tilezero then raised SIGILL, the tiles unconfigured) */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

TAMX static void amx_end(void) { _tile_release(); }

/* -------------------------------------------------------- micro-kernel */

/* C[0:mr, 0:nr] (=, or += when add) of a 32 x 32 block from an A micro-panel
 * and a B micro-panel kd pairs deep (kd a multiple of 16). R2 / C2: 1 or 2
 * row / column tiles (compile-time at each call site).
 *
 * With add, the accumulators start from C itself (a full block loads its tiles
 * straight from C, an edge block through `buf`), so each element of C is
 * C + its products in TDPBF16PS's order in both cases; the first version
 * summed from zero and added the buffer to C with zmm loads, ~20% of the
 * kernel's time. */
TAMX __attribute__((always_inline)) static inline void uk_tiles(const int R2, const int C2, long kd,
                                                                 const float *A, const float *B, float *C,
                                                                 long ldc, int mr, int nr, int add) {
    const int full = R2 > 1 && C2 > 1 && mr == MR && nr == NR;
    const long ld = ldc * (long)sizeof(float);
    _Alignas(64) float buf[MR * NR]; /* [32][32] fp32: edge blocks of C */
    __mmask16 m0 = lanes(nr), m1 = lanes(nr - 16);
    if (!add) {
        _tile_zero(0);
        if (C2 > 1) _tile_zero(1);
        if (R2 > 1) _tile_zero(2);
        if (R2 > 1 && C2 > 1) _tile_zero(3);
    } else if (full) {
        _tile_loadd(0, C, ld);
        _tile_loadd(1, C + 16, ld);
        _tile_loadd(2, C + 16 * ldc, ld);
        _tile_loadd(3, C + 16 * ldc + 16, ld);
    } else {
        for (int i = 0; i < 16 * R2; i++) { /* rows past mr: zeros, never stored */
            const float *cr = C + (i < mr ? i : 0) * ldc;
            _mm512_store_ps(buf + i * NR, _mm512_maskz_loadu_ps(i < mr ? m0 : (__mmask16)0, cr));
            if (C2 > 1) _mm512_store_ps(buf + i * NR + 16, _mm512_maskz_loadu_ps(i < mr ? m1 : (__mmask16)0, cr + 16));
        }
        _tile_loadd(0, buf, NR * 4);
        if (C2 > 1) _tile_loadd(1, buf + 16, NR * 4);
        if (R2 > 1) _tile_loadd(2, buf + 16 * NR, NR * 4);
        if (R2 > 1 && C2 > 1) _tile_loadd(3, buf + 16 * NR + 16, NR * 4);
    }
    /* The driver's next call is usually the block to the right (the next B
     * micro-panel): fetch its rows of C while these tiles compute, since it
     * starts by loading them (a prefetch past the end of C is harmless). */
    long nsteps = kd / KSTEP, pf_per_step = add ? (mr + nsteps - 1) / nsteps : 0, pf = 0;
    for (long s = 0; s < kd; s += KSTEP) {
        const float *a = A + s * MR, *b = B + s * NR; /* A step: [32 rows][16]; B rows s.. of [kd][32] */
        for (long q = 0; q < pf_per_step && pf < mr; q++, pf++) {
            _mm_prefetch((const char *)(C + pf * ldc + NR), _MM_HINT_T0);
            _mm_prefetch((const char *)(C + pf * ldc + NR + 16), _MM_HINT_T0);
        }
        _tile_loadd(4, a, 64);
        _tile_loadd(6, b, NR * 4);
        _tile_dpbf16ps(0, 4, 6);
        if (C2 > 1) {
            _tile_loadd(7, b + 16, NR * 4);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (R2 > 1) {
            _tile_loadd(5, a + 16 * KSTEP, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (C2 > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (full) {
        _tile_stored(0, C, ld);
        _tile_stored(1, C + 16, ld);
        _tile_stored(2, C + 16 * ldc, ld);
        _tile_stored(3, C + 16 * ldc + 16, ld);
        return;
    }
    _tile_stored(0, buf, NR * 4);
    if (C2 > 1) _tile_stored(1, buf + 16, NR * 4);
    if (R2 > 1) _tile_stored(2, buf + 16 * NR, NR * 4);
    if (R2 > 1 && C2 > 1) _tile_stored(3, buf + 16 * NR + 16, NR * 4);
    for (int i = 0; i < mr; i++) {
        _mm512_mask_storeu_ps(C + i * ldc, m0, _mm512_load_ps(buf + i * NR));
        if (C2 > 1) _mm512_mask_storeu_ps(C + i * ldc + 16, m1, _mm512_load_ps(buf + i * NR + 16));
    }
}

static long amx_depth(long kc) { return ((kc + 1) / 2 + KSTEP - 1) / KSTEP * KSTEP; }

TAMX static void uk_amx(long kc, const float *restrict A, const float *restrict B, float *C, long ldc, int mr,
                        int nr, int add) {
    long kd = amx_depth(kc);
    if (mr > 16) {
        if (nr > 16) uk_tiles(2, 2, kd, A, B, C, ldc, mr, nr, add);
        else uk_tiles(2, 1, kd, A, B, C, ldc, mr, nr, add);
    } else {
        if (nr > 16) uk_tiles(1, 2, kd, A, B, C, ldc, mr, nr, add);
        else uk_tiles(1, 1, kd, A, B, C, ldc, mr, nr, add);
    }
}

/* ------------------------------------------------------------- packing */

/* A rows [0, m), k [0, kc) as ceil(m / 32) micro-panels of 32 * kd lanes:
 * panel p holds pair (row p*32 + i, k pair k2) at [k2 / 16][i][k2 % 16];
 * rows past m and pairs past kc are zeros. */
T512BF16 static void pack_a_amx(float *dst, gemm_view a, long m, long kc) {
    long np = (m + MR - 1) / MR, kd = amx_depth(kc);
    if (a.cs == 1) {
        /* row-major (k contiguous): each row's pairs are adjacent already */
        for (long p = 0; p < np; p++)
            for (int i = 0; i < MR; i++) {
                long r = p * MR + i;
                float *d = dst + p * MR * kd + i * KSTEP;
                const float *src = a.p + (r < m ? r : 0) * a.rs;
                for (long s = 0; s < kd; s += KSTEP) {
                    long kn = r < m ? kc - 2 * s : 0; /* <= 0: padding */
                    const float *q = src + (kn > 0 ? 2 * s : 0);
                    __m512 x0 = _mm512_maskz_loadu_ps(lanes((int)(kn < 32 ? kn : 32)), q);
                    __m512 x1 = _mm512_maskz_loadu_ps(lanes((int)(kn < 32 ? kn : 32) - 16), q + 16);
                    _mm512_store_si512(d + s * MR, bf16_pair_along(x0, x1));
                }
            }
        return;
    }
    if (a.rs == 1) {
        /* transposed (dw's dout^T): source row k holds the m values of one k;
         * pair rows k, k+1 lane by lane (lanes = 16 rows of A), then 16 x 16
         * transposes turn [pair][row] into the tile's [row][pair] */
        for (long s = 0; s < kd; s += KSTEP)
            for (long p = 0; p < np; p++)
                for (int h = 0; h < 2; h++) {
                    long rows = m - p * MR - 16 * h;
                    float *d = dst + p * MR * kd + s * MR + 16 * h * KSTEP;
                    __m512 r[16];
                    if (rows <= 0) {
                        for (int i = 0; i < 16; i++) _mm512_store_ps(d + i * KSTEP, _mm512_setzero_ps());
                        continue;
                    }
                    __mmask16 mk = lanes((int)(rows < 16 ? rows : 16));
#pragma GCC unroll 16
                    for (int j = 0; j < 16; j++) {
                        long k = 2 * (s + j);
                        int has0 = k < kc, has1 = k + 1 < kc;
                        const float *s0 = a.p + (has0 ? k : 0) * a.cs + p * MR + 16 * h;
                        __m512 x0 = _mm512_maskz_loadu_ps(has0 ? mk : (__mmask16)0, s0);
                        __m512 x1 = _mm512_maskz_loadu_ps(has1 ? mk : (__mmask16)0, has1 ? s0 + a.cs : s0);
                        r[j] = _mm512_castsi512_ps(bf16_pair_rows(x0, x1));
                    }
                    transpose16(r);
#pragma GCC unroll 16
                    for (int i = 0; i < 16; i++) _mm512_store_ps(d + i * KSTEP, r[i]);
                }
        return;
    }
    for (long p = 0; p < np; p++) /* any other strides (not used by the model) */
        for (long k2 = 0; k2 < kd; k2++)
            for (int i = 0; i < MR; i++) {
                long r = p * MR + i, k = 2 * k2;
                float lo = r < m && k < kc ? a.p[r * a.rs + k * a.cs] : 0.0f;
                float hi = r < m && k + 1 < kc ? a.p[r * a.rs + (k + 1) * a.cs] : 0.0f;
                dst[p * MR * kd + (k2 / KSTEP) * MR * KSTEP + i * KSTEP + k2 % KSTEP] = bf16_pair_scalar(lo, hi);
            }
}

static void pack_b_amx(float *dst, gemm_view b, long kc, long n) { gemm_pack_b_bf16(dst, b, kc, n, amx_depth(kc)); }
static void pack_b_h_amx(float *dst, gemm_view b, long kc, long n) {
    gemm_pack_b_bf16_h(dst, b, kc, n, amx_depth(kc));
}

const gemm_arch gemm_arch_amx = {
    .name = "amx",
    .mr = MR,
    .mrs = MR,
    .nr = NR,
    .kc = 1024,
    .mc = 16 * MR,
    .nc = 2048,
    .ncb = 256,
    .ukernel = uk_amx,
    .pack_a = pack_a_amx,
    .pack_b = pack_b_amx,
    .pack_b_h = pack_b_h_amx,
    .nt_small = NULL, /* matmul_bf16 always packs (see gemm_bf16.c) */
    .kpack = 2,
    .kalign = KSTEP,
    .thread_begin = amx_begin,
    .thread_end = amx_end,
};

/* ------------------------------------------------- the matmul_bf16 op */

void kern_matmul_bf16_fwd_amx(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    gemm_view a = {inp, K, 1, NULL}, b = {w, 1, K, NULL}; /* out[M,N] = inp[M,K] (w[N,K] viewed [K,N]) */
    gemm_f32(&gemm_arch_amx, M, N, K, a, b, out, N, accumulate);
}
void kern_matmul_bf16_bwd_amx(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                              int K, int N, int accumulate) {
    gemm_matmul_bwd(&gemm_arch_amx, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
void kern_matmul_fwd_wbf16_bf16_amx(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                    int accumulate) {
    gemm_matmul_fwd_wbf16(&gemm_arch_amx, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_bf16_amx(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                     int ldd, int accumulate) {
    gemm_matmul_dinp_wbf16(&gemm_arch_amx, dinp, dout, w, M, K, N, ldd, accumulate);
}

#endif /* x86-64 */
