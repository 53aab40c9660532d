/* model/qwen3.c: Qwen3 dense forward and backward, llm.c style.
 *
 * The forward of a training step runs straight into the fused
 * lm_head + cross-entropy, which already produces d(final norm output):
 * with the gradient scale (1 / valid targets of the whole optimizer step)
 * known up front, the [BT x V] logits never need to exist at once, only
 * `logit_rows` rows of them. Backward then walks the layers in reverse,
 * accumulating (+=) into the flat gradient buffer. Everything the backward
 * reads was saved in the per-layer activation plan allocated in
 * qwen3_create, or, for a layer under activation checkpointing, is rebuilt
 * from the layer's saved input just before its backward (layer_recompute);
 * nothing is allocated per step. */
#include "model/qwen3.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

/* ---------------------------------------------------------------- layout */

static void add_tensor(qwen3_model *m, int *cap, const char *name, int64_t d0, int64_t d1, int is_matrix) {
    if (m->n_tensors == *cap) {
        *cap = *cap ? *cap * 2 : 64;
        m->tensors = realloc(m->tensors, (size_t)*cap * sizeof *m->tensors);
        if (!m->tensors) { fprintf(stderr, "ctitan: error: out of memory\n"); exit(1); }
    }
    qwen3_tensor *t = &m->tensors[m->n_tensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = d1 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->numel = (size_t)d0 * (size_t)(d1 ? d1 : 1);
    t->offset = m->n_params;
    t->is_matrix = is_matrix;
    m->n_params += t->numel;
}

/* The tensor table, in HF names, ordered by layer so each layer is contiguous. */
static void build_layout(qwen3_model *m) {
    const qwen3_config *c = &m->cfg;
    int cap = 0;
    char n[QWEN3_NAME_MAX];
    int64_t H = c->hidden, I = c->intermediate, hd = c->head_dim;
    int64_t qd = (int64_t)c->n_heads * hd, kvd = (int64_t)c->n_kv_heads * hd;
    add_tensor(m, &cap, "model.embed_tokens.weight", c->vocab_size, H, 1);
    for (int l = 0; l < c->n_layers; l++) {
#define T_(suffix, d0, d1, mat)                                              \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                 \
    add_tensor(m, &cap, n, d0, d1, mat)
        T_("input_layernorm.weight", H, 0, 0);
        T_("self_attn.q_proj.weight", qd, H, 1);
        T_("self_attn.k_proj.weight", kvd, H, 1);
        T_("self_attn.v_proj.weight", kvd, H, 1);
        T_("self_attn.o_proj.weight", H, qd, 1);
        T_("self_attn.q_norm.weight", hd, 0, 0);
        T_("self_attn.k_norm.weight", hd, 0, 0);
        T_("post_attention_layernorm.weight", H, 0, 0);
        T_("mlp.gate_proj.weight", I, H, 1);
        T_("mlp.up_proj.weight", I, H, 1);
        T_("mlp.down_proj.weight", H, I, 1);
#undef T_
    }
    add_tensor(m, &cap, "model.norm.weight", H, 0, 0);
    if (!c->tie_embeddings) add_tensor(m, &cap, "lm_head.weight", c->vocab_size, H, 1);
}

/* Points a weights view at a flat buffer; relies on build_layout's order. */
static void bind_weights(qwen3_weights *w, const qwen3_model *m, float *base) {
    const qwen3_tensor *t = m->tensors;
    w->wte = base + (t++)->offset;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        qwen3_layer_w *lw = &w->layer[l];
        float **slots[] = {&lw->ln1, &lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->qn,
                           &lw->kn,  &lw->ln2, &lw->wg, &lw->wu, &lw->wd};
        for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) *slots[i] = base + (t++)->offset;
    }
    w->lnf = base + (t++)->offset;
    w->lm_head = m->cfg.tie_embeddings ? w->wte : base + t->offset;
}

/* ------------------------------------------------------ activation plan */

/* Carves named buffers out of one allocation; first pass only counts. */
typedef struct {
    float *base;
    size_t used;
} carver;

static float *carve(carver *cv, size_t n) {
    float *p = cv->base ? cv->base + cv->used : NULL;
    cv->used += (n + 15) & ~(size_t)15; /* 64-byte aligned slices */
    return p;
}

