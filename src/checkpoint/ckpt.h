/* checkpoint/ckpt.h: training checkpoints: save, list, verify, select, load, prune.
 *
 * A checkpoint is the directory FOLDER/step-N/ holding
 *   model.safetensors   every parameter by HF name, fp32, whole tensors
 *   optim.safetensors   AdamW moments "NAME.exp_avg", "NAME.exp_avg_sq", fp32
 *                       (absent in a model-only checkpoint)
 *   state.json          the trainer's state text (opaque here)
 *   config.toml         the resolved run config text (opaque here)
 *   config.json         the model's HF config
 *   manifest.json       written last: step, model_only, and the size and
 *                       XXH3-64 checksum of every other file
 * The layout never depends on the parallel layout, so any run can load any
 * checkpoint. A step-N directory only ever appears by renaming a complete,
 * fsynced temporary directory, so a crash leaves either the old state or the
 * new one; damage after the fact (truncation, bit flips) is caught by the
 * manifest. docs/checkpoints.md has the full contract. */
#ifndef CT_CHECKPOINT_CKPT_H
#define CT_CHECKPOINT_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "model/lm.h"

#define CKPT_FORMAT "ctitan-checkpoint"
#define CKPT_VERSION 1
/* ckpt_select's result when the folder holds no step-N directory at all
 * (distinct from every ct_err code, which are positive). */
#define CKPT_NONE (-1)

typedef struct {
    int step;
    char dir[4096];  /* the checkpoint directory written or read */
    uint64_t bytes;  /* bytes of every file in it, manifest included */
    double seconds;  /* wall time of the save or load, verification included */
    uint64_t read_bytes;   /* a load: tensor bytes this process read (its rows only: ckpt_load_part) */
    uint64_t hashed_bytes; /* a load: bytes this process read for the checksums (0: verified before) */
} ckpt_info;

/* Writes FOLDER/step-STEP atomically (temp dir, fsync, rename; an existing
 * step-STEP is replaced only once the new one is complete; a final export
 * there, ckpt_dir_kind, is moved aside to hf-step-STEP instead, never
 * deleted). exp_avg and
 * exp_avg_sq hold m->n_params floats each, or are both NULL for a model-only
 * checkpoint. state_json and config_toml are stored verbatim when non-NULL.
 * On any failure nothing under FOLDER but the temp dir changed, and the temp
 * dir is removed; the error names the path. info may be NULL. */
int ckpt_save(const char *folder, int step, const lm_model *m, const float *exp_avg, const float *exp_avg_sq,
              const char *state_json, const char *config_toml, ckpt_info *info, ct_err *e);

/* ckpt_save in steps, for callers that never hold the whole state: begin
 * creates the temp dir and starts model.safetensors from m's tensor table
 * and config (m->params is not read; m must outlive the stream); put appends
 * n floats, in m's flat order: the parameters, then (unless model_only) every
 * exp_avg, then every exp_avg_sq, in pieces of any size; end writes the
 * other files and the manifest and publishes as ckpt_save does. The files are
 * ckpt_save's, byte for byte (ckpt_save is this with three puts). After any
 * error, or to give up, abort removes the temp dir; end frees the stream
 * whatever it returns. */
typedef struct ckpt_stream ckpt_stream;
int ckpt_stream_begin(ckpt_stream **out, const char *folder, int step, const lm_model *m, int model_only,
                      ct_err *e);
int ckpt_stream_put(ckpt_stream *s, const float *x, size_t n, ct_err *e);
int ckpt_stream_end(ckpt_stream *s, const char *state_json, const char *config_toml, ckpt_info *info, ct_err *e);
/* The checkpoint's config.json is also a Hugging Face model's (transformers
 * loads a step-N as it is): with this, it gets the bos/eos token ids of the
 * first of src[0..n) (n <= 2) whose config.json has them, as hf_keep_token_ids
 * gives a final save or an export, so transformers' generate stops at the end
 * token there too. Before ckpt_stream_end: the ids are in the file the
 * manifest checksums. The strings must outlive the stream. */
void ckpt_stream_token_ids(ckpt_stream *s, const char *const *src, int n);
void ckpt_stream_abort(ckpt_stream *s);

/* A save that every process writes its part of, when all of them see the
 * checkpoint folder (the same files): begin_parts (one process) creates the
 * temp dir and lays out model.safetensors and optim.safetensors (headers
 * written, files sized: the bytes every tensor's data takes are fixed by
 * its shape); each writer then opens them (ckpt_part_open, with the temp
 * dir as it sees it: ckpt_tmp_dir of the first process's pid) and pwrites
 * the elements it holds at their offsets, each element by exactly one
 * writer; once every writer has closed (fsynced), the first process ends
 * the stream as ckpt_stream_end does (it fsyncs the files again, reads
 * them back for the checksums, writes the manifest and publishes). The
 * files are ckpt_save's, byte for byte. */
int ckpt_stream_begin_parts(ckpt_stream **out, const char *folder, int step, const lm_model *m, int model_only,
                            ct_err *e);
