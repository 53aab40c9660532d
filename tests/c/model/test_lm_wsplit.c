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
#include "kernels/registry.h"
#include "model/lm.h"

enum { B = 2, T = 8 };

/* The name of the tensor holding parameter i (a failure's first difference). */
static const char *lm_tensor_at(const lm_model *m, size_t i) {
    for (int t = 0; t < m->n_tensors; t++)
        if (i >= m->tensors[t].offset && i < m->tensors[t].offset + m->tensors[t].numel) return m->tensors[t].name;
    return "?";
}

/* The norm layouts a split backward defers the weight gradients of (lm.h, LM_W_NORM ...). */
enum {
    FAM_QWEN3,    /* pre-norms, per-head q/k norms fused with RoPE (the rope op's qknorm_bwd_w) */
    FAM_OLMO2,    /* post-norms on the attention and MLP outputs, q/k norms over the whole projection */
    FAM_GEMMA,    /* four norms a layer, (1 + w), per-head q/k norms */
    FAM_HUNYUAN,  /* per-head q/k norms on the rotated q and k (rmsnorm's bwd_w on R x) */
    FAM_NOPE,     /* per-head q/k norms, layer 1 without RoPE (EXAONE 4's NoPE layers: no fused op) */
    FAM_BIAS,     /* no q/k norms, biases on q/k/v, o and the MLP: W sums them from the projections' copies */
    FAM_OLMOE,    /* pre-norms, q/k norms over the whole projection */
    FAM_PARTIAL,  /* per-head q/k norms, then RoPE on half of each head (GLM-4.5: not the fused op) */
    FAM_FLEX,     /* OLMo2's post-norms, with FlexOlmo's on a sparse block's output */
};

/* moe: 0 dense; 1 every other layer sparse (1 of 3: layer 1), 4 experts top 2; 2 the same with
 * qwen2_moe's shared expert beside the experts */
static lm_config tiny_fam(int tied, int moe, int fam) {
    lm_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 37, c.hidden = 16, c.intermediate = 24, c.n_layers = 3, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 8, c.max_pos = 64, c.rope_theta = 1e4, c.rms_eps = 1e-6, c.decoder_sparse_step = 1;
    c.tie_embeddings = tied;
    if (moe) {
        c.n_experts = 4, c.top_k = 2, c.moe_intermediate = 12, c.norm_topk_prob = 1, c.decoder_sparse_step = 2;
        c.shared_intermediate = moe == 2 ? 20 : 0;
    }
    if (fam == FAM_OLMO2) c.norm_place = LM_NORM_POST, c.qk_norm = LM_QK_PROJ;
    if (fam == FAM_GEMMA) c.norm_place = LM_NORM_SANDWICH, c.norm_plus_one = 1;
    if (fam == FAM_HUNYUAN) c.qk_norm_after_rope = 1;
    if (fam == FAM_NOPE) c.layer_nope[1] = 1;
    if (fam == FAM_OLMOE) c.qk_norm = LM_QK_PROJ;
    if (fam == FAM_PARTIAL) { /* default RoPE of factor 0.5 (lm.c rope_default's fields otherwise) */
        c.has_rope = 1, c.rope.type = ROPE_DEFAULT, c.rope.theta = c.rope_theta, c.rope.partial_rotary_factor = 0.5;
        c.rope_local = c.rope;
    }
    if (fam == FAM_FLEX) c.norm_place = LM_NORM_POST, c.qk_norm = LM_QK_PROJ;
    if (fam == FAM_BIAS) c.qk_norm = LM_QK_NONE, c.qkv_bias = c.o_bias = c.mlp_bias = 1;
    snprintf(c.name, sizeof c.name, "tiny");
    c.lazy_buffers = 1;
    return c;
}

/* Whether W adds tensor t's gradient beside the projections' and experts': an RMSNorm's weight
 * (a layer's, a q/k norm or the final norm) or a trained projection's bias. */
static int is_small_w(const lm_tensor *t) {
    switch (t->slot) {
    case LM_S_LN_IN: case LM_S_LN_ATTN_OUT: case LM_S_LN_PRE_MLP: case LM_S_LN_MLP_OUT: case LM_S_QN:
    case LM_S_KN: case LM_S_LNF: case LM_S_BQ: case LM_S_BK: case LM_S_BV: case LM_S_BO: case LM_S_BG:
    case LM_S_BU: case LM_S_BD: return 1;
    default: return 0;
    }
}

