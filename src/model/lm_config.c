/* model/lm_config.c: where the ways of naming a model meet.
 *
 * A native flavor is a row of the table below (the published
 * hyperparameters); an HF directory is its config.json. Both fill the same
 * lm_config. Reading config.json is strict about what we cannot compute
 * (attention bias, sliding windows, RoPE scaling): silently training a
 * different model than the checkpoint describes is the worst failure. RoPE
 * theta is always taken from the file, never from a flavor. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/fs.h"
#include "formats/json.h"
#include "model/lm.h"

typedef struct {
    const char *name;
    int V, H, I, L, nH, nKV, hd, tied;
    double theta;
    int E, k, Im; /* MoE flavors (model/moe.h): experts, experts per token, expert MLP size; 0: dense */
} flavor_row;

static const flavor_row flavors[] = {
    {"debugmodel", 2048, 256, 3072, 8, 16, 8, 128, 0, 1e6f, 0, 0, 0},
    {"0.6B", 151936, 1024, 3072, 28, 16, 8, 128, 1, 1e6f, 0, 0, 0},
    {"1.7B", 151936, 2048, 6144, 28, 16, 8, 128, 1, 1e6f, 0, 0, 0},
    {"4B", 151936, 2560, 9728, 36, 32, 8, 128, 1, 1e6f, 0, 0, 0},
    {"8B", 151936, 4096, 12288, 36, 32, 8, 128, 0, 1e6f, 0, 0, 0},
    {"14B", 151936, 5120, 17408, 40, 40, 8, 128, 0, 1e6f, 0, 0, 0},
    {"32B", 151936, 5120, 25600, 64, 64, 8, 128, 0, 1e6f, 0, 0, 0},
    /* MoE: the published Qwen3-30B-A3B / 235B-A22B config.json values (every
     * layer sparse, norm_topk_prob true); debugmodel_moe is debugmodel with 8
     * experts of 768, 2 per token */
    {"debugmodel_moe", 2048, 256, 3072, 8, 16, 8, 128, 0, 1e6f, 8, 2, 768},
    {"30B-A3B", 151936, 2048, 6144, 48, 32, 4, 128, 0, 1e6f, 128, 8, 768},
    {"235B-A22B", 151936, 4096, 12288, 94, 64, 4, 128, 0, 1e6f, 128, 8, 1536},
};

int lm_holds_layer(const lm_config *c, int l) { return !c->pp_stage || (l >= 0 && l < c->n_layers && c->layer_held[l]); }
int lm_holds_head(const lm_config *c) { return !c->pp_stage || c->n_layers == 0 || c->layer_held[c->n_layers - 1]; }
int lm_holds_embed(const lm_config *c) {
    return !c->pp_stage || c->n_layers == 0 || c->layer_held[0] || (c->tie_embeddings && lm_holds_head(c));
}

int lm_layer_is_moe(const lm_config *c, int l) {
    if (c->n_experts <= 0) return 0;
    for (int i = 0; i < c->n_mlp_only; i++)
        if (c->mlp_only_layers[i] == l) return 0;
    return (l + 1) % c->decoder_sparse_step == 0;
}

/* router_sigmoid marks DeepSeek-V3's router (glm4_moe, dots1): its ungated shared experts and its
 * selection bias under mlp.gate go with it */
int lm_shared_experts_ungated(const lm_config *c) {
    return !strcmp(c->model_type, "ernie4_5_moe") || c->router_sigmoid;
}

moe_router_opt lm_router_opt(const lm_config *c) {
    moe_router_opt o = {c->norm_topk_prob, c->router_sigmoid, c->n_group > 1 ? c->n_group : 1,
                        c->topk_group > 1 ? c->topk_group : 1, c->routed_scaling > 0 ? (float)c->routed_scaling : 1.0f,
                        (float)c->moe_norm_min};
    return o;
}

int lm_router_bias_name(const lm_config *c, int l, char *name, size_t n) {
    if (!lm_layer_is_moe(c, l)) return 0;
    if (c->router_sigmoid) { /* Glm4MoeTopkRouter's (Dots1TopkRouter's) buffer [E] */
        snprintf(name, n, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        return 1;
    }
    if (strcmp(c->model_type, "ernie4_5_moe")) return 0;
    snprintf(name, n, "model.layers.%d.mlp.moe_statics.e_score_correction_bias", l);
    return 2;
}

int lm_fused_file_name(const lm_config *c, const lm_tensor *t, char *name, size_t n) {
    if (c->moe_keys != LM_MOE_KEYS_GRANITE || t->layer < 0 || t->lora) return 0;
    if (t->slot == LM_S_EXP_G || t->slot == LM_S_EXP_U || t->slot == LM_S_EXP_D) {
        snprintf(name, n, "model.layers.%d.block_sparse_moe.%s.weight", t->layer,
                 t->slot == LM_S_EXP_D ? "output_linear" : "input_linear");
        return 1;
    }
    if (c->shared_intermediate > 0 && (t->slot == LM_S_WG || t->slot == LM_S_WU) && lm_layer_is_moe(c, t->layer)) {
        snprintf(name, n, "model.layers.%d.shared_mlp.input_linear.weight", t->layer);
        return 1;
    }
    return 0;
}

int lm_module_param_name(const lm_config *c, const lm_tensor *t, char *name, size_t n) {
    if (t->layer < 0 || t->lora) return 0;
    const char *moe = c->moe_keys == LM_MOE_KEYS_GRANITE ? "block_sparse_moe" : "mlp";
    if (t->slot == LM_S_EXP_G || t->slot == LM_S_EXP_U || t->slot == LM_S_EXP_D) {
        snprintf(name, n, "model.layers.%d.%s.experts.%s", t->layer, moe,
                 t->slot == LM_S_EXP_D ? "down_proj" : "gate_up_proj");
        return 1;
    }
    if (t->slot == LM_S_ROUTER && c->moe_keys != LM_MOE_KEYS_QWEN) {
        snprintf(name, n, "model.layers.%d.%s", t->layer,
                 c->moe_keys == LM_MOE_KEYS_GRANITE ? "block_sparse_moe.router.weight" : "mlp.gate.weight");
        return 1;
    }
    return 0;
}

int lm_config_check(const lm_config *c, const char *where, ct_err *e) {
    struct { const char *k; int v; } pos[] = {
        {"vocab_size", c->vocab_size}, {"hidden_size", c->hidden}, {"intermediate_size", c->intermediate},
        {"num_hidden_layers", c->n_layers}, {"num_attention_heads", c->n_heads},
        {"num_key_value_heads", c->n_kv_heads}, {"head_dim", c->head_dim}};
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v <= 0) return ct_fail(e, CT_ERR_CONFIG, "%s: %s must be positive, got %d", where, pos[i].k, pos[i].v);
    if (c->n_heads % c->n_kv_heads)
        return ct_fail(e, CT_ERR_CONFIG, "%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                       where, c->n_heads, c->n_kv_heads);
    /* widths the layers hold in an int (a projection's rows, the fused q|k|v and gate|up
     * rows): beyond INT_MAX they would wrap, so refuse them by the keys that multiply */
    long long qkv = ((long long)c->n_heads + 2LL * c->n_kv_heads) * c->head_dim;
    if ((long long)c->n_heads * c->head_dim > INT_MAX || qkv > INT_MAX)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: (num_attention_heads %d + 2 x num_key_value_heads %d) x head_dim %d = %lld is out of range "
                       "(at most %d)", where, c->n_heads, c->n_kv_heads, c->head_dim, qkv, INT_MAX);
    if (2LL * c->intermediate > INT_MAX)
        return ct_fail(e, CT_ERR_CONFIG, "%s: intermediate_size = %d is out of range (2 x intermediate_size must be "
                       "at most %d)", where, c->intermediate, INT_MAX);
    /* the parameter count is summed in size_t and allocated as 4 bytes each (more for
     * gradients and moments): sizes whose product nears 2^64 would wrap into a small
     * allocation, so refuse far below that (2^50 parameters is 4 PiB of fp32) */
    double H = c->hidden, I = c->intermediate, E = c->n_experts > 0 ? c->n_experts : 0;
    double Is = c->shared_intermediate > 0 ? c->shared_intermediate : 0; /* and its gate, H */
    double layer = H * (2.0 * qkv) + 3.0 * H * I + E * (3.0 * H * (c->moe_intermediate > 0 ? c->moe_intermediate : 0) + H);
    layer += 3.0 * H * Is + H;
    double total = 2.0 * (double)c->vocab_size * H + (double)c->n_layers * layer;
    if (total > LM_MAX_PARAMS) {
        char moe[128] = ""; /* the experts' and the shared expert's widths, which the sum counts too */
        if (E > 0)
            snprintf(moe, sizeof moe, ", num_experts %d x moe_intermediate_size %d", c->n_experts,
                     c->moe_intermediate);
        if (Is > 0)
            snprintf(moe + strlen(moe), sizeof moe - strlen(moe), ", shared_expert_intermediate_size %d",
                     c->shared_intermediate);
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: vocab_size %d, hidden_size %d, intermediate_size %d%s, num_hidden_layers %d and the "
                       "heads give about %.3g parameters, out of range (at most 2^50)",
                       where, c->vocab_size, c->hidden, c->intermediate, moe, c->n_layers, total);
    }
    if (c->head_dim % 2) return ct_fail(e, CT_ERR_CONFIG, "%s: head_dim must be even for RoPE, got %d", where, c->head_dim);
    if (c->head_dim > 2 * ROPE_MAX_HALF)
        return ct_fail(e, CT_ERR_CONFIG, "%s: head_dim = %d: at most %d is supported", where, c->head_dim,
                       2 * ROPE_MAX_HALF);
    if (!(c->rope_theta > 0)) return ct_fail(e, CT_ERR_CONFIG, "%s: rope_theta must be positive", where);
    if (!(c->rms_eps > 0)) return ct_fail(e, CT_ERR_CONFIG, "%s: rms_norm_eps must be positive", where);
    if (c->n_experts < 0) return ct_fail(e, CT_ERR_CONFIG, "%s: num_experts must be >= 0, got %d", where, c->n_experts);
    if (c->n_layers > LM_MAX_LAYERS)
        return ct_fail(e, CT_ERR_CONFIG, "%s: num_hidden_layers = %d: at most %d are supported", where, c->n_layers,
                       LM_MAX_LAYERS);
    if (c->q_scale_len < 0 || (c->q_scale_len > 0 && !isfinite(c->q_scale_beta)))
        return ct_fail(e, CT_ERR_CONFIG, "%s: q scale (llama_4_scaling_beta %g, original_max_position_embeddings %d) "
                       "invalid", where, c->q_scale_beta, c->q_scale_len);
    for (int l = 0; c->q_scale_len > 0 && l < c->n_layers; l++) /* q takes one scaled pair of tables */
        if (c->layer_nope[l] || c->qk_norm != LM_QK_NONE || lm_rope_local_differs(c))
            return ct_fail(e, CT_ERR_CONFIG, "%s: the q scale (llama_4_scaling_beta) is supported with RoPE on every "
                           "layer and no q/k norms only", where);
    /* a post-norm sparse layer (FlexOlmo) norms the branch before its add; sandwich norms are not built */
    if (c->n_experts > 0 && (c->norm_place == LM_NORM_SANDWICH || c->act != LM_ACT_SILU || c->mlp_bias))
        return ct_fail(e, CT_ERR_CONFIG, "%s: MoE layers are supported with pre-norms or post-norms (OLMo2's), "
                       "SiLU and no MLP bias only", where);
    if (c->n_experts > 0) {
        if (c->top_k < 1 || c->top_k > c->n_experts)
            return ct_fail(e, CT_ERR_CONFIG, "%s: num_experts_per_tok must be in [1, num_experts = %d], got %d", where,
                           c->n_experts, c->top_k);
        if (c->moe_intermediate <= 0)
            return ct_fail(e, CT_ERR_CONFIG, "%s: moe_intermediate_size must be positive, got %d", where,
                           c->moe_intermediate);
        if (c->decoder_sparse_step < 1)
            return ct_fail(e, CT_ERR_CONFIG, "%s: decoder_sparse_step must be >= 1, got %d", where,
                           c->decoder_sparse_step);
        if (!(c->router_aux_loss_coef >= 0))
            return ct_fail(e, CT_ERR_CONFIG, "%s: router_aux_loss_coef must be >= 0", where);
    }
    return 0;
}

/* The positions the model was trained for: max_position_embeddings, moved by a
 * RoPE scaling that stretches the positions as vLLM derives it (factor x
 * original_max_position_embeddings, x max_position_embeddings for linear);
 * dynamic NTK rescales by length, so it has none (0). generate refuses more,
 * train warns (cmd_generate.c, trainer.c). */
