/* kernels/ref/attention_blk.c: the block form of attention (ops.h, kern_attn_blk),
 * one query row at a time like the offset form's reference (ops_ref.c), for ring
 * attention: a chunk's query rows meet the sequence's keys a block at a time as
 * the blocks travel round the context-parallel ring (distributed/cp.c).
 *
 * The forward cannot finish a row's softmax inside one block, so it keeps the
 * online-softmax state of flash attention per row: the running max m, the sum l
 * of exp(s - m) and the unnormalised output acc = sum exp(s - m) v. A block with
 * a larger max rescales what is there by exp(m_old - m_new) (exactly 1 when the
 * max does not move, 0 before any key), so the order the blocks arrive in only
 * changes rounding. The backward needs no state: with the finished row's lse and
 * D = dout . out, p = exp(s - lse) is each key's final probability, and each
 * block's share of dq, dk, dv is the offset form's expression for its keys.
 * The masks are by position: a row at position t sees key position p when
 * p <= t and, with a window, p > t - window; the soft cap is applied to the
 * scaled score and differentiated as 1 - tanh^2, as in ops_ref.c. */
#include <math.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/ops.h"
#include "kernels/ref/attention_bwd_elem.h"

/* The block's keys query position t sees: [*lo, *hi] (as indices into the block); 0 when none. */
static int attn_blk_span(const kern_attn_blk *g, int t, int window, int *lo, int *hi) {
    int a = kern_attn_first_key(t, window) - g->k0, b = t - g->k0;
    if (a < 0) a = 0;
    if (b > g->Tk - 1) b = g->Tk - 1;
    *lo = a, *hi = b;
    return a <= b;
}

void op_attention_fwd_blk(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                          const kern_attn_blk *g, const kern_attn_opt *opt) {
    int B = g->B, nh = g->nh, nkv = g->nkv, hd = g->hd, Tq = g->Tq, group = nh / nkv;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        float *p = ct_malloc((size_t)(g->Tk > 0 ? g->Tk : 1) * sizeof(float)); /* the row's scores in the block */
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < nh; h++)
                for (int r = 0; r < Tq; r++) {
                    int lo, hi, kh = h / group;
                    if (!attn_blk_span(g, g->q0 + r, window, &lo, &hi)) continue;
                    const float *qt = q + (((size_t)b * g->ldq + r) * nh + h) * hd;
                    float mb = -INFINITY;
                    for (int j = lo; j <= hi; j++) {
                        const float *kt = k + (((size_t)b * g->ldk + j) * nkv + kh) * hd;
                        float dot = 0.0f;
                        for (int i = 0; i < hd; i++) dot += qt[i] * kt[i];
                        float sc = dot * scale;
                        if (cap > 0.0f) sc = cap * tanhf(sc / cap);
                        p[j] = sc;
                        if (sc > mb) mb = sc;
                    }
                    size_t row = ((size_t)b * nh + h) * g->ldq + r;
                    float mo = m[row], mn = mo > mb ? mo : mb;
                    float alpha = mo == -INFINITY ? 0.0f : expf(mo - mn), sum = 0.0f;
                    float *at = acc + (((size_t)b * g->ldq + r) * nh + h) * hd;
                    for (int i = 0; i < hd; i++) at[i] *= alpha;
                    for (int j = lo; j <= hi; j++) {
                        float e = expf(p[j] - mn);
                        const float *vt = v + (((size_t)b * g->ldk + j) * nkv + kh) * hd;
                        sum += e;
                        for (int i = 0; i < hd; i++) at[i] += e * vt[i];
                    }
                    l[row] = l[row] * alpha + sum;
                    m[row] = mn;
                }
        free(p);
        KERN_TRACE_EXIT(kt_);
    }
}

void op_attention_blk_finish(float *acc, float *m, const float *l, const kern_attn_blk *g) {
    int nh = g->nh, hd = g->hd;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < g->B; b++)
            for (int h = 0; h < nh; h++)
                for (int r = 0; r < g->Tq; r++) {
                    size_t row = ((size_t)b * nh + h) * g->ldq + r;
                    float *at = acc + (((size_t)b * g->ldq + r) * nh + h) * hd, inv = 1.0f / l[row];
                    for (int i = 0; i < hd; i++) at[i] *= inv;
                    m[row] += logf(l[row]);
                }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_attention_blk_rowdot(float *D, const float *dout, const float *out, const kern_attn_blk *g) {
    int nh = g->nh, hd = g->hd;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < g->B; b++)
            for (int h = 0; h < nh; h++)
                for (int r = 0; r < g->Tq; r++) {
                    size_t at = (((size_t)b * g->ldq + r) * nh + h) * hd;
                    float s = 0.0f;
                    for (int i = 0; i < hd; i++) s += dout[at + i] * out[at + i];
                    D[((size_t)b * nh + h) * g->ldq + r] = s;
                }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_attention_bwd_blk(float *dq, float *dk, float *dv, const float *dout, const float *lse, const float *D,
                          const float *q, const float *k, const float *v, const kern_attn_blk *g,
                          const kern_attn_opt *opt) {
    int B = g->B, nh = g->nh, nkv = g->nkv, hd = g->hd, Tq = g->Tq, group = nh / nkv;
    float scale = kern_attn_scale(opt, hd);
    int window = kern_attn_window(opt);
    float cap = kern_attn_softcap(opt);
    int b16 = kern_attn_bf16(opt);
    kern_trace *kt_ = kern_trace_armed();
    /* one thread owns a (b, kv head): the dk, dv rows of its keys and the dq rows
     * of its query heads, so every sum runs in one fixed order */
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for collapse(2) schedule(static) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++)
                for (int h = kh * group; h < (kh + 1) * group; h++)
                    for (int r = 0; r < Tq; r++) {
                        int lo, hi;
                        if (!attn_blk_span(g, g->q0 + r, window, &lo, &hi)) continue;
                        size_t qa = (((size_t)b * g->ldq + r) * nh + h) * hd, row = ((size_t)b * nh + h) * g->ldq + r;
                        const float *qt = q + qa, *dot_ = dout + qa;
                        float *dqt = dq + qa, L = lse[row], Dr = D[row];
                        for (int j = lo; j <= hi; j++) {
                            size_t ka = (((size_t)b * g->ldk + j) * nkv + kh) * hd;
                            const float *kt = k + ka, *vt = v + ka;
                            float *dkt = dk + ka, *dvt = dv + ka;
                            op_attention_bwd_elem(dqt, dkt, dvt, qt, kt, vt, dot_, L, Dr, hd, scale, cap, b16);
                        }
                    }
        KERN_TRACE_EXIT(kt_);
    }
}

/* The tiled pair (attention_blk_tiled.inc): generic, and on x86-64 compiled for AVX-512
 * too (the vectorised loops are element-wise and -std=c11 contracts nothing into FMAs,
 * so both copies round alike). */
#define BLK_BQ 32 /* query rows per tile of the forward */
#define BLK_BK 64 /* keys per tile */
#define BLK_TARGET
#define BLK_NAME(x) x
#include "kernels/ref/attention_blk_tiled.inc"
#undef BLK_TARGET
#undef BLK_NAME
#if defined(__x86_64__)
#define BLK_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define BLK_NAME(x) x##_avx512
#include "kernels/ref/attention_blk_tiled.inc"
#undef BLK_TARGET
#undef BLK_NAME
#endif
