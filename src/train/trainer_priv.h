/* train/trainer_priv.h: what the trainer's three files share; not part of
 * the trainer's API (train/trainer.h).
 *   trainer.c       set-up, the step (reductions, clipping, AdamW), the run loop
 *   trainer_ckpt.c  the model state in and out: resume, loading, saving, HF export
 *   trainer_plan.c  `ctitan train --dry-run`, whole model and per rank */
#ifndef CT_TRAIN_TRAINER_PRIV_H
#define CT_TRAIN_TRAINER_PRIV_H

#include <stddef.h>
#include <stdio.h>

#include "core/dtype.h"
#include "train/trainer.h"

/* out = dir/name, or name alone when it is absolute. Returns 0 if it fits. */
int trainer_join_path(char *out, size_t cap, const char *dir, const char *name);
/* Where the layout came from, for the mesh and plan checks' messages: "command
 * line" when an override set any [parallelism] degree or batch size, else the
 * config file (cfg_origin_any). */
const char *trainer_layout_origin(const ct_config *c);
/* The same for lora_apply_frozen's messages (training.freeze, lora.modules_to_save, lora.rank). */
const char *trainer_frozen_origin(const ct_config *c);
/* A global batch the data-parallel ranks cannot split evenly is a layout
 * error: the run and the dry run reject it alike. */
int trainer_check_global_batch(const ct_config *c, int dp, ct_err *e);
/* [lora] and training.freeze into the model config mc: which projections
 * get adapters, their scale and dropout (every layout runs them; its slices
 * come later, distributed/tp.h). The run and the dry run share it. */
int trainer_finetune_config(const ct_config *c, lm_config *mc, ct_err *e);
/* The weights (and on resume the moments and state) of this rank's part of
 * the model, from a checkpoint, HF files or the seed (trainer_ckpt.c).
 * Collective: every rank learns whether another failed. */
int trainer_init_weights(trainer *t, ct_err *e);
/* Every rank calls it at the same point with its own rc: each learns whether any
 * failed, and rank 0's error becomes the lowest failing rank's ("rank R of N
 * failed to WHAT: ..."), so that an error one rank alone meets is printed. */
int trainer_agree(trainer *t, int rc, const char *what, ct_err *e);
/* The ranks' options that must agree (all but per-machine ones) compared; CT_ERR_CONFIG on every rank if not. */
int trainer_agree_config(trainer *t, ct_err *e);
/* The ranks' copies of the training and validation data hold the same number
 * of windows; CT_ERR_CONFIG on every rank, naming the key, if not. */
int trainer_agree_data(trainer *t, const ds *train, const ds *val, ct_err *e);
/* Restores the step, the loader position and the MoE routing bias from a
 * checkpoint's state.json text (txt NULL: missing), after checking it was
 * written for the same data stream (seq_len, batch, seed, shuffle); dir
 * names the checkpoint in errors. Non-static so the fuzz target
 * (tests/fuzz/fuzz_train_state.c) can feed it. */
int trainer_state_from_json(trainer *t, const char *txt, const char *dir, ct_err *e);
/* checkpoint.async_mode "async" (or "async_with_pinned_mem", the same on CPU): a full checkpoint of the current
 * step staged now (every rank takes part: the gather to rank 0 is collective) and written by a background
 * thread of rank 0 while training goes on; "disabled": trainer_save. It first waits for the previous one. */
int trainer_save_async(trainer *t, const ds *data, ct_err *e);
/* Waits for the save in the background, if any. collective: every rank calls it at the same point and each
 * learns whether rank 0's write failed (its error on rank 0); else (an error or exit path, or trainer_free)
 * this rank alone waits, and a failure is its error. No-op when none is pending. */
int trainer_save_wait(trainer *t, int collective, ct_err *e);
/* Frees the staging copy the async saves keep from one to the next (async_save.stage): at a synchronous save
 * and the run's end, after trainer_save_wait. A no-op while a save is in flight (its thread reads it). */
void trainer_stage_free(trainer *t);
/* events.jsonl's "checkpoint" line for a save of the current step (rank 0's
 * log; nothing elsewhere): kind full, model_only, hf or adapter; mib < 0 when
 * the save does not count its bytes. */
void trainer_checkpoint_event(trainer *t, const char *kind, const char *dir, double mib, double seconds);
/* The final HF export of the run to folder/step-N (or hf-step-N beside a
 * training checkpoint of the same step); dir gets the path. Collective. */
int trainer_save_hf(trainer *t, const char *folder, char *dir, ct_dtype dtype, const char *torch_dtype, ct_err *e);
/* "PREFIXtrained: N parameters (P%) of M, frozen: F (...)", PEFT's
 * print_trainable_parameters: the run's start-up log and the dry run
 * (lora: name what is trained) print the same line. */
size_t trainer_saved_params(const lm_model *m);
void trainer_print_trained(FILE *out, const char *prefix, size_t trained, size_t total, size_t saved, int lora);
/* [profiling] enable_memory_snapshot at step `step`: what the dry run plans
 * for this rank's model beside what its buffers hold resident now, written
 * under save_memory_snapshot_folder/iteration_N (trainer_plan.c). */
int trainer_memory_snapshot(trainer *t, int step, FILE *log, ct_err *e);

#endif
