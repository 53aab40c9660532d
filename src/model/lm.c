/* model/lm.c: the decoder forward and backward, llm.c style.
 *
 * The forward of a training step runs straight into the fused
 * lm_head + cross-entropy, which already produces d(final norm output):
 * with the gradient scale (1 / valid targets of the whole optimizer step)
 * known up front, the [BT x V] logits never need to exist at once, only
 * `logit_rows` rows of them. Backward then walks the layers in reverse,
 * accumulating (+=) into the flat gradient buffer. Everything the backward
 * reads was saved in the per-layer activation plan allocated in
 * lm_create, or, for a layer under activation checkpointing, is rebuilt
 * from the layer's saved input just before its backward (layer_recompute);
 * nothing is allocated per step. */
#include "model/lm.h"

#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "metrics/profile.h"
#include "model/lora.h"

/* ---------------------------------------------------------------- layout */

/* Vocabulary-parallel (distributed/tp.c): under TP every vocabulary is cut
 * by rows in ceil chunks, so a rank may hold none (vocab_rows 0 is then an
 * empty block, not the whole table). */
static int vocab_par(const lm_config *c) { return c->tp_degree > 1; }
/* Rows of the embedding and lm_head this model holds. */
static int vocab_held(const lm_config *c) { return vocab_par(c) ? c->vocab_rows : c->vocab_size; }

static void add_tensor(lm_model *m, int *cap, const char *name, int64_t d0, int64_t d1, int is_matrix, int slot,
                       int layer, int expert) {
    if (m->n_tensors == *cap) {
        *cap = *cap ? *cap * 2 : 64;
        m->tensors = realloc(m->tensors, (size_t)*cap * sizeof *m->tensors);
        if (!m->tensors) { fprintf(stderr, "ctitan: error: out of memory\n"); exit(1); }
    }
    lm_tensor *t = &m->tensors[m->n_tensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    /* another pipeline stage's tensor: its name, no elements */
    const lm_config *c = &m->cfg;
    if (layer >= 0 ? !lm_holds_layer(c, layer)
                   : slot == LM_S_EMBED || slot == LM_S_EMB_LA || slot == LM_S_EMB_LB ? !lm_holds_embed(c)
                                                                                      : !lm_holds_head(c))
        d0 = 0;
    t->ndim = d1 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->numel = (size_t)d0 * (size_t)(d1 ? d1 : 1);
    t->offset = m->n_params;
    t->is_matrix = is_matrix;
    t->slot = slot;
    t->layer = layer;
    t->expert = expert;
    t->store = LM_NO_STORE;
    m->n_params += t->numel;
}

/* The most adapters that read one input (q, k, v): lora_fwd_n / lora_bwd_n's groups. */
#define LM_LORA_GROUP 3

/* Projection p's input and output widths in layer l, and its module path in a
 * layer. A sparse layer's MLP projections are its shared expert's (qwen2_moe;
 * the trainer leaves no MLP adapter on a MoE layer without one): width Is. */
static void lora_dims(const lm_config *c, int l, int p, int64_t *in, int64_t *out) {
    int shared = c->shared_intermediate > 0 && lm_layer_is_moe(c, l);
    int64_t H = c->hidden, I = shared ? c->shared_intermediate : c->intermediate;
    int64_t qd = (int64_t)c->n_heads * c->head_dim;
    int64_t kvd = (int64_t)c->n_kv_heads * c->head_dim;
    static const int in_kind[LM_LORA_N] = {0, 0, 0, 1, 0, 0, 2, 0}, out_kind[LM_LORA_N] = {1, 3, 3, 0, 2, 2, 0, 4};
    const int64_t w[5] = {H, qd, I, kvd, 1};
    *in = w[in_kind[p]];
    *out = w[out_kind[p]];
}
static const char *const lora_module[LM_LORA_N] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                      "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                      "mlp.down_proj",    "mlp.shared_expert_gate"};
static const char *const lora_shared_module[LM_LORA_N] = {[LM_LORA_GATE] = "mlp.shared_expert.gate_proj",
                                                             [LM_LORA_UP] = "mlp.shared_expert.up_proj",
                                                             [LM_LORA_DOWN] = "mlp.shared_expert.down_proj"};
static const char *const lora_shared_experts_module[LM_LORA_N] = {[LM_LORA_GATE] = "mlp.shared_experts.gate_proj",
                                                                     [LM_LORA_UP] = "mlp.shared_experts.up_proj",
                                                                     [LM_LORA_DOWN] = "mlp.shared_experts.down_proj"};

/* A projection whose adapter is part of a fused module's (Phi3's k, v under
 * qkv_proj; up under gate_up_proj): the module's one A and B are listed at
 * its first projection, and bind_weights gives this one views of them. */
static int lora_fused_member(const lm_config *c, int p) {
    return ((c->lora_targets & LORA_FUSED_QKV) && (p == LM_LORA_K || p == LM_LORA_V)) ||
           ((c->lora_targets & LORA_FUSED_GATE_UP) && p == LM_LORA_UP);
}

/* The projection whose dropout mask p shares: PEFT drops the fused Linear's
 * one input once for all its outputs. */
static int lora_fused_head(const lm_config *c, int p) {
    if (!lora_fused_member(c, p)) return p;
    return p == LM_LORA_UP ? LM_LORA_GATE : LM_LORA_Q;
}

/* bind_weights for the adapters of a fused module (tensor t at pointer p):
 * A is shared, B's row blocks are q|k|v or gate|up, as the base's rows. */
static void lora_bind_fused(const lm_config *c, lm_layer_w *lw, const lm_tensor *t, float *p) {
    size_t r = (size_t)lm_lora_rank(c, t->layer, t->expert), qd = (size_t)c->n_heads * c->head_dim;
    size_t kvd = (size_t)c->n_kv_heads * c->head_dim;
    int b = t->slot == LM_S_LORA_B;
    float **v = b ? lw->lora_b : lw->lora_a;
    if ((c->lora_targets & LORA_FUSED_QKV) && t->expert == LM_LORA_Q) {
        v[LM_LORA_K] = p && b ? p + qd * r : p;
        v[LM_LORA_V] = p && b ? p + (qd + kvd) * r : p;
    }
    if ((c->lora_targets & LORA_FUSED_GATE_UP) && t->expert == LM_LORA_GATE) {
        int64_t in, rows; /* the gate's rows: GraniteMoeShared's shared width S in its sparse layers */
        lora_dims(c, t->layer, LM_LORA_GATE, &in, &rows);
        v[LM_LORA_UP] = p && b ? p + (size_t)rows * r : p;
    }
}

int lm_lora_on(const lm_config *c, int l, int p) {
    /* on MoE models the trainer keeps only the attention targets (and, with a shared
     * expert, the MLP's, its own); a shared expert's gate exists in sparse layers only */
    if (p == LM_LORA_SHGATE && !(l >= 0 && l < c->n_layers && c->shared_intermediate > 0 && lm_layer_is_moe(c, l)))
        return 0;
    return c->lora_rank > 0 && (c->lora_targets & (1u << p)) &&
           !(l >= 0 && l < c->n_layers && c->lora_lp[l][p] == LM_LORA_LP_OFF);
}

/* The lora_kind entry of layer l's projection p; 0: lora_rank and lora_scale. */
static int lora_kind_of(const lm_config *c, int l, int p) {
    int k = l >= 0 && l < c->n_layers && p >= 0 && p < LM_LORA_N ? c->lora_lp[l][p] : 0;
    return k != LM_LORA_LP_OFF ? k : 0;
}

int lm_lora_rank(const lm_config *c, int l, int p) {
    int k = lora_kind_of(c, l, p);
    return k ? c->lora_kind[k - 1].rank : c->lora_rank;
}

float lm_lora_scale(const lm_config *c, int l, int p) {
    int k = lora_kind_of(c, l, p);
    return k ? c->lora_kind[k - 1].scale : c->lora_scale;
}

/* The largest rank of any Linear adapter: the width of the [BT, r] buffers. */
static int lm_lora_max_rank(const lm_config *c) {
    int r = c->lora_rank;
    for (int l = 0; l < c->n_layers; l++)
        for (int p = 0; p < LM_LORA_N; p++)
            if (lm_lora_on(c, l, p) && lm_lora_rank(c, l, p) > r) r = lm_lora_rank(c, l, p);
    return r;
}

int lm_lora_expert_on(const lm_config *c, int l, int p) {
    return c->lora_rank > 0 && l >= 0 && l < c->n_layers && lm_layer_is_moe(c, l) && (c->lora_experts[l] >> p & 1);
}

size_t lm_expert_lora_scratch_floats(const lm_config *c) {
    for (int l = 0; l < c->n_layers; l++)
        if (lm_holds_layer(c, l) && (lm_lora_expert_on(c, l, LM_LORA_EXP_GU) || lm_lora_expert_on(c, l, LM_LORA_EXP_D)))
            return 2 * 3 * (size_t)(c->expert_rows ? c->expert_rows : c->n_experts) * c->moe_intermediate * c->hidden;
    return 0;
}

int lm_lora_exp_rank(const lm_config *c, int p) { return c->lora_exp_rank[p] ? c->lora_exp_rank[p] : c->lora_rank; }
float lm_lora_exp_scale(const lm_config *c, int p) { return c->lora_exp_rank[p] ? c->lora_exp_scale[p] : c->lora_scale; }

/* The module holding a MoE layer's experts and router in PEFT's names:
 * transformers v5's mlp (Mixtral's too), GraniteMoE's block_sparse_moe */
static const char *moe_module(const lm_config *c) {
    return c->moe_keys == LM_MOE_KEYS_GRANITE ? "block_sparse_moe" : "mlp";
}

/* Layer l's adapters on its fused experts, PEFT's ParamWrapper keys: one
 * wrapper per parameter, nested in the experts' declaration order, so with
 * both adapted gate_up_proj's lies under the outer wrapper's base_layer.
 * Expert e's A rows and B columns (lora_experts_delta) are held with it:
 * under expert parallel A [r El, in] and B [out, r El] for the El held
 * experts, column j El + (e - expert0) of B being the whole B's j E + e
 * (distributed/tp.c slices them so). */
static void add_expert_lora(lm_model *m, int *cap, int l) {
    const lm_config *c = &m->cfg;
    int64_t E = c->n_experts, H = c->hidden, Im = c->moe_intermediate;
    int64_t El = c->expert_rows ? c->expert_rows : E;
    int both = lm_lora_expert_on(c, l, LM_LORA_EXP_GU) && lm_lora_expert_on(c, l, LM_LORA_EXP_D);
    for (int p = 0; p < LM_LORA_EXP_N; p++) {
        if (!lm_lora_expert_on(c, l, p)) continue;
        int64_t r = lm_lora_exp_rank(c, p);
        int64_t in = p == LM_LORA_EXP_GU ? H : Im, out = p == LM_LORA_EXP_GU ? 2 * Im : H;
        const char *nest = both && p == LM_LORA_EXP_GU ? "base_layer." : "";
        char n[LM_NAME_MAX];
        snprintf(n, sizeof n, "model.layers.%d.%s.experts.%slora_A.weight", l, moe_module(c), nest);
        add_tensor(m, cap, n, r * El, in, 1, LM_S_LORA_EA, l, p);
        m->tensors[m->n_tensors - 1].lora = 1;
        snprintf(n, sizeof n, "model.layers.%d.%s.experts.%slora_B.weight", l, moe_module(c), nest);
        add_tensor(m, cap, n, out, r * El, 1, LM_S_LORA_EB, l, p);
        m->tensors[m->n_tensors - 1].lora = 1;
    }
}

/* the router's weight [E, H], a 2-D parameter: PEFT's ParamWrapper with
 * one "expert", A [r, H] and B [E, r] under mlp.gate (Mixtral's too:
 * transformers v5 renames its block_sparse_moe to mlp; GraniteMoE's
 * block_sparse_moe.router); whole on every rank */
static void add_router_lora(lm_model *m, int *cap, int l) {
    const lm_config *c = &m->cfg;
    if (!lm_lora_expert_on(c, l, LM_LORA_EXP_R)) return;
    int64_t r = lm_lora_exp_rank(c, LM_LORA_EXP_R);
    char n[LM_NAME_MAX];
    const char *gate = c->moe_keys == LM_MOE_KEYS_GRANITE ? "block_sparse_moe.router" : "mlp.gate";
    snprintf(n, sizeof n, "model.layers.%d.%s.lora_A.weight", l, gate);
    add_tensor(m, cap, n, r, c->hidden, 1, LM_S_LORA_EA, l, LM_LORA_EXP_R);
    m->tensors[m->n_tensors - 1].lora = 1;
    snprintf(n, sizeof n, "model.layers.%d.%s.lora_B.weight", l, gate);
    add_tensor(m, cap, n, c->n_experts, r, 1, LM_S_LORA_EB, l, LM_LORA_EXP_R);
    m->tensors[m->n_tensors - 1].lora = 1;
}

/* The HF names of a layer's norms, by placement: [0] before attention, [1]
 * on its output, [2] before the MLP, [3] on its output (NULL: absent). */
static void norm_names(const lm_config *c, const char *n[4]) {
    n[0] = n[1] = n[2] = n[3] = NULL;
    if (c->norm_place == LM_NORM_POST) {
        n[1] = "post_attention_layernorm";
        n[3] = "post_feedforward_layernorm";
    } else if (c->norm_place == LM_NORM_SANDWICH && !strcmp(c->model_type, "glm4")) {
        /* Glm4DecoderLayer: its post_attention_layernorm is the MLP's pre-norm */
        n[0] = "input_layernorm";
        n[1] = "post_self_attn_layernorm";
        n[2] = "post_attention_layernorm";
        n[3] = "post_mlp_layernorm";
    } else if (c->norm_place == LM_NORM_SANDWICH) {
        n[0] = "input_layernorm";
        n[1] = "post_attention_layernorm";
        n[2] = "pre_feedforward_layernorm";
        n[3] = "post_feedforward_layernorm";
    } else {
        n[0] = "input_layernorm";
        /* VaultGemmaDecoderLayer: Gemma2's MLP pre-norm, its post-norms dropped */
        n[2] = strcmp(c->model_type, "vaultgemma") ? "post_attention_layernorm" : "pre_feedforward_layernorm";
    }
}

/* The tensor table, in HF names, ordered by layer so each layer is contiguous
 * (a layer's LoRA adapters last among its tensors, PEFT's names without
 * PEFT's "base_model.model." prefix; in a MoE layer the experts and their
 * adapters after the others). q, k and v are adjacent (one block:
 * Phi3's qkv_proj is exactly their concatenation, and frozen bf16 storage
 * widens them together), so are gate and up. A Qwen3 model's order is the
 * one ctitan always had. */
static void build_layout(lm_model *m) {
    const lm_config *c = &m->cfg;
    int cap = 0;
    char n[LM_NAME_MAX];
    int64_t H = c->hidden, I = c->intermediate, hd = c->head_dim;
    int64_t qd = (int64_t)c->n_heads * hd, kvd = (int64_t)c->n_kv_heads * hd;
    const char *nn[4];
    norm_names(c, nn);
    add_tensor(m, &cap, "model.embed_tokens.weight", vocab_held(c), H, 1, LM_S_EMBED,
               -1, -1);
    /* embed_tokens' adapter beside it (FSDP's piece 0, the first stage's; PEFT's keys
     * have no ".weight": they are parameters, not modules). A whole on every rank, also
     * vocabulary-parallel: the adapter's rows are added once, after the blocks' lookups are summed */
    if (c->lora_rank > 0 && (c->lora_targets & LORA_EMBED)) {
        add_tensor(m, &cap, "model.embed_tokens.lora_embedding_A", c->lora_rank, c->vocab_size, 1, LM_S_EMB_LA, -1,
                   -1);
        m->tensors[m->n_tensors - 1].lora = 1;
        add_tensor(m, &cap, "model.embed_tokens.lora_embedding_B", H, c->lora_rank, 1, LM_S_EMB_LB, -1, -1);
        m->tensors[m->n_tensors - 1].lora = 1;
    }
    for (int l = 0; l < c->n_layers; l++) {
#define T_(suffix, d0, d1, mat, slot)                                        \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                 \
    add_tensor(m, &cap, n, d0, d1, mat, slot, l, -1)
        char sfx[64];
        if (nn[0]) {
            snprintf(sfx, sizeof sfx, "%s.weight", nn[0]);
            T_(sfx, H, 0, 0, LM_S_LN_IN);
        }
        if (c->fused_qkv) {
            T_("self_attn.qkv_proj.weight", qd + 2 * kvd, H, 1, LM_S_WQKV);
        } else {
            T_("self_attn.q_proj.weight", qd, H, 1, LM_S_WQ);
            T_("self_attn.k_proj.weight", kvd, H, 1, LM_S_WK);
            T_("self_attn.v_proj.weight", kvd, H, 1, LM_S_WV);
        }
        if (c->qkv_bias) {
            T_("self_attn.q_proj.bias", qd, 0, 0, LM_S_BQ);
            T_("self_attn.k_proj.bias", kvd, 0, 0, LM_S_BK);
            T_("self_attn.v_proj.bias", kvd, 0, 0, LM_S_BV);
        }
        T_("self_attn.o_proj.weight", H, qd, 1, LM_S_WO);
        if (c->o_bias) { T_("self_attn.o_proj.bias", H, 0, 0, LM_S_BO); }
        if (c->qk_norm != LM_QK_NONE) {
            int proj = c->qk_norm == LM_QK_PROJ, hy = c->qk_norm_after_rope; /* HunYuan's names */
            T_(hy ? "self_attn.query_layernorm.weight" : "self_attn.q_norm.weight", proj ? qd : hd, 0, 0, LM_S_QN);
            T_(hy ? "self_attn.key_layernorm.weight" : "self_attn.k_norm.weight", proj ? kvd : hd, 0, 0, LM_S_KN);
        }
        if (nn[1]) {
            snprintf(sfx, sizeof sfx, "%s.weight", nn[1]);
            T_(sfx, H, 0, 0, LM_S_LN_ATTN_OUT);
        }
        if (nn[2]) {
            snprintf(sfx, sizeof sfx, "%s.weight", nn[2]);
            T_(sfx, H, 0, 0, LM_S_LN_PRE_MLP);
        }
        if (lm_layer_is_moe(c, l)) { /* the router here, the experts at the layer's end (below) */
            snprintf(sfx, sizeof sfx, "%s", c->moe_keys == LM_MOE_KEYS_MIXTRAL   ? "block_sparse_moe.gate.weight"
                                            : c->moe_keys == LM_MOE_KEYS_GRANITE ? "block_sparse_moe.router.layer.weight"
                                                                                 : "mlp.gate.weight");
            T_(sfx, c->n_experts, H, 1, LM_S_ROUTER);
            if (c->shared_intermediate > 0 && c->moe_keys == LM_MOE_KEYS_GRANITE) {
                /* GraniteMoeShared's shared_mlp, ungated: its files fuse gate and up rows into
                 * shared_mlp.input_linear [2 S, H] (checkpoint/hf.c maps the two names) */
                int64_t Is = c->shared_intermediate;
                T_("shared_mlp.gate_proj.weight", Is, H, 1, LM_S_WG);
                T_("shared_mlp.up_proj.weight", Is, H, 1, LM_S_WU);
                T_("shared_mlp.output_linear.weight", H, Is, 1, LM_S_WD);
            } else if (c->shared_intermediate > 0 && lm_shared_experts_ungated(c)) {
                /* Ernie4_5_MoeSparseMoeBlock's shared_experts: one MLP of moe_num_shared_experts x
                 * moe_intermediate_size, ungated, added to the routed experts' output */
                int64_t Is = c->shared_intermediate;
                T_("mlp.shared_experts.gate_proj.weight", Is, H, 1, LM_S_WG);
                T_("mlp.shared_experts.up_proj.weight", Is, H, 1, LM_S_WU);
                T_("mlp.shared_experts.down_proj.weight", H, Is, 1, LM_S_WD);
            } else if (c->shared_intermediate > 0) { /* qwen2_moe: a dense MLP under its own name, and its gate */
                int64_t Is = c->shared_intermediate;
                T_("mlp.shared_expert.gate_proj.weight", Is, H, 1, LM_S_WG);
                T_("mlp.shared_expert.up_proj.weight", Is, H, 1, LM_S_WU);
                T_("mlp.shared_expert.down_proj.weight", H, Is, 1, LM_S_WD);
                T_("mlp.shared_expert_gate.weight", 1, H, 1, LM_S_SHARED_GATE);
            }
        } else {
            if (c->fused_gate_up) {
                T_("mlp.gate_up_proj.weight", 2 * I, H, 1, LM_S_WGU);
            } else {
                T_("mlp.gate_proj.weight", I, H, 1, LM_S_WG);
                T_("mlp.up_proj.weight", I, H, 1, LM_S_WU);
            }
            T_("mlp.down_proj.weight", H, I, 1, LM_S_WD);
            if (c->mlp_bias) {
                T_("mlp.gate_proj.bias", I, 0, 0, LM_S_BG);
                T_("mlp.up_proj.bias", I, 0, 0, LM_S_BU);
                T_("mlp.down_proj.bias", H, 0, 0, LM_S_BD);
            }
        }
        if (nn[3]) {
            snprintf(sfx, sizeof sfx, "%s.weight", nn[3]);
            T_(sfx, H, 0, 0, LM_S_LN_MLP_OUT);
        }
        for (int p = 0; p < LM_LORA_N; p++) {
            if (!lm_lora_on(c, l, p) || lora_fused_member(c, p)) continue;
            int64_t in, out;
            lora_dims(c, l, p, &in, &out);
            int shared = lora_shared_module[p] && c->shared_intermediate > 0 && lm_layer_is_moe(c, l);
            const char *mod = shared ? lora_shared_module[p] : lora_module[p];
            if (shared && lm_shared_experts_ungated(c)) mod = lora_shared_experts_module[p]; /* ERNIE 4.5 */
            int granite = shared && c->moe_keys == LM_MOE_KEYS_GRANITE; /* PEFT's shared_mlp Linears */
            if (granite) mod = p == LM_LORA_DOWN ? "shared_mlp.output_linear" : "shared_mlp.input_linear";
            if ((c->lora_targets & LORA_FUSED_QKV) && p == LM_LORA_Q) mod = "self_attn.qkv_proj", out = qd + 2 * kvd;
            if ((c->lora_targets & LORA_FUSED_GATE_UP) && p == LM_LORA_GATE)
                mod = granite ? "shared_mlp.input_linear" : "mlp.gate_up_proj", out = 2 * out;
            snprintf(sfx, sizeof sfx, "%s.lora_A.weight", mod);
            T_(sfx, lm_lora_rank(c, l, p), in, 1, LM_S_LORA_A);
            m->tensors[m->n_tensors - 1].lora = 1;
            m->tensors[m->n_tensors - 1].expert = p;
            snprintf(sfx, sizeof sfx, "%s.lora_B.weight", mod);
            T_(sfx, out, lm_lora_rank(c, l, p), 1, LM_S_LORA_B);
            m->tensors[m->n_tensors - 1].lora = 1;
            m->tensors[m->n_tensors - 1].expert = p;
        }
        /* a MoE layer's experts and their adapters last: under expert parallel
         * they are what the ranks hold apart (FSDP shards them as a piece of
         * their own, distributed/fsdp.h) */
        if (lm_layer_is_moe(c, l)) {
            add_router_lora(m, &cap, l);
            int64_t E = c->n_experts, Im = c->moe_intermediate;
            int mx = c->moe_keys == LM_MOE_KEYS_MIXTRAL;
            static const char *const proj[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};
            static const int slot[3] = {LM_S_EXP_G, LM_S_EXP_U, LM_S_EXP_D};
            /* HF's per-expert keys, ordered so each projection's experts are
             * one stacked [E, ., .] block for the grouped kernels */
            for (int p = 0; p < 3; p++)
                for (int64_t x = 0; x < E; x++) {
                    snprintf(sfx, sizeof sfx, "%s.experts.%lld.%s.weight",
                             mx || c->moe_keys == LM_MOE_KEYS_GRANITE ? "block_sparse_moe" : "mlp",
                             (long long)x, proj[mx][p]);
                    int held = !c->expert_rows || (x >= c->expert0 && x < c->expert0 + c->expert_rows);
                    T_(sfx, held ? (p < 2 ? Im : H) : 0, p < 2 ? H : Im, 1, slot[p]);
                    m->tensors[m->n_tensors - 1].expert = (int)x;
                }
            add_expert_lora(m, &cap, l);
        }
#undef T_
    }
    add_tensor(m, &cap, "model.norm.weight", H, 0, 0, LM_S_LNF, -1, -1);
    if (!c->tie_embeddings)
        add_tensor(m, &cap, "lm_head.weight", vocab_held(c), H, 1, LM_S_HEAD, -1, -1);
    /* lm_head's adapter, tied or not (PEFT's LoRA Linear on lm_head): A whole
     * on every rank, B this rank's vocabulary rows, as lm_head's */
    if (c->lora_rank > 0 && (c->lora_targets & LORA_HEAD)) {
        add_tensor(m, &cap, "lm_head.lora_A.weight", c->lora_rank, H, 1, LM_S_HEAD_LA, -1, -1);
        m->tensors[m->n_tensors - 1].lora = 1;
        add_tensor(m, &cap, "lm_head.lora_B.weight", vocab_held(c), c->lora_rank, 1, LM_S_HEAD_LB, -1, -1);
        m->tensors[m->n_tensors - 1].lora = 1;
    }
}

/* Points a weights view at a flat buffer by each tensor's slot.
 * grads: the gradient view, where a frozen tensor has no pointer (NULL). */
static void bind_weights(lm_weights *w, const lm_model *m, float *base, int grads) {
    const lm_config *c = &m->cfg;
    size_t H = c->hidden, qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    size_t I = c->intermediate;
    for (int l = 0; l < c->n_layers; l++) memset(&w->layer[l], 0, sizeof w->layer[l]);
    w->wte = w->lnf = w->lm_head = w->head_a = w->head_b = w->emb_a = w->emb_b = NULL;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        float *p = grads && t->frozen ? NULL : base + t->offset;
        lm_layer_w *lw = t->layer >= 0 ? &w->layer[t->layer] : NULL;
        switch (t->slot) {
        case LM_S_EMBED: w->wte = p; break;
        case LM_S_LNF: w->lnf = p; break;
        case LM_S_HEAD: w->lm_head = p; break;
        case LM_S_HEAD_LA: w->head_a = p; break;
        case LM_S_HEAD_LB: w->head_b = p; break;
        case LM_S_EMB_LA: w->emb_a = t->numel ? p : NULL; break;
        case LM_S_EMB_LB: w->emb_b = t->numel ? p : NULL; break;
        case LM_S_LN_IN: lw->ln1 = p; break;
        case LM_S_WQ: lw->wq = p; break;
        case LM_S_WK: lw->wk = p; break;
        case LM_S_WV: lw->wv = p; break;
        case LM_S_WQKV: /* q, k, v rows of one tensor */
            lw->wq = p;
            lw->wk = p ? p + qd * H : NULL;
            lw->wv = p ? p + (qd + kvd) * H : NULL;
            break;
        case LM_S_BQ: lw->bq = p; break;
        case LM_S_BK: lw->bk = p; break;
        case LM_S_BV: lw->bv = p; break;
        case LM_S_WO: lw->wo = p; break;
        case LM_S_BO: lw->bo = p; break;
        case LM_S_QN: lw->qn = p; break;
        case LM_S_KN: lw->kn = p; break;
        case LM_S_LN_ATTN_OUT: lw->ln_ao = p; break;
        case LM_S_LN_PRE_MLP: lw->ln2 = p; break;
        case LM_S_WG: lw->wg = p; break;
        case LM_S_WU: lw->wu = p; break;
        case LM_S_WGU: /* gate rows first, as Phi3MLP chunks them */
            lw->wg = p;
            lw->wu = p ? p + I * H : NULL;
            break;
        case LM_S_WD: lw->wd = p; break;
        case LM_S_BG: lw->bg = p; break;
        case LM_S_BU: lw->bu = p; break;
        case LM_S_BD: lw->bd = p; break;
        case LM_S_LN_MLP_OUT: lw->ln_mo = p; break;
        case LM_S_ROUTER: lw->router = p; break;
        case LM_S_SHARED_GATE: lw->shgate = p; break;
        /* a projection's experts are one stacked block from its first held expert */
        case LM_S_EXP_G: if (!lw->ewg && t->numel) lw->ewg = p; break;
        case LM_S_EXP_U: if (!lw->ewu && t->numel) lw->ewu = p; break;
        case LM_S_EXP_D: if (!lw->ewd && t->numel) lw->ewd = p; break;
        case LM_S_LORA_A: lw->lora_a[t->expert] = p; lora_bind_fused(c, lw, t, p); break;
        case LM_S_LORA_B: lw->lora_b[t->expert] = p; lora_bind_fused(c, lw, t, p); break;
        case LM_S_LORA_EA: lw->lora_ea[t->expert] = p; break;
        case LM_S_LORA_EB: lw->lora_eb[t->expert] = p; break;
        }
    }
    if (c->tie_embeddings) w->lm_head = w->wte;
}

