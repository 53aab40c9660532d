/* tests/c/model/test_rope.c: model/rope.h without Python. Default RoPE tables equal
 * op_rope_tables bit for bit; the config rules that decide which numbers are
 * used (precedence of rope_scaling over rope_parameters, family defaults,
 * Gemma3's layer types, Phi3's attribute) pick the right ones; values stated
 * independently of any implementation (Llama 3.1's frequencies, YaRN's and
 * longrope's attention factors) come out; dynamic and longrope change at
 * their length thresholds; errors are CT_ERR_CONFIG naming the file and key.
 * The full comparison with transformers is tests/py/test_rope.py. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "check.h"
#include "kernels/ops.h"
#include "model/rope.h"

#define PATH "/x/config.json"

/* Parses `json` and resolves the RoPE of layer type lt; returns the error code. */
static int parse(rope_params *p, const char *json, const char *lt, int hd, ct_err *e) {
    cJSON *root = cJSON_Parse(json);
    if (!root) {
        fprintf(stderr, "bad test JSON: %s\n", json);
        exit(1);
    }
    memset(e, 0, sizeof *e);
    int rc = rope_params_from_hf(p, root, lt, hd, PATH, e);
    cJSON_Delete(root);
    return rc;
}

static void test_default_equals_op_rope_tables(void) {
    struct { double theta; int hd, T; } cases[] = {{1e6, 128, 70}, {5e5, 64, 33}, {1e4, 256, 9}, {10000.0, 80, 17}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char json[256];
        snprintf(json, sizeof json, "{\"model_type\": \"qwen3\", \"rope_theta\": %.17g}", cases[k].theta);
        rope_params p;
        ct_err e;
        int rc = parse(&p, json, NULL, cases[k].hd, &e);
        CHECK(rc == 0, "%s", e.msg);
        int T = cases[k].T, half = cases[k].hd / 2;
        double inv[ROPE_MAX_HALF], attn = 0;
        rope_inv_freq(&p, cases[k].hd, T, inv, &attn);
        CHECK(attn == 1.0, "default attention scaling %g", attn);
        float *c1 = malloc(sizeof(float) * T * half), *s1 = malloc(sizeof(float) * T * half);
        float *c2 = malloc(sizeof(float) * T * half), *s2 = malloc(sizeof(float) * T * half);
        rope_tables(c1, s1, 0, T, half, inv, attn);
        op_rope_tables(c2, s2, T, cases[k].hd, (float)cases[k].theta);
        CHECK(memcmp(c1, c2, sizeof(float) * T * half) == 0, "cos table differs from op_rope_tables (theta %g)",
              cases[k].theta);
        CHECK(memcmp(s1, s2, sizeof(float) * T * half) == 0, "sin table differs from op_rope_tables (theta %g)",
              cases[k].theta);
        free(c1), free(s1), free(c2), free(s2);
    }
}

static void test_llama31(void) {
    /* the published Llama-3.1-8B values: factor 8, low 1, high 4, original 8192, theta 5e5 */
    const char *json =
        "{\"model_type\": \"llama\", \"hidden_size\": 4096, \"num_attention_heads\": 32, "
        "\"max_position_embeddings\": 131072, \"rope_theta\": 500000.0, \"rope_scaling\": {\"factor\": 8.0, "
        "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192, "
        "\"rope_type\": \"llama3\"}}";
    rope_params p;
    ct_err e;
    CHECK(parse(&p, json, NULL, 128, &e) == 0, "%s", e.msg);
    CHECK(p.type == ROPE_LLAMA3 && p.theta == 5e5 && p.factor == 8 && p.original_max_pos == 8192,
          "type %d theta %g factor %g orig %d", p.type, p.theta, p.factor, p.original_max_pos);
    double inv[64], attn;
    rope_inv_freq(&p, 128, 16, inv, &attn);
    CHECK(attn == 1.0, "llama3 has no attention scaling");
    /* wavelengths under 8192 / 4 = 2048 keep their frequency, over 8192 are divided by 8 */
    for (int i = 0; i < 64; i++) {
        double base = 1.0 / pow(5e5, 2.0 * i / 128), wl = 2 * M_PI / base;
        if (wl < 2048) CHECK_CLOSE(inv[i], base, 1e-6);
        if (wl > 8192) CHECK_CLOSE(inv[i], base / 8, 1e-6);
        if (wl >= 2048 && wl <= 8192) CHECK(inv[i] < base && inv[i] > base / 8, "medium frequency %d", i);
    }
    CHECK(inv[0] == 1.0, "inv_freq[0] = %.17g", inv[0]);
}

