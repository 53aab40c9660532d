/* train/trainer_ckpt.c: the model state in and out of a run.
 *
 * Resume picks the newest full checkpoint that verifies (or exactly
 * checkpoint.load_step) and restores the parameters, both AdamW moments and
 * state.json (step, data position, MoE routing bias), so a resumed run
 * computes the same bits as an uninterrupted one.
 *
 * Neither direction ever holds the whole model on one rank. Loading: the
 * loaders (checkpoint, HF safetensors, the seeded init) hand over each
 * tensor a block of rows at a time in the whole model's table order
 * (lm_sink) and each rank keeps its TP/EP part and, under FSDP, its
 * shard's part of it; a checkpoint's rows a rank does not keep are not even
 * read, nor the columns of a row-parallel weight outside its TP slice
 * (ckpt_load_part with plan_load_rows, plan_load_cols), and the ranks that
 * see rank 0's checkpoint folder take its checksum verdicts (pick_shared).
 * Saving: where every rank sees rank 0's folder, each pwrites its part
 * (its shard's runs, its TP slice's row pieces, its experts) into the files
 * rank 0 laid out (save_parts). Otherwise every rank runs one loop over units
 * (embedding, each layer, head; parameters, then each moment), the unit's
 * parts are gathered to rank 0, which appends them to files whose headers
 * it wrote first. The files are the same whatever the layout
 * (docs/checkpoints.md). */
#define _XOPEN_SOURCE 700
#include "train/trainer.h"
#include "train/trainer_priv.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/hf.h"
#include "core/cpu.h"
#include "core/fs.h"
#include "core/rng.h"
#include "core/timer.h"
#include "formats/json.h"
#include "formats/safetensors.h"
#include "model/lora.h"

/* state.json: what a checkpoint needs beyond tensors to continue exactly. */
static char *state_to_json(const trainer *t, const ds *data) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", t->step);
    cJSON_AddNumberToObject(o, "seed", (double)t->cfg.seed);
    cJSON_AddNumberToObject(o, "lr_factor_next", lr_schedule_factor(&t->sched, t->step));
    /* the data order depends on these: a resume with other values would repeat or skip data */
    cJSON_AddNumberToObject(o, "seq_len", t->cfg.seq_len);
    cJSON_AddNumberToObject(o, "global_batch", (double)t->global_batch);
    cJSON_AddBoolToObject(o, "shuffle", t->cfg.shuffle);
    cJSON_AddNumberToObject(o, "training_steps", t->cfg.steps);
    if (t->val_pending) cJSON_AddBoolToObject(o, "validation_pending", 1);
    if (data) {
        ds_state s;
        ds_get_state(data, &s);
        cJSON *d = cJSON_AddObjectToObject(o, "data");
        cJSON_AddNumberToObject(d, "epoch", (double)s.epoch);
        cJSON_AddNumberToObject(d, "pos", (double)s.pos);
    }
    const lm_model *m = &t->model;
    int biased = 0; /* a file's frozen selection bias (ERNIE 4.5 MoE's e_score_correction_bias) */
    for (size_t i = 0; m->moe.n_layers && i < (size_t)m->cfg.n_layers * m->cfg.n_experts; i++)
        biased |= m->moe.bias[i] != 0.0f;
    if (m->moe.n_layers && (t->cfg.load_balance_coeff > 0 || biased)) {
        /* the routing bias [L][E] (dense layers' rows stay 0); cJSON prints
         * doubles round-trip exact, so floats come back bit-identical */
        cJSON *b = cJSON_AddArrayToObject(o, "moe_expert_bias");
        for (size_t i = 0; i < (size_t)m->cfg.n_layers * m->cfg.n_experts; i++)
            cJSON_AddItemToArray(b, cJSON_CreateNumber(m->moe.bias[i]));
    }
    char *txt = cJSON_Print(o);
    cJSON_Delete(o);
    return txt;
}

/* The global batch a checkpoint was written with differs from this run's:
 * where this run's comes from (unset, it is local_batch_size x the
 * data-parallel ranks, so the same command under another mpirun -np changes
 * it) and the settings that give the checkpoint's again. */
static int global_batch_differs(const trainer *t, double was_d, const char *dir, ct_err *e) {
    const ct_config *c = &t->cfg;
    int dp = t->plan.mesh.dp_size > 0 ? t->plan.mesh.dp_size : 1, L = c->local_batch_size > 0 ? c->local_batch_size : 1;
    int set = c->global_batch_size > 0, was = fabs(was_d) < 1e9 ? (int)was_d : 0; /* any number: state.json is input */
    char from[320], keep[400];
    if (set)
        snprintf(from, sizeof from, "set in %s", cfg_origin(c, "training.global_batch_size"));
    else
        snprintf(from, sizeof from, "not set: training.local_batch_size %d x %d data-parallel rank%s", L, dp,
                 dp == 1 ? "" : "s");
    if (was_d != was || was < 1 || was % dp)
        snprintf(keep, sizeof keep, "%g sequences do not split over %d data-parallel ranks: resume with a "
                 "data-parallel degree that divides it", was_d, dp);
    else if (was % (L * dp) == 0) /* this local batch fits: accumulate */
        snprintf(keep, sizeof keep, "to keep %d, set --training.global_batch_size=%d (%d micro-batch%s of %d per "
                 "rank)", was, was, was / (L * dp), was / (L * dp) == 1 ? "" : "es", L);
    else if (set)
        snprintf(keep, sizeof keep, "to keep %d, set --training.global_batch_size=%d --training.local_batch_size=%d",
                 was, was, was / dp);
    else
        snprintf(keep, sizeof keep, "to keep %d, set --training.local_batch_size=%d (%d sequences / %d ranks)", was,
                 was / dp, was, dp);
    return ct_fail(e, CT_ERR_CONFIG,
                   "%s: training.global_batch_size is %d (%s) but the checkpoint was written with %g; resuming "
                   "would change the data order: %s, or start a new checkpoint.folder",
                   dir, t->global_batch, from, was_d, keep);
}

int trainer_state_from_json(trainer *t, const char *txt, const char *dir, ct_err *e) {
    char what[4200];
    snprintf(what, sizeof what, "%s/state.json", dir);
    cJSON *o = txt ? json_parse(txt, strlen(txt), what, e) : NULL;
    if (txt && !o) return CT_ERR_FORMAT;
    t->have_resume_data = 0;
    const cJSON *st = o ? cJSON_GetObjectItemCaseSensitive(o, "step") : NULL;
    if (!json_int_in(st, 0, INT_MAX)) {
        cJSON_Delete(o);
        return ct_fail(e, CT_ERR_FORMAT, "%s/state.json: missing or malformed \"step\"", dir);
    }
    t->step = (int)st->valuedouble;
    /* the data stream must be the same one, or "exact resume" would silently not be */
    const ct_config *c = &t->cfg;
    struct { const char *json, *key; double now; } same[] = {
        {"seq_len", "training.seq_len", c->seq_len},
        {"global_batch", "training.global_batch_size", (double)t->global_batch},
        {"seed", "training.seed", (double)c->seed},
        {"shuffle", "training.shuffle", c->shuffle}};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, same[i].json);
        double was = cJSON_IsBool(v) ? cJSON_IsTrue(v) : cJSON_IsNumber(v) ? v->valuedouble : same[i].now;
        if (was != same[i].now && !strcmp(same[i].json, "global_batch")) {
            cJSON_Delete(o);
            return global_batch_differs(t, was, dir, e);
        }
        if (was != same[i].now) {
            cJSON_Delete(o);
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: %s is %g but the checkpoint was written with %g; resuming would change the data "
                           "order (use the same value, or a new checkpoint.folder)",
                           dir, same[i].key, same[i].now, was);
        }
    }
    t->val_pending = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "validation_pending"));
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(o, "training_steps");
    if (cJSON_IsNumber(ts) && ts->valuedouble != c->steps)
        fprintf(stderr, "ctitan: warning: training.steps was %g and is now %d: the LR schedule changes from here\n",
                ts->valuedouble, c->steps);
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(o, "data");
    if (d) {
        /* 2^53: the largest count a JSON number holds exactly */
        const cJSON *ep = cJSON_GetObjectItemCaseSensitive(d, "epoch"), *pos = cJSON_GetObjectItemCaseSensitive(d, "pos");
        if (!json_int_in(ep, 0, 9007199254740992.0) || !json_int_in(pos, 0, 9007199254740992.0)) {
            cJSON_Delete(o);
            return ct_fail(e, CT_ERR_FORMAT, "%s/state.json: malformed \"data\"", dir);
        }
        t->resume_data.epoch = (int64_t)ep->valuedouble;
        t->resume_data.pos = (int64_t)pos->valuedouble;
        t->have_resume_data = 1;
    }
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(o, "moe_expert_bias");
    lm_model *m = &t->model;
    size_t nb = (size_t)m->cfg.n_layers * m->cfg.n_experts;
    if (b && m->moe.n_layers) {
        int bad = !cJSON_IsArray(b) || (size_t)cJSON_GetArraySize(b) != nb;
        const cJSON *v;
        /* a double beyond float range does not convert (undefined behaviour) */
        for (v = bad ? NULL : b->child; v; v = v->next) bad |= !cJSON_IsNumber(v) || !(fabs(v->valuedouble) <= FLT_MAX);
        if (bad) {
            cJSON_Delete(o);
            return ct_fail(e, CT_ERR_FORMAT, "%s/state.json: \"moe_expert_bias\" must hold %zu numbers (layers x "
                           "experts)", dir, nb);
        }
        size_t i = 0;
        cJSON_ArrayForEach(v, b) m->moe.bias[i++] = (float)v->valuedouble;
    }
    cJSON_Delete(o);
    /* every save writes it (trainer_save); without it the data order would
     * silently start over, and "exact resume" would not be */
    if (!t->have_resume_data)
        return ct_fail(e, CT_ERR_FORMAT, "%s/state.json: missing \"data\" (the data position)", dir);
    return 0;
}

