/* kernels/cpu/gemm.c: the portable driver of the packed fp32 GEMM.
 *
 * Design (GotoBLAS/BLIS loop structure, our own code). Each thread owns a
 * rectangle of C and computes it with this serial loop nest:
 *
 *   for jc over its columns in blocks of nc     packed B block [kc x nc]
 *     for pc over K in blocks of kc
 *       pack B block
 *       for ic over its rows in blocks of mc     packed A block [mc x kc]
 *         pack A block
 *         for column chunks of ncb              kc x ncb of B stays in L2
 *           for each A micro-panel (MR rows)    kc x MR of A stays in L1
 *             for each B micro-panel (NR cols)  streamed from L2
 *               micro-kernel MR x NR (registers)
 *
 * Parallelism: C is split once per call into T rectangles (T = OpenMP
 * threads), by rows, by columns, or both, at micro-tile granularity; the
 * split minimises the busiest thread's compute plus the packing it repeats
 * (a row split makes every thread pack all of B, a column split all of A,
 * so it splits along the larger of M and N). The threads then share nothing
 * and never wait for each other: no barriers. Measured on 2 cores shared
 * with other processes, barrier-synchronised shared packing lost up to 3x
 * whenever one thread was descheduled; duplicated packing of the smaller
 * operand costs about 1%.
 *
 * Determinism: an element of C is summed by exactly one thread, in a fixed
 * order: k blocks ascending, each summed in k order inside the micro-kernel
 * and added to C once. The k blocking depends on K only (never on the thread
 * count, M or N), so results are bit-identical for any number of threads.
 * No float atomics, no reductions across threads.
 *
 * Packed panels are kc deep in 32-bit lanes, or ceil(kc / kpack) when an
 * arch packs several k per lane (bf16 pairs: gemm_bf16_avx512.c), rounded up
 * to a multiple of kalign when the micro-kernel consumes k in fixed steps
 * (AMX tiles: gemm_bf16_amx.c); the driver only needs that depth to find
 * each panel. An arch with per-thread state (AMX's tile configuration) gets
 * thread_begin / thread_end around each thread's rectangle.
 *
 * Workspace: each thread allocates its packed blocks per call (malloc keeps
 * freed large blocks in its heap after the first call, so repeated calls of
 * the same shape do not fault pages in again); no global state. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/kern_cpu.h"

/* Below this many flops a parallel region costs more than it saves. */
#define GEMM_SERIAL_FLOPS 4.0e6

static long ceil_div(long a, long b) { return (a + b - 1) / b; }

static float *gemm_alloc(size_t nfloats) {
    size_t bytes = (nfloats * sizeof(float) + 63) & ~(size_t)63;
    float *p = aligned_alloc(64, bytes ? bytes : 64);
    if (!p) {
        /* same policy as ct_malloc: running out of memory mid-step leaves nothing to recover */
        fprintf(stderr, "ctitan: error: out of memory allocating %zu bytes of GEMM workspace\n", bytes);
        exit(1);
    }
    return p;
}

/* Split [0, n) into parts; part `i` of `parts`: [*lo, *hi). Sizes differ by at most 1. */
static void split_range(long n, int parts, int i, long *lo, long *hi) {
    long base = n / parts, rem = n % parts;
    *lo = i * base + (i < rem ? i : rem);
    *hi = *lo + base + (i < rem ? 1 : 0);
}

/* Block size for n rows (or columns) in blocks of at most maxb (a multiple of
 * unit): near-equal blocks, each a multiple of unit. So 1100 rows with maxb
 * 1036 become 2 blocks of 560 and 540, not 1036 + 64. */
static long balanced_block(long n, long maxb, long unit) {
    if (n <= maxb) return n;
    long nb = ceil_div(n, maxb);
    return ceil_div(ceil_div(n, nb), unit) * unit;
}

/* Depth in 32-bit lanes of a packed panel of kc k values (kpack per lane,
 * rounded up to a multiple of kalign). */