/* FOLDER/.step-STEP.tmp-PID: the temp dir of the save PID begins. */
int ckpt_tmp_dir(char *out, size_t cap, const char *folder, int step, long pid, ct_err *e);
typedef struct ckpt_part ckpt_part;
/* m: the table begin_parts was given (the tensors the files hold); final
 * names the checkpoint in messages. */
int ckpt_part_open(ckpt_part **out, const char *tmp, const char *final, const lm_model *m, int model_only,
                   ct_err *e);
/* Elements [at, at + n) of tensor i of the table, as `kind` (LM_PARAMS,
 * LM_EXP_AVG, LM_EXP_AVG_SQ: moments are ignored for a model-only save).
 * A non-finite value is refused as ckpt_stream_put refuses it. */
int ckpt_part_write(ckpt_part *w, int kind, int i, size_t at, const float *x, size_t n, ct_err *e);
/* Tensor bytes written so far. */
uint64_t ckpt_part_written(const ckpt_part *w);
/* fsyncs and closes; frees w whatever it returns. */
int ckpt_part_close(ckpt_part *w, ct_err *e);
void ckpt_part_abort(ckpt_part *w);

/* Step numbers of FOLDER's step-N directories (complete or not; temp dirs
 * ignored), ascending. Returns how many exist (a missing folder has 0) and
 * stores the first min(count, cap); -1 if FOLDER cannot be read. */
int ckpt_list(const char *folder, int *steps, int cap);

/* What a step-N directory holds. A run's final save with
 * checkpoint.last_save_in_hf is a Hugging Face model directory (config.json
 * and safetensors) or a LoRA run's PEFT adapter (adapter_config.json), with
 * no manifest: complete models, written to a temp dir and renamed into place,
 * but no training checkpoint (no optimizer state). A training checkpoint
 * always holds config.toml, which no export writes: one that lost its
 * manifest is a damaged checkpoint (CKPT_DIR_CHECKPOINT, for ckpt_verify to
 * name), never taken for an export. */
enum { CKPT_DIR_CHECKPOINT = 0, CKPT_DIR_HF_MODEL = 1, CKPT_DIR_PEFT_ADAPTER = 2 };
int ckpt_dir_kind(const char *dir);
/* A model directory that holds a PEFT adapter (adapter_config.json) is no model:
 * out gets " (DIR holds a LoRA adapter ...: give the base model (BASE) as BASE_AS
 * and DIR as ADAPTER_AS)", the same words from every command that reads a model
 * directory; "" when DIR holds no adapter_config.json. */
void ckpt_adapter_hint(const char *dir, const char *base_as, const char *adapter_as, char *out, size_t cap);
/* "a Hugging Face export" / "a PEFT adapter" / "a training checkpoint", for messages. */
const char *ckpt_dir_kind_name(int kind);

/* Checks DIR/manifest.json and every file it lists (size and checksum), and
 * that the files a checkpoint needs are listed. The error names the damaged
 * file. */
int ckpt_verify(const char *dir, ct_err *e);
/* ckpt_verify, with *hashed (may be NULL) the bytes read for the checksums. */
int ckpt_verify_hashed(const char *dir, uint64_t *hashed, ct_err *e);
/* The manifest and every listed file's size, not the checksums: for a
 * process whose files another one has verified (ranks that see the same
 * folder share one verdict: train/trainer_ckpt.c). */
int ckpt_verify_sizes(const char *dir, ct_err *e);

/* load_step < 0: the newest step-N of FOLDER that verifies; each damaged newer
 * one is reported on stderr by name and skipped, and each final export newer
 * than it (ckpt_dir_kind) is named as such in a note: it cannot be resumed. Returns CKPT_NONE (e
 * untouched) when FOLDER has no step-N directory that is a training
 * checkpoint (none at all, or only final exports), and an error when
 * there are some but none verifies. load_step >= 0: exactly step-load_step;
 * missing or damaged is an error (never a fallback). On success out_dir gets
 * FOLDER/step-N and out_step N (either may be NULL). */
int ckpt_select(const char *folder, int load_step, char *out_dir, size_t cap, int *out_step, ct_err *e);
/* ckpt_select with `verify` in place of ckpt_verify (dir and its step;
 * NULL: ckpt_verify), for callers that share one verdict between
 * processes. */
typedef int (*ckpt_verify_fn)(void *ctx, const char *dir, int step, ct_err *e);
int ckpt_select_with(const char *folder, int load_step, ckpt_verify_fn verify, void *vctx, char *out_dir, size_t cap,
                     int *out_step, ct_err *e);
/* For readers of the model (export, generate): FOLDER's newest step-N that
 * is a model, a training checkpoint that verifies or a final export
 * (CKPT_DIR_HF_MODEL or CKPT_DIR_PEFT_ADAPTER: nothing to verify, they are
 * renamed into place complete); damaged checkpoints newer than it are
 * reported on stderr and skipped, as by ckpt_select. *out_kind gets its
 * CKPT_DIR_ kind. Returns CKPT_NONE when FOLDER has no step-N at all. */
