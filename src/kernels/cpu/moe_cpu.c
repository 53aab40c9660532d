/* kernels/cpu/moe_cpu.c: the grouped experts of a MoE layer on gemm_f32.
 *
 * The op_moe_experts_* contract (kernels/ops.h) computed as GEMMs on rows
 * permuted by expert: the router's metadata (perm, offsets) says which rows
 * of the gathered matrix belong to which expert, so each projection is one
 * grouped GEMM, a gemm_f32 call per non-empty expert segment on contiguous
 * rows, with the expert's weight matrix read in place (no copies: the views
 * of matmul_cpu.c). Three forms occur:
 *   NT  C[seg] (+)= A[seg] . W_e^T     forward projections
 *   NN  C[seg] (+)= A[seg] . W_e       backward to the inputs
 *   TN  C_e    +=   A[seg]^T . B[seg]  weight gradients
 * Each grouped GEMM is one parallel region over pieces of the segments
 * (grouped_gemm below); an output element is summed by one serial GEMM in a
 * fixed order: bit-identical for any thread count.
 *
 * Memory: the gathered tokens and the expert outputs are [N*k, H], never
 * [N, E, H]; gate/up/h [N*k, I] are the caller's saved activations. The
 * combine (un-permute and weight) sums each token's k rows in choice order.
 * The backward reuses the forward's perm/pos/offsets and gate/up/h, and gets
 * d(topw) as (wd_e^T dout) . h, so the expert outputs need not be kept.
 *
 * bf16 (moe_experts_bf16, end of file): the same code on matmul_bf16's
 * gemm_archs, whose packers round both factors to bf16; nothing else changes.
 *
 * Frozen weights stored in bf16 (the *_wbf16 entries, ops.h): the NT and NN
 * products take the expert's weight as a bf16 B view (gemm_view.h), which
 * the GEMM packs straight from the store (pack_b_h: AMX, vdpbf16ps) or
 * widens block by block in the piece's own thread before packing (the
 * others); both pack the bits the fp32 widening would, so the results are
 * those of the fp32 entries on the widened weights, and no fp32 copy of a
 * whole weight is ever made. The TN products (weight gradients) never read
 * the weights. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include "kernels/cpu/avx2_util.h" /* x86-64 only (avx512_util.h guards itself) */
#endif
#include "kernels/cpu/avx512_util.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/cpu/neon_util.h"
#include "kernels/ops.h"

enum { MOE_NT, MOE_NN, MOE_TN };

/* Smallest piece of a grouped GEMM handed to a thread (packing and loop
 * overheads stay small next to it). */
#define MOE_PIECE_MIN_FLOPS 4.0e6

/* One expert's GEMM of the given form on rows [p0, p0 + M) of the permuted
 * operands, restricted to output rows [n0, n1) of W_e (NT) or of C_e (TN):
 *   NT: C[M, n0:n1] (+)= A[M,K] W_e[n0:n1, K]^T    NN: C[M,K] (+)= A[M,N] W_e[N,K]
 *   TN: C_e[n0:n1, K] += A[M, n0:n1]^T B[M,K]  (B passed as W, C indexed per expert) */
static void expert_gemm(const gemm_arch *ar, int form, int e, long p0, int M, int N, int K, int n0, int n1,
                        const float *A, const float *W, const uint16_t *Wh, float *C, int accumulate) {
    if (form == MOE_NT) {
        size_t wo = ((size_t)e * N + n0) * K;
        gemm_view a = {A + p0 * K, K, 1, NULL}, b = {Wh ? NULL : W + wo, 1, K, Wh ? Wh + wo : NULL};
        gemm_f32(ar, M, n1 - n0, K, a, b, C + p0 * N + n0, N, accumulate);
    } else if (form == MOE_NN) {
        size_t wo = (size_t)e * N * K;
        gemm_view a = {A + p0 * N, N, 1, NULL}, b = {Wh ? NULL : W + wo, K, 1, Wh ? Wh + wo : NULL};
        gemm_f32(ar, M, K, N, a, b, C + p0 * K, K, accumulate);
    } else {
        gemm_view a = {A + p0 * N + n0, 1, N, NULL}, b = {W + p0 * K, K, 1, NULL};
        gemm_f32(ar, n1 - n0, K, M, a, b, C + ((size_t)e * N + n0) * K, K, 1);
    }
}

