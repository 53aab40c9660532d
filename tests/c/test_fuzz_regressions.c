/* tests/c/test_fuzz_regressions.c: the inputs the fuzz targets (tests/fuzz)
 * found crashing, leaking or hitting undefined behaviour, fed to the same
 * entry points, each with the verdict the file formats call for. Under the
 * plain build the old code accepted them (an out-of-range cast gives some
 * int and rc 0); under `make sanitize` it was a UBSan report. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
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

int main(void) {
    test_train_state_ranges();
    return CHECK_DONE();
}
