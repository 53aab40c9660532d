/* model/rope.c: RoPE parameters from config.json and their frequencies,
 * exactly as transformers 5.24 resolves and computes them.
 *
 * Design. Resolution and arithmetic are split. rope_params_from_hf applies
 * every config-time rule once (family defaults, legacy spellings, the
 * precedence between rope_scaling and rope_parameters, the values
 * transformers' standardize_rope_params fills in or overrides) and leaves a
 * flat, pointer-free rope_params; rope_inv_freq is then pure arithmetic.
 * Where transformers would accept a config only to fail (or to silently
 * ignore what it says) when the model is built, we refuse it here, naming
 * the key: a config we cannot reproduce must never train a different model.
 *
 * The rules, from transformers 5.24 (the file and function that hold each):
 *
 *  - Which dict (PreTrainedConfig.convert_rope_params_to_dict, Phi3Config's
 *    override): `rope_scaling or rope_parameters`. A non-empty legacy
 *    rope_scaling REPLACES rope_parameters wholesale, rope_theta inside
 *    rope_parameters included; an empty or null one does not count.
 *    Gemma3TextConfig instead keeps rope_parameters nested per layer type
 *    and, when rope_scaling is not null, merges it into full_attention
 *    (dict.update: rope_scaling's keys win, the others stay).
 *  - rope_type: the dict's rope_type, else its legacy `type`, else "default"
 *    (standardize_rope_params). Where both are given and differ, transformers
 *    takes rope_type; we refuse (the Gemma3 case where that silently drops a
 *    legacy {"type": "linear"} is the one that happens).
 *  - rope_theta: the dict's, else the top-level rope_theta, else the
 *    family's default_theta (1e6 for mixtral, 1e4 for the rest); Gemma3:
 *    top-level rope_theta (default 1e6) for full_attention,
 *    rope_local_base_freq (default 1e4) for sliding_attention; Olmo3 (nested
 *    as Gemma3): top-level rope_theta for full_attention only, sliding_attention
 *    its entry's or default_theta 5e5 (Olmo3Config pops the key for the first).
 *  - partial_rotary_factor: the dict's, else the top-level one, else 1
 *    (GlmConfig's 0.5 for glm and glm4). Phi3's and GLM's default RoPE and
 *    every scaled type's init function read it; the
 *    other families' default RoPE
 *    (<Family>RotaryEmbedding.compute_default_rope_parameters) rotates the
 *    whole head whatever it says, so it resolves to 1 there (the value
 *    given is kept in partial_rotary_factor_given for the export).
 *  - original_max_position_embeddings (yarn, llama3, longrope): Phi3 always
 *    takes its top-level attribute (default 4096), whatever the dict says;
 *    the other families take a top-level one when config.json has it (the
 *    rope init functions re-run standardize_rope_params once it is an
 *    attribute), else the dict's, else max_position_embeddings.
 *  - Phi3: legacy rope types "su" and "yarn" mean longrope; only default and
 *    longrope pass its validate_rope; "su" must carry the key itself.
 *  - yarn's `truncate` is read from config.rope_parameters, which for
 *    Gemma3 and Olmo3 is the nested dict: it is always true there.
 *  - Validation raises only for missing required keys (and odd heads); a
 *    factor below 1 or a wrong list length only warns, and the latter then
 *    fails in the model. We refuse non-numbers, non-positive values, list
 *    lengths other than rotary_dim / 2, odd rotary dims, and anything whose
 *    frequencies are not finite.
 *
 * Rounding: transformers computes the frequencies in float32 tensors
 * (arange in int64 or float32 -> float32, Python floats entering a float32
 * op rounded to float32) and the scalar parts (YaRN's correction range,
 * every attention factor, dynamic's theta when seq_len is a Python int) in
 * Python doubles. rope_inv_freq mirrors that operation by operation; the
 * values are float32 numbers returned as doubles, within an ulp or two of
 * torch's (whose pow/exp kernels differ from libm's by that much).
 * Dynamic NTK above the original length is the one place the rounding of
 * the base matters: transformers computes it from a tensor seq_len, so in
 * float32. */
#include "model/rope.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "formats/json.h"

#define ROPE_TYPES "default, linear, dynamic, yarn, llama3, longrope"
static const char *const type_names[] = {"default", "linear", "dynamic", "yarn", "llama3", "longrope"};

const char *rope_type_name(int type) {
    return type >= 0 && type < (int)(sizeof type_names / sizeof type_names[0]) ? type_names[type] : "?";
}

int rope_rotary_dim(const rope_params *p, int head_dim) {
    return (int)(head_dim * p->partial_rotary_factor); /* Python's int(head_dim * factor) */
}

/* The RoPE dict being read: an overlay searched first (Gemma3's rope_scaling
 * merged into full_attention), then the dict itself; either may be NULL. */
typedef struct {
    const cJSON *d[2];
    const char *name[2];
    const char *path;
    ct_err *e;
} rdict;

