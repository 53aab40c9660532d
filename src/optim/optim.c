/* optim/optim.c: AdamW, clipping and the LR schedule. */
#include "optim/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/err.h"
#include "kernels/ops.h" /* the per-thread stamps of a traced step */
#include "kernels/registry.h" /* kern_cpu_features: the norm's AVX2 loop */

#if defined(__x86_64__)
#include <immintrin.h>
#endif

void adamw_init(adamw_state *s, size_t n) {
    s->n = n;
    s->m = ct_calloc(n, sizeof(float));
    s->v = ct_calloc(n, sizeof(float));
    s->step = 0;
    s->lazy = 0;
}

void adamw_init_lazy(adamw_state *s, size_t n) {
    s->n = n;
    s->m = ct_alloc_lazy(n * sizeof(float));
    s->v = ct_alloc_lazy(n * sizeof(float));
    s->step = 0;
    s->lazy = 1;
}

void adamw_free(adamw_state *s) {
    if (s->lazy) {
        ct_free_lazy(s->m, s->n * sizeof(float));
        ct_free_lazy(s->v, s->n * sizeof(float));
        memset(s, 0, sizeof *s);
        return;
    }
    free(s->m);
    free(s->v);
    memset(s, 0, sizeof *s);
}

adamw_scalars adamw_begin_step(adamw_state *s, double lr, const adamw_hparams *h) {
    s->step++;
    const double bc1 = 1.0 - pow(h->beta1, (double)s->step);
    const double bc2 = 1.0 - pow(h->beta2, (double)s->step);
    return (adamw_scalars){
        .decay = (float)(1.0 - lr * h->weight_decay),
        .b1 = (float)h->beta1,
        .b2 = (float)h->beta2,
        .step_size = (float)(lr / bc1),
        .bc2_sqrt = (float)sqrt(bc2),
        .eps = (float)h->eps,
    };
}

void adamw_step(adamw_state *s, float *params, float *grads, float gscale, double lr, const adamw_hparams *h) {
    /* scalars in double like torch's Python-side math, elementwise in fp32 */
    const adamw_scalars sc = adamw_begin_step(s, lr, h);
    const float decay = sc.decay, b1 = sc.b1, b2 = sc.b2, step_size = sc.step_size, bc2_sqrt = sc.bc2_sqrt,
                eps = sc.eps;
    float *m = s->m, *v = s->v;
    long n = (long)s->n;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel if (n >= ADAMW_PARALLEL_MIN) /* a small range: no second thread to wake */
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long i = 0; i < n; i++) {
            float g = grads[i] * gscale; /* what the clipping pass stored, to the bit */
            grads[i] = 0.0f;
            float p = params[i] * decay;
            m[i] = m[i] + (1.0f - b1) * (g - m[i]); /* lerp, as torch */
            v[i] = v[i] * b2 + (1.0f - b2) * g * g;
            float denom = sqrtf(v[i]) / bc2_sqrt + eps;
            params[i] = p - step_size * (m[i] / denom);
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void adam_l2_grad(float *grads, const float *params, float gscale, double wd, size_t n) {
    const float w = (float)wd; /* torch's alpha: the Python float as the tensor's fp32 */
    long len = (long)n;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel if (len >= ADAMW_PARALLEL_MIN)
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long i = 0; i < len; i++) {
            float g = grads[i] * gscale; /* what the clipping pass stored */
            grads[i] = g + w * params[i];
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* The squares of one block in a fixed order: element i into lane i % NORM_LANES,
 * each lane a sequential chain, then the lanes summed as a fixed tree. The
 * order depends on the block alone, never on threads or on the instruction
 * set: a float's square is exact in double (24 + 24 significand bits), so
 * acc + g * g rounds once whether it is a multiply and an add or one FMA, and
 * every path below gives the same bits. Sixteen lanes, not eight: on the AMX
 * Xeon the 8-lane SSE2 loop (4 add chains) read 874 MB of W1 gradients at
 * 14 GB/s (61 ms of a 2.3 s step, docs/benchmarks.md); four 4-double AVX2
 * chains read at the memory's speed. */
#define NORM_LANES 16

static void norm_tree(double acc[NORM_LANES], const float *g, size_t i, size_t n) {
    for (; i < n; i++) acc[i % NORM_LANES] += (double)g[i] * g[i];
    for (int w = NORM_LANES / 2; w; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
}

static double norm_block(const float *g, size_t n) {
    double acc[NORM_LANES] = {0};
    size_t i = 0;
    for (; i + NORM_LANES <= n; i += NORM_LANES)
#pragma GCC unroll 16
        for (int j = 0; j < NORM_LANES; j++) acc[j] += (double)g[i + j] * g[i + j];
    norm_tree(acc, g, i, n);
    return acc[0];
}

#if defined(__x86_64__)
/* norm_block's lanes as four ymm chains of 4 doubles (lanes 0-3, 4-7, 8-11, 12-15). */
__attribute__((target("avx2,fma"))) static double norm_block_avx2(const float *g, size_t n) {
    __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    size_t i = 0;
    for (; i + NORM_LANES <= n; i += NORM_LANES)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(g + i + 4 * j));
            a[j] = _mm256_fmadd_pd(x, x, a[j]);
        }
    double acc[NORM_LANES];
    for (int j = 0; j < 4; j++) _mm256_storeu_pd(acc + 4 * j, a[j]);
    norm_tree(acc, g, i, n);
    return acc[0];
}
#endif

double optim_grad_norm(const float *g, size_t n) {
    /* fixed-size blocks summed in order keep the result independent of threads */
    enum { BLOCK = 1 << 16 };
    long nb = (long)((n + BLOCK - 1) / BLOCK);
    double *part = ct_calloc((size_t)nb + 1, sizeof(double));
    double (*block)(const float *, size_t) = norm_block;
#if defined(__x86_64__)
    unsigned f = kern_cpu_features(); /* CTITAN_ISA=ref keeps the portable loop (test_optim compares them) */
    if ((f & KERN_FEAT_AVX2) && (f & KERN_FEAT_FMA)) block = norm_block_avx2;
#endif
    kern_trace *kt_ = kern_trace_armed();
    /* up to 4 blocks (a LoRA run's adapter ranges, under 2^18 gradients
     * each): no second thread to wake, which on cores other processes share
     * cost up to a time slice per call (traced: 24 ms for 0.06 ms of work) */
#pragma omp parallel if (nb > 4)
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long b = 0; b < nb; b++) {
            size_t lo = (size_t)b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
            part[b] = block(g + lo, hi - lo);
        }
        KERN_TRACE_EXIT(kt_);
    }
    double total = 0;
    for (long b = 0; b < nb; b++) total += part[b];
    free(part);
    return sqrt(total);
}

