/* model/lora.c: LoRA's choices, PEFT's initialisation and adapter files.
 *
 * The math (y += scale B A drop(x) beside a linear, and its backward) is in
 * lm.c next to the linears it adapts; this file decides which tensors
 * are adapters or frozen and moves adapters in and out of PEFT's format,
 * through the same lm_sink the HF loader uses, so every parallel layout
 * receives its part of them as it does any tensor. */
#include "model/lora.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "checkpoint/hf.h"
#include "config/config.h"
#include "core/fs.h"
#include "formats/json.h"
#include "core/rng.h"
#include "formats/safetensors.h"
#include "kernels/ops.h"

static const char *const target_names[LM_LORA_N] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                       "gate_proj", "up_proj", "down_proj", "shared_expert_gate"};
#define PEFT_PREFIX "base_model.model."

static int target_index(const char *name) {
    for (int p = 0; p < LM_LORA_N; p++)
        if (!strcmp(name, target_names[p])) return p;
    return -1;
}

/* Whether c is GraniteMoeShared, whose shared MLP PEFT sees as two Linears:
 * shared_mlp.input_linear [2 S, H] (gate rows, then up rows) and
 * shared_mlp.output_linear [H, S]; ctitan holds them as gate/up/down_proj. */
static int granite_shared(const lm_config *c) {
    return c->moe_keys == LM_MOE_KEYS_GRANITE && c->shared_intermediate > 0;
}

/* A target_modules name -> its bits: one projection, or the fused module of
 * the files (Phi3's qkv_proj, gate_up_proj; GraniteMoeShared's input_linear),
 * which PEFT adapts as one Linear. 0: not a module ctitan adapts. */
static unsigned target_bits(const lm_config *c, const char *name) {
    if (granite_shared(c)) { /* its names for the shared MLP; gate_proj and the like name nothing there */
        if (!strcmp(name, "input_linear"))
            return (1u << LM_LORA_GATE) | (1u << LM_LORA_UP) | LORA_FUSED_GATE_UP;
        if (!strcmp(name, "output_linear")) return 1u << LM_LORA_DOWN;
    }
    if (!strcmp(name, "qkv_proj"))
        return (1u << LM_LORA_Q) | (1u << LM_LORA_K) | (1u << LM_LORA_V) | LORA_FUSED_QKV;
    if (!strcmp(name, "gate_up_proj")) return (1u << LM_LORA_GATE) | (1u << LM_LORA_UP) | LORA_FUSED_GATE_UP;
    int p = target_index(name);
    return p < 0 ? 0 : 1u << p;
}

int lora_check_fused(const lm_config *c, const char *where, const char *key, ct_err *e) {
    unsigned qkv = (1u << LM_LORA_Q) | (1u << LM_LORA_K) | (1u << LM_LORA_V);
    unsigned gu = (1u << LM_LORA_GATE) | (1u << LM_LORA_UP);
    unsigned t = c->lora_targets;
    if ((t & (1u << LM_LORA_SHGATE)) && (!c->shared_intermediate || lm_shared_experts_ungated(c)))
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s: model_type \"%s\" has no shared_expert_gate (qwen2_moe's)", where,
                       key, c->model_type);
    if (c->fused_qkv && (t & qkv) && !(t & LORA_FUSED_QKV))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %s: model_type \"%s\" holds q, k and v as one qkv_proj: name qkv_proj "
                       "(one adapter over the fused projection, as PEFT adapts it)",
                       where, key, c->model_type);
    if (c->fused_gate_up && (t & gu) && !(t & LORA_FUSED_GATE_UP))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %s: model_type \"%s\" holds gate and up as one gate_up_proj: name "
                       "gate_up_proj",
                       where, key, c->model_type);
    if (granite_shared(c) && (t & gu) && !(t & LORA_FUSED_GATE_UP))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %s: model_type \"%s\" holds its shared MLP's gate and up as one "
                       "shared_mlp.input_linear: name input_linear",
                       where, key, c->model_type);
    if ((!c->fused_qkv && (t & LORA_FUSED_QKV)) ||
        (!c->fused_gate_up && !granite_shared(c) && (t & LORA_FUSED_GATE_UP)))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %s: model_type \"%s\" has no %s: name %s",
                       where, key, c->model_type, !c->fused_qkv && (t & LORA_FUSED_QKV) ? "qkv_proj" : "gate_up_proj",
                       !c->fused_qkv && (t & LORA_FUSED_QKV) ? "q_proj, k_proj, v_proj" : "gate_proj, up_proj");
    return 0;
}

/* ------------------------------------------- experts (target_parameters) */

static const char *const exp_param[LM_LORA_EXP_N] = {"gate_up_proj", "down_proj"};

/* Parameter x's (LM_LORA_EXP_*, the router LM_LORA_EXP_R) name in a layer
 * without "model.layers.N.", as PEFT names it ("mlp.experts.down_proj",
 * "mlp.gate.weight"; GraniteMoE's module tree holds them under
 * block_sparse_moe, its router's weight as router.weight) */
static const char *param_path(const lm_config *c, int x) {
    static const char *const p[2][LM_LORA_PARAM_N] = {
        {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"},
        {"block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj",
         "block_sparse_moe.router.weight"}};
    return x >= 0 && x < LM_LORA_PARAM_N ? p[c->moe_keys == LM_MOE_KEYS_GRANITE][x] : "?";
}

/* Parameter x's last name components that select it in every MoE layer and
 * nothing else: PEFT's spelling in target_parameters after its rewrite */
static const char *param_short(const lm_config *c, int x) {
    static const char *const p[2][LM_LORA_PARAM_N] = {{"gate_up_proj", "down_proj", "gate.weight"},
                                                      {"gate_up_proj", "down_proj", "router.weight"}};
    return x >= 0 && x < LM_LORA_PARAM_N ? p[c->moe_keys == LM_MOE_KEYS_GRANITE][x] : "?";
}

/* PEFT's _inject_parameters: the key equals the target or ends with "." + target */
static int key_matches(const char *key, const char *target) {
    size_t nk = strlen(key), nt = strlen(target);
    return !strcmp(key, target) || (nk > nt && key[nk - nt - 1] == '.' && !strcmp(key + nk - nt, target));
}

/* The first parameter of the model, other than the fused experts and the
 * routers, that `item` selects by PEFT's rule (NULL: none). PEFT wraps every
 * parameter a target_parameters item matches, so an item such as "weight"
 * also reaches the norms and projections, where its ParamWrapper raises on a
 * 1-D parameter; ctitan adapting the routers alone would train another model.
 * The names are the HF ones of ctitan's table, which are the module tree's
 * (transformers v5) but for the experts and routers skipped here. */
static const char *other_param(const lm_config *c, const char *item, char *buf, size_t cap) {
    lm_config base = *c;
    base.lora_rank = 0; /* the base model's parameters only */
    lm_model m;
    lm_layout(&m, &base);
    const char *hit = NULL;
    for (int i = 0; i < m.n_tensors && !hit; i++) {
        const lm_tensor *t = &m.tensors[i];
        if (t->lora || t->slot == LM_S_ROUTER || t->slot == LM_S_EXP_G || t->slot == LM_S_EXP_U ||
            t->slot == LM_S_EXP_D)
            continue;
        if (key_matches(t->name, item)) {
            snprintf(buf, cap, "%s", t->name);
            hit = buf;
        }
    }
    free(m.tensors);
    return hit;
}

/* GraniteMoE's modules that are no Linear (transformers v5's module tree:
 * the MoE block, its router and experts, the layer, its norms, the shared
 * MLP as a whole): the first one that target_modules entry `name` selects
 * by PEFT's rule, into buf; NULL if none. PEFT raises on such a module
 * ("Target module ... is not supported") and skips an entry that selects no
 * module at all while another entry matches. */
static const char *granite_other_module(const lm_config *c, const char *name, char *buf, size_t cap) {
    static const char *const top[] = {"model", "model.layers", "model.norm", "model.rotary_emb"};
    static const char *const sub[] = {"",
                                      ".self_attn",
                                      ".input_layernorm",
                                      ".post_attention_layernorm",
                                      ".block_sparse_moe",
                                      ".block_sparse_moe.router",
                                      ".block_sparse_moe.experts",
                                      ".block_sparse_moe.experts.act_fn",
                                      ".shared_mlp",
                                      ".shared_mlp.activation"};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (key_matches(top[i], name)) return snprintf(buf, cap, "%s", top[i]), buf;
    for (int l = 0; l < c->n_layers; l++)
        for (size_t i = 0; i < sizeof sub / sizeof sub[0]; i++) {
            if (!strncmp(sub[i], ".shared_mlp", 11) && !granite_shared(c)) continue;
            snprintf(buf, cap, "model.layers.%d%s", l, sub[i]);
            if (key_matches(buf, name)) return buf;
        }
    return NULL;
}

int lora_parse_target_params(const char *list, lm_config *c, const char *where, const char *key, ct_err *e) {
    char item[256], full[128], other[LM_NAME_MAX];
    memset(c->lora_experts, 0, sizeof c->lora_experts);
    /* transformers v5 stacks Mixtral's w1|w3 and w2 into the same
     * mlp.experts.gate_up_proj / down_proj as Qwen3-MoE's, PEFT's keys alike */
    int experts = c->n_experts > 0, skipped = 0, any = 0;
    for (const char *p = list; p && (p = cfg_list_next(p, item, sizeof item));) {
        int hit = 0;
        for (int l = 0; experts && l < c->n_layers; l++) {
            if (!lm_layer_is_moe(c, l)) continue;
            for (int x = 0; x < LM_LORA_PARAM_N; x++) {
                snprintf(full, sizeof full, "model.layers.%d.%s", l, param_path(c, x));
                if (key_matches(full, item)) {
                    c->lora_experts[l] |= (unsigned char)(1u << x);
                    hit = 1;
                }
            }
        }
        if (!hit && !experts)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: %s: \"%s\": this model has no fused MoE experts (target_parameters adapts "
                           "mlp.experts.gate_up_proj, mlp.experts.down_proj and the router mlp.gate.weight of "
                           "qwen3_moe and mixtral models)",
                           where, key, item);
        if (hit && other_param(c, item, other, sizeof other))
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: %s: \"%s\" also selects %s (PEFT wraps every parameter whose name equals the "
                           "item or ends with \".\" + the item: it would adapt that one too, and raises on a 1-D "
                           "one); name the fused experts' and the routers' parameters only (mlp.experts.gate_up_proj, "
                           "mlp.experts.down_proj, gate.weight)",
                           where, key, item, other);
        /* GraniteMoE: PEFT's _inject_parameters skips an item that names no parameter of the
         * model (v4's block_sparse_moe.input_linear.weight, router.layer.weight among them) */
        if (!hit && c->moe_keys == LM_MOE_KEYS_GRANITE && !other_param(c, item, other, sizeof other)) {
            fprintf(stderr, "ctitan: warning: %s: %s: \"%s\" names no parameter of model_type \"%s\"; skipped, as "
                            "PEFT skips it\n", where, key, item, c->model_type);
            skipped++;
            continue;
        }
        any |= hit;
        if (!hit)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: %s: \"%s\" names no parameter ctitan adapts; target_parameters may name the fused "
                           "experts mlp.experts.gate_up_proj and mlp.experts.down_proj and the router mlp.gate.weight "
                           "(or a suffix of model.layers.N.mlp.experts.X / model.layers.N.mlp.gate.weight, as PEFT "
                           "matches; GraniteMoE's block_sparse_moe.experts.X, block_sparse_moe.router.weight)",
                           where, key, item);
    }
    if (skipped && !any && !c->lora_targets)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %s: %s: no parameter of model_type \"%s\" has these names, and no target_modules "
                       "matched (PEFT: \"No `target_modules` passed but also no `target_parameters` found\")",
                       where, key, list, c->model_type);
    return 0;
}

/* c->lora_experts[] back as a target_parameters list (comma-joined, to
 * free): when every MoE layer has the same, the names PEFT's rewrite of
 * target_modules saves ("gate_up_proj", "down_proj", "gate.weight"), so a
 * file diffs clean against PEFT's for the same recipe; else every layer's
 * full parameter name, the only spelling that selects those layers alone.
 * "" when none. */
static char *lora_target_params_text(const lm_config *c) {
    int uniform = 1, ref = -1;
    for (int l = 0; l < c->n_layers; l++) {
        if (!lm_layer_is_moe(c, l)) continue;
        int bits = c->lora_rank > 0 ? c->lora_experts[l] : 0;
        if (ref < 0) ref = bits;
        else if (bits != ref) uniform = 0;
    }
    size_t cap = 64 + (size_t)c->n_layers * LM_LORA_PARAM_N * 64, n = 0;
    char *s = ct_malloc(cap);
    s[0] = 0;
    int layers = uniform ? 1 : c->n_layers; /* uniform: one pass of the short names */
    for (int l = 0; l < layers; l++)
        for (int x = 0; x < LM_LORA_PARAM_N; x++) {
            int on = uniform ? ref > 0 && (ref >> x & 1) : lm_lora_expert_on(c, l, x);
            if (!on) continue;
            if (uniform) n += (size_t)snprintf(s + n, cap - n, "%s%s", n ? "," : "", param_short(c, x));
            else n += (size_t)snprintf(s + n, cap - n, "%smodel.layers.%d.%s", n ? "," : "", l, param_path(c, x));
        }
    return s;
}

/* the run's fp32 matmul even under bf16 mixed precision (kern_use_bf16_matmuls) */
static kern_matmul_fwd_fn fp32_fwd(const kern_ops *k) {
    const kern_impl *c = k ? k->chosen[KERN_OP_MATMUL] : NULL;
    return c && c->fn.matmul.fwd ? c->fn.matmul.fwd : op_matmul_fwd;
}
static kern_matmul_bwd_fn fp32_bwd(const kern_ops *k) {
    const kern_impl *c = k ? k->chosen[KERN_OP_MATMUL] : NULL;
    return c && c->fn.matmul.bwd ? c->fn.matmul.bwd : op_matmul_bwd;
}