static const cJSON *rd_get(const rdict *r, const char *key, const char **where) {
    for (int i = 0; i < 2; i++) {
        if (!r->d[i]) continue;
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(r->d[i], key);
        if (it) {
            if (where) *where = r->name[i];
            return it;
        }
    }
    return NULL;
}

/* A number from the dict: 0 with *found = 0 when absent, or null and
 * null_ok (transformers' `.get(key)` is None there); else it must be a number. */
static int rd_num(const rdict *r, const char *key, int null_ok, int *found, double *out) {
    const char *where = "";
    const cJSON *it = rd_get(r, key, &where);
    *found = 0;
    if (!it || (null_ok && cJSON_IsNull(it))) return 0;
    if (!cJSON_IsNumber(it))
        return ct_fail(r->e, CT_ERR_CONFIG, "%s: %s.%s must be a number", r->path, where, key);
    *out = it->valuedouble;
    *found = 1;
    return 0;
}

/* A required key of the rope type, as _check_received_keys demands it. */
static int rd_require(const rdict *r, const char *key, const char *type) {
    if (rd_get(r, key, NULL)) return 0;
    return ct_fail(r->e, CT_ERR_CONFIG, "%s: %s is missing \"%s\", required for rope_type \"%s\"", r->path,
                   r->d[1] ? r->name[1] : r->name[0], key, type);
}

static int rd_positive(const rdict *r, const char *key, double v) {
    if (v > 0 && isfinite(v)) return 0;
    const char *where = "";
    rd_get(r, key, &where);
    return ct_fail(r->e, CT_ERR_CONFIG, "%s: %s.%s must be positive, got %g", r->path, where, key, v);
}

/* A top-level number: *found = 0 when absent or null. */
static int top_num(const cJSON *root, const char *key, int null_ok, int *found, double *out, const char *path,
                   ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    *found = 0;
    if (!it || (null_ok && cJSON_IsNull(it))) return 0;
    if (!cJSON_IsNumber(it)) return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be a number", path, key);
    *out = it->valuedouble;
    *found = 1;
    return 0;
}

static int as_int(double v, int *out) {
    if (!(v == floor(v)) || v < 1 || v > 2147483647.0) return 0;
    *out = (int)v;
    return 1;
}

/* A top-level config.json field the model's config class declares int: written
 * as an integer (4096, not 4096.0), as transformers' strict dataclass checks
 * refuse a float there ("expected int, got float"). Inside the RoPE dict,
 * transformers takes 4096.0 (and llama3 only warns), so as_int serves there. */
static int as_top_int(const cJSON *it, int *out) {
    return it && json_is_integer(it) && as_int(it->valuedouble, out);
}

/* A RoPE dict value: an object, or null / absent (NULL). */
static int dict_item(const cJSON *root, const char *key, const cJSON **out, const char *path, ct_err *e) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    *out = NULL;
    if (!it || cJSON_IsNull(it)) return 0;
    if (!cJSON_IsObject(it)) return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" must be an object or null", path, key);
    *out = it;
    return 0;
}

static int is_layer_key(const char *k) { return !strcmp(k, "full_attention") || !strcmp(k, "sliding_attention"); }

static int read_factors(const rdict *r, const char *key, int n, double *out) {
    const char *where = "";
    const cJSON *a = rd_get(r, key, &where);
    if (!cJSON_IsArray(a))
        return ct_fail(r->e, CT_ERR_CONFIG, "%s: %s.%s must be a list of numbers", r->path, where, key);
    int len = cJSON_GetArraySize(a);
    if (len != n)
        return ct_fail(r->e, CT_ERR_CONFIG, "%s: %s.%s must have rotary_dim / 2 = %d entries, got %d", r->path,
                       where, key, n, len);
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, a) {
        if (!cJSON_IsNumber(it) || !(it->valuedouble > 0) || !isfinite(it->valuedouble))
            return ct_fail(r->e, CT_ERR_CONFIG, "%s: %s.%s[%d] must be a positive number", r->path, where, key, i);
        out[i++] = it->valuedouble;
    }
    return 0;
}

/* What the stages of rope_params_from_hf share: the request, the dict found
 * and what the earlier stages resolved. Each stage reads what those before it
 * left and fills its own fields of p, in the order transformers checks them,
 * so that the first problem is the one reported. */
typedef struct {
    rope_params *p;
    const cJSON *root;
    const rope_family *fam;
    const char *layer_type; /* NULL: one RoPE for all layers */
    int head_dim;
    const char *path;
    ct_err *e;
    rdict r;                /* the RoPE dict (Gemma3: with rope_scaling overlaid) */
    char entry_name[64];    /* Gemma3: "rope_parameters.<layer type>", r's name for the entry */
    int synth_default;      /* Gemma3, Olmo3: transformers' own {"rope_type": "default"} stands for the entry */
    const char *dname;      /* the dict's name for messages */
    const char *type;       /* the rope type as resolved (Phi3's legacy names mapped) */
    const char *type_where; /* the dict and key that gave it, for messages */
    const char *type_key;
    int top_orig, has_top_orig; /* top-level original_max_position_embeddings (Phi3: default 4096) */
    int orig_from_top;          /* standardize_rope_params sets it from the attribute */
    int dim;                    /* the rotary dimension */
} rope_read;