/* Two micro-batches through layers [l0, l1): forward, then the backward
 * fused (split 0) or as I then W; the gradients in m->grads, each
 * micro-batch's d(input) in d_in. */
static void run(lm_model *m, int l0, int l1, int split, float *d_in, int skip_w, int *n_exp) {
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
    if (split && skip_w) /* one experts record per sparse layer of the stage and micro-batch */
        for (int l = l0; l < l1; l++) *n_exp -= 2 * lm_layer_is_moe(&m->cfg, l);
    if (split && skip_w) *n_exp += st.n_experts;
    lm_wstore_free(&st);
    free(x);
    free(xo);
    free(dy);
}

/* kmode: the model's kernels, 0 the references (lm_create's), 1 the machine's default choice (the grouped
 * experts, the vectorised norms), 2 that under bf16 mixed precision (moe_experts_bf16); fam: the norms'
 * layout (FAM_*); ac: activation checkpointing, "full" (I reads the recomputed layer's scratch), a
 * selective option ("op", "2") or NULL */
static void check_split_f(int tied, int moe, int l0, int l1, int kmode, int fam, const char *ac) {
    lm_model m;
    ct_err e;
    lm_config c = tiny_fam(tied, moe, fam);
    const char *mode = !ac ? "none" : strcmp(ac, "full") ? "selective" : "full"; /* else ac is its option */
    CHECK(lm_create_ac(&m, &c, B, T, mode, strcmp(mode, "selective") ? NULL : ac, &e) == 0, "%s", e.msg);
    if (kmode) CHECK(kern_select(&m.k, NULL, NULL, 0, &e) == 0, "kern_select: %s", e.msg);
    if (kmode == 2) kern_use_bf16_matmuls(&m.k);
    lm_init_random(&m, 7);
    size_t n = (size_t)2 * B * T * c.hidden;
    float *g0 = malloc(m.n_params * sizeof(float)), *d0 = calloc(n, sizeof(float)), *d1 = calloc(n, sizeof(float));
    int n_exp = 0;
    run(&m, l0, l1, 0, d0, 0, &n_exp);
    memcpy(g0, m.grads, m.n_params * sizeof(float));
    run(&m, l0, l1, 1, d1, 0, &n_exp);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < m.n_params; i++)
        if (memcmp(&g0[i], &m.grads[i], sizeof(float)) && !bad++) first = i;
    CHECK(!bad, "kernels %d fam %d ac %s tied %d moe %d layers [%d, %d): I then W differs from the fused backward "
          "in %zu gradients (first at %zu, %s: %g vs %g)", kmode, fam, ac ? ac : "none", tied, moe, l0, l1, bad,
          first, bad ? lm_tensor_at(&m, first) : "", bad ? m.grads[first] : 0.0, bad ? g0[first] : 0.0);
    if (l0 > 0)
        CHECK(!memcmp(d0, d1, n * sizeof(float)), "tied %d moe %d layers [%d, %d): d(input) differs", tied, moe, l0,
              l1);
    /* I alone: every projection's dW is still to come */
    run(&m, l0, l1, 1, d1, 1, &n_exp);
    CHECK(n_exp == 0, "moe %d layers [%d, %d): I recorded %d experts records too few (one per sparse layer and "
          "micro-batch)", moe, l0, l1, -n_exp);
    static const char *const deferred[] = {"model.layers.1.self_attn.q_proj.weight",
                                           "model.layers.1.mlp.experts.0.gate_proj.weight",
                                           "model.layers.1.mlp.experts.3.up_proj.weight",
                                           "model.layers.1.mlp.experts.2.down_proj.weight"};
    for (int d = 0; d < (moe ? 4 : 1); d++) {
        const lm_tensor *t = lm_find(&m, deferred[d]);
        CHECK(t != NULL, "%s", deferred[d]);
        double s = 0, s0 = 0;
        for (size_t i = 0; t && i < t->numel; i++) s += fabs(m.grads[t->offset + i]), s0 += fabs(g0[t->offset + i]);
        CHECK(s == 0 && s0 > 0, "I alone: %s's gradient %g (fused %g)", deferred[d], s, s0);
    }
    /* and every trained norm's weight and bias the stage holds (the final norm with the model's end) */
    int n_norms = 0, n_bias = 0;
    for (int i = 0; i < m.n_tensors; i++) {
        const lm_tensor *t = &m.tensors[i];
        if (!is_small_w(t) || (t->slot == LM_S_LNF ? l1 < c.n_layers : t->layer < l0 || t->layer >= l1)) continue;
        double s = 0, s0 = 0;
        for (size_t j = 0; j < t->numel; j++) s += fabs(m.grads[t->offset + j]), s0 += fabs(g0[t->offset + j]);
        CHECK(s == 0 && s0 > 0, "fam %d I alone: %s's gradient %g (fused %g)", fam, t->name, s, s0);
        n_norms++;
        n_bias += (t->slot >= LM_S_BQ && t->slot <= LM_S_BV) || t->slot == LM_S_BO ||
                  (t->slot >= LM_S_BG && t->slot <= LM_S_BD);
    }
    CHECK(n_norms - n_bias > (fam == FAM_BIAS ? 1 : 3) * (l1 - l0), "fam %d layers [%d, %d): only %d norms", fam,
          l0, l1, n_norms - n_bias);
    CHECK(fam != FAM_BIAS || n_bias == 7 * (l1 - l0), "fam %d layers [%d, %d): %d biases", fam, l0, l1, n_bias);
    free(g0);
    free(d0);
    free(d1);
    lm_free(&m);
}