/* A piece of a grouped GEMM: job j, expert e, permuted rows [p0, p0 + M), output rows [n0, n1). */
typedef struct {
    int j, e, M, n0, n1;
    long p0;
} moe_item;

/* One projection's operands (see expert_gemm); Wh: W in bf16 (NT, NN only), read instead of W. */
typedef struct {
    const float *A, *W;
    float *C;
    int accumulate;
    const uint16_t *Wh;
} moe_job;

/* The grouped GEMM: every non-empty expert segment of offsets[E+1], in one
 * parallel region. Each segment is cut into pieces with disjoint outputs
 * (row blocks of the segment for NT/NN; blocks of the weight gradient's
 * rows for TN, whose sum over the segment's rows must stay in one GEMM) of
 * about total / (8 threads) flops, and threads take pieces dynamically, each
 * a serial gemm_f32: many short parallel regions (one per expert) wait on
 * every descheduled thread, measured 4x slower on a shared 2-core machine.
 * The cut depends on the shapes only, and a piece's elements are summed by
 * one GEMM in K-only blocking: bit-identical for any thread count. */
static void grouped_gemm(const gemm_arch *ar, int form, const int32_t *offsets, int E, int N, int K,
                         const moe_job *jobs, int njobs, int chain) {
    long S = offsets[E];
    if (S <= 0) return;
    int T = omp_get_max_threads(), nj = chain ? 1 : njobs; /* chain: every piece runs all jobs, in order */
    double total = 2.0 * (double)S * N * K * njobs, piece = total / (8.0 * (T > 0 ? T : 1));
    if (piece < MOE_PIECE_MIN_FLOPS) piece = MOE_PIECE_MIN_FLOPS;
    int rows = (int)(piece / (2.0 * N * K * (chain ? njobs : 1))); /* NT/NN: segment rows per piece; TN: weight rows */
    rows = rows < 32 ? 32 : (rows + 31) / 32 * 32;
    long cap = 0;
    for (int e = 0; e < E; e++) {
        long M = offsets[e + 1] - offsets[e];
        if (M > 0) cap += form == MOE_TN ? (N + rows - 1) / rows : (M + rows - 1) / rows;
    }
    cap *= nj;
    moe_item *it = malloc((size_t)cap * sizeof *it);
    if (!it) {
        fprintf(stderr, "ctitan: error: out of memory in the grouped MoE GEMM\n");
        exit(1);
    }
    long n = 0;
    for (int e = 0; e < E; e++) {
        int M = offsets[e + 1] - offsets[e];
        if (M <= 0) continue;
        for (int j = 0; j < nj; j++) {
            if (form == MOE_TN) {
                for (int n0 = 0; n0 < N; n0 += rows)
                    it[n++] = (moe_item){j, e, M, n0, n0 + rows < N ? n0 + rows : N, offsets[e]};
            } else {
                for (int r = 0; r < M; r += rows)
                    it[n++] = (moe_item){j, e, M - r < rows ? M - r : rows, 0, N, (long)offsets[e] + r};
            }
        }
    }
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel if (n > 1 && !omp_in_parallel())
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(dynamic, 1) nowait
        for (long i = 0; i < n; i++) {
            for (int j = chain ? 0 : it[i].j; j < (chain ? njobs : it[i].j + 1); j++) {
                const moe_job *jb = &jobs[j];
                expert_gemm(ar, form, it[i].e, it[i].p0, it[i].M, N, K, it[i].n0, it[i].n1, jb->A, jb->W, jb->Wh,
                            jb->C, jb->accumulate);
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
    free(it);
}

/* dst[p,:] = src[perm[p] / k, :] for the S permuted rows of width C. */
static void gather(float *dst, const float *src, const int32_t *perm, long S, int k, int C) {
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long p = 0; p < S; p++) memcpy(dst + p * C, src + (size_t)(perm[p] / k) * C, (size_t)C * sizeof(float));
        KERN_TRACE_EXIT(kt_);
    }
}

