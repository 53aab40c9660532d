/* tests/c/model/test_lm_wsplit.c: the split backward of zero-bubble pipelines
 * (model/lm.h, lm_wstore). A stage's backward run as I (lm_stage_backward
 * with m->wdefer: d(input) and the small gradients) then W
 * (lm_stage_backward_weight: the recorded projections' dW) gives the fused
 * backward's gradients and d(input) bit for bit, over two micro-batches
 * accumulated; I alone leaves the projections' dW untouched, and W empties
 * its store. The values the fused backward computes are checked against
 * torch elsewhere (tests/py/test_parity.py); here only the split's
 * equality to it is. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "model/lm.h"

enum { B = 2, T = 8 };

static lm_config tiny(int tied) {
    lm_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 37, c.hidden = 16, c.intermediate = 24, c.n_layers = 3, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 8, c.max_pos = 64, c.rope_theta = 1e4, c.rms_eps = 1e-6, c.decoder_sparse_step = 1;
    c.tie_embeddings = tied;
    snprintf(c.name, sizeof c.name, "tiny");
    c.lazy_buffers = 1;
    return c;
}

/* Two micro-batches through layers [l0, l1): forward, then the backward
 * fused (split 0) or as I then W; the gradients in m->grads, each
 * micro-batch's d(input) in d_in. */
static void run(lm_model *m, int l0, int l1, int split, float *d_in, int skip_w) {
    int L = m->cfg.n_layers, H = m->cfg.hidden;
    size_t n = (size_t)B * T * H;
    int32_t tok[B * T], lab[B * T];
    float *x = malloc(n * sizeof(float)), *xo = malloc(n * sizeof(float)), *dy = malloc(n * sizeof(float));
    lm_wstore st;
    memset(&st, 0, sizeof st);
    memset(m->grads, 0, m->n_params * sizeof(float));
    for (int mb = 0; mb < 2; mb++) {
        for (int i = 0; i < B * T; i++) tok[i] = (i * 7 + 3 + mb) % 37, lab[i] = (i * 5 + 1 + 2 * mb) % 37;
        for (size_t i = 0; i < n; i++)
            x[i] = 0.3f * (float)sin(0.37 * (double)i + mb), dy[i] = 0.01f * (float)cos(0.11 * (double)i - mb);
        lm_stage_forward(m, l0, l1, tok, x, xo, B, T, 1);
        m->wdefer = split ? &st : NULL;
        lm_stage_backward(m, l0, l1, tok, lab, l1 == L ? NULL : dy, d_in + (size_t)mb * n, B, T, 1.0f / 32, NULL);
        m->wdefer = NULL;
        if (split && !skip_w) lm_stage_backward_weight(m, &st, l0, l1);
    }
    if (split && !skip_w) CHECK(st.n == 0 && st.used == 0, "W leaves its store empty (%d records)", st.n);
    if (split) CHECK(st.peak > 0, "I recorded the projections' products");
    lm_wstore_free(&st);
    free(x);
    free(xo);
    free(dy);
}

static void check_split(int tied, int l0, int l1) {
    lm_model m;
    ct_err e;
    lm_config c = tiny(tied);
    CHECK(lm_create(&m, &c, B, T, &e) == 0, "%s", e.msg);
    lm_init_random(&m, 7);
    size_t n = (size_t)2 * B * T * c.hidden;
    float *g0 = malloc(m.n_params * sizeof(float)), *d0 = calloc(n, sizeof(float)), *d1 = calloc(n, sizeof(float));
    run(&m, l0, l1, 0, d0, 0);
    memcpy(g0, m.grads, m.n_params * sizeof(float));
    run(&m, l0, l1, 1, d1, 0);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < m.n_params; i++)
        if (memcmp(&g0[i], &m.grads[i], sizeof(float)) && !bad++) first = i;
    CHECK(!bad, "tied %d layers [%d, %d): I then W differs from the fused backward in %zu gradients (first at %zu: %g "
          "vs %g)", tied, l0, l1, bad, first, bad ? m.grads[first] : 0.0, bad ? g0[first] : 0.0);
    if (l0 > 0) CHECK(!memcmp(d0, d1, n * sizeof(float)), "tied %d layers [%d, %d): d(input) differs", tied, l0, l1);
    /* I alone: every projection's dW is still to come */
    run(&m, l0, l1, 1, d1, 1);
    const lm_tensor *t = lm_find(&m, "model.layers.1.self_attn.q_proj.weight");
    CHECK(t != NULL, "q_proj of layer 1");
    double s = 0, s0 = 0;
    for (size_t i = 0; t && i < t->numel; i++) s += fabs(m.grads[t->offset + i]), s0 += fabs(g0[t->offset + i]);
    CHECK(s == 0 && s0 > 0, "I alone: q_proj's gradient %g (fused %g)", s, s0);
    free(g0);
    free(d0);
    free(d1);
    lm_free(&m);
}

int main(void) {
    check_split(0, 0, 3); /* the whole model: the embedding, the layers and the head */
    /* tied: the head's dW lands in the embedding's gradient; both stay in I, in the fused
     * backward's order, so even one stage holding both is bit-identical */
    check_split(1, 0, 3);
    check_split(1, 1, 3);
    check_split(1, 0, 2);
    check_split(0, 1, 3); /* a last stage: from x_in, d(input) out */
    check_split(0, 1, 2); /* a middle stage: from d_out */
    return CHECK_DONE();
}