/* expert e's scale B_e [N, r] (contiguous) out of B [N, r E] */
static void gather_b(float *bt, const float *B, int e, int E, int r, int N, float scale) {
    for (size_t o = 0; o < (size_t)N; o++)
        for (int j = 0; j < r; j++) bt[o * r + j] = scale * B[o * ((size_t)r * E) + (size_t)j * E + e];
}

void lora_experts_delta(const kern_ops *k, float *w0, float *w1, const float *A, const float *B, int E, int r, int K,
                        int N, int n0, float scale) {
    kern_matmul_fwd_fn mm = fp32_fwd(k);
    float *bt = ct_malloc((size_t)N * r * sizeof(float)), *at = ct_malloc((size_t)K * r * sizeof(float));
    for (int e = 0; e < E; e++) {
        gather_b(bt, B, e, E, r, N, scale);
        const float *ae = A + (size_t)e * r * K; /* [r, K] */
        for (int j = 0; j < r; j++)
            for (size_t i = 0; i < (size_t)K; i++) at[i * r + j] = ae[(size_t)j * K + i];
        /* W_e[n, K] += (scale B_e)[n, r] A_e[r, K], i.e. with A_e^T [K, r] as the matmul's weight */
        mm(w0 + (size_t)e * n0 * K, bt, at, n0, r, K, 1);
        if (w1 && N > n0) mm(w1 + (size_t)e * (N - n0) * K, bt + (size_t)n0 * r, at, N - n0, r, K, 1);
    }
    free(bt);
    free(at);
}

void lora_experts_grad(const kern_ops *k, float *dA, float *dB, const float *dw0, const float *dw1, const float *A,
                       const float *B, int E, int r, int K, int N, int n0, float scale) {
    kern_matmul_fwd_fn mm = fp32_fwd(k);
    kern_matmul_bwd_fn mb = fp32_bwd(k);
    float *bt = ct_malloc((size_t)N * r * sizeof(float)), *t = ct_malloc((size_t)N * r * sizeof(float));
    for (int e = 0; e < E; e++) {
        const float *ae = A + (size_t)e * r * K;
        const float *d0 = dw0 + (size_t)e * n0 * K, *d1 = dw1 ? dw1 + (size_t)e * (N - n0) * K : NULL;
        if (dA) { /* dA_e[r, K] += (scale B_e)^T dW_e */
            gather_b(bt, B, e, E, r, N, scale);
            mb(NULL, dA + (size_t)e * r * K, bt, d0, ae, n0, K, r, 1);
            if (d1 && N > n0) mb(NULL, dA + (size_t)e * r * K, bt + (size_t)n0 * r, d1, ae, N - n0, K, r, 1);
        }
        if (dB) { /* dB_e[N, r] += scale dW_e A_e^T, scattered back to B's interleaved columns */
            mm(t, d0, ae, n0, K, r, 0);
            if (d1 && N > n0) mm(t + (size_t)n0 * r, d1, ae, N - n0, K, r, 0);
            for (size_t o = 0; o < (size_t)N; o++)
                for (int j = 0; j < r; j++) dB[o * ((size_t)r * E) + (size_t)j * E + e] += scale * t[o * r + j];
        }
    }
    free(bt);
    free(t);
}

float lora_scaling(double alpha, int r, int rslora) {
    return (float)(rslora ? alpha / sqrt((double)r) : alpha / (double)r);
}

int lora_saved(const lm_tensor *t) { return t->lora || !t->frozen; }

/* Whether tensor `name` lies in a module PEFT's modules_to_save entry
 * `item` selects: PEFT (_set_trainable) takes every module whose path ends
 * with the text, so "norm" is model.norm and every input_layernorm,
 * post_attention_layernorm, q_norm and k_norm, and "mlp" a whole MLP. The
 * module paths of "model.layers.0.mlp.up_proj.weight" are its prefixes that
 * end before a dot. */
static int in_saved_module(const char *name, const char *item) {
    size_t k = strlen(item);
    for (const char *d = strchr(name, '.'); d; d = strchr(d + 1, '.')) {
        size_t n = (size_t)(d - name);
        if (n >= k && !strncmp(d - k, item, k)) return 1;
    }
    return 0;
}

/* The key PEFT saves modules_to_save tensor t under (its wrapper's
 * state_dict over transformers v5's module tree), without PEFT_PREFIX: the
 * table's name, but for GraniteMoE, whose files name tensors that tree
 * lacks: a fused piece (hf_fused_piece; f then its place, and 1 returned)
 * is part of block_sparse_moe.experts.gate_up_proj / down_proj or of
 * shared_mlp.input_linear.weight, and the router is
 * block_sparse_moe.router.weight (the files' router.layer.weight): transformers'
 * names, lm_module_param_name. */
static int peft_module_key(const lm_config *c, const lm_tensor *t, char *key, size_t n, hf_fused *f) {
    int fused = !t->lora && hf_fused_piece(c, t, f);
    if (!t->lora && c->moe_keys == LM_MOE_KEYS_GRANITE && lm_module_param_name(c, t, key, n)) return fused;
    snprintf(key, n, "%s", fused ? f->name : t->name);
    return fused;
}

/* Whether table tensor t lies in a module modules_to_save entry `item`
 * selects, by the module tree PEFT sees (peft_module_key's names) */
static int in_saved_module_of(const lm_config *c, const lm_tensor *t, const char *item) {
    char key[LM_NAME_MAX];
    hf_fused f;
    peft_module_key(c, t, key, sizeof key, &f);
    return in_saved_module(key, item);
}

/* On a model with tie_word_embeddings, lm_head is the embedding: ctitan
 * holds one tensor (model.embed_tokens.weight), and a modules_to_save entry
 * that selects either module trains that one tensor. PEFT matches that only
 * under ensure_weight_tying = true (LoraModel._add_modules_to_save_to_tie:
 * the embedding's trained copy is shared by lm_head's wrapper), and only for
 * an entry whose last dotted part is one of its EMBEDDING_LAYER_NAMES
 * (BaseTuner._check_tied_modules: m.split(".")[-1]); any other entry that
 * selects one of the pair ("tokens", "head", "model") gets a copy of that
 * module alone, the other staying at the base weights. */
static int selects_tied(const lm_config *c, const char *item) {
    return c->tie_embeddings &&
           (in_saved_module("model.embed_tokens.weight", item) || in_saved_module("lm_head.weight", item));
}

static int tying_name(const char *item) {
    const char *d = strrchr(item, '.');
    const char *last = d ? d + 1 : item;
    return !strcmp(last, "embed_tokens") || !strcmp(last, "lm_head");
}

/* The refusal of a modules_to_save entry (key: where it was given) that
 * selects the tied pair under another name than PEFT ties; 0 if none. */
static int refuse_untied_name(const lm_config *c, const char *item, const char *where, const char *key, int code,
                              ct_err *e) {
    if (!selects_tied(c, item) || tying_name(item)) return 0;
    return ct_fail(e, code,
                   "%s: %s: \"%s\" selects embed_tokens or lm_head, which are one tied tensor in this model "
                   "(tie_word_embeddings); PEFT ties the pair (ensure_weight_tying) only for an entry named "
                   "embed_tokens or lm_head, and trains a copy of the one module otherwise: name it embed_tokens",
                   where, key, item);
}

int lora_apply_frozen(lm_model *m, const char *freeze, const char *modules_to_save, const char *where,
                      ct_err *e) {
    char item[256];
    int lora = m->cfg.lora_rank > 0;
    for (int i = 0; i < m->n_tensors; i++) m->tensors[i].frozen = lora && !m->tensors[i].lora;
    for (const char *p = modules_to_save; p && (p = cfg_list_next(p, item, sizeof item));) {
        if (!lora)
            return ct_fail(e, CT_ERR_CONFIG, "%s: lora.modules_to_save: needs lora.rank > 0", where);
        int rc = refuse_untied_name(&m->cfg, item, where, "lora.modules_to_save", CT_ERR_CONFIG, e);
        if (rc) return rc;
        /* PEFT's ensure_weight_tying would put the pair's trained copy under lm_head's
         * adapter as well, which ctitan's one tied tensor plus a head adapter does not compute */
        if ((m->cfg.lora_targets & (LORA_HEAD | LORA_EMBED)) && selects_tied(&m->cfg, item))
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: lora.modules_to_save: \"%s\" trains the tied embedding, and lora.target_modules "
                           "adapts %s, the same tied tensor (tie_word_embeddings): choose one",
                           where, item, m->cfg.lora_targets & LORA_HEAD ? "lm_head" : "embed_tokens");
        int hit = 0;
        for (int i = 0; i < m->n_tensors; i++) {
            lm_tensor *t = &m->tensors[i];
            /* tied: "lm_head" is the embedding, trained as one tensor and saved for PEFT's ensure_weight_tying */
            int tied = t->slot == LM_S_EMBED && selects_tied(&m->cfg, item);
            /* GraniteMoE's fused tensors by PEFT's names: every piece of one (lora_save_peft
             * writes it whole) */
            if (t->lora || !(tied || in_saved_module_of(&m->cfg, t, item))) continue;
            t->frozen = 0;
            hit = 1;
        }
        if (!hit)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: lora.modules_to_save: \"%s\" names no module of this model (e.g. embed_tokens, "
                           "lm_head, norm, input_layernorm)",
                           where, item);
    }
    for (const char *p = freeze; p && (p = cfg_list_next(p, item, sizeof item));) {
        int hit = 0;
        for (int i = 0; i < m->n_tensors; i++) {
            /* GraniteMoE's files name fused tensors the table holds apart, and transformers
             * names the experts (and some routers) otherwise again: such a name freezes
             * every piece of it */
            char fused[LM_NAME_MAX], module[LM_NAME_MAX];
            if (fnmatch(item, m->tensors[i].name, 0) == 0 ||
                (lm_fused_file_name(&m->cfg, &m->tensors[i], fused, sizeof fused) && fnmatch(item, fused, 0) == 0) ||
                (lm_module_param_name(&m->cfg, &m->tensors[i], module, sizeof module) &&
                 fnmatch(item, module, 0) == 0))
                m->tensors[i].frozen = hit = 1;
        }
        if (!hit)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: training.freeze: \"%s\" matches no tensor of this model (the names of its "
                           "safetensors files or of transformers' named_parameters(), e.g. %s)",
                           where, item, m->n_tensors > 1 ? m->tensors[1].name : m->tensors[0].name);
    }
    if (!lm_trained_runs(m, 0, m->n_params, NULL, NULL))
        return ct_fail(e, CT_ERR_CONFIG, "%s: training.freeze: every tensor is frozen", where);
    return lm_bind_frozen(m, e);
}

void lora_apply(const kern_ops *k, float *y, float *u, const float *x, const float *A, const float *B, int n, int K,
                int N, int r, float scale) {
    lora_proj p = {.A = A, .B = B, .y = y, .u = u, .N = N, .r = r, .scale = scale};
    lora_fwd_group(k, x, n, K, &p, 1);
}

/* Threads for a group over n rows: one parallel region of all the
 * adapters' products, each thread on its own rows with serial products.
 * Rank-r products gain little from the GEMM's own threads (measured ~60
 * GFLOP/s on 2 threads: the r-wide tile is half empty), while each of its
 * parallel regions waits for every thread: on a loaded host a descheduled
 * thread costs a time slice per region, and at six regions per adapter that
 * was where a W1 LoRA step lost its time (docs/benchmarks.md, issue 13).
 * Each thread's rows stay above LORA_MIN_ROWS (well above the matmuls'
 * few-row path, GEMM_SMALL_M), so every element of u, y, du and dx is
 * summed by the same kernel in the same order whatever the thread count. */
#define LORA_MIN_ROWS 32
static int lora_threads(int n) {
    if (omp_in_parallel()) return 1;
    int t = omp_get_max_threads();
    while (t > 1 && n / t < LORA_MIN_ROWS) t--;
    return t;
}

static void fwd_rows(const kern_ops *k, const float *x, int K, const lora_proj *p, long i0, long i1) {
    int n = (int)(i1 - i0), r = p->r;
    if (n <= 0) return;
    float *u = p->u + i0 * r;
    k->matmul_fwd(u, x + i0 * K, p->A, n, K, r, 0);
    for (long i = 0; i < (long)n * r; i++) u[i] *= p->scale;
    if (p->B) k->matmul_fwd(p->y + i0 * p->N, u, p->B, n, r, p->N, 1);
}

void lora_fwd_group(const kern_ops *k, const float *x, int n, int K, const lora_proj *p, int np) {
    int T = lora_threads(n);
    if (T <= 1) {
        for (int j = 0; j < np; j++) fwd_rows(k, x, K, &p[j], 0, n);
        return;
    }
    kern_trace *kt_ = kern_trace_armed(); /* the kernels inside, nested, do not stamp: this region does */
#pragma omp parallel num_threads(T)
    {
        KERN_TRACE_ENTER(kt_);
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long i0 = (long)n * t / nt, i1 = (long)n * (t + 1) / nt;
        for (int j = 0; j < np; j++) fwd_rows(k, x, K, &p[j], i0, i1);
        KERN_TRACE_EXIT(kt_);
    }
}

/* du = scale dy B (overwritten) and dx += du A on rows [i0, i1). */
static void bwd_rows(const kern_ops *k, float *dx, int K, const lora_proj *p, long i0, long i1) {
    int n = (int)(i1 - i0), r = p->r;
    if (n <= 0) return;
    float *du = p->du + i0 * r;
    k->matmul_bwd(du, NULL, p->dy + i0 * p->N, NULL, p->B, n, r, p->N, 0);
    for (long i = 0; i < (long)n * r; i++) du[i] *= p->scale;
    if (dx) k->matmul_bwd(dx + i0 * K, NULL, du, NULL, p->A, n, K, r, 1);
}