/* Every per-layer activation but res: name, floats, and whether QWEN3_AC_OP
 * keeps it (1: a matmul or attention output, costly to rerun) or reruns it
 * (0: a norm, RoPE or SwiGLU output, cheap elementwise work). */
#define LAYER_ACTS(X)                                                          \
    X(ln1, BT * H, 0) X(ln1_rstd, BT, 0) X(q, BT * qd, 1) X(q_rstd, BT * nH, 0) \
    X(qr, BT * qd, 0) X(k, BT * kvd, 1) X(k_rstd, BT * nKV, 0) X(kr, BT * kvd, 0) \
    X(v, BT * kvd, 1) X(lse, BT * nH, 1) X(att, BT * qd, 1) X(res_mid, BT * H, 1) \
    X(ln2, BT * H, 0) X(ln2_rstd, BT, 0) X(gate, BT * I, 1) X(up, BT * I, 1) X(h, BT * I, 0)

static void plan_activations(qwen3_model *m, carver *cv, const int *ac) {
    // ac[L]: QWEN3_AC_* per layer
    const qwen3_config *c = &m->cfg;
    size_t BT = (size_t)m->B * m->T, H = c->hidden, I = c->intermediate, hd = c->head_dim;
    size_t nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    /* one scratch set that every checkpointed layer's forward, recomputation
     * and backward use in turn (layers run one at a time) */
    int any_ac = 0;
    for (int l = 0; l < c->n_layers; l++) any_ac |= ac[l] != QWEN3_AC_NONE;
    qwen3_layer_acts *sc = &m->ac_scratch;
    memset(sc, 0, sizeof *sc);
#define SCRATCH(name, n, keep) sc->name = carve(cv, n);
    if (any_ac) { LAYER_ACTS(SCRATCH) }
#undef SCRATCH
    for (int l = 0; l < c->n_layers; l++) {
        qwen3_layer_acts *a = &m->acts[l];
        a->ac = ac[l];
        a->res = carve(cv, BT * H); /* always kept: the layer's input, where recomputation starts */
#define OWN(name, n, keep)                                                              \
    a->name = ac[l] == QWEN3_AC_NONE || (ac[l] == QWEN3_AC_OP && (keep)) ? carve(cv, n) : sc->name;
        LAYER_ACTS(OWN)
#undef OWN
    }
    m->res_out = carve(cv, BT * H);
    m->lnf = carve(cv, BT * H);
    m->lnf_rstd = carve(cv, BT);
    m->rope_cos = carve(cv, (size_t)m->T * hd / 2);
    m->rope_sin = carve(cv, (size_t)m->T * hd / 2);
    m->logits = carve(cv, (size_t)m->logit_rows * c->vocab_size);
    m->d_res = carve(cv, BT * H);
    m->d_ln = carve(cv, BT * H);
    m->d_att = carve(cv, BT * qd);
    m->d_q = carve(cv, BT * qd);
    m->d_q2 = carve(cv, BT * qd);
    m->d_k = carve(cv, BT * kvd);
    m->d_k2 = carve(cv, BT * kvd);
    m->d_v = carve(cv, BT * kvd);
    m->d_h = carve(cv, BT * I);
    m->d_gate = carve(cv, BT * I);
    m->d_up = carve(cv, BT * I);
}

int qwen3_ac_layer(const char *ac_mode, const char *ac_option, int l, ct_err *e) {
    if (!ac_mode || strcmp(ac_mode, "none") == 0) return QWEN3_AC_NONE;
    if (strcmp(ac_mode, "full") == 0) return QWEN3_AC_FULL;
    if (strcmp(ac_mode, "selective") != 0) {
        ct_fail(e, CT_ERR_CONFIG, "activation_checkpoint.mode: \"%s\" is not one of none, selective, full",
                ac_mode);
        return -1;
    }
    const char *o = ac_option ? ac_option : "";
    if (strcmp(o, "op") == 0) return QWEN3_AC_OP;
    char *end;
    long n = o[0] >= '0' && o[0] <= '9' ? strtol(o, &end, 10) : 0;
    if (n < 1 || n > 1000000 || *end) {
        ct_fail(e, CT_ERR_CONFIG,
                "activation_checkpoint.selective_ac_option: \"%s\" is neither \"op\" nor a layer period >= 1", o);
        return -1;
    }
    /* torchtitan counts wrapped blocks from 1 and checkpoints when count % N == 0 */
    return (l + 1) % n == 0 ? QWEN3_AC_FULL : QWEN3_AC_NONE;
}

