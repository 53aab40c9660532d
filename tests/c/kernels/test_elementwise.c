/* tests/c/kernels/test_elementwise.c: the AVX-512 memory-bound kernels
 * (kernels/cpu/elementwise_avx512.c) beyond what `kernels check` compares.
 *
 * - the vector exp against double-precision exp over the whole float range
 *   it serves, and its special values (0, +-inf, NaN, overflow, underflow);
 *   the vector tanh (attention's soft cap) likewise;
 * - every op gives bit-identical results at 1, 2 and 3 threads (the resume
 *   and activation-checkpointing tests rely on reruns matching bit for bit);
 * - AdamW, add and embedding round exactly as the reference (same operations
 *   in the same order), so switching those kernels changes nothing;
 * - the register-blocked attention (kernels/cpu/attention_avx512.c) too is
 *   thread-count independent, and a model with head_dim 64 (its path) gives
 *   bit-identical gradients under every activation-checkpointing mode, which
 *   rerun the fused q/k-norm + RoPE and the attention forward. */
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

/* vexp: kern_exp_avx512 or kern_exp_avx2 (the same algorithm for 16 / 8 lanes), named `isa` in messages */
static void test_exp(void (*vexp)(float *, const float *, long), const char *isa) {
    enum { N = 1 << 21 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    /* a dense grid over [-86.5, 88.7]: every result the exp does not flush to 0 */
    for (int i = 0; i < N; i++) x[i] = -86.5f + (88.7f + 86.5f) * (float)i / (float)(N - 1);
    vexp(y, x, N);
    double worst = 0, at = 0;
    for (int i = 0; i < N; i++) {
        double ref = exp((double)x[i]);
        double e = fabs((double)y[i] - ref) / ref;
        if (!(e <= worst)) worst = e, at = x[i];
    }
    /* 2^-23, two half-ulps (elementwise_avx512.c's comment says 7.8e-8 measured) */
    CHECK(worst <= 1.2e-7, "%s vector exp: max relative error %.3g at x = %.9g", isa, worst, at);
    /* the CE / softmax range in detail: x - max in [-30, 0] */
    worst = 0;
    for (int i = 0; i < N; i++) x[i] = -30.0f * (float)i / (float)(N - 1);
    vexp(y, x, N);
    for (int i = 0; i < N; i++) {
        double ref = exp((double)x[i]);
        double e = fabs((double)y[i] - ref) / ref;
        if (!(e <= worst)) worst = e, at = x[i];
    }
    CHECK(worst <= 1.2e-7, "%s vector exp on [-30, 0]: max relative error %.3g at x = %.9g", isa, worst, at);
    float sx[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 89.0f, 1000.0f, -104.0f, -1000.0f, -100.0f, 1.0f,
                  -86.5f, -86.50001f, -87.5f};
    int ns = (int)(sizeof sx / sizeof sx[0]);
    float sy[sizeof sx / sizeof sx[0]];
    vexp(sy, sx, ns); /* also the masked tail: 14 lanes (6 past a full ymm) */
    CHECK(sy[0] == 1.0f && sy[1] == 1.0f, "exp(+-0) = %g %g", sy[0], sy[1]);
    CHECK(isinf(sy[2]) && sy[2] > 0, "exp(inf) = %g", sy[2]);
    CHECK(sy[3] == 0.0f, "exp(-inf) = %g", sy[3]);
    CHECK(isnan(sy[4]), "exp(NaN) = %g (NaN must propagate, as expf)", sy[4]);
    CHECK(isinf(sy[5]) && isinf(sy[6]), "exp(89), exp(1000) = %g %g (overflow)", sy[5], sy[6]);
    CHECK(sy[7] == 0.0f && sy[8] == 0.0f, "exp(-104), exp(-1000) = %g %g", sy[7], sy[8]);
    /* results below the normal range are 0 (avx512_util.h's exp16: x < -86.5), where expf underflows gradually */
    CHECK(sy[9] == 0.0f && sy[13] == 0.0f, "exp(-100), exp(-87.5) = %g %g (flushed to 0)", sy[9], sy[13]);
    CHECK(fabsf(sy[10] - 2.71828183f) <= 3e-7f, "exp(1) = %.9g", sy[10]);
    CHECK(fabs(sy[11] - exp(-86.5)) <= 1.2e-7 * exp(-86.5) && sy[11] >= 1.17549435e-38f,
          "exp(-86.5) = %g vs %g (the last unflushed input: normal and accurate)", sy[11], exp(-86.5));
    CHECK(sy[12] == 0.0f, "exp(-86.50001) = %g (flushed)", sy[12]);
    free(x), free(y);
}

/* vtanh: kern_tanh_avx512, kern_tanh_avx2 or kern_tanh_neon (attention's soft cap, geglu): relative
 * error against double tanh over [-12, 12] (both branches, the switch at 0.625 and saturation), near 0,
 * and the special values. */
static void test_tanh(void (*vtanh)(float *, const float *, long), const char *isa) {
    enum { N = 1 << 21 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) x[i] = -12.0f + 24.0f * (float)i / (float)(N - 1);
    vtanh(y, x, N);
    double worst = 0, at = 0;
    for (int i = 0; i < N; i++) {
        double ref = tanh((double)x[i]);
        double e = ref == 0 ? fabs((double)y[i]) : fabs((double)y[i] - ref) / fabs(ref);
        if (!(e <= worst)) worst = e, at = x[i];
    }
    CHECK(worst <= 2.5e-7, "%s vector tanh: max relative error %.3g at x = %.9g", isa, worst, at);
    /* tiny arguments: relative accuracy where 1 - e^-2a would cancel */
    worst = 0;
    for (int i = 0; i < N; i++) x[i] = ldexpf(1.0f + (float)(i % 1024) / 1024.0f, -40 + (i / 1024) % 40);
    vtanh(y, x, N);
    for (int i = 0; i < N; i++) {
        double ref = tanh((double)x[i]);
        double e = fabs((double)y[i] - ref) / ref;
        if (!(e <= worst)) worst = e, at = x[i];
    }
    CHECK(worst <= 2.5e-7, "%s vector tanh near 0: max relative error %.3g at x = %.9g", isa, worst, at);
    float sx[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 30.0f, -1000.0f, 0.625f, -0.625f, 1.0f, 1e-30f};
    int ns = (int)(sizeof sx / sizeof sx[0]);
    float sy[sizeof sx / sizeof sx[0]];
    vtanh(sy, sx, ns);
    CHECK(sy[0] == 0.0f && !signbit(sy[0]) && sy[1] == 0.0f && signbit(sy[1]), "tanh(+-0) = %g %g", sy[0], sy[1]);
    CHECK(sy[2] == 1.0f && sy[3] == -1.0f, "tanh(+-inf) = %g %g", sy[2], sy[3]);
    CHECK(isnan(sy[4]), "tanh(NaN) = %g", sy[4]);
    CHECK(sy[5] == 1.0f && sy[6] == -1.0f, "tanh(30), tanh(-1000) = %g %g", sy[5], sy[6]);
    CHECK(fabs(sy[7] - tanh(0.625)) <= 2e-7 && sy[8] == -sy[7], "tanh(+-0.625) = %.9g %.9g", sy[7], sy[8]);
    CHECK(fabsf(sy[9] - 0.761594156f) <= 2e-7f && sy[10] == 1e-30f, "tanh(1), tanh(1e-30) = %.9g %g", sy[9],
          sy[10]);
    free(x), free(y);
}

#if defined(__x86_64__) /* the AVX-512 tests below; on aarch64 only the vector exp (test_neon.c: the rest) */
typedef struct {
    int B, T, nh, hd, N, C, V;
    float *x, *w, *dout, *cs, *sn, *g, *u;
    int32_t *tgt;
} ctx_t;

/* out = [out | rstd | dx | dw] of rmsnorm fwd + bwd (dx, dw accumulate onto fixed values) */
static void run_rmsnorm(void *c_, float *o) {
    ctx_t *c = c_;
    size_t nc = (size_t)c->N * c->C;
    float *y = o, *rs = o + nc, *dx = rs + c->N, *dw = dx + nc;
    kern_rmsnorm_fwd_avx512(y, rs, c->x, c->w, c->N, c->C, 1e-6f);
    memcpy(dx, c->dout, nc * sizeof(float));
    memcpy(dw, c->w, (size_t)c->C * sizeof(float));
    kern_rmsnorm_bwd_avx512(dx, dw, c->dout, c->x, c->w, rs, c->N, c->C);
}

static void run_qknorm_rope(void *c_, float *o) {
    ctx_t *c = c_;
    size_t rows = (size_t)c->B * c->T * c->nh, n = rows * c->hd;
    float *y = o, *rs = o + n, *dx = rs + rows, *dw = dx + n;
    kern_qknorm_rope_fwd_avx512(y, rs, c->x, c->w, c->cs, c->sn, c->B, c->T, c->nh, c->hd, 1e-6f);
    memcpy(dx, c->dout, n * sizeof(float));
    memcpy(dw, c->w, (size_t)c->hd * sizeof(float));
    kern_qknorm_rope_bwd_avx512(dx, dw, c->dout, c->x, c->w, rs, c->cs, c->sn, c->B, c->T, c->nh, c->hd, 1);
}

static void run_swiglu(void *c_, float *o) {
    ctx_t *c = c_;
    size_t n = (size_t)c->N;
    kern_swiglu_fwd_avx512(o, c->g, c->u, c->N);
    memcpy(o + n, c->dout, n * sizeof(float));
    memcpy(o + 2 * n, c->dout, n * sizeof(float));
    kern_swiglu_bwd_avx512(o + n, o + 2 * n, c->dout, c->g, c->u, c->N, 1);
}

static void run_ce(void *c_, float *o) {
    ctx_t *c = c_;
    size_t nv = (size_t)c->N * c->V;
    memcpy(o, c->x, nv * sizeof(float));
    long cnt = 0;
    double loss = kern_crossentropy_fwdbwd_avx512(o, c->tgt, c->N, c->V, 1.0f / c->N, &cnt);
    o[nv] = (float)loss;
    o[nv + 1] = (float)(loss - (double)(float)loss); /* the double's low bits too */
    double l2 = kern_crossentropy_fwd_avx512(o + nv + 2, c->x, c->tgt, c->N, c->V);
    o[nv + 2 + c->N] = (float)l2;
}

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
        kern_adamw_step_avx512(&s, o, g, k ? 0.5f : 1.0f, h.lr, &h);
    }
    free(g);
    memcpy(o + n, s.m, n * sizeof(float));
    memcpy(o + 2 * n, s.v, n * sizeof(float));
    adamw_free(&s);
}