/* The weight gradients, whole products over all n rows: item 2 j is dB of
 * p[j] (dB += dy^T u), 2 j + 1 its dA (dA += du^T x). */
static void bwd_weight(const kern_ops *k, const float *x, int n, int K, const lora_proj *p, int item) {
    const lora_proj *q = &p[item / 2];
    if (item % 2 == 0) k->matmul_bwd(NULL, q->gB, q->dy, q->u, q->B, n, q->r, q->N, 1);
    else k->matmul_bwd(NULL, q->gA, q->du, x, q->A, n, K, q->r, 1);
}

#define LORA_GROUP_MAX 4
void lora_bwd_group(const kern_ops *k, float *dx, const float *x, int n, int K, const lora_proj *p, int np) {
    int T = lora_threads(n);
    if (T <= 1 || np > LORA_GROUP_MAX) {
        for (int j = 0; j < np; j++) {
            bwd_rows(k, dx, K, &p[j], 0, n);
            if (p[j].gB) bwd_weight(k, x, n, K, p, 2 * j);
            if (p[j].gA) bwd_weight(k, x, n, K, p, 2 * j + 1);
        }
        return;
    }
    /* Each weight gradient is one whole product by one thread, so it sums
     * as the GEMM alone would; products into the same buffer (a fused qkv
     * adapter's shared A) go to one thread in the order above, so their
     * sum keeps it too. Owners: longest first onto the least loaded. */
    int owner[2 * LORA_GROUP_MAX], ni = 2 * np;
    double cost[2 * LORA_GROUP_MAX], load[64] = {0};
    if (T > 64) T = 64;
    for (int i = 0; i < ni; i++) {
        const lora_proj *q = &p[i / 2];
        const float *dst = i % 2 ? q->gA : q->gB;
        owner[i] = dst ? -1 : -2; /* -2: frozen, nothing to do */
        cost[i] = 0;
        if (!dst) continue;
        for (int h = 0; h < i; h++) /* joins the first item writing the same buffer */
            if (owner[h] != -2 && (h % 2 ? p[h / 2].gA : p[h / 2].gB) == dst) {
                owner[i] = -3 - h;
                break;
            }
        if (owner[i] == -1) cost[i] = (double)(i % 2 ? K : q->N) * q->r;
        else cost[-3 - owner[i]] += (double)(i % 2 ? K : q->N) * q->r;
    }
    for (;;) {
        int best = -1;
        for (int i = 0; i < ni; i++)
            if (owner[i] == -1 && (best < 0 || cost[i] > cost[best])) best = i;
        if (best < 0) break;
        int t = 0;
        for (int h = 1; h < T; h++)
            if (load[h] < load[t]) t = h;
        owner[best] = t;
        load[t] += cost[best];
    }
    for (int i = 0; i < ni; i++)
        if (owner[i] <= -3) owner[i] = owner[-3 - owner[i]];
    int any = 0;
    for (int i = 0; i < ni; i++) any |= owner[i] >= 0;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel num_threads(T)
    {
        KERN_TRACE_ENTER(kt_);
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long i0 = (long)n * t / nt, i1 = (long)n * (t + 1) / nt;
        for (int j = 0; j < np; j++) bwd_rows(k, dx, K, &p[j], i0, i1);
        if (any) {
#pragma omp barrier /* dA reads every row of du */
            for (int i = 0; i < ni; i++)
                if (owner[i] >= 0 && (nt == T ? owner[i] == t : t == 0)) bwd_weight(k, x, n, K, p, i);
        }
        KERN_TRACE_EXIT(kt_);
    }
}

void lora_init_each(const lm_model *table, uint64_t seed, const lm_sink *s) {
    ct_rng r;
    ct_rng_seed(&r, seed ^ 0x4c6f5241ull); /* "LoRA": a stream apart from the base init's */
    size_t most = 1;
    for (int i = 0; i < table->n_tensors; i++)
        if (table->tensors[i].lora && table->tensors[i].numel > most) most = table->tensors[i].numel;
    float *buf = ct_malloc(most * sizeof(float)); /* [r, in] or [out, r]: small */
    for (int i = 0; i < table->n_tensors; i++) {
        const lm_tensor *t = &table->tensors[i];
        if (!t->lora) continue;
        int is_a = strstr(t->name, ".lora_A.") != NULL;
        double bound = 1.0 / sqrt((double)t->shape[1]); /* kaiming_uniform(a = sqrt(5)): 1 / sqrt(fan_in) */
        for (size_t j = 0; j < t->numel; j++) buf[j] = is_a ? (float)((2.0 * ct_rng_uniform(&r) - 1.0) * bound) : 0.0f;
        /* an embedding's the other way round (PEFT: A zeros, B normal_ with std 1) */
        if (t->slot == LM_S_EMB_LB)
            for (size_t j = 0; j < t->numel; j++) buf[j] = (float)ct_rng_normal(&r);
        s->put(s->ctx, LM_PARAMS, i, 0, (size_t)t->shape[0], buf);
    }
    free(buf);
}

/* ---------------------------------------------------------------- loading */

static const char *const module_paths[LM_LORA_N] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                       "mlp.down_proj",    "mlp.shared_expert_gate"};

/* Projection p's module path in layer l of c's model ("self_attn.q_proj";
 * a fused model's "self_attn.qkv_proj" for q, k and v; a sparse layer's MLP
 * is its shared expert's, qwen2_moe's "mlp.shared_expert.gate_proj"). */
static const char *lora_module_path(const lm_config *c, int l, int p) {
    static const char *const shared[3] = {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                                          "mlp.shared_expert.down_proj"};
    static const char *const shared_experts[3] = {"mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                                  "mlp.shared_experts.down_proj"}; /* ERNIE 4.5 MoE */
    if (p < 0 || p >= LM_LORA_N) return "?";
    if (granite_shared(c) && p >= LM_LORA_GATE && p <= LM_LORA_DOWN)
        return p == LM_LORA_DOWN ? "shared_mlp.output_linear" : "shared_mlp.input_linear";
    if (p >= LM_LORA_GATE && p <= LM_LORA_DOWN && c->shared_intermediate > 0 && lm_layer_is_moe(c, l))
        return lm_shared_experts_ungated(c) ? shared_experts[p - LM_LORA_GATE] : shared[p - LM_LORA_GATE];
    if (c->fused_qkv && p <= LM_LORA_V) return "self_attn.qkv_proj";
    if (c->fused_gate_up && (p == LM_LORA_GATE || p == LM_LORA_UP)) return "mlp.gate_up_proj";
    return module_paths[p];
}

/* The projection whose adapter p's is (a fused module's: its first), as the
 * tensor table lists them; p itself otherwise. */
static int module_head(const lm_config *c, int p) {
    if (c->fused_qkv && (p == LM_LORA_K || p == LM_LORA_V)) return LM_LORA_Q;
    if ((c->fused_gate_up || granite_shared(c)) && p == LM_LORA_UP) return LM_LORA_GATE;
    return p;
}

/* Whether layer l has the module of projection p in its files: a MoE
 * layer's MLP is its experts (target_parameters), not Linears, but for its
 * shared expert's (qwen2_moe). */
static int module_exists(const lm_config *c, int l, int p) {
    if (p == LM_LORA_SHGATE) return lm_layer_is_moe(c, l) && c->shared_intermediate > 0;
    return p < LM_LORA_GATE || !lm_layer_is_moe(c, l) || c->shared_intermediate > 0;
}

int lora_is_all_linear(const char *targets) {
    char item[64];
    const char *p = cfg_list_next(targets, item, sizeof item);
    return p && !strcasecmp(item, "all-linear") && !cfg_list_next(p, item, sizeof item);
}

unsigned lora_all_linear(const lm_config *c) {
    /* every nn.Linear of a decoder layer but the output layer (lm_head), which
     * PEFT's _maybe_include_all_linear_layers leaves out: the projections */
    unsigned bits = 0;
    for (int p = 0; p < LM_LORA_N; p++) bits |= 1u << p;
    /* GraniteMoE: the experts and the router are no Linear (PEFT adapts none of
     * them); GraniteMoeShared's shared MLP is: its input_linear, output_linear */
    if (c->moe_keys == LM_MOE_KEYS_GRANITE) {
        bits &= (1u << LM_LORA_Q) | (1u << LM_LORA_K) | (1u << LM_LORA_V) | (1u << LM_LORA_O);
        if (granite_shared(c))
            bits |= (1u << LM_LORA_GATE) | (1u << LM_LORA_UP) | (1u << LM_LORA_DOWN) | LORA_FUSED_GATE_UP;
        return bits;
    }
    /* qwen2_moe's shared_expert_gate: a Linear (ERNIE 4.5 MoE's shared experts have none) */
    if (!c->shared_intermediate || lm_shared_experts_ungated(c)) bits &= ~(1u << LM_LORA_SHGATE);
    if (c->fused_qkv) bits |= LORA_FUSED_QKV;
    if (c->fused_gate_up) bits |= LORA_FUSED_GATE_UP;
    return bits;
}

/* target_modules names (comma list) into c->lora_targets and, where they
 * name single modules ("model.layers.0.self_attn.q_proj", as PEFT saves
 * "all-linear" of a model with fewer than 20 Linears), per-layer lora_lp
 * LM_LORA_LP_OFF. PEFT's rule: a module is targeted when its full name
 * equals a name or ends with "." + it. */
static int targets_from_list(const char *list, lm_config *c, const char *where, const char *key, int code,
                             unsigned *exact, ct_err *e) {
    memset(c->lora_lp, 0, sizeof c->lora_lp);
    c->n_lora_kinds = 0;
    c->lora_targets = 0;
    unsigned *bits = ct_calloc((size_t)c->n_layers + 1, sizeof *bits), all = 0;
    char name[256], full[LM_NAME_MAX], skipped_names[512] = "";
    int rc = 0, skipped = 0;
    for (const char *q = list; q && (q = cfg_list_next(q, name, sizeof name));) {
        unsigned b = target_bits(c, name);
        int hit = 0;
        if (!strcmp(name, "lm_head")) { /* the output layer, whose full name is "lm_head" (PEFT's rule) */
            all |= LORA_HEAD;
            continue;
        }
        if (!strcmp(name, "embed_tokens") || !strcmp(name, "model.embed_tokens")) { /* PEFT's LoRA Embedding */
            all |= LORA_EMBED;
            continue;
        }
        /* GraniteMoE: gate_proj / up_proj / down_proj name no Linear (PEFT skips such a
         * name beside one that matches; the trainer refuses a list of them alone) */
        if (c->moe_keys == LM_MOE_KEYS_GRANITE && c->n_experts > 0 && (b & ~LORA_FUSED_GATE_UP) &&
            !(b & ((1u << LM_LORA_GATE) - 1)) && strcmp(name, "input_linear") && strcmp(name, "output_linear"))
            continue;
        if (b) { /* a module name: every layer's (the trainer strips a MoE model's MLP names) */
            for (int l = 0; l < c->n_layers; l++) bits[l] |= b;
            all |= b;
            continue;
        }
        for (int l = 0; l < c->n_layers; l++)
            for (int p = 0; p < LM_LORA_N; p++) {
                if (module_head(c, p) != p || !module_exists(c, l, p)) continue;
                snprintf(full, sizeof full, "model.layers.%d.%s", l, lora_module_path(c, l, p));
                if (!key_matches(full, name)) continue;
                unsigned mb = target_bits(c, strrchr(full, '.') + 1);
                if (exact && !strcmp(full, name)) exact[l] |= mb; /* layers_to_transform spares it */
                bits[l] |= mb;
                all |= mb;
                hit = 1;
            }
        if (!hit && c->moe_keys == LM_MOE_KEYS_GRANITE) {
            char other[LM_NAME_MAX];
            if (granite_other_module(c, name, other, sizeof other)) {
                rc = ct_fail(e, code,
                             "%s: %s: \"%s\" selects %s, which is no Linear: PEFT refuses it (\"Target module ... "
                             "is not supported\"); GraniteMoE's experts and router take lora.target_parameters "
                             "(block_sparse_moe.experts.gate_up_proj, down_proj, router.weight)",
                             where, key, name, other);
                break;
            }
            /* PEFT skips an entry that selects no module beside one that matches; a typo
             * is then at least visible */
            fprintf(stderr, "ctitan: warning: %s: %s: \"%s\" selects no module of model_type \"%s\"; skipped, as "
                            "PEFT skips it\n", where, key, name, c->model_type);
            skipped = 1;
            if (strlen(skipped_names) + strlen(name) + 3 < sizeof skipped_names)
                snprintf(skipped_names + strlen(skipped_names), sizeof skipped_names - strlen(skipped_names), "%s%s",
                         skipped_names[0] ? ", " : "", name);
            continue;
        }
        if (!hit) {
            rc = ct_fail(e, code,
                         "%s: %s: \"%s\" is not a projection ctitan adapts (q_proj, k_proj, v_proj, o_proj, "
                         "gate_proj, up_proj, down_proj; Phi3's qkv_proj, gate_up_proj; GraniteMoeShared's "
                         "input_linear, output_linear; lm_head; embed_tokens; or one layer's, "
                         "model.layers.N.self_attn.q_proj)",
                         where, key, name);
            break;
        }
    }
    if (!rc && skipped && !all && code == CT_ERR_CONFIG)
        rc = ct_fail(e, code,
                     "%s: %s: %s: no module of model_type \"%s\" has these names (PEFT: \"Target modules {...} not "
                     "found in the base model\")",
                     where, key, skipped_names, c->model_type);
    if (!rc) {
        c->lora_targets = all;
        for (int l = 0; l < c->n_layers; l++)
            for (int p = 0; p < LM_LORA_N; p++)
                if ((all >> p & 1) && !(bits[l] >> p & 1)) c->lora_lp[l][p] = LM_LORA_LP_OFF;
    }
    free(bits);
    return rc;
}

int lora_parse_targets(const char *list, lm_config *c, const char *where, ct_err *e) {
    int rc = targets_from_list(list, c, where, "lora.target_modules", CT_ERR_CONFIG, NULL, e);
    if (!rc && !c->lora_targets) /* an adapter's may be [] (target_parameters only): a config's says so by omission */
        rc = ct_fail(e, CT_ERR_CONFIG, "%s: lora.target_modules: empty", where);
    return rc;
}

/* Whether layer index `l` is in PEFT's layers_to_transform (an int or a list) */
static int in_layers(const cJSON *lt, int l) {
    if (cJSON_IsNumber(lt)) return lt->valuedouble == l;
    const cJSON *it;
    cJSON_ArrayForEach(it, lt) if (cJSON_IsNumber(it) && it->valuedouble == l) return 1;
    return 0;
}

/* PEFT's layers_to_transform / layers_pattern (check_target_module_exists):
 * a module selected by a list entry other than its own full name is kept
 * only if the layer index its name holds is listed; the index is the first
 * numbered segment (".*?\.[^.]*\.(\d+)\.") or, with layers_pattern, the
 * one after a pattern ("(?:^|.*?\.)PAT\.(\d+)\."); no index: not kept.
 * Expert parameters are not filtered (PEFT's _inject_parameters is not).
 * ctitan then holds and saves the result per layer (full module names). */
static int apply_layers(const cJSON *o, const cJSON *tm, lm_config *c, const unsigned *exact, const char *path,
                        ct_err *e) {
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(o, "layers_to_transform");
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(o, "layers_pattern");
    int using = cJSON_IsNumber(lt) || cJSON_GetArraySize(lt) > 0;
    if (lt && !cJSON_IsNull(lt) && !cJSON_IsNumber(lt) && !cJSON_IsArray(lt))
        return ct_fail(e, CT_ERR_FORMAT, "%s: layers_to_transform: expected an integer or a list of integers", path);
    const cJSON *it;
    const cJSON *arr = cJSON_IsArray(lt) ? lt : NULL;
    cJSON_ArrayForEach(it, arr) {
        if (!cJSON_IsNumber(it) || it->valuedouble != (int)it->valuedouble)
            return ct_fail(e, CT_ERR_FORMAT, "%s: layers_to_transform: expected an integer or a list of integers",
                           path);
    }
    int n_pat = cJSON_IsString(lp) ? (lp->valuestring[0] != 0) : cJSON_GetArraySize(lp);
    if (lp && !cJSON_IsNull(lp) && !cJSON_IsString(lp) && !cJSON_IsArray(lp))
        return ct_fail(e, CT_ERR_FORMAT, "%s: layers_pattern: expected a string or a list of strings", path);
    if (n_pat && !using) /* LoraConfig refuses it so */
        return ct_fail(e, CT_ERR_FORMAT, "%s: layers_pattern: given without layers_to_transform", path);
    if (!using) return 0;
    if (!cJSON_IsArray(tm))
        return ct_fail(e, CT_ERR_FORMAT, "%s: layers_to_transform: needs target_modules as a list (PEFT refuses it "
                                         "with a string)",
                       path);
    int np = n_pat ? n_pat : 1, rc = 0;
    pcre2_code **re = ct_calloc((size_t)np, sizeof *re);
    for (int i = 0; i < np && !rc; i++) {
        const cJSON *pi = cJSON_IsString(lp) ? lp : cJSON_GetArrayItem(lp, i);
        if (n_pat && !cJSON_IsString(pi)) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: layers_pattern: expected a string or a list of strings", path);
            break;
        }
        char pat[512];
        if (n_pat) snprintf(pat, sizeof pat, "(?:^|.*?\\.)%s\\.(?P<idx>\\d+)\\.", pi->valuestring);
        else snprintf(pat, sizeof pat, ".*?\\.[^.]*\\.(?P<idx>\\d+)\\.");
        int code;
        PCRE2_SIZE off;
        re[i] = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED, &code, &off, NULL);
        if (!re[i])
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: layers_pattern: \"%s\" is not a regular expression", path,
                         pi->valuestring);
    }
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    char full[LM_NAME_MAX];
    int any = 0;
    for (int l = 0; l < c->n_layers && !rc; l++)
        for (int p = 0; p < LM_LORA_N; p++) {
            if (!lm_lora_on(c, l, p)) continue;
            if (exact[l] >> p & 1) {
                any = 1;
                continue;
            }
            snprintf(full, sizeof full, "model.layers.%d.%s", l, lora_module_path(c, l, p));
            long idx = -1;
            for (int i = 0; i < np && idx < 0; i++) /* the first pattern that matches gives the index */
                if (pcre2_match(re[i], (PCRE2_SPTR)full, strlen(full), 0, 0, md, NULL) >= 0) {
                    PCRE2_UCHAR *v;
                    PCRE2_SIZE len;
                    if (!pcre2_substring_get_byname(md, (PCRE2_SPTR) "idx", &v, &len)) {
                        idx = strtol((const char *)v, NULL, 10);
                        pcre2_substring_free(v);
                    }
                }
            if (idx >= 0 && idx <= INT32_MAX && in_layers(lt, (int)idx)) any = 1;
            else c->lora_lp[l][p] = LM_LORA_LP_OFF;
        }
    pcre2_match_data_free(md);
    for (int i = 0; i < np; i++) pcre2_code_free(re[i]);
    free(re);
    if (!rc && !any && c->lora_targets)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: layers_to_transform: selects no layer of the targeted modules", path);
    return rc;
}

