/* tests/c/kernels/test_elementwise_avx2.c: the AVX2 + FMA memory-bound kernels
 * (kernels/cpu/elementwise_avx2.c on elementwise_vec.inc) and attention
 * (blocked_avx2, tiled_avx2) beyond what `kernels check` compares. The AVX2
 * vector exp's accuracy is tested beside the AVX-512 one in test_elementwise.c.
 *
 * - every op gives bit-identical results at 1, 2 and 3 threads (the resume
 *   and activation-checkpointing tests rely on reruns matching bit for bit);
 * - AdamW, add and the embedding round exactly as the reference, and
 *   tiled_avx2 exactly as tiled (no FMA contraction);
 * - exp8 equals the AVX-512 exp16 bit for bit where the CPU has both (same
 *   polynomial; the two-step 2^n scaling rounds once, as vscalefps);
 * - a head_dim-64 model with every op on its AVX2 implementation gives
 *   bit-identical loss and gradients under every activation-checkpointing mode.
 * The implementations are looked up in the registry by name, so the same
 * file can test another instantiation of elementwise_vec.inc by changing the
 * names. Skips (passing) on CPUs without AVX2 + FMA and off x86-64. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kern_test.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "model/lm.h"

#if defined(__x86_64__)
typedef struct {
    const kern_impl *im; /* the implementation under test (its op's member of fn) */
    int B, T, nh, hd, N, C, V;
    float *x, *w, *dout, *cs, *sn, *g, *u;
    int32_t *tgt;
} ctx_t;

/* out = [out | rstd | dx | dw] of rmsnorm fwd + bwd (dx, dw accumulate onto fixed values) */
static void run_rmsnorm(void *c_, float *o) {
    ctx_t *c = c_;
    size_t nc = (size_t)c->N * c->C;
    float *y = o, *rs = o + nc, *dx = rs + c->N, *dw = dx + nc;
    c->im->fn.rmsnorm.fwd(y, rs, c->x, c->w, c->N, c->C, 1e-6f);
    memcpy(dx, c->dout, nc * sizeof(float));
    memcpy(dw, c->w, (size_t)c->C * sizeof(float));
    c->im->fn.rmsnorm.bwd(dx, dw, c->dout, c->x, c->w, rs, c->N, c->C);
}

/* [qknorm out | rstd | dx | dw | rope out | rope dinp] */
static void run_rope(void *c_, float *o) {
    ctx_t *c = c_;
    size_t rows = (size_t)c->B * c->T * c->nh, n = rows * c->hd;
    float *y = o, *rs = o + n, *dx = rs + rows, *dw = dx + n, *ry = dw + c->hd, *rd = ry + n;
    c->im->fn.rope.qknorm_fwd(y, rs, c->x, c->w, c->cs, c->sn, c->B, c->T, c->nh, c->hd, 1e-6f);
    memcpy(dx, c->dout, n * sizeof(float));
    memcpy(dw, c->w, (size_t)c->hd * sizeof(float));
    c->im->fn.rope.qknorm_bwd(dx, dw, c->dout, c->x, c->w, rs, c->cs, c->sn, c->B, c->T, c->nh, c->hd, 1);
    c->im->fn.rope.fwd(ry, c->x, c->cs, c->sn, c->B, c->T, c->nh, c->hd, c->hd);
    memcpy(rd, c->x, n * sizeof(float));
    c->im->fn.rope.bwd(rd, c->dout, c->cs, c->sn, c->B, c->T, c->nh, c->hd, c->hd);
}

static void run_swiglu(void *c_, float *o) {
    ctx_t *c = c_;
    size_t n = (size_t)c->N;
    c->im->fn.swiglu.fwd(o, c->g, c->u, c->N);
    memcpy(o + n, c->dout, n * sizeof(float));
    memcpy(o + 2 * n, c->dout, n * sizeof(float));
    c->im->fn.swiglu.bwd(o + n, o + 2 * n, c->dout, c->g, c->u, c->N, 1);
}

static void run_geglu(void *c_, float *o) {
    ctx_t *c = c_;
    size_t n = (size_t)c->N;
    c->im->fn.geglu.fwd(o, c->g, c->u, c->N);
    memcpy(o + n, c->dout, n * sizeof(float));
    memcpy(o + 2 * n, c->dout, n * sizeof(float));
    c->im->fn.geglu.bwd(o + n, o + 2 * n, c->dout, c->g, c->u, c->N, 1);
}