static void moe_fwd(const gemm_arch *ar, float *out, float *gate, float *up, float *h, float *work, const float *x,
                    const float *wg, const float *wu, const float *wd, const uint16_t *hg, const uint16_t *hu,
                    const uint16_t *hd, const int32_t *perm, const int32_t *pos, const int32_t *offsets,
                    const float *topw, int N, int H, int I, int E, int k) {
    long S = (long)N * k;
    float *xg = work; /* [S, H] tokens in expert order, then the expert outputs */
    gather(xg, x, perm, S, k, H);
    moe_job gu[2] = {{xg, wg, gate, 0, hg}, {xg, wu, up, 0, hu}};
    grouped_gemm(ar, MOE_NT, offsets, E, I, H, gu, 2, 0);
    op_swiglu_fwd(h, gate, up, (int)(S * I));
    if (!out) return;
    float *y = work; /* [S, H] */
    moe_job dn = {h, wd, y, 0, hd};
    grouped_gemm(ar, MOE_NT, offsets, E, H, I, &dn, 1, 0);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int t = 0; t < N; t++) {
            float *o = out + (size_t)t * H;
            for (int j = 0; j < k; j++) {
                long s = (long)t * k + j;
                const float *yr = y + (size_t)pos[s] * H;
                float w = topw[s];
                for (int c = 0; c < H; c++) o[c] += w * yr[c];
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* The SwiGLU backward of one permuted row, scaled by its routing weight w:
 * on entry dg[I] = wd_e^T dout; on return dg = d gate, du[I] = d up. */
typedef void (*moe_dact_fn)(float *dg, float *du, const float *gate, const float *up, float w, int I);

#if defined(__x86_64__)
/* The avx2 experts' (ymm, avx2_util.h's exp8): the scalar loop with libm's expf
 * it replaces was ~1.5% of a debugmodel_moe step on the AVX2 path (perf). */
T256 static void dact_avx2(float *dg, float *du, const float *gate, const float *up, float w, int I) {
    const __m256 one = _mm256_set1_ps(1.0f), wv = _mm256_set1_ps(w), zero = _mm256_setzero_ps();
    for (int i = 0; i < I; i += 8) {
        long n = I - i;
        __m256 g = avx2_loadn(gate + i, n), u = avx2_loadn(up + i, n);
        __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        __m256 d = _mm256_mul_ps(wv, avx2_loadn(dg + i, n));
        __m256 ds = _mm256_add_ps(one, _mm256_mul_ps(g, _mm256_sub_ps(one, sig)));
        avx2_storen(dg + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d, u), sig), ds), n);
        avx2_storen(du + i, _mm256_mul_ps(_mm256_mul_ps(d, g), sig), n);
    }
}
#endif

#if defined(__x86_64__)
/* The same in zmm registers (e^-g from the AVX-512 kernels' vector exp): the
 * scalar loop, libm's expf and its divisions were ~11% of the single-thread
 * backward on the debugmodel_moe layer (perf). */
