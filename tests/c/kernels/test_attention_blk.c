/* tests/c/kernels/test_attention_blk.c: the block form of attention (ops.h,
 * kern_attn_blk), as ring attention uses it (distributed/cp.c), for every registered
 * implementation with a block form of its own that this CPU runs (the reference, the
 * tiled pair and its AVX-512 copy, the register-blocked kernels):
 *
 * - a headtail chunk's pieces against every rank's chunk, taken in ring order
 *   (each rank's own first) and merged by online softmax, then finished, give the
 *   offset form's rows (op_attention_fwd_q0 over the piece's whole prefix), with
 *   and without a window and a soft cap; the blocks' backward sums to its dq and
 *   to its dk, dv of the prefix; in pieces of 5 rows (inside a tile) and of 70 (past a
 *   64-key tile and a 32-row query tile, pieces starting inside tiles), head dims 8 and
 *   64 (the register-blocked kernels' path), GQA groups of 2 and 3, a window that
 *   crosses the blocks' edges, scale with a soft cap, bf16 products;
 * - a block wholly in the pieces' future, or left of every row's window, leaves
 *   acc, m, l and the gradients bit for bit as they were. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

typedef struct {
    const char *name;
    void (*fwd)(float *, float *, float *, const float *, const float *, const float *, const kern_attn_blk *,
                const kern_attn_opt *);
    void (*bwd)(float *, float *, float *, const float *, const float *, const float *, const float *, const float *,
                const float *, const kern_attn_blk *, const kern_attn_opt *);
} blk_impl;

static float *randn(ct_rng *r, size_t n) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)ct_rng_normal(r);
    return x;
}

/* max |a - b| / max |b| over n */
static double rel_err(const float *a, const float *b, size_t n) {
    double e = 0, m = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        e = d > e ? d : e;
        m = fabs(b[i]) > m ? fabs(b[i]) : m;
    }
    return e / m;
}

/* B, nh, nkv, hd and the piece's rows L of a check_piece */
typedef struct {
    int B, nh, nkv, hd, L;
} blk_shape;

/* Piece at position pq (L rows of the whole sequence's q [B, T, ...]) against the whole
 * sequence cut into 2n pieces of L keys, in ring order from `first`; compared with the
 * offset form over the prefix pq + L. */