int qwen3_create(qwen3_model *m, const qwen3_config *c, int B, int T, ct_err *e) {
    return qwen3_create_ac(m, c, B, T, "none", NULL, e);
}

/* The layout and the activation plan, counted but not allocated: m->tensors,
 * m->n_params, m->acts (pointers still NULL) and m->act_floats. *ac gets the
 * per-layer checkpointing policy [L] (the caller frees it). Shared by
 * qwen3_create_ac and qwen3_plan_memory so --dry-run reports what a run
 * allocates. */
static int plan_model(qwen3_model *m, const qwen3_config *c, int B, int T, const char *ac_mode,
                      const char *ac_option, int **ac, ct_err *e) {
    memset(m, 0, sizeof *m);
    *ac = NULL;
    int rc = qwen3_config_check(c, "model", e);
    if (rc) return rc;
    if (B < 1 || T < 1) return ct_fail(e, CT_ERR_CONFIG, "model: batch %d x sequence %d is empty", B, T);
    int *pol = ct_calloc((size_t)c->n_layers + 1, sizeof(int)); // [L] policy per layer
    for (int l = 0; l < c->n_layers; l++) {
        if ((pol[l] = qwen3_ac_layer(ac_mode, ac_option, l, e)) < 0) {
            free(pol);
            return CT_ERR_CONFIG;
        }
    }
    m->cfg = *c;
    build_layout(m);
    m->B = B;
    m->T = T;
    m->logit_rows = B * T < 256 ? B * T : 256;
    m->acts = ct_calloc((size_t)c->n_layers, sizeof(qwen3_layer_acts));
    carver cv = {0};
    plan_activations(m, &cv, pol);
    m->act_floats = cv.used;
    *ac = pol;
    return 0;
}

int qwen3_create_ac(qwen3_model *m, const qwen3_config *c, int B, int T, const char *ac_mode,
                    const char *ac_option, ct_err *e) {
    int *ac;
    int rc = plan_model(m, c, B, T, ac_mode, ac_option, &ac, e);
    if (rc) {
        qwen3_free(m);
        return rc;
    }
    kern_select_ref(&m->k);
    m->params = ct_calloc(m->n_params, sizeof(float));
    m->grads = ct_calloc(m->n_params, sizeof(float));
    m->w.layer = ct_calloc((size_t)c->n_layers, sizeof(qwen3_layer_w));
    m->g.layer = ct_calloc((size_t)c->n_layers, sizeof(qwen3_layer_w));
    bind_weights(&m->w, m, m->params);
    bind_weights(&m->g, m, m->grads);
    m->act_mem = ct_calloc(m->act_floats, sizeof(float));
    carver cv = {m->act_mem, 0};
    plan_activations(m, &cv, ac);
    free(ac);
    m->ac_scratch_layer = -1;
    op_rope_tables(m->rope_cos, m->rope_sin, T, c->head_dim, (float)c->rope_theta);
    return 0;
}

int qwen3_plan_memory(const qwen3_config *c, int B, int T, const char *ac_mode, const char *ac_option,
                      size_t *n_params, size_t *act_bytes, ct_err *e) {
    qwen3_model m;
    int *ac;
    int rc = plan_model(&m, c, B, T, ac_mode, ac_option, &ac, e);
    if (!rc) {
        *n_params = m.n_params;
        *act_bytes = m.act_floats * sizeof(float);
    }
    free(ac);
    qwen3_free(&m);
    return rc;
}

void qwen3_free(qwen3_model *m) {
    free(m->tensors);
    free(m->params);
    free(m->grads);
    free(m->w.layer);
    free(m->g.layer);
    free(m->acts);
    free(m->act_mem);
    memset(m, 0, sizeof *m);
}

void qwen3_init_random(qwen3_model *m, uint64_t seed) {
    ct_rng r;
    ct_rng_seed(&r, seed);
    for (int i = 0; i < m->n_tensors; i++) {
        const qwen3_tensor *t = &m->tensors[i];
        float *p = m->params + t->offset;
        for (size_t j = 0; j < t->numel; j++) p[j] = t->is_matrix ? (float)(0.02 * ct_rng_normal(&r)) : 1.0f;
    }
}

