/* tests/c/model/test_audit11_wstore_reserve.c: a zero-bubble store that was not sized to
 * what it holds (lm_wstore_reserve with too few records and floats) grows while I records
 * into it, and W then gives the same weight gradients, bit for bit, as a store sized by
 * lm_wstore_floats first (pp.c's take_wstore). The eleventh mutation audit found that a
 * reserve dropping the records already kept when it grows the record array passed the
 * suite: every store the suite builds is sized first (or holds under 64 records), so the
 * growth path with records in it never ran. Here it runs from a capacity of 2 records. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "model/lm.h"

/* The weight gradients [n_params] of one I + W over layers [0, L) through store st. */
static void grads_via(lm_model *m, lm_wstore *st, const int32_t *tok, const int32_t *lab, const float *x,
                      float *xo, float *din, int B, int T, float *out) {
    int L = m->cfg.n_layers;
    memset(m->grads, 0, m->n_params * sizeof(float));
    lm_stage_forward(m, 0, L, tok, x, xo, B, T, 1);
    m->wdefer = st;
    lm_stage_backward(m, 0, L, tok, lab, NULL, din, B, T, 1.0f / 32, NULL);
    m->wdefer = NULL;
    lm_stage_backward_weight(m, st, 0, L);
    memcpy(out, m->grads, m->n_params * sizeof(float));
}

int main(void) {
    lm_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 29, c.hidden = 16, c.intermediate = 24, c.n_layers = 3, c.n_heads = 2, c.n_kv_heads = 1;
    c.head_dim = 8, c.max_pos = 64, c.rope_theta = 1e4, c.rms_eps = 1e-6, c.decoder_sparse_step = 1;
    c.lazy_buffers = 1;
    snprintf(c.name, sizeof c.name, "tiny");
    int B = 2, T = 5, L = c.n_layers;
    lm_model m;
    ct_err e;
    CHECK(lm_create(&m, &c, B, T, &e) == 0, "%s", e.msg);
    lm_init_random(&m, 3);
    size_t BT = (size_t)B * T, n = BT * (size_t)c.hidden;
    int32_t *tok = malloc(BT * sizeof *tok), *lab = malloc(BT * sizeof *lab);
    float *x = calloc(n, sizeof(float)), *xo = malloc(n * sizeof(float)), *din = malloc(n * sizeof(float));
    for (size_t i = 0; i < BT; i++) tok[i] = (int32_t)((i * 7 + 3) % 29), lab[i] = (int32_t)((i * 5 + 1) % 29);
    float *sized = malloc(m.n_params * sizeof(float)), *grown = malloc(m.n_params * sizeof(float));
    lm_wstore a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    lm_wstore_reserve(&a, lm_wstore_floats(&m, 0, L, BT), 12 * L); /* as take_wstore sizes it */
    lm_wstore_reserve(&b, 16, 2);                                   /* far too small: grows while recording */
    grads_via(&m, &a, tok, lab, x, xo, din, B, T, sized);
    CHECK(a.size == lm_wstore_floats(&m, 0, L, BT), "the sized store grew: %zu floats", a.size);
    grads_via(&m, &b, tok, lab, x, xo, din, B, T, grown);
    CHECK(b.cap > 2 && b.size > 16, "test setup: the small store did not grow (cap %d, size %zu)", b.cap, b.size);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < m.n_params; i++)
        if (memcmp(&sized[i], &grown[i], sizeof(float)) != 0 && !bad++) first = i;
    CHECK(bad == 0, "%zu of %zu weight gradients differ after the store grew (first at %zu: %g vs %g)", bad,
          m.n_params, first, (double)grown[first], (double)sized[first]);
    lm_wstore_free(&a);
    lm_wstore_free(&b);
    free(tok), free(lab), free(x), free(xo), free(din), free(sized), free(grown);
    lm_free(&m);
    return CHECK_DONE();
}