static long panel_depth(const gemm_arch *ar, long kc) {
    long kd = ceil_div(kc, ar->kpack > 1 ? ar->kpack : 1);
    return ar->kalign > 1 ? ceil_div(kd, ar->kalign) * ar->kalign : kd;
}

/* One call's operands and blocking. */
typedef struct {
    const gemm_arch *ar;
    int M, N, K, accumulate;
    gemm_view A, B;
    float *C;
    long ldc;
    long kcb; /* k block: depends on K only */
} gemm_job;

/* C[i0:i1, j0:j1] of the job, serially, with this thread's own buffers. */
static void gemm_rect(const gemm_job *g, long i0, long i1, long j0, long j1) {
    const gemm_arch *ar = g->ar;
    const long MR = ar->mr, MRS = ar->mrs, NR = ar->nr;
    const gemm_view A = g->A, B = g->B;
    const long K = g->K, kcb = g->kcb, ldc = g->ldc;
    if (i1 <= i0 || j1 <= j0) return;
    long mc = balanced_block(i1 - i0, ar->mc, MR), nc = balanced_block(j1 - j0, ar->nc, NR);
    float *Ap = gemm_alloc((size_t)ceil_div(mc, MR) * MRS * panel_depth(ar, kcb));
    float *Bp = gemm_alloc((size_t)ceil_div(nc, NR) * NR * panel_depth(ar, kcb));
    if (ar->thread_begin) ar->thread_begin();
    long chunk = ar->ncb / NR > 0 ? ar->ncb / NR : 1;
    for (long jc = j0; jc < j1; jc += nc) {
        long ncur = j1 - jc < nc ? j1 - jc : nc;
        long nt = ceil_div(ncur, NR);
        for (long pc = 0; pc < K; pc += kcb) {
            long kc = K - pc < kcb ? K - pc : kcb;
            long kd = panel_depth(ar, kc); /* depth of a packed panel in 32-bit lanes */
            gemm_view b = {B.p + pc * B.rs + jc * B.cs, B.rs, B.cs};
            ar->pack_b(Bp, b, kc, ncur);
            int add = g->accumulate || pc > 0;
            for (long ic = i0; ic < i1; ic += mc) {
                long mcur = i1 - ic < mc ? i1 - ic : mc;
                long mt = ceil_div(mcur, MR);
                gemm_view a = {A.p + ic * A.rs + pc * A.cs, A.rs, A.cs};
                ar->pack_a(Ap, a, mcur, kc);
                for (long jb = 0; jb < nt; jb += chunk) {
                    long jb1 = jb + chunk < nt ? jb + chunk : nt;
                    for (long ip = 0; ip < mt; ip++) {
                        long r0 = ic + ip * MR;
                        int mr = (int)(i1 - r0 < MR ? i1 - r0 : MR);
                        const float *ap = Ap + ip * MRS * kd;
                        for (long jp = jb; jp < jb1; jp++) {
                            long c0 = jc + jp * NR;
                            int nr = (int)(j1 - c0 < NR ? j1 - c0 : NR);
                            ar->ukernel(kc, ap, Bp + jp * NR * kd, g->C + r0 * ldc + c0, ldc, mr, nr, add);
                        }
                    }
                }
            }
        }
    }
    if (ar->thread_end) ar->thread_end();
    free(Ap);
    free(Bp);
}

/* Rows x columns of threads (tr * tc = T) over an mt x nt grid of micro-tiles:
 * minimises the busiest thread's multiply-adds plus the packing it repeats,
 * both per unit of K: compute ~ rows*cols/16 (cycles at 32 flops/cycle, 2
 * flops per multiply-add), packing ~ 1 cycle per float packed (A once per
 * column block it meets, B once per row block). */