int ckpt_select_model(const char *folder, char *out_dir, size_t cap, int *out_step, int *out_kind, ct_err *e);

/* Verifies DIR, then loads every parameter of m by name (shape checked; a
 * missing, extra or mis-shaped tensor is an error naming tensor and file),
 * the moments when exp_avg/exp_avg_sq are non-NULL (an error for a model-only
 * checkpoint), and state.json into *state_json (malloc'd; NULL when the
 * checkpoint has none) when state_json is non-NULL. The checkpoint's
 * config.json must describe the same architecture as m->cfg. info may be NULL. */
int ckpt_load(const char *dir, lm_model *m, float *exp_avg, float *exp_avg_sq, char **state_json,
              ckpt_info *info, ct_err *e);
/* The same checks, with every tensor handed to `sink` (tensor index of m's
 * table, the whole model's; m's buffers are not touched, so m may be a bare
 * lm_layout) instead of copied: the parameters, then, when `moments`, every
 * exp_avg and every exp_avg_sq. Each tensor's data lives in the mapped file
 * during the call, so nothing whole-model-sized is allocated. */
int ckpt_load_each(const char *dir, const lm_model *m, int moments, char **state_json, ckpt_info *info,
                   const lm_sink *sink, ct_err *e);
/* Which rows of each tensor a loading process keeps (its FSDP shard, TP
 * slice, experts, stages): rows(ctx, kind, i, add, acc) calls add(acc, r0,
 * r1) for runs [r0, r1) of whole rows of tensor i of the loader's table
 * (lm_sink's rows), ascending. It may name rows the sink then drops, never
 * fewer than it keeps. cols (may be NULL) likewise names the columns
 * [c0, c1) of each of those rows it keeps, ascending (no call: whole rows):
 * only they are read, the rest of the rows the sink gets is left as it was. */
typedef void (*ckpt_rows_add)(void *acc, size_t r0, size_t r1);
typedef struct {
    void (*rows)(void *ctx, int kind, int i, ckpt_rows_add add, void *acc);
    void *ctx;
    void (*cols)(void *ctx, int kind, int i, ckpt_rows_add add, void *acc);
} ckpt_rows;
/* ckpt_load_each reading only the rows `want` names (NULL: every row), with
 * pread at the offsets the safetensors headers give, a bounded block of
 * rows at a time: a rank reads about its share of the files, not all of
 * them. The values checks cover what is read. verified: the caller has
 * checked the checksums already (ckpt_verify, or the verdict of a process
 * that sees the same files): the manifest and sizes are checked again, the
 * checksums not. info->read_bytes and hashed_bytes say what was read. */
int ckpt_load_part(const char *dir, const lm_model *m, int moments, char **state_json, ckpt_info *info,
                   const lm_sink *sink, const ckpt_rows *want, int verified, ct_err *e);

/* Keeps the newest keep_latest_k complete full checkpoints (k <= 0: keeps
 * all; model-only ones do not count) and removes every step-N older than the
 * oldest kept one, except final exports (ckpt_dir_kind: a finished run's
 * model, not a checkpoint to rotate out, kept when the run is extended); removes temp dirs
 * left by crashed writers (never those of a live process). A checkpoint is
 * removed by renaming it aside first, so a crash mid-removal never leaves a
 * half-deleted step-N. "Complete" here means the manifest parses and every
 * listed file has its size (checksums are left to select/load). */
int ckpt_prune(const char *folder, int keep_latest_k, ct_err *e);

/* What ckpt_prune does first: removes FOLDER's temporary entries of saves,
 * replaces and removals cut short (.step-N.tmp-PID, .step-N.del-PID, the
 * trainer's .hf-step-N.tmp-PID; a .step-N.old-PID whose step-N is missing is
 * renamed back instead): those of processes no longer alive, or with `all`
 * every one, whatever its pid (for a caller that holds the folder's lock, so
 * that no other process writes there: a pid may have been reused since).
 * *n (may be NULL) gets how many were found, first[cap] the first one's name.
 * A missing folder is no error. */
int ckpt_clean_temps(const char *folder, int all, int *n, char *first, size_t cap, ct_err *e);

/* Model-only checkpoint's state (true/false) from DIR/manifest.json; -1 on
 * error. For callers that must decide before loading (e.g. a trainer that
 * treats an imported step-0 as an initial load). */
int ckpt_is_model_only(const char *dir, ct_err *e);

/* The first free name for a final Hugging Face export of `step` beside what
 * folder holds: folder/hf-step-N, else hf-step-N.2, .3, ... into out[cap].
 * An export is never replaced: a name in use, whatever it holds, is skipped.
 * CT_ERR_IO when a name cannot be checked or a thousand are taken. */
int ckpt_free_export_name(const char *folder, int step, char *out, size_t cap, ct_err *e);

#endif