double lm_position_limit(const lm_config *c) {
    double limit = c->max_pos > 0 ? c->max_pos : 0;
    if (!c->has_rope || limit == 0) return limit;
    const rope_params *ps[2] = {&c->rope, &c->rope_local};
    for (int i = 0; i < 2; i++) {
        const rope_params *p = ps[i];
        if (p->type == ROPE_DYNAMIC && p->alpha == 0) return 0; /* HunYuan's alpha: a fixed base */
        if (p->type == ROPE_LINEAR || p->type == ROPE_YARN || p->type == ROPE_LLAMA3) {
            double ext = p->factor * (p->original_max_pos > 0 ? p->original_max_pos : c->max_pos);
            if (ext > limit) limit = ext;
        }
    }
    return limit;
}

int lm_config_from_flavor(lm_config *c, const char *flavor, ct_err *e) {
    for (size_t i = 0; i < sizeof flavors / sizeof flavors[0]; i++) {
        const flavor_row *f = &flavors[i];
        if (strcmp(f->name, flavor) != 0) continue;
        memset(c, 0, sizeof *c);
        c->vocab_size = f->V;
        c->hidden = f->H;
        c->intermediate = f->I;
        c->n_layers = f->L;
        c->n_heads = f->nH;
        c->n_kv_heads = f->nKV;
        c->head_dim = f->hd;
        c->tie_embeddings = f->tied;
        c->rope_theta = f->theta;
        c->rms_eps = 1e-6;
        c->max_pos = 40960;
        if (f->E) {
            c->n_experts = f->E;
            c->top_k = f->k;
            c->moe_intermediate = f->Im;
            c->norm_topk_prob = 1;
            c->decoder_sparse_step = 1;
            c->router_aux_loss_coef = 0.001;
        }
        snprintf(c->name, sizeof c->name, "%s", f->name);
        return 0;
    }
    char known[512] = "";
    for (size_t i = 0; i < sizeof flavors / sizeof flavors[0]; i++) {
        strcat(known, i ? ", " : "");
        strcat(known, flavors[i].name);
    }
    return ct_fail(e, CT_ERR_CONFIG, "model.flavor: unknown flavor \"%s\" for model.spec \"qwen3\" (known: %s)",
                   flavor, known);
}

/* v as Python's repr writes a float: 32.0, 1e+20 (for messages). */
typedef struct {
    char s[32];
} lm_float_str;
static lm_float_str lm_float_text(double v) {
    lm_float_str r;
    if (fabs(v) < 1e16) snprintf(r.s, sizeof r.s, "%.1f", v);
    else snprintf(r.s, sizeof r.s, "%g", v);
    return r;
}

/* IT as an int: 0, or -1 when it is not a number with an integer value, -2
 * for an integer written as a float (32.0: cJSON stores it as 32, json_parse's
 * mark tells them apart; transformers' config classes refuse a float where
 * they declare int, "expected int, got float"), -3 for one an int cannot hold
 * (the cast would be undefined). */
static int int_of(const cJSON *it, int *out) {
    if (!json_is_integer(it))
        return cJSON_IsNumber(it) && isfinite(it->valuedouble) && it->valuedouble == floor(it->valuedouble) ? -2
                                                                                                          : -1;
    if (!json_int_in(it, -2147483648.0, 2147483647.0)) return -3;
    *out = (int)it->valuedouble;
    return 0;
}

/* An integer field: required unless def_ok, then *out keeps its default. */
static int json_int(const cJSON *root, const char *key, int *out, int required, const char *path, ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) {
        if (required) return ct_fail(e, CT_ERR_CONFIG, "%s: missing required key \"%s\"", path, key);
        return 0;
    }
    switch (int_of(it, out)) {
    case -1: return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be an integer", path, key);
    case -2:
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be an integer, got %s", path, key,
                       lm_float_text(it->valuedouble).s);
    /* an integer the file states exactly but an int cannot hold: naming it a type error
     * would send the reader looking for quotes or a decimal point */
    case -3:
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" = %.0f is out of range [-2147483648, 2147483647]", path, key,
                       it->valuedouble);
    }
    return 0;
}

static int json_float(const cJSON *root, const char *key, double *out, const char *path, ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) return 0;
    if (!cJSON_IsNumber(it)) return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be a number", path, key);
    *out = it->valuedouble;
    return 0;
}

static int json_bool(const cJSON *root, const char *key, int *out, const char *path, ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) return 0;
    if (!cJSON_IsBool(it)) return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be true or false", path, key);
    *out = cJSON_IsTrue(it);
    return 0;
}

/* lm_family.olmoe: OLMoE's sparse block (every layer, experts intermediate_size wide) in
 * OlmoeConfig (pre-norms, clip_qkv, q_norm over hidden_size) or FlexOlmoConfig (OLMo2's
 * post-norms, q_norm over heads x head_dim, no clip_qkv key). */
enum { OLMOE_NONE, OLMOE_OLMOE, OLMOE_FLEX };

/* The qwen3_moe keys, with Qwen3MoeConfig's defaults (MixtralConfig's,
 * Qwen2MoeConfig's: qwen2_moe adds its shared expert's width). */
static int moe_config_from_json(lm_config *c, const cJSON *root, int mixtral, int shared, int olmoe,
                                const char *type, const char *path, ct_err *e) {
    int rc;
    c->n_experts = mixtral ? 8 : shared ? 60 : olmoe == OLMOE_FLEX ? 7 : olmoe ? 64 : 128; /* FlexOlmoConfig: 7, 5 */
    c->top_k = mixtral ? 2 : shared ? 4 : olmoe == OLMOE_FLEX ? 5 : 8;
    c->moe_intermediate = shared ? 1408 : 768;
    c->shared_intermediate = shared ? 5632 : 0;
    c->norm_topk_prob = 0;
    c->decoder_sparse_step = 1;
    c->output_router_logits = 0;
    c->router_aux_loss_coef = olmoe ? 0.01 : 0.001; /* OlmoeConfig's and FlexOlmoConfig's default */
    /* transformers writes num_local_experts (its attribute_map), Qwen's files num_experts;
     * GraniteMoeConfig has no num_experts (the key would be an unused attribute there) */
    const char *ek = cJSON_GetObjectItemCaseSensitive(root, "num_local_experts") || !strncmp(type, "granitemoe", 10)
                         ? "num_local_experts" : "num_experts";
    if ((rc = json_int(root, ek, &c->n_experts, 0, path, e)) ||
        (rc = json_int(root, "num_experts_per_tok", &c->top_k, 0, path, e)) ||
        (rc = json_int(root, "moe_intermediate_size", &c->moe_intermediate, 0, path, e)) ||
        (rc = json_bool(root, "norm_topk_prob", &c->norm_topk_prob, path, e)) ||
        (rc = json_int(root, "decoder_sparse_step", &c->decoder_sparse_step, 0, path, e)) ||
        (rc = json_bool(root, "output_router_logits", &c->output_router_logits, path, e)) ||
        (rc = json_float(root, "router_aux_loss_coef", &c->router_aux_loss_coef, path, e)) ||
        (shared && (rc = json_int(root, "shared_expert_intermediate_size", &c->shared_intermediate, 0, path, e))))
        return rc;
    if (c->n_experts < 1)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" = %d: a %s model needs at least one expert", path, ek,
                       c->n_experts, type);
    if (shared && c->shared_intermediate < 1)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"shared_expert_intermediate_size\" must be positive, got %d", path,
                       c->shared_intermediate);
    const cJSON *mo = cJSON_GetObjectItemCaseSensitive(root, "mlp_only_layers");
    if (mo && !cJSON_IsNull(mo)) {
        if (!cJSON_IsArray(mo))
            return ct_fail(e, CT_ERR_CONFIG, "%s: \"mlp_only_layers\" must be a list of layer indices", path);
        const cJSON *it;
        cJSON_ArrayForEach(it, mo) {
            int layer = 0, bad = int_of(it, &layer); /* as json_int: transformers refuses [0.0] */
            if (bad == -1) return ct_fail(e, CT_ERR_CONFIG, "%s: \"mlp_only_layers\" must hold integers", path);
            if (bad == -2)
                return ct_fail(e, CT_ERR_CONFIG, "%s: \"mlp_only_layers\" must hold integers, got %s", path,
                               lm_float_text(it->valuedouble).s);
            if (bad == -3)
                return ct_fail(e, CT_ERR_CONFIG,
                               "%s: \"mlp_only_layers\" holds %.0f, out of range [-2147483648, 2147483647]", path,
                               it->valuedouble);
            if (c->n_mlp_only == LM_MAX_MLP_ONLY)
                return ct_fail(e, CT_ERR_CONFIG, "%s: \"mlp_only_layers\" has more than %d entries", path,
                               LM_MAX_MLP_ONLY);
            c->mlp_only_layers[c->n_mlp_only++] = layer;
        }
    }
    return 0;
}

/* Ernie4_5_MoeConfig's keys and defaults (64 experts, 6 per token, 1536 wide, 2 shared
 * experts, sparse layers 1 .. L-1 at interval 1, moe_norm_min 1e-12, aux coef 0.001).
 * Ernie4_5_MoeTopKRouter always renormalises the top k by max(sum, moe_norm_min). The
 * sparse-layer rule (l + 1) % interval == 0 and start <= l <= end is held as
 * decoder_sparse_step = interval and the layers outside [start, end] as mlp_only_layers. */
static int ernie_moe_from_json(lm_config *c, const cJSON *root, const char *path, ct_err *e) {
    int rc, n_shared = 2, start = 1, end = -1, interval = 1;
    double norm_min = 1e-12;
    c->n_experts = 64, c->top_k = 6, c->moe_intermediate = 1536;
    if ((rc = json_int(root, "moe_intermediate_size", &c->moe_intermediate, 0, path, e))) return rc;
    /* output_router_logits and router_aux_loss_coef (default 0.001): moe_config_from_json read them */
    c->norm_topk_prob = 1, c->n_mlp_only = 0;
    if ((rc = json_int(root, "num_experts", &c->n_experts, 0, path, e)) || /* attribute_map's aliases */
        (rc = json_int(root, "num_experts_per_tok", &c->top_k, 0, path, e)) ||
        (rc = json_int(root, "moe_num_experts", &c->n_experts, 0, path, e)) ||
        (rc = json_int(root, "moe_k", &c->top_k, 0, path, e)) ||
        (rc = json_int(root, "moe_num_shared_experts", &n_shared, 0, path, e)) ||
        (rc = json_int(root, "moe_layer_start_index", &start, 0, path, e)) ||
        (rc = json_int(root, "moe_layer_end_index", &end, 0, path, e)) ||
        (rc = json_int(root, "moe_layer_interval", &interval, 0, path, e)) ||
        (rc = json_float(root, "moe_norm_min", &norm_min, path, e)))
        return rc;
    if (c->moe_intermediate < 1)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"moe_intermediate_size\" must be positive, got %d", path,
                       c->moe_intermediate);
    if (c->n_experts < 1 || c->top_k < 1 || c->top_k > c->n_experts)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"moe_k\" = %d with \"moe_num_experts\" = %d: need 1 <= moe_k <= "
                       "moe_num_experts", path, c->top_k, c->n_experts);
    if (n_shared < 0 || (long long)n_shared * c->moe_intermediate > INT_MAX)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"moe_num_shared_experts\" = %d is out of range", path, n_shared);
    if (interval < 1)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"moe_layer_interval\" must be >= 1, got %d", path, interval);
    /* torch.clamp(sum, min=moe_norm_min): a negative or NaN floor is no floor transformers means */
    if (!(norm_min >= 0) || norm_min > FLT_MAX)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"moe_norm_min\" = %g is not supported (need a finite floor >= 0)",
                       path, norm_min);
    c->moe_norm_min = norm_min;
    c->shared_intermediate = n_shared * c->moe_intermediate;
    c->decoder_sparse_step = interval;
    c->moe_layer_start = start;
    c->moe_layer_end = end == -1 ? c->n_layers - 1 : end; /* Ernie4_5_MoeConfig.__post_init__ */
    for (int l = 0; l < c->n_layers; l++)
        if (l < start || l > c->moe_layer_end) {
            if (c->n_mlp_only == LM_MAX_MLP_ONLY)
                return ct_fail(e, CT_ERR_CONFIG, "%s: more than %d dense layers outside moe_layer_start_index .. "
                               "moe_layer_end_index", path, LM_MAX_MLP_ONLY);
            c->mlp_only_layers[c->n_mlp_only++] = l;
        }
    return 0;
}