/* adapter_config.json's target_modules: a list, or "all-linear" */
static int json_targets(const cJSON *o, const cJSON *tm, lm_config *c, const char *path, ct_err *e) {
    if (cJSON_IsString(tm)) {
        memset(c->lora_lp, 0, sizeof c->lora_lp);
        const cJSON *lt = cJSON_GetObjectItemCaseSensitive(o, "layers_to_transform");
        if (cJSON_IsNumber(lt) || cJSON_GetArraySize(lt) > 0)
            return ct_fail(e, CT_ERR_FORMAT, "%s: layers_to_transform: needs target_modules as a list (PEFT refuses "
                                             "it with a string)",
                           path);
        if (!lora_is_all_linear(tm->valuestring))
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: target_modules: \"%s\": a regular expression is not supported; list the modules",
                           path, tm->valuestring);
        /* PEFT saves all-linear of a MoE model resolved (q..o_proj and
         * target_parameters); the unresolved form would need its rewrite here
         * (GraniteMoE has none: its Linears are lora_all_linear's) */
        if (c->n_experts > 0 && c->moe_keys != LM_MOE_KEYS_GRANITE)
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: target_modules: \"all-linear\" on model_type \"%s\": give it resolved as PEFT saves "
                           "it (target_modules q_proj, k_proj, v_proj, o_proj and target_parameters gate.weight, "
                           "gate_up_proj, down_proj with rank_pattern / alpha_pattern .*\\.gate_up_proj at 2 r, 2 alpha)",
                           path, c->model_type);
        c->lora_targets = lora_all_linear(c);
        return 0;
    }
    size_t cap = 1, n = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, tm) {
        if (!cJSON_IsString(it) || strchr(it->valuestring, ','))
            return ct_fail(e, CT_ERR_FORMAT, "%s: target_modules: %s is not a module name", path,
                           cJSON_IsString(it) ? it->valuestring : "(not a string)");
        cap += strlen(it->valuestring) + 1;
    }
    char *list = ct_malloc(cap);
    list[0] = 0;
    cJSON_ArrayForEach(it, tm) n += (size_t)snprintf(list + n, cap - n, "%s%s", n ? "," : "", it->valuestring);
    unsigned *exact = ct_calloc((size_t)c->n_layers + 1, sizeof *exact);
    int rc = targets_from_list(list, c, path, "target_modules", CT_ERR_FORMAT, exact, e);
    if (!rc) rc = apply_layers(o, tm, c, exact, path, e);
    free(exact);
    free(list);
    return rc;
}

/* PEFT's rank_pattern / alpha_pattern: {regex: value}, tried in order
 * against a module's (or parameter's) full name as
 * re.match(rf"(.*\.)?({key})$", name), the first match giving the value
 * (peft/utils/other.py, get_pattern_key). */
typedef struct {
    const char *key;
    double val;
    pcre2_code *re;
    int used;
} lora_pat;

static int pats_compile(const cJSON *o, const char *what, int integer, lora_pat **out, int *n, const char *where,
                        ct_err *e) {
    *out = NULL;
    *n = 0;
    if (!o || cJSON_IsNull(o)) return 0;
    if (!cJSON_IsObject(o))
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s: expected an object {pattern: value}", where, what);
    int cap = cJSON_GetArraySize(o);
    lora_pat *p = ct_calloc((size_t)cap + 1, sizeof *p);
    const cJSON *it;
    int rc = 0;
    cJSON_ArrayForEach(it, o) {
        double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!(v > 0) || (integer && (v != (int)v || v > 65536))) {
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: %s: \"%s\": expected a positive %s", where, what, it->string,
                         integer ? "integer" : "number");
            break;
        }
        size_t len = strlen(it->string) + 16;
        char *re = ct_malloc(len);
        snprintf(re, len, "(.*\\.)?(%s)$", it->string);
        int code;
        PCRE2_SIZE off;
        p[*n].re = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED, &code, &off, NULL);
        free(re);
        if (!p[*n].re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(code, msg, sizeof msg);
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: %s: key \"%s\" is not a regular expression: %s", where, what,
                         it->string, (const char *)msg);
            break;
        }
        p[*n].key = it->string;
        p[(*n)++].val = v;
    }
    *out = p;
    return rc;
}

static void pats_free(lora_pat *p, int n) {
    for (int i = 0; i < n; i++) pcre2_code_free(p[i].re);
    free(p);
}

/* The first key that matches `name`; every key that does is marked used
 * (PEFT warns only on a key that matches no targeted module). */
static lora_pat *pats_first(lora_pat *p, int n, const char *name, pcre2_match_data *md) {
    lora_pat *first = NULL;
    for (int i = 0; i < n; i++)
        if (pcre2_match(p[i].re, (PCRE2_SPTR)name, strlen(name), 0, 0, md, NULL) >= 0) {
            p[i].used = 1;
            if (!first) first = &p[i];
        }
    return first;
}

/* The rank and alpha PEFT gives module or parameter `name`. */
static void pats_pick(lora_pat *R, int nr, lora_pat *A, int na, const char *name, pcre2_match_data *md, int r0,
                      double a0, int *r, double *a) {
    lora_pat *pr = pats_first(R, nr, name, md), *pa = pats_first(A, na, name, md);
    *r = pr ? (int)pr->val : r0;
    *a = pa ? pa->val : a0;
}

/* rank_pattern / alpha_pattern into c (lora_lp, lora_kind, lora_exp_*): its
 * targets, rank and scale set, alpha the default. */
static int set_patterns(lm_config *c, const cJSON *rank_pattern, const cJSON *alpha_pattern, double alpha, int rslora,
                        const char *where, ct_err *e) {
    lora_pat *R = NULL, *A = NULL;
    int nr = 0, na = 0;
    int rc = pats_compile(rank_pattern, "rank_pattern", 1, &R, &nr, where, e);
    if (!rc) rc = pats_compile(alpha_pattern, "alpha_pattern", 0, &A, &na, where, e);
    c->n_lora_kinds = 0;
    for (int l = 0; l < c->n_layers; l++)
        for (int p = 0; p < LM_LORA_N; p++)
            if (c->lora_lp[l][p] != LM_LORA_LP_OFF) c->lora_lp[l][p] = 0;
    memset(c->lora_exp_rank, 0, sizeof c->lora_exp_rank);
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    char name[LM_NAME_MAX];
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int p = 0; p < LM_LORA_N && !rc; p++) {
            if (!lm_lora_on(c, l, p) || module_head(c, p) != p) continue;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, lora_module_path(c, l, p));
            int r;
            double a;
            pats_pick(R, nr, A, na, name, md, c->lora_rank, alpha, &r, &a);
            if (r == c->lora_rank && a == alpha) continue;
            int k = 0;
            while (k < c->n_lora_kinds && (c->lora_kind[k].rank != r || c->lora_kind[k].alpha != a)) k++;
            if (k == LM_LORA_MAX_KINDS) {
                rc = ct_fail(e, CT_ERR_CONFIG, "%s: rank_pattern / alpha_pattern: more than %d distinct (rank, alpha)",
                             where, LM_LORA_MAX_KINDS);
                break;
            }
            if (k == c->n_lora_kinds) {
                c->lora_kind[k].rank = r;
                c->lora_kind[k].alpha = a;
                c->lora_kind[k].scale = lora_scaling(a, r, rslora);
                c->n_lora_kinds++;
            }
            for (int q = 0; q < LM_LORA_N; q++) /* a fused module's projections share its one adapter */
                if (module_head(c, q) == p && lm_lora_on(c, l, q)) c->lora_lp[l][q] = (unsigned char)(k + 1);
        }
    /* an expert parameter keeps one rank and scale over the MoE layers
     * (lora_exp_rank): PEFT's own patterns (.*\.gate_up_proj) select all */
    for (int x = 0; x < LM_LORA_PARAM_N && !rc; x++) {
        int seen = -1, r0 = 0;
        double a0 = 0;
        for (int l = 0; l < c->n_layers && !rc; l++) {
            if (!lm_lora_expert_on(c, l, x)) continue;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, param_path(c, x));
            int r;
            double a;
            pats_pick(R, nr, A, na, name, md, c->lora_rank, alpha, &r, &a);
            if (seen < 0) seen = l, r0 = r, a0 = a;
            else if (r != r0 || a != a0)
                rc = ct_fail(e, CT_ERR_CONFIG,
                             "%s: rank_pattern / alpha_pattern: %s gets rank %d, alpha %g in layer %d but "
                             "rank %d, alpha %g in layer %d; ctitan keeps one rank and alpha per expert (router) "
                             "parameter",
                             where, param_path(c, x), r0, a0, seen, r, a, l);
        }
        if (!rc && seen >= 0 && (r0 != c->lora_rank || a0 != alpha)) {
            c->lora_exp_rank[x] = r0;
            c->lora_exp_alpha[x] = a0;
            c->lora_exp_scale[x] = lora_scaling(a0, r0, rslora);
        }
    }
    /* lm_head's and embed_tokens' adapters are held at lora_rank and lora_scale (build_layout) */
    static const struct { unsigned bit; const char *path, *name; } held[] = {
        {LORA_HEAD, "lm_head", "lm_head"}, {LORA_EMBED, "model.embed_tokens", "embed_tokens"}};
    for (size_t k = 0; k < sizeof held / sizeof held[0] && !rc; k++) {
        if (!(c->lora_targets & held[k].bit)) continue;
        int r;
        double a;
        pats_pick(R, nr, A, na, held[k].path, md, c->lora_rank, alpha, &r, &a);
        if (r != c->lora_rank || a != alpha)
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: rank_pattern / alpha_pattern: a key selects %s (rank %d, alpha %g); ctitan adapts "
                         "%s at lora.rank and lora.alpha (%d, %g) only",
                         where, held[k].name, r, a, held[k].name, c->lora_rank, alpha);
    }
    /* PEFT warns on a key that selects no adapted module and ignores it: a
     * typo here would silently leave the rank of the module it meant */
    for (int w = 0; w < 2 && !rc; w++)
        for (int i = 0; i < (w ? na : nr) && !rc; i++)
            if (!(w ? A : R)[i].used)
                rc = ct_fail(e, CT_ERR_CONFIG,
                             "%s: %s: key \"%s\" selects no adapted module or parameter of this model (PEFT matches "
                             "it as (.*\\.)?(KEY)$ against names like model.layers.0.self_attn.q_proj)",
                             where, w ? "alpha_pattern" : "rank_pattern", (w ? A : R)[i].key);
    pcre2_match_data_free(md);
    pats_free(R, nr);
    pats_free(A, na);
    return rc;
}