/* 1 if DIR is a run's last_save_in_hf output (an HF model directory or a
 * LoRA run's PEFT adapter), not a training checkpoint: ckpt_dir_kind, whose
 * rule (a checkpoint that lost its manifest still holds config.toml) keeps a
 * damaged checkpoint from being stepped over as an export. */
static int is_hf_export(const char *dir) { return ckpt_dir_kind(dir) != CKPT_DIR_CHECKPOINT; }

/* Runs with frozen tensors (LoRA, training.freeze) checkpoint the trained
 * tensors only, with their moments: the frozen ones never change, so the run
 * takes them from where it started (checkpoint.initial_load_path or the
 * seed) on resume too, and a Qwen3-4B LoRA checkpoint is its adapters, not
 * 48 GB of base weights and zero moments. This is the table of what such a
 * checkpoint holds: the trained tensors of `whole`, packed, and full[i]
 * the index in `whole` of its tensor i. */
typedef struct {
    lm_model tab;
    int *full;
    const lm_sink *inner; /* loading: where the whole model's tensors go */
    const ckpt_rows *inner_rows; /* and which of their rows this rank keeps */
} trained_table;

static void trained_table_init(trained_table *s, const lm_model *whole, const lm_model *flags) {
    memset(s, 0, sizeof *s);
    s->tab.cfg = whole->cfg;
    s->tab.tensors = ct_calloc((size_t)whole->n_tensors + 1, sizeof *s->tab.tensors);
    s->full = ct_calloc((size_t)whole->n_tensors + 1, sizeof *s->full);
    for (int i = 0; i < whole->n_tensors; i++) {
        if (flags->tensors[i].frozen) continue; /* flags: this rank's model, whose tensors line up with whole's */
        lm_tensor *t = &s->tab.tensors[s->tab.n_tensors];
        *t = whole->tensors[i];
        t->offset = s->tab.n_params;
        s->tab.n_params += t->numel;
        s->full[s->tab.n_tensors++] = i;
    }
}

static void trained_table_free(trained_table *s) {
    free(s->tab.tensors);
    free(s->full);
}

static void trained_put(void *ctx, int kind, int i, size_t r0, size_t r1, const float *rows) {
    trained_table *s = ctx;
    s->inner->put(s->inner->ctx, kind, s->full[i], r0, r1, rows);
}

static void trained_rows(void *ctx, int kind, int i, ckpt_rows_add add, void *acc) {
    trained_table *s = ctx;
    s->inner_rows->rows(s->inner_rows->ctx, kind, s->full[i], add, acc);
}

static void trained_cols(void *ctx, int kind, int i, ckpt_rows_add add, void *acc) {
    trained_table *s = ctx;
    s->inner_rows->cols(s->inner_rows->ctx, kind, s->full[i], add, acc);
}

/* ckpt_rows over the plan: the rows of each tensor this rank keeps, and of
 * them the columns (a TP slice of a row-parallel weight). */
static void plan_rows(void *ctx, int kind, int i, ckpt_rows_add add, void *acc) {
    plan_load_rows(ctx, kind, i, add, acc);
}

static void plan_cols(void *ctx, int kind, int i, ckpt_rows_add add, void *acc) {
    plan_load_cols(ctx, kind, i, add, acc);
}

static int load_checkpoint_of(trainer *t, const char *dir, int model_only, const lm_model *whole,
                              const ckpt_rows *want, uint64_t hashed, ct_err *e);

/* hashed: the bytes this rank read to verify the checkpoint (pick_shared) */
static int load_checkpoint(trainer *t, const char *dir, int model_only, uint64_t hashed, ct_err *e) {
    int rc;
    const lm_model *whole = t->load.whole;
    trained_table tt;
    lm_sink outer = t->load.sink;
    ckpt_rows want = {plan_rows, &t->plan, plan_cols}, outer_rows = want;
    if (t->model.n_frozen) { /* the checkpoint holds the trained tensors only */
        trained_table_init(&tt, whole, &t->model);
        tt.inner = &outer;
        tt.inner_rows = &outer_rows;
        whole = &tt.tab;
        t->load.sink = (lm_sink){trained_put, &tt};
        want = (ckpt_rows){trained_rows, &tt, trained_cols};
    }
    rc = load_checkpoint_of(t, dir, model_only, whole, &want, hashed, e);
    if (t->model.n_frozen) {
        t->load.sink = outer;
        trained_table_free(&tt);
    }
    return rc;
}

/* for the run's start event (events.jsonl) */
static void note_loaded(trainer *t, const char *dir, const ckpt_info *info, int resumed) {
    snprintf(t->loaded.dir, sizeof t->loaded.dir, "%s", dir);
    t->loaded.seconds = info->seconds;
    t->loaded.mib = info->bytes / 1048576.0;
    t->loaded.resumed = resumed;
}

/* A number as the user wrote it: the shortest of %.15g / %.17g that reads back. */
typedef struct { char s[32]; } alpha_str;
static alpha_str alpha_text(double v) {
    alpha_str a;
    snprintf(a.s, sizeof a.s, "%.15g", v);
    if (strtod(a.s, NULL) != v) snprintf(a.s, sizeof a.s, "%.17g", v);
    return a;
}

/* A checkpoint holds its run's trained tensors only (frozen ones come from
 * where the run started), so it resumes only a run that trains the same
 * ones. With another training.freeze or [lora] the load failed on a
 * "missing" or "unexpected" tensor, as if the file were damaged: the
 * settings of the run that saved it (its config.toml) are compared first,
 * and a difference is named. A config.toml that does not parse is left to
 * the load (its checks name what is wrong with the tensors). */
static int same_trained_tensors(const trainer *t, const char *dir, ct_err *e) {
    char arg[4300];
    snprintf(arg, sizeof arg, "--config=%s/config.toml", dir);
    char *argv[] = {arg};
    ct_config was;
    cfg_defaults(&was);
    ct_err ignore = {0};
    int rc = 0;
    if (!cfg_parse_args(&was, 1, argv, &ignore)) {
        const ct_config *c = &t->cfg;
        struct { const char *key, *then, *now; } str[] = {
            {"training.freeze", was.freeze, c->freeze},
            {"lora.target_modules", was.lora_rank > 0 ? was.lora_targets : "", c->lora_rank > 0 ? c->lora_targets : ""},
            {"lora.modules_to_save", was.lora_modules_to_save, c->lora_modules_to_save},
            {"lora.target_parameters", was.lora_target_params, c->lora_target_params},
            {"lora.rank_pattern", was.lora_rank_pattern, c->lora_rank_pattern}};
        if (was.lora_rank != c->lora_rank)
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: saved by a run with lora.rank = %d (its config.toml), this run has %d: a checkpoint "
                         "resumes only the same trained tensors (use the same setting, or a new checkpoint.folder)",
                         dir, was.lora_rank, c->lora_rank);
        for (size_t i = 0; !rc && i < sizeof str / sizeof str[0]; i++)
            if (strcmp(str[i].then, str[i].now))
                rc = ct_fail(e, CT_ERR_CONFIG,
                             "%s: saved by a run with %s = \"%s\" (its config.toml), this run has \"%s\": a "
                             "checkpoint resumes only the same trained tensors (use the same setting, or a new "
                             "checkpoint.folder)",
                             dir, str[i].key, str[i].then, str[i].now);
        /* the same tensors under another scale are another model: PEFT keeps alpha,
         * use_rslora and alpha_pattern in adapter_config.json beside the weights
         * (lora.dropout only adds noise to training, and may change) */
        if (!rc && c->lora_rank > 0 && was.lora_alpha != c->lora_alpha)
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: saved by a run with lora.alpha = %s (its config.toml), this run has %s: the "
                         "adapters were trained under the checkpoint's scale, and resuming would change the model "
                         "(use the same setting, or a new checkpoint.folder)",
                         dir, alpha_text(was.lora_alpha).s, alpha_text(c->lora_alpha).s);
        if (!rc && c->lora_rank > 0 && !was.lora_rslora != !c->lora_rslora)
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: saved by a run with lora.use_rslora = %s (its config.toml), this run has %s: the "
                         "adapters were trained under the checkpoint's scale, and resuming would change the model "
                         "(use the same setting, or a new checkpoint.folder)",
                         dir, was.lora_rslora ? "true" : "false", c->lora_rslora ? "true" : "false");
        /* AdamW's moments resumed under Adam's update (or the reverse) would be neither run:
         * torch's Adam loading AdamW's state keeps its decoupled_weight_decay, so the same
         * resume there goes on with AdamW */
        if (!rc && strcmp(was.opt_name, c->opt_name))
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: saved by a run with optimizer.name = \"%s\" (its config.toml), this run has \"%s\": "
                         "the moments belong to the checkpoint's update rule (use the same optimizer, or start a new "
                         "checkpoint.folder from this one's weights: checkpoint.initial_load_path = it, "
                         "checkpoint.initial_load_in_hf = true)",
                         dir, was.opt_name, c->opt_name);
        if (!rc && c->lora_rank > 0 && strcmp(was.lora_alpha_pattern, c->lora_alpha_pattern))
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: saved by a run with lora.alpha_pattern = \"%s\" (its config.toml), this run has "
                         "\"%s\": the adapters were trained under the checkpoint's scale, and resuming would change "
                         "the model (use the same setting, or a new checkpoint.folder)",
                         dir, was.lora_alpha_pattern, c->lora_alpha_pattern);
    }
    cfg_free(&was);
    return rc;
}

/* What this rank read of a checkpoint (its rows of the tensors, and what it
 * checksummed), on the ranks CTITAN_LOG_RANKS shows: the load is spread over
 * the ranks (tests/py/test_ckpt_parallel_io.py checks the shares). */