/* Glm4MoeConfig's MoE keys and defaults (128 routed experts, 8 per token, 1408 wide, 1
 * shared expert, n_group = topk_group = 1, routed_scaling_factor 1, norm_topk_prob true,
 * first_k_dense_replace 1). Glm4MoeDecoderLayer is sparse from layer first_k_dense_replace
 * on: the layers before it are held as mlp_only_layers. Glm4MoeForCausalLM adds no
 * load-balancing loss whatever output_router_logits says (its forward returns the CE
 * alone), so ctitan adds none either: the key is taken and left off. */
static int glm4_moe_from_json(lm_config *c, const cJSON *root, int dots, const char *path, ct_err *e) {
    /* dots1 (Dots1Config): n_routed_experts, num_experts_per_tok and n_shared_experts default
     * to None (Dots1TopkRouter / Dots1MoE fail on it), so they are required; first_k_dense_replace
     * 0, norm_topk_prob false; no MTP layers and no use_qk_norm key (its q/k norms are always on) */
    int rc, n_shared = 1, first = dots ? 0 : 1, norm = !dots, qk = 0, mtp = dots ? 0 : 1, orl = 0;
    double scale = 1.0;
    c->n_experts = 128, c->top_k = 8, c->moe_intermediate = 1408, c->n_group = 1, c->topk_group = 1;
    c->n_mlp_only = 0, c->decoder_sparse_step = 1;
    const cJSON *alias = cJSON_GetObjectItemCaseSensitive(root, "num_local_experts");
    int need_e = dots && (!alias || cJSON_IsNull(alias)); /* either key gives dots1's expert count */
    if ((rc = json_int(root, "n_routed_experts", &c->n_experts, need_e, path, e)) ||
        (rc = json_int(root, "num_local_experts", &c->n_experts, 0, path, e)) || /* attribute_map's alias */
        (rc = json_int(root, "num_experts_per_tok", &c->top_k, dots, path, e)) ||
        (rc = json_int(root, "moe_intermediate_size", &c->moe_intermediate, 0, path, e)) ||
        (rc = json_int(root, "n_shared_experts", &n_shared, dots, path, e)) ||
        (rc = json_int(root, "n_group", &c->n_group, 0, path, e)) ||
        (rc = json_int(root, "topk_group", &c->topk_group, 0, path, e)) ||
        (rc = json_int(root, "first_k_dense_replace", &first, 0, path, e)) ||
        (!dots && (rc = json_int(root, "num_nextn_predict_layers", &mtp, 0, path, e))) ||
        (rc = json_float(root, "routed_scaling_factor", &scale, path, e)) ||
        (rc = json_bool(root, "norm_topk_prob", &norm, path, e)) ||
        (rc = json_bool(root, "output_router_logits", &orl, path, e)) ||
        (!dots && (rc = json_bool(root, "use_qk_norm", &qk, path, e))))
        return rc;
    (void)orl;
    if (mtp < 0 || mtp > LM_MAX_LAYERS)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"num_nextn_predict_layers\" = %d is out of range", path, mtp);
    c->mtp_layers = mtp;
    c->output_router_logits = 0, c->router_aux_loss_coef = 0;
    if (c->moe_intermediate < 1 || c->n_experts < 1 || c->top_k < 1 || c->top_k > c->n_experts)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"num_experts_per_tok\" = %d, \"n_routed_experts\" = %d, "
                       "\"moe_intermediate_size\" = %d: need 1 <= num_experts_per_tok <= n_routed_experts and a "
                       "positive width", path, c->top_k, c->n_experts, c->moe_intermediate);
    if (n_shared < 0 || (long long)n_shared * c->moe_intermediate > INT_MAX)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"n_shared_experts\" = %d is out of range", path, n_shared);
    /* the router views the scores as [N, n_group, E / n_group] and sums each group's top 2 */
    if (c->n_group < 1 || c->n_group > MOE_MAX_GROUPS || c->n_experts % c->n_group ||
        c->n_experts / c->n_group < 2)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"n_group\" = %d with n_routed_experts %d is not supported (it must "
                       "divide the experts into groups of 2 or more, at most %d groups)", path, c->n_group,
                       c->n_experts, MOE_MAX_GROUPS);
    if (c->topk_group < 1 || c->topk_group > c->n_group ||
        (long long)c->topk_group * (c->n_experts / c->n_group) < c->top_k)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"topk_group\" = %d is not supported with n_group %d, "
                       "num_experts_per_tok %d (the kept groups must hold num_experts_per_tok experts)", path,
                       c->topk_group, c->n_group, c->top_k);
    if (!(isfinite(scale) && scale > 0))
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"routed_scaling_factor\" must be positive, got %g", path, scale);
    if (first < 0 || first > LM_MAX_MLP_ONLY)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"first_k_dense_replace\" = %d is out of range [0, %d]", path, first,
                       LM_MAX_MLP_ONLY);
    c->router_sigmoid = 1, c->routed_scaling = scale, c->norm_topk_prob = norm, c->first_k_dense = first;
    c->shared_intermediate = n_shared * c->moe_intermediate;
    c->qk_norm = qk || dots ? LM_QK_HEAD : LM_QK_NONE;
    for (int l = 0; l < first && l < c->n_layers; l++) c->mlp_only_layers[c->n_mlp_only++] = l;
    return 0;
}

/* ------------------------------------------------------------ families
 *
 * One row per HF model_type: what its decoder layer computes and the
 * defaults of its transformers config class (5.x) for keys a config.json may
 * leave out. Adding a family is a row here plus whatever new op it needs in
 * model/lm.c; nothing outside the model folder names a family. */
enum { WIN_NONE, WIN_ALL, WIN_TYPES, WIN_GEMMA, WIN_GEMMA2, WIN_QWEN2_MOE,
       WIN_SMOLLM3, /* layer_types, else the NoPE layers slide when use_sliding_window and sliding_window */
       WIN_OLMO3, /* layer_types, else every 4th layer full, the others sliding */
       WIN_MINISTRAL, /* layer_types, else every layer slides when a window exists */
       WIN_EXAONE4 /* layer_types, else sliding_window_pattern; with a window the full layers are NoPE */ };
/* What a family does with Gemma's soft-caps (final_logit_softcapping,
 * attn_logit_softcapping) and query_pre_attn_scalar. */
enum { CAPS_NONE,   /* the caps are not part of the family: refused unless absent, null or 0 */
       CAPS_GEMMA3, /* final cap applied; the attention cap carried to the export, applied nowhere */
       CAPS_GEMMA2  /* both applied (Gemma2's eager attention caps the scores) */ };

/* Shapes a family's transformers classes fail on (the config is refused, naming them). */
enum { HEADS_ANY,
       HEADS_O_HIDDEN, /* Helium: o_proj is Linear(hidden_size, hidden_size), so heads x head_dim = hidden_size */
       HEADS_DIVIDE    /* VaultGemmaConfig.validate_architecture: num_attention_heads divides hidden_size */ };

/* The projections a family's files fuse: Phi3's qkv_proj and gate_up_proj, GLM's gate_up_proj only. */
enum { FUSED_NONE, FUSED_QKV_GATE_UP, FUSED_GATE_UP };

/* The families with DeepSeek-V3's sigmoid, group-limited router: Glm4MoeConfig's keys and
 * defaults (use_qk_norm, num_nextn_predict_layers), Dots1Config's (q/k norms always, no MTP). */
enum { GLM_MOE_NONE, GLM_MOE_GLM4, GLM_MOE_DOTS1 };

typedef struct {
    const char *type, *arch;
    int moe;            /* 0 dense; 1 + LM_MOE_KEYS_* */
    int norm_place, norm_plus_one, qk_norm, fused, embed_scaled; /* fused: FUSED_* */
    int qkv_bias;       /* 1: always (Qwen2); 0: the attention_bias key (q, k, v and o) when has_attn_bias */
    int attn_bias_qkv;  /* attention_bias gives q, k and v biases, o_proj has none: 1 GLM (default true),
                           2 Helium (default false) */
    int interleaved;    /* GLM: RoPE on the pairs (2i, 2i+1) of the rotary part (lm_config.rope_interleaved) */
    int use_bias;       /* Ernie 4.5: one use_bias key (default false) for q/k/v/o and the MLP's three */
    int out_bias;       /* Seed-OSS: attention_out_bias (default false) for o_proj beside attention_bias's q/k/v */
    int dropout_default; /* Seed-OSS: attention_dropout and residual_dropout default to 0.1 when absent */
    int has_attn_bias, has_mlp_bias;
    int kv_default;     /* num_key_value_heads when absent; 0: num_attention_heads */
    int hd_default;     /* head_dim when absent; 0: hidden_size / num_attention_heads */
    int hd_required;    /* Ministral: an absent or null head_dim fails in transformers (the config keeps None) */
    double eps;
    int tied;
    int max_pos;
    int pad;            /* pad_token_id when absent (-1: None) */
    int win;            /* WIN_*: how layers get the sliding window */
    int win_default;    /* sliding_window when absent (0: None) */
    const char *win_gate; /* a bool key that must be true for the window to exist (use_sliding_window) */
    const char *act_key;
    int act_gelu_is_tanh; /* GemmaConfig: hidden_act "gelu" means the tanh approximation */
    int caps;           /* CAPS_* (query_pre_attn_scalar is read where the caps are) */
    double final_cap_default, attn_cap_default; /* absent keys; 0: None */
    double theta, theta_local; /* RoPE (model/rope.h): default_theta; Gemma3's sliding layers' */
    int rope_style, rope_head_dim_none;
    int granite;        /* the four Granite scalars (embedding_multiplier ...) are read */
    int shared_expert;  /* qwen2_moe: a gated shared expert in every sparse layer, q/k/v biases by "qkv_bias" */
    int nope;           /* SmolLM3: no_rope_layers / no_rope_layer_interval pick layers without RoPE */
    int granite_shared; /* GraniteMoeShared: an ungated shared MLP of shared_intermediate_size (0: none) */
    int q_scale;        /* Ministral 3: q times Llama 4's position scale, its keys in rope_parameters */
    int olmoe;          /* OLMOE_*: every layer sparse, experts intermediate_size wide; OLMoE's clip_qkv and
                           q/k norms over hidden_size (head_dim must be hidden_size / num_attention_heads) */
    int heads_check;    /* HEADS_*: a shape rule of the family's transformers classes */
    int qk_after_rope;  /* HunYuan: the per-head q/k norms (query_layernorm, key_layernorm) after RoPE */
    int ernie_moe;      /* ERNIE 4.5 MoE: moe_* keys, sparse layers from moe_layer_{start,end}_index and
                           moe_layer_interval, ungated shared experts (moe_num_shared_experts) */
    int glm4_moe;       /* DeepSeek-V3's router (glm4_moe_from_json): GLM_MOE_* */
    int mw_default;     /* max_window_layers when absent (WIN_TYPES); 0: 28 (Qwen2Config, Qwen3Config) */
} lm_family;