int lm_bind_frozen(lm_model *m, ct_err *e) {
    m->n_frozen = 0;
    for (int i = 0; i < m->n_tensors; i++) m->n_frozen += m->tensors[i].frozen != 0;
    /* the grouped experts kernels take a projection's E experts as one block */
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        if (t->slot < LM_S_EXP_G || t->slot > LM_S_EXP_D || t->expert != 0) continue;
        for (int j = i + 1; j < i + m->cfg.n_experts && j < m->n_tensors; j++)
            if (m->tensors[j].frozen != t->frozen)
                return ct_fail(e, CT_ERR_CONFIG,
                               "%s: a MoE layer's experts of one projection are trained or frozen together, but %s "
                               "is %s",
                               m->tensors[j].name, t->name, t->frozen ? "frozen" : "trained");
    }
    if (m->g.layer) bind_weights(&m->g, m, m->grads, 1);
    return 0;
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

/* A MoE layer's routing arrays (moe.h); pointers only once memory exists. */
static void carve_route(carver *cv, moe_route *r, int N, int E, int k) {
    float *mem = carve(cv, moe_route_floats(N, E, k));
    if (mem) moe_route_bind(r, mem, N, E, k);
    else memset(r, 0, sizeof *r);
}

/* Rows of the residual stream and the norms this model holds room for:
 * under sequence parallel (lm_config.tp_seq) the chunk of the B x T rows,
 * ceil(BT / tp_degree) as DTensor's Shard cuts them (a rank holding fewer
 * pads its block to it for the collectives). */
static size_t seq_rows(const lm_config *c, size_t BT) {
    return c->tp_seq && c->tp_degree > 1 ? (BT + (size_t)c->tp_degree - 1) / (size_t)c->tp_degree : BT;
}
/* Rows of a buffer that holds every rank's chunk, gathered: tp_degree chunks. */
static size_t seq_all_rows(const lm_config *c, size_t BT) {
    return c->tp_seq && c->tp_degree > 1 ? seq_rows(c, BT) * (size_t)c->tp_degree : BT;
}
/* Granite's residual_multiplier as the factor a branch's output is scaled
 * by before its residual add; 0 where the family adds it as it is. */
static float resid_mult(const lm_config *c) {
    return c->residual_mult != 0 && c->residual_mult != 1 ? (float)c->residual_mult : 0.0f;
}
/* Whether a layer's attention and MLP outputs get buffers of their own (ao,
 * mo): a norm reads them (OLMo2, Gemma), or they are scaled before the add. */
static size_t branch_bufs(const lm_config *c) { return c->norm_place != LM_NORM_PRE || resid_mult(c) != 0; }
/* Granite's logits_scaling as the divisor of the logits; 0 where the family
 * does not divide them. */
static float logits_div(const lm_config *c) {
    return c->logits_div != 0 && c->logits_div != 1 ? (float)c->logits_div : 0.0f;
}

/* The norm weights of one layer (lm_layer_w's ln1, ln_ao, ln2, ln_mo)
 * whose gradients, partial under sequence parallel, are summed together. */
static size_t seq_norms(const lm_config *c) {
    return c->norm_place == LM_NORM_SANDWICH ? 4 : 2;
}

/* Every per-layer activation but res: name, floats, and whether LM_AC_OP
 * keeps it (1: a matmul or attention output, costly to rerun) or reruns it
 * (0: a norm, RoPE or SwiGLU output, cheap elementwise work). */
#define LAYER_ACTS(X)                                                          \
    X(ln1, BS * H, 0) X(ln1_rstd, BS, 0) X(q, BT * qd, 1) X(q_rstd, BT * nH, 0) \
    X(qr, BT * qd, 0) X(k, BT * kvd, 1) X(k_rstd, BT * nKV, 0) X(kr, BT * kvd, 0) \
    X(v, BT * kvd, 1) X(lse, BT * nH, 1) X(att, BT * qd, 1) X(res_mid, BS * H, 1) \
    X(ln2, BS * H, 0) X(ln2_rstd, BS, 0) X(gate, BT * I, 1) X(up, BT * I, 1) X(h, BT * I, 0)             \
    X(ao, BS * H * pa, 1) X(ao_rstd, BS * pa, 0) X(mo, BS * H * pa, 1) X(mo_rstd, BS * pa, 0)   \
    X(sgate, BT * Is, 1) X(sup, BT * Is, 1) X(sh, BT * Is, 0) X(so, BT * H * (Is > 0), 1) X(sg, BT * (Is > 0), 1)

/* One layer's saved activations (what a micro-batch in flight keeps until
 * its backward): kept ones carved from cv, the others pointing into the
 * shared checkpointing scratch (plan_activations carves it first). */
static void plan_layer(const lm_model *m, carver *cv, lm_layer_acts *a, int l) {
    const lm_config *c = &m->cfg;
    size_t BT = (size_t)m->act.B * m->act.T, BS = seq_rows(c, BT), H = c->hidden, I, hd = c->head_dim;
    size_t nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    size_t pa = c->norm_place != LM_NORM_PRE; /* the attention and MLP outputs have norms */
    const lm_layer_acts *sc = &m->act.scratch;
    int ac = m->act.pol[l];
    a->ac = ac;
    a->moe = lm_layer_is_moe(c, l);
    I = a->moe ? (size_t)c->top_k * c->moe_intermediate : (size_t)c->intermediate;
    size_t Is = a->moe ? (size_t)c->shared_intermediate : 0; /* the shared expert's width (0: none) */
    a->res = carve(cv, BS * H); /* always kept: the layer's input, where recomputation starts */
#define OWN(name, n, keep) a->name = ac == LM_AC_NONE || (ac == LM_AC_OP && (keep)) ? carve(cv, n) : sc->name;
    LAYER_ACTS(OWN)
#undef OWN
    if (!Is) a->sgate = a->sup = a->sh = a->so = a->sg = NULL;
    if (!pa) { /* no norm reads them: Granite's scaled branches share one buffer (else none) */
        a->ao = a->mo = m->ws.branch;
        a->ao_rstd = a->mo_rstd = NULL;
    }
    /* LoRA's [BT, r] products are small: every layer keeps its own (a recomputation rewrites the same bits) */
    for (int p = 0; p < LM_LORA_N; p++)
        a->lora_u[p] = lm_lora_on(c, l, p) ? carve(cv, BT * (size_t)lm_lora_rank(c, l, p)) : NULL;
    /* the routing is small next to the experts' activations: rerun only under full recomputation */
    if (a->moe && ac != LM_AC_FULL) carve_route(cv, &a->route, m->act.B * m->act.T, c->n_experts, c->top_k);
    else if (a->moe) a->route = sc->route;
}

/* What one micro-batch keeps between its forward and backward over layers
 * [l0, l1): the layers' saved activations and, with the last layer, the
 * final norm's input and output. */
static void plan_range(const lm_model *m, carver *cv, lm_layer_acts *acts, int l0, int l1, float **res_out,
                       float **lnf, float **lnf_rstd) {
    const lm_config *c = &m->cfg;
    size_t BS = seq_rows(c, (size_t)m->act.B * m->act.T), H = c->hidden;
    for (int l = l0; l < l1; l++) plan_layer(m, cv, &acts[l - l0], l);
    if (l1 == c->n_layers) {
        *res_out = carve(cv, BS * H);
        *lnf = carve(cv, BS * H);
        *lnf_rstd = carve(cv, BS);
    }
}

static void plan_activations(lm_model *m, carver *cv) {
    const lm_config *c = &m->cfg;
    const int *ac = m->act.pol; /* [L] LM_AC_* per layer */
    size_t BT = (size_t)m->act.B * m->act.T, BS = seq_rows(c, BT), H = c->hidden, I, hd = c->head_dim;
    size_t nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    size_t pa = c->norm_place != LM_NORM_PRE;
    /* I below is the width of a layer's gate/up/h rows per token: the dense
     * intermediate, or k * Im for a MoE layer (k expert rows per token) */
    size_t I_moe = (size_t)c->top_k * c->moe_intermediate, I_max = 0, I_dense = 0, Is = 0;
    int E = c->n_experts, Nk = m->act.B * m->act.T * c->top_k;
    /* one scratch set that every checkpointed layer's forward, recomputation
     * and backward use in turn (layers run one at a time) */
    int any_ac = 0, full_moe = 0;
    m->moe.n_layers = 0;
    for (int l = 0; l < c->n_layers; l++) {
        int moe = lm_layer_is_moe(c, l);
        size_t Il = moe ? I_moe : (size_t)c->intermediate;
        m->moe.n_layers += moe; /* every stage's: HF's load-balancing loss averages over all of them */
        if (!lm_holds_layer(c, l)) continue;
        any_ac |= ac[l] != LM_AC_NONE;
        if (ac[l] != LM_AC_NONE && Il > I_max) I_max = Il;
        if (!moe) I_dense = (size_t)c->intermediate;
        if (moe && ac[l] != LM_AC_NONE) Is = (size_t)c->shared_intermediate;
        full_moe |= moe && ac[l] == LM_AC_FULL;
    }
    lm_layer_acts *sc = &m->act.scratch;
    memset(sc, 0, sizeof *sc);
    I = I_max;
#define SCRATCH(name, n, keep) sc->name = carve(cv, n);
    if (any_ac) { LAYER_ACTS(SCRATCH) }
#undef SCRATCH
    if (full_moe) carve_route(cv, &sc->route, m->act.B * m->act.T, E, c->top_k);
    m->ws.branch = !pa && branch_bufs(c) ? carve(cv, BS * H) : NULL; /* before the layers point at it */
    /* a pipeline stage's micro-batches keep theirs in banks (lm_bank_new) */
    if (!c->pp_stage) plan_range(m, cv, m->act.layer, 0, c->n_layers, &m->act.res_out, &m->act.lnf, &m->act.lnf_rstd);
    I = I_dense; /* the dense backward's scratch below, the shared expert's too */
    if (m->moe.n_layers && (size_t)c->shared_intermediate > I) I = (size_t)c->shared_intermediate;
    if (m->moe.n_layers && c->shared_intermediate > 0) {
        m->ws.d_so = carve(cv, BT * H);
        m->ws.d_sg = carve(cv, BT);
    }
    /* d of a sparse layer's branch: scaled (GraniteMoE) or through its output norm (FlexOlmo) */
    if (m->moe.n_layers && (resid_mult(c) != 0 || pa)) m->ws.d_moe = carve(cv, BT * H);
    if (m->moe.n_layers) {
        m->ws.moe_work = carve(cv, KERN_MOE_WORK(Nk, H, c->moe_intermediate));
        m->ws.moe_dtopw = carve(cv, (size_t)Nk);
        m->ws.moe_dprobs = carve(cv, BT * E);
        m->ws.moe_dprob_all = carve(cv, (size_t)E);
    }
    if (c->lora_rank > 0) {
        m->ws.lora_du = carve(cv, LM_LORA_GROUP * BT * (size_t)lm_lora_max_rank(c)); /* lora_bwd_n: one per adapter */
        size_t kmax = H > qd ? H : qd;
        kmax = kmax > (size_t)c->intermediate ? kmax : (size_t)c->intermediate;
        kmax = kmax > (size_t)c->shared_intermediate ? kmax : (size_t)c->shared_intermediate;
        m->ws.lora_x = c->lora_dropout > 0 ? carve(cv, BT * kmax) : NULL;
        m->ws.lora_dx = c->lora_dropout > 0 ? carve(cv, BT * kmax) : NULL;
    }
    m->ws.rope_cos = carve(cv, (size_t)m->act.T * hd / 2);
    m->ws.rope_sin = carve(cv, (size_t)m->act.T * hd / 2);
    m->ws.rope_cos_l = m->ws.rope_cos, m->ws.rope_sin_l = m->ws.rope_sin;
    if (lm_rope_local_differs(c)) {
        m->ws.rope_cos_l = carve(cv, (size_t)m->act.T * hd / 2);
        m->ws.rope_sin_l = carve(cv, (size_t)m->act.T * hd / 2);
    }
    m->ws.rope_cos_q = m->ws.rope_cos, m->ws.rope_sin_q = m->ws.rope_sin;
    if (c->q_scale_len > 0) {
        m->ws.rope_cos_q = carve(cv, (size_t)m->act.T * hd / 2);
        m->ws.rope_sin_q = carve(cv, (size_t)m->act.T * hd / 2);
    }
    m->ws.norm_w = c->norm_plus_one ? carve(cv, H > qd ? H : qd) : NULL;
    size_t Vr = vocab_held(c);
    m->ws.cap_t = c->final_softcap > 0 ? carve(cv, (size_t)m->ws.logit_rows * Vr) : NULL;
    m->ws.logits = carve(cv, (size_t)m->ws.logit_rows * Vr);
    if (vocab_par(c)) m->ws.ce_stats = carve(cv, 3 * (size_t)m->ws.logit_rows);
    m->ws.embed_ids = vocab_par(c) ? (int32_t *)carve(cv, BT) : NULL; /* int32 is a float's size */
    m->ws.d_res = carve(cv, BS * H);
    m->ws.d_ln = carve(cv, seq_all_rows(c, BT) * H); /* reduce-scattered in place: every rank's chunk */
    if (c->tp_seq && c->tp_degree > 1) {
        m->ws.sp_x = carve(cv, seq_all_rows(c, BT) * H);
        m->ws.sp_dy = carve(cv, seq_all_rows(c, BT) * H);
        m->ws.sp_dw = carve(cv, seq_norms(c) * H);
    }
    m->ws.d_att = carve(cv, BT * qd);
    m->ws.d_q = carve(cv, BT * qd);
    m->ws.d_q2 = carve(cv, BT * qd);
    m->ws.d_k = carve(cv, BT * kvd);
    m->ws.d_k2 = carve(cv, BT * kvd);
    m->ws.d_v = carve(cv, BT * kvd);
    m->ws.d_h = carve(cv, BT * I);
    m->ws.d_gate = carve(cv, BT * I);
    m->ws.d_up = carve(cv, BT * I);
}

size_t lm_bank_floats(const lm_model *m, int l0, int l1) {
    carver cv = {0};
    lm_layer_acts *tmp = ct_calloc((size_t)(l1 - l0) + 1, sizeof *tmp);
    float *a, *b, *c;
    plan_range(m, &cv, tmp, l0, l1, &a, &b, &c);
    free(tmp);
    return cv.used;
}

lm_bank *lm_bank_new(const lm_model *m, int l0, int l1) {
    lm_bank *b = ct_calloc(1, sizeof *b);
    b->l0 = l0;
    b->l1 = l1;
    b->acts = ct_calloc((size_t)(l1 - l0) + 1, sizeof *b->acts);
    b->floats = lm_bank_floats(m, l0, l1);
    b->dev = m->dev;
    b->mem = b->dev->alloc((b->floats + 1) * sizeof(float));
    carver cv = {b->mem, 0};
    plan_range(m, &cv, b->acts, l0, l1, &b->res_out, &b->lnf, &b->lnf_rstd);
    return b;
}

void lm_bank_use(lm_model *m, const lm_bank *b) {
    memcpy(&m->act.layer[b->l0], b->acts, (size_t)(b->l1 - b->l0) * sizeof *b->acts);
    if (b->l1 == m->cfg.n_layers) {
        m->act.res_out = b->res_out;
        m->act.lnf = b->lnf;
        m->act.lnf_rstd = b->lnf_rstd;
    }
    m->act.scratch_layer = -1; /* the scratch holds another micro-batch's recomputation, if any */
    m->act.bank = b;           /* expert parallel keeps its dispatch state per bank (distributed/ep.c) */
}

void lm_bank_free(lm_bank *b) {
    if (!b) return;
    free(b->acts);
    b->dev->free(b->mem, (b->floats + 1) * sizeof(float), 0);
    free(b);
}

int lm_ac_layer(const char *ac_mode, const char *ac_option, int l, ct_err *e) {
    if (!ac_mode || strcmp(ac_mode, "none") == 0) return LM_AC_NONE;
    if (strcmp(ac_mode, "full") == 0) return LM_AC_FULL;
    if (strcmp(ac_mode, "selective") != 0) {
        ct_fail(e, CT_ERR_CONFIG, "activation_checkpoint.mode: \"%s\" is not one of none, selective, full",
                ac_mode);
        return -1;
    }
    const char *o = ac_option ? ac_option : "";
    if (strcmp(o, "op") == 0) return LM_AC_OP;
    char *end;
    long n = o[0] >= '0' && o[0] <= '9' ? strtol(o, &end, 10) : 0;
    if (n < 1 || n > 1000000 || *end) {
        ct_fail(e, CT_ERR_CONFIG,
                "activation_checkpoint.selective_ac_option: \"%s\" is neither \"op\" nor a layer period >= 1", o);
        return -1;
    }
    /* torchtitan counts wrapped blocks from 1 and checkpoints when count % N == 0 */
    return (l + 1) % n == 0 ? LM_AC_FULL : LM_AC_NONE;
}

int lm_create(lm_model *m, const lm_config *c, int B, int T, ct_err *e) {
    return lm_create_ac(m, c, B, T, "none", NULL, e);
}

/* Each block of logits rows re-reads the whole lm_head in its forward and in
 * its d(input) product, and reads and writes the whole d(lm_head): at Qwen3's
 * vocabulary ~1.9 GB of traffic per block whatever its rows, against 6 x rows
 * x 156 MFLOP. So as few blocks as keep one block's logits within
 * LM_LOGITS_BUDGET, of equal rows (one block of W1's 512 rows, where two of
 * 256 ran 5-11% slower in bf16: docs/benchmarks.md), and never fewer than the
 * 256 rows the blocks always had. HF's model holds all [BT, V] logits; the
 * budget is a third of that at 2048 rows of Qwen3's vocabulary. */
#define LM_LOGITS_BUDGET ((size_t)512 << 20)
int lm_logit_rows(const lm_config *c, int BT) {
    if (c->logit_rows > 0) return c->logit_rows < BT ? c->logit_rows : BT;
    /* vocabulary-parallel: every rank the same rows (their loss's collectives pair block by block),
     * sized by the largest block, rank 0's ceil(V / t); a config that gives its rows without a
     * degree (tests/c/model/test_lm.c) by those */
    size_t V = vocab_par(c)   ? ((size_t)c->vocab_size + c->tp_degree - 1) / (size_t)c->tp_degree
               : c->vocab_rows ? (size_t)c->vocab_rows
                               : (size_t)c->vocab_size;
    size_t blocks = ((size_t)BT * V * sizeof(float) + LM_LOGITS_BUDGET - 1) / LM_LOGITS_BUDGET;
    int rows = (int)(((size_t)BT + blocks - 1) / blocks), least = BT < 256 ? BT : 256;
    return rows > least ? rows : least;
}

/* The layout and the activation plan, counted but not allocated: m->tensors,
 * m->n_params, m->act.layer (pointers still NULL), m->act.floats and the
 * per-layer checkpointing policy m->act.pol [L]. Shared by
 * lm_create_ac and lm_plan_memory so --dry-run reports what a run
 * allocates. */
static int plan_model(lm_model *m, const lm_config *c, int B, int T, const char *ac_mode,
                      const char *ac_option, ct_err *e) {
    memset(m, 0, sizeof *m);
    int rc = lm_config_check(c, "model", e);
    if (rc) return rc;
    if (B < 1 || T < 1) return ct_fail(e, CT_ERR_CONFIG, "model: batch %d x sequence %d is empty", B, T);
    /* the layers count rows in an int (B x T): the product must fit one. The library API
     * comes here without cfg_validate, which says the same about the TOML's keys */
    if ((long long)B * T > INT_MAX)
        return ct_fail(e, CT_ERR_CONFIG,
                       "model: training.local_batch_size %d x training.seq_len %d = %lld rows, out of range (at most %d)",
                       B, T, (long long)B * T, INT_MAX);
    {
        /* a layer's activations are ~20 buffers of B x T x a width: refuse before their
         * size_t sums could wrap (see LM_MAX_PARAMS) */
        double w = (double)c->hidden + ((double)c->n_heads + 2.0 * c->n_kv_heads) * c->head_dim +
                   (c->n_experts > 0 ? (double)c->top_k * c->moe_intermediate : (double)c->intermediate) +
                   (c->shared_intermediate > 0 ? (double)c->shared_intermediate : 0); /* beside the experts' */
        double acts = (double)B * T * 8.0 * w * (c->n_layers + 1);
        if (acts > LM_MAX_PARAMS) {
            char sh[64] = "";
            if (c->shared_intermediate > 0)
                snprintf(sh, sizeof sh, ", shared_expert_intermediate_size %d", c->shared_intermediate);
            return ct_fail(e, CT_ERR_CONFIG,
                           "model: training.local_batch_size %d x training.seq_len %d x the layers' widths "
                           "(hidden_size %d, intermediate_size %d%s) give about %.3g activation floats, out of "
                           "range (at most 2^50)",
                           B, T, c->hidden, c->intermediate, sh, acts);
        }
    }
    int *pol = ct_calloc((size_t)c->n_layers + 1, sizeof(int)); // [L] policy per layer
    for (int l = 0; l < c->n_layers; l++) {
        if ((pol[l] = lm_ac_layer(ac_mode, ac_option, l, e)) < 0) {
            free(pol);
            return CT_ERR_CONFIG;
        }
    }
    m->cfg = *c;
    build_layout(m);
    m->act.B = B;
    m->act.T = T;
    m->ws.logit_rows = lm_logit_rows(c, B * T);
    m->act.layer = ct_calloc((size_t)c->n_layers + 1, sizeof(lm_layer_acts));
    m->act.pol = pol;
    carver cv = {0};
    plan_activations(m, &cv);
    m->act.floats = cv.used;
    return 0;
}

/* ------------------------------------------------------------------ RoPE */

static rope_params rope_default(const lm_config *c) {
    rope_params p;
    memset(&p, 0, sizeof p);
    p.type = ROPE_DEFAULT;
    p.theta = c->rope_theta;
    p.partial_rotary_factor = 1.0;
    return p;
}

/* Whether the tables depend on the forward's length (dynamic, longrope). */
static int lm_rope_by_length(const lm_config *c) {
    /* HunYuan's dynamic with alpha (ntk_alpha) has a fixed base */
    return c->has_rope && ((c->rope.type == ROPE_DYNAMIC && c->rope.alpha == 0) || c->rope.type == ROPE_LONGROPE ||
                           (c->rope_local.type == ROPE_DYNAMIC && c->rope_local.alpha == 0) ||
                           c->rope_local.type == ROPE_LONGROPE);
}

int lm_rope_local_differs(const lm_config *c) {
    return c->has_rope && memcmp(&c->rope, &c->rope_local, sizeof c->rope) != 0;
}

rope_params lm_rope_params(const lm_config *c, int sliding) {
    /* without config.json's RoPE, default RoPE with rope_theta: rope_tables gives op_rope_tables' bits */
    return !c->has_rope ? rope_default(c) : sliding ? c->rope_local : c->rope;
}

void lm_rope_tables(const lm_config *c, int sliding, int seq_len, int p0, int T, float *cos, float *sin) {
    rope_params p = lm_rope_params(c, sliding);
    double inv[ROPE_MAX_HALF], scale = 1.0;
    rope_inv_freq(&p, c->head_dim, seq_len, inv, &scale);
    rope_tables(cos, sin, p0, T, rope_rotary_dim(&p, c->head_dim) / 2, inv, scale);
}

void lm_rope_q_tables(const lm_config *c, int p0, int T, const float *cos, const float *sin, float *qcos,
                      float *qsin) {
    size_t half = (size_t)lm_rotary_dim(c) / 2;
    for (int t = 0; t < T; t++) {
        /* get_llama_4_attn_scale: float32 tensor ops on the integer positions */
        float fl = floorf((float)(p0 + t) / (float)c->q_scale_len);
        float s = 1.0f + (float)c->q_scale_beta * logf(1.0f + fl);
        for (size_t i = 0; i < half; i++) {
            qcos[(size_t)t * half + i] = cos[(size_t)t * half + i] * s;
            qsin[(size_t)t * half + i] = sin[(size_t)t * half + i] * s;
        }
    }
}

int lm_rotary_dim(const lm_config *c) {
    /* lm_config_from_hf refuses a sliding-layer RoPE that rotates another width */
    return c->has_rope ? rope_rotary_dim(&c->rope, c->head_dim) : c->head_dim;
}

/* The model's tables for a forward of T positions. */
static void rope_build(lm_model *m, int T) {
    lm_rope_tables(&m->cfg, 0, T, 0, T, m->ws.rope_cos, m->ws.rope_sin);
    if (m->ws.rope_cos_l != m->ws.rope_cos) lm_rope_tables(&m->cfg, 1, T, 0, T, m->ws.rope_cos_l, m->ws.rope_sin_l);
    if (m->ws.rope_cos_q != m->ws.rope_cos)
        lm_rope_q_tables(&m->cfg, 0, T, m->ws.rope_cos, m->ws.rope_sin, m->ws.rope_cos_q, m->ws.rope_sin_q);
    m->ws.rope_T = T;
}