static void note_read(const trainer *t, const ckpt_info *info, uint64_t hashed) {
    if (t->world->size > 1)
        fprintf(stderr, "ctitan: rank %d of %d: read %llu bytes of checkpoint tensors and checksummed %llu bytes "
                "(%s, %llu bytes in all)\n", t->world->rank, t->world->size, (unsigned long long)info->read_bytes,
                (unsigned long long)(hashed + info->hashed_bytes), info->dir, (unsigned long long)info->bytes);
}

/* The checkpoint was verified when it was picked (pick_shared: by this rank,
 * or by a rank that sees the same files), so the load checks sizes only and
 * reads the rows `want` names. */
static int load_checkpoint_of(trainer *t, const char *dir, int model_only, const lm_model *whole,
                              const ckpt_rows *want, uint64_t hashed, ct_err *e) {
    ckpt_info info;
    int rc;
    if (model_only) {
        /* a model-only checkpoint (an import) seeds a new run at step 0 */
        if ((rc = ckpt_load_part(dir, whole, 0, NULL, &info, &t->load.sink, want, 1, e))) return rc;
        note_read(t, &info, hashed);
        note_loaded(t, dir, &info, 0);
        fprintf(stderr, "ctitan: loaded model-only checkpoint %s as initial weights (%.1f MiB in %.2f s)\n", dir,
                info.bytes / 1048576.0, info.seconds);
        return 0;
    }
    char *state = NULL;
    if ((rc = same_trained_tensors(t, dir, e))) return rc;
    if ((rc = ckpt_load_part(dir, whole, 1, &state, &info, &t->load.sink, want, 1, e))) return rc;
    note_read(t, &info, hashed);
    rc = trainer_state_from_json(t, state, dir, e);
    free(state);
    if (rc) return rc;
    /* the manifest's step is the directory's (ckpt_verify); a state.json of
     * another step would resume the schedule and data there */
    if (t->step != info.step)
        return ct_fail(e, CT_ERR_FORMAT, "%s/state.json: step %d, but the checkpoint's manifest.json says step %d",
                       dir, t->step, info.step);
    t->opt.step = t->step;
    note_loaded(t, dir, &info, 1);
    fprintf(stderr, "ctitan: resuming from %s (step %d): %.1f MiB restored in %.2f s\n", dir, t->step,
            info.bytes / 1048576.0, info.seconds);
    return 0;
}

/* With checkpoint.enable, picks what to continue from. load_step N: exactly
 * step-N (damaged is an error). load_step -1: the newest FULL checkpoint
 * that verifies; a model-only one seeds the run only when it is step 0 (an
 * import); a final save (model-only or HF) at or past training.steps means
 * the run is complete. Damage follows ckpt_select's contract (which cannot
 * be called as it is: it would take an HF export for a damaged checkpoint):
 * each damaged newer one is named and skipped, or with checkpoint.fallback =
 * false stops the run; when damaged ones leave nothing to continue from, the
 * run stops naming them instead of starting afresh over them (its saves
 * would replace them). Every rank looks at the folder itself and loads
 * nothing yet: load_weights first checks that the ranks chose the same
 * (agree_on_pick). */
/* FOLDER's step-N numbers, ascending, malloc'd (*n of them; NULL and -1 if
 * it cannot be read). All of them: a fixed buffer would keep the oldest and
 * drop the newest ones. */
static int *list_steps(const char *folder, int *n) {
    int count = ckpt_list(folder, NULL, 0);
    *n = count;
    if (count < 0) return NULL;
    int *v = ct_malloc(((size_t)count + 1) * sizeof *v);
    int again = ckpt_list(folder, v, count);
    *n = again < count ? again : count; /* one writer per folder: a difference is a removal */
    return v;
}

enum { PICK_NONE, PICK_LOAD, PICK_COMPLETE };
typedef struct {
    int kind, step, model_only;
    char dir[4200];
    uint64_t hashed; /* bytes this rank read to verify checkpoints */
} resume_pick;

/* One checksum pass per file system, not per rank: rank 0 verifies what it
 * looks at and records each verdict; a rank that sees rank 0's folder (the
 * same files, sees_rank0_folder) takes those verdicts and checks only the
 * manifest and the sizes itself. A rank told of damage verifies the files
 * itself, so that its error names the damaged file as rank 0's does. Ranks
 * that do not see rank 0's folder (per-machine folders) verify their own. */
#define SV_MAX 64
typedef struct {
    int follow;            /* takes rank 0's verdicts */
    int n;                 /* verdicts recorded (rank 0) or received */
    int32_t v[2 * SV_MAX]; /* step, rc */
    uint64_t hashed;       /* bytes this rank read for checksums */
} shared_verify;

static int sv_verify(void *ctx, const char *dir, int step, ct_err *e) {
    shared_verify *sv = ctx;
    int k = -1;
    for (int i = 0; sv->follow && i < sv->n && k < 0; i++)
        if (sv->v[2 * i] == step) k = i;
    if (k >= 0 && !sv->v[2 * k + 1]) return ckpt_verify_sizes(dir, e);
    uint64_t h = 0;
    int rc = ckpt_verify_hashed(dir, &h, e);
    sv->hashed += h;
    if (k >= 0 && !rc) /* read intact here, damaged on rank 0: rank 0's verdict stands, as the ranks must agree */
        return ct_fail(e, sv->v[2 * k + 1] > 0 ? sv->v[2 * k + 1] : CT_ERR_FORMAT,
                       "%s: rank 0 found this checkpoint damaged (its message names the file), this rank reads it "
                       "intact", dir);
    if (!sv->follow && sv->n < SV_MAX) {
        sv->v[2 * sv->n] = step;
        sv->v[2 * sv->n + 1] = rc;
        sv->n++;
    }
    return rc;
}

static int pick_newest(trainer *t, resume_pick *p, shared_verify *sv, const int *steps, int n, ct_err *e);

/* A stop saves whatever checkpoint.enable says, so a folder may hold a
 * checkpoint this run will not resume from: rerunning the stopped command as
 * it was would start over in silence. Named: the newest step a run with
 * checkpoint.enable would resume from (a full checkpoint, or an import's
 * step-0), not a final Hugging Face export or adapter, nor a model-only final
 * save. Its manifest is not verified here: only named. */
static void warn_not_resumed(trainer *t) {
    int n, *steps = list_steps(t->ckpt_folder, &n);
    for (int i = n - 1; i >= 0; i--) {
        char dir[4200];
        snprintf(dir, sizeof dir, "%s/step-%d", t->ckpt_folder, steps[i]);
        if (is_hf_export(dir)) continue;
        int mo = ckpt_is_model_only(dir, NULL);
        if (mo < 0 || (mo && steps[i] > 0)) continue;
        fprintf(stderr,
                "ctitan: warning: %s holds step-%d, which this run does not resume from: checkpoint.enable is false "
                "(pass --checkpoint.enable=true to resume); starting at step 0\n",
                t->ckpt_folder, steps[i]);
        break;
    }
    free(steps);
}

static int pick_resume(trainer *t, resume_pick *p, shared_verify *sv, ct_err *e) {
    ct_config *c = &t->cfg;
    p->kind = PICK_NONE;
    if (!c->ckpt_enable) {
        if (t->world->rank == 0) warn_not_resumed(t);
        return 0;
    }
    if (c->load_step >= 0) {
        int rc = ckpt_select_with(t->ckpt_folder, c->load_step, sv_verify, sv, p->dir, sizeof p->dir, &p->step, e);
        if (rc == CKPT_NONE) return 0; /* an error once the ranks agree that there is none */
        if (rc) return rc;
        if ((p->model_only = ckpt_is_model_only(p->dir, e)) < 0) return e ? e->code : CT_ERR_FORMAT;
        /* A model-only save seeds a run at step 0: trained from here, it
         * restarted the run, whose saves then replaced the folder's full
         * checkpoints step-1 ... step-N. Only an import (step 0) seeds a run
         * this way; a later one loads (ctitan compare's probe scores it) but
         * trainer_run refuses to train from it (seed_step). */
        if (p->model_only && p->step > 0) t->seed_step = p->step;
        p->kind = PICK_LOAD;
        return 0;
    }
    int n, *steps = list_steps(t->ckpt_folder, &n);
    if (n < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot list checkpoints", t->ckpt_folder);
    int rc = pick_newest(t, p, sv, steps, n, e);
    free(steps);
    return rc;
}

/* load_step -1's choice among the folder's steps (ascending), newest first. */
static int pick_newest(trainer *t, resume_pick *p, shared_verify *sv, const int *steps, int n, ct_err *e) {
    const ct_config *c = &t->cfg;
    char damaged[512] = "";
    size_t dlen = 0;
    int n_damaged = 0, export_step = -1;
    for (int i = n - 1; i >= 0 && p->kind == PICK_NONE; i--) {
        snprintf(p->dir, sizeof p->dir, "%s/step-%d", t->ckpt_folder, steps[i]);
        p->step = steps[i];
        if (is_hf_export(p->dir)) {
            if (steps[i] >= c->steps) p->kind = PICK_COMPLETE;
            /* a finished run extended (training.steps raised): its final save is a
             * model, not damage, but it cannot be resumed; say what happens instead */
            else if (export_step < 0 && t->world->rank == 0)
                fprintf(stderr,
                        "ctitan: note: %s is %s, the final save of a run that ended at step %d: it holds no optimizer "
                        "state, so training.steps = %d continues from the newest training checkpoint before it and "
                        "trains the steps after that again (if step %d is saved again, the export is kept as "
                        "hf-step-%d)\n",
                        p->dir, ckpt_dir_kind_name(ckpt_dir_kind(p->dir)), steps[i], c->steps, steps[i], steps[i]);
            if (steps[i] < c->steps && export_step < 0) export_step = steps[i];
            continue;
        }
        ct_err ve = {0};
        if (sv_verify(sv, p->dir, steps[i], &ve)) {
            if (!c->ckpt_fallback)
                return ct_fail(e, ve.code, "%s (checkpoint.fallback = false: not falling back to an older checkpoint)",
                               ve.msg);
            fprintf(stderr, "ctitan: warning: skipping damaged checkpoint %s: %s\n", p->dir, ve.msg);
            n_damaged++;
            if (dlen < sizeof damaged) {
                int k = snprintf(damaged + dlen, sizeof damaged - dlen, "%sstep-%d", dlen ? ", " : "", steps[i]);
                dlen += k > 0 ? (size_t)k : 0;
            }
            continue;
        }
        int mo = ckpt_is_model_only(p->dir, e);
        if (mo < 0) return e ? e->code : CT_ERR_FORMAT;
        p->model_only = mo;
        if (mo && steps[i] >= c->steps && steps[i] > 0) p->kind = PICK_COMPLETE;
        else if (!mo || steps[i] == 0) p->kind = PICK_LOAD; /* a model-only save mid-run cannot be resumed */
    }
    if (p->kind == PICK_NONE && export_step >= 0 && !n_damaged && t->world->rank == 0)
        fprintf(stderr,
                "ctitan: warning: %s holds no training checkpoint before the final save step-%d: training starts at "
                "step 0 (to train that model further instead, start a new checkpoint.folder with "
                "checkpoint.initial_load_path = %s/step-%d)\n",
                t->ckpt_folder, export_step, t->ckpt_folder, export_step);
    if (p->kind == PICK_NONE && n_damaged)
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: no checkpoint to resume from: %d damaged (%s; each file named above), none intact; not "
                       "starting afresh over them (move them away, or use another checkpoint.folder)",
                       t->ckpt_folder, n_damaged, damaged);
    return 0;
}