static const lm_family families[] = {
    {.type = "qwen3", .arch = "Qwen3ForCausalLM", .has_attn_bias = 1, .hd_default = 128, .eps = 1e-6,
     .max_pos = 32768, .pad = -1, .win = WIN_TYPES, .win_default = 4096, .win_gate = "use_sliding_window",
     .act_key = "hidden_act", .theta = 1e4},
    {.type = "qwen3_moe", .arch = "Qwen3MoeForCausalLM", .moe = 1 + LM_MOE_KEYS_QWEN, .has_attn_bias = 1,
     .kv_default = 4, .eps = 1e-6, .max_pos = 32768, .pad = -1, .win = WIN_ALL, .win_default = 4096,
     .win_gate = "use_sliding_window", .act_key = "hidden_act", .theta = 1e4},
    {.type = "llama", .arch = "LlamaForCausalLM", .qk_norm = LM_QK_NONE, .has_attn_bias = 1, .has_mlp_bias = 1,
     .eps = 1e-6, .max_pos = 2048, .pad = -1, .act_key = "hidden_act", .theta = 1e4},
    {.type = "mistral", .arch = "MistralForCausalLM", .qk_norm = LM_QK_NONE, .kv_default = 8, .eps = 1e-6,
     .max_pos = 131072, .pad = -1, .win = WIN_ALL, .win_default = 4096, .act_key = "hidden_act", .theta = 1e4},
    /* Ministral (Ministral-8B-Instruct-2410): Mistral's layer with sliding and full layers
     * from layer_types; MinistralConfig derives no head_dim */
    {.type = "ministral", .arch = "MinistralForCausalLM", .qk_norm = LM_QK_NONE, .kv_default = 8,
     .hd_required = 1, .eps = 1e-6, .max_pos = 131072, .pad = -1, .win = WIN_MINISTRAL, .win_default = 4096,
     .act_key = "hidden_act", .theta = 1e4},
    /* Ministral 3 (Ministral-3-3B/8B/14B): Mistral's layer (one sliding_window for all, None
     * by default) with q scaled by position after RoPE (llama_4_scaling_beta and
     * original_max_position_embeddings in rope_parameters) */
    {.type = "ministral3", .arch = "Ministral3ForCausalLM", .qk_norm = LM_QK_NONE, .kv_default = 8,
     .hd_default = 128, .eps = 1e-5, .max_pos = 262144, .pad = 11, .win = WIN_ALL, .win_default = 0,
     .act_key = "hidden_act", .theta = 1e4, .q_scale = 1},
    /* EXAONE 4.0: OLMo2's post-norm layer with Qwen3's per-head q/k norms, sliding layers
     * from layer_types or sliding_window_pattern, and no RoPE on the full layers while a
     * window exists */
    {.type = "exaone4", .arch = "Exaone4ForCausalLM", .norm_place = LM_NORM_POST, .qk_norm = LM_QK_HEAD,
     .kv_default = 32, .eps = 1e-5, .max_pos = 2048, .pad = -1, .win = WIN_EXAONE4, .win_default = 4096,
     .act_key = "hidden_act", .theta = 1e4},
    {.type = "qwen2", .arch = "Qwen2ForCausalLM", .qk_norm = LM_QK_NONE, .qkv_bias = 1, .kv_default = 32,
     .eps = 1e-6, .max_pos = 32768, .pad = -1, .win = WIN_TYPES, .win_default = 4096,
     .win_gate = "use_sliding_window", .act_key = "hidden_act", .theta = 1e4},
    {.type = "mixtral", .arch = "MixtralForCausalLM", .moe = 1 + LM_MOE_KEYS_MIXTRAL, .qk_norm = LM_QK_NONE,
     .kv_default = 8, .eps = 1e-5, .max_pos = 131072, .pad = -1, .win = WIN_ALL, .act_key = "hidden_act",
     .theta = 1e6, .rope_head_dim_none = 1},
    {.type = "olmo2", .arch = "Olmo2ForCausalLM", .norm_place = LM_NORM_POST, .qk_norm = LM_QK_PROJ,
     .has_attn_bias = 1, .eps = 1e-5, .max_pos = 2048, .pad = 1, .act_key = "hidden_act", .theta = 1e4},
    {.type = "phi3", .arch = "Phi3ForCausalLM", .qk_norm = LM_QK_NONE, .fused = FUSED_QKV_GATE_UP, .eps = 1e-5, .max_pos = 4096,
     .pad = 32000, .win = WIN_ALL, .act_key = "hidden_act", .theta = 1e4, .rope_style = ROPE_STYLE_PHI3},
    {.type = "gemma3_text", .arch = "Gemma3ForCausalLM", .norm_place = LM_NORM_SANDWICH, .norm_plus_one = 1,
     .embed_scaled = 1, .has_attn_bias = 1, .kv_default = 4, .hd_default = 256, .eps = 1e-6, .tied = 1,
     .max_pos = 131072, .pad = 0, .win = WIN_GEMMA, .win_default = 4096, .act_key = "hidden_activation",
     .caps = CAPS_GEMMA3, .theta = 1e6, .theta_local = 1e4, .rope_style = ROPE_STYLE_GEMMA3},
    /* Gemma2: Gemma3's layer without q/k norms, one RoPE for every layer, sliding and full
     * layers alternating unless layer_types says otherwise, both soft-caps applied */
    {.type = "gemma2", .arch = "Gemma2ForCausalLM", .norm_place = LM_NORM_SANDWICH, .norm_plus_one = 1,
     .qk_norm = LM_QK_NONE, .embed_scaled = 1, .has_attn_bias = 1, .kv_default = 4, .hd_default = 256, .eps = 1e-6,
     .tied = 1, .max_pos = 8192, .pad = 0, .win = WIN_GEMMA2, .win_default = 4096, .act_key = "hidden_activation",
     .caps = CAPS_GEMMA2, .final_cap_default = 30.0, .attn_cap_default = 50.0, .theta = 1e4},
    /* Granite 3.x: Llama's layer with its embeddings, branches, attention scores and
     * logits scaled by four config scalars */
    {.type = "granite", .arch = "GraniteForCausalLM", .qk_norm = LM_QK_NONE, .has_attn_bias = 1, .has_mlp_bias = 1,
     .eps = 1e-6, .max_pos = 2048, .pad = -1, .act_key = "hidden_act", .theta = 1e4, .granite = 1},
    /* Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v biases as "qkv_bias" says, default on)
     * with Qwen3-MoE's sparse layers plus a gated shared expert in each */
    {.type = "qwen2_moe", .arch = "Qwen2MoeForCausalLM", .moe = 1 + LM_MOE_KEYS_QWEN, .qk_norm = LM_QK_NONE,
     .qkv_bias = 1, .kv_default = 16, .eps = 1e-6, .max_pos = 32768, .pad = -1, .win = WIN_QWEN2_MOE,
     .win_default = 4096, .win_gate = "use_sliding_window", .act_key = "hidden_act", .theta = 1e4,
     .shared_expert = 1},
    /* Gemma: Llama's pre-norms with Gemma's (1 + w) RMSNorm, scaled embeddings and GELU-tanh */
    {.type = "gemma", .arch = "GemmaForCausalLM", .norm_plus_one = 1, .qk_norm = LM_QK_NONE, .embed_scaled = 1,
     .has_attn_bias = 1, .kv_default = 16, .hd_default = 256, .eps = 1e-6, .tied = 1, .max_pos = 8192, .pad = 0,
     .act_key = "hidden_act", .act_gelu_is_tanh = 1, .theta = 1e4},
    /* SmolLM3: Llama's layer, some layers without RoPE (NoPE), tied embeddings */
    {.type = "smollm3", .arch = "SmolLM3ForCausalLM", .qk_norm = LM_QK_NONE, .has_attn_bias = 1, .has_mlp_bias = 1,
     .kv_default = 4, .eps = 1e-6, .tied = 1, .max_pos = 32768, .pad = 128004, .win = WIN_SMOLLM3,
     .win_gate = "use_sliding_window", .act_key = "hidden_act", .theta = 2e6, .nope = 1},
    /* Olmo3: OLMo2's post-norm layer and whole-projection q/k norms, sliding layers with
     * their own RoPE (rope_scaling applies to the full layers only) */
    {.type = "olmo3", .arch = "Olmo3ForCausalLM", .norm_place = LM_NORM_POST, .qk_norm = LM_QK_PROJ,
     .has_attn_bias = 1, .eps = 1e-5, .max_pos = 2048, .pad = 1, .win = WIN_OLMO3, .win_default = 4096,
     .act_key = "hidden_act", .theta = 5e5, .rope_style = ROPE_STYLE_OLMO3},
    /* OLMoE: Llama's pre-norm layer with OLMo2's whole-projection q/k norms, and Qwen3-MoE's
     * router and experts (softmax top-k, renormalised as norm_topk_prob says) in every layer */
    {.type = "olmoe", .arch = "OlmoeForCausalLM", .moe = 1 + LM_MOE_KEYS_QWEN, .qk_norm = LM_QK_PROJ,
     .has_attn_bias = 1, .eps = 1e-5, .max_pos = 4096, .pad = 1, .act_key = "hidden_act", .theta = 1e4,
     .olmoe = OLMOE_OLMOE},
    /* FlexOlmo (FlexOlmo-7x7B-1T): OLMo2's post-norm layer (norms on the attention's and the
     * sparse block's outputs before each residual add, q/k norms over the whole projections)
     * around OLMoE's sparse block; 7 experts, 5 per token by default */
    {.type = "flex_olmo", .arch = "FlexOlmoForCausalLM", .moe = 1 + LM_MOE_KEYS_QWEN, .norm_place = LM_NORM_POST,
     .qk_norm = LM_QK_PROJ, .has_attn_bias = 1, .eps = 1e-6, .max_pos = 4096, .pad = 100277,
     .act_key = "hidden_act", .theta = 5e5, .olmoe = OLMOE_FLEX},
    /* GraniteMoE (granite-3.0-1b-a400m, 3b-a800m): Granite's four scalars around Mixtral's
     * layer: every layer sparse, experts intermediate_size wide, softmax over the top-k
     * logits (the renormalised top-k softmax), the files fusing each layer's experts */
    {.type = "granitemoe", .arch = "GraniteMoeForCausalLM", .moe = 1 + LM_MOE_KEYS_GRANITE, .qk_norm = LM_QK_NONE,
     .has_attn_bias = 1, .eps = 1e-6, .max_pos = 2048, .pad = -1, .act_key = "hidden_act", .theta = 1e4,
     .granite = 1},
    /* GraniteMoeShared: GraniteMoE plus an ungated shared MLP (shared_intermediate_size; 0,
     * the default: none) added to the experts' output in every layer */
    {.type = "granitemoeshared", .arch = "GraniteMoeSharedForCausalLM", .moe = 1 + LM_MOE_KEYS_GRANITE,
     .qk_norm = LM_QK_NONE, .has_attn_bias = 1, .eps = 1e-6, .max_pos = 2048, .pad = -1, .act_key = "hidden_act",
     .theta = 1e4, .granite = 1, .granite_shared = 1},
    /* GLM-4 (glm-4-9b-chat-hf): Llama's pre-norm layer with q/k/v biases, the files' fused
     * gate_up_proj, and RoPE on the interleaved pairs of the first half of each head */
    {.type = "glm", .arch = "GlmForCausalLM", .qk_norm = LM_QK_NONE, .fused = FUSED_GATE_UP, .has_attn_bias = 1,
     .attn_bias_qkv = 1, .interleaved = 1, .kv_default = 2, .hd_default = 128, .eps = 0.00000015625,
     .max_pos = 131072, .pad = 151329, .act_key = "hidden_act", .theta = 1e4, .rope_style = ROPE_STYLE_GLM},
    /* GLM-4-0414 (GLM-4-9B-0414, GLM-Z1): GLM's layer with a norm on each branch's output
     * before its residual add (Gemma3's sandwich under other names, model/lm.c norm_names) */
    {.type = "glm4", .arch = "Glm4ForCausalLM", .norm_place = LM_NORM_SANDWICH, .qk_norm = LM_QK_NONE,
     .fused = FUSED_GATE_UP, .has_attn_bias = 1, .attn_bias_qkv = 1, .interleaved = 1, .kv_default = 2,
     .hd_default = 128, .eps = 0.00000015625, .max_pos = 131072, .pad = 151329, .act_key = "hidden_act",
     .theta = 1e4, .rope_style = ROPE_STYLE_GLM},
    /* ERNIE 4.5 (ERNIE-4.5-0.3B): Llama's layer with GLM's interleaved RoPE over the whole
     * head (its default RoPE ignores partial_rotary_factor) and one use_bias switch */
    {.type = "ernie4_5", .arch = "Ernie4_5ForCausalLM", .qk_norm = LM_QK_NONE, .interleaved = 1, .use_bias = 1,
     .kv_default = 2, .hd_default = 128, .eps = 1e-5, .tied = 1, .max_pos = 131072, .pad = 0,
     .act_key = "hidden_act", .theta = 5e5},
    /* Seed-OSS (Seed-OSS-36B): Llama's layer with q/k/v biases (attention_bias, default true),
     * o_proj's by attention_out_bias, and dropouts that default to 0.1 */
    {.type = "seed_oss", .arch = "SeedOssForCausalLM", .qk_norm = LM_QK_NONE, .has_attn_bias = 1,
     .attn_bias_qkv = 1, .out_bias = 1, .has_mlp_bias = 1, .dropout_default = 1, .kv_default = 8,
     .hd_default = 128, .eps = 1e-6, .max_pos = 524288, .pad = 1, .act_key = "hidden_act", .theta = 1e4},
    /* Helium (kyutai/helium-1-preview-2b, helium-1-2b): Llama's layer with GLM's interleaved
     * RoPE over the whole head, q/k/v biases by attention_bias (o_proj never has one) */
    {.type = "helium", .arch = "HeliumForCausalLM", .qk_norm = LM_QK_NONE, .has_attn_bias = 1, .attn_bias_qkv = 2,
     .has_mlp_bias = 1, .interleaved = 1, .kv_default = 20, .hd_default = 128, .eps = 1e-8, .max_pos = 4096,
     .pad = 3, .act_key = "hidden_act", .theta = 1e5, .heads_check = HEADS_O_HIDDEN},
    /* VaultGemma (google/vaultgemma-1b): Gemma2's pre-norm layer without its post-norms
     * (input_layernorm, pre_feedforward_layernorm: model/lm.c norm_names), both soft-caps,
     * query_pre_attn_scalar, alternating sliding layers, attention biases on q, k, v and o */
    {.type = "vaultgemma", .arch = "VaultGemmaForCausalLM", .norm_plus_one = 1, .qk_norm = LM_QK_NONE,
     .embed_scaled = 1, .has_attn_bias = 1, .kv_default = 4, .hd_default = 256, .eps = 1e-6, .tied = 1,
     .max_pos = 8192, .pad = 0, .win = WIN_GEMMA2, .win_default = 4096, .act_key = "hidden_activation",
     .caps = CAPS_GEMMA2, .final_cap_default = 30.0, .attn_cap_default = 50.0, .theta = 1e4,
     .heads_check = HEADS_DIVIDE},
    /* HunYuan dense (tencent/Hunyuan-0.5B/1.8B/4B/7B-Instruct): Llama's layer with per-head
     * q/k RMSNorms applied to the rotated q and k (query_layernorm, key_layernorm), attention
     * biases on q, k, v and o; num_key_value_heads num_attention_heads when absent; head_dim
     * required (the config keeps None and HunYuanDenseV1Attention fails on it) */
    {.type = "hunyuan_v1_dense", .arch = "HunYuanDenseV1ForCausalLM", .qk_norm = LM_QK_HEAD, .qk_after_rope = 1,
     .has_attn_bias = 1, .hd_required = 1, .eps = 1e-5, .max_pos = 2048, .pad = 0, .act_key = "hidden_act",
     .theta = 1e4},
    /* ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B): ERNIE 4.5's layer (interleaved RoPE over the whole
     * head) with a softmax top-k router always renormalised, ungated shared experts and
     * dense layers outside moe_layer_{start,end}_index / off moe_layer_interval */
    {.type = "ernie4_5_moe", .arch = "Ernie4_5_MoeForCausalLM", .moe = 1 + LM_MOE_KEYS_QWEN, .qk_norm = LM_QK_NONE,
     .interleaved = 1, .use_bias = 1, .kv_default = 4, .eps = 1e-5, .tied = 1, .max_pos = 131072, .pad = 0,
     .act_key = "hidden_act", .theta = 5e5, .ernie_moe = 1},
    /* GLM-4.5 / GLM-4.5-Air (glm4_moe): Llama's layer with q/k/v biases (attention_bias), optional
     * per-head q/k norms (use_qk_norm) and Phi3's partial RoPE (rotate-half of the first
     * partial_rotary_factor of each head, 0.5 by default), dense layers before
     * first_k_dense_replace, then a sigmoid group-limited router with a selection bias
     * (e_score_correction_bias) and ungated shared experts */
    {.type = "glm4_moe", .arch = "Glm4MoeForCausalLM", .moe = 1 + LM_MOE_KEYS_QWEN, .qk_norm = LM_QK_NONE,
     .has_attn_bias = 1, .attn_bias_qkv = 2, .kv_default = 8, .eps = 1e-5, .max_pos = 131072, .pad = -1,
     .act_key = "hidden_act", .theta = 1e4, .rope_style = ROPE_STYLE_GLM, .glm4_moe = GLM_MOE_GLM4},
    /* rednote's dots.llm1 (dots1): Qwen3's attention (per-head q/k norms always, whole-head RoPE)
     * with q/k/v/o biases by attention_bias, Qwen2's sliding layers (from max_window_layers, 62 by
     * default, with no use_sliding_window gate), and GLM-4.5's router, ungated shared experts and
     * first_k_dense_replace (default 0); no MTP layers */
    {.type = "dots1", .arch = "Dots1ForCausalLM", .moe = 1 + LM_MOE_KEYS_QWEN, .has_attn_bias = 1, .kv_default = 32,
     .eps = 1e-6, .max_pos = 2048, .pad = -1, .win = WIN_TYPES, .win_default = 4096, .mw_default = 62,
     .act_key = "hidden_act", .theta = 1e4, .glm4_moe = GLM_MOE_DOTS1},
};
#define N_FAMILIES (sizeof families / sizeof families[0])

