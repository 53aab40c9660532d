/* kernels/timing.c: a timed call of any implementation of any op at any size.
 *
 * Shared by `ctitan kernels bench` (fixed Qwen3-0.6B sizes, printed) and the
 * tuner (tune.c: the run's own sizes, the fastest kept). One kern_bench holds
 * every input an op needs, pseudo-random and allocated once, so the
 * implementations compared are timed on the same bytes. Inputs are values in
 * [-0.5, 0.5): a softmax, exp or AdamW step on them runs the same code paths
 * as on a model's tensors, and nothing overflows. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/dtype.h"
#include "core/err.h"
#include "core/timer.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

struct kern_bench {
    kern_op op;
    kern_shape s;
    float *a, *b, *c, *d, *e, *f, *g, *h;
    int32_t *tok;
    int32_t *perm, *pos, *off; /* moe_experts routing */
    float *dw;                 /* matmul dw [N,K]; moe_experts weight gradients [3, E, I, H] */
    uint16_t *wh;              /* matmul: w rounded to bf16 [N,K]; moe_experts: wg | wu | wd rounded to bf16
                                * [3, E, I, H], made at the first wbf16 call (the wbf16 parts) */
    adamw_state st;
    adamw_hparams hp;
    unsigned char *cold; /* kern_bench_set_cold's scratch (the caller's), NULL: operands stay cached */
    size_t cold_bytes;
    unsigned cold_pass; /* a new byte each pass, so every pass writes */
};

static float *rand_buf(size_t n, uint64_t *s) {
    float *p = ct_malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((*s >> 40) * (1.0 / 16777216.0)) - 0.5f;
    }
    return p;
}

static int32_t *token_ids(int n, int V) {
    int32_t *t = ct_malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 7919L) % V);
    return t;
}