/* [dlogits | loss hi, lo | losses | sum | vp: max | sumexp | tlogit | dlogits | loss] */
static void run_ce(void *c_, float *o) {
    ctx_t *c = c_;
    size_t nv = (size_t)c->N * c->V;
    memcpy(o, c->x, nv * sizeof(float));
    long cnt = 0;
    double loss = c->im->fn.crossentropy.fwdbwd(o, c->tgt, c->N, c->V, 1.0f / c->N, &cnt);
    o[nv] = (float)loss;
    o[nv + 1] = (float)(loss - (double)(float)loss); /* the double's low bits too */
    float *p = o + nv + 2;
    double l2 = c->im->fn.crossentropy.fwd(p, c->x, c->tgt, c->N, c->V);
    p[c->N] = (float)l2;
    float *mx = p + c->N + 1, *se = mx + c->N, *tl = se + c->N, *g = tl + c->N;
    int v0 = 1000; /* a second rank's columns: some targets are local, some not */
    c->im->fn.crossentropy.vp_max(mx, c->x, c->N, c->V);
    c->im->fn.crossentropy.vp_sums(se, tl, c->x, mx, c->tgt, c->N, c->V, v0);
    memcpy(g, c->x, nv * sizeof(float));
    g[nv] = (float)c->im->fn.crossentropy.vp_grad(g, mx, se, tl, c->tgt, c->N, c->V, v0, 0.5f, NULL);
}

static size_t ce_size(const ctx_t *c) { return 2 * (size_t)c->N * c->V + 4 + 4 * (size_t)c->N; }

static void run_adamw(void *c_, float *o) {
    ctx_t *c = c_;
    size_t n = (size_t)c->N;
    adamw_hparams h = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    adamw_state s;
    adamw_init(&s, n);
    memcpy(o, c->x, n * sizeof(float));
    float *g = malloc(n * sizeof(float)); /* the step zeroes its gradients: a copy per step */
    for (int k = 0; k < 2; k++) {
        memcpy(g, c->dout, n * sizeof(float));
        c->im->fn.adamw.step(&s, o, g, k ? 0.5f : 1.0f, h.lr, &h);
    }
    free(g);
    memcpy(o + n, s.m, n * sizeof(float));
    memcpy(o + 2 * n, s.v, n * sizeof(float));
    adamw_free(&s);
}

/* dwte [13 x C] from N rows whose tokens repeat */
static void run_embedding_bwd(void *c_, float *o) {
    ctx_t *c = c_;
    int32_t *tok = malloc((size_t)c->N * sizeof(int32_t));
    for (int i = 0; i < c->N; i++) tok[i] = (i * 7) % 13;
    memcpy(o, c->w, 13 * (size_t)c->C * sizeof(float));
    c->im->fn.embedding.bwd(o, c->dout, tok, c->N, c->C);
    free(tok);
}