const qwen3_tensor *qwen3_find(const qwen3_model *m, const char *name) {
    for (int i = 0; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0) return &m->tensors[i];
    return NULL;
}

size_t qwen3_activation_bytes(const qwen3_model *m) { return m->act_floats * sizeof(float); }
size_t qwen3_num_params(const qwen3_model *m) { return m->n_params; }

double qwen3_flops_per_token(const qwen3_model *m, int T) {
    const qwen3_config *c = &m->cfg;
    double matmul_params = (double)m->n_params - (double)c->vocab_size * c->hidden; /* no lookup */
    if (c->tie_embeddings) matmul_params += (double)c->vocab_size * c->hidden;      /* lm_head runs */
    return 6.0 * matmul_params + 12.0 * c->n_layers * c->n_heads * c->head_dim * (double)T;
}

/* ---------------------------------------------------------------- forward */

/* One layer's forward from a->res: fills the layer's activations and, unless
 * res_next is NULL (recomputation before backward, where the next layer's
 * input is already known), writes the residual leaving the layer. */
static void layer_forward(qwen3_model *m, qwen3_layer_acts *a, const qwen3_layer_w *w, float *res_next, int B,
                          int T) {
    const qwen3_config *c = &m->cfg;
    int BT = B * T, H = c->hidden, I = c->intermediate, hd = c->head_dim;
    int nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    float eps = (float)c->rms_eps;
    /* cos/sin were tabulated for m->T positions; rows 0..T-1 serve any T <= m->T */
    const float *cs = m->rope_cos, *sn = m->rope_sin;
    /* attention block */
    m->k.rmsnorm_fwd(a->ln1, a->ln1_rstd, a->res, w->ln1, BT, H, eps);
    m->k.matmul_fwd(a->q, a->ln1, w->wq, BT, H, qd, 0);
    m->k.matmul_fwd(a->k, a->ln1, w->wk, BT, H, kvd, 0);
    m->k.matmul_fwd(a->v, a->ln1, w->wv, BT, H, kvd, 0);
    m->k.rmsnorm_fwd(a->qr, a->q_rstd, a->q, w->qn, BT * nH, hd, eps); /* per head */
    m->k.rmsnorm_fwd(a->kr, a->k_rstd, a->k, w->kn, BT * nKV, hd, eps);
    m->k.rope_fwd(a->qr, a->qr, cs, sn, B, T, nH, hd);
    m->k.rope_fwd(a->kr, a->kr, cs, sn, B, T, nKV, hd);
    m->k.attention_fwd(a->att, a->lse, a->qr, a->kr, a->v, B, T, nH, nKV, hd);
    memcpy(a->res_mid, a->res, (size_t)BT * H * sizeof(float));
    m->k.matmul_fwd(a->res_mid, a->att, w->wo, BT, qd, H, 1); /* res_mid = res + o_proj(att) */
    /* MLP block */
    m->k.rmsnorm_fwd(a->ln2, a->ln2_rstd, a->res_mid, w->ln2, BT, H, eps);
    m->k.matmul_fwd(a->gate, a->ln2, w->wg, BT, H, I, 0);
    m->k.matmul_fwd(a->up, a->ln2, w->wu, BT, H, I, 0);
    m->k.swiglu_fwd(a->h, a->gate, a->up, BT * I);
    if (!res_next) return;
    memcpy(res_next, a->res_mid, (size_t)BT * H * sizeof(float));
    m->k.matmul_fwd(res_next, a->h, w->wd, BT, I, H, 1);
}

/* Before a checkpointed layer's backward: rebuild what it did not keep, with
 * the forward's own kernels on the forward's own inputs (bit-identical). */
