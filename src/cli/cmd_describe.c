/* cli/cmd_describe.c: `ctitan describe MODEL_DIR|--flavor NAME [--seq-len N] [--json]
 * [--config-out FILE]`.
 *
 * What ctitan derives from a config.json, without weights and without
 * allocating a model: the family, the sizes, the parameter count (from the
 * tensor table the loader would fill), each layer's attention (window,
 * score scale) and its RoPE (inverse frequencies and the cos/sin multiplier
 * for a forward of --seq-len positions). Users read it to check that ctitan
 * understood their checkpoint; the tests compare it with what transformers
 * derives from the same file (tests/py/test_published_configs.py). A native
 * flavor (model.spec = "qwen3") is described the same way, and --config-out
 * writes the config.json an export of it would carry, so the flavor table can
 * be compared key by key with the published file of each size.
 *
 * Exit codes: 2 for a bad option, a directory without config.json or a
 * config.json ctitan refuses, 3 for a malformed one, 1 when a Hub id cannot be
 * fetched. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint/ckpt.h"
#include "cli/cli.h"
#include "hub/hub.h"
#include "model/lm.h"

static void cli_describe_help(void) {
    printf("usage: ctitan describe MODEL_DIR|HUB_ID|--flavor NAME [--revision R] [--seq-len N] [--json]\n"
           "                       [--config-out FILE]\n\n"
           "Prints what ctitan derives from MODEL_DIR/config.json (a Hub id fetches config.json only)\n"
           "or from a native flavor (model.flavor of model.spec \"qwen3\"): the family and sizes, the parameter\n"
           "count, each layer's attention (sliding window, score scale), the soft-caps applied, and RoPE\n"
           "(inverse frequencies and attention scaling for a forward of N positions, default 16).\n"
           "--json: one JSON object.\n"
           "--config-out FILE: also write the config.json ctitan writes for this model (an export's).\n");
}

/* A directory without config.json: the loader's message names
 * model.hf_assets_path, a key the user of describe never set. A run folder
 * (job.dump_folder) is the usual mistake, so point at its checkpoints. */
static int describe_no_config(const char *dir) {
    char p[4200];
    struct stat st;
    snprintf(p, sizeof p, "%s/config.json", dir);
    if (stat(p, &st) == 0) return 0;
    snprintf(p, sizeof p, "%s/checkpoint", dir);
    if (stat(p, &st) == 0 && S_ISDIR(st.st_mode))
        fprintf(stderr, "ctitan: error: describe: %s/config.json: not found (this looks like a run folder: describe "
                        "one of its checkpoints, %s/step-N)\n", dir, p);
    else {
        char hint[2 * 4096 + 400];
        ckpt_adapter_hint(dir, "the directory to describe", "train's lora.adapter_path (or generate's --adapter)", hint,
                          sizeof hint);
        fprintf(stderr, "ctitan: error: describe: %s/config.json: not found (describe reads a Hugging Face model "
                        "directory)%s\n", dir, hint);
    }
    return 1; /* a missing file (docs/reliability.md, "Exit codes"), as generate and import say it */
}

/* A soft-cap the forward applies (null: none). Gemma 3's attention cap, which
 * transformers carries and never applies, is null here as in ctitan's forward. */
static void print_cap(const char *key, double cap) {
    if (cap > 0)
        printf(" \"%s\": %.17g,\n", key, cap);
    else
        printf(" \"%s\": null,\n", key);
}

static void print_doubles(const double *x, int n) {
    for (int i = 0; i < n; i++) printf("%s%.17g", i ? ", " : "", x[i]);
}