static void test_thread_independence(const char *isa) {
    uint32_t s = 11;
    ctx_t c = {.B = 2, .T = 67, .nh = 3, .hd = 128, .N = 301, .C = 200, .V = 5003};
    size_t rows = (size_t)c.B * c.T * c.nh, nq = rows * c.hd, nc = (size_t)c.N * c.C;
    size_t big = nq > nc ? nq : nc; /* x, dout serve every case below */
    big = big > 40000 ? big : 40000;
    c.x = malloc(big * sizeof(float)), c.dout = malloc(big * sizeof(float)), c.w = malloc(13 * 256 * sizeof(float));
    c.g = malloc(big * sizeof(float)), c.u = malloc(big * sizeof(float));
    c.cs = malloc((size_t)c.T * c.hd / 2 * sizeof(float)), c.sn = malloc((size_t)c.T * c.hd / 2 * sizeof(float));
    fill_lcg(c.x, big, &s, -2, 2);
    fill_lcg(c.dout, big, &s, -1, 1);
    fill_lcg(c.w, 13 * 256, &s, 0.5f, 1.5f);
    fill_lcg(c.g, big, &s, -8, 8);
    fill_lcg(c.u, big, &s, -2, 2);
    op_rope_tables(c.cs, c.sn, c.T, c.hd, 1e6f);
    if ((c.im = impl_of(KERN_OP_RMSNORM, isa)))
        same_at_any_threads("rmsnorm fwd+bwd", run_rmsnorm, &c, 2 * (size_t)c.N * c.C + c.N + c.C);
    if ((c.im = impl_of(KERN_OP_ROPE, isa)))
        same_at_any_threads("q/k norm + rope, rope fwd+bwd", run_rope, &c, 4 * nq + rows + c.hd);
    if ((c.im = impl_of(KERN_OP_EMBEDDING, isa)))
        same_at_any_threads("embedding bwd", run_embedding_bwd, &c, 13 * (size_t)c.C);
    c.N = 40000 - 3; /* several element blocks and a tail */
    if ((c.im = impl_of(KERN_OP_SWIGLU, isa))) same_at_any_threads("swiglu fwd+bwd", run_swiglu, &c, 3 * (size_t)c.N);
    if ((c.im = impl_of(KERN_OP_GEGLU, isa))) same_at_any_threads("geglu fwd+bwd", run_geglu, &c, 3 * (size_t)c.N);
    if ((c.im = impl_of(KERN_OP_ADAMW, isa))) same_at_any_threads("adamw", run_adamw, &c, 3 * (size_t)c.N);
    c.N = 7; /* 7 x 5003 logits */
    int32_t tgt[7] = {0, 5002, -100, 17, 2500, 4999, 1};
    c.tgt = tgt;
    if ((c.im = impl_of(KERN_OP_CROSSENTROPY, isa))) same_at_any_threads("crossentropy", run_ce, &c, ce_size(&c));
    free(c.x), free(c.dout), free(c.w), free(c.g), free(c.u), free(c.cs), free(c.sn);
}

