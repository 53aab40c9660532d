/* report/compare.h: two runs of one recipe side by side, for `ctitan compare`.
 *
 * What the critics asked of a trainer and no log line tells: did two layouts
 * (machines, kernels) give the same loss curve, how fast was each, how much
 * time did restarts cost, and what did the whole run cost. Everything here is
 * computed from the run directories alone (report/run.h): metrics.jsonl for
 * the curve and the speed, events.jsonl for the sessions of a run (each launch,
 * its exit or its last sign of life). The restore check, which has to launch
 * ctitan, lives in the CLI (cli/cmd_compare.c); docs/compare.md has the
 * formulas. */
#ifndef CT_REPORT_COMPARE_H
#define CT_REPORT_COMPARE_H

#include <stdio.h>

#include "report/run.h"

/* The loss curves on the steps both runs logged. */
typedef struct {
    int n;             /* steps both runs logged a finite loss for */
    int *steps;        /* [n] ascending */
    double *a, *b;     /* [n] the two losses */
    double max_rel, mean_rel; /* of cmp_rel_diff over the n steps (0 when n == 0) */
    int max_step;      /* step of max_rel (-1 when n == 0) */
    int n_only_a, n_only_b; /* steps one run logged and the other did not */
    int only_a[8], only_b[8]; /* the first of them */
} cmp_loss;

/* |a - b| / max(|a|, |b|, 1e-12): symmetric, and 0 for two zeros. */
double cmp_rel_diff(double a, double b);
void cmp_loss_diff(const run_data *a, const run_data *b, cmp_loss *out);
void cmp_loss_free(cmp_loss *l);

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
} cmp_session;

typedef struct {
    int n_sessions;
    cmp_session *s;
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
} cmp_run;

void cmp_run_analyse(const run_data *r, cmp_run *out);
void cmp_run_free(cmp_run *c);

/* One direction of the restore check: run X's final checkpoint loaded in
 * run Y's layout, its loss on a fixed batch against the same in X's own. */
typedef struct {
    int checked;          /* 0: --no-restore, or nothing to check (why says) */
    int step;             /* the checkpoint's step */
    int own_world, other_world;
    double own_loss, other_loss, rel; /* NaN when a probe failed */
    int ok;               /* loaded in both and rel <= tolerance */
    char why[512];        /* why not ok / not checked; "" when ok */
} cmp_restore;

typedef struct {
    const char *dir_a, *dir_b;
    double tolerance;     /* < 0: none given */
    double restore_tol;   /* the restore check's */
    double price;         /* per machine-hour; < 0: none given */
    int bill_downtime;
    int show_steps;       /* the per-step table */
} cmp_opts;

/* The report as text (the table a person reads) and as one JSON object. */
void cmp_print_text(FILE *f, const cmp_opts *o, const cmp_loss *l, const cmp_run *ra, const cmp_run *rb,
                    const cmp_restore rs[2]);
void cmp_print_json(FILE *f, const cmp_opts *o, const cmp_loss *l, const cmp_run *ra, const cmp_run *rb,
                    const cmp_restore rs[2]);
/* The cost of a run at o->price per machine-hour (NaN without a price). */
double cmp_cost(const cmp_opts *o, const cmp_run *r);

#endif
