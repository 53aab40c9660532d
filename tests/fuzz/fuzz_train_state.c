/* Feeds: a checkpoint's state.json text to trainer_state_from_json (the
 * resume path of src/train/trainer_ckpt.c) for a trainer with default
 * config and a 2-layer, 4-expert MoE routing bias to restore.
 * Why: resume reads the step, the data position and the bias array from
 * this file; a count that disagrees with the model, or a number beyond
 * int range, must be an error, not a write past the bias or UB. */
#include "fuzz_util.h"
#include "train/trainer_priv.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static trainer *t;
    static float bias[2 * 4];
    if (!t) {
        t = ct_calloc(1, sizeof *t);
        cfg_defaults(&t->cfg);
        t->global_batch = 8;
        t->model.cfg.n_layers = 2;
        t->model.cfg.n_experts = 4;
        t->model.moe.n_layers = 2;
        t->model.moe.bias = bias;
    }
    /* state.json is read whole as text (NUL-terminated) */
    char *txt = ct_malloc(size + 1);
    memcpy(txt, data, size);
    txt[size] = 0;
    ct_err e = {0};
    int rc = trainer_state_from_json(t, txt, "step-7", &e);
    if (rc && !strstr(e.msg, "step-7")) abort();
    free(txt);
    return 0;
}