/* A config's pattern text ("" or a JSON object) -> a cJSON object (NULL: "") */
static int pattern_text(const char *text, const char *what, cJSON **out, const char *where, ct_err *e) {
    *out = NULL;
    if (!text || !text[strspn(text, " \t\n")]) return 0;
    *out = cJSON_Parse(text);
    if (!cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        *out = NULL;
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: lora.%s: \"%s\" is not a JSON object {\"pattern\": value} (PEFT's LoraConfig.%s)", where,
                       what, text, what);
    }
    return 0;
}

int lora_config_patterns(lm_config *c, const char *rank_pattern, const char *alpha_pattern, double alpha, int rslora,
                         int gate_up_fused, const char *where, ct_err *e) {
    /* GraniteMoE: PEFT rewrites no target_modules name into its experts or router (they
     * are no Linear: "all-linear" adapts q/k/v/o_proj and GraniteMoeShared's
     * shared_mlp.input_linear / output_linear only); target_parameters reach them
     * (block_sparse_moe.experts.gate_up_proj / down_proj, block_sparse_moe.router.weight) */
    unsigned attn = (1u << LM_LORA_Q) | (1u << LM_LORA_K) | (1u << LM_LORA_V) | (1u << LM_LORA_O);
    if (granite_shared(c)) attn |= (1u << LM_LORA_GATE) | (1u << LM_LORA_UP) | (1u << LM_LORA_DOWN);
    if (c->moe_keys == LM_MOE_KEYS_GRANITE && (c->lora_targets & ~attn & ((1u << LM_LORA_N) - 1)))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: lora.target_modules: model_type \"%s\" has no Linear experts or router (PEFT "
                       "reaches them through lora.target_parameters block_sparse_moe.experts.gate_up_proj / "
                       "down_proj, router.weight; its \"all-linear\" adapts q_proj, k_proj, v_proj, o_proj and a "
                       "shared MLP's input_linear, output_linear only)",
                       where, c->model_type);
    cJSON *rp, *ap;
    int rc = pattern_text(rank_pattern, "rank_pattern", &rp, where, e);
    if (!rc) rc = pattern_text(alpha_pattern, "alpha_pattern", &ap, where, e);
    if (rc) {
        cJSON_Delete(rp);
        return rc;
    }
    if (gate_up_fused) {
        /* PEFT's _convert_peft_config_moe: rank_pattern[".*\.gate_up_proj"] =
         * 2 r, alpha_pattern[...] = 2 alpha, a Python dict assignment: the
         * value of an existing key is replaced where it stands, a new key goes
         * last (so a user's earlier key that also matches still wins) */
        const char *key = ".*\\.gate_up_proj";
        cJSON **d[2] = {&rp, &ap};
        double v[2] = {2.0 * c->lora_rank, 2.0 * alpha};
        for (int w = 0; w < 2; w++) {
            if (!*d[w]) *d[w] = cJSON_CreateObject();
            if (cJSON_GetObjectItemCaseSensitive(*d[w], key))
                cJSON_ReplaceItemInObjectCaseSensitive(*d[w], key, cJSON_CreateNumber(v[w]));
            else cJSON_AddNumberToObject(*d[w], key, v[w]);
        }
    }
    rc = set_patterns(c, rp, ap, alpha, rslora, where, e);
    cJSON_Delete(rp);
    cJSON_Delete(ap);
    return rc;
}

static int lora_any_expert(const lm_config *c) {
    for (int l = 0; l < c->n_layers; l++)
        if (c->lora_rank > 0 && lm_layer_is_moe(c, l) && c->lora_experts[l]) return 1;
    return 0;
}

/* adapter_config.json's target_parameters (absent, null or a list of
 * strings) into c->lora_experts[] */
static int json_target_params(const cJSON *tp, lm_config *c, const char *path, ct_err *e) {
    memset(c->lora_experts, 0, sizeof c->lora_experts);
    if (!tp || cJSON_IsNull(tp)) return 0;
    if (!cJSON_IsArray(tp))
        return ct_fail(e, CT_ERR_FORMAT, "%s: target_parameters: expected a list of parameter names", path);
    size_t cap = 1, n = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, tp) {
        if (!cJSON_IsString(it) || strchr(it->valuestring, ','))
            return ct_fail(e, CT_ERR_FORMAT, "%s: target_parameters: %s is not a parameter name", path,
                           cJSON_IsString(it) ? it->valuestring : "(not a string)");
        cap += strlen(it->valuestring) + 1;
    }
    char *list = ct_malloc(cap);
    list[0] = 0;
    cJSON_ArrayForEach(it, tp) n += (size_t)snprintf(list + n, cap - n, "%s%s", n ? "," : "", it->valuestring);
    int rc = lora_parse_target_params(list, c, path, "target_parameters", e);
    free(list);
    if (rc && e) e->code = CT_ERR_FORMAT;
    return rc ? CT_ERR_FORMAT : 0;
}

/* The adapter's target_parameters against the run's lora.target_parameters */
static int check_target_params(const cJSON *tp, const lm_config *c, const char *path, ct_err *e) {
    if (!tp || cJSON_IsNull(tp))
        return lora_any_expert(c) ? ct_fail(e, CT_ERR_CONFIG,
                                            "%s: target_parameters: none in the adapter, but lora.target_parameters "
                                            "names some",
                                            path)
                                  : 0;
    lm_config *own = ct_malloc(sizeof *own);
    *own = *c;
    int rc = json_target_params(tp, own, path, e);
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int x = 0; !rc && x < LM_LORA_PARAM_N; x++) {
            int oa = lm_lora_expert_on(own, l, x), on = lm_lora_expert_on(c, l, x);
            if (oa != on)
                rc = ct_fail(e, CT_ERR_CONFIG,
                             "%s: target_parameters: the adapter %s model.layers.%d.%s%s, the run's [lora] %s it "
                             "(lora.target_parameters; all-linear on a MoE model adapts the experts and the routers)",
                             path, oa ? "adapts" : "does not adapt", l, param_path(c, x),
                             x == LM_LORA_EXP_R ? " (the MoE router)" : "", on ? "adapts" : "does not adapt");
        }
    free(own);
    return rc;
}


/* adapter_config.json keys with which PEFT computes something ctitan does
 * not (LoraConfig, peft 0.21.2): each must be absent or hold its default.
 * need: 0 null or empty, 1 false, 2 "none", 3 true / false / "gaussian"
 * (initialisations of fresh adapters only; pissa, olora, corda, loftq, eva,
 * lora_ga and the like also rewrite the base weights). */
static const struct {
    const char *key;
    int need;
    const char *what;
} plain_keys[] = {
    {"use_dora", 1, "DoRA adapters are not supported"},
    {"fan_in_fan_out", 1, "true is for Conv1D models, not Qwen3"},
    {"lora_bias", 1, "a bias on lora_B is not supported"},
    {"bias", 2, "training the base model's biases is not supported"},
    {"init_lora_weights", 3, "this initialisation also changes the base weights, which ctitan does not"},
    {"exclude_modules", 0, "not supported: list the modules to adapt in target_modules"},
    {"layer_replication", 0, "replicated layers are not supported"},
    {"trainable_token_indices", 0, "trainable tokens are not supported"},
    {"alora_invocation_tokens", 0, "activated LoRA (aLoRA) is not supported"},
    {"use_qalora", 1, "QA-LoRA is not supported"},
    {"use_bdlora", 0, "not supported"},
    {"arrow_config", 0, "Arrow routing is not supported"},
    {"kasa_config", 0, "KaSA is not supported"},
    {"monteclora_config", 0, "MonteCLoRA is not supported"},
    {"velora_config", 0, "not supported"},
    {"megatron_config", 0, "Megatron layers are not supported"},
};

static int plain_lora(const cJSON *o, const char *path, ct_err *e) {
    for (size_t i = 0; i < sizeof plain_keys / sizeof *plain_keys; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, plain_keys[i].key);
        if (!v || cJSON_IsNull(v)) continue;
        int ok;
        switch (plain_keys[i].need) {
        case 0: ok = (cJSON_IsArray(v) || cJSON_IsObject(v)) && !cJSON_GetArraySize(v); break;
        case 1: ok = cJSON_IsFalse(v); break;
        case 2: ok = cJSON_IsString(v) && !strcmp(v->valuestring, "none"); break;
        default: ok = cJSON_IsBool(v) || (cJSON_IsString(v) && !strcmp(v->valuestring, "gaussian")); break;
        }
        if (ok) continue;
        char *txt = cJSON_PrintUnformatted(v);
        int rc = ct_fail(e, CT_ERR_FORMAT, "%s: %s: %.200s: %s", path, plain_keys[i].key, txt ? txt : "?",
                         plain_keys[i].what);
        free(txt);
        return rc;
    }
    return 0;
}

/* PEFT never puts an adapter inside a module of modules_to_save
 * (check_target_module_exists: re.match(rf"(^|.*\.){m}($|\..*)", key)):
 * where ctitan's targets and modules_to_save overlap so, it is refused
 * rather than computed otherwise. list: comma-joined. */
static int saved_vs_targets(const lm_config *c, const char *list, const char *where, const char *key, ct_err *e) {
    char item[256], pat[320], full[LM_NAME_MAX];
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    int rc = 0;
    for (const char *q = list; !rc && q && (q = cfg_list_next(q, item, sizeof item));) {
        snprintf(pat, sizeof pat, "(^|.*\\.)%s($|\\..*)", item);
        int code;
        PCRE2_SIZE off;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED, &code, &off, NULL);
        for (int l = 0; re && !rc && l < c->n_layers; l++)
            for (int p = 0; p < LM_LORA_N && !rc; p++) {
                if (!lm_lora_on(c, l, p) || module_head(c, p) != p) continue;
                snprintf(full, sizeof full, "model.layers.%d.%s", l, lora_module_path(c, l, p));
                if (pcre2_match(re, (PCRE2_SPTR)full, strlen(full), 0, 0, md, NULL) >= 0)
                    rc = ct_fail(e, CT_ERR_CONFIG,
                                 "%s: %s: \"%s\" holds the adapted module %s: PEFT puts no adapter inside a module "
                                 "to save (it would train the module in full instead); adapt or save it, not both",
                                 where, key, item, full);
            }
        if (re && !rc && (c->lora_targets & LORA_HEAD) &&
            pcre2_match(re, (PCRE2_SPTR) "lm_head", 7, 0, 0, md, NULL) >= 0)
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: %s: \"%s\" holds the adapted module lm_head: PEFT puts no adapter inside a module "
                         "to save (it would train the module in full instead); adapt or save it, not both",
                         where, key, item);
        if (re && !rc && (c->lora_targets & LORA_EMBED) &&
            pcre2_match(re, (PCRE2_SPTR) "model.embed_tokens", 18, 0, 0, md, NULL) >= 0)
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: %s: \"%s\" holds the adapted module embed_tokens: PEFT puts no adapter inside a "
                         "module to save (it would train the module in full instead); adapt or save it, not both",
                         where, key, item);
        pcre2_code_free(re);
    }
    pcre2_match_data_free(md);
    return rc;
}

int lora_check_saved_targets(const lm_config *c, const char *modules_to_save, const char *where, ct_err *e) {
    return saved_vs_targets(c, modules_to_save, where, "lora.modules_to_save", e);
}

/* ensure_weight_tying in adapter_config.json: whether PEFT shares one
 * tensor between embed_tokens and lm_head as ctitan's tied model does.
 * true asks PEFT to tie where the model is tied (tie_word_embeddings) and a
 * modules_to_save entry names embed_tokens or lm_head (_check_tied_modules);
 * elsewhere it ties nothing (PEFT warns and computes plain LoRA, as ctitan
 * does), so true is read everywhere. What ctitan cannot compute is a tied
 * model whose adapter trains one of the pair alone: an entry selecting
 * either without ensure_weight_tying (PEFT copies that module; the other
 * keeps the base weights), or under another name than PEFT ties. */