/* The request itself: a config.json object of a family with RoPE rules, a
 * layer type where the family needs one, a head that can rotate. */
static int check_request(const cJSON *root, const char *layer_type, int head_dim, const char *path,
                         rope_family *fam, ct_err *e) {
    if (!cJSON_IsObject(root)) return ct_fail(e, CT_ERR_CONFIG, "%s: not a JSON object", path);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) return ct_fail(e, CT_ERR_CONFIG, "%s: missing \"model_type\"", path);
    if (lm_family_rope(mt->valuestring, fam))
        return ct_fail(e, CT_ERR_CONFIG, "%s: model_type \"%s\": no RoPE rules for it (not a supported family)", path,
                       mt->valuestring);
    if (layer_type && strcmp(layer_type, "full_attention") && strcmp(layer_type, "sliding_attention"))
        return ct_fail(e, CT_ERR_CONFIG, "%s: layer type \"%s\" has no RoPE (expected full_attention or sliding_attention)",
                       path, layer_type);
    if (rope_style_nested(fam->style) && !layer_type)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %s has one RoPE per layer type: ask for full_attention or sliding_attention", path,
                       fam->model_type);
    if (head_dim < 2) return ct_fail(e, CT_ERR_CONFIG, "%s: head_dim must be at least 2 for RoPE, got %d", path, head_dim);
    return 0;
}

/* max_position_embeddings: dynamic's reference length, the default original length */
static int read_max_pos(rope_read *s) {
    int rc, found;
    double v;
    s->p->max_pos = s->fam->max_pos;
    if ((rc = top_num(s->root, "max_position_embeddings", 0, &found, &v, s->path, s->e))) return rc;
    if (found && !as_top_int(cJSON_GetObjectItemCaseSensitive(s->root, "max_position_embeddings"), &s->p->max_pos))
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: \"max_position_embeddings\" must be a positive integer%s", s->path,
                       as_int(v, &(int){0}) ? ", written without a fraction (not as a float)" : "");
    return 0;
}

/* Gemma3: rope_parameters nested per layer type, the layer type's entry read,
 * rope_scaling overlaid on full_attention's. */
static int find_gemma3_dict(rope_read *s, const cJSON *rs, const cJSON *rp) {
    const cJSON *ent = NULL;
    if (rp) {
        const cJSON *it;
        cJSON_ArrayForEach(it, rp) {
            if (!is_layer_key(it->string) || !(cJSON_IsObject(it) || cJSON_IsNull(it)))
                return ct_fail(s->e, CT_ERR_CONFIG,
                               "%s: %s reads rope_parameters nested per layer type "
                               "({\"full_attention\": {...}, \"sliding_attention\": {...}}); key \"%s\" is not one "
                               "(transformers 5.24 ignores a flat dict here)",
                               s->path, s->fam->model_type, it->string);
        }
        ent = cJSON_GetObjectItemCaseSensitive(rp, s->layer_type);
        if (ent && cJSON_IsNull(ent)) ent = NULL;
        /* Gemma3TextConfig, Olmo3Config: rope_parameters["full_attention"].update(rope_scaling) */
        if (rs && !strcmp(s->layer_type, "full_attention") && !ent)
            return ct_fail(s->e, CT_ERR_CONFIG,
                           "%s: rope_scaling beside a rope_parameters without a full_attention entry "
                           "(transformers 5.24 fails on it)",
                           s->path);
    }
    snprintf(s->entry_name, sizeof s->entry_name, "rope_parameters.%s", s->layer_type);
    s->r.d[1] = ent;
    s->r.name[1] = s->entry_name;
    s->synth_default = !ent;
    if (rs && !strcmp(s->layer_type, "full_attention")) {
        s->r.d[0] = rs;
        s->r.name[0] = "rope_scaling";
    }
    return 0;
}

/* The other families: `rope_scaling or rope_parameters`, one flat dict for all layers. */
static int find_flat_dict(rope_read *s, const cJSON *rs, const cJSON *rp) {
    /* a non-empty legacy dict wins wholesale */
    if (rs && rs->child) {
        s->r.d[1] = rs;
        s->r.name[1] = "rope_scaling";
    } else {
        s->r.d[1] = rp;
        s->r.name[1] = "rope_parameters";
    }
    if (s->r.d[1]) {
        const cJSON *it;
        cJSON_ArrayForEach(it, s->r.d[1]) {
            if (is_layer_key(it->string) && cJSON_IsObject(it))
                return ct_fail(s->e, CT_ERR_CONFIG,
                               "%s: %s is nested per layer type (\"%s\"), but %s has one RoPE for all layers", s->path,
                               s->r.name[1], it->string, s->fam->model_type);
        }
    }
    return 0;
}