static void check_piece(const blk_impl *im, ct_rng *r, const blk_shape *sh, int n, int piece,
                        const kern_attn_opt *o) {
    int B = sh->B, nh = sh->nh, nkv = sh->nkv, hd = sh->hd, L = sh->L, T = 2 * n * L, pq = piece * L, Tk = pq + L;
    size_t qd = (size_t)nh * hd, kvd = (size_t)nkv * hd;
    float *q = randn(r, (size_t)B * T * qd), *k = randn(r, (size_t)B * T * kvd), *v = randn(r, (size_t)B * T * kvd);
    float *dout = randn(r, (size_t)B * T * qd);
    if (kern_attn_bf16(o)) /* the contract's bf16 operands */
        ct_round_bf16(q, (size_t)B * T * qd), ct_round_bf16(k, (size_t)B * T * kvd),
            ct_round_bf16(v, (size_t)B * T * kvd), ct_round_bf16(dout, (size_t)B * T * qd);
    /* the offset form's inputs: the piece's rows, the prefix's keys */
    float *qp = malloc((size_t)B * L * qd * sizeof(float)), *dp = malloc((size_t)B * L * qd * sizeof(float));
    float *kp = malloc((size_t)B * Tk * kvd * sizeof(float)), *vp = malloc((size_t)B * Tk * kvd * sizeof(float));
    for (int b = 0; b < B; b++) {
        memcpy(qp + (size_t)b * L * qd, q + ((size_t)b * T + pq) * qd, (size_t)L * qd * sizeof(float));
        memcpy(dp + (size_t)b * L * qd, dout + ((size_t)b * T + pq) * qd, (size_t)L * qd * sizeof(float));
        memcpy(kp + (size_t)b * Tk * kvd, k + (size_t)b * T * kvd, (size_t)Tk * kvd * sizeof(float));
        memcpy(vp + (size_t)b * Tk * kvd, v + (size_t)b * T * kvd, (size_t)Tk * kvd * sizeof(float));
    }
    size_t nq = (size_t)B * L * qd, nk = (size_t)B * Tk * kvd, nl = (size_t)B * nh * L;
    float *out1 = malloc(nq * sizeof(float)), *lse1 = malloc(nl * sizeof(float));
    float *dq1 = malloc(nq * sizeof(float)), *dk1 = malloc(nk * sizeof(float)), *dv1 = malloc(nk * sizeof(float));
    op_attention_fwd_q0(out1, lse1, qp, kp, vp, B, L, Tk, nh, nkv, hd, o);
    op_attention_bwd_q0(dq1, dk1, dv1, dp, out1, lse1, qp, kp, vp, B, L, Tk, nh, nkv, hd, o, 0);
    /* the blocks: acc, m, l in the piece's own buffers (ldq L), keys in place in k (ldk T) */
    float *acc = calloc(nq, sizeof(float)), *m = malloc(nl * sizeof(float)), *l = calloc(nl, sizeof(float));
    for (size_t i = 0; i < nl; i++) m[i] = -INFINITY;
    float *dq2 = calloc(nq, sizeof(float)), *dk2 = calloc((size_t)B * T * kvd, sizeof(float));
    float *dv2 = calloc((size_t)B * T * kvd, sizeof(float)), *D = malloc(nl * sizeof(float));
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            kern_attn_blk g = {B, nh, nkv, hd, L, pq, L, 0, 0, T};
            op_attention_blk_finish(acc, m, l, &g);
            op_attention_blk_rowdot(D, dp, acc, &g);
        }
        for (int s = 0; s < 2 * n; s++) {
            int bk = (piece + s) % (2 * n); /* the order the ring brings them: own first */
            kern_attn_blk g = {B, nh, nkv, hd, L, pq, L, L, bk * L, T};
            const float *kb = k + (size_t)bk * L * kvd, *vb = v + (size_t)bk * L * kvd;
            if (pass == 0)
                im->fwd(acc, m, l, qp, kb, vb, &g, o);
            else
                im->bwd(dq2, dk2 + (size_t)bk * L * kvd, dv2 + (size_t)bk * L * kvd, dp, m, D, qp, kb, vb, &g, o);
        }
    }
    /* dk2 [B, T]: the prefix's rows are dk1's, the rest zero */
    float *dk2p = malloc(nk * sizeof(float)), *dv2p = malloc(nk * sizeof(float));
    double tail = 0;
    for (int b = 0; b < B; b++) {
        memcpy(dk2p + (size_t)b * Tk * kvd, dk2 + (size_t)b * T * kvd, (size_t)Tk * kvd * sizeof(float));
        memcpy(dv2p + (size_t)b * Tk * kvd, dv2 + (size_t)b * T * kvd, (size_t)Tk * kvd * sizeof(float));
        for (size_t i = (size_t)Tk * kvd; i < (size_t)T * kvd; i++)
            tail += fabs(dk2[(size_t)b * T * kvd + i]) + fabs(dv2[(size_t)b * T * kvd + i]);
    }
    int w = o ? o->window : 0;
    const char *nm = im->name;
    /* bf16: P and dS rounded to bf16 from fp32 values that differ in the last bits flip
     * some roundings (registry.h's bound for the bf16 kernels) */
    double bt = kern_attn_bf16(o) ? KERN_ATTN_BF16_TOL : 1e-5;
    CHECK(rel_err(acc, out1, nq) <= 1e-5, "%s L %d hd %d n %d piece %d window %d: out err %.3g", nm, L, hd, n,
          piece, w, rel_err(acc, out1, nq));
    CHECK(rel_err(m, lse1, nl) <= 1e-5, "%s L %d hd %d n %d piece %d window %d: lse err %.3g", nm, L, hd, n, piece,
          w, rel_err(m, lse1, nl));
    CHECK(rel_err(dq2, dq1, nq) <= bt, "%s L %d hd %d n %d piece %d window %d: dq err %.3g", nm, L, hd, n, piece,
          w, rel_err(dq2, dq1, nq));
    CHECK(rel_err(dk2p, dk1, nk) <= bt, "%s L %d hd %d n %d piece %d window %d: dk err %.3g", nm, L, hd, n,
          piece, w, rel_err(dk2p, dk1, nk));
    CHECK(rel_err(dv2p, dv1, nk) <= bt, "%s L %d hd %d n %d piece %d window %d: dv err %.3g", nm, L, hd, n,
          piece, w, rel_err(dv2p, dv1, nk));
    CHECK(tail == 0.0, "%s n %d piece %d: the future's keys got gradients (%g)", nm, n, piece, tail);
    float *f[] = {q, k, v, dout, qp, dp, kp, vp, out1, lse1, dq1, dk1, dv1, acc, m, l, dq2, dk2, dv2, D, dk2p, dv2p};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) free(f[i]);
}