/* Every rank learns whether any failed at a point every rank reaches (what: "load
 * or initialise the model", "open its data"), so that none is left waiting in the
 * next collective; every rank calls this, also one that has failed (rc). A
 * failure is then a verdict that every rank has (all_ranks: each ends on its own,
 * none aborts the others; see agree_on_pick). The lowest failing rank's error
 * reaches rank 0, whose message is the one printed (cli/cmd_train.c prints a
 * config error on rank 0 alone): a failure that is one rank's own (a checkpoint
 * folder or a data file on each machine's disk, another run's or another model's
 * on one of them) was otherwise printed nowhere. Returns the code to end with:
 * this rank's own, or the relayed error's. */
int trainer_agree(trainer *t, int rc, const char *what, ct_err *e) { return comm_agree(t->world, rc, what, e); }


/* Every rank reads its own copy of --config and its own command line (mpirun's
 * MPMD form gives each machine its own): a rank given another recipe (a batch
 * size, a learning rate, a save interval) mixed other maths into the sums
 * without a word, or waited in a collective the others never made. The ranks
 * compare every option that must agree (config.h's cfg_shared_text: all but
 * where each machine keeps its files (whether it is set, not where), threads,
 * the peak and timeouts) by its hash; every rank names the first that differs,
 * with its own value, and rank 0's message is the one printed. */
int trainer_agree_config(trainer *t, ct_err *e) {
    ct_comm *w = t->world;
    if (w->size <= 1) return 0;
    int n = cfg_n_options();
    int64_t *h = ct_calloc(3 * (size_t)n, sizeof *h), *lo = h + n, *hi = lo + n;
    for (int i = 0; i < n; i++) {
        char *text = cfg_shared_text(&t->cfg, i);
        h[i] = (int64_t)(ct_hash_text(text) >> 2); /* 62 bits: its negation fits */
        free(text);
    }
    comm_range_i64(w, h, lo, hi, (size_t)n);
    int bad = 0;
    while (bad < n && lo[bad] == hi[bad]) bad++;
    free(h);
    if (bad == n) return 0;
    char *text = cfg_shared_text(&t->cfg, bad), name[128];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(text, " "), text);
    ct_fail(e, CT_ERR_CONFIG,
            "%s: %s differs between the ranks (rank %d has %s): every rank must be given the same recipe; only "
            "where each machine keeps its files, training.threads, metrics.peak_tflops and job.description may "
            "differ",
            cfg_origin(&t->cfg, name), name, w->rank, text);
    free(text);
    e->all_ranks = 1; /* every rank knows it from the all-reduce */
    return CT_ERR_CONFIG;
}

/* Each rank opens its own machine's copy of the data: copies of other sizes made
 * the ranks run other numbers of steps' windows and of validation batches
 * (validation.steps = -1: one machine's longer file hung the job in the
 * evaluation's collectives), and a copy of the same size with other tokens
 * trained the job on mixed data at exit 0. Every rank compares its window
 * counts and its data's digest (ds_digest: the tokens and masks the windows
 * hold) with rank 0's; the lowest rank that differs names its own file. */
int trainer_agree_data(trainer *t, const ds *train, const ds *val, ct_err *e) {
    if (t->world->size <= 1) return 0;
    const ds *set[2] = {train, val};
    int64_t mine[4] = {0}, root[4];
    for (int i = 0; i < 2; i++)
        if (set[i]) {
            uint64_t h = ds_digest(set[i]);
            mine[2 * i] = (int64_t)ds_num_windows(set[i]);
            memcpy(&mine[2 * i + 1], &h, sizeof h);
        }
    memcpy(root, mine, sizeof root);
    comm_broadcast(t->world, root, 4, COMM_I64, 0);
    int bad = 0;
    while (bad < 2 && !memcmp(&mine[2 * bad], &root[2 * bad], 2 * sizeof *mine)) bad++;
    int rc = 0;
    if (bad < 2) {
        const ct_config *c = &t->cfg;
        const char *key = bad ? "validation.dataset_path" : "training.dataset_path";
        const int64_t *m = mine + 2 * bad, *r = root + 2 * bad; /* windows, digest */
        int len = bad ? cfg_val_seq_len(c) : c->seq_len; /* validation.seq_len's windows */
        char how[160];
        if (m[0] != r[0])
            snprintf(how, sizeof how, "rank 0's: %lld windows of %d tokens; this rank's: %lld", (long long)r[0],
                     len + 1, (long long)m[0]);
        else
            snprintf(how, sizeof how,
                     "the same %lld windows of %d tokens, other tokens or loss masks: digest %016llx here, %016llx on "
                     "rank 0",
                     (long long)m[0], len + 1, (unsigned long long)m[1], (unsigned long long)r[1]);
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: %s = \"%s\": the ranks' copies hold different data (%s): every machine must hold the same "
                     "data", cfg_origin(c, key), key, bad ? c->val_dataset_path : c->dataset_path, how);
    }
    return trainer_agree(t, rc, "hold rank 0's data", e);
}

/* Every rank must continue from the same checkpoint. On machines that do not
 * share the checkpoint folder the ranks of one would resume while the others
 * started afresh, and the collectives would mix the two states without a word:
 * an error instead, on every rank. Every rank calls this, also one that has
 * failed (rc), so that the collectives stay matched. */
static int agree_on_pick(trainer *t, int rc, const resume_pick *p, ct_err *e) {
    if (t->world->size <= 1) return rc;
    if ((rc = trainer_agree(t, rc, "load or initialise the model", e))) return rc;
    /* one number per choice (its step, whether a final save, whether model-only: a rank
     * whose step-N is model-only refuses to resume where another resumes), and its range */
    int64_t k = p->kind == PICK_NONE ? -1 : (int64_t)p->step * 4 + (p->kind == PICK_COMPLETE) * 2 + !!p->model_only;
    int64_t lo, hi;
    comm_range_i64(t->world, &k, &lo, &hi, 1);
    if (lo == hi) return 0;
    int64_t other = k == hi ? lo : hi;
    char theirs[64];
    if (other < 0) snprintf(theirs, sizeof theirs, "none");
    else
        snprintf(theirs, sizeof theirs, "step-%lld%s%s", (long long)(other / 4), other & 2 ? " (a final save)" : "",
                 other & 1 ? " (model-only)" : "");
    ct_fail(e, CT_ERR_IO,
            "%s: the ranks do not see the same checkpoints (rank %d of %d found %s, another rank %s): the "
            "checkpoint folder must be on a file system every rank sees (docs/distributed.md, \"Across machines\")",
            t->ckpt_folder, t->world->rank, t->world->size, p->kind == PICK_NONE ? "none" : p->dir, theirs);
    /* every rank knows it from the all-reduce: each ends on its own. Ranks aborting at once
     * crashed mpirun itself (a segfault in its PMIx log handler) in a CI run. */
    e->all_ranks = 1;
    return CT_ERR_IO;
}

/* Whether this rank sees rank 0's checkpoint folder, the same files and not
 * only the same path (a per-machine folder elsewhere has the same name):
 * rank 0 writes a random token into a new file there, every rank looks for
 * it, and rank 0 removes it once all have looked. 1 on rank 0 when it could
 * write it; 0 everywhere when it could not (no folder yet: nothing to
 * verify). A file system that shows a new file late (some NFS caches) only
 * makes a rank verify for itself. *all (may be NULL): whether every rank
 * saw it. Collective. */
