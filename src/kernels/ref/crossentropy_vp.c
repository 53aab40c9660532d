/* kernels/ref/crossentropy_vp.c: the reference of the vocabulary-parallel
 * cross-entropy (op_crossentropy_vp_*, contract in kernels/ops.h).
 *
 * Design: the loops the model ran inline before this became an op, operation
 * for operation (float sums in column order, expf, x - max before exp, the
 * gradient as exp * (1/sum) * scale), so tensor-parallel runs on "ref" give
 * the numbers they always gave. The three phases exist because the row max
 * and the sums are global over ranks: the model all-reduces between them
 * (lm.c, crossentropy()). Rows are independent, so the row loops run in
 * parallel; the loss is summed serially in row order, independent of the
 * thread count. Unlike op_crossentropy_*, a target outside this rank's
 * columns is normal (another rank holds it), so nothing is checked here:
 * token ids are checked against the whole vocabulary when a dataset opens
 * (data/dataset.c). */
#include <math.h>
#include <string.h>

#include "kernels/ops.h"

#define CE_IGNORE (-100)

void op_crossentropy_vp_max(float *maxv, const float *logits, int N, int V) {
    // maxv[N], logits[N,V]
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = logits + (size_t)n * V;
            float v = -INFINITY;
            for (int i = 0; i < V; i++) v = x[i] > v ? x[i] : v;
            maxv[n] = v;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void op_crossentropy_vp_sums(float *sumexp, float *tlogit, const float *logits, const float *maxv,
                             const int32_t *targets, int N, int V, int v0) {
    // sumexp[N], tlogit[N], logits[N,V], maxv[N] (global), targets[N] (global column ids)
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const float *x = logits + (size_t)n * V;
            float s = 0.0f;
            for (int i = 0; i < V; i++) s += expf(x[i] - maxv[n]);
            sumexp[n] = s;
            int y = targets[n] - v0;
            tlogit[n] = targets[n] != CE_IGNORE && y >= 0 && y < V ? x[y] - maxv[n] : 0.0f;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

double op_crossentropy_vp_loss(const float *sumexp, const float *tlogit, const int32_t *targets, int N,
                               long *n_valid) {
    // sumexp, tlogit, targets [N]
    double total = 0.0;
    long count = 0;
    for (int n = 0; n < N; n++) {
        if (targets[n] == CE_IGNORE) continue;
        total += -(tlogit[n] - logf(sumexp[n]));
        count++;
    }
    if (n_valid) *n_valid += count;
    return total;
}

double op_crossentropy_vp_grad(float *logits, const float *maxv, const float *sumexp, const float *tlogit,
                               const int32_t *targets, int N, int V, int v0, float grad_scale, long *n_valid) {
    // logits[N,V] in: logits, out: dlogits * grad_scale; maxv, sumexp, tlogit [N] (global); targets[N]
    double total = op_crossentropy_vp_loss(sumexp, tlogit, targets, N, n_valid);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            float *x = logits + (size_t)n * V;
            if (targets[n] == CE_IGNORE) {
                memset(x, 0, (size_t)V * sizeof(float));
                continue;
            }
            float inv = 1.0f / sumexp[n];
            for (int i = 0; i < V; i++) x[i] = expf(x[i] - maxv[n]) * inv * grad_scale;
            int y = targets[n] - v0;
            if (y >= 0 && y < V) x[y] -= grad_scale;
        }
        KERN_TRACE_EXIT(kt_);
    }
    return total;
}