/* A block that no row sees (in the future; left of the window) changes nothing. */
static void check_untouched(const blk_impl *im, ct_rng *r) {
    int B = 1, nh = 2, nkv = 1, hd = 4, L = 6;
    size_t nq = (size_t)B * L * nh * hd, nk = (size_t)B * L * nkv * hd, nl = (size_t)B * nh * L;
    float *q = randn(r, nq), *k = randn(r, nk), *v = randn(r, nk), *acc = randn(r, nq), *m = randn(r, nl);
    float *l = randn(r, nl), *dq = randn(r, nq), *dk = randn(r, nk), *dv = randn(r, nk), *D = randn(r, nl);
    float *c[] = {acc, m, l, dq, dk, dv}, *keep[6];
    size_t sz[] = {nq, nl, nl, nq, nk, nk};
    for (int i = 0; i < 6; i++) keep[i] = malloc(sz[i] * sizeof(float)), memcpy(keep[i], c[i], sz[i] * sizeof(float));
    kern_attn_opt win = {0.0f, 4, 0.0f, 0};
    struct {
        int q0, k0;
        const kern_attn_opt *o;
    } cases[] = {{12, 18, NULL}, {12, 13, NULL}, {20, 6, &win}, {20, 14, &win}};
    for (size_t t = 0; t < sizeof cases / sizeof *cases; t++) {
        kern_attn_blk g = {B, nh, nkv, hd, L, cases[t].q0, L, L, cases[t].k0, L};
        int any = 0; /* whether some row sees some key: the first row's window or the last row's prefix */
        for (int rr = 0; rr < L; rr++)
            for (int j = 0; j < L; j++) {
                int tq = cases[t].q0 + rr, pk = cases[t].k0 + j, wd = cases[t].o ? cases[t].o->window : 0;
                any |= pk <= tq && !(wd > 0 && pk <= tq - wd);
            }
        im->fwd(acc, m, l, q, k, v, &g, cases[t].o);
        im->bwd(dq, dk, dv, q, m, D, q, k, v, &g, cases[t].o);
        int same = 1;
        for (int i = 0; i < 6; i++) same &= !memcmp(keep[i], c[i], sz[i] * sizeof(float));
        CHECK(any || same, "%s case %zu: a block no row sees changed the state", im->name, t);
        if (any) /* the partly visible cases change it: restore */
            for (int i = 0; i < 6; i++) memcpy(c[i], keep[i], sz[i] * sizeof(float));
        CHECK(any == (t == 1 || t == 3), "case %zu: visibility %d", t, any);
    }
    float *f[] = {q, k, v, acc, m, l, dq, dk, dv, D};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) free(f[i]);
    for (int i = 0; i < 6; i++) free(keep[i]);
}

int main(void) {
    ct_rng r;
    ct_rng_seed(&r, 77);
    kern_attn_opt win = {0.0f, 7, 0.0f, 0}, cap = {0.3f, 0, 2.0f, 0};
    /* L 70: a window of 90 reaches back across one block's edge; with a cap; bf16 */
    kern_attn_opt win90 = {0.0f, 90, 0.0f, 0}, wcap = {0.2f, 90, 3.0f, 0}, b16 = {0.0f, 0, 0.0f, 1};
    kern_attn_opt b16w = {0.0f, 90, 5.0f, 1};
    const kern_attn_opt *small[] = {NULL, &win, &cap}, *big[] = {NULL, &win90, &wcap, &cap, &b16, &b16w};
    blk_shape s5 = {2, 4, 2, 8, 5}, s70 = {1, 6, 2, 64, 70}, s70b = {2, 3, 1, 128, 70};
    blk_impl impls[16];
    int n_impl = 0;
    size_t nreg;
    const kern_impl *reg = kern_registry(&nreg);
    unsigned feat = kern_cpu_features();
    for (size_t i = 0; i < nreg && n_impl < 16; i++)
        if (reg[i].op == KERN_OP_ATTENTION && reg[i].fn.attention.fwd_blk && (reg[i].features & ~feat) == 0)
            impls[n_impl++] = (blk_impl){reg[i].name, reg[i].fn.attention.fwd_blk, reg[i].fn.attention.bwd_blk};
    CHECK(n_impl >= 2, "the registry lists %d block forms (ref and tiled at least)", n_impl);
    /* Under qemu (scripts/test_aarch64.sh) each block form is ~1/3 of this test's 53 s; ref's and
     * tiled's are portable C, which the native run checks the same way */
    int emu = getenv("CTITAN_EMULATED") != NULL;
    if (emu) printf("skip under emulation: the portable block forms (ref, tiled), checked by the native run\n");
    /* Under the sanitizers (make sanitize sets CTITAN_SANITIZE) they look for memory and UB errors,
     * which follow the source, not the target it was compiled for: tiled_avx512 is "tiled"'s
     * source (attention_blk_tiled.inc) again, and of the 70-row pieces the last two reach between
     * them every kind of block (the future: piece 2; wholly left of a window: piece 3; partly
     * seen, past and diagonal: both, at head dims 64 and 128); the first two were half of this
     * test's ~43 CPU s under ASan. */
    int san = getenv("CTITAN_SANITIZE") != NULL;
    if (san)
        printf("skip under the sanitizers: tiled_avx512 (tiled's source again), and the 70-row pieces 0 and 1 "
               "(pieces 2 and 3 reach every kind of block)\n");
    for (int i = 0; i < n_impl; i++) {
        if (emu && (!strcmp(impls[i].name, "ref") || !strcmp(impls[i].name, "tiled"))) continue;
        if (san && !strcmp(impls[i].name, "tiled_avx512")) continue;
        for (int n = 2; n <= 4; n += 2)
            for (int piece = 0; piece < 2 * n; piece++)
                for (size_t o = 0; o < sizeof small / sizeof *small; o++)
                    check_piece(&impls[i], &r, &s5, n, piece, small[o]);
        for (int piece = san ? 2 : 0; piece < 4; piece++)
            for (size_t o = 0; o < sizeof big / sizeof *big; o++)
                check_piece(&impls[i], &r, piece % 2 ? &s70b : &s70, 2, piece, big[o]);
        check_untouched(&impls[i], &r);
    }
    return CHECK_DONE();
}
