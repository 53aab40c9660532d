/* tests/c/regressions/test_fuzz_regressions.c: the inputs the fuzz targets (tests/fuzz)
 * found crashing, leaking or hitting undefined behaviour, fed to the same
 * entry points, each with the verdict the file formats call for. Under the
 * plain build the old code accepted them (an out-of-range cast gives some
 * int and rc 0); under `make sanitize` it was a UBSan report. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"
#include "data/jinja.h"
#include "train/trainer_priv.h"

/* fuzz_train_state: state.json numbers beyond the range of the integer they
 * are cast to (step to int, data.epoch/pos to int64, the bias to float). */
static void test_train_state_ranges(void) {
    trainer *t = calloc(1, sizeof *t);
    cfg_defaults(&t->cfg);
    t->global_batch = 8;
    float bias[8] = {0};
    t->model.cfg.n_layers = 2;
    t->model.cfg.n_experts = 4;
    t->model.moe.n_layers = 2;
    t->model.moe.bias = bias;
    static const struct {
        const char *json, *want;
    } bad[] = {
        {"{\"step\": 90071992547409937}", "\"step\""}, /* the fuzzer's input, its trailing bytes dropped */
        {"{\"step\": 2147483648}", "\"step\""},
        {"{\"step\": -1}", "\"step\""},
        {"{\"step\": 1.5}", "\"step\""},
        {"{\"step\": 3, \"data\": {\"epoch\": 1e300, \"pos\": 0}}", "\"data\""},
        {"{\"step\": 3, \"data\": {\"epoch\": 0, \"pos\": -5}}", "\"data\""},
        {"{\"step\": 3, \"moe_expert_bias\": [1e300, 0, 0, 0, 0, 0, 0, 0]}", "moe_expert_bias"},
        {"{\"step\": 3, \"moe_expert_bias\": [\"x\", 0, 0, 0, 0, 0, 0, 0]}", "moe_expert_bias"},
        {"{\"step\": 3}\x0b", "byte 11"}, /* control byte after the value */
        {"{\"step\": 3} {}", "byte 12"},   /* trailing data */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ct_err e = {0};
        int rc = trainer_state_from_json(t, bad[i].json, "ck/step-3", &e);
        CHECK(rc == CT_ERR_FORMAT && strstr(e.msg, "ck/step-3/state.json") && strstr(e.msg, bad[i].want),
              "%s: rc %d: %s", bad[i].json, rc, e.msg);
    }
    ct_err e = {0};
    int rc = trainer_state_from_json(
        t, "{\"step\": 2147483647, \"data\": {\"epoch\": 2, \"pos\": 9007199254740992}, \"moe_expert_bias\": "
           "[0.5, 0, 0, 0, 0, 0, 0, -3.4e38]}", "ck/step-3", &e);
    CHECK(rc == 0 && t->step == 2147483647 && t->resume_data.pos == 9007199254740992LL && bias[0] == 0.5f &&
              bias[7] == -3.4e38f,
          "the largest values in range still load: rc %d %s", rc, e.msg);
    cfg_free(&t->cfg);
    free(t);
}

/* Renders src; returns rc, the output in out (freed by the caller) or the message in e. */
static int render(const char *src, char **out, ct_err *e) {
    jinja_tmpl *t = NULL;
    *out = NULL;
    int rc = jinja_parse(src, strlen(src), "t.jinja", &t, e);
    if (rc) return rc;
    size_t n;
    rc = jinja_render(t, NULL, out, &n, NULL, e);
    jinja_free(t);
    return rc;
}

/* fuzz_chat_template, fuzz_tokenizer_config: an integer literal past 64 bits
 * overflowed in the lexer (UBSan), and so did + - * // ** and unary minus;
 * 1 ** 10**18 looped 10**18 times and 'x' * n kept n growing copies. Python
 * has big ints, so the wrapped values were another rendering than
 * transformers'; an error is what jinja.h promises for what it cannot do. */
static void test_jinja_int_overflow(void) {
    /* the fuzzers' inputs, as found (tests/data/fuzz) */
    size_t n;
    ct_err e = {0};
    char *src = fs_read_file("tests/data/fuzz/chat_template-int-literal.jinja", 0, &n, &e);
    CHECK(src != NULL, "%s", e.msg);
    jinja_tmpl *t = NULL;
    int rc = src ? jinja_parse(src, n, "found.jinja", &t, &e) : -1;
    CHECK(rc == CT_ERR_FORMAT && strstr(e.msg, "found.jinja") && strstr(e.msg, "out of range"), "rc %d: %s", rc,
          e.msg);
    jinja_free(t);
    free(src);
    char dir[] = "/tmp/ctitan-test-fuzzreg-XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    char *cfg = fs_join(dir, "tokenizer_config.json");
    src = fs_read_file("tests/data/fuzz/tokenizer_config-int-literal.json", 0, &n, &e);
    CHECK(src && fs_write_atomic(cfg, src, n, &e) == 0, "%s", e.msg);
    jinja_chat *c = NULL;
    e = (ct_err){0};
    rc = jinja_chat_open(dir, &c, &e);
    CHECK(rc == CT_ERR_FORMAT && !c && strstr(e.msg, "tokenizer_config.json") && strstr(e.msg, "out of range"),
          "rc %d: %s", rc, e.msg);
    jinja_chat_close(c);
    free(src);
    free(cfg);
    ct_rm_tree(dir, NULL);

    static const char *overflow[] = {
        "{{ 99999999999999999999 }}", "{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
        "{{ 4294967296 * 4294967296 }}", "{{ (-9223372036854775807 - 1) // -1 }}", "{{ 2 ** 64 }}",
        "{{ -(-9223372036854775807 - 1) }}", "{{ 'x' * 100000000 }}",
    };
    for (size_t i = 0; i < sizeof overflow / sizeof *overflow; i++) {
        char *out;
        e = (ct_err){0};
        rc = render(overflow[i], &out, &e);
        CHECK(rc == CT_ERR_FORMAT && strstr(e.msg, "t.jinja"), "%s: rc %d, output %s", overflow[i], rc,
              out ? out : e.msg);
        free(out);
    }
    /* what fits renders as Python does */
    static const char *fits[][2] = {
        {"{{ 9223372036854775807 }}", "9223372036854775807"},
        {"{{ -9223372036854775807 - 1 }}", "-9223372036854775808"},
        {"{{ 2 ** 62 }}", "4611686018427387904"},
        {"{{ 1 ** 1000000000000000000 }}", "1"},
        {"{{ (-9223372036854775807 - 1) % -1 }}", "0"},
        {"{{ -7 // -1 }}", "7"},
        {"{{ 'ab' * 3 }}|{{ 2 * 'c' }}|{{ 'x' * 0 }}", "ababab|cc|"},
        {"{{ range(9223372036854775806, 9223372036854775807, 5) | length }}", "1"},
    };
    for (size_t i = 0; i < sizeof fits / sizeof *fits; i++) {
        char *out;
        e = (ct_err){0};
        rc = render(fits[i][0], &out, &e);
        CHECK(rc == 0 && out && !strcmp(out, fits[i][1]), "%s: rc %d, got %s, want %s", fits[i][0], rc,
              out ? out : e.msg, fits[i][1]);
        free(out);
    }
}

int main(void) {
    test_train_state_ranges();
    test_jinja_int_overflow();
    return CHECK_DONE();
}
