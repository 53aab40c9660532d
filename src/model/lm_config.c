/* model/lm_config.c: where the ways of naming a model meet.
 *
 * A native flavor is a row of the table below (the published
 * hyperparameters); an HF directory is its config.json. Both fill the same
 * lm_config. Reading config.json is strict about what we cannot compute
 * (attention bias, sliding windows, RoPE scaling): silently training a
 * different model than the checkpoint describes is the worst failure. RoPE
 * theta is always taken from the file, never from a flavor. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/fs.h"
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

int lm_layer_is_moe(const lm_config *c, int l) {
    if (c->n_experts <= 0) return 0;
    for (int i = 0; i < c->n_mlp_only; i++)
        if (c->mlp_only_layers[i] == l) return 0;
    return (l + 1) % c->decoder_sparse_step == 0;
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
    if (c->head_dim % 2) return ct_fail(e, CT_ERR_CONFIG, "%s: head_dim must be even for RoPE, got %d", where, c->head_dim);
    if (!(c->rope_theta > 0)) return ct_fail(e, CT_ERR_CONFIG, "%s: rope_theta must be positive", where);
    if (!(c->rms_eps > 0)) return ct_fail(e, CT_ERR_CONFIG, "%s: rms_norm_eps must be positive", where);
    if (c->n_experts < 0) return ct_fail(e, CT_ERR_CONFIG, "%s: num_experts must be >= 0, got %d", where, c->n_experts);
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

/* An integer field: required unless def_ok, then *out keeps its default. */
static int json_int(const cJSON *root, const char *key, int *out, int required, const char *path, ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) {
        if (required) return ct_fail(e, CT_ERR_CONFIG, "%s: missing required key \"%s\"", path, key);
        return 0;
    }
    double v = it->valuedouble;
    if (!cJSON_IsNumber(it) || v != floor(v) || v < -2147483648.0 || v > 2147483647.0)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be an integer", path, key);
    *out = (int)v;
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

/* The qwen3_moe keys, with Qwen3MoeConfig's defaults. */
static int moe_config_from_json(lm_config *c, const cJSON *root, const char *path, ct_err *e) {
    int rc;
    c->n_experts = 128;
    c->top_k = 8;
    c->moe_intermediate = 768;
    c->norm_topk_prob = 0;
    c->decoder_sparse_step = 1;
    c->output_router_logits = 0;
    c->router_aux_loss_coef = 0.001;
    /* transformers writes num_local_experts (its attribute_map), Qwen's files num_experts */
    const char *ek = cJSON_GetObjectItemCaseSensitive(root, "num_local_experts") ? "num_local_experts" : "num_experts";
    if ((rc = json_int(root, ek, &c->n_experts, 0, path, e)) ||
        (rc = json_int(root, "num_experts_per_tok", &c->top_k, 0, path, e)) ||
        (rc = json_int(root, "moe_intermediate_size", &c->moe_intermediate, 0, path, e)) ||
        (rc = json_bool(root, "norm_topk_prob", &c->norm_topk_prob, path, e)) ||
        (rc = json_int(root, "decoder_sparse_step", &c->decoder_sparse_step, 0, path, e)) ||
        (rc = json_bool(root, "output_router_logits", &c->output_router_logits, path, e)) ||
        (rc = json_float(root, "router_aux_loss_coef", &c->router_aux_loss_coef, path, e)))
        return rc;
    if (c->n_experts < 1)
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" = %d: a qwen3_moe model needs at least one expert", path, ek,
                       c->n_experts);
    const cJSON *mo = cJSON_GetObjectItemCaseSensitive(root, "mlp_only_layers");
    if (mo && !cJSON_IsNull(mo)) {
        if (!cJSON_IsArray(mo))
            return ct_fail(e, CT_ERR_CONFIG, "%s: \"mlp_only_layers\" must be a list of layer indices", path);
        const cJSON *it;
        cJSON_ArrayForEach(it, mo) {
            if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble))
                return ct_fail(e, CT_ERR_CONFIG, "%s: \"mlp_only_layers\" must hold integers", path);
            if (c->n_mlp_only == LM_MAX_MLP_ONLY)
                return ct_fail(e, CT_ERR_CONFIG, "%s: \"mlp_only_layers\" has more than %d entries", path,
                               LM_MAX_MLP_ONLY);
            c->mlp_only_layers[c->n_mlp_only++] = (int)it->valuedouble;
        }
    }
    return 0;
}