int lm_create_ac(lm_model *m, const lm_config *c, int B, int T, const char *ac_mode,
                    const char *ac_option, ct_err *e) {
    int rc = plan_model(m, c, B, T, ac_mode, ac_option, e);
    if (rc) {
        lm_free(m);
        return rc;
    }
    kern_select_ref(&m->k);
    m->dev = &ct_device_cpu; /* the memory kernels touch comes from the run's device */
    void *(*alloc)(size_t) = c->lazy_buffers ? m->dev->alloc_lazy : m->dev->alloc;
    m->params = alloc(m->n_params * sizeof(float));
    m->grads = alloc(m->n_params * sizeof(float));
    m->w.layer = ct_calloc((size_t)c->n_layers, sizeof(lm_layer_w));
    m->g.layer = ct_calloc((size_t)c->n_layers, sizeof(lm_layer_w));
    bind_weights(&m->w, m, m->params, 0);
    bind_weights(&m->g, m, m->grads, 1);
    m->act.mem = m->dev->alloc(m->act.floats * sizeof(float));
    carver cv = {m->act.mem, 0};
    plan_activations(m, &cv);
    m->act.scratch_layer = -1;
    m->moe.aux_scale = 1.0f;
    m->moe.count = ct_calloc((size_t)c->n_experts + 1, sizeof(double));
    m->moe.psum = ct_calloc((size_t)c->n_experts + 1, sizeof(double));
    m->moe.load_min = ct_calloc((size_t)c->n_layers + 1, sizeof(int));
    m->moe.load_max = ct_calloc((size_t)c->n_layers + 1, sizeof(int));
    m->moe.bias = ct_calloc((size_t)c->n_layers * c->n_experts + 1, sizeof(float));
    m->moe.tokens = ct_calloc((size_t)c->n_layers * c->n_experts + 1, sizeof(double));
    for (int l = 0; l < c->n_layers; l++) m->moe.load_min[l] = m->moe.load_max[l] = -1;
    rope_build(m, T);
    return 0;
}

int lm_layout(lm_model *m, const lm_config *c) {
    memset(m, 0, sizeof *m);
    m->cfg = *c;
    build_layout(m);
    return 0;
}

int lm_plan_memory(const lm_config *c, int B, int T, const char *ac_mode, const char *ac_option,
                      size_t *n_params, size_t *act_bytes, ct_err *e) {
    lm_model m;
    int rc = plan_model(&m, c, B, T, ac_mode, ac_option, e);
    if (!rc) {
        *n_params = m.n_params;
        *act_bytes = m.act.floats * sizeof(float);
    }
    lm_free(&m);
    return rc;
}

void lm_free(lm_model *m) {
    free(m->tensors);
    if (m->dev) {
        m->dev->free(m->params, m->n_params * sizeof(float), m->cfg.lazy_buffers);
        m->dev->free(m->grads, m->n_params * sizeof(float), m->cfg.lazy_buffers);
        m->dev->free(m->act.mem, m->act.floats * sizeof(float), 0);
    }
    free(m->fstore);
    free(m->ws.lora_ew);
    free(m->ws.lora_dew);
    free(m->ws.lora_rw);
    free(m->ws.lora_drw);
    free(m->ws.head_tmp);
    free(m->ws.head_u);
    free(m->ws.head_du);
    free(m->ws.head_da);
    free(m->ws.emb_du);
    free(m->w.layer);
    free(m->g.layer);
    free(m->act.layer);
    free(m->act.pol);
    free(m->moe.count);
    free(m->moe.psum);
    free(m->moe.load_min);
    free(m->moe.load_max);
    free(m->moe.bias);
    free(m->moe.tokens);
    memset(m, 0, sizeof *m);
}

size_t lm_tensor_cols(const lm_tensor *t) { return t->ndim == 2 ? (size_t)t->shape[1] : 1; }

size_t lm_block_rows(const lm_model *m, const lm_tensor *t) {
    size_t r = (m->block_elems ? m->block_elems : LM_BLOCK_ELEMS) / lm_tensor_cols(t);
    return r ? r : 1;
}

static void copy_put(void *ctx, int kind, int i, size_t r0, size_t r1, const float *rows) {
    lm_copy_ctx *c = ctx;
    const lm_tensor *t = &c->m->tensors[i];
    size_t cols = lm_tensor_cols(t);
    if (kind == LM_PARAMS && t->store != LM_NO_STORE) {
        lm_put_rows(c->m, i, r0, r1, rows);
        return;
    }
    if (c->dst[kind]) memcpy(c->dst[kind] + t->offset + r0 * cols, rows, (r1 - r0) * cols * sizeof(float));
}

lm_sink lm_copy_sink(lm_copy_ctx *ctx, lm_model *m, float *exp_avg, float *exp_avg_sq) {
    *ctx = (lm_copy_ctx){m, {m->params, exp_avg, exp_avg_sq}};
    return (lm_sink){copy_put, ctx};
}

void lm_init_random_each(const lm_model *table, uint64_t seed, const lm_sink *s) {
    ct_rng r;
    ct_rng_seed(&r, seed);
    size_t most = 1;
    for (int i = 0; i < table->n_tensors; i++) {
        const lm_tensor *t = &table->tensors[i];
        size_t b = lm_block_rows(table, t) * lm_tensor_cols(t);
        most = b > most ? b : most;
    }
    float *buf = ct_malloc(most * sizeof(float)); /* [block] a block of rows at a time, in table order */
    for (int i = 0; i < table->n_tensors; i++) {
        const lm_tensor *t = &table->tensors[i];
        if (t->lora) continue; /* adapters have PEFT's init (model/lora.h), and draw nothing from this stream */
        /* vectors as transformers initialises them: biases 0, norms 1 (Gemma's 1 + w norms: 0) */
        int bias = t->slot == LM_S_BQ || t->slot == LM_S_BK || t->slot == LM_S_BV || t->slot == LM_S_BO ||
                   t->slot == LM_S_BG || t->slot == LM_S_BU || t->slot == LM_S_BD;
        float vec = bias || table->cfg.norm_plus_one ? 0.0f : 1.0f;
        size_t rows = t->numel / lm_tensor_cols(t), cols = lm_tensor_cols(t), step = lm_block_rows(table, t);
        for (size_t r0 = 0; r0 < rows; r0 += step) { /* row-major: the same draws as one tensor at once */
            size_t r1 = r0 + step < rows ? r0 + step : rows;
            for (size_t j = 0; j < (r1 - r0) * cols; j++)
                buf[j] = t->is_matrix ? (float)(0.02 * ct_rng_normal(&r)) : vec;
            s->put(s->ctx, LM_PARAMS, i, r0, r1, buf);
        }
    }
    free(buf);
}

void lm_init_random(lm_model *m, uint64_t seed) {
    lm_copy_ctx cc;
    lm_sink s = lm_copy_sink(&cc, m, NULL, NULL);
    lm_init_random_each(m, seed, &s);
}

size_t lm_trained_runs(const lm_model *m, size_t a, size_t b, void (*run)(void *ctx, size_t x, size_t y),
                          void *ctx) {
    size_t total = 0, rx = 0, ry = 0; /* the run being extended: [rx, ry) */
    for (int i = 0; i < m->n_tensors && a < b; i++) {
        const lm_tensor *q = &m->tensors[i];
        size_t x = q->offset > a ? q->offset : a, y = q->offset + q->numel < b ? q->offset + q->numel : b;
        if (q->frozen || x >= y) continue;
        total += y - x;
        if (ry == x && ry > rx) { /* adjacent trained tensors: one run */
            ry = y;
            continue;
        }
        if (run && ry > rx) run(ctx, rx, ry);
        rx = x, ry = y;
    }
    if (run && ry > rx) run(ctx, rx, ry);
    return total;
}

/* ------------------------------------------------- frozen bf16 storage */

size_t lm_store_frozen_bf16(lm_model *m) {
    size_t n = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        lm_tensor *t = &m->tensors[i];
        t->store = LM_NO_STORE;
        if (!t->frozen || !t->is_matrix || !t->numel) continue; /* norms stay fp32: tiny */
        t->store = n;
        n += t->numel;
    }
    free(m->fstore);
    m->fstore = n ? ct_malloc(n * sizeof(uint16_t)) : NULL;
    m->n_store = n;
    return n;
}

void lm_put_rows(lm_model *m, int i, size_t r0, size_t r1, const float *rows) {
    const lm_tensor *t = &m->tensors[i];
    size_t cols = lm_tensor_cols(t), n = (r1 - r0) * cols;
    if (t->store == LM_NO_STORE) {
        memcpy(m->params + t->offset + r0 * cols, rows, n * sizeof(float));
        return;
    }
    ct_convert_from_f32(m->fstore + t->store + r0 * cols, CT_BF16, rows, n); /* round to nearest even */
}

void lm_frozen_widen(lm_model *m, size_t off, size_t n, int on) {
    if (!m->n_store || !n) return;
    int lo = 0, hi = m->n_tensors; /* the first tensor ending after off */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (m->tensors[mid].offset + m->tensors[mid].numel <= off) lo = mid + 1;
        else hi = mid;
    }
    for (int i = lo; i < m->n_tensors && m->tensors[i].offset < off + n; i++) {
        const lm_tensor *t = &m->tensors[i];
        if (t->store == LM_NO_STORE) continue;
        if (on) ct_convert_to_f32(m->params + t->offset, m->fstore + t->store, CT_BF16, t->numel);
        else ct_drop_pages(m->params + t->offset, t->numel * sizeof(float));
    }
}

const lm_tensor *lm_find(const lm_model *m, const char *name) {
    for (int i = 0; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0) return &m->tensors[i];
    return NULL;
}

size_t lm_activation_bytes(const lm_model *m) { return m->act.floats * sizeof(float); }
size_t lm_num_params(const lm_model *m) { return m->n_params; }

double lm_flops_per_token(const lm_model *m, int T) {
    const lm_config *c = &m->cfg;
    /* a pipeline stage counts what it runs: its layers, the lookup or the lm_head where it has them */
    double VH = (double)m->tensors[0].numel; /* V x H, or 0 on a stage without the embedding */
    double matmul_params = (double)m->n_params - VH;             /* no lookup */
    if (c->tie_embeddings && lm_holds_head(c)) /* lm_head runs: its rows of the vocabulary */
        matmul_params += (double)vocab_held(c) * c->hidden;
    /* a token runs k of the E experts of each MoE layer (on some rank, under expert parallel) */
    int held = c->expert_rows ? c->expert_rows : c->n_experts, moe = 0, layers = 0;
    for (int l = 0; l < c->n_layers; l++) {
        layers += lm_holds_layer(c, l);
        moe += lm_holds_layer(c, l) && lm_layer_is_moe(c, l);
    }
    matmul_params -= (double)moe * (held - c->top_k) * 3.0 * c->hidden * c->moe_intermediate;
    return 6.0 * matmul_params + 12.0 * layers * c->n_heads * c->head_dim * (double)T;
}

/* ---------------------------------------------------------------- forward */

/* A bf16-stored (frozen, lm_store_frozen_bf16) weight is never widened into
 * params for a step: every product reads it from its store, the dense
 * linears and the lm_head through the matmul op's wbf16 entries (mm_fwd,
 * mm_bwd, head_fwd), the MoE router the same way (moe_route_fwd) and the
 * MoE experts through the experts op's (experts_h). Their fp32 pages in
 * params are never touched, so they cost no memory. */

/* A kernel call, timed as one "op" span (its kern_ops member, the op and the
 * chosen implementation) when a profiler is attached (metrics/profile.h);
 * without one it costs a test of m->prof. */