static void test_thread_independence(void) {
    uint32_t s = 11;
    ctx_t c = {.B = 2, .T = 67, .nh = 3, .hd = 128, .N = 301, .C = 200, .V = 5003};
    size_t rows = (size_t)c.B * c.T * c.nh, nq = rows * c.hd, nc = (size_t)c.N * c.C;
    size_t big = nq > nc ? nq : nc; /* x, dout serve every case below: rmsnorm N x C, q/k rows, 40000 elements */
    big = big > 40000 ? big : 40000;
    c.x = malloc(big * sizeof(float)), c.dout = malloc(big * sizeof(float)), c.w = malloc(256 * sizeof(float));
    c.g = malloc(big * sizeof(float)), c.u = malloc(big * sizeof(float));
    c.cs = malloc((size_t)c.T * c.hd / 2 * sizeof(float)), c.sn = malloc((size_t)c.T * c.hd / 2 * sizeof(float));
    fill_lcg(c.x, big, &s, -2, 2);
    fill_lcg(c.dout, big, &s, -1, 1);
    fill_lcg(c.w, 256, &s, 0.5f, 1.5f);
    fill_lcg(c.g, big, &s, -8, 8);
    fill_lcg(c.u, big, &s, -2, 2);
    op_rope_tables(c.cs, c.sn, c.T, c.hd, 1e6f);
    same_at_any_threads("rmsnorm fwd+bwd", run_rmsnorm, &c, 2 * (size_t)c.N * c.C + c.N + c.C);
    same_at_any_threads("q/k norm + rope fwd+bwd", run_qknorm_rope, &c, 2 * nq + rows + c.hd);
    c.N = 40000 - 3; /* several element blocks and a tail */
    same_at_any_threads("swiglu fwd+bwd", run_swiglu, &c, 3 * (size_t)c.N);
    same_at_any_threads("adamw", run_adamw, &c, 3 * (size_t)c.N);
    c.N = 7; /* 7 x 5003 logits */
    int32_t tgt[7] = {0, 5002, -100, 17, 2500, 4999, 1};
    c.tgt = tgt;
    same_at_any_threads("crossentropy", run_ce, &c, (size_t)c.N * c.V + 3 + c.N);
    free(c.x), free(c.dout), free(c.w), free(c.g), free(c.u), free(c.cs), free(c.sn);
}