static int sees_rank0_folder(trainer *t, int *all) {
    ct_comm *w = t->world;
    int64_t probe[2] = {0, 0}; /* the file's name, its content */
    char path[4300], want[32];
    if (w->rank == 0) {
        uint64_t r[2];
        if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) {
            r[0] = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull ^ (uint64_t)(ct_now() * 1e9);
            r[1] = r[0] * 0xBF58476D1CE4E5B9ull + 1;
        }
        r[0] |= 1; /* never 0: 0 says "no probe" */
        snprintf(path, sizeof path, "%s/.ctitan-fs-probe-%016llx", t->ckpt_folder, (unsigned long long)r[0]);
        int len = snprintf(want, sizeof want, "%016llx\n", (unsigned long long)r[1]);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        int ok = fd >= 0 && write(fd, want, (size_t)len) == len;
        if (fd >= 0 && close(fd) != 0) ok = 0;
        if (ok) memcpy(probe, r, sizeof r);
        else if (fd >= 0) unlink(path);
    }
    comm_broadcast(w, probe, 2, COMM_I64, 0);
    int seen = probe[0] != 0 && w->rank == 0;
    if (probe[0] && w->rank != 0) {
        snprintf(path, sizeof path, "%s/.ctitan-fs-probe-%016llx", t->ckpt_folder, (unsigned long long)probe[0]);
        int len = snprintf(want, sizeof want, "%016llx\n", (unsigned long long)probe[1]);
        char got[32];
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t k = read(fd, got, sizeof got);
            close(fd);
            seen = k == len && !memcmp(got, want, (size_t)len);
        }
    }
    int32_t blind = !seen; /* once every rank has looked, the file can go */
    comm_allreduce(w, &blind, 1, COMM_I32, COMM_MAX);
    if (w->rank == 0 && probe[0]) unlink(path);
    if (all) *all = !blind;
    return seen;
}

/* pick_resume on every rank, with the checksums read once per file system
 * (shared_verify): rank 0 picks first and sends its verdicts to the ranks
 * that see its folder, which then pick with them. Every rank calls this,
 * also one that has failed (rc): the collectives stay matched. */
static int pick_shared(trainer *t, int rc, resume_pick *p, ct_err *e) {
    shared_verify sv = {0};
    ct_comm *w = t->world;
    if (w->size > 1 && t->cfg.ckpt_enable) {
        sv.follow = sees_rank0_folder(t, NULL) && w->rank != 0;
        if (!rc && !sv.follow) rc = pick_resume(t, p, &sv, e);
        int32_t v[1 + 2 * SV_MAX] = {0};
        if (w->rank == 0) {
            v[0] = sv.n;
            memcpy(v + 1, sv.v, sizeof sv.v);
        }
        comm_broadcast(w, v, 1 + 2 * SV_MAX, COMM_I32, 0);
        if (sv.follow) {
            sv.n = v[0] < SV_MAX ? v[0] : SV_MAX;
            memcpy(sv.v, v + 1, sizeof sv.v);
            if (!rc) rc = pick_resume(t, p, &sv, e);
        }
    } else if (!rc) {
        rc = pick_resume(t, p, &sv, e);
    }
    p->hashed = sv.hashed;
    return rc;
}

static int load_weights(trainer *t, ct_err *e);

/* The weights (and on resume the moments) of this rank's part of the model,
 * from a checkpoint, HF files or the seed, without anyone holding the whole
 * model: the loaders hand over a block of rows at a time in the whole
 * model's table order (the random init draws every tensor's values in that
 * order, so every layout starts from one process's weights), and each rank
 * keeps its slice. Under FSDP the shard buffers exist first and receive
 * their parts directly. Peak extra memory: a block of rows (a mapped
 * tensor from a checkpoint), and under TP one tensor's column slice.
 * Every rank then learns whether another one failed, so none is left
 * waiting in the next collective. */
int trainer_init_weights(trainer *t, ct_err *e) {
    int rc = plan_attach(&t->plan, &t->model, &t->opt, e); /* FSDP's shards exist before they are filled */
    if (!rc) {
        t->load.sink = plan_load_begin(&t->plan, &t->load.whole);
        rc = load_weights(t, e);
        plan_load_end(&t->plan);
    }
    memset(&t->load, 0, sizeof t->load);
    if (rc && e->all_ranks) return rc; /* agree_on_pick has told every rank */
    if ((rc = trainer_agree(t, rc, "load or initialise the model", e))) return rc;
    if (t->world->size > 1) /* on the ranks CTITAN_LOG_RANKS shows; tests/py/test_dist.py checks it */
        fprintf(stderr, "ctitan: rank %d of %d: %.3f GiB peak after loading the model\n", t->world->rank,
                t->world->size, cpu_peak_rss_bytes() / (1024.0 * 1024.0 * 1024.0));
    return rc;
}

static int initial_weights(trainer *t, ct_err *e);

static int load_weights(trainer *t, ct_err *e) {
    resume_pick p = {0};
    int rc = 0;
    /* with frozen tensors a checkpoint holds the trained ones only: the rest
     * come from where the run started, first */
    if (t->model.n_frozen) rc = initial_weights(t, e);
    rc = pick_shared(t, rc, &p, e);
    if ((rc = agree_on_pick(t, rc, &p, e))) return rc;
    if (p.kind == PICK_NONE && t->cfg.ckpt_enable && t->cfg.load_step >= 0)
        return ct_fail(e, CT_ERR_CONFIG, "checkpoint.load_step = %d: %s has no checkpoints", t->cfg.load_step,
                       t->ckpt_folder);
    if (p.kind == PICK_COMPLETE) {
        t->complete = 1;
        fprintf(stderr, "ctitan: %s is this run's final save (step %d of %d): nothing to do\n", p.dir, p.step,
                t->cfg.steps);
    }
    if (p.kind == PICK_LOAD) return load_checkpoint(t, p.dir, p.model_only, p.hashed, e);
    if (t->model.n_frozen) return 0;
    return initial_weights(t, e);
}

/* The weights a run starts from: HF files or the seed, and LoRA's adapters. */
static int initial_weights(trainer *t, ct_err *e) {
    ct_config *c = &t->cfg;
    int rc = 0;
    if (c->initial_load_path[0]) {
        if (!c->initial_load_in_hf)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: checkpoint.initial_load_path = \"%s\": only Hugging Face safetensors directories "
                           "can be loaded as initial weights; set checkpoint.initial_load_in_hf = true",
                           cfg_origin_any(c, "checkpoint.initial_load_path,checkpoint.initial_load_in_hf"),
                           c->initial_load_path);
        rc = hf_load_each(t->load.whole, cfg_initial_dir(c), &t->load.sink, t->model.moe.bias, e);
        if (!rc && c->load_balance_coeff > 0 && t->model.moe.n_layers) {
            /* a file's selection bias (ERNIE 4.5 MoE's e_score_correction_bias) is frozen in
             * transformers; torchtitan's balancing would move it from a start it never has */
            size_t nb = (size_t)t->model.cfg.n_layers * t->model.cfg.n_experts;
            for (size_t i = 0; i < nb && !rc; i++)
                if (t->model.moe.bias[i] != 0.0f)
                    rc = ct_fail(e, CT_ERR_CONFIG, "%s: model.load_balance_coeff = %g with a non-zero router "
                                 "selection bias in %s (e_score_correction_bias) is not supported: set "
                                 "model.load_balance_coeff = 0", cfg_origin(c, "model.load_balance_coeff"),
                                 c->load_balance_coeff, cfg_initial_dir(c));
        }
        if (rc == CT_ERR_FORMAT && strcmp(c->model_spec, "hf") &&
            (strstr(e->msg, "the model expects") || strstr(e->msg, "missing tensor"))) {
            /* the usual cause: the native flavor (the default debugmodel) beside published
             * weights of another size or family, where model.spec = "hf" was meant */
            size_t n = strlen(e->msg);
            snprintf(e->msg + n, sizeof e->msg - n,
                     "; the model is model.flavor = \"%s\" of model.spec = \"%s\": to build it from the "
                     "checkpoint's own config.json, set model.spec = \"hf\"",
                     c->model_flavor, c->model_spec);
        }
    } else {
        lm_init_random_each(t->load.whole, (uint64_t)c->seed, &t->load.sink);
    }
    if (rc || c->lora_rank <= 0) return rc;
    /* LoRA: the adapters start from a PEFT adapter directory, or as PEFT starts them */
    if (c->lora_adapter_path[0]) {
        if ((rc = lora_load_peft_each(t->load.whole, cfg_adapter_dir(c), &t->load.sink, e))) return rc;
        if (t->world->rank == 0) fprintf(stderr, "ctitan: LoRA adapter loaded from %s\n", c->lora_adapter_path);
        return 0;
    }
    lora_init_each(t->load.whole, (uint64_t)c->seed, &t->load.sink);
    return 0;
}

/* After a save: every rank learns whether rank 0's write failed. The others
 * then give rank 0 a few seconds to report its own error first: its
 * MPI_Abort (cli/cmd_train.c) ends them, where theirs could end rank 0
 * before its message, the one that says what went wrong, is out. */
static int save_outcome(trainer *t, int rc, const char *what, ct_err *e) {
    int32_t bad = rc != 0;
    comm_allreduce(t->world, &bad, 1, COMM_I32, COMM_MAX);
    if (bad && !rc) {
        sleep(5);
        rc = ct_fail(e, CT_ERR_IO, "%s step %d: rank 0 could not write it (its error says why)", what, t->step);
    }
    return rc;
}

/* Where save_gather's floats go: the stream (a synchronous save), or, for
 * checkpoint.async_mode, the staging copy the background thread streams
 * later, in the same order (so the files are the same bytes). */
typedef struct {
    ckpt_stream *s;
    float *stage; /* [cap] or NULL */
    size_t at, cap;
} save_sink;

/* dst[0..n) = src[0..n), in 2 MB chunks over the run's threads: a staged
 * unit is up to a whole embedding's floats (and its two moments), which one
 * core's memcpy copies at a fraction of the memory bandwidth. */
static void stage_copy(float *dst, const float *src, size_t n) {
    enum { CHUNK = (1 << 21) / sizeof(float) };
    long nc = (long)((n + CHUNK - 1) / CHUNK);
#pragma omp parallel for schedule(static) if (nc > 1)
    for (long i = 0; i < nc; i++) {
        size_t lo = (size_t)i * CHUNK, len = n - lo < CHUNK ? n - lo : CHUNK;
        memcpy(dst + lo, src + lo, len * sizeof(float));
    }
}

