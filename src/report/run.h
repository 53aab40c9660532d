/* report/run.h: a finished (or running) training run, read back from its
 * dump folder for `ctitan report` and `ctitan compare`.
 *
 * A run directory is a run's job.dump_folder: config.toml (the resolved
 * config), metrics.jsonl (a line per logged step and per validation) and
 * events.jsonl (starts, checkpoints, exits: metrics/events.h). The readers
 * keep what the commands need as plain arrays, with NaN for a value a line
 * does not have, so a run of an older ctitan (no events.jsonl, fewer keys)
 * still reads. A last line cut short (a run killed while writing it: the
 * start of an object, no newline) is dropped with a warning naming
 * file:line; any other line that is not JSON, or a known key of the wrong
 * type, is a format error naming file:line (and the key). */
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

/* Reads DIR. CT_ERR_IO when DIR or its metrics.jsonl is missing or logs no step,
 * CT_ERR_FORMAT when a file is malformed; r is safe to run_free either way. */
int run_load(run_data *r, const char *dir, ct_err *e);
void run_free(run_data *r);
/* The value of "section.key" in the run's config, or NULL. */
const char *run_setting_get(const run_data *r, const char *key);
/* The last point's step (0 when none). */
int run_last_step(const run_data *r);

/* One launch of the process: from its start event to its exit event or,
 * when it was killed, its last sign of life. */
typedef struct {
    double launch, end;   /* Unix seconds */
    int killed;           /* no exit event: end is the last sign of life */
    char reason[16];      /* the exit's reason, or "killed" */
    int world, machines, threads;
    int start_step, end_step; /* the step it began from and the furthest it reached */
    double cpu_s, energy_j;   /* its exit's (NaN when unknown) */
    /* a restart (every session but the first) */
    double downtime_s;    /* launch - the previous session's end */
    double startup_s, load_s; /* launch to the loop, of which loading the checkpoint */
    int redone_steps;     /* previous end_step - start_step (steps done again) */
} run_session;

typedef struct {
    int n_sessions;
    run_session *s;
    double tps_mean;      /* mean tokens/s per rank (metrics "tps") of the logged steps after step 1 (NaN: none) */
    double job_tps_mean;  /* the whole job's: global tokens per step / step_time_s, likewise */
    double step_time_mean; /* mean step_time_s, likewise */
    int restarts;         /* n_sessions - 1 */
    double downtime_s, startup_s, load_s, redone_s, lost_s; /* restart totals; lost = the three */
    int redone_steps;
    double wall_s;        /* sum of the sessions' launch..end (what a machine was held) */
    double machine_s;     /* sum of machines x session wall */
    double downtime_machine_s; /* sum of the next session's machines x downtime */
    double core_s;        /* sum of ranks x threads x session wall (CPU time allocated) */
    double cpu_est_s;     /* sum of rank 0's cpu_s x world over the sessions with an exit */
    int cpu_unknown;      /* sessions without an exit (no cpu_s) */
    double energy_j;      /* sum of energy_j (rank 0's machine) */
    int energy_n;         /* exits that had energy_j */
    int energy_unknown;   /* sessions without energy_j */
    char energy_note[160]; /* the last energy_unavailable reason */
    double energy_est_j;  /* sum of each session's energy_j x machines */
} run_summary;

/* The accounting of r, the one `ctitan report` and `ctitan compare` both
 * print (docs/compare.md, "Sessions and restarts" and "Cost"); free with
 * run_summary_free. */
void run_summarise(const run_data *r, run_summary *out);
void run_summary_free(run_summary *s);

/* With run_mean_after_first: the job's tokens/s of a logged step, global
 * batch tokens (tokens_seen / step) over step_time_s. */
#define RUN_JOB_TPS RUN_N_FIELDS
/* Mean of field f (a run_field or RUN_JOB_TPS) over the logged steps after
 * step 1 (its time includes the warm-up: first touch of the buffers, kernel
 * choice), or over all when the run logged step 1 alone; NaN when none. */
double run_mean_after_first(const run_data *r, int f);

#endif