kern_bench *kern_bench_new(kern_op op, const kern_shape *sh) {
    kern_bench *x = ct_calloc(1, sizeof *x);
    x->op = op;
    x->s = *sh;
    const kern_shape *s = &x->s;
    uint64_t seed = 7;
    switch (op) {
    case KERN_OP_MATMUL:
    case KERN_OP_MATMUL_BF16:
        x->a = rand_buf((size_t)s->M * s->K, &seed);  /* inp [M,K] */
        x->b = rand_buf((size_t)s->N * s->K, &seed);  /* w [N,K] */
        x->c = rand_buf((size_t)s->M * s->N, &seed);  /* out [M,N] */
        x->d = rand_buf((size_t)s->M * s->N, &seed);  /* dout [M,N] */
        x->e = rand_buf((size_t)s->M * s->K, &seed);  /* dinp [M,K] */
        x->dw = rand_buf((size_t)s->N * s->K, &seed); /* dw [N,K] */
        x->wh = ct_malloc(((size_t)s->N * s->K + 1) * sizeof(uint16_t));
        ct_convert_from_f32(x->wh, CT_BF16, x->b, (size_t)s->N * s->K);
        break;
    case KERN_OP_EMBEDDING:
        x->a = rand_buf((size_t)s->rows * s->C, &seed); /* out [rows,C] */
        x->b = rand_buf((size_t)s->V * s->C, &seed);    /* wte [V,C] */
        x->tok = token_ids(s->rows, s->V);
        break;
    case KERN_OP_RMSNORM:
        x->a = rand_buf((size_t)s->rows * s->C, &seed), x->b = rand_buf((size_t)s->rows * s->C, &seed);
        x->c = rand_buf((size_t)s->rows, &seed), x->d = rand_buf((size_t)s->C, &seed);
        x->e = rand_buf((size_t)s->rows * s->C, &seed), x->f = rand_buf((size_t)s->C, &seed);
        break;
    case KERN_OP_ROPE: {
        size_t n = (size_t)s->B * s->T * s->nh * s->hd;
        x->a = rand_buf(n, &seed), x->b = rand_buf(n, &seed), x->e = rand_buf(n, &seed); /* out, x, dx */
        x->c = ct_malloc((size_t)s->T * s->hd / 2 * sizeof(float) + sizeof(float));      /* cos [T, hd/2] */
        x->d = ct_malloc((size_t)s->T * s->hd / 2 * sizeof(float) + sizeof(float));      /* sin */
        op_rope_tables(x->c, x->d, s->T, s->hd, 1e6f);
        x->f = rand_buf((size_t)s->B * s->T * s->nh, &seed);                     /* rstd [B,T,nh] */
        x->g = rand_buf((size_t)s->hd, &seed), x->h = rand_buf((size_t)s->hd, &seed); /* w, dw [hd] */
        break;
    }
    case KERN_OP_ATTENTION: {
        size_t nq = (size_t)s->B * s->T * s->nh * s->hd, nk = (size_t)s->B * s->T * s->nkv * s->hd;
        x->a = rand_buf(nq, &seed), x->b = rand_buf((size_t)s->B * s->nh * s->T, &seed); /* out, lse */
        x->c = rand_buf(nq, &seed), x->d = rand_buf(nk, &seed), x->e = rand_buf(nk, &seed); /* q, k, v */
        x->f = rand_buf(nq, &seed), x->g = rand_buf(nk, &seed), x->h = rand_buf(nk, &seed); /* dq, dk, dv */
        break;
    }
    case KERN_OP_SWIGLU:
    case KERN_OP_GEGLU:
        x->a = rand_buf((size_t)s->n, &seed), x->b = rand_buf((size_t)s->n, &seed);
        x->c = rand_buf((size_t)s->n, &seed), x->d = rand_buf((size_t)s->n, &seed);
        x->e = rand_buf((size_t)s->n, &seed);
        break;
    case KERN_OP_CROSSENTROPY:
        x->a = rand_buf((size_t)s->rows * s->V, &seed), x->b = rand_buf((size_t)s->rows * s->V, &seed);
        x->c = rand_buf((size_t)s->rows, &seed);
        x->tok = token_ids(s->rows, s->V);
        break;
    case KERN_OP_ADD:
        x->a = rand_buf((size_t)s->n, &seed), x->b = rand_buf((size_t)s->n, &seed);
        x->c = rand_buf((size_t)s->n, &seed);
        break;
    case KERN_OP_ADAMW:
        x->a = rand_buf((size_t)s->n, &seed), x->b = rand_buf((size_t)s->n, &seed);
        adamw_init(&x->st, (size_t)s->n);
        x->hp = (adamw_hparams){.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
        break;
    case KERN_OP_MOE:
    case KERN_OP_MOE_BF16: {
        /* balanced routing: token t picks experts t, t+1, ... (mod E) */
        int N = s->rows, H = s->C, Im = s->I, E = s->E, k = s->k;
        size_t S = (size_t)N * k, nw = (size_t)E * Im * H;
        x->a = rand_buf((size_t)N * H, &seed), x->e = rand_buf((size_t)N * H, &seed); /* x, out / dx */
        x->b = rand_buf(nw, &seed), x->c = rand_buf(nw, &seed), x->d = rand_buf(nw, &seed); /* wg, wu, wd */
        x->f = rand_buf(S * Im, &seed), x->g = rand_buf(S * Im, &seed);                     /* gate, up */
        x->h = rand_buf(S * (Im + 2) + KERN_MOE_WORK(S, H, Im), &seed); /* h | topw | dtopw | work */
        x->dw = rand_buf(3 * nw, &seed);
        x->perm = ct_malloc(S * sizeof(int32_t)), x->pos = ct_malloc(S * sizeof(int32_t));
        x->off = ct_calloc((size_t)E + 1, sizeof(int32_t));
        for (size_t r = 0; r < S; r++) x->off[(r / k + r % k) % E + 1]++;
        for (int ex = 0; ex < E; ex++) x->off[ex + 1] += x->off[ex];
        int32_t *cur = ct_malloc((size_t)E * sizeof(int32_t));
        memcpy(cur, x->off, (size_t)E * sizeof(int32_t));
        for (size_t r = 0; r < S; r++) {
            int ex = (int)((r / k + r % k) % E);
            x->perm[cur[ex]] = (int32_t)r;
            x->pos[r] = cur[ex]++;
        }
        free(cur);
        break;
    }
    } /* no default: -Wswitch names an op of ops_list.h left out here */
    return x;
}

void kern_bench_free(kern_bench *x) {
    if (!x) return;
    free(x->a), free(x->b), free(x->c), free(x->d), free(x->e), free(x->f), free(x->g), free(x->h), free(x->tok);
    free(x->perm), free(x->pos), free(x->off), free(x->dw), free(x->wh);
    if (x->op == KERN_OP_ADAMW) adamw_free(&x->st);
    free(x);
}

int kern_bench_has_bwd(kern_op op) {
    static const unsigned char has_bwd[KERN_N_OPS] = {
#define OP_BWD(ID, name, bwd, heavy, help) [KERN_OP_##ID] = bwd,
        KERN_OP_LIST(OP_BWD)
#undef OP_BWD
    };
    return op >= 0 && op < KERN_N_OPS && has_bwd[op];
}

/* One call of `part` of im. */
static void run_once(kern_bench *x, const kern_impl *im, kern_bench_part part) {
    const kern_shape *s = &x->s;
    int fwd = part == KERN_BENCH_FWD;
    switch (im->op) {
    case KERN_OP_MATMUL:
    case KERN_OP_MATMUL_BF16:
        if (part == KERN_BENCH_FWD_WBF16 || part == KERN_BENCH_DINP_WBF16) {
            const kern_impl full = kern_impl_complete(im); /* what kern_select installs */
            kern_matmul_fwd_wbf16_fn fh = full.fn.matmul.fwd_wbf16;
            kern_matmul_dinp_wbf16_fn dh = full.fn.matmul.dinp_wbf16;
            if (part == KERN_BENCH_FWD_WBF16) fh(x->c, x->a, x->wh, s->M, s->K, s->N, 0);
            else dh(x->e, x->d, x->wh, s->M, s->K, s->N, s->N, 0);
        } else if (fwd) im->fn.matmul.fwd(x->c, x->a, x->b, s->M, s->K, s->N, 0);
        else /* NULL output: that product is skipped (ops.h); d(input) overwritten, as the model's
              * first product into each gradient buffer (model/lm.c) */
            im->fn.matmul.bwd(part == KERN_BENCH_DW ? NULL : x->e, part == KERN_BENCH_DINP ? NULL : x->dw, x->d,
                              x->a, x->b, s->M, s->K, s->N, 0);
        break;
    case KERN_OP_EMBEDDING:
        if (fwd) im->fn.embedding.fwd(x->a, x->tok, x->b, s->rows, s->C);
        else im->fn.embedding.bwd(x->b, x->a, x->tok, s->rows, s->C);
        break;
    case KERN_OP_RMSNORM:
        if (fwd) im->fn.rmsnorm.fwd(x->a, x->c, x->b, x->d, s->rows, s->C, 1e-6f);
        else im->fn.rmsnorm.bwd(x->e, x->f, x->a, x->b, x->d, x->c, s->rows, s->C);
        break;
    case KERN_OP_ROPE:
        /* the fused per-head q/k norm + RoPE is what the model runs (Qwen3) */
        if (fwd) im->fn.rope.qknorm_fwd(x->a, x->f, x->b, x->g, x->c, x->d, s->B, s->T, s->nh, s->hd, 1e-6f);
        else im->fn.rope.qknorm_bwd(x->e, x->h, x->a, x->b, x->g, x->f, x->c, x->d, s->B, s->T, s->nh, s->hd, 0);
        break;
    case KERN_OP_ATTENTION: {
        /* Qwen3's attention (opt NULL): the options cost nothing without a window, and a window only
         * takes work away; bf16 products where the shape asks (a bf16 run's: other kernels) */
        const kern_attn_opt b16 = {0, 0, 0, 1}, *o = s->bf16 ? &b16 : NULL;
        if (fwd) im->fn.attention.fwd(x->a, x->b, x->c, x->d, x->e, s->B, s->T, s->nh, s->nkv, s->hd, o);
        else /* dout: q stands in, any [B,T,nh,hd] input times the same; acc 0 as the model's call */
            im->fn.attention.bwd(x->f, x->g, x->h, x->c, x->a, x->b, x->c, x->d, x->e, s->B, s->T, s->nh, s->nkv,
                                 s->hd, o, 0);
        break;
    }
    case KERN_OP_SWIGLU:
        if (fwd) im->fn.swiglu.fwd(x->a, x->b, x->c, (int)s->n);
        else im->fn.swiglu.bwd(x->d, x->e, x->a, x->b, x->c, (int)s->n, 0);
        break;
    case KERN_OP_GEGLU:
        if (fwd) im->fn.geglu.fwd(x->a, x->b, x->c, (int)s->n);
        else im->fn.geglu.bwd(x->d, x->e, x->a, x->b, x->c, (int)s->n, 0);
        break;
    case KERN_OP_CROSSENTROPY:
        /* fwdbwd overwrites its input: refresh it from b first (as the model's logits are fresh) */
        if (fwd) im->fn.crossentropy.fwd(x->c, x->b, x->tok, s->rows, s->V);
        else {
            memcpy(x->a, x->b, (size_t)s->rows * s->V * sizeof(float));
            im->fn.crossentropy.fwdbwd(x->a, x->tok, s->rows, s->V, 1.0f / (float)s->rows, NULL);
        }
        break;
    case KERN_OP_ADD: im->fn.add.fwd(x->a, x->b, x->c, s->n); break;
    /* the step zeroes the gradients: repetitions after the first step on zeros,
     * the same work (no data-dependent path; the moments decay by beta per
     * step, far from denormals within a timing's few repetitions) */
    case KERN_OP_ADAMW: im->fn.adamw.step(&x->st, x->a, x->b, 1.0f, 1e-4, &x->hp); break;
    case KERN_OP_MOE:
    case KERN_OP_MOE_BF16: {
        size_t S = (size_t)s->rows * s->k, nw = (size_t)s->E * s->I * s->C;
        float *topw = x->h + S * s->I, *dtopw = topw + S, *work = dtopw + S;
        if ((part == KERN_BENCH_FWD_WBF16 || part == KERN_BENCH_BWD_WBF16) && !x->wh) {
            /* only a run whose experts are bf16-stored times these: the store costs it nothing otherwise */
            x->wh = ct_malloc(3 * nw * sizeof(uint16_t));
            ct_convert_from_f32(x->wh, CT_BF16, x->b, nw);
            ct_convert_from_f32(x->wh + nw, CT_BF16, x->c, nw);
            ct_convert_from_f32(x->wh + 2 * nw, CT_BF16, x->d, nw);
        }
        const uint16_t *hg = x->wh, *hu = x->wh ? x->wh + nw : NULL, *hd = x->wh ? x->wh + 2 * nw : NULL;
        const kern_impl full = kern_impl_complete(im); /* what kern_select installs */
        kern_moe_fwd_wbf16_fn fh = full.fn.moe.fwd_wbf16;
        kern_moe_bwd_wbf16_fn bh = full.fn.moe.bwd_wbf16;
        if (part == KERN_BENCH_FWD_WBF16)
            fh(x->e, x->f, x->g, x->h, work, x->a, x->b, x->c, x->d, hg, hu, hd, x->perm, x->pos, x->off, topw,
               s->rows, s->C, s->I, s->E, s->k);
        else if (part == KERN_BENCH_BWD_WBF16) /* frozen experts: no weight gradients, as the model asks */
            bh(x->e, NULL, NULL, NULL, dtopw, work, x->a, x->a, x->b, x->c, x->d, hg, hu, hd, x->f, x->g, x->h,
               x->perm, x->pos, x->off, topw, s->rows, s->C, s->I, s->E, s->k);
        else if (fwd)
            im->fn.moe.fwd(x->e, x->f, x->g, x->h, work, x->a, x->b, x->c, x->d, x->perm, x->pos, x->off, topw,
                           s->rows, s->C, s->I, s->E, s->k);
        else
            im->fn.moe.bwd(x->e, x->dw, x->dw + nw, x->dw + 2 * nw, dtopw, work, x->a, x->a, x->b, x->c, x->d, x->f,
                           x->g, x->h, x->perm, x->pos, x->off, topw, s->rows, s->C, s->I, s->E, s->k);
        break;
    }
    } /* no default: -Wswitch names an op of ops_list.h left out here */
}

void kern_bench_set_cold(kern_bench *x, unsigned char *scratch, size_t bytes) {
    x->cold = scratch && bytes ? scratch : NULL;
    x->cold_bytes = x->cold ? bytes : 0;
}

/* The last-level cache this CPU's cores share, from sysfs (sysconf's figure
 * can be the whole host's: 384 MB on a 2-core Zen 5 guest whose L3 is 32 MB). */
static size_t llc_bytes(void) {
    const char *paths[] = {"/sys/devices/system/cpu/cpu0/cache/index3/size",
                           "/sys/devices/system/cpu/cpu0/cache/index2/size"};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(paths[i], "r");
        if (!f) continue;
        unsigned long v = 0;
        char unit = 0;
        int got = fscanf(f, "%lu%c", &v, &unit);
        fclose(f);
        if (got >= 1 && v) return (size_t)v << (unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0);
    }
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? (size_t)l3 : 0;
}

