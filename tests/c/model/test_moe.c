/* tests/c/model/test_moe.c: the router's choice where probabilities tie. transformers
 * and torchtitan take torch.topk, whose order among equal values is unspecified (on
 * this CPU it returned [2, 3, 0, 1] for four equal probabilities), so no oracle fixes
 * it; ctitan's rule (model/moe.h, docs/moe.md) is descending probability with ties to
 * the lower expert index, which makes a route the same on every machine. Checked on
 * a router whose logits are exactly [1, 2, 2, 0] for every token and on an all-zero
 * router (a uniform softmax), with the weights the chosen probabilities. The
 * comparison of whole MoE layers with transformers is tests/py/test_moe.py. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/registry.h"
#include "model/moe.h"

/* Routes N tokens of one feature (x = 1) through a router of logits w[E]; fills topi [N*k]. */
static void route(const float *w, int E, int k, int N, int norm, int32_t *topi, float *topw) {
    kern_ops ops;
    kern_select_ref(&ops);
    float *x = malloc((size_t)N * sizeof(float)), *mem = calloc(moe_route_floats(N, E, k), sizeof(float));
    for (int t = 0; t < N; t++) x[t] = 1.0f;
    moe_route r;
    moe_route_bind(&r, mem, N, E, k);
    moe_route_fwd(&ops, &r, x, w, NULL, NULL, N, 1, E, k, norm);
    memcpy(topi, r.topi, (size_t)N * k * sizeof(int32_t));
    memcpy(topw, r.topw, (size_t)N * k * sizeof(float));
    free(x);
    free(mem);
}

static void test_ties_to_the_lower_index(void) {
    enum { N = 3 };
    int32_t ix[N * 4];
    float wt[N * 4];
    const float w[4] = {1, 2, 2, 0};
    double z = exp(1.0) + 2 * exp(2.0) + 1; /* softmax's denominator */
    route(w, 4, 3, N, 0, ix, wt);
    for (int t = 0; t < N; t++) {
        CHECK(ix[3 * t] == 1 && ix[3 * t + 1] == 2 && ix[3 * t + 2] == 0,
              "token %d: logits [1, 2, 2, 0], top 3 = [%d, %d, %d], want [1, 2, 0]", t, ix[3 * t], ix[3 * t + 1],
              ix[3 * t + 2]);
        CHECK_CLOSE(wt[3 * t], exp(2.0) / z, 1e-6);
        CHECK_CLOSE(wt[3 * t + 2], exp(1.0) / z, 1e-6);
    }
    const float zero[8] = {0};
    route(zero, 8, 4, N, 1, ix, wt);
    for (int t = 0; t < N; t++) {
        CHECK(ix[4 * t] == 0 && ix[4 * t + 1] == 1 && ix[4 * t + 2] == 2 && ix[4 * t + 3] == 3,
              "token %d: a uniform router, top 4 of 8 = [%d, %d, %d, %d], want [0, 1, 2, 3]", t, ix[4 * t],
              ix[4 * t + 1], ix[4 * t + 2], ix[4 * t + 3]);
        for (int j = 0; j < 4; j++) CHECK_CLOSE(wt[4 * t + j], 0.25, 1e-7);
    }
}

int main(void) {
    test_ties_to_the_lower_index();
    return CHECK_DONE();
}