static const lm_family *family_of(const char *type) {
    for (size_t i = 0; i < N_FAMILIES; i++)
        if (strcmp(families[i].type, type) == 0) return &families[i];
    return NULL;
}

int lm_family_rope(const char *model_type, rope_family *out) {
    const lm_family *f = family_of(model_type);
    if (!f) return -1;
    *out = (rope_family){f->type, f->max_pos, f->theta, f->theta_local, f->rope_style, f->rope_head_dim_none};
    return 0;
}

static const lm_family *family_of_config(const lm_config *c) {
    const lm_family *f = c->model_type[0] ? family_of(c->model_type) : NULL;
    return f ? f : &families[c->n_experts > 0 ? 1 : 0];
}

static void family_list(char *out, size_t n) {
    out[0] = 0;
    for (size_t i = 0; i < N_FAMILIES; i++) {
        size_t k = strlen(out);
        snprintf(out + k, n - k, "%s%s", i ? ", " : "", families[i].type);
    }
}

/* A key that must be absent, null, false or 0 (training would differ). */
static int refuse_nonzero(const cJSON *root, const char *key, const char *why, const char *path, ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it) || cJSON_IsFalse(it) || (cJSON_IsNumber(it) && it->valuedouble == 0)) return 0;
    char *v = cJSON_PrintUnformatted(it);
    int rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" = %s is not supported (%s)", path, key, v ? v : "?", why);
    free(v);
    return rc;
}

/* SmolLM3's NoPE layers: no_rope_layers (1: the layer uses RoPE; at least
 * num_hidden_layers entries, as SmolLM3Attention indexes it), else every
 * no_rope_layer_interval-th layer has none (SmolLM3Config.__post_init__). */
static int read_nope(lm_config *c, const cJSON *root, const char *path, ct_err *e) {
    memset(c->layer_nope, 0, sizeof c->layer_nope);
    const cJSON *nl = cJSON_GetObjectItemCaseSensitive(root, "no_rope_layers");
    if (!nl || cJSON_IsNull(nl)) {
        int iv = 4, rc;
        if ((rc = json_int(root, "no_rope_layer_interval", &iv, 0, path, e))) return rc;
        if (iv < 1)
            return ct_fail(e, CT_ERR_CONFIG, "%s: \"no_rope_layer_interval\" must be >= 1, got %d", path, iv);
        for (int l = 0; l < c->n_layers; l++) c->layer_nope[l] = (l + 1) % iv == 0;
        return 0;
    }
    if (!cJSON_IsArray(nl) || cJSON_GetArraySize(nl) < c->n_layers)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: \"no_rope_layers\" must be a list of at least num_hidden_layers = %d entries (1: RoPE, "
                       "0: none)", path, c->n_layers);
    int l = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, nl) {
        int v = -1;
        if (int_of(it, &v) || (v != 0 && v != 1))
            return ct_fail(e, CT_ERR_CONFIG, "%s: \"no_rope_layers\"[%d] must be 1 (RoPE) or 0 (none)", path, l);
        if (l < c->n_layers) c->layer_nope[l] = v == 0;
        l++;
    }
    return 0;
}

/* Which layers slide, by the family's rule (transformers' config classes). */
static int read_windows(lm_config *c, const lm_family *f, const cJSON *root, const char *path, ct_err *e) {
    int rc, win = f->win_default;
    const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    if (sw && cJSON_IsNull(sw)) win = 0;
    else if ((rc = json_int(root, "sliding_window", &win, 0, path, e))) return rc;
    /* a window of 0 is a value, not None: SmolLM3Config still makes the NoPE layers slide
     * over it, and a sliding layer's mask over 0 keys fails in transformers' forward */
    int win_set = !(sw && cJSON_IsNull(sw)) && (sw || f->win_default > 0);
    if (f->win_gate) { /* Qwen: sliding_window = sliding_window if use_sliding_window else None */
        int on = 0;
        if ((rc = json_bool(root, f->win_gate, &on, path, e))) return rc;
        if (!on) {
            win = 0;
            win_set = 0;
        }
    }
    if (f->win == WIN_NONE) win = 0;
    if (win < 0) return ct_fail(e, CT_ERR_CONFIG, "%s: \"sliding_window\" must be positive, got %d", path, win);
    c->sliding_window = win;
    memset(c->layer_sliding, 0, sizeof c->layer_sliding);
    if (f->win == WIN_NONE) return 0;
    if (f->win == WIN_ALL) {
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = win > 0;
        return 0;
    }
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (lt && !cJSON_IsNull(lt)) {
        if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != c->n_layers)
            return ct_fail(e, CT_ERR_CONFIG, "%s: \"layer_types\" must be a list of num_hidden_layers = %d entries",
                           path, c->n_layers);
        int l = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, lt) {
            int sl = cJSON_IsString(it) && strcmp(it->valuestring, "sliding_attention") == 0;
            if (!sl && !(cJSON_IsString(it) && strcmp(it->valuestring, "full_attention") == 0))
                return ct_fail(e, CT_ERR_CONFIG,
                               "%s: \"layer_types\"[%d] must be \"full_attention\" or \"sliding_attention\"", path, l);
            c->layer_sliding[l++] = (unsigned char)sl;
        }
    } else if (f->win == WIN_GEMMA2) { /* Gemma2Config: even layers slide, odd ones are global */
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = (l + 1) % 2 != 0;
    } else if (f->win == WIN_MINISTRAL) { /* MinistralConfig: all slide unless sliding_window is null */
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = win_set;
    } else if (f->win == WIN_EXAONE4) { /* Exaone4Config: every pattern-th layer is global */
        const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "sliding_window_pattern");
        int pat = 4;
        if (!win_set)
            return ct_fail(e, CT_ERR_CONFIG, "%s: \"sliding_window\" is null and \"layer_types\" absent: "
                           "Exaone4Config then divides by a sliding_window_pattern of 0 and fails; give "
                           "layer_types", path);
        if (pt && cJSON_IsString(pt))
            return ct_fail(e, CT_ERR_CONFIG, "%s: \"sliding_window_pattern\" = \"%s\": Exaone4Config takes the "
                           "remainder by it and fails on a string; give an integer or layer_types", path,
                           pt->valuestring);
        if ((rc = json_int(root, "sliding_window_pattern", &pat, 0, path, e))) return rc;
        if (pat < 1) return ct_fail(e, CT_ERR_CONFIG, "%s: \"sliding_window_pattern\" must be >= 1", path);
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = (l + 1) % pat != 0;
    } else if (f->win == WIN_OLMO3) { /* Olmo3Config: every 4th layer is global */
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = (l + 1) % 4 != 0;
    } else if (f->win == WIN_SMOLLM3) { /* SmolLM3Config: the NoPE layers slide, when a window exists */
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = win_set && c->layer_nope[l];
    } else if (f->win == WIN_GEMMA) { /* the legacy period: every pattern-th layer is global */
        int pat = 6;
        if ((rc = json_int(root, "sliding_window_pattern", &pat, 0, path, e))) return rc;
        if (pat < 1) return ct_fail(e, CT_ERR_CONFIG, "%s: \"sliding_window_pattern\" must be >= 1", path);
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = (l + 1) % pat != 0;
    } else if (f->win == WIN_QWEN2_MOE) { /* Qwen2MoeConfig: even layers below max_window_layers slide */
        int mw = 28;
        if ((rc = json_int(root, "max_window_layers", &mw, 0, path, e))) return rc;
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = win > 0 && (l + 1) % 2 && l < mw;
    } else { /* Qwen: layers from max_window_layers on slide, when a window exists */
        int mw = f->mw_default ? f->mw_default : 28;
        if ((rc = json_int(root, "max_window_layers", &mw, 0, path, e))) return rc;
        for (int l = 0; l < c->n_layers; l++) c->layer_sliding[l] = win > 0 && l >= mw;
    }
    /* Exaone4Attention rotates every layer when sliding_window is null, else the sliding ones only */
    if (f->win == WIN_EXAONE4)
        for (int l = 0; l < c->n_layers; l++) c->layer_nope[l] = win_set && !c->layer_sliding[l];
    for (int l = 0; l < c->n_layers; l++)
        if (c->layer_sliding[l] && win <= 0)
            return ct_fail(e, CT_ERR_CONFIG, "%s: layer %d is a sliding_attention layer but \"sliding_window\" is %s",
                           path, l, win_set ? "0 (a window must hold at least the query's own key)"
                                    : f->win_gate ? "off (use_sliding_window false or sliding_window null)" : "null");
    return 0;
}

/* Ministral3Config.__post_init__: a config without rope_parameters (absent or
 * null) gets transformers' own dict, a yarn RoPE (which rope.c reads as any
 * other: factor, beta_fast/slow, mscale and mscale_all_dim) with the q scale's
 * two keys; its max_position_embeddings is the config's. A top-level rope_theta
 * is then ignored, as there (the dict's 1e6 wins). A top-level rope_scaling is
 * left to read_q_scale's refusal. */