static void check_split_k(int tied, int moe, int l0, int l1, int kmode) {
    check_split_f(tied, moe, l0, l1, kmode, FAM_QWEN3, NULL);
}
static void check_split(int tied, int moe, int l0, int l1) { check_split_k(tied, moe, l0, l1, 0); }

int main(void) {
    check_split(0, 0, 0, 3); /* the whole model: the embedding, the layers and the head */
    /* tied: the head's dW lands in the embedding's gradient; both stay in I, in the fused
     * backward's order, so even one stage holding both is bit-identical */
    check_split(1, 0, 0, 3);
    check_split(1, 0, 1, 3);
    check_split(1, 0, 0, 2);
    check_split(0, 0, 1, 3); /* a last stage: from x_in, d(input) out */
    check_split(0, 0, 1, 2); /* a middle stage: from d_out */
    /* MoE (layer 1 sparse): the experts' gate / up / down gradients deferred too, the
     * router and the shared expert's gate with them in their own halves */
    check_split(0, 1, 0, 3);
    check_split(0, 1, 1, 2);
    check_split(0, 2, 1, 3);
    check_split_k(0, 2, 1, 3, 1); /* the grouped experts (op_moe_experts_bwd_w's own GEMMs) */
    check_split_k(0, 1, 0, 2, 2);
    /* the norms' weight gradients in W, every layout, the references and this machine's kernels */
    for (int fam = FAM_QWEN3; fam <= FAM_FLEX; fam++)
        for (int kmode = 0; kmode < 2; kmode++) {
            check_split_f(0, 0, 0, 3, kmode, fam, NULL); /* the final norm and layer 0's too */
            check_split_f(0, 0, 1, 2, kmode, fam, NULL);
        }
    /* activation checkpointing: the norms' inputs and rstd come from the recomputed scratch */
    check_split_f(0, 0, 0, 3, 1, FAM_QWEN3, "full");
    check_split_f(0, 0, 1, 3, 1, FAM_OLMO2, "full");
    check_split_f(0, 1, 1, 3, 1, FAM_OLMOE, "full");
    check_split_f(0, 2, 0, 3, 0, FAM_NOPE, "op");
    check_split_f(0, 0, 0, 3, 1, FAM_GEMMA, "op");
    check_split_f(0, 0, 0, 3, 0, FAM_HUNYUAN, "2");
    check_split_f(0, 1, 0, 3, 1, FAM_PARTIAL, "full");
    check_split_f(0, 1, 0, 3, 1, FAM_FLEX, "op");
    /* bf16 mixed precision (the norms stay fp32; their d(output) comes from bf16 products) */
    check_split_f(0, 0, 0, 3, 2, FAM_GEMMA, NULL);
    check_split_f(0, 1, 0, 3, 2, FAM_OLMOE, "full");
    check_split_f(0, 0, 0, 3, 2, FAM_OLMO2, NULL);
    return CHECK_DONE();
}
