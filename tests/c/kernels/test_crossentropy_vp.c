/* tests/c/kernels/test_crossentropy_vp.c: the vocabulary-parallel cross-entropy
 * phases (op_crossentropy_vp_* and every registered implementation of them)
 * against the whole-row kernel, with the ranks simulated in one process.
 *
 * `kernels check` compares each implementation with the reference phase by
 * phase; this checks the contract itself, for the reference too:
 * - R ranks each holding V columns, combined as the model's hooks combine
 *   them (max, then sums in rank order), give the loss, the valid count and
 *   the gradient of the implementation's own whole-row fwdbwd on the R*V
 *   columns (1e-5; the sums are split differently), every rank the same loss;
 * - one rank holding everything is that whole-row kernel bit for bit (same
 *   operations in the same order), which ties the reference to
 *   op_crossentropy_fwdbwd and so to the PyTorch parity tests;
 * - rows with target -100 come back zero; the results are bit-identical at
 *   1, 2 and 3 threads (resume tests rely on reruns matching). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kern_test.h"
#include "kernels/ops.h"
#include "kernels/registry.h"


/* The R ranks of a tensor-parallel loss on logits[N, R*V]: grad[N, R*V]
 * receives the ranks' gradients side by side; returns rank 0's loss, and
 * checks that every rank returned the same loss and count. */
static double vp_ranks(float *grad, long *count, const kern_impl *im, const float *logits, const int32_t *tgt, int N,
                       int V, int R, float scale) {
    size_t Vt = (size_t)V * R;
    float *part = malloc((size_t)R * N * V * sizeof(float)); // [R, N, V]: each rank's columns
    float *mx = malloc((size_t)R * N * sizeof(float)), *se = malloc((size_t)R * N * sizeof(float));
    float *tl = malloc((size_t)R * N * sizeof(float)); // [R, N] each: per-rank stats before the reduction
    float *gmx = malloc((size_t)N * sizeof(float)), *gse = malloc((size_t)N * sizeof(float));
    float *gtl = malloc((size_t)N * sizeof(float)); // [N]: after it
    for (int r = 0; r < R; r++)
        for (int n = 0; n < N; n++)
            memcpy(part + ((size_t)r * N + n) * V, logits + n * Vt + (size_t)r * V, (size_t)V * sizeof(float));
    for (int r = 0; r < R; r++) im->fn.crossentropy.vp_max(mx + (size_t)r * N, part + (size_t)r * N * V, N, V);
    for (int n = 0; n < N; n++) {
        gmx[n] = mx[n];
        for (int r = 1; r < R; r++) gmx[n] = fmaxf(gmx[n], mx[(size_t)r * N + n]);
    }
    for (int r = 0; r < R; r++)
        im->fn.crossentropy.vp_sums(se + (size_t)r * N, tl + (size_t)r * N, part + (size_t)r * N * V, gmx, tgt, N, V,
                                    r * V);
    for (int n = 0; n < N; n++) {
        gse[n] = se[n], gtl[n] = tl[n];
        for (int r = 1; r < R; r++) gse[n] += se[(size_t)r * N + n], gtl[n] += tl[(size_t)r * N + n];
    }
    double loss0 = 0;
    long c0 = 0;
    for (int r = 0; r < R; r++) {
        long c = 0;
        double loss = im->fn.crossentropy.vp_grad(part + (size_t)r * N * V, gmx, gse, gtl, tgt, N, V, r * V, scale,
                                                  &c);
        if (r == 0) loss0 = loss, c0 = c;
        CHECK(loss == loss0 && c == c0, "%s: rank %d's loss %.17g (count %ld) vs rank 0's %.17g (%ld)", im->name, r,
              loss, c, loss0, c0);
    }
    for (int r = 0; r < R; r++)
        for (int n = 0; n < N; n++)
            memcpy(grad + n * Vt + (size_t)r * V, part + ((size_t)r * N + n) * V, (size_t)V * sizeof(float));
    *count += c0;
    free(part), free(mx), free(se), free(tl), free(gmx), free(gse), free(gtl);
    return loss0;
}