static void test_precedence(void) {
    /* the case: rope_scaling (legacy, yarn) beside rope_parameters (v5, default):
     * transformers takes rope_scaling wholesale, rope_parameters' rope_theta included */
    const char *json =
        "{\"model_type\": \"llama\", \"max_position_embeddings\": 8192, "
        "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 777.0}, "
        "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 2048}}";
    rope_params p;
    ct_err e;
    CHECK(parse(&p, json, NULL, 64, &e) == 0, "%s", e.msg);
    CHECK(p.type == ROPE_YARN, "rope_scaling must win: type %s", rope_type_name(p.type));
    CHECK(p.theta == 1e4, "rope_parameters' theta must be dropped with it: theta %g", p.theta);
    CHECK(p.original_max_pos == 2048 && p.factor == 4, "orig %d factor %g", p.original_max_pos, p.factor);
    double inv[32], attn;
    rope_inv_freq(&p, 64, 16, inv, &attn);
    CHECK_CLOSE(attn, 0.1 * log(4.0) + 1.0, 1e-15);
    CHECK(inv[0] == 1.0, "the highest frequency extrapolates");
    CHECK_CLOSE(inv[31], 1.0 / pow(1e4, 62.0 / 64) / 4, 1e-6); /* the lowest interpolates */

    /* an empty rope_scaling does not count; a top-level rope_theta fills in */
    CHECK(parse(&p, "{\"model_type\": \"llama\", \"rope_theta\": 5e5, \"rope_scaling\": {}, "
                    "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2}}",
                NULL, 64, &e) == 0,
          "%s", e.msg);
    CHECK(p.type == ROPE_LINEAR && p.theta == 5e5 && p.factor == 2, "type %d theta %g", p.type, p.theta);
    /* v5 theta beats the top-level one */
    CHECK(parse(&p, "{\"model_type\": \"llama\", \"rope_theta\": 5e5, \"rope_parameters\": {\"rope_theta\": 3.0}}",
                NULL, 64, &e) == 0,
          "%s", e.msg);
    CHECK(p.type == ROPE_DEFAULT && p.theta == 3.0, "theta %g", p.theta);
}