int lm_config_from_hf(lm_config *c, const char *dir, ct_err *e) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len = 0;
    char *text = ct_read_file(path, &len, NULL);
    if (!text) return ct_fail(e, CT_ERR_CONFIG, "%s: cannot read (model.hf_assets_path = \"%s\")", path, dir);
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return ct_fail(e, CT_ERR_CONFIG, "%s: not a valid JSON object", path);
    }
    int rc = 0;
    memset(c, 0, sizeof *c);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) {
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: missing \"model_type\"", path);
        goto done;
    }
    int moe = strcmp(mt->valuestring, "qwen3_moe") == 0;
    if (strcmp(mt->valuestring, "qwen3") != 0 && !moe) {
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: model_type \"%s\" is not supported here (expected \"qwen3\" or \"qwen3_moe\")", path,
                     mt->valuestring);
        goto done;
    }
    /* Defaults are Qwen3Config's (Qwen3MoeConfig's) for the optional keys.
     * Qwen3MoeConfig has no head_dim of its own: its attention and RoPE take
     * getattr(config, "head_dim", hidden_size // num_attention_heads), so an
     * absent head_dim is hidden / heads there (-1 marks "absent" until the
     * sizes are read). */
    c->n_kv_heads = moe ? 4 : -1;
    c->head_dim = moe ? -1 : 128;
    c->max_pos = 32768;
    c->rms_eps = 1e-6;
    c->rope_theta = 10000.0;
    c->tie_embeddings = 0;
    if ((rc = json_int(root, "vocab_size", &c->vocab_size, 1, path, e)) ||
        (rc = json_int(root, "hidden_size", &c->hidden, 1, path, e)) ||
        (rc = json_int(root, "intermediate_size", &c->intermediate, 1, path, e)) ||
        (rc = json_int(root, "num_hidden_layers", &c->n_layers, 1, path, e)) ||
        (rc = json_int(root, "num_attention_heads", &c->n_heads, 1, path, e)) ||
        (rc = json_int(root, "num_key_value_heads", &c->n_kv_heads, 0, path, e)) ||
        (rc = json_int(root, "head_dim", &c->head_dim, 0, path, e)) ||
        (rc = json_int(root, "max_position_embeddings", &c->max_pos, 0, path, e)) ||
        (rc = json_float(root, "rms_norm_eps", &c->rms_eps, path, e)) ||
        (rc = json_float(root, "rope_theta", &c->rope_theta, path, e)) ||
        (rc = json_bool(root, "tie_word_embeddings", &c->tie_embeddings, path, e)))
        goto done;
    if (c->n_kv_heads == -1) c->n_kv_heads = c->n_heads;
    if (c->head_dim == -1) c->head_dim = c->n_heads > 0 ? c->hidden / c->n_heads : 0;
    if (moe && (rc = moe_config_from_json(c, root, path, e))) goto done;
    /* transformers v5 moved theta into rope_parameters; it wins when present. */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (!rp || cJSON_IsNull(rp)) rp = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (rp && !cJSON_IsNull(rp)) {
        if (!cJSON_IsObject(rp)) {
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be an object", path, rp->string);
            goto done;
        }
        if ((rc = json_float(rp, "rope_theta", &c->rope_theta, path, e))) goto done;
        const cJSON *rt = cJSON_GetObjectItemCaseSensitive(rp, "rope_type");
        if (!rt) rt = cJSON_GetObjectItemCaseSensitive(rp, "type");
        if (rt && !(cJSON_IsString(rt) && strcmp(rt->valuestring, "default") == 0)) {
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: %s.rope_type \"%s\" is not supported (only \"default\")", path,
                         rp->string, cJSON_IsString(rt) ? rt->valuestring : "?");
            goto done;
        }
    }
    int flag = 0;
    if ((rc = json_bool(root, "attention_bias", &flag, path, e))) goto done;
    if (flag) {
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: attention_bias = true is not supported", path);
        goto done;
    }
    flag = 0;
    if ((rc = json_bool(root, "use_sliding_window", &flag, path, e))) goto done;
    if (flag) {
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: use_sliding_window = true is not supported", path);
        goto done;
    }
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (act && !(cJSON_IsString(act) && strcmp(act->valuestring, "silu") == 0)) {
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: hidden_act must be \"silu\"", path);
        goto done;
    }
    snprintf(c->name, sizeof c->name, "hf");
    rc = lm_config_check(c, path, e);