static void test_exact_vs_ref(void) {
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
        kern_adamw_step_avx512(&s2, p2, g2, gs, h.lr, &h);
        for (int i = 0; i < N; i++) zeroed &= g2[i] == 0.0f;
    }
    free(g2);
    CHECK(!memcmp(p1, p2, N * 4) && !memcmp(s1.m, s2.m, N * 4) && !memcmp(s1.v, s2.v, N * 4) && s1.step == s2.step,
          "adamw avx512 is not bit-identical to the reference");
    CHECK(zeroed, "adamw avx512 left gradients unzeroed");
    op_add(o1, a, b, N);
    kern_add_avx512(o2, a, b, N);
    CHECK(!memcmp(o1, o2, N * 4), "add avx512 is not bit-identical to the reference");
    /* embedding: the rows of a 13 x 37 table gathered and scattered back (repeated tokens) */
    int32_t tok[101];
    for (int i = 0; i < 101; i++) tok[i] = (i * 7) % 13;
    float *d1 = calloc(13 * 37, 4), *d2 = calloc(13 * 37, 4);
    op_embedding_fwd(o1, tok, a, 101, 37);
    kern_embedding_fwd_avx512(o2, tok, a, 101, 37);
    CHECK(!memcmp(o1, o2, 101 * 37 * 4), "embedding fwd differs from the reference");
    op_embedding_bwd(d1, b, tok, 101, 37);
    kern_embedding_bwd_avx512(d2, b, tok, 101, 37);
    CHECK(!memcmp(d1, d2, 13 * 37 * 4), "embedding bwd is not bit-identical to the reference");
    adamw_free(&s1);
    adamw_free(&s2);
    free(p1), free(p2), free(g), free(a), free(b), free(o1), free(o2), free(d1), free(d2);
}