static void test_family_defaults(void) {
    rope_params p;
    ct_err e;
    CHECK(parse(&p, "{\"model_type\": \"mixtral\"}", NULL, 128, &e) == 0, "%s", e.msg);
    CHECK(p.theta == 1e6 && p.max_pos == 131072, "mixtral theta %g max %d", p.theta, p.max_pos);
    CHECK(parse(&p, "{\"model_type\": \"olmo2\"}", NULL, 128, &e) == 0, "%s", e.msg);
    CHECK(p.theta == 1e4 && p.max_pos == 2048, "olmo2 theta %g max %d", p.theta, p.max_pos);
    CHECK(parse(&p, "{\"model_type\": \"gemma3_text\"}", "full_attention", 256, &e) == 0, "%s", e.msg);
    CHECK(p.theta == 1e6, "gemma3 full theta %g", p.theta);
    CHECK(parse(&p, "{\"model_type\": \"gemma3_text\", \"rope_local_base_freq\": 5000}", "sliding_attention", 256, &e) ==
              0,
          "%s", e.msg);
    CHECK(p.theta == 5000, "gemma3 sliding theta %g", p.theta);
    /* gemma-3-4b's legacy form: linear on full attention only */
    const char *g = "{\"model_type\": \"gemma3_text\", \"rope_scaling\": {\"factor\": 8.0, \"rope_type\": \"linear\"}}";
    CHECK(parse(&p, g, "full_attention", 256, &e) == 0 && p.type == ROPE_LINEAR && p.factor == 8, "%s", e.msg);
    CHECK(parse(&p, g, "sliding_attention", 256, &e) == 0 && p.type == ROPE_DEFAULT && p.theta == 1e4, "%s", e.msg);
    /* partial_rotary_factor: ignored by default RoPE outside phi3 */
    CHECK(parse(&p, "{\"model_type\": \"llama\", \"partial_rotary_factor\": 0.5}", NULL, 64, &e) == 0, "%s", e.msg);
    CHECK(p.partial_rotary_factor == 1.0 && rope_rotary_dim(&p, 64) == 64, "llama default rotates the whole head");
    CHECK(p.partial_rotary_factor_given == 0.5, "the value given is kept for the export: %g", p.partial_rotary_factor_given);
    CHECK(parse(&p, "{\"model_type\": \"qwen3\"}", NULL, 64, &e) == 0 && p.partial_rotary_factor_given == 0,
          "absent: nothing to carry");
    CHECK(parse(&p, "{\"model_type\": \"phi3\", \"partial_rotary_factor\": 0.5}", NULL, 64, &e) == 0, "%s", e.msg);
    CHECK(rope_rotary_dim(&p, 64) == 32, "phi3 default reads partial_rotary_factor");
}

static void test_length_dependence(void) {
    rope_params p;
    ct_err e;
    double a[32], b[32], d[32], attn;
    /* dynamic: the original frequencies up to max_position_embeddings, a larger theta past it */
    CHECK(parse(&p, "{\"model_type\": \"llama\", \"max_position_embeddings\": 256, "
                    "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}}",
                NULL, 64, &e) == 0,
          "%s", e.msg);
    rope_params q = p; /* a copy by value computes the same */
    rope_inv_freq(&q, 64, 256, a, &attn);
    rope_inv_freq(&p, 64, 257, b, &attn);
    rope_params def;
    CHECK(parse(&def, "{\"model_type\": \"llama\"}", NULL, 64, &e) == 0, "%s", e.msg);
    rope_inv_freq(&def, 64, 1, d, &attn);
    CHECK(memcmp(a, d, sizeof a) == 0, "dynamic at max_position_embeddings is the default RoPE");
    CHECK(b[0] == 1.0 && b[31] < a[31], "past it theta grows: %.9g vs %.9g", b[31], a[31]);
    /* theta' = theta * (2 * 257 / 256 - 1) ** (64 / 62) */
    CHECK_CLOSE(b[1], 1.0 / pow(1e4 * pow(2.0 * 257 / 256 - 1, 64.0 / 62), 2.0 / 64), 1e-6);

    /* longrope: short_factor up to original_max_position_embeddings, long_factor past it */
    char json[2048] = "{\"model_type\": \"phi3\", \"max_position_embeddings\": 131072, "
                      "\"original_max_position_embeddings\": 4096, \"rope_scaling\": {\"type\": \"longrope\", ";
    for (int k = 0; k < 2; k++) {
        strcat(json, k ? "\"long_factor\": [" : "\"short_factor\": [");
        for (int i = 0; i < 32; i++) {
            char num[32];
            snprintf(num, sizeof num, "%s%g", i ? ", " : "", k ? 4.0 : 1.0);
            strcat(json, num);
        }
        strcat(json, k ? "]}}" : "], ");
    }
    CHECK(parse(&p, json, NULL, 64, &e) == 0, "%s", e.msg);
    rope_inv_freq(&p, 64, 4096, a, &attn);
    CHECK_CLOSE(attn, sqrt(1 + log(32.0) / log(4096.0)), 1e-15);
    rope_inv_freq(&p, 64, 4097, b, &attn);
    CHECK(a[0] == 1.0 && b[0] == 0.25, "short %g, long %g", a[0], b[0]);
    /* the cos/sin multiplier reaches the tables */
    float c[2 * 32], s[2 * 32];
    rope_tables(c, s, 0, 2, 32, b, attn);
    CHECK(c[0] == (float)attn && s[0] == 0.0f, "row 0: cos %g sin %g", c[0], s[0]);
}