static int sink_put(save_sink *k, const float *x, size_t n, ct_err *e) {
    if (!k->stage) return ckpt_stream_put(k->s, x, n, e);
    if (n > k->cap - k->at)
        return ct_fail(e, CT_ERR_IO, "checkpoint staging: %zu floats more than a checkpoint of this model holds", n);
    stage_copy(k->stage + k->at, x, n);
    k->at += n;
    return 0;
}

static int put_ckpt(void *ctx, const lm_model *fm, int i0, int i1, const float *x, size_t n, ct_err *e) {
    (void)fm, (void)i0, (void)i1;
    return sink_put(ctx, x, n, e);
}

/* save_gather's put for a checkpoint of the trained tensors only: their
 * floats, parameters then each moment, go on to the sink. */
static int put_trained(void *ctx, const lm_model *fm, int i0, int i1, const float *x, size_t n, ct_err *e) {
    (void)n;
    int rc = 0;
    for (int i = i0; i < i1 && !rc; i++) {
        const lm_tensor *q = &fm->tensors[i];
        if (!q->frozen) rc = sink_put(ctx, x + (q->offset - fm->tensors[i0].offset), q->numel, e);
    }
    return rc;
}

/* A checkpoint: save_gather into ckpt_stream (the file layout is ckpt_save's). */
/* Where a saved config.json's bos/eos token ids come from (hf_keep_token_ids):
 * the model the run started from, as save_pretrained keeps them after
 * fine-tuning. Pointers into c. */
static void token_id_sources(const ct_config *c, const char *src[2]) {
    src[0] = c->hf_assets_path[0] ? cfg_hf_dir(c) : NULL;
    src[1] = c->initial_load_path[0] ? cfg_initial_dir(c) : NULL;
}

/* save_parts' put: whole tensor i's elements into the file's tensor idx[i]
 * (the trained table's; -1: frozen, not saved). */
typedef struct {
    ckpt_part *w;
    const int *idx;
} part_ctx;

static int put_part(void *ctx, int kind, int i, size_t at, const float *x, size_t n, ct_err *e) {
    part_ctx *c = ctx;
    int j = c->idx ? c->idx[i] : i;
    return j < 0 ? 0 : ckpt_part_write(c->w, kind, j, at, x, n, e);
}

static int sees_rank0_folder(trainer *t, int *all);

/* Whether every rank can write its part of a save itself (ckpt_part_*,
 * plan_save_parts; any layout): every rank sees rank 0's checkpoint folder
 * (sees_rank0_folder; rank 0 creates the folder first). Collective. */
static int save_in_parts(trainer *t) {
    /* CTITAN_CKPT_GATHER=1: rank 0 writes, as before (a debug knob: the tests compare the two paths' files) */
    const char *g = getenv("CTITAN_CKPT_GATHER");
    if (t->world->size <= 1 || (g && *g && strcmp(g, "0"))) return 0;
    if (t->world->rank == 0) ct_mkdirs(t->ckpt_folder, NULL); /* a failure is the save's to report */
    int all;
    sees_rank0_folder(t, &all);
    return all;
}

/* trainer_save's writing when every rank writes its part: rank 0 lays out
 * the files, every rank pwrites the elements it holds (plan_save_parts),
 * every rank's outcome reaches every rank (trainer_agree), and rank 0
 * finishes (*s ended or aborted). tab: the files' tensors; idx: tab's index
 * of each whole tensor (NULL: the same). */
static int save_parts(trainer *t, const lm_model *tab, const int *idx, int model_only, ckpt_stream **s, ct_err *e) {
    int rank0 = t->world->rank == 0, rc = 0;
    const char *id_src[2];
    token_id_sources(&t->cfg, id_src);
    if (rank0 && !(rc = ckpt_stream_begin_parts(s, t->ckpt_folder, t->step, tab, model_only, e)))
        ckpt_stream_token_ids(*s, id_src, 2); /* a step-N is also an HF directory */
    rc = trainer_agree(t, rc, "begin the checkpoint", e);
    int64_t pid = (int64_t)getpid(); /* rank 0's names the temp dir */
    comm_broadcast(t->world, &pid, 1, COMM_I64, 0);
    if (rc) return rc;
    char tmp[4200], final[4200];
    snprintf(final, sizeof final, "%s/step-%d", t->ckpt_folder, t->step);
    ckpt_part *w = NULL;
    int mine = ckpt_tmp_dir(tmp, sizeof tmp, t->ckpt_folder, t->step, (long)pid, e);
    if (!mine) mine = ckpt_part_open(&w, tmp, final, tab, model_only, e);
    part_ctx pc = {w, idx};
    if (!mine) mine = plan_save_parts(&t->plan, model_only ? 1 : 3, put_part, &pc, e);
    uint64_t wrote = ckpt_part_written(w);
    if (!mine) mine = ckpt_part_close(w, e);
    else ckpt_part_abort(w);
    if (!mine) /* on the ranks CTITAN_LOG_RANKS shows: the save is spread over the ranks */
        fprintf(stderr, "ctitan: rank %d of %d: wrote %llu bytes of checkpoint tensors into %s\n", t->world->rank,
                t->world->size, (unsigned long long)wrote, tmp);
    return trainer_agree(t, mine, "write its part of the checkpoint", e);
}

/* checkpoint.async_mode: a save staged by the main thread (every rank takes
 * part in the gather to rank 0) and written by a background thread of rank 0
 * while training goes on. The thread owns all it reads: the files' tensor
 * table, the staged floats, the texts; it never touches the trainer, calls no
 * collective (MPI runs without THREAD_MULTIPLE) and takes the same path as a
 * synchronous save (ckpt_stream: temp dir, fsync, manifest last, rename), so
 * a kill at any moment leaves no step-N that is not complete. */
static int put_adapter(void *ctx, const lm_model *fm, int i0, int i1, const float *x, size_t n, ct_err *e);

/* The staging copy for n floats: the one the previous async save used, kept
 * (the run waits for that save's thread before it stages the next: nothing
 * reads it any more), else a new one. A new buffer's pages fault in as the
 * stage first writes them, which took most of the stage's time when every
 * save had its own (docs/benchmarks.md, "Asynchronous checkpoints"). Plain
 * 4 KB pages: advised for huge ones (ct_alloc_huge) the first stage took
 * 0.5-2 s instead of 0.2-0.3 s there, the kernel compacting memory to find
 * them (THP defrag "madvise"), for a buffer that is then never faulted again. */
static float *stage_buffer(trainer *t, size_t n, int *reused) {
    *reused = t->async_save.stage && t->async_save.stage_n >= n;
    if (*reused) return t->async_save.stage;
    trainer_stage_free(t);
    t->async_save.stage_n = n ? n : 1;
    return t->async_save.stage = ct_malloc(t->async_save.stage_n * sizeof(float));
}

void trainer_stage_free(trainer *t) {
    if (t->async_save.job) return; /* its thread may still read it (never the case after trainer_save_wait) */
    free(t->async_save.stage);
    t->async_save.stage = NULL;
    t->async_save.stage_n = 0;
}

typedef struct trainer_ckpt_job {
    pthread_t th;
    int joinable;             /* th runs (else the job ran on the main thread: no thread could start) */
    char folder[4096];        /* the checkpoint folder */
    int step;
    lm_model tab;             /* the files' tensors (table_copy: config and tensors, no buffers) */
    const float *stage;       /* [n]: parameters, exp_avg, exp_avg_sq of tab, in the stream's order; the
                               * trainer's staging copy (t->async_save.stage), which the job borrows */
    int reused;               /* stage held an earlier save's floats (stage_buffer) */
    size_t n;
    char *state, *toml;       /* state.json, config.toml as the step left them */
    char *id_src[2];          /* where config.json's token ids come from (ckpt_stream_token_ids) */
    int keep_k;               /* checkpoint.keep_latest_k */
    int lora;                 /* a LoRA run: its PEFT adapter goes into step-N after the rename */
    lm_model atab;            /* the adapter's table */
    float **adata;            /* [atab.n_tensors]: copies of the saved tensors (NULL: not saved) */
    char *base, *modules_to_save;
    double alpha, dropout;
    int rslora;
    double sleep_s;           /* CTITAN_CKPT_ASYNC_TEST_SLEEP (test-only): pause mid-write */
    double staged_s;          /* the main thread's part */
    int rc;                   /* the thread's outcome */
    ct_err err;
    ckpt_info info;
    double write_s;
} trainer_ckpt_job;

/* A table with m's config and tensors and no buffers, for a reader that
 * outlives m (the stream reads cfg, n_params, tensors; lora_save_peft the same). */
static void table_copy(lm_model *dst, const lm_model *src) {
    memset(dst, 0, sizeof *dst);
    dst->cfg = src->cfg;
    dst->n_tensors = src->n_tensors;
    dst->n_params = src->n_params;
    dst->n_frozen = src->n_frozen;
    dst->tensors = ct_malloc(((size_t)src->n_tensors + 1) * sizeof *dst->tensors);
    memcpy(dst->tensors, src->tensors, (size_t)src->n_tensors * sizeof *dst->tensors);
}

static void job_free(trainer_ckpt_job *j) {
    if (!j) return;
    free(j->tab.tensors); /* not j->stage: the trainer's, kept for the next save (trainer_stage_free) */
    free(j->state);
    free(j->toml);
    for (int i = 0; i < 2; i++) free(j->id_src[i]);
    if (j->adata)
        for (int i = 0; i < j->atab.n_tensors; i++) free(j->adata[i]);
    free(j->adata);
    free(j->atab.tensors);
    free(j->base);
    free(j->modules_to_save);
    free(j);
}

