/* tests/c/optim/test_optim.c: optim_grad_norm (optim/optim.c), the global norm that
 * clipping divides by.
 *
 * Against a long double sum of the same squares (its own order: the fixed
 * order of the function is an implementation choice, the value is not), on
 * lengths around its 2^16 blocks and its 16 lanes; bitwise equal at 1, 2 and
 * 3 threads (the blocks, not the threads, fix the order) and with the
 * portable loop (CTITAN_ISA=ref) against the CPU's vector one (the lanes, not
 * the instructions, fix it); 0 for no gradients. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kern_test.h"
#include "core/rng.h"
#include "optim/optim.h"

static long double ref_norm(const float *g, size_t n) {
    long double s = 0;
    for (size_t i = 0; i < n; i++) s += (long double)g[i] * g[i];
    return sqrtl(s);
}

typedef struct {
    const float *g;
    size_t n;
} norm_case;

static void run_norm(void *ctx, float *out) { /* the double's bytes, for same_at_any_threads */
    const norm_case *c = ctx;
    double v = optim_grad_norm(c->g, c->n);
    memcpy(out, &v, sizeof v);
}

static void test_norm(ct_rng *r, size_t n) {
    float *g = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) g[i] = (float)ct_rng_normal(r) * (i % 3 ? 1e-3f : 2.0f);
    norm_case c = {g, n};
    char what[64];
    snprintf(what, sizeof what, "the norm of %zu gradients", n);
    same_at_any_threads(what, run_norm, &c, sizeof(double) / sizeof(float));
    double got = optim_grad_norm(g, n);
    const char *isa = getenv("CTITAN_ISA"); /* a lane of make test may set it: put it back */
    char *was = isa ? strdup(isa) : NULL;
    setenv("CTITAN_ISA", "ref", 1);
    double portable = optim_grad_norm(g, n);
    if (was) setenv("CTITAN_ISA", was, 1);
    else unsetenv("CTITAN_ISA");
    free(was);
    CHECK(!memcmp(&got, &portable, sizeof got), "n %zu: %.17g on this CPU's loop, %.17g on the portable one", n, got,
          portable);
    long double want = ref_norm(g, n);
    CHECK(fabsl(got - want) <= 1e-14L * want, "n %zu: %.17g against %.17Lg", n, got, want);
    free(g);
}

/* The clipping coefficient is torch.nn.utils.clip_grad_norm_'s: max_norm /
 * (norm + 1e-6), capped at 1 (torch/nn/utils/clip_grad.py). At a norm near
 * the 1e-6 its constant matters: 1e-5 in its place went unnoticed by the
 * training tests, where norms are of order 1 (a mutation audit). */
static void test_clip_scale(void) {
    const double cases[][2] = {{5e-5, 1e-5}, {3.0, 1.0}, {2e-6, 1e-6}, {0.5, 1.0}, {7.0, 0.0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double norm = cases[i][0], max_norm = cases[i][1];
        double want = max_norm <= 0 ? 1.0 : fmin(max_norm / (norm + 1e-6), 1.0); /* max_norm 0: no clipping */
        float got = optim_clip_scale(norm, max_norm);
        CHECK(fabs(got - want) <= 1e-6 * want, "clip scale at norm %g, max_norm %g: %.9g, torch's formula %.9g", norm,
              max_norm, got, want);
    }
}

int main(void) {
    test_clip_scale();
    ct_rng r;
    ct_rng_seed(&r, 7);
    CHECK(optim_grad_norm(NULL, 0) == 0.0, "no gradients: a norm of 0");
    size_t sizes[] = {1, 7, 8, 9, 15, 16, 17, 33, 4095, 65536, 65537, 4 * 65536 + 3, 5 * 65536 + 12345};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) test_norm(&r, sizes[i]);
    return CHECK_DONE();
}