static void layer_recompute(qwen3_model *m, int l, int B, int T) {
    qwen3_layer_acts *a = &m->acts[l];
    const qwen3_layer_w *w = &m->w.layer[l];
    if (a->ac == QWEN3_AC_NONE || m->ac_scratch_layer == l) return; /* the scratch may still hold it */
    m->ac_scratch_layer = l;
    if (a->ac == QWEN3_AC_FULL) {
        layer_forward(m, a, w, NULL, B, T);
        return;
    }
    /* QWEN3_AC_OP: the elementwise ops only, from the kept matmul outputs */
    const qwen3_config *c = &m->cfg;
    int BT = B * T, H = c->hidden, I = c->intermediate, hd = c->head_dim, nH = c->n_heads, nKV = c->n_kv_heads;
    float eps = (float)c->rms_eps;
    m->k.rmsnorm_fwd(a->ln1, a->ln1_rstd, a->res, w->ln1, BT, H, eps);
    m->k.rmsnorm_fwd(a->qr, a->q_rstd, a->q, w->qn, BT * nH, hd, eps);
    m->k.rmsnorm_fwd(a->kr, a->k_rstd, a->k, w->kn, BT * nKV, hd, eps);
    m->k.rope_fwd(a->qr, a->qr, m->rope_cos, m->rope_sin, B, T, nH, hd);
    m->k.rope_fwd(a->kr, a->kr, m->rope_cos, m->rope_sin, B, T, nKV, hd);
    m->k.rmsnorm_fwd(a->ln2, a->ln2_rstd, a->res_mid, w->ln2, BT, H, eps);
    m->k.swiglu_fwd(a->h, a->gate, a->up, BT * I);
}

/* The transformer stack up to the final norm: fills m->acts, m->lnf. */
static void forward_stack(qwen3_model *m, const int32_t *tokens, int B, int T) {
    const qwen3_config *c = &m->cfg;
    int BT = B * T, H = c->hidden;
    m->tokens = tokens;
    m->fwd_B = B;
    m->fwd_T = T;

    m->k.embedding_fwd(c->n_layers ? m->acts[0].res : m->res_out, tokens, m->w.wte, BT, H);
    for (int l = 0; l < c->n_layers; l++) {
        float *res_next = l + 1 < c->n_layers ? m->acts[l + 1].res : m->res_out;
        layer_forward(m, &m->acts[l], &m->w.layer[l], res_next, B, T);
        if (m->acts[l].ac != QWEN3_AC_NONE) m->ac_scratch_layer = l;
    }
    m->k.rmsnorm_fwd(m->lnf, m->lnf_rstd, m->res_out, m->w.lnf, BT, H, (float)c->rms_eps);
}

void qwen3_logits(qwen3_model *m, const int32_t *tokens, int B, int T, float *logits) {
    forward_stack(m, tokens, B, T);
    m->k.matmul_fwd(logits, m->lnf, m->w.lm_head, B * T, m->cfg.hidden, m->cfg.vocab_size, 0);
}

double qwen3_loss(qwen3_model *m, const int32_t *tokens, const int32_t *labels, int B, int T, long *n_valid) {
    forward_stack(m, tokens, B, T);
    int BT = B * T, H = m->cfg.hidden, V = m->cfg.vocab_size;
    double sum = 0;
    long count = 0;
    for (int r0 = 0; r0 < BT; r0 += m->logit_rows) {
        int n = BT - r0 < m->logit_rows ? BT - r0 : m->logit_rows;
        m->k.matmul_fwd(m->logits, m->lnf + (size_t)r0 * H, m->w.lm_head, n, H, V, 0);
        sum += m->k.crossentropy_fwdbwd(m->logits, labels + r0, n, V, 0.0f, &count);
    }
    if (n_valid) *n_valid = count;
    return sum;
}

/* --------------------------------------------------------------- backward */

static void zero(float *p, size_t n) { memset(p, 0, n * sizeof(float)); }