size_t kern_bench_cold_bytes(void) {
    size_t b = 4 * llc_bytes(), lo = (size_t)64 << 20, hi = (size_t)1 << 30;
    return b < lo ? lo : b > hi ? hi : b;
}

/* Every thread writes its share of the cold scratch (its own core's caches
 * too, not only the shared last level). */
static void cold_pass(kern_bench *x) {
    if (!x->cold) return;
    if (++x->cold_pass % 256 == 0) x->cold_pass++; /* never 0: a written byte differs from a fresh page */
    ct_fill(x->cold, (int)(x->cold_pass % 256), x->cold_bytes);
}

double kern_bench_time(kern_bench *x, const kern_impl *im, kern_bench_part part, int reps, double cutoff) {
    /* warm-up: faults pages in and lets malloc keep its workspace; it also
     * tells a hopeless candidate (cutoff) without timing it further */
    cold_pass(x);
    double t0 = ct_now();
    run_once(x, im, part);
    double best = ct_now() - t0, spent = best;
    if (cutoff > 0 && best > cutoff) return best;
    for (int r = 0; r < reps && (r < 2 || spent < 2.0); r++) {
        cold_pass(x);
        t0 = ct_now();
        run_once(x, im, part);
        double dt = ct_now() - t0;
        spent += dt;
        if (dt < best) best = dt;
    }
    return best;
}
