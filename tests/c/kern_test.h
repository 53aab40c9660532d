/* tests/c/kern_test.h: the helpers the kernel tests share (include after check.h).
 *
 * fill_lcg            pseudo-random floats in [lo, hi) from a 32-bit LCG (a
 *                     fixed sequence per seed, no global state);
 * impl_of             a registry entry by (op, name), a failed CHECK if absent;
 * same_at_any_threads runs a kernel at 1, 2 and 3 OpenMP threads and checks
 *                     the outputs are equal byte for byte (the kernels' contract:
 *                     results do not depend on the thread count). */
#ifndef CT_TESTS_KERN_TEST_H
#define CT_TESTS_KERN_TEST_H

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/registry.h"

__attribute__((unused)) static void fill_lcg(float *p, size_t n, uint32_t *s, float lo, float hi) {
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        p[i] = lo + (hi - lo) * (float)(*s >> 8) * (1.0f / 16777216.0f);
    }
}

/* The registry entry (op, name); NULL (and a failed check) if it is missing. */
__attribute__((unused)) static const kern_impl *impl_of(kern_op op, const char *name) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    for (size_t i = 0; i < n; i++)
        if (t[i].op == op && !strcmp(t[i].name, name)) return &t[i];
    CHECK(0, "no %s=%s in the registry", kern_op_name(op), name);
    return NULL;
}

typedef void (*run_fn)(void *ctx, float *out);

/* Runs `f` at 1, 2 and 3 threads; each run fills out[run] (n floats) from the
 * same inputs; all three must be equal byte for byte. */
__attribute__((unused)) static void same_at_any_threads(const char *what, run_fn f, void *ctx, size_t n) {
    int saved = omp_get_max_threads();
    float *out[3];
    for (int th = 0; th < 3; th++) {
        out[th] = malloc((n ? n : 1) * sizeof(float)); /* not zeroed: an element a kernel leaves unwritten differs */
        omp_set_num_threads(th + 1);
        f(ctx, out[th]);
    }
    omp_set_num_threads(saved);
    CHECK(!memcmp(out[0], out[1], n * sizeof(float)) && !memcmp(out[0], out[2], n * sizeof(float)),
          "%s differs between 1, 2 and 3 threads", what);
    for (int th = 0; th < 3; th++) free(out[th]);
}

#endif