double qwen3_forward_backward(qwen3_model *m, const int32_t *tokens, const int32_t *labels, int B, int T,
                              float grad_scale, long *n_valid) {
    const qwen3_config *c = &m->cfg;
    int BT = B * T, H = c->hidden, I = c->intermediate, hd = c->head_dim, V = c->vocab_size;
    int nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    const float *cs = m->rope_cos, *sn = m->rope_sin;
    forward_stack(m, tokens, B, T);

    /* fused lm_head + cross-entropy + their backward, a block of rows at a time:
     * d_ln holds d(final norm output) [BT, H] */
    zero(m->d_ln, (size_t)BT * H);
    double loss_sum = 0;
    long count = 0;
    for (int r0 = 0; r0 < BT; r0 += m->logit_rows) {
        int n = BT - r0 < m->logit_rows ? BT - r0 : m->logit_rows;
        const float *x = m->lnf + (size_t)r0 * H;
        m->k.matmul_fwd(m->logits, x, m->w.lm_head, n, H, V, 0);
        loss_sum += m->k.crossentropy_fwdbwd(m->logits, labels + r0, n, V, grad_scale, &count);
        m->k.matmul_bwd(m->d_ln + (size_t)r0 * H, m->g.lm_head, m->logits, x, m->w.lm_head, n, H, V);
    }
    if (n_valid) *n_valid = count;

    /* d_res carries d(residual stream) downwards */
    zero(m->d_res, (size_t)BT * H);
    m->k.rmsnorm_bwd(m->d_res, m->g.lnf, m->d_ln, m->res_out, m->w.lnf, m->lnf_rstd, BT, H);

    for (int l = c->n_layers - 1; l >= 0; l--) {
        layer_recompute(m, l, B, T);
        qwen3_layer_acts *a = &m->acts[l];
        const qwen3_layer_w *w = &m->w.layer[l];
        qwen3_layer_w *g = &m->g.layer[l];
        /* res_next = res_mid + down(h): d_res flows to res_mid unchanged, plus the MLP path */
        zero(m->d_h, (size_t)BT * I);
        m->k.matmul_bwd(m->d_h, g->wd, m->d_res, a->h, w->wd, BT, I, H);
        zero(m->d_gate, (size_t)BT * I);
        zero(m->d_up, (size_t)BT * I);
        m->k.swiglu_bwd(m->d_gate, m->d_up, m->d_h, a->gate, a->up, BT * I);
        zero(m->d_ln, (size_t)BT * H);
        m->k.matmul_bwd(m->d_ln, g->wg, m->d_gate, a->ln2, w->wg, BT, H, I);
        m->k.matmul_bwd(m->d_ln, g->wu, m->d_up, a->ln2, w->wu, BT, H, I);
        m->k.rmsnorm_bwd(m->d_res, g->ln2, m->d_ln, a->res_mid, w->ln2, a->ln2_rstd, BT, H);

        /* res_mid = res + o_proj(att) */
        zero(m->d_att, (size_t)BT * qd);
        m->k.matmul_bwd(m->d_att, g->wo, m->d_res, a->att, w->wo, BT, qd, H);
        zero(m->d_q, (size_t)BT * qd);
        zero(m->d_k, (size_t)BT * kvd);
        zero(m->d_v, (size_t)BT * kvd);
        m->k.attention_bwd(m->d_q, m->d_k, m->d_v, m->d_att, a->att, a->lse, a->qr, a->kr, a->v, B, T, nH, nKV,
                           hd);
        /* through RoPE (d_q -> d_q2) and the per-head norms (d_q2 -> d_q) */
        zero(m->d_q2, (size_t)BT * qd);
        m->k.rope_bwd(m->d_q2, m->d_q, cs, sn, B, T, nH, hd);
        zero(m->d_q, (size_t)BT * qd);
        m->k.rmsnorm_bwd(m->d_q, g->qn, m->d_q2, a->q, w->qn, a->q_rstd, BT * nH, hd);
        zero(m->d_k2, (size_t)BT * kvd);
        m->k.rope_bwd(m->d_k2, m->d_k, cs, sn, B, T, nKV, hd);
        zero(m->d_k, (size_t)BT * kvd);
        m->k.rmsnorm_bwd(m->d_k, g->kn, m->d_k2, a->k, w->kn, a->k_rstd, BT * nKV, hd);
        zero(m->d_ln, (size_t)BT * H);
        m->k.matmul_bwd(m->d_ln, g->wq, m->d_q, a->ln1, w->wq, BT, H, qd);
        m->k.matmul_bwd(m->d_ln, g->wk, m->d_k, a->ln1, w->wk, BT, H, kvd);
        m->k.matmul_bwd(m->d_ln, g->wv, m->d_v, a->ln1, w->wv, BT, H, kvd);
        m->k.rmsnorm_bwd(m->d_res, g->ln1, m->d_ln, a->res, w->ln1, a->ln1_rstd, BT, H);
    }
    m->k.embedding_bwd(m->g.wte, m->d_res, tokens, BT, H);
    return loss_sum;
}