static int choose_row_threads(const gemm_arch *ar, long M, long N, int T) {
    long mt = ceil_div(M, ar->mr), nt = ceil_div(N, ar->nr);
    int best = 1;
    double best_cost = -1;
    for (int tr = 1; tr <= T; tr++) {
        if (T % tr) continue;
        int tc = T / tr;
        if (tr > mt || tc > nt) continue;
        double rows = (double)ceil_div(mt, tr) * ar->mr, cols = (double)ceil_div(nt, tc) * ar->nr;
        double cost = rows * cols / 16 + rows * ceil_div((long)cols, ar->nc) + cols * ceil_div((long)rows, ar->mc);
        if (best_cost < 0 || cost < best_cost) {
            best_cost = cost;
            best = tr;
        }
    }
    return best;
}

void gemm_f32(const gemm_arch *ar, int M, int N, int K, gemm_view A, gemm_view B, float *C, long ldc,
              int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        /* an empty sum: C = 0 or C unchanged */
        if (!accumulate)
            for (int i = 0; i < M; i++) memset(C + (size_t)i * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    /* k blocks of near-equal size: a function of K alone (determinism) */
    long nkb = ceil_div(K, ar->kc);
    gemm_job g = {.ar = ar, .M = M, .N = N, .K = K, .accumulate = accumulate, .A = A, .B = B, .C = C, .ldc = ldc};
    g.kcb = ceil_div(K, nkb);
    if (ar->kalign > 1) {
        /* whole tile rows of k in every block but the last (still a function of K alone) */
        long unit = (long)ar->kalign * (ar->kpack > 1 ? ar->kpack : 1);
        g.kcb = ceil_div(g.kcb, unit) * unit;
    }

    double flops = 2.0 * M * (double)N * K;
    long tiles = ceil_div(M, ar->mr) * ceil_div(N, ar->nr);
    int T = omp_get_max_threads();
    if (flops < GEMM_SERIAL_FLOPS || omp_in_parallel()) T = 1;
    if (T > tiles) T = (int)tiles;
    if (T <= 1) {
        gemm_rect(&g, 0, M, 0, N); /* no parallel region for small products */
        return;
    }
    int tr = choose_row_threads(ar, M, N, T), tc = T / tr;
    long mt = ceil_div(M, ar->mr), nt = ceil_div(N, ar->nr);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel num_threads(T)
    {
        KERN_TRACE_ENTER(kt_);
        int tid = omp_get_thread_num();
        if (omp_get_num_threads() == T) {
            long ip0, ip1, jp0, jp1;
            split_range(mt, tr, tid / tc, &ip0, &ip1);
            split_range(nt, tc, tid % tc, &jp0, &jp1);
            long i1 = ip1 * ar->mr < M ? ip1 * ar->mr : M, j1 = jp1 * ar->nr < N ? jp1 * ar->nr : N;
            gemm_rect(&g, ip0 * ar->mr, i1, jp0 * ar->nr, j1);
        } else if (tid == 0) {
            /* the runtime gave fewer threads than asked (thread limit): one does it all */
            gemm_rect(&g, 0, M, 0, N);
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void gemm_nt_small(const gemm_arch *ar, float *out, const float *inp, const float *w, int M, int K, int N,
                   int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate) memset(out, 0, (size_t)M * N * sizeof(float));
        return;
    }
    /* blocks of 96 columns (a multiple of both kernels' 4 and 3 rows of w) */
    const long blk = 96;
    long nblk = ceil_div(N, blk);
    int T = omp_get_max_threads();
    if (2.0 * M * (double)N * K < GEMM_SERIAL_FLOPS || omp_in_parallel()) T = 1;
    if (T > nblk) T = (int)nblk;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel num_threads(T > 0 ? T : 1)
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long b = 0; b < nblk; b++) {
            long n1 = (b + 1) * blk < N ? (b + 1) * blk : N;
            ar->nt_small(out, N, inp, w, M, K, b * blk, n1, accumulate);
        }
        KERN_TRACE_EXIT(kt_);
    }
}