int cli_describe(int argc, char **argv) {
    const char *dir = NULL, *revision = NULL, *flavor = NULL, *config_out = NULL;
    int seq = 16, json = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            cli_describe_help();
            return 0;
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (!strcmp(argv[i], "--flavor") && i + 1 < argc) {
            flavor = argv[++i];
        } else if (!strcmp(argv[i], "--config-out") && i + 1 < argc) {
            config_out = argv[++i];
        } else if (!strcmp(argv[i], "--revision") && i + 1 < argc) {
            revision = argv[++i];
        } else if (!strcmp(argv[i], "--seq-len") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 100000000) {
                fprintf(stderr, "ctitan: error: describe: --seq-len must be a positive integer, got \"%s\"\n", argv[i]);
                return 2;
            }
            seq = (int)v;
        } else if (argv[i][0] == '-' || dir) {
            fprintf(stderr, "ctitan: error: describe: unexpected argument \"%s\" (try ctitan describe --help)\n",
                    argv[i]);
            return 2;
        } else {
            dir = argv[i];
        }
    }
    if (!dir == !flavor) {
        fprintf(stderr, "ctitan: error: describe: give a model directory (or Hub id) or --flavor NAME%s "
                        "(try ctitan describe --help)\n", dir ? ", not both" : "");
        return 2;
    }
    hub_local loc;
    ct_err e = {0};
    lm_config c;
    int rc;
    if (flavor) {
        rc = lm_config_from_flavor(&c, flavor, &e);
        dir = flavor;
    } else {
        rc = hub_resolve(dir, revision, HUB_CONFIG, &loc, &e);
        if (rc) {
            fprintf(stderr, "ctitan: error: %s\n", e.msg);
            return ct_exit_code(rc);
        }
        dir = loc.dir;
        if ((rc = describe_no_config(dir))) return rc;
        rc = lm_config_from_hf(&c, dir, &e);
    }
    if (rc) {
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(rc); /* a value 2, a malformed config.json 3, as train gives them */
    }
    if (config_out && (rc = lm_config_write_hf(&c, config_out, "float32", &e))) {
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(rc);
    }
    lm_model table;
    lm_layout(&table, &c);
    size_t n_params = table.n_params;
    lm_free(&table);
    int rd = lm_rotary_dim(&c), half = rd / 2; /* partial_rotary_factor (Phi3, GLM): inv_freq over rd features */
    double inv[2][ROPE_MAX_HALF], scale[2];
    for (int k = 0; k < 2; k++) {
        rope_params p = lm_rope_params(&c, k);
        rope_inv_freq(&p, c.head_dim, seq, inv[k], &scale[k]);
    }
    /* "" is the Qwen3 family (lm.h): a flavor's */
    const char *type = c.model_type[0] ? c.model_type : c.n_experts > 0 ? "qwen3_moe" : "qwen3";
    double attn = c.attn_scale > 0 ? c.attn_scale : 1.0 / sqrt((double)c.head_dim);
    if (json) {
        printf("{\"model_type\": \"%s\", \"head_dim\": %d, \"rotary_dim\": %d, \"num_parameters\": %zu, "
               "\"seq_len\": %d, \"tie_word_embeddings\": %s, \"shared_expert_intermediate_size\": %d,\n "
               "\"layers\": [",
               type, c.head_dim, rd, n_params, seq, c.tie_embeddings ? "true" : "false", c.shared_intermediate);
        for (int l = 0; l < c.n_layers; l++)
            printf("%s{\"sliding_window\": %d, \"rope\": \"%s\", \"moe\": %s}", l ? ", " : "",
                   c.layer_sliding[l] ? c.sliding_window : 0,
                   c.layer_nope[l] ? "none" : c.layer_sliding[l] ? "sliding" : "full",
                   lm_layer_is_moe(&c, l) ? "true" : "false");
        printf("],\n \"rope_interleaved\": %s,\n \"scaling\": %.17g,\n", c.rope_interleaved ? "true" : "false", attn);
        print_cap("attn_logit_softcapping", c.attn_softcap);
        print_cap("final_logit_softcapping", c.final_softcap);
        printf(" \"rope\": {");
        for (int k = 0; k < 2; k++) {
            printf("%s\"%s\": {\"type\": \"%s\", \"attention_scaling\": %.17g, \"inv_freq\": [", k ? ", " : "",
                   k ? "sliding" : "full", rope_type_name(lm_rope_params(&c, k).type), scale[k]);
            print_doubles(inv[k], half);
            printf("]}");
        }
        printf("}}\n");
        return 0;
    }
    printf("%s: model_type %s, %d layers, hidden %d, intermediate %d, %d heads of %d (%d kv), vocab %d%s\n", dir,
           type, c.n_layers, c.hidden, c.intermediate, c.n_heads, c.head_dim, c.n_kv_heads, c.vocab_size,
           c.tie_embeddings ? ", tied embeddings" : "");
    printf("parameters: %zu (%.3f B)\n", n_params, n_params / 1e9);
    if (c.n_experts) {
        printf("experts: %d of %d per token, %d wide", c.top_k, c.n_experts, c.moe_intermediate);
        /* qwen2_moe: the shared expert is half or more of a sparse layer's active MLP */
        if (c.shared_intermediate > 0)
            printf(", and a shared expert %d wide (%s)", c.shared_intermediate,
                   c.moe_keys == LM_MOE_KEYS_GRANITE || lm_shared_experts_ungated(&c) ? "ungated" : "sigmoid-gated");
        printf("\n");
    }
    int sliding = 0;
    for (int l = 0; l < c.n_layers; l++) sliding += c.layer_sliding[l];
    printf("attention: scale %.6g, %d of %d layers slide over %d keys\n", attn, sliding, c.n_layers,
           c.sliding_window);
    if (c.attn_softcap > 0 || c.final_softcap > 0) {
        printf("soft-caps:");
        if (c.attn_softcap > 0) printf(" attention scores %g", c.attn_softcap);
        if (c.final_softcap > 0) printf("%s logits %g", c.attn_softcap > 0 ? "," : "", c.final_softcap);
        printf(" (x = cap tanh(x / cap))\n");
    }
    for (int k = 0; k < (lm_rope_local_differs(&c) ? 2 : 1); k++)
        printf("rope%s: %s, theta %g, attention scaling %.6g at %d positions, rotates %d of %d features%s\n",
               k ? " (sliding layers)" : "", rope_type_name(lm_rope_params(&c, k).type), lm_rope_params(&c, k).theta,
               scale[k], seq, rd, c.head_dim, c.rope_interleaved ? " in interleaved pairs (2i, 2i+1)" : "");
    if (c.q_scale_len > 0) /* Ministral 3 (Llama 4's attention scaling) */
        printf("q scale: q times 1 + %g log(1 + floor(pos / %d)) after RoPE (rope_parameters' "
               "llama_4_scaling_beta, original_max_position_embeddings)\n", c.q_scale_beta, c.q_scale_len);
    int nope = 0;
    for (int l = 0; l < c.n_layers; l++) nope += c.layer_nope[l];
    if (nope) { /* the lines above would otherwise read as every layer's */
        /* EXAONE 4 has no such key: its full layers go without RoPE while a window is set */
        printf("rope: none on %d of %d layers (%s):", nope, c.n_layers,
               strcmp(c.model_type, "exaone4") ? "no_rope_layers" : "the full layers, as sliding_window is set");
        for (int l = 0; l < c.n_layers; l++)
            if (c.layer_nope[l]) printf(" %d", l);
        printf("\n");
    }
    return 0;
}
