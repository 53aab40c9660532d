/* tests/c/kernels/test_neon.c: the aarch64 build beyond what `kernels check` compares
 * (run under qemu-user by `make test-aarch64`; skips, passing, elsewhere).
 *
 * - feature detection: every aarch64 Linux CPU reports "neon" (ASIMD), the
 *   names of the Arm bits print, and every default the registry picks runs
 *   on this CPU;
 * - the NEON element-wise kernels (elementwise_neon.c on elementwise_vec.inc)
 *   give bit-identical results at 1, 2 and 3 threads, and AdamW, add and the
 *   embedding equal the reference bit for bit;
 * - the grouped MoE experts (grouped_neon, and the bf16 ones) do not depend
 *   on the thread count;
 * - the cross build has no MPI (CT_NO_MPI): a launch under mpirun fails with
 *   a message instead of crashing. (The GEMMs' thread independence is in
 *   test_kernels.c / test_bf16.c, the vector exp's accuracy in
 *   test_elementwise.c.) */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kern_test.h"
#include "distributed/comm.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

#if defined(__aarch64__)
static void test_features(void) {
    unsigned f = kern_cpu_features();
    CHECK(f & KERN_FEAT_NEON, "an aarch64 CPU without ASIMD? features %#x", f);
    char buf[128];
    kern_features_str(KERN_FEAT_NEON | KERN_FEAT_ARM_BF16 | KERN_FEAT_SVE, buf, sizeof buf);
    CHECK(!strcmp(buf, "neon bf16 sve"), "feature names \"%s\"", buf);
    kern_ops k;
    ct_err e = {0};
    CHECK(kern_select(&k, NULL, NULL, 0, &e) == 0, "kern_select: %s", e.msg);
    for (int op = 0; op < KERN_N_OPS; op++)
        CHECK(k.chosen[op] && !(k.chosen[op]->features & ~f), "%s default %s needs features this CPU lacks",
              kern_op_name(op), k.chosen[op] ? k.chosen[op]->name : "-");
    CHECK(!strcmp(k.chosen[KERN_OP_MATMUL]->name, "neon") && !strcmp(k.chosen[KERN_OP_RMSNORM]->name, "neon"),
          "defaults matmul=%s rmsnorm=%s", k.chosen[KERN_OP_MATMUL]->name, k.chosen[KERN_OP_RMSNORM]->name);
    printf("cpu features: %s\n", (kern_features_str(f, buf, sizeof buf), buf));
}

typedef struct {
    int B, T, nh, hd, N, C, V;
    float *x, *w, *dout, *cs, *sn;
    int32_t *tgt;
} ew_ctx;

/* [rmsnorm out | rstd | dx | dw | qknorm out | rstd | dx | dw | swiglu out | dg | du] */
static void run_ew(void *c_, float *o) {
    ew_ctx *c = c_;
    const kern_impl *rn = impl_of(KERN_OP_RMSNORM, "neon"), *rp = impl_of(KERN_OP_ROPE, "neon"),
                    *sw = impl_of(KERN_OP_SWIGLU, "neon");
    size_t nc = (size_t)c->N * c->C, rows = (size_t)c->B * c->T * c->nh, nq = rows * c->hd;
    float *p = o;
    memset(p + 2 * nc + c->N, 0, (size_t)c->C * 4); /* the dw of each norm accumulates (+=) */
    memset(p + 2 * nc + c->N + c->C + 2 * nq + rows, 0, (size_t)c->hd * 4);
    rn->fn.rmsnorm.fwd(p, p + nc, c->x, c->w, c->N, c->C, 1e-6f);
    memcpy(p + nc + c->N, c->dout, nc * 4);
    rn->fn.rmsnorm.bwd(p + nc + c->N, p + 2 * nc + c->N, c->dout, c->x, c->w, p + nc, c->N, c->C);
    p += 2 * nc + c->N + c->C;
    rp->fn.rope.qknorm_fwd(p, p + nq, c->x, c->w, c->cs, c->sn, c->B, c->T, c->nh, c->hd, 1e-6f);
    rp->fn.rope.qknorm_bwd(p + nq + rows, p + 2 * nq + rows, c->dout, c->x, c->w, p + nq, c->cs, c->sn, c->B, c->T,
                           c->nh, c->hd, 0);
    p += 2 * nq + rows + c->hd;
    sw->fn.swiglu.fwd(p, c->x, c->dout, (int)nc);
    sw->fn.swiglu.bwd(p + nc, p + 2 * nc, c->w, c->x, c->dout, (int)nc, 0); /* dout: the first nc of w */
}