/* The dict, with its name for messages. */
static int find_dict(rope_read *s) {
    int rc;
    const cJSON *rs, *rp;
    if ((rc = dict_item(s->root, "rope_scaling", &rs, s->path, s->e)) ||
        (rc = dict_item(s->root, "rope_parameters", &rp, s->path, s->e)))
        return rc;
    int nested = rope_style_nested(s->fam->style);
    rc = nested ? find_gemma3_dict(s, rs, rp) : find_flat_dict(s, rs, rp);
    if (rc) return rc;
    s->dname = s->r.d[1] ? s->r.name[1] : (s->r.d[0] ? s->r.name[0] : "rope_parameters");
    return 0;
}

/* rope_type, else the legacy type, else default */
static int read_type(rope_read *s) {
    const char *rt_where = "", *ty_where = "";
    const cJSON *rt = rd_get(&s->r, "rope_type", &rt_where), *ty = rd_get(&s->r, "type", &ty_where);
    if (rt && !cJSON_IsString(rt))
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: %s.rope_type must be a string", s->path, rt_where);
    if (ty && !cJSON_IsString(ty))
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: %s.type must be a string", s->path, ty_where);
    const char *type = rt ? rt->valuestring : NULL;
    if (!type && s->synth_default && ty) {
        /* the entry transformers made up has rope_type "default": a legacy type is dropped */
        return ct_fail(s->e, CT_ERR_CONFIG,
                       "%s: %s.type \"%s\" is ignored by transformers 5.24 for %s (%s keeps its rope_type "
                       "\"default\"); write rope_type instead",
                       s->path, ty_where, ty->valuestring, s->fam->model_type, s->entry_name);
    }
    if (type && ty && strcmp(type, ty->valuestring))
        return ct_fail(s->e, CT_ERR_CONFIG,
                       "%s: %s.rope_type \"%s\" and %s.type \"%s\" disagree (transformers 5.24 takes rope_type); "
                       "keep one",
                       s->path, rt_where, type, ty_where, ty->valuestring);
    s->type = type ? type : ty ? ty->valuestring : "default";
    s->type_where = rt ? rt_where : (ty ? ty_where : s->dname);
    s->type_key = rt ? "rope_type" : "type";
    return 0;
}

/* top-level original_max_position_embeddings (Phi3: always an attribute, default 4096) */
static int read_top_original(rope_read *s) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(s->root, "original_max_position_embeddings");
    if (it) {
        if (!as_top_int(it, &s->top_orig))
            return ct_fail(s->e, CT_ERR_CONFIG, "%s: \"original_max_position_embeddings\" must be a positive integer%s",
                           s->path,
                           cJSON_IsNumber(it) && as_int(it->valuedouble, &(int){0})
                               ? ", written without a fraction (not as a float)"
                               : "");
        s->has_top_orig = 1;
    } else if (s->fam->style == ROPE_STYLE_PHI3) {
        s->top_orig = 4096, s->has_top_orig = 1;
    }
    return 0;
}

/* Phi3's rules: the legacy names su and yarn mean longrope, only default and
 * longrope pass its validate_rope, the original length is its attribute. */
static int phi3_type(rope_read *s) {
    /* standardize runs before Phi3 renames su / yarn, so "su" keeps only its own key */
    if (!strcmp(s->type, "yarn") || !strcmp(s->type, "longrope") || !strcmp(s->type, "llama3")) s->orig_from_top = 1;
    if (!strcmp(s->type, "su")) {
        if (!rd_get(&s->r, "original_max_position_embeddings", NULL))
            return ct_fail(s->e, CT_ERR_CONFIG,
                           "%s: %s is missing \"original_max_position_embeddings\", required for rope_type "
                           "\"longrope\" (legacy \"su\")",
                           s->path, s->dname);
        s->orig_from_top = 1;
    }
    if (!strcmp(s->type, "su") || !strcmp(s->type, "yarn")) s->type = "longrope";
    if (strcmp(s->type, "default") && strcmp(s->type, "longrope"))
        return ct_fail(s->e, CT_ERR_CONFIG,
                       "%s: %s.%s \"%s\" is not supported for phi3 (transformers 5.24 accepts default and "
                       "longrope; su and yarn are legacy names of longrope)",
                       s->path, s->type_where, s->type_key, s->type);
    return 0;
}

