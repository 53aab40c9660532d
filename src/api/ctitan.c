/* api/ctitan.c: the library API over the trainer.
 *
 * A session is a trainer plus the last error; inputs from the caller are
 * checked here (batch within the plan, tokens within the vocabulary) because
 * the model's ops trust their arguments. */
#include "api/ctitan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/hf.h"
#include "model/lora.h"
#include "train/trainer.h"

struct ct_session {
    trainer t;
    ct_err err;
    long seqs; /* sequences given to forward_backward since the last zero_grad or optimizer step */
};

ct_session *ctitan_open(int argc, const char **argv, char *err, int errlen) {
    ct_err e = {0};
    ct_config cfg;
    cfg_defaults(&cfg);
    if (cfg_parse_args(&cfg, argc, (char **)argv, &e)) {
        cfg_free(&cfg);
        if (err && errlen > 0) snprintf(err, (size_t)errlen, "%s", e.msg);
        return NULL;
    }
    ct_session *s = ct_calloc(1, sizeof *s);
    if (trainer_init(&s->t, &cfg, &e)) {
        if (err && errlen > 0) snprintf(err, (size_t)errlen, "%s", e.msg);
        trainer_free(&s->t);
        free(s);
        return NULL;
    }
    return s;
}

void ctitan_close(ct_session *s) {
    if (!s) return;
    trainer_free(&s->t);
    free(s);
}

const char *ctitan_last_error(const ct_session *s) { return s ? s->err.msg : ""; }
int ctitan_vocab_size(const ct_session *s) { return s->t.model.cfg.vocab_size; }
int ctitan_num_tensors(const ct_session *s) { return s->t.model.n_tensors; }

const char *ctitan_tensor_name(const ct_session *s, int i) {
    return i >= 0 && i < s->t.model.n_tensors ? s->t.model.tensors[i].name : NULL;
}

int ctitan_tensor_shape(const ct_session *s, int i, int64_t *shape) {
    if (i < 0 || i >= s->t.model.n_tensors) return -1;
    const lm_tensor *t = &s->t.model.tensors[i];
    for (int d = 0; d < t->ndim; d++) shape[d] = t->shape[d];
    return t->ndim;
}

static const lm_tensor *find(ct_session *s, const char *name) {
    const lm_tensor *t = lm_find(&s->t.model, name);
    if (!t) ct_fail(&s->err, CT_ERR_CONFIG, "no tensor named \"%s\" in this model", name);
    return t;
}

int ctitan_get_param(ct_session *s, const char *name, float *out) {
    const lm_tensor *t = find(s, name);
    if (!t) return CT_ERR_CONFIG;
    if (t->store != LM_NO_STORE) /* a frozen tensor kept in bf16 */
        ct_convert_to_f32(out, s->t.model.fstore + t->store, CT_BF16, t->numel);
    else
        memcpy(out, s->t.model.params + t->offset, t->numel * sizeof(float));
    return 0;
}

int ctitan_set_param(ct_session *s, const char *name, const float *in) {
    const lm_tensor *t = find(s, name);
    if (!t) return CT_ERR_CONFIG;
    lm_put_rows(&s->t.model, (int)(t - s->t.model.tensors), 0, t->numel / lm_tensor_cols(t), in);
    return 0;
}

int ctitan_get_grad(ct_session *s, const char *name, float *out) {
    const lm_tensor *t = find(s, name);
    if (!t) return CT_ERR_CONFIG;
    if (t->frozen) return ct_fail(&s->err, CT_ERR_CONFIG, "%s: frozen: it has no gradient", name);
    memcpy(out, s->t.model.grads + t->offset, t->numel * sizeof(float));
    return 0;
}

static int check_batch(ct_session *s, const int32_t *tokens, const int32_t *labels, int B, int T) {
    const lm_model *m = &s->t.model;
    if (B < 1 || T < 1 || B > m->act.B || T > m->act.T)
        return ct_fail(&s->err, CT_ERR_CONFIG, "batch %d x %d does not fit the planned %d x %d", B, T, m->act.B, m->act.T);
    for (long i = 0; i < (long)B * T; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size)
            return ct_fail(&s->err, CT_ERR_CONFIG, "token %d at %ld is outside the vocabulary", tokens[i], i);
        if (labels && labels[i] != -100 && (labels[i] < 0 || labels[i] >= m->cfg.vocab_size))
            return ct_fail(&s->err, CT_ERR_CONFIG, "label %d at %ld is outside the vocabulary", labels[i], i);
    }
    return 0;
}

int ctitan_logits(ct_session *s, const int32_t *tokens, int B, int T, float *logits) {
    int rc = check_batch(s, tokens, NULL, B, T);
    if (rc) return rc;
    lm_logits(&s->t.model, tokens, B, T, logits);
    return 0;
}

int ctitan_zero_grad(ct_session *s) {
    memset(s->t.model.grads, 0, s->t.model.n_params * sizeof(float));
    s->seqs = 0; /* a new accumulation: its calls hold the step's sequences from the first */
    return 0;
}

int ctitan_forward_backward(ct_session *s, const int32_t *tokens, const int32_t *labels, int B, int T,
                            long n_valid_total, double *loss_sum) {
    int rc = check_batch(s, tokens, labels, B, T);
    if (rc) return rc;
    if (n_valid_total < 1) return ct_fail(&s->err, CT_ERR_CONFIG, "n_valid_total must be positive");
    /* LoRA dropout: the step's masks, for the sequences that follow the step's earlier calls'
     * (as the trainer's micro-batches follow each other), so any split of a step's batch into
     * calls draws the trainer's masks */
    s->t.model.lora_seed = trainer_lora_seed(&s->t, s->t.step + 1);
    s->t.model.lora_seq0 = s->seqs, s->t.model.lora_seq_stride = 1;
    s->seqs += B;
    double l = lm_forward_backward(&s->t.model, tokens, labels, B, T, 1.0f / (float)n_valid_total, NULL);
    if (loss_sum) *loss_sum = l;
    return 0;
}

int ctitan_aux_loss(const ct_session *s, double *aux) {
    *aux = s->t.model.moe.aux_loss;
    return 0;
}

int ctitan_optimizer_step(ct_session *s, double *grad_norm, double *lr) {
    trainer_optimizer_step(&s->t, grad_norm, lr);
    s->seqs = 0;
    return 0;
}

int ctitan_save_hf(ct_session *s, const char *dir, const char *dtype) {
    int dt = hf_dtype_from_name(dtype ? dtype : "float32");
    if (dt < 0) return ct_fail(&s->err, CT_ERR_CONFIG, "unknown dtype \"%s\" (float32, bfloat16, float16)", dtype);
    return hf_save(&s->t.model, dir, (ct_dtype)dt, 0, &s->err);
}

int ctitan_save_adapter(ct_session *s, const char *dir) {
    if (s->t.cfg.lora_rank <= 0) return ct_fail(&s->err, CT_ERR_CONFIG, "save_adapter: the session has no LoRA (lora.rank = 0)");
    return trainer_save_adapter(&s->t, dir, &s->err);
}

int ctitan_merge_adapter(ct_session *s) {
    if (s->t.cfg.lora_rank <= 0) return ct_fail(&s->err, CT_ERR_CONFIG, "merge_adapter: the session has no LoRA (lora.rank = 0)");
    lora_merge(&s->t.model);
    return 0;
}
