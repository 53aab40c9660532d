/* kernels/cpu/gemm.c: the portable driver of the packed fp32 GEMM.
 *
 * Design (GotoBLAS/BLIS loop structure, our own code). Each rectangle of C
 * (a unit, below) is computed by one thread with this serial loop nest:
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
 * An arch with mcb > 0 runs an A read in place over more than ncb columns
 * B-stationary instead: for blocks of mcb rows, for each B micro-panel (in
 * L1), for each A micro-panel of the block (in L2).
 *
 * Parallelism: C is split into rectangles ("units") that the threads take
 * in turn (an OpenMP dynamic schedule), never waiting for each other until
 * the end of the call. The split runs along the larger of M and N (or both
 * when T has several factors): a row split makes every thread pack all of B,
 * a column split all of A, so it minimises the busiest thread's compute plus
 * the packing it repeats. In a split along one dimension each thread keeps
 * its own packed copy of the shared operand for the whole call (gemm_cache:
 * packed at its first use, reused by every unit the thread takes), so units
 * can be small (GEMM_UNITS_PER_THREAD per thread) at no extra packing: a
 * thread that other processes hold up (2 cores shared with other work) then
 * leaves its remaining units to the others instead of stalling the call by
 * its whole share. Measured on 2 cores with one of them taken 50% of the
 * time: 1.2-1.4x the static one-rectangle-per-thread split; without
 * interference within noise of it. When the copy would be too large (e.g.
 * the lm_head's dlogits block with K = vocabulary), one unit per thread. An
 * earlier version shared the packed B block between threads with barriers;
 * it lost up to 3x whenever a thread was descheduled.
 *
 * A row-major A (k contiguous: the forward's inp, dinp's dout) is not packed
 * at all on an arch with ukernel_rm (avx2): its micro-kernel broadcasts from
 * the MR row pointers in place, the same FMAs in the same order. Such a call
 * has no A packing to repeat, so the split model counts none and a column
 * split needs no cache: each thread packs only its own columns of B, and no
 * packing is done twice. The archs that must transform A while packing it
 * (rounding to bf16, bf16 pairs, AMX tiles) leave ukernel_rm NULL.
 *
 * Determinism: an element of C is summed by exactly one thread, in a fixed
 * order: k blocks ascending, each summed in k order inside the micro-kernel
 * and added to C once. The k blocking depends on K only (never on the thread
 * count, M or N), and a unit's elements are summed in the same order by
 * whichever thread takes it, so results are bit-identical for any number of
 * threads and any assignment of units. No float atomics, no reductions
 * across threads.
 *
 * Packed panels are kc deep in 32-bit lanes, or ceil(kc / kpack) when an
 * arch packs several k per lane (bf16 pairs: gemm_bf16_avx512.c), rounded up
 * to a multiple of kalign when the micro-kernel consumes k in fixed steps
 * (AMX tiles: gemm_bf16_amx.c); the driver only needs that depth to find
 * each panel. An arch with per-thread state (AMX's tile configuration) gets
 * thread_begin / thread_end around each thread's units.
 *
 * Workspace: each thread allocates its packed blocks and cache per call
 * (malloc keeps freed large blocks in its heap after the first call, so
 * repeated calls of the same shape do not fault pages in again); no global
 * state. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/cpu/kern_cpu.h"

/* Below this many flops a parallel region costs more than it saves. */
#define GEMM_SERIAL_FLOPS 4.0e6

static long ceil_div(long a, long b) { return (a + b - 1) / b; }

static float *gemm_alloc(size_t nfloats) { return ct_malloc64(nfloats * sizeof(float)); }

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
    int a_rm; /* A read in place by ukernel_rm (a row-major A), never packed */
    gemm_view A, B;
    float *C;
    long ldc;
    long kcb; /* k block: depends on K only */
} gemm_job;

/* A thread's packed copy of the operand all its units share (A when units are
 * column ranges, B when they are row ranges): the block of row (column) block
 * b and k block q at p + (b * nkb + q) * slot, packed by the first of the
 * thread's units that needs it (done[b * nkb + q]). */
typedef struct {
    float *p;
    unsigned char *done;
    long slot, nkb;
} gemm_cache;

/* Per-thread buffers of one call: a packed A block [mc x kcb] and B block
 * [kcb x nc], at most one of the caches, and for a bf16 B on an arch without
 * pack_b_h the block widened to fp32 ([kcb x nc], NULL otherwise). */