typedef struct {
    int B, T, nh, nkv, hd;
    float *q, *k, *v, *g;
    const kern_attn_opt *opt;
} att_ctx;

static void run_attention(void *c_, float *o) {
    att_ctx *c = c_;
    size_t nq = (size_t)c->B * c->T * c->nh * c->hd, nk = (size_t)c->B * c->T * c->nkv * c->hd;
    float *out = o, *lse = o + nq, *dq = lse + (size_t)c->B * c->nh * c->T, *dk = dq + nq, *dv = dk + nk;
    kern_attention_fwd_avx512(out, lse, c->q, c->k, c->v, c->B, c->T, c->nh, c->nkv, c->hd, c->opt);
    kern_attention_bwd_avx512(dq, dk, dv, c->g, out, lse, c->q, c->k, c->v, c->B, c->T, c->nh, c->nkv, c->hd,
                              c->opt, 0); /* overwrites dq, dk, dv */
}

static void test_attention_blocked(void) {
    att_ctx c = {.B = 2, .T = 101, .nh = 4, .nkv = 2, .hd = 64};
    size_t nq = (size_t)c.B * c.T * c.nh * c.hd, nk = (size_t)c.B * c.T * c.nkv * c.hd;
    uint32_t s = 21;
    c.q = malloc(nq * 4), c.k = malloc(nk * 4), c.v = malloc(nk * 4), c.g = malloc(nq * 4);
    fill_lcg(c.q, nq, &s, -2, 2);
    fill_lcg(c.k, nk, &s, -2, 2);
    fill_lcg(c.v, nk, &s, -1, 1);
    fill_lcg(c.g, nq, &s, -1, 1);
    same_at_any_threads("blocked attention fwd+bwd", run_attention, &c,
                        2 * nq + (size_t)c.B * c.nh * c.T + 2 * nk);
    const kern_attn_opt wcap = {0.2f, 37, 5.0f, 0}; /* a family's window and soft cap */
    c.opt = &wcap;
    same_at_any_threads("blocked attention fwd+bwd, window + softcap", run_attention, &c,
                        2 * nq + (size_t)c.B * c.nh * c.T + 2 * nk);
    free(c.q), free(c.k), free(c.v), free(c.g);
}