/* After a full save: keep_latest_k. It counts from the newest step-N in the
 * folder. After a fallback past a damaged checkpoint (or a load_step older
 * than the newest) the folder holds steps beyond this one: counted as kept
 * (pruning checks sizes, not checksums), they would push out the checkpoint
 * just written and the intact ones before it, leaving only what the run fell
 * back from. Until the run passes them (saving their step replaces them),
 * only leftover temporary directories go. */
static void prune_after_save(const char *folder, int step, int k) {
    int n, *steps = list_steps(folder, &n);
    if (n > 0 && steps[n - 1] > step) k = 0;
    free(steps);
    ct_err pe = {0};
    if (ckpt_prune(folder, k, &pe))
        fprintf(stderr, "ctitan: warning: the checkpoint is saved but pruning old ones failed: %s\n", pe.msg);
}

/* The background thread: the staged floats into a checkpoint, as ckpt_save
 * writes it, then the adapter, then keep_latest_k (only once it is complete). */
static void *job_run(void *arg) {
    trainer_ckpt_job *j = arg;
    double t0 = ct_now();
    ckpt_stream *s = NULL;
    ct_err *e = &j->err;
    int rc = ckpt_stream_begin(&s, j->folder, j->step, &j->tab, 0, e);
    if (!rc) ckpt_stream_token_ids(s, (const char *const *)j->id_src, 2); /* a step-N is also an HF directory */
    size_t first = 0;
    if (!rc && j->sleep_s > 0) { /* test-only: a save caught mid-write, its temp dir half filled */
        first = j->n / 2;
        rc = ckpt_stream_put(s, j->stage, first, e);
        if (!rc) {
            struct timespec ts = {(time_t)j->sleep_s, (long)((j->sleep_s - (double)(time_t)j->sleep_s) * 1e9)};
            while (nanosleep(&ts, &ts) && errno == EINTR) {}
        }
    }
    if (!rc) rc = ckpt_stream_put(s, j->stage + first, j->n - first, e);
    if (rc) ckpt_stream_abort(s);
    else rc = ckpt_stream_end(s, j->state, j->toml, &j->info, e);
    if (!rc && j->lora) /* a LoRA run's checkpoint is also a PEFT adapter directory */
        rc = lora_save_peft(&j->atab, (const float *const *)j->adata, j->info.dir, j->base, j->alpha, j->rslora,
                            j->dropout, j->modules_to_save, e);
    if (!rc) prune_after_save(j->folder, j->step, j->keep_k);
    j->write_s = ct_now() - t0;
    if (!rc)
        fprintf(stderr, "ctitan: saved checkpoint %s: %.1f MiB, staged in %.2f s, finished in the background in "
                        "%.2f s\n", j->info.dir, j->info.bytes / 1048576.0, j->staged_s, j->write_s);
    j->rc = rc;
    return NULL;
}

/* The adapters' tensors (and modules_to_save) of the current model gathered
 * to rank 0: *tab their table (table_copy), *data copies of them. Collective. */
static int adapter_gather(trainer *t, lm_model *tab, float ***data, ct_err *e) {
    /* TP and EP do not run LoRA: the whole table is the model's, or (a pipeline stage) its layout */
    lm_model ftab;
    const lm_model *fm = &t->model;
    int rc = 0, whole_tab = plan_holds_part(&t->plan);
    if (whole_tab) {
        lm_layout(&ftab, &t->plan.whole);
        for (int i = 0; i < ftab.n_tensors; i++) ftab.tensors[i].frozen = t->model.tensors[i].frozen; /* lora_saved */
        fm = &ftab;
    }
    *data = ct_calloc((size_t)fm->n_tensors + 1, sizeof(float *)); /* [n_tensors] */
    plan_save_gather(&t->plan, fm, 1, 0, put_adapter, *data, &rc, e); /* adapters and modules_to_save: trained, fp32 */
    table_copy(tab, fm);
    if (whole_tab) lm_free(&ftab);
    return rc;
}

/* trainer_save, or with job (checkpoint.async_mode, a full save) the same
 * gather into job's staging copy, the texts into job, no file written. */
static int save_checkpoint(trainer *t, const ds *data, int model_only, trainer_ckpt_job *job, ct_err *e) {
    lm_model ftab;
    const lm_model *fm = &t->model; /* the whole model's table, on rank 0 and the stages' roots */
    /* staged: gathered to rank 0 (the gather's collectives stay on this thread; the files are the same) */
    int rank0 = t->world->rank == 0, rc = 0, parts = !job && save_in_parts(t);
    /* in parts every rank lays out the files: each needs the whole table */
    int whole_tab = (parts || plan_save_root(&t->plan)) && plan_holds_part(&t->plan);
    ckpt_stream *s = NULL;
    if (whole_tab) {
        lm_layout(&ftab, &t->plan.whole);
        for (int i = 0; i < ftab.n_tensors; i++) ftab.tensors[i].frozen = t->model.tensors[i].frozen; /* trained only */
        fm = &ftab;
    }
    plan_gather_bias(&t->plan);
    trained_table tt;
    int trained_only = t->model.n_frozen > 0; /* frozen tensors come from the run's start on resume */
    if (trained_only) trained_table_init(&tt, fm, &t->model);
    if (parts) {
        int *idx = NULL;
        if (trained_only) { /* whole tensor -> its index in the trained table */
            idx = ct_malloc(((size_t)fm->n_tensors + 1) * sizeof *idx);
            for (int i = 0; i < fm->n_tensors; i++) idx[i] = -1;
            for (int j = 0; j < tt.tab.n_tensors; j++) idx[tt.full[j]] = j;
        }
        rc = save_parts(t, trained_only ? &tt.tab : fm, idx, model_only, &s, e);
        free(idx);
    } else {
        const lm_model *files = trained_only ? &tt.tab : fm;
        save_sink sk = {0};
        if (rank0 && job) { /* the staging copy: one more of what the checkpoint holds */
            table_copy(&job->tab, files);
            sk.cap = files->n_params * (model_only ? 1 : 3);
            sk.stage = stage_buffer(t, sk.cap, &job->reused);
            job->stage = sk.stage;
        } else if (rank0) {
            rc = ckpt_stream_begin(&s, t->ckpt_folder, t->step, files, model_only, e);
        }
        const char *id_src[2];
        token_id_sources(&t->cfg, id_src);
        if (rank0 && !rc && s) ckpt_stream_token_ids(s, id_src, 2); /* a step-N is also an HF directory */
        sk.s = s;
        if (trained_only) plan_save_gather(&t->plan, fm, model_only ? 1 : 3, 0, put_trained, &sk, &rc, e);
        else plan_save_gather(&t->plan, fm, model_only ? 1 : 3, 1, put_ckpt, &sk, &rc, e);
        if (rank0 && job) {
            job->n = sk.at;
            for (int i = 0; i < 2; i++) job->id_src[i] = id_src[i] ? ct_strdup(id_src[i]) : NULL;
            if (!rc && sk.at != sk.cap)
                rc = ct_fail(e, CT_ERR_IO, "checkpoint staging: %zu of %zu floats", sk.at, sk.cap);
        }
    }
    ckpt_info info;
    if (rank0 && rc) ckpt_stream_abort(s);
    if (rank0 && !rc) {
        char *state = state_to_json(t, data);
        char *toml = NULL;
        size_t toml_len = 0;
        FILE *mf = open_memstream(&toml, &toml_len);
        if (mf) {
            cfg_write_toml(&t->cfg, mf);
            fclose(mf);
        }
        if (job) { /* the step's state now: the loader moves on before the thread writes it */
            job->state = state;
            job->toml = toml;
            state = toml = NULL;
        } else {
            rc = ckpt_stream_end(s, state, toml, &info, e);
        }
        free(state);
        free(toml);
    }
    if (whole_tab) lm_free(&ftab);
    if (trained_only) trained_table_free(&tt); /* the stream read it until its end */
    rc = save_outcome(t, rc, job ? "stage the checkpoint of" : "checkpoint", e);
    if (!rc && t->cfg.lora_rank > 0) { /* a LoRA run's checkpoint is also a PEFT adapter directory; resume reads
                                         * only the manifest's files */
        if (job) { /* gathered now, written by the thread into step-N once it is in place */
            rc = adapter_gather(t, &job->atab, &job->adata, e);
            job->lora = 1;
            rc = save_outcome(t, rc, "stage the PEFT adapter of", e);
        } else {
            char dir[4200];
            snprintf(dir, sizeof dir, "%s/step-%d", t->ckpt_folder, t->step);
            rc = trainer_save_adapter(t, dir, e);
        }
    }
    if (rc || !rank0 || job) return rc;
    fprintf(stderr, "ctitan: saved %scheckpoint %s: %.1f MiB in %.2f s\n", model_only ? "model-only " : "", info.dir,
            info.bytes / 1048576.0, info.seconds);
    trainer_checkpoint_event(t, model_only ? "model_only" : "full", info.dir, info.bytes / 1048576.0, info.seconds);
    prune_after_save(t->ckpt_folder, t->step, t->cfg.keep_latest_k);
    return 0;
}

int trainer_save(trainer *t, const ds *data, int model_only, ct_err *e) {
    int rc = trainer_save_wait(t, 1, e); /* one save at a time: the one in the background first */
    trainer_stage_free(t); /* a synchronous save (the run's last, a stop's) streams: the staging copy goes */
    if (rc) return rc;
    double t0 = ct_now();
    rc = save_checkpoint(t, data, model_only, NULL, e);
    t->ckpt_save_s += ct_now() - t0;
    return rc;
}

static int async_on(const ct_config *c) { return c->ckpt_async_mode && strcmp(c->ckpt_async_mode, "disabled"); }