#define K(ID, fn, ...)                                                                                           \
    do {                                                                                                         \
        int64_t k_t0_ = PROF_T0(m->prof);                                                                        \
        m->k.fn(__VA_ARGS__);                                                                                    \
        if (m->prof) prof_kern(m->prof, KERN_OP_##ID, #fn, k_t0_);                                               \
    } while (0)
/* The same for a kernel that returns a value, into dst. */
#define K_RET(dst, ID, fn, ...)                                                                                  \
    do {                                                                                                         \
        int64_t k_t0_ = PROF_T0(m->prof);                                                                        \
        (dst) = m->k.fn(__VA_ARGS__);                                                                            \
        if (m->prof) prof_kern(m->prof, KERN_OP_##ID, #fn, k_t0_);                                               \
    } while (0)

static void zero(float *p, size_t n) { memset(p, 0, n * sizeof(float)); }

/* The bf16 store of weight w (a pointer into m->params, maybe inside its
 * tensor), or NULL when w is fp32: not in params, or its tensor not stored. */
static const uint16_t *frozen_bf16(const lm_model *m, const float *w) {
    uintptr_t p = (uintptr_t)w, b = (uintptr_t)m->params;
    if (!m->n_store || !w || p < b || p >= b + m->n_params * sizeof(float)) return NULL;
    size_t off = (size_t)(w - m->params);
    int lo = 0, hi = m->n_tensors; /* the first tensor ending after off */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (m->tensors[mid].offset + m->tensors[mid].numel <= off) lo = mid + 1;
        else hi = mid;
    }
    if (lo == m->n_tensors) return NULL;
    const lm_tensor *t = &m->tensors[lo];
    if (t->store == LM_NO_STORE || off < t->offset) return NULL;
    return m->fstore + t->store + (off - t->offset);
}

/* The bf16 store of a stacked expert projection w[n] (E adjacent tensors,
 * trained or frozen together, lm_bind_frozen, so stored one after another),
 * or NULL when it is fp32. */
static const uint16_t *experts_bf16(const lm_model *m, const float *w, size_t n) {
    const uint16_t *h = frozen_bf16(m, w);
    if (h && n && frozen_bf16(m, w + n - 1) != h + n - 1) {
        /* lm_store_frozen_bf16 stores frozen matrices in table order: a gap is a layout bug */
        fprintf(stderr, "ctitan: error: a MoE projection's experts are not one block of the bf16 store\n");
        abort();
    }
    return h;
}

/* out[M, N] (+)= in[M, K] @ w[N, K]^T, w read from its bf16 store when it has
 * one (the kernels give the bits of the product on its fp32 widening). */
static void mm_fwd(lm_model *m, float *out, const float *in, const float *w, int M, int K, int N, int accumulate) {
    const uint16_t *h = frozen_bf16(m, w);
    if (h) K(MATMUL, matmul_fwd_wbf16, out, in, h, M, K, N, accumulate);
    else K(MATMUL, matmul_fwd, out, in, w, M, K, N, accumulate);
}

/* I of a split backward (lm.h, lm_wstore): dw's product, recorded instead of run. */
static void wdefer_put(lm_model *m, float *dw, float *db, const float *dout, const float *in, const float *w, int M,
                       int K, int N) {
    lm_wstore *s = m->wdefer;
    size_t nx = (size_t)M * K, ny = (size_t)M * N;
    /* past lm_wstore_reserve's room (a store not sized first): grown by doubling */
    if (s->n == s->cap) lm_wstore_reserve(s, 0, s->cap ? 2 * s->cap : 64);
    /* q, k and v read one input, as gate and up do: a layer's products in a row on the same
     * buffer share its copy */
    const lm_wrec *last = s->n ? &s->rec[s->n - 1] : NULL;
    if (last && last->layer == s->cur && s->xsrc == in && last->M == M && last->K == K) nx = 0;
    if (s->used + nx + ny > s->size) lm_wstore_reserve(s, 2 * (s->used + nx + ny), 0);
    size_t x = nx ? s->used : last ? last->x : 0;
    s->rec[s->n++] = (lm_wrec){.layer = s->cur, .x = x, .dy = s->used + nx, .dw = dw, .db = db, .w = w, .M = M,
                               .K = K, .N = N};
    if (nx) memcpy(s->data + s->used, in, nx * sizeof(float));
    memcpy(s->data + s->used + nx, dout, ny * sizeof(float));
    s->xsrc = in;
    s->used += nx + ny;
    if (s->used > s->peak) s->peak = s->used;
}

/* I of a split backward on a MoE layer's experts (lm.h, lm_wstore): the
 * experts kernel ran with its weight gradients NULL (d(input) and d topw
 * only) and left d gate / d up in work; recorded here, copies all, is what
 * op_moe_experts_bwd_w needs to add dg, du, dd (NULL: frozen) later, on the
 * same operands: x [BT, H] (ln2, all rows) for gate / up, dout [BT, H] and
 * the forward's h [BT k, Im] for down, and the routing (perm, topw,
 * offsets). Copies, not references: h and the routing live in the
 * micro-batch's bank, which the stage's next forward may refill (or, under
 * checkpointing, the scratch layer, the next recomputation) before W, and
 * d gate / d up in the experts' scratch, which the next MoE layer's
 * backward overwrites. */
static void wdefer_experts(lm_model *m, float *dg, float *du, float *dd, const float *dout, const lm_layer_acts *a,
                           const float *work, int BT) {
    const lm_config *c = &m->cfg;
    lm_wstore *s = m->wdefer;
    int H = c->hidden, E = c->n_experts, k = c->top_k, Im = c->moe_intermediate;
    size_t S = (size_t)BT * k, nx = dg || du ? (size_t)BT * H : 0, nd = dd ? (size_t)BT * H : 0;
    size_t nh = dd ? S * Im : 0, ng = dg ? S * Im : 0, nu = du ? S * Im : 0, nr = S + (dd ? S : 0) + (size_t)E + 1;
    size_t need = nx + nd + nh + ng + nu + nr;
    if (s->n == s->cap) lm_wstore_reserve(s, 0, s->cap ? 2 * s->cap : 64);
    if (s->used + need > s->size) lm_wstore_reserve(s, 2 * (s->used + need), 0);
    const moe_route *r = &a->route;
    lm_wrec *w = &s->rec[s->n++];
    memset(w, 0, sizeof *w);
    w->layer = s->cur, w->kind = LM_W_EXPERTS, w->dw = dg, w->dwu = du, w->dwd = dd, w->M = BT, w->K = H, w->N = Im;
    w->E = E, w->k = k;
    float *d = s->data;
    size_t o = s->used;
    /* each copy at its offset (o advances); an operand not needed keeps offset 0, unread */
#define WCOPY(field, src, n)                                                                                          \
    do {                                                                                                              \
        w->field = o;                                                                                                 \
        if (n) memcpy(d + o, src, (n) * sizeof(float));                                                               \
        o += (n);                                                                                                     \
    } while (0)
    WCOPY(x, a->ln2, nx);
    WCOPY(dy, dout, nd);
    WCOPY(h, a->h, nh);
    WCOPY(dg, KERN_MOE_DGATE(work, S, Im), ng);
    WCOPY(du, KERN_MOE_DUP(work, S, Im), nu);
#undef WCOPY
    w->route = o; /* perm [S], offsets [E + 1], topw [S] (dd only): int32 as 4 bytes each */
    memcpy(d + o, r->perm, S * sizeof(int32_t));
    memcpy(d + o + S, r->offsets, ((size_t)E + 1) * sizeof(int32_t));
    if (dd) memcpy(d + o + S + E + 1, r->topw, S * sizeof(float));
    s->used += need;
    s->xsrc = NULL; /* a dense product after it copies its own input */
    if (s->used > s->peak) s->peak = s->used;
    s->n_experts++;
}

/* I of a split backward on an RMSNorm (lm.h, lm_wstore): its d(input) ran
 * with dw NULL; recorded here, copies all, is what the weight gradient's
 * half (kind: the op that adds it) reads: the norm's input x and d(output)
 * dy [rows, C] and rstd [rows]. Copies, as the experts': x and rstd sit in the
 * micro-batch's bank or checkpointing scratch, dy in the layer's gradient
 * scratch, both refilled before W. x and rstd rather than the normalised x r
 * (one float a row fewer, 1 / (2 C + 1) of the record): a copy, no arithmetic
 * in I, and W's product is then the fused kernel's dy (x r) by construction. */
static void wdefer_norm(lm_model *m, int kind, float *dw, const float *dy, const float *x, const float *rstd,
                        int rows, int C) {
    lm_wstore *s = m->wdefer;
    size_t n = (size_t)rows * C, need = 2 * n + (size_t)rows;
    if (s->n == s->cap) lm_wstore_reserve(s, 0, s->cap ? 2 * s->cap : 64);
    if (s->used + need > s->size) lm_wstore_reserve(s, 2 * (s->used + need), 0);
    lm_wrec *w = &s->rec[s->n++];
    memset(w, 0, sizeof *w);
    w->layer = s->cur, w->kind = kind, w->dw = dw, w->M = rows, w->K = C;
    w->x = s->used, w->dy = s->used + n, w->rstd = s->used + 2 * n;
    memcpy(s->data + w->x, x, n * sizeof(float));
    memcpy(s->data + w->dy, dy, n * sizeof(float));
    memcpy(s->data + w->rstd, rstd, (size_t)rows * sizeof(float));
    s->used += need;
    s->xsrc = NULL; /* a dense product after it copies its own input */
    if (s->used > s->peak) s->peak = s->used;
}

/* matmul_bwd's din[M, K] (+)= dout[M, N] w[N, K] (acc 0: din's first product,
 * overwritten) and dw[N, K] += dout^T in[M, K], and the bias's db[N] += the
 * sum of dout's rows (NULL: none or frozen); a bf16-stored w is frozen, so it
 * has no dw (NULL) and only din runs, from the store. Under m->wdefer (I of a
 * split backward) dw's product is recorded, not run, and db's sum with it: it
 * reads the d(output) the record copies, so W has it for no store. */
static void mm_bwd_b(lm_model *m, float *din, float *dw, float *db, const float *dout, const float *in, const float *w,
                     int M, int K, int N, int acc) {
    const uint16_t *h = frozen_bf16(m, w);
    if (!h && dw && m->wdefer) {
        wdefer_put(m, dw, db, dout, in, w, M, K, N);
        dw = db = NULL;
    }
    if (db) op_bias_bwd(db, dout, M, N);
    if (!h) K(MATMUL, matmul_bwd, din, dw, dout, in, w, M, K, N, acc);
    else if (din) K(MATMUL, matmul_dinp_wbf16, din, dout, h, M, K, N, N, acc);
}
static void mm_bwd(lm_model *m, float *din, float *dw, const float *dout, const float *in, const float *w, int M, int K,
                   int N, int acc) {
    mm_bwd_b(m, din, dw, NULL, dout, in, w, M, K, N, acc);
}

/* The gradient scratch a layer's backward accumulates into (+=), zeroed at the
 * layer's start. Most of it needs none: the first product into each buffer
 * overwrites it (acc 0) -- d_h and d_att (down_proj's and o_proj's d(input)),
 * d_gate and d_up (swiglu / geglu), d_q, d_k and d_v (attention), and d_q2 and
 * d_k2 when the per-head q/k norm + RoPE writes them (Qwen3). Zeroing those
 * 54 MB per layer at W3's shapes, and the kernels' read of the zeros, were
 * ~2% of its step at AVX2 (docs/benchmarks.md). What is left: d_q2 and d_k2
 * under the other q/k paths, whose RoPE and RMSNorm backwards add. */
static void zero_layer_scratch(lm_model *m, int BT) {
    const lm_config *c = &m->cfg;
    size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    float *p[2] = {m->ws.d_q2, m->ws.d_k2};
    size_t n[2] = {qd * (size_t)BT, kvd * (size_t)BT}, total = n[0] + n[1];
    if (total < ((size_t)1 << 18)) { /* a region costs more than it saves */
        for (int i = 0; i < 2; i++) zero(p[i], n[i]);
        return;
    }
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        /* this thread's share of the buffers laid end to end */
        size_t t = (size_t)omp_get_thread_num(), T = (size_t)omp_get_num_threads();
        size_t lo = total * t / T, hi = total * (t + 1) / T, base = 0;
        for (int i = 0; i < 2; i++) {
            size_t a = lo > base ? lo - base : 0, b = hi - base < n[i] ? hi - base : n[i];
            if (hi > base && a < b) zero(p[i] + a, b - a);
            base += n[i];
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* Sequence parallel (m->sp): the residual stream and the norms hold this
 * rank's block of the BT rows, the projections between them all rows. The
 * blocks are DTensor Shard's: chunks of C = ceil(BT / t) rows, rank r's
 * rows [r C, min((r + 1) C, BT)), so the last ranks' are shorter or empty.
 * The collectives move whole chunks: a short block is padded (rows nobody
 * reads), and since only the ranks after every full one are short, the
 * first BT rows of t gathered chunks are all rows in order. */
static int sp_chunk(const lm_model *m, int BT) { return m->sp ? (BT + m->sp->t - 1) / m->sp->t : BT; }
static size_t sp_row0(const lm_model *m, int BT) {
    size_t r0 = m->sp ? (size_t)m->sp->rank * (size_t)sp_chunk(m, BT) : 0;
    return r0 < (size_t)BT ? r0 : (size_t)BT;
}
static int sp_rows(const lm_model *m, int BT) {
    int n = BT - (int)sp_row0(m, BT), C = sp_chunk(m, BT);
    return n < C ? n : C;
}
/* x: this rank's chunk [C, H] -> full[t C, H], every rank's in order (its
 * first BT rows all rows); without sequence parallel x holds all rows. */
static float *sp_gather(lm_model *m, float *full, const float *x, int BT, int H) {
    if (!m->sp) return (float *)x;
    m->sp->gather(m->sp->ctx, full, x, (size_t)sp_chunk(m, BT) * H);
    /* full now holds other rows: a deferred product's copy of its old ones must not be shared
     * with the next record reading full (gate / up, then q when o_proj records nothing) */
    if (m->wdefer) m->wdefer->xsrc = NULL;
    return full;
}
/* A partial sum under tensor parallelism that every rank needs whole (the
 * MoE experts' d(routing weights)); d of a column-parallel block's input
 * goes through sum_rows. */
static void reduce_d_input(lm_model *m, float *d, size_t n) {
    if (m->hooks && m->hooks->reduce_partial) m->hooks->reduce_partial(m->hooks->ctx, d, n);
}

/* x[BT, H], a partial sum over the tensor-parallel group -> the sum of the
 * rows this rank holds: all of them (all-reduce in place), or under
 * sequence parallel its block, reduce-scattered in place (returned); x then
 * has room for t chunks (d_ln), the rows past BT padding summed into the
 * short ranks' padding. */
static float *sum_rows(lm_model *m, float *x, int BT, int H) {
    if (m->sp) {
        size_t n = (size_t)sp_chunk(m, BT) * H;
        float *mine = x + (size_t)m->sp->rank * n;
        m->sp->scatter(m->sp->ctx, mine, x, n);
        return mine;
    }
    reduce_d_input(m, x, (size_t)BT * H);
    return x;
}

/* out[BT, N] = base + in[BT, K] @ w[N, K]^T, the residual add of o_proj and
 * down_proj. Under tensor parallelism (hooks->reduce_partial) this rank's
 * product covers only its slice of K: the partial products are summed over
 * the ranks first and base is added once; under sequence parallel out and
 * base are this rank's rows, the sum a reduce-scatter (through d_ln, free
 * in a forward and before a layer's backward). */
static void residual_matmul(lm_model *m, float *out, const float *base, const float *in, const float *w, int BT,
                            int K, int N) {
    size_t n = (size_t)BT * N;
    if (!m->hooks || !m->hooks->reduce_partial) {
        memcpy(out, base, n * sizeof(float));
        mm_fwd(m, out, in, w, BT, K, N, 1);
        return;
    }
    if (m->sp) {
        mm_fwd(m, m->ws.d_ln, in, w, BT, K, N, 0);
        const float *y = sum_rows(m, m->ws.d_ln, BT, N);
        for (size_t i = 0; i < (size_t)sp_rows(m, BT) * N; i++) out[i] = base[i] + y[i];
        return;
    }
    mm_fwd(m, out, in, w, BT, K, N, 0);
    m->hooks->reduce_partial(m->hooks->ctx, out, n);
    for (size_t i = 0; i < n; i++) out[i] += base[i];
}

/* ------------------------------------------------------------------ LoRA */

/* The adapter's input: x itself, or in a training forward with dropout,
 * drop(x) = x * keep / (1 - p) in m->ws.lora_x. The mask is a hash of
 * (lora_seed, layer, projection, element), so a recomputation and the
 * backward rebuild it without storing it, and a resumed run replays it. */
static uint64_t lora_mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static uint64_t lora_key(const lm_model *m, int l, int p) {
    p = lora_fused_head(&m->cfg, p);
    return lora_mix(m->lora_seed ^ lora_mix(((uint64_t)l << 8) | (uint64_t)p));
}
/* Element i survives when its hash's top 24 bits are at or above p 2^24. */
static int lora_kept(uint64_t key, size_t i, uint32_t cut) { return (uint32_t)(lora_mix(key + i) >> 40) >= cut; }
static uint32_t lora_cut(const lm_model *m) { return (uint32_t)((double)m->cfg.lora_dropout * 16777216.0); }

/* Row `row` of the input [BT, K] starts at element lora_row_elem of the
 * step's whole input [global batch x T, K] (one process's, had it run the
 * step as one micro-batch), and its K columns follow on, so the mask is
 * every layout's: its row b is sequence lora_seq0 + b lora_seq_stride of the
 * global batch (data-parallel ranks and micro-batches hold interleaved or
 * consecutive ones); under tensor parallelism o_proj's and down_proj's input
 * is this rank's block of K columns of the whole [BT, K t]; under context
 * parallel its rows are a chunk of each sequence's. */
static int lora_row_parallel(const lm_model *m, int p) {
    return m->cfg.tp_degree > 1 && (p == LM_LORA_O || p == LM_LORA_DOWN);
}
static size_t lora_row_elem(const lm_model *m, int p, size_t row, size_t K) {
    size_t col = 0, W = K, Tl = (size_t)m->act.fwd_T, T = Tl, pos = row % Tl;
    size_t stride = m->lora_seq_stride > 0 ? (size_t)m->lora_seq_stride : 1;
    if (lora_row_parallel(m, p)) col += (size_t)m->cfg.tp_rank * K, W = K * (size_t)m->cfg.tp_degree;
    if (m->cp_T) {
        size_t half = Tl / 2;
        pos = m->cp_p1 && pos >= half ? (size_t)m->cp_p1 + pos - half : (size_t)m->cp_p0 + pos;
        T = (size_t)m->cp_T;
    }
    size_t seq = (size_t)m->lora_seq0 + row / Tl * stride;
    return (seq * T + pos) * W + col;
}

/* PEFT's dropout on an adapter's input, rows [r0, r0 + BT) of the step's
 * x[., K] of projection p in layer l (the head's adapter: l = n_layers):
 * dx NULL: drop(x) into m->ws.lora_x, returned; else the backward,
 * dx += d drop(x) / dx of dxd (1 / (1 - p) where the mask kept x, 0 where it
 * dropped it). */
static const float *lora_mask(lm_model *m, int l, int p, const float *x, int r0, int BT, int K, float *dx,
                              const float *dxd) {
    uint64_t key = lora_key(m, l, p);
    uint32_t cut = lora_cut(m);
    float keep = 1.0f / (1.0f - m->cfg.lora_dropout);
    float *d = m->ws.lora_x;
    int64_t t0 = PROF_T0(m->prof);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long row = 0; row < BT; row++) {
            size_t e = lora_row_elem(m, p, (size_t)(r0 + row), (size_t)K), i = (size_t)row * K;
            for (size_t c = 0; c < (size_t)K; c++) {
                int kept = lora_kept(key, e + c, cut);
                if (dx) {
                    if (kept) dx[i + c] += dxd[i + c] * keep;
                } else {
                    d[i + c] = kept ? x[i + c] * keep : 0.0f;
                }
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
    if (m->prof) prof_model_op(m->prof, dx ? "lora_dropout_bwd" : "lora_dropout_fwd", "lora_dropout", PROF_NO_KERNEL, t0);
    return d;
}

static int lora_dropping(const lm_model *m) { return m->cfg.lora_dropout > 0 && m->lora_train; }

/* x[BT, K] */
static const float *lora_input(lm_model *m, int l, int p, const float *x, int BT, int K) {
    return lora_dropping(m) ? lora_mask(m, l, p, x, 0, BT, K, NULL, NULL) : x;
}

/* y[BT, N] += B (scale A drop(x[BT, K])): PEFT's LoRA branch beside the
 * linear of projection p in layer l; u[BT, r] keeps scale A drop(x).
 * Row-parallel under tensor parallelism (o_proj, down_proj: A holds this
 * rank's columns, B is whole): A x is a partial sum, summed over the group
 * before B, so B u is added once, on every rank alike, beside the base's
 * output that was summed already. */
static void lora_fwd(lm_model *m, int l, int p, float *y, float *u, const float *x, const lm_layer_w *w, int BT,
                     int K, int N) {
    const float *xd = lora_input(m, l, p, x, BT, K);
    int r = lm_lora_rank(&m->cfg, l, p);
    float sc = lm_lora_scale(&m->cfg, l, p);
    if (!lora_row_parallel(m, p) || !m->hooks || !m->hooks->reduce_partial) {
        lora_apply(&m->k, y, u, xd, w->lora_a[p], w->lora_b[p], BT, K, N, r, sc);
        return;
    }
    lora_apply(&m->k, NULL, u, xd, w->lora_a[p], NULL, BT, K, N, r, sc); /* u alone */
    m->hooks->reduce_partial(m->hooks->ctx, u, (size_t)BT * r);
    /* under sequence parallel y holds this rank's rows only */
    K(MATMUL, matmul_fwd, y, u + sp_row0(m, BT) * (size_t)r, w->lora_b[p], sp_rows(m, BT), r, N, 1);
}

/* Its backward from dy[BT, N]: dB += dy^T u, dA += du^T drop(x), dx += (du A)
 * through the dropout, du = scale dy B. dA, dB NULL: frozen adapters; dx NULL:
 * nothing below wants it. */
static void lora_bwd(lm_model *m, int l, int p, float *dx, const float *dy, const float *u, const float *x, int BT,
                     int K, int N) {
    const lm_layer_w *w = &m->w.layer[l];
    lm_layer_w *g = &m->g.layer[l];
    int r = lm_lora_rank(&m->cfg, l, p);
    float *du = m->ws.lora_du; /* [BT, r] */
    K(MATMUL, matmul_bwd, du, g->lora_b[p], dy, u, w->lora_b[p], BT, r, N, 0);
    float sc = lm_lora_scale(&m->cfg, l, p);
    for (size_t i = 0; i < (size_t)BT * r; i++) du[i] *= sc;
    const float *xd = lora_input(m, l, p, x, BT, K);
    if (xd == x) {
        K(MATMUL, matmul_bwd, dx, g->lora_a[p], du, x, w->lora_a[p], BT, K, r, 1);
        return;
    }
    float *dxd = dx ? m->ws.lora_dx : NULL;
    K(MATMUL, matmul_bwd, dxd, g->lora_a[p], du, xd, w->lora_a[p], BT, K, r, 0);
    if (dx) lora_mask(m, l, p, NULL, 0, BT, K, dx, dxd);
}

/* Whether projection p of layer l has an adapter (its A is bound). */
#define LORA(w, p) ((w)->lora_a[p] != NULL)

/* The adapters of projections ps[0..np) of layer l, which all read x[BT, K]
 * (q, k, v; gate, up; or one projection), as one group: lora_fwd_group's one
 * parallel region instead of two GEMM regions per adapter. ys, us, Ns: each
 * one's output, u and width. With dropout in a training forward each adapter
 * reads its own drop(x) in the one m->ws.lora_x: one at a time, as before. */
static void lora_fwd_n(lm_model *m, int l, const lm_layer_w *w, const float *x, int BT, int K, int np, const int *ps,
                       float *const *ys, float *const *us, const int *Ns) {
    /* dropout, or a row-parallel adapter (u summed over the group): one at a time */
    if ((m->cfg.lora_dropout > 0 && m->lora_train) || (np == 1 && lora_row_parallel(m, ps[0]))) {
        for (int j = 0; j < np; j++)
            if (LORA(w, ps[j])) lora_fwd(m, l, ps[j], ys[j], us[j], x, w, BT, K, Ns[j]);
        return;
    }
    lora_proj g[LM_LORA_GROUP];
    int n = 0;
    for (int j = 0; j < np && j < LM_LORA_GROUP; j++)
        if (LORA(w, ps[j]))
            g[n++] = (lora_proj){.A = w->lora_a[ps[j]], .B = w->lora_b[ps[j]], .y = ys[j], .u = us[j], .N = Ns[j],
                                 .r = lm_lora_rank(&m->cfg, l, ps[j]), .scale = lm_lora_scale(&m->cfg, l, ps[j])};
    if (!n) return;
    int64_t t0 = PROF_T0(m->prof);
    lora_fwd_group(&m->k, x, BT, K, g, n);
    if (m->prof) prof_model_op(m->prof, "lora_fwd", "lora", KERN_OP_MATMUL, t0);
}

/* Their backward from dys (each one's d output): dx += their d input (NULL:
 * nothing below wants it), and the adapters' gradients. Each keeps its own du
 * (m->ws.lora_du holds LM_LORA_GROUP of them): dA reads it after every row is
 * done. Dropout as lora_fwd_n. */
static void lora_bwd_n(lm_model *m, int l, float *dx, const float *x, int BT, int K, int np, const int *ps,
                       const float *const *dys, const int *Ns) {
    const lm_layer_w *w = &m->w.layer[l];
    float *const *us = m->act.layer[l].lora_u;
    if (m->cfg.lora_dropout > 0 && m->lora_train) {
        for (int j = 0; j < np; j++)
            if (LORA(w, ps[j])) lora_bwd(m, l, ps[j], dx, dys[j], us[ps[j]], x, BT, K, Ns[j]);
        return;
    }
    lm_layer_w *g = &m->g.layer[l];
    size_t du_n = (size_t)BT * lm_lora_max_rank(&m->cfg);
    lora_proj gp[LM_LORA_GROUP];
    int n = 0;
    for (int j = 0; j < np && j < LM_LORA_GROUP; j++) {
        int p = ps[j];
        if (!LORA(w, p)) continue;
        gp[n] = (lora_proj){.A = w->lora_a[p], .B = w->lora_b[p], .u = us[p], .dy = dys[j],
                            .du = m->ws.lora_du + n * du_n, .gA = g->lora_a[p], .gB = g->lora_b[p], .N = Ns[j],
                            .r = lm_lora_rank(&m->cfg, l, p), .scale = lm_lora_scale(&m->cfg, l, p)};
        n++;
    }
    if (!n) return;
    int64_t t0 = PROF_T0(m->prof);
    lora_bwd_group(&m->k, dx, x, BT, K, gp, n);
    if (m->prof) prof_model_op(m->prof, "lora_bwd", "lora", KERN_OP_MATMUL, t0);
}

/* dst[n] = the stacked experts w[n], from their bf16 store if they have one
 * (exact: the adapted weight W + scale B A is formed in fp32 either way). */
static void experts_copy(const lm_model *m, float *dst, const float *w, size_t n) {
    const uint16_t *h = experts_bf16(m, w, n);
    if (h) ct_convert_to_f32(dst, h, CT_BF16, n);
    else memcpy(dst, w, n * sizeof(float));
}

/* The weights an expert-parallel dispatch runs on (lm_experts_w): eg, eu,
 * ed and, for a bf16-stored base projection, its store. */
static lm_experts_w experts_w(const lm_model *m, const float *eg, const float *eu, const float *ed) {
    const lm_config *c = &m->cfg;
    size_t ex = (size_t)(c->expert_rows ? c->expert_rows : c->n_experts) * c->moe_intermediate * c->hidden;
    return (lm_experts_w){{eg, eu, ed}, {experts_bf16(m, eg, ex), experts_bf16(m, eu, ex), experts_bf16(m, ed, ex)}};
}

/* The experts op on weights eg, eu, ed (base or adapted): the wbf16 entries
 * when any of them is a bf16-stored base projection, which they read from
 * the store (the same bits as on its fp32 widening); else the fp32 ones.
 * fwd: out[BT, H] (NULL: recomputation) from the gate / up / h ([BT*k, Im],
 * permuted rows) it fills; else the backward into dx[BT, H], the experts'
 * dg, du [E, Im, H] and dd [E, H, Im] (NULL: not wanted), dtopw[BT, k] from
 * dout[BT, H]. */
static void experts_h(lm_model *m, int fwd, float *out, float *dx, float *dg, float *du, float *dd, float *dtopw,
                      const float *dout, lm_layer_acts *a, float *work, const float *eg, const float *eu,
                      const float *ed, int BT) {
    const lm_config *c = &m->cfg;
    int H = c->hidden, E = c->n_experts, k = c->top_k, Im = c->moe_intermediate;
    size_t ex = (size_t)(c->expert_rows ? c->expert_rows : E) * Im * H; /* one projection's held experts */
    const uint16_t *hg = experts_bf16(m, eg, ex), *hu = experts_bf16(m, eu, ex), *hd = experts_bf16(m, ed, ex);
    const moe_route *r = &a->route;
    int h = hg || hu || hd;
    if (fwd && h)
        K(MOE, moe_fwd_wbf16, out, a->gate, a->up, a->h, work, a->ln2, eg, eu, ed, hg, hu, hd, r->perm, r->pos,
          r->offsets, r->topw, BT, H, Im, E, k);
    else if (fwd)
        K(MOE, moe_fwd, out, a->gate, a->up, a->h, work, a->ln2, eg, eu, ed, r->perm, r->pos, r->offsets, r->topw, BT,
          H, Im, E, k);
    else if (h)
        K(MOE, moe_bwd_wbf16, dx, dg, du, dd, dtopw, work, dout, a->ln2, eg, eu, ed, hg, hu, hd, a->gate, a->up, a->h,
          r->perm, r->pos, r->offsets, r->topw, BT, H, Im, E, k);
    else
        K(MOE, moe_bwd, dx, dg, du, dd, dtopw, work, dout, a->ln2, eg, eu, ed, a->gate, a->up, a->h, r->perm, r->pos,
          r->offsets, r->topw, BT, H, Im, E, k);
}

/* Expert LoRA (target_parameters, PEFT's ParamWrapper): the experts kernels
 * run on the adapted weights W + scale B A, formed per layer and pass in
 * m->ws.lora_ew [3, E, Im, H] (gate, up, down; E the held experts under
 * expert parallel, whose adapters are held with them), exactly what PEFT's
 * parametrization computes; *eg, *eu, *ed point there, or at the base
 * experts when layer l has no expert adapter. Costs a copy of the layer's
 * experts and the delta's 6 r E Im H FLOPs per pass (docs/lora.md). */
static void experts_adapted(lm_model *m, const lm_layer_w *w, const float **eg, const float **eu, const float **ed) {
    const lm_config *c = &m->cfg;
    *eg = w->ewg, *eu = w->ewu, *ed = w->ewd;
    if (!w->lora_ea[LM_LORA_EXP_GU] && !w->lora_ea[LM_LORA_EXP_D]) return;
    int E = c->expert_rows ? c->expert_rows : c->n_experts, H = c->hidden, Im = c->moe_intermediate;
    int rg = lm_lora_exp_rank(c, LM_LORA_EXP_GU), rd = lm_lora_exp_rank(c, LM_LORA_EXP_D);
    size_t ex = (size_t)E * Im * H;
    if (!m->ws.lora_ew) m->ws.lora_ew = ct_malloc(3 * ex * sizeof(float));
    float *ew = m->ws.lora_ew;
    /* only an adapted parameter is copied and folded; the other stays the base's */
    if (w->lora_ea[LM_LORA_EXP_GU]) { /* gate_up_proj [E, 2 Im, H]: gate rows first */
        experts_copy(m, ew, w->ewg, ex);
        experts_copy(m, ew + ex, w->ewu, ex);
        lora_experts_delta(&m->k, ew, ew + ex, w->lora_ea[LM_LORA_EXP_GU], w->lora_eb[LM_LORA_EXP_GU], E, rg, H, 2 * Im,
                           Im, lm_lora_exp_scale(c, LM_LORA_EXP_GU));
        *eg = ew, *eu = ew + ex;
    }
    if (w->lora_ea[LM_LORA_EXP_D]) { /* down_proj [E, H, Im] */
        experts_copy(m, ew + 2 * ex, w->ewd, ex);
        lora_experts_delta(&m->k, ew + 2 * ex, NULL, w->lora_ea[LM_LORA_EXP_D], w->lora_eb[LM_LORA_EXP_D], E, rd, Im, H,
                           H, lm_lora_exp_scale(c, LM_LORA_EXP_D));
        *ed = ew + 2 * ex;
    }
}

/* The backward's side of it: where the experts kernel writes d(W + scale B A).
 * Without expert adapters the base experts' gradient views (NULL when
 * frozen); with them a zeroed m->ws.lora_dew [3, E, Im, H], which
 * experts_adapted_grad then reduces to dA, dB (and adds to trained base
 * experts, if any). */
static void experts_adapted_dw(lm_model *m, const lm_layer_w *w, const lm_layer_w *g, float **dg, float **du,
                               float **dd) {
    const lm_config *c = &m->cfg;
    *dg = g->ewg, *du = g->ewu, *dd = g->ewd;
    if (!w->lora_ea[LM_LORA_EXP_GU] && !w->lora_ea[LM_LORA_EXP_D]) return;
    size_t ex = (size_t)(c->expert_rows ? c->expert_rows : c->n_experts) * c->moe_intermediate * c->hidden;
    if (!m->ws.lora_dew) m->ws.lora_dew = ct_malloc(3 * ex * sizeof(float));
    zero(m->ws.lora_dew, 3 * ex);
    /* a projection with neither an adapter nor a trained base (gate and up frozen under a
     * down_proj-only adapter, say) has no use for its gradient: NULL skips its product */
    int gu = w->lora_ea[LM_LORA_EXP_GU] != NULL, d = w->lora_ea[LM_LORA_EXP_D] != NULL;
    *dg = gu || g->ewg ? m->ws.lora_dew : NULL;
    *du = gu || g->ewu ? m->ws.lora_dew + ex : NULL;
    *dd = d || g->ewd ? m->ws.lora_dew + 2 * ex : NULL;
}

static void experts_adapted_grad(lm_model *m, const lm_layer_w *w, lm_layer_w *g) {
    const lm_config *c = &m->cfg;
    if (!w->lora_ea[LM_LORA_EXP_GU] && !w->lora_ea[LM_LORA_EXP_D]) return;
    int E = c->expert_rows ? c->expert_rows : c->n_experts, H = c->hidden, Im = c->moe_intermediate;
    int rg = lm_lora_exp_rank(c, LM_LORA_EXP_GU), rd = lm_lora_exp_rank(c, LM_LORA_EXP_D);
    size_t ex = (size_t)E * Im * H;
    const float *dew = m->ws.lora_dew;
    if (w->lora_ea[LM_LORA_EXP_GU])
        lora_experts_grad(&m->k, g->lora_ea[LM_LORA_EXP_GU], g->lora_eb[LM_LORA_EXP_GU], dew, dew + ex,
                          w->lora_ea[LM_LORA_EXP_GU], w->lora_eb[LM_LORA_EXP_GU], E, rg, H, 2 * Im, Im,
                          lm_lora_exp_scale(c, LM_LORA_EXP_GU));
    if (w->lora_ea[LM_LORA_EXP_D])
        lora_experts_grad(&m->k, g->lora_ea[LM_LORA_EXP_D], g->lora_eb[LM_LORA_EXP_D], dew + 2 * ex, NULL,
                          w->lora_ea[LM_LORA_EXP_D], w->lora_eb[LM_LORA_EXP_D], E, rd, Im, H, H,
                          lm_lora_exp_scale(c, LM_LORA_EXP_D));
    float *base[3] = {g->ewg, g->ewu, g->ewd}; /* d(W + scale B A) / dW = 1 */
    for (int x = 0; x < 3; x++)
        if (base[x])
            for (size_t i = 0; i < ex; i++) base[x][i] += dew[(size_t)x * ex + i];
}

/* Router LoRA (target_parameters gate.weight): the routing runs on
 * W + scale B A [E, H], formed per layer and pass in m->ws.lora_rw as PEFT's
 * parametrization forms it (a bf16-stored router widened first); the base
 * router where layer l has no such adapter. */
static const float *router_adapted(lm_model *m, const lm_layer_w *w) {
    if (!w->lora_ea[LM_LORA_EXP_R]) return w->router;
    const lm_config *c = &m->cfg;
    int E = c->n_experts, H = c->hidden;
    size_t n = (size_t)E * H;
    if (!m->ws.lora_rw) m->ws.lora_rw = ct_malloc(n * sizeof(float));
    const uint16_t *h = frozen_bf16(m, w->router);
    if (h) ct_convert_to_f32(m->ws.lora_rw, h, CT_BF16, n);
    else memcpy(m->ws.lora_rw, w->router, n * sizeof(float));
    lora_experts_delta(&m->k, m->ws.lora_rw, NULL, w->lora_ea[LM_LORA_EXP_R], w->lora_eb[LM_LORA_EXP_R], 1,
                       lm_lora_exp_rank(c, LM_LORA_EXP_R), H, E, E, lm_lora_exp_scale(c, LM_LORA_EXP_R));
    return m->ws.lora_rw;
}

/* ------------------------------------------------- family pieces */

/* The family's small elementwise pieces of the forward, shared by training's
 * forward and the KV-cache forward (lm_kv_forward). */

/* A norm's weight as the kernels read it: w itself, or 1 + w in scratch[n]
 * (Gemma's RMSNorm). d/dw is the same either way, so backward kernels take
 * the same pointer and accumulate the true gradient. */
static const float *lm_norm_weight(const lm_config *c, float *scratch, const float *w, int n) {
    if (!c->norm_plus_one || !w) return w;
    for (int i = 0; i < n; i++) scratch[i] = 1.0f + w[i];
    return scratch;
}
static const float *nw(lm_model *m, const float *w, int n) { return lm_norm_weight(&m->cfg, m->ws.norm_w, w, n); }

/* x[n] *= sqrt(hidden), rounded to fp32, where the family scales its
 * embeddings (Gemma); a no-op elsewhere. */
static void lm_embed_scale(const lm_config *c, float *x, size_t n) {
    if (!c->embed_scaled && (c->embed_mult == 0 || c->embed_mult == 1)) return;
    /* Gemma's sqrt(H) is transformers' fp32 buffer; Granite's multiplier a Python float
     * that torch rounds to the tensor's fp32 */
    float sc = c->embed_scaled ? (float)sqrt((double)c->hidden) : (float)c->embed_mult;
    for (size_t i = 0; i < n; i++) x[i] *= sc;
}

/* x[n] = cap tanh(x / cap) where the family caps its final logits, keeping
 * tanh in t[n] (NULL: not kept); x[n] /= logits_scaling where it divides them
 * (Granite: a division, as GraniteForCausalLM's, so the same fp32 bits); a
 * no-op elsewhere. */
static void lm_final_softcap(const lm_config *c, float *x, size_t n, float *t) {
    float s = logits_div(c);
    if (s != 0)
        for (size_t i = 0; i < n; i++) x[i] /= s;
    if (!(c->final_softcap > 0)) return;
    float cap = (float)c->final_softcap;
    for (size_t i = 0; i < n; i++) {
        float th = tanhf(x[i] / cap);
        if (t) t[i] = th;
        x[i] = th * cap;
    }
}

/* Layer l's attention variant: its scale, window (sliding layers) and cap, and
 * bf16 products under bf16 mixed precision. */
static kern_attn_opt attn_opt(const lm_model *m, int l) {
    const lm_config *c = &m->cfg;
    kern_attn_opt o = {(float)c->attn_scale, c->layer_sliding[l] ? c->sliding_window : 0, (float)c->attn_softcap,
                       m->attn_bf16};
    return o;
}

/* xs[i][0:ns[i]] rounded to bf16 in place, in one parallel region: the
 * attention's inputs under m->attn_bf16 (kern_attn_opt.bf16's contract). */
static void attn_round_bf16(lm_model *m, int n, float *const xs[], const long ns[], const char *name) {
    int64_t t0 = PROF_T0(m->prof);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        for (int i = 0; i < n; i++) { /* each thread its share of every array */
            long lo = ns[i] * id / nt, hi = ns[i] * (id + 1) / nt;
            ct_round_bf16(xs[i] + lo, hi - lo);
        }
        KERN_TRACE_EXIT(kt_);
    }
    if (m->prof) prof_model_op(m->prof, name, "round_bf16", PROF_NO_KERNEL, t0);
}

/* Layer l's RoPE tables: the sliding layers' own base where a family has one;
 * NULL for a NoPE layer (SmolLM3), which qk_fwd / qk_bwd then leave unrotated.
 * Every path that rotates q/k (training, recompute, the KV cache, context
 * parallel's gathered keys) takes its tables from here, so NoPE holds in all. */
static void rope_pick(const lm_config *c, int l, const float *cos, const float *sin, const float *cos_l,
                      const float *sin_l, const float **cs, const float **sn) {
    int loc = c->layer_sliding[l];
    *cs = c->layer_nope[l] ? NULL : loc ? cos_l : cos;
    *sn = c->layer_nope[l] ? NULL : loc ? sin_l : sin;
}

static void rope_of(const lm_model *m, int l, const float **cs, const float **sn) {
    rope_pick(&m->cfg, l, m->ws.rope_cos, m->ws.rope_sin, m->ws.rope_cos_l, m->ws.rope_sin_l, cs, sn);
}

/* q's tables where k's are cs/sn: Ministral 3's scaled pair (it has no NoPE or
 * sliding-only RoPE: lm_config_check), else k's own. */
static void rope_q_pick(const lm_config *c, const float *cs, const float *sn, const float *cos_q, const float *sin_q,
                        const float **qcs, const float **qsn) {
    int scaled = c->q_scale_len > 0 && cs;
    *qcs = scaled ? cos_q : cs;
    *qsn = scaled ? sin_q : sn;
}

/* The inputs of the attention and MLP projections: the pre-norms' outputs,
 * or (OLMo2, no pre-norms) the residual stream itself. */
static const float *attn_in(const lm_model *m, const lm_layer_acts *a) {
    return m->cfg.norm_place == LM_NORM_POST ? a->res : a->ln1;
}
static const float *mlp_in(const lm_model *m, const lm_layer_acts *a) {
    return m->cfg.norm_place == LM_NORM_POST ? a->res_mid : a->ln2;
}

/* Under tensor parallelism a q/k norm over the whole projection (OLMo2) sees
 * only this rank's heads: its row sums are summed over the group. */
static int qk_norm_split(const lm_model *m) {
    return m->cfg.tp_degree > 1 && m->hooks && m->hooks->reduce_partial;
}

/* GLM's interleaved RoPE, the one place it is held: the rotary part's pairs
 * (2i, 2i+1) are gathered to (i, i + rd/2) of each head row, where the
 * rotate-half kernels rotate them; the tail stays. q and k are gathered alike,
 * so every score q.k is the one transformers computes and v is untouched: the
 * gathered q and k (attention's inputs, the KV cache) never leave the layer.
 * The backward scatters the gradient back (adding, as rope_bwd adds). */
static void rope_pairs_gather(float *out, const float *x, long rows, int hd, int rd) {
    int half = rd / 2;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long r = 0; r < rows; r++) {
            float tmp[2 * ROPE_MAX_HALF]; /* out may alias x */
            const float *xr = x + (size_t)r * hd;
            float *o = out + (size_t)r * hd;
            memcpy(tmp, xr, (size_t)rd * sizeof(float));
            for (int i = 0; i < half; i++) {
                o[i] = tmp[2 * i];
                o[half + i] = tmp[2 * i + 1];
            }
            if (o != xr) memcpy(o + rd, xr + rd, (size_t)(hd - rd) * sizeof(float));
        }
        KERN_TRACE_EXIT(kt_);
    }
}
static void rope_pairs_scatter_add(float *dx, const float *d, long rows, int hd, int rd) {
    int half = rd / 2;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long r = 0; r < rows; r++) {
            const float *dr = d + (size_t)r * hd;
            float *o = dx + (size_t)r * hd;
            for (int i = 0; i < half; i++) {
                o[2 * i] += dr[i];
                o[2 * i + 1] += dr[half + i];
            }
            for (int i = rd; i < hd; i++) o[i] += dr[i];
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* out[BT, nh*hd] = RoPE(q/k norm(x)), by the family's q/k norm kind; cs NULL:
 * a NoPE layer, out = q/k norm(x). */
static void qk_fwd(lm_model *m, float *out, float *rstd, const float *x, const float *w, const float *cs,
                   const float *sn, int B, int T, int nh, int hd) {
    float eps = (float)m->cfg.rms_eps;
    int rd = lm_rotary_dim(&m->cfg); /* the fused per-head op rotates whole heads: not taken where rd < hd */
    if (!cs && m->cfg.qk_norm == LM_QK_NONE) {
        if (out != x) memcpy(out, x, (size_t)B * T * nh * hd * sizeof(float));
        return;
    }
    switch (m->cfg.qk_norm) {
    case LM_QK_HEAD:
        if (cs && m->cfg.qk_norm_after_rope) { /* HunYuan: norm(R x), R x in a scratch */
            size_t nrow = (size_t)B * T * nh;
            float *t = ct_malloc(nrow * hd * sizeof(float)); /* [BT, nh, hd] R x */
            K(ROPE, rope_fwd, t, x, cs, sn, B, T, nh, hd, rd);
            K(RMSNORM, rmsnorm_fwd, out, rstd, t, nw(m, w, hd), (int)nrow, hd, eps);
            free(t);
        } else if (cs && rd < hd) { /* GLM-4.5: the fused op rotates whole heads; norm, then RoPE in place */
            K(RMSNORM, rmsnorm_fwd, out, rstd, x, nw(m, w, hd), B * T * nh, hd, eps);
            K(ROPE, rope_fwd, out, out, cs, sn, B, T, nh, hd, rd);
        } else if (cs) K(ROPE, qknorm_rope_fwd, out, rstd, x, nw(m, w, hd), cs, sn, B, T, nh, hd, eps);
        else K(RMSNORM, rmsnorm_fwd, out, rstd, x, nw(m, w, hd), B * T * nh, hd, eps); /* EXAONE 4's NoPE layers */
        break;
    case LM_QK_PROJ: /* one norm over all heads of a token, then RoPE in place */
        if (qk_norm_split(m)) { /* this rank's heads are 1/tp of the row: sum the squares over ranks */
            int C = nh * hd, Cw = C * m->cfg.tp_degree;
            op_rmsnorm_sumsq(rstd, x, B * T, C);
            m->hooks->reduce_partial(m->hooks->ctx, rstd, (size_t)B * T);
            for (int i = 0; i < B * T; i++) rstd[i] = 1.0f / sqrtf(rstd[i] / (float)Cw + eps);
            op_rmsnorm_scale(out, x, nw(m, w, C), rstd, B * T, C);
        } else {
            K(RMSNORM, rmsnorm_fwd, out, rstd, x, nw(m, w, nh * hd), B * T, nh * hd, eps);
        }
        if (cs) K(ROPE, rope_fwd, out, out, cs, sn, B, T, nh, hd, rd);
        break;
    default:
        if (m->cfg.rope_interleaved && cs) { /* the GLM families have no q/k norms */
            rope_pairs_gather(out, x, (long)B * T * nh, hd, rd);
            K(ROPE, rope_fwd, out, out, cs, sn, B, T, nh, hd, rd);
        } else {
            K(ROPE, rope_fwd, out, x, cs, sn, B, T, nh, hd, rd);
        }
    }
}
/* dx[BT, nh*hd] (+)= d(x) and dw[hd] or [nh*hd] (the norm's weight) += from
 * dout[BT, nh*hd] = d(out), which is overwritten (scratch); rstd: the
 * forward's [BT, nh] or [BT]. The per-head norm + RoPE overwrites dx; the other
 * paths add to it (zero_layer_scratch). */
static void qk_bwd(lm_model *m, float *dx, float *dw, float *dout, const float *x, const float *w, const float *rstd,
                   const float *cs, const float *sn, int B, int T, int nh, int hd) {
    int rd = lm_rotary_dim(&m->cfg);
    int wd = dw && m->wdefer; /* I of a split backward: the norm's dw left to W (wdefer_norm) */
    if (!cs && m->cfg.qk_norm == LM_QK_NONE) { /* NoPE: the identity's gradient, added as rope_bwd adds */
        K(ADD, add, dx, dx, dout, (long)B * T * nh * hd);
        return;
    }
    switch (m->cfg.qk_norm) {
    case LM_QK_HEAD: /* dx: its first product, overwritten (zero_layer_scratch skips it) */
        if (cs && m->cfg.qk_norm_after_rope) { /* out = norm(t), t = R x: dx = R^T d(t) */
            size_t nrow = (size_t)B * T * nh;
            float *t = ct_malloc(nrow * hd * sizeof(float)); /* [BT, nh, hd] R x, recomputed */
            K(ROPE, rope_fwd, t, x, cs, sn, B, T, nh, hd, rd);
            zero(dx, nrow * hd); /* rmsnorm_bwd adds: d(t) into dx, then R^T in place */
            K(RMSNORM, rmsnorm_bwd, dx, wd ? NULL : dw, dout, t, nw(m, w, hd), rstd, (int)nrow, hd);
            if (wd) wdefer_norm(m, LM_W_NORM, dw, dout, t, rstd, (int)nrow, hd);
            K(ROPE, rope_bwd, dx, dx, cs, sn, B, T, nh, hd, rd);
            free(t);
        } else if (cs && rd < hd) { /* out = R norm(x): d(norm) = R^T dout in place, then the norm's */
            K(ROPE, rope_bwd, dout, dout, cs, sn, B, T, nh, hd, rd);
            zero(dx, (size_t)B * T * nh * hd); /* rmsnorm_bwd adds */
            K(RMSNORM, rmsnorm_bwd, dx, wd ? NULL : dw, dout, x, nw(m, w, hd), rstd, B * T * nh, hd);
            if (wd) wdefer_norm(m, LM_W_NORM, dw, dout, x, rstd, B * T * nh, hd);
        } else if (cs) {
            K(ROPE, qknorm_rope_bwd, dx, wd ? NULL : dw, dout, x, nw(m, w, hd), rstd, cs, sn, B, T, nh, hd, 0);
            if (wd) { /* W's qknorm_bwd_w rotates dout back as the fused kernel does */
                wdefer_norm(m, LM_W_QKNORM_ROPE, dw, dout, x, rstd, B * T * nh, hd);
                lm_wrec *r = &m->wdefer->rec[m->wdefer->n - 1];
                r->cs = cs, r->sn = sn, r->B = B, r->T = T, r->N = nh;
            }
        } else { /* rmsnorm_bwd adds */
            zero(dx, (size_t)B * T * nh * hd);
            K(RMSNORM, rmsnorm_bwd, dx, wd ? NULL : dw, dout, x, nw(m, w, hd), rstd, B * T * nh, hd);
            if (wd) wdefer_norm(m, LM_W_NORM, dw, dout, x, rstd, B * T * nh, hd);
        }
        break;
    case LM_QK_PROJ:
        if (cs) K(ROPE, rope_bwd, dout, dout, cs, sn, B, T, nh, hd, rd); /* in place: dout = R^T dout */
        if (qk_norm_split(m)) { /* the row's dot(dout, w x) spans the ranks' heads: summed over them */
            int C = nh * hd;
            float *dot = ct_malloc((size_t)B * T * sizeof(float)); /* [BT] */
            op_rmsnorm_bwd_dot(dot, dout, x, nw(m, w, C), B * T, C);
            m->hooks->reduce_partial(m->hooks->ctx, dot, (size_t)B * T);
            op_rmsnorm_bwd_given(dx, wd ? NULL : dw, dout, x, nw(m, w, C), rstd, dot, B * T, C, C * m->cfg.tp_degree);
            if (wd) wdefer_norm(m, LM_W_NORM_REF, dw, dout, x, rstd, B * T, C); /* its dw: op_rmsnorm_bwd_w */
            free(dot);
        } else {
            K(RMSNORM, rmsnorm_bwd, dx, wd ? NULL : dw, dout, x, nw(m, w, nh * hd), rstd, B * T, nh * hd);
            if (wd) wdefer_norm(m, LM_W_NORM, dw, dout, x, rstd, B * T, nh * hd);
        }
        break;
    default:
        if (m->cfg.rope_interleaved && cs) { /* dout is scratch: R^T in place, then scattered */
            K(ROPE, rope_bwd, dout, dout, cs, sn, B, T, nh, hd, rd);
            rope_pairs_scatter_add(dx, dout, (long)B * T * nh, hd, rd);
        } else {
            K(ROPE, rope_bwd, dx, dout, cs, sn, B, T, nh, hd, rd);
        }
    }
}

/* out[BT, N] = in[BT, K] @ w^T (summed over tensor-parallel ranks) + b: a
 * row-parallel projection whose output a norm reads before the residual. */
static void proj_reduced(lm_model *m, float *out, const float *in, const float *w, const float *b, int BT, int K,
                         int N) {
    if (m->sp) { /* out: this rank's rows, reduce-scattered through d_ln (as residual_matmul) */
        mm_fwd(m, m->ws.d_ln, in, w, BT, K, N, 0);
        memcpy(out, sum_rows(m, m->ws.d_ln, BT, N), (size_t)sp_rows(m, BT) * N * sizeof(float));
        if (b) op_bias_add(out, b, sp_rows(m, BT), N);
        return;
    }
    mm_fwd(m, out, in, w, BT, K, N, 0);
    if (m->hooks && m->hooks->reduce_partial) m->hooks->reduce_partial(m->hooks->ctx, out, (size_t)BT * N);
    if (b) op_bias_add(out, b, BT, N);
}

/* out[n] = base[n] + y[n] rm, the product rounded to fp32 before the add as
 * transformers' `residual + hidden_states * residual_multiplier` is; base
 * NULL: out = y rm (a scaled branch's backward). Threaded: at B T x H per
 * layer a serial pass costs as much as a small projection. */
static void scaled_add(float *out, const float *base, const float *y, float rm, size_t n) {
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (size_t i = 0; i < n; i++) {
            float p = y[i] * rm;
            out[i] = base ? base[i] + p : p;
        }
        KERN_TRACE_EXIT(kt_);
    }
}

/* The gated MLP's activation: h[n] = act(gate[n]) * up[n] (n = BT x I). */
static void glu_fwd(lm_model *m, float *h, const float *gate, const float *up, int n) {
    if (m->cfg.act == LM_ACT_GELU_TANH) K(GEGLU, geglu_fwd, h, gate, up, n);
    else K(SWIGLU, swiglu_fwd, h, gate, up, n);
}

/* The gated MLP's input side, the dense MLP's and a shared expert's alike:
 * gate, up [BT, I] = x wg^T (+ bg), x wu^T (+ bu) (+ their adapters), then
 * h [BT, I] = act(gate) * up. x [BT, H]. */
static void mlp_up_fwd(lm_model *m, int l, const lm_layer_w *w, lm_layer_acts *a, const float *x, float *gate,
                       float *up, float *h, int BT, int I) {
    int H = m->cfg.hidden;
    mm_fwd(m, gate, x, w->wg, BT, H, I, 0);
    mm_fwd(m, up, x, w->wu, BT, H, I, 0);
    if (w->bg) {
        op_bias_add(gate, w->bg, BT, I);
        op_bias_add(up, w->bu, BT, I);
    }
    lora_fwd_n(m, l, w, x, BT, H, 2, (const int[]){LM_LORA_GATE, LM_LORA_UP}, (float *const[]){gate, up},
               (float *const[]){a->lora_u[LM_LORA_GATE], a->lora_u[LM_LORA_UP]}, (const int[]){I, I});
    glu_fwd(m, h, gate, up, BT * I);
}

/* The shared expert's down_proj adapter: so[BT, H] += B (scale A drop(sh)).
 * Under tensor parallelism so is this rank's partial sum over its Is slice,
 * as is A sh: u is summed over the group and B u added on rank 0 alone, so
 * the ranks' so still sum to the whole (and the gate logit's gradient, a dot
 * with so, to its whole); lora_fwd's row-parallel add, once on every rank,
 * is for an output that was summed already. */
static void shared_down_lora_fwd(lm_model *m, int l, lm_layer_acts *a, const lm_layer_w *w, int BT) {
    int H = m->cfg.hidden, Is = m->cfg.shared_intermediate, p = LM_LORA_DOWN;
    if (!LORA(w, p)) return;
    if (!lora_row_parallel(m, p) || !m->hooks || !m->hooks->reduce_partial) {
        lora_fwd_n(m, l, w, a->sh, BT, Is, 1, &p, &a->so, &a->lora_u[p], &H);
        return;
    }
    int r = lm_lora_rank(&m->cfg, l, p);
    const float *xd = lora_input(m, l, p, a->sh, BT, Is);
    lora_apply(&m->k, NULL, a->lora_u[p], xd, w->lora_a[p], NULL, BT, Is, H, r, lm_lora_scale(&m->cfg, l, p));
    m->hooks->reduce_partial(m->hooks->ctx, a->lora_u[p], (size_t)BT * r);
    if (m->cfg.tp_rank == 0) K(MATMUL, matmul_fwd, a->so, a->lora_u[p], w->lora_b[p], BT, r, H, 1);
}

/* A MoE layer's shared expert (qwen2_moe's sparse block): y[BT, H] +=
 * sigmoid(x shgate^T) * down(act(gate(x)) * up(x)), the dense MLP's products
 * on width Is, for every token. y NULL: only the activations (recomputation).
 * Under tensor parallelism so is this rank's partial sum over its Is slice
 * and y the partial sum the caller reduces; the gate logit is whole. */
static void shared_expert_fwd(lm_model *m, int l, lm_layer_acts *a, const lm_layer_w *w, const float *x, float *y,
                              int BT) {
    int H = m->cfg.hidden, Is = m->cfg.shared_intermediate;
    mlp_up_fwd(m, l, w, a, x, a->sgate, a->sup, a->sh, BT, Is); /* [BT, Is] each */
    mm_fwd(m, a->so, a->sh, w->wd, BT, Is, H, 0);                /* [BT, H] */
    shared_down_lora_fwd(m, l, a, w, BT);
    if (!w->shgate) { /* GraniteMoeShared: the shared MLP's output added as it is */
        if (y)
            for (size_t i = 0; i < (size_t)BT * H; i++) y[i] += a->so[i];
        return;
    }
    mm_fwd(m, a->sg, x, w->shgate, BT, H, 1, 0);                 /* [BT] the gate's logits */
    lora_fwd_n(m, l, w, x, BT, H, 1, (const int[]){LM_LORA_SHGATE}, &a->sg, &a->lora_u[LM_LORA_SHGATE],
               (const int[]){1}); /* whole on every rank, as the gate (its input is) */
    for (int t = 0; t < BT; t++) a->sg[t] = 1.0f / (1.0f + expf(-a->sg[t]));
    if (!y) return;
    for (size_t t = 0; t < (size_t)BT; t++)
        for (size_t j = 0; j < (size_t)H; j++) y[t * H + j] += a->sg[t] * a->so[t * H + j];
}

static void kv_attention(lm_model *m, lm_kv *kv, int l, float *out, const float *q, int n,
                         const kern_attn_opt *at);

/* One layer's forward from a->res: fills the layer's activations and, unless
 * res_next is NULL (recomputation before backward, where the next layer's
 * input is already known), writes the residual leaving the layer.
 * kv: the KV-cache forward of generation (lm_kv_forward; B = 1, rows at
 * kv->p0 ..), whose a->kr and a->v point into layer l's cache; NULL for
 * training and validation. Checked once per layer, never per token. */
static void layer_forward_at(lm_model *m, lm_kv *kv, int l, lm_layer_acts *a, const lm_layer_w *w, float *res_next,
                             int B, int T) {
    const lm_config *c = &m->cfg;
    int BT = B * T, H = c->hidden, I = c->intermediate, hd = c->head_dim;
    int nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    float eps = (float)c->rms_eps;
    size_t n = (size_t)BT * H;
    /* under sequence parallel the residual stream and the norms: this rank's rows */
    int BS = sp_rows(m, BT);
    size_t ns = (size_t)BS * H;
    /* cos/sin were tabulated for m->act.T positions; rows 0..T-1 serve any T <= m->act.T
     * (the cache's: the rows in flight, positions kv->p0 ..) */
    const float *cs, *sn;
    const float *qcs, *qsn;
    if (kv) rope_pick(c, l, kv->rope_cos, kv->rope_sin, kv->rope_cos_l, kv->rope_sin_l, &cs, &sn);
    else rope_of(m, l, &cs, &sn);
    if (kv) rope_q_pick(c, cs, sn, kv->rope_cos_q, kv->rope_sin_q, &qcs, &qsn);
    else rope_q_pick(c, cs, sn, m->ws.rope_cos_q, m->ws.rope_sin_q, &qcs, &qsn);
    /* attention block */
    if (w->ln1) K(RMSNORM, rmsnorm_fwd, a->ln1, a->ln1_rstd, a->res, nw(m, w->ln1, H), BS, H, eps);
    const float *xa = sp_gather(m, m->ws.sp_x, attn_in(m, a), BT, H); /* [BT, H] */
    mm_fwd(m, a->q, xa, w->wq, BT, H, qd, 0);
    mm_fwd(m, a->k, xa, w->wk, BT, H, kvd, 0);
    mm_fwd(m, a->v, xa, w->wv, BT, H, kvd, 0);
    if (w->bq) {
        op_bias_add(a->q, w->bq, BT, qd);
        op_bias_add(a->k, w->bk, BT, kvd);
        op_bias_add(a->v, w->bv, BT, kvd);
    }
    lora_fwd_n(m, l, w, xa, BT, H, 3, (const int[]){LM_LORA_Q, LM_LORA_K, LM_LORA_V}, (float *const[]){a->q, a->k, a->v},
               (float *const[]){a->lora_u[LM_LORA_Q], a->lora_u[LM_LORA_K], a->lora_u[LM_LORA_V]},
               (const int[]){qd, kvd, kvd});
    /* q/k norms (per head: fused with RoPE, one pass) then RoPE */
    qk_fwd(m, a->qr, a->q_rstd, a->q, w->qn, qcs, qsn, B, T, nH, hd);
    qk_fwd(m, a->kr, a->k_rstd, a->k, w->kn, cs, sn, B, T, nKV, hd);
    kern_attn_opt ao = attn_opt(m, l);
    if (ao.bf16 && !kv) /* the backward reads the same saved (or recomputed) bf16 values */
        attn_round_bf16(m, 3, (float *const[]){a->qr, a->kr, a->v}, (const long[]){(long)BT * qd, (long)BT * kvd,
                                                                                   (long)BT * kvd}, "attention_in_bf16");
    if (kv) kv_attention(m, kv, l, a->att, a->qr, T, &ao); /* over the cache, positions 0 .. p0+T-1 */
    else if (m->attn_cp) /* context parallel: over the whole sequence's keys (distributed/cp.h) */
        m->attn_cp->fwd(m->attn_cp->ctx, a->att, a->lse, a->qr, a->kr, a->v, B, T, nH, nKV, hd, &ao);
    else K(ATTENTION, attention_fwd, a->att, a->lse, a->qr, a->kr, a->v, B, T, nH, nKV, hd, &ao);
    float rm = resid_mult(c);
    if (w->ln_ao || rm != 0) { /* res_mid = res + norm(o_proj(att)), or res + rm o_proj(att) */
        proj_reduced(m, a->ao, a->att, w->wo, w->bo, BT, qd, H);
        lora_fwd_n(m, l, w, a->att, BT, qd, 1, (const int[]){LM_LORA_O}, &a->ao, &a->lora_u[LM_LORA_O], &H);
        if (w->ln_ao) {
            K(RMSNORM, rmsnorm_fwd, a->res_mid, a->ao_rstd, a->ao, nw(m, w->ln_ao, H), BS, H, eps);
            K(ADD, add, a->res_mid, a->res_mid, a->res, (long)ns);
        } else {
            scaled_add(a->res_mid, a->res, a->ao, rm, ns);
        }
    } else { /* res_mid = res + o_proj(att) */
        residual_matmul(m, a->res_mid, a->res, a->att, w->wo, BT, qd, H);
        if (w->bo) op_bias_add(a->res_mid, w->bo, BS, H);
        lora_fwd_n(m, l, w, a->att, BT, qd, 1, (const int[]){LM_LORA_O}, &a->res_mid, &a->lora_u[LM_LORA_O], &H);
    }
    /* MLP block */
    if (w->ln2) K(RMSNORM, rmsnorm_fwd, a->ln2, a->ln2_rstd, a->res_mid, nw(m, w->ln2, H), BS, H, eps);
    const float *xm = sp_gather(m, m->ws.sp_x, mlp_in(m, a), BT, H); /* [BT, H] */
    if (a->moe) {
        /* sparse: route, then the experts kernel adds sum_j w_j expert_j(ln2) onto res_mid */
        int E = c->n_experts, k = c->top_k;
        moe_route *r = &a->route;
        int64_t rt0 = PROF_T0(m->prof);
        const float *wr = router_adapted(m, w);
        moe_router_opt ro = lm_router_opt(c);
        moe_route_fwd_opt(&m->k, r, xm, wr, wr == w->router ? frozen_bf16(m, w->router) : NULL,
                          m->moe.bias + (size_t)l * E, BT, H, E, k, &ro);
        if (m->prof) prof_model_op(m->prof, "moe_route_fwd", "moe_route", KERN_OP_MATMUL, rt0);
        /* Under tensor parallelism every expert holds this rank's slice of
         * moe_intermediate, so its output is a partial sum: it goes to a
         * scratch (d_ln is free during a forward), is summed over the group
         * and the residual is added once, as residual_matmul does. The router
         * and its top-k run on the replicated ln2, identically on every rank. */
        int tp = m->hooks && m->hooks->reduce_partial;
        /* Granite's residual_multiplier scales the whole branch (experts and shared MLP)
         * before the add: it too goes through the scratch */
        int scr = tp || rm != 0;
        /* generate's cache has no d_ln but keeps the branch buffer mo (branch_bufs) */
        float *y = res_next && scr ? (kv ? a->mo : m->ws.d_ln) : res_next; /* [BT, H] */
        /* FlexOlmo: res_next = res_mid + norm(branch). The branch alone is built (a
         * recomputation too: the backward reads it, mo, and its rstd), in mo itself, or
         * under tensor parallelism in d_ln (room for every rank's rows) before the sum */
        if (w->ln_mo) {
            scr = 1;
            y = tp && !kv ? m->ws.d_ln : a->mo;
        }
        if (y && scr) zero(y, n);
        else if (y) memcpy(y, a->res_mid, n * sizeof(float));
        const float *eg, *eu, *ed;
        experts_adapted(m, w, &eg, &eu, &ed);
        lm_layer_acts ag = *a; /* the experts read ln2: all rows, gathered under sequence parallel */
        ag.ln2 = (float *)xm;
        if (m->moe_ep) {
            lm_experts_w ew = experts_w(m, eg, eu, ed);
            m->moe_ep->fwd(m->moe_ep->ctx, l, y, xm, r, &ew, BT);
        } else
            experts_h(m, 1, y, NULL, NULL, NULL, NULL, NULL, NULL, &ag, kv ? kv->moe_work : m->ws.moe_work, eg, eu,
                      ed, BT);
        if (c->shared_intermediate > 0) shared_expert_fwd(m, l, a, w, xm, y, BT);
        if (w->ln_mo) { /* mo [BS, H] = the branch summed over the group; then as the dense MLP's */
            const float *ys = tp ? sum_rows(m, y, BT, H) : y;
            if (ys != a->mo) memcpy(a->mo, ys, ns * sizeof(float));
            float *yn = res_next ? res_next : m->ws.d_ln; /* d_ln: free scratch before this layer's backward */
            K(RMSNORM, rmsnorm_fwd, yn, a->mo_rstd, a->mo, nw(m, w->ln_mo, H), BS, H, eps);
            if (res_next) K(ADD, add, res_next, res_next, a->res_mid, (long)ns);
            return;
        }
        if (y && scr) {
            const float *ys = tp ? sum_rows(m, y, BT, H) : y;
            scaled_add(res_next, a->res_mid, ys, rm != 0 ? rm : 1.0f, ns); /* y 1 is y: the same bits */
        }
        return;
    }
    mlp_up_fwd(m, l, w, a, xm, a->gate, a->up, a->h, BT, I);
    /* res_next = res_mid + norm(down(h)) (a recomputation needs mo and its rstd), or res_mid + rm down(h) */
    if (w->ln_mo || (rm != 0 && res_next)) {
        proj_reduced(m, a->mo, a->h, w->wd, w->bd, BT, I, H);
        lora_fwd_n(m, l, w, a->h, BT, I, 1, (const int[]){LM_LORA_DOWN}, &a->mo, &a->lora_u[LM_LORA_DOWN], &H);
        if (!w->ln_mo) {
            scaled_add(res_next, a->res_mid, a->mo, rm, ns);
            return;
        }
        float *y = res_next ? res_next : m->ws.d_ln; /* d_ln: free scratch before this layer's backward */
        K(RMSNORM, rmsnorm_fwd, y, a->mo_rstd, a->mo, nw(m, w->ln_mo, H), BS, H, eps);
        if (res_next) K(ADD, add, res_next, res_next, a->res_mid, (long)ns);
        return;
    }
    if (!res_next) return; /* a recomputation: the down adapter's u was kept */
    residual_matmul(m, res_next, a->res_mid, a->h, w->wd, BT, I, H);
    if (w->bd) op_bias_add(res_next, w->bd, BS, H);
    lora_fwd_n(m, l, w, a->h, BT, I, 1, (const int[]){LM_LORA_DOWN}, &res_next, &a->lora_u[LM_LORA_DOWN], &H);
}

static void layer_forward(lm_model *m, lm_layer_acts *a, const lm_layer_w *w, float *res_next, int B, int T) {
    layer_forward_at(m, NULL, (int)(a - m->act.layer), a, w, res_next, B, T);
}

/* Before a checkpointed layer's backward: rebuild what it did not keep, with
 * the forward's own kernels on the forward's own inputs (bit-identical). */
static void layer_recompute(lm_model *m, int l, int B, int T) {
    lm_layer_acts *a = &m->act.layer[l];
    const lm_layer_w *w = &m->w.layer[l];
    if (a->ac == LM_AC_NONE || m->act.scratch_layer == l) return; /* the scratch may still hold it */
    m->act.scratch_layer = l;
    if (a->ac == LM_AC_FULL) {
        layer_forward(m, a, w, NULL, B, T);
        return;
    }
    /* LM_AC_OP: the elementwise ops only, from the kept matmul outputs */
    const lm_config *c = &m->cfg;
    int BT = B * T, H = c->hidden, I = c->intermediate, hd = c->head_dim, nH = c->n_heads, nKV = c->n_kv_heads;
    float eps = (float)c->rms_eps;
    const float *cs, *sn, *qcs, *qsn;
    rope_of(m, l, &cs, &sn);
    rope_q_pick(c, cs, sn, m->ws.rope_cos_q, m->ws.rope_sin_q, &qcs, &qsn);
    int BS = sp_rows(m, BT); /* the norms' rows: this rank's under sequence parallel */
    if (w->ln1) K(RMSNORM, rmsnorm_fwd, a->ln1, a->ln1_rstd, a->res, nw(m, w->ln1, H), BS, H, eps);
    qk_fwd(m, a->qr, a->q_rstd, a->q, w->qn, qcs, qsn, B, T, nH, hd);
    qk_fwd(m, a->kr, a->k_rstd, a->k, w->kn, cs, sn, B, T, nKV, hd);
    if (attn_opt(m, l).bf16) /* the forward rounded them in place: the backward must read those bits */
        attn_round_bf16(m, 2, (float *const[]){a->qr, a->kr}, (const long[]){(long)BT * nH * hd, (long)BT * nKV * hd},
                        "attention_in_bf16");
    /* the norms of kept outputs: only their rstd is read, the output goes to a free scratch */
    if (w->ln_ao) K(RMSNORM, rmsnorm_fwd, m->ws.d_ln, a->ao_rstd, a->ao, nw(m, w->ln_ao, H), BS, H, eps);
    if (w->ln2) K(RMSNORM, rmsnorm_fwd, a->ln2, a->ln2_rstd, a->res_mid, nw(m, w->ln2, H), BS, H, eps);
    if (a->sgate) glu_fwd(m, a->sh, a->sgate, a->sup, BT * c->shared_intermediate); /* as shared_expert_fwd */
    if (a->moe) /* the experts kernels compute h with the reference SwiGLU (ops.h contract): so do we */
        op_swiglu_fwd(a->h, a->gate, a->up, BT * c->top_k * c->moe_intermediate);
    else
        glu_fwd(m, a->h, a->gate, a->up, BT * I);
    if (w->ln_mo) K(RMSNORM, rmsnorm_fwd, m->ws.d_ln, a->mo_rstd, a->mo, nw(m, w->ln_mo, H), BS, H, eps);
}

/* After MoE layer l's forward, while a checkpointed layer's routing is still
 * in the scratch: the load-balancing sums and the layer's min/max expert load. */
static void moe_layer_stats(lm_model *m, int l, int BT) {
    int E = m->cfg.n_experts;
    const moe_route *r = &m->act.layer[l].route;
    char bn[LM_NAME_MAX];
    /* a family with a file selection bias: HF's loss counts the top k of the probabilities alone
     * (the chosen experts are those where the layer's bias is zero) */
    int k_probs = 0; /* (GLM-4.5's router has no such loss: its counts are the chosen experts') */
    for (int e = 0; e < E && !m->cfg.router_sigmoid && lm_router_bias_name(&m->cfg, l, bn, sizeof bn); e++)
        k_probs = m->moe.bias[(size_t)l * E + e] != 0.0f ? m->cfg.top_k : k_probs;
    moe_route_stats(m->moe.count, m->moe.psum, r, BT, E, k_probs);
    if (m->moe.count_tokens)
        for (int e = 0; e < E; e++) m->moe.tokens[(size_t)l * E + e] += r->offsets[e + 1] - r->offsets[e];
    for (int e = 0; e < E; e++) {
        int n = r->offsets[e + 1] - r->offsets[e];
        if (e == 0 || n < m->moe.load_min[l]) m->moe.load_min[l] = n;
        if (e == 0 || n > m->moe.load_max[l]) m->moe.load_max[l] = n;
    }
}

/* ------------------------------------- embed_tokens' adapter (LORA_EMBED)
 *
 * PEFT's LoRA Embedding: the row of id gains scale B A[:, id], A [r, V]
 * looked up as an embedding of its transpose (no dropout on ids), added to
 * the base row before embed_scale (Gemma's normalizer multiplies the sum; a
 * scaled embedding module has PEFT multiply the adapter's part alike). Its
 * backward from d = d(the unscaled row): dB += scale d A[:, id]^T over all
 * rows, dA[:, id] += scale B^T d, the looked-up columns only, none for
 * padding_idx (torch's embedding leaves that column's gradient zero, and it
 * is A that PEFT looks up with the base's padding_idx). */
static void embed_lora_fwd(lm_model *m, float *x0, const int32_t *tokens, int n) {
    const lm_config *c = &m->cfg;
    const float *A = m->w.emb_a, *Bw = m->w.emb_b;
    if (!A || !Bw) return;
    int H = c->hidden, r = c->lora_rank, V = c->vocab_size;
    float sc = c->lora_scale;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long i = 0; i < n; i++) {
            size_t id = (size_t)tokens[i];
            float *x = x0 + (size_t)i * H;
            for (int h = 0; h < H; h++) {
                float s = 0; /* (A[:, id] @ B^T)[h], then the scale: PEFT's order */
                for (int j = 0; j < r; j++) s += A[(size_t)j * V + id] * Bw[(size_t)h * r + j];
                x[h] += s * sc;
            }
        }
        KERN_TRACE_EXIT(kt_);
    }
}