/* The type name to ROPE_*, then what the family's config class cannot build. */
static int resolve_type(rope_read *s) {
    rope_params *p = s->p;
    if (s->fam->style == ROPE_STYLE_PHI3) {
        int rc = phi3_type(s);
        if (rc) return rc;
    } else if (s->fam->style == ROPE_STYLE_GENERIC && s->has_top_orig) {
        s->orig_from_top = 1;
    }

    p->type = -1;
    for (int i = 0; i < (int)(sizeof type_names / sizeof type_names[0]); i++)
        if (!strcmp(s->type, type_names[i])) p->type = i;
    if (p->type < 0)
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: %s.%s \"%s\" is not supported (supported: " ROPE_TYPES ")", s->path,
                       s->type_where, s->type_key, s->type);

    if (s->fam->head_dim_none && (p->type == ROPE_DYNAMIC || p->type == ROPE_YARN || p->type == ROPE_LONGROPE)) {
        const cJSON *hd = cJSON_GetObjectItemCaseSensitive(s->root, "head_dim");
        if (!hd || cJSON_IsNull(hd))
            return ct_fail(s->e, CT_ERR_CONFIG,
                           "%s: %s RoPE reads config.head_dim, which %s leaves null without a \"head_dim\" key "
                           "(transformers 5.24 fails on it); give head_dim",
                           s->path, s->type, s->fam->model_type);
    }
    return 0;
}

/* required keys (_validate_<type>_rope_parameters) */
static int require_keys(rope_read *s) {
    const rdict *r = &s->r;
    const char *type = s->type;
    int rc;
    switch (s->p->type) {
    case ROPE_LINEAR:
    case ROPE_DYNAMIC:
    case ROPE_YARN:
        return rd_require(r, "factor", type);
    case ROPE_LLAMA3:
        if ((rc = rd_require(r, "factor", type)) || (rc = rd_require(r, "low_freq_factor", type))) return rc;
        return rd_require(r, "high_freq_factor", type);
    case ROPE_LONGROPE:
        if ((rc = rd_require(r, "short_factor", type))) return rc;
        return rd_require(r, "long_factor", type);
    }
    return 0;
}

/* rope_theta: the dict's, else the top-level one (Gemma3 sliding: rope_local_base_freq), else the default */
static int read_theta(rope_read *s) {
    rope_params *p = s->p;
    int rc, found;
    double v;
    if ((rc = rd_num(&s->r, "rope_theta", 0, &found, &p->theta))) return rc;
    if (found) return rd_positive(&s->r, "rope_theta", p->theta);
    int sliding = s->layer_type && !strcmp(s->layer_type, "sliding_attention");
    int local = s->fam->style == ROPE_STYLE_GEMMA3 && sliding;
    /* Olmo3Config: kwargs.pop("rope_theta") fills full_attention, so the sliding
     * entry's setdefault finds it gone and takes default_theta */
    if (s->fam->style == ROPE_STYLE_OLMO3 && sliding) {
        p->theta = s->fam->theta; /* default_theta */
        return 0;
    }
    const char *theta_key = local ? "rope_local_base_freq" : "rope_theta";
    p->theta = local ? s->fam->theta_local : s->fam->theta;
    if ((rc = top_num(s->root, theta_key, 0, &found, &v, s->path, s->e))) return rc;
    if (found) {
        if (!(v > 0) || !isfinite(v))
            return ct_fail(s->e, CT_ERR_CONFIG, "%s: \"%s\" must be positive, got %g", s->path, theta_key, v);
        p->theta = v;
    }
    return 0;
}

/* partial_rotary_factor: the dict's, else the top-level one (null: absent), else 1
 * (GLM: 0.5). Read and checked for every family and type, and kept as given for
 * the export; only Phi3's and GLM's RoPE and the scaled types read it (the other
 * families' default RoPE rotates whole heads whatever it says, so there it
 * resolves to 1; lm_config refuses the scaled types outside Phi3). A
 * null inside the dict is refused where the factor is read: transformers'
 * int(head_dim * None) fails there. */
static int read_partial_factor(rope_read *s) {
    rope_params *p = s->p;
    int rc, found;
    double v;
    int glm = s->fam->style == ROPE_STYLE_GLM;
    int prf_read = p->type != ROPE_DEFAULT || s->fam->style == ROPE_STYLE_PHI3 || glm;
    p->partial_rotary_factor = glm ? 0.5 : 1.0; /* GlmConfig's kwargs.setdefault */
    const char *pwhere = "";
    double prf = 1.0;
    if ((rc = rd_num(&s->r, "partial_rotary_factor", !prf_read, &found, &prf))) return rc;
    if (found) {
        rd_get(&s->r, "partial_rotary_factor", &pwhere);
    } else {
        if ((rc = top_num(s->root, "partial_rotary_factor", 1, &found, &v, s->path, s->e))) return rc;
        if (found) prf = v;
    }
    if (found) {
        if (!(prf > 0 && prf <= 1))
            return ct_fail(s->e, CT_ERR_CONFIG, "%s: %s%spartial_rotary_factor must be in (0, 1], got %g (model_type %s)",
                           s->path, pwhere, *pwhere ? "." : "", prf, s->fam->model_type);
        p->partial_rotary_factor_given = prf;
        if (prf_read) p->partial_rotary_factor = prf;
    }
    return 0;
}