done:
    cJSON_Delete(root);
    return rc;
}

int lm_config_write_hf(const lm_config *c, const char *path, const char *dtype_name, ct_err *e) {
    cJSON *o = cJSON_CreateObject();
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    int moe = c->n_experts > 0;
    cJSON_AddItemToArray(arch, cJSON_CreateString(moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"));
    cJSON_AddStringToObject(o, "model_type", moe ? "qwen3_moe" : "qwen3");
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(o, "hidden_size", c->hidden);
    cJSON_AddNumberToObject(o, "intermediate_size", c->intermediate);
    cJSON_AddNumberToObject(o, "num_hidden_layers", c->n_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", c->n_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", c->n_kv_heads);
    cJSON_AddNumberToObject(o, "head_dim", c->head_dim);
    cJSON_AddStringToObject(o, "hidden_act", "silu");
    cJSON_AddNumberToObject(o, "max_position_embeddings", c->max_pos);
    cJSON_AddNumberToObject(o, "rms_norm_eps", c->rms_eps);
    cJSON_AddNumberToObject(o, "rope_theta", c->rope_theta);
    cJSON *rp = cJSON_AddObjectToObject(o, "rope_parameters");
    cJSON_AddStringToObject(rp, "rope_type", "default");
    cJSON_AddNumberToObject(rp, "rope_theta", c->rope_theta);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_embeddings);
    cJSON_AddBoolToObject(o, "attention_bias", 0);
    cJSON_AddNumberToObject(o, "attention_dropout", 0);
    cJSON_AddBoolToObject(o, "use_sliding_window", 0);
    cJSON_AddBoolToObject(o, "use_cache", 1);
    cJSON_AddNumberToObject(o, "initializer_range", 0.02);
    cJSON_AddStringToObject(o, "dtype", dtype_name);
    if (moe) {
        cJSON_AddNumberToObject(o, "num_experts", c->n_experts);
        cJSON_AddNumberToObject(o, "num_experts_per_tok", c->top_k);
        cJSON_AddNumberToObject(o, "moe_intermediate_size", c->moe_intermediate);
        cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk_prob);
        cJSON_AddNumberToObject(o, "decoder_sparse_step", c->decoder_sparse_step);
        cJSON *mo = cJSON_AddArrayToObject(o, "mlp_only_layers");
        for (int i = 0; i < c->n_mlp_only; i++) cJSON_AddItemToArray(mo, cJSON_CreateNumber(c->mlp_only_layers[i]));
        cJSON_AddBoolToObject(o, "output_router_logits", c->output_router_logits);
        cJSON_AddNumberToObject(o, "router_aux_loss_coef", c->router_aux_loss_coef);
    }
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    int rc = 0;
    FILE *f = fopen(path, "wb");
    if (!f || fputs(text, f) < 0 || fputc('\n', f) < 0) rc = ct_fail(e, CT_ERR_IO, "%s: cannot write", path);
    if (f && fclose(f) != 0 && !rc) rc = ct_fail(e, CT_ERR_IO, "%s: cannot write", path);
    free(text);
    return rc;
}