static void q_scale_default_rope(cJSON *root) {
    cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if ((rp && !cJSON_IsNull(rp)) || cJSON_GetObjectItemCaseSensitive(root, "rope_scaling")) return;
    const cJSON *mp = cJSON_GetObjectItemCaseSensitive(root, "max_position_embeddings");
    cJSON *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "type", "yarn");
    cJSON_AddStringToObject(d, "rope_type", "yarn"); /* standardize's copy of the legacy key */
    const struct { const char *key; double v; } nums[] = {
        {"rope_theta", 1e6}, {"factor", 16.0}, {"original_max_position_embeddings", 16384},
        {"max_position_embeddings", cJSON_IsNumber(mp) ? mp->valuedouble : 262144}, {"beta_fast", 32.0},
        {"beta_slow", 1.0}, {"mscale_all_dim", 1.0}, {"mscale", 1.0}, {"llama_4_scaling_beta", 0.1}};
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) cJSON_AddNumberToObject(d, nums[i].key, nums[i].v);
    if (rp) cJSON_ReplaceItemInObjectCaseSensitive(root, "rope_parameters", d);
    else cJSON_AddItemToObject(root, "rope_parameters", d);
}

/* Ministral 3's q scale: Ministral3Attention reads both keys from the
 * rope_parameters dict itself (a missing one fails there); an absent dict is
 * transformers' default (q_scale_default_rope). */
static int read_q_scale(lm_config *c, const cJSON *root, const char *path, ct_err *e) {
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (!cJSON_IsObject(rp))
        return ct_fail(e, CT_ERR_CONFIG, "%s: model_type ministral3 needs \"rope_parameters\" given as an object "
                       "with llama_4_scaling_beta and original_max_position_embeddings", path);
    if (cJSON_GetObjectItemCaseSensitive(root, "rope_scaling") || cJSON_GetObjectItemCaseSensitive(root,
                                                                      "original_max_position_embeddings"))
        return ct_fail(e, CT_ERR_CONFIG, "%s: model_type ministral3: give the RoPE in \"rope_parameters\" only "
                       "(a top-level rope_scaling or original_max_position_embeddings is refused)", path);
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(rp, "llama_4_scaling_beta");
    if (!cJSON_IsNumber(b) || !isfinite(b->valuedouble))
        return ct_fail(e, CT_ERR_CONFIG, "%s: rope_parameters.llama_4_scaling_beta must be a number (Ministral3Attention "
                       "multiplies q by 1 + beta * log(1 + floor(pos / original_max_position_embeddings)))", path);
    int len = 0, rc;
    if ((rc = json_int(rp, "original_max_position_embeddings", &len, 1, path, e))) return rc;
    if (len <= 0)
        return ct_fail(e, CT_ERR_CONFIG, "%s: rope_parameters.original_max_position_embeddings must be positive, got %d",
                       path, len);
    c->q_scale_beta = b->valuedouble;
    c->q_scale_len = len;
    return 0;
}

/* RoPE of the full-attention and the sliding layers (model/rope.h resolves
 * rope_parameters, the legacy keys and transformers' precedence). */
static int read_rope(lm_config *c, const lm_family *f, const cJSON *root, const char *path, ct_err *e) {
    int rc, gemma = rope_style_nested(f->rope_style); /* nested per layer type */
    if ((rc = rope_params_from_hf(&c->rope, root, gemma ? "full_attention" : NULL, c->head_dim, path, e))) return rc;
    c->rope_local = c->rope;
    if (gemma && (rc = rope_params_from_hf(&c->rope_local, root, "sliding_attention", c->head_dim, path, e)))
        return rc;
    /* Only Phi3's and GLM's apply_rotary_pos_emb rotate the first rotary_dim
     * features and pass the rest through (lm_rotary_dim). The other families' default RoPE
     * ignores the factor (rope.c resolves it to 1 there, as transformers does),
     * but their scaled types' init functions (linear, dynamic, yarn, llama3,
     * longrope) do read it, and their apply_rotary_pos_emb then multiplies whole
     * heads by cos/sin of rotary_dim features: transformers 5.24 fails with a
     * shape error on the first forward, so there is nothing to reproduce. The
     * fused per-head q/k norm + RoPE op rotates whole heads too. */
    const rope_params *ps[2] = {&c->rope, &c->rope_local};
    for (int i = 0; i < 2; i++)
        if (rope_rotary_dim(ps[i], c->head_dim) != c->head_dim &&
            ((f->rope_style != ROPE_STYLE_PHI3 && f->rope_style != ROPE_STYLE_GLM) || gemma ||
             (c->qk_norm == LM_QK_HEAD && !f->glm4_moe)))
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: \"partial_rotary_factor\" = %g with rope_type \"%s\" is not supported for model_type %s: "
                           "it rotates %d of head_dim %d, and transformers' %s attention rotates whole heads (its "
                           "forward fails); partial RoPE is supported for model_type phi3 (default, longrope), glm, "
                           "glm4 and glm4_moe, and the default RoPE of the other families ignores the factor",
                           path, ps[i]->partial_rotary_factor, rope_type_name(ps[i]->type), f->type,
                           rope_rotary_dim(ps[i], c->head_dim), c->head_dim, f->type);
    c->has_rope = 1;
    c->rope_theta = c->rope.theta;
    return 0;
}

/* rope_parameters as transformers 5 writes them, for one layer type. */
static void add_float(cJSON *o, const char *key, double v);
static void write_rope(cJSON *o, const rope_params *p) {
    cJSON_AddStringToObject(o, "rope_type", rope_type_name(p->type));
    add_float(o, "rope_theta", p->theta);
    /* as config.json gave it (also where the default RoPE ignores it), so that the
     * export reads back as the same config; transformers takes it from
     * rope_parameters before the top-level key */
    if (p->partial_rotary_factor_given > 0) add_float(o, "partial_rotary_factor", p->partial_rotary_factor_given);
    if (p->type == ROPE_DEFAULT) return;
    if (p->type != ROPE_LONGROPE) add_float(o, "factor", p->factor);
    if (p->alpha > 0) add_float(o, "alpha", p->alpha); /* HunYuan's ntk_alpha */
    if (p->type == ROPE_YARN || p->type == ROPE_LLAMA3 || p->type == ROPE_LONGROPE)
        cJSON_AddNumberToObject(o, "original_max_position_embeddings", p->original_max_pos);
    if (p->has_attention_factor) add_float(o, "attention_factor", p->attention_factor);
    if (p->type == ROPE_YARN) {
        /* what transformers assumes when a key is absent is left out, as a published file has it */
        if (p->beta_fast != 32) add_float(o, "beta_fast", p->beta_fast);
        if (p->beta_slow != 1) add_float(o, "beta_slow", p->beta_slow);
        if (p->mscale != 0) add_float(o, "mscale", p->mscale);
        if (p->mscale_all_dim != 0) add_float(o, "mscale_all_dim", p->mscale_all_dim);
        if (!p->truncate) cJSON_AddBoolToObject(o, "truncate", 0);
    }
    if (p->type == ROPE_LLAMA3) {
        add_float(o, "low_freq_factor", p->low_freq_factor);
        add_float(o, "high_freq_factor", p->high_freq_factor);
    }
    if (p->type == ROPE_LONGROPE) {
        cJSON *sf = cJSON_AddArrayToObject(o, "short_factor"), *lf = cJSON_AddArrayToObject(o, "long_factor");
        for (int i = 0; i < p->n_factors; i++) {
            cJSON_AddItemToArray(sf, cJSON_CreateNumber(p->short_factor[i]));
            cJSON_AddItemToArray(lf, cJSON_CreateNumber(p->long_factor[i]));
        }
    }
}

/* A positive scalar of the config: absent, the config class's default def;
 * null, if_null (NAN: refused, where the config class types the field
 * float | int and transformers' strict validation refuses a null); else a
 * positive finite number. Gemma's soft-caps (null: none) are divided by, so
 * 0 would give NaN or flat scores and a negative cap computes what its
 * absolute value does; Granite's scalars at 0 would zero the stream or
 * divide the logits by 0, and ctitan reads an attention scale of 0 as
 * head_dim^-0.5. */
static int read_positive(const cJSON *root, const char *key, double def, double if_null, double *out,
                         const char *path, ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    *out = def;
    if (!it) return 0;
    if (cJSON_IsNull(it) && !isnan(if_null)) {
        *out = if_null;
        return 0;
    }
    if (!cJSON_IsNumber(it) || !(it->valuedouble > 0) || !isfinite(it->valuedouble))
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be a positive number%s", path, key,
                       isnan(if_null) ? "" : " or null");
    *out = it->valuedouble;
    return 0;
}

/* Gemma's files carry hidden_act ("gelu", which GemmaConfig reads as the tanh
 * approximation) and often hidden_activation too, which transformers 4.x's
 * GemmaMLP preferred and 5.x ignores: where the two name different functions
 * the versions compute different models, so ctitan refuses the file. */
static int gemma_act_agrees(const lm_config *c, const cJSON *root, const char *path, ct_err *e) {
    const cJSON *ha = cJSON_GetObjectItemCaseSensitive(root, "hidden_activation");
    if (!ha || cJSON_IsNull(ha)) return 0;
    const char *mine = c->act == LM_ACT_GELU_TANH ? "gelu_pytorch_tanh" : "silu";
    if (cJSON_IsString(ha) && strcmp(ha->valuestring, mine) == 0) return 0;
    return ct_fail(e, CT_ERR_CONFIG,
                   "%s: \"hidden_activation\" = \"%s\" disagrees with \"hidden_act\" (%s): transformers 5.x "
                   "computes hidden_act, 4.x hidden_activation; make them name the same function",
                   path, cJSON_IsString(ha) ? ha->valuestring : "?", mine);
}