/* The rotary dimension the factor leaves: even, within the tables, and above 2 for dynamic. */
static int check_rotary_dim(rope_read *s) {
    const rope_params *p = s->p;
    int dim = s->dim = rope_rotary_dim(p, s->head_dim);
    if (dim < 2 || dim % 2)
        return ct_fail(s->e, CT_ERR_CONFIG,
                       "%s: the rotary dimension int(head_dim %d * partial_rotary_factor %g) = %d must be even and "
                       "at least 2 (model_type %s)",
                       s->path, s->head_dim, p->partial_rotary_factor, dim, s->fam->model_type);
    if (dim / 2 > ROPE_MAX_HALF)
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: rotary dimension %d is over %d", s->path, dim, 2 * ROPE_MAX_HALF);
    if (p->type == ROPE_DYNAMIC && dim == 2)
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: dynamic RoPE needs a rotary dimension above 2 (it divides by dim - 2)",
                       s->path);
    return 0;
}

/* original_max_position_embeddings: yarn's, llama3's and longrope's; max_pos for the rest */
static int read_original(rope_read *s) {
    rope_params *p = s->p;
    int rc, found;
    double v;
    p->original_max_pos = p->max_pos;
    if (p->type != ROPE_YARN && p->type != ROPE_LLAMA3 && p->type != ROPE_LONGROPE) return 0;
    if (s->orig_from_top) {
        p->original_max_pos = s->top_orig;
        return 0;
    }
    if ((rc = rd_num(&s->r, "original_max_position_embeddings", 0, &found, &v))) return rc;
    if (found && !as_int(v, &p->original_max_pos)) {
        const char *where = "";
        rd_get(&s->r, "original_max_position_embeddings", &where);
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: %s.original_max_position_embeddings must be a positive integer",
                       s->path, where);
    }
    return 0;
}

/* factor: required for linear, dynamic, llama3; yarn's may be null and
 * longrope's absent, both then max_position_embeddings / original */
static int read_factor(rope_read *s) {
    rope_params *p = s->p;
    int rc, found;
    p->factor = 1.0;
    if (p->type == ROPE_DEFAULT) return 0;
    int null_ok = p->type == ROPE_YARN || p->type == ROPE_LONGROPE;
    if ((rc = rd_num(&s->r, "factor", null_ok, &found, &p->factor))) return rc;
    if (found) return rd_positive(&s->r, "factor", p->factor);
    if (null_ok) p->factor = (double)p->max_pos / p->original_max_pos;
    return 0;
}

/* attention_factor (yarn, longrope): null or absent means transformers computes it */
static int read_attention_factor(rope_read *s) {
    rope_params *p = s->p;
    int rc;
    if ((rc = rd_num(&s->r, "attention_factor", 1, &p->has_attention_factor, &p->attention_factor))) return rc;
    if (p->has_attention_factor) return rd_positive(&s->r, "attention_factor", p->attention_factor);
    return 0;
}

static int read_yarn(rope_read *s) {
    rope_params *p = s->p;
    int rc, found;
    double v;
    if ((rc = read_attention_factor(s))) return rc;
    /* `get("beta_fast") or 32`: absent, null and 0 all mean the default */
    p->beta_fast = 32, p->beta_slow = 1;
    if ((rc = rd_num(&s->r, "beta_fast", 1, &found, &v))) return rc;
    if (found && v != 0) p->beta_fast = v;
    if ((rc = rd_num(&s->r, "beta_slow", 1, &found, &v))) return rc;
    if (found && v != 0) p->beta_slow = v;
    if ((rc = rd_positive(&s->r, "beta_fast", p->beta_fast)) || (rc = rd_positive(&s->r, "beta_slow", p->beta_slow)))
        return rc;
    if ((rc = rd_num(&s->r, "mscale", 1, &found, &p->mscale)) ||
        (rc = rd_num(&s->r, "mscale_all_dim", 1, &found, &p->mscale_all_dim)))
        return rc;
    p->truncate = 1;
    const char *where = "";
    const cJSON *tr = rd_get(&s->r, "truncate", &where);
    if (tr && !rope_style_nested(s->fam->style)) {
        if (cJSON_IsNull(tr))
            p->truncate = 0; /* `if truncate:` with None */
        else if (cJSON_IsBool(tr))
            p->truncate = cJSON_IsTrue(tr);
        else
            return ct_fail(s->e, CT_ERR_CONFIG, "%s: %s.truncate must be true or false", s->path, where);
    }
    if (p->theta == 1.0)
        return ct_fail(s->e, CT_ERR_CONFIG, "%s: yarn divides by log(rope_theta): it cannot be 1", s->path);
    return 0;
}

static int read_llama3(rope_read *s) {
    rope_params *p = s->p;
    int rc, found;
    if ((rc = rd_num(&s->r, "low_freq_factor", 0, &found, &p->low_freq_factor)) ||
        (rc = rd_num(&s->r, "high_freq_factor", 0, &found, &p->high_freq_factor)))
        return rc;
    if ((rc = rd_positive(&s->r, "low_freq_factor", p->low_freq_factor)) ||
        (rc = rd_positive(&s->r, "high_freq_factor", p->high_freq_factor)))
        return rc;
    if (p->high_freq_factor == p->low_freq_factor)
        return ct_fail(s->e, CT_ERR_CONFIG,
                       "%s: %s.high_freq_factor equals low_freq_factor (%g): llama3 RoPE divides by their difference",
                       s->path, s->dname, p->low_freq_factor);
    return 0;
}