static void embed_lora_bwd(lm_model *m, const float *d, const int32_t *tokens, int n) {
    const lm_config *c = &m->cfg;
    const float *A = m->w.emb_a, *Bw = m->w.emb_b;
    float *dA = m->g.emb_a, *dB = m->g.emb_b;
    if (!A || !Bw) return;
    int H = c->hidden, r = c->lora_rank, V = c->vocab_size;
    float sc = c->lora_scale;
    kern_trace *kt_ = kern_trace_armed();
    if (dB) {
#pragma omp parallel
        {
            KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
            for (long h = 0; h < H; h++)
                for (int j = 0; j < r; j++) {
                    double s = 0;
                    for (int i = 0; i < n; i++) s += (double)d[(size_t)i * H + h] * A[(size_t)j * V + tokens[i]];
                    dB[(size_t)h * r + j] += (float)(s * sc);
                }
            KERN_TRACE_EXIT(kt_);
        }
    }
    if (!dA) return;
    if (n > m->ws.emb_du_rows) {
        free(m->ws.emb_du);
        m->ws.emb_du = ct_malloc((size_t)n * r * sizeof(float));
        m->ws.emb_du_rows = n;
    }
    float *du = m->ws.emb_du; /* du[i] = scale B^T d[i] for every row, then scattered */
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (long i = 0; i < n; i++)
            for (int j = 0; j < r; j++) {
                double s = 0;
                for (int h = 0; h < H; h++) s += (double)d[(size_t)i * H + h] * Bw[(size_t)h * r + j];
                du[(size_t)i * r + j] = (float)(s * sc);
            }
        KERN_TRACE_EXIT(kt_);
    }
    for (int i = 0; i < n; i++) /* in row order: a repeated id's column sums as torch's index_add */
        if (!(c->has_pad && tokens[i] == c->pad_token))
            for (int j = 0; j < r; j++) dA[(size_t)j * V + tokens[i]] += du[(size_t)i * r + j];
}