static int check_tying(const cJSON *o, const lm_config *c, const char *path, ct_err *e) {
    const cJSON *ewt = cJSON_GetObjectItemCaseSensitive(o, "ensure_weight_tying"), *it;
    if (ewt && !cJSON_IsNull(ewt) && !cJSON_IsBool(ewt))
        return ct_fail(e, CT_ERR_FORMAT, "%s: ensure_weight_tying: expected true or false", path);
    /* PEFT with ensure_weight_tying moves an lm_head target of a tied model onto the
     * embedding (LoraModel._add_targets_to_tie: lora_embedding_A / B, lm_head sharing them) */
    if (c->tie_embeddings && (c->lora_targets & LORA_HEAD) && cJSON_IsTrue(ewt))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: ensure_weight_tying: true with target_modules lm_head on a tied model: PEFT then adapts "
                       "embed_tokens (lora_embedding_A / B) and ties lm_head to it, which ctitan does not support",
                       path);
    /* and with an embed_tokens target it gives lm_head the same adapter (TiedEmbedding) */
    if (c->tie_embeddings && (c->lora_targets & LORA_EMBED) && cJSON_IsTrue(ewt))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: ensure_weight_tying: true with target_modules embed_tokens on a tied model: PEFT then "
                       "adapts lm_head with the embedding's adapter too, which ctitan does not support",
                       path);
    const cJSON *mts = cJSON_GetObjectItemCaseSensitive(o, "modules_to_save");
    if (!cJSON_IsArray(mts)) return 0;
    cJSON_ArrayForEach(it, mts) {
        if (!cJSON_IsString(it) || !selects_tied(c, it->valuestring)) continue;
        /* the file's own values: a malformed file (3), as plain_lora's keys */
        int rc = refuse_untied_name(c, it->valuestring, path, "modules_to_save", CT_ERR_FORMAT, e);
        if (rc) return rc;
        if (!cJSON_IsTrue(ewt))
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: ensure_weight_tying: modules_to_save lists \"%s\", but lm_head and embed_tokens are "
                           "one tied tensor in this model (tie_word_embeddings) and the adapter does not set "
                           "ensure_weight_tying = true: PEFT then trains a copy of the one module and keeps the other "
                           "at the base weights, which ctitan's tied model cannot compute (an adapter ctitan wrote "
                           "before it saved ensure_weight_tying was trained as the tied pair: set "
                           "\"ensure_weight_tying\": true in its adapter_config.json to read it so)",
                           path, it->valuestring);
    }
    return 0;
}

/* adapter_config.json into c's LoRA fields: rank, targets, expert
 * parameters, scale, the per-module rank_pattern / alpha_pattern (no
 * dropout: the caller's). */
static int read_adapter(const cJSON *o, lm_config *c, double *alpha, int *rslora, const char *path, ct_err *e) {
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(o, "r"), *a = cJSON_GetObjectItemCaseSensitive(o, "lora_alpha");
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(o, "target_modules");
    const cJSON *tp = cJSON_GetObjectItemCaseSensitive(o, "target_parameters");
    int has_tp = cJSON_GetArraySize(tp) > 0;
    /* "r": 4.0 is refused as PEFT refuses it (LoraConfig's int field), and as config.json's sizes are */
    if (!json_integer_in(r, 1, 65536))
        return ct_fail(e, CT_ERR_FORMAT, "%s: r: expected a positive integer", path);
    if (!cJSON_IsNumber(a) || !(a->valuedouble > 0))
        return ct_fail(e, CT_ERR_FORMAT, "%s: lora_alpha: expected a positive number", path);
    if (!cJSON_IsArray(tm) && !cJSON_IsString(tm) && !(has_tp && (!tm || cJSON_IsNull(tm))))
        return ct_fail(e, CT_ERR_FORMAT, "%s: target_modules: expected a list of module names", path);
    int rc = plain_lora(o, path, e);
    if (rc) return rc;
    c->lora_rank = (int)r->valuedouble;
    rc = cJSON_IsNull(tm) || !tm ? (c->lora_targets = 0, memset(c->lora_lp, 0, sizeof c->lora_lp), 0)
                                     : json_targets(o, tm, c, path, e);
    if (!rc) rc = json_target_params(tp, c, path, e);
    if (rc) return rc;
    *alpha = a->valuedouble;
    *rslora = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "use_rslora"));
    c->lora_scale = lora_scaling(*alpha, c->lora_rank, *rslora);
    c->lora_dropout = 0;
    if ((rc = lora_check_fused(c, path, "target_modules", e))) return rc;
    const cJSON *mts = cJSON_GetObjectItemCaseSensitive(o, "modules_to_save"), *it;
    if (!cJSON_IsArray(mts)) mts = NULL;
    cJSON_ArrayForEach(it, mts) {
        if (cJSON_IsString(it) && (rc = saved_vs_targets(c, it->valuestring, path, "modules_to_save", e))) return rc;
    }
    if ((rc = check_tying(o, c, path, e))) return rc;
    rc = set_patterns(c, cJSON_GetObjectItemCaseSensitive(o, "rank_pattern"),
                      cJSON_GetObjectItemCaseSensitive(o, "alpha_pattern"), *alpha, *rslora, path, e);
    /* set_patterns' errors are config errors (2) for [lora]'s values; here the patterns are the
     * adapter file's, a malformed file (3) as its r and lora_alpha are */
    if (rc == CT_ERR_CONFIG) {
        if (e) e->code = CT_ERR_FORMAT;
        rc = CT_ERR_FORMAT;
    }
    return rc;
}

/* The adapter's modules, ranks and scales (ad) against the run's (c) */
static int compare_adapter(const lm_config *ad, const lm_config *c, const char *path, ct_err *e) {
    char name[LM_NAME_MAX];
    if ((ad->lora_targets ^ c->lora_targets) & LORA_EMBED)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: target_modules: the adapter %s embed_tokens, the run's lora.target_modules %s it", path,
                       ad->lora_targets & LORA_EMBED ? "adapts" : "does not adapt",
                       c->lora_targets & LORA_EMBED ? "adapts" : "does not adapt");
    if ((ad->lora_targets ^ c->lora_targets) & LORA_HEAD)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: target_modules: the adapter %s lm_head, the run's lora.target_modules %s it", path,
                       ad->lora_targets & LORA_HEAD ? "adapts" : "does not adapt",
                       c->lora_targets & LORA_HEAD ? "adapts" : "does not adapt");
    for (int l = 0; l < c->n_layers; l++)
        for (int p = 0; p < LM_LORA_N; p++) {
            int oa = lm_lora_on(ad, l, p), on = lm_lora_on(c, l, p);
            if ((!oa && !on) || module_head(c, p) != p) continue;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, lora_module_path(c, l, p));
            if (oa != on)
                return ct_fail(e, CT_ERR_CONFIG,
                               "%s: target_modules: the adapter %s %s, the run's lora.target_modules %s it",
                               path, oa ? "adapts" : "does not adapt", name, on ? "adapts" : "does not adapt");
            int ra = lm_lora_rank(ad, l, p), rr = lm_lora_rank(c, l, p);
            float sa = lm_lora_scale(ad, l, p), sr = lm_lora_scale(c, l, p);
            if (ra != rr || fabsf(sa - sr) > 1e-6f * sr)
                return ct_fail(e, CT_ERR_CONFIG,
                               "%s: r / rank_pattern / alpha_pattern: %s has rank %d and scaling %g in the adapter, "
                               "rank %d and scaling %g in the run (give lora.rank_pattern / lora.alpha_pattern as "
                               "the adapter's)",
                               path, name, ra, (double)sa, rr, (double)sr);
        }
    for (int x = 0; x < LM_LORA_PARAM_N; x++) {
        int on = 0;
        for (int l = 0; l < c->n_layers; l++) on |= lm_lora_expert_on(c, l, x);
        if (!on) continue;
        int ra = lm_lora_exp_rank(ad, x), rr = lm_lora_exp_rank(c, x);
        float sa = lm_lora_exp_scale(ad, x), sr = lm_lora_exp_scale(c, x);
        if (ra != rr || fabsf(sa - sr) > 1e-6f * sr)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: rank_pattern / alpha_pattern: the adapter's %s has rank %d and scaling %g, "
                           "the run's %d and %g (gate_proj + up_proj in lora.target_modules of a MoE model give "
                           "gate_up_proj rank 2 r and alpha 2 alpha, as PEFT's rewrite; lora.target_parameters alone r "
                           "and alpha)",
                           path, param_path(c, x), ra, (double)sa, rr, (double)sr);
    }
    return 0;
}

static int check_config(const lm_model *table, const cJSON *o, const char *path, ct_err *e) {
    if (!cJSON_IsObject(o)) return ct_fail(e, CT_ERR_FORMAT, "%s: not a JSON object", path);
    const lm_config *c = &table->cfg;
    int rc = 0;
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(o, "peft_type");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(o, "r");
    const cJSON *alpha = cJSON_GetObjectItemCaseSensitive(o, "lora_alpha");
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(o, "use_rslora");
    const cJSON *tp = cJSON_GetObjectItemCaseSensitive(o, "target_parameters");
    if (!cJSON_IsString(pt) || strcmp(pt->valuestring, "LORA"))
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: peft_type: expected \"LORA\"", path);
    else if (!cJSON_IsNumber(r) || r->valuedouble != c->lora_rank)
        rc = cJSON_IsNumber(r) ? ct_fail(e, CT_ERR_CONFIG, "%s: r: the adapter's rank %g differs from lora.rank = %d",
                                         path, r->valuedouble, c->lora_rank)
                               : ct_fail(e, CT_ERR_FORMAT, "%s: r: missing or not a number", path);
    else if (cJSON_IsNumber(alpha) &&
             fabsf(lora_scaling(alpha->valuedouble, c->lora_rank, cJSON_IsTrue(rs)) - c->lora_scale) >
                 1e-6f * c->lora_scale)
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: lora_alpha %g (use_rslora %s) gives another scaling than lora.alpha and lora.use_rslora",
                     path, alpha->valuedouble, cJSON_IsTrue(rs) ? "true" : "false");
    else if (!(rc = plain_lora(o, path, e)))
        rc = check_target_params(tp, c, path, e);
    if (!rc) { /* the adapter read as generation reads it, module by module against the run */
        lm_config *own = ct_malloc(sizeof *own);
        *own = *c;
        double al;
        int rsl;
        rc = read_adapter(o, own, &al, &rsl, path, e);
        if (!rc) rc = compare_adapter(own, c, path, e);
        free(own);
    }
    return rc;
}

/* A key of PEFT's per-expert form ("...mlp.experts.3.gate_proj.lora_A.weight",
 * Mixtral's "...block_sparse_moe.experts.3.w1.lora_A.weight"):
 * transformers v4 held Qwen3-MoE's (and Mixtral's) experts as a list of
 * Linears, and PEFT adapted each one. transformers v5 fuses them, PEFT 0.21
 * adapts the fused parameters, and ctitan reads that form only; without this
 * check the config's gate_proj would be read as a dense MLP's and the error
 * would name a key the file never had. */
static int per_expert_key(const char *name) {
    /* Qwen3-MoE's v4 module path, and Mixtral's (block_sparse_moe.experts.N.w1 / w2 / w3) */
    static const char *const lists[] = {".mlp.experts.", ".block_sparse_moe.experts."};
    for (size_t i = 0; i < sizeof lists / sizeof *lists; i++) {
        const char *p = strstr(name, lists[i]);
        if (!p) continue;
        p += strlen(lists[i]);
        if (*p < '0' || *p > '9') continue;
        while (*p >= '0' && *p <= '9') p++;
        if (*p == '.') return 1;
    }
    return 0;
}

/* The refusal of a per-expert adapter file f (at path), naming its first such key. */
static int refuse_per_expert(st_file *f, const char *path, ct_err *e) {
    for (int j = 0; j < st_count(f); j++)
        if (per_expert_key(st_get(f, j)->name))
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: tensor \"%s\" is a per-expert adapter (PEFT on transformers v4's unfused experts); "
                           "ctitan reads expert adapters in PEFT's fused form only (target_parameters "
                           "mlp.experts.gate_up_proj / mlp.experts.down_proj, as PEFT 0.21 on transformers v5 "
                           "saves them)",
                           path, st_get(f, j)->name);
    return 0;
}

/* The same, before the adapter's config is read: such a config names modules
 * (Mixtral's w1, w2, w3) that would otherwise be refused first, as targets
 * ctitan does not adapt, which hides what the file is. A file that cannot be
 * opened is left to the loader, which says so. */
static int refuse_per_expert_dir(const char *dir, ct_err *e) {
    char path[4200];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    ct_err quiet = {0};
    st_file *f = st_open(path, &quiet);
    if (!f) return 0;
    int rc = refuse_per_expert(f, path, e);
    st_close(f);
    return rc;
}

int lora_read_config(const char *dir, lm_config *c, double *alpha, int *rslora, ct_err *e) {
    int rc = refuse_per_expert_dir(dir, e);
    if (rc) return rc;
    char path[4200];
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    cJSON *o = json_parse_file(path, 0, e);
    if (!o) return e ? e->code : CT_ERR_FORMAT;
    rc = cJSON_IsObject(o) ? read_adapter(o, c, alpha, rslora, path, e)
                               : ct_fail(e, CT_ERR_FORMAT, "%s: not a JSON object", path);
    cJSON_Delete(o);
    return rc;
}

/* An error (e set) when the adapter config o (at cpath) lists, in
 * modules_to_save, a module holding tensor t (of the model c), whose PEFT
 * key KEY the adapter's file (at path) lacks; else 0. */