static int read_longrope(rope_read *s) {
    rope_params *p = s->p;
    int rc;
    if ((rc = read_attention_factor(s))) return rc;
    p->n_factors = s->dim / 2;
    if ((rc = read_factors(&s->r, "short_factor", p->n_factors, p->short_factor))) return rc;
    return read_factors(&s->r, "long_factor", p->n_factors, p->long_factor);
}

/* HunYuanDenseV1RotaryEmbedding: a dynamic RoPE whose alpha is truthy is its
 * ntk_alpha type (the other families' dynamic never reads the key). */
static int read_ntk_alpha(rope_read *s) {
    int rc, found;
    double v = 0;
    if (strcmp(s->fam->model_type, "hunyuan_v1_dense")) return 0;
    if ((rc = rd_num(&s->r, "alpha", 1, &found, &v))) return rc;
    if (!found || v == 0) return 0;
    if ((rc = rd_positive(&s->r, "alpha", v))) return rc;
    s->p->alpha = v;
    return 0;
}

/* The keys only one type reads; linear and default have none beyond factor. */
static int read_type_keys(rope_read *s) {
    switch (s->p->type) {
    case ROPE_DYNAMIC: return read_ntk_alpha(s);
    case ROPE_YARN: return read_yarn(s);
    case ROPE_LLAMA3: return read_llama3(s);
    case ROPE_LONGROPE: return read_longrope(s);
    default: return 0;
    }
}

/* Whatever got through must give finite, positive frequencies at both lengths that matter. */
static int check_frequencies(const rope_read *s) {
    const rope_params *p = s->p;
    double inv[ROPE_MAX_HALF], att;
    int lens[2] = {1, (p->max_pos > p->original_max_pos ? p->max_pos : p->original_max_pos) + 1};
    for (int k = 0; k < 2; k++) {
        rope_inv_freq(p, s->head_dim, lens[k], inv, &att);
        int ok = att > 0 && isfinite(att);
        for (int i = 0; i < s->dim / 2 && ok; i++) ok = inv[i] > 0 && isfinite(inv[i]);
        if (!ok)
            return ct_fail(s->e, CT_ERR_CONFIG,
                           "%s: %s RoPE of %s gives non-finite or non-positive frequencies (rope_theta %g, factor %g)",
                           s->path, s->type, s->dname, p->theta, p->factor);
    }
    return 0;
}

/* The stages in transformers' order: the first rule a config breaks is the one named. */
int rope_params_from_hf(rope_params *p, const cJSON *root, const char *layer_type, int head_dim, const char *path,
                        ct_err *e) {
    int rc;
    memset(p, 0, sizeof *p);
    rope_family fam;
    if ((rc = check_request(root, layer_type, head_dim, path, &fam, e))) return rc;
    rope_read s = {.p = p, .root = root, .fam = &fam, .layer_type = layer_type, .head_dim = head_dim, .path = path,
                   .e = e, .r = {{NULL, NULL}, {"", ""}, path, e}};
    if ((rc = read_max_pos(&s))) return rc;
    if ((rc = find_dict(&s))) return rc;
    if ((rc = read_type(&s))) return rc;
    if ((rc = read_top_original(&s))) return rc;
    if ((rc = resolve_type(&s))) return rc;
    if ((rc = require_keys(&s))) return rc;
    if ((rc = read_theta(&s))) return rc;
    if ((rc = read_partial_factor(&s))) return rc;
    if ((rc = check_rotary_dim(&s))) return rc;
    if ((rc = read_original(&s))) return rc;
    if ((rc = read_factor(&s))) return rc;
    if ((rc = read_type_keys(&s))) return rc;
    return check_frequencies(&s);
}

/* ---------------------------------------------------------------- frequencies */

/* transformers' get_mscale (YaRN) */
static double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0; }

/* find_correction_dim: the dimension at which `rotations` turns fit in the original length */
static double yarn_dim(double rotations, int dim, double base, int orig) {
    return (dim * log(orig / (rotations * 2 * M_PI))) / (2 * log(base));
}