int lm_config_from_hf(lm_config *c, const char *dir, ct_err *e) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len = 0;
    char *text = fs_read_file(path, 0, &len, NULL);
    if (!text) return ct_fail(e, CT_ERR_CONFIG, "%s: cannot read (model.hf_assets_path = \"%s\")", path, dir);
    cJSON *root = json_parse(text, len, path, e);
    free(text);
    if (!root) return CT_ERR_FORMAT;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        /* the file is malformed, not a value in it: a format error, like a broken safetensors header */
        return ct_fail(e, CT_ERR_FORMAT, "%s: not a valid JSON object", path);
    }
    int rc = 0;
    memset(c, 0, sizeof *c);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) {
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: missing \"model_type\"", path);
        goto done;
    }
    const lm_family *f = family_of(mt->valuestring);
    /* AutoConfig reads a mistral file that has the key layer_types (null included) as a
     * ministral one, so transformers builds MinistralForCausalLM from it */
    if (f && !strcmp(f->type, "mistral") && cJSON_GetObjectItemCaseSensitive(root, "layer_types"))
        f = family_of("ministral");
    if (!f && !strcmp(mt->valuestring, "gemma3")) {
        /* the published gemma-3-4b/12b/27b folders: Gemma3ForConditionalGeneration, a vision
         * tower around a gemma3_text language model (docs/families.md) */
        const cJSON *tmt =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "text_config"), "model_type");
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: model_type \"gemma3\" is Gemma 3's multimodal wrapper (Gemma3ForConditionalGeneration: "
                     "a vision tower and a language model), which ctitan does not read; its \"text_config\" is a "
                     "%s model, which ctitan trains: save the language model as a checkpoint of its own "
                     "(config.json = text_config, model_type \"gemma3_text\", weights named as "
                     "Gemma3ForCausalLM names them; docs/families.md has a recipe) and point "
                     "model.hf_assets_path at it, or start from a text-only Gemma 3 (gemma-3-1b-it)",
                     path, cJSON_IsString(tmt) ? tmt->valuestring : "gemma3_text");
        goto done;
    }
    if (!f) {
        char known[512];
        family_list(known, sizeof known);
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: model_type \"%s\" is not supported (supported: %s)", path,
                     mt->valuestring, known);
        goto done;
    }
    snprintf(c->model_type, sizeof c->model_type, "%s", f->type);
    c->norm_place = f->norm_place;
    c->norm_plus_one = f->norm_plus_one;
    c->qk_norm = f->qk_norm;
    c->fused_qkv = f->fused == FUSED_QKV_GATE_UP;
    c->fused_gate_up = f->fused != FUSED_NONE;
    c->rope_interleaved = f->interleaved;
    c->qk_norm_after_rope = f->qk_after_rope;
    c->embed_scaled = f->embed_scaled;
    c->qkv_bias = f->qkv_bias;
    c->moe_keys = f->moe ? f->moe - 1 : 0;
    /* -1 marks "absent" until the sizes are read */
    c->n_kv_heads = f->kv_default ? f->kv_default : -1;
    c->head_dim = f->hd_default ? f->hd_default : -1;
    c->max_pos = f->max_pos;
    c->rms_eps = f->eps;
    c->tie_embeddings = f->tied;
    if ((rc = json_int(root, "vocab_size", &c->vocab_size, 1, path, e)) ||
        (rc = json_int(root, "hidden_size", &c->hidden, 1, path, e)) ||
        (rc = json_int(root, "intermediate_size", &c->intermediate, 1, path, e)) ||
        (rc = json_int(root, "num_hidden_layers", &c->n_layers, 1, path, e)) ||
        (rc = json_int(root, "num_attention_heads", &c->n_heads, 1, path, e)) ||
        (rc = json_int(root, "num_key_value_heads", &c->n_kv_heads, 0, path, e)) ||
        (rc = json_int(root, "head_dim", &c->head_dim, 0, path, e)) ||
        (rc = json_int(root, "max_position_embeddings", &c->max_pos, 0, path, e)) ||
        (rc = json_float(root, "rms_norm_eps", &c->rms_eps, path, e)) ||
        (rc = json_bool(root, "tie_word_embeddings", &c->tie_embeddings, path, e)))
        goto done;
    c->pad_token = f->pad;
    const cJSON *pad = cJSON_GetObjectItemCaseSensitive(root, "pad_token_id");
    if (pad && cJSON_IsNull(pad)) c->pad_token = -1;
    else if ((rc = json_int(root, "pad_token_id", &c->pad_token, 0, path, e))) goto done;
    c->has_pad = c->pad_token >= 0 && c->pad_token < c->vocab_size; /* nn.Embedding rejects others */
    if (c->pad_token >= c->vocab_size) {
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"pad_token_id\" = %d is outside the vocabulary (vocab_size %d)", path,
                     c->pad_token, c->vocab_size);
        goto done;
    }
    /* null, in the config classes that take None, derives num_attention_heads and
     * hidden_size / num_attention_heads whatever the absent key's default (ERNIE's 2 and
     * 128, Seed-OSS's 8 and 128, Qwen2's 32 kv heads); the others fail on it */
    const cJSON *kvn = cJSON_GetObjectItemCaseSensitive(root, "num_key_value_heads");
    if (kvn && cJSON_IsNull(kvn)) c->n_kv_heads = -1;
    if (c->n_kv_heads == -1) c->n_kv_heads = c->n_heads;
    const cJSON *hd = cJSON_GetObjectItemCaseSensitive(root, "head_dim");
    if (hd && cJSON_IsNull(hd)) c->head_dim = -1;
    if (f->hd_required && (!hd || cJSON_IsNull(hd))) {
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: \"head_dim\" is %s: model_type %s needs it given (its config class derives none and "
                     "transformers' attention fails without it)", path, hd ? "null" : "absent", f->type);
        goto done;
    }
    if (c->head_dim == -1) c->head_dim = c->n_heads > 0 ? c->hidden / c->n_heads : 0;
    if (f->heads_check == HEADS_O_HIDDEN && c->n_heads > 0 && (long long)c->n_heads * c->head_dim != c->hidden) {
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: \"head_dim\" = %d with hidden_size %d and num_attention_heads %d: model_type %s needs "
                     "head_dim x num_attention_heads = hidden_size (its o_proj maps hidden_size features; "
                     "transformers' forward fails otherwise)", path, c->head_dim, c->hidden, c->n_heads, f->type);
        goto done;
    }
    if (f->heads_check == HEADS_DIVIDE && c->n_heads > 0 && c->hidden % c->n_heads) {
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: hidden_size %d is not a multiple of num_attention_heads %d, which model_type %s's "
                     "config class refuses", path, c->hidden, c->n_heads, f->type);
        goto done;
    }
    if (c->n_layers > LM_MAX_LAYERS) {
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: num_hidden_layers = %d: at most %d are supported", path, c->n_layers,
                     LM_MAX_LAYERS);
        goto done;
    }
    /* GraniteMoeConfig: Mixtral's keys and defaults (num_local_experts 8, 2 per token) */
    int mixlike = f->moe == 1 + LM_MOE_KEYS_MIXTRAL || f->moe == 1 + LM_MOE_KEYS_GRANITE;
    if (f->moe && (rc = moe_config_from_json(c, root, mixlike, f->shared_expert, f->olmoe, f->type, path, e)))
        goto done;
    if (f->ernie_moe && (rc = ernie_moe_from_json(c, root, path, e))) goto done;
    if (f->glm4_moe && (rc = glm4_moe_from_json(c, root, f->glm4_moe == GLM_MOE_DOTS1, path, e))) goto done;
    if (f->olmoe) {
        /* OlmoeSparseMoeBlock in every layer, its experts intermediate_size wide: OlmoeConfig
         * has no moe_intermediate_size, decoder_sparse_step nor mlp_only_layers */
        c->moe_intermediate = c->intermediate;
        c->n_mlp_only = 0;
        c->decoder_sparse_step = 1;
        /* OLMoE's q_norm spans hidden_size and k_norm (hidden_size / heads) x kv heads,
         * whatever head_dim says: other head widths fail in transformers' forward */
        if (f->olmoe == OLMOE_OLMOE && c->n_heads > 0 && (long long)c->n_heads * c->head_dim != c->hidden) {
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: \"head_dim\" = %d with hidden_size %d and num_attention_heads %d: model_type olmoe "
                         "needs head_dim x num_attention_heads = hidden_size (OlmoeAttention's q_norm spans "
                         "hidden_size)", path, c->head_dim, c->hidden, c->n_heads);
            goto done;
        }
        /* FlexOlmoConfig has no clip_qkv: FlexOlmoAttention clamps nothing, whatever the file says */
        const cJSON *clip = cJSON_GetObjectItemCaseSensitive(root, "clip_qkv");
        if (f->olmoe == OLMOE_OLMOE && clip && !cJSON_IsNull(clip)) {
            char *v = cJSON_PrintUnformatted(clip);
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"clip_qkv\" = %s is not supported (ctitan does not clamp q, k "
                         "and v); only null is", path, v ? v : "?");
            free(v);
            goto done;
        }
    }
    if (f->shared_expert && (rc = json_bool(root, "qkv_bias", &c->qkv_bias, path, e))) goto done;
    if (f->granite_shared) {
        if ((rc = json_int(root, "shared_intermediate_size", &c->shared_intermediate, 0, path, e))) goto done;
        if (c->shared_intermediate < 0) {
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"shared_intermediate_size\" must be >= 0 (0: no shared MLP), got %d",
                         path, c->shared_intermediate);
            goto done;
        }
    }
    if (mixlike) {
        /* MixtralTopKRouter always renormalises the top k, GraniteMoeTopKRouter takes the
         * softmax of the top-k logits (the same weights); the experts are intermediate_size wide */
        c->norm_topk_prob = 1;
        c->moe_intermediate = c->intermediate;
        c->n_mlp_only = 0;
        c->decoder_sparse_step = 1;
        if (f->moe == 1 + LM_MOE_KEYS_MIXTRAL &&
            (rc = refuse_nonzero(root, "router_jitter_noise", "ctitan's router adds no noise", path, e)))
            goto done;
    }
    if (f->has_attn_bias) {
        int b = f->attn_bias_qkv == 1; /* GlmConfig's default true */
        if ((rc = json_bool(root, "attention_bias", &b, path, e))) goto done;
        c->qkv_bias = b;
        c->o_bias = b && !f->attn_bias_qkv;
    } else if ((rc = refuse_nonzero(root, "attention_bias", "this family's attention has no biases", path, e))) {
        goto done;
    }
    if (f->out_bias && (rc = json_bool(root, "attention_out_bias", &c->o_bias, path, e))) goto done;
    if (f->use_bias) {
        int b = 0;
        if ((rc = json_bool(root, "use_bias", &b, path, e))) goto done;
        c->qkv_bias = c->o_bias = c->mlp_bias = b;
        if (b && f->ernie_moe) { /* its shared experts and lm_head take biases too: not built */
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"use_bias\" = true is not supported for model_type ernie4_5_moe "
                         "(biases on its shared experts and lm_head are not built); only false is", path);
            goto done;
        }
    }
    if (f->has_mlp_bias) {
        if ((rc = json_bool(root, "mlp_bias", &c->mlp_bias, path, e))) goto done;
    } else if ((rc = refuse_nonzero(root, "mlp_bias", "this family's MLP has no biases", path, e))) {
        goto done;
    }
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, f->act_key);
    if (act && !cJSON_IsNull(act)) {
        if (cJSON_IsString(act) && strcmp(act->valuestring, "silu") == 0) c->act = LM_ACT_SILU;
        else if (cJSON_IsString(act) && strcmp(act->valuestring, "gelu_pytorch_tanh") == 0) c->act = LM_ACT_GELU_TANH;
        else if (f->act_gelu_is_tanh && cJSON_IsString(act) && strcmp(act->valuestring, "gelu") == 0)
            c->act = LM_ACT_GELU_TANH; /* GemmaConfig maps the published files' "gelu" so */
        else {
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" = \"%s\" is not supported (supported: silu, gelu_pytorch_tanh)",
                         path, f->act_key, cJSON_IsString(act) ? act->valuestring : "?");
            goto done;
        }
    } else {
        c->act = f->norm_plus_one ? LM_ACT_GELU_TANH : LM_ACT_SILU; /* the Gemma config classes' default */
    }
    if (f->act_gelu_is_tanh && (rc = gemma_act_agrees(c, root, path, e))) goto done;
    if (f->nope && (rc = read_nope(c, root, path, e))) goto done;
    if (f->q_scale) q_scale_default_rope(root); /* before read_rope: the dict is its RoPE too */
    if ((rc = read_windows(c, f, root, path, e)) || (rc = read_rope(c, f, root, path, e))) goto done;
    if (f->q_scale && (rc = read_q_scale(c, root, path, e))) goto done;
    if (f->caps) {
        int qs = 256; /* Gemma2/3 declare it int: 256.0 and 256.5 fail there */
        if ((rc = json_int(root, "query_pre_attn_scalar", &qs, 0, path, e))) goto done;
        if (!(qs > 0)) {
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"query_pre_attn_scalar\" must be positive", path);
            goto done;
        }
        c->attn_scale = 1.0 / sqrt(qs);
        /* attn_logit_softcapping: Gemma2's eager attention applies it; Gemma3Attention
         * (transformers 5.24) keeps it but never hands it to the attention function, so
         * there it changes nothing, nor here: it is only carried to the exported config */
        if ((rc = read_positive(root, "final_logit_softcapping", f->final_cap_default, 0, &c->final_softcap, path,
                                e)) ||
            (rc = f->caps == CAPS_GEMMA2
                      ? read_positive(root, "attn_logit_softcapping", f->attn_cap_default, 0, &c->attn_softcap, path, e)
                      : json_float(root, "attn_logit_softcapping", &c->attn_softcap_unused, path, e)) ||
            (rc = refuse_nonzero(root, "use_bidirectional_attention", "ctitan trains causal attention", path, e)))
            goto done;
    } else if ((rc = refuse_nonzero(root, "final_logit_softcapping", "not part of this family", path, e)) ||
               (rc = refuse_nonzero(root, "attn_logit_softcapping", "not part of this family", path, e)) ||
               (f->norm_plus_one &&
                (rc = refuse_nonzero(root, "use_bidirectional_attention", "ctitan trains causal attention", path, e)))) {
        goto done;
    }
    /* Granite's scalars: absent, GraniteConfig's default 1.0; null refused, as GraniteConfig refuses it */
    if (f->granite && ((rc = read_positive(root, "embedding_multiplier", 1, NAN, &c->embed_mult, path, e)) ||
                       (rc = read_positive(root, "residual_multiplier", 1, NAN, &c->residual_mult, path, e)) ||
                       (rc = read_positive(root, "attention_multiplier", 1, NAN, &c->attn_scale, path, e)) ||
                       (rc = read_positive(root, "logits_scaling", 1, NAN, &c->logits_div, path, e))))
        goto done;
    /* dropout would change what a training step computes; ctitan has none */
    if ((rc = refuse_nonzero(root, "attention_dropout", "ctitan trains without dropout", path, e)) ||
        (rc = refuse_nonzero(root, "resid_pdrop", "ctitan trains without dropout", path, e)) ||
        (rc = refuse_nonzero(root, "embd_pdrop", "ctitan trains without dropout", path, e)) ||
        (f->dropout_default &&
         (rc = refuse_nonzero(root, "residual_dropout", "ctitan trains without dropout", path, e))))
        goto done;
    /* SeedOssConfig trains with 0.1 where the key is absent (and refuses null) */
    if (f->dropout_default)
        for (int i = 0; i < 2; i++) {
            const char *k = i ? "residual_dropout" : "attention_dropout";
            const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, k);
            if (!it || cJSON_IsNull(it)) {
                rc = ct_fail(e, CT_ERR_CONFIG,
                             "%s: \"%s\" is %s, which model_type %s reads as %s; ctitan trains without "
                             "dropout: set it to 0.0 in config.json",
                             path, k, it ? "null" : "absent", f->type, it ? "an error" : "0.1");
                goto done;
            }
        }
    snprintf(c->name, sizeof c->name, "hf");
    rc = lm_config_check(c, path, e);
