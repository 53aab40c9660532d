/* report/run.h: a finished (or running) training run, read back from its
 * dump folder for `ctitan report` and `ctitan compare`.
 *
 * A run directory is a run's job.dump_folder: config.toml (the resolved
 * config), metrics.jsonl (a line per logged step and per validation) and
 * events.jsonl (starts, checkpoints, exits: metrics/events.h). The readers
 * keep what the commands need as plain arrays, with NaN for a value a line
 * does not have, so a run of an older ctitan (no events.jsonl, fewer keys)
 * still reads. A last line cut short (a run killed while writing it) is
 * dropped; any other line that is not JSON is a format error naming
 * file:line. */
#ifndef CT_REPORT_RUN_H
#define CT_REPORT_RUN_H

#include "core/err.h"

/* The per-step series of metrics.jsonl, by their keys there. */
typedef enum {
    RUN_LOSS,
    RUN_GRAD_NORM,
    RUN_LR,
    RUN_MEMORY_GIB,
    RUN_TPS,
    RUN_TFLOPS,
    RUN_MFU,
    RUN_ELAPSED_S,
    RUN_STEP_TIME_S,
    RUN_TOKENS_SEEN,
    RUN_TIME,
    RUN_WORLD,
    RUN_N_FIELDS
} run_field;

typedef struct {
    int step;
    double v[RUN_N_FIELDS]; /* NaN where the line lacks the key */
} run_point;

typedef struct {
    int step;
    double loss, perplexity; /* val_loss, val_perplexity */
} run_val;

typedef enum { RUN_EV_START, RUN_EV_CHECKPOINT, RUN_EV_EXIT, RUN_EV_OTHER } run_ev_kind;

/* One line of events.jsonl; numbers NaN (and strings "") when absent. */
typedef struct {
    run_ev_kind kind;
    double time;  /* Unix seconds */
    int step;
    /* start */
    int world, machines, threads;
    double launch_time, startup_s, load_s;
    char resumed_from[512]; /* "" for a fresh start */
    char cpu[128], host[128];
    /* a resume's: the furthest step and latest time metrics.jsonl held
     * before the resume cut it back (-1 and NaN when absent) */
    int metrics_last_step;
    double metrics_last_time;
    /* checkpoint */
    char ckpt_kind[16]; /* full, model_only, hf, adapter */
    char path[512];
    double save_s, mib;
    /* exit */
    char reason[16];    /* done, stopped, error */
    double wall_s, cpu_s, energy_j;
    char energy_note[160]; /* energy_unavailable */
} run_event;

/* "section.key" and its value as config.toml writes it. */
typedef struct {
    char *key, *value;
} run_setting;

typedef struct {
    char dir[4096];
    run_point *points; /* in file order (a resume truncates the redone steps) */
    int n_points;
    run_val *vals;
    int n_vals;
    run_event *events; /* empty when the run has no events.jsonl */
    int n_events;
    run_setting *config; /* empty when the run has no config.toml */
    int n_config;
} run_data;

/* Reads DIR. CT_ERR_IO when DIR or its metrics.jsonl is missing,
 * CT_ERR_FORMAT when a file is malformed; r is safe to run_free either way. */
int run_load(run_data *r, const char *dir, ct_err *e);
void run_free(run_data *r);

/* The metrics.jsonl key of a field ("loss", "grad_norm", ...). */
const char *run_field_key(run_field f);
/* The value of "section.key" in the run's config, or NULL. */
const char *run_setting_get(const run_data *r, const char *key);
/* The last point's step (0 when none). */
int run_last_step(const run_data *r);

#endif