static int adapter_lists_module(const cJSON *o, const lm_config *c, const char *cpath, const char *path,
                                const lm_tensor *t, const char *key, ct_err *e) {
    const cJSON *mts = cJSON_GetObjectItemCaseSensitive(o, "modules_to_save"), *it;
    if (!cJSON_IsArray(mts)) mts = NULL;
    cJSON_ArrayForEach(it, mts) {
        if (cJSON_IsString(it) && (in_saved_module_of(c, t, it->valuestring) ||
                                   (t->slot == LM_S_EMBED && selects_tied(c, it->valuestring))))
            return ct_fail(e, CT_ERR_FORMAT, "%s: modules_to_save lists \"%s\", but %s has no \"%s\"", cpath,
                           it->valuestring, path, key);
    }
    return 0;
}

/* Whether the adapter config o trains the tied embedding as PEFT's
 * ensure_weight_tying does (check_tying has refused every other way a tied
 * model's embedding or lm_head could be listed). PEFT then saves the one
 * tensor twice, as the embedding's copy and as lm_head's, and its loader
 * needs both keys (set_peft_model_state_dict: KeyError without lm_head's). */
static int tied_pair_saved(const cJSON *o, const lm_config *c) {
    const cJSON *mts = cJSON_GetObjectItemCaseSensitive(o, "modules_to_save"), *it;
    if (!c->tie_embeddings || !cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "ensure_weight_tying")) ||
        !cJSON_IsArray(mts))
        return 0;
    cJSON_ArrayForEach(it, mts) {
        if (cJSON_IsString(it) && selects_tied(c, it->valuestring)) return 1;
    }
    return 0;
}

#define PEFT_TIED_HEAD PEFT_PREFIX "lm_head.weight"
#define PEFT_HEAD_BASE PEFT_PREFIX "lm_head.base_layer.weight"
#define PEFT_EMBED_BASE PEFT_PREFIX "model.embed_tokens.base_layer.weight"

/* The file's tensor st (key KEY) for table tensor t into buf, as fp32,
 * checked: its shape, its dtype, finite values. */
static int read_tensor(const lm_model *table, const lm_tensor *t, const st_tensor *st, const char *key,
                       const char *path, float *buf, ct_err *e) {
    if (st->ndim > 2) /* the shape messages below print two dimensions */
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has %d dimensions, the model expects %d", path, key,
                       st->ndim, t->ndim);
    int same = st->ndim == t->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = st->shape[d] == t->shape[d];
    if (!same && (t->slot == LM_S_LORA_EA || t->slot == LM_S_LORA_EB))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: tensor \"%s\" has shape [%lld%s%lld], the model expects [%lld, %lld] (an expert adapter: "
                       "r x num_experts = %d x %d rows of lora_A, columns of lora_B)",
                       path, key, (long long)st->shape[0], st->ndim > 1 ? ", " : "",
                       st->ndim > 1 ? (long long)st->shape[1] : 0LL, (long long)t->shape[0], (long long)t->shape[1],
                       table->cfg.lora_rank, table->cfg.n_experts);
    if (!same)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has shape [%lld%s%lld], the model expects [%lld, %lld]",
                       path, key, (long long)st->shape[0], st->ndim > 1 ? ", " : "",
                       st->ndim > 1 ? (long long)st->shape[1] : 0LL, (long long)t->shape[0],
                       (long long)(t->ndim > 1 ? t->shape[1] : 1));
    if (ct_convert_to_f32(buf, st->data, st->dtype, t->numel) != 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s; expected F32, BF16, F16 or F64", path, key,
                       ct_dtype_name(st->dtype));
    /* a NaN adapter weight trained to "diverged at step 1" or generated "non-finite logits",
     * naming nothing; merged by export it was written out */
    return ct_check_finite(buf, t->numel, 0, path, key, e);
}

/* Table tensor t, a piece of fused file tensor st (f: its place), into buf */
static int read_piece(const lm_tensor *t, const hf_fused *f, const st_tensor *st, const char *key, const char *path,
                      float *buf, ct_err *e) {
    int same = st->ndim == f->ndim;
    for (int d = 0; same && d < f->ndim; d++) same = st->shape[d] == f->shape[d];
    if (!same) {
        char got[96] = "", want[96] = "";
        for (int d = 0; d < st->ndim && d < 3; d++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "", (long long)st->shape[d]);
        for (int d = 0; d < f->ndim; d++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", d ? ", " : "", (long long)f->shape[d]);
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has shape [%s], the model expects [%s]", path, key, got,
                       want);
    }
    const char *src = (const char *)st->data + f->off * ct_dtype_size(st->dtype);
    if (ct_convert_to_f32(buf, src, st->dtype, t->numel) != 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s; expected F32, BF16, F16 or F64", path, key,
                       ct_dtype_name(st->dtype));
    return ct_check_finite(buf, t->numel, f->off, path, key, e);
}

int lora_load_peft_each(const lm_model *table, const char *dir, const lm_sink *s, ct_err *e) {
    char path[4200];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    st_file *f = st_open(path, e);
    if (!f) return e ? e->code : CT_ERR_IO;
    if (refuse_per_expert(f, path, e)) {
        st_close(f);
        return e ? e->code : CT_ERR_FORMAT;
    }
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/adapter_config.json", dir);
    cJSON *cfg = json_parse_file(cpath, 0, e); /* read once: checked here, its modules_to_save below */
    int rc = cfg ? check_config(table, cfg, cpath, e) : e ? e->code : CT_ERR_FORMAT;
    if (rc) {
        cJSON_Delete(cfg);
        st_close(f);
        return rc;
    }
    int pair = tied_pair_saved(cfg, &table->cfg);
    char key[LM_NAME_MAX + 32];
    float *buf = NULL, *buf2 = NULL;
    for (int i = 0; i < table->n_tensors && !rc; i++) {
        const lm_tensor *t = &table->tensors[i];
        if (!lora_saved(t)) continue;
        hf_fused fz;
        char mod[LM_NAME_MAX];
        int fused = peft_module_key(&table->cfg, t, mod, sizeof mod, &fz);
        snprintf(key, sizeof key, PEFT_PREFIX "%s", mod);
        const st_tensor *st = st_find(f, key);
        /* tied: lm_head's key is the same tensor again, which PEFT loads into the one shared parameter */
        const st_tensor *head = pair && t->slot == LM_S_EMBED ? st_find(f, PEFT_TIED_HEAD) : NULL;
        if (!st && head) {
            st = head;
            head = NULL;
            snprintf(key, sizeof key, "%s", PEFT_TIED_HEAD);
        }
        if (!st) {
            /* a module the run saves that the adapter never trained keeps the base's value; one that
             * the adapter's own config lists is missing from its file (PEFT: KeyError) */
            if (!t->lora && !(rc = adapter_lists_module(cfg, &table->cfg, cpath, path, t, key, e))) continue;
            if (!rc)
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: missing tensor \"%s\" (the run's lora config needs it)", path,
                             key);
            break;
        }
        free(buf);
        buf = ct_malloc((t->numel ? t->numel : 1) * sizeof(float));
        if (fused) {
            if ((rc = read_piece(t, &fz, st, key, path, buf, e))) break;
        } else if ((rc = read_tensor(table, t, st, key, path, buf, e))) break;
        if (head) {
            free(buf2);
            buf2 = ct_malloc((t->numel ? t->numel : 1) * sizeof(float));
            if ((rc = read_tensor(table, t, head, PEFT_TIED_HEAD, path, buf2, e))) break;
            if (memcmp(buf, buf2, t->numel * sizeof(float))) {
                rc = ct_fail(e, CT_ERR_FORMAT,
                             "%s: tensors \"%s\" and \"%s\" differ, but they are one tied tensor in this model "
                             "(tie_word_embeddings, ensure_weight_tying)",
                             path, key, PEFT_TIED_HEAD);
                break;
            }
        }
        s->put(s->ctx, LM_PARAMS, i, 0, t->numel / lm_tensor_cols(t), buf);
    }
    /* PEFT saves an adapted lm_head's base weight beside its adapter
     * (save_embedding_layers "auto": lm_head is one of its EMBEDDING_LAYER_NAMES)
     * and its loader puts it into the base layer: tied, the one shared tensor */
    const lm_tensor *head_w =
        lm_find(table, table->cfg.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
    const st_tensor *hb = (table->cfg.lora_targets & LORA_HEAD) && head_w ? st_find(f, PEFT_HEAD_BASE) : NULL;
    if (hb && !rc) {
        free(buf);
        buf = ct_malloc((head_w->numel ? head_w->numel : 1) * sizeof(float));
        if (!(rc = read_tensor(table, head_w, hb, PEFT_HEAD_BASE, path, buf, e)))
            s->put(s->ctx, LM_PARAMS, (int)(head_w - table->tensors), 0, head_w->numel / lm_tensor_cols(head_w), buf);
    }
    /* the same for an adapted embedding's base weight */
    const st_tensor *eb = (table->cfg.lora_targets & LORA_EMBED) && lm_find(table, "model.embed_tokens.weight")
                              ? st_find(f, PEFT_EMBED_BASE)
                              : NULL;
    if (eb && !rc) {
        const lm_tensor *ew = lm_find(table, "model.embed_tokens.weight");
        free(buf);
        buf = ct_malloc((ew->numel ? ew->numel : 1) * sizeof(float));
        if (!(rc = read_tensor(table, ew, eb, PEFT_EMBED_BASE, path, buf, e)))
            s->put(s->ctx, LM_PARAMS, (int)(ew - table->tensors), 0, ew->numel / lm_tensor_cols(ew), buf);
    }
    free(buf);
    free(buf2);
    const lm_tensor *emb = lm_find(table, "model.embed_tokens.weight");
    for (int j = 0; j < st_count(f) && !rc; j++) { /* nothing the run would silently drop */
        const char *name = st_get(f, j)->name;
        const lm_tensor *t = strncmp(name, PEFT_PREFIX, strlen(PEFT_PREFIX))
                                    ? NULL
                                    : lm_find(table, name + strlen(PEFT_PREFIX));
        if (!t && pair && !strcmp(name, PEFT_TIED_HEAD)) t = emb; /* loaded (or compared) with it above */
        for (int i = 0; !t && !strncmp(name, PEFT_PREFIX, strlen(PEFT_PREFIX)) && i < table->n_tensors; i++) {
            hf_fused fz; /* GraniteMoE's names of PEFT's module tree */
            char mod[LM_NAME_MAX];
            peft_module_key(&table->cfg, &table->tensors[i], mod, sizeof mod, &fz);
            if (!strcmp(mod, name + strlen(PEFT_PREFIX))) t = &table->tensors[i];
        }
        if (hb && !strcmp(name, PEFT_HEAD_BASE)) continue; /* loaded above */
        if (eb && !strcmp(name, PEFT_EMBED_BASE)) continue;
        if (!t || !lora_saved(t))
            rc = ct_fail(e, CT_ERR_FORMAT,
                         "%s: tensor \"%s\" is not an adapter or module to save of this model and lora config", path,
                         name);
    }
    cJSON_Delete(cfg);
    st_close(f);
    return rc;
}

/* ----------------------------------------------------------------- saving */

static cJSON *string_list(const char *list) {
    cJSON *a = cJSON_CreateArray();
    char item[256];
    for (const char *p = list; p && (p = cfg_list_next(p, item, sizeof item));) cJSON_AddItemToArray(a, cJSON_CreateString(item));
    return a;
}

