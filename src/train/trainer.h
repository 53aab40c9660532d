/* train/trainer.h: one training run: config -> model -> data -> steps -> save.
 *
 * The trainer is the run context: it owns the config, the model, the
 * optimizer state and the schedule; nothing lives in globals. The CLI's
 * `train` runs trainer_run; the library API (api/ctitan.h) drives the same
 * struct a micro-batch at a time, so tests and the CLI share one code path. */
#ifndef CT_TRAIN_TRAINER_H
#define CT_TRAIN_TRAINER_H

#include <stdint.h>
#include <stdio.h>

#include "config/config.h"
#include "core/err.h"
#include "data/dataset.h"
#include "distributed/comm.h"
#include "distributed/plan.h"
#include "metrics/events.h"
#include "model/lm.h"
#include "optim/optim.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    ct_config cfg;
    lm_model model;
    adamw_state opt;
    adamw_hparams hp;
    lr_schedule sched;
    int grad_accum;   /* micro-batches per optimizer step */
    int step;         /* optimizer steps done */
    int complete;     /* the checkpoint folder already holds this run's final save */
    int val_batch;    /* sequences per validation batch */
    ds_state resume_data; /* loader position restored from a checkpoint */
    int have_resume_data;
    int val_pending;  /* the stop at this step skipped its validation: the resumed run does it first */
    int seed_step;    /* > 0: checkpoint.load_step named this model-only step-N: weights only, training refused */
    char ckpt_folder[4096]; /* {dump_folder}/{checkpoint.folder} */
    /* distributed run: the world, and the plan of the layout over it (distributed/plan.h) */
    ct_comm *world;   /* never NULL after init: &single when no world was given */
    ct_comm single;
    ct_plan plan;     /* every layout question goes to it; the model is this rank's part */
    struct {          /* while the weights load (init_weights): where each whole tensor goes */
        const lm_model *whole; /* the whole model's tensor table */
        lm_sink sink;
    } load;
    int global_batch; /* sequences per optimizer step over every data-parallel rank */
    /* for events.jsonl (metrics/events.h) */
    double t_launch;  /* Unix time trainer_init began */
    struct {          /* what the weights came from, when a checkpoint */
        char dir[4200];   /* a checkpoint's step-N under ckpt_folder */
        double seconds, mib;
        int resumed;  /* a full checkpoint (else a model-only one seeding step 0) */
    } loaded;
    struct ev_log *events; /* rank 0 during trainer_run; NULL elsewhere */
    int dump_lock;         /* rank 0 of trainer_init_dist: job.dump_folder's lock, its descriptor + 1 (0: none) */
    ev_energy energy;      /* RAPL reading at launch (rank 0) */
    /* the CLI's data (trainer_init_dist), opened before the kernels are timed and the
     * weights load; trainer_run takes them over, trainer_free closes what it did not */
    ds *data, *val;
    tok *tk;
    /* checkpoint.async_mode: the save a background thread is writing (trainer_ckpt.c); pending on every rank
     * (the wait's outcome is agreed), job on rank 0 only, which writes it */
    struct {
        struct trainer_ckpt_job *job;
        int pending;
        int step;     /* the step it saves */
        float *stage; /* [stage_n] rank 0: the staging copy, kept from one save to the next (trainer_stage_free) */
        size_t stage_n;
    } async_save;
    /* the seconds this rank's step loop spent in checkpoint saves, for events.jsonl's exit line: */
    double ckpt_save_s; /* saving (a synchronous save, gather and write) or staging (async_mode) */
    double ckpt_wait_s; /* waiting for the save a background thread writes (trainer_save_wait) */
} trainer;

/* Takes ownership of *cfg (the caller must not free it). Builds the model from
 * model.spec, loads or initialises weights, sets up AdamW and the schedule. */
int trainer_init(trainer *t, ct_config *cfg, ct_err *e);
/* The same on an MPI world (cli train): [parallelism] is checked against
 * world->size before anything is built, the data is split by data-parallel
 * rank, and FSDP shards the model state. world == NULL: one process. The
 * caller keeps world alive until trainer_free. Unlike trainer_init (the
 * library's sessions, which write nothing into job.dump_folder), it claims
 * the folder for the run: rank 0 holds an flock on {dump_folder}/.ctitan.lock
 * until trainer_free or its end, taken before the checkpoints are looked at,
 * and a second run on a held folder fails at once (CT_ERR_CONFIG, naming the
 * holder's pid and host) on every rank (docs/checkpoints.md, "One run per
 * folder"). */
int trainer_init_dist(trainer *t, ct_config *cfg, ct_comm *world, ct_err *e);
void trainer_free(trainer *t);
/* Clip, AdamW at the scheduled lr, zero the gradients, step++. */
void trainer_optimizer_step(trainer *t, double *grad_norm, double *lr);
/* The full loop of `ctitan train`. Returns CT_STOPPED after SIGTERM/SIGINT
 * (or training.stop_at_step) once a checkpoint is written. */
int trainer_run(trainer *t, ct_err *e);
/* Saves a full (or model-only) training checkpoint of the current step. */
int trainer_save(trainer *t, const ds *data, int model_only, ct_err *e);
/* `ctitan train --dry-run`: prints the memory the run would plan (parameters,
 * gradients, AdamW moments, activations + workspace) and allocates none of it;
 * for a world of several ranks, also what rank 0 of the layout plans. world:
 * mpirun's size, or 0 without mpirun (then the product of the degrees when
 * [parallelism] fixes them all, else 1). The layout is checked as a run
 * checks it (CT_ERR_CONFIG). out NULL: check only, print nothing. */
int trainer_dry_run(const ct_config *cfg, int world, FILE *out, ct_err *e);
/* The seed of LoRA's dropout masks (lm_model.lora_seed) of optimizer step
 * `step` (1-based): a function of training.seed and the step alone, so resume
 * replays them. The caller tells the model which sequences of the step's
 * global batch each forward holds (lm_model.lora_seq0, lora_seq_stride), so
 * every layout and every split of the batch draws one process's masks. */
uint64_t trainer_lora_seed(const trainer *t, int step);
/* LoRA: the adapters' tensors (and modules_to_save) of the current model as
 * a PEFT adapter directory (model/lora.h) at dir; files already there stay
 * (a checkpoint can carry one). Collective. */
int trainer_save_adapter(trainer *t, const char *dir, ct_err *e);
/* Builds the model config for cfg (flavor table or HF config.json). */
int trainer_model_config(const ct_config *cfg, lm_config *mc, ct_err *e);
/* Every [kernels] override runs on this CPU (the message names where it was set):
 * checked by the run, the dry run and, before anything else is built, the CLI. */
int trainer_check_kernels(const ct_config *c, ct_err *e);
/* Warns (stderr) when training.seq_len exceeds the model's positions (lm_position_limit). */
void trainer_warn_positions(const ct_config *c, const lm_config *mc);
/* model.hf_assets_path and checkpoint.initial_load_path as local directories into
 * cfg->hf_assets_dir / initial_load_dir: a directory as it is, a Hugging Face Hub id
 * (at model.hf_revision) as its snapshot in the Hub cache, fetched when missing: config.json
 * (spec "hf"), the tokenizer files the repo has, and the weights for initial_load_path;
 * config.json alone for a dry run. trainer_init does it; errors are hub_resolve's. */
int trainer_resolve_hub(ct_config *cfg, int dry_run, ct_err *e);

#endif