T512 static void dact_avx512(float *dg, float *du, const float *gate, const float *up, float w, int I) {
    for (int i = 0; i < I; i++) du[i] = -gate[i];
    kern_exp_avx512(du, du, I);
    const __m512 one = _mm512_set1_ps(1.0f), wv = _mm512_set1_ps(w);
    for (int i = 0; i < I; i += 16) {
        long n = I - i;
        __m512 g = avx512_loadn(gate + i, n), u = avx512_loadn(up + i, n);
        __m512 sig = avx512_div(one, _mm512_add_ps(one, avx512_loadn(du + i, n)));
        __m512 d = _mm512_mul_ps(wv, avx512_loadn(dg + i, n));
        __m512 ds = _mm512_add_ps(one, _mm512_mul_ps(g, _mm512_sub_ps(one, sig)));
        avx512_storen(dg + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(d, u), sig), ds), n);
        avx512_storen(du + i, _mm512_mul_ps(_mm512_mul_ps(d, g), sig), n);
    }
}
#elif defined(__aarch64__)
/* The same with NEON (neon_util.h's vector exp). */
static void dact_neon(float *dg, float *du, const float *gate, const float *up, float w, int I) {
    const float32x4_t one = vdupq_n_f32(1.0f), wv = vdupq_n_f32(w);
    for (int i = 0; i < I; i += 4) {
        long n = I - i;
        float32x4_t g = neon_loadn(gate + i, n), u = neon_loadn(up + i, n);
        float32x4_t sig = vdivq_f32(one, vaddq_f32(one, neon_exp4(vnegq_f32(g))));
        float32x4_t d = vmulq_f32(wv, neon_loadn(dg + i, n));
        float32x4_t ds = vaddq_f32(one, vmulq_f32(g, vsubq_f32(one, sig)));
        neon_storen(dg + i, vmulq_f32(vmulq_f32(vmulq_f32(d, u), sig), ds), n);
        neon_storen(du + i, vmulq_f32(vmulq_f32(d, g), sig), n);
    }
}
#endif

/* The experts' weight gradients from G[S, H] = w * dout in expert order (then
 * overwritten with the gathered x), h and d gate / d up [S, I]: the grouped TN
 * GEMMs both the fused backward (moe_bwd) and a split one's W (moe_bwd_w) run,
 * so the two give each element the same sum. NULL: frozen, skipped. */
static void moe_dw(const gemm_arch *ar, float *dwg, float *dwu, float *dwd, float *G, const float *x, const float *h,
                   const float *dgate, const float *dup, const int32_t *perm, const int32_t *offsets, long S, int k,
                   int H, int I, int E) {
    moe_job dd = {G, h, dwd, 1, NULL};
    if (dwd) grouped_gemm(ar, MOE_TN, offsets, E, H, I, &dd, 1, 0);
    if (!dwg && !dwu) return;
    gather(G, x, perm, S, k, H);
    moe_job dgu[2] = {{dgate, G, dwg, 1, NULL}, {dup, G, dwu, 1, NULL}};
    if (dwg && dwu) grouped_gemm(ar, MOE_TN, offsets, E, I, H, dgu, 2, 0);
    else grouped_gemm(ar, MOE_TN, offsets, E, I, H, dwg ? &dgu[0] : &dgu[1], 1, 0);
}

