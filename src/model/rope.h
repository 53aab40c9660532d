/* model/rope.h: rotary position embeddings of any supported HF family, as
 * transformers 5.24 resolves and computes them.
 *
 * Why a module of its own: RoPE is where the HF families differ most in
 * small ways that change every logit (a theta default, a scaling type, a
 * legacy key spelling, a precedence rule between the legacy and the v5
 * form), and the rules live in three places of transformers
 * (modeling_rope_utils.py, configuration_utils.py and each family's config
 * class). Keeping them here, behind three calls, lets lm_config read any
 * family's config.json without learning them, and lets one oracle test
 * (tests/py/test_rope.py) pin every rule to the installed transformers.
 *
 *   rope_params_from_hf  config.json root + layer type -> rope_params (all
 *                        defaults, legacy names and precedence resolved)
 *   rope_inv_freq        rope_params + head_dim + sequence length ->
 *                        inv_freq[rotary_dim / 2] and the cos/sin multiplier
 *   rope_tables          inv_freq -> cos/sin tables [T, half], laid out and
 *                        rounded as op_rope_tables (kernels/ops.h)
 *
 * rope_params holds no pointers: a config struct holding it may be copied
 * by value. */
#ifndef CT_MODEL_ROPE_H
#define CT_MODEL_ROPE_H

#include "core/err.h"

struct cJSON;

enum { ROPE_DEFAULT, ROPE_LINEAR, ROPE_DYNAMIC, ROPE_YARN, ROPE_LLAMA3, ROPE_LONGROPE };

#define ROPE_MAX_HALF 256 /* rotary_dim / 2 at most */

typedef struct {
    int type;                   /* rope_type (legacy: type; Phi3's su and yarn are longrope) */
    double theta;               /* rope_theta (legacy: top-level rope_theta; Gemma3 sliding: rope_local_base_freq) */
    double factor;              /* factor; yarn / longrope without one: max_position_embeddings /
                                   original_max_position_embeddings, as transformers derives it */
    int original_max_pos;       /* original_max_position_embeddings (yarn, llama3, longrope), resolved */
    int max_pos;                /* max_position_embeddings: dynamic's threshold and reference length */
    int has_attention_factor;   /* attention_factor given (yarn, longrope); else derived */
    double attention_factor;    /* attention_factor */
    double beta_fast, beta_slow;/* beta_fast (32 when absent or 0), beta_slow (1 when absent or 0) */
    double mscale, mscale_all_dim; /* mscale, mscale_all_dim (0: absent) */
    int truncate;               /* truncate (yarn; absent: true, null: false) */
    double low_freq_factor, high_freq_factor; /* llama3 */
    double alpha;               /* HunYuan's dynamic with alpha (its ntk_alpha): theta times
                                   alpha^(dim / (dim - 2)), whatever the length; 0: none */
    int n_factors;              /* longrope: entries of short_factor / long_factor (= rotary_dim / 2) */
    double short_factor[ROPE_MAX_HALF], long_factor[ROPE_MAX_HALF];
    double partial_rotary_factor; /* partial_rotary_factor as the frequencies use it: 1 for
                                     default RoPE outside phi3, whose default ignores it */
    double partial_rotary_factor_given; /* as config.json gives it for this layer type (0: absent):
                                           what an export writes back, so that transformers
                                           reads the same config (and ignores it where it did) */
} rope_params;

/* What RoPE reads of a family's config class. The family table of
 * model/lm_config.c holds it beside the rest of each family's description,
 * so that adding a family stays one row there. */
/* ROPE_STYLE_OLMO3: rope_parameters nested per layer type as Gemma3's, but
 * Olmo3Config pops the top-level rope_theta into full_attention only: the
 * sliding layers take default_theta unless their own entry names one. */
/* ROPE_STYLE_GLM: GlmConfig / Glm4Config default partial_rotary_factor to 0.5,
 * and their default RoPE reads it (a partial rotation as Phi3's). */
enum { ROPE_STYLE_GENERIC, ROPE_STYLE_PHI3, ROPE_STYLE_GEMMA3, ROPE_STYLE_OLMO3, ROPE_STYLE_GLM };
/* Whether a style nests rope_parameters per layer type (Gemma3's and Olmo3's configs). */
static inline int rope_style_nested(int style) { return style == ROPE_STYLE_GEMMA3 || style == ROPE_STYLE_OLMO3; }
typedef struct {
    const char *model_type;
    int max_pos;        /* max_position_embeddings' default */
    double theta;       /* default_theta (Gemma3: full_attention's) */
    double theta_local; /* Gemma3: sliding_attention's (Olmo3's take theta, its default_theta) */
    int style;          /* ROPE_STYLE_*: Phi3's and Gemma3's own rules */
    int head_dim_none;  /* head_dim stays None when absent: yarn, dynamic and longrope then fail */
} rope_family;
/* model_type's row (0), or -1 for a model_type no family has (model/lm_config.c). */
int lm_family_rope(const char *model_type, rope_family *out);

/* The RoPE of one layer type ("full_attention", "sliding_attention"; NULL for
 * a model with one RoPE for all layers, where either name is accepted too)
 * from a parsed config.json, resolved with transformers 5.24's rules for the
 * family named by its model_type (llama, mistral, qwen2, qwen3, qwen3_moe,
 * mixtral, olmo2, phi3, gemma3_text). The family's defaults (rope_theta,
 * max_position_embeddings) come from a table here, so the caller sets
 * nothing beforehand. head_dim is the attention head size as that family's
 * model computes it (head_dim, else hidden_size / num_attention_heads; the
 * caller resolves it). Errors are CT_ERR_CONFIG naming path and the key. */
int rope_params_from_hf(rope_params *p, const struct cJSON *root, const char *layer_type, int head_dim,
                        const char *path, ct_err *e);

/* int(head_dim * partial_rotary_factor): the rotated part of each head. */
int rope_rotary_dim(const rope_params *p, int head_dim);

/* "default", "linear", "dynamic", "yarn", "llama3", "longrope". */
const char *rope_type_name(int type);

/* inv_freq[rope_rotary_dim / 2] and *attn_scale (the cos/sin multiplier,
 * transformers' attention_scaling) for a forward over positions
 * 0 .. seq_len-1 of a freshly built rotary embedding, as transformers'
 * dynamic_rope_update leaves them: dynamic recomputes theta when seq_len >
 * max_position_embeddings (else the original frequencies), longrope uses
 * long_factor when seq_len > original_max_position_embeddings (else
 * short_factor); the other types do not depend on seq_len. */
void rope_inv_freq(const rope_params *p, int head_dim, int seq_len, double *inv_freq, double *attn_scale);

/* cos/sin [T, half] for positions p0..p0+T-1, times attn_scale: fp32 angle
 * (float)t * (float)inv_freq[i] as op_rope_tables, so that for default RoPE
 * the tables equal op_rope_tables' bit for bit (rows of a later chunk equal
 * the same rows of a table built from 0). */
void rope_tables(float *cos, float *sin, int p0, int T, int half, const double *inv_freq, double attn_scale);

#endif