int lora_save_peft(const lm_model *table, const float *const *data, const char *dir, const char *base,
                   double alpha, int rslora, double dropout, const char *modules_to_save, ct_err *e) {
    const lm_config *c = &table->cfg;
    int rc = ct_mkdirs(dir, e);
    if (rc) return rc;
    /* the tensors, by PEFT's keys; the config last, so a directory with
     * adapter_config.json always has its tensors complete */
    st_wtensor *ts = ct_calloc((size_t)table->n_tensors + 1, sizeof *ts);
    char (*keys)[LM_NAME_MAX + 32] = ct_calloc((size_t)table->n_tensors + 1, sizeof *keys);
    float **whole = ct_calloc((size_t)table->n_tensors + 1, sizeof *whole); /* fused tensors put together */
    int n = 0, tied = 0;
    for (int i = 0; i < table->n_tensors; i++) {
        const lm_tensor *t = &table->tensors[i];
        if (!lora_saved(t) || !data[i]) continue;
        hf_fused f;
        char mod[LM_NAME_MAX];
        int fused = peft_module_key(c, t, mod, sizeof mod, &f);
        if (fused && !f.first) continue; /* written with the piece that starts it */
        snprintf(keys[n], sizeof keys[n], PEFT_PREFIX "%s", mod);
        ts[n] = (st_wtensor){.name = keys[n], .dtype = CT_F32, .src_dtype = CT_F32, .ndim = t->ndim, .data = data[i]};
        for (int d = 0; d < t->ndim; d++) ts[n].shape[d] = t->shape[d];
        if (fused) { /* GraniteMoE: PEFT's one tensor from every piece of the table (all saved together) */
            size_t numel = 1;
            for (int d = 0; d < f.ndim; d++) numel *= (size_t)(ts[n].shape[d] = f.shape[d]);
            ts[n].ndim = f.ndim;
            whole[n] = ct_calloc(numel, sizeof(float));
            for (int j = 0; j < table->n_tensors; j++) {
                hf_fused g;
                const lm_tensor *u = &table->tensors[j];
                if (data[j] && !u->lora && hf_fused_piece(c, u, &g) && !strcmp(g.name, f.name))
                    memcpy(whole[n] + g.off, data[j], u->numel * sizeof(float));
            }
            ts[n].data = whole[n];
        }
        n++;
        if (c->tie_embeddings && t->slot == LM_S_EMBED && !t->lora) {
            /* the trained tied embedding is lm_head too: PEFT's ensure_weight_tying layout, the one
             * tensor under lm_head's key as well (its loader needs both; ts and keys have room for it) */
            ts[n] = ts[n - 1];
            snprintf(keys[n], sizeof keys[n], "%s", PEFT_TIED_HEAD);
            ts[n].name = keys[n];
            n++;
            tied = 1;
        }
    }
    static const char *const meta[] = {"format", "pt", NULL};
    char *path = fs_join(dir, "adapter_model.safetensors");
    rc = st_write(path, ts, n, meta, e); /* itself through path.tmp and a rename */
    free(path);
    for (int i = 0; i < n; i++) free(whole[i]);
    free(whole);
    free(ts);
    free(keys);
    if (rc) return rc;
    /* adapter_config.json: LoraConfig's fields that say how the tensors apply */
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "peft_type", "LORA");
    cJSON_AddStringToObject(o, "task_type", "CAUSAL_LM");
    cJSON_AddStringToObject(o, "base_model_name_or_path", base ? base : "");
    cJSON_AddNumberToObject(o, "r", c->lora_rank);
    cJSON_AddNumberToObject(o, "lora_alpha", alpha);
    cJSON_AddNumberToObject(o, "lora_dropout", dropout);
    int per_layer = 0; /* some layer lacks a target: every adapted module by its full name, as PEFT saves */
    for (int l = 0; l < c->n_layers; l++)
        for (int p = 0; p < LM_LORA_N; p++)
            per_layer |= (c->lora_targets >> p & 1) && module_exists(c, l, p) && !lm_lora_on(c, l, p);
    if (c->lora_targets && per_layer) {
        cJSON *tm = cJSON_AddArrayToObject(o, "target_modules");
        char full[LM_NAME_MAX];
        for (int l = 0; l < c->n_layers; l++)
            for (int p = 0; p < LM_LORA_N; p++) {
                if (!lm_lora_on(c, l, p) || module_head(c, p) != p) continue;
                snprintf(full, sizeof full, "model.layers.%d.%s", l, lora_module_path(c, l, p));
                cJSON_AddItemToArray(tm, cJSON_CreateString(full));
            }
        if (c->lora_targets & LORA_HEAD) cJSON_AddItemToArray(tm, cJSON_CreateString("lm_head"));
        if (c->lora_targets & LORA_EMBED) cJSON_AddItemToArray(tm, cJSON_CreateString("embed_tokens"));
    } else if (c->lora_targets) {
        cJSON *tm = cJSON_AddArrayToObject(o, "target_modules");
        for (int p = 0; p < LM_LORA_N; p++) {
            if (!(c->lora_targets & (1u << p))) continue;
            if (p == LM_LORA_SHGATE && !c->shared_intermediate) continue; /* a name no module of this model has */
            /* a fused module is one entry, at its first projection */
            int fq = (c->lora_targets & LORA_FUSED_QKV) && p <= LM_LORA_V;
            int fg = (c->lora_targets & LORA_FUSED_GATE_UP) && (p == LM_LORA_GATE || p == LM_LORA_UP);
            if ((fq && p != LM_LORA_Q) || (fg && p != LM_LORA_GATE)) continue;
            const char *nm = fq ? "qkv_proj" : fg ? "gate_up_proj" : target_names[p];
            if (granite_shared(c) && p >= LM_LORA_GATE && p <= LM_LORA_DOWN)
                nm = p == LM_LORA_DOWN ? "output_linear" : "input_linear";
            cJSON_AddItemToArray(tm, cJSON_CreateString(nm));
        }
        if (c->lora_targets & LORA_HEAD) cJSON_AddItemToArray(tm, cJSON_CreateString("lm_head"));
        if (c->lora_targets & LORA_EMBED) cJSON_AddItemToArray(tm, cJSON_CreateString("embed_tokens"));
    } else {
        cJSON_AddArrayToObject(o, "target_modules"); /* expert parameters only: PEFT writes [] (older ctitan null) */
    }
    char *params = lora_target_params_text(c);
    if (params[0]) cJSON_AddItemToObject(o, "target_parameters", string_list(params));
    free(params);
    cJSON_AddBoolToObject(o, "use_rslora", rslora);
    /* gate_up_proj at 2 r (PEFT's rewrite of gate_proj + up_proj): its patterns */
    cJSON *rp = cJSON_AddObjectToObject(o, "rank_pattern"), *ap = cJSON_AddObjectToObject(o, "alpha_pattern");
    /* per-module ranks and alphas: one key per projection where its layers
     * agree, else per layer; each key (dots escaped) selects exactly its
     * modules, so their order does not matter to PEFT's first match */
    for (int p = 0; p < LM_LORA_N; p++) {
        if (module_head(c, p) != p) continue;
        int kind = -1, same = 1, l0 = 0; /* same: one key for every layer (their module paths alike) */
        for (int l = 0; l < c->n_layers; l++) {
            if (!lm_lora_on(c, l, p)) continue;
            if (kind < 0) kind = c->lora_lp[l][p], l0 = l;
            else same &= kind == c->lora_lp[l][p] && !strcmp(lora_module_path(c, l, p), lora_module_path(c, l0, p));
        }
        for (int l = 0; l < c->n_layers && kind >= 0; l++) {
            int k = same ? kind : lm_lora_on(c, l, p) ? c->lora_lp[l][p] : 0;
            if (k) {
                char mod[LM_NAME_MAX], key[2 * LM_NAME_MAX];
                if (same) snprintf(mod, sizeof mod, "%s", lora_module_path(c, l0, p));
                else snprintf(mod, sizeof mod, "model.layers.%d.%s", l, lora_module_path(c, l, p));
                size_t kn = 0;
                for (const char *q = mod; *q && kn + 3 < sizeof key; q++) {
                    if (*q == '.') key[kn++] = '\\';
                    key[kn++] = *q;
                }
                key[kn] = 0;
                cJSON_AddNumberToObject(rp, key, c->lora_kind[k - 1].rank);
                cJSON_AddNumberToObject(ap, key, c->lora_kind[k - 1].alpha);
            }
            if (same) break;
        }
    }
    for (int x = 0; x < LM_LORA_PARAM_N; x++) {
        if (!c->lora_exp_rank[x]) continue;
        char key[64];
        if (x == LM_LORA_EXP_R)
            snprintf(key, sizeof key, ".*\\.%s\\.weight", c->moe_keys == LM_MOE_KEYS_GRANITE ? "router" : "gate");
        else snprintf(key, sizeof key, ".*\\.%s", exp_param[x]);
        cJSON_AddNumberToObject(rp, key, c->lora_exp_rank[x]);
        cJSON_AddNumberToObject(ap, key, c->lora_exp_alpha[x]);
    }
    if (modules_to_save && modules_to_save[0]) cJSON_AddItemToObject(o, "modules_to_save", string_list(modules_to_save));
    else cJSON_AddNullToObject(o, "modules_to_save");
    /* PEFT shares the embedding's trained copy with lm_head only when asked to
     * (_check_tied_modules); without it lm_head keeps the base weights */
    if (tied) cJSON_AddBoolToObject(o, "ensure_weight_tying", 1);
    cJSON_AddStringToObject(o, "bias", "none");
    cJSON_AddBoolToObject(o, "fan_in_fan_out", 0);
    cJSON_AddBoolToObject(o, "init_lora_weights", 1);
    cJSON_AddBoolToObject(o, "inference_mode", 1);
    cJSON_AddBoolToObject(o, "use_dora", 0);
    char *txt = cJSON_Print(o);
    cJSON_Delete(o);
    path = fs_join(dir, "adapter_config.json");
    rc = fs_write_text(path, txt, e);
    free(path);
    free(txt);
    return rc;
}

/* W_e += scale B_e A_e on a layer's stacked experts (PEFT's ParamWrapper.merge);
 * the router's W += scale B A */
static void merge_experts(lm_model *m, const lm_tensor *ta, const lm_tensor *tb) {
    const lm_config *c = &m->cfg;
    if (ta->expert == LM_LORA_EXP_R) {
        const lm_tensor *tw = NULL;
        for (int i = 0; i < m->n_tensors && !tw; i++)
            if (m->tensors[i].slot == LM_S_ROUTER && m->tensors[i].layer == ta->layer) tw = &m->tensors[i];
        if (!tw) return;
        float *B = m->params + tb->offset;
        lora_experts_delta(&m->k, m->params + tw->offset, NULL, m->params + ta->offset, B, 1,
                           lm_lora_exp_rank(c, LM_LORA_EXP_R), c->hidden, c->n_experts, c->n_experts,
                           lm_lora_exp_scale(c, LM_LORA_EXP_R));
        memset(B, 0, tb->numel * sizeof(float));
        return;
    }
    int E = c->n_experts, H = c->hidden, Im = c->moe_intermediate, gu = ta->expert == LM_LORA_EXP_GU;
    char name[LM_NAME_MAX];
    float *w[2] = {NULL, NULL};
    static const char *const proj[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};
    int mx = c->moe_keys == LM_MOE_KEYS_MIXTRAL;
    for (int x = 0; x < (gu ? 2 : 1); x++) { /* each projection's experts are one stacked block from expert 0 */
        snprintf(name, sizeof name, "model.layers.%d.%s.experts.0.%s.weight", ta->layer,
                 mx || c->moe_keys == LM_MOE_KEYS_GRANITE ? "block_sparse_moe" : "mlp", proj[mx][gu ? x : 2]);
        w[x] = m->params + lm_find(m, name)->offset;
    }
    float *A = m->params + ta->offset, *B = m->params + tb->offset;
    lora_experts_delta(&m->k, w[0], w[1], A, B, E, lm_lora_exp_rank(c, ta->expert), gu ? H : Im, gu ? 2 * Im : H,
                       gu ? Im : H, lm_lora_exp_scale(c, ta->expert));
    memset(B, 0, tb->numel * sizeof(float)); /* folded in: the adapter now adds nothing */
}

/* W[V, H] += scale (B A)^T, PEFT's Embedding.get_delta_weight. Tied, W is
 * lm_head too: PEFT's merge writes the shared parameter, so its output
 * layer changes as well (unmerged, only the lookup had the adapter). */
static void merge_embedding(lm_model *m, const lm_tensor *ta, const lm_tensor *tb) {
    const lm_config *c = &m->cfg;
    const lm_tensor *tw = lm_find(m, "model.embed_tokens.weight");
    if (!tw || !tw->numel) return;
    if (c->tie_embeddings)
        fprintf(stderr, "ctitan: warning: merging the embed_tokens adapter into the tied embedding "
                        "(tie_word_embeddings): the merged model's lm_head changes too, as PEFT's "
                        "merge_and_unload does; it no longer computes the adapted model\n");
    int V = (int)ta->shape[1], H = (int)tb->shape[0], r = (int)ta->shape[0];
    float *W = m->params + tw->offset, *A = m->params + ta->offset, *B = m->params + tb->offset;
    for (int v = 0; v < V; v++)
        for (int h = 0; h < H; h++) {
            double sum = 0;
            for (int j = 0; j < r; j++) sum += (double)B[(size_t)h * r + j] * A[(size_t)j * V + v];
            W[(size_t)v * H + h] += (float)(c->lora_scale * sum);
        }
    memset(B, 0, (size_t)H * r * sizeof(float)); /* folded in: the adapter now adds nothing */
}

void lora_merge(lm_model *m) {
    const lm_config *c = &m->cfg;
    for (int i = 0; i + 1 < m->n_tensors; i++) {
        const lm_tensor *ta = &m->tensors[i], *tb = ta + 1; /* build_layout puts B right after A */
        const char *suffix = strstr(ta->name, ".lora_A.weight");
        if (ta->slot == LM_S_LORA_EA) {
            merge_experts(m, ta, tb);
            continue;
        }
        if (ta->slot == LM_S_EMB_LA && ta->numel) {
            merge_embedding(m, ta, tb);
            continue;
        }
        int head = ta->slot == LM_S_HEAD_LA;
        if (!ta->lora || (ta->slot != LM_S_LORA_A && !head) || !suffix) continue;
        char base[LM_NAME_MAX];
        snprintf(base, sizeof base, "%.*s.weight", (int)(suffix - ta->name), ta->name);
        /* tied, lm_head's weight is the embedding: PEFT's merge_and_unload folds the
         * adapter into the one shared tensor, so the lookup changes too (it warns) */
        const lm_tensor *tw = head && c->tie_embeddings ? lm_find(m, "model.embed_tokens.weight") : lm_find(m, base);
        /* GraniteMoeShared's shared_mlp.input_linear is held as gate_proj then up_proj:
         * B's first S rows fold into the gate, the rest into the up projection */
        const lm_tensor *tw2 = NULL;
        size_t split = (size_t)tb->shape[0];
        if (!tw && granite_shared(c) && ta->expert == LM_LORA_GATE) {
            snprintf(base, sizeof base, "model.layers.%d.shared_mlp.gate_proj.weight", ta->layer);
            tw = lm_find(m, base);
            snprintf(base, sizeof base, "model.layers.%d.shared_mlp.up_proj.weight", ta->layer);
            tw2 = lm_find(m, base);
            split = (size_t)c->shared_intermediate;
        }
        if (head && c->tie_embeddings)
            fprintf(stderr, "ctitan: warning: merging the lm_head adapter into the tied embedding "
                            "(tie_word_embeddings): the merged model's input embeddings change too, as PEFT's "
                            "merge_and_unload does; it no longer computes the adapted model\n");
        int K = (int)ta->shape[1], N = (int)tb->shape[0], r = (int)ta->shape[0];
        float scale = head ? c->lora_scale : lm_lora_scale(c, ta->layer, ta->expert);
        /* W[N, K] += scale B[N, r] A[r, K], PEFT's merge (get_delta_weight), summed in double */
        float *A = m->params + ta->offset, *B = m->params + tb->offset;
        for (int n = 0; n < N; n++) {
            float *W = (size_t)n < split ? m->params + tw->offset + (size_t)n * K
                                         : m->params + tw2->offset + ((size_t)n - split) * K;
            for (int k = 0; k < K; k++) {
                double sum = 0;
                for (int j = 0; j < r; j++) sum += (double)B[(size_t)n * r + j] * A[(size_t)j * K + k];
                W[k] += (float)(scale * sum);
            }
        }
        memset(B, 0, (size_t)N * r * sizeof(float)); /* folded in: the adapter now adds nothing */
    }
}