done:
    cJSON_Delete(root);
    return rc;
}

/* A float field: transformers' strict config classes reject an integer
 * literal where they declare float, and cJSON prints 0.0 as 0. */
static void add_float(cJSON *o, const char *key, double v) {
    char buf[64];
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(buf, sizeof buf, "%.1f", v);
        cJSON_AddRawToObject(o, key, buf);
    } else {
        cJSON_AddNumberToObject(o, key, v);
    }
}

char *lm_config_hf_json(const lm_config *c, const char *dtype_name) {
    const lm_family *f = family_of_config(c);
    cJSON *o = cJSON_CreateObject();
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    int moe = c->n_experts > 0, mixtral = c->moe_keys == LM_MOE_KEYS_MIXTRAL;
    cJSON_AddItemToArray(arch, cJSON_CreateString(f->arch));
    cJSON_AddStringToObject(o, "model_type", f->type);
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(o, "hidden_size", c->hidden);
    cJSON_AddNumberToObject(o, "intermediate_size", c->intermediate);
    cJSON_AddNumberToObject(o, "num_hidden_layers", c->n_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", c->n_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", c->n_kv_heads);
    cJSON_AddNumberToObject(o, "head_dim", c->head_dim);
    cJSON_AddStringToObject(o, f->act_key, c->act == LM_ACT_GELU_TANH ? "gelu_pytorch_tanh" : "silu");
    cJSON_AddNumberToObject(o, "max_position_embeddings", c->max_pos);
    add_float(o, "rms_norm_eps", c->rms_eps);
    /* flavors: default RoPE with rope_theta (partial_rotary_factor 1), sliding layers alike */
    rope_params rg = lm_rope_params(c, 0), rl = lm_rope_params(c, 1);
    cJSON *rp = cJSON_AddObjectToObject(o, "rope_parameters");
    if (rope_style_nested(f->rope_style)) {
        write_rope(cJSON_AddObjectToObject(rp, "full_attention"), &rg);
        write_rope(cJSON_AddObjectToObject(rp, "sliding_attention"), &rl);
    } else {
        write_rope(rp, &rg);
    }
    if (c->q_scale_len > 0) { /* Ministral3Attention reads them from this dict */
        cJSON_DeleteItemFromObjectCaseSensitive(rp, "original_max_position_embeddings");
        cJSON_AddNumberToObject(rp, "original_max_position_embeddings", c->q_scale_len);
        add_float(rp, "llama_4_scaling_beta", c->q_scale_beta);
    }
    if (strcmp(f->type, "phi3") == 0 && rg.original_max_pos > 0) /* a Phi3Config attribute of its own */
        cJSON_AddNumberToObject(o, "original_max_position_embeddings", rg.original_max_pos);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_embeddings);
    if (c->has_pad) cJSON_AddNumberToObject(o, "pad_token_id", c->pad_token);
    else cJSON_AddNullToObject(o, "pad_token_id");
    if (f->has_attn_bias) cJSON_AddBoolToObject(o, "attention_bias", f->attn_bias_qkv ? c->qkv_bias : c->o_bias);
    if (f->out_bias) cJSON_AddBoolToObject(o, "attention_out_bias", c->o_bias);
    if (f->has_mlp_bias) cJSON_AddBoolToObject(o, "mlp_bias", c->mlp_bias);
    if (f->use_bias) cJSON_AddBoolToObject(o, "use_bias", c->qkv_bias);
    add_float(o, "attention_dropout", 0);
    if (f->dropout_default) add_float(o, "residual_dropout", 0);
    /* windows: the family's own keys, so that its config class derives the same layers */
    int any = 0, first = c->n_layers, past = 0; /* past: one after the last sliding layer */
    for (int l = 0; l < c->n_layers; l++)
        if (c->layer_sliding[l]) {
            any = 1;
            if (l < first) first = l;
            past = l + 1;
        }
    /* Olmo3 as Gemma: a window always written (its default would apply otherwise) */
    int gemma_win = f->win == WIN_GEMMA || f->win == WIN_GEMMA2 || f->win == WIN_OLMO3;
    int types = f->win == WIN_TYPES || f->win == WIN_QWEN2_MOE || f->win == WIN_SMOLLM3 || f->win == WIN_MINISTRAL ||
                f->win == WIN_EXAONE4;
    /* EXAONE 4: a window (even one no layer uses) takes RoPE off the full layers */
    for (int l = 0; f->win == WIN_EXAONE4 && l < c->n_layers; l++) any |= c->layer_nope[l];
    if (f->win == WIN_ALL || types || gemma_win) {
        if (any) cJSON_AddNumberToObject(o, "sliding_window", c->sliding_window);
        else if (!gemma_win) cJSON_AddNullToObject(o, "sliding_window");
        else cJSON_AddNumberToObject(o, "sliding_window", c->sliding_window > 0 ? c->sliding_window : 4096);
    }
    if (f->win_gate) cJSON_AddBoolToObject(o, f->win_gate, any);
    /* Qwen2's layers from max_window_layers on slide; Qwen2MoeConfig's (even) ones below it */
    if (f->win == WIN_TYPES || f->win == WIN_QWEN2_MOE)
        cJSON_AddNumberToObject(o, "max_window_layers", f->win == WIN_QWEN2_MOE ? past : first);
    if (types || gemma_win) {
        cJSON *lt = cJSON_AddArrayToObject(o, "layer_types");
        for (int l = 0; l < c->n_layers; l++)
            cJSON_AddItemToArray(lt, cJSON_CreateString(c->layer_sliding[l] ? "sliding_attention" : "full_attention"));
    }
    if (f->caps) {
        double sc = c->attn_scale > 0 ? c->attn_scale : 1.0 / sqrt((double)c->head_dim);
        cJSON_AddNumberToObject(o, "query_pre_attn_scalar", round(1.0 / (sc * sc)));
        if (c->final_softcap > 0) add_float(o, "final_logit_softcapping", c->final_softcap);
        else cJSON_AddNullToObject(o, "final_logit_softcapping");
        double asc = c->attn_softcap > 0 ? c->attn_softcap : c->attn_softcap_unused;
        if (asc > 0) add_float(o, "attn_logit_softcapping", asc);
        else cJSON_AddNullToObject(o, "attn_logit_softcapping");
    }
    if (f->nope) {
        cJSON *nl = cJSON_AddArrayToObject(o, "no_rope_layers");
        for (int l = 0; l < c->n_layers; l++) cJSON_AddItemToArray(nl, cJSON_CreateNumber(!c->layer_nope[l]));
    }
    if (f->granite) {
        add_float(o, "embedding_multiplier", c->embed_mult > 0 ? c->embed_mult : 1.0);
        add_float(o, "residual_multiplier", c->residual_mult > 0 ? c->residual_mult : 1.0);
        add_float(o, "attention_multiplier", c->attn_scale > 0 ? c->attn_scale : 1.0 / sqrt((double)c->head_dim));
        add_float(o, "logits_scaling", c->logits_div > 0 ? c->logits_div : 1.0);
    }
    cJSON_AddBoolToObject(o, "use_cache", 1);
    add_float(o, "initializer_range", 0.02);
    cJSON_AddStringToObject(o, "dtype", dtype_name);
    if (moe && (mixtral || c->moe_keys == LM_MOE_KEYS_GRANITE)) {
        cJSON_AddNumberToObject(o, "num_local_experts", c->n_experts);
        cJSON_AddNumberToObject(o, "num_experts_per_tok", c->top_k);
        cJSON_AddBoolToObject(o, "output_router_logits", c->output_router_logits);
        add_float(o, "router_aux_loss_coef", c->router_aux_loss_coef);
        if (mixtral) add_float(o, "router_jitter_noise", 0);
        if (f->granite_shared) cJSON_AddNumberToObject(o, "shared_intermediate_size", c->shared_intermediate);
    } else if (moe && f->ernie_moe) {
        cJSON_AddNumberToObject(o, "moe_num_experts", c->n_experts);
        cJSON_AddNumberToObject(o, "moe_k", c->top_k);
        cJSON_AddNumberToObject(o, "moe_intermediate_size", c->moe_intermediate);
        cJSON_AddNumberToObject(o, "moe_num_shared_experts", c->shared_intermediate / c->moe_intermediate);
        cJSON_AddNumberToObject(o, "moe_layer_start_index", c->moe_layer_start);
        cJSON_AddNumberToObject(o, "moe_layer_end_index", c->moe_layer_end);
        cJSON_AddNumberToObject(o, "moe_layer_interval", c->decoder_sparse_step);
        add_float(o, "moe_norm_min", c->moe_norm_min);
        cJSON_AddBoolToObject(o, "output_router_logits", c->output_router_logits);
        add_float(o, "router_aux_loss_coef", c->router_aux_loss_coef);
    } else if (moe && f->glm4_moe) {
        cJSON_AddNumberToObject(o, "n_routed_experts", c->n_experts);
        cJSON_AddNumberToObject(o, "num_experts_per_tok", c->top_k);
        cJSON_AddNumberToObject(o, "moe_intermediate_size", c->moe_intermediate);
        cJSON_AddNumberToObject(o, "n_shared_experts", c->shared_intermediate / c->moe_intermediate);
        cJSON_AddNumberToObject(o, "n_group", c->n_group);
        cJSON_AddNumberToObject(o, "topk_group", c->topk_group);
        add_float(o, "routed_scaling_factor", c->routed_scaling);
        cJSON_AddNumberToObject(o, "first_k_dense_replace", c->first_k_dense);
        cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk_prob);
        if (f->glm4_moe == GLM_MOE_GLM4) { /* Dots1Config has neither key */
            cJSON_AddBoolToObject(o, "use_qk_norm", c->qk_norm == LM_QK_HEAD);
            cJSON_AddNumberToObject(o, "num_nextn_predict_layers", 0); /* none written */
        }
    } else if (moe && f->olmoe) { /* the experts' width is intermediate_size, every layer sparse */
        cJSON_AddNumberToObject(o, "num_experts", c->n_experts);
        cJSON_AddNumberToObject(o, "num_experts_per_tok", c->top_k);
        cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk_prob);
        cJSON_AddBoolToObject(o, "output_router_logits", c->output_router_logits);
        add_float(o, "router_aux_loss_coef", c->router_aux_loss_coef);
        if (f->olmoe == OLMOE_OLMOE) cJSON_AddNullToObject(o, "clip_qkv");
    } else if (moe) {
        cJSON_AddNumberToObject(o, "num_experts", c->n_experts);
        cJSON_AddNumberToObject(o, "num_experts_per_tok", c->top_k);
        cJSON_AddNumberToObject(o, "moe_intermediate_size", c->moe_intermediate);
        cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk_prob);
        cJSON_AddNumberToObject(o, "decoder_sparse_step", c->decoder_sparse_step);
        cJSON *mo = cJSON_AddArrayToObject(o, "mlp_only_layers");
        for (int i = 0; i < c->n_mlp_only; i++) cJSON_AddItemToArray(mo, cJSON_CreateNumber(c->mlp_only_layers[i]));
        cJSON_AddBoolToObject(o, "output_router_logits", c->output_router_logits);
        add_float(o, "router_aux_loss_coef", c->router_aux_loss_coef);
        if (f->shared_expert) cJSON_AddNumberToObject(o, "shared_expert_intermediate_size", c->shared_intermediate);
    }
    if (f->shared_expert) cJSON_AddBoolToObject(o, "qkv_bias", c->qkv_bias);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    return text; /* NULL: out of memory, cJSON's only failure */
}

int lm_config_write_hf(const lm_config *c, const char *path, const char *dtype_name, ct_err *e) {
    char *text = lm_config_hf_json(c, dtype_name);
    if (!text) return ct_fail(e, CT_ERR_IO, "%s: out of memory rendering it", path);
    int rc = 0;
    FILE *out = fopen(path, "wb");
    if (!out || fputs(text, out) < 0 || fputc('\n', out) < 0) rc = ct_fail(e, CT_ERR_IO, "%s: cannot write", path);
    if (out && fclose(out) != 0 && !rc) rc = ct_fail(e, CT_ERR_IO, "%s: cannot write", path);
    free(text);
    return rc;
}