void rope_inv_freq(const rope_params *p, int head_dim, int seq_len, double *inv_freq, double *attn_scale) {
    int dim = rope_rotary_dim(p, head_dim), half = dim / 2;
    float fdim = (float)dim;
    double attn = 1.0;
    switch (p->type) {
    case ROPE_DEFAULT:
    case ROPE_LINEAR: {
        /* 1.0 / (base ** (arange(0, dim, 2).float() / dim)), then /= factor */
        float b = (float)p->theta, f = (float)p->factor;
        for (int i = 0; i < half; i++) {
            float x = 1.0f / powf(b, (float)(2 * i) / fdim);
            if (p->type == ROPE_LINEAR) x = x / f;
            inv_freq[i] = x;
        }
        break;
    }
    case ROPE_DYNAMIC: {
        if (p->alpha > 0) { /* HunYuan's ntk_alpha: base = theta * alpha ** (dim / (dim - 2)) in Python floats */
            float b = (float)(p->theta * pow(p->alpha, (double)dim / (dim - 2)));
            for (int i = 0; i < half; i++) inv_freq[i] = 1.0f / powf(b, (float)(2 * i) / fdim);
            break;
        }
        /* base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2)), seq_len
         * at least max_pos: a Python int at init (double arithmetic), the tensor
         * max(position_ids) + 1 once a forward outgrows max_pos (float32 arithmetic) */
        float b;
        double ex = (double)dim / (dim - 2);
        if (seq_len > p->max_pos) {
            float a = (float)p->factor * (float)seq_len;
            a = a / (float)p->max_pos;
            a = a - (float)(p->factor - 1.0);
            b = (float)p->theta * powf(a, (float)ex);
        } else {
            double s = p->max_pos;
            b = (float)(p->theta * pow(p->factor * s / p->max_pos - (p->factor - 1.0), ex));
        }
        for (int i = 0; i < half; i++) inv_freq[i] = 1.0f / powf(b, (float)(2 * i) / fdim);
        break;
    }
    case ROPE_YARN: {
        float b = (float)p->theta, f = (float)p->factor;
        double lo = yarn_dim(p->beta_fast, dim, p->theta, p->original_max_pos);
        double hi = yarn_dim(p->beta_slow, dim, p->theta, p->original_max_pos);
        if (p->truncate) lo = floor(lo), hi = ceil(hi);
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = dim - 1;
        if (lo == hi) hi += 0.001; /* linear_ramp_factor's guard */
        float flo = (float)lo, span = (float)(hi - lo);
        for (int i = 0; i < half; i++) {
            float pos = powf(b, (float)(2 * i) / fdim);
            float extra = 1.0f / pos, inter = 1.0f / (f * pos);
            float ramp = ((float)i - flo) / span;
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            float ef = 1.0f - ramp; /* inv_freq_extrapolation_factor */
            float a = inter * (1.0f - ef), c = extra * ef;
            inv_freq[i] = a + c;
        }
        if (p->has_attention_factor)
            attn = p->attention_factor;
        else if (p->mscale != 0 && p->mscale_all_dim != 0)
            attn = yarn_mscale(p->factor, p->mscale) / yarn_mscale(p->factor, p->mscale_all_dim);
        else
            attn = yarn_mscale(p->factor, 1.0);
        break;
    }
    case ROPE_LLAMA3: {
        float b = (float)p->theta, f = (float)p->factor;
        double low_wl = p->original_max_pos / p->low_freq_factor, high_wl = p->original_max_pos / p->high_freq_factor;
        float flow_wl = (float)low_wl, fhigh_wl = (float)high_wl; /* compared in float32 with the float32 tensor */
        float two_pi = (float)(2 * M_PI), forig = (float)p->original_max_pos, flow = (float)p->low_freq_factor;
        float fspan = (float)(p->high_freq_factor - p->low_freq_factor);
        for (int i = 0; i < half; i++) {
            float x = 1.0f / powf(b, (float)(2 * i) / fdim);
            float wl = two_pi / x;
            float xl = wl > flow_wl ? x / f : x;
            float s = (forig / wl - flow) / fspan;
            float a = (1.0f - s) * xl, sm = a / f, c = s * xl;
            sm = sm + c;
            int medium = !(wl < fhigh_wl) && !(wl > flow_wl);
            inv_freq[i] = medium ? sm : xl;
        }
        break;
    }
    case ROPE_LONGROPE: {
        float b = (float)p->theta;
        const double *ext = seq_len > p->original_max_pos ? p->long_factor : p->short_factor;
        for (int i = 0; i < half; i++) {
            float x = (float)ext[i] * powf(b, (float)(2 * i) / fdim);
            inv_freq[i] = 1.0f / x;
        }
        if (p->has_attention_factor)
            attn = p->attention_factor;
        else
            attn = p->factor <= 1.0 ? 1.0 : sqrt(1 + log(p->factor) / log((double)p->original_max_pos));
        break;
    }
    }
    *attn_scale = attn;
}

void rope_tables(float *cos, float *sin, int p0, int T, int half, const double *inv_freq, double attn_scale) {
    float s = (float)attn_scale; /* `emb.cos() * attention_scaling`, a float32 multiply */
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            float angle = (float)(p0 + t) * (float)inv_freq[i];
            float c = cosf(angle), sn = sinf(angle);
            if (attn_scale != 1.0) c *= s, sn *= s;
            cos[(size_t)t * half + i] = c;
            sin[(size_t)t * half + i] = sn;
        }
    }
}
