/* tests/c/model/test_lm_wstore_size.c: what a zero-bubble I records (model/lm.h,
 * lm_wstore). Per layer it keeps each deferred product's d(output) and one copy
 * of each input buffer the layer's products read (q, k and v share ln1's; gate
 * and up share ln2's): B T (4 H + 2 (q + kv widths) + 3 I) floats, the
 * arithmetic of the dense layer's projections (x: ln1, ln2, o_proj's input,
 * down_proj's input h; dy: q, k, v, o, gate, up, down). The store holds them
 * inside its own buffer: used <= size after every I, over shapes and stages
 * whose records land at many points of the buffer's growth.
 *
 * MoE layers (every other one sparse here): the attention's share as above,
 * and the experts' operands op_moe_experts_bwd_w reads, each token routed to
 * exactly top_k experts whatever the router picks: x and dout [B T, H], h, d
 * gate, d up [B T k, Im], topw and perm [B T k], offsets [E + 1]. The router
 * stays in I. lm_wstore_floats, which pp.c and the dry run size stores with,
 * must be that run's peak exactly, for every micro-batch's routing.
 *
 * The RMSNorms' weight gradients are W's too: each trained norm copies its
 * input and d(output) [rows, C] and rstd [rows] (rows: B T for a layer's or
 * the final norm, B T heads for a per-head q/k norm). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "model/lm.h"

/* post: OLMo2's post-norms (FlexOlmo's on a sparse block's output too): two norms a layer as
 * the pre-norms' input and post-attention ones, each over H */
static void check_store(int H, int I, int L, int B, int T, int l0, int l1, int E, int k, int post) {
    lm_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 29, c.hidden = H, c.intermediate = I, c.n_layers = L, c.n_heads = 2, c.n_kv_heads = 1;
    c.head_dim = 8, c.max_pos = 64, c.rope_theta = 1e4, c.rms_eps = 1e-6, c.decoder_sparse_step = 1;
    c.lazy_buffers = 1;
    if (E) c.n_experts = E, c.top_k = k, c.moe_intermediate = I / 2 + 4, c.norm_topk_prob = 1;
    if (E) c.decoder_sparse_step = 2;
    if (post) c.norm_place = LM_NORM_POST;
    snprintf(c.name, sizeof c.name, "tiny");
    lm_model m;
    ct_err e;
    CHECK(lm_create(&m, &c, B, T, &e) == 0, "%s", e.msg);
    lm_init_random(&m, 3);
    size_t BT = (size_t)B * T, n = BT * (size_t)H;
    int32_t *tok = malloc(BT * sizeof *tok), *lab = malloc(BT * sizeof *lab);
    float *x = malloc(n * sizeof(float)), *xo = malloc(n * sizeof(float)), *dy = malloc(n * sizeof(float)),
          *din = malloc(n * sizeof(float));
    for (size_t i = 0; i < BT; i++) tok[i] = (int32_t)((i * 7 + 3) % 29), lab[i] = (int32_t)((i * 5 + 1) % 29);
    for (size_t i = 0; i < n; i++) x[i] = 0.01f * (float)(i % 13), dy[i] = 0.001f * (float)(i % 7);
    size_t qd = (size_t)c.n_heads * c.head_dim, kvd = (size_t)c.n_kv_heads * c.head_dim;
    size_t per = BT * (4 * (size_t)H + 2 * (qd + kvd) + 3 * (size_t)I), want = 0;
    /* the norms' weight gradients (Qwen3's: input and post-attention norms [H], per-head
     * q/k norms [hd] over nH and nKV rows a token): each copies its input and d(output)
     * and one rstd a row; the final norm's with the model's end */
    size_t norms = BT * 2 * (2 * (size_t)H + 1) +
                   BT * (size_t)(c.n_heads + c.n_kv_heads) * (2 * (size_t)c.head_dim + 1);
    if (l1 == L) want += BT * (2 * (size_t)H + 1);
    for (int l = l0; l < l1; l++) {
        want += norms;
        if (!lm_layer_is_moe(&c, l)) {
            want += per;
            continue;
        }
        size_t S = BT * (size_t)k;
        want += BT * (2 * (size_t)H + 2 * (qd + kvd)) + 2 * BT * (size_t)H + 3 * S * (size_t)c.moe_intermediate +
                2 * S + (size_t)E + 1;
    }
    lm_wstore st;
    memset(&st, 0, sizeof st);
    for (int mb = 0; mb < 3; mb++) { /* the store reused, as a stage's pool reuses it */
        for (size_t i = 0; i < n; i++) x[i] = 0.01f * (float)((i + 5 * mb) % 13); /* routing differs */
        lm_stage_forward(&m, l0, l1, tok, x, xo, B, T, 1);
        m.wdefer = &st;
        lm_stage_backward(&m, l0, l1, tok, lab, l1 == L ? NULL : dy, din, B, T, 1.0f / 32, NULL);
        m.wdefer = NULL;
        CHECK(st.used == want, "H %d I %d E %d BT %zu layers [%d, %d) post %d: I recorded %zu floats, the layers' "
              "inputs and d(outputs) are %zu", H, I, E, BT, l0, l1, post, st.used, want);
        CHECK(st.peak == lm_wstore_floats(&m, l0, l1, BT), "H %d I %d E %d BT %zu layers [%d, %d) post %d: peak %zu "
              "floats, lm_wstore_floats %zu", H, I, E, BT, l0, l1, post, st.peak, lm_wstore_floats(&m, l0, l1, BT));
        int sparse = 0;
        for (int l = l0; l < l1; l++) sparse += lm_layer_is_moe(&c, l);
        CHECK(st.n_experts == sparse, "E %d layers [%d, %d): %d experts records, %d sparse layers", E, l0, l1,
              st.n_experts, sparse);
        CHECK(st.used <= st.size, "H %d I %d BT %zu layers [%d, %d): %zu floats recorded in a buffer of %zu", H, I,
              BT, l0, l1, st.used, st.size);
        lm_stage_backward_weight(&m, &st, l0, l1);
    }
    lm_wstore_free(&st);
    free(tok), free(lab), free(x), free(xo), free(dy), free(din);
    lm_free(&m);
}

int main(void) {
    static const int shapes[][4] = {{16, 24, 2, 8}, {16, 40, 1, 5}, {24, 24, 2, 3}, {24, 56, 3, 7}, {32, 16, 1, 9}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int *q = shapes[s];
        for (int post = 0; post < 2; post++) {
            check_store(q[0], q[1], 4, q[2], q[3], 1, 3, 0, 0, post); /* a middle stage of two layers */
            check_store(q[0], q[1], 4, q[2], q[3], 0, 4, 0, 0, post); /* the whole model: the head's dW in I */
            check_store(q[0], q[1], 4, q[2], q[3], 1, 4, 4 + (int)s, 1 + (int)s % 3, post); /* layers 1, 3 sparse */
            check_store(q[0], q[1], 4, q[2], q[3], 0, 4, 8, 2, post);
        }
    }
    return CHECK_DONE();
}