static void moe_bwd(const gemm_arch *ar, moe_dact_fn dact, float *dx, float *dwg, float *dwu, float *dwd,
                    float *dtopw, float *work, const float *dout, const float *x, const float *wg, const float *wu,
                    const float *wd, const uint16_t *hg, const uint16_t *hu, const uint16_t *hd, const float *gate,
                    const float *up, const float *h, const int32_t *perm, const int32_t *pos, const int32_t *offsets,
                    const float *topw, int N, int H, int I, int E, int k) {
    long S = (long)N * k;
    float *Pm = KERN_MOE_DGATE(work, S, I); /* [S, I] wd_e^T dout, then d gate (left there: ops.h) */
    float *du = KERN_MOE_DUP(work, S, I);   /* [S, I] d up (left there too) */
    float *G = du + (size_t)S * I;         /* [S, H] dout in expert order, then w * dout, then the gathered x */
    float *dxg = G + (size_t)S * H;         /* [S, H] d x in expert order */
    gather(G, dout, perm, S, k, H);
    moe_job job = {G, wd, Pm, 0, hd};
    grouped_gemm(ar, MOE_NN, offsets, E, H, I, &job, 1, 0);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long p = 0; p < S; p++) {
            long s = perm[p];
            float w = topw[s];
            float *pr = Pm + (size_t)p * I, *dur = du + (size_t)p * I, *gr = G + (size_t)p * H;
            const float *hr = h + (size_t)p * I, *gt = gate + (size_t)p * I, *ur = up + (size_t)p * I;
            float dw = 0;
            for (int i = 0; i < I; i++) dw += pr[i] * hr[i];
            dtopw[s] = dw;
            dact(pr, dur, gt, ur, w, I);
            for (int c = 0; c < H; c++) gr[c] *= w;
        }
        KERN_TRACE_EXIT(kt_);
    }
    moe_dw(ar, dwg, dwu, dwd, G, x, h, Pm, du, perm, offsets, S, k, H, I, E);
    moe_job dx2[2] = {{Pm, wg, dxg, 0, hg}, {du, wu, dxg, 1, hu}}; /* the same rows: one piece runs both, in order */
    grouped_gemm(ar, MOE_NN, offsets, E, I, H, dx2, 2, 1);
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int t = 0; t < N; t++) {
            float *d = dx + (size_t)t * H;
            for (int j = 0; j < k; j++) {
                const float *r = dxg + (size_t)pos[(long)t * k + j] * H;
                for (int c = 0; c < H; c++) d[c] += r[c];
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* G[S, H] = w * dout in expert order: moe_bwd's d(output) of the down projection */
static void gather_scaled(float *G, const float *dout, const int32_t *perm, const float *topw, long S, int k, int H) {
    gather(G, dout, perm, S, k, H);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long p = 0; p < S; p++) {
            float w = topw[perm[p]], *gr = G + (size_t)p * H;
            for (int c = 0; c < H; c++) gr[c] *= w; /* the product moe_bwd forms: the same bits */
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* moe_bwd's weight gradients alone (op_moe_experts_bwd_w), from the d gate /
 * d up it left: its operands rebuilt with the same gathers and products and
 * its grouped TN GEMMs with the same jobs, so each element is the same GEMM's
 * sum over the same rows, in the same order. */
static void moe_bwd_w(const gemm_arch *ar, float *dwg, float *dwu, float *dwd, float *work, const float *dout,
                      const float *x, const float *h, const float *dgate, const float *dup, const int32_t *perm,
                      const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    long S = (long)N * k;
    float *G = work; /* [S, H] w * dout in expert order, then the gathered x */
    if (dwd) gather_scaled(G, dout, perm, topw, S, k, H);
    moe_dw(ar, dwg, dwu, dwd, G, x, h, dgate, dup, perm, offsets, S, k, H, I, E);
}

/* The five entries of one implementation on arch expression AR (evaluated
 * in each, as a gemm_arch value) with SwiGLU backward DACT: fwd / bwd of the
 * op, their wbf16 forms (ops.h), which only pass the bf16 views on, and the
 * split backward's weight gradients (bwd_w). */
#define MOE_ENTRIES(SUF, AR, DACT)                                                                                     \
    void kern_moe_fwd_##SUF(float *out, float *gate, float *up, float *h, float *work, const float *x,                 \
                            const float *wg, const float *wu, const float *wd, const int32_t *perm,                    \
                            const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int I,        \
                            int E, int k) {                                                                            \
        gemm_arch ar = AR;                                                                                             \
        moe_fwd(&ar, out, gate, up, h, work, x, wg, wu, wd, NULL, NULL, NULL, perm, pos, offsets, topw, N, H, I, E,   \
                k);                                                                                                    \
    }                                                                                                                  \
    void kern_moe_bwd_##SUF(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,                  \
                            const float *dout, const float *x, const float *wg, const float *wu, const float *wd,      \
                            const float *gate, const float *up, const float *h, const int32_t *perm,                   \
                            const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int I,        \
                            int E, int k) {                                                                            \
        gemm_arch ar = AR;                                                                                             \
        moe_bwd(&ar, DACT, dx, dwg, dwu, dwd, dtopw, work, dout, x, wg, wu, wd, NULL, NULL, NULL, gate, up, h, perm,   \
                pos, offsets, topw, N, H, I, E, k);                                                                    \
    }                                                                                                                  \
    void kern_moe_fwd_wbf16_##SUF(float *out, float *gate, float *up, float *h, float *work, const float *x,           \
                                  const float *wg, const float *wu, const float *wd, const uint16_t *hg,               \
                                  const uint16_t *hu, const uint16_t *hd, const int32_t *perm, const int32_t *pos,     \
                                  const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {      \
        gemm_arch ar = AR;                                                                                             \
        moe_fwd(&ar, out, gate, up, h, work, x, wg, wu, wd, hg, hu, hd, perm, pos, offsets, topw, N, H, I, E, k);      \
    }                                                                                                                  \
    void kern_moe_bwd_wbf16_##SUF(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,            \
                                  const float *dout, const float *x, const float *wg, const float *wu,                 \
                                  const float *wd, const uint16_t *hg, const uint16_t *hu, const uint16_t *hd,         \
                                  const float *gate, const float *up, const float *h, const int32_t *perm,             \
                                  const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int I,  \
                                  int E, int k) {                                                                      \
        gemm_arch ar = AR;                                                                                             \
        moe_bwd(&ar, DACT, dx, dwg, dwu, dwd, dtopw, work, dout, x, wg, wu, wd, hg, hu, hd, gate, up, h, perm, pos,    \
                offsets, topw, N, H, I, E, k);                                                                         \
    }                                                                                                                  \
    void kern_moe_bwd_w_##SUF(float *dwg, float *dwu, float *dwd, float *work, const float *dout, const float *x,      \
                              const float *h, const float *dgate, const float *dup, const int32_t *perm,               \
                              const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {          \
        gemm_arch ar = AR;                                                                                             \
        moe_bwd_w(&ar, dwg, dwu, dwd, work, dout, x, h, dgate, dup, perm, offsets, topw, N, H, I, E, k);               \
    }