static void test_impl(const kern_impl *im, int N, int V, int R) {
    size_t Vt = (size_t)V * R, nv = (size_t)N * Vt;
    uint32_t s = 7;
    float *x = malloc(nv * sizeof(float)), *want = malloc(nv * sizeof(float)), *got = malloc(nv * sizeof(float));
    fill_lcg(x, nv, &s, -6, 6);
    int32_t *tgt = malloc((size_t)N * sizeof(int32_t));
    /* every rank's first and last column (the edges of the local index), -100, anywhere */
    for (int n = 0; n < N; n++) {
        int r = (n / 5) % R;
        switch (n % 5) {
        case 0: tgt[n] = r * V; break;
        case 1: tgt[n] = r * V + V - 1; break;
        case 3: tgt[n] = -100; break;
        default: tgt[n] = (int32_t)((n * 7919u + 13u) % Vt); break;
        }
    }
    float scale = 1.0f / (float)N;
    memcpy(want, x, nv * sizeof(float));
    long cw = 0, cg = 0;
    double lw = im->fn.crossentropy.fwdbwd(want, tgt, N, (int)Vt, scale, &cw);

    double lg = vp_ranks(got, &cg, im, x, tgt, N, V, R, scale);
    double emax = 0, rmax = 0;
    for (size_t i = 0; i < nv; i++) {
        emax = fmax(emax, fabs((double)got[i] - want[i]));
        rmax = fmax(rmax, fabs((double)want[i]));
    }
    CHECK(emax <= 1e-5 * rmax, "%s N=%d V=%d R=%d: gradient differs from the whole-row kernel by %.3g of max %.3g",
          im->name, N, V, R, emax, rmax);
    CHECK(fabs(lg - lw) <= 1e-5 * fabs(lw), "%s N=%d V=%d R=%d: loss %.9g vs whole-row %.9g", im->name, N, V, R, lg,
          lw);
    CHECK(cg == cw, "%s: count %ld vs %ld", im->name, cg, cw);
    int zero = 1;
    for (int n = 0; n < N; n++)
        for (size_t i = 0; tgt[n] == -100 && i < Vt; i++) zero &= got[n * Vt + i] == 0.0f;
    CHECK(zero, "%s: rows with target -100 must come back zero", im->name);

    /* one rank holding every column: the whole-row kernel, bit for bit */
    cg = 0;
    lg = vp_ranks(got, &cg, im, x, tgt, N, (int)Vt, 1, scale);
    CHECK(lg == lw && cg == cw && !memcmp(got, want, nv * sizeof(float)),
          "%s N=%d V=%zu: one rank differs from the whole-row kernel (loss %.17g vs %.17g)", im->name, N, Vt, lg, lw);

    /* thread-count independence of the R-rank run */
    int saved = omp_get_max_threads();
    float *again = malloc(nv * sizeof(float));
    omp_set_num_threads(1);
    cg = 0;
    lw = vp_ranks(want, &cg, im, x, tgt, N, V, R, scale);
    for (int th = 2; th <= 3; th++) {
        omp_set_num_threads(th);
        cg = 0;
        lg = vp_ranks(again, &cg, im, x, tgt, N, V, R, scale);
        CHECK(lg == lw && !memcmp(again, want, nv * sizeof(float)), "%s: %d threads differ from 1", im->name, th);
    }
    omp_set_num_threads(saved);
    free(x), free(want), free(got), free(tgt), free(again);
}

int main(void) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    int tested = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i].op != KERN_OP_CROSSENTROPY) continue;
        if (t[i].features & ~cpu) {
            printf("skip: crossentropy=%s (this CPU lacks its features)\n", t[i].name);
            continue;
        }
        CHECK(t[i].fn.crossentropy.vp_max && t[i].fn.crossentropy.vp_sums && t[i].fn.crossentropy.vp_grad,
              "crossentropy=%s registers no vocabulary-parallel phases", t[i].name);
        if (!t[i].fn.crossentropy.vp_grad) continue;
        test_impl(&t[i], 15, 37, 3);   /* masked tails only, -100 rows, targets on every rank */
        test_impl(&t[i], 6, 1000, 2);  /* several 64-column blocks per rank */
        test_impl(&t[i], 1, 16, 4);    /* one row, exactly one vector per rank */
        tested++;
    }
    CHECK(tested >= 1, "no crossentropy implementation ran");
    return CHECK_DONE();
}