typedef struct {
    float *Ap, *Bp, *wide;
    long mc, nc;
    gemm_cache *ca, *cb;
} gemm_ws;

/* dst[i] = s[i] widened (exact: the bits moved up by 16). Not
 * ct_convert_to_f32: that one opens a parallel region (idle here, inside the
 * GEMM's) per call, which cost more than the widening on short rows. */
static void widen_bf16(float *dst, const uint16_t *s, long n) {
    for (long i = 0; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

void gemm_pack_b_h_strided(float *dst, gemm_view b, long kc, long n, int nr) {
    long np = (n + nr - 1) / nr;
    for (long p = 0; p < np; p++)
        for (long k = 0; k < kc; k++)
            for (int j = 0; j < nr; j++) {
                uint32_t u = p * nr + j < n ? (uint32_t)b.h[k * b.rs + (p * nr + j) * b.cs] << 16 : 0;
                memcpy(dst + p * nr * kc + k * nr + j, &u, sizeof u);
            }
}

/* Packs B block b (kc x n): pack_b, or for a bf16 view pack_b_h, or the
 * block widened into ws->wide in b's own orientation (so the widening reads
 * the store sequentially) and then pack_b. Widening bf16 is exact and a
 * rounding packer leaves a bf16 value as it is, so all three pack the bits
 * the arch packs from the fp32 widening of the whole matrix. */
static void pack_b_any(const gemm_arch *ar, const gemm_ws *ws, float *dst, gemm_view b, long kc, long n) {
    if (!b.h) {
        ar->pack_b(dst, b, kc, n);
        return;
    }
    if (ar->pack_b_h) {
        ar->pack_b_h(dst, b, kc, n);
        return;
    }
    float *x = ws->wide;
    gemm_view v = {x, n, 1, NULL};
    if (b.cs == 1) {
        for (long k = 0; k < kc; k++) widen_bf16(x + k * n, b.h + k * b.rs, n);
    } else if (b.rs == 1) {
        for (long j = 0; j < n; j++) widen_bf16(x + j * kc, b.h + j * b.cs, kc);
        v.rs = 1, v.cs = kc;
    } else {
        for (long k = 0; k < kc; k++)
            for (long j = 0; j < n; j++) x[k * n + j] = ct_bf16_to_f32(b.h[k * b.rs + j * b.cs]);
    }
    ar->pack_b(dst, v, kc, n);
}

/* Packed block (outer block index ob, k block starting at pc) of a cached
 * operand, packing it first if this thread has not yet. */
static const float *cached_block(gemm_cache *c, const gemm_job *g, const gemm_ws *ws, long ob, long pc, int is_a,
                                 gemm_view v, long n, long kc) {
    long idx = ob * c->nkb + pc / g->kcb;
    float *dst = c->p + idx * c->slot;
    if (!c->done[idx]) {
        if (is_a) g->ar->pack_a(dst, v, n, kc);
        else pack_b_any(g->ar, ws, dst, v, kc, n);
        c->done[idx] = 1;
    }
    return dst;
}

/* One tile of C: A micro-panel ip of the row block at ic (its rows in place,
 * or the packed panel in Ap) times B micro-panel jp of the packed column block
 * Bp at jc, over the k block at pc (kc deep, kd lanes a packed panel); edge
 * tiles clipped to i1 and j1. */
static inline void gemm_tile(const gemm_job *g, const float *Ap, const float *Bp, long pc, long kc, long kd, long ic,
                             long ip, long i1, long jc, long jp, long j1, int add) {
    const gemm_arch *ar = g->ar;
    long r0 = ic + ip * ar->mr, c0 = jc + jp * ar->nr;
    int mr = (int)(i1 - r0 < ar->mr ? i1 - r0 : ar->mr), nr = (int)(j1 - c0 < ar->nr ? j1 - c0 : ar->nr);
    const float *bp = Bp + jp * ar->nr * kd;
    float *cp = g->C + r0 * g->ldc + c0;
    if (g->a_rm) ar->ukernel_rm(kc, g->A.p + r0 * g->A.rs + pc, g->A.rs, bp, cp, g->ldc, mr, nr, add);
    else ar->ukernel(kc, Ap + ip * ar->mrs * kd, bp, cp, g->ldc, mr, nr, add);
}

/* C[i0:i1, j0:j1] of the job, serially, in blocks of ws->mc rows and ws->nc
 * columns. A cached A needs i0 == 0 (its row blocks are numbered from row 0),
 * a cached B j0 == 0. */
static void gemm_rect(const gemm_job *g, gemm_ws *ws, long i0, long i1, long j0, long j1) {
    const gemm_arch *ar = g->ar;
    const long MR = ar->mr, NR = ar->nr;
    const gemm_view A = g->A, B = g->B;
    const long K = g->K, kcb = g->kcb, mc = ws->mc, nc = ws->nc;
    if (i1 <= i0 || j1 <= j0) return;
    long chunk = ar->ncb / NR > 0 ? ar->ncb / NR : 1;
    for (long jc = j0; jc < j1; jc += nc) {
        long ncur = j1 - jc < nc ? j1 - jc : nc;
        long nt = ceil_div(ncur, NR);
        for (long pc = 0; pc < K; pc += kcb) {
            long kc = K - pc < kcb ? K - pc : kcb;
            long kd = panel_depth(ar, kc); /* depth of a packed panel in 32-bit lanes */
            long boff = pc * B.rs + jc * B.cs;
            gemm_view b = {B.h ? NULL : B.p + boff, B.rs, B.cs, B.h ? B.h + boff : NULL};
            const float *Bp = ws->Bp;
            if (ws->cb) Bp = cached_block(ws->cb, g, ws, jc / nc, pc, 0, b, ncur, kc);
            else pack_b_any(ar, ws, ws->Bp, b, kc, ncur);
            int add = g->accumulate || pc > 0;
            for (long ic = i0; ic < i1; ic += mc) {
                long mcur = i1 - ic < mc ? i1 - ic : mc;
                long mt = ceil_div(mcur, MR);
                gemm_view a = {A.p + ic * A.rs + pc * A.cs, A.rs, A.cs, NULL};
                const float *Ap = ws->Ap;
                if (g->a_rm) Ap = NULL;
                else if (ws->ca) Ap = cached_block(ws->ca, g, ws, ic / mc, pc, 1, a, mcur, kc);
                else ar->pack_a(ws->Ap, a, mcur, kc);
                if (g->a_rm && ar->mcb >= MR && nt > chunk) {
                    /* B-stationary: for each block of mcb rows, each B micro-panel
                     * (kc x NR, in L1) meets the block's A micro-panels (its rows in
                     * place, mcb x kc in L2) in turn. The order below streams the
                     * ncb-column B chunk from L2 for every A micro-panel: 16 KB per
                     * 6 x 16 tile at kc 256 against 6 KB here, and on the AMX Xeon's
                     * cores at AVX2 the K = 256 forwards (N 1024-3072) ran 5-7%
                     * faster this way (docs/benchmarks.md). Each tile's sum is the
                     * same, in the same k order: the same bits. */
                    long pb = ar->mcb / MR;
                    for (long is = 0; is < mt; is += pb) {
                        long ie = is + pb < mt ? is + pb : mt;
                        for (long jp = 0; jp < nt; jp++)
                            for (long ip = is; ip < ie; ip++) gemm_tile(g, Ap, Bp, pc, kc, kd, ic, ip, i1, jc, jp, j1, add);
                    }
                    continue;
                }
                for (long jb = 0; jb < nt; jb += chunk) {
                    long jb1 = jb + chunk < nt ? jb + chunk : nt;
                    for (long ip = 0; ip < mt; ip++)
                        for (long jp = jb; jp < jb1; jp++) gemm_tile(g, Ap, Bp, pc, kc, kd, ic, ip, i1, jc, jp, j1, add);
                }
            }
        }
    }
}

/* Rows x columns of threads (tr * tc = T) over an mt x nt grid of micro-tiles:
 * minimises the busiest thread's multiply-adds plus the packing it repeats,
 * both per unit of K: compute ~ rows*cols/16 (cycles at 32 flops/cycle, 2
 * flops per multiply-add), packing ~ 1 cycle per float packed (A once per
 * column block it meets, B once per row block). */
static int choose_row_threads(const gemm_arch *ar, long M, long N, int T, int a_rm) {
    long mt = ceil_div(M, ar->mr), nt = ceil_div(N, ar->nr);
    int best = 1;
    double best_cost = -1;
    for (int tr = 1; tr <= T; tr++) {
        if (T % tr) continue;
        int tc = T / tr;
        if (tr > mt || tc > nt) continue;
        double rows = (double)ceil_div(mt, tr) * ar->mr, cols = (double)ceil_div(nt, tc) * ar->nr;
        double cost = rows * cols / 16 + (a_rm ? 0 : rows * ceil_div((long)cols, ar->nc)) +
                      cols * ceil_div((long)rows, ar->mc);
        if (best_cost < 0 || cost < best_cost) {
            best_cost = cost;
            best = tr;
        }
    }
    return best;
}

/* Units per thread of a one-dimensional split: enough that a held-up thread
 * leaves most of its share to the others (2 and 8 measured within noise of 4
 * under interference), few enough that a unit still walks several B
 * micro-panels per A micro-panel. */
#define GEMM_UNITS_PER_THREAD 4
/* The most floats the threads' caches of the shared operand may hold
 * together (32 MB); larger operands are split one unit per thread. */
#define GEMM_CACHE_MAX_FLOATS (8L << 20)

/* How one call splits C: ur x uc units over the mt x nt micro-tiles, blocks of
 * mcu x ncu in a unit, and the cached operand if any (slot_a / slot_b > 0:
 * floats per cached block of A / B, whose blocks are mcs rows / ncs columns). */
typedef struct {
    long ur, uc, mt, nt, nkb, kdb, mcs, ncs, mcu, ncu, slot_a, slot_b;
} gemm_split;

/* A thread's cache of blocks blocks x nkb k blocks of slot floats each. */
static void cache_alloc(gemm_cache *c, long blocks, long nkb, long slot) {
    c->slot = slot, c->nkb = nkb;
    c->p = gemm_alloc((size_t)(blocks * nkb * slot));
    c->done = calloc((size_t)(blocks * nkb), 1);
    if (!c->done) {
        fprintf(stderr, "ctitan: error: out of memory allocating GEMM workspace\n");
        exit(1);
    }
}

/* One thread's part of the call: its buffers, then, in the team of gemm_f32's
 * region (team = 1), units taken as threads come free, so a thread that other
 * processes hold up leaves its remaining units to the others; alone (team = 0,
 * maybe inside someone else's region, whose team must not share this loop),
 * the one unit, all of C. */
static void gemm_thread(const gemm_job *g, const gemm_split *sp, int team) {
    const gemm_arch *ar = g->ar;
    gemm_ws ws = {.mc = sp->mcu, .nc = sp->ncu};
    gemm_cache ca = {0}, cb = {0};
    if (sp->slot_a) cache_alloc(&ca, ceil_div(g->M, sp->mcs), sp->nkb, sp->slot_a), ws.ca = &ca;
    else if (!g->a_rm) ws.Ap = gemm_alloc((size_t)ceil_div(sp->mcu, ar->mr) * ar->mrs * sp->kdb);
    if (sp->slot_b) cache_alloc(&cb, ceil_div(g->N, sp->ncs), sp->nkb, sp->slot_b), ws.cb = &cb;
    else ws.Bp = gemm_alloc((size_t)ceil_div(sp->ncu, ar->nr) * ar->nr * sp->kdb);
    if (g->B.h && !ar->pack_b_h) {
        /* a B block is at most kcb deep and as wide as a unit's block, or a cached block */
        long wn = sp->slot_b ? sp->ncs : sp->ncu;
        ws.wide = gemm_alloc((size_t)(g->kcb * wn));
    }
    if (ar->thread_begin) ar->thread_begin();
    long nunits = sp->ur * sp->uc;
    if (!team) {
        gemm_rect(g, &ws, 0, g->M, 0, g->N);
    } else {
#pragma omp for schedule(dynamic, 1) nowait
        for (long u = 0; u < nunits; u++) {
            long ip0, ip1, jp0, jp1;
            split_range(sp->mt, (int)sp->ur, (int)(u / sp->uc), &ip0, &ip1);
            split_range(sp->nt, (int)sp->uc, (int)(u % sp->uc), &jp0, &jp1);
            long i1 = ip1 * ar->mr < g->M ? ip1 * ar->mr : g->M, j1 = jp1 * ar->nr < g->N ? jp1 * ar->nr : g->N;
            gemm_rect(g, &ws, ip0 * ar->mr, i1, jp0 * ar->nr, j1);
        }
    }
    if (ar->thread_end) ar->thread_end();
    free(ca.p);
    free(ca.done);
    free(cb.p);
    free(cb.done);
    free(ws.Ap);
    free(ws.Bp);
    free(ws.wide);
}

void gemm_f32(const gemm_arch *ar, int M, int N, int K, gemm_view A, gemm_view B, float *C, long ldc,
              int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (A.h) {
        /* no caller has a bf16 A (kern_cpu.h, gemm_view); refuse rather than read p */
        fprintf(stderr, "ctitan: error: gemm_f32 was given a bf16 A operand\n");
        abort();
    }
    if (K <= 0) {
        /* an empty sum: C = 0 or C unchanged */
        if (!accumulate)
            for (int i = 0; i < M; i++) memset(C + (size_t)i * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    /* k blocks of near-equal size: a function of K alone (determinism) */
    long nkb = ceil_div(K, ar->kc);
    gemm_job g = {.ar = ar, .M = M, .N = N, .K = K, .accumulate = accumulate, .A = A, .B = B, .C = C, .ldc = ldc};
    g.a_rm = ar->ukernel_rm && A.cs == 1;
    g.kcb = ceil_div(K, nkb);
    if (ar->kalign > 1) {
        /* whole tile rows of k in every block but the last (still a function of K alone) */
        long unit = (long)ar->kalign * (ar->kpack > 1 ? ar->kpack : 1);
        g.kcb = ceil_div(g.kcb, unit) * unit;
    }
    nkb = ceil_div(K, g.kcb);
    long kdb = panel_depth(ar, g.kcb);

    double flops = 2.0 * M * (double)N * K;
    long mt = ceil_div(M, ar->mr), nt = ceil_div(N, ar->nr);
    int T = omp_get_max_threads();
    if (flops < GEMM_SERIAL_FLOPS || omp_in_parallel()) T = 1;
    if (T > mt * nt) T = (int)(mt * nt);
    gemm_split sp = {.ur = 1, .uc = 1, .mt = mt, .nt = nt, .nkb = nkb, .kdb = kdb};
    sp.mcs = balanced_block(M, ar->mc, ar->mr), sp.ncs = balanced_block(N, ar->nc, ar->nr);
    if (T <= 1) {
        sp.mcu = sp.mcs, sp.ncu = sp.ncs;
        gemm_thread(&g, &sp, 0); /* no parallel region for small products */
        return;
    }
    int tr = choose_row_threads(ar, M, N, T, g.a_rm), tc = T / tr;
    /* units: ur x uc rectangles of C; by default one per thread */
    sp.ur = tr, sp.uc = tc;
    long slot_a = ceil_div(sp.mcs, ar->mr) * ar->mrs * kdb, slot_b = ceil_div(sp.ncs, ar->nr) * ar->nr * kdb;
    if (tr == 1 && (g.a_rm || ceil_div(M, sp.mcs) * nkb * slot_a * T <= GEMM_CACHE_MAX_FLOATS)) {
        sp.uc = nt < (long)T * GEMM_UNITS_PER_THREAD ? nt : (long)T * GEMM_UNITS_PER_THREAD;
        if (!g.a_rm) sp.slot_a = slot_a; /* an A read in place needs no copy */
    } else if (tc == 1 && ceil_div(N, sp.ncs) * nkb * slot_b * T <= GEMM_CACHE_MAX_FLOATS) {
        sp.ur = mt < (long)T * GEMM_UNITS_PER_THREAD ? mt : (long)T * GEMM_UNITS_PER_THREAD;
        sp.slot_b = slot_b;
    }
    /* block sizes: the shared dimension's of the whole matrix (cached blocks are
     * numbered from 0), the split one's of the largest unit */
    sp.mcu = sp.ur == 1 ? sp.mcs : balanced_block(ceil_div(mt, sp.ur) * ar->mr, ar->mc, ar->mr);
    sp.ncu = sp.uc == 1 ? sp.ncs : balanced_block(ceil_div(nt, sp.uc) * ar->nr, ar->nc, ar->nr);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel num_threads(T)
    {
        KERN_TRACE_ENTER(kt_);
        gemm_thread(&g, &sp, 1);
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