/* x0[BT, H] = the (scaled) embedding rows of tokens. Vocabulary-parallel,
 * this model's rows give its tokens' rows and zeros for the others, summed
 * over the ranks: each element is one rank's row plus zeros, so the bits of
 * the whole lookup. */
static void embed_fwd(lm_model *m, float *x0, const int32_t *tokens, int BT) {
    const lm_config *c = &m->cfg;
    int H = c->hidden, V = c->vocab_rows, v0 = c->vocab_row0, BS = sp_rows(m, BT), vp = vocab_par(c);
    const lm_tensor *te = &m->tensors[0];
    if (vp && m->sp) { /* sequence parallel: all rows' partial lookups, reduce-scattered to this rank's rows */
        for (int n = 0; n < BT; n++) {
            float *x = m->ws.d_ln + (size_t)n * H; /* d_ln: free before the first layer */
            size_t r = (size_t)(tokens[n] - v0);
            if (tokens[n] < v0 || tokens[n] >= v0 + V) zero(x, (size_t)H);
            else if (te->store != LM_NO_STORE) ct_convert_to_f32(x, m->fstore + te->store + r * H, CT_BF16, (size_t)H);
            else memcpy(x, m->w.wte + r * H, (size_t)H * sizeof(float));
        }
        memcpy(x0, sum_rows(m, m->ws.d_ln, BT, H), (size_t)BS * H * sizeof(float));
    } else if (vp) {
        for (int n = 0; n < BT; n++) {
            float *x = x0 + (size_t)n * H;
            size_t r = (size_t)(tokens[n] - v0);
            if (tokens[n] < v0 || tokens[n] >= v0 + V) zero(x, (size_t)H);
            else if (te->store != LM_NO_STORE) ct_convert_to_f32(x, m->fstore + te->store + r * H, CT_BF16, (size_t)H);
            else memcpy(x, m->w.wte + r * H, (size_t)H * sizeof(float));
        }
        m->hooks->reduce_partial(m->hooks->ctx, x0, (size_t)BT * H);
    } else if (te->store != LM_NO_STORE) { /* a bf16-stored embedding: its rows widened as they are looked up */
        const int32_t *own = tokens + sp_row0(m, BT); /* a whole table: this rank's rows' own lookups */
        for (int n = 0; n < BS; n++)
            ct_convert_to_f32(x0 + (size_t)n * H, m->fstore + te->store + (size_t)own[n] * H, CT_BF16, (size_t)H);
    } else {
        K(EMBEDDING, embedding_fwd, x0, tokens + sp_row0(m, BT), m->w.wte, BS, H);
    }
    embed_lora_fwd(m, x0, tokens + sp_row0(m, BT), BS);
    lm_embed_scale(c, x0, (size_t)BS * H);
}

/* What every forward sets before its first layer. */
static void forward_begin(lm_model *m, const int32_t *tokens, int B, int T) {
    m->act.tokens = tokens;
    m->act.fwd_B = B;
    m->act.fwd_T = T;
    if (lm_rope_by_length(&m->cfg) && m->ws.rope_T != T) rope_build(m, T); /* transformers' dynamic_rope_update */
    if (m->moe.n_layers) {
        memset(m->moe.count, 0, (size_t)m->cfg.n_experts * sizeof(double));
        memset(m->moe.psum, 0, (size_t)m->cfg.n_experts * sizeof(double));
    }
}

/* Layers [l0, l1) from act.layer[l0].res; the last one writes out[BT, H]. */
static void forward_layers(lm_model *m, int l0, int l1, float *out, int B, int T) {
    for (int l = l0; l < l1; l++) {
        float *res_next = l + 1 < l1 ? m->act.layer[l + 1].res : out;
        if (m->hooks) m->hooks->pre_forward(m->hooks->ctx, l);
        int64_t t0 = PROF_T0(m->prof);
        layer_forward(m, &m->act.layer[l], &m->w.layer[l], res_next, B, T);
        if (m->prof) prof_layer(m->prof, "layer_fwd", l, t0);
        if (m->hooks) m->hooks->post_forward(m->hooks->ctx, l);
        if (m->act.layer[l].ac != LM_AC_NONE) m->act.scratch_layer = l;
        if (m->act.layer[l].moe) moe_layer_stats(m, l, B * T);
    }
}

int lm_aux_in_grad(const lm_config *c) {
    return c->n_experts > 0 && c->output_router_logits && c->router_aux_loss_coef > 0;
}

/* HF's load-balancing loss of this forward's routing sums (0 if dense). */
static void forward_aux(lm_model *m, int BT) {
    const lm_config *c = &m->cfg;
    m->moe.aux_loss = 0;
    if (m->moe.n_layers)
        m->moe.aux_loss = moe_aux_loss(m->ws.moe_dprob_all, m->moe.count, m->moe.psum, BT, m->moe.n_layers, c->n_experts,
                                   c->output_router_logits ? c->router_aux_loss_coef * m->moe.aux_scale : 0.0);
}

void lm_stage_aux_grad(lm_model *m, const double *count, int B, int T) {
    const lm_config *c = &m->cfg;
    if (!m->moe.n_layers || !lm_aux_in_grad(c)) return;
    /* the same scale as forward_aux's, so a stage's routers get the one-process gradient bit for bit */
    moe_aux_loss(m->ws.moe_dprob_all, count, NULL, B * T, m->moe.n_layers, c->n_experts,
                 c->router_aux_loss_coef * m->moe.aux_scale);
}

/* act.lnf[BT, H] = RMSNorm(act.res_out[BT, H]), lnf_rstd[BT] kept for the backward. */
static void final_norm_fwd(lm_model *m, int BT) {
    int H = m->cfg.hidden;
    K(RMSNORM, rmsnorm_fwd, m->act.lnf, m->act.lnf_rstd, m->act.res_out, nw(m, m->w.lnf, H), sp_rows(m, BT), H,
      (float)m->cfg.rms_eps);
}

/* The transformer stack up to the final norm: fills m->act.layer, m->act.lnf. */
static void forward_stack(lm_model *m, const int32_t *tokens, int B, int T) {
    int L = m->cfg.n_layers, BT = B * T;
    forward_begin(m, tokens, B, T);
    embed_fwd(m, L ? m->act.layer[0].res : m->act.res_out, tokens, BT); /* [BT, H] */
    forward_layers(m, 0, L, m->act.res_out, B, T);
    forward_aux(m, BT);
    final_norm_fwd(m, BT);
}

/* d(raw logits) = d(capped) (1 - t^2), then / logits_scaling, in place. */
static void softcap_bwd(lm_model *m, float *dlogits, size_t n) {
    if (m->cfg.final_softcap > 0)
        for (size_t i = 0; i < n; i++) dlogits[i] *= 1.0f - m->ws.cap_t[i] * m->ws.cap_t[i];
    float s = logits_div(&m->cfg);
    if (s != 0)
        for (size_t i = 0; i < n; i++) dlogits[i] /= s;
}

/* Cross-entropy of n rows of logits against labels, in place into
 * d(logits) * grad_scale (the kernel's contract). Vocabulary-parallel, the
 * rows hold this rank's columns [v0, v0 + V) only: the row max, the sum of
 * exponentials and the target logit (from the rank that holds it) are
 * combined over ranks by the hooks, then each rank writes the gradient of
 * its own columns. Every rank returns the whole loss. */
static double crossentropy(lm_model *m, float *logits, const int32_t *labels, int n, float grad_scale,
                           long *count) {
    const lm_config *c = &m->cfg;
    double loss;
    if (!vocab_par(c)) {
        K_RET(loss, CROSSENTROPY, crossentropy_fwdbwd, logits, labels, n, c->vocab_size, grad_scale, count);
        return loss;
    }
    int V = c->vocab_rows, v0 = c->vocab_row0;
    float *mx = m->ws.ce_stats, *se = mx + n, *tl = se + n; /* [n] each, se and tl adjacent for one all-reduce */
    K(CROSSENTROPY, crossentropy_vp_max, mx, logits, n, V);
    m->hooks->reduce_max(m->hooks->ctx, mx, (size_t)n);
    K(CROSSENTROPY, crossentropy_vp_sums, se, tl, logits, mx, labels, n, V, v0);
    m->hooks->reduce_partial(m->hooks->ctx, se, 2 * (size_t)n); /* se and tl are adjacent */
    K_RET(loss, CROSSENTROPY, crossentropy_vp_grad, logits, mx, se, tl, labels, n, V, v0, grad_scale, count);
    return loss;
}

/* A bf16-stored (frozen) lm_head, tied or not, is never widened: the head
 * products read it from its store, over blocks of HEAD_VBLOCK vocabulary rows
 * (the blocks an earlier version widened one at a time; kept, so the results
 * are those bits), each block's logits through m->ws.head_tmp. Except the
 * forward of more than HEAD_ONE_CALL_ROWS rows (training's logits chunks):
 * one product over the whole vocabulary straight into the logits, the same
 * bits (each logit is one dot product over the hidden size, whichever block
 * holds its row of the head), without 19 blocks' copies through head_tmp
 * (the chunk's whole logits, 155 MB at Qwen3's vocabulary and 256 rows) and
 * their parallel regions. Few rows keep the blocks: the kernels' few-rows
 * forward (decode) widens the w it is given. */
#define HEAD_VBLOCK 8192
#define HEAD_ONE_CALL_ROWS 16
static const lm_tensor *head_stored(const lm_model *m) {
    const lm_tensor *t = &m->tensors[0];
    if (!m->cfg.tie_embeddings) /* the last tensor, or before its adapter's */
        for (int i = m->n_tensors - 1; i >= 0 && (t = &m->tensors[i])->slot != LM_S_HEAD; i--) {}
    return t->store != LM_NO_STORE ? t : NULL;
}
static void head_scratch(lm_model *m) { /* only head_fwd's few-rows path uses it */
    if (!m->ws.head_tmp) m->ws.head_tmp = ct_malloc((size_t)HEAD_ONE_CALL_ROWS * HEAD_VBLOCK * sizeof(float));
}

/* logits[n, V] = x[n, H] @ lm_head^T */
static void head_fwd(lm_model *m, float *logits, const float *x, int n) {
    int H = m->cfg.hidden, V = vocab_held(&m->cfg);
    const lm_tensor *t = head_stored(m);
    if (!V) return; /* a vocabulary-parallel rank past the last row: no logits */
    if (!t) {
        K(MATMUL, matmul_fwd, logits, x, m->w.lm_head, n, H, V, 0);
        return;
    }
    if (n > HEAD_ONE_CALL_ROWS) {
        K(MATMUL, matmul_fwd_wbf16, logits, x, m->fstore + t->store, n, H, V, 0);
        return;
    }
    head_scratch(m);
    for (int v0 = 0; v0 < V; v0 += HEAD_VBLOCK) {
        int nv = V - v0 < HEAD_VBLOCK ? V - v0 : HEAD_VBLOCK;
        const uint16_t *hw = m->fstore + t->store + (size_t)v0 * H;
        float *o = nv == V ? logits : m->ws.head_tmp; /* [n, nv] */
        K(MATMUL, matmul_fwd_wbf16, o, x, hw, n, H, nv, 0);
        if (o != logits)
            for (int r = 0; r < n; r++) memcpy(logits + (size_t)r * V + v0, o + (size_t)r * nv, nv * sizeof(float));
    }
}

/* dx[n, H] = dlogits[n, V] @ lm_head (overwritten); d lm_head += dlogits^T x
 * (not for a stored, frozen one) */
static void head_bwd(lm_model *m, float *dx, const float *dlogits, const float *x, int n) {
    int H = m->cfg.hidden, V = vocab_held(&m->cfg);
    const lm_tensor *t = head_stored(m);
    if (!V) { /* no rows here: this rank's part of d(input), summed over the group, is zero */
        zero(dx, (size_t)n * H);
        return;
    }
    if (!t) { /* not deferred by a split backward: its d(output) is [rows, V], which the fused
               * head never holds whole (lm.h, lm_wstore) */
        K(MATMUL, matmul_bwd, dx, m->g.lm_head, dlogits, x, m->w.lm_head, n, H, V, 0);
        return;
    }
    /* the block's columns of d(logits) read in place, rows V apart (they were
     * copied to head_tmp first: 155 MB per 256-row chunk at Qwen3's
     * vocabulary); the same products, so the same bits */
    for (int v0 = 0; v0 < V; v0 += HEAD_VBLOCK) {
        int nv = V - v0 < HEAD_VBLOCK ? V - v0 : HEAD_VBLOCK;
        const uint16_t *hw = m->fstore + t->store + (size_t)v0 * H; /* [nv, H] */
        K(MATMUL, matmul_dinp_wbf16, dx, dlogits + v0, hw, n, H, nv, V, v0 > 0);
    }
}

/* ------------------------------------------- lm_head's adapter (LORA_HEAD)
 *
 * PEFT's LoRA Linear on the output layer: logits += B (scale A drop(x)), at
 * lora_rank and lora_scale, before the final soft cap. It runs beside each
 * block of logits rows of the fused head + cross-entropy: u = scale A drop(x)
 * [n, r] once per row, then B's rows add their rank-r products to the
 * block's logits, so no logits beyond the block's exist. Vocabulary-parallel,
 * A is whole on every rank and B holds the rank's vocabulary rows: u is the
 * same on every rank, B u is this rank's columns only, and d u, hence dA and
 * d x, are partial sums over the group (dA summed in head_loss_bwd, d x with
 * lm_head's own). Its dropout mask is the layers' rule with layer index
 * n_layers, projection 0 (a key no layer has), over the input [rows, H]. */
static void head_lora_scratch(lm_model *m) {
    if (m->ws.head_u) return;
    size_t rows = m->ws.logit_rows > 1 ? (size_t)m->ws.logit_rows : 1, r = (size_t)m->cfg.lora_rank;
    m->ws.head_u = ct_malloc(rows * r * sizeof(float));
    m->ws.head_du = ct_malloc(rows * r * sizeof(float));
    m->ws.head_da = ct_malloc(r * (size_t)m->cfg.hidden * sizeof(float));
}

/* drop(x) of rows [r0, r0 + n) of the head's input x [n, H] (x itself outside
 * training or without dropout); dx != NULL: dx += d drop(x) / dx of dxd. Its
 * mask is the layers' rule with layer index n_layers, projection 0 (a key no
 * layer has). */
static const float *head_lora_input(lm_model *m, const float *x, int r0, int n, float *dx, const float *dxd) {
    if (!lora_dropping(m)) return x;
    return lora_mask(m, m->cfg.n_layers, LM_LORA_Q, x, r0, n, m->cfg.hidden, dx, dxd);
}

/* logits[n, V] += B (scale A drop(x[n, H])) for rows [r0, r0 + n) of the step;
 * m->ws.head_u keeps scale A drop(x) for the backward. */
static void head_lora_fwd(lm_model *m, float *logits, const float *x, int r0, int n) {
    if (!m->w.head_a) return;
    const lm_config *c = &m->cfg;
    int V = vocab_held(c);
    head_lora_scratch(m);
    const float *xd = head_lora_input(m, x, r0, n, NULL, NULL);
    lora_apply(&m->k, V ? logits : NULL, m->ws.head_u, xd, m->w.head_a, V ? m->w.head_b : NULL, n, c->hidden, V,
               c->lora_rank, c->lora_scale);
}

/* Its backward from dlogits[n, V] (head_lora_fwd's rows just before):
 * dB += dlogits^T u, du = scale dlogits B, dx[n, H] += du A through the
 * dropout, and dA += du^T drop(x) into da (a partial sum when
 * vocabulary-parallel). */
static void head_lora_bwd(lm_model *m, float *dx, float *da, const float *dlogits, const float *x, int r0, int n) {
    if (!m->w.head_a) return;
    const lm_config *c = &m->cfg;
    int V = vocab_held(c), H = c->hidden, r = c->lora_rank;
    if (!V) return; /* no rows of B here: du is zero */
    float *du = m->ws.head_du;
    K(MATMUL, matmul_bwd, du, m->g.head_b, dlogits, m->ws.head_u, m->w.head_b, n, r, V, 0);
    for (size_t i = 0; i < (size_t)n * r; i++) du[i] *= c->lora_scale;
    const float *xd = head_lora_input(m, x, r0, n, NULL, NULL);
    if (!lora_dropping(m)) {
        K(MATMUL, matmul_bwd, dx, da, du, x, m->w.head_a, n, H, r, 1);
        return;
    }
    K(MATMUL, matmul_bwd, m->ws.lora_dx, da, du, xd, m->w.head_a, n, H, r, 0);
    head_lora_input(m, x, r0, n, dx, m->ws.lora_dx);
}

int lm_experts_read_bf16(const lm_model *m) {
    const lm_config *c = &m->cfg;
    size_t ex = (size_t)(c->expert_rows ? c->expert_rows : c->n_experts) * c->moe_intermediate * c->hidden;
    int moe = 0, h = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const lm_layer_w *w = &m->w.layer[l];
        if (!lm_layer_is_moe(c, l) || !w->ewg) continue; /* dense, or another stage's */
        moe++;
        /* experts_h's test on what experts_adapted passes: an adapted
         * parameter runs on its fp32 copy W + scale B A, not the store */
        int gu = !w->lora_ea[LM_LORA_EXP_GU] && (experts_bf16(m, w->ewg, ex) || experts_bf16(m, w->ewu, ex));
        int d = !w->lora_ea[LM_LORA_EXP_D] && experts_bf16(m, w->ewd, ex);
        h += gu || d;
    }
    return moe > 0 && 2 * h >= moe;
}