float optim_clip_scale(double norm, double max_norm) {
    if (max_norm <= 0) return 1.0f;
    double coef = max_norm / (norm + 1e-6);
    return coef < 1.0 ? (float)coef : 1.0f;
}

int lr_decay_type_from_name(const char *name) {
    if (!strcmp(name, "linear")) return LR_DECAY_LINEAR;
    if (!strcmp(name, "sqrt")) return LR_DECAY_SQRT;
    if (!strcmp(name, "cosine")) return LR_DECAY_COSINE;
    return -1;
}

void lr_schedule_init(lr_schedule *s, int training_steps, int warmup_steps, double decay_ratio,
                      lr_decay_type type, double min_lr_factor) {
    s->warmup_steps = warmup_steps;
    if (decay_ratio < 0) {
        s->decay_steps = training_steps - warmup_steps;
    } else {
        s->decay_steps = (int)lround(training_steps * decay_ratio);
        if (warmup_steps + s->decay_steps > training_steps) s->decay_steps = training_steps - warmup_steps;
    }
    if (s->decay_steps < 0) s->decay_steps = 0;
    /* the +1 is torchtitan's: step indices run 0..training_steps */
    s->stable_steps = training_steps + 1 - warmup_steps - s->decay_steps;
    s->type = type;
    s->min_lr_factor = min_lr_factor;
}

double lr_schedule_factor(const lr_schedule *s, int step) {
    int warm_stable = s->warmup_steps + s->stable_steps;
    if (step < s->warmup_steps) return (double)(step + 1) / s->warmup_steps;
    if (step < warm_stable) return 1.0;
    if (s->decay_steps <= 0) return s->min_lr_factor;
    double progress = (double)(step + 1 - warm_stable) / s->decay_steps;
    double adj;
    switch (s->type) {
    case LR_DECAY_SQRT: adj = 1.0 - sqrt(progress); break;
    case LR_DECAY_COSINE: adj = 0.5 * (1.0 + cos(M_PI * progress)); break;
    default: adj = 1.0 - progress; break;
    }
    return s->min_lr_factor + (1.0 - s->min_lr_factor) * adj;
}