/* [dlogits | loss] of the whole-row cross-entropy */
static void run_ce(void *c_, float *o) {
    ew_ctx *c = c_;
    const kern_impl *ce = impl_of(KERN_OP_CROSSENTROPY, "neon");
    memcpy(o, c->x, (size_t)c->N * c->V * 4);
    o[(size_t)c->N * c->V] = (float)ce->fn.crossentropy.fwdbwd(o, c->tgt, c->N, c->V, 0.25f, NULL);
}

static void test_elementwise(void) {
    ew_ctx c = {.B = 2, .T = 37, .nh = 3, .hd = 64, .N = 150, .C = 203, .V = 3001};
    size_t big = 2 * (size_t)c.N * c.V;
    uint32_t s = 7;
    c.x = malloc(big * 4), c.dout = malloc(big * 4), c.w = malloc(big * 4);
    c.cs = malloc((size_t)c.T * c.hd / 2 * 4), c.sn = malloc((size_t)c.T * c.hd / 2 * 4);
    fill_lcg(c.x, big, &s, -3, 3);
    fill_lcg(c.dout, big, &s, -1, 1);
    fill_lcg(c.w, big, &s, 0.5f, 1.5f);
    op_rope_tables(c.cs, c.sn, c.T, c.hd, 1e6f);
    size_t nc = (size_t)c.N * c.C, rows = (size_t)c.B * c.T * c.nh;
    same_at_any_threads("rmsnorm, q/k norm + rope, swiglu", run_ew, &c, 5 * nc + c.N + c.C + 2 * rows * c.hd + rows + c.hd);
    int32_t tgt[150];
    for (int i = 0; i < c.N; i++) tgt[i] = i % 7 == 3 ? -100 : (i * 131) % c.V;
    c.tgt = tgt;
    same_at_any_threads("crossentropy", run_ce, &c, (size_t)c.N * c.V + 1);

    /* AdamW, add, embedding: the reference's operations in its order */
    enum { N = 10007 };
    float *p1 = malloc(N * 4), *p2 = malloc(N * 4), *o1 = malloc(N * 4), *o2 = malloc(N * 4);
    memcpy(p1, c.x, N * 4), memcpy(p2, c.x, N * 4);
    adamw_hparams h = {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    adamw_state s1, s2;
    adamw_init(&s1, N), adamw_init(&s2, N);
    const kern_impl *ad = impl_of(KERN_OP_ADAMW, "neon"), *ai = impl_of(KERN_OP_ADD, "neon"),
                    *em = impl_of(KERN_OP_EMBEDDING, "neon");
    float *g1 = malloc(N * 4), *g2 = malloc(N * 4); /* each step zeroes its gradients */
    int zeroed = 1;
    for (int k = 0; k < 3; k++) {
        memcpy(g1, c.dout + k * N, N * 4), memcpy(g2, c.dout + k * N, N * 4);
        float gs = k == 1 ? 0.3f : 1.0f; /* a clipping coefficient on one step */
        adamw_step(&s1, p1, g1, gs, h.lr, &h);
        ad->fn.adamw.step(&s2, p2, g2, gs, h.lr, &h);
        for (int i = 0; i < N; i++) zeroed &= g2[i] == 0.0f;
    }
    free(g1), free(g2);
    CHECK(zeroed, "adamw neon left gradients unzeroed");
    CHECK(!memcmp(p1, p2, N * 4) && !memcmp(s1.m, s2.m, N * 4) && !memcmp(s1.v, s2.v, N * 4),
          "adamw neon is not bit-identical to the reference");
    op_add(o1, c.x, c.dout, N);
    ai->fn.add.fwd(o2, c.x, c.dout, N);
    CHECK(!memcmp(o1, o2, N * 4), "add neon is not bit-identical to the reference");
    int32_t tok[101];
    for (int i = 0; i < 101; i++) tok[i] = (i * 7) % 13;
    memcpy(o1, c.w, 13 * 37 * 4), memcpy(o2, c.w, 13 * 37 * 4);
    op_embedding_bwd(o1, c.dout, tok, 101, 37);
    em->fn.embedding.bwd(o2, c.dout, tok, 101, 37);
    CHECK(!memcmp(o1, o2, 13 * 37 * 4), "embedding bwd neon is not bit-identical to the reference");
    adamw_free(&s1), adamw_free(&s2);
    free(p1), free(p2), free(o1), free(o2);
    free(c.x), free(c.dout), free(c.w), free(c.cs), free(c.sn);
}

/* One MoE layer's experts: N tokens, top-k of E, routed round-robin. */
typedef struct {
    const kern_impl *im;
    int N, H, I, E, k;
    float *x, *wg, *wu, *wd, *topw, *dout;
    int32_t *perm, *pos, *offsets;
} moe_ctx;

/* [out | gate | up | h | dx | dwg | dwu | dwd | dtopw] */
static void run_moe(void *c_, float *o) {
    moe_ctx *c = c_;
    size_t S = (size_t)c->N * c->k, nx = (size_t)c->N * c->H, ns = S * c->I, nw = (size_t)c->E * c->I * c->H;
    float *out = o, *gate = out + nx, *up = gate + ns, *h = up + ns, *dx = h + ns, *dwg = dx + nx, *dwu = dwg + nw,
          *dwd = dwu + nw, *dtopw = dwd + nw;
    float *work = malloc((2 * S * c->H + 2 * ns) * 4);
    memset(out, 0, nx * 4); /* out, dx and the weight gradients accumulate (+=) */
    memset(dx, 0, (nx + 3 * nw) * 4);
    c->im->fn.moe.fwd(out, gate, up, h, work, c->x, c->wg, c->wu, c->wd, c->perm, c->pos, c->offsets, c->topw, c->N,
                      c->H, c->I, c->E, c->k);
    c->im->fn.moe.bwd(dx, dwg, dwu, dwd, dtopw, work, c->dout, c->x, c->wg, c->wu, c->wd, gate, up, h, c->perm,
                      c->pos, c->offsets, c->topw, c->N, c->H, c->I, c->E, c->k);
    free(work);
}

static void test_moe(void) {
    moe_ctx c = {.N = 97, .H = 40, .I = 24, .E = 4, .k = 2};
    size_t S = (size_t)c.N * c.k, nx = (size_t)c.N * c.H, nw = (size_t)c.E * c.I * c.H, ns = S * c.I;
    uint32_t s = 9;
    c.x = malloc(nx * 4), c.dout = malloc(nx * 4), c.wg = malloc(nw * 4), c.wu = malloc(nw * 4);
    c.wd = malloc(nw * 4), c.topw = malloc(S * 4);
    fill_lcg(c.x, nx, &s, -1, 1), fill_lcg(c.dout, nx, &s, -1, 1), fill_lcg(c.wg, nw, &s, -0.3f, 0.3f);
    fill_lcg(c.wu, nw, &s, -0.3f, 0.3f), fill_lcg(c.wd, nw, &s, -0.3f, 0.3f), fill_lcg(c.topw, S, &s, 0, 1);
    /* choice j of token t goes to expert (t + j) % E; perm lists the choices by expert */
    c.perm = malloc(S * 4), c.pos = malloc(S * 4), c.offsets = malloc((size_t)(c.E + 1) * 4);
    int p = 0;
    for (int e = 0; e < c.E; e++) {
        c.offsets[e] = p;
        for (int t = 0; t < c.N; t++)
            for (int j = 0; j < c.k; j++)
                if ((t + j) % c.E == e) c.perm[p] = t * c.k + j, c.pos[t * c.k + j] = p, p++;
    }
    c.offsets[c.E] = p;
    size_t n = 2 * nx + 3 * ns + 3 * nw + S;
    const struct {
        kern_op op;
        const char *name;
    } impls[] = {{KERN_OP_MOE, "grouped_neon"}, {KERN_OP_MOE_BF16, "grouped_neon"}, {KERN_OP_MOE_BF16, "grouped_bfmmla"}};
    for (int i = 0; i < 3; i++) {
        c.im = impl_of(impls[i].op, impls[i].name);
        if (!c.im || (c.im->features & ~kern_cpu_features())) continue;
        char what[64];
        snprintf(what, sizeof what, "%s %s", kern_op_name(impls[i].op), impls[i].name);
        same_at_any_threads(what, run_moe, &c, n);
    }
    free(c.x), free(c.dout), free(c.wg), free(c.wu), free(c.wd), free(c.topw), free(c.perm), free(c.pos),
        free(c.offsets);
}

static void test_no_mpi(void) {
#ifdef CT_NO_MPI
    ct_comm w;
    ct_err e = {0};
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1); /* as if started by mpirun */
    int rc = comm_init_world(&w, NULL, NULL, &e);
    unsetenv("OMPI_COMM_WORLD_SIZE");
    CHECK(rc != 0 && strstr(e.msg, "without MPI"), "a launch under mpirun without MPI: rc %d, \"%s\"", rc, e.msg);
    CHECK(comm_init_world(&w, NULL, NULL, &e) == 0 && w.size == 1, "the single-process world");
    comm_free(&w);
#endif
}
#endif /* __aarch64__ */

int main(void) {
#if defined(__aarch64__)
    test_features();
    test_elementwise();
    test_moe();
    test_no_mpi();
#else
    printf("skip: the NEON kernels (not aarch64)\n");
    CHECK(1, "nothing to test");
#endif
    return CHECK_DONE();
}