int lm_projections_read_bf16(const lm_model *m) {
    const lm_config *c = &m->cfg;
    /* each dense product's FLOPs are rows x the weight's size, the rows the same for all:
     * weigh each weight by its size */
    double H = c->hidden, qd = (double)c->n_heads * c->head_dim, kvd = (double)c->n_kv_heads * c->head_dim;
    double I = c->intermediate, all = 0, stored = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const lm_layer_w *w = &m->w.layer[l];
        if (!lm_holds_layer(c, l)) continue;
        /* mm_fwd / mm_bwd's test: a LoRA adapter adds its own product, the base is still read from the store */
        const float *p[7] = {w->wq, w->wk, w->wv, w->wo, w->wg, w->wu, w->wd}; /* wg..wd NULL in a MoE layer */
        double n[7] = {qd * H, kvd * H, kvd * H, H * qd, I * H, I * H, H * I};
        for (int j = 0; j < 7; j++)
            if (p[j]) {
                all += n[j];
                if (frozen_bf16(m, p[j])) stored += n[j];
            }
    }
    if (lm_holds_head(c)) { /* head_fwd / head_bwd: the wbf16 entries over the whole vocabulary */
        double v = (double)vocab_held(c) * H;
        all += v;
        if (head_stored(m)) stored += v;
    }
    return all > 0 && 2 * stored >= all;
}

size_t lm_frozen_widened_floats(const lm_model *m) {
    /* every stored matrix, the MoE router and experts included, is read from
     * its store by the products (the GEMMs' per-thread widening of one packed
     * block at a time is workspace, not counted); what remains is a stored
     * lm_head's block of logits, head_tmp: [HEAD_ONE_CALL_ROWS, HEAD_VBLOCK] */
    return head_stored(m) ? (size_t)HEAD_VBLOCK * HEAD_ONE_CALL_ROWS : 0;
}

void lm_logits(lm_model *m, const int32_t *tokens, int B, int T, float *logits) {
    forward_stack(m, tokens, B, T);
    int V = vocab_held(&m->cfg);
    const float *lnf = sp_gather(m, m->ws.sp_x, m->act.lnf, B * T, m->cfg.hidden); /* the head reads all rows */
    if (!V) return; /* a vocabulary-parallel rank past the last row */
    if (!head_stored(m)) {
        K(MATMUL, matmul_fwd, logits, lnf, m->w.lm_head, B * T, m->cfg.hidden, V, 0);
    } else {
        for (int r0 = 0; r0 < B * T; r0 += m->ws.logit_rows) { /* head_fwd's scratch holds logit_rows rows */
            int n = B * T - r0 < m->ws.logit_rows ? B * T - r0 : m->ws.logit_rows;
            head_fwd(m, logits + (size_t)r0 * V, lnf + (size_t)r0 * m->cfg.hidden, n);
        }
    }
    for (int r0 = 0; m->w.head_a && r0 < B * T; r0 += m->ws.logit_rows) { /* head_u holds logit_rows rows */
        int n = B * T - r0 < m->ws.logit_rows ? B * T - r0 : m->ws.logit_rows;
        head_lora_fwd(m, logits + (size_t)r0 * V, lnf + (size_t)r0 * m->cfg.hidden, r0, n);
    }
    lm_final_softcap(&m->cfg, logits, (size_t)B * T * V, NULL);
}

double lm_loss(lm_model *m, const int32_t *tokens, const int32_t *labels, int B, int T, long *n_valid) {
    forward_stack(m, tokens, B, T);
    return lm_stage_loss(m, labels, B, T, n_valid);
}

/* ------------------------------------------ KV-cache forward (generation) */

/* lm_kv_forward runs layer_forward_at over the rows in flight with the
 * layer's K and V going straight into the cache; what differs from
 * training is only the attention, which reads the cache: a prefill chunk
 * does its two products with matmul_fwd (the n x (p0+n) scores of a long
 * prompt cost GEMMs), a decode step (fewer rows) a direct loop that moves
 * each cached value once. */
#define KV_GEMM_ROWS 4

/* A score as HF eager forms it: (q . k) * scale, then cap tanh(s / cap). */
static inline float kv_score(float dot, float scale, float cap) {
    float s = dot * scale;
    return cap > 0 ? cap * tanhf(s / cap) : s;
}

/* Causal GQA attention of n new queries against the cache, one row at a
 * time. out[n, nH, hd], q[n, nH, hd] (after q_norm + RoPE); kc, vc
 * [max_len, nKV, hd] hold positions 0 .. p0+n-1; query i sits at absolute
 * position p0+i and sees keys first .. p0+i (first > 0 only in a sliding
 * window). The order of operations is HF eager's: (q . k) * scale, soft cap,
 * softmax with the row max subtracted, then probs @ v. */
static void kv_attention_decode(const lm_model *m, lm_kv *kv, float *out, const float *q, const float *kc,
                                const float *vc, int n, const kern_attn_opt *at) {
    const lm_config *c = &m->cfg;
    int nH = c->n_heads, nKV = c->n_kv_heads, hd = c->head_dim, group = nH / nKV, p0 = kv->p0, max_len = kv->max_len;
    size_t kvd = (size_t)nKV * hd;
    float scale = at->scale > 0 ? at->scale : 1.0f / sqrtf((float)hd), cap = at->softcap;
    float *scores = kv->scores; /* [n_threads, max_len] */
#pragma omp parallel for collapse(2) num_threads(kv->n_threads) schedule(static)
    for (int i = 0; i < n; i++) {
        for (int h = 0; h < nH; h++) {
            float *s = scores + (size_t)omp_get_thread_num() * max_len;
            int kh = h / group, last = p0 + i, t0 = kern_attn_first_key(last, at->window);
            const float *qi = q + ((size_t)i * nH + h) * hd;
            float maxv = -INFINITY;
            for (int t = t0; t <= last; t++) {
                const float *kt = kc + (size_t)t * kvd + (size_t)kh * hd;
                float dot = 0.0f;
                /* simd: lets the compiler split the sum into vector lanes (a
                 * different fp32 rounding order, as BLAS has in HF's matmul) */
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < hd; d++) dot += qi[d] * kt[d];
                s[t] = kv_score(dot, scale, cap);
                if (s[t] > maxv) maxv = s[t];
            }
            float sum = 0.0f;
            for (int t = t0; t <= last; t++) {
                s[t] = expf(s[t] - maxv);
                sum += s[t];
            }
            float inv = 1.0f / sum;
            float *o = out + ((size_t)i * nH + h) * hd;
            for (int d = 0; d < hd; d++) o[d] = 0.0f;
            for (int t = t0; t <= last; t++) {
                const float *vt = vc + (size_t)t * kvd + (size_t)kh * hd;
                float p = s[t] * inv;
#pragma omp simd /* o and vt never overlap (output vs cache) */
                for (int d = 0; d < hd; d++) o[d] += p * vt[d];
            }
        }
    }
}

/* The same attention for a prefill chunk through matmul_fwd: per kv head,
 * its cached K [p0+n, hd] and V^T [hd, p0+n] are gathered once, then for
 * each query head of its group S = Q K^T, the masked softmax of each row,
 * and O = S V. */
static void kv_attention_prefill(const lm_model *m, lm_kv *kv, float *out, const float *q, const float *kc,
                                 const float *vc, int n, const kern_attn_opt *at) {
    const lm_config *c = &m->cfg;
    int nH = c->n_heads, nKV = c->n_kv_heads, hd = c->head_dim, group = nH / nKV, p0 = kv->p0, T = p0 + n;
    size_t kvd = (size_t)nKV * hd;
    float scale = at->scale > 0 ? at->scale : 1.0f / sqrtf((float)hd), cap = at->softcap;
    /* [T, hd], [hd, T], [n, hd], [n, hd], [n, T] */
    float *kh = kv->kh, *vht = kv->vht, *qh = kv->qh, *oh = kv->oh, *S = kv->probs;
    for (int k = 0; k < nKV; k++) {
        for (int t = 0; t < T; t++) {
            memcpy(kh + (size_t)t * hd, kc + (size_t)t * kvd + (size_t)k * hd, (size_t)hd * sizeof(float));
            for (int d = 0; d < hd; d++) vht[(size_t)d * T + t] = vc[(size_t)t * kvd + (size_t)k * hd + d];
        }
        for (int h = k * group; h < (k + 1) * group; h++) {
            for (int i = 0; i < n; i++)
                memcpy(qh + (size_t)i * hd, q + ((size_t)i * nH + h) * hd, (size_t)hd * sizeof(float));
            K(MATMUL, matmul_fwd, S, qh, kh, n, hd, T, 0); /* S[n, T] = Q K^T */
#pragma omp parallel for num_threads(kv->n_threads) schedule(static)
            for (int i = 0; i < n; i++) {
                float *row = S + (size_t)i * T;
                /* keys after the query's own position, and before its window, are masked */
                int last = p0 + i, t0 = kern_attn_first_key(last, at->window);
                float maxv = -INFINITY, sum = 0.0f;
                for (int t = t0; t <= last; t++) {
                    row[t] = kv_score(row[t], scale, cap);
                    if (row[t] > maxv) maxv = row[t];
                }
                for (int t = t0; t <= last; t++) {
                    row[t] = expf(row[t] - maxv);
                    sum += row[t];
                }
                float inv = 1.0f / sum;
                for (int t = 0; t < t0; t++) row[t] = 0.0f;
                for (int t = t0; t <= last; t++) row[t] *= inv;
                for (int t = last + 1; t < T; t++) row[t] = 0.0f;
            }
            K(MATMUL, matmul_fwd, oh, S, vht, n, T, hd, 0); /* O[n, hd] = P V */
            for (int i = 0; i < n; i++)
                memcpy(out + ((size_t)i * nH + h) * hd, oh + (size_t)i * hd, (size_t)hd * sizeof(float));
        }
    }
}

/* out[n, nH*hd] = attention of the n rows in flight (q[n, nH*hd]) over
 * layer l's cache, positions 0 .. kv->p0+n-1. */
static void kv_attention(lm_model *m, lm_kv *kv, int l, float *out, const float *q, int n,
                         const kern_attn_opt *at) {
    size_t off = (size_t)l * kv->max_len * m->cfg.n_kv_heads * m->cfg.head_dim; /* layer l's [max_len, nKV*hd] */
    if (n >= KV_GEMM_ROWS) kv_attention_prefill(m, kv, out, q, kv->k + off, kv->v + off, n, at);
    else kv_attention_decode(m, kv, out, q, kv->k + off, kv->v + off, n, at);
}

size_t lm_kv_layout(lm_kv *kv, const lm_config *c, int max_len, int rows, int n_threads, float *base) {
    carver cv = {base, 0};
    size_t L = (size_t)c->n_layers, H = (size_t)c->hidden, I = (size_t)c->intermediate, hd = (size_t)c->head_dim;
    size_t nH = (size_t)c->n_heads, nKV = (size_t)c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    size_t T = (size_t)max_len, R = (size_t)rows, pa = branch_bufs(c);
    int moe = c->n_experts > 0;
    size_t Ik = (size_t)c->top_k * c->moe_intermediate; /* a MoE layer's gate/up/h per token */
    if (moe && Ik > I) I = Ik;
    memset(kv, 0, sizeof *kv);
    kv->max_len = max_len;
    kv->rows = rows;
    kv->n_threads = n_threads;
    kv->k = carve(&cv, L * T * kvd);
    kv->v = carve(&cv, L * T * kvd);
    kv->x[0] = carve(&cv, R * H);
    kv->x[1] = carve(&cv, R * H);
    lm_layer_acts *a = &kv->a; /* a.res, a.kr, a.v and a.moe: set per layer by lm_kv_forward */
    a->ac = LM_AC_NONE;
    a->ln1 = carve(&cv, R * H);
    a->ln1_rstd = carve(&cv, R);
    a->q = carve(&cv, R * qd);
    a->q_rstd = carve(&cv, R * nH);
    a->qr = carve(&cv, R * qd);
    a->k = carve(&cv, R * kvd);
    a->k_rstd = carve(&cv, R * nKV);
    a->att = carve(&cv, R * qd);
    a->ao = pa ? carve(&cv, R * H) : NULL;
    a->ao_rstd = pa ? carve(&cv, R) : NULL;
    a->res_mid = carve(&cv, R * H);
    a->ln2 = carve(&cv, R * H);
    a->ln2_rstd = carve(&cv, R);
    a->gate = carve(&cv, R * I);
    a->up = carve(&cv, R * I);
    a->h = carve(&cv, R * I);
    a->mo = pa ? carve(&cv, R * H) : NULL;
    a->mo_rstd = pa ? carve(&cv, R) : NULL;
    if (moe && c->shared_intermediate > 0) {
        size_t Is = (size_t)c->shared_intermediate;
        a->sgate = carve(&cv, R * Is);
        a->sup = carve(&cv, R * Is);
        a->sh = carve(&cv, R * Is);
        a->so = carve(&cv, R * H);
        a->sg = carve(&cv, R);
    }
    if (moe) {
        carve_route(&cv, &a->route, rows, c->n_experts, c->top_k);
        kv->moe_work = carve(&cv, KERN_MOE_WORK(R * c->top_k, H, c->moe_intermediate));
    }
    if (c->lora_rank > 0) { /* u = scale A x is read right after it is written: one buffer for every projection */
        float *u = carve(&cv, R * (size_t)lm_lora_max_rank(c));
        for (int p = 0; p < LM_LORA_N; p++) a->lora_u[p] = u;
    }
    kv->rope_cos = carve(&cv, R * hd / 2);
    kv->rope_sin = carve(&cv, R * hd / 2);
    kv->rope_cos_l = kv->rope_cos, kv->rope_sin_l = kv->rope_sin;
    if (lm_rope_local_differs(c)) {
        kv->rope_cos_l = carve(&cv, R * hd / 2);
        kv->rope_sin_l = carve(&cv, R * hd / 2);
    }
    kv->rope_cos_q = kv->rope_cos, kv->rope_sin_q = kv->rope_sin;
    if (c->q_scale_len > 0) {
        kv->rope_cos_q = carve(&cv, R * hd / 2);
        kv->rope_sin_q = carve(&cv, R * hd / 2);
    }
    kv->scores = carve(&cv, (size_t)n_threads * T);
    kv->kh = carve(&cv, T * hd);
    kv->vht = carve(&cv, hd * T);
    kv->qh = carve(&cv, R * hd);
    kv->oh = carve(&cv, R * hd);
    kv->probs = carve(&cv, R * T);
    return cv.used;
}

void lm_kv_forward(lm_model *m, lm_kv *kv, const int32_t *tokens, int p0, int n, float *logits) {
    const lm_config *c = &m->cfg;
    int H = c->hidden, kvd = c->n_kv_heads * c->head_dim;
    lm_layer_acts *a = &kv->a;
    kv->p0 = p0;
    /* the rows' RoPE tables, as transformers' forward over positions
     * 0 .. p0+n-1 resolves them (its length matters to dynamic and longrope) */
    int len = lm_rope_by_length(c) ? p0 + n : kv->max_len;
    lm_rope_tables(c, 0, len, p0, n, kv->rope_cos, kv->rope_sin);
    if (kv->rope_cos_l != kv->rope_cos) lm_rope_tables(c, 1, len, p0, n, kv->rope_cos_l, kv->rope_sin_l);
    if (kv->rope_cos_q != kv->rope_cos)
        lm_rope_q_tables(c, p0, n, kv->rope_cos, kv->rope_sin, kv->rope_cos_q, kv->rope_sin_q);
    embed_fwd(m, kv->x[0], tokens, n);
    for (int l = 0; l < c->n_layers; l++) {
        size_t rows0 = ((size_t)l * kv->max_len + p0) * kvd; /* layer l's cache rows p0 .. p0+n-1 */
        a->res = kv->x[l & 1];
        a->kr = kv->k + rows0;
        a->v = kv->v + rows0;
        a->moe = lm_layer_is_moe(c, l);
        layer_forward_at(m, kv, l, a, &m->w.layer[l], kv->x[(l + 1) & 1], 1, n);
    }
    if (!logits) return;
    /* the final norm and lm_head on the last row only: one distribution per step */
    const float *x = kv->x[c->n_layers & 1] + (size_t)(n - 1) * H;
    K(RMSNORM, rmsnorm_fwd, a->ln1, a->ln1_rstd, x, nw(m, m->w.lnf, H), 1, H, (float)c->rms_eps);
    head_fwd(m, logits, a->ln1, 1);
    head_lora_fwd(m, logits, a->ln1, 0, 1);
    lm_final_softcap(c, logits, (size_t)c->vocab_size, NULL);
}

/* --------------------------------------------------------------- backward */

/* The sparse MLP's backward from d_res[BT, H] (d of the layer's output, the
 * same as d of the MLP's output): d_ln[BT, H] = d(ln2), gradients of the
 * experts and the router. Reuses the forward's routing; the load-balancing term, if on,
 * enters d probs through moe_dprob_all. */
/* RMSNorm backward over the rows this model holds: dx += d(input), dw +=
 * d(weight) (NULL: frozen). Under sequence parallel a rank's rows give part
 * of dw: it waits in the next [H] block of sp_dw, so that a layer's norms
 * are summed over the group in one all-reduce (lm_norm_partials), then
 * added. */
static void norm_bwd(lm_model *m, float *dx, float *dw, const float *dout, const float *x, const float *w,
                     const float *rstd, int rows, int H) {
    if (dw && m->wdefer) { /* I of a split backward: dw in W (norm_bwd_w, the same sum) */
        K(RMSNORM, rmsnorm_bwd, dx, NULL, dout, x, nw(m, w, H), rstd, rows, H);
        wdefer_norm(m, LM_W_NORM, dw, dout, x, rstd, rows, H);
        m->wdefer->rec[m->wdefer->n - 1].sp = m->sp != NULL;
        return;
    }
    if (!m->sp || !dw) {
        K(RMSNORM, rmsnorm_bwd, dx, dw, dout, x, nw(m, w, H), rstd, rows, H);
        return;
    }
    float *pw = m->ws.sp_dw + (size_t)m->sp_norm_n * H;
    zero(pw, (size_t)H);
    K(RMSNORM, rmsnorm_bwd, dx, pw, dout, x, nw(m, w, H), rstd, rows, H);
    m->sp_norm_dw[m->sp_norm_n++] = dw;
}

/* W of norm_bwd's split: dw[H] += from the copies of r, as norm_bwd would
 * have (under sequence parallel into the next pending block of sp_dw, summed
 * over the group by the layer's post_backward or norm_flush). */
static void norm_bwd_w(lm_model *m, const lm_wstore *s, const lm_wrec *r) {
    const float *d = s->data;
    float *dw = r->dw;
    if (r->sp) {
        dw = m->ws.sp_dw + (size_t)m->sp_norm_n * r->K;
        zero(dw, (size_t)r->K);
    }
    K(RMSNORM, rmsnorm_bwd_w, dw, d + r->dy, d + r->x, d + r->rstd, r->M, r->K);
    if (r->sp) m->sp_norm_dw[m->sp_norm_n++] = r->dw;
}

size_t lm_norm_partials(lm_model *m, float **buf) {
    *buf = m->ws.sp_dw;
    return (size_t)m->sp_norm_n * (size_t)m->cfg.hidden;
}

void lm_norm_partials_add(lm_model *m) {
    size_t H = (size_t)m->cfg.hidden;
    for (int k = 0; k < m->sp_norm_n; k++)
        for (size_t i = 0; i < H; i++) m->sp_norm_dw[k][i] += m->ws.sp_dw[k * H + i];
    m->sp_norm_n = 0;
}

/* The pending norm partials summed here, where no hook took them (the final
 * norm's, before any layer; a layer's when the hooks do not batch them). */
static void norm_flush(lm_model *m) {
    float *buf;
    size_t n = lm_norm_partials(m, &buf);
    if (!n) return;
    m->hooks->reduce_partial(m->hooks->ctx, buf, n);
    lm_norm_partials_add(m);
}

/* The gated MLP's input side backward, the dense MLP's and a shared
 * expert's alike, from d_h[BT, I] = d(h): d_gate, d_up (their first
 * product, overwritten), the biases', weights' and adapters' gradients
 * (+=), and d_ln[BT, H] = d(x) (acc 0: overwritten; 1: added). */
static void mlp_up_bwd(lm_model *m, int l, const lm_layer_w *w, lm_layer_w *g, const float *x, const float *gate,
                       const float *up, int BT, int I, int acc) {
    int H = m->cfg.hidden;
    if (m->cfg.act == LM_ACT_GELU_TANH) K(GEGLU, geglu_bwd, m->ws.d_gate, m->ws.d_up, m->ws.d_h, gate, up, BT * I, 0);
    else K(SWIGLU, swiglu_bwd, m->ws.d_gate, m->ws.d_up, m->ws.d_h, gate, up, BT * I, 0);
    mm_bwd_b(m, m->ws.d_ln, g->wg, g->bg, m->ws.d_gate, x, w->wg, BT, H, I, acc);
    mm_bwd_b(m, m->ws.d_ln, g->wu, g->bu, m->ws.d_up, x, w->wu, BT, H, I, 1);
    lora_bwd_n(m, l, m->ws.d_ln, x, BT, H, 2, (const int[]){LM_LORA_GATE, LM_LORA_UP},
               (const float *const[]){m->ws.d_gate, m->ws.d_up}, (const int[]){I, I});
}

/* The shared expert's backward (shared_expert_fwd) from dy[BT, H] = d(block
 * output): d_ln[BT, H] += d(x) through the expert, the gradients of its
 * weights accumulate, and ws.d_sg[BT] = d(gate logit), whole under tensor
 * parallelism (summed over the Is slices); the gate's own share of d(x),
 * not a partial sum, is shared_gate_bwd's. */
static void shared_expert_bwd(lm_model *m, int l, const lm_layer_acts *a, const lm_layer_w *w, lm_layer_w *g,
                              const float *x, const float *dy, int BT) {
    size_t H = (size_t)m->cfg.hidden;
    int Is = m->cfg.shared_intermediate;
    float *dso = m->ws.d_so, *dsg = m->ws.d_sg; /* [BT, H], [BT] */
    for (size_t t = 0; t < (size_t)BT && w->shgate; t++) {
        float s = a->sg[t], dot = 0;
        for (size_t j = 0; j < H; j++) {
            dot += dy[t * H + j] * a->so[t * H + j];
            dso[t * H + j] = s * dy[t * H + j];
        }
        dsg[t] = dot * s * (1.0f - s); /* sigmoid' = s (1 - s) */
    }
    if (w->shgate) reduce_d_input(m, dsg, (size_t)BT);
    const float *dout = w->shgate ? dso : dy; /* ungated (GraniteMoeShared): d(output) is the branch's */
    mm_bwd(m, m->ws.d_h, g->wd, dout, a->sh, w->wd, BT, Is, (int)H, 0); /* d_h [BT, Is], overwritten */
    lora_bwd_n(m, l, m->ws.d_h, a->sh, BT, Is, 1, (const int[]){LM_LORA_DOWN}, (const float *const[]){dout},
               (const int[]){(int)H});
    mlp_up_bwd(m, l, w, g, x, a->sgate, a->sup, BT, Is, 1);
}

/* The shared expert gate's backward: d shgate [1, H] += d_sg^T x, dx[BT, H] += d_sg shgate
 * (and its adapter's, whole gradients on every rank under TP, as the gate's). */
static void shared_gate_bwd(lm_model *m, int l, float *dx, const lm_layer_w *w, lm_layer_w *g, const float *x,
                            int BT) {
    mm_bwd(m, dx, g->shgate, m->ws.d_sg, x, w->shgate, BT, m->cfg.hidden, 1, 1);
    lora_bwd_n(m, l, dx, x, BT, m->cfg.hidden, 1, (const int[]){LM_LORA_SHGATE}, (const float *const[]){m->ws.d_sg},
               (const int[]){1});
}

/* Whether a split backward's I leaves layer l's expert weight gradients to
 * W: not under expert parallel (its dispatch runs the kernel per source
 * rank, whole in I), nor with expert adapters (their dA, dB are reduced from
 * d(W + s B A) right after the kernel, in I); lm_wstore_floats asks the same
 * of the tensor table. */
static int experts_deferred(const lm_model *m, int l) {
    const lm_layer_w *w = &m->w.layer[l];
    return m->wdefer && !m->moe_ep && !m->cfg.expert_rows && !w->lora_ea[LM_LORA_EXP_GU] &&
           !w->lora_ea[LM_LORA_EXP_D];
}