/* head_dim 64 (the blocked attention's path), GQA, T across its tiles: one
 * forward+backward per checkpointing mode must give mode none's loss and
 * gradients bit for bit (recomputation reruns the same kernels). */
static void test_checkpointing_hd64(void) {
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
        CHECK(kern_select(&m.k, NULL, NULL, 0, &e) == 0, "kern_select: %s", e.msg);
        /* the blocked kernel: with AVX512_BF16 its bf16 build, which is blocked_avx512 in fp32 */
        const char *att = kern_cpu_features() & KERN_FEAT_AVX512BF16 ? "blocked_avx512bf16" : "blocked_avx512";
        CHECK(!strcmp(m.k.chosen[KERN_OP_ATTENTION]->name, att) && !strcmp(m.k.chosen[KERN_OP_ROPE]->name, "avx512"),
              "defaults: attention=%s rope=%s", m.k.chosen[KERN_OP_ATTENTION]->name, m.k.chosen[KERN_OP_ROPE]->name);
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
#if defined(__aarch64__)
    test_exp(kern_exp_neon, "neon"); /* the other NEON kernels: test_neon.c */
    test_tanh(kern_tanh_neon, "neon");
    return CHECK_DONE();
#elif defined(__x86_64__)
    /* the AVX2 exp (avx2_util.h's exp8) to the same bound; the other AVX2 kernels: test_elementwise_avx2.c */
    if ((kern_cpu_features() & (KERN_FEAT_AVX2 | KERN_FEAT_FMA)) == (KERN_FEAT_AVX2 | KERN_FEAT_FMA))
        test_exp(kern_exp_avx2, "avx2"), test_tanh(kern_tanh_avx2, "avx2");
    if ((kern_cpu_features() & KERN_FEAT_AVX512) != KERN_FEAT_AVX512) {
        printf("skip: the AVX-512 kernels (this CPU lacks AVX-512)\n");
        CHECK(1, "nothing to test");
        return CHECK_DONE();
    }
    test_exp(kern_exp_avx512, "avx512");
    test_tanh(kern_tanh_avx512, "avx512");
    test_thread_independence();
    test_exact_vs_ref();
    test_attention_blocked();
    test_checkpointing_hd64();
    return CHECK_DONE();
#else
    CHECK(1, "nothing to test");
    return CHECK_DONE();
#endif
}