static void test_exact_vs_ref(const char *isa) {
    const kern_impl *ad = impl_of(KERN_OP_ADAMW, isa), *ai = impl_of(KERN_OP_ADD, isa),
                    *em = impl_of(KERN_OP_EMBEDDING, isa);
    if (!ad || !ai || !em) return;
    uint32_t s = 3;
    enum { N = 20011 };
    float *p1 = malloc(N * 4), *g = malloc(N * 4), *a = malloc(N * 4), *b = malloc(N * 4), *o1 = malloc(N * 4),
          *o2 = malloc(N * 4);
    fill_lcg(p1, N, &s, -1, 1);
    fill_lcg(a, N, &s, -1, 1);
    fill_lcg(b, N, &s, -1, 1);
    float *p2 = malloc(N * 4);
    memcpy(p2, p1, N * 4);
    adamw_hparams h = {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    adamw_state s1, s2;
    adamw_init(&s1, N);
    adamw_init(&s2, N);
    float *g2 = malloc(N * 4);
    int zeroed = 1;
    for (int k = 0; k < 4; k++) {
        fill_lcg(g, N, &s, -k - 1.0f, k + 1.0f);
        memcpy(g2, g, N * 4); /* each step zeroes its gradients */
        float gs = k == 2 ? 0.3f : 1.0f; /* a clipping coefficient on one step */
        adamw_step(&s1, p1, g, gs, h.lr, &h);
        ad->fn.adamw.step(&s2, p2, g2, gs, h.lr, &h);
        for (int i = 0; i < N; i++) zeroed &= g2[i] == 0.0f;
    }
    free(g2);
    CHECK(!memcmp(p1, p2, N * 4) && !memcmp(s1.m, s2.m, N * 4) && !memcmp(s1.v, s2.v, N * 4) && s1.step == s2.step,
          "adamw %s is not bit-identical to the reference", isa);
    CHECK(zeroed, "adamw %s left gradients unzeroed", isa);
    op_add(o1, a, b, N);
    ai->fn.add.fwd(o2, a, b, N);
    CHECK(!memcmp(o1, o2, N * 4), "add %s is not bit-identical to the reference", isa);
    int32_t tok[101];
    for (int i = 0; i < 101; i++) tok[i] = (i * 7) % 13;
    float *d1 = calloc(13 * 37, 4), *d2 = calloc(13 * 37, 4);
    op_embedding_fwd(o1, tok, a, 101, 37);
    em->fn.embedding.fwd(o2, tok, a, 101, 37);
    CHECK(!memcmp(o1, o2, 101 * 37 * 4), "embedding fwd %s differs from the reference", isa);
    op_embedding_bwd(d1, b, tok, 101, 37);
    em->fn.embedding.bwd(d2, b, tok, 101, 37);
    CHECK(!memcmp(d1, d2, 13 * 37 * 4), "embedding bwd %s is not bit-identical to the reference", isa);
    adamw_free(&s1);
    adamw_free(&s2);
    free(p1), free(p2), free(g), free(a), free(b), free(o1), free(o2), free(d1), free(d2);
}

typedef struct {
    const kern_impl *im;
    int B, T, nh, nkv, hd;
    float *q, *k, *v, *g;
    const kern_attn_opt *opt;
} att_ctx;

static void run_attention(void *c_, float *o) {
    att_ctx *c = c_;
    size_t nq = (size_t)c->B * c->T * c->nh * c->hd, nk = (size_t)c->B * c->T * c->nkv * c->hd;
    float *out = o, *lse = o + nq, *dq = lse + (size_t)c->B * c->nh * c->T, *dk = dq + nq, *dv = dk + nk;
    c->im->fn.attention.fwd(out, lse, c->q, c->k, c->v, c->B, c->T, c->nh, c->nkv, c->hd, c->opt);
    c->im->fn.attention.bwd(dq, dk, dv, c->g, out, lse, c->q, c->k, c->v, c->B, c->T, c->nh, c->nkv, c->hd, c->opt,
                            0); /* overwrites dq, dk, dv */
}

/* blocked_avx2 at 1, 2, 3 threads (hd 64 and 128: its path; hd 40: its tiled_avx2 fallback),
 * and tiled_avx2 bit-identical to tiled. */
static void test_attention(void) {
    static const int shapes[][5] = {{2, 101, 4, 2, 64}, {1, 150, 2, 1, 128}, {2, 37, 2, 2, 40}};
    for (int si = 0; si < 3; si++) {
        att_ctx c = {.B = shapes[si][0], .T = shapes[si][1], .nh = shapes[si][2], .nkv = shapes[si][3],
                     .hd = shapes[si][4]};
        size_t nq = (size_t)c.B * c.T * c.nh * c.hd, nk = (size_t)c.B * c.T * c.nkv * c.hd;
        size_t n = 2 * nq + (size_t)c.B * c.nh * c.T + 2 * nk;
        uint32_t s = 21 + si;
        c.q = malloc(nq * 4), c.k = malloc(nk * 4), c.v = malloc(nk * 4), c.g = malloc(nq * 4);
        fill_lcg(c.q, nq, &s, -2, 2);
        fill_lcg(c.k, nk, &s, -2, 2);
        fill_lcg(c.v, nk, &s, -1, 1);
        fill_lcg(c.g, nq, &s, -1, 1);
        /* Qwen3's attention, then a family's window + scale + soft cap */
        const kern_attn_opt wcap = {0.2f, 29, 5.0f, 0}, *opts[2] = {NULL, &wcap};
        for (int oi = 0; oi < 2; oi++) {
            c.opt = opts[oi];
            if ((c.im = impl_of(KERN_OP_ATTENTION, "blocked_avx2")))
                same_at_any_threads(oi ? "blocked_avx2 attention fwd+bwd, window + softcap"
                                       : "blocked_avx2 attention fwd+bwd",
                                    run_attention, &c, n);
            const kern_impl *t2 = impl_of(KERN_OP_ATTENTION, "tiled_avx2"), *t0 = impl_of(KERN_OP_ATTENTION, "tiled");
            if (t2 && t0) {
                float *o1 = malloc(n * 4), *o2 = malloc(n * 4);
                c.im = t0;
                run_attention(&c, o1);
                c.im = t2;
                run_attention(&c, o2);
                CHECK(!memcmp(o1, o2, n * 4), "tiled_avx2 differs from tiled (hd %d, opt %d)", c.hd, oi);
                free(o1), free(o2);
            }
        }
        free(c.q), free(c.k), free(c.v), free(c.g);
    }
}

/* exp8 == exp16 bit for bit, where the CPU runs both. */
static void test_exp_matches_avx512(void) {
    if ((kern_cpu_features() & KERN_FEAT_AVX512) != KERN_FEAT_AVX512) return;
    enum { N = 1 << 20 };
    float *x = malloc(N * 4), *y1 = malloc(N * 4), *y2 = malloc(N * 4);
    for (int i = 0; i < N; i++) x[i] = -110.0f + 200.0f * (float)i / (float)(N - 1);
    x[0] = -INFINITY, x[1] = INFINITY, x[2] = NAN, x[3] = -103.5f, x[4] = 88.72f;
    kern_exp_avx2(y1, x, N);
    kern_exp_avx512(y2, x, N);
    long diff = 0;
    for (int i = 0; i < N; i++)
        if (memcmp(&y1[i], &y2[i], 4) && !(isnan(y1[i]) && isnan(y2[i]))) diff++;
    CHECK(diff == 0, "exp8 differs from exp16 at %ld of %d points", diff, N);
    free(x), free(y1), free(y2);
}

/* head_dim 64, GQA, T across tiles, every op on its AVX2 implementation: one
 * forward+backward per checkpointing mode must give mode none's loss and
 * gradients bit for bit (recomputation reruns the same kernels). */
static void test_checkpointing_hd64(void) {
    static const char *const avx2_set[] = {"matmul=avx2",  "embedding=avx2",    "rmsnorm=avx2",
                                           "rope=avx2",    "attention=blocked_avx2", "swiglu=avx2",
                                           "crossentropy=avx2", "add=avx2", "adamw=avx2", NULL};
    lm_config cf = {.vocab_size = 97, .hidden = 48, .intermediate = 40, .n_layers = 3, .n_heads = 4,
                       .n_kv_heads = 2, .head_dim = 64, .max_pos = 128, .tie_embeddings = 1,
                       .rope_theta = 1e6, .rms_eps = 1e-6};
    enum { B = 2, T = 70 };
    int32_t tok[B * T], lab[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (i * 31 + 3) % 97, lab[i] = i % 13 == 0 ? -100 : (i * 17 + 1) % 97;
    const char *modes[][2] = {{"none", NULL}, {"selective", "op"}, {"selective", "2"}, {"full", NULL}};
    float *ref = NULL;
    double loss0 = 0;
    for (int i = 0; i < 4; i++) {
        lm_model m;
        ct_err e = {0};
        CHECK(lm_create_ac(&m, &cf, B, T, modes[i][0], modes[i][1], &e) == 0, "create %s: %s", modes[i][0], e.msg);
        lm_init_random(&m, 4);
        CHECK(kern_select(&m.k, avx2_set, NULL, 0, &e) == 0, "kern_select: %s", e.msg);
        double loss = lm_forward_backward(&m, tok, lab, B, T, 1.0f / 100, NULL);
        if (i == 0) {
            ref = malloc(m.n_params * sizeof(float));
            memcpy(ref, m.grads, m.n_params * sizeof(float));
            loss0 = loss;
        } else {
            CHECK(loss == loss0 && !memcmp(ref, m.grads, m.n_params * sizeof(float)),
                  "ac %s %s: loss %.9g vs %.9g or grads not bit-identical", modes[i][0],
                  modes[i][1] ? modes[i][1] : "", loss, loss0);
        }
        lm_free(&m);
    }
    free(ref);
}
#endif /* __x86_64__ */

int main(void) {
#if defined(__x86_64__)
    unsigned need = KERN_FEAT_AVX2 | KERN_FEAT_FMA;
    if ((kern_cpu_features() & need) != need) {
        printf("skip: the AVX2 kernels (this CPU lacks AVX2 + FMA)\n");
        CHECK(1, "nothing to test");
        return CHECK_DONE();
    }
    test_thread_independence("avx2");
    test_exact_vs_ref("avx2");
    test_attention();
    test_exp_matches_avx512();
    test_checkpointing_hd64();
#else
    printf("skip: the AVX2 kernels (not x86-64)\n");
    CHECK(1, "nothing to test");
#endif
    return CHECK_DONE();
}