static float *moe_layer_bwd(lm_model *m, int l, int BT) {
    const lm_config *c = &m->cfg;
    lm_layer_acts *a = &m->act.layer[l];
    const lm_layer_w *w = &m->w.layer[l];
    lm_layer_w *g = &m->g.layer[l];
    int H = c->hidden, E = c->n_experts, k = c->top_k;
    const moe_route *r = &a->route;
    zero(m->ws.d_ln, (size_t)BT * H);
    const float *eg, *eu, *ed;
    float *dg, *du, *dd;
    experts_adapted(m, w, &eg, &eu, &ed);
    experts_adapted_dw(m, w, g, &dg, &du, &dd);
    /* the experts and the router run on all rows: under sequence parallel
     * their input (ln2, or res_mid without pre-norms) and d(output) are gathered */
    const float *dy = m->ws.d_res; /* [BS, H] */
    if (w->ln_mo) { /* res_next = res_mid + norm(branch) (FlexOlmo): d(branch) [BS, H] through the norm */
        int BS = sp_rows(m, BT);
        zero(m->ws.d_moe, (size_t)BS * H);
        norm_bwd(m, m->ws.d_moe, g->ln_mo, m->ws.d_res, a->mo, w->ln_mo, a->mo_rstd, BS, H);
        dy = m->ws.d_moe;
    }
    dy = sp_gather(m, m->ws.sp_dy, dy, BT, H); /* [BT, H] */
    float rm = resid_mult(c);
    if (rm != 0) { /* the branch was scaled before the add: d(branch) = rm d(residual) */
        scaled_add(m->ws.d_moe, NULL, dy, rm, (size_t)BT * H);
        dy = m->ws.d_moe;
    }
    lm_layer_acts ag = *a;
    ag.ln2 = sp_gather(m, m->ws.sp_x, mlp_in(m, a), BT, H);
    if (m->moe_ep) { /* the dispatch's own backward, whole in I (lm.h, lm_wstore) */
        lm_experts_w ew = experts_w(m, eg, eu, ed);
        m->moe_ep->bwd(m->moe_ep->ctx, l, m->ws.d_ln, (float *const[3]){dg, du, dd}, m->ws.moe_dtopw, dy, r, &ew,
                       BT);
    } else if (experts_deferred(m, l) && (dg || du || dd)) { /* I: d(input) now, the weight gradients in W */
        experts_h(m, 0, NULL, m->ws.d_ln, NULL, NULL, NULL, m->ws.moe_dtopw, dy, &ag, m->ws.moe_work, eg, eu, ed, BT);
        wdefer_experts(m, dg, du, dd, dy, &ag, m->ws.moe_work, BT);
    } else
        experts_h(m, 0, NULL, m->ws.d_ln, dg, du, dd, m->ws.moe_dtopw, dy, &ag, m->ws.moe_work, eg, eu, ed, BT);
    experts_adapted_grad(m, w, g);
    if (c->shared_intermediate > 0) shared_expert_bwd(m, l, a, w, g, ag.ln2, dy, BT);
    /* under tensor parallelism both are partial sums over the experts'
     * intermediate slices; the router's own d(ln2), added next, is not
     * (its rows outside this rank's block, under sequence parallel, unread) */
    float *dl = sum_rows(m, m->ws.d_ln, BT, H);
    reduce_d_input(m, m->ws.moe_dtopw, (size_t)BT * k);
    int aux = lm_aux_in_grad(c);
    int64_t rt0 = PROF_T0(m->prof);
    const float *wr = router_adapted(m, w);
    float *dwr = g->router;
    if (wr != w->router) { /* d(W + scale B A) into scratch: dA, dB come from it */
        if (!m->ws.lora_drw) m->ws.lora_drw = ct_malloc((size_t)E * H * sizeof(float));
        dwr = m->ws.lora_drw;
        zero(dwr, (size_t)E * H);
    }
    moe_router_opt ro = lm_router_opt(c);
    moe_route_bwd_opt(&m->k, m->ws.d_ln, dwr, m->ws.moe_dprobs, m->ws.moe_dtopw, aux ? m->ws.moe_dprob_all : NULL,
                      ag.ln2, wr, wr == w->router ? frozen_bf16(m, w->router) : NULL, r, BT, H, E, k, &ro);
    if (wr != w->router) {
        lora_experts_grad(&m->k, g->lora_ea[LM_LORA_EXP_R], g->lora_eb[LM_LORA_EXP_R], dwr, NULL,
                          w->lora_ea[LM_LORA_EXP_R], w->lora_eb[LM_LORA_EXP_R], 1, lm_lora_exp_rank(c, LM_LORA_EXP_R),
                          H, E, E, lm_lora_exp_scale(c, LM_LORA_EXP_R));
        if (g->router) /* a trained base router too: d(W + scale B A) / dW = 1 */
            for (size_t i = 0; i < (size_t)E * H; i++) g->router[i] += dwr[i];
    }
    if (m->prof) prof_model_op(m->prof, "moe_route_bwd", "moe_route", KERN_OP_MATMUL, rt0);
    if (w->shgate) shared_gate_bwd(m, l, m->ws.d_ln, w, g, ag.ln2, BT); /* whole, as the router's, after the sum */
    return dl;
}

/* The backward of x[BT, H] += [norm](in[BT, K] @ w^T + b) (+ LoRA adapter p):
 * o_proj and down_proj. From d_res[BT, H] = d(x): din[BT, K] = d(in) (its first
 * product, overwritten; the adapter's then adds) and the weight [H, K], bias [H],
 * norm [H] and adapter gradients (NULL: frozen or absent).
 * y, rstd: the forward's output before the norm and its rstd (ln NULL: no
 * norm, d(output) is d_res itself). d_ln is the scratch for d(y). */
static void out_proj_bwd(lm_model *m, int l, int p, float *din, const float *in, const float *w, float *gw, float *gb,
                         const float *ln, float *gln, const float *y, const float *rstd, int BT, int K) {
    int H = m->cfg.hidden, BS = sp_rows(m, BT);
    const float *dy = m->ws.d_res; /* [BT, H]; under sequence parallel this rank's rows, then gathered */
    float rm = resid_mult(&m->cfg);
    if (ln) {
        zero(m->ws.d_ln, (size_t)BS * H);
        norm_bwd(m, m->ws.d_ln, gln, m->ws.d_res, y, ln, rstd, BS, H);
        dy = m->ws.d_ln;
    } else if (rm != 0) { /* the branch was scaled before the add: d(branch) = rm d(residual) */
        scaled_add(m->ws.d_ln, NULL, m->ws.d_res, rm, (size_t)BS * H);
        dy = m->ws.d_ln;
    }
    dy = sp_gather(m, m->ws.sp_dy, dy, BT, H);
    /* din (d_h or d_att): this is its first product */
    mm_bwd_b(m, din, gw, gb, dy, in, w, BT, K, H, 0);
    lora_bwd_n(m, l, din, in, BT, K, 1, &p, &dy, &H);
}

/* The fused lm_head + cross-entropy + their backward over m->act.lnf, a block
 * of rows at a time, then the final norm's: d_res = d(res_out). Returns
 * the CE sum; *count gets the valid labels. */
static double head_loss_bwd(lm_model *m, const int32_t *labels, int BT, float grad_scale, long *count) {
    const lm_config *c = &m->cfg;
    int H = c->hidden;
    double loss_sum = 0; /* d_ln: d(final norm output) [BT, H], each block's rows written by head_bwd */
    const float *lnf = sp_gather(m, m->ws.sp_x, m->act.lnf, BT, H); /* the head reads all rows */
    /* the adapter's dA: partial over the vocabulary-parallel group, summed once below */
    float *da = m->w.head_a && vocab_par(c) && m->g.head_a ? (head_lora_scratch(m), m->ws.head_da) : m->g.head_a;
    if (da && da != m->g.head_a) zero(da, (size_t)c->lora_rank * H);
    for (int r0 = 0; r0 < BT; r0 += m->ws.logit_rows) {
        int n = BT - r0 < m->ws.logit_rows ? BT - r0 : m->ws.logit_rows;
        const float *x = lnf + (size_t)r0 * H;
        size_t nv = (size_t)n * vocab_held(c);
        head_fwd(m, m->ws.logits, x, n);
        head_lora_fwd(m, m->ws.logits, x, r0, n);
        lm_final_softcap(c, m->ws.logits, nv, m->ws.cap_t); /* tanh kept for softcap_bwd */
        loss_sum += crossentropy(m, m->ws.logits, labels + r0, n, grad_scale, count);
        softcap_bwd(m, m->ws.logits, nv);
        head_bwd(m, m->ws.d_ln + (size_t)r0 * H, m->ws.logits, x, n);
        head_lora_bwd(m, m->ws.d_ln + (size_t)r0 * H, da, m->ws.logits, x, r0, n);
    }
    if (da && da != m->g.head_a) {
        reduce_d_input(m, da, (size_t)c->lora_rank * H);
        for (size_t i = 0; i < (size_t)c->lora_rank * H; i++) m->g.head_a[i] += da[i];
    }
    /* each rank's rows of lm_head: partial; a whole head: every row whole, this rank's taken */
    const float *dl = vocab_par(c) ? sum_rows(m, m->ws.d_ln, BT, H) : m->ws.d_ln + sp_row0(m, BT) * H;
    /* d_res carries d(residual stream) downwards */
    int BS = sp_rows(m, BT);
    zero(m->ws.d_res, (size_t)BS * H);
    norm_bwd(m, m->ws.d_res, m->g.lnf, dl, m->act.res_out, m->w.lnf, m->act.lnf_rstd, BS, H);
    norm_flush(m); /* on its own: the last layer's are summed after its backward */
    return loss_sum;
}

/* Layer l's backward from d_res[BT, H] = d(its output): d_res becomes d(its
 * input), and layer l's weight gradients accumulate (+=). */
static void layer_backward(lm_model *m, int l, int B, int T) {
    const lm_config *c = &m->cfg;
    int BT = B * T, H = c->hidden, I = c->intermediate, hd = c->head_dim;
    int nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd, BS = sp_rows(m, BT);
    float *dl; /* d of a norm's output: the rows this rank holds */
    layer_recompute(m, l, B, T);
    lm_layer_acts *a = &m->act.layer[l];
    if (m->cfg.qk_norm != LM_QK_HEAD) {
        int64_t z_t0 = PROF_T0(m->prof);
        zero_layer_scratch(m, BT);
        if (m->prof) prof_model_op(m->prof, "zero_layer_scratch", "zero", PROF_NO_KERNEL, z_t0);
    }
    const lm_layer_w *w = &m->w.layer[l];
    lm_layer_w *g = &m->g.layer[l];
    const float *cs, *sn, *qcs, *qsn;
    rope_of(m, l, &cs, &sn);
    rope_q_pick(&m->cfg, cs, sn, m->ws.rope_cos_q, m->ws.rope_sin_q, &qcs, &qsn);
    if (a->moe) {
        dl = moe_layer_bwd(m, l, BT);
    } else {
        /* res_next = res_mid + [norm](down(h) + bd): d_res flows to res_mid unchanged, plus the MLP path */
        out_proj_bwd(m, l, LM_LORA_DOWN, m->ws.d_h, a->h, w->wd, g->wd, g->bd, w->ln_mo, g->ln_mo, a->mo, a->mo_rstd,
                     BT, I);
        const float *xm = sp_gather(m, m->ws.sp_x, mlp_in(m, a), BT, H);
        mlp_up_bwd(m, l, w, g, xm, a->gate, a->up, BT, I, 0);
        dl = sum_rows(m, m->ws.d_ln, BT, H);
    }
    if (w->ln2) norm_bwd(m, m->ws.d_res, g->ln2, dl, a->res_mid, w->ln2, a->ln2_rstd, BS, H);
    else K(ADD, add, m->ws.d_res, m->ws.d_res, dl, (long)BS * H); /* the MLP read res_mid itself */

    /* res_mid = res + [norm](o_proj(att) + bo) */
    out_proj_bwd(m, l, LM_LORA_O, m->ws.d_att, a->att, w->wo, g->wo, g->bo, w->ln_ao, g->ln_ao, a->ao, a->ao_rstd, BT,
                 qd);
    kern_attn_opt ao = attn_opt(m, l);
    if (ao.bf16) attn_round_bf16(m, 1, (float *const[]){m->ws.d_att}, (const long[]){(long)BT * qd}, "attention_dout_bf16");
    /* d_q, d_k, d_v: their first product, overwritten */
    if (m->attn_cp) /* context parallel: over the whole sequence's keys (distributed/cp.h) */
        m->attn_cp->bwd(m->attn_cp->ctx, m->ws.d_q, m->ws.d_k, m->ws.d_v, m->ws.d_att, a->att, a->lse, a->qr, a->kr,
                        a->v, B, T, nH, nKV, hd, &ao);
    else
        K(ATTENTION, attention_bwd, m->ws.d_q, m->ws.d_k, m->ws.d_v, m->ws.d_att, a->att, a->lse, a->qr, a->kr, a->v, B, T,
          nH, nKV, hd, &ao, 0);
    /* through RoPE and the q/k norms: d_q, d_k (w.r.t. the rotated q, k) ->
     * d_q2, d_k2 (w.r.t. the projections' outputs) */
    qk_bwd(m, m->ws.d_q2, g->qn, m->ws.d_q, a->q, w->qn, a->q_rstd, qcs, qsn, B, T, nH, hd);
    qk_bwd(m, m->ws.d_k2, g->kn, m->ws.d_k, a->k, w->kn, a->k_rstd, cs, sn, B, T, nKV, hd);
    /* the embedding and layer 0's input norm frozen: nothing below wants d(ln1) of
     * layer 0 (autograd skips these input-gradient products too) */
    float *dln = l > 0 || m->g.wte || m->g.emb_a || m->g.emb_b || g->ln1 ? m->ws.d_ln : NULL; /* [BT, H] */
    const float *xa = sp_gather(m, m->ws.sp_x, attn_in(m, a), BT, H);
    mm_bwd_b(m, dln, g->wq, g->bq, m->ws.d_q2, xa, w->wq, BT, H, qd, 0);
    mm_bwd_b(m, dln, g->wk, g->bk, m->ws.d_k2, xa, w->wk, BT, H, kvd, 1);
    mm_bwd_b(m, dln, g->wv, g->bv, m->ws.d_v, xa, w->wv, BT, H, kvd, 1);
    lora_bwd_n(m, l, dln, xa, BT, H, 3, (const int[]){LM_LORA_Q, LM_LORA_K, LM_LORA_V},
               (const float *const[]){m->ws.d_q2, m->ws.d_k2, m->ws.d_v}, (const int[]){qd, kvd, kvd});
    if (dln) {
        dl = sum_rows(m, m->ws.d_ln, BT, H);
        if (w->ln1) norm_bwd(m, m->ws.d_res, g->ln1, dl, a->res, w->ln1, a->ln1_rstd, BS, H);
        else K(ADD, add, m->ws.d_res, m->ws.d_res, dl, (long)BS * H); /* attention read res itself */
    }
}

/* Layers l1-1 down to l0, from d_res = d(layer l1-1's output). */
static void backward_layers(lm_model *m, int l0, int l1, int B, int T) {
    for (int l = l1 - 1; l >= l0; l--) {
        if (m->hooks) m->hooks->pre_backward(m->hooks->ctx, l);
        if (m->wdefer) m->wdefer->cur = l;
        int64_t t0 = PROF_T0(m->prof);
        layer_backward(m, l, B, T);
        if (m->prof) prof_layer(m->prof, "layer_bwd", l, t0);
        if (m->hooks) m->hooks->post_backward(m->hooks->ctx, l); /* tensor parallel's sums the norms' */
        norm_flush(m);
    }
}

/* The embedding's gradient wte[V, H] += from d_res[BT, H] = d(layer 0's input). */
static void embed_bwd(lm_model *m, const int32_t *tokens, int BT) {
    const lm_config *c = &m->cfg;
    int H = c->hidden;
    if (!m->g.wte && !m->g.emb_a && !m->g.emb_b) return;
    /* under sequence parallel every rank adds all rows (gathered), as without it */
    float *d = sp_gather(m, m->ws.sp_dy, m->ws.d_res, BT, H);
    lm_embed_scale(c, d, (size_t)BT * H); /* d(lookup) = sqrt(H) d(scaled) */
    embed_lora_bwd(m, d, tokens, BT); /* before padding_idx's rows are zeroed: B's gradient has them */
    if (!m->g.wte) return;
    if (c->has_pad) /* torch's padding_idx: the lookup adds nothing to that row */
        for (int i = 0; i < BT; i++)
            if (tokens[i] == c->pad_token) zero(d + (size_t)i * H, (size_t)H);
    if (vocab_par(c)) { /* d is whole on every rank: this rank's tokens' rows, moved up in order, to its rows
                          * (the kernel adds a row's tokens in order, so the bits of the whole table's) */
        int n = 0;
        for (int i = 0; i < BT; i++) {
            if (tokens[i] < c->vocab_row0 || tokens[i] >= c->vocab_row0 + c->vocab_rows) continue;
            if (n < i) memcpy(d + (size_t)n * H, d + (size_t)i * H, (size_t)H * sizeof(float));
            m->ws.embed_ids[n++] = tokens[i] - c->vocab_row0;
        }
        if (n) K(EMBEDDING, embedding_bwd, m->g.wte, d, m->ws.embed_ids, n, H);
        return;
    }
    K(EMBEDDING, embedding_bwd, m->g.wte, d, tokens, BT, H);
}

double lm_forward_backward(lm_model *m, const int32_t *tokens, const int32_t *labels, int B, int T,
                              float grad_scale, long *n_valid) {
    int BT = B * T;
    m->moe.count_tokens = 1; /* training forwards feed load_balance_coeff's counts */
    m->lora_train = 1;       /* and LoRA's dropout */
    forward_stack(m, tokens, B, T);
    m->moe.count_tokens = 0;
    long count = 0;
    double loss_sum = head_loss_bwd(m, labels, BT, grad_scale, &count);
    if (n_valid) *n_valid = count;
    backward_layers(m, 0, m->cfg.n_layers, B, T);
    embed_bwd(m, tokens, BT);
    m->lora_train = 0;
    return loss_sum;
}

void lm_stage_forward(lm_model *m, int l0, int l1, const int32_t *tokens, const float *x_in, float *x_out, int B,
                      int T, int train) {
    int L = m->cfg.n_layers, BT = B * T, H = m->cfg.hidden;
    forward_begin(m, tokens, B, T);
    m->moe.count_tokens = train;
    m->lora_train = train;
    /* x_in, x_out hold all rows; under sequence parallel the layers this rank's */
    size_t ns = (size_t)sp_rows(m, BT) * H;
    if (l0 == 0) embed_fwd(m, L ? m->act.layer[0].res : m->act.res_out, tokens, BT);
    else memcpy(m->act.layer[l0].res, x_in + sp_row0(m, BT) * H, ns * sizeof(float));
    float *out = l1 == L ? m->act.res_out : m->sp ? m->ws.sp_dy : x_out; /* sp_dy: free in a forward */
    forward_layers(m, l0, l1, out, B, T);
    if (l1 < L && m->sp) /* t padded chunks, then the BT rows the message holds */
        memcpy(x_out, sp_gather(m, m->ws.sp_x, out, BT, H), (size_t)BT * H * sizeof(float));
    if (l1 == L) final_norm_fwd(m, BT);
    m->moe.count_tokens = 0;
    m->lora_train = 0;
}

double lm_stage_backward(lm_model *m, int l0, int l1, const int32_t *tokens, const int32_t *labels,
                         const float *d_out, float *d_in, int B, int T, float grad_scale, long *n_valid) {
    int L = m->cfg.n_layers, BT = B * T, H = m->cfg.hidden;
    double loss_sum = 0;
    long count = 0;
    m->lora_train = 1;
    size_t ns = (size_t)sp_rows(m, BT) * H; /* d_out, d_in: all rows; d_res: this rank's (sp_gather) */
    if (m->wdefer) m->wdefer->cur = L; /* the final norm's record: W replays it before the layers' */
    if (l1 == L) loss_sum = head_loss_bwd(m, labels, BT, grad_scale, &count);
    else memcpy(m->ws.d_res, d_out + sp_row0(m, BT) * H, ns * sizeof(float));
    if (n_valid) *n_valid = count;
    backward_layers(m, l0, l1, B, T);
    if (l0 == 0) embed_bwd(m, tokens, BT);
    else if (m->sp) memcpy(d_in, sp_gather(m, m->ws.sp_dy, m->ws.d_res, BT, H), (size_t)BT * H * sizeof(float));
    else memcpy(d_in, m->ws.d_res, (size_t)BT * H * sizeof(float));
    m->lora_train = 0;
    return loss_sum;
}

/* Replays record r of store s (lm_stage_backward_weight). */
static void wrec_replay(lm_model *m, const lm_wstore *s, const lm_wrec *r) {
    const float *d = s->data;
    switch (r->kind) {
    case LM_W_PROJ:
        if (r->db) op_bias_bwd(r->db, d + r->dy, r->M, r->N);
        K(MATMUL, matmul_bwd, NULL, r->dw, d + r->dy, d + r->x, r->w, r->M, r->K, r->N, 0);
        break;
    case LM_W_EXPERTS: {
        /* the experts' [E, ...] gradients, from I's copies (wdefer_experts), with
         * the experts' scratch as the op's work (free between two layers' ops) */
        const int32_t *perm = (const int32_t *)(d + r->route), *off = perm + (size_t)r->M * r->k;
        const float *topw = d + r->route + (size_t)r->M * r->k + r->E + 1;
        K(MOE, moe_bwd_w, r->dw, r->dwu, r->dwd, m->ws.moe_work, d + r->dy, d + r->x, d + r->h, d + r->dg,
          d + r->du, perm, off, topw, r->M, r->K, r->N, r->E, r->k);
        break;
    }
    case LM_W_NORM: norm_bwd_w(m, s, r); break;
    case LM_W_NORM_REF: op_rmsnorm_bwd_w(r->dw, d + r->dy, d + r->x, d + r->rstd, r->M, r->K); break;
    case LM_W_QKNORM_ROPE:
        K(ROPE, qknorm_rope_bwd_w, r->dw, d + r->dy, d + r->x, d + r->rstd, r->cs, r->sn, r->B, r->T, r->N, r->K);
        break;
    default: abort();
    }
}

void lm_stage_backward_weight(lm_model *m, lm_wstore *s, int l0, int l1) {
    int k = 0;
    /* the final norm's first, where the fused backward ran it: before the last
     * layer's pre_backward (FSDP reduces the head's piece there) */
    for (; k < s->n && s->rec[k].layer == m->cfg.n_layers; k++) wrec_replay(m, s, &s->rec[k]);
    norm_flush(m); /* sequence parallel: its partial on its own, as head_loss_bwd's */
    /* each layer's inside its hooks, as the fused backward ran them */
    for (int l = l1 - 1; l >= l0; l--) {
        if (m->hooks) m->hooks->pre_backward(m->hooks->ctx, l);
        for (; k < s->n && s->rec[k].layer == l; k++) wrec_replay(m, s, &s->rec[k]);
        if (m->hooks) m->hooks->post_backward(m->hooks->ctx, l); /* tensor parallel's sums the norms' */
        norm_flush(m);
    }
    s->n = 0;
    s->used = 0;
    s->n_experts = 0;
}

/* What wdefer_experts copies for layer l's experts, from the table: each
 * token takes exactly top_k experts, so the permuted rows are rows k
 * whatever the routing (only their split between experts varies, and the
 * copies hold all of them at once). x [rows, H] for trained gate or up, d
 * gate / d up [rows k, Im] each trained, dout [rows, H], h [rows k, Im] and
 * topw [rows k] for trained down, perm [rows k] and offsets [E + 1]. */
static size_t experts_store_floats(const lm_model *m, int l, size_t rows) {
    const lm_config *c = &m->cfg;
    if (c->expert_rows || !lm_layer_is_moe(c, l)) return 0;
    int tg = 0, tu = 0, td = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        if (t->layer != l) continue;
        if (t->slot == LM_S_LORA_EA && (t->expert == LM_LORA_EXP_GU || t->expert == LM_LORA_EXP_D)) return 0;
        if (t->frozen || t->expert != 0) continue; /* a projection's experts are trained or frozen together */
        tg |= t->slot == LM_S_EXP_G, tu |= t->slot == LM_S_EXP_U, td |= t->slot == LM_S_EXP_D;
    }
    if (!tg && !tu && !td) return 0;
    size_t S = rows * (size_t)c->top_k, H = (size_t)c->hidden, Im = (size_t)c->moe_intermediate;
    return (tg || tu ? rows * H : 0) + (size_t)(tg + tu) * S * Im + (td ? rows * H + S * Im + S : 0) + S +
           (size_t)c->n_experts + 1;
}

/* What wdefer_norm copies for a trained norm of C features over nrows rows:
 * x and d(output) [nrows, C], rstd [nrows]. */
static size_t norm_store_floats(size_t nrows, size_t C) { return nrows * (2 * C + 1); }

size_t lm_wstore_floats(const lm_model *m, int l0, int l1, size_t rows) {
    const lm_config *c = &m->cfg;
    size_t total = 0;
    /* the norms: a layer's and the final one over the rows this rank holds (sequence
     * parallel: its block), a q/k norm over all rows, per head or per token */
    size_t ns = (size_t)sp_rows(m, (int)rows), H = (size_t)c->hidden;
    if (!m->sp && c->tp_seq && c->tp_degree > 1) /* a table (the dry run): rank 0's block, the largest */
        ns = (rows + (size_t)c->tp_degree - 1) / (size_t)c->tp_degree;
    size_t qrows = c->qk_norm == LM_QK_HEAD ? rows * (size_t)c->n_heads : rows;
    size_t krows = c->qk_norm == LM_QK_HEAD ? rows * (size_t)c->n_kv_heads : rows;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        if (t->frozen || t->lora) continue;
        if (t->slot == LM_S_LNF && l1 == c->n_layers) total += norm_store_floats(ns, H);
        if (t->layer < l0 || t->layer >= l1) continue;
        switch (t->slot) {
        case LM_S_LN_IN: case LM_S_LN_ATTN_OUT: case LM_S_LN_PRE_MLP:
        case LM_S_LN_MLP_OUT: /* the dense MLP's, or a sparse block's under post-norms (FlexOlmo) */
            total += norm_store_floats(ns, H);
            break;
        case LM_S_QN: total += norm_store_floats(qrows, t->numel); break;
        case LM_S_KN: total += norm_store_floats(krows, t->numel); break;
        default: break;
        }
    }
    for (int l = l0; l < l1; l++) {
        /* per group (q/k/v, gate/up): whether a member records, and its inputs' width K */
        size_t qkv = 0, gu = 0;
        int shared_gate = 0;
        for (int i = 0; i < m->n_tensors; i++) {
            const lm_tensor *t = &m->tensors[i];
            if (t->layer != l || t->lora || t->frozen || t->ndim != 2) continue;
            size_t N = (size_t)t->shape[0], K = (size_t)t->shape[1];
            switch (t->slot) {
            case LM_S_WQ: case LM_S_WK: case LM_S_WV: case LM_S_WQKV: qkv = K; total += rows * N; break;
            case LM_S_WG: case LM_S_WU: case LM_S_WGU: gu = K; total += rows * N; break;
            case LM_S_WO: case LM_S_WD: total += rows * (N + K); break;
            case LM_S_SHARED_GATE: shared_gate = 1; total += rows * N; break;
            default: break;
            }
        }
        /* the shared gate reads the shared expert's input: a copy of its own only
         * where that expert's gate and up record nothing */
        if (shared_gate && !gu) gu = (size_t)m->cfg.hidden;
        total += rows * (qkv + gu) + experts_store_floats(m, l, rows);
    }
    return total;
}

void lm_wstore_reserve(lm_wstore *s, size_t floats, int records) {
    if (floats > s->size) {
        float *d = ct_malloc64(floats * sizeof(float));
        if (s->used) memcpy(d, s->data, s->used * sizeof(float));
        free(s->data);
        s->data = d;
        s->size = floats;
    }
    if (records > s->cap) {
        lm_wrec *r = ct_malloc((size_t)records * sizeof *r);
        if (s->n) memcpy(r, s->rec, (size_t)s->n * sizeof *r);
        free(s->rec);
        s->rec = r;
        s->cap = records;
    }
}

void lm_wstore_free(lm_wstore *s) {
    free(s->rec);
    free(s->data);
    memset(s, 0, sizeof *s);
}

double lm_stage_loss(lm_model *m, const int32_t *labels, int B, int T, long *n_valid) {
    int BT = B * T, H = m->cfg.hidden;
    double sum = 0;
    long count = 0;
    const float *lnf = sp_gather(m, m->ws.sp_x, m->act.lnf, BT, H); /* the head reads all rows */
    for (int r0 = 0; r0 < BT; r0 += m->ws.logit_rows) {
        int n = BT - r0 < m->ws.logit_rows ? BT - r0 : m->ws.logit_rows;
        head_fwd(m, m->ws.logits, lnf + (size_t)r0 * H, n);
        head_lora_fwd(m, m->ws.logits, lnf + (size_t)r0 * H, r0, n);
        lm_final_softcap(&m->cfg, m->ws.logits, (size_t)n * vocab_held(&m->cfg),
                         NULL);
        sum += crossentropy(m, m->ws.logits, labels + r0, n, 0.0f, &count);
    }
    if (n_valid) *n_valid = count;
    return sum;
}