int trainer_save_async(trainer *t, const ds *data, ct_err *e) {
    if (!async_on(&t->cfg)) return trainer_save(t, data, 0, e);
    int rc = trainer_save_wait(t, 1, e); /* as torchtitan: the previous save ends before the next stages */
    if (rc) return rc;
    double t0 = ct_now();
    trainer_ckpt_job *j = ct_calloc(1, sizeof *j);
    rc = save_checkpoint(t, data, 0, j, e);
    if (rc || t->world->rank != 0) { /* only rank 0 writes; every rank waits for it at the same points */
        t->ckpt_save_s += ct_now() - t0;
        job_free(j);
        if (!rc) t->async_save.pending = 1, t->async_save.step = t->step;
        return rc;
    }
    const ct_config *c = &t->cfg;
    snprintf(j->folder, sizeof j->folder, "%s", t->ckpt_folder);
    j->step = t->step;
    j->keep_k = c->keep_latest_k;
    j->base = ct_strdup(c->initial_load_path[0] ? c->initial_load_path : c->hf_assets_path);
    j->modules_to_save = c->lora_modules_to_save ? ct_strdup(c->lora_modules_to_save) : NULL;
    j->alpha = c->lora_alpha;
    j->rslora = c->lora_rslora;
    j->dropout = c->lora_dropout;
    const char *sl = getenv("CTITAN_CKPT_ASYNC_TEST_SLEEP"); /* test-only (docs/checkpoints.md) */
    j->sleep_s = sl && *sl ? atof(sl) : 0;
    j->staged_s = ct_now() - t0;
    fprintf(stderr, "ctitan: staged checkpoint step-%d (%.1f MiB of tensors) in %.2f s (%s staging copy); writing it "
                    "in the background\n", j->step, (double)j->n * sizeof(float) / 1048576.0, j->staged_s,
            j->reused ? "the previous save's" : "a new");
    /* the stop signals go to the step loop's thread (trainer.c's handler), never interrupt the writer */
    sigset_t stop, was;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &stop, &was);
    int err = pthread_create(&j->th, NULL, job_run, j);
    pthread_sigmask(SIG_SETMASK, &was, NULL);
    j->joinable = err == 0;
    if (!j->joinable) { /* no thread to be had: the save is written now, as a synchronous one */
        fprintf(stderr, "ctitan: warning: cannot start the checkpoint thread: %s; saving synchronously\n",
                strerror(err));
        job_run(j);
    }
    t->async_save.job = j;
    t->async_save.pending = 1;
    t->async_save.step = t->step;
    t->ckpt_save_s += ct_now() - t0; /* the stage and the thread's start */
    return 0;
}

static int save_wait(trainer *t, int collective, ct_err *e) {
    trainer_ckpt_job *j = t->async_save.job;
    int step = t->async_save.step, rc = 0;
    t->async_save.job = NULL;
    t->async_save.pending = 0;
    if (j) {
        double w0 = ct_now();
        if (j->joinable) pthread_join(j->th, NULL);
        double waited = ct_now() - w0;
        if (waited >= 0.01)
            fprintf(stderr, "ctitan: waited %.2f s for the checkpoint of step %d written in the background\n", waited,
                    step);
        rc = j->rc;
        if (rc && e) *e = j->err;
        if (!rc) { /* events.jsonl's line names the step it saved */
            int now = t->step;
            t->step = step;
            trainer_checkpoint_event(t, "full", j->info.dir, j->info.bytes / 1048576.0, j->write_s);
            t->step = now;
        }
        job_free(j);
    }
    if (!collective) return rc;
    int32_t bad = rc != 0;
    comm_allreduce(t->world, &bad, 1, COMM_I32, COMM_MAX);
    if (bad && !rc) { /* as save_outcome: rank 0's own error says what went wrong first */
        sleep(5);
        rc = ct_fail(e, CT_ERR_IO, "checkpoint step %d (written in the background): rank 0 could not write it (its "
                     "error says why)", step);
    }
    return rc;
}

int trainer_save_wait(trainer *t, int collective, ct_err *e) {
    if (!t->async_save.pending) return 0;
    double t0 = ct_now(); /* the join on rank 0, the outcome's all-reduce on every rank */
    int rc = save_wait(t, collective, e);
    t->ckpt_wait_s += ct_now() - t0;
    return rc;
}

/* save_gather's put for an adapter: copies of the saved tensors (small),
 * into data[n_tensors] (ctx). */
static int put_adapter(void *ctx, const lm_model *fm, int i0, int i1, const float *x, size_t n, ct_err *e) {
    (void)n, (void)e;
    float **data = ctx;
    for (int i = i0; i < i1; i++) {
        const lm_tensor *q = &fm->tensors[i];
        if (!lora_saved(q)) continue;
        data[i] = ct_malloc((q->numel ? q->numel : 1) * sizeof(float));
        memcpy(data[i], x + (q->offset - fm->tensors[i0].offset), q->numel * sizeof(float));
    }
    return 0;
}

int trainer_save_adapter(trainer *t, const char *dir, ct_err *e) {
    lm_model tab;
    float **data;
    int rank0 = t->world->rank == 0, rc = adapter_gather(t, &tab, &data, e);
    const ct_config *c = &t->cfg;
    const char *base = c->initial_load_path[0] ? c->initial_load_path : c->hf_assets_path;
    if (rank0 && !rc)
        rc = lora_save_peft(&tab, (const float *const *)data, dir, base, c->lora_alpha, c->lora_rslora, c->lora_dropout,
                            c->lora_modules_to_save, e);
    for (int i = 0; i < tab.n_tensors; i++) free(data[i]);
    free(data);
    free(tab.tensors);
    return save_outcome(t, rc, "PEFT adapter", e);
}

/* The final HF save, written to a temp dir and renamed into place so a kill
 * never leaves half an export. It never merges into a training checkpoint of
 * the same step (that would break its manifest): then it goes to hf-step-N.
 * An earlier HF export of the step is replaced. `dir` gets the final path. */
typedef struct {
    st_dir_stream *out;
    const float *bias; /* [L, E] the model's router selection biases (lm_moe_state.bias) */
} hf_put_ctx;
static int put_hf(void *ctx, const lm_model *fm, int i0, int i1, const float *x, size_t n, ct_err *e) {
    (void)n; /* a unit is one layer (or the embedding, the head): a fused tensor's pieces all come in one */
    const hf_put_ctx *h = ctx;
    return hf_write_unit(fm, h->bias, i0, i1, x, h->out, 0, NULL, e);
}

/* Written like a checkpoint (save_gather: every rank takes part, rank 0
 * writes unit by unit), the files hf_save's: the tensors as st_write_dir
 * would shard them (5 GiB), then config.json with torch_dtype, and what
 * `ctitan export` adds beside them (hf_copy_assets, hf_keep_token_ids): all
 * in the temp dir, so the export appears whole or not at all. */
int trainer_save_hf(trainer *t, const char *folder, char *dir, ct_dtype dtype, const char *torch_dtype,
                          ct_err *e) {
    int rank0 = t->world->rank == 0, step = t->step, rc = 0;
    lm_model ftab;
    const lm_model *fm = &t->model;
    st_dir_stream *out = NULL;
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s/.hf-step-%d.tmp-%ld", folder, step, (long)getpid());
    int whole_tab = plan_save_root(&t->plan) && plan_holds_part(&t->plan);
    if (whole_tab) { /* rank 0 and the stages' roots name the whole model's tensors */
        lm_layout(&ftab, &t->plan.whole);
        fm = &ftab;
    }
    if (rank0) { /* the files' tensors: GraniteMoE's fused experts as transformers reads them (checkpoint/hf.h) */
        ct_rm_tree(tmp, NULL);
        st_wtensor *ts = ct_calloc(hf_file_tensor_cap(fm), sizeof *ts);
        char (*names)[LM_NAME_MAX] = ct_calloc(hf_file_tensor_cap(fm), sizeof *names);
        int n = hf_file_tensors(fm, dtype, ts, names);
        static const char *const meta[] = {"format", "pt", NULL};
        rc = st_dir_stream_open(&out, tmp, ts, n, (size_t)5 << 30, meta, e);
        free(ts);
        free(names);
    }
    hf_put_ctx hp = {out, t->model.moe.bias};
    plan_save_gather(&t->plan, fm, 1, 1, put_hf, &hp, &rc, e);
    if (rank0) {
        char p[4300];
        if (rc) st_dir_stream_abort(out);
        else rc = st_dir_stream_close(out, e);
        snprintf(p, sizeof p, "%s/config.json", tmp);
        if (!rc) rc = lm_config_write_hf(&fm->cfg, p, torch_dtype, e);
        /* as save_pretrained leaves a fine-tuned model (and `ctitan export` its
         * output): the tokenizer and generation files of the model the run
         * started from, and its end-of-text ids in config.json, so generate
         * (transformers' or ctitan's) stops where it should and the directory
         * serves as model.hf_assets_path of a next run */
        const char *id_src[2];
        token_id_sources(&t->cfg, id_src);
        const char *assets = id_src[0];
        if (!rc && assets && hf_copy_assets(assets, tmp, NULL, e) < 0) rc = e && e->code ? e->code : CT_ERR_IO;
        if (!rc) rc = hf_keep_token_ids(p, id_src, 2, e);
        /* step-N taken (a checkpoint of this step, or an earlier final save, which may
         * be a model the user keeps): the first free hf-step-N[.K]. Nothing is deleted. */
        if (!rc && access(dir, F_OK) == 0) {
            rc = ckpt_free_export_name(folder, step, dir, 4096, e);
            if (!rc) fprintf(stderr, "ctitan: note: step-%d is taken; the final save goes to %s\n", step, dir);
        }
        if (!rc && rename(tmp, dir) != 0)
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot rename %s into place: %s", dir, tmp, strerror(errno));
        if (rc) ct_rm_tree(tmp, NULL);
    }
    if (whole_tab) lm_free(&ftab);
    return save_outcome(t, rc, "Hugging Face export", e);
}