static void expect_error(const char *json, const char *lt, const char *needle) {
    rope_params p;
    ct_err e;
    int rc = parse(&p, json, lt, 64, &e);
    CHECK(rc == CT_ERR_CONFIG && e.code == CT_ERR_CONFIG, "expected a config error for %s", json);
    CHECK(strncmp(e.msg, PATH ": ", strlen(PATH) + 2) == 0, "message must start with the path: %s", e.msg);
    CHECK(strstr(e.msg, needle) != NULL, "\"%s\" not in \"%s\"", needle, e.msg);
}

static void test_errors(void) {
    /* read and checked even where ignored: a factor outside (0, 1] is no model */
    expect_error("{\"model_type\": \"mistral\", \"rope_parameters\": {\"rope_type\": \"default\", "
                 "\"partial_rotary_factor\": 0}}",
                 NULL, "rope_parameters.partial_rotary_factor must be in (0, 1], got 0 (model_type mistral)");
    expect_error("{\"model_type\": \"llama\", \"rope_parameters\": {\"rope_type\": \"linear\"}}", NULL,
                 "rope_parameters is missing \"factor\", required for rope_type \"linear\"");
    expect_error("{\"model_type\": \"llama\", \"rope_scaling\": {\"type\": \"ntk\", \"factor\": 2}}", NULL,
                 "rope_scaling.type \"ntk\" is not supported (supported: default, linear, dynamic, yarn, llama3, "
                 "longrope)");
    expect_error("{\"model_type\": \"llama\", \"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": \"8\"}}",
                 NULL, "rope_parameters.factor must be a number");
    expect_error("{\"model_type\": \"llama\", \"rope_theta\": null}", NULL, "\"rope_theta\" must be a number");
    expect_error("{\"model_type\": \"llama\", \"rope_parameters\": {\"rope_theta\": -1}}", NULL,
                 "rope_parameters.rope_theta must be positive");
    expect_error("{\"model_type\": \"llama\", \"rope_scaling\": {\"type\": \"linear\", \"rope_type\": \"dynamic\", "
                 "\"factor\": 2}}",
                 NULL, "disagree");
    expect_error("{\"model_type\": \"qwen3\", \"rope_parameters\": {\"full_attention\": {}}}", NULL,
                 "nested per layer type");
    expect_error("{\"model_type\": \"gemma3_text\", \"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 8}}",
                 "full_attention", "nested per layer type");
    expect_error("{\"model_type\": \"gemma3_text\"}", NULL, "one RoPE per layer type");
    expect_error("{\"model_type\": \"phi3\", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2}}", NULL,
                 "not supported for phi3");
    expect_error("{\"model_type\": \"llama\", \"rope_parameters\": {\"rope_type\": \"longrope\", "
                 "\"short_factor\": [1, 1], \"long_factor\": [1, 1]}}",
                 NULL, "short_factor must have rotary_dim / 2 = 32 entries, got 2");
    expect_error("{\"model_type\": \"gpt2\"}", NULL, "model_type \"gpt2\"");
    expect_error("{\"model_type\": \"llama\", \"rope_parameters\": \"yarn\"}", NULL,
                 "\"rope_parameters\" must be an object or null");
    expect_error("{\"model_type\": \"llama\", \"partial_rotary_factor\": 1.5, \"rope_parameters\": {\"rope_type\": "
                 "\"linear\", \"factor\": 2}}",
                 NULL, "partial_rotary_factor must be in (0, 1]");
}

int main(void) {
    test_default_equals_op_rope_tables();
    test_llama31();
    test_precedence();
    test_family_defaults();
    test_length_dependence();
    test_errors();
    return CHECK_DONE();
}