#if defined(__x86_64__)
MOE_ENTRIES(avx512, gemm_arch_avx512, dact_avx512)
MOE_ENTRIES(avx2, gemm_arch_avx2, dact_avx2)
#elif defined(__aarch64__)
MOE_ENTRIES(neon, gemm_arch_neon, dact_neon)
#endif

/* moe_experts_bf16: the same grouped GEMMs on matmul_bf16's architectures,
 * whose packers round both factors to bf16 (the sums stay fp32), so every
 * expert projection, forward and both backward products, is a bf16 linear
 * exactly as the dense ones; the elementwise parts are unchanged. */
#if defined(__x86_64__)
static gemm_arch bf16_arch(const gemm_arch *base) {
    /* the bf16-pair archs (vdpbf16ps, AMX) round in their own packers */
    return base == &gemm_arch_avx512bf16 || base == &gemm_arch_amx ? *base : gemm_arch_rounding_bf16(base);
}
#elif defined(__aarch64__)
static gemm_arch bf16_arch(const gemm_arch *base) {
    return base == &gemm_arch_bfmmla ? *base : gemm_arch_rounding_bf16(base);
}
#endif
#if defined(__x86_64__)
MOE_ENTRIES(bf16_amx, bf16_arch(&gemm_arch_amx), dact_avx512)
MOE_ENTRIES(bf16_avx512bf16, bf16_arch(&gemm_arch_avx512bf16), dact_avx512)
MOE_ENTRIES(bf16_avx512, bf16_arch(&gemm_arch_avx512), dact_avx512)
MOE_ENTRIES(bf16_avx2, bf16_arch(&gemm_arch_avx2), dact_avx2)
#elif defined(__aarch64__)
MOE_ENTRIES(bf16_bfmmla, bf16_arch(&gemm_arch_bfmmla), dact_neon)
MOE_ENTRIES(bf16_neon, bf16_arch(&gemm_arch_neon), dact_neon)
#endif
